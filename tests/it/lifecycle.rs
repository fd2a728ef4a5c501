//! Outages, start-up with the store down, graceful shutdown and crashes.

use std::sync::Arc;
use std::time::Duration;

use crate::cli::{ProxyProcess, process_config};
use crate::on_both_stores;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{
    Backend, Behavior, Gate, Relay, TestApp, TestStore, Upstream, until_waiting_on_locks,
    waiting_on_locks,
};
use dedupe_proxy::config::{Config, Mode, OnUnavailable};

on_both_stores!(
    store_outage_answers_503_forwards_nothing_and_recovers_without_restart,
    store_outage_can_forward_without_dedupe,
    in_shadow_mode_a_store_outage_forwards_with_the_key_and_no_attempt,
    graceful_shutdown_finishes_in_flight_requests_and_refuses_new_connections,
    claims_still_open_at_the_grace_deadline_are_released,
    a_claim_abandoned_by_a_killed_proxy_is_reclaimed_after_its_lease_and_not_before,
    a_claim_won_too_late_to_forward_safely_is_released_with_503,
    in_shadow_mode_a_claim_won_too_late_is_released_and_the_delivery_forwarded,
    a_sender_that_hangs_up_during_its_claim_leaves_no_orphaned_claim,
    readyz_answers_503_while_the_claims_table_is_missing,
    an_outcome_the_store_has_not_taken_keeps_its_key_from_a_second_forward,
);

/// Makes the store unavailable to the proxy and back: a relay cut for
/// PostgreSQL, an exclusive lock held by another connection for SQLite.
enum Outage {
    Postgres(Relay),
    Sqlite {
        path: String,
        lock: Option<std::sync::mpsc::Sender<()>>,
    },
}

impl Outage {
    /// Returns the outage switch and the store URL the proxy must use.
    async fn prepare(backend: Backend, store: &TestStore) -> (Self, String) {
        match backend {
            Backend::Postgres => {
                let relay = Relay::start(store.postgres_addr(), true).await;
                let url = store.url_via(relay.addr);
                (Outage::Postgres(relay), url)
            }
            Backend::Sqlite => {
                let path = store.url.trim_start_matches("sqlite://").to_string();
                (Outage::Sqlite { path, lock: None }, store.url.clone())
            }
        }
    }

    async fn begin(&mut self) {
        match self {
            Outage::Postgres(relay) => relay.cut().await,
            Outage::Sqlite { path, lock } => {
                let (release, released) = std::sync::mpsc::channel::<()>();
                let (locked, is_locked) = std::sync::mpsc::channel::<()>();
                let path = path.clone();
                std::thread::spawn(move || {
                    let connection = rusqlite::Connection::open(path).unwrap();
                    connection.execute_batch("BEGIN EXCLUSIVE").unwrap();
                    locked.send(()).unwrap();
                    let _ = released.recv();
                    connection.execute_batch("COMMIT").unwrap();
                });
                is_locked.recv().unwrap();
                *lock = Some(release);
            }
        }
    }

    fn end(&mut self) {
        match self {
            Outage::Postgres(relay) => relay.restore(),
            Outage::Sqlite { lock, .. } => drop(lock.take()),
        }
    }
}

async fn store_outage_answers_503_forwards_nothing_and_recovers_without_restart(backend: Backend) {
    let store = Arc::new(TestStore::new(backend).await);
    let (mut outage, url) = Outage::prepare(backend, &store).await;
    let app = TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.url = url
    })
    .await;
    assert_eq!(app.deliver("evt_before", "{}").await.outcome(), "forwarded");

    outage.begin().await;
    for key in ["evt_during", "evt_before"] {
        let response = app.deliver(key, "{}").await;
        assert_eq!(
            (response.status, response.outcome()),
            (503, "unavailable"),
            "{key}"
        );
        assert_eq!(response.header("retry-after"), Some("3"));
    }
    assert_eq!(
        app.upstream.count(),
        1,
        "nothing forwarded during the outage"
    );
    if backend == Backend::Postgres {
        assert_eq!(app.admin_get("/readyz").await.status, 503);
    }
    assert_eq!(app.admin_get("/healthz").await.status, 200);

    outage.end();
    app.wait_ready().await;
    let recovered = async {
        loop {
            let response = app.deliver("evt_during", "{}").await;
            if response.status != 503 {
                return response;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let response = tokio::time::timeout(Duration::from_secs(15), recovered)
        .await
        .expect("recovered");
    assert_eq!(response.outcome(), "forwarded");
    assert_eq!(app.deliver("evt_before", "{}").await.outcome(), "duplicate");
    assert_eq!(app.upstream.count(), 2);
    let metrics = app.admin_get("/metrics").await.body;
    assert!(
        metrics.contains(r#"dedupe_store_errors_total{op="claim"}"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"dedupe_requests_total{outcome="store_unavailable",route="orders"}"#),
        "{metrics}"
    );
}

async fn store_outage_can_forward_without_dedupe(backend: Backend) {
    let store = Arc::new(TestStore::new(backend).await);
    let (mut outage, url) = Outage::prepare(backend, &store).await;
    let app = TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.url = url;
        config.store.on_unavailable = OnUnavailable::Forward;
    })
    .await;
    outage.begin().await;
    for _ in 0..2 {
        let response = app.deliver("evt_fwd", "{}").await;
        assert_eq!((response.status, response.outcome()), (200, "passthrough"));
    }
    assert_eq!(app.upstream.count(), 2);
    let seen = &app.upstream.seen()[0];
    assert_eq!(seen.header("x-dedupe-key"), Some("evt_fwd"));
    assert_eq!(seen.header("x-dedupe-source"), Some("orders"));
    assert_eq!(seen.header("x-dedupe-attempt"), None, "no claim was made");
    app.assert_metrics(&[r#"dedupe_requests_total{outcome="store_unavailable",route="orders"} 2"#])
        .await;
    outage.end();
}

async fn in_shadow_mode_a_store_outage_forwards_with_the_key_and_no_attempt(backend: Backend) {
    for on_unavailable in [OnUnavailable::Reject, OnUnavailable::Forward] {
        let store = Arc::new(TestStore::new(backend).await);
        let (mut outage, url) = Outage::prepare(backend, &store).await;
        let app = TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
            config.store.url = url;
            config.store.on_unavailable = on_unavailable;
            config.routes[0].mode = Mode::Shadow;
        })
        .await;
        outage.begin().await;
        let response = app.deliver("evt_shadow_down", "{}").await;
        assert_eq!(
            (response.status, response.outcome()),
            (200, "passthrough"),
            "{on_unavailable:?}"
        );
        let seen = &app.upstream.seen()[0];
        assert_eq!(seen.header("x-dedupe-key"), Some("evt_shadow_down"));
        assert_eq!(seen.header("x-dedupe-source"), Some("orders"));
        assert_eq!(seen.header("x-dedupe-attempt"), None, "no claim was won");
        outage.end();
    }
}

async fn graceful_shutdown_finishes_in_flight_requests_and_refuses_new_connections(
    backend: Backend,
) {
    let mut app = TestApp::spawn(backend, |_| {}).await;
    let gate = Gate::new();
    app.upstream
        .script("evt_g", [Behavior::Gate(Arc::clone(&gate))]);
    let app_addr = app.addr;
    let client = crate::support::client();
    let in_flight = tokio::spawn(async move {
        let request = http::Request::post(format!("http://{app_addr}/hooks/orders"))
            .header("x-event-id", "evt_g")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        crate::support::TestResponse::read(client.request(request).await.unwrap()).await
    });
    app.upstream.wait_for(1).await;
    app.begin_shutdown();
    let refused = async {
        while tokio::net::TcpStream::connect(app_addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), refused)
        .await
        .expect("listener closed");
    let not_ready = app.admin_get("/readyz").await;
    assert_eq!(
        (not_ready.status, not_ready.body.as_str()),
        (503, "shutting down\n"),
        "the admin listener stays up through the drain, and not ready"
    );
    let metrics = app.admin_get("/metrics").await.body;
    assert!(
        metrics.lines().any(|l| l == "dedupe_in_flight_requests 1"),
        "the drain can be scraped: {metrics}"
    );
    let task = app.take_task();
    assert!(
        !task.is_finished(),
        "shutdown waits for the in-flight request"
    );
    gate.open();
    let response = in_flight.await.unwrap();
    assert_eq!((response.status, response.outcome()), (200, "forwarded"));
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("stopped")
        .unwrap();

    let store = Arc::clone(&app.store);
    let after = TestApp::spawn_on(store, Upstream::start().await, |_| {}).await;
    assert_eq!(
        after.deliver("evt_g", "{}").await.outcome(),
        "duplicate",
        "the request was settled before exit"
    );
}

async fn claims_still_open_at_the_grace_deadline_are_released(backend: Backend) {
    let mut app = TestApp::spawn(backend, |config| {
        config.shutdown_grace = Duration::from_millis(200)
    })
    .await;
    app.upstream.script("evt_stuck", [Behavior::Hang]);
    let app_addr = app.addr;
    let client = crate::support::client();
    let _stuck = tokio::spawn(async move {
        let request = http::Request::post(format!("http://{app_addr}/hooks/orders"))
            .header("x-event-id", "evt_stuck")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        client.request(request).await
    });
    app.upstream.wait_for(1).await;
    app.shutdown().await;

    // Released to `failed`: the retry is forwarded now, not after the 10s lease.
    let store = Arc::clone(&app.store);
    let after = TestApp::spawn_on(store, Upstream::start().await, |_| {}).await;
    let retry = after.deliver("evt_stuck", "{}").await;
    assert_eq!(retry.outcome(), "forwarded");
    assert_eq!(
        after.upstream.seen()[0].header("x-dedupe-attempt"),
        Some("2")
    );
}

async fn a_claim_abandoned_by_a_killed_proxy_is_reclaimed_after_its_lease_and_not_before(
    backend: Backend,
) {
    let store = Arc::new(TestStore::new(backend).await);
    let upstream = Upstream::start().await;
    upstream.script("evt_crash", [Behavior::Hang]);
    let lease = Duration::from_secs(4);
    let mut proxy = ProxyProcess::start(&format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nupstream: {{ url: \"{}\", timeout: 3s }}\nstore: {{ url: \"{}\", lease: 4s }}\nroutes: [{{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}]\n",
        upstream.url(),
        store.url
    ))
    .await;
    proxy.wait_ready().await;
    let addr = proxy.addr;
    let client = crate::support::client();
    let abandoned = tokio::spawn(async move {
        let request = http::Request::post(format!("http://{addr}/hooks/orders"))
            .header("x-event-id", "evt_crash")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        client.request(request).await
    });
    upstream.wait_for(1).await;
    let claimed_at = std::time::Instant::now();
    proxy.kill().await;
    assert!(
        abandoned.await.unwrap().is_err(),
        "the sender saw the proxy die"
    );

    let app = TestApp::spawn_on(Arc::clone(&store), upstream.clone(), |config| {
        config.store.lease = lease;
    })
    .await;
    let early = app.deliver("evt_crash", "{}").await;
    assert!(
        claimed_at.elapsed() < lease,
        "the check ran inside the lease"
    );
    assert_eq!(
        (early.status, early.outcome()),
        (409, "in-flight"),
        "reclaimed before the lease expired"
    );
    assert_eq!(upstream.count(), 1);

    tokio::time::sleep(lease.saturating_sub(claimed_at.elapsed()) + Duration::from_millis(300))
        .await;
    let late = app.deliver("evt_crash", "{}").await;
    assert_eq!((late.status, late.outcome()), (200, "forwarded"));
    assert_eq!(upstream.seen()[1].header("x-dedupe-attempt"), Some("2"));
    let metrics = app.admin_get("/metrics").await.body;
    assert!(
        metrics.contains(r#"dedupe_claims_total{result="won_expired_lease",route="orders"} 1"#),
        "{metrics}"
    );
}

/// Blocks claims on the table for `hold`, from another connection.
async fn block_claims_for(backend: Backend, store: &TestStore, hold: Duration) {
    match backend {
        Backend::Postgres => {
            let client = store.postgres().await;
            client
                .batch_execute("BEGIN; LOCK TABLE processed_events IN SHARE ROW EXCLUSIVE MODE")
                .await
                .unwrap();
            tokio::spawn(async move {
                tokio::time::sleep(hold).await;
                client.batch_execute("COMMIT").await.unwrap();
            });
        }
        Backend::Sqlite => {
            let path = store.url.trim_start_matches("sqlite://").to_string();
            let (locked, is_locked) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let connection = rusqlite::Connection::open(path).unwrap();
                connection.execute_batch("BEGIN EXCLUSIVE").unwrap();
                locked.send(()).unwrap();
                std::thread::sleep(hold);
                connection.execute_batch("COMMIT").unwrap();
            });
            is_locked.recv().unwrap();
        }
    }
}

/// A lease only 500ms longer than the upstream timeout, so a claim delayed by
/// [`LATE_CLAIM_DELAY`] leaves less lease than forwarding could take.
fn lease_just_over_upstream_timeout(config: &mut Config) {
    config.upstream.timeout = Duration::from_secs(1);
    config.store.lease = Duration::from_millis(1500);
    config.store.timeout = Duration::from_secs(3);
}

const LATE_CLAIM_DELAY: Duration = Duration::from_millis(700);

async fn a_claim_won_too_late_to_forward_safely_is_released_with_503(backend: Backend) {
    let app = TestApp::spawn(backend, lease_just_over_upstream_timeout).await;
    block_claims_for(backend, &app.store, LATE_CLAIM_DELAY).await;
    let late = app.deliver("evt_late", "{}").await;
    assert_eq!((late.status, late.outcome()), (503, "unavailable"));
    assert!(late.body.contains("lease"), "{}", late.body);
    assert_eq!(app.upstream.count(), 0);
    let retry = app.deliver("evt_late", "{}").await;
    assert_eq!(
        retry.outcome(),
        "forwarded",
        "the claim was released, not left to expire"
    );
    assert_eq!(app.upstream.seen()[0].header("x-dedupe-attempt"), Some("2"));
}

/// With `store.migrate: false` nothing creates the table: the proxy is not
/// ready (every webhook would get 503) until `migrate` has run.
async fn readyz_answers_503_while_the_claims_table_is_missing(backend: Backend) {
    let store = Arc::new(TestStore::new(backend).await);
    let app = TestApp::start(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.migrate = false
    })
    .await;
    let not_ready = app.admin_get("/readyz").await;
    assert_eq!(not_ready.status, 503);
    assert!(
        not_ready.body.contains("the claims table is missing (")
            && not_ready.body.contains("processed_events"),
        "{}",
        not_ready.body
    );
    let config = dedupe_proxy::config::StoreConfig {
        url: store.url.clone(),
        ..Default::default()
    };
    let migrated = dedupe_proxy::store::Store::open(&config).unwrap();
    migrated.migrate().await.unwrap();
    app.wait_ready().await;
    assert_eq!(app.deliver("evt_ready", "{}").await.outcome(), "forwarded");
}

/// The SQLite files deleted or replaced under a running proxy: it goes on
/// with the files it opened, so nothing fails on its own; readiness says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_answers_503_once_the_sqlite_files_are_deleted_or_replaced() {
    for (suffix, replace) in [("", true), ("-wal", false), ("-shm", false)] {
        let store = Arc::new(TestStore::new(Backend::Sqlite).await);
        let app = TestApp::start(Arc::clone(&store), Upstream::start().await, |_| {}).await;
        assert_eq!(app.deliver("evt_before", "{}").await.outcome(), "forwarded");
        let path = format!("{}{suffix}", store.url.strip_prefix("sqlite://").unwrap());
        std::fs::remove_file(&path).unwrap();
        if replace {
            std::fs::write(&path, "").unwrap();
        }
        let not_ready = app.admin_get("/readyz").await;
        assert_eq!(not_ready.status, 503, "{suffix}: {}", not_ready.body);
        assert!(
            not_ready.body.starts_with(&format!(
                "store unavailable: sqlite: {path} was deleted, moved or replaced while the proxy had it open"
            )),
            "{suffix}: {}",
            not_ready.body
        );
    }
}

/// The same, said in the log, where nothing may poll readiness (a compose
/// service without a health check): the keys written from then on are lost
/// when the proxy stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_file_moved_under_the_proxy_is_logged() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::start(&format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nupstream: {{ url: '{}' }}\nstore: {{ url: '{}' }}\nroutes: [{{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}]\n",
        upstream.url(),
        store.url
    ))
    .await;
    proxy.wait_ready().await;
    let path = store.url.strip_prefix("sqlite://").unwrap();
    std::fs::rename(path, format!("{path}.moved")).unwrap();
    proxy
        .wait_for_log("the SQLite database is no longer where the proxy opened it")
        .await;
}

/// An HTTP/2 connection with no request open whose sender never answers the
/// GOAWAY's ping (a half-open connection, say) is dropped soon after
/// shutdown begins, not held for the whole grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_that_ignores_the_goaway_does_not_hold_shutdown() {
    let mut app = TestApp::spawn(Backend::Sqlite, |config| {
        // Longer than TestApp::shutdown waits.
        config.shutdown_grace = Duration::from_secs(90);
        config.limits.header_read_timeout = Duration::from_secs(90);
    })
    .await;
    let mut silent = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    silent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    // The server's SETTINGS: the connection is served.
    let mut first = [0u8; 9];
    silent.read_exact(&mut first).await.unwrap();
    assert_eq!(first[3], 0x4, "a SETTINGS frame");
    app.shutdown().await;
}

/// Another process holding the SQLite database's write lock: reads still
/// pass (WAL), every claim fails, and readiness says so until it lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_answers_503_while_another_process_holds_the_sqlite_write_lock() {
    let store = Arc::new(TestStore::new(Backend::Sqlite).await);
    let app = TestApp::start(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.timeout = Duration::from_millis(300);
    })
    .await;
    assert_eq!(app.admin_get("/readyz").await.status, 200);
    let path = store.url.strip_prefix("sqlite://").unwrap();
    let holder = rusqlite::Connection::open(path).unwrap();
    holder.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let not_ready = app.admin_get("/readyz").await;
    assert_eq!(not_ready.status, 503, "{}", not_ready.body);
    assert!(
        not_ready.body.starts_with("store unavailable: ") && not_ready.body.contains("locked"),
        "{}",
        not_ready.body
    );
    let refused = app.deliver("evt_locked", "{}").await;
    assert_eq!((refused.status, refused.outcome()), (503, "unavailable"));
    holder.execute_batch("ROLLBACK").unwrap();
    assert_eq!(app.admin_get("/readyz").await.status, 200);
    assert_eq!(app.deliver("evt_locked", "{}").await.outcome(), "forwarded");
}

/// A column's type changed under the running proxy (an ALTER TABLE, such as
/// one mending a type `/readyz` named) does not leave the statements it had
/// prepared failing: PostgreSQL refuses to run them with another result
/// type, and they are prepared anew. Once `/readyz` has found the table is
/// not the claims table, webhooks are refused too, until it is mended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_type_changed_under_the_proxy_does_not_break_its_statements() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    // One connection, so every statement meets the one prepared before.
    let app = TestApp::start(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.pool_size = 1
    })
    .await;
    assert_eq!(app.deliver("evt_1", "{}").await.outcome(), "forwarded");
    assert_eq!(app.deliver("evt_1", "{}").await.outcome(), "duplicate");
    crate::rows::batch(
        &store,
        "ALTER TABLE processed_events ALTER COLUMN status TYPE varchar(10)",
    )
    .await;
    assert_eq!(app.deliver("evt_1", "{}").await.outcome(), "duplicate");
    assert_eq!(app.deliver("evt_2", "{}").await.outcome(), "forwarded");
    let not_ready = app.admin_get("/readyz").await;
    assert_eq!(not_ready.status, 503);
    assert!(
        not_ready
            .body
            .contains("(column status is character varying(10), not text)"),
        "{}",
        not_ready.body
    );
    let refused = app.deliver("evt_3", "{}").await;
    assert_eq!((refused.status, refused.outcome()), (503, "unavailable"));
    crate::rows::batch(
        &store,
        "ALTER TABLE processed_events ALTER COLUMN status TYPE text",
    )
    .await;
    app.wait_ready().await;
    assert_eq!(app.deliver("evt_2", "{}").await.outcome(), "duplicate");
    assert_eq!(app.deliver("evt_3", "{}").await.outcome(), "forwarded");
    // The attempt number is read as the integer it is meant to be, whatever
    // the column became: decoding another width would fail every claim.
    crate::rows::batch(
        &store,
        "ALTER TABLE processed_events ALTER COLUMN attempts TYPE bigint",
    )
    .await;
    assert_eq!(app.deliver("evt_4", "{}").await.outcome(), "forwarded");
    assert_eq!(app.deliver("evt_4", "{}").await.outcome(), "duplicate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_starts_with_the_store_down_and_serves_once_it_answers() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let relay = Relay::start(store.postgres_addr(), false).await;
    let url = store.url_via(relay.addr);
    let app = TestApp::start(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.url = url
    })
    .await;
    assert_eq!(app.admin_get("/healthz").await.status, 200);
    let not_ready = app.admin_get("/readyz").await;
    assert_eq!(not_ready.status, 503);
    assert!(
        not_ready
            .body
            .starts_with("store unavailable: postgres: cannot connect to PostgreSQL at 127.0.0.1:"),
        "the reason is the store, not the schema: {}",
        not_ready.body
    );
    let refused = app.deliver("evt_early", "{}").await;
    assert_eq!((refused.status, refused.outcome()), (503, "unavailable"));
    assert_eq!(app.upstream.count(), 0);

    relay.restore();
    app.wait_ready().await;
    assert_eq!(app.deliver("evt_early", "{}").await.outcome(), "forwarded");
    assert_eq!(app.deliver("evt_early", "{}").await.outcome(), "duplicate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_whose_settle_fails_is_still_returned_and_settled_later() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let relay = Relay::start(store.postgres_addr(), true).await;
    let url = store.url_via(relay.addr);
    let app = Arc::new(
        TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
            config.store.url = url
        })
        .await,
    );
    let response = app.deliver_answered_after("evt_settle", relay.cut()).await;
    assert_eq!(
        (response.status, response.outcome()),
        (200, "forwarded"),
        "the upstream's answer is not lost"
    );

    relay.restore();
    let client = store.postgres().await;
    let settled = async {
        loop {
            let row = client
                .query_one(
                    "SELECT status FROM processed_events WHERE event_id = 'evt_settle'",
                    &[],
                )
                .await
                .unwrap();
            if row.get::<_, String>(0) == "done" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), settled)
        .await
        .expect("settled in the background");
    let metrics = app.admin_get("/metrics").await.body;
    assert!(
        metrics.contains(r#"dedupe_store_errors_total{op="settle"}"#),
        "{metrics}"
    );
    assert_eq!(app.deliver("evt_settle", "{}").await.outcome(), "duplicate");
}

/// A key's status in the claims table.
async fn status_of(client: &tokio_postgres::Client, key: String) -> String {
    client
        .query_one(
            "SELECT status FROM processed_events WHERE event_id = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

/// A settle waiting on a row another transaction holds locked outlasts
/// `store.timeout`: its sender still gets the upstream's answer, and the
/// write lands once the lock goes. Meanwhile every other key is settled
/// before its answer, as usual: the retry waits for the write still at the
/// database instead of sending a second one to wait beside it, which would
/// hold the last free settle batch, and with it every settle after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_waiting_on_a_locked_row_holds_up_no_other_keys_settle() {
    let app = TestApp::spawn(Backend::Postgres, |config| {
        config.store.timeout = Duration::from_millis(300);
    })
    .await;
    let holder = app.store.postgres().await;
    let locked = app
        .deliver_answered_after("evt_locked", async {
            holder
                .batch_execute(
                    "BEGIN; SELECT 1 FROM processed_events WHERE event_id = 'evt_locked' FOR UPDATE",
                )
                .await
                .unwrap();
        })
        .await;
    assert_eq!((locked.status, locked.outcome()), (200, "forwarded"));
    let client = app.store.postgres().await;
    let status = |key: &str| status_of(&client, key.to_owned());
    assert_eq!(status("evt_locked").await, "processing");

    // Past the background retry's first try, and several more.
    let until = std::time::Instant::now() + Duration::from_millis(1500);
    let mut others = 0;
    while std::time::Instant::now() < until {
        let key = format!("evt_other_{others}");
        assert_eq!(
            app.deliver(&key, "{}").await.outcome(),
            "forwarded",
            "{key}"
        );
        assert_eq!(
            status(&key).await,
            "done",
            "{key} is settled before its answer"
        );
        others += 1;
    }
    assert_eq!(
        waiting_on_locks(&client).await.len(),
        1,
        "the held key's retry waits for its first write instead of sending more"
    );

    holder.batch_execute("COMMIT").await.unwrap();
    let settled = async {
        while status("evt_locked").await != "done" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), settled)
        .await
        .expect("the waiting write lands once the lock goes");
    // The replica's own record of the unwritten outcome goes a moment after
    // the write commits; until then a delivery is answered in flight.
    redelivered_until_duplicate(&app, "evt_locked").await;
}

/// A claim waiting on a row another transaction is inserting (an open
/// transaction holds the key's insert) holds a claim slot, and its caller
/// is answered 503 after `store.timeout`. The sender's retries of that key
/// are answered in flight without a statement: each one sent would wait on
/// the same row in a slot of its own, until no slot was left for any other
/// key's claim. Once the transaction ends, the waiting claim decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_of_a_key_whose_claim_waits_on_a_held_row_take_no_more_slots() {
    let app = TestApp::spawn(Backend::Postgres, |config| {
        config.store.timeout = Duration::from_millis(500);
    })
    .await;
    let holder = app.store.postgres().await;
    holder
        .batch_execute(
            "BEGIN; INSERT INTO processed_events (source, event_id, status, lease_expires_at)
             VALUES ('orders', 'evt_held', 'processing', now() + interval '1 hour')",
        )
        .await
        .unwrap();
    let first = app.deliver("evt_held", "{}").await;
    assert_eq!((first.status, first.outcome()), (503, "unavailable"));
    // More than there are slots for claims, stuck ones included.
    for _ in 0..8 {
        let retry = app.deliver("evt_held", "{}").await;
        assert_eq!(
            (retry.status, retry.outcome()),
            (409, "in-flight"),
            "{retry:?}"
        );
    }
    let observer = app.store.postgres().await;
    assert_eq!(waiting_on_locks(&observer).await.len(), 1);
    assert_eq!(app.deliver("evt_other", "{}").await.outcome(), "forwarded");
    holder.batch_execute("ROLLBACK").await.unwrap();
    // The waiting claim inserts the key, and is released: its caller has
    // had its answer.
    redelivered_until(&app, "evt_held", "forwarded").await;
    assert_eq!(app.upstream.count(), 2);
}

/// With every settle slot taken by a statement waiting on a row another
/// transaction holds (a pool of six leaves no slots for stuck statements
/// beyond the two regular ones), the settle of any other key still lands
/// before its answer: it goes out without a slot, waiting on no row lock,
/// instead of queueing behind them for as long as the rows are held and
/// past the key's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_settle_slot_waiting_on_a_held_row_other_keys_still_settle() {
    let app = TestApp::spawn(Backend::Postgres, |config| {
        config.store.pool_size = 6;
        config.store.timeout = Duration::from_millis(500);
    })
    .await;
    let mut holders = Vec::new();
    for key in ["evt_held_1", "evt_held_2"] {
        let holder = app.store.postgres().await;
        let answer = app
            .deliver_answered_after(key, async {
                holder
                    .batch_execute(&format!(
                        "BEGIN; SELECT 1 FROM processed_events WHERE event_id = '{key}' FOR UPDATE"
                    ))
                    .await
                    .unwrap();
            })
            .await;
        assert_eq!(answer.outcome(), "forwarded", "{key}");
        holders.push(holder);
    }
    let client = app.store.postgres().await;
    let status = |key: &str| status_of(&client, key.to_owned());
    assert_eq!(
        waiting_on_locks(&client).await.len(),
        2,
        "both settle slots wait on held rows"
    );
    for key in ["evt_free_1", "evt_free_2"] {
        assert_eq!(app.deliver(key, "{}").await.outcome(), "forwarded", "{key}");
        assert_eq!(
            status(key).await,
            "done",
            "{key} is settled before its answer"
        );
    }
    for holder in &holders {
        holder.batch_execute("COMMIT").await.unwrap();
    }
    let settled = async {
        while status("evt_held_1").await != "done" || status("evt_held_2").await != "done" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), settled)
        .await
        .expect("the waiting writes land once the locks go");
}

async fn in_shadow_mode_a_claim_won_too_late_is_released_and_the_delivery_forwarded(
    backend: Backend,
) {
    let app = TestApp::spawn(backend, |config| {
        lease_just_over_upstream_timeout(config);
        config.routes[0].mode = Mode::Shadow;
    })
    .await;
    block_claims_for(backend, &app.store, LATE_CLAIM_DELAY).await;
    let late = app.deliver("evt_late", "{}").await;
    assert_eq!((late.status, late.outcome()), (200, "passthrough"));
    assert_eq!(app.upstream.count(), 1);
    assert_eq!(
        app.upstream.seen()[0].header("x-dedupe-attempt"),
        None,
        "forwarded without a claim"
    );
    assert_eq!(
        app.upstream.seen()[0].header("x-dedupe-key"),
        Some("evt_late")
    );
    let retry = app.deliver("evt_late", "{}").await;
    assert_eq!(retry.outcome(), "passthrough");
    assert_eq!(
        app.upstream.seen()[1].header("x-dedupe-attempt"),
        Some("2"),
        "the late claim was released, so the next delivery won attempt 2"
    );
}

async fn a_sender_that_hangs_up_during_its_claim_leaves_no_orphaned_claim(backend: Backend) {
    let app = TestApp::spawn(backend, |_| {}).await;
    // The claim waits on a lock while the sender gives up and disconnects.
    block_claims_for(backend, &app.store, Duration::from_millis(600)).await;
    let (addr, client) = (app.addr, crate::support::client());
    let mut sender = tokio::spawn(async move {
        let request = http::Request::post(format!("http://{addr}/hooks/orders"))
            .header("x-event-id", "evt_gone")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        client.request(request).await
    });
    let waiting = tokio::time::timeout(Duration::from_millis(200), &mut sender).await;
    assert!(
        waiting.is_err(),
        "the request was still waiting on its claim"
    );
    sender.abort();
    assert!(
        sender.await.unwrap_err().is_cancelled(),
        "the sender hung up"
    );
    // Once the claim commits, the webhook is forwarded and settled anyway.
    app.upstream.wait_for(1).await;
    redelivered_until_duplicate(&app, "evt_gone").await;
    assert_eq!(app.upstream.count(), 1);
}

/// An HTTP/2 sender that cancels its stream drops the request's handler at
/// once (an HTTP/1 connection only notices on writing the answer); the
/// delivery still goes on to the upstream, and is counted as forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_http2_stream_is_cancelled_is_still_counted() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let gate = Gate::new();
    app.upstream
        .script("evt_reset", [Behavior::Gate(Arc::clone(&gate))]);
    let tcp = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let mut sender = crate::support::http2_sender(tcp).await;
    let stream = tokio::spawn(async move {
        crate::support::send_http2(&mut sender, "/hooks/orders", "evt_reset").await
    });
    app.upstream.wait_for(1).await;
    stream.abort();
    assert!(stream.await.unwrap_err().is_cancelled());
    gate.open();
    redelivered_until_duplicate(&app, "evt_reset").await;
    // The cancelled delivery is counted as forwarded.
    app.wait_for_metric(r#"dedupe_requests_total{outcome="forwarded",route="orders"} 1"#)
        .await;
}

/// A cancelled HTTP/2 stream's delivery goes on, and keeps its place under
/// `limits.max_concurrent_requests` until it ends: otherwise a sender that
/// cancels every stream once sent would start any number of deliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_http2_stream_keeps_its_place_under_the_concurrency_limit() {
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.limits.max_concurrent_requests = 1;
    })
    .await;
    let gate = Gate::new();
    app.upstream
        .script("evt_held", [Behavior::Gate(Arc::clone(&gate))]);
    let tcp = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let mut sender = crate::support::http2_sender(tcp).await;
    let held = tokio::spawn({
        let mut sender = sender.clone();
        async move { crate::support::send_http2(&mut sender, "/hooks/orders", "evt_held").await }
    });
    app.upstream.wait_for(1).await;
    held.abort();
    assert!(held.await.unwrap_err().is_cancelled());
    // On the same connection, after the cancellation.
    let next = crate::support::send_http2(&mut sender, "/hooks/orders", "evt_next").await;
    assert_eq!(
        (next.status, next.outcome()),
        (503, "unavailable"),
        "{next:?}"
    );
    assert_eq!(app.upstream.count(), 1);
    app.assert_metrics(&["dedupe_in_flight_requests 1"]).await;
    gate.open();
    // The cancelled delivery ends.
    app.wait_for_metric("dedupe_in_flight_requests 0").await;
    assert_eq!(app.deliver("evt_held", "{}").await.outcome(), "duplicate");
    let next = app.deliver("evt_next", "{}").await;
    assert_eq!(next.outcome(), "forwarded", "{next:?}");
}

/// An HTTP/2 sender that cancels its stream leaves no connection waiting for
/// its delivery; shutdown still waits for it within the grace period, so the
/// application's answer is written rather than the claim released (its
/// retry would be forwarded again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_delivery_whose_http2_sender_has_gone() {
    let store = Arc::new(TestStore::new(Backend::Sqlite).await);
    let upstream = Upstream::start().await;
    let gate = Gate::new();
    upstream.script("evt_gone", [Behavior::Gate(Arc::clone(&gate))]);
    let config = process_config(&upstream, &store.url, "shutdown_grace: 20s\n");
    let mut proxy = ProxyProcess::start(&config).await;
    proxy.wait_ready().await;
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let mut sender = crate::support::http2_sender(tcp).await;
    let stream = tokio::spawn(async move {
        crate::support::send_http2(&mut sender, "/hooks/orders", "evt_gone").await
    });
    upstream.wait_for(1).await;
    stream.abort();
    assert!(stream.await.unwrap_err().is_cancelled());
    proxy.terminate();
    proxy
        .wait_for_log("shutdown waits for webhooks whose senders have gone")
        .await;
    gate.open();
    assert!(proxy.wait().await.success());
    let after = TestApp::spawn_on(store, Upstream::start().await, |_| {}).await;
    assert_eq!(
        after.deliver("evt_gone", "{}").await.outcome(),
        "duplicate",
        "the application's answer was written before exit"
    );
    assert_eq!(upstream.count(), 1);
}

/// A claim answered as timed out (its row held by another transaction) is
/// still at the database when shutdown begins: shutdown waits for it, within
/// the grace period, and releases it once it wins, rather than exiting and
/// leaving the key `processing` until its lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_claim_answered_as_timed_out_and_releases_it() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let upstream = Upstream::start().await;
    let config = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nshutdown_grace: 20s\nupstream: {{ url: '{}' }}\nstore: {{ url: '{}', timeout: 300ms }}\nroutes: [{{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}]\n",
        upstream.url(),
        store.url
    );
    let mut proxy = ProxyProcess::start(&config).await;
    proxy.wait_ready().await;
    let holder = store.postgres().await;
    holder
        .batch_execute(
            "BEGIN; INSERT INTO processed_events (source, event_id, status) VALUES ('orders', 'evt_late', 'done')",
        )
        .await
        .unwrap();
    let timed_out = crate::cli::post_webhook(proxy.addr, "evt_late", "{}".into()).await;
    assert_eq!(
        (timed_out.status, timed_out.outcome()),
        (503, "unavailable")
    );
    proxy.terminate();
    proxy
        .wait_for_log("shutdown waits for claims answered as timed out")
        .await;
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert!(proxy.wait().await.success());
    let row = store
        .postgres()
        .await
        .query_one(
            "SELECT status, attempts FROM processed_events WHERE source = 'orders' AND event_id = 'evt_late'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, i32>(1)),
        ("failed".to_owned(), 1),
        "released, so the sender's retry is forwarded"
    );
    assert_eq!(upstream.count(), 0);
}

/// Delivers `key` again until it is answered `duplicate` (its outcome was
/// written), every answer before that being `in-flight`, never forwarded.
async fn redelivered_until_duplicate(app: &TestApp, key: &str) {
    redelivered_until(app, key, "duplicate").await;
}

/// Delivers `key` again until it is answered with `outcome`, every answer
/// before that being `in-flight`.
async fn redelivered_until(app: &TestApp, key: &str, outcome: &str) {
    let answered = async {
        loop {
            let again = app.deliver(key, "{}").await;
            if again.outcome() == outcome {
                return;
            }
            assert_eq!(again.outcome(), "in-flight", "{again:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), answered)
        .await
        .unwrap_or_else(|_| panic!("{key} never answered {outcome}"));
}

/// A proxy that, in shutdown, would wait a minute for a connection that it
/// did not close.
async fn spawn_with_a_minute_of_grace() -> TestApp {
    TestApp::spawn(Backend::Sqlite, |config| {
        config.shutdown_grace = Duration::from_secs(60);
        config.limits.header_read_timeout = Duration::from_secs(60);
    })
    .await
}

/// A connection that has sent nothing yet is closed when shutdown begins,
/// not waited for: with a grace period and a header read timeout of a
/// minute each, shutdown still ends within `TestApp::shutdown`'s bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_has_not_started_a_request_does_not_hold_up_shutdown() {
    use tokio::io::AsyncReadExt;
    let mut app = spawn_with_a_minute_of_grace().await;
    let mut silent = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    // Served, so the silent connection has been handed to a serving thread.
    assert_eq!(app.deliver("evt_before", "{}").await.outcome(), "forwarded");
    app.shutdown().await;
    let mut buffer = [0u8; 16];
    let closed = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buffer))
        .await
        .expect("the silent connection is closed");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
}

/// An idle keep-alive connection is closed when shutdown begins: with a
/// grace period and a header read timeout of a minute each, shutdown still
/// ends within `TestApp::shutdown`'s bound and the sender sees the close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_when_shutdown_begins() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut app = spawn_with_a_minute_of_grace().await;
    let mut kept = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    kept.write_all(
        b"POST /hooks/orders HTTP/1.1\r\nhost: proxy\r\nx-event-id: evt_kept\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await
    .unwrap();
    let mut answered = Vec::new();
    let mut buffer = [0u8; 1024];
    while !String::from_utf8_lossy(&answered).ends_with("upstream says 200 to evt_kept") {
        let read = kept.read(&mut buffer).await.unwrap();
        assert_ne!(read, 0, "closed before answering");
        answered.extend_from_slice(&buffer[..read]);
    }
    let answered = String::from_utf8_lossy(&answered).into_owned();
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
    assert!(
        !answered.to_ascii_lowercase().contains("connection: close"),
        "{answered}"
    );
    app.shutdown().await;
    let closed = tokio::time::timeout(Duration::from_secs(10), kept.read(&mut buffer))
        .await
        .expect("the idle connection is closed");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
}

/// The upstream answered while the store was down, so the outcome waits to
/// be written; the lease expires meanwhile. When the store is back, the
/// sender's retry must not be forwarded again, whether or not the
/// background write has landed yet.
async fn an_outcome_the_store_has_not_taken_keeps_its_key_from_a_second_forward(backend: Backend) {
    const LEASE: Duration = Duration::from_secs(3);
    let store = Arc::new(TestStore::new(backend).await);
    let (mut outage, url) = Outage::prepare(backend, &store).await;
    let app = TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.url = url;
        config.store.lease = LEASE;
    })
    .await;
    let first = app.deliver_answered_after("evt_lost", outage.begin()).await;
    assert_eq!((first.status, first.outcome()), (200, "forwarded"));
    // The claim's lease runs out while its outcome cannot be written.
    tokio::time::sleep(LEASE).await;
    outage.end();
    let retry = app.deliver("evt_lost", "{}").await;
    assert_ne!(retry.outcome(), "forwarded", "{retry:?}");
    redelivered_until_duplicate(&app, "evt_lost").await;
    assert_eq!(app.upstream.count(), 1);
}

/// A known outcome the store could not take is written at shutdown once the
/// store is back, as long as that is within the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_keeps_trying_to_write_known_outcomes_until_the_grace_ends() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let relay = Relay::start(store.postgres_addr(), true).await;
    let url = store.url_via(relay.addr);
    let mut app = TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.url = url;
        config.shutdown_grace = Duration::from_secs(20);
    })
    .await;
    let first = app.deliver_answered_after("evt_term", relay.cut()).await;
    assert_eq!(first.outcome(), "forwarded");
    let refused = relay.refusals();
    app.begin_shutdown();
    // Shutdown has tried to write the outcome and found the store down.
    relay.wait_for_refusal(refused).await;
    relay.restore();
    app.shutdown().await;
    let after = TestApp::spawn_on(store, Upstream::start().await, |_| {}).await;
    assert_eq!(
        after.deliver("evt_term", "{}").await.outcome(),
        "duplicate",
        "the outcome was written before exit"
    );
}

/// Shutdown's final writes go out together, each bounded by
/// `store.timeout`: with a store that has stopped answering, the process
/// ends about one `store.timeout` after the grace period however many claims
/// are open, not one per claim (here 10 x 4 s, past `TestApp::shutdown`'s
/// bound). The claims are left to their leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_the_store_hung_ends_one_store_timeout_after_the_grace() {
    const OPEN: usize = 10;
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let relay = Relay::start(store.postgres_addr(), true).await;
    let url = store.url_via(relay.addr);
    let mut app = TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.url = url;
        config.store.timeout = Duration::from_secs(4);
        config.shutdown_grace = Duration::from_millis(200);
        // No 504 (and its settle) before the process ends.
        config.upstream.timeout = Duration::from_secs(30);
        config.store.lease = Duration::from_secs(60);
    })
    .await;
    let mut senders = Vec::new();
    for n in 0..OPEN {
        let key = format!("evt_open_{n}");
        app.upstream.script(&key, [Behavior::Hang]);
        let addr = app.addr;
        senders.push(tokio::spawn(async move {
            crate::cli::send_webhook(addr, &key, "{}".into()).await
        }));
    }
    app.upstream.wait_for(OPEN).await;
    relay.freeze();
    app.shutdown().await;
    let processing = store
        .postgres()
        .await
        .query_one(
            "SELECT count(*) FROM processed_events WHERE status = 'processing'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    assert_eq!(processing, OPEN as i64, "left to their leases");
    for sender in senders {
        assert!(sender.await.unwrap().is_err(), "no answer after the grace");
    }
}

/// A request still sending its body when the grace period ends is claimed
/// while shutdown settles the open claims: forwarded then, it would be cut
/// off when the process ends and leave its key `processing` for the lease,
/// so it is released and answered 503 instead, without reaching the
/// application.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_won_while_shutdown_settles_is_released_not_forwarded() {
    let mut app = TestApp::spawn(Backend::Postgres, |config| {
        config.shutdown_grace = Duration::from_millis(200);
    })
    .await;
    app.upstream.script("evt_stuck", [Behavior::Hang]);
    app.upstream.script("evt_late", [Behavior::Hang]);
    let stuck = {
        let addr = app.addr;
        tokio::spawn(async move {
            let request = http::Request::post(format!("http://{addr}/hooks/orders"))
                .header("x-event-id", "evt_stuck")
                .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
                .unwrap();
            crate::support::client().request(request).await
        })
    };
    app.upstream.wait_for(1).await;
    // Shutdown's release of evt_stuck waits on this lock, holding shutdown
    // between closing the registry and the end of the process.
    let mut locker = app.store.postgres().await;
    let lock = locker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM processed_events WHERE source = 'orders' AND event_id = 'evt_stuck' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let mut late = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    late.write_all(
        b"POST /hooks/orders HTTP/1.1\r\nhost: proxy\r\nx-event-id: evt_late\r\ncontent-length: 2\r\n\r\n",
    )
    .await
    .unwrap();
    // Both requests are in flight before shutdown begins.
    app.wait_for_metric("dedupe_in_flight_requests 2").await;
    app.begin_shutdown();
    let observer = app.store.postgres().await;
    until_waiting_on_locks(&observer, 1).await;
    late.write_all(b"{}").await.unwrap();
    let mut answer = Vec::new();
    let mut buffer = [0; 1024];
    while !String::from_utf8_lossy(&answer).contains("\r\n\r\n") {
        let read = late.read(&mut buffer).await.unwrap();
        assert!(read > 0, "answered: {}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&buffer[..read]);
    }
    let answer = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("x-dedupe-outcome: unavailable"), "{answer}");
    lock.commit().await.unwrap();
    app.shutdown().await;
    assert!(stuck.await.unwrap().is_err(), "cut off at the deadline");
    let seen: Vec<_> = app
        .upstream
        .seen()
        .iter()
        .map(|seen| seen.header("x-event-id").unwrap().to_owned())
        .collect();
    assert_eq!(seen, ["evt_stuck"], "the late claim was not forwarded");
    let rows = observer
        .query(
            "SELECT event_id, status, attempts FROM processed_events ORDER BY event_id",
            &[],
        )
        .await
        .unwrap();
    let rows: Vec<(String, String, i32)> = rows
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    assert_eq!(
        rows,
        [
            ("evt_late".to_owned(), "failed".to_owned(), 1),
            ("evt_stuck".to_owned(), "failed".to_owned(), 1),
        ]
    );
}

/// A transaction holding the PostgreSQL claims table (an `ALTER TABLE`, a
/// `VACUUM FULL`, a `LOCK TABLE`) stops every claim; `/readyz` says so, as
/// it does for SQLite's write lock, rather than reading the catalog and
/// answering ready.
#[tokio::test]
async fn readyz_answers_503_while_a_transaction_holds_the_postgres_table() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let app = TestApp::start(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.timeout = Duration::from_millis(400);
    })
    .await;
    app.wait_ready().await;
    let holder = store.postgres().await;
    holder
        .batch_execute("BEGIN; LOCK TABLE processed_events IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let not_ready = app.admin_get("/readyz").await;
    assert_eq!(not_ready.status, 503, "{}", not_ready.body);
    assert!(
        not_ready.body.starts_with("store unavailable: ") && not_ready.body.contains("lock"),
        "{}",
        not_ready.body
    );
    let refused = app.deliver("evt_locked", "{}").await;
    assert_eq!((refused.status, refused.outcome()), (503, "unavailable"));
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(app.admin_get("/readyz").await.status, 200);
    // evt_locked's claim, answered 503, is still decided once the lock goes
    // (and released), so another key shows the claims going through.
    assert_eq!(app.deliver("evt_after", "{}").await.outcome(), "forwarded");
}
