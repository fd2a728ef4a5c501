//! Recovery without a restart: store connections terminated mid-traffic, an
//! upstream restarted on the same port behind pooled keep-alive connections,
//! a settle that outlives a store outage longer than the lease, and retries
//! answered while an outcome waits for the store.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use dedupe_proxy::config::OnPayloadMismatch;

use crate::support::{Backend, Relay, TestApp, TestStore, Upstream};

/// Delivers `key` until it is acknowledged, within a bound. Only 503 (store
/// unavailable) and 409 (a claim whose answer the terminated connection lost
/// holds its lease) may come before.
async fn deliver_until_acknowledged(app: &TestApp, key: &str) -> crate::support::TestResponse {
    for _ in 0..400 {
        let response = app.deliver(key, "{}").await;
        match response.status {
            503 | 409 => tokio::time::sleep(Duration::from_millis(25)).await,
            _ => return response,
        }
    }
    panic!("{key}: not acknowledged after 400 deliveries");
}

async fn terminate_proxy_backends(store: &TestStore) -> i64 {
    store
        .postgres()
        .await
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
              WHERE datname = current_database() AND application_name = 'dedupe-proxy'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_store_connections_cost_at_most_503s_and_traffic_recovers() {
    let app = Arc::new(
        TestApp::spawn(Backend::Postgres, |config| {
            config.store.lease = Duration::from_secs(3)
        })
        .await,
    );
    // Open several pooled connections, so more than one is terminated.
    let warm: Vec<_> = (0..8)
        .map(|i| {
            let app = Arc::clone(&app);
            tokio::spawn(async move { app.deliver(&format!("evt_warm_{i}"), "{}").await })
        })
        .collect();
    for delivery in warm {
        assert_eq!(delivery.await.unwrap().outcome(), "forwarded");
    }

    let senders: Vec<_> = (0..4)
        .map(|sender| {
            let app = Arc::clone(&app);
            tokio::spawn(async move {
                let mut answers = HashMap::new();
                for i in 0..25 {
                    let key = format!("evt_{sender}_{i}");
                    let response = deliver_until_acknowledged(&app, &key).await;
                    answers.insert(key, (response.status, response.outcome().to_owned()));
                }
                answers
            })
        })
        .collect();
    let mut terminated = 0;
    for round in 1..=3 {
        app.upstream.wait_for(8 + 20 * round).await;
        terminated += terminate_proxy_backends(&app.store).await;
    }
    assert!(terminated > 0, "no backend of the proxy was terminated");
    let mut answers = HashMap::new();
    for sender in senders {
        answers.extend(sender.await.unwrap());
    }
    for (key, answer) in &answers {
        assert_eq!(answer, &(200, "forwarded".to_owned()), "{key}");
    }
    let mut forwarded: HashMap<String, usize> = HashMap::new();
    for seen in app.upstream.seen() {
        *forwarded
            .entry(seen.header("x-dedupe-key").unwrap().to_owned())
            .or_default() += 1;
    }
    assert_eq!(forwarded.len(), 108);
    assert!(
        forwarded.values().all(|&count| count == 1),
        "a key was forwarded twice: {forwarded:?}"
    );
    assert_eq!(app.deliver("evt_2_7", "{}").await.outcome(), "duplicate");
    app.wait_ready().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_that_failed_is_written_when_the_store_returns_after_the_lease() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let relay = Relay::start(store.postgres_addr(), true).await;
    let url = store.url_via(relay.addr);
    let lease = Duration::from_secs(2);
    let app = Arc::new(
        TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
            config.store.url = url;
            config.store.lease = lease;
            config.upstream.timeout = Duration::from_secs(1);
            config.store.timeout = Duration::from_millis(500);
        })
        .await,
    );
    let response = app.deliver_answered_after("evt_outage", relay.cut()).await;
    assert_eq!((response.status, response.outcome()), (200, "forwarded"));

    // The outage outlasts the lease: the claim is reclaimable in the table,
    // but the proxy knows the application acted.
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    relay.restore();
    let client = store.postgres().await;
    let settled = async {
        loop {
            let status: String = client
                .query_one(
                    "SELECT status FROM processed_events WHERE event_id = 'evt_outage'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if status == "done" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), settled)
        .await
        .expect("the known outcome is written once the store answers");
    assert_eq!(app.deliver("evt_outage", "{}").await.outcome(), "duplicate");
    assert_eq!(app.upstream.count(), 1, "acted on once");
}

/// While the store is down and this replica holds an outcome it could not
/// write, a retry of the key is answered without the store, and its body is
/// still compared with the first delivery's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_during_an_unwritten_settle_is_compared_with_the_first_body() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let relay = Relay::start(store.postgres_addr(), true).await;
    let url = store.url_via(relay.addr);
    let app = TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.url = url;
        config.store.timeout = Duration::from_millis(300);
        config.routes[0].on_payload_mismatch = Some(OnPayloadMismatch::Reject);
    })
    .await;
    let response = app.deliver_answered_after("evt_gap", relay.cut()).await;
    assert_eq!((response.status, response.outcome()), (200, "forwarded"));

    let changed = app.deliver("evt_gap", r#"{"n":2}"#).await;
    assert_eq!((changed.status, changed.outcome()), (422, "rejected"));
    let same = app.deliver("evt_gap", "{}").await;
    assert_eq!((same.status, same.outcome()), (409, "in-flight"));
    assert_eq!(app.upstream.count(), 1, "neither retry is forwarded");
    app.assert_metrics(&[
        r#"dedupe_payload_mismatch_total{route="orders"} 1"#,
        r#"dedupe_claims_total{result="lost_in_flight",route="orders"} 2"#,
    ])
    .await;

    relay.restore();
    let settled = async {
        while app.deliver("evt_gap", "{}").await.outcome() != "duplicate" {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), settled)
        .await
        .expect("the outcome is written once the store answers");
    assert_eq!(app.upstream.count(), 1, "acted on once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_restarted_on_the_same_port_gets_the_next_delivery() {
    let app = TestApp::spawn(Backend::Postgres, |_| {}).await;
    for key in ["evt_before_1", "evt_before_2"] {
        assert_eq!(app.deliver(key, "{}").await.outcome(), "forwarded");
    }
    // The proxy now holds an idle keep-alive connection to the old process.
    let addr = app.upstream.addr;
    app.upstream.stop();
    let listener = rebind(addr).await;
    let restarted = Upstream::serve(listener);
    for key in ["evt_after_1", "evt_after_2", "evt_after_3"] {
        let response = app.deliver(key, "{}").await;
        assert_eq!(
            (response.status, response.outcome()),
            (200, "forwarded"),
            "{key}: {}",
            response.body
        );
    }
    assert_eq!(restarted.count(), 3);
    assert!(
        restarted
            .seen()
            .iter()
            .all(|seen| seen.header("x-dedupe-attempt") == Some("1")),
        "each was forwarded on its first attempt"
    );
    assert_eq!(
        app.deliver("evt_before_1", "{}").await.outcome(),
        "duplicate"
    );
    assert_eq!(restarted.count(), 3);
    restarted.stop();
}

/// Binds `addr` again once the previous listener is gone.
async fn rebind(addr: std::net::SocketAddr) -> TcpListener {
    for _ in 0..200 {
        if let Ok(listener) = TcpListener::bind(addr).await {
            return listener;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{addr} never became free");
}

/// A raw HTTP/1.1 upstream that closes the connection carrying the second
/// request right after reading it, without answering: what a server that
/// closed a keep-alive connection as the request arrived looks like. It
/// counts requests across connections because the client's pool may not have
/// taken the first connection back when the second request goes out, and
/// then the second request opens a connection of its own.
async fn closing_upstream() -> (std::net::SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let record = Arc::clone(&record);
            tokio::spawn(async move {
                while let Some(head) = read_request(&mut stream).await {
                    let requests_so_far = {
                        let mut seen = record.lock().unwrap();
                        seen.push(head);
                        seen.len()
                    };
                    if requests_so_far == 2 {
                        return;
                    }
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if stream.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// Reads one request (head and `Content-Length` body); returns the head.
async fn read_request(stream: &mut tokio::net::TcpStream) -> Option<String> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .map_or(0, |value| value.trim().parse().unwrap());
    while buffer.len() < head_end + length {
        let read = stream.read(&mut chunk).await.ok()?;
        if read == 0 {
            return None;
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
    Some(head)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_connection_closed_under_a_request_fails_it_and_the_retry_succeeds() {
    let (addr, seen) = closing_upstream().await;
    let app = TestApp::spawn(Backend::Postgres, |config| {
        config.upstream.url = format!("http://{addr}");
    })
    .await;
    assert_eq!(app.deliver("evt_first", "{}").await.outcome(), "forwarded");
    let lost = app.deliver("evt_lost", "{}").await;
    assert_eq!(
        (lost.status, lost.outcome()),
        (502, "upstream-error"),
        "{}",
        lost.body
    );
    let row = app
        .store
        .postgres()
        .await
        .query_one(
            "SELECT status, response_status FROM processed_events WHERE event_id = 'evt_lost'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "failed");
    assert_eq!(row.get::<_, Option<i16>>(1), None);

    let retry = app.deliver("evt_lost", "{}").await;
    assert_eq!((retry.status, retry.outcome()), (200, "forwarded"));
    let seen = seen.lock().unwrap().clone();
    let attempts: Vec<&str> = seen
        .iter()
        .filter(|head| head.contains("x-dedupe-key: evt_lost"))
        .filter_map(|head| {
            head.lines()
                .find_map(|line| line.strip_prefix("x-dedupe-attempt: "))
        })
        .collect();
    assert_eq!(attempts, ["1", "2"], "{seen:?}");
    assert_eq!(app.deliver("evt_lost", "{}").await.outcome(), "duplicate");
}

/// A view, or a table a column was dropped from, takes the statement a
/// claim runs, but not every settle: the migration and `/readyz` refuse it,
/// and webhooks are refused too (503, nothing forwarded) until the table is
/// mended, with no restart.
#[tokio::test]
async fn webhooks_are_refused_while_the_table_is_not_a_claims_table() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let upstream = Upstream::start().await;
    let mut app = TestApp::spawn_on(Arc::clone(&store), upstream.clone(), |_| {}).await;
    app.shutdown().await;
    crate::rows::batch(
        &store,
        "ALTER TABLE processed_events RENAME TO claims_kept;
         CREATE VIEW processed_events AS SELECT * FROM claims_kept;",
    )
    .await;
    let app = TestApp::start(Arc::clone(&store), upstream.clone(), |_| {}).await;
    let refused = |readyz: &str| readyz.contains("it is a view");
    while !refused(&app.admin_get("/readyz").await.body) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let answer = app.deliver("evt_view", "{}").await;
    assert_eq!((answer.status, answer.outcome()), (503, "unavailable"));
    crate::rows::batch(
        &store,
        "DROP VIEW processed_events; ALTER TABLE claims_kept RENAME TO processed_events;",
    )
    .await;
    let answer = deliver_until_acknowledged(&app, "evt_view").await;
    assert_eq!(answer.outcome(), "forwarded");

    // Dropped while the proxy runs: seen by `/readyz`, then by claims.
    crate::rows::batch(
        &store,
        "ALTER TABLE processed_events DROP COLUMN completed_at",
    )
    .await;
    assert_eq!(app.admin_get("/readyz").await.status, 503);
    let answer = app.deliver("evt_dropped", "{}").await;
    assert_eq!((answer.status, answer.outcome()), (503, "unavailable"));
    crate::rows::batch(
        &store,
        "ALTER TABLE processed_events ADD COLUMN completed_at timestamptz",
    )
    .await;
    let answer = deliver_until_acknowledged(&app, "evt_dropped").await;
    assert_eq!(answer.outcome(), "forwarded");
    assert_eq!(upstream.count(), 2, "only the deliveries after each mend");
}

/// A full disk fails every claim that needs the file to grow, and `/readyz`
/// says so too, where taking the write lock alone passed; both recover once
/// there is room again, with no restart. Needs a file system of its own (a
/// small tmpfs, which root may mount); elsewhere it says why it did not run.
#[tokio::test]
async fn a_full_disk_makes_the_store_unready_until_there_is_room() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().to_path_buf();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mount)
        .stderr(std::process::Stdio::null())
        .status();
    if !mounted.is_ok_and(|status| status.success()) {
        eprintln!("not run: this user cannot mount a tmpfs");
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(mount.clone());
    let database = mount.join("dedupe.db");
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.store.url = format!("sqlite://{}", database.display());
    })
    .await;
    assert_eq!(app.deliver("evt_room", "{}").await.outcome(), "forwarded");
    let filler = mount.join("filler");
    let mut fill = std::fs::File::create(&filler).unwrap();
    while fill.write_all(&[0; 4096]).is_ok() {}
    drop(fill);
    let refused = app.deliver("evt_full", "{}").await;
    assert_eq!((refused.status, refused.outcome()), (503, "unavailable"));
    let readyz = app.admin_get("/readyz").await;
    assert_eq!(readyz.status, 503, "{}", readyz.body);
    assert!(readyz.body.contains("full"), "{}", readyz.body);
    std::fs::remove_file(&filler).unwrap();
    app.wait_ready().await;
    assert_eq!(app.deliver("evt_full", "{}").await.outcome(), "forwarded");
    assert_eq!(app.upstream.count(), 2);
}
