//! What a request leaves behind for operators: its metrics and its log line.

use std::time::{Duration, Instant};

use http::Response;
use hyper::body::Incoming;

use super::{Answer, Proxy, Trace};
use crate::route::Route;
use crate::store::{Claim, WonFrom};
use crate::upstream::UpstreamError;

impl Proxy {
    pub(super) fn count_claim(&self, route: &Route, key: &str, claim: &Claim) {
        let result = match claim {
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
        };
        self.metrics
            .claims
            .with_label_values(&[&*route.name, result])
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
        result: &Result<Response<Incoming>, UpstreamError>,
        took: Duration,
    ) {
        let class = match result {
            Ok(response) => match response.status().as_u16() {
                200..=299 => "2xx",
                300..=399 => "3xx",
                400..=499 => "4xx",
                _ => "5xx",
            },
            Err(UpstreamError::Timeout(_)) => "timeout",
            Err(_) => "connect_error",
        };
        self.metrics
            .upstream_responses
            .with_label_values(&[&*route.name, class])
            .inc();
        self.metrics
            .upstream_duration(&route.name)
            .observe(took.as_secs_f64());
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
