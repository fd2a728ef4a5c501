//! Prometheus metrics of SPEC section 7, registered on an explicit registry
//! and passed around; label values come from configuration and fixed enums
//! only, never from request data.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Buckets from sub-millisecond store calls to multi-second upstream calls.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// Buckets for the age of duplicates: seconds (fast retries) to weeks (replays).
const AGE_BUCKETS: &[f64] = &[
    1.0,
    10.0,
    60.0,
    300.0,
    1800.0,
    3600.0,
    6.0 * 3600.0,
    86400.0,
    3.0 * 86400.0,
    7.0 * 86400.0,
    30.0 * 86400.0,
];

/// Every value each label can take, so that every series the proxy may
/// record exists at zero from start-up: `rate()` and `increase()` see the
/// first event of a series only when the series was already there.
pub mod labels {
    /// `dedupe_requests_total{outcome}` on a configured route.
    pub const OUTCOMES: &[&str] = &[
        "forwarded",
        "duplicate",
        "in_flight",
        "rejected_missing_key",
        "rejected_signature",
        "rejected_too_large",
        "rejected_bad_request",
        "rejected_payload_mismatch",
        "store_unavailable",
        "upstream_error",
        "passthrough",
        "overloaded",
    ];
    /// `dedupe_requests_total{outcome}` with `route="unmatched"`.
    pub const UNMATCHED_OUTCOMES: &[&str] = &[
        "passthrough",
        "upstream_error",
        "rejected_bad_request",
        "overloaded",
    ];
    /// `dedupe_claims_total{result}`.
    pub const CLAIM_RESULTS: &[&str] = &[
        "won_new",
        "won_failed",
        "won_expired_lease",
        "lost_done",
        "lost_in_flight",
    ];
    /// `dedupe_upstream_responses_total{class}`.
    pub const UPSTREAM_CLASSES: &[&str] = &["2xx", "3xx", "4xx", "5xx", "timeout", "connect_error"];
    /// `dedupe_store_duration_seconds{op}` and `dedupe_store_errors_total{op}`.
    pub const STORE_OPS: &[&str] = &["claim", "settle", "prune"];
}

/// Every metric the proxy exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// `dedupe_requests_total{route, outcome}`.
    pub requests: IntCounterVec,
    /// `dedupe_claims_total{route, result}`.
    pub claims: IntCounterVec,
    /// `dedupe_upstream_responses_total{route, class}`.
    pub upstream_responses: IntCounterVec,
    /// `dedupe_upstream_duration_seconds{route}`.
    pub upstream_duration: HistogramVec,
    /// `dedupe_store_duration_seconds{op}`.
    pub store_duration: HistogramVec,
    /// `dedupe_store_errors_total{op}`.
    pub store_errors: IntCounterVec,
    /// `dedupe_payload_mismatch_total{route}`.
    pub payload_mismatch: IntCounterVec,
    /// `dedupe_duplicate_age_seconds{route}`.
    pub duplicate_age: HistogramVec,
    /// `dedupe_keys_pruned_total`.
    pub keys_pruned: IntCounter,
    /// `dedupe_in_flight_requests`.
    pub in_flight: IntGauge,
}

impl Metrics {
    /// Registers every metric on a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry
                .register(Box::new(metric.clone()))
                .expect("unique metric");
            metric
        };
        let histogram = |name: &str, help: &str, labels: &[&str], buckets: &[f64]| {
            let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
            let metric = HistogramVec::new(opts, labels).expect("valid metric");
            registry
                .register(Box::new(metric.clone()))
                .expect("unique metric");
            metric
        };
        let metrics = Self {
            requests: counter(
                "dedupe_requests_total",
                "Webhook requests by route and outcome.",
                &["route", "outcome"],
            ),
            claims: counter(
                "dedupe_claims_total",
                "Claim attempts by route and result.",
                &["route", "result"],
            ),
            upstream_responses: counter(
                "dedupe_upstream_responses_total",
                "Upstream answers by route and status class.",
                &["route", "class"],
            ),
            upstream_duration: histogram(
                "dedupe_upstream_duration_seconds",
                "Time to the upstream's response headers.",
                &["route"],
                LATENCY_BUCKETS,
            ),
            store_duration: histogram(
                "dedupe_store_duration_seconds",
                "Store operation latency.",
                &["op"],
                LATENCY_BUCKETS,
            ),
            store_errors: counter(
                "dedupe_store_errors_total",
                "Failed store operations.",
                &["op"],
            ),
            payload_mismatch: counter(
                "dedupe_payload_mismatch_total",
                "Keys delivered again with a different body.",
                &["route"],
            ),
            duplicate_age: histogram(
                "dedupe_duplicate_age_seconds",
                "Time since a duplicate key's first delivery.",
                &["route"],
                AGE_BUCKETS,
            ),
            keys_pruned: IntCounter::new(
                "dedupe_keys_pruned_total",
                "Keys deleted after their retention.",
            )
            .expect("valid metric"),
            in_flight: IntGauge::new(
                "dedupe_in_flight_requests",
                "Requests being handled on the webhook listener, unmatched ones included.",
            )
            .expect("valid metric"),
            registry: registry.clone(),
        };
        registry
            .register(Box::new(metrics.keys_pruned.clone()))
            .expect("unique metric");
        registry
            .register(Box::new(metrics.in_flight.clone()))
            .expect("unique metric");
        let build_info = IntGaugeVec::new(
            Opts::new("dedupe_build_info", "Always 1; the version is a label."),
            &["version"],
        )
        .expect("valid metric");
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        registry
            .register(Box::new(build_info))
            .expect("unique metric");
        metrics
    }

    /// Creates every series the proxy can record for `routes` (the
    /// configured route names) and requests matching none, at zero.
    pub fn start_at_zero<'a>(&self, routes: impl IntoIterator<Item = &'a str>) {
        for route in routes {
            for outcome in labels::OUTCOMES {
                self.requests.with_label_values(&[route, outcome]);
            }
            for result in labels::CLAIM_RESULTS {
                self.claims.with_label_values(&[route, result]);
            }
            for class in labels::UPSTREAM_CLASSES {
                self.upstream_responses.with_label_values(&[route, class]);
            }
            self.upstream_duration.with_label_values(&[route]);
            self.payload_mismatch.with_label_values(&[route]);
            self.duplicate_age.with_label_values(&[route]);
        }
        for outcome in labels::UNMATCHED_OUTCOMES {
            self.requests
                .with_label_values(&[crate::config::UNMATCHED_ROUTE, outcome]);
        }
        self.upstream_series(crate::config::UNMATCHED_ROUTE);
        for op in labels::STORE_OPS {
            self.store_duration.with_label_values(&[op]);
            self.store_errors.with_label_values(&[op]);
        }
    }

    /// Times a store operation into `dedupe_store_duration_seconds` and counts
    /// its failure in `dedupe_store_errors_total`.
    pub async fn time_store<T, E>(
        &self,
        op: &str,
        operation: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let timer = self.store_duration.with_label_values(&[op]).start_timer();
        let result = operation.await;
        timer.observe_duration();
        if result.is_err() {
            self.store_errors.with_label_values(&[op]).inc();
        }
        result
    }

    /// The histogram of one route's upstream latency.
    pub fn upstream_duration(&self, route: &str) -> Histogram {
        self.upstream_duration.with_label_values(&[route])
    }

    /// One route's upstream series, looked up once, for a caller that counts
    /// on every request and should not hash its labels each time.
    pub fn upstream_series(&self, route: &str) -> UpstreamSeries {
        UpstreamSeries {
            responses: labels::UPSTREAM_CLASSES
                .iter()
                .map(|class| self.upstream_responses.with_label_values(&[route, class]))
                .collect(),
            duration: self.upstream_duration(route),
        }
    }

    /// The text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .expect("text encoding cannot fail");
        String::from_utf8(buffer).expect("exposition is UTF-8")
    }
}

/// `dedupe_upstream_responses_total` and `dedupe_upstream_duration_seconds`
/// of one route.
pub struct UpstreamSeries {
    /// In the order of [`labels::UPSTREAM_CLASSES`].
    responses: Box<[IntCounter]>,
    duration: Histogram,
}

impl UpstreamSeries {
    /// Counts one upstream answer (or failure) of `class`, one of
    /// [`labels::UPSTREAM_CLASSES`], that took `took`.
    pub fn observe(&self, class: &str, took: std::time::Duration) {
        let index = labels::UPSTREAM_CLASSES
            .iter()
            .position(|known| *known == class)
            .expect("an upstream class is one of the label's values");
        self.responses[index].inc();
        self.duration.observe(took.as_secs_f64());
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
