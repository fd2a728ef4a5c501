//! Listeners and lifecycle: binds the webhook and admin ports, runs the
//! start-up migration in the background until the store answers, runs the
//! background pruner, serves connections, and drains them on shutdown within
//! the grace period before settling the claims still open.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

mod http2_connection;
mod sender_stall;
mod serving;
mod timer;
mod write_stall;

use serving::{ServingThreads, Webhooks};

use crate::admin::{Admin, Schema};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::prune::{PrunePlan, Pruner};
use crate::store::{Store, StoreError};
use crate::tls::{CertificateReloader, TlsError};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_rustls::TlsAcceptor;

/// Header fields per request; more get 431.
const MAX_HEADERS: usize = 100;
/// Request head size (request line and header fields), over HTTP/2 and
/// HTTP/1; also HTTP/1's read buffer, which holds a head while it is parsed.
/// hyper's own HTTP/1 bound is its read buffer's, about 400 KiB, which a
/// sender could make a connection hold for `limits.header_read_timeout` by
/// sending a head that never ends.
const MAX_HEADER_LIST_BYTES: u32 = 64 * 1024;

/// How long accepting pauses after an error that is not one connection's.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Why the proxy could not start. Each message leaves its cause to the
/// error's source, so printing the chain (`{:#}`) names it once.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A listener could not bind.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The store could not be opened (SQLite file, bad URL).
    #[error("cannot open the store")]
    Store(#[from] StoreError),
    /// A route could not be built (a secret became unreadable).
    #[error("{0}")]
    Route(String),
    /// The TLS certificate or key could not be loaded.
    #[error("tls")]
    Tls(#[from] TlsError),
    /// A webhook serving thread could not be started.
    #[error("cannot start a serving thread")]
    ServingThread(#[source] std::io::Error),
}

/// A bound, not yet running proxy.
pub struct Application {
    proxy: Arc<Proxy>,
    admin: Arc<Admin>,
    webhook_listener: TcpListener,
    serving: ServingThreads,
    admin_listener: TcpListener,
    tls: Option<Arc<CertificateReloader>>,
    pruner: Pruner,
    prune_interval: Duration,
    migrate: bool,
    shutdown_grace: Duration,
}

impl Application {
    /// Opens the store, binds both listeners (port 0 picks a free port) and
    /// starts the webhook serving threads, which get no connections until
    /// [`Application::run_until_stopped`].
    pub async fn build(config: &Config) -> Result<Self, StartError> {
        crate::tls::install_crypto_provider();
        let tls = match &config.tls {
            Some(tls) => Some(CertificateReloader::load(&tls.cert_file, &tls.key_file)?),
            None => None,
        };
        let metrics = Metrics::new();
        let store = Store::open(&config.store)?.counted_in(metrics.clone());
        metrics.start_at_zero(config.routes.iter().map(|route| route.name.as_str()));
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { addr, source })
        };
        let webhook_listener = bind(config.listen).await?;
        let admin_listener = bind(config.admin_listen).await?;
        let admin = Arc::new(Admin {
            metrics: metrics.clone(),
            store: store.clone(),
            schema: Arc::new(Schema::new(!config.store.migrate)),
            shutting_down: AtomicBool::new(false),
        });
        let pruner = Pruner::new(store.clone(), PrunePlan::new(config, None), metrics.clone());
        let lanes = serving_threads();
        let proxy = Arc::new(Proxy::new(config, store, metrics, lanes).map_err(StartError::Route)?);
        let webhooks = Webhooks {
            proxy: Arc::clone(&proxy),
            tls: tls
                .as_ref()
                .map(|reloader| TlsAcceptor::from(reloader.server_config())),
            grace: config.shutdown_grace,
            header_read_timeout: config.limits.header_read_timeout,
            upstream_timeout: config.upstream.timeout,
        };
        let serving = ServingThreads::start(lanes, &webhooks).map_err(StartError::ServingThread)?;
        // The first serving thread talks to the database for all of them: a
        // request it serves wakes no other thread on its way to the store.
        proxy.store().set_home(serving.first_runtime());
        Ok(Self {
            proxy,
            admin,
            webhook_listener,
            serving,
            admin_listener,
            tls,
            pruner,
            prune_interval: config.store.prune_interval,
            migrate: config.store.migrate,
            shutdown_grace: config.shutdown_grace,
        })
    }

    /// Where webhooks are accepted.
    pub fn webhook_addr(&self) -> SocketAddr {
        self.webhook_listener.local_addr().expect("bound listener")
    }

    /// Where the admin endpoints are served.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_listener.local_addr().expect("bound listener")
    }

    /// Serves until `stop` is cancelled, then drains and settles.
    pub async fn run_until_stopped(self, stop: CancellationToken) {
        // Listened for with or without TLS, and before anything answers:
        // SIGHUP's default action ends the process on the spot, without the
        // drain or the final settles.
        let hangups = signal(SignalKind::hangup());
        tracing::info!(
            listen = %self.webhook_addr(),
            admin_listen = %self.admin_addr(),
            serving_threads = self.serving.len(),
            "dedupe-proxy serving"
        );
        if self.migrate {
            tokio::spawn(migrate_until_done(
                self.proxy.store().clone(),
                Arc::clone(&self.admin.schema),
                stop.clone(),
            ));
        } else {
            tokio::spawn(check_table_at_start(self.proxy.store().clone()));
        }
        if self.proxy.store().has_one_writer_at_a_time() {
            tokio::spawn(watch_the_database_file(
                self.proxy.store().clone(),
                stop.clone(),
            ));
        }
        let pruner_task = tokio::spawn(self.pruner.run(self.prune_interval, stop.clone()));
        tokio::spawn(crate::telemetry::report_dropped_lines(
            DROPPED_LINES_REPORT_INTERVAL,
            stop.clone(),
        ));
        let admin = Arc::clone(&self.admin);
        // The admin endpoints outlive the webhook listener: through the
        // drain `/readyz` says so and `/metrics` can still be scraped.
        let admin_stop = CancellationToken::new();
        let admin_task = tokio::spawn(serve_admin(self.admin_listener, admin, admin_stop.clone()));
        tokio::spawn(reload_on_sighup(hangups, self.tls, stop.clone()));
        self.serving.accept(self.webhook_listener, &stop).await;
        self.admin.shutting_down.store(true, Ordering::Release);
        let deadline = Instant::now() + self.shutdown_grace;
        let drained = self.serving.drain(self.shutdown_grace).await;
        // A webhook whose HTTP/2 sender has gone (a stream or connection
        // reset) is no connection's any more (an HTTP/1 connection waits
        // for its webhook whatever its sender does): released now, a
        // delivery the application may yet complete would be forwarded
        // again on the sender's retry. Past the deadline the drain has said
        // so already.
        if Instant::now() < deadline && !self.proxy.finish_webhooks(deadline).await {
            tracing::warn!(
                grace = ?self.shutdown_grace,
                "shutdown grace period ended with webhooks still being processed"
            );
        }
        let settles = self
            .proxy
            .open_claims()
            .settle_all(self.proxy.store(), deadline)
            .await;
        if settles.open > 0 {
            tracing::warn!(
                open = settles.open,
                outcomes_written = settles.outcomes_written,
                released = settles.released,
                unwritten = settles.unwritten,
                already_settled = settles.already_settled,
                "claims still open at shutdown: known outcomes written, the rest released"
            );
        }
        if !self.proxy.store().finish_releases(deadline.into()).await {
            tracing::warn!(
                grace = ?self.shutdown_grace,
                "shutdown grace period ended with claims answered as timed out still at the store: any that win stay processing until their leases expire (dedupe-proxy keys release frees them)"
            );
        }
        drained.release().await;
        admin_stop.cancel();
        let _ = admin_task.await;
        let _ = pruner_task.await;
        tracing::info!("dedupe-proxy stopped");
    }
}

/// How often dropped log lines are reported.
const DROPPED_LINES_REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// How many threads serve webhooks: one per core the process may use.
fn serving_threads() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// The next connection on `listener`, or `None` once `stop` is cancelled.
/// Failures are logged, with a pause after those that are not one
/// connection's own.
async fn accept_next(
    listener: &TcpListener,
    stop: &CancellationToken,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        let error = tokio::select! {
            () = stop.cancelled() => return None,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => return Some(accepted),
                Err(error) => error,
            },
        };
        let local = listener.local_addr().ok();
        tracing::warn!(?local, %error, "accept failed");
        if let Some(pause) = pause_after(&error) {
            tokio::select! {
                () = stop.cancelled() => return None,
                () = tokio::time::sleep(pause) => {}
            }
        }
    }
}

/// How long to stop accepting after `error`. One connection's failure
/// (reset or aborted before it was accepted) leaves the next accept fine;
/// anything else, such as running out of file descriptors or memory, fails
/// again at once until a connection closes, and retrying without a pause
/// would spin a core and flood the log.
fn pause_after(error: &std::io::Error) -> Option<Duration> {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset, Interrupted};
    match error.kind() {
        ConnectionAborted | ConnectionRefused | ConnectionReset | Interrupted => None,
        _ => Some(ACCEPT_ERROR_PAUSE),
    }
}

async fn serve_admin(listener: TcpListener, admin: Arc<Admin>, stop: CancellationToken) {
    let builder = http1_builder(Duration::from_secs(30));
    loop {
        let Some((stream, _)) = accept_next(&listener, &stop).await else {
            return;
        };
        let admin = Arc::clone(&admin);
        let service = service_fn(move |request| {
            let admin = Arc::clone(&admin);
            async move { Ok::<_, std::convert::Infallible>(admin.handle(request).await) }
        });
        let connection = builder.serve_connection(io(stream), service);
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = connection => {}
                () = stop.cancelled() => {}
            }
        });
    }
}

/// hyper's HTTP/1 server, as both listeners use it.
fn http1_builder(header_read_timeout: Duration) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        // Otherwise hyper reads the socket while a request is in flight, to
        // notice a sender that went away. That read finds the connection's
        // buffer still shared with the request's head and allocates a new
        // 8 KiB one, on every request (with glibc's malloc, 10% of the CPU
        // per pass-through request at 256 senders). A sender that goes away
        // is noticed when its answer is written instead, and one that only
        // shut down its sending side still gets its answer.
        .half_close(true)
        .max_headers(MAX_HEADERS)
        .max_header_size(MAX_HEADER_LIST_BYTES as usize)
        .max_buf_size(MAX_HEADER_LIST_BYTES as usize);
    builder
}

/// Streams an HTTP/2 connection may have open at once: RFC 9113's
/// recommended least (hyper's default is 200).
const HTTP2_MAX_STREAMS: u32 = 100;

/// Bytes of a response an HTTP/2 stream holds while its sender does not
/// take them: an HTTP/1 connection's buffer (hyper's default is 400 KiB).
/// A response is released from `max_concurrent_requests` once its head is
/// made, so what bounds its memory is this, times the streams.
const HTTP2_SEND_BUFFER_BYTES: usize = MAX_HEADER_LIST_BYTES as usize;

/// hyper's HTTP/2 server, for webhook senders that ask for HTTP/2.
fn http2_builder() -> http2::Builder<TokioExecutor> {
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEADER_LIST_BYTES)
        .max_concurrent_streams(HTTP2_MAX_STREAMS)
        .max_send_buf_size(HTTP2_SEND_BUFFER_BYTES);
    builder
}

/// Re-reads the certificate and key on SIGHUP; a bad pair is logged and the
/// previous one kept.
async fn reload_on_sighup(
    hangups: std::io::Result<Signal>,
    reloader: Option<Arc<CertificateReloader>>,
    stop: CancellationToken,
) {
    let mut hangups = match hangups {
        Ok(hangups) => hangups,
        Err(error) => {
            tracing::warn!(%error, "cannot listen for SIGHUP; TLS certificates will not be reloaded");
            return;
        }
    };
    let latest = Arc::new(AtomicU64::new(0));
    let reading = Arc::new(AtomicUsize::new(0));
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = hangups.recv() => match &reloader {
                None => tracing::info!("SIGHUP: no TLS listener, nothing to reload"),
                // Each stuck read keeps its thread for good: bounded, so
                // that a renewal job signalling over a hung mount does not
                // pile them up.
                Some(_) if reading.load(Ordering::Relaxed) >= MAX_RELOADS_READING => {
                    tracing::error!(
                        error = %format!("{MAX_RELOADS_READING} earlier reloads are still reading tls.cert_file and tls.key_file"),
                        "{NOT_RELOADED}"
                    );
                }
                Some(reloader) => {
                    // Counted here, not in the task: the next SIGHUP may
                    // come before the task has run.
                    reading.fetch_add(1, Ordering::Relaxed);
                    let this = latest.fetch_add(1, Ordering::Relaxed) + 1;
                    let reload = reload(
                        Arc::clone(reloader),
                        this,
                        Arc::clone(&latest),
                        Arc::clone(&reading),
                    );
                    tokio::spawn(stop.clone().run_until_cancelled_owned(reload));
                }
            },
        }
    }
}

const NOT_RELOADED: &str = "SIGHUP: TLS certificate not reloaded; keeping the previous one";

/// Most reloads reading their files at once, each on a thread of its own.
const MAX_RELOADS_READING: usize = 4;

/// How often the SQLite database's path is checked to still lead to the
/// file the proxy opened.
const DATABASE_FILE_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// Logs an error when the SQLite database's file is deleted, moved or
/// replaced under the running proxy (once, until it is back): every write
/// from then on is lost when the proxy stops, and `/readyz`, which says so
/// too, may have no one polling it (a compose service without a health
/// check).
async fn watch_the_database_file(store: Store, stop: CancellationToken) {
    let mut checks = tokio::time::interval(DATABASE_FILE_CHECK_INTERVAL);
    checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut said = false;
    while stop.run_until_cancelled(checks.tick()).await.is_some() {
        match store.file_gone() {
            Some(gone) if !said => {
                tracing::error!(error = %gone, "the SQLite database is no longer where the proxy opened it");
                said = true;
            }
            Some(_) => {}
            None => said = false,
        }
    }
}

/// Longest a reload waits for its files to be read before it is given up.
const RELOAD_READ_LIMIT: Duration = Duration::from_secs(10);

/// One SIGHUP's reload, counted in `reading` by its caller until its read
/// returns. The files are read on a thread of their own, not
/// the runtime's: a read that never returns (a FIFO, a hung network mount)
/// would otherwise hold a worker, and the runtime's shutdown with it, and
/// keep every later SIGHUP from reloading. The latest SIGHUP decides: a
/// read that comes back after a later SIGHUP's is dropped.
async fn reload(
    reloader: Arc<CertificateReloader>,
    this: u64,
    latest: Arc<AtomicU64>,
    reading: Arc<AtomicUsize>,
) {
    let (done, read) = tokio::sync::oneshot::channel();
    let reader = Arc::clone(&reloader);
    let still_reading = Arc::clone(&reading);
    let started = std::thread::Builder::new()
        .name("dedupe-tls-reload".into())
        .spawn(move || {
            let read = reader.read();
            still_reading.fetch_sub(1, Ordering::Relaxed);
            let _ = done.send(read);
        });
    if let Err(error) = started {
        reading.fetch_sub(1, Ordering::Relaxed);
        tracing::error!(%error, "{NOT_RELOADED}");
        return;
    }
    let read = tokio::time::timeout(RELOAD_READ_LIMIT, read).await;
    // A later SIGHUP's reload says what became of the pair; this one's
    // outcome, a failure included, would contradict it.
    if latest.load(Ordering::Relaxed) != this {
        tracing::debug!("SIGHUP: a later SIGHUP's reload supersedes this one");
        return;
    }
    match read {
        Err(_) => tracing::error!(
            error = %format!(
                "reading tls.cert_file and tls.key_file took longer than {}",
                crate::config::format_duration(RELOAD_READ_LIMIT)
            ),
            "{NOT_RELOADED}"
        ),
        Ok(Err(_)) => tracing::error!(error = "the reading thread failed", "{NOT_RELOADED}"),
        Ok(Ok(Err(error))) => tracing::error!(%error, "{NOT_RELOADED}"),
        Ok(Ok(Ok(pair))) => {
            reloader.install(pair);
            tracing::info!("SIGHUP: TLS certificate reloaded");
        }
    }
}

fn io(stream: TcpStream) -> TokioIo<TcpStream> {
    let _ = stream.set_nodelay(true);
    TokioIo::new(stream)
}

/// With `store.migrate: false` nothing looks at the table before the first
/// claim: a missing or unusable one is said at start-up, and not only by
/// `/readyz` and each webhook refused for it.
async fn check_table_at_start(store: Store) {
    match store.ping().await {
        Ok(()) => tracing::info!("store schema is ready"),
        Err(error) => tracing::warn!(%error, "the store cannot take claims yet"),
    }
}

/// The longest wait between two start-up migration attempts: the proxy is
/// unready until one succeeds, so a store that comes back is noticed soon.
const MIGRATION_RETRY_CAP: Duration = Duration::from_secs(2);
/// How often the same migration failure is repeated at `warn`.
const MIGRATION_WARNING_INTERVAL: Duration = Duration::from_secs(30);

async fn migrate_until_done(store: Store, schema: Arc<Schema>, stop: CancellationToken) {
    let mut delay = Duration::from_millis(200);
    // Each error's last warning: several hosts may fail in turns.
    let mut warned: HashMap<String, Instant> = HashMap::new();
    loop {
        match store.migrate().await {
            Ok(_) => {
                schema.set_ready();
                tracing::info!("store schema is ready");
                return;
            }
            Err(error) => {
                let error = error.to_string();
                let now = Instant::now();
                if repeats_recent_warning(&warned, &error, now) {
                    tracing::debug!(%error, retry_in = ?delay, "store migration failed; retrying");
                } else {
                    tracing::warn!(%error, retry_in = ?delay, "store migration failed; retrying");
                    warned.retain(|_, at| repeats_within_interval(*at, now));
                    warned.insert(error.clone(), now);
                }
                schema.set_failure(error);
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(MIGRATION_RETRY_CAP);
    }
}

/// Whether `error` was last warned about less than
/// [`MIGRATION_WARNING_INTERVAL`] before `now`.
fn repeats_recent_warning(warned: &HashMap<String, Instant>, error: &str, now: Instant) -> bool {
    warned
        .get(error)
        .is_some_and(|at| repeats_within_interval(*at, now))
}

fn repeats_within_interval(warned_at: Instant, now: Instant) -> bool {
    now.saturating_duration_since(warned_at) < MIGRATION_WARNING_INTERVAL
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lasting_migration_failure_is_warned_about_when_it_changes_or_now_and_then() {
        let start = Instant::now();
        let mut warned = HashMap::new();
        assert!(!repeats_recent_warning(
            &warned,
            "connection refused",
            start
        ));
        warned.insert("connection refused".to_owned(), start);
        let soon = start + MIGRATION_RETRY_CAP;
        assert!(repeats_recent_warning(&warned, "connection refused", soon));
        assert!(!repeats_recent_warning(
            &warned,
            "password authentication failed",
            soon
        ));
        // Two hosts failing in turns: each error is remembered on its own.
        warned.insert("password authentication failed".to_owned(), soon);
        let next = soon + MIGRATION_RETRY_CAP;
        assert!(repeats_recent_warning(&warned, "connection refused", next));
        assert!(repeats_recent_warning(
            &warned,
            "password authentication failed",
            next
        ));
        let later = start + MIGRATION_WARNING_INTERVAL;
        assert!(!repeats_recent_warning(
            &warned,
            "connection refused",
            later
        ));
    }

    #[test]
    fn accepting_pauses_after_running_out_of_descriptors_but_not_after_a_reset() {
        const EMFILE: i32 = 24;
        const ENFILE: i32 = 23;
        for exhausted in [EMFILE, ENFILE] {
            let error = std::io::Error::from_raw_os_error(exhausted);
            assert_eq!(pause_after(&error), Some(ACCEPT_ERROR_PAUSE), "{error}");
        }
        for one_connection in [
            std::io::ErrorKind::ConnectionAborted,
            std::io::ErrorKind::ConnectionReset,
        ] {
            assert_eq!(pause_after(&one_connection.into()), None);
        }
    }
}
