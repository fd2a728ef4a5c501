//! Sending a webhook upstream: a won claim only while enough of its lease
//! is left, settled from the upstream's status before the answer goes back;
//! a delivery that holds no claim (shadowed, keyless, store unavailable)
//! passed on as it is.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderValue;

use super::{Answer, Checked, Decision, OpenClaim, PassReason, Proxy, Trace, Unavailable, Won};
use crate::key;
use crate::route::Route;
use crate::store::{ClaimRequest, Fence, SettledStatus, Settlement};
use crate::upstream::{DedupeHeaders, Outgoing};

impl Proxy {
    /// A won claim is forwarded only while enough of its lease is left;
    /// otherwise it is released.
    pub(super) async fn forward_if_lease_allows(
        &self,
        won: Won,
        claimed_at: Instant,
        trace: &mut Trace,
    ) -> Decision {
        trace.attempt = Some(won.fence.attempt);
        if !self.lease_left_too_short(claimed_at) {
            return Decision::Claimed(won);
        }
        let (answer, settle_time) = self
            .release_unforwarded(&won.request, won.fence, Unavailable::LeaseTooShort)
            .await;
        trace.store_time += settle_time;
        Decision::Answer(answer)
    }

    /// Releases a won claim that is not to be forwarded; returns the 503
    /// that says why and the time the release took.
    pub(super) async fn release_unforwarded(
        &self,
        claim: &ClaimRequest,
        fence: Fence,
        why: Unavailable,
    ) -> (Answer, Duration) {
        let settle_started = Instant::now();
        // Not retried: a release that fails leaves the key to its lease, as
        // a crash between claim and forward would.
        let _ = self.settle(claim, fence, Settlement::RELEASED).await;
        let answer = Answer::Unavailable(why, self.settings.retry_after);
        (answer, settle_started.elapsed())
    }

    /// Forwards a won claim and settles it before the response goes back.
    pub(super) async fn forward_claimed(
        &self,
        route: &Route,
        won: Won,
        request: Checked,
        trace: &mut Trace,
    ) -> Answer {
        let (answer, upstream_time, settle_time) =
            self.forward_and_settle(route, won, request).await;
        trace.upstream_time = upstream_time;
        trace.store_time += settle_time;
        answer
    }

    /// Whether too little of a lease taken at `claimed_at` (before the claim
    /// was sent) is left to wait out the upstream: another replica may own
    /// the key by the time the upstream answers.
    fn lease_left_too_short(&self, claimed_at: Instant) -> bool {
        let lease_deadline = claimed_at + self.settings.lease;
        lease_deadline.saturating_duration_since(Instant::now()) < self.settings.upstream_timeout
    }

    async fn forward_and_settle(
        &self,
        route: &Route,
        won: Won,
        request: Checked,
    ) -> (Answer, Option<Duration>, Duration) {
        let Won {
            request: claim,
            fence,
            payload_mismatch,
        } = won;
        let attempt = fence.attempt;
        let registered = self.open_claims.register(OpenClaim {
            source: Arc::clone(&claim.source),
            key: claim.key.clone(),
            fence,
            // The store keeps the first delivery's hash, which this body's is
            // unless the store said otherwise.
            first_payload_sha256: (!payload_mismatch).then_some(claim.payload_sha256),
            outcome: None,
        });
        let Some(guard) = registered else {
            let (answer, settle_time) = self
                .release_unforwarded(&claim, fence, Unavailable::ShuttingDown)
                .await;
            return (answer, None, settle_time);
        };
        let dedupe = DedupeHeaders {
            key: key::header_value(claim.key.as_bytes()),
            source: route_source(route),
            attempt: Some(attempt),
        };
        let sent_at = Instant::now();
        let result = self
            .upstream
            .send(
                request.parts,
                Outgoing::Whole(request.body),
                request.peer,
                Some(&route.name),
                Some(dedupe),
            )
            .await;
        let upstream_time = sent_at.elapsed();
        self.count_upstream(route, &result, upstream_time);
        if let Err(error) = &result {
            tracing::warn!(
                route = &*route.name,
                key = claim.key.as_str(),
                attempt,
                %error,
                "upstream gave no response"
            );
        }
        let settlement = match &result {
            Ok(response) if route.is_done(response.status()) => Settlement {
                status: SettledStatus::Done,
                response_status: Some(response.status().as_u16()),
            },
            Ok(response) => Settlement {
                status: SettledStatus::Failed,
                response_status: Some(response.status().as_u16()),
            },
            Err(_) => Settlement::RELEASED,
        };
        guard.set_outcome(settlement);
        let settle_started = Instant::now();
        if let Err(unsettled) = self.settle(&claim, fence, settlement).await {
            self.settle_in_background(claim, fence, settlement, route.retention, guard, unsettled);
        }
        let settle_time = settle_started.elapsed();
        let answer = match result {
            Ok(response) => Answer::Forwarded(response),
            Err(error) => Answer::UpstreamError(error),
        };
        (answer, Some(upstream_time), settle_time)
    }

    pub(super) async fn pass(
        &self,
        route: &Route,
        request: Checked,
        reason: PassReason,
        dedupe: Option<DedupeHeaders>,
        trace: &mut Trace,
    ) -> Answer {
        let sent_at = Instant::now();
        let result = self
            .upstream
            .send(
                request.parts,
                Outgoing::Whole(request.body),
                request.peer,
                Some(&route.name),
                dedupe,
            )
            .await;
        let upstream_time = sent_at.elapsed();
        trace.upstream_time = Some(upstream_time);
        self.count_upstream(route, &result, upstream_time);
        match (result, reason) {
            (Ok(response), reason) => Answer::Passthrough(response, reason),
            (Err(error), PassReason::Shadow(enforced)) => {
                Answer::ShadowedUpstreamError { error, enforced }
            }
            (Err(error), _) => Answer::UpstreamError(error),
        }
    }
}

/// For a shadowed delivery that holds no claim: the application still
/// learns the key, so it can see the duplicates enforcing would suppress,
/// but no attempt is named.
pub(super) fn unclaimed_dedupe_headers(route: &Route, trace: &Trace) -> Option<DedupeHeaders> {
    let key = trace.key.as_deref()?;
    Some(DedupeHeaders {
        key: key::header_value(key.as_bytes()),
        source: route_source(route),
        attempt: None,
    })
}

/// `X-Dedupe-Source`: the route's name.
fn route_source(route: &Route) -> HeaderValue {
    HeaderValue::from_str(&route.name).expect("route names are header-safe")
}
