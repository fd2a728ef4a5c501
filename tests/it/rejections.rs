//! The failure rows of SPEC section 3 that refuse a request: each answers
//! its status with `X-Dedupe-Outcome`, forwards nothing and claims nothing.

use std::sync::Arc;
use std::time::Duration;

use crate::on_both_stores;
use crate::support::{Backend, Behavior, Gate, TestApp};
use dedupe_proxy::config::Unmatched;

on_both_stores!(
    missing_key_is_rejected_with_400,
    oversized_body_is_rejected_with_413,
    overlong_key_is_rejected_with_400,
    non_json_body_on_a_json_route_is_rejected_with_400,
    key_with_a_nul_character_is_rejected_with_400,
    unmatched_requests_can_be_rejected_with_404,
    requests_over_the_concurrency_limit_get_503,
    bodies_past_the_buffered_body_budget_get_503,
);

async fn assert_nothing_forwarded(app: &TestApp) {
    assert_eq!(
        app.upstream.count(),
        0,
        "the upstream received a rejected request"
    );
}

async fn missing_key_is_rejected_with_400(backend: Backend) {
    let app = TestApp::spawn(backend, |_| {}).await;
    let response = app.post("/hooks/orders", &[], "{}").await;
    assert_eq!((response.status, response.outcome()), (400, "rejected"));
    assert!(
        response.body.contains(
            "no idempotency key found in the request: expected a non-empty `x-event-id` header"
        ),
        "names where the key was looked for: {}",
        response.body
    );
    let empty = app.post("/hooks/orders", &[("x-event-id", "")], "{}").await;
    assert_eq!(empty.status, 400);
    let no_id = app.post("/hooks/json", &[], r#"{"type":"x"}"#).await;
    assert_eq!(no_id.status, 400);
    assert!(
        no_id.body.contains("at `/id` in the JSON body"),
        "{}",
        no_id.body
    );
    assert_nothing_forwarded(&app).await;
    let metrics = app.admin_get("/metrics").await.body;
    assert!(
        metrics
            .contains(r#"dedupe_requests_total{outcome="rejected_missing_key",route="orders"} 2"#),
        "{metrics}"
    );
}

async fn oversized_body_is_rejected_with_413(backend: Backend) {
    let app = TestApp::spawn(backend, |config| config.limits.max_body_bytes = 1000).await;
    let response = app.deliver("evt_big", &"x".repeat(1001)).await;
    assert_eq!((response.status, response.outcome()), (413, "rejected"));
    assert_eq!(app.deliver("evt_ok", &"x".repeat(1000)).await.status, 200);
    assert_eq!(app.upstream.count(), 1);
    // The oversized delivery claimed nothing: the same key is new.
    assert_eq!(app.deliver("evt_big", "small").await.outcome(), "forwarded");
}

async fn overlong_key_is_rejected_with_400(backend: Backend) {
    let app = TestApp::spawn(backend, |config| config.limits.max_key_bytes = 8).await;
    let response = app.deliver("123456789", "{}").await;
    assert_eq!((response.status, response.outcome()), (400, "rejected"));
    assert!(response.body.contains("longer than"), "{}", response.body);
    assert_nothing_forwarded(&app).await;
}

async fn non_json_body_on_a_json_route_is_rejected_with_400(backend: Backend) {
    let app = TestApp::spawn(backend, |_| {}).await;
    for body in [
        "id=1",
        "",
        "{\"id\":",
        &format!("{}1{}", "[".repeat(200), "]".repeat(200)),
    ] {
        let response = app.post("/hooks/json", &[], body).await;
        assert_eq!(
            (response.status, response.outcome()),
            (400, "rejected"),
            "{body}"
        );
    }
    assert_nothing_forwarded(&app).await;
}

async fn key_with_a_nul_character_is_rejected_with_400(backend: Backend) {
    let app = TestApp::spawn(backend, |_| {}).await;
    let response = app.post("/hooks/json", &[], r#"{"id":"evt\u0000"}"#).await;
    assert_eq!((response.status, response.outcome()), (400, "rejected"));
    assert_nothing_forwarded(&app).await;
}

async fn unmatched_requests_can_be_rejected_with_404(backend: Backend) {
    let app = TestApp::spawn(backend, |config| config.unmatched = Unmatched::Reject).await;
    let response = app.post("/elsewhere", &[], "{}").await;
    assert_eq!((response.status, response.outcome()), (404, "rejected"));
    assert_nothing_forwarded(&app).await;
    app.assert_metrics(&[
        r#"dedupe_requests_total{outcome="rejected_bad_request",route="unmatched"} 1"#,
    ])
    .await;
}

async fn requests_over_the_concurrency_limit_get_503(backend: Backend) {
    let app =
        Arc::new(TestApp::spawn(backend, |config| config.limits.max_concurrent_requests = 1).await);
    let (gate, busy) = take_the_only_slot(&app).await;
    let refused = app.deliver("evt_other", "{}").await;
    assert_eq!((refused.status, refused.outcome()), (503, "unavailable"));
    assert!(refused.header("retry-after").is_some());
    gate.open();
    assert_eq!(busy.await.unwrap().outcome(), "forwarded");
    assert_eq!(app.upstream.count(), 1);
    assert_eq!(
        app.deliver("evt_other", "{}").await.outcome(),
        "forwarded",
        "nothing was claimed"
    );
    app.assert_metrics(&[r#"dedupe_requests_total{outcome="overloaded",route="orders"} 1"#])
        .await;
}

/// A sender refused for the concurrency limit that writes its whole body
/// before it reads gets the 503 (and its Retry-After), not a connection
/// closed under its writes: the body is read and dropped, then the
/// connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_refused_for_the_concurrency_limit_is_drained_before_the_close() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const BODY: usize = 4 << 20;
    let app = Arc::new(
        TestApp::spawn(Backend::Sqlite, |config| {
            config.limits.max_concurrent_requests = 1;
            config.limits.max_body_bytes = 2 * BODY;
        })
        .await,
    );
    let (gate, busy) = take_the_only_slot(&app).await;
    let mut sender = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let head = format!(
        "POST /hooks/orders HTTP/1.1\r\nhost: proxy\r\nx-event-id: evt_big\r\ncontent-length: {BODY}\r\n\r\n"
    );
    sender.write_all(head.as_bytes()).await.unwrap();
    sender
        .write_all(&vec![b'x'; BODY])
        .await
        .expect("the whole body is taken");
    let mut answer = String::new();
    sender.read_to_string(&mut answer).await.unwrap();
    let answer = answer.to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(
        answer.contains("\r\nretry-after: ") && answer.contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    // A request without a body leaves nothing unread: its connection is
    // kept, and carries the next request once there is room.
    let mut kept = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let bodyless = b"GET /elsewhere HTTP/1.1\r\nhost: proxy\r\n\r\n";
    kept.write_all(bodyless).await.unwrap();
    let head = read_response_head(&mut kept).await;
    assert!(head.starts_with("http/1.1 503"), "{head}");
    assert!(!head.contains("\r\nconnection: close"), "{head}");
    gate.open();
    assert_eq!(busy.await.unwrap().outcome(), "forwarded");
    kept.write_all(bodyless).await.unwrap();
    let head = read_response_head(&mut kept).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert_eq!(app.upstream.count(), 2);
}

/// A response's head and as much of its body as came with it, lower-cased.
async fn read_response_head(stream: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut read = Vec::new();
    let mut buffer = [0u8; 4096];
    while !read.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buffer).await.unwrap();
        assert!(n > 0, "closed before a response head");
        read.extend_from_slice(&buffer[..n]);
    }
    String::from_utf8_lossy(&read).to_ascii_lowercase()
}

/// Delivers `evt_busy`, held at the upstream until the gate opens, on an
/// app with `max_concurrent_requests: 1`: returns once it holds the slot.
async fn take_the_only_slot(
    app: &Arc<TestApp>,
) -> (
    Arc<Gate>,
    tokio::task::JoinHandle<crate::support::TestResponse>,
) {
    let gate = Gate::new();
    app.upstream
        .script("evt_busy", [Behavior::Gate(Arc::clone(&gate))]);
    let busy = tokio::spawn({
        let app = Arc::clone(app);
        async move { app.deliver("evt_busy", "{}").await }
    });
    app.upstream.wait_for(1).await;
    (gate, busy)
}

/// A chunked body's buffer doubles as it fills, and is cut to size once the
/// body is whole, its surplus given back to the buffered-body budget: a body
/// of 600,000 one-byte chunks grows a 1 MiB buffer, but holds 600,000 bytes
/// of the budget while its request goes on, leaving room for another to
/// grow its own buffer beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_gives_back_its_buffers_surplus_once_whole() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const BODY: usize = 600_000;
    const LIMIT: usize = 1 << 20;
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.limits.max_body_bytes = LIMIT;
        config.limits.max_buffered_body_bytes = LIMIT + BODY;
        // The first request waits at the upstream while the second is sent.
        config.upstream.timeout = Duration::from_secs(60);
        config.store.lease = Duration::from_secs(120);
        // A debug build parses 600,000 chunks slowly on a busy machine.
        config.limits.body_read_timeout = Duration::from_secs(600);
    })
    .await;
    let gate = Gate::new();
    app.upstream
        .script("evt_first", [Behavior::Gate(Arc::clone(&gate))]);
    let mut body = b"1\r\nx\r\n".repeat(BODY);
    body.extend_from_slice(b"0\r\n\r\n");
    let send = |key: &'static str| {
        let (addr, body) = (app.addr, body.clone());
        async move {
            let mut sender = tokio::net::TcpStream::connect(addr).await.unwrap();
            let head = format!(
                "POST /hooks/orders HTTP/1.1\r\nhost: proxy\r\nx-event-id: {key}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            );
            sender.write_all(head.as_bytes()).await.unwrap();
            sender.write_all(&body).await.unwrap();
            let mut answer = String::new();
            sender.read_to_string(&mut answer).await.unwrap();
            answer
        }
    };
    let first = tokio::spawn(send("evt_first"));
    app.upstream.wait_for(1).await;
    let second = send("evt_second").await;
    assert!(second.starts_with("HTTP/1.1 200"), "{second}");
    gate.open();
    let first = first.await.unwrap();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert_eq!(app.upstream.seen()[0].body.len(), BODY);
}

/// A body is held from its first byte until its request ends, so what
/// senders can make the proxy hold, before any signature is checked, is
/// bounded by `limits.max_buffered_body_bytes`.
async fn bodies_past_the_buffered_body_budget_get_503(backend: Backend) {
    let app = Arc::new(
        TestApp::spawn(backend, |config| {
            config.limits.max_body_bytes = 1024;
            config.limits.max_buffered_body_bytes = 1024;
        })
        .await,
    );
    let gate = Gate::new();
    app.upstream
        .script("evt_held", [Behavior::Gate(Arc::clone(&gate))]);
    let held_body = format!(r#"{{"pad":"{}"}}"#, "x".repeat(990));
    let held = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.deliver("evt_held", &held_body).await }
    });
    app.upstream.wait_for(1).await;
    let small = app.deliver("evt_small", "{}").await;
    assert_eq!(small.outcome(), "forwarded", "2 bytes still fit");
    let other_body = format!(r#"{{"pad":"{}"}}"#, "y".repeat(90));
    let refused = app.deliver("evt_other", &other_body).await;
    assert_eq!((refused.status, refused.outcome()), (503, "unavailable"));
    assert!(refused.header("retry-after").is_some());
    gate.open();
    assert_eq!(held.await.unwrap().outcome(), "forwarded");
    assert_eq!(
        app.deliver("evt_other", &other_body).await.outcome(),
        "forwarded",
        "the budget is back once the held request ends, and nothing was claimed"
    );
    app.assert_metrics(&[r#"dedupe_requests_total{outcome="overloaded",route="orders"} 1"#])
        .await;
}
