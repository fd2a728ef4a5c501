//! The chaos schedule: two independent loops, so faults overlap as they do in
//! production. One SIGKILLs a random replica (or now and then SIGTERMs it, as
//! a rolling deployment does) and restarts it a moment later;
//! the other cuts the replicas off from PostgreSQL (a relay cut, or
//! `pg_terminate_backend` of their connections) or stalls the application.
//! Pauses between faults are the schedule itself, drawn from the seed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::app::App;
use super::replicas::Replicas;
use super::rng::Rng;
use crate::support::{Relay, TestStore};

#[derive(Debug, Default)]
pub struct FaultTally {
    pub crashes: AtomicU64,
    pub graceful_restarts: AtomicU64,
    pub store_cuts: AtomicU64,
    pub backend_terminations: AtomicU64,
    pub upstream_stalls: AtomicU64,
}

pub struct Faults {
    pub replicas: Arc<Replicas>,
    pub relay: Arc<Relay>,
    pub app: Arc<App>,
    pub store: Arc<TestStore>,
    pub tally: FaultTally,
    /// The longest store cut; longer than the lease, as real outages can be.
    pub max_store_cut: Duration,
}

/// Sleeps for `pause` unless stopped first; false when stopped.
async fn pause(stop: &CancellationToken, pause: Duration) -> bool {
    tokio::select! {
        () = stop.cancelled() => false,
        () = tokio::time::sleep(pause) => true,
    }
}

impl Faults {
    pub async fn crash_loop(self: Arc<Self>, mut rng: Rng, stop: CancellationToken) {
        while pause(&stop, rng.between(ms(1000), ms(3000))).await {
            let live = self.replicas.live_slots();
            if live.len() < 2 {
                continue;
            }
            let victim = live[rng.below(live.len() as u64) as usize];
            if rng.chance(0.25) {
                if self.replicas.terminate(victim).await {
                    self.tally.graceful_restarts.fetch_add(1, Ordering::Relaxed);
                }
            } else if self.replicas.kill(victim).await {
                self.tally.crashes.fetch_add(1, Ordering::Relaxed);
            }
            tokio::time::sleep(rng.between(ms(200), ms(1500))).await;
            self.replicas.restart(victim).await;
        }
    }

    pub async fn infrastructure_loop(self: Arc<Self>, mut rng: Rng, stop: CancellationToken) {
        while pause(&stop, rng.between(ms(1500), ms(4000))).await {
            let roll = rng.unit();
            if roll < 0.4 {
                self.tally.store_cuts.fetch_add(1, Ordering::Relaxed);
                self.relay.cut().await;
                tokio::time::sleep(rng.between(ms(300), self.max_store_cut)).await;
                self.relay.restore();
            } else if roll < 0.7 {
                self.tally
                    .backend_terminations
                    .fetch_add(1, Ordering::Relaxed);
                self.terminate_backends().await;
            } else {
                self.tally.upstream_stalls.fetch_add(1, Ordering::Relaxed);
                self.app.set_stalled(true);
                tokio::time::sleep(rng.between(ms(500), ms(2500))).await;
                self.app.set_stalled(false);
            }
        }
        self.relay.restore();
        self.app.set_stalled(false);
    }

    async fn terminate_backends(&self) {
        let client = self.store.postgres().await;
        client
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                  WHERE datname = current_database() AND application_name = 'dedupe-proxy'",
                &[],
            )
            .await
            .expect("terminate the proxies' backends");
    }
}

pub fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}
