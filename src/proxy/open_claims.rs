//! Claims this process has won and not yet settled. While one has an outcome
//! the store has not taken yet (it was down), its key is not claimed again by
//! this process: past the lease the store would hand the key to a retry.
//! Such a retry is compared with the key's first body where this process
//! knows it, as the store would compare it.
//! Shutdown settles what is left: the known outcome when the upstream
//! answered but the write failed, otherwise `failed`, so senders' retries go
//! through at once instead of waiting for the lease. From then on the
//! registry is closed: a claim won later (its body was still arriving, say)
//! would be left `processing` when the process ends, so it is not forwarded.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::settle::SETTLE_RETRY_MAX_DELAY;
use crate::store::{Fence, Settlement, Store};

/// One won, unsettled claim.
#[derive(Debug, Clone)]
pub struct OpenClaim {
    /// The route name.
    pub source: Arc<str>,
    /// The key.
    pub key: String,
    /// The fencing token.
    pub fence: Fence,
    /// The SHA-256 of the key's first delivery, when this process knows it.
    pub first_payload_sha256: Option<[u8; 32]>,
    /// The outcome, once the upstream has answered.
    pub outcome: Option<Settlement>,
}

/// The registry of open claims.
#[derive(Default)]
pub struct OpenClaims {
    next_id: AtomicU64,
    registry: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    claims: HashMap<u64, OpenClaim>,
    /// The open claims with a known outcome, by route and key.
    decided: HashMap<Arc<str>, HashMap<String, Decided>>,
    /// Whether shutdown has taken the claims to settle them.
    closed: bool,
}

/// The open claims of one key whose outcome is known.
#[derive(Default)]
struct Decided {
    count: usize,
    first_payload_sha256: Option<[u8; 32]>,
}

/// A key with an open claim whose outcome the store has not taken yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnwrittenOutcome {
    first_payload_sha256: Option<[u8; 32]>,
}

impl UnwrittenOutcome {
    /// Whether a delivery whose body hashes to `payload_sha256` differs from
    /// the key's first delivery. Unknown first bodies count as the same:
    /// only the store could tell.
    pub fn payload_mismatch(&self, payload_sha256: &[u8; 32]) -> bool {
        self.first_payload_sha256
            .is_some_and(|first| first != *payload_sha256)
    }
}

impl Registry {
    fn set_outcome(&mut self, id: u64, outcome: Settlement) {
        let Some(claim) = self.claims.get_mut(&id) else {
            return;
        };
        if claim.outcome.replace(outcome).is_none() {
            let decided = self
                .decided
                .entry(Arc::clone(&claim.source))
                .or_default()
                .entry(claim.key.clone())
                .or_default();
            decided.count += 1;
            // Every claim on a key shares its first delivery: retries never
            // change the stored hash.
            decided.first_payload_sha256 =
                decided.first_payload_sha256.or(claim.first_payload_sha256);
        }
    }

    fn remove(&mut self, id: u64) -> Option<OpenClaim> {
        let claim = self.claims.remove(&id)?;
        if claim.outcome.is_none() {
            return Some(claim);
        }
        if let Some(keys) = self.decided.get_mut(&claim.source) {
            if let Some(decided) = keys.get_mut(&claim.key) {
                decided.count -= 1;
                if decided.count == 0 {
                    keys.remove(&claim.key);
                }
            }
            if keys.is_empty() {
                self.decided.remove(&claim.source);
            }
        }
        Some(claim)
    }
}

/// What shutdown's final settles did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinalSettles {
    /// Claims open when shutdown took them.
    pub open: usize,
    /// Claims whose upstream had answered: that outcome written.
    pub outcomes_written: usize,
    /// Claims whose upstream had not answered: released (`failed`).
    pub released: usize,
    /// Left to their leases: the store did not take them before the deadline.
    pub unwritten: usize,
    /// Found settled already (by a background retry that landed meanwhile)
    /// or no longer this replica's (released or taken over).
    pub already_settled: usize,
}

/// Keeps a claim registered until dropped.
pub struct ClaimGuard {
    registry: Arc<OpenClaims>,
    id: u64,
}

impl OpenClaims {
    /// Registers a won claim until the guard is dropped. Its outcome comes
    /// later, through the guard. `None` once shutdown has closed the
    /// registry: the claim must be released, not forwarded.
    pub fn register(self: &Arc<Self>, claim: OpenClaim) -> Option<ClaimGuard> {
        debug_assert!(
            claim.outcome.is_none(),
            "outcomes are set through the guard"
        );
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut registry = self.lock();
        if registry.closed {
            return None;
        }
        registry.claims.insert(id, claim);
        Some(ClaimGuard {
            registry: Arc::clone(self),
            id,
        })
    }

    /// Takes every open claim and refuses new ones.
    fn close(&self) -> Vec<OpenClaim> {
        let closed = Registry {
            closed: true,
            ..Registry::default()
        };
        let registry = std::mem::replace(&mut *self.lock(), closed);
        registry.claims.into_values().collect()
    }

    /// How many claims are open.
    pub fn len(&self) -> usize {
        self.lock().claims.len()
    }

    /// Whether this process holds a claim on `key` of `source` whose
    /// outcome is known but not yet written.
    pub fn unwritten_outcome(&self, source: &str, key: &str) -> Option<UnwrittenOutcome> {
        let registry = self.lock();
        let decided = registry.decided.get(source)?.get(key)?;
        Some(UnwrittenOutcome {
            first_payload_sha256: decided.first_payload_sha256,
        })
    }

    /// Whether no claim is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes the registry and settles every open claim: its known outcome,
    /// or released. The writes go out together, each bounded by the store's
    /// own timeout, so one try takes about that long however many claims are
    /// open, and it is made even when the drain has used up the grace
    /// period. A write the store fails is tried again, at most a second
    /// apart, until `deadline`; past it the claim is left to its lease.
    pub async fn settle_all(&self, store: &Store, deadline: Instant) -> FinalSettles {
        let mut pending = self.close();
        let open = pending.len();
        let (mut outcomes_written, mut released, mut already_settled) = (0, 0, 0);
        let mut delay = Duration::from_millis(100);
        loop {
            let settles = pending.iter().map(|claim| {
                let settlement = claim.outcome.unwrap_or(Settlement::RELEASED);
                store.settle_counted(&claim.source, &claim.key, claim.fence, settlement)
            });
            let results = futures_util::future::join_all(settles).await;
            let mut failed = Vec::new();
            for (claim, result) in pending.into_iter().zip(results) {
                match (result, claim.outcome) {
                    // The request's own line is never logged when its sender's
                    // connection is cut at the deadline: this one names its key.
                    (Ok(true), None) => {
                        released += 1;
                        tracing::warn!(
                            route = &*claim.source,
                            key = claim.key.as_str(),
                            attempt = claim.fence.attempt,
                            "released at shutdown before the upstream answered: the sender gets no answer, and its retry is forwarded again"
                        );
                    }
                    (Ok(true), Some(settlement)) => {
                        outcomes_written += 1;
                        tracing::info!(
                            route = &*claim.source,
                            key = claim.key.as_str(),
                            attempt = claim.fence.attempt,
                            status = settlement.status.as_str(),
                            upstream_status = settlement.response_status,
                            "outcome written at shutdown"
                        );
                    }
                    // Written by an earlier try, or taken over: nothing left.
                    (Ok(false), _) => already_settled += 1,
                    (Err(error), _) => failed.push((claim, error)),
                }
            }
            if failed.is_empty() || Instant::now() + delay >= deadline {
                for (claim, error) in &failed {
                    tracing::error!(
                        route = &*claim.source,
                        key = claim.key.as_str(),
                        attempt = claim.fence.attempt,
                        %error,
                        "could not settle the claim by the end of the grace period; it is reclaimable when its lease expires"
                    );
                }
                return FinalSettles {
                    open,
                    outcomes_written,
                    released,
                    unwritten: failed.len(),
                    already_settled,
                };
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(SETTLE_RETRY_MAX_DELAY);
            pending = failed.into_iter().map(|(claim, _)| claim).collect();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        // A panic elsewhere cannot leave the maps inconsistent: no critical
        // section can panic between its updates of the two.
        self.registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl ClaimGuard {
    /// Records the upstream's outcome, so shutdown writes it rather than
    /// releasing the claim.
    pub fn set_outcome(&self, outcome: Settlement) {
        self.registry.lock().set_outcome(self.id, outcome);
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        self.registry.lock().remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIRST: [u8; 32] = [1; 32];
    const OTHER: [u8; 32] = [2; 32];

    fn claim(key: &str) -> OpenClaim {
        OpenClaim {
            source: Arc::from("orders"),
            key: key.into(),
            fence: Fence {
                attempt: 1,
                claimed_at: std::time::UNIX_EPOCH,
            },
            first_payload_sha256: Some(FIRST),
            outcome: None,
        }
    }

    /// The final settles at shutdown are timed like a request's, and a
    /// store that fails them is counted: `/metrics` is still served then.
    #[tokio::test]
    async fn final_settles_are_timed_and_their_failures_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedupe.db");
        let config = crate::config::StoreConfig {
            url: format!("sqlite://{}", path.display()),
            ..crate::config::StoreConfig::default()
        };
        let metrics = crate::metrics::Metrics::new();
        let store = Store::open(&config).unwrap().counted_in(metrics.clone());
        store.migrate().await.unwrap();
        rusqlite::Connection::open(&path)
            .unwrap()
            .execute_batch("DROP TABLE processed_events")
            .unwrap();
        let claims = Arc::new(OpenClaims::default());
        let _open = claims.register(claim("k")).unwrap();
        let deadline = Instant::now();
        claims.settle_all(&store, deadline).await;
        let exposed = metrics.render();
        assert!(
            exposed.contains("dedupe_store_errors_total{op=\"settle\"} 1\n")
                && exposed.contains("dedupe_store_duration_seconds_count{op=\"settle\"} 1\n"),
            "{exposed}"
        );
    }

    fn has_unwritten_outcome(claims: &OpenClaims, source: &str, key: &str) -> bool {
        claims.unwritten_outcome(source, key).is_some()
    }

    #[test]
    fn a_key_has_an_unwritten_outcome_from_its_outcome_until_its_last_guard_drops() {
        let claims = Arc::new(OpenClaims::default());
        let first = claims.register(claim("k")).unwrap();
        let second = claims.register(claim("k")).unwrap();
        assert!(
            !has_unwritten_outcome(&claims, "orders", "k"),
            "at the upstream"
        );
        first.set_outcome(Settlement::RELEASED);
        first.set_outcome(Settlement::RELEASED);
        second.set_outcome(Settlement::RELEASED);
        assert!(has_unwritten_outcome(&claims, "orders", "k"));
        assert!(!has_unwritten_outcome(&claims, "orders", "other"));
        assert!(!has_unwritten_outcome(&claims, "other", "k"));
        drop(first);
        assert!(has_unwritten_outcome(&claims, "orders", "k"));
        drop(second);
        assert!(!has_unwritten_outcome(&claims, "orders", "k"));
        assert!(claims.is_empty());
    }

    #[test]
    fn a_retry_is_compared_with_the_first_body_when_it_is_known() {
        let claims = Arc::new(OpenClaims::default());
        let known = claims.register(claim("known")).unwrap();
        known.set_outcome(Settlement::RELEASED);
        let unwritten = claims.unwritten_outcome("orders", "known").unwrap();
        assert!(!unwritten.payload_mismatch(&FIRST));
        assert!(unwritten.payload_mismatch(&OTHER));

        // Won with another body than the stored one: the first is unknown.
        let unknown = claims
            .register(OpenClaim {
                first_payload_sha256: None,
                ..claim("unknown")
            })
            .unwrap();
        unknown.set_outcome(Settlement::RELEASED);
        let unwritten = claims.unwritten_outcome("orders", "unknown").unwrap();
        assert!(!unwritten.payload_mismatch(&FIRST));
        assert!(!unwritten.payload_mismatch(&OTHER));

        // One claim of the key that knows the first body is enough.
        let knowing = claims.register(claim("unknown")).unwrap();
        knowing.set_outcome(Settlement::RELEASED);
        let unwritten = claims.unwritten_outcome("orders", "unknown").unwrap();
        assert!(unwritten.payload_mismatch(&OTHER));
    }

    #[test]
    fn once_closed_the_registry_hands_over_its_claims_and_refuses_new_ones() {
        let claims = Arc::new(OpenClaims::default());
        let decided = claims.register(claim("decided")).unwrap();
        decided.set_outcome(Settlement::RELEASED);
        let _open = claims.register(claim("open")).unwrap();
        let mut taken: Vec<String> = claims.close().into_iter().map(|c| c.key).collect();
        taken.sort();
        assert_eq!(taken, ["decided", "open"]);
        assert!(claims.is_empty());
        assert!(claims.register(claim("late")).is_none());
        assert!(claims.is_empty());
        // Guards of taken claims drop without a trace.
        drop(decided);
        assert!(claims.close().is_empty());
    }
}
