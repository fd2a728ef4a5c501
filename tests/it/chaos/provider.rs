//! The simulated webhook provider. Like real ones it delivers each event until
//! it is acknowledged (a 2xx, which includes the proxy's `duplicate` answer),
//! with a timeout per delivery and capped exponential backoff with jitter,
//! and gives up after a bounded total time. Deliveries go to a replica chosen
//! at random; some are sent twice at once (a provider's duplicate), events
//! start in shuffled order, and some acknowledged events are replayed by
//! hand later.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::replicas::{Replicas, Target};
use super::rng::Rng;

/// The provider's retry policy and habits.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub delivery_timeout: Duration,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
    /// After this long without an acknowledgement, the provider gives up.
    pub give_up_after: Duration,
    /// Events start at random times within this window.
    pub spread: Duration,
    pub duplicate_probability: f64,
    pub replay_probability: f64,
    pub max_replay_delay: Duration,
}

/// How the provider's deliveries were answered.
#[derive(Debug, Default)]
pub struct Tally {
    pub deliveries: AtomicU64,
    pub forwarded_2xx: AtomicU64,
    pub duplicates: AtomicU64,
    pub in_flight: AtomicU64,
    pub unavailable: AtomicU64,
    pub upstream_errors: AtomicU64,
    pub forwarded_failures: AtomicU64,
    pub transport_errors: AtomicU64,
    pub other: AtomicU64,
    pub replays: AtomicU64,
    pub duplicate_copies: AtomicU64,
}

impl Tally {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// What happened to one event, from the provider's side.
#[derive(Debug, Clone)]
pub struct EventReport {
    pub key: String,
    /// Acknowledged before the provider gave up.
    pub acknowledged: bool,
    /// Replayed by hand after the acknowledgement, and that replay acknowledged.
    pub replays: u32,
    pub replays_acknowledged: u32,
}

pub struct Provider {
    pub replicas: Arc<Replicas>,
    pub policy: Policy,
    pub seed: u64,
    pub tally: Tally,
    client: Client<HttpConnector, Full<Bytes>>,
}

enum Answer {
    Ack,
    Retry,
}

impl Provider {
    pub fn new(replicas: Arc<Replicas>, policy: Policy, seed: u64) -> Self {
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(5))
            .build_http();
        Self {
            replicas,
            policy,
            seed,
            tally: Tally::default(),
            client,
        }
    }

    /// Delivers event `index` until acknowledged, then maybe replays it.
    pub async fn run_event(self: Arc<Self>, index: u64) -> EventReport {
        let mut rng = Rng::derive(self.seed, 0xE7E, index);
        let key = format!("evt_{index:06}");
        let body = format!(r#"{{"id":"{key}","amount":{}}}"#, rng.below(10_000));
        tokio::time::sleep(rng.between(Duration::ZERO, self.policy.spread)).await;
        let acknowledged = self.deliver_until_acknowledged(&key, &body, &mut rng).await;
        let mut report = EventReport {
            key,
            acknowledged,
            replays: 0,
            replays_acknowledged: 0,
        };
        if acknowledged && rng.chance(self.policy.replay_probability) {
            tokio::time::sleep(rng.between(Duration::ZERO, self.policy.max_replay_delay)).await;
            self.tally.replays.fetch_add(1, Ordering::Relaxed);
            report.replays += 1;
            if self
                .deliver_until_acknowledged(&report.key, &body, &mut rng)
                .await
            {
                report.replays_acknowledged += 1;
            }
        }
        report
    }

    async fn deliver_until_acknowledged(&self, key: &str, body: &str, rng: &mut Rng) -> bool {
        let started = Instant::now();
        let mut backoff = self.policy.first_backoff;
        loop {
            let copies = if rng.chance(self.policy.duplicate_probability) {
                self.tally.duplicate_copies.fetch_add(1, Ordering::Relaxed);
                2
            } else {
                1
            };
            let sends: Vec<_> = (0..copies)
                .map(|_| self.deliver_once(pick(&self.replicas.live(), rng), key, body))
                .collect();
            let answers = futures_util::future::join_all(sends).await;
            if answers.iter().any(|answer| matches!(answer, Answer::Ack)) {
                return true;
            }
            let pause = rng.between(backoff / 2, backoff);
            if started.elapsed() + pause > self.policy.give_up_after {
                return false;
            }
            tokio::time::sleep(pause).await;
            backoff = (backoff * 2).min(self.policy.max_backoff);
        }
    }

    async fn deliver_once(&self, target: Option<Target>, key: &str, body: &str) -> Answer {
        let tally = &self.tally;
        tally.deliveries.fetch_add(1, Ordering::Relaxed);
        let Some(target) = target else {
            tally.transport_errors.fetch_add(1, Ordering::Relaxed);
            return Answer::Retry;
        };
        let request = Request::post(format!("http://{}/hooks/orders", target.addr))
            .header("x-event-id", key)
            .header("x-chaos-replica", &target.tag)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        let exchange = async {
            let response = self.client.request(request).await.ok()?;
            let outcome = response
                .headers()
                .get("x-dedupe-outcome")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("<none>")
                .to_owned();
            let status = response.status().as_u16();
            response.into_body().collect().await.ok()?;
            Some((status, outcome))
        };
        let Ok(Some((status, outcome))) =
            tokio::time::timeout(self.policy.delivery_timeout, exchange).await
        else {
            tally.transport_errors.fetch_add(1, Ordering::Relaxed);
            return Answer::Retry;
        };
        let counter = match (status, outcome.as_str()) {
            (200..=299, "duplicate") => &tally.duplicates,
            (200..=299, "forwarded") => &tally.forwarded_2xx,
            (409, "in-flight") => &tally.in_flight,
            (503, "unavailable") => &tally.unavailable,
            (502 | 504, "upstream-error") => &tally.upstream_errors,
            (_, "forwarded") => &tally.forwarded_failures,
            _ => &tally.other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if (200..=299).contains(&status) {
            Answer::Ack
        } else {
            Answer::Retry
        }
    }
}

fn pick(live: &[Target], rng: &mut Rng) -> Option<Target> {
    if live.is_empty() {
        return None;
    }
    Some(live[rng.below(live.len() as u64) as usize].clone())
}
