//! Keep-alive connections to the upstream, kept apart per serving thread: a
//! connection is opened, driven and used by one thread only, so a request
//! going out on it and its response coming back wake no other thread. Each
//! thread's connections are used newest first, and one left idle for the
//! idle timeout is closed the next time that thread looks for one.
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
use tokio::time::Sleep;
use tower_service::Service;

use super::{RequestBody, UpstreamError};
use crate::config::UpstreamConfig;
use crate::error_chain;
use crate::tls::{self, TlsError};

thread_local! {
    static LANE: Cell<usize> = const { Cell::new(0) };
}

/// Makes the calling thread use the connections of `lane` in every
/// [`Pool`]: each serving thread takes its own.
pub fn use_lane(lane: usize) {
    LANE.with(|current| current.set(lane));
}

type Sender = http1::SendRequest<RequestBody>;

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
}

/// A timer kept with its connection and reset for each request on it. Until
/// it is reset, its deadline may pass and wake the last request's task, which
/// is harmless.
type Deadline = Pin<Box<Sleep>>;

struct Idle {
    sender: Sender,
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
        connector.enforce_http(false);
        let tls = if url.scheme() == Some(&http::uri::Scheme::HTTPS) {
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
        })
    }

    /// Sends on one of this thread's open connections, or on a new one. A
    /// request that never left a kept-alive connection the upstream had
    /// closed (it restarted, or its keep-alive ran out) goes out again on
    /// another; one whose bytes were written is never resent.
    pub async fn send(
        &self,
        mut request: Request<RequestBody>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let until = tokio::time::Instant::now() + self.timeout;
        loop {
            let (mut sender, mut deadline, reused) = match self.checkout() {
                Some(Idle {
                    sender,
                    mut deadline,
                    ..
                }) => {
                    deadline.as_mut().reset(until);
                    (sender, deadline, true)
                }
                None => {
                    // A new timer, even on a retry: a timer stays with the
                    // connection it was made with, so that both belong to
                    // the runtime driving that connection.
                    let mut deadline = Box::pin(tokio::time::sleep_until(until));
                    let sender = tokio::select! {
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
                    (sender, deadline, false)
                }
            };
            let sent = tokio::select! {
                biased;
                sent = sender.try_send_request(request) => sent,
                () = &mut deadline => return Err(UpstreamError::Timeout(self.timeout)),
            };
            match sent {
                Ok(response) => {
                    // Back before the body is read: until the body ends the
                    // connection is not ready and checkout passes over it.
                    self.checkin(sender, deadline);
                    return Ok(response);
                }
                Err(mut error) => match error.take_message() {
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(UpstreamError::Failed(error_chain(&error.into_error()))),
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
            let sender = &kept[index].sender;
            if sender.is_closed() {
                kept.remove(index);
            } else if sender.is_ready() {
                return kept.remove(index);
            }
        }
        None
    }

    fn checkin(&self, sender: Sender, deadline: Deadline) {
        if !sender.is_closed() {
            self.lane().push_back(Idle {
                sender,
                deadline,
                since: Instant::now(),
            });
        }
    }

    async fn connect(&self) -> Result<Sender, UpstreamError> {
        let io = self
            .connector
            .clone()
            .call(self.origin.clone())
            .await
            .map_err(|error| UpstreamError::Connect(error_chain(&*error)))?;
        let (sender, connection) = http1::handshake(io)
            .await
            .map_err(|error| UpstreamError::Connect(error_chain(&error)))?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "upstream connection ended with an error");
            }
        });
        Ok(sender)
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
            let config = UpstreamConfig {
                url: self.url.clone(),
                timeout,
                ..Default::default()
            };
            tls::install_crypto_provider();
            Pool::new(&config, &self.url.parse().unwrap(), 2, idle_timeout).unwrap()
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
        let response = pool.send(get()).await.unwrap();
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
        let streaming = pool.send(get()).await.unwrap();
        let second = pool.send(get()).await.unwrap();
        assert_eq!(upstream.connections(), 2, "the first is still busy");
        upstream.finish.add_permits(2);
        let (first, second) = tokio::join!(body(streaming), body(second));
        assert_eq!((first, second), ("ok".into(), "ok".into()));
        let third = pool.send(get()).await.unwrap();
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
        let error = pool.send(get()).await.unwrap_err();
        assert!(
            matches!(error, UpstreamError::Timeout(t) if t == timeout),
            "{error:?}"
        );
        assert_eq!(upstream.connections(), 1, "it was the kept connection");
        upstream.finish.add_permits(1);
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
        let config = UpstreamConfig {
            url: url.clone(),
            ..Default::default()
        };
        tls::install_crypto_provider();
        let pool = Pool::new(&config, &url.parse().unwrap(), 1, MINUTE).unwrap();
        let error = pool.send(get()).await.unwrap_err();
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
        let config = UpstreamConfig {
            url: url.clone(),
            timeout: Duration::from_millis(200),
            ..Default::default()
        };
        tls::install_crypto_provider();
        let pool = Pool::new(&config, &url.parse().unwrap(), 1, MINUTE).unwrap();
        let error = pool.send(get()).await.unwrap_err();
        assert!(
            matches!(&error, UpstreamError::Connect(message) if message.contains("200ms")),
            "{error:?}"
        );
    }
}
