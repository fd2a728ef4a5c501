//! TLS: inbound termination with SIGHUP reload, and `https://` upstreams.
//! Certificates are made at test time; no private key is checked in.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::cli::ProxyProcess;
use crate::support::{Backend, TestApp, TestStore, Upstream};

/// A throwaway certificate authority.
pub struct TestPki {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and key in PEM, and the certificate's DER.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: CertificateDer<'static>,
}

impl TestPki {
    pub fn new() -> Self {
        dedupe_proxy::tls::install_crypto_provider();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Self { issuer }
    }

    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    pub fn leaf(&self, name: &str) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_string()])
            .unwrap()
            .signed_by(&key, &self.issuer)
            .unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
        }
    }

    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.issuer.der().clone()).unwrap();
        Arc::new(
            rustls::ClientConfig::builder()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        )
    }
}

/// An HTTP/1.1 connection over TLS, and the certificate the server showed.
struct TlsClient {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    server_certificate: CertificateDer<'static>,
}

impl TlsClient {
    async fn connect(pki: &TestPki, addr: std::net::SocketAddr) -> Self {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let stream = TlsConnector::from(pki.client_config())
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .expect("TLS handshake");
        let server_certificate = stream.get_ref().1.peer_certificates().unwrap()[0].clone();
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(connection);
        Self {
            sender,
            server_certificate,
        }
    }

    async fn deliver(&mut self, key: &str) -> (u16, String, String) {
        let request = http::Request::post("/hooks/orders")
            .header("host", "localhost")
            .header("x-event-id", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        self.sender.ready().await.expect("connection open");
        let response = self.sender.send_request(request).await.expect("response");
        let status = response.status().as_u16();
        let outcome = response.headers()["x-dedupe-outcome"]
            .to_str()
            .unwrap()
            .to_string();
        let body =
            String::from_utf8_lossy(&response.into_body().collect().await.unwrap().to_bytes())
                .into_owned();
        (status, outcome, body)
    }
}

fn write(dir: &std::path::Path, name: &str, content: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, content).unwrap();
    path.display().to_string()
}

/// A proxy terminating TLS with `leaf`, whose files live in the returned
/// directory.
async fn app_serving_tls(leaf: &Leaf) -> (TestApp, tempfile::TempDir) {
    app_serving_tls_with(leaf, |_| {}).await
}

async fn app_serving_tls_with(
    leaf: &Leaf,
    configure: impl FnOnce(&mut dedupe_proxy::Config),
) -> (TestApp, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (
        write(dir.path(), "tls.crt", &leaf.cert_pem),
        write(dir.path(), "tls.key", &leaf.key_pem),
    );
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.tls = Some(dedupe_proxy::config::TlsConfig {
            cert_file: cert.into(),
            key_file: key.into(),
        });
        configure(config);
    })
    .await;
    (app, dir)
}

/// The TLS handshake is a new connection's first bytes: it gets
/// `header_read_timeout` like a plain connection's request line does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_connection_that_never_completes_its_handshake_is_closed() {
    let leaf = TestPki::new().leaf("localhost");
    let (app, _dir) = app_serving_tls_with(&leaf, |config| {
        config.limits.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    for first_bytes in [&b""[..], &b"\x16\x03\x01\x00\xc8\x01"[..]] {
        let mut stalled = TcpStream::connect(app.addr).await.unwrap();
        stalled.write_all(first_bytes).await.unwrap();
        let mut buffer = [0u8; 1024];
        // Generous against 300 ms, and short of the 10 s a handshake given
        // its own fixed timeout would be allowed.
        let closed = tokio::time::timeout(Duration::from_secs(5), stalled.read(&mut buffer))
            .await
            .expect("a stalled handshake is closed at the header read timeout");
        assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_tls_is_terminated_and_marked_https_upstream() {
    let pki = TestPki::new();
    let leaf = pki.leaf("localhost");
    let (app, _dir) = app_serving_tls(&leaf).await;
    let mut client = TlsClient::connect(&pki, app.addr).await;
    assert_eq!(client.server_certificate, leaf.der);
    let (status, outcome, _) = client.deliver("evt_tls").await;
    assert_eq!((status, outcome.as_str()), (200, "forwarded"));
    assert_eq!(client.deliver("evt_tls").await.1, "duplicate");
    assert_eq!(
        app.upstream.seen()[0].header("x-forwarded-proto"),
        Some("https")
    );
    // Plain HTTP on the TLS port gets no answer.
    let plain = tokio::time::timeout(
        Duration::from_secs(15),
        crate::support::client().get(format!("http://{}/", app.addr).parse().unwrap()),
    )
    .await;
    assert!(
        matches!(plain, Ok(Err(_))),
        "plain HTTP must not be served on a TLS listener"
    );
}

/// A sender that offers HTTP/2 by ALPN gets it; one that offers nothing gets
/// HTTP/1.1 (the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_sender_over_tls_is_served_by_alpn() {
    let pki = TestPki::new();
    let leaf = pki.leaf("localhost");
    let (app, _dir) = app_serving_tls(&leaf).await;
    let mut client_config = (*pki.client_config()).clone();
    client_config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let tcp = TcpStream::connect(app.addr).await.unwrap();
    let stream = TlsConnector::from(Arc::new(client_config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("TLS handshake");
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let mut sender = crate::support::http2_sender(stream).await;
    for expected in ["forwarded", "duplicate"] {
        let response = crate::support::send_http2(&mut sender, "/hooks/orders", "evt_h2").await;
        assert_eq!((response.status, response.outcome()), (200, expected));
    }
    assert_eq!(app.upstream.seen().len(), 1);
}

/// The binary terminating TLS with a leaf whose files, `tls.crt` and
/// `tls.key`, are in `dir`, in front of a store and an upstream of its own.
struct TlsProcess {
    proxy: ProxyProcess,
    dir: tempfile::TempDir,
    _store: TestStore,
    _upstream: Upstream,
}

impl TlsProcess {
    async fn start(leaf: &Leaf) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cert = write(dir.path(), "tls.crt", &leaf.cert_pem);
        let key = write(dir.path(), "tls.key", &leaf.key_pem);
        let store = TestStore::new(Backend::Sqlite).await;
        let upstream = Upstream::start().await;
        let proxy = ProxyProcess::start(&format!(
            "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\ntls: {{ cert_file: '{cert}', key_file: '{key}' }}\nupstream: {{ url: '{}' }}\nstore: {{ url: '{}' }}\nroutes: [{{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }} }}]\n",
            upstream.url(),
            store.url
        ))
        .await;
        proxy.wait_ready().await;
        Self {
            proxy,
            dir,
            _store: store,
            _upstream: upstream,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_certificate_without_dropping_connections() {
    let pki = TestPki::new();
    let (first, second) = (pki.leaf("localhost"), pki.leaf("localhost"));
    let TlsProcess {
        proxy,
        dir,
        _store,
        _upstream,
    } = TlsProcess::start(&first).await;
    let mut old_connection = TlsClient::connect(&pki, proxy.addr).await;
    assert_eq!(old_connection.server_certificate, first.der);
    assert_eq!(old_connection.deliver("evt_1").await.1, "forwarded");

    write(dir.path(), "tls.crt", &second.cert_pem);
    write(dir.path(), "tls.key", &second.key_pem);
    proxy.signal("HUP");
    let reloaded = async {
        loop {
            if TlsClient::connect(&pki, proxy.addr)
                .await
                .server_certificate
                == second.der
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), reloaded)
        .await
        .expect("new certificate served");
    assert_eq!(
        old_connection.deliver("evt_2").await.1,
        "forwarded",
        "the open connection survived the reload"
    );

    // A broken pair is refused and the current one kept.
    write(dir.path(), "tls.key", "not a key");
    proxy.signal("HUP");
    proxy.wait_for_log("TLS certificate not reloaded").await;
    let mut after = TlsClient::connect(&pki, proxy.addr).await;
    assert_eq!(after.server_certificate, second.der);
    assert_eq!(after.deliver("evt_3").await.1, "forwarded");
}

/// A reload whose certificate file never yields (a FIFO here, a hung
/// network mount in life) holds up neither the next SIGHUP's reload nor the
/// process's exit; and reads stuck that way, each on a thread of its own,
/// are not piled up past four.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_stuck_reading_its_files_holds_up_neither_the_next_nor_the_exit() {
    let pki = TestPki::new();
    let (first, second) = (pki.leaf("localhost"), pki.leaf("localhost"));
    let TlsProcess {
        mut proxy,
        dir,
        _store,
        _upstream,
    } = TlsProcess::start(&first).await;
    let cert = dir.path().join("tls.crt").display().to_string();

    // Opening the FIFO to write waits for a reload to open it to read; held
    // open and never written to, it keeps every read of it waiting.
    let stuck_reading = || async {
        std::fs::remove_file(&cert).unwrap();
        let fifo = std::process::Command::new("mkfifo")
            .arg(&cert)
            .status()
            .unwrap();
        assert!(fifo.success());
        let (opened, writer) = tokio::sync::oneshot::channel();
        let fifo_path = cert.clone();
        std::thread::spawn(move || {
            let _ = opened.send(std::fs::OpenOptions::new().write(true).open(fifo_path));
        });
        proxy.signal("HUP");
        tokio::time::timeout(Duration::from_secs(10), writer)
            .await
            .expect("the reload opened the certificate file")
            .unwrap()
            .unwrap()
    };
    let until_reading = |count: usize| {
        let proxy = &proxy;
        async move {
            let reading = async {
                // The kernel keeps 15 bytes of a thread's name.
                while proxy.threads_named("dedupe-tls-relo") != count {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(10), reading)
                .await
                .unwrap_or_else(|_| panic!("never {count} reloads reading"));
        }
    };

    let writer = stuck_reading().await;
    for _ in 0..3 {
        proxy.signal("HUP");
    }
    until_reading(4).await;
    proxy.signal("HUP");
    proxy
        .wait_for_log("4 earlier reloads are still reading tls.cert_file and tls.key_file")
        .await;
    // The reads come back empty, and their threads end.
    drop(writer);
    until_reading(0).await;

    let _writer = stuck_reading().await;
    // The read is stuck; the pair is replaced under it.
    std::fs::remove_file(&cert).unwrap();
    write(dir.path(), "tls.crt", &second.cert_pem);
    write(dir.path(), "tls.key", &second.key_pem);
    proxy.signal("HUP");
    proxy.wait_for_log("SIGHUP: TLS certificate reloaded").await;
    let mut after = TlsClient::connect(&pki, proxy.addr).await;
    assert_eq!(after.server_certificate, second.der);
    assert_eq!(after.deliver("evt_after_reload").await.1, "forwarded");

    proxy.terminate();
    assert!(proxy.wait().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstreams_are_verified_against_the_configured_ca() {
    let pki = TestPki::new();
    let leaf = pki.leaf("localhost");
    let dir = tempfile::tempdir().unwrap();
    let ca = write(dir.path(), "ca.pem", &pki.ca_pem());
    let server_config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der.clone()], {
            use rustls::pki_types::pem::PemObject;
            rustls::pki_types::PrivateKeyDer::from_pem_slice(leaf.key_pem.as_bytes()).unwrap()
        })
        .unwrap();
    let upstream = Upstream::start_tls(Arc::new(server_config)).await;
    let port = upstream.addr.port();
    let store = Arc::new(TestStore::new(Backend::Sqlite).await);
    let app = TestApp::spawn_on(Arc::clone(&store), upstream.clone(), |config| {
        config.upstream.url = format!("https://localhost:{port}");
        config.upstream.ca_file = Some(ca.clone().into());
    })
    .await;
    let response = app.deliver("evt_https", "{}").await;
    assert_eq!(
        (response.status, response.outcome()),
        (200, "forwarded"),
        "{}",
        response.body
    );
    assert_eq!(upstream.count(), 1);
    drop(app);

    // Without the CA the upstream's certificate is not trusted: 502, and the
    // key is settled failed so the retry goes through once trust is fixed.
    let untrusting = TestApp::spawn_on(Arc::clone(&store), upstream.clone(), |config| {
        config.upstream.url = format!("https://localhost:{port}");
        config.upstream.ca_file =
            Some(write(dir.path(), "other-ca.pem", &TestPki::new().ca_pem()).into());
    })
    .await;
    let refused = untrusting.deliver("evt_untrusted", "{}").await;
    assert_eq!((refused.status, refused.outcome()), (502, "upstream-error"));
    assert_eq!(upstream.count(), 1);
}
