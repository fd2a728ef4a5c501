//! Retention: which keys have outlived their route's `retention`, and the
//! loop that deletes them in small batches. Shared by the background pruner
//! (every `store.prune_interval` on every replica; on PostgreSQL a replica
//! that finds another one pruning skips its turn) and the `prune` command.
//! The statements themselves are the store's.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::store::{PruneBatch, PruneGroup, Sources, Store, StoreError};

/// Rows deleted per statement: small enough that no statement holds locks
/// for long.
pub const BATCH_SIZE: u32 = 1000;

/// The least time a pruner in another process than the proxy leaves a
/// SQLite store's write lock alone between two batches. A claim waiting for
/// the lock looks for it again after a sleep that grows to 100 ms (SQLite's
/// busy handler); taken again at once, the lock was nearly never free when
/// it looked, and claims ran out of `store.timeout` while a large backlog
/// was pruned.
const LEAST_YIELD: Duration = Duration::from_millis(25);

/// How long to leave the write lock alone after a batch that held it for
/// `batch_took`: at least as long, so the proxy has the lock at least half
/// of the time.
fn yield_after(batch_took: Duration) -> Duration {
    batch_took.max(LEAST_YIELD)
}

/// The retention horizon of every source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrunePlan {
    groups: Vec<PruneGroup>,
}

impl PrunePlan {
    /// Each route's effective `retention` (its own, else the longer of
    /// `store.retention` and its provider preset's), `store.retention` for
    /// every other source (including routes since removed); `older_than`
    /// overrides them all.
    pub fn new(config: &Config, older_than: Option<Duration>) -> Self {
        let default = config.store.retention;
        let Some(override_all) = older_than else {
            let mut by_horizon: BTreeMap<Duration, Vec<String>> = BTreeMap::new();
            for route in &config.routes {
                let retention = config.effective_route(route).retention.unwrap_or(default);
                if retention != default {
                    by_horizon
                        .entry(retention)
                        .or_default()
                        .push(route.name.clone());
                }
            }
            let own_horizon: Vec<String> = by_horizon.values().flatten().cloned().collect();
            let mut groups: Vec<PruneGroup> = by_horizon
                .into_iter()
                .map(|(older_than, sources)| PruneGroup {
                    older_than,
                    sources: Sources::Only(sources),
                })
                .collect();
            groups.push(PruneGroup {
                older_than: default,
                sources: Sources::AllExcept(own_horizon),
            });
            return Self { groups };
        };
        Self {
            groups: vec![PruneGroup {
                older_than: override_all,
                sources: Sources::AllExcept(Vec::new()),
            }],
        }
    }

    /// The statements' groups, one per distinct horizon.
    pub fn groups(&self) -> &[PruneGroup] {
        &self.groups
    }
}

/// What one pruning round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// It ran (possibly handing over to another replica part-way).
    Pruned {
        /// Rows deleted.
        deleted: u64,
    },
    /// Another process was pruning the table; this round did nothing.
    Skipped,
}

/// A round that stopped on a store error.
#[derive(Debug, thiserror::Error)]
#[error("pruning stopped after deleting {deleted} keys")]
pub struct PruneError {
    /// Rows deleted before the error.
    pub deleted: u64,
    /// The store's error.
    #[source]
    pub source: StoreError,
}

/// Deletes keys past their horizon, counting them in
/// `dedupe_keys_pruned_total` and timing each statement as `op="prune"`.
#[derive(Clone)]
pub struct Pruner {
    store: Store,
    plan: PrunePlan,
    metrics: Metrics,
    batch_size: u32,
    yields_between_batches: bool,
}

impl Pruner {
    /// A pruner deleting [`BATCH_SIZE`] rows per statement.
    pub fn new(store: Store, plan: PrunePlan, metrics: Metrics) -> Self {
        Self {
            store,
            plan,
            metrics,
            batch_size: BATCH_SIZE,
            yields_between_batches: false,
        }
    }

    /// Pauses between batches, for a pruner run beside a live proxy on a
    /// store with one writer at a time (see [`yield_after`]).
    pub fn yielding_between_batches(mut self) -> Self {
        self.yields_between_batches = true;
        self
    }

    /// Changes the rows deleted per statement (at least 1).
    pub fn with_batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// One round: every group, batch after batch until a batch comes back
    /// short. Stops early, keeping what it did, if another process takes
    /// the prune lock between two batches.
    pub async fn run_once(&self) -> Result<Round, PruneError> {
        self.round(&CancellationToken::new()).await
    }

    /// A round that also stops, between two statements, once `stop` is
    /// cancelled.
    async fn round(&self, stop: &CancellationToken) -> Result<Round, PruneError> {
        let mut deleted = 0;
        for group in self.plan.groups() {
            loop {
                if stop.is_cancelled() {
                    return Ok(Round::Pruned { deleted });
                }
                let started = tokio::time::Instant::now();
                let batch = self.store.prune(group, self.batch_size);
                match self.metrics.time_store("prune", batch).await {
                    Ok(PruneBatch::Deleted(count)) => {
                        deleted += count;
                        self.metrics.keys_pruned.inc_by(count);
                        if count < u64::from(self.batch_size) {
                            break;
                        }
                        if self.yields_between_batches {
                            tokio::time::sleep(yield_after(started.elapsed())).await;
                        }
                    }
                    Ok(PruneBatch::Busy) if deleted == 0 => return Ok(Round::Skipped),
                    Ok(PruneBatch::Busy) => return Ok(Round::Pruned { deleted }),
                    Err(source) => return Err(PruneError { deleted, source }),
                }
            }
        }
        Ok(Round::Pruned { deleted })
    }

    /// Runs a round every `interval`, the first one `interval` after start,
    /// until `stop`; a round in progress stops after its current statement.
    pub async fn run(self, interval: Duration, stop: CancellationToken) {
        let start = tokio::time::Instant::now() + interval;
        let mut ticks = tokio::time::interval_at(start, interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            match self.round(&stop).await {
                Ok(Round::Pruned { deleted: 0 }) => tracing::debug!("prune: nothing to delete"),
                Ok(Round::Pruned { deleted }) => tracing::info!(deleted, "pruned expired keys"),
                Ok(Round::Skipped) => {
                    tracing::debug!("prune: another replica is pruning; skipped this round")
                }
                Err(error) => tracing::warn!(
                    deleted = error.deleted,
                    error = %error.source,
                    "prune round failed; retrying next interval"
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);
    const DAY: Duration = Duration::from_secs(86400);

    fn config() -> Config {
        Config::from_yaml(
            "store: { retention: 1d }
routes:
  - { name: a, path: /a, key: { header: X }, retention: 1h }
  - { name: b, path: /b, key: { header: X }, retention: 1h }
  - { name: c, path: /c, key: { header: X }, retention: 1d }
  - { name: d, path: /d, key: { header: X } }
",
            None,
        )
        .unwrap()
    }

    #[test]
    fn sources_are_grouped_by_horizon_and_the_rest_use_store_retention() {
        assert_eq!(
            PrunePlan::new(&config(), None).groups(),
            [
                PruneGroup {
                    older_than: HOUR,
                    sources: Sources::Only(vec!["a".into(), "b".into()])
                },
                PruneGroup {
                    older_than: DAY,
                    sources: Sources::AllExcept(vec!["a".into(), "b".into()])
                },
            ]
        );
    }

    #[test]
    fn a_preset_route_without_its_own_retention_keeps_the_presets_horizon() {
        let config = Config::from_yaml(
            "store: { retention: 1d }
routes:
  - { name: payments, path: /stripe, provider: stripe, secrets: [{ value: whsec_test }] }
  - { name: repos, path: /github, provider: github, secrets: [{ value: s }], retention: 2h }
  - { name: orders, path: /orders, key: { header: X } }
",
            None,
        )
        .unwrap();
        assert_eq!(
            PrunePlan::new(&config, None).groups(),
            [
                PruneGroup {
                    older_than: 2 * HOUR,
                    sources: Sources::Only(vec!["repos".into()])
                },
                PruneGroup {
                    older_than: 31 * DAY,
                    sources: Sources::Only(vec!["payments".into()])
                },
                PruneGroup {
                    older_than: DAY,
                    sources: Sources::AllExcept(vec!["repos".into(), "payments".into()])
                },
            ]
        );
    }

    #[test]
    fn a_pruner_beside_the_proxy_leaves_the_lock_free_at_least_as_long_as_it_held_it() {
        assert_eq!(yield_after(Duration::from_millis(1)), LEAST_YIELD);
        assert_eq!(
            yield_after(Duration::from_millis(80)),
            Duration::from_millis(80)
        );
    }

    #[test]
    fn older_than_replaces_every_horizon() {
        assert_eq!(
            PrunePlan::new(&config(), Some(HOUR)).groups(),
            [PruneGroup {
                older_than: HOUR,
                sources: Sources::AllExcept(vec![])
            }]
        );
    }
}
