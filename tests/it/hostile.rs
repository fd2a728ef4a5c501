//! Hostile and malformed input: each gets a clear 4xx, nothing is forwarded,
//! and the proxy stays healthy.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{Backend, Behavior, Gate, TestApp};

/// An HTTP/2 connection to the proxy (prior knowledge), and the task that
/// drives it, which ends when the connection closes.
async fn http2_client(
    app: &TestApp,
    builder: &h2::client::Builder,
) -> (
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(app.addr).await.unwrap();
    let (client, connection) = builder.handshake(tcp).await.unwrap();
    (client, tokio::spawn(connection))
}

/// Sends a request without a body on an HTTP/2 connection.
async fn send_whole(
    client: h2::client::SendRequest<Bytes>,
    request: http::Request<()>,
) -> h2::client::ResponseFuture {
    let (response, _) = client
        .ready()
        .await
        .unwrap()
        .send_request(request, true)
        .unwrap();
    response
}

/// Sends raw bytes and returns the status line of the answer (or why none).
async fn raw(app: &TestApp, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buffer = [0u8; 4096];
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    answer.extend_from_slice(&buffer[..n]);
                    if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            }
        }
    });
    read.await.expect("an answer or a close");
    String::from_utf8_lossy(&answer)
        .lines()
        .next()
        .unwrap_or("<closed>")
        .to_string()
}

/// Sends raw bytes on a connection of its own and returns all the proxy
/// wrote before closing it, checking that it answered exactly once (so
/// nothing after the request was read as another).
async fn only_answer_before_close(app: &TestApp, request: &str) -> String {
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("the connection is closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let answers = answer.lines().filter(|line| line.starts_with("HTTP/"));
    assert_eq!(answers.count(), 1, "{answer}");
    answer
}

/// [`only_answer_before_close`], checking its status line and that it said
/// `Connection: close`, and only that.
async fn assert_answered_and_closed(app: &TestApp, request: &str, status: &str) {
    let answer = only_answer_before_close(app, request).await;
    assert!(answer.starts_with(status), "{answer}");
    let fields = answer.to_ascii_lowercase();
    assert!(fields.contains("\r\nconnection: close\r\n"), "{answer}");
    assert!(!fields.contains("keep-alive"), "{answer}");
}

/// Sends each request on a connection of its own and checks the status line
/// of its answer.
async fn assert_each_answered(app: &TestApp, requests: &[&[u8]], status: &str) {
    for request in requests {
        let answer = raw(app, request).await;
        assert!(
            answer.starts_with(status),
            "{answer} for {}",
            String::from_utf8_lossy(request)
        );
    }
}

async fn assert_healthy_and_untouched(app: &TestApp) {
    assert_eq!(
        app.upstream.count(),
        0,
        "hostile input reached the upstream"
    );
    assert_eq!(app.admin_get("/healthz").await.status, 200);
    assert_eq!(app.deliver("evt_after", "{}").await.outcome(), "forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_smuggling_patterns_are_refused() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let attempts: [&[u8]; 4] = [
        b"POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: s2\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcd",
        b"POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: s3\r\nTransfer-Encoding: gzip\r\n\r\nabcd",
        b"POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: s4\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
        b"POST /elsewhere HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n",
    ];
    assert_each_answered(&app, &attempts, "HTTP/1.1 400").await;
    assert_healthy_and_untouched(&app).await;
}

/// A webhook whose chunked body breaks off in a bad chunk size is answered
/// 400 with what was wrong with it, and nothing is claimed or forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_badly_chunked_webhook_body_is_refused_saying_why() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let answer = only_answer_before_close(
        &app,
        "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: c1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\ng\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains("the request body could not be read: ") && answer.contains("chunk size"),
        "{answer}"
    );
    assert_healthy_and_untouched(&app).await;
}

/// A request refused for its framing or its `Host` closes its connection:
/// whatever follows it on the connection is not read as a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_for_its_framing_closes_the_connection() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let pipelined = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    let refused = [
        format!(
            "POST /elsewhere HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{pipelined}"
        ),
        format!(
            "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: f1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n{pipelined}"
        ),
        format!("POST /elsewhere HTTP/1.1\r\nContent-Length: 0\r\n\r\n{pipelined}"),
    ];
    for request in refused {
        let answer = only_answer_before_close(&app, &request).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    }
    assert_healthy_and_untouched(&app).await;
}

/// A body refused as too large is not read to its end, so its connection
/// cannot carry another request: the 413 says `Connection: close` (and only
/// that, to an HTTP/1.0 sender that asked for keep-alive) and the connection
/// closes, whether the body was announced with `Expect: 100-continue` and
/// never sent, sent whole, or chunked past the limit. A request refused for
/// its framing says the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_refused_as_too_large_closes_the_connection() {
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.limits.max_body_bytes = 1000
    })
    .await;
    let pipelined = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    let refused = [
        ("HTTP/1.1 413", "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: big1\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n".to_string()),
        ("HTTP/1.1 413", format!(
            "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: big2\r\nContent-Length: 1500\r\n\r\n{}{pipelined}",
            "x".repeat(1500)
        )),
        ("HTTP/1.1 413", format!(
            "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: big3\r\nTransfer-Encoding: chunked\r\n\r\n7d0\r\n{}\r\n0\r\n\r\n{pipelined}",
            "x".repeat(2000)
        )),
        ("HTTP/1.0 413", format!(
            "POST /hooks/orders HTTP/1.0\r\nX-Event-Id: big4\r\nConnection: keep-alive\r\nContent-Length: 1500\r\n\r\n{}",
            "x".repeat(1500)
        )),
        ("HTTP/1.0 400", "POST /hooks/orders HTTP/1.0\r\nHost: a/b\r\nX-Event-Id: big5\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}".to_string()),
    ];
    for (status, request) in refused {
        assert_answered_and_closed(&app, &request, status).await;
    }
    assert_healthy_and_untouched(&app).await;
}

/// A sender that writes a body far over the limit whole before it reads the
/// answer (as most HTTP clients do) gets its 413: the proxy reads and drops
/// the rest of the body before it closes the connection, so the sender's
/// writes are not refused by a closed socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_writes_a_huge_body_before_reading_gets_its_413() {
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.limits.max_body_bytes = 1000
    })
    .await;
    let size = 16 << 20;
    let chunked = format!("{size:x}\r\n");
    let framings = [
        (
            format!(
                "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: huge1\r\nContent-Length: {size}\r\n\r\n"
            ),
            "",
        ),
        (
            format!(
                "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: huge2\r\nTransfer-Encoding: chunked\r\n\r\n{chunked}"
            ),
            "\r\n0\r\n\r\n",
        ),
    ];
    for (head, end) in framings {
        let mut stream = TcpStream::connect(app.addr).await.unwrap();
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut body = vec![b'x'; size];
        body.extend_from_slice(end.as_bytes());
        stream
            .write_all(&body)
            .await
            .expect("the proxy reads the body it refused instead of closing under it");
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
            .await
            .expect("the connection is closed")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    }
    assert_healthy_and_untouched(&app).await;
}

/// Request targets other than a path, where a reverse proxy has none to
/// forward: CONNECT's authority, an authority on another method, `*` on
/// anything but OPTIONS, and an absolute URL naming another host than Host.
/// And a key whose header field comes twice, where the application might
/// take the other one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_without_a_path_and_repeated_key_fields_are_refused() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let refused: [&[u8]; 10] = [
        b"POST /hooks/orders HTTP/1.1\r\nHost: x/evil\r\nX-Event-Id: t0\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/orders HTTP/1.1\r\nHost: x:y\r\nX-Event-Id: t0\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/orders HTTP/1.1\r\nHost: [::1\r\nX-Event-Id: t0\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/orders HTTP/1.1\r\nHost: a b\r\nX-Event-Id: t0\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/orders HTTP/1.1\r\nHost: user@x\r\nX-Event-Id: t0\r\nContent-Length: 2\r\n\r\n{}",
        b"CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443\r\n\r\n",
        b"GET a.example:80 HTTP/1.1\r\nHost: a.example\r\n\r\n",
        b"POST * HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        b"POST http://evil.example/hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: t1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: t2\r\nX-Event-Id: t3\r\nContent-Length: 2\r\n\r\n{}",
    ];
    assert_each_answered(&app, &refused, "HTTP/1.1 400").await;
    assert_healthy_and_untouched(&app).await;
    let status = raw(&app, b"POST http://X/hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: t4\r\nContent-Length: 2\r\n\r\n{}").await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let seen = app.upstream.seen();
    assert_eq!(seen.last().unwrap().header("x-dedupe-key"), Some("t4"));
}

/// Over HTTP/2 as over HTTP/1: a Host that names another authority than
/// `:authority`, an `:authority` with a user part, and `*` as the path of
/// anything but OPTIONS, are refused; and so is a field value with
/// whitespace around it, which HTTP/1 would have trimmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_requests_whose_host_or_path_is_not_their_target_are_refused() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let (client, _) = http2_client(&app, &h2::client::Builder::new()).await;
    let post = |uri: &str, fields: &[(&str, &str)]| {
        let mut request = http::Request::post(uri);
        for (name, value) in fields {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap()
    };
    let other_host = post(
        "http://a.example/hooks/orders",
        &[("host", "b.example"), ("x-event-id", "h2_host")],
    );
    let mut star = http::Request::post("http://a.example/").body(()).unwrap();
    *star.uri_mut() = http::Uri::from_parts({
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(http::uri::Scheme::HTTP);
        parts.authority = Some(http::uri::Authority::from_static("a.example"));
        parts.path_and_query = Some(http::uri::PathAndQuery::from_static("*"));
        parts
    })
    .unwrap();
    // With no Host field, `:authority` is the Host passed on: a user part
    // in it is refused as it is in Host.
    let user_authority = post(
        "http://user@a.example/hooks/orders",
        &[("x-event-id", "h2_user")],
    );
    // RFC 9113 section 8.2.1: HTTP/1 would have trimmed the key to
    // another's, or to none.
    let padded_key = post(
        "http://a.example/hooks/orders",
        &[("x-event-id", "h2_same ")],
    );
    let blank_key = post("http://a.example/hooks/orders", &[("x-event-id", "\t")]);
    let padded_elsewhere = post("http://a.example/elsewhere", &[("x-anything", " x")]);
    for request in [
        other_host,
        star,
        user_authority,
        padded_key,
        blank_key,
        padded_elsewhere,
    ] {
        let response = send_whole(client.clone(), request).await.await.unwrap();
        assert_eq!(response.status(), 400);
        assert_eq!(response.headers()["x-dedupe-outcome"], "rejected");
    }
    let same_host = post(
        "http://a.example/hooks/orders",
        &[("host", "A.example"), ("x-event-id", "h2_same")],
    );
    let response = send_whole(client, same_host).await.await.unwrap();
    assert_eq!(response.headers()["x-dedupe-outcome"], "forwarded");
    assert_eq!(app.upstream.count(), 1);
}

/// Variants of a route's path that an application may read as that path
/// (letter case, percent-encoding, dot segments, extra slashes, `;`
/// parameters, spaces around a segment), or its method in other letters, are refused: forwarded as
/// unmatched they would reach the webhook handler unverified and
/// undeduplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variants_of_a_route_are_refused_not_forwarded() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let variants: [&[u8]; 8] = [
        b"POST /hooks/%6Frders HTTP/1.1\r\nHost: x\r\nX-Event-Id: v1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/orders%20%09 HTTP/1.1\r\nHost: x\r\nX-Event-Id: v1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/orders.json HTTP/1.1\r\nHost: x\r\nX-Event-Id: v1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /HOOKS/Orders/ HTTP/1.1\r\nHost: x\r\nX-Event-Id: v1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST //hooks/./orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: v1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks%2Forders HTTP/1.1\r\nHost: x\r\nX-Event-Id: v1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/orders;v=1 HTTP/1.1\r\nHost: x\r\nX-Event-Id: v1\r\nContent-Length: 2\r\n\r\n{}",
        b"post /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: v1\r\nContent-Length: 2\r\n\r\n{}",
    ];
    assert_each_answered(&app, &variants, "HTTP/1.1 400").await;
    let response = app
        .post("/hooks/orders/", &[("x-event-id", "v1")], "{}")
        .await;
    assert_eq!((response.status, response.outcome()), (400, "rejected"));
    assert!(
        response.body.contains("orders") && response.body.contains("POST /hooks/orders"),
        "{}",
        response.body
    );
    app.assert_metrics(&[
        r#"dedupe_requests_total{outcome="rejected_bad_request",route="orders"} 9"#,
    ])
    .await;
    assert_healthy_and_untouched(&app).await;
    // Other paths and other methods are still forwarded as unmatched.
    let elsewhere = app.post("/hooks/orders/1", &[], "{}").await;
    assert_eq!(elsewhere.outcome(), "passthrough");
    let other_method = app.send(http::Method::GET, "/hooks/orders/", &[], "").await;
    assert_eq!(other_method.outcome(), "passthrough");
}

/// A request under a route's `path_prefix` whose path an application may
/// read as another route's (dot segments, letter case), or as a path outside
/// the prefix, is refused: forwarded with the prefix route's checks, it would
/// reach the other route's handler without that route's signature checked
/// or its key claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_under_a_prefix_that_leads_to_another_route_is_refused() {
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        let catch_all: dedupe_proxy::config::RouteConfig = serde_yaml::from_str(
            "{ name: misc, path_prefix: /hooks/misc/, key: { header: X-Event-Id } }",
        )
        .unwrap();
        config.routes.push(catch_all);
    })
    .await;
    let refused: [&[u8]; 4] = [
        b"POST /hooks/misc/../orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: p1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/misc/%2E%2E/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: p1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/misc/x/../../json HTTP/1.1\r\nHost: x\r\nX-Event-Id: p1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/misc/../../admin HTTP/1.1\r\nHost: x\r\nX-Event-Id: p1\r\nContent-Length: 2\r\n\r\n{}",
    ];
    assert_each_answered(&app, &refused, "HTTP/1.1 400").await;
    let escaped = app
        .post("/hooks/misc/../../admin", &[("x-event-id", "p1")], "{}")
        .await;
    assert_eq!((escaped.status, escaped.outcome()), (400, "rejected"));
    assert!(escaped.body.contains("lead out of it"), "{}", escaped.body);
    app.assert_metrics(&[
        r#"dedupe_requests_total{outcome="rejected_bad_request",route="orders"} 2"#,
        r#"dedupe_requests_total{outcome="rejected_bad_request",route="json"} 1"#,
        r#"dedupe_requests_total{outcome="rejected_bad_request",route="misc"} 2"#,
    ])
    .await;
    assert_healthy_and_untouched(&app).await;
    // Paths that stay under the prefix are the prefix route's.
    let inside = app
        .post("/hooks/misc/a/../b", &[("x-event-id", "p2")], "{}")
        .await;
    assert_eq!((inside.status, inside.outcome()), (200, "forwarded"));
    assert_eq!(
        app.upstream.seen().last().unwrap().uri.path(),
        "/hooks/misc/a/../b"
    );
}

/// HTTP/2 lets a sender end a stream with RST_STREAM(NO_ERROR), which
/// hyper reads as the end of the request body: a body cut off that way must
/// not be claimed and forwarded as the event, or its real delivery would be
/// answered as a duplicate. With or without a declared length, the whole
/// delivery sent after it is the one forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_body_cut_off_by_a_reset_is_neither_claimed_nor_forwarded() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let (client, _) = http2_client(&app, &h2::client::Builder::new()).await;
    let mut client = client.ready().await.unwrap();
    let whole = Bytes::from_static(b"amount=1000&currency=usd");
    let request = |key: &str, declared: bool| {
        let mut request =
            http::Request::post("http://localhost/hooks/orders").header("x-event-id", key);
        if declared {
            request = request.header("content-length", whole.len());
        }
        request.body(()).unwrap()
    };
    for (key, declared) in [("evt_cut", false), ("evt_cut_declared", true)] {
        let (_, mut cut) = client.send_request(request(key, declared), false).unwrap();
        cut.send_data(whole.slice(..9), false).unwrap();
        cut.send_reset(h2::Reason::NO_ERROR);
        client = client.ready().await.unwrap();
        let (response, mut sent) = client.send_request(request(key, declared), false).unwrap();
        sent.send_data(whole.clone(), true).unwrap();
        let response = response.await.unwrap();
        assert_eq!(
            response.headers()["x-dedupe-outcome"],
            "forwarded",
            "{key}: the whole delivery is the event"
        );
        client = client.ready().await.unwrap();
    }
    let seen = app.upstream.seen();
    let bodies: Vec<_> = seen
        .iter()
        .map(|seen| (seen.header("x-dedupe-key").unwrap(), &seen.body[..]))
        .collect();
    assert_eq!(
        bodies,
        [("evt_cut", &whole[..]), ("evt_cut_declared", &whole[..])]
    );
}

/// A request whose sender resets its HTTP/2 stream is counted and logged
/// all the same: an unmatched one the upstream has not answered is
/// abandoned, and a webhook whose stream is reset as its body ends is not
/// claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_requests_their_senders_reset_are_still_counted() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let gate = Gate::new();
    app.upstream
        .script("/elsewhere", [Behavior::Gate(Arc::clone(&gate))]);
    let tcp = TcpStream::connect(app.addr).await.unwrap();
    let (client, mut connection) = h2::client::handshake(tcp).await.unwrap();
    let mut ping = connection.ping_pong().expect("one ping handle");
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let unmatched = http::Request::post("http://localhost/elsewhere")
        .body(())
        .unwrap();
    let (_, mut sent) = client.send_request(unmatched, false).unwrap();
    sent.send_data(Bytes::from_static(b"{}"), true).unwrap();
    app.upstream.wait_for(1).await;
    sent.send_reset(h2::Reason::CANCEL);
    // Answered once the proxy has read the reset.
    ping.ping(h2::Ping::opaque()).await.unwrap();
    app.wait_for_metric(
        r#"dedupe_requests_total{outcome="rejected_bad_request",route="unmatched"} 1"#,
    )
    .await;
    gate.open();

    let deliveries = 10;
    for n in 0..deliveries {
        client = client.ready().await.unwrap();
        let webhook = http::Request::post("http://localhost/hooks/orders")
            .header("x-event-id", format!("evt_reset_{n}"))
            .body(())
            .unwrap();
        let (_, mut sent) = client.send_request(webhook, false).unwrap();
        sent.send_data(Bytes::from_static(b"{}"), true).unwrap();
        sent.send_reset(h2::Reason::CANCEL);
    }
    let counted = |metrics: &str, outcome: &str| -> usize {
        let line = format!(r#"dedupe_requests_total{{outcome="{outcome}",route="orders"}} "#);
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map_or(0, |n| n.parse().unwrap())
    };
    let all_counted = async {
        loop {
            let metrics = app.admin_get("/metrics").await.body;
            let (forwarded, reset) = (
                counted(&metrics, "forwarded"),
                counted(&metrics, "rejected_bad_request"),
            );
            if forwarded + reset == deliveries {
                return forwarded;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let forwarded = tokio::time::timeout(Duration::from_secs(10), all_counted)
        .await
        .expect("every webhook counted once");
    assert!(
        forwarded < deliveries,
        "no stream was reset before its claim"
    );
    // The unmatched request, and the webhooks claimed before their reset.
    assert_eq!(app.upstream.count(), 1 + forwarded);
}

/// An HTTP/2 connection with no open request for `limits.header_read_timeout`
/// is closed, as an idle HTTP/1 connection is: one whose sender answers the
/// GOAWAY's ping gracefully, one that sent the preface and then nothing at
/// all a timeout later. A request open longer than that is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http2_connections_are_closed_and_open_requests_are_not_cut() {
    let idle = Duration::from_millis(300);
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.limits.header_read_timeout = idle;
    })
    .await;
    let (client, connection) = http2_client(&app, &h2::client::Builder::new()).await;
    let gate = Gate::new();
    app.upstream
        .script("evt_long", [Behavior::Gate(Arc::clone(&gate))]);
    let request = http::Request::post("http://localhost/hooks/orders")
        .header("x-event-id", "evt_long")
        .body(())
        .unwrap();
    let response = send_whole(client, request).await;
    app.upstream.wait_for(1).await;
    // The request stays open for several idle periods before it is answered.
    tokio::time::sleep(idle * 4).await;
    gate.open();
    let response = response.await.unwrap();
    assert_eq!(response.headers()["x-dedupe-outcome"], "forwarded");
    let closed = tokio::time::timeout(Duration::from_secs(10), connection)
        .await
        .expect("the idle connection is closed");
    assert!(closed.unwrap().is_ok(), "closed with GOAWAY(NO_ERROR)");

    let mut silent = TcpStream::connect(app.addr).await.unwrap();
    silent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut received = Vec::new();
    // Ended by a close or, with the server's frames unread, a reset.
    let _ended = tokio::time::timeout(Duration::from_secs(10), silent.read_to_end(&mut received))
        .await
        .expect("a connection that never answers the GOAWAY is dropped");
    assert_eq!(app.admin_get("/healthz").await.status, 200);
}

/// RFC 9112 section 3.2: an HTTP/1.1 request with no `Host`, or with more
/// than one, is answered 400; HTTP/1.0 may leave it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http11_needs_exactly_one_host() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let refused: [&[u8]; 3] = [
        b"POST /hooks/orders HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\nX-Event-Id: h1\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /hooks/orders HTTP/1.1\r\nX-Event-Id: h2\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /elsewhere HTTP/1.1\r\n\r\n",
    ];
    assert_each_answered(&app, &refused, "HTTP/1.1 400").await;
    assert_healthy_and_untouched(&app).await;
    let status = raw(
        &app,
        b"POST /hooks/orders HTTP/1.0\r\nX-Event-Id: h3\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await;
    assert!(status.starts_with("HTTP/1.0 200"), "{status}");
    let seen = app.upstream.seen();
    assert_eq!(seen.last().unwrap().header("x-dedupe-key"), Some("h3"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_with_chunked_cannot_smuggle_a_second_request() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    // A front end honouring Content-Length would see one request; one honouring
    // Transfer-Encoding sees a second, smuggled one after the empty chunk.
    let smuggled = "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: smuggled\r\nContent-Length: 2\r\n\r\n{}";
    let request = format!(
        "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: front\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}",
        5 + smuggled.len()
    );
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    // RFC 9112 section 6.1: Transfer-Encoding wins, Content-Length is dropped
    // and the connection is closed after the answer, so the rest is never read
    // as a request.
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{answer}");
    let seen = app.upstream.seen();
    assert_eq!(seen.len(), 1, "a smuggled request reached the upstream");
    assert_eq!(seen[0].header("x-dedupe-key"), Some("front"));
    assert!(seen[0].body.is_empty(), "the body ends at the empty chunk");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_too_many_headers_are_refused() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let many: String = (0..150).map(|i| format!("X-H{i}: v\r\n")).collect();
    let status = raw(&app, format!("POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: h1\r\n{many}Content-Length: 0\r\n\r\n").as_bytes()).await;
    assert!(status.starts_with("HTTP/1.1 431"), "{status}");
    // Past 64 KiB of head: hyper's own limit would take about 400 KiB.
    let big = "a".repeat(100 * 1024);
    let status = raw(&app, format!("POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: h2\r\nX-Big: {big}\r\nContent-Length: 0\r\n\r\n").as_bytes()).await;
    assert!(status.starts_with("HTTP/1.1 431"), "{status}");
    let status = raw(&app, b"POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: a\x01b\r\nContent-Length: 0\r\n\r\n").await;
    assert!(status.starts_with("HTTP/1.1 400"), "{status}");
    let long = "a".repeat(70 * 1024);
    let status = raw(
        &app,
        format!("POST /hooks/{long} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n").as_bytes(),
    )
    .await;
    // A request line past the head's 64 KiB: the head is too large.
    assert!(status.starts_with("HTTP/1.1 431"), "{status}");
    // Refused before routing, they are counted as unmatched bad requests
    // once their connections have ended, which may be after the answer.
    app.wait_for_metric(
        r#"dedupe_requests_total{outcome="rejected_bad_request",route="unmatched"} 4"#,
    )
    .await;
    assert_healthy_and_untouched(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_are_not_text_are_refused() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let status = raw(&app, b"POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: a\xffb\r\nContent-Length: 2\r\n\r\n{}").await;
    assert!(status.starts_with("HTTP/1.1 400"), "{status}");
    let nested = format!(
        r#"{{"id":"x","deep":{}1{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let response = app.post("/hooks/json", &[], &nested).await;
    assert_eq!((response.status, response.outcome()), (400, "rejected"));
    assert_healthy_and_untouched(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_senders_are_cut_off() {
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.limits.header_read_timeout = Duration::from_millis(300);
        config.limits.body_read_timeout = Duration::from_millis(300);
    })
    .await;
    // A connection that never sends anything: closed.
    let mut silent = TcpStream::connect(app.addr).await.unwrap();
    let mut buffer = [0u8; 1024];
    let closed = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buffer))
        .await
        .expect("a silent connection is closed");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    // Headers that never finish: the connection is closed.
    let mut slow_headers = TcpStream::connect(app.addr).await.unwrap();
    slow_headers
        .write_all(b"POST /hooks/orders HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buffer = [0u8; 1024];
    let closed = tokio::time::timeout(Duration::from_secs(10), slow_headers.read(&mut buffer))
        .await
        .expect("closed");
    assert!(
        matches!(closed, Ok(0) | Err(_))
            || String::from_utf8_lossy(&buffer).starts_with("HTTP/1.1 408")
    );
    // A body that never finishes: 408, and the connection closed, saying so.
    let slow_body = "POST /hooks/orders HTTP/1.1\r\nHost: x\r\nX-Event-Id: slow\r\nContent-Length: 100\r\n\r\n{\"partial\":";
    assert_answered_and_closed(&app, slow_body, "HTTP/1.1 408").await;
    assert_healthy_and_untouched(&app).await;
    // Streamed to the upstream when unmatched, so the upstream sees its
    // start, then the connection reset: still the sender's fault (408, or
    // 400 for a body that cannot be read), not the upstream's.
    let slow_unmatched =
        "POST /elsewhere HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"partial\":";
    assert_answered_and_closed(&app, slow_unmatched, "HTTP/1.1 408").await;
    assert_each_answered(
        &app,
        &[b"POST /elsewhere HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhiXX0\r\n\r\n"],
        "HTTP/1.1 400",
    )
    .await;
    app.assert_metrics(&[
        r#"dedupe_requests_total{outcome="rejected_bad_request",route="unmatched"} 2"#,
        r#"dedupe_upstream_responses_total{class="connect_error",route="unmatched"} 0"#,
        r#"dedupe_upstream_responses_total{class="timeout",route="unmatched"} 0"#,
    ])
    .await;
}

/// An unmatched request's body is streamed to the upstream, and the
/// upstream's `upstream.timeout` runs from when the body is over: an upload
/// that pauses for longer than it is answered, and an upstream that then
/// hangs still times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmatched_upload_does_not_spend_the_upstreams_time() {
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.timeout = Duration::from_secs(1);
    })
    .await;
    app.upstream.script("/hangs", [Behavior::Hang]);
    for (path, status) in [("/uploads", "HTTP/1.1 200"), ("/hangs", "HTTP/1.1 504")] {
        let mut sender = TcpStream::connect(app.addr).await.unwrap();
        let head = format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello");
        sender.write_all(head.as_bytes()).await.unwrap();
        // Three times upstream.timeout.
        tokio::time::sleep(Duration::from_secs(3)).await;
        sender.write_all(b"world").await.unwrap();
        let mut answer = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(10), sender.read(&mut answer))
            .await
            .expect("an answer")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..read]);
        assert!(answer.starts_with(status), "{path}: {answer}");
    }
    let seen = app.upstream.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|request| request.body == "helloworld"));
    app.assert_metrics(&[
        r#"dedupe_upstream_responses_total{class="2xx",route="unmatched"} 1"#,
        r#"dedupe_upstream_responses_total{class="timeout",route="unmatched"} 1"#,
    ])
    .await;
}

/// A body hyper stops asking for once it has sent it whole, rather than
/// reading its end (after trailers; once an HTTP/2 sender's declared length
/// is in, its stream ending in a frame of its own), is over then too: an
/// upstream that hangs gets `upstream.timeout` from there, not
/// `limits.body_read_timeout` more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sent_whole_starts_the_upstreams_time_however_it_ends() {
    use http_body_util::BodyExt;
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.timeout = Duration::from_secs(1);
        config.limits.body_read_timeout = Duration::from_secs(60);
    })
    .await;
    app.upstream
        .script("/hangs", [Behavior::Hang, Behavior::Hang]);
    fn answered<T>(read: Result<T, tokio::time::error::Elapsed>) -> T {
        read.expect("answered within 20 s, not after body_read_timeout")
    }
    let mut trailers = TcpStream::connect(app.addr).await.unwrap();
    trailers
        .write_all(b"POST /hangs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-sum: 1\r\n\r\n")
        .await
        .unwrap();
    let mut answer = [0u8; 64];
    let read =
        answered(tokio::time::timeout(Duration::from_secs(20), trailers.read(&mut answer)).await)
            .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]);
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");

    let tcp = TcpStream::connect(app.addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    // The data, then the end of the stream in a frame of its own.
    let (frames, mut to_send) = tokio::sync::mpsc::channel::<Bytes>(1);
    let body = http_body_util::StreamBody::new(futures_util::stream::poll_fn(move |cx| {
        to_send.poll_recv(cx).map(|data| {
            data.map(|data| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(data)))
        })
    }));
    let request = http::Request::post("http://x/hangs")
        .header("content-length", "5")
        .body(body.boxed())
        .unwrap();
    let response = tokio::spawn(async move { sender.send_request(request).await });
    frames.send(Bytes::from_static(b"hello")).await.unwrap();
    drop(frames);
    let response = answered(tokio::time::timeout(Duration::from_secs(20), response).await);
    assert_eq!(response.unwrap().unwrap().status(), 504);
    assert_eq!(app.upstream.count(), 2, "both reached the upstream whole");
}

/// With `upstream.timeout` no longer than `limits.body_read_timeout` (their
/// defaults are equal), an unmatched body that stalls is the sender's
/// fault: 408, not the upstream's 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_unmatched_upload_is_a_408_whatever_the_upstream_timeout() {
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.timeout = Duration::from_secs(1);
        config.limits.body_read_timeout = Duration::from_secs(1);
    })
    .await;
    let stalled = "POST /uploads HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello";
    assert_answered_and_closed(&app, stalled, "HTTP/1.1 408").await;
    app.assert_metrics(&[
        r#"dedupe_requests_total{outcome="rejected_bad_request",route="unmatched"} 1"#,
        r#"dedupe_upstream_responses_total{class="timeout",route="unmatched"} 0"#,
    ])
    .await;
}

/// An upstream that accepts a connection and reads nothing stops the
/// proxy taking the sender's body, so the body is never over: the upstream
/// gets `upstream.timeout` from when the body was due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_reads_no_upload_still_times_out() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = listener.local_addr().unwrap();
    let deaf = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((connection, _)) = listener.accept().await {
            held.push(connection);
        }
    });
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.url = format!("http://{upstream_addr}");
        config.upstream.timeout = Duration::from_millis(300);
        config.limits.body_read_timeout = Duration::from_millis(300);
    })
    .await;
    // Far more than the sockets on the way hold.
    const BODY: usize = 64 << 20;
    let mut sender = TcpStream::connect(app.addr).await.unwrap();
    let head = format!("POST /uploads HTTP/1.1\r\nHost: x\r\nContent-Length: {BODY}\r\n\r\n");
    sender.write_all(head.as_bytes()).await.unwrap();
    let upload = tokio::spawn(async move {
        let _ = sender.write_all(&vec![b'x'; BODY]).await;
        sender
    });
    app.wait_for_metric(r#"dedupe_upstream_responses_total{class="timeout",route="unmatched"} 1"#)
        .await;
    upload.abort();
    deaf.abort();
}

/// `Upgrade` is never forwarded, so an upstream that switches protocols
/// anyway would leave the sender on a protocol nobody speaks: 502, and a
/// webhook's key is `failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_switches_protocols_is_a_failed_upstream() {
    let upstream_addr = raw_upstream(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
    )
    .await;
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.url = format!("http://{upstream_addr}");
    })
    .await;
    let unmatched = app
        .send(
            http::Method::GET,
            "/ws",
            &[("connection", "upgrade"), ("upgrade", "websocket")],
            "",
        )
        .await;
    assert_eq!(
        (unmatched.status, unmatched.outcome()),
        (502, "upstream-error")
    );
    let webhook = app.deliver("evt_switch", "{}").await;
    assert_eq!((webhook.status, webhook.outcome()), (502, "upstream-error"));
    // Settled `failed`: the retry goes to the upstream again.
    let retry = app.deliver("evt_switch", "{}").await;
    assert_eq!((retry.status, retry.outcome()), (502, "upstream-error"));
}

/// Connection fields are refused in HTTP/2 trailers as in a head: an
/// upstream's trailers that carry them would reset the sender's stream after
/// the whole body, and a webhook the upstream acted on would look failed to
/// its sender. They are dropped, and so is a forged `X-Dedupe-Outcome`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_fields_in_an_upstreams_trailers_are_dropped() {
    let upstream_addr = raw_upstream(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\
          Trailer: X-Checksum, Keep-Alive, Connection, X-Dedupe-Outcome\r\n\r\n\
          2\r\nhi\r\n0\r\nX-Checksum: abc\r\nKeep-Alive: timeout=1\r\n\
          Connection: close\r\nX-Dedupe-Outcome: forged\r\n\r\n",
    )
    .await;
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.url = format!("http://{upstream_addr}");
    })
    .await;
    let (client, _) = http2_client(&app, &h2::client::Builder::new()).await;
    for (path, key) in [
        ("/elsewhere", None),
        ("/hooks/orders", Some("evt_trailers")),
    ] {
        let mut request = http::Request::get(format!("http://localhost{path}"));
        if let Some(key) = key {
            request = request.method("POST").header("x-event-id", key);
        }
        let response = send_whole(client.clone(), request.body(()).unwrap()).await;
        let mut body = response.await.unwrap().into_body();
        let data = body.data().await.unwrap().unwrap();
        assert_eq!(&data[..], b"hi", "{path}");
        let trailers = body
            .trailers()
            .await
            .unwrap_or_else(|error| panic!("{path}: {error}"))
            .expect("trailers passed on");
        let mut names: Vec<_> = trailers.keys().map(http::HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["x-checksum"], "{path}");
    }
}

/// An upstream that answers each request head it reads with `answer`, byte
/// for byte, whatever the request's body, and otherwise keeps the
/// connection open without a word.
async fn raw_upstream(answer: &'static [u8]) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                while read_head(&mut stream).await {
                    if stream.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Reads from `stream` up to the end of a request head (whatever follows
/// it in the same read is dropped); false if the stream ended or failed
/// first.
async fn read_head(stream: &mut TcpStream) -> bool {
    let mut head = Vec::new();
    let mut buffer = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => head.extend_from_slice(&buffer[..n]),
        }
    }
    true
}

/// An upstream that takes one connection, reads a request head from it and
/// hands it to `answer`; the receiver hears when `answer` is done.
async fn answering_once<Answer, Answered>(
    answer: Answer,
) -> (std::net::SocketAddr, tokio::sync::oneshot::Receiver<()>)
where
    Answer: FnOnce(TcpStream) -> Answered + Send + 'static,
    Answered: Future<Output = ()> + Send,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (done_tx, done) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        assert!(read_head(&mut stream).await, "a request head");
        answer(stream).await;
        let _ = done_tx.send(());
    });
    (addr, done)
}

/// An HTTP/1 sender that stops reading has its connection closed once it
/// has taken nothing for `upstream.timeout`, so the upstream connection its
/// response comes on is closed too instead of being held (with the
/// application's worker writing to it) for as long as the sender stays
/// connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_sender_that_stops_reading_frees_its_upstream_connection() {
    const LENGTH: usize = 256 << 20;
    let (upstream_addr, closed) = answering_once(|mut stream| async move {
        let answer = format!("HTTP/1.1 200 OK\r\nContent-Length: {LENGTH}\r\n\r\n");
        stream.write_all(answer.as_bytes()).await.unwrap();
        // Writes until the proxy's end of the connection closes; the body is
        // far larger than every buffer on the way.
        let piece = vec![b'x'; 64 << 10];
        for _ in 0..LENGTH / piece.len() {
            if stream.write_all(&piece).await.is_err() {
                return;
            }
        }
        panic!("the whole body was taken");
    })
    .await;
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.url = format!("http://{upstream_addr}");
        config.upstream.timeout = Duration::from_millis(300);
    })
    .await;
    let mut sender = TcpStream::connect(app.addr).await.unwrap();
    sender
        .write_all(b"GET /download HTTP/1.1\r\nhost: proxy\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 64];
    let read = sender.read(&mut first).await.unwrap();
    assert!(first[..read].starts_with(b"HTTP/1.1 200"));
    // The sender reads nothing more, and stays connected.
    tokio::time::timeout(Duration::from_secs(20), closed)
        .await
        .expect("the upstream connection is closed")
        .unwrap();
    drop(sender);
}

/// An HTTP/2 connection may open 100 streams at once (RFC 9113's
/// recommended least), not hyper's 200: each holds up to 64 KiB of a
/// response its sender does not take, and with the upstream's read-ahead
/// that bounds what one connection can make the proxy hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_may_open_100_streams() {
    let app = TestApp::spawn(Backend::Sqlite, |_| {}).await;
    let (client, _) = http2_client(&app, &h2::client::Builder::new()).await;
    let request = http::Request::get("http://localhost/elsewhere")
        .body(())
        .unwrap();
    let response = send_whole(client.clone(), request).await.await.unwrap();
    assert_eq!(response.headers()["x-dedupe-outcome"], "passthrough");
    assert_eq!(client.current_max_send_streams(), 100);
}

/// An HTTP/2 sender that takes nothing of a response (its stream's
/// flow-control window left at zero) has it cut off after
/// `upstream.timeout`, so the upstream connection the response came on is
/// closed instead of being held for as long as the sender stays connected;
/// and the stream no longer counts as open, so the sender's connection,
/// with no other request on it, is closed as idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_sender_that_takes_nothing_of_a_response_frees_its_upstream_connection() {
    let (upstream_addr, closed) = answering_once(|mut stream| async move {
        stream
            .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            .await
            .unwrap();
        // Whatever the proxy does next, its end of the connection closes.
        let _ = stream.read(&mut [0u8; 4096]).await;
    })
    .await;
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.url = format!("http://{upstream_addr}");
        config.upstream.timeout = Duration::from_millis(300);
        config.limits.header_read_timeout = Duration::from_millis(300);
    })
    .await;
    let (client, connection) =
        http2_client(&app, h2::client::Builder::new().initial_window_size(0)).await;
    let request = http::Request::get("http://localhost/download")
        .body(())
        .unwrap();
    let response = send_whole(client.clone(), request).await;
    let response = response.await.unwrap();
    assert_eq!(response.headers()["x-dedupe-outcome"], "passthrough");
    // Guards against a hang, not measures: the cut comes after 300 ms, the
    // connection's close 300 ms after its GOAWAY, 300 ms later.
    tokio::time::timeout(Duration::from_secs(20), closed)
        .await
        .expect("the upstream connection is closed")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), connection)
        .await
        .expect("the proxy closed the sender's connection")
        .unwrap()
        .ok();
    // Held until then: the sender neither closed nor gave up its stream.
    drop((client, response));
    assert_eq!(app.admin_get("/healthz").await.status, 200);
}

/// A response with both `Content-Length` and `Transfer-Encoding: chunked`
/// is read by its chunks (RFC 9112 section 6.3), and passed on without the
/// length, which would have cut it short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_framed_twice_is_passed_on_by_its_chunks() {
    let upstream_addr = raw_upstream(
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.url = format!("http://{upstream_addr}");
    })
    .await;
    let webhook = app.deliver("evt_framed", "{}").await;
    assert_eq!((webhook.status, webhook.outcome()), (200, "forwarded"));
    assert_eq!(webhook.body, "hello");
    assert!(!webhook.headers.contains_key("content-length"));
    let unmatched = app.post("/elsewhere", &[], "{}").await;
    assert_eq!(unmatched.body, "hello");
}

/// An upstream that sends its headers and then stalls has its response cut
/// off once `upstream.timeout` passes without a byte, instead of holding the
/// sender's connection, and an upstream connection, for good. The key was
/// settled by the status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_body_that_stalls_is_cut_off_after_the_upstream_timeout() {
    let upstream_addr = raw_upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf").await;
    let app = TestApp::spawn(Backend::Sqlite, |config| {
        config.upstream.url = format!("http://{upstream_addr}");
        config.upstream.timeout = Duration::from_millis(300);
    })
    .await;
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    stream
        .write_all(
            b"POST /hooks/orders HTTP/1.1\r\nHost: proxy\r\nX-Event-Id: evt_stall\r\nContent-Length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
    let mut received = Vec::new();
    // A guard against a hang, not a measure: the cut comes after 300 ms.
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut received))
        .await
        .expect("the response was cut off")
        .ok();
    let received = String::from_utf8_lossy(&received);
    assert!(received.starts_with("HTTP/1.1 200 OK\r\n"), "{received}");
    assert!(received.ends_with("\r\n\r\nhalf"), "{received}");
    let again = app.deliver("evt_stall", "{}").await;
    assert_eq!(again.outcome(), "duplicate");
}

/// A body sent a byte a chunk is held in one buffer, charged whole to
/// `limits.max_buffered_body_bytes`, not as a piece per chunk (each costing
/// tens of bytes more than the byte it holds): bodies that fill the budget
/// that way grow the process by about the budget, not by many times it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_sent_a_byte_a_chunk_cost_about_their_size() {
    const BODY: usize = 256 * 1024;
    const SENDERS: usize = 4;
    let store = crate::support::TestStore::new(Backend::Sqlite).await;
    let upstream = crate::support::Upstream::start().await;
    // A debug build parses a million one-byte chunks in about a second
    // alone, and in far longer on a busy machine: no held body may time out
    // before the budget is seen full.
    let limits = format!(
        "limits: {{ max_body_bytes: {BODY}, max_buffered_body_bytes: {}, body_read_timeout: 1h }}\n",
        BODY * SENDERS
    );
    let config = crate::cli::process_config(&upstream, &store.url, &limits);
    let proxy = crate::cli::ProxyProcess::start(&config).await;
    proxy.wait_ready().await;
    let warm_up = crate::cli::post_webhook(proxy.addr, "evt_warm_up", "{}".into()).await;
    assert_eq!(warm_up.outcome(), "forwarded");
    let before = proxy.resident_bytes();
    let mut senders = Vec::new();
    for n in 0..SENDERS {
        let mut sender = TcpStream::connect(proxy.addr).await.unwrap();
        let head = format!(
            "POST /hooks/orders HTTP/1.1\r\nhost: proxy\r\nx-event-id: evt_drip_{n}\r\ntransfer-encoding: chunked\r\n\r\n"
        );
        sender.write_all(head.as_bytes()).await.unwrap();
        // The last chunk never comes: the body stays held.
        sender.write_all(&b"1\r\nx\r\n".repeat(BODY)).await.unwrap();
        senders.push(sender);
    }
    // A body's last charge to the budget is taken once it is half read. A
    // probe sent before then would take the byte that charge needs, and the
    // body would be refused instead; once the proxy has read every byte the
    // senders wrote (all but its 64 KiB buffer parsed), the budget is full.
    let read = async {
        while !senders.iter().all(wholly_read) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(600), read)
        .await
        .expect("the proxy reads what the senders wrote");
    let probe = crate::cli::post_webhook(proxy.addr, "evt_probe", "x".into()).await;
    assert_eq!(probe.status, 503, "a body of one byte more is refused");
    let grown = proxy.resident_bytes().saturating_sub(before);
    assert!(
        grown < 16 << 20,
        "{grown} bytes more resident to hold {} bytes of bodies",
        BODY * SENDERS
    );
    drop(senders);
}

/// Whether the other end of `sender`'s connection (on loopback, so both ends
/// are in `/proc/net/tcp`) has received and read every byte written to it.
fn wholly_read(sender: &TcpStream) -> bool {
    let entry = |address: std::net::SocketAddr| match address {
        std::net::SocketAddr::V4(v4) => format!(
            "{:08X}:{:04X}",
            u32::from_le_bytes(v4.ip().octets()),
            v4.port()
        ),
        std::net::SocketAddr::V6(_) => unreachable!("the proxy listens on IPv4"),
    };
    let (ours, theirs) = (
        entry(sender.local_addr().unwrap()),
        entry(sender.peer_addr().unwrap()),
    );
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let queues = |local: &str, remote: &str| {
        table
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .find(|fields| fields.get(1) == Some(&local) && fields.get(2) == Some(&remote))
            .map(|fields| fields[4].to_owned())
            .expect("both ends of the connection are listed")
    };
    let unsent_or_unacknowledged = queues(&ours, &theirs);
    let unread = queues(&theirs, &ours);
    unsent_or_unacknowledged.starts_with("00000000:") && unread.ends_with(":00000000")
}
