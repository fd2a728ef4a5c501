//! The application behind the proxies: it succeeds, fails with a 5xx, or
//! hangs past the proxies' `upstream.timeout`, at random (seeded per key and
//! attempt), and can be stalled as a whole. It records every request, and an
//! *effect* exactly when it answers 2xx: that is the application acting.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::rng::Rng;

/// What the application did with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Answered 2xx: acted on the event.
    Effect,
    /// Answered 5xx without acting.
    Failed,
    /// Held the request past the proxy's timeout, then gave up without acting.
    Hung,
}

/// One request as the application saw it.
#[derive(Debug, Clone)]
pub struct Record {
    pub key: Option<String>,
    pub attempt: Option<i32>,
    /// The replica process that forwarded it (the provider's tag, passed
    /// through untouched).
    pub replica: Option<String>,
    pub arrived: Instant,
    pub answered: Instant,
    pub verdict: Verdict,
}

/// How the application behaves.
#[derive(Debug, Clone, Copy)]
pub struct AppBehavior {
    pub seed: u64,
    pub fail_probability: f64,
    pub hang_probability: f64,
    /// How long a hang lasts: longer than the proxies' `upstream.timeout`.
    pub hang_for: Duration,
    /// Work done before a 2xx answer, at most.
    pub max_work: Duration,
}

struct State {
    behavior: AppBehavior,
    stalled: AtomicBool,
    records: Mutex<Vec<Record>>,
}

/// The running application.
pub struct App {
    pub addr: SocketAddr,
    state: Arc<State>,
    stop: CancellationToken,
}

impl App {
    pub async fn start(behavior: AppBehavior) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind app");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            behavior,
            stalled: AtomicBool::new(false),
            records: Mutex::default(),
        });
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
                tokio::spawn(async move {
                    let service = service_fn(move |request| handle(Arc::clone(&state), request));
                    let connection = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service);
                    tokio::select! { _ = connection => {}, () = stop.cancelled() => {} }
                });
            }
        });
        Self { addr, state, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// While stalled, every request hangs.
    pub fn set_stalled(&self, stalled: bool) {
        self.state.stalled.store(stalled, Ordering::SeqCst);
    }

    pub fn records(&self) -> Vec<Record> {
        self.state.records.lock().unwrap().clone()
    }
}

impl Drop for App {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn handle(
    state: Arc<State>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let arrived = Instant::now();
    let (parts, body) = request.into_parts();
    let _ = body.collect().await;
    let text = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let key = text("x-dedupe-key");
    let attempt = text("x-dedupe-attempt").and_then(|a| a.parse().ok());
    let behavior = state.behavior;
    // The decision depends only on the seed, the key and the attempt.
    let mut rng = Rng::derive(
        behavior.seed,
        0xA99,
        fingerprint(key.as_deref().unwrap_or(""), attempt.unwrap_or(0)),
    );
    let roll = rng.unit();
    let verdict = if state.stalled.load(Ordering::SeqCst) || roll < behavior.hang_probability {
        Verdict::Hung
    } else if roll < behavior.hang_probability + behavior.fail_probability {
        Verdict::Failed
    } else {
        Verdict::Effect
    };
    let replica = text("x-chaos-replica");
    // Detached, like an application that finishes its work even when the
    // caller hangs up: a proxy killed mid-request does not undo the effect.
    let work = tokio::spawn(async move {
        let status = match verdict {
            Verdict::Hung => {
                tokio::time::sleep(behavior.hang_for).await;
                StatusCode::SERVICE_UNAVAILABLE
            }
            Verdict::Failed => StatusCode::INTERNAL_SERVER_ERROR,
            Verdict::Effect => {
                tokio::time::sleep(rng.between(Duration::ZERO, behavior.max_work)).await;
                StatusCode::OK
            }
        };
        state.records.lock().unwrap().push(Record {
            key,
            attempt,
            replica,
            arrived,
            answered: Instant::now(),
            verdict,
        });
        status
    });
    let status = work.await.expect("application task");
    let mut response = Response::new(Full::new(Bytes::from_static(b"app")));
    *response.status_mut() = status;
    Ok(response)
}

fn fingerprint(key: &str, attempt: i32) -> u64 {
    key.bytes()
        .fold(0xCBF2_9CE4_8422_2325u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01B3)
        })
        .wrapping_add(attempt as u64)
}
