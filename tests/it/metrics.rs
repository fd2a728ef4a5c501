//! `/metrics` after scripted traffic, read with a real exposition parser:
//! every family's type, every series' labels and exact values, histogram
//! counts that match the requests, and label values drawn only from the
//! configuration and fixed vocabularies.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::exposition::{Exposition, Labels};
use crate::on_both_stores;
use crate::support::{Backend, Behavior, Gate, TestApp};

on_both_stores!(
    every_series_exists_at_zero_from_start_up,
    scripted_traffic_gives_exact_metric_values,
    an_unreachable_upstream_counts_as_a_connect_error,
);

/// Every family SPEC section 7 names, with its type.
const FAMILIES: &[(&str, &str)] = &[
    ("dedupe_requests_total", "counter"),
    ("dedupe_claims_total", "counter"),
    ("dedupe_upstream_responses_total", "counter"),
    ("dedupe_upstream_duration_seconds", "histogram"),
    ("dedupe_store_duration_seconds", "histogram"),
    ("dedupe_store_errors_total", "counter"),
    ("dedupe_payload_mismatch_total", "counter"),
    ("dedupe_duplicate_age_seconds", "histogram"),
    ("dedupe_keys_pruned_total", "counter"),
    ("dedupe_in_flight_requests", "gauge"),
    ("dedupe_build_info", "gauge"),
];

type Series = BTreeMap<Labels, f64>;

/// Expected series: `[(labels, value)]` with label pairs in name order.
fn series(expected: &[(&[(&str, &str)], f64)]) -> Series {
    expected
        .iter()
        .map(|(labels, value)| {
            let mut labels: Labels = labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            labels.sort();
            (labels, *value)
        })
        .collect()
}

/// The series that have counted something: every series the proxy may
/// record exists from start-up, at zero.
fn counted(series: Series) -> Series {
    series
        .into_iter()
        .filter(|(_, value)| *value != 0.0)
        .collect()
}

async fn scrape(app: &TestApp) -> Exposition {
    let response = app.admin_get("/metrics").await;
    assert_eq!(response.status, 200);
    assert_eq!(
        response.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    Exposition::parse(&response.body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_answers_say_what_they_are_and_which_methods_they_take() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let text = Some("text/plain; charset=utf-8");
    for (path, status) in [("/healthz", 200), ("/readyz", 200), ("/nothing-here", 404)] {
        let response = app.admin_get(path).await;
        assert_eq!(response.status, status, "{path}");
        assert_eq!(response.header("content-type"), text, "{path}");
    }
    let refused = app.admin_request(http::Method::POST, "/metrics").await;
    assert_eq!(refused.status, 405);
    assert_eq!(refused.header("allow"), Some("GET, HEAD"));
    assert_eq!(refused.header("content-type"), text);
}

/// A series born at its first event hides that event from `rate()` and
/// `increase()`, so an alert on the first payload mismatch or store error
/// after a restart would never fire.
async fn every_series_exists_at_zero_from_start_up(backend: Backend) {
    let app = TestApp::spawn(backend, |_| {}).await;
    let metrics = scrape(&app).await;
    assert_families_and_labels(&metrics);
    for (family, _) in FAMILIES {
        assert!(metrics.types.contains_key(*family), "{family} is exposed");
    }
    let routes = ["orders", "json"];
    let sizes = [
        ("dedupe_requests_total", routes.len() * 12 + 4),
        ("dedupe_claims_total", routes.len() * 5),
        // Unmatched requests are forwarded too: their upstream series exist.
        ("dedupe_upstream_responses_total", (routes.len() + 1) * 6),
        ("dedupe_payload_mismatch_total", routes.len()),
        ("dedupe_store_errors_total", 3),
        ("dedupe_upstream_duration_seconds_count", routes.len() + 1),
        ("dedupe_duplicate_age_seconds_count", routes.len()),
        ("dedupe_store_duration_seconds_count", 3),
    ];
    for (name, size) in sizes {
        let series = metrics.series(name);
        assert_eq!(series.len(), size, "{name}: {series:?}");
        assert!(counted(series).is_empty(), "{name} starts at zero");
    }
    for outcome in [
        "passthrough",
        "upstream_error",
        "rejected_bad_request",
        "overloaded",
    ] {
        let labels = [("outcome", outcome), ("route", "unmatched")];
        assert_eq!(
            metrics.value("dedupe_requests_total", &labels),
            Some(0.0),
            "{outcome}"
        );
    }
}

async fn scripted_traffic_gives_exact_metric_values(backend: Backend) {
    let app = TestApp::spawn(backend, |config| {
        config.upstream.timeout = Duration::from_secs(1);
        config.limits.max_body_bytes = 64;
    })
    .await;
    let outcome =
        |response: crate::support::TestResponse| (response.status, response.outcome().to_owned());
    // First delivery, then two duplicates (the second with another body).
    assert_eq!(
        outcome(app.deliver("evt_new", "{}").await),
        (200, "forwarded".into())
    );
    assert_eq!(
        outcome(app.deliver("evt_new", "{}").await),
        (200, "duplicate".into())
    );
    assert_eq!(
        outcome(app.deliver("evt_new", r#"{"other":1}"#).await),
        (200, "duplicate".into())
    );
    // A duplicate while the first delivery is still at the upstream.
    let gate = Gate::new();
    app.upstream
        .script("evt_slow", [Behavior::Gate(gate.clone())]);
    let (first, (second, during)) = tokio::join!(app.deliver("evt_slow", "{}"), async {
        app.upstream.wait_for(2).await;
        let second = app.deliver("evt_slow", "{}").await;
        let during = scrape(&app).await;
        gate.open();
        (second, during)
    });
    assert_eq!(outcome(first), (200, "forwarded".into()));
    assert_eq!(outcome(second), (409, "in-flight".into()));
    assert_eq!(during.value("dedupe_in_flight_requests", &[]), Some(1.0));
    // An upstream 500, then its retry.
    app.upstream.script("evt_500", [Behavior::Status(500)]);
    assert_eq!(
        outcome(app.deliver("evt_500", "{}").await),
        (500, "forwarded".into())
    );
    assert_eq!(
        outcome(app.deliver("evt_500", "{}").await),
        (200, "forwarded".into())
    );
    // A redirect and a client error: forwarded answers, settled failed.
    for (key, status) in [("evt_302", 302), ("evt_404", 404)] {
        app.upstream.script(key, [Behavior::Status(status)]);
        let answered = outcome(app.deliver(key, "{}").await);
        assert_eq!(answered, (status, "forwarded".into()));
    }
    // An upstream that never answers.
    app.upstream.script("evt_hang", [Behavior::Hang]);
    assert_eq!(
        outcome(app.deliver("evt_hang", "{}").await),
        (504, "upstream-error".into())
    );
    // Rejections and a request matching no route.
    assert_eq!(outcome(app.post("/hooks/orders", &[], "{}").await).0, 400);
    assert_eq!(
        outcome(app.deliver("evt_big", &"x".repeat(100)).await).0,
        413
    );
    assert_eq!(
        outcome(app.post("/hooks/json", &[], "not json").await).0,
        400
    );
    assert_eq!(
        outcome(
            app.post("/elsewhere", &[("x-event-id", "evt_stray")], "{}")
                .await
        ),
        (200, "passthrough".into())
    );
    assert_eq!(app.upstream.count(), 8);

    let metrics = scrape(&app).await;
    assert_families_and_labels(&metrics);
    assert_eq!(
        counted(metrics.series("dedupe_requests_total")),
        series(&[
            (&[("route", "orders"), ("outcome", "forwarded")], 6.0),
            (&[("route", "orders"), ("outcome", "duplicate")], 2.0),
            (&[("route", "orders"), ("outcome", "in_flight")], 1.0),
            (&[("route", "orders"), ("outcome", "upstream_error")], 1.0),
            (
                &[("route", "orders"), ("outcome", "rejected_missing_key")],
                1.0
            ),
            (
                &[("route", "orders"), ("outcome", "rejected_too_large")],
                1.0
            ),
            (
                &[("route", "json"), ("outcome", "rejected_bad_request")],
                1.0
            ),
            (&[("route", "unmatched"), ("outcome", "passthrough")], 1.0),
        ])
    );
    assert_eq!(
        counted(metrics.series("dedupe_claims_total")),
        series(&[
            (&[("route", "orders"), ("result", "won_new")], 6.0),
            (&[("route", "orders"), ("result", "won_failed")], 1.0),
            (&[("route", "orders"), ("result", "lost_done")], 2.0),
            (&[("route", "orders"), ("result", "lost_in_flight")], 1.0),
        ])
    );
    assert_eq!(
        counted(metrics.series("dedupe_upstream_responses_total")),
        series(&[
            (&[("route", "orders"), ("class", "2xx")], 3.0),
            (&[("route", "orders"), ("class", "3xx")], 1.0),
            (&[("route", "orders"), ("class", "4xx")], 1.0),
            (&[("route", "orders"), ("class", "5xx")], 1.0),
            (&[("route", "orders"), ("class", "timeout")], 1.0),
            (&[("route", "unmatched"), ("class", "2xx")], 1.0),
        ])
    );
    assert_eq!(
        counted(metrics.series("dedupe_payload_mismatch_total")),
        series(&[(&[("route", "orders")], 1.0)])
    );
    assert!(counted(metrics.series("dedupe_store_errors_total")).is_empty());
    assert_eq!(metrics.value("dedupe_keys_pruned_total", &[]), Some(0.0));
    assert_eq!(metrics.value("dedupe_in_flight_requests", &[]), Some(0.0));
    assert_eq!(
        metrics.series("dedupe_build_info"),
        series(&[(&[("version", env!("CARGO_PKG_VERSION"))], 1.0)])
    );

    // Histogram counts match the traffic: 7 upstream calls on the route and
    // 1 unmatched, 10 claims, 7 settles, 2 duplicates; nothing else was
    // observed.
    let counts = |family: &str| counted(metrics.series(&format!("{family}_count")));
    assert_eq!(
        counts("dedupe_upstream_duration_seconds"),
        series(&[
            (&[("route", "orders")], 7.0),
            (&[("route", "unmatched")], 1.0)
        ])
    );
    assert_eq!(
        counts("dedupe_store_duration_seconds"),
        series(&[(&[("op", "claim")], 10.0), (&[("op", "settle")], 7.0)])
    );
    assert_eq!(
        counts("dedupe_duplicate_age_seconds"),
        series(&[(&[("route", "orders")], 2.0)])
    );
    let hung = metrics
        .value(
            "dedupe_upstream_duration_seconds_sum",
            &[("route", "orders")],
        )
        .unwrap();
    assert!(
        hung >= 1.0,
        "the timed-out call took the whole timeout: {hung}"
    );
    assert_eq!(
        metrics.value(
            "dedupe_upstream_duration_seconds_bucket",
            &[("route", "orders"), ("le", "0.5")]
        ),
        Some(6.0),
        "only the timed-out call took longer than 0.5s"
    );
}

async fn an_unreachable_upstream_counts_as_a_connect_error(backend: Backend) {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let app = TestApp::spawn(backend, |config| {
        config.upstream.url = format!("http://{closed}");
    })
    .await;
    let response = app.deliver("evt_1", "{}").await;
    assert_eq!(
        (response.status, response.outcome()),
        (502, "upstream-error")
    );
    let unmatched = app.send(http::Method::GET, "/status", &[], "").await;
    assert_eq!(
        (unmatched.status, unmatched.outcome()),
        (502, "upstream-error")
    );
    let metrics = scrape(&app).await;
    assert_families_and_labels(&metrics);
    assert_eq!(
        counted(metrics.series("dedupe_upstream_responses_total")),
        series(&[
            (&[("route", "orders"), ("class", "connect_error")], 1.0),
            (&[("route", "unmatched"), ("class", "connect_error")], 1.0),
        ])
    );
    assert_eq!(
        counted(metrics.series("dedupe_requests_total")),
        series(&[
            (&[("route", "orders"), ("outcome", "upstream_error")], 1.0),
            (
                &[("route", "unmatched"), ("outcome", "upstream_error")],
                1.0
            ),
        ])
    );
    assert_eq!(
        counted(metrics.series("dedupe_claims_total")),
        series(&[(&[("route", "orders"), ("result", "won_new")], 1.0)])
    );
}

/// Every family is one of SPEC's with its type and help; every histogram is
/// well formed; every label value comes from the configuration or a fixed
/// vocabulary, never from a request.
fn assert_families_and_labels(metrics: &Exposition) {
    let known: BTreeMap<&str, &str> = FAMILIES.iter().copied().collect();
    for (family, kind) in &metrics.types {
        assert_eq!(known.get(family.as_str()), Some(&kind.as_str()), "{family}");
        assert!(!metrics.help[family].is_empty(), "{family} has help");
    }
    for sample in &metrics.samples {
        let family = metrics.family(&sample.name);
        assert!(
            metrics.types.contains_key(family),
            "{} has a TYPE line",
            sample.name
        );
        for (name, value) in &sample.labels {
            let allowed: &[&str] = match name.as_str() {
                "route" => &["orders", "json", "unmatched"],
                "outcome" => &[
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
                ],
                "result" => &[
                    "won_new",
                    "won_failed",
                    "won_expired_lease",
                    "lost_done",
                    "lost_in_flight",
                ],
                "class" => &["2xx", "3xx", "4xx", "5xx", "timeout", "connect_error"],
                "op" => &["claim", "settle", "prune"],
                "version" => &[env!("CARGO_PKG_VERSION")],
                "le" => continue,
                other => panic!("unexpected label {other} on {}", sample.name),
            };
            assert!(
                allowed.contains(&value.as_str()),
                "{}{{{name}={value:?}}}",
                sample.name
            );
        }
    }
    for (family, _) in FAMILIES.iter().filter(|(_, kind)| *kind == "histogram") {
        assert_histograms_are_cumulative(metrics, family);
    }
}

/// Buckets never decrease with `le`, and the `+Inf` bucket is the count.
fn assert_histograms_are_cumulative(metrics: &Exposition, family: &str) {
    let mut buckets: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
    for sample in metrics
        .samples
        .iter()
        .filter(|s| s.name == format!("{family}_bucket"))
    {
        let mut labels = sample.labels.clone();
        let le: f64 = match labels.remove("le").expect("le label").as_str() {
            "+Inf" => f64::INFINITY,
            number => number.parse().expect("numeric le"),
        };
        buckets
            .entry(labels.into_iter().collect())
            .or_default()
            .push((le, sample.value));
    }
    let counts = metrics.series(&format!("{family}_count"));
    assert_eq!(buckets.len(), counts.len(), "{family}: a count per series");
    for (labels, mut series) in buckets {
        series.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(
            series.windows(2).all(|w| w[0].1 <= w[1].1),
            "{family} {labels:?}"
        );
        let (le, total) = *series.last().unwrap();
        assert_eq!(
            (le, total),
            (f64::INFINITY, counts[&labels]),
            "{family} {labels:?}"
        );
    }
}
