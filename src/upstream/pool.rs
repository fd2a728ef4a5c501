//! Keep-alive connections to the upstream, kept apart per serving thread: a
//! connection is opened, driven and used by one thread only, so a request
//! going out on it and its response coming back wake no other thread. Each
//! thread's connections are used newest first, and one left idle for the
//! idle timeout is closed the next time that thread looks for one.
//!
//! A connection whose response did not come in time is reset, not closed:
//! closing would leave the request's unsent bytes to the kernel, which goes
//! on sending them to an upstream gone silent, and one back after a while
//! would then receive the old request after its retry had been processed.
//!
//! Each connection keeps the timer that bounds the wait for a response:
//! moving a registered timer's deadline later costs an atomic exchange, where
//! a timer per request is entered in and removed from the runtime's timer
//! wheel under its lock (about 2% of the proxy's instructions per
//! pass-through request).

use std::cell::Cell;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;
use tokio::time::Sleep;
use tower_service::Service;

use super::{BodyEnd, RequestBody, SenderBodyError, UpstreamError};
use crate::config::UpstreamConfig;
use crate::error_chain;
use crate::tls::{self, TlsError};

thread_local! {
    static LANE: Cell<usize> = const { Cell::new(0) };
}

/// Makes the calling thread use the connections of `lane` in every
/// upstream `Pool`: each serving thread takes its own.
pub fn use_lane(lane: usize) {
    LANE.with(|current| current.set(lane));
}

const UPSTREAM_KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const UPSTREAM_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const UPSTREAM_KEEPALIVE_RETRIES: u32 = 3;

type Sender = http1::SendRequest<RequestBody>;
type Io = hyper_rustls::MaybeHttpsStream<TokioIo<tokio::net::TcpStream>>;

/// A connection's request side, and the switch that resets it.
struct Connection {
    sender: Sender,
    reset: oneshot::Sender<()>,
}

/// The upstream's keep-alive connections, one set per serving thread.
pub(super) struct Pool {
    connector: HttpsConnector<HttpConnector>,
    /// `scheme://authority` of the upstream, what the connector dials.
    origin: Uri,
    lanes: Box<[Mutex<VecDeque<Idle>>]>,
    idle_timeout: Duration,
    /// How long a request may wait for its response headers, connecting
    /// included: `upstream.timeout`.
    timeout: Duration,
    /// For an `https://` upstream, what its certificate is checked against,
    /// said when the check fails.
    verified_against: Option<String>,
}

/// A timer kept with its connection and reset for each request on it. Until
/// it is reset, its deadline may pass and wake the last request's task, which
/// is harmless.
type Deadline = Pin<Box<Sleep>>;

struct Idle {
    connection: Connection,
    deadline: Deadline,
    since: Instant,
}

impl Pool {
    /// A pool for `url` (`config.url`, validated by the configuration) with
    /// a set of connections for each of `lanes` serving threads. An
    /// `https://` upstream is verified against `ca_file` or the system roots.
    pub fn new(
        config: &UpstreamConfig,
        url: &Uri,
        lanes: usize,
        idle_timeout: Duration,
    ) -> Result<Self, TlsError> {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        // `upstream.timeout` ends at the response headers; an upstream that
        // vanishes while sending the body is found by probes instead, in
        // about a minute rather than the kernel's two hours.
        connector.set_keepalive(Some(UPSTREAM_KEEPALIVE_IDLE));
        connector.set_keepalive_interval(Some(UPSTREAM_KEEPALIVE_INTERVAL));
        connector.set_keepalive_retries(Some(UPSTREAM_KEEPALIVE_RETRIES));
        connector.enforce_http(false);
        let https = url.scheme() == Some(&http::uri::Scheme::HTTPS);
        let verified_against = https.then(|| match &config.ca_file {
            Some(ca_file) => format!("upstream.ca_file {}", ca_file.display()),
            None => "the system's trusted roots (upstream.ca_file is not set)".into(),
        });
        let tls = if https {
            tls::client_config(config.ca_file.as_deref())?
        } else {
            // Never used for http:// upstreams; no roots needed.
            rustls::ClientConfig::builder()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        };
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let origin = Uri::builder()
            .scheme(url.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP))
            .authority(url.authority().cloned().expect("validated: url has a host"))
            .path_and_query("/")
            .build()
            .expect("a scheme and an authority make a valid URI");
        Ok(Self {
            connector,
            origin,
            lanes: (0..lanes.max(1)).map(|_| Mutex::default()).collect(),
            idle_timeout,
            timeout: config.timeout,
            verified_against,
        })
    }

    /// Sends on one of this thread's open connections, or on a new one. A
    /// request that never left a kept-alive connection the upstream had
    /// closed (it restarted, or its keep-alive ran out) goes out again on
    /// another; one whose bytes were written is never resent.
    pub async fn send(
        &self,
        mut request: Request<RequestBody>,
        body_end: Option<&BodyEnd>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let until = tokio::time::Instant::now() + self.timeout;
        loop {
            let (mut connection, mut deadline, reused) = match self.checkout() {
                Some(Idle {
                    connection,
                    mut deadline,
                    ..
                }) => {
                    deadline.as_mut().reset(until);
                    (connection, deadline, true)
                }
                None => {
                    // A new timer, even on a retry: a timer stays with the
                    // connection it was made with, so that both belong to
                    // the runtime driving that connection.
                    let mut deadline = Box::pin(tokio::time::sleep_until(until));
                    let connection = tokio::select! {
                        biased;
                        // Boxed: connecting takes a large future that most
                        // requests, on a kept-alive connection, would
                        // otherwise carry and copy.
                        connected = Box::pin(self.connect()) => connected?,
                        // Out of time before the request left (a TLS
                        // handshake that never finishes, say): the upstream
                        // never saw it, so this is a failure to connect
                        // (502), not a timeout.
                        () = &mut deadline => return Err(UpstreamError::Connect(format!(
                            "no connection within upstream.timeout ({})",
                            crate::config::format_duration(self.timeout)
                        ))),
                    };
                    (connection, deadline, false)
                }
            };
            let sent = {
                let mut sending = std::pin::pin!(connection.sender.try_send_request(request));
                // Set while the answer's deadline waits for a streamed body
                // to be over (nearly never: most bodies are, long before).
                let mut watched: Option<&BodyEnd> = None;
                loop {
                    tokio::select! {
                        biased;
                        sent = &mut sending => break sent,
                        over = async { watched.expect("guarded").over().await }, if watched.is_some() => {
                            deadline.as_mut().reset(over + self.timeout);
                            watched = None;
                        }
                        () = &mut deadline => {
                            let now = tokio::time::Instant::now();
                            match body_end.and_then(|end| end.answer_due(now, self.timeout)) {
                                Some((later, watch)) => {
                                    deadline.as_mut().reset(later);
                                    watched = body_end.filter(|_| watch);
                                }
                                None => {
                                    let _ = connection.reset.send(());
                                    return Err(UpstreamError::Timeout(self.timeout));
                                }
                            }
                        }
                    }
                }
            };
            match sent {
                Ok(response) => {
                    // Back before the body is read: until the body ends the
                    // connection is not ready and checkout passes over it.
                    self.checkin(connection, deadline);
                    return Ok(response);
                }
                Err(mut error) => match error.take_message() {
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(failure(error.into_error())),
                },
            }
        }
    }

    /// How many connections this thread keeps, busy or idle.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.lane().len()
    }

    fn lane(&self) -> MutexGuard<'_, VecDeque<Idle>> {
        let lane = LANE.with(Cell::get) % self.lanes.len();
        // Only this lane's thread takes this lock, so it is never contended.
        self.lanes[lane]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn checkout(&self) -> Option<Idle> {
        let mut kept = self.lane();
        let now = Instant::now();
        while kept
            .front()
            .is_some_and(|oldest| now.duration_since(oldest.since) >= self.idle_timeout)
        {
            kept.pop_front();
        }
        let mut index = kept.len();
        while index > 0 {
            index -= 1;
            let sender = &kept[index].connection.sender;
            if sender.is_closed() {
                kept.remove(index);
            } else if sender.is_ready() {
                return kept.remove(index);
            }
        }
        None
    }

    fn checkin(&self, connection: Connection, deadline: Deadline) {
        if !connection.sender.is_closed() {
            self.lane().push_back(Idle {
                connection,
                deadline,
                since: Instant::now(),
            });
        }
    }

    async fn connect(&self) -> Result<Connection, UpstreamError> {
        let io = self
            .connector
            .clone()
            .call(self.origin.clone())
            .await
            .map_err(|error| {
                let mut cause = error_chain(&*error);
                if let Some(roots) = &self.verified_against
                    && cause.contains("invalid peer certificate")
                {
                    cause = format!("{cause} (checked against {roots})");
                }
                UpstreamError::Connect(cause)
            })?;
        let (sender, connection) = http1::handshake(io)
            .await
            .map_err(|error| UpstreamError::Connect(error_chain(&error)))?;
        let (reset, to_reset) = oneshot::channel();
        tokio::spawn(drive(connection, to_reset));
        Ok(Connection { sender, reset })
    }
}

/// What a failed exchange was: the sender's body failing on its way, or the
/// upstream failing.
fn failure(error: hyper::Error) -> UpstreamError {
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        if let Some(sender) = cause.downcast_ref::<SenderBodyError>() {
            return UpstreamError::SenderBody(sender.clone());
        }
        source = cause.source();
    }
    UpstreamError::Failed(error_chain(&error))
}

/// Runs a connection until it ends, or resets it when told to. A dropped
/// switch (the connection left the pool) is not a reset: it ends as hyper
/// ends it.
async fn drive(
    mut connection: http1::Connection<Io, RequestBody>,
    mut to_reset: oneshot::Receiver<()>,
) {
    let ended = tokio::select! {
        biased;
        Ok(()) = &mut to_reset => {
            let io = connection.into_parts().io;
            let socket = match &io {
                hyper_rustls::MaybeHttpsStream::Http(plain) => plain.inner(),
                hyper_rustls::MaybeHttpsStream::Https(tls) => tls.inner().get_ref().0.inner().inner(),
            };
            // A zero linger makes the close a reset, which drops the unsent bytes.
            if let Err(error) = socket.set_zero_linger() {
                tracing::debug!(%error, "cannot reset the upstream connection; closing it");
            }
            return;
        }
        ended = &mut connection => ended,
    };
    if let Err(error) = ended {
        tracing::debug!(%error, "upstream connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;
    use http_body_util::{BodyExt, Empty};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::Semaphore;

    use super::*;

    /// How the raw upstream answers every request.
    #[derive(Clone, Copy)]
    enum Answer {
        Ok,
        OkThenClose,
        /// A chunked body that ends only when `finish` gives a permit.
        Streaming,
        /// The first request on a connection is answered; later ones only
        /// once `finish` gives a permit.
        FirstThenStall,
    }

    struct RawUpstream {
        url: String,
        connections: Arc<AtomicUsize>,
        finish: Arc<Semaphore>,
    }

    impl RawUpstream {
        async fn start(answer: Answer) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", listener.local_addr().unwrap());
            let connections = Arc::new(AtomicUsize::new(0));
            let finish = Arc::new(Semaphore::new(0));
            let (counted, finished) = (Arc::clone(&connections), Arc::clone(&finish));
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    counted.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(answer_requests(stream, answer, Arc::clone(&finished)));
                }
            });
            Self {
                url,
                connections,
                finish,
            }
        }

        fn connections(&self) -> usize {
            self.connections.load(Ordering::SeqCst)
        }

        fn pool(&self, idle_timeout: Duration) -> Pool {
            self.pool_with_timeout(idle_timeout, UpstreamConfig::default().timeout)
        }

        fn pool_with_timeout(&self, idle_timeout: Duration, timeout: Duration) -> Pool {
            pool_for(&self.url, timeout, 2, idle_timeout)
        }
    }

    async fn answer_requests(
        mut stream: tokio::net::TcpStream,
        answer: Answer,
        finish: Arc<Semaphore>,
    ) {
        let mut received = Vec::new();
        let mut chunk = [0u8; 1024];
        let mut answered = 0;
        loop {
            while let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
                received.drain(..end + 4);
                if matches!(answer, Answer::FirstThenStall) && answered > 0 {
                    finish.acquire().await.unwrap().forget();
                }
                answered += 1;
                let reply: &[u8] = match answer {
                    Answer::Ok | Answer::FirstThenStall => {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                    }
                    Answer::OkThenClose => {
                        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
                    }
                    Answer::Streaming => {
                        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n"
                    }
                };
                if stream.write_all(reply).await.is_err() {
                    return;
                }
                match answer {
                    Answer::Ok | Answer::FirstThenStall => {}
                    Answer::OkThenClose => return,
                    Answer::Streaming => {
                        finish.acquire().await.unwrap().forget();
                        if stream.write_all(b"0\r\n\r\n").await.is_err() {
                            return;
                        }
                    }
                }
            }
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(read) => received.extend_from_slice(&chunk[..read]),
            }
        }
    }

    fn get() -> Request<RequestBody> {
        Request::get("/")
            .header(http::header::HOST, "upstream")
            .body(Empty::new().map_err(|never| match never {}).boxed())
            .unwrap()
    }

    async fn send_ok(pool: &Pool) {
        let response = pool.send(get(), None).await.unwrap();
        assert_eq!(body(response).await, "ok");
    }

    /// Sends `count` requests, each after the previous one's answer.
    async fn send_in_turn(pool: &Pool, count: usize) {
        for _ in 0..count {
            send_ok(pool).await;
        }
    }

    async fn body(response: Response<Incoming>) -> Bytes {
        response.into_body().collect().await.unwrap().to_bytes()
    }

    const MINUTE: Duration = Duration::from_secs(60);

    /// A pool for an upstream at `url` answering within `timeout`.
    fn pool_for(url: &str, timeout: Duration, lanes: usize, idle_timeout: Duration) -> Pool {
        let config = UpstreamConfig {
            url: url.to_owned(),
            timeout,
            ..Default::default()
        };
        tls::install_crypto_provider();
        Pool::new(&config, &url.parse().unwrap(), lanes, idle_timeout).unwrap()
    }

    fn one_lane_pool(url: &str, timeout: Duration) -> Pool {
        pool_for(url, timeout, 1, MINUTE)
    }

    #[tokio::test]
    async fn one_connection_serves_requests_one_after_another() {
        let upstream = RawUpstream::start(Answer::Ok).await;
        let pool = upstream.pool(MINUTE);
        send_in_turn(&pool, 3).await;
        assert_eq!(upstream.connections(), 1);
        assert_eq!(pool.kept(), 1);
    }

    #[tokio::test]
    async fn a_connection_still_streaming_a_body_is_not_reused_until_it_ends() {
        let upstream = RawUpstream::start(Answer::Streaming).await;
        let pool = upstream.pool(MINUTE);
        let streaming = pool.send(get(), None).await.unwrap();
        let second = pool.send(get(), None).await.unwrap();
        assert_eq!(upstream.connections(), 2, "the first is still busy");
        upstream.finish.add_permits(2);
        let (first, second) = tokio::join!(body(streaming), body(second));
        assert_eq!((first, second), ("ok".into(), "ok".into()));
        let third = pool.send(get(), None).await.unwrap();
        upstream.finish.add_permits(1);
        assert_eq!(body(third).await, "ok");
        assert_eq!(
            upstream.connections(),
            2,
            "a finished connection was reused"
        );
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closes_is_not_kept() {
        let upstream = RawUpstream::start(Answer::OkThenClose).await;
        let pool = upstream.pool(MINUTE);
        send_in_turn(&pool, 3).await;
        assert_eq!(upstream.connections(), 3);
    }

    #[tokio::test]
    async fn an_idle_connection_past_the_idle_timeout_is_closed() {
        let upstream = RawUpstream::start(Answer::Ok).await;
        let pool = upstream.pool(Duration::ZERO);
        send_in_turn(&pool, 2).await;
        assert_eq!(upstream.connections(), 2);
        assert_eq!(pool.kept(), 1, "the expired one was dropped");
    }

    #[tokio::test]
    async fn each_serving_thread_has_connections_of_its_own() {
        let upstream = RawUpstream::start(Answer::Ok).await;
        let pool = upstream.pool(MINUTE);
        for lane in [0, 1, 0, 1] {
            use_lane(lane);
            send_ok(&pool).await;
        }
        use_lane(0);
        assert_eq!(upstream.connections(), 2);
    }

    #[tokio::test]
    async fn a_response_slower_than_the_timeout_on_a_kept_connection_times_out() {
        let upstream = RawUpstream::start(Answer::FirstThenStall).await;
        let timeout = Duration::from_millis(200);
        let pool = upstream.pool_with_timeout(MINUTE, timeout);
        send_ok(&pool).await;
        let error = pool.send(get(), None).await.unwrap_err();
        assert!(
            matches!(error, UpstreamError::Timeout(t) if t == timeout),
            "{error:?}"
        );
        assert_eq!(upstream.connections(), 1, "it was the kept connection");
        upstream.finish.add_permits(1);
    }

    /// An idle kept connection runs the kernel's keepalive timer (`tr` 2 in
    /// `/proc/net/tcp`), which is what finds an upstream that vanished while
    /// a response body was still coming.
    #[tokio::test]
    async fn upstream_connections_are_probed_while_idle() {
        let upstream = RawUpstream::start(Answer::Ok).await;
        let pool = upstream.pool(MINUTE);
        send_ok(&pool).await;
        let port = upstream
            .url
            .rsplit(':')
            .next()
            .unwrap()
            .parse::<u16>()
            .unwrap();
        let remote = format!("0100007F:{port:04X}");
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let timers: Vec<&str> = table
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .filter(|fields| fields.get(2) == Some(&remote.as_str()) && fields[3] == "01")
            .map(|fields| fields[5].split(':').next().unwrap())
            .collect();
        assert_eq!(
            timers,
            ["02"],
            "the proxy's side of the connection:\n{table}"
        );
    }

    /// Given up on, the connection is reset rather than closed, so that no
    /// byte of the request the kernel still holds reaches the upstream later.
    #[tokio::test]
    async fn a_connection_whose_response_timed_out_is_reset() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let pool = one_lane_pool(&url, Duration::from_millis(200));
        let (error, mut accepted) = tokio::join!(pool.send(get(), None), async {
            let (stream, _) = listener.accept().await.unwrap();
            read_request(stream).await
        });
        assert!(matches!(error, Err(UpstreamError::Timeout(_))), "{error:?}");
        assert_reset(&mut accepted).await;
    }

    /// The same through TLS, whose stream wraps the socket to reset.
    #[tokio::test]
    async fn an_https_connection_whose_response_timed_out_is_reset() {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        tls::install_crypto_provider();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let issuer = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, issuer.pem()).unwrap();
        let server = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let config = UpstreamConfig {
            url: url.clone(),
            timeout: Duration::from_millis(300),
            ca_file: Some(ca_file),
            ..Default::default()
        };
        let pool = Pool::new(&config, &url.parse().unwrap(), 1, MINUTE).unwrap();
        let (error, mut accepted) = tokio::join!(pool.send(get(), None), async {
            let (stream, _) = listener.accept().await.unwrap();
            read_request(acceptor.accept(stream).await.unwrap()).await
        });
        assert!(matches!(error, Err(UpstreamError::Timeout(_))), "{error:?}");
        assert_reset(&mut accepted).await;
    }

    /// Reads the first bytes of a request, then hands the stream back.
    async fn read_request<S: tokio::io::AsyncRead + Unpin>(mut stream: S) -> S {
        let read = stream.read(&mut [0u8; 1024]).await.unwrap();
        assert!(read > 0, "the request arrived");
        stream
    }

    async fn assert_reset<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) {
        let after = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut [0u8; 16]))
            .await
            .expect("the connection ended");
        assert_eq!(
            after.map_err(|error| error.kind()),
            Err(std::io::ErrorKind::ConnectionReset),
            "reset, not closed"
        );
    }

    /// The kept timer's deadline passed while the connection sat idle: the
    /// next request on it gets the whole timeout again.
    #[tokio::test]
    async fn a_connection_reused_after_a_timeout_has_passed_gets_a_new_deadline() {
        let upstream = RawUpstream::start(Answer::Ok).await;
        let timeout = Duration::from_millis(100);
        let pool = upstream.pool_with_timeout(MINUTE, timeout);
        send_ok(&pool).await;
        tokio::time::sleep(timeout * 3).await;
        send_in_turn(&pool, 2).await;
        assert_eq!(upstream.connections(), 1);
    }

    #[tokio::test]
    async fn an_unreachable_upstream_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let pool = one_lane_pool(&url, UpstreamConfig::default().timeout);
        let error = pool.send(get(), None).await.unwrap_err();
        assert!(matches!(error, UpstreamError::Connect(_)), "{error:?}");
    }

    #[tokio::test]
    async fn a_connection_not_made_within_the_timeout_is_a_connect_error() {
        // Accepts, then never answers the TLS handshake.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let _held = tokio::spawn(async move {
            let mut accepted = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                accepted.push(stream);
            }
        });
        let pool = one_lane_pool(&url, Duration::from_millis(200));
        let error = pool.send(get(), None).await.unwrap_err();
        assert!(
            matches!(&error, UpstreamError::Connect(message) if message.contains("200ms")),
            "{error:?}"
        );
    }
}
