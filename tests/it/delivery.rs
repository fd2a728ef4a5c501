//! The happy and retry paths of SPEC section 3: first delivery, duplicates,
//! failures and retries, concurrency, shadow mode, and the headers the
//! upstream and the sender see.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::on_both_stores;
use crate::support::{Backend, Behavior, Gate, TestApp};
use dedupe_proxy::config::{Mode, OnPayloadMismatch, StatusMatch};

on_both_stores!(
    first_delivery_is_forwarded_once_and_duplicates_are_answered_by_the_proxy,
    upstream_failure_settles_failed_and_the_retry_is_forwarded_with_attempt_two,
    done_on_decides_which_statuses_count_as_processed,
    concurrent_identical_deliveries_reach_the_upstream_exactly_once,
    in_flight_duplicates_get_409_with_retry_after,
    unreachable_upstream_answers_502_and_the_retry_goes_through,
    upstream_timeout_answers_504_and_settles_failed,
    json_keys_are_read_from_the_body,
    keys_with_control_and_non_ascii_characters_are_kept_byte_for_byte,
    shadow_mode_forwards_everything_but_records_claims,
    a_shadowed_duplicate_whose_upstream_fails_is_still_counted_as_a_duplicate,
    payload_mismatch_is_counted_or_rejected,
    a_mismatched_retry_of_a_failed_key_is_rejected_and_the_key_left_as_it_was,
    shadow_mode_records_the_payload_mismatches_it_would_reject,
    forwarded_requests_carry_dedupe_and_forwarding_headers,
    unmatched_requests_are_forwarded_untouched,
    missing_key_can_be_forwarded_without_dedupe,
);

async fn first_delivery_is_forwarded_once_and_duplicates_are_answered_by_the_proxy(
    backend: Backend,
) {
    let app = TestApp::spawn(backend, |_| {}).await;
    let first = app.deliver("evt_1", r#"{"n":1}"#).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.outcome(), "forwarded");
    assert_eq!(
        first.header("x-upstream"),
        Some("yes"),
        "the upstream's response is passed back"
    );
    assert_eq!(first.body, "upstream says 200 to evt_1");

    // Settle happens before the answer, so an immediate retry is a duplicate.
    for _ in 0..3 {
        let again = app.deliver("evt_1", r#"{"n":1}"#).await;
        assert_eq!(again.status, 200);
        assert_eq!(again.outcome(), "duplicate");
        assert!(again.header("x-upstream").is_none());
    }
    assert_eq!(app.upstream.count(), 1);
    let other = app.deliver("evt_2", "{}").await;
    assert_eq!(other.outcome(), "forwarded");
    assert_eq!(app.upstream.count(), 2);
}

async fn upstream_failure_settles_failed_and_the_retry_is_forwarded_with_attempt_two(
    backend: Backend,
) {
    let app = TestApp::spawn(backend, |_| {}).await;
    app.upstream.script(
        "evt_f",
        [
            Behavior::Status(500),
            Behavior::Status(503),
            Behavior::Status(201),
        ],
    );
    let first = app.deliver("evt_f", "{}").await;
    assert_eq!((first.status, first.outcome()), (500, "forwarded"));
    let second = app.deliver("evt_f", "{}").await;
    assert_eq!((second.status, second.outcome()), (503, "forwarded"));
    let third = app.deliver("evt_f", "{}").await;
    assert_eq!((third.status, third.outcome()), (201, "forwarded"));
    let fourth = app.deliver("evt_f", "{}").await;
    assert_eq!(fourth.outcome(), "duplicate");
    let attempts: Vec<_> = app
        .upstream
        .seen()
        .iter()
        .map(|s| s.header("x-dedupe-attempt").unwrap().to_string())
        .collect();
    assert_eq!(attempts, ["1", "2", "3"]);
}

async fn done_on_decides_which_statuses_count_as_processed(backend: Backend) {
    let app = TestApp::spawn(backend, |config| {
        config.routes[0].done_on = Some(vec![StatusMatch::Class(2), StatusMatch::Exact(410)]);
        config.routes[0].duplicate_status = Some(208);
    })
    .await;
    app.upstream.script("gone", [Behavior::Status(410)]);
    app.upstream.script("missing", [Behavior::Status(404)]);
    assert_eq!(app.deliver("gone", "{}").await.status, 410);
    let duplicate = app.deliver("gone", "{}").await;
    assert_eq!((duplicate.status, duplicate.outcome()), (208, "duplicate"));
    assert_eq!(app.deliver("missing", "{}").await.status, 404);
    assert_eq!(
        app.deliver("missing", "{}").await.outcome(),
        "forwarded",
        "404 is not in done_on: retried"
    );
    assert_eq!(app.upstream.count(), 3);
}

async fn concurrent_identical_deliveries_reach_the_upstream_exactly_once(backend: Backend) {
    let app = Arc::new(TestApp::spawn(backend, |_| {}).await);
    let gate = Gate::new();
    app.upstream
        .script("evt_c", [Behavior::Gate(Arc::clone(&gate))]);
    let (done, mut responses) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..50 {
        let (app, done) = (Arc::clone(&app), done.clone());
        tokio::spawn(async move { done.send(app.deliver("evt_c", r#"{"same":true}"#).await) });
    }
    // The winner is held at the gate, so every other delivery must be
    // answered without it.
    let mut losers = Vec::new();
    for _ in 0..49 {
        let response =
            tokio::time::timeout(std::time::Duration::from_secs(20), responses.recv()).await;
        losers.push(
            response
                .expect("49 deliveries answered while one is held upstream")
                .unwrap(),
        );
    }
    assert!(
        losers
            .iter()
            .all(|r| (r.status, r.outcome()) == (409, "in-flight")),
        "{losers:?}"
    );
    gate.open();
    let winner = responses.recv().await.unwrap();
    assert_eq!((winner.status, winner.outcome()), (200, "forwarded"));
    assert_eq!(app.upstream.count(), 1);
}

async fn in_flight_duplicates_get_409_with_retry_after(backend: Backend) {
    let app = Arc::new(
        TestApp::spawn(backend, |config| {
            config.defaults.in_flight_retry_after = std::time::Duration::from_secs(7);
        })
        .await,
    );
    let gate = Gate::new();
    app.upstream
        .script("evt_slow", [Behavior::Gate(Arc::clone(&gate))]);
    let first = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.deliver("evt_slow", "{}").await }
    });
    app.upstream.wait_for(1).await;
    let duplicate = app.deliver("evt_slow", "{}").await;
    assert_eq!(duplicate.status, 409);
    assert_eq!(duplicate.outcome(), "in-flight");
    assert_eq!(duplicate.header("retry-after"), Some("7"));
    gate.open();
    assert_eq!(first.await.unwrap().outcome(), "forwarded");
    assert_eq!(app.deliver("evt_slow", "{}").await.outcome(), "duplicate");
    assert_eq!(app.upstream.count(), 1);
}

async fn unreachable_upstream_answers_502_and_the_retry_goes_through(backend: Backend) {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closed_addr = closed.local_addr().unwrap();
    drop(closed);
    let app = TestApp::spawn(backend, |config| {
        config.upstream.url = format!("http://{closed_addr}")
    })
    .await;
    let refused = app.deliver("evt_u", "{}").await;
    assert_eq!((refused.status, refused.outcome()), (502, "upstream-error"));
    // Same store, now with a working upstream: the key was settled failed.
    let store = Arc::clone(&app.store);
    drop(app);
    let app = TestApp::spawn_on(store, crate::support::Upstream::start().await, |_| {}).await;
    let retry = app.deliver("evt_u", "{}").await;
    assert_eq!((retry.status, retry.outcome()), (200, "forwarded"));
    assert_eq!(app.upstream.seen()[0].header("x-dedupe-attempt"), Some("2"));
}

async fn upstream_timeout_answers_504_and_settles_failed(backend: Backend) {
    let app = TestApp::spawn(backend, |config| {
        config.upstream.timeout = std::time::Duration::from_millis(300)
    })
    .await;
    app.upstream.script("evt_t", [Behavior::Hang]);
    let timed_out = app.deliver("evt_t", "{}").await;
    assert_eq!(
        (timed_out.status, timed_out.outcome()),
        (504, "upstream-error")
    );
    let retry = app.deliver("evt_t", "{}").await;
    assert_eq!((retry.status, retry.outcome()), (200, "forwarded"));
    assert_eq!(app.upstream.count(), 2);
    assert_eq!(app.upstream.seen()[1].header("x-dedupe-attempt"), Some("2"));
}

async fn json_keys_are_read_from_the_body(backend: Backend) {
    let app = TestApp::spawn(backend, |_| {}).await;
    let body = r#"{"id":"evt_json","type":"charge"}"#;
    assert_eq!(
        app.post("/hooks/json", &[], body).await.outcome(),
        "forwarded"
    );
    assert_eq!(
        app.post("/hooks/json", &[], body).await.outcome(),
        "duplicate"
    );
    assert_eq!(
        app.post("/hooks/json", &[], r#"{"id":12345}"#)
            .await
            .outcome(),
        "forwarded"
    );
    assert_eq!(app.upstream.seen()[1].header("x-dedupe-key"), Some("12345"));
    // Keys are namespaced by route: the same id on another route is new.
    assert_eq!(app.deliver("evt_json", body).await.outcome(), "forwarded");
    assert_eq!(app.upstream.count(), 3);
}

/// SPEC section 8: keys are compared byte for byte and sent upstream with
/// the bytes outside visible ASCII percent-encoded; control characters are
/// text like any other (only NUL, which PostgreSQL's text cannot hold, is
/// refused).
async fn keys_with_control_and_non_ascii_characters_are_kept_byte_for_byte(backend: Backend) {
    let app = TestApp::spawn(backend, |_| {}).await;
    let body = r#"{"id":"evt\t\u00e4\n\u001b"}"#;
    assert_eq!(
        app.post("/hooks/json", &[], body).await.outcome(),
        "forwarded"
    );
    assert_eq!(
        app.post("/hooks/json", &[], body).await.outcome(),
        "duplicate"
    );
    let shorter = r#"{"id":"evt\t\u00e4\n"}"#;
    assert_eq!(
        app.post("/hooks/json", &[], shorter).await.outcome(),
        "forwarded"
    );
    let tab = app
        .post("/hooks/orders", &[("x-event-id", "a\tb")], "{}")
        .await;
    assert_eq!(tab.outcome(), "forwarded");
    let seen = app.upstream.seen();
    let keys: Vec<_> = seen
        .iter()
        .map(|seen| seen.header("x-dedupe-key"))
        .collect();
    assert_eq!(
        keys,
        [
            Some("evt%09%C3%A4%0A%1B"),
            Some("evt%09%C3%A4%0A"),
            Some("a%09b")
        ]
    );
}

async fn shadow_mode_forwards_everything_but_records_claims(backend: Backend) {
    let app = TestApp::spawn(backend, |config| config.routes[0].mode = Mode::Shadow).await;
    let first = app.deliver("evt_s", "{}").await;
    let second = app.deliver("evt_s", "{}").await;
    let keyless = app.post("/hooks/orders", &[], "{}").await;
    for response in [&first, &second, &keyless] {
        assert_eq!((response.status, response.outcome()), (200, "passthrough"));
    }
    assert_eq!(app.upstream.count(), 3, "shadow mode suppresses nothing");
    let seen = app.upstream.seen();
    assert_eq!(seen[0].header("x-dedupe-attempt"), Some("1"));
    // The duplicate holds no claim, so it names no attempt, but the
    // application still learns its key.
    assert_eq!(seen[1].header("x-dedupe-key"), Some("evt_s"));
    assert_eq!(seen[1].header("x-dedupe-source"), Some("orders"));
    assert_eq!(seen[1].header("x-dedupe-attempt"), None);
    assert_eq!(seen[2].header("x-dedupe-key"), None, "no key to name");
    // The metrics say what enforcing would have done.
    app.assert_metrics(&[
        r#"dedupe_claims_total{result="won_new",route="orders"} 1"#,
        r#"dedupe_claims_total{result="lost_done",route="orders"} 1"#,
        r#"dedupe_requests_total{outcome="forwarded",route="orders"} 1"#,
        r#"dedupe_requests_total{outcome="duplicate",route="orders"} 1"#,
        r#"dedupe_requests_total{outcome="rejected_missing_key",route="orders"} 1"#,
    ])
    .await;
}

async fn a_shadowed_duplicate_whose_upstream_fails_is_still_counted_as_a_duplicate(
    backend: Backend,
) {
    let app = TestApp::spawn(backend, |config| {
        config.routes[0].mode = Mode::Shadow;
        config.upstream.timeout = std::time::Duration::from_millis(300);
    })
    .await;
    app.upstream
        .script("evt_sf", [Behavior::Status(200), Behavior::Hang]);
    assert_eq!(app.deliver("evt_sf", "{}").await.status, 200);
    let duplicate = app.deliver("evt_sf", "{}").await;
    assert_eq!(
        (duplicate.status, duplicate.outcome()),
        (504, "upstream-error"),
        "the sender gets what the upstream did"
    );
    // Enforcing would have answered it as a duplicate, whatever the upstream
    // did; the upstream's failure is in the upstream's own metrics.
    app.assert_metrics(&[
        r#"dedupe_requests_total{outcome="duplicate",route="orders"} 1"#,
        r#"dedupe_requests_total{outcome="upstream_error",route="orders"} 0"#,
        r#"dedupe_upstream_responses_total{class="timeout",route="orders"} 1"#,
    ])
    .await;
}

async fn payload_mismatch_is_counted_or_rejected(backend: Backend) {
    let app = TestApp::spawn(backend, |config| {
        config.routes[1].on_payload_mismatch = Some(OnPayloadMismatch::Reject)
    })
    .await;
    // warn (default): answered by key, counted.
    app.deliver("evt_m", r#"{"amount":1}"#).await;
    let changed = app.deliver("evt_m", r#"{"amount":2}"#).await;
    assert_eq!(changed.outcome(), "duplicate");
    let metrics = app.admin_get("/metrics").await.body;
    assert!(
        metrics.contains(r#"dedupe_payload_mismatch_total{route="orders"} 1"#),
        "{metrics}"
    );
    // reject: 422, nothing forwarded.
    app.post("/hooks/json", &[], r#"{"id":"evt_r","amount":1}"#)
        .await;
    let rejected = app
        .post("/hooks/json", &[], r#"{"id":"evt_r","amount":2}"#)
        .await;
    assert_eq!((rejected.status, rejected.outcome()), (422, "rejected"));
    assert_eq!(app.upstream.count(), 2);
}

async fn a_mismatched_retry_of_a_failed_key_is_rejected_and_the_key_left_as_it_was(
    backend: Backend,
) {
    let app = TestApp::spawn(backend, |config| {
        config.routes[1].on_payload_mismatch = Some(OnPayloadMismatch::Reject)
    })
    .await;
    app.upstream.script("evt_f", [Behavior::Status(500)]);
    let first = app
        .post("/hooks/json", &[], r#"{"id":"evt_f","n":1}"#)
        .await;
    assert_eq!((first.status, first.outcome()), (500, "forwarded"));
    let changed = app
        .post("/hooks/json", &[], r#"{"id":"evt_f","n":2}"#)
        .await;
    assert_eq!((changed.status, changed.outcome()), (422, "rejected"));
    assert_eq!(
        app.upstream.count(),
        1,
        "the mismatched retry is not forwarded"
    );
    // It took no attempt and left the key failed: the original body's retry
    // is forwarded at once, as attempt 2.
    let retry = app
        .post("/hooks/json", &[], r#"{"id":"evt_f","n":1}"#)
        .await;
    assert_eq!((retry.status, retry.outcome()), (200, "forwarded"));
    assert_eq!(app.upstream.seen()[1].header("x-dedupe-attempt"), Some("2"));
}

async fn shadow_mode_records_the_payload_mismatches_it_would_reject(backend: Backend) {
    let app = TestApp::spawn(backend, |config| {
        config.routes[1].mode = Mode::Shadow;
        config.routes[1].on_payload_mismatch = Some(OnPayloadMismatch::Reject);
    })
    .await;
    app.upstream.script("evt_f", [Behavior::Status(500)]);
    for (body, status) in [
        (r#"{"id":"evt_d","n":1}"#, 200),
        (r#"{"id":"evt_d","n":2}"#, 200),
        (r#"{"id":"evt_f","n":1}"#, 500),
        (r#"{"id":"evt_f","n":2}"#, 200),
    ] {
        let response = app.post("/hooks/json", &[], body).await;
        assert_eq!(
            (response.status, response.outcome()),
            (status, "passthrough"),
            "{body}"
        );
    }
    assert_eq!(app.upstream.count(), 4, "shadow mode suppresses nothing");
    let unclaimed = &app.upstream.seen()[3];
    assert_eq!(unclaimed.header("x-dedupe-key"), Some("evt_f"));
    assert_eq!(
        unclaimed.header("x-dedupe-attempt"),
        None,
        "forwarded unclaimed"
    );
    // As enforcing would have left it: the mismatched delivery took no
    // attempt, so the original body is claimed again as attempt 2.
    app.post("/hooks/json", &[], r#"{"id":"evt_f","n":1}"#)
        .await;
    assert_eq!(app.upstream.seen()[4].header("x-dedupe-attempt"), Some("2"));
    app.assert_metrics(&[
        r#"dedupe_requests_total{outcome="rejected_payload_mismatch",route="json"} 2"#,
        r#"dedupe_payload_mismatch_total{route="json"} 2"#,
    ])
    .await;
}

async fn forwarded_requests_carry_dedupe_and_forwarding_headers(backend: Backend) {
    let app = TestApp::spawn(backend, |_| {}).await;
    let response = app
        .post(
            "/hooks/orders?x=1",
            &[
                ("x-event-id", "evt h/1"),
                ("host", "hooks.example.com"),
                ("x-dedupe-attempt", "99"),
                ("x-dedupe-source", "forged"),
                ("x-forwarded-for", "192.0.2.7"),
                ("connection", "x-hop"),
                ("x-hop", "secret"),
                ("x-custom", "kept"),
            ],
            "payload",
        )
        .await;
    assert_eq!(response.outcome(), "forwarded");
    let seen = &app.upstream.seen()[0];
    assert_eq!(seen.uri.path(), "/hooks/orders");
    assert_eq!(seen.uri.query(), Some("x=1"));
    assert_eq!(seen.header("x-dedupe-key"), Some("evt%20h/1"));
    assert_eq!(seen.header("x-dedupe-source"), Some("orders"));
    assert_eq!(seen.header("x-dedupe-attempt"), Some("1"));
    assert_eq!(seen.header("host"), Some("hooks.example.com"));
    assert_eq!(seen.header("x-forwarded-host"), Some("hooks.example.com"));
    assert_eq!(seen.header("x-forwarded-for"), Some("192.0.2.7, 127.0.0.1"));
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));
    assert_eq!(seen.header("x-hop"), None);
    assert_eq!(seen.header("x-custom"), Some("kept"));
    assert_eq!(&seen.body[..], b"payload");
}

async fn unmatched_requests_are_forwarded_untouched(backend: Backend) {
    let app = TestApp::spawn(backend, |_| {}).await;
    let response = app
        .send(
            http::Method::GET,
            "/health/app",
            &[("x-dedupe-key", "forged")],
            "",
        )
        .await;
    assert_eq!((response.status, response.outcome()), (200, "passthrough"));
    // A route's path with another method does not match the route either.
    let put = app
        .send(
            http::Method::PUT,
            "/hooks/orders",
            &[("x-event-id", "evt_p")],
            "x",
        )
        .await;
    assert_eq!(put.outcome(), "passthrough");
    let put_again = app
        .send(
            http::Method::PUT,
            "/hooks/orders",
            &[("x-event-id", "evt_p")],
            "x",
        )
        .await;
    assert_eq!(put_again.outcome(), "passthrough");
    assert_eq!(app.upstream.count(), 3);
    let seen = app.upstream.seen();
    assert_eq!(
        seen[0].header("x-dedupe-key"),
        None,
        "sender's X-Dedupe-* stripped"
    );
    assert_eq!(seen[0].method, http::Method::GET);
    let metrics = app.admin_get("/metrics").await.body;
    assert!(
        metrics.contains(r#"dedupe_requests_total{outcome="passthrough",route="unmatched"} 3"#),
        "{metrics}"
    );
}

async fn missing_key_can_be_forwarded_without_dedupe(backend: Backend) {
    let app = TestApp::spawn(backend, |config| {
        config.routes[0].on_missing_key = Some(dedupe_proxy::config::OnMissingKey::Forward);
    })
    .await;
    for _ in 0..2 {
        let response = app.post("/hooks/orders", &[], "{}").await;
        assert_eq!((response.status, response.outcome()), (200, "passthrough"));
    }
    assert_eq!(app.upstream.count(), 2);
    assert_eq!(app.upstream.seen()[0].header("x-dedupe-key"), None);
}

/// `X-Dedupe-*` fields sent as trailers are stripped as header fields are:
/// an application that merges trailers into the head would otherwise take
/// them for the proxy's. So are hop-by-hop ones, and the forwarding fields
/// the proxy sets in the head. Other trailers pass.
#[tokio::test]
async fn forged_dedupe_trailers_are_stripped_from_unmatched_requests() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    stream
        .write_all(
            b"POST /other HTTP/1.1\r\nhost: proxy\r\ntransfer-encoding: chunked\r\n\
              trailer: x-dedupe-key, x-other, x_dedupe_key, keep-alive, x-forwarded-for, x-forwarded-host\r\n\
              connection: close\r\n\r\n\
              2\r\nhi\r\n0\r\nx-dedupe-key: forged\r\nx-other: kept\r\n\
              x_dedupe_key: forged\r\nkeep-alive: timeout=1\r\n\
              x-forwarded-for: 6.6.6.6\r\nx-forwarded-host: evil\r\n\r\n",
        )
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let seen = &app.upstream.seen()[0];
    assert_eq!(&seen.body[..], b"hi");
    let trailers = seen.trailers.as_ref().expect("trailers passed on");
    let mut names: Vec<_> = trailers.keys().map(http::HeaderName::as_str).collect();
    names.sort_unstable();
    assert_eq!(names, ["x-other"]);
    assert_eq!(trailers["x-other"], "kept");
}

/// The upstream URL's path is put before the request's path, and an HTTP/1.0
/// request that came without `Host` reaches the upstream with its host.
#[tokio::test]
async fn the_upstream_gets_its_base_path_and_a_host() {
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.url = format!("{}/app/", config.upstream.url);
    })
    .await;
    let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    stream
        .write_all(b"GET /status?verbose=1 HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    let seen = app.upstream.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].uri, "/app/status?verbose=1");
    assert_eq!(
        seen[0].header("host"),
        Some(app.upstream.addr.to_string().as_str())
    );
}

/// A sender may shut down its side of the connection once its request is
/// out; the answer still reaches it. The upstream holds its answer until the
/// proxy has had every chance to notice the shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_half_closes_after_its_request_still_gets_the_answer() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let gate = Gate::new();
    app.upstream
        .script("/half-closed", [Behavior::Gate(Arc::clone(&gate))]);
    let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    stream
        .write_all(b"GET /half-closed HTTP/1.1\r\nHost: app\r\n\r\n")
        .await
        .unwrap();
    stream.shutdown().await.unwrap();
    app.upstream.wait_for(1).await;
    gate.open();
    let mut answer = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_to_string(&mut answer),
    )
    .await
    .expect("the answer, then the proxy closes")
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// A duplicate answered 204, 205 or 304 carries no content, over HTTP/2 as
/// over HTTP/1.1 (where hyper would leave out a 204's or 304's body itself);
/// over HTTP/2 content would be a protocol error to the sender.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_answered_without_content_carry_none_over_http2() {
    for status in [204, 205, 304] {
        let app = TestApp::spawn(Backend::Sqlite, |config| {
            config.routes[0].duplicate_status = Some(status);
        })
        .await;
        let tcp = tokio::net::TcpStream::connect(app.addr).await.unwrap();
        let mut sender = crate::support::http2_sender(tcp).await;
        let first = crate::support::send_http2(&mut sender, "/hooks/orders", "evt_empty").await;
        assert_eq!(first.outcome(), "forwarded");
        let duplicate = crate::support::send_http2(&mut sender, "/hooks/orders", "evt_empty").await;
        assert_eq!(
            (duplicate.status, duplicate.outcome()),
            (status, "duplicate")
        );
        assert_eq!(duplicate.body, "", "{status}");
        assert!(duplicate.header("content-type").is_none(), "{status}");
    }
}

/// HTTP/2 without TLS, with prior knowledge: the connection preface decides
/// the protocol. Deduplication and pass-through work as over HTTP/1.1, and
/// the upstream is spoken to in HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_sender_with_prior_knowledge_is_served() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let tcp = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let mut sender = crate::support::http2_sender(tcp).await;
    for expected in ["forwarded", "duplicate"] {
        let response = crate::support::send_http2(&mut sender, "/hooks/orders", "evt_h2c").await;
        assert_eq!((response.status, response.outcome()), (200, expected));
    }
    let response = crate::support::send_http2(&mut sender, "/elsewhere", "evt_other").await;
    assert_eq!((response.status, response.outcome()), (200, "passthrough"));
    // HTTP/2 may split Cookie into a field per cookie; HTTP/1.1 has one.
    let split_cookies = http::Request::post("http://localhost/elsewhere")
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let response = sender.send_request(split_cookies).await.unwrap();
    assert_eq!(response.status(), 200);
    let seen = app.upstream.seen();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[0].header("x-dedupe-key"), Some("evt_h2c"));
    assert_eq!(seen[1].uri.path(), "/elsewhere");
    let cookies: Vec<_> = seen[2].headers.get_all("cookie").iter().collect();
    assert_eq!(cookies, ["a=1; b=2"]);
}
