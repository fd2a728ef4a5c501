//! Claims this process has won and not yet settled. Shutdown settles what is
//! left: the known outcome when the upstream answered but the write failed,
//! otherwise `failed`, so senders' retries go through at once instead of
//! waiting for the lease.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::store::{Settlement, Store};

/// One won, unsettled claim.
#[derive(Debug, Clone)]
pub struct OpenClaim {
    /// The route name.
    pub source: Arc<str>,
    /// The key.
    pub key: String,
    /// The fencing token.
    pub attempt: i32,
    /// The outcome, once the upstream has answered.
    pub outcome: Option<Settlement>,
}

/// The registry of open claims.
#[derive(Default)]
pub struct OpenClaims {
    next_id: AtomicU64,
    claims: Mutex<HashMap<u64, OpenClaim>>,
}

/// Keeps a claim registered until dropped.
pub struct ClaimGuard {
    registry: Arc<OpenClaims>,
    id: u64,
}

impl OpenClaims {
    /// Registers a won claim until the guard is dropped.
    pub fn register(self: &Arc<Self>, claim: OpenClaim) -> ClaimGuard {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, claim);
        ClaimGuard {
            registry: Arc::clone(self),
            id,
        }
    }

    /// How many claims are open.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no claim is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Settles every open claim: its known outcome, or released. Returns how
    /// many were settled by this call.
    pub async fn settle_all(&self, store: &Store) -> usize {
        let claims: Vec<OpenClaim> = self.lock().drain().map(|(_, claim)| claim).collect();
        let mut settled = 0;
        for claim in claims {
            let settlement = claim.outcome.unwrap_or(Settlement::RELEASED);
            match store
                .settle(&claim.source, &claim.key, claim.attempt, settlement)
                .await
            {
                Ok(true) => settled += 1,
                Ok(false) => {}
                Err(error) => tracing::error!(
                    route = &*claim.source,
                    key = %claim.key,
                    attempt = claim.attempt,
                    %error,
                    "could not release the claim at shutdown; it is reclaimable when its lease expires"
                ),
            }
        }
        settled
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, OpenClaim>> {
        // A panic elsewhere cannot leave the map inconsistent: every critical
        // section is one map operation.
        self.claims
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl ClaimGuard {
    /// Records the upstream's outcome, so shutdown writes it rather than
    /// releasing the claim.
    pub fn set_outcome(&self, outcome: Settlement) {
        if let Some(claim) = self.registry.lock().get_mut(&self.id) {
            claim.outcome = Some(outcome);
        }
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}
