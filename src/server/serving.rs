//! Webhook connections are served by one thread per core, each running its
//! own current-thread runtime. A connection, the requests on it and the
//! pooled upstream connections they go out on are all driven by one thread,
//! so handing a request to the upstream client and its response back wakes
//! no other thread. On tokio's shared worker pool each request woke two or
//! three, and the scheduler took about a quarter of the proxy's CPU.
//!
//! One accept loop hands each new connection to the thread serving the
//! fewest, so connections opened in a burst are spread evenly; with an accept
//! loop per thread on a shared socket, the first thread to wake took them
//! all. The first thread is also the store's home: its runtime opens and
//! drives the database connections and runs the claim and settle batches for
//! every thread.
//!
//! Each connection is served by hyper's HTTP/1 server, or its HTTP/2 server
//! when the sender asks for HTTP/2 (ALPN over TLS, the connection preface
//! without).

use std::convert::Infallible;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Waker;
use std::thread::JoinHandle;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::{Service, service_fn};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulConnection;
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::http2_connection::{Counted, OpenRequests, serve_http2};
use super::timer::ConnectionTimer;
use super::write_stall::StalledWrites;
use crate::proxy::{Body, Proxy};
use crate::upstream::Peer;

/// What every serving thread needs to serve webhook connections.
#[derive(Clone)]
pub(super) struct Webhooks {
    pub proxy: Arc<Proxy>,
    pub tls: Option<TlsAcceptor>,
    pub grace: Duration,
    pub header_read_timeout: Duration,
    pub upstream_timeout: Duration,
}

/// A connection handed to a serving thread, with its sender's address.
type Handover = (std::net::TcpStream, SocketAddr);

/// The serving threads, idle until connections are handed to them.
pub(super) struct ServingThreads {
    lanes: Vec<Lane>,
    threads: Vec<ServingThread>,
}

/// Where connections reach one serving thread, and how many it serves.
struct Lane {
    connections: mpsc::UnboundedSender<Handover>,
    open: Arc<AtomicUsize>,
}

struct ServingThread {
    /// Whether the thread's grace period ended with requests in flight.
    drained: oneshot::Receiver<CutShort>,
    release: oneshot::Sender<()>,
    join: JoinHandle<()>,
    runtime: tokio::runtime::Handle,
}

/// Serving threads that have finished their grace period and keep running
/// their remaining tasks until released.
pub(super) struct DrainedThreads {
    threads: Vec<(oneshot::Sender<()>, JoinHandle<()>)>,
}

/// Marks a lane whose thread has stopped, so it is never the least busy.
const STOPPED: usize = usize::MAX;

impl ServingThreads {
    /// Starts `count` threads (at least one).
    pub fn start(count: usize, webhooks: &Webhooks) -> std::io::Result<Self> {
        let (mut lanes, mut threads) = (Vec::new(), Vec::new());
        for lane in 0..count.max(1) {
            let (connections, thread) = ServingThread::spawn(lane, webhooks.clone())?;
            lanes.push(connections);
            threads.push(thread);
        }
        Ok(Self { lanes, threads })
    }

    pub fn len(&self) -> usize {
        self.threads.len()
    }

    /// The runtime of the first serving thread (there is always one).
    pub fn first_runtime(&self) -> tokio::runtime::Handle {
        self.threads[0].runtime.clone()
    }

    /// Accepts connections until `stop` is cancelled.
    pub async fn accept(&self, listener: TcpListener, stop: &CancellationToken) {
        while let Some((stream, addr)) = super::accept_next(&listener, stop).await {
            let _ = stream.set_nodelay(true);
            match stream.into_std() {
                Ok(stream) => hand_over(&self.lanes, (stream, addr)),
                Err(error) => tracing::warn!(%addr, %error, "cannot hand a connection over"),
            }
        }
    }

    /// Stops handing out connections and waits until every thread has
    /// drained its connections or its grace period has ended.
    pub async fn drain(self, grace: Duration) -> DrainedThreads {
        drop(self.lanes);
        let mut threads = Vec::with_capacity(self.threads.len());
        let mut cut_short = false;
        for thread in self.threads {
            // An error means the thread is gone, which is as drained as it gets.
            cut_short |= thread.drained.await.is_ok_and(|CutShort(cut)| cut);
            threads.push((thread.release, thread.join));
        }
        if cut_short {
            tracing::warn!(
                ?grace,
                "shutdown grace period ended with requests still in flight"
            );
        }
        DrainedThreads { threads }
    }
}

/// Gives the connection to the thread serving the fewest.
fn hand_over(lanes: &[Lane], mut handover: Handover) {
    loop {
        let Some(lane) = lanes
            .iter()
            .filter(|lane| lane.open.load(Ordering::Relaxed) != STOPPED)
            .min_by_key(|lane| lane.open.load(Ordering::Relaxed))
        else {
            tracing::error!(addr = %handover.1, "every serving thread has stopped; connection dropped");
            return;
        };
        lane.open.fetch_add(1, Ordering::Relaxed);
        match lane.connections.send(handover) {
            Ok(()) => return,
            Err(returned) => {
                tracing::error!("a serving thread has stopped; its connections go to the others");
                lane.open.store(STOPPED, Ordering::Relaxed);
                handover = returned.0;
            }
        }
    }
}

impl DrainedThreads {
    /// Ends the threads, dropping whatever they still run, and waits for them.
    pub async fn release(self) {
        let joins: Vec<_> = self
            .threads
            .into_iter()
            .map(|(release, join)| {
                let _ = release.send(());
                join
            })
            .collect();
        let _ = tokio::task::spawn_blocking(move || {
            for join in joins {
                let _ = join.join();
            }
        })
        .await;
    }
}

impl ServingThread {
    fn spawn(lane: usize, webhooks: Webhooks) -> std::io::Result<(Lane, Self)> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (connections, incoming) = mpsc::unbounded_channel();
        let (drained_tx, drained) = oneshot::channel();
        let (release, released) = oneshot::channel::<()>();
        let open = Arc::new(AtomicUsize::new(0));
        let open_here = Arc::clone(&open);
        let handle = runtime.handle().clone();
        let join = std::thread::Builder::new()
            .name(format!("dedupe-serve-{lane}"))
            .spawn(move || {
                crate::upstream::use_lane(lane);
                runtime.block_on(async move {
                    let cut_short = serve(incoming, webhooks, open_here).await;
                    let _ = drained_tx.send(cut_short);
                    // Background settles, requests still running past the
                    // grace period and store connections opened here keep
                    // going until the open claims have been settled.
                    let _ = released.await;
                });
            })?;
        let thread = Self {
            drained,
            release,
            join,
            runtime: handle,
        };
        Ok((Lane { connections, open }, thread))
    }
}

/// Whether a thread's grace period ended before its connections did.
struct CutShort(bool);

/// Serves the connections handed to this thread until the sender closes,
/// then drains them within the grace period.
async fn serve(
    mut incoming: mpsc::UnboundedReceiver<Handover>,
    webhooks: Webhooks,
    open: Arc<AtomicUsize>,
) -> CutShort {
    let Webhooks {
        proxy,
        tls,
        grace,
        header_read_timeout,
        upstream_timeout,
    } = webhooks;
    let connections = TaskTracker::new();
    let http = Arc::new(Http {
        http1: super::http1_builder(header_read_timeout),
        http2: super::http2_builder(),
        http2_idle: header_read_timeout,
        http2_send_stall: upstream_timeout,
    });
    let closing = Closing::default();
    while let Some((stream, addr)) = incoming.recv().await {
        let counted = OpenConnection(Arc::clone(&open));
        let stream = match TcpStream::from_std(stream) {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%addr, %error, "cannot serve a handed-over connection");
                continue;
            }
        };
        let proxy = Arc::clone(&proxy);
        let counter = Arc::clone(&proxy);
        let peer = Peer::new(addr, tls.is_some());
        let service = service_fn(move |request| {
            let (proxy, peer) = (Arc::clone(&proxy), peer.clone());
            async move { Ok::<_, Infallible>(proxy.handle(request, peer).await) }
        });
        let (http, closing) = (Arc::clone(&http), closing.clone());
        // One task type per transport: a task is as large as its largest
        // state, and a plain connection should not carry room for a TLS
        // session for as long as it stays open.
        match tls.clone() {
            None => connections.spawn(async move {
                // Bounded like the headers that follow: a sender that
                // connects and sends nothing is closed too.
                let sniffed = tokio::time::timeout(header_read_timeout, sniff(&stream));
                let Some(sniffed) = closing.token.run_until_cancelled(sniffed).await else {
                    return;
                };
                let Ok(Ok(protocol)) = sniffed else {
                    tracing::debug!(%addr, "no request began within the header read timeout");
                    return;
                };
                let stream = StalledWrites::new(stream, upstream_timeout);
                http.serve(TokioIo::new(stream), protocol, service, &closing, &counter)
                    .await;
                drop(counted);
            }),
            Some(acceptor) => connections.spawn(async move {
                // The handshake is the connection's first bytes, bounded as
                // they are without TLS.
                let stream = StalledWrites::new(stream, upstream_timeout);
                let handshake = tokio::time::timeout(header_read_timeout, acceptor.accept(stream));
                let Some(handshake) = closing.token.run_until_cancelled(handshake).await else {
                    return;
                };
                let Ok(Ok(stream)) = handshake else {
                    tracing::debug!(%addr, "TLS handshake failed or timed out");
                    return;
                };
                let protocol = match stream.get_ref().1.alpn_protocol() {
                    Some(b"h2") => Protocol::Http2,
                    _ => Protocol::Http1,
                };
                http.serve(TokioIo::new(stream), protocol, service, &closing, &counter)
                    .await;
                drop(counted);
            }),
        };
    }
    closing.begin();
    connections.close();
    CutShort(
        tokio::time::timeout(grace, connections.wait())
            .await
            .is_err(),
    )
}

/// The HTTP/2 connection preface (RFC 9113 section 3.4): what a sender
/// speaking HTTP/2 without TLS sends before anything else.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a webhook connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// Which protocol a sender without TLS speaks, from the bytes it sends
/// first. They are peeked, not read, so that hyper's HTTP/1 server reads the
/// request itself, whole. Handed bytes read beforehand, its first read
/// returned only those, the second found its buffer partly full, and the
/// buffer doubled to 16 KiB for the life of the connection.
async fn sniff(stream: &TcpStream) -> std::io::Result<Protocol> {
    let mut first = [0; H2_PREFACE.len()];
    let mut sender_closed = false;
    loop {
        let seen = stream.peek(&mut first).await?;
        // An empty peek is the sender closing: HTTP/1 ends that quietly.
        if seen == 0 || first[..seen] != H2_PREFACE[..seen] {
            return Ok(Protocol::Http1);
        }
        if seen == H2_PREFACE.len() {
            return Ok(Protocol::Http2);
        }
        // Part of the preface, and no more is coming: HTTP/1 answers what
        // it can of those bytes and ends the connection.
        if sender_closed {
            return Ok(Protocol::Http1);
        }
        // Marking the socket not readable makes the next peek wait for more
        // bytes instead of seeing these again; but a sender's close is a
        // readiness never cleared, and would have every peek return these
        // bytes at once, in a loop.
        let _ = stream.try_io(Interest::READABLE, || {
            Err::<(), _>(std::io::ErrorKind::WouldBlock.into())
        });
        sender_closed = stream.ready(Interest::READABLE).await?.is_read_closed();
    }
}

/// hyper's servers for both protocols, shared by a thread's connections.
struct Http {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
    /// How long an HTTP/2 connection may go without an open request: as
    /// long as an HTTP/1 connection may wait for a request's head.
    http2_idle: Duration,
    /// How long an HTTP/2 sender may take nothing of a response (see
    /// `sender_stall`): as long as the upstream may send nothing of it.
    http2_send_stall: Duration,
}

impl Http {
    /// Serves the connection until it ends, and logs an end in error.
    async fn serve<I, S>(
        &self,
        io: I,
        protocol: Protocol,
        service: S,
        closing: &Closing,
        proxy: &Proxy,
    ) where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
        S: Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>
            + Send
            + 'static,
        S::Future: Send + 'static,
    {
        let served = match protocol {
            Protocol::Http1 => {
                let mut http1 = self.http1.clone();
                http1.timer(ConnectionTimer::default());
                closing.watch(http1.serve_connection(io, service)).await
            }
            // Boxed: HTTP/1 connections, nearly all of them, would otherwise
            // carry room for an HTTP/2 one for as long as they stay open.
            Protocol::Http2 => {
                let requests = Arc::new(OpenRequests::default());
                let service = Counted {
                    service,
                    requests: Arc::clone(&requests),
                    send_stall: self.http2_send_stall,
                };
                let connection = self.http2.serve_connection(io, service);
                Box::pin(serve_http2(
                    connection,
                    &closing.token,
                    &requests,
                    self.http2_idle,
                ))
                .await
            }
        };
        match served {
            Ok(()) => {}
            // hyper has answered it (400 or 431) and closes the
            // connection; the request never reached the proxy's handler.
            Err(error) if error.is_parse() => {
                proxy.count_unparsable_request();
                tracing::debug!(%error, "request refused: malformed or over the header limits");
            }
            Err(error) => tracing::debug!(%error, "webhook connection ended with an error"),
        }
    }
}

/// Shutdown as one serving thread's connections see it. When it begins, a
/// connection that has not started a request is closed, and the others
/// finish the request in hand and close.
#[derive(Clone, Default)]
struct Closing {
    /// Set before `token` is cancelled. A connection reads it on every poll
    /// (several per request); checking the token itself takes a lock.
    begun: Arc<AtomicBool>,
    token: CancellationToken,
}

impl Closing {
    fn begin(&self) {
        self.begun.store(true, Ordering::Release);
        self.token.cancel();
    }

    /// Serves `connection` to its end, asking it to finish gracefully once
    /// shutdown begins.
    async fn watch<C: GracefulConnection>(&self, connection: C) -> C::Output {
        let mut connection = pin!(connection);
        let mut cancelled = pin!(self.token.cancelled());
        let mut watch = Watch::Unregistered;
        poll_fn(|cx| {
            match &watch {
                Watch::Told => {}
                Watch::Waiting(waker)
                    if waker.will_wake(cx.waker()) && !self.begun.load(Ordering::Acquire) => {}
                _ => {
                    if cancelled.as_mut().poll(cx).is_ready() {
                        watch = Watch::Told;
                        connection.as_mut().graceful_shutdown();
                    } else {
                        watch = Watch::Waiting(cx.waker().clone());
                    }
                }
            }
            connection.as_mut().poll(cx)
        })
        .await
    }
}

/// Where a connection stands with the shutdown.
enum Watch {
    Unregistered,
    /// The cancellation will wake this task; until shutdown begins or
    /// another task polls the connection, it need not be polled again.
    Waiting(Waker),
    /// Asked to finish gracefully.
    Told,
}

/// Counts a connection against its thread until the connection ends.
struct OpenConnection(Arc<AtomicUsize>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        // A stopped thread's count stays marked, whatever it drops later.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |open| {
                (open != STOPPED).then(|| open - 1)
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Connections {
        listener: std::net::TcpListener,
        clients: Vec<std::net::TcpStream>,
    }

    impl Connections {
        fn new() -> Self {
            Self {
                listener: std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
                clients: Vec::new(),
            }
        }

        fn accept(&mut self) -> Handover {
            let addr = self.listener.local_addr().unwrap();
            self.clients
                .push(std::net::TcpStream::connect(addr).unwrap());
            self.listener.accept().unwrap()
        }
    }

    fn lanes(count: usize) -> (Vec<Lane>, Vec<mpsc::UnboundedReceiver<Handover>>) {
        (0..count)
            .map(|_| {
                let (connections, incoming) = mpsc::unbounded_channel();
                let open = Arc::new(AtomicUsize::new(0));
                (Lane { connections, open }, incoming)
            })
            .unzip()
    }

    fn open(lanes: &[Lane]) -> Vec<usize> {
        lanes
            .iter()
            .map(|lane| lane.open.load(Ordering::Relaxed))
            .collect()
    }

    #[test]
    fn a_burst_of_connections_is_spread_over_the_threads() {
        let (lanes, mut incoming) = lanes(2);
        let mut connections = Connections::new();
        for _ in 0..6 {
            hand_over(&lanes, connections.accept());
        }
        assert_eq!(open(&lanes), [3, 3]);
        for queue in &mut incoming {
            assert_eq!(queue.len(), 3);
        }
    }

    #[test]
    fn a_new_connection_goes_to_the_thread_serving_the_fewest() {
        let (lanes, _incoming) = lanes(2);
        let mut connections = Connections::new();
        for _ in 0..4 {
            hand_over(&lanes, connections.accept());
        }
        drop(OpenConnection(Arc::clone(&lanes[1].open)));
        drop(OpenConnection(Arc::clone(&lanes[1].open)));
        assert_eq!(open(&lanes), [2, 0]);
        hand_over(&lanes, connections.accept());
        hand_over(&lanes, connections.accept());
        assert_eq!(open(&lanes), [2, 2]);
    }

    #[test]
    fn a_stopped_thread_gets_no_more_connections() {
        let (lanes, mut incoming) = lanes(2);
        drop(incoming.remove(0));
        let mut connections = Connections::new();
        for _ in 0..3 {
            hand_over(&lanes, connections.accept());
        }
        assert_eq!(open(&lanes), [STOPPED, 3]);
        assert_eq!(incoming[0].len(), 3);
        drop(OpenConnection(Arc::clone(&lanes[0].open)));
        assert_eq!(
            open(&lanes)[0],
            STOPPED,
            "still marked after its connections end"
        );
    }

    #[test]
    fn with_every_thread_stopped_a_connection_is_closed() {
        let (lanes, incoming) = lanes(1);
        drop(incoming);
        let mut connections = Connections::new();
        hand_over(&lanes, connections.accept());
        let mut client = connections.clients.pop().unwrap();
        let mut buffer = [0; 1];
        let read = std::io::Read::read(&mut client, &mut buffer);
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "the connection stayed open: {read:?}"
        );
    }

    /// A connected pair: what the sender writes, and the proxy's end.
    async fn socket_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let sender = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        (sender, accepted)
    }

    #[tokio::test]
    async fn sniffing_tells_http1_from_the_http2_preface_and_consumes_nothing() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        for (first, protocol) in [
            (&b"POST /hooks HTTP/1.1\r\n"[..], Protocol::Http1),
            (b"PRI * HTTP/1.1\r\n", Protocol::Http1),
            (H2_PREFACE, Protocol::Http2),
        ] {
            let (mut sender, mut accepted) = socket_pair().await;
            sender.write_all(first).await.unwrap();
            assert_eq!(sniff(&accepted).await.unwrap(), protocol);
            let mut read = vec![0; first.len()];
            accepted.read_exact(&mut read).await.unwrap();
            assert_eq!(read, first, "the bytes are still there to be read");
        }
    }

    #[tokio::test]
    async fn a_sender_that_closes_at_once_is_left_to_http1() {
        let (sender, accepted) = socket_pair().await;
        drop(sender);
        assert_eq!(sniff(&accepted).await.unwrap(), Protocol::Http1);
    }

    /// A sender that closes after part of the preface sends nothing more:
    /// waiting for the rest would wake at once, again and again, until the
    /// header read timeout.
    #[tokio::test]
    async fn a_sender_that_closes_after_part_of_the_preface_is_left_to_http1() {
        use tokio::io::AsyncWriteExt;
        for part in [&b"P"[..], &H2_PREFACE[..23]] {
            let (mut sender, accepted) = socket_pair().await;
            sender.write_all(part).await.unwrap();
            sender.shutdown().await.unwrap();
            let sniffed = tokio::time::timeout(Duration::from_secs(30), sniff(&accepted))
                .await
                .expect("sniffing ends once the sender has closed");
            assert_eq!(sniffed.unwrap(), Protocol::Http1);
        }
    }

    /// On loopback, written bytes are in the receiving socket when the write
    /// returns, so the first poll sees exactly this part of the preface.
    #[tokio::test]
    async fn a_preface_split_across_writes_is_waited_for() {
        use futures_util::FutureExt;
        use tokio::io::AsyncWriteExt;
        let (mut sender, accepted) = socket_pair().await;
        let (head, rest) = H2_PREFACE.split_at(10);
        sender.write_all(head).await.unwrap();
        let sniffing = sniff(&accepted);
        tokio::pin!(sniffing);
        assert!(
            (&mut sniffing).now_or_never().is_none(),
            "decided on part of the preface"
        );
        sender.write_all(rest).await.unwrap();
        assert_eq!(sniffing.await.unwrap(), Protocol::Http2);
    }
}
