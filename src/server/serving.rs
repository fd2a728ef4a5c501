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
//! all. The store's batch dispatchers are started lazily, so they run on the
//! thread whose request makes the first claim and serve every thread from
//! there.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::proxy::Proxy;
use crate::upstream::Peer;

/// How long a client may take to complete the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What every serving thread needs to serve webhook connections.
#[derive(Clone)]
pub(super) struct Webhooks {
    pub proxy: Arc<Proxy>,
    pub tls: Option<TlsAcceptor>,
    pub grace: Duration,
    pub header_read_timeout: Duration,
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
    drained: oneshot::Receiver<()>,
    release: oneshot::Sender<()>,
    join: JoinHandle<()>,
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
    pub async fn drain(self) -> DrainedThreads {
        drop(self.lanes);
        let mut threads = Vec::with_capacity(self.threads.len());
        for thread in self.threads {
            // An error means the thread is gone, which is as drained as it gets.
            let _ = thread.drained.await;
            threads.push((thread.release, thread.join));
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
        let join = std::thread::Builder::new()
            .name(format!("dedupe-serve-{lane}"))
            .spawn(move || {
                crate::upstream::use_lane(lane);
                runtime.block_on(async move {
                    serve(incoming, webhooks, open_here).await;
                    let _ = drained_tx.send(());
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
        };
        Ok((Lane { connections, open }, thread))
    }
}

/// Serves the connections handed to this thread until the sender closes,
/// then drains them within the grace period.
async fn serve(
    mut incoming: mpsc::UnboundedReceiver<Handover>,
    webhooks: Webhooks,
    open: Arc<AtomicUsize>,
) {
    let Webhooks {
        proxy,
        tls,
        grace,
        header_read_timeout,
    } = webhooks;
    let graceful = GracefulShutdown::new();
    let builder = Arc::new(super::connection_builder(header_read_timeout));
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
        let peer = Peer::new(addr, tls.is_some());
        let service = service_fn(move |request| {
            let (proxy, peer) = (Arc::clone(&proxy), peer.clone());
            async move { Ok::<_, std::convert::Infallible>(proxy.handle(request, peer).await) }
        });
        let (builder, watcher) = (Arc::clone(&builder), graceful.watcher());
        // One task type per transport: a task is as large as its largest
        // state, and a plain connection should not carry room for a TLS
        // session for as long as it stays open.
        match tls.clone() {
            None => tokio::spawn(async move {
                let connection = builder.serve_connection(TokioIo::new(stream), service);
                log_connection_end(watcher.watch(connection.into_owned()).await);
                drop(counted);
            }),
            Some(acceptor) => tokio::spawn(async move {
                let handshake =
                    tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream));
                let Ok(Ok(stream)) = handshake.await else {
                    tracing::debug!(%addr, "TLS handshake failed or timed out");
                    return;
                };
                let connection = builder.serve_connection(TokioIo::new(stream), service);
                log_connection_end(watcher.watch(connection.into_owned()).await);
                drop(counted);
            }),
        };
    }
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?grace,
            "shutdown grace period ended with requests still in flight"
        );
    }
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

fn log_connection_end<E: std::fmt::Display>(served: Result<(), E>) {
    if let Err(error) = served {
        tracing::debug!(%error, "webhook connection ended with an error");
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
}
