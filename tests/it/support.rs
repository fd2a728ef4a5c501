//! The test harness: a fresh store per test (its own PostgreSQL database, or
//! an SQLite file in a temp dir), a recording upstream that can be scripted
//! per key, the proxy started in-process on port 0, a TCP relay that can cut
//! the proxy off from PostgreSQL, and a small HTTP client.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dedupe_proxy::store::{Claim, Fence, Settlement, Store, StoreError};
use dedupe_proxy::{Application, Config};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Which store a scenario runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// Generates one `#[tokio::test]` per backend for each scenario function
/// `async fn name(backend: Backend)`.
#[macro_export]
macro_rules! on_both_stores {
    ($($scenario:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario($crate::support::Backend::Postgres).await
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario($crate::support::Backend::Sqlite).await
                }
            )*
        }
    };
}

pub fn init_logs() {
    if std::env::var_os("TEST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                std::env::var("RUST_LOG").unwrap_or_else(|_| "debug".into()),
            ))
            .with_test_writer()
            .try_init();
    }
}

// ---------------------------------------------------------------- stores

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

fn maintenance_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into())
}

/// A store private to one test; dropped with it.
pub struct TestStore {
    pub url: String,
    database: Option<String>,
    _dir: Option<tempfile::TempDir>,
}

static NEXT_DATABASE: AtomicU64 = AtomicU64::new(0);

impl TestStore {
    pub async fn new(backend: Backend) -> Self {
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let url = format!("sqlite://{}", dir.path().join("dedupe.db").display());
                Self {
                    url,
                    database: None,
                    _dir: Some(dir),
                }
            }
            Backend::Postgres => {
                let name = format!(
                    "dedupe_test_{}_{}",
                    std::process::id(),
                    NEXT_DATABASE.fetch_add(1, Ordering::Relaxed)
                );
                let admin = connect_maintenance().await;
                admin
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await
                    .expect("drop a leftover test database");
                admin
                    .batch_execute(&format!("CREATE DATABASE {name}"))
                    .await
                    .expect("create test database");
                let mut config: tokio_postgres::Config =
                    maintenance_url().parse().expect("DATABASE_URL");
                config.dbname(&name);
                Self {
                    url: postgres_url(&config),
                    database: Some(name),
                    _dir: None,
                }
            }
        }
    }

    /// The store's URL with its host and port replaced (to go through a relay).
    pub fn url_via(&self, addr: SocketAddr) -> String {
        let config: tokio_postgres::Config = self.url.parse().expect("postgres url");
        let user = config.get_user().unwrap_or("postgres");
        let password = config
            .get_password()
            .map(|p| format!(":{}", String::from_utf8_lossy(p)))
            .unwrap_or_default();
        format!(
            "postgres://{user}{password}@{addr}/{}",
            config.get_dbname().unwrap_or("postgres")
        )
    }

    /// The address of the PostgreSQL server.
    pub fn postgres_addr(&self) -> SocketAddr {
        let config: tokio_postgres::Config = self.url.parse().expect("postgres url");
        let host = match &config.get_hosts()[0] {
            tokio_postgres::config::Host::Tcp(host) => host.clone(),
            other => panic!("tests need a TCP PostgreSQL, got {other:?}"),
        };
        let host = if host == "localhost" {
            "127.0.0.1".to_string()
        } else {
            host
        };
        SocketAddr::new(host.parse().expect("an IP host"), config.get_ports()[0])
    }

    /// Runs SQL on the test database (PostgreSQL only).
    pub async fn postgres(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.url, tokio_postgres::NoTls)
            .await
            .expect("connect to the test database");
        tokio::spawn(connection);
        client
    }
}

fn postgres_url(config: &tokio_postgres::Config) -> String {
    let host = match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(host) => host.clone(),
        tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
    };
    let user = config.get_user().unwrap_or("postgres");
    let password = config
        .get_password()
        .map(|p| format!(":{}", String::from_utf8_lossy(p)))
        .unwrap_or_default();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let dbname = config.get_dbname().unwrap_or("postgres");
    format!("postgres://{user}{password}@{host}:{port}/{dbname}")
}

async fn connect_maintenance() -> tokio_postgres::Client {
    let url = maintenance_url();
    match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
        Ok((client, connection)) => {
            tokio::spawn(connection);
            client
        }
        Err(error) => panic!(
            "PostgreSQL is not reachable at {url} ({error}).\n\
             The PostgreSQL tests need a server: run `scripts/test` (it starts or installs one), \
             or start the local cluster with \
             `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`, \
             or point DATABASE_URL at a server where the user may create databases."
        ),
    }
}

impl Drop for TestStore {
    fn drop(&mut self) {
        let Some(name) = self.database.take() else {
            return;
        };
        // Drop runs inside the test's runtime; a thread with its own runtime
        // can block on the cleanup.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                if let Ok((client, connection)) =
                    tokio_postgres::connect(&maintenance_url(), tokio_postgres::NoTls).await
                {
                    tokio::spawn(connection);
                    let _ = client
                        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .await;
                }
            });
        })
        .join();
    }
}

/// Counts this database's sessions waiting on a lock until there are
/// `waiters`, and returns the query text of those waiting.
pub async fn until_waiting_on_locks(
    observer: &tokio_postgres::Client,
    waiters: i64,
) -> Vec<String> {
    let waiting = async {
        loop {
            let queries = waiting_on_locks(observer).await;
            if queries.len() as i64 >= waiters {
                return queries;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .unwrap_or_else(|_| panic!("{waiters} statements never waited on locks"))
}

/// The statements of the test database waiting on a lock.
pub async fn waiting_on_locks(observer: &tokio_postgres::Client) -> Vec<String> {
    observer
        .query(
            "SELECT query FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

// ---------------------------------------------------------------- upstream

/// What the upstream does with a request.
#[derive(Clone)]
pub enum Behavior {
    /// Answer with this status.
    Status(u16),
    /// Never answer.
    Hang,
    /// Answer 200 once the gate is opened.
    Gate(Arc<Gate>),
}

/// A one-shot barrier the test opens.
#[derive(Default)]
pub struct Gate {
    open: watch::Sender<bool>,
}

impl Gate {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            open: watch::Sender::new(false),
        })
    }
    pub fn open(&self) {
        self.open.send_replace(true);
    }
    async fn passed(&self) {
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|open| *open).await;
    }
}

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: http::Method,
    pub uri: http::Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ascii header"))
    }
}

#[derive(Default)]
struct UpstreamState {
    seen: Mutex<Vec<Seen>>,
    arrived: Notify,
    script: Mutex<HashMap<String, VecDeque<Behavior>>>,
}

/// A real HTTP server that records every request and follows a script keyed
/// by `X-Dedupe-Key` (or the path for requests without one).
#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<UpstreamState>,
    stop: CancellationToken,
}

impl Upstream {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        Self::serve(listener)
    }

    /// An upstream speaking HTTPS with the given certificate.
    pub async fn start_tls(config: Arc<rustls::ServerConfig>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        Self::serve_with(listener, Some(tokio_rustls::TlsAcceptor::from(config)))
    }

    /// Serves on an existing listener (to restart on the same port).
    pub fn serve(listener: TcpListener) -> Self {
        Self::serve_with(listener, None)
    }

    fn serve_with(listener: TcpListener, tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(UpstreamState::default());
        let stop = CancellationToken::new();
        let (task_state, task_stop) = (Arc::clone(&state), stop.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    () = task_stop.cancelled() => return,
                    accepted = listener.accept() => match accepted { Ok((s, _)) => s, Err(_) => continue },
                };
                let state = Arc::clone(&task_state);
                let stop = task_stop.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| respond(Arc::clone(&state), request));
                    let builder = hyper::server::conn::http1::Builder::new();
                    match tls {
                        None => {
                            let connection =
                                builder.serve_connection(TokioIo::new(stream), service);
                            tokio::select! { _ = connection => {}, () = stop.cancelled() => {} }
                        }
                        Some(acceptor) => {
                            let Ok(stream) = acceptor.accept(stream).await else {
                                return;
                            };
                            let connection =
                                builder.serve_connection(TokioIo::new(stream), service);
                            tokio::select! { _ = connection => {}, () = stop.cancelled() => {} }
                        }
                    }
                });
            }
        });
        Self { addr, state, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Queues behaviours for a key: each request of that key takes the next;
    /// after the queue is empty requests get 200.
    pub fn script(&self, key: &str, behaviors: impl IntoIterator<Item = Behavior>) {
        self.state
            .script
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_default()
            .extend(behaviors);
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.state.seen.lock().unwrap().len()
    }

    /// Waits until at least `n` requests have arrived.
    pub async fn wait_for(&self, n: usize) {
        let wait = async {
            loop {
                let arrived = self.state.arrived.notified();
                if self.count() >= n {
                    return;
                }
                arrived.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), wait)
            .await
            .unwrap_or_else(|_| panic!("upstream saw {} requests, expected {n}", self.count()));
    }

    /// Stops serving and closes every connection.
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

async fn respond(
    state: Arc<UpstreamState>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let (body, trailers) = match body.collect().await {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            (collected.to_bytes(), trailers)
        }
        Err(_) => (Bytes::new(), None),
    };
    let key = parts
        .headers
        .get("x-dedupe-key")
        .and_then(|v| v.to_str().ok())
        .map_or_else(|| parts.uri.path().to_string(), str::to_string);
    state.seen.lock().unwrap().push(Seen {
        method: parts.method.clone(),
        uri: parts.uri.clone(),
        headers: parts.headers.clone(),
        body: body.clone(),
        trailers,
    });
    state.arrived.notify_waiters();
    let behavior = state
        .script
        .lock()
        .unwrap()
        .get_mut(&key)
        .and_then(VecDeque::pop_front)
        .unwrap_or(Behavior::Status(200));
    let status = match behavior {
        Behavior::Status(status) => status,
        Behavior::Hang => std::future::pending().await,
        Behavior::Gate(gate) => {
            gate.passed().await;
            200
        }
    };
    let mut response = Response::new(Full::new(Bytes::from(format!(
        "upstream says {status} to {key}"
    ))));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    response
        .headers_mut()
        .insert("x-upstream", "yes".parse().unwrap());
    Ok(response)
}

// ---------------------------------------------------------------- relay

/// A TCP relay to PostgreSQL that the test can cut and restore, standing in
/// for a database outage.
pub struct Relay {
    pub addr: SocketAddr,
    up: watch::Sender<bool>,
    frozen: watch::Sender<bool>,
    open_connections: Arc<AtomicU64>,
    refused: watch::Sender<u64>,
}

impl Relay {
    pub async fn start(target: SocketAddr, up: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().unwrap();
        let up = watch::Sender::new(up);
        let state = up.subscribe();
        let frozen = watch::Sender::new(false);
        let freezing = frozen.subscribe();
        let open_connections = Arc::new(AtomicU64::new(0));
        let open = Arc::clone(&open_connections);
        let refused = watch::Sender::new(0);
        let refusals = refused.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let mut state = state.clone();
                let mut freezing = freezing.clone();
                if !*state.borrow_and_update() {
                    drop(inbound);
                    refusals.send_modify(|count| *count += 1);
                    continue;
                }
                open.fetch_add(1, Ordering::SeqCst);
                let open = Arc::clone(&open);
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let frozen = tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => false,
                            _ = state.wait_for(|up| !*up) => false,
                            _ = freezing.wait_for(|frozen| *frozen) => true,
                        };
                        if frozen {
                            // Both ends stay open, and nothing passes.
                            let _ = state.wait_for(|up| !*up).await;
                        }
                    }
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Self {
            addr,
            up,
            frozen,
            open_connections,
            refused,
        }
    }

    /// The store stops answering: connections, open and new, stay open and
    /// pass nothing, as with a database host that has hung.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Waits until a connection is refused while the relay is cut: someone
    /// tried to reach the store after `since` refusals.
    pub async fn wait_for_refusal(&self, since: u64) {
        let mut refused = self.refused.subscribe();
        tokio::time::timeout(Duration::from_secs(10), refused.wait_for(|n| *n > since))
            .await
            .expect("a connection attempt while cut")
            .unwrap();
    }

    /// Connections refused so far.
    pub fn refusals(&self) -> u64 {
        *self.refused.borrow()
    }

    /// Connections relayed and still open.
    pub fn open_connections(&self) -> u64 {
        self.open_connections.load(Ordering::SeqCst)
    }

    /// Waits until every relayed connection has closed.
    pub async fn wait_until_all_closed(&self) {
        let closed = async {
            while self.open_connections() > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), closed)
            .await
            .expect("relay connections closed");
    }

    /// Closes every relayed connection and refuses new ones; returns once
    /// every connection is closed.
    pub async fn cut(&self) {
        self.up.send_replace(false);
        self.wait_until_all_closed().await;
    }

    pub fn restore(&self) {
        self.up.send_replace(true);
    }
}

// ---------------------------------------------------------------- proxy

/// Configuration every test starts from: short timeouts, one header-keyed
/// route and one JSON-keyed route.
pub fn base_config(store_url: &str, upstream: &Upstream) -> Config {
    let yaml = format!(
        r#"
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
upstream: {{ url: "{upstream}", timeout: 2s, connect_timeout: 1s }}
store: {{ url: "{store_url}", lease: 10s, timeout: 1s, retry_after: 3s }}
shutdown_grace: 5s
routes:
  - {{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}
  - {{ name: json, path: /hooks/json, key: {{ json: /id }} }}
"#,
        upstream = upstream.url()
    );
    Config::from_yaml(&yaml, None).unwrap_or_else(|p| panic!("base config: {p:?}"))
}

/// A running proxy with its store and upstream.
pub struct TestApp {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub upstream: Upstream,
    pub store: Arc<TestStore>,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl TestApp {
    /// A proxy on a fresh store, with the base configuration changed by `edit`.
    pub async fn spawn(backend: Backend, edit: impl FnOnce(&mut Config)) -> Self {
        let store = Arc::new(TestStore::new(backend).await);
        let upstream = Upstream::start().await;
        Self::spawn_on(store, upstream, edit).await
    }

    /// A proxy on an existing store and upstream, ready to serve.
    pub async fn spawn_on(
        store: Arc<TestStore>,
        upstream: Upstream,
        edit: impl FnOnce(&mut Config),
    ) -> Self {
        let app = Self::start(store, upstream, edit).await;
        app.wait_ready().await;
        app
    }

    /// A proxy that may not be ready yet (its store may be down).
    pub async fn start(
        store: Arc<TestStore>,
        upstream: Upstream,
        edit: impl FnOnce(&mut Config),
    ) -> Self {
        init_logs();
        let mut config = base_config(&store.url, &upstream);
        edit(&mut config);
        let problems = config.validate();
        assert!(problems.is_empty(), "invalid test config: {problems:?}");
        let application = Application::build(&config)
            .await
            .expect("build application");
        let (addr, admin) = (application.webhook_addr(), application.admin_addr());
        let stop = CancellationToken::new();
        let task = tokio::spawn(application.run_until_stopped(stop.clone()));
        Self {
            addr,
            admin,
            upstream,
            store,
            stop,
            task: Some(task),
            client: client(),
        }
    }

    /// Waits for `/readyz` to answer 200.
    pub async fn wait_ready(&self) {
        let ready = async {
            loop {
                if self.admin_get("/readyz").await.status == 200 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), ready)
            .await
            .expect("proxy never became ready");
    }

    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> TestResponse {
        self.send(http::Method::POST, path, headers, body).await
    }

    /// Posts to the header-keyed route with `X-Event-Id: key`.
    pub async fn deliver(&self, key: &str, body: &str) -> TestResponse {
        self.post("/hooks/orders", &[("x-event-id", key)], body)
            .await
    }

    /// Delivers `key` (body `{}`), with the upstream holding the request
    /// until `meanwhile` has run: an application that answers only after,
    /// say, the store has gone away.
    pub async fn deliver_answered_after(
        &self,
        key: &str,
        meanwhile: impl Future<Output = ()>,
    ) -> TestResponse {
        let gate = Gate::new();
        self.upstream
            .script(key, [Behavior::Gate(Arc::clone(&gate))]);
        let arrived = self.upstream.count() + 1;
        let (response, ()) = tokio::join!(self.deliver(key, "{}"), async {
            self.upstream.wait_for(arrived).await;
            meanwhile.await;
            gate.open();
        });
        response
    }

    pub async fn send(
        &self,
        method: http::Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> TestResponse {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        TestResponse::read(self.client.request(request).await.expect("proxy answers")).await
    }

    pub async fn admin_get(&self, path: &str) -> TestResponse {
        self.admin_request(http::Method::GET, path).await
    }

    pub async fn admin_request(&self, method: http::Method, path: &str) -> TestResponse {
        let request = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.admin))
            .body(Full::new(Bytes::new()))
            .unwrap();
        TestResponse::read(self.client.request(request).await.expect("admin answers")).await
    }

    /// Asserts that `/metrics` has each of `lines`, whole.
    pub async fn assert_metrics(&self, lines: &[&str]) {
        let metrics = self.admin_get("/metrics").await.body;
        for line in lines {
            assert!(
                metrics.lines().any(|l| l == *line),
                "{line} missing from\n{metrics}"
            );
        }
    }

    /// Waits until `/metrics` has `line`, whole: for what the proxy counts
    /// after it has answered. Bounded, so that a line that never comes fails
    /// the test, showing what was there.
    pub async fn wait_for_metric(&self, line: &str) {
        let present = async {
            while !self
                .admin_get("/metrics")
                .await
                .body
                .lines()
                .any(|l| l == line)
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), present)
            .await
            .is_err()
        {
            let metrics = self.admin_get("/metrics").await.body;
            panic!("{line} missing from\n{metrics}");
        }
    }

    /// Asks the proxy to stop (as SIGTERM does) and waits until it has.
    pub async fn shutdown(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect("shutdown finishes")
                .expect("no panic");
        }
    }

    pub fn begin_shutdown(&self) {
        self.stop.cancel();
    }

    pub fn take_task(&mut self) -> JoinHandle<()> {
        self.task.take().expect("running")
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.stop.cancel();
        self.upstream.stop();
    }
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A fully read response.
/// An HTTP/2 connection over `io` (plain TCP with prior knowledge, or TLS
/// that negotiated `h2`).
pub async fn http2_sender<I>(io: I) -> hyper::client::conn::http2::SendRequest<Full<Bytes>>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
            .await
            .expect("HTTP/2 handshake");
    tokio::spawn(connection);
    sender
}

/// Posts `{}` to `path` with `X-Event-Id: key` over HTTP/2.
pub async fn send_http2(
    sender: &mut hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    path: &str,
    key: &str,
) -> TestResponse {
    let request = Request::post(format!("http://localhost{path}"))
        .header("x-event-id", key)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    sender.ready().await.expect("connection open");
    let response = sender.send_request(request).await.expect("proxy answers");
    assert_eq!(response.version(), http::Version::HTTP_2);
    TestResponse::read(response).await
}

#[derive(Debug)]
pub struct TestResponse {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: String,
}

impl TestResponse {
    pub async fn read(response: Response<Incoming>) -> Self {
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("read body").to_bytes();
        Self {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    pub fn outcome(&self) -> &str {
        self.headers
            .get("x-dedupe-outcome")
            .map_or("<none>", |v| v.to_str().unwrap())
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

/// Settles `key` as its `attempt`, for the tests of attempt fencing: the
/// fence's claim time is the key's row's, or one no claim has when the row is
/// gone. A test of claim-time fencing settles with the fence its claim
/// returned.
pub async fn settle_attempt(
    store: &Store,
    source: &str,
    key: &str,
    attempt: i32,
    settlement: Settlement,
) -> Result<bool, StoreError> {
    let claimed_at = store
        .show(source, key)
        .await?
        .map_or(std::time::UNIX_EPOCH, |row| row.claimed_at);
    let fence = Fence {
        attempt,
        claimed_at,
    };
    store.settle(source, key, fence, settlement).await
}

/// The attempt a claim won, if it won.
pub fn won_attempt(claim: &Claim) -> Option<i32> {
    match claim {
        Claim::Won { fence, .. } => Some(fence.attempt),
        _ => None,
    }
}
