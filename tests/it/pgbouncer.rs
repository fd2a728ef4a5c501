//! The proxy through PgBouncer in transaction pooling mode, where every
//! transaction may run on another server connection: migrations at start-up
//! (a transaction-scoped advisory lock), deliveries, duplicates, one forward
//! for concurrent identical deliveries, retries, the pruner and the `prune`
//! and `keys` commands, with and without named prepared statements.
//!
//! The test starts its own `pgbouncer` (Debian's package: `apt-get install -y
//! pgbouncer`; `scripts/test` installs it) and fails when it is missing.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use crate::cli::{ProxyProcess, run};
use crate::support::{Backend, Behavior, Gate, TestResponse, TestStore, Upstream, client};

/// A private PgBouncer in front of one test database.
struct Bouncer {
    addr: SocketAddr,
    child: Child,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// The `pgbouncer` on `PATH`, else Debian's, which sits in /usr/sbin (not
/// on every user's `PATH`).
fn pgbouncer() -> Command {
    let on_path = Command::new("pgbouncer")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok();
    Command::new(if on_path {
        "pgbouncer"
    } else {
        "/usr/sbin/pgbouncer"
    })
}

/// The installed PgBouncer's version, as (major, minor).
fn pgbouncer_version() -> (u32, u32) {
    let output = pgbouncer().arg("--version").output();
    let output = output.unwrap_or_else(|error| {
        panic!(
            "pgbouncer is not installed ({error}). Install it with \
             `apt-get install -y pgbouncer` (scripts/test does), then run the tests again."
        )
    });
    let text = String::from_utf8_lossy(&output.stdout);
    let version = text
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("unexpected `pgbouncer --version`: {text}"));
    let mut parts = version.split('.').map(|n| n.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

fn running_as_root() -> bool {
    let output = Command::new("id").arg("-u").output().expect("id -u");
    String::from_utf8_lossy(&output.stdout).trim() == "0"
}

impl Bouncer {
    /// Starts PgBouncer in transaction mode for `store`'s server, with
    /// protocol-level prepared statement support when the version has it.
    async fn start(store: &TestStore) -> Self {
        Self::start_with(store, "pool_mode = transaction\n").await
    }

    /// Starts PgBouncer with `settings` added to its `[pgbouncer]` section.
    async fn start_with(store: &TestStore, settings: &str) -> Self {
        let (major, minor) = pgbouncer_version();
        let dir = tempfile::tempdir().unwrap();
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let server = store.postgres_addr();
        let config: tokio_postgres::Config = store.url.parse().unwrap();
        let user = config.get_user().unwrap_or("postgres").to_owned();
        let password = config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        // Before 1.21 PgBouncer does not track prepared statements. Servers
        // in turn, rather than the last one used, make it show: a named
        // statement prepared in one round trip is looked for on another
        // server connection in the next.
        let prepared = if (major, minor) >= (1, 21) {
            "max_prepared_statements = 100\n"
        } else {
            "server_round_robin = 1\n"
        };
        let users = dir.path().join("users.txt");
        std::fs::write(&users, format!("\"{user}\" \"{password}\"\n")).unwrap();
        let ini = dir.path().join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host={} port={}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {}\n{settings}\
                 default_pool_size = 4\nmax_client_conn = 200\n\
                 ignore_startup_parameters = extra_float_digits,options\n{prepared}",
                server.ip(),
                server.port(),
                users.display()
            ),
        )
        .unwrap();
        make_readable(dir.path());
        let log = dir.path().join("stderr.log");
        let mut command = pgbouncer();
        if running_as_root() {
            // PgBouncer refuses to run as root.
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(&ini)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start pgbouncer");
        let bouncer = Self {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
            log,
            _dir: dir,
        };
        bouncer.wait_accepting().await;
        bouncer
    }

    async fn wait_accepting(&self) {
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("pgbouncer never listened: {}", self.log_text());
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn make_readable(dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
}

fn proxy_config(upstream: &Upstream, store_url: &str, statement_cache: bool) -> String {
    format!(
        "listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
upstream: {{ url: '{}', timeout: 5s }}
store: {{ url: '{store_url}', lease: 10s, timeout: 3s, pool_size: 4, prune_interval: 200ms, statement_cache: {statement_cache} }}
routes:
  - {{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}
",
        upstream.url()
    )
}

async fn deliver(proxy: &ProxyProcess, key: &str) -> TestResponse {
    let request = http::Request::post(format!("http://{}/hooks/orders", proxy.addr))
        .header("x-event-id", key)
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
        .unwrap();
    TestResponse::read(client().request(request).await.expect("proxy answers")).await
}

async fn scenario(statement_cache: bool) {
    let store = TestStore::new(Backend::Postgres).await;
    let bouncer = Bouncer::start(&store).await;
    let url = store.url_via(bouncer.addr);
    let upstream = Upstream::start().await;
    let config = proxy_config(&upstream, &url, statement_cache);

    // Two migrations at once, then two replicas migrating at start-up.
    let migrations: Vec<_> = (0..2)
        .map(|_| {
            let config = config.clone();
            std::thread::spawn(move || run(&["migrate"], Some(&config), &[]))
        })
        .collect();
    for migration in migrations {
        let out = migration.join().unwrap();
        assert_eq!(out.code, 0, "migrate: {}", out.stderr);
    }
    let replicas = Arc::new([
        ProxyProcess::start(&config).await,
        ProxyProcess::start(&config).await,
    ]);
    for replica in replicas.iter() {
        replica.wait_ready().await;
    }

    assert_eq!(deliver(&replicas[0], "evt_a").await.outcome(), "forwarded");
    assert_eq!(deliver(&replicas[1], "evt_a").await.outcome(), "duplicate");

    // Many keys at once, on every pooled connection.
    let deliveries: Vec<_> = (0..40)
        .map(|i| {
            let replicas = Arc::clone(&replicas);
            tokio::spawn(async move {
                let key = format!("evt_many_{i}");
                let first = deliver(&replicas[i % 2], &key).await;
                let again = deliver(&replicas[(i + 1) % 2], &key).await;
                (first.outcome().to_owned(), again.outcome().to_owned())
            })
        })
        .collect();
    for delivery in deliveries {
        let outcomes = delivery.await.unwrap();
        assert_eq!(outcomes, ("forwarded".into(), "duplicate".into()));
    }

    concurrent_identical_deliveries_are_forwarded_once(&replicas, &upstream).await;

    upstream.script("evt_fail", [Behavior::Status(500)]);
    let failed = deliver(&replicas[0], "evt_fail").await;
    assert_eq!((failed.status, failed.outcome()), (500, "forwarded"));
    let retried = deliver(&replicas[1], "evt_fail").await;
    assert_eq!((retried.status, retried.outcome()), (200, "forwarded"));
    assert_eq!(
        deliver(&replicas[0], "evt_fail").await.outcome(),
        "duplicate"
    );

    let listed = run(&["keys", "list", "--json"], Some(&config), &[]);
    assert_eq!(listed.code, 0, "keys list: {}", listed.stderr);
    assert!(listed.stdout.contains("evt_many_39"), "{}", listed.stdout);

    the_pruner_runs_without_store_errors(&replicas[0]).await;
    assert!(
        !bouncer.log_text().contains("ERROR"),
        "{}",
        bouncer.log_text()
    );

    let Ok(replicas) = Arc::try_unwrap(replicas) else {
        panic!("every delivery task has finished");
    };
    let mut switched = 0;
    for mut replica in replicas {
        replica.terminate();
        let lines = replica.all_log_lines().await;
        for line in lines
            .iter()
            .filter(|line| line.contains("named prepared statements do not survive"))
        {
            // The server's own words, not only "db error".
            assert!(line.contains("db error: ERROR: "), "{line}");
            switched += 1;
        }
    }
    let tracks_prepared_statements = pgbouncer_version() >= (1, 21);
    assert_eq!(
        switched > 0,
        statement_cache && !tracks_prepared_statements,
        "replicas that switched to unnamed statements: {switched}"
    );

    // With the replicas' pruners gone, `prune` holds the lock itself.
    let pruned = run(&["prune", "--older-than", "1ms"], Some(&config), &[]);
    assert_eq!(pruned.code, 0, "prune: {}", pruned.stderr);
    assert_eq!(pruned.stdout.trim(), "pruned 43 keys");
    let left: i64 = store
        .postgres()
        .await
        .query_one("SELECT count(*) FROM processed_events", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

async fn concurrent_identical_deliveries_are_forwarded_once(
    replicas: &Arc<[ProxyProcess; 2]>,
    upstream: &Upstream,
) {
    let gate = Gate::new();
    upstream.script("evt_same", [Behavior::Gate(Arc::clone(&gate))]);
    let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..16 {
        let (replicas, answers) = (Arc::clone(replicas), answers.clone());
        tokio::spawn(async move {
            let response = deliver(&replicas[i % 2], "evt_same").await;
            let _ = answers.send((response.status, response.outcome().to_owned()));
        });
    }
    // While the winner waits at the gate, every other delivery is answered.
    let mut outcomes = Vec::new();
    for _ in 0..15 {
        outcomes.push(answered.recv().await.unwrap());
    }
    gate.open();
    outcomes.push(answered.recv().await.unwrap());
    let in_flight = outcomes
        .iter()
        .filter(|answer| **answer == (409, "in-flight".to_owned()))
        .count();
    assert_eq!(in_flight, 15, "{outcomes:?}");
    assert_eq!(outcomes[15], (200, "forwarded".to_owned()));
    let forwarded = upstream
        .seen()
        .iter()
        .filter(|seen| seen.header("x-dedupe-key") == Some("evt_same"))
        .count();
    assert_eq!(forwarded, 1, "exactly once upstream");
}

/// The replica's background pruner runs, through the pooler, without a
/// store error.
async fn the_pruner_runs_without_store_errors(replica: &ProxyProcess) {
    for _ in 0..100 {
        let metrics = client()
            .get(format!("http://{}/metrics", replica.admin).parse().unwrap())
            .await
            .unwrap();
        let metrics = TestResponse::read(metrics).await.body;
        let exposition = crate::exposition::Exposition::parse(&metrics);
        assert_eq!(
            exposition.value("dedupe_store_errors_total", &[("op", "prune")]),
            Some(0.0),
            "{metrics}"
        );
        let rounds = exposition.value("dedupe_store_duration_seconds_count", &[("op", "prune")]);
        if rounds.is_some_and(|rounds| rounds > 0.0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the pruner never ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_in_transaction_mode_without_named_statements() {
    scenario(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_in_transaction_mode_with_named_statements() {
    scenario(true).await;
}

/// PgBouncer answers a statement past its `query_timeout` with its own
/// 08P01 error and closes the connection; the code is also one of those a
/// lost named statement gives, but this says nothing about named
/// statements, which a session-mode pooler keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poolers_own_fatal_error_keeps_named_statements() {
    let store = TestStore::new(Backend::Postgres).await;
    let bouncer = Bouncer::start_with(&store, "pool_mode = session\nquery_timeout = 1\n").await;
    let upstream = Upstream::start().await;
    let config = format!(
        "listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
upstream: {{ url: '{}', timeout: 5s }}
store: {{ url: '{}', lease: 20s, timeout: 10s, pool_size: 2 }}
routes:
  - {{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}
",
        upstream.url(),
        store.url_via(bouncer.addr)
    );
    let mut proxy = ProxyProcess::start(&config).await;
    proxy.wait_ready().await;
    assert_eq!(deliver(&proxy, "evt_before").await.outcome(), "forwarded");

    // A transaction inserting the key holds the proxy's claim of it past
    // PgBouncer's query_timeout.
    let mut holder = store.postgres().await;
    let holding = holder.transaction().await.unwrap();
    holding
        .execute(
            "INSERT INTO processed_events (source, event_id, status) VALUES ('orders', 'evt_held', 'processing')",
            &[],
        )
        .await
        .unwrap();
    let held = deliver(&proxy, "evt_held").await;
    assert_eq!(held.status, 503, "{held:?}");
    holding.rollback().await.unwrap();
    assert!(
        bouncer.log_text().contains("query timeout")
            || bouncer.log_text().contains("query_timeout"),
        "PgBouncer never timed the statement out: {}",
        bouncer.log_text()
    );

    assert_eq!(deliver(&proxy, "evt_after").await.outcome(), "forwarded");
    proxy.terminate();
    let lines = proxy.all_log_lines().await;
    assert!(
        !lines
            .iter()
            .any(|line| line.contains("named prepared statements do not survive")),
        "{lines:#?}"
    );
    // The claim's failure carries PgBouncer's reason, not only the closed
    // connection that followed it.
    assert!(
        lines
            .iter()
            .any(|line| line.contains("evt_held") && line.contains("query timeout")),
        "{lines:#?}"
    );
}
