//! What a request leaves behind for operators: its metrics and its log line.

use std::time::{Duration, Instant};

use http::Response;

use super::{Answer, Proxy, Trace};
use crate::route::Route;
use crate::store::{Claim, WonFrom};
use crate::upstream::{ResponseBody, UpstreamError};

impl Proxy {
    pub(super) fn count_claim(&self, route: &Route, key: &str, claim: &Claim) {
        self.metrics
            .claims
            .with_label_values(&[&*route.name, claim_result(claim)])
            .inc();
        if let Claim::Done { age, .. } = claim {
            self.metrics
                .duplicate_age
                .with_label_values(&[&*route.name])
                .observe(age.as_secs_f64());
        }
        if claim.payload_mismatch() {
            self.metrics
                .payload_mismatch
                .with_label_values(&[&*route.name])
                .inc();
            tracing::warn!(
                route = &*route.name,
                key,
                "event id delivered again with a different body"
            );
        }
    }

    pub(super) fn count_upstream(
        &self,
        route: &Route,
        result: &Result<Response<ResponseBody>, UpstreamError>,
        took: Duration,
    ) {
        let class = class_of(result);
        self.metrics
            .upstream_responses
            .with_label_values(&[&*route.name, class])
            .inc();
        self.metrics
            .upstream_duration(&route.name)
            .observe(took.as_secs_f64());
    }
}

/// The `result` label of `dedupe_claims_total`.
fn claim_result(claim: &Claim) -> &'static str {
    match claim {
        Claim::Won {
            from: WonFrom::New, ..
        } => "won_new",
        Claim::Won {
            from: WonFrom::Failed,
            ..
        } => "won_failed",
        Claim::Won {
            from: WonFrom::ExpiredLease,
            ..
        } => "won_expired_lease",
        Claim::Done { .. } => "lost_done",
        Claim::InFlight { .. } => "lost_in_flight",
    }
}

/// The `class` label of `dedupe_upstream_responses_total` for one call.
pub(super) fn class_of(result: &Result<Response<ResponseBody>, UpstreamError>) -> &'static str {
    upstream_class(result.as_ref().map(|response| response.status().as_u16()))
}

/// The `class` label of `dedupe_upstream_responses_total`, from the status
/// the upstream answered with or why it did not.
fn upstream_class(answered: Result<u16, &UpstreamError>) -> &'static str {
    match answered {
        Ok(200..=299) => "2xx",
        Ok(300..=399) => "3xx",
        Ok(400..=499) => "4xx",
        Ok(_) => "5xx",
        Err(UpstreamError::Timeout(_)) => "timeout",
        Err(_) => "connect_error",
    }
}

/// Counts a request in `dedupe_in_flight_requests` until dropped, however
/// the request ends.
pub(super) struct InFlight(prometheus::IntGauge);

impl InFlight {
    pub(super) fn count(gauge: &prometheus::IntGauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The one log line per request: at info for webhooks, at debug for
/// unmatched traffic the proxy merely passes along.
pub(super) fn log_request(
    webhook: bool,
    route: &str,
    trace: &Trace,
    answer: &Answer,
    started: Instant,
) {
    macro_rules! line {
        ($level:expr) => {
            tracing::event!(
                $level,
                route,
                key = trace.key,
                outcome = answer.metric_outcome(),
                attempt = trace.attempt,
                upstream_status = answer.upstream_status(),
                reason = answer.reason().as_deref(),
                store_ms = millis(trace.store_time),
                upstream_ms = trace.upstream_time.map(millis),
                total_ms = millis(started.elapsed()),
                "webhook"
            )
        };
    }
    if webhook {
        line!(tracing::Level::INFO);
    } else {
        line!(tracing::Level::DEBUG);
    }
}

/// Milliseconds with microsecond precision, for log fields.
fn millis(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1e6).round() / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::labels;

    #[test]
    fn every_claim_result_and_upstream_class_is_created_at_start_up() {
        let age = Duration::ZERO;
        let payload_mismatch = false;
        let wins = [WonFrom::New, WonFrom::Failed, WonFrom::ExpiredLease].map(|from| Claim::Won {
            fence: crate::store::Fence {
                attempt: 1,
                claimed_at: std::time::UNIX_EPOCH,
            },
            from,
            payload_mismatch,
        });
        let losses = [
            Claim::Done {
                age,
                payload_mismatch,
            },
            Claim::InFlight { payload_mismatch },
        ];
        for claim in wins.iter().chain(&losses) {
            assert!(
                labels::CLAIM_RESULTS.contains(&claim_result(claim)),
                "{claim:?}"
            );
        }
        let errors = [
            UpstreamError::Timeout(Duration::ZERO),
            UpstreamError::Connect(String::new()),
            UpstreamError::Failed(String::new()),
        ];
        let answered = [200, 302, 404, 503].map(Ok);
        for class in answered
            .into_iter()
            .chain(errors.iter().map(Err))
            .map(upstream_class)
        {
            assert!(labels::UPSTREAM_CLASSES.contains(&class), "{class}");
        }
    }
}
