//! The monitoring files against the real thing: a real Prometheus scrapes the
//! proxy with the shipped scrape configuration (deploy/prometheus/prometheus.yml,
//! its target rewritten to the test's admin address) and evaluates the shipped
//! alert rules; every query of the Grafana dashboard runs; `promtool check
//! metrics` accepts the live exposition. Both tools come from Debian's
//! `prometheus` package; without it these tests fail, they never skip.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, Command};

use crate::support::{Backend, TestApp, TestResponse, client};

const SCRAPE_CONFIG: &str = include_str!("../../deploy/prometheus/prometheus.yml");
const ALERT_RULES: &str = include_str!("../../deploy/prometheus/alerts.yml");
const DASHBOARD: &str = include_str!("../../deploy/grafana/dedupe-proxy.json");
/// The job of the shipped scrape configuration that the test keeps.
const JOB: &str = "dedupe-proxy";
/// The longest wait for any one thing Prometheus is expected to do.
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_proxy_with_the_shipped_configuration() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    deliver_some_webhooks(&app).await;
    let mut prometheus = Prometheus::start(app.admin).await;

    let series = prometheus
        .query_until("dedupe_requests_total > 0", |series| series.len() >= 4)
        .await;
    let instance = app.admin.to_string();
    let mut seen: Vec<String> = series
        .iter()
        .map(|s| {
            let label = |name: &str| s["metric"][name].as_str().unwrap_or_default().to_string();
            assert_eq!(label("job"), JOB, "{s}");
            assert_eq!(label("instance"), instance, "{s}");
            let value = s["value"][1].as_str().unwrap_or_default();
            format!("{} {} {value}", label("route"), label("outcome"))
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            "json forwarded 1",
            "orders duplicate 1",
            "orders forwarded 2",
            "orders rejected_missing_key 1",
        ]
    );

    let up = prometheus
        .query_until(&format!("up{{job=\"{JOB}\"}}"), |s| !s.is_empty())
        .await;
    assert_eq!(up[0]["value"][1], "1", "{up:?}");

    prometheus.wait_for_healthy_alert_rules().await;
    prometheus.run_dashboard_queries(app.admin).await;
    prometheus.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_live_exposition() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    deliver_some_webhooks(&app).await;
    let metrics = app.admin_get("/metrics").await;
    assert_eq!(metrics.status, 200);
    assert!(
        metrics.body.contains("dedupe_requests_total{"),
        "{}",
        metrics.body
    );

    let mut promtool = Command::new(tool("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start promtool");
    let mut stdin = promtool.stdin.take().expect("stdin");
    stdin.write_all(metrics.body.as_bytes()).await.unwrap();
    drop(stdin);
    let output = tokio::time::timeout(Duration::from_secs(30), promtool.wait_with_output())
        .await
        .expect("promtool finishes")
        .expect("promtool runs");
    assert!(
        output.status.success(),
        "promtool check metrics: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Two forwarded and one duplicate delivery on `orders`, one without a key,
/// and one forwarded on the JSON-keyed route.
async fn deliver_some_webhooks(app: &TestApp) {
    assert_eq!(app.deliver("evt-1", "{}").await.outcome(), "forwarded");
    assert_eq!(app.deliver("evt-1", "{}").await.outcome(), "duplicate");
    assert_eq!(app.deliver("evt-2", "{}").await.outcome(), "forwarded");
    assert_eq!(app.post("/hooks/orders", &[], "{}").await.status, 400);
    let json = app.post("/hooks/json", &[], r#"{"id":"j-1"}"#).await;
    assert_eq!(json.outcome(), "forwarded");
}

/// The path of an installed tool, or a failure that says how to install it.
fn tool(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(name))
                .find(|path| path.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "`{name}` is not installed, and these tests run the real Prometheus tools: \
                 install them with `apt-get install prometheus` (scripts/test does so when \
                 they are missing)"
            )
        })
}

/// The shipped configuration reduced to the proxy's job, scraping `admin`
/// every second and evaluating the rules every second.
fn scrape_config(admin: SocketAddr) -> String {
    use serde_yaml::Value as Yaml;
    let mut config: Yaml = serde_yaml::from_str(SCRAPE_CONFIG).expect("prometheus.yml parses");
    let rule_files = config["rule_files"].as_sequence().expect("rule_files");
    assert!(
        rule_files
            .iter()
            .any(|file| file.as_str() == Some("alerts.yml")),
        "prometheus.yml loads alerts.yml"
    );
    let mut job = config["scrape_configs"]
        .as_sequence()
        .expect("scrape_configs")
        .iter()
        .find(|job| job["job_name"].as_str() == Some(JOB))
        .cloned()
        .unwrap_or_else(|| panic!("prometheus.yml has no `{JOB}` job"));
    assert_eq!(job["metrics_path"].as_str(), Some("/metrics"));
    job["static_configs"] = serde_yaml::from_str(&format!("[{{ targets: ['{admin}'] }}]")).unwrap();
    job["scrape_interval"] = Yaml::from("1s");
    job["scrape_timeout"] = Yaml::from("1s");
    config["scrape_configs"] = Yaml::Sequence(vec![job]);
    config["global"]["scrape_interval"] = Yaml::from("1s");
    config["global"]["evaluation_interval"] = Yaml::from("1s");
    serde_yaml::to_string(&config).unwrap()
}

/// A port that was free a moment ago (Prometheus cannot listen on port 0).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    listener.local_addr().unwrap().port()
}

/// A Prometheus server in a temporary directory, killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(admin: SocketAddr) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("prometheus.yml"), scrape_config(admin)).unwrap();
        std::fs::write(dir.path().join("alerts.yml"), ALERT_RULES).unwrap();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let port = free_port();
        let child = Command::new(tool("prometheus"))
            .arg(flag("config.file", &dir.path().join("prometheus.yml")))
            .arg(flag("storage.tsdb.path", &dir.path().join("data")))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("start prometheus");
        let mut prometheus = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            dir,
        };
        prometheus.wait_ready().await;
        prometheus
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + WAIT;
        while self.get_status("/-/ready").await != Some(200) {
            self.assert_within(deadline, "Prometheus never became ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Runs an instant query until its result satisfies `done`.
    async fn query_until(&mut self, query: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + WAIT;
        loop {
            let result = self.query(query).await;
            if done(&result) {
                return result;
            }
            self.assert_within(deadline, &format!("`{query}` last returned {result:?}"));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until every rule of alerts.yml is loaded and has been evaluated
    /// without error.
    async fn wait_for_healthy_alert_rules(&mut self) {
        let expected = ALERT_RULES.matches("- alert:").count();
        let deadline = Instant::now() + WAIT;
        loop {
            let rules = self.rules().await;
            let errors: Vec<&Value> = rules.iter().filter(|r| r["health"] == "err").collect();
            assert!(
                errors.is_empty(),
                "alert rules fail to evaluate: {errors:?}"
            );
            let healthy = rules.iter().filter(|r| r["health"] == "ok").count();
            if rules.len() == expected && healthy == expected {
                return;
            }
            self.assert_within(deadline, &format!("{healthy} of {expected} rules healthy"));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Every query of the dashboard, with its variables set, runs without error.
    async fn run_dashboard_queries(&mut self, admin: SocketAddr) {
        let dashboard: Value = serde_json::from_str(DASHBOARD).expect("dashboard is JSON");
        let panels = dashboard["panels"].as_array().expect("panels");
        let queries: Vec<String> = panels
            .iter()
            .flat_map(|panel| panel["targets"].as_array().cloned().unwrap_or_default())
            .filter_map(|target| target["expr"].as_str().map(str::to_string))
            .map(|expr| {
                expr.replace("$__rate_interval", "1m")
                    .replace("$__range", "5m")
                    .replace("$job", JOB)
                    .replace("$instance", &admin.to_string())
                    .replace("$route", ".*")
            })
            .collect();
        assert!(queries.len() >= 10, "dashboard queries: {queries:?}");
        for query in &queries {
            let answer = self.api("/api/v1/query", query).await;
            assert_eq!(answer["status"], "success", "{query}: {answer}");
        }
    }

    async fn query(&mut self, query: &str) -> Vec<Value> {
        let answer = self.api("/api/v1/query", query).await;
        assert_eq!(answer["status"], "success", "{query}: {answer}");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    async fn rules(&mut self) -> Vec<Value> {
        let answer = self.get("/api/v1/rules").await;
        let groups = answer["data"]["groups"].as_array().cloned();
        groups
            .unwrap_or_default()
            .iter()
            .flat_map(|group| group["rules"].as_array().cloned().unwrap_or_default())
            .collect()
    }

    async fn api(&mut self, path: &str, query: &str) -> Value {
        let encoded =
            percent_encoding::utf8_percent_encode(query, percent_encoding::NON_ALPHANUMERIC);
        self.get(&format!("{path}?query={encoded}")).await
    }

    async fn get(&mut self, path: &str) -> Value {
        let response = self.request(path).await.expect("Prometheus answers");
        serde_json::from_str(&response.body)
            .unwrap_or_else(|_| panic!("{path}: not JSON: {}", response.body))
    }

    async fn get_status(&mut self, path: &str) -> Option<u16> {
        self.request(path).await.map(|response| response.status)
    }

    async fn request(&mut self, path: &str) -> Option<TestResponse> {
        let request = Request::get(format!("{}{path}", self.url))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = tokio::time::timeout(Duration::from_secs(10), client().request(request));
        match response.await {
            Ok(Ok(response)) => Some(TestResponse::read(response).await),
            _ => None,
        }
    }

    /// Fails, with Prometheus's log, when it has exited or the deadline passed.
    fn assert_within(&mut self, deadline: Instant, what: &str) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("prometheus exited ({status}): {what}\n{}", self.log());
        }
        assert!(
            Instant::now() < deadline,
            "gave up after {WAIT:?}: {what}\n{}",
            self.log()
        );
    }

    fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("prometheus.log"));
        format!("prometheus log:\n{}", log.unwrap_or_default())
    }

    async fn stop(mut self) {
        self.child.kill().await.expect("kill prometheus");
    }
}

fn flag(name: &str, path: &Path) -> String {
    format!("--{name}={}", path.display())
}
