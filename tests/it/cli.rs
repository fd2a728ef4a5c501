//! The binary: subcommands, exit codes, configuration errors, signals.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

use crate::support::{Backend, Behavior, TestResponse, TestStore, Upstream};

pub const BINARY: &str = env!("CARGO_BIN_EXE_dedupe-proxy");

/// One header-keyed route (`orders` on `/hooks/orders`) on `store_url` in
/// front of `upstream`, on free ports, with `extra` top-level settings.
pub fn process_config(upstream: &Upstream, store_url: &str, extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{extra}upstream: {{ url: '{}' }}\nstore: {{ url: '{store_url}' }}\nroutes: [{{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}]\n",
        upstream.url()
    )
}

/// Posts `body` to the `orders` route at `addr` under `key`.
pub async fn send_webhook(
    addr: std::net::SocketAddr,
    key: &str,
    body: String,
) -> Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error> {
    let request = http::Request::post(format!("http://{addr}/hooks/orders"))
        .header("x-event-id", key)
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    crate::support::client().request(request).await
}

/// [`send_webhook`], answered and read.
pub async fn post_webhook(addr: std::net::SocketAddr, key: &str, body: String) -> TestResponse {
    TestResponse::read(send_webhook(addr, key, body).await.expect("proxy answers")).await
}

/// The proxy binary, started with a configuration file.
pub struct ProxyProcess {
    pub addr: std::net::SocketAddr,
    pub admin: std::net::SocketAddr,
    child: Child,
    logs: tokio::sync::watch::Sender<Vec<String>>,
    drain: Option<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl ProxyProcess {
    /// Starts the binary and waits for its "serving" log line.
    pub async fn start(config: &str) -> Self {
        Self::start_with_log_filter(config, "info").await
    }

    /// Starts the binary with `RUST_LOG=filter`, keeping every stderr line.
    pub async fn start_with_log_filter(config: &str, filter: &str) -> Self {
        Self::launch(config, Some(filter), None).await
    }

    /// Starts the binary without `RUST_LOG`: the configuration's `log_level`
    /// filters.
    pub async fn start_with_configured_log_level(config: &str) -> Self {
        Self::launch(config, None, None).await
    }

    /// Starts the binary allowed at most `limit` open file descriptors.
    pub async fn start_with_fd_limit(config: &str, limit: u32) -> Self {
        Self::launch(config, Some("info"), Some(limit)).await
    }

    async fn launch(config: &str, filter: Option<&str>, fd_limit: Option<u32>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, config).unwrap();
        let mut command = match fd_limit {
            None => Command::new(BINARY),
            Some(limit) => {
                // prlimit sets the limit, then execs the binary in its place.
                let mut command = Command::new("prlimit");
                command.arg(format!("--nofile={limit}")).arg(BINARY);
                command
            }
        };
        match filter {
            Some(filter) => command.env("RUST_LOG", filter),
            None => command.env_remove("RUST_LOG"),
        };
        let mut child = command
            .args(["run", "--log-format", "json", "--config"])
            .arg(&path)
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the binary");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let logs = tokio::sync::watch::Sender::new(Vec::new());
        let serving = async {
            while let Some(line) = lines.next_line().await.unwrap() {
                logs.send_modify(|lines| lines.push(line.clone()));
                let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if event["message"] == "dedupe-proxy serving" {
                    return event;
                }
            }
            panic!("the binary exited before serving");
        };
        let event = tokio::time::timeout(Duration::from_secs(20), serving)
            .await
            .expect("serving line");
        // Keep draining stderr so the child never blocks on a full pipe.
        let collected = logs.clone();
        let drain = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                collected.send_modify(|lines| lines.push(line));
            }
        });
        let addr = |field: &str| event[field].as_str().unwrap().parse().unwrap();
        Self {
            addr: addr("listen"),
            admin: addr("admin_listen"),
            child,
            logs,
            drain: Some(drain),
            _dir: dir,
        }
    }

    /// Every line the process wrote to stderr, once it has exited.
    pub async fn all_log_lines(&mut self) -> Vec<String> {
        self.wait().await;
        if let Some(drain) = self.drain.take() {
            tokio::time::timeout(Duration::from_secs(10), drain)
                .await
                .expect("stderr closes when the process exits")
                .unwrap();
        }
        self.logs.borrow().clone()
    }

    pub async fn wait_ready(&self) {
        let client = crate::support::client();
        let uri: http::Uri = format!("http://{}/readyz", self.admin).parse().unwrap();
        let ready = async {
            loop {
                if client
                    .get(uri.clone())
                    .await
                    .is_ok_and(|response| response.status() == 200)
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), ready)
            .await
            .expect("binary ready");
    }

    /// SIGKILL: no shutdown path runs.
    pub async fn kill(&mut self) {
        self.child.kill().await.unwrap();
    }

    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends a signal by name (`TERM`, `HUP`, …).
    pub fn signal(&self, name: &str) {
        let pid = self.child.id().expect("running");
        let status = std::process::Command::new("kill")
            .args([format!("-{name}"), pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// How many of the process's threads are named `name`, from `/proc`.
    pub fn threads_named(&self, name: &str) -> usize {
        let pid = self.child.id().expect("running");
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .filter(|comm| comm.trim_end() == name)
            .count()
    }

    /// The process's resident memory, from `/proc`.
    pub fn resident_bytes(&self) -> u64 {
        let pid = self.child.id().expect("running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|value| value.trim().strip_suffix("kB"))
            .and_then(|value| value.trim().parse().ok())
            .expect("VmRSS in kB");
        kib * 1024
    }

    /// Waits for a log line containing `text`.
    pub async fn wait_for_log(&self, text: &str) {
        let mut logs = self.logs.subscribe();
        let seen = logs.wait_for(|lines| lines.iter().any(|line| line.contains(text)));
        tokio::time::timeout(Duration::from_secs(10), seen)
            .await
            .expect("log line")
            .unwrap();
    }

    pub async fn wait(&mut self) -> std::process::ExitStatus {
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("exits")
            .unwrap()
    }
}

/// What a finished run of the binary printed.
pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// Checks that stderr is one JSON log line at `level` whose message
    /// starts with `message`.
    fn assert_one_json_line(&self, level: &str, message: &str) {
        let line: serde_json::Value = serde_json::from_str(self.stderr.trim())
            .unwrap_or_else(|e| panic!("not one JSON object ({e}): {}", self.stderr));
        assert_eq!(line["level"], level, "{line}");
        assert!(
            line["message"].as_str().unwrap().starts_with(message),
            "{line}"
        );
    }
}

/// Runs the binary to completion, with `config` written to a file and
/// passed as `--config`.
pub fn run(args: &[&str], config: Option<&str>, env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let mut command = std::process::Command::new(BINARY);
    command
        .args(args)
        .env_remove("DEDUPE_CONFIG")
        .env_remove("DEDUPE_STORE_URL")
        .envs(env.iter().copied());
    if let Some(config) = config {
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, config).unwrap();
        command.arg("--config").arg(path);
    }
    let output = command.output().unwrap();
    Output {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

const VALID: &str = "store: { url: 'postgres://app:hunter2@127.0.0.1:1/db' }\nroutes: [{ name: orders, path: /hooks/orders, key: { header: X-Event-Id } }]\n";

#[test]
fn check_config_prints_the_effective_config_with_the_password_redacted() {
    let out = run(&["check-config"], Some(VALID), &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let printed: serde_yaml::Value = serde_yaml::from_str(&out.stdout).unwrap();
    assert_eq!(printed["store"]["lease"].as_str(), Some("5m"));
    assert_eq!(printed["routes"][0]["duplicate_status"].as_u64(), Some(200));
    assert_eq!(printed["routes"][0]["retention"].as_str(), Some("7d"));
    assert!(!out.stdout.contains("hunter2"), "{}", out.stdout);
    assert!(out.stdout.contains("REDACTED"));
}

/// What `check-config` prints checks the same: the same effective
/// configuration, and no warning the original did not get (a route that signs
/// no timestamp is printed with the default tolerance).
#[test]
fn check_config_output_checks_as_the_original_did() {
    let config = "routes:\n  - { name: gh, path: /gh, provider: github, secrets: [{ env: HOME }] }\n  - { name: orders, path: /hooks/orders, key: { header: X-Event-Id } }\n";
    let first = run(&["check-config"], Some(config), &[]);
    assert_eq!(first.code, 0, "{}", first.stderr);
    assert!(first.stdout.contains("tolerance: 5m"), "{}", first.stdout);
    let second = run(&["check-config"], Some(&first.stdout), &[]);
    assert_eq!(second.code, 0, "{}", second.stderr);
    assert_eq!(second.stdout, first.stdout);
    assert_eq!(second.stderr, first.stderr);
}

/// Every default SPEC section 5 names, as check-config prints them for a
/// configuration that sets nothing but one route.
#[test]
fn check_config_fills_in_every_default() {
    let config = "routes: [{ name: orders, path: /hooks/orders, key: { header: X-Event-Id } }]\n";
    let out = run(&["check-config"], Some(config), &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let printed: serde_yaml::Value = serde_yaml::from_str(&out.stdout).unwrap();
    let expected: serde_yaml::Value = serde_yaml::from_str(
        "
listen: 0.0.0.0:8080
admin_listen: 127.0.0.1:9090
upstream: { url: 'http://127.0.0.1:3000', timeout: 30s, connect_timeout: 2s }
store:
  url: sqlite://dedupe.db
  table: processed_events
  lease: 5m
  retention: 7d
  prune_interval: 10m
  pool_size: 16
  on_unavailable: reject
  timeout: 2s
  retry_after: 5s
  migrate: true
  statement_cache: true
log_level: info
limits:
  max_body_bytes: 1048576
  max_key_bytes: 256
  max_concurrent_requests: 1024
  max_buffered_body_bytes: 67108864
  header_read_timeout: 30s
  body_read_timeout: 30s
shutdown_grace: 25s
defaults:
  done_on: [2xx]
  duplicate_status: 200
  in_flight_status: 409
  in_flight_retry_after: 5s
  on_missing_key: reject
  on_payload_mismatch: warn
unmatched: forward
",
    )
    .unwrap();
    let mut route = printed["routes"][0].clone();
    let route = route.as_mapping_mut().unwrap();
    for (field, value) in expected["defaults"].as_mapping().unwrap() {
        assert_eq!(route.remove(field).as_ref(), Some(value), "{field:?}");
    }
    let own: serde_yaml::Value = serde_yaml::from_str(
        "{ name: orders, path: /hooks/orders, methods: [POST], key: { header: X-Event-Id },
           tolerance: 5m, mode: enforce, retention: 7d }",
    )
    .unwrap();
    assert_eq!(&serde_yaml::Value::from(route.clone()), &own);
    let mut printed = printed;
    printed.as_mapping_mut().unwrap().remove("routes");
    assert_eq!(printed, expected, "{}", out.stdout);
}

#[test]
fn check_config_redacts_a_password_holding_url_delimiters() {
    let config = "store: { url: 'postgres://app:s3/cr?t@127.0.0.1:1/db' }\nroutes: [{ name: orders, path: /hooks/orders, key: { header: X-Event-Id } }]\n";
    let out = run(&["check-config"], Some(config), &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!out.stdout.contains("s3/cr"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("postgres://app:REDACTED@127.0.0.1:1/db"),
        "{}",
        out.stdout
    );
}

#[test]
fn check_config_prints_warnings_whatever_the_log_level() {
    let config = "log_level: error\nroutes: [{ name: gh, path: /gh, provider: github }]\n";
    let out = run(&["check-config"], Some(config), &[("RUST_LOG", "off")]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("warning: routes[0] (gh) (line 2): provider github without secrets"),
        "{}",
        out.stderr
    );
    assert!(!out.stdout.contains("warning"), "stdout stays YAML");
    // In the JSON format, as every other line on stderr is.
    let json = run(
        &["check-config", "--log-format", "json"],
        Some(config),
        &[("RUST_LOG", "off")],
    );
    assert_eq!(json.code, 0, "{}", json.stderr);
    json.assert_one_json_line(
        "WARN",
        "routes[0] (gh) (line 2): provider github without secrets",
    );
}

/// A SQLite file moved away from under a running proxy leaves its
/// write-ahead log at the path, holding the latest writes: no command makes
/// a new database there, which would discard the log, and none suggests
/// `migrate`.
#[test]
fn a_write_ahead_log_without_its_database_is_not_discarded() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("moved.db");
    let log = dir.path().join("moved.db-wal");
    std::fs::write(&log, b"the latest writes").unwrap();
    let config = format!(
        "store: {{ url: 'sqlite://{}' }}\nroutes: [{{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}]\n",
        db.display()
    );
    for command in [&["migrate"][..], &["keys", "list"], &["prune"]] {
        let out = run(command, Some(&config), &[]);
        assert_eq!(out.code, 1, "{command:?}: {}", out.stderr);
        assert!(
            out.stderr.contains("but its write-ahead log")
                && out.stderr.contains("put the file back")
                && !out.stderr.contains("dedupe-proxy migrate"),
            "{command:?}: {}",
            out.stderr
        );
    }
    assert!(!db.exists(), "no new database was made");
    assert_eq!(std::fs::read(&log).unwrap(), b"the latest writes");
}

/// An `https://` upstream without `upstream.ca_file`, on a system without
/// a CA bundle (a bare image), is refused by `check-config` as by `run`,
/// as a configuration error.
#[test]
fn an_https_upstream_needs_roots_to_verify_it_against() {
    let config = "upstream: { url: 'https://app.internal:8443' }\nroutes: [{ name: orders, path: /hooks/orders, key: { header: X-Event-Id } }]\n";
    let no_bundle = [
        ("SSL_CERT_FILE", "/nonexistent"),
        ("SSL_CERT_DIR", "/nonexistent"),
    ];
    for command in ["check-config", "run"] {
        let out = run(&[command], Some(config), &no_bundle);
        assert_eq!(out.code, 2, "{command}: {}", out.stderr);
        assert!(
            out.stderr.contains(
                "upstream.ca_file is not set and the system has no trusted root certificates"
            ),
            "{command}: {}",
            out.stderr
        );
    }
}

/// An error in the arguments themselves is, under `--log-format json`, the
/// one JSON line any other fatal error is; clap's own text otherwise.
#[test]
fn usage_errors_follow_the_log_format() {
    for args in [
        &["--log-format", "json", "keys", "list", "--status", "bogus"][..],
        &["keys", "list", "--status", "bogus", "--log-format=json"],
    ] {
        let out = run(args, Some(VALID), &[]);
        assert_eq!(out.code, 2, "{}", out.stderr);
        out.assert_one_json_line("ERROR", "invalid value 'bogus' for '--status <STATUS>'");
    }
    let text = run(&["keys", "list", "--status", "bogus"], Some(VALID), &[]);
    assert_eq!(text.code, 2);
    assert!(
        text.stderr
            .starts_with("error: invalid value 'bogus' for '--status <STATUS>'"),
        "{}",
        text.stderr
    );
}

#[test]
fn configuration_errors_exit_2_naming_the_field() {
    let unknown = run(&["check-config"], Some("store: { lease_time: 5m }\n"), &[]);
    assert_eq!(unknown.code, 2);
    assert!(
        unknown.stderr.contains("lease_time") && unknown.stderr.contains("line"),
        "{}",
        unknown.stderr
    );
    let invalid = run(
        &["check-config"],
        Some("store: { lease: 10s }\nupstream: { timeout: 30s }\n"),
        &[],
    );
    assert_eq!(invalid.code, 2);
    assert!(
        invalid
            .stderr
            .contains("store.lease (line 1): 10s must exceed"),
        "{}",
        invalid.stderr
    );
    let route = run(
        &["check-config"],
        Some("routes:\n  - name: a\n    path: hooks/a\n    key: { header: X-Id }\n"),
        &[],
    );
    assert_eq!(route.code, 2);
    assert!(
        route
            .stderr
            .contains("routes[0] (a).path (line 3): must start with `/`"),
        "{}",
        route.stderr
    );
    let missing = run(&["check-config"], None, &[]);
    assert_eq!(missing.code, 2);
    assert!(missing.stderr.contains("--config"), "{}", missing.stderr);
    let unreadable = run(
        &["check-config", "--config", "/nonexistent/dedupe.yaml"],
        None,
        &[],
    );
    assert_eq!(unreadable.code, 2);
    let usage = run(&["no-such-command"], Some(VALID), &[]);
    assert_eq!(usage.code, 2);
}

#[test]
fn config_may_come_from_the_environment_and_follow_the_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.yaml");
    std::fs::write(&path, VALID).unwrap();
    let path = path.to_str().unwrap();
    let from_env = run(
        &["check-config"],
        None,
        &[
            ("DEDUPE_CONFIG", path),
            ("DEDUPE_STORE_URL", "sqlite://override.db"),
        ],
    );
    assert_eq!(from_env.code, 0, "{}", from_env.stderr);
    assert!(
        from_env.stdout.contains("sqlite://override.db"),
        "{}",
        from_env.stdout
    );
    let before = run(&["--config", path, "check-config"], None, &[]);
    assert_eq!(before.code, 0, "{}", before.stderr);
    // Set from an unset variable, it means no file.
    let empty = run(&["check-config"], None, &[("DEDUPE_CONFIG", "")]);
    assert_eq!(
        (empty.code, empty.stderr.as_str()),
        (
            2,
            "error: no configuration: pass --config FILE or set DEDUPE_CONFIG\n"
        )
    );
    let given = run(
        &["check-config", "--config", path],
        None,
        &[("DEDUPE_CONFIG", "")],
    );
    assert_eq!(given.code, 0, "{}", given.stderr);
    // A bad overriding URL is not placed on the file's line: it is said to
    // come from the environment.
    let bad = run(
        &["check-config"],
        None,
        &[("DEDUPE_CONFIG", path), ("DEDUPE_STORE_URL", "mysql://x")],
    );
    assert_eq!(bad.code, 2);
    assert!(
        bad.stderr
            .contains("store.url (from DEDUPE_STORE_URL): `mysql://x`"),
        "{}",
        bad.stderr
    );
}

#[test]
fn check_config_connect_fails_when_the_store_is_unreachable() {
    let out = run(&["check-config", "--connect"], Some(VALID), &[]);
    assert_eq!(out.code, 1, "{}", out.stderr);
    let error = out.stderr.lines().last().unwrap_or_default();
    assert!(
        error.contains("cannot connect to PostgreSQL at 127.0.0.1:1/db: "),
        "names the server: {error}"
    );
    assert!(
        !out.stderr.contains("hunter2") && !out.stderr.contains("app@"),
        "not who connects, nor with what: {}",
        out.stderr
    );
    let words: Vec<&str> = error.split(": ").collect();
    let mut deduplicated = words.clone();
    deduplicated.dedup();
    assert_eq!(words, deduplicated, "each cause once: {error}");
}

#[test]
fn check_config_connect_reports_a_missing_table_without_failing() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("fresh.db").display());
    let config = format!(
        "store: {{ url: '{url}' }}\nroutes: [{{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}]\n"
    );
    let out = run(&["check-config", "--connect"], Some(&config), &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!(
            "store: there is no SQLite file at {} yet",
            dir.path().join("fresh.db").display()
        )),
        "{}",
        out.stderr
    );
    assert!(
        !dir.path().join("fresh.db").exists(),
        "the check created the file"
    );
    // An empty file is an empty database.
    std::fs::write(dir.path().join("fresh.db"), "").unwrap();
    let out = run(&["check-config", "--connect"], Some(&config), &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr
            .contains("the claims table `processed_events` does not exist yet"),
        "{}",
        out.stderr
    );
    std::fs::remove_file(dir.path().join("fresh.db")).unwrap();
    let missing_dir = format!("sqlite://{}", dir.path().join("typo/fresh.db").display());
    std::fs::write(dir.path().join("a-file"), "").unwrap();
    let file_as_dir = format!("sqlite://{}", dir.path().join("a-file/fresh.db").display());
    for (unusable, error) in [
        (missing_dir.as_str(), "typo does not exist"),
        (file_as_dir.as_str(), "a-file is not a directory"),
        // Nobody may create a file in /sys, root included.
        ("sqlite:///sys/fresh.db", "cannot open /sys/fresh.db: "),
    ] {
        let config = config.replace(&url, unusable);
        let out = run(&["check-config", "--connect"], Some(&config), &[]);
        assert_eq!(out.code, 1, "{unusable}: {}", out.stderr);
        assert!(out.stderr.contains(error), "{unusable}: {}", out.stderr);
    }
}

/// Of several `migrate` runs at once on a new store, one creates the table
/// and says so; the others find it made, whether they spell the table with
/// its schema or without.
#[tokio::test]
async fn of_concurrent_migrations_only_the_one_that_created_the_table_says_so() {
    for backend in [Backend::Postgres, Backend::Sqlite] {
        let store = TestStore::new(backend).await;
        let dir = tempfile::tempdir().unwrap();
        let table = match backend {
            Backend::Postgres => ["processed_events", "public.processed_events"],
            Backend::Sqlite => ["processed_events"; 2],
        };
        let paths = table.map(|table| {
            let path = dir.path().join(format!("{table}.yaml"));
            let config = format!("store: {{ url: '{}', table: {table} }}\n", store.url);
            std::fs::write(&path, config).unwrap();
            path
        });
        let runs: Vec<_> = (0..4)
            .map(|run| {
                std::process::Command::new(BINARY)
                    .args(["migrate", "--config"])
                    .arg(&paths[run % 2])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let said: Vec<String> = runs
            .into_iter()
            .map(|run| {
                let out = run.wait_with_output().unwrap();
                assert!(out.status.success(), "{backend:?}: {out:?}");
                String::from_utf8_lossy(&out.stdout).into_owned()
            })
            .collect();
        let created = said
            .iter()
            .filter(|stdout| stdout.contains("created the claims table"))
            .count();
        assert_eq!(created, 1, "{backend:?}: {said:?}");
        assert_eq!(
            said.iter()
                .filter(|stdout| stdout.contains("schema is up to date"))
                .count(),
            3,
            "{backend:?}: {said:?}"
        );
    }
}

#[tokio::test]
async fn migrate_creates_the_schema() {
    let store = TestStore::new(Backend::Postgres).await;
    // Named as the statements name it: `store.table` is case-insensitive.
    let out = run(
        &["migrate"],
        Some(&format!(
            "store: {{ url: '{}', table: My_Events }}\n",
            store.url
        )),
        &[],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    let client = store.postgres().await;
    let columns: Vec<String> = client
        .query("SELECT column_name::text FROM information_schema.columns WHERE table_name = 'my_events' ORDER BY ordinal_position", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        columns,
        [
            "source",
            "event_id",
            "status",
            "attempts",
            "payload_sha256",
            "response_status",
            "received_at",
            "claimed_at",
            "lease_expires_at",
            "completed_at"
        ]
    );
    let index: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE indexname = 'my_events_received_at_idx'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(index, 1);
    assert!(
        out.stdout.contains("created the claims table `my_events`"),
        "{}",
        out.stdout
    );
    let again = run(
        &["migrate"],
        Some(&format!(
            "store: {{ url: '{}', table: my_events }}\n",
            store.url
        )),
        &[],
    );
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(
        (again.stdout.as_str(), again.stderr.as_str()),
        ("store: schema is up to date\n", "")
    );
}

/// A `store.table` naming some other table is refused by name, by the
/// commands that check the store, before anything is claimed in it.
#[tokio::test]
async fn a_table_that_is_not_a_claims_table_is_named_as_such() {
    for backend in [Backend::Postgres, Backend::Sqlite] {
        let store = TestStore::new(backend).await;
        crate::rows::batch(&store, "CREATE TABLE orders (id integer)").await;
        let config = format!("store: {{ url: '{}', table: orders }}\n", store.url);
        for command in [
            &["migrate"][..],
            &["check-config", "--connect"],
            &["keys", "list"],
            &["keys", "show", "orders", "k"],
            &["prune"],
        ] {
            let out = run(command, Some(&config), &[]);
            assert_eq!(out.code, 1, "{backend:?} {command:?}: {}", out.stderr);
            assert!(
                out.stderr
                    .contains("the table `orders` is not a dedupe-proxy claims table"),
                "{backend:?} {command:?}: {}",
                out.stderr
            );
            assert!(
                !out.stderr.contains("NOTICE"),
                "{backend:?} {command:?}: {}",
                out.stderr
            );
        }
    }
}

/// `migrate`, `check-config --connect`, `keys list` and `prune` each exit 1
/// naming why `processed_events` is not a claims table.
fn every_command_refuses_the_claims_table(config: &str, why: &str) {
    for command in [
        &["migrate"][..],
        &["check-config", "--connect"],
        &["keys", "list"],
        &["prune"],
    ] {
        let out = run(command, Some(config), &[]);
        assert_eq!(out.code, 1, "{command:?}: {}", out.stderr);
        assert!(
            out.stderr.contains(&format!(
                "the table `processed_events` is not a dedupe-proxy claims table ({why})"
            )),
            "{command:?}: {}",
            out.stderr
        );
    }
}

/// On SQLite too: a table with every column but no key for the claims'
/// `ON CONFLICT`, or a view, was taken for the claims table, and every
/// webhook was then answered 503 while `/readyz` said ready.
#[tokio::test]
async fn an_sqlite_claims_table_without_its_key_or_a_view_is_refused_naming_why() {
    let store = TestStore::new(Backend::Sqlite).await;
    let config = format!("store: {{ url: '{}' }}\n", store.url);
    let create = |key: &str| {
        format!(
            "DROP TABLE IF EXISTS processed_events;
             CREATE TABLE processed_events (
               source TEXT NOT NULL, event_id TEXT NOT NULL, status TEXT NOT NULL,
               attempts INTEGER NOT NULL DEFAULT 1, payload_sha256 BLOB, response_status INTEGER,
               received_at INTEGER NOT NULL, claimed_at INTEGER NOT NULL,
               lease_expires_at INTEGER, completed_at INTEGER{key});"
        )
    };
    for (sql, why) in [
        (
            create(""),
            "no primary key or unique index on (source, event_id)",
        ),
        (
            format!(
                "{} CREATE UNIQUE INDEX only_some ON processed_events (event_id, source) WHERE status <> 'done';",
                create("")
            ),
            "no primary key or unique index on (source, event_id)",
        ),
        (
            format!(
                "{} ALTER TABLE processed_events RENAME TO claims_kept;
                 CREATE VIEW processed_events AS SELECT * FROM claims_kept;",
                create(", PRIMARY KEY (source, event_id)")
            ),
            "it is a view",
        ),
    ] {
        crate::rows::batch(&store, &sql).await;
        every_command_refuses_the_claims_table(&config, why);
    }
    // A unique index on the two columns, in either order, does as well.
    crate::rows::batch(
        &store,
        &format!(
            "DROP VIEW processed_events; DROP TABLE claims_kept; {} CREATE UNIQUE INDEX claims_key ON processed_events (event_id, source);",
            create("")
        ),
    )
    .await;
    let out = run(&["migrate"], Some(&config), &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
}

/// A table with the claims table's columns but other types, or without its
/// primary key, would fail every claim (or, for a type, every decode): it is
/// refused by name before anything is written, by every command (and by
/// `/readyz`, which runs the same check).
#[tokio::test]
async fn a_claims_table_of_other_types_or_without_its_key_is_refused_naming_why() {
    let store = TestStore::new(Backend::Postgres).await;
    let config = format!("store: {{ url: '{}' }}\n", store.url);
    let create = |attempts: &str, key: &str| {
        format!(
            "DROP TABLE IF EXISTS processed_events;
             CREATE TABLE processed_events (
               source text NOT NULL, event_id text NOT NULL, status text NOT NULL,
               attempts {attempts} NOT NULL DEFAULT 1, payload_sha256 bytea, response_status smallint,
               received_at timestamptz NOT NULL DEFAULT now(), claimed_at timestamptz NOT NULL DEFAULT now(),
               lease_expires_at timestamptz, completed_at timestamptz{key});"
        )
    };
    for (sql, why) in [
        (
            create("bigint", ", PRIMARY KEY (source, event_id)"),
            "column attempts is bigint, not integer",
        ),
        (
            create("integer", ""),
            "no primary key or unique index on (source, event_id)",
        ),
        (
            create("integer", ", PRIMARY KEY (source, event_id)").replace(
                "received_at timestamptz NOT NULL",
                "received_at timestamptz",
            ),
            "column received_at may be NULL, where it must be NOT NULL",
        ),
        (
            format!(
                "{} ALTER TABLE processed_events RENAME TO claims_kept;
                 CREATE VIEW processed_events AS SELECT * FROM claims_kept;",
                create("integer", ", PRIMARY KEY (source, event_id)")
            ),
            "it is a view",
        ),
    ] {
        crate::rows::batch(&store, &sql).await;
        every_command_refuses_the_claims_table(&config, why);
    }
    // A unique index on the two columns, in either order, does as well, and
    // other columns a claim can leave out; the index the pruner reads is
    // added.
    crate::rows::batch(
        &store,
        &format!(
            "DROP VIEW processed_events; {}",
            create(
                "integer",
                ", note text, tenant text NOT NULL DEFAULT 'a', \
                 serial_no integer GENERATED ALWAYS AS IDENTITY, UNIQUE (event_id, source)"
            )
        ),
    )
    .await;
    let out = run(&["migrate"], Some(&config), &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains("created the received_at index of the claims table `processed_events`"),
        "{}",
        out.stdout
    );
}

/// A server that takes no writes (a hot standby; here one read-only by a
/// session default) would take the connection and refuse every claim: it is
/// passed over as it is connected to, unless the URL asks for any server.
#[tokio::test]
async fn a_server_that_takes_no_writes_is_refused_unless_the_url_says_any() {
    let store = TestStore::new(Backend::Postgres).await;
    let read_only = format!(
        "{}?options=-c%20default_transaction_read_only%3Don",
        store.url
    );
    let config = |url: &str| format!("store: {{ url: '{url}' }}\n");
    let out = run(
        &["check-config", "--connect"],
        Some(&config(&read_only)),
        &[],
    );
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains(
            "database does not allow writes (a standby, or a server read-only by default"
        ),
        "{}",
        out.stderr
    );
    let any = format!("{read_only}&target_session_attrs=any");
    let out = run(&["check-config", "--connect"], Some(&config(&any)), &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
}

/// A lock held on the table does not hang `migrate`: with the schema in
/// place it reads only the catalog, and what it must create waits at most
/// `store.timeout`.
#[tokio::test]
async fn migrate_under_a_held_table_lock_finishes_or_fails_within_the_store_timeout() {
    let store = TestStore::new(Backend::Postgres).await;
    let config = format!("store: {{ url: '{}', timeout: 300ms }}\n", store.url);
    assert_eq!(run(&["migrate"], Some(&config), &[]).code, 0);
    let holder = store.postgres().await;
    let lock = "BEGIN; LOCK TABLE processed_events IN ACCESS EXCLUSIVE MODE";
    holder.batch_execute(lock).await.unwrap();
    let out = run(&["migrate"], Some(&config), &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    holder
        .batch_execute("ROLLBACK; DROP INDEX processed_events_received_at_idx")
        .await
        .unwrap();
    holder.batch_execute(lock).await.unwrap();
    let out = run(&["migrate"], Some(&config), &[]);
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(out.stderr.contains("lock timeout"), "{}", out.stderr);
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(run(&["migrate"], Some(&config), &[]).code, 0);
}

#[test]
fn migrate_against_an_unreachable_store_exits_1() {
    let out = run(
        &["migrate"],
        Some("store: { url: 'postgres://postgres@127.0.0.1:1/db', timeout: 500ms }\n"),
        &[],
    );
    assert_eq!(out.code, 1, "{}", out.stderr);
}

#[test]
fn an_unopenable_sqlite_file_stops_start_up_with_exit_1_naming_it_once() {
    let out = run(
        &["run"],
        Some(
            "store: { url: 'sqlite:///nonexistent-dir/keys.db' }\nlisten: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n",
        ),
        &[],
    );
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert_eq!(
        out.stderr.matches("cannot open the store").count(),
        1,
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("/nonexistent-dir/keys.db: the directory /nonexistent-dir does not exist"),
        "{}",
        out.stderr
    );
}

/// The store's commands name a relative SQLite path they cannot open by its
/// full path: it is read from the working directory, easy to get wrong.
#[test]
fn a_relative_sqlite_path_in_a_missing_directory_is_named_in_full() {
    let full = std::env::current_dir().unwrap().join("no-such-dir-7f3a");
    let config = "store: { url: 'sqlite://no-such-dir-7f3a/keys.db' }\nlisten: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n";
    for command in [&["keys", "list"][..], &["run"]] {
        let out = run(command, Some(config), &[]);
        assert_eq!(out.code, 1, "{command:?}: {}", out.stderr);
        assert!(
            out.stderr.contains(&format!(
                "cannot open {}/keys.db: the directory {} does not exist",
                full.display(),
                full.display()
            )),
            "{command:?}: {}",
            out.stderr
        );
    }
}

/// SQLite says only "unable to open database file"; the proxy says why.
#[test]
fn an_sqlite_path_that_cannot_be_a_database_file_is_explained() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a-file"), "").unwrap();
    for (path, why) in [
        (dir.path().to_owned(), "it is a directory"),
        (
            dir.path().join("a-file/keys.db"),
            "a-file is not a directory",
        ),
    ] {
        let config = format!("store: {{ url: 'sqlite://{}' }}\n", path.display());
        let out = run(&["migrate"], Some(&config), &[]);
        assert_eq!(out.code, 1, "{}", out.stderr);
        let explained = out.stderr.lines().last().unwrap_or_default();
        assert!(
            explained.contains(&format!("cannot open {}: ", path.display()))
                && explained.ends_with(why),
            "{}",
            out.stderr
        );
    }
}

#[test]
fn a_sqlite_url_that_is_not_a_file_path_is_a_configuration_error() {
    for url in ["sqlite://:memory:", "sqlite://keys.db?mode=rwc"] {
        let config = format!("store: {{ url: '{url}' }}\n");
        let out = run(&["check-config"], Some(&config), &[]);
        assert_eq!(out.code, 2, "{url}: {}", out.stderr);
        assert!(out.stderr.contains("store.url"), "{}", out.stderr);
    }
}

#[tokio::test]
async fn sigterm_stops_the_binary_with_exit_code_0() {
    let store = TestStore::new(Backend::Sqlite).await;
    let mut proxy = ProxyProcess::start(&format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nstore: {{ url: '{}' }}\n",
        store.url
    ))
    .await;
    proxy.wait_ready().await;
    proxy.terminate();
    assert_eq!(proxy.wait().await.code(), Some(0));
}

/// Requests still in flight on several serving threads at the end of the
/// grace period are reported once, not once per thread.
#[tokio::test]
async fn a_grace_period_cut_short_is_logged_once() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    let keys: Vec<String> = (0..4).map(|n| format!("evt_slow_{n}")).collect();
    for key in &keys {
        upstream.script(key, [Behavior::Hang]);
    }
    let config = process_config(&upstream, &store.url, "shutdown_grace: 200ms\n");
    let mut proxy = ProxyProcess::start(&config).await;
    proxy.wait_ready().await;
    let addr = proxy.addr;
    for key in keys.clone() {
        // A client each: one connection each, spread over the threads.
        tokio::spawn(async move { send_webhook(addr, &key, "{}".into()).await });
    }
    upstream.wait_for(keys.len()).await;
    proxy.terminate();
    let lines = proxy.all_log_lines().await;
    let reports = lines
        .iter()
        .filter(|line| line.contains("grace period ended with requests still in flight"))
        .count();
    assert_eq!(reports, 1, "{lines:#?}");
}

/// SIGHUP's default action would end the process at once, skipping the drain
/// and the final settles; without a TLS listener there is nothing to reload.
#[tokio::test]
async fn sighup_without_tls_is_logged_and_the_proxy_keeps_serving() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    let mut proxy = ProxyProcess::start(&format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nupstream: {{ url: '{}' }}\nstore: {{ url: '{}' }}\n",
        upstream.url(),
        store.url
    ))
    .await;
    proxy.wait_ready().await;
    proxy.signal("HUP");
    proxy.wait_for_log("SIGHUP: no TLS listener").await;
    let answer = get_status(proxy.addr).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    proxy.terminate();
    assert_eq!(proxy.wait().await.code(), Some(0));
}

/// Out of file descriptors, the proxy pauses accepting instead of retrying
/// at once, and serves again as soon as connections close.
#[tokio::test]
async fn out_of_file_descriptors_the_proxy_pauses_accepting_and_recovers() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    // Enough to start (each serving thread's runtime takes a few) and little
    // enough to run out of with connections.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let limit = 48 + 4 * u32::try_from(cores).unwrap();
    let proxy = ProxyProcess::start_with_fd_limit(
        &format!(
            "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nupstream: {{ url: '{}' }}\nstore: {{ url: '{}' }}\n",
            upstream.url(),
            store.url
        ),
        limit,
    )
    .await;
    proxy.wait_ready().await;
    let mut held = Vec::new();
    for _ in 0..limit {
        held.push(TcpStream::connect(proxy.addr).await.unwrap());
    }
    proxy.wait_for_log("accept failed").await;
    drop(held);
    let served = async {
        loop {
            if get_status(proxy.addr).await.starts_with("HTTP/1.1 200") {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), served)
        .await
        .expect("served again once descriptors were free");
    assert!(upstream.count() >= 1);
}

/// An unmatched `GET /status` on a connection of its own: the raw answer,
/// or what arrived of it before the connection closed.
async fn get_status(addr: std::net::SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /status HTTP/1.1\r\nhost: app\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer).await;
    answer
}

/// A SIGHUP during start-up (a configuration reloader signalling every
/// process as a pod starts) does not end the process. Here start-up waits
/// for the SQLite file's write lock, which another process holds, and ends
/// as it would have without the signal: exit 1, naming the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_during_start_up_does_not_end_the_process() {
    let store = TestStore::new(Backend::Sqlite).await;
    let holder = rusqlite::Connection::open(store.url.strip_prefix("sqlite://").unwrap()).unwrap();
    holder.execute_batch("BEGIN IMMEDIATE").unwrap();
    let upstream = Upstream::start().await;
    let config = process_config(&upstream, &store.url, "").replace(
        &format!("url: '{}' }}", store.url),
        &format!("url: '{}', timeout: 5s }}", store.url),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, config).unwrap();
    let child = Command::new(BINARY)
        .args(["run", "--config"])
        .arg(&path)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    // Start-up has begun once the process catches SIGTERM (bit 14 of
    // `SigCgt`); it catches SIGHUP (bit 0) from then on, or never.
    let caught = || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let mask = status
            .lines()
            .find_map(|line| line.strip_prefix("SigCgt:"))?;
        u64::from_str_radix(mask.trim(), 16).ok()
    };
    let started = async {
        while caught().is_none_or(|mask| mask & (1 << 14) == 0) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), started)
        .await
        .expect("start-up begins");
    let status = std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let ended = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&ended.stderr);
    assert_eq!(ended.status.code(), Some(1), "{:?}: {stderr}", ended.status);
    assert!(stderr.contains("database is locked"), "{stderr}");
    holder.execute_batch("ROLLBACK").unwrap();
}
