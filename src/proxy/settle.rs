//! Writing a claim's outcome: once before the answer goes back, and, when the
//! store fails that write, again in the background until it is written or
//! fenced out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Proxy;
use super::open_claims::ClaimGuard;
use crate::metrics::Metrics;
use crate::store::{ClaimRequest, Fence, SettleWrite, Settlement, Store, StoreError};

/// The longest pause between retries of a settle, in the background and at
/// shutdown.
pub(super) const SETTLE_RETRY_MAX_DELAY: Duration = Duration::from_secs(1);
/// The longest a settle is retried, whatever the retention.
const SETTLE_RETRY_HORIZON: Duration = Duration::from_secs(30 * 86400);

/// Why a settle is left to the background.
pub(super) enum Unsettled {
    /// The store failed the write.
    Failed,
    /// The write outlasted `store.timeout` and is still at the database
    /// (waiting on a row another transaction holds, say). Its outcome is
    /// awaited rather than another write sent beside it: that one would
    /// wait on the same row (the batch's own statement holds the rows of
    /// the keys before it), holding one more batch and connection for as
    /// long.
    Pending(SettleWrite),
}

impl Proxy {
    /// Writes a settlement, within `store.timeout`; fenced out counts as
    /// settled.
    pub(super) async fn settle(
        &self,
        claim: &ClaimRequest,
        fence: Fence,
        settlement: Settlement,
    ) -> Result<(), Unsettled> {
        let attempt = fence.attempt;
        match send_settle(&self.store, &self.metrics, claim, fence, settlement).await {
            Ok(true) => Ok(()),
            Ok(false) => {
                tracing::warn!(
                    route = &*claim.source,
                    key = claim.key.as_str(),
                    attempt,
                    "claim no longer held by this attempt (released with `keys release`, taken over after its lease expired, or deleted with `keys forget` or `prune`); outcome not recorded"
                );
                Ok(())
            }
            Err((error, unsettled)) => {
                match unsettled {
                    Unsettled::Failed => tracing::warn!(
                        route = &*claim.source, key = claim.key.as_str(), attempt, %error,
                        "settle failed; retrying in the background"
                    ),
                    // Nothing failed, and nothing is sent again.
                    Unsettled::Pending(_) => tracing::warn!(
                        route = &*claim.source, key = claim.key.as_str(), attempt, %error,
                        "settle still at the database (waiting on a row another transaction holds, or on a store that has stopped answering); answered, and its outcome awaited in the background"
                    ),
                }
                Err(unsettled)
            }
        }
    }

    /// Retries a failed settle until it is written or fenced out. Past the
    /// lease the write is still worth making: the fence keeps it off a new
    /// owner's row, and until a delivery takes the key over it records an
    /// effect that really happened, which is what keeps that delivery from
    /// being forwarded again. Gives up after the route's retention, when the
    /// key would be pruned anyway.
    pub(super) fn settle_in_background(
        &self,
        claim: ClaimRequest,
        fence: Fence,
        settlement: Settlement,
        retention: Duration,
        guard: ClaimGuard,
        unsettled: Unsettled,
    ) {
        let attempt = fence.attempt;
        let give_up_at = Instant::now() + retention.min(SETTLE_RETRY_HORIZON);
        let store = self.store.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let mut pending = match unsettled {
                Unsettled::Pending(write) => Some(write),
                Unsettled::Failed => None,
            };
            let mut delay = Duration::from_millis(100);
            loop {
                let written = match pending.take() {
                    Some(write) => {
                        let give_up_at = tokio::time::Instant::from_std(give_up_at);
                        tokio::time::timeout_at(give_up_at, write)
                            .await
                            .unwrap_or(Err(StoreError::Timeout(retention)))
                    }
                    None if Instant::now() + delay >= give_up_at => break,
                    None => {
                        tokio::time::sleep(delay).await;
                        send_settle(&store, &metrics, &claim, fence, settlement)
                            .await
                            .map_err(|(error, unsettled)| {
                                if let Unsettled::Pending(write) = unsettled {
                                    pending = Some(write);
                                }
                                error
                            })
                    }
                };
                match written {
                    Ok(true) => {
                        tracing::info!(
                            route = &*claim.source,
                            key = claim.key.as_str(),
                            attempt,
                            status = settlement.status.as_str(),
                            "settled in the background"
                        );
                        drop(guard);
                        return;
                    }
                    Ok(false) => {
                        // An earlier try may have been written with its reply lost.
                        tracing::warn!(
                            route = &*claim.source,
                            key = claim.key.as_str(),
                            attempt,
                            "settle in the background found the claim no longer processing under this attempt: written by an earlier try, released with `keys release`, taken over after its lease expired, or deleted"
                        );
                        drop(guard);
                        return;
                    }
                    Err(_) => {}
                }
                // Short, so the write lands soon after the store returns,
                // before a retry of the event can take the key over.
                delay = (delay * 2).min(SETTLE_RETRY_MAX_DELAY);
            }
            tracing::error!(
                route = &*claim.source,
                key = claim.key.as_str(),
                attempt,
                "settle never succeeded within the key's retention"
            );
        });
    }
}

/// Sends a settle and waits for it for `store.timeout`, timed as the store's
/// `settle`. A write that outlasts that comes back with the error as
/// [`Unsettled::Pending`], still at the database.
async fn send_settle(
    store: &Store,
    metrics: &Metrics,
    claim: &ClaimRequest,
    fence: Fence,
    settlement: Settlement,
) -> Result<bool, (StoreError, Unsettled)> {
    let mut write = store.settle_write(
        Arc::clone(&claim.source),
        claim.key.clone(),
        fence,
        settlement,
    );
    let mut still_pending = false;
    let written = metrics
        .time_store("settle", async {
            store.within_timeout(&mut write).await.unwrap_or_else(|| {
                still_pending = true;
                Err(StoreError::Timeout(store.timeout()))
            })
        })
        .await;
    written.map_err(|error| {
        let unsettled = if still_pending {
            Unsettled::Pending(write)
        } else {
            Unsettled::Failed
        };
        (error, unsettled)
    })
}
