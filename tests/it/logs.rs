//! The binary's logs with `--log-format json`: one JSON object per line,
//! exactly one `webhook` line per webhook with the fields operators filter
//! on, never a request body, even at the most verbose filter, and store
//! errors with the server's own message.

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::Value;

use crate::cli::{ProxyProcess, post_webhook, process_config as config};
use crate::support::{
    Backend, Behavior, TestResponse, TestStore, Upstream, client, until_waiting_on_locks,
};

const MARKER: &str = "BODY-MARKER-5f1c2e";

async fn deliver(proxy: &ProxyProcess, key: &str) -> TestResponse {
    deliver_body(proxy, key, format!(r#"{{"card":"{MARKER}"}}"#)).await
}

async fn deliver_body(proxy: &ProxyProcess, key: &str, body: String) -> TestResponse {
    post_webhook(proxy.addr, key, body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_webhook_logs_one_json_line_and_no_body() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    let config = config(&upstream, &store.url, "");
    let mut proxy = ProxyProcess::start_with_log_filter(&config, "trace").await;
    proxy.wait_ready().await;
    assert_eq!(deliver(&proxy, "evt_log").await.outcome(), "forwarded");
    assert_eq!(deliver(&proxy, "evt_log").await.outcome(), "duplicate");
    let changed = deliver_body(&proxy, "evt_log", format!(r#"{{"card":"{MARKER}","n":2}}"#));
    assert_eq!(changed.await.outcome(), "duplicate");
    proxy.terminate();
    let lines = proxy.all_log_lines().await;

    let events: Vec<Value> = lines
        .iter()
        .map(|line| {
            let event: Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not one JSON object ({e}): {line}"));
            assert!(event.is_object(), "{line}");
            event
        })
        .collect();
    let webhooks: Vec<&Value> = events
        .iter()
        .filter(|event| event["message"] == "webhook")
        .collect();
    assert_eq!(webhooks.len(), 3, "one line per webhook: {webhooks:#?}");

    let forwarded = webhooks[0];
    assert_eq!(forwarded["level"], "INFO");
    assert_eq!(forwarded["route"], "orders");
    assert_eq!(forwarded["key"], "evt_log");
    assert_eq!(forwarded["outcome"], "forwarded");
    assert_eq!(forwarded["attempt"], 1);
    assert_eq!(forwarded["upstream_status"], 200);
    for duration in ["store_ms", "upstream_ms", "total_ms"] {
        let ms = forwarded[duration].as_f64();
        assert!(ms.is_some_and(|ms| ms >= 0.0), "{duration}: {forwarded}");
    }
    assert!(forwarded["timestamp"].is_string());

    assert!(forwarded.get("reason").is_none(), "{forwarded}");
    let duplicate = webhooks[1];
    assert_eq!(duplicate["outcome"], "duplicate");
    assert_eq!(duplicate["key"], "evt_log");
    assert!(duplicate.get("upstream_status").is_none(), "{duplicate}");
    assert!(duplicate.get("attempt").is_none(), "{duplicate}");

    let mismatches: Vec<&Value> = events
        .iter()
        .filter(|event| event["message"] == "event id delivered again with a different body")
        .collect();
    assert_eq!(mismatches.len(), 1, "{events:#?}");
    assert_eq!(mismatches[0]["level"], "WARN");
    assert_eq!(mismatches[0]["route"], "orders");
    assert_eq!(mismatches[0]["key"], "evt_log");

    let leaked: Vec<&String> = lines.iter().filter(|l| l.contains(MARKER)).collect();
    assert!(leaked.is_empty(), "the body was logged: {leaked:#?}");
    assert_eq!(upstream.count(), 1);
    assert!(
        upstream.seen()[0]
            .body
            .windows(MARKER.len())
            .any(|w| w == MARKER.as_bytes()),
        "the marker did travel through the proxy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_forwarded_without_a_claim_logs_its_upstream_time() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    let config = config(
        &upstream,
        &store.url,
        "defaults: { on_missing_key: forward }\n",
    );
    let mut proxy = ProxyProcess::start(&config).await;
    proxy.wait_ready().await;
    let passed = only_webhook_line(&mut proxy, "/hooks/orders").await;
    assert_eq!(passed["outcome"], "passthrough");
    assert_eq!(passed["upstream_status"], 200);
    let upstream_ms = passed["upstream_ms"].as_f64();
    assert!(upstream_ms.is_some_and(|ms| ms >= 0.0), "{passed}");
    assert_eq!(upstream.count(), 1);
}

/// An unmatched request's line (at debug) carries the upstream's time too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmatched_request_logs_its_upstream_time_at_debug() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    let config = config(&upstream, &store.url, "");
    let mut proxy = ProxyProcess::start_with_log_filter(&config, "info,dedupe_proxy=debug").await;
    proxy.wait_ready().await;
    let passed = only_webhook_line(&mut proxy, "/elsewhere").await;
    assert_eq!(passed["route"], "unmatched");
    assert_eq!(passed["level"], "DEBUG", "{passed}");
    assert_eq!(passed["upstream_status"], 200);
    let upstream_ms = passed["upstream_ms"].as_f64();
    assert!(upstream_ms.is_some_and(|ms| ms >= 0.0), "{passed}");
    assert_eq!(upstream.count(), 1);
}

/// A response the upstream cuts off after its head reaches the sender cut
/// off; the warning names the delivery (route, key as the webhook's line has
/// it, attempt), a request forwarded without a key its route, and an
/// unmatched request's says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_cut_off_on_its_way_is_logged_with_its_delivery() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut connection, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 4096];
                while !request.ends_with(b"\r\n\r\n{}") {
                    match connection.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                // Dropped after the head: the body ends 93 bytes short.
                let _ = connection
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
                    .await;
            });
        }
    });
    let store = TestStore::new(Backend::Sqlite).await;
    let unused = Upstream::start().await;
    let config = config(
        &unused,
        &store.url,
        "defaults: { on_missing_key: forward }\n",
    )
    .replace(&unused.url(), &upstream_url);
    let mut proxy = ProxyProcess::start(&config).await;
    proxy.wait_ready().await;
    for (path, key) in [
        ("/hooks/orders", Some("evt cut%")),
        ("/elsewhere", Some("evt cut%")),
        ("/hooks/orders", None),
    ] {
        let mut request = Request::post(format!("http://{}{path}", proxy.addr));
        if let Some(key) = key {
            request = request.header("x-event-id", key);
        }
        let request = request.body(Full::new(Bytes::from_static(b"{}"))).unwrap();
        let response = client().request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        let body = http_body_util::BodyExt::collect(response.into_body()).await;
        assert!(body.is_err(), "the body is cut off");
    }
    proxy.terminate();
    let warnings: Vec<Value> = proxy
        .all_log_lines()
        .await
        .iter()
        .filter(|line| line.contains("cut off on its way to the sender"))
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(warnings.len(), 3, "{warnings:#?}");
    let webhook = &warnings[0];
    assert_eq!(webhook["level"], "WARN");
    assert_eq!(webhook["route"], "orders");
    assert_eq!(webhook["key"], "evt cut%");
    assert_eq!(webhook["attempt"], 1);
    assert_eq!(warnings[1]["route"], "unmatched");
    assert!(warnings[1].get("key").is_none(), "{:?}", warnings[1]);
    // Forwarded without a key (on_missing_key: forward): its route still.
    assert_eq!(warnings[2]["route"], "orders");
    assert!(warnings[2].get("key").is_none(), "{:?}", warnings[2]);
}

/// Posts `{}` to `path`, expects it passed through, stops the proxy and
/// returns the one `webhook` line it logged.
async fn only_webhook_line(proxy: &mut ProxyProcess, path: &str) -> Value {
    let request = Request::post(format!("http://{}{path}", proxy.addr))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let response = TestResponse::read(client().request(request).await.expect("proxy answers"));
    assert_eq!(response.await.outcome(), "passthrough");
    proxy.terminate();
    let lines = proxy.all_log_lines().await;
    let mut webhooks: Vec<Value> = lines
        .iter()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|event| event["message"] == "webhook")
        .collect();
    assert_eq!(webhooks.len(), 1, "{lines:#?}");
    webhooks.remove(0)
}

/// A request still at the upstream when the grace period ends never gets
/// its `webhook` line (its sender's connection is cut); the release of its
/// claim names the route and key instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_cut_off_at_the_grace_deadline_is_logged_with_its_key() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    upstream.script("evt_cut", [Behavior::Hang]);
    let config = config(
        &upstream,
        &store.url,
        "shutdown_grace: 200ms
",
    );
    let mut proxy = ProxyProcess::start(&config).await;
    proxy.wait_ready().await;
    let cut_off = tokio::spawn({
        let addr = proxy.addr;
        async move {
            let request = Request::post(format!("http://{addr}/hooks/orders"))
                .header("x-event-id", "evt_cut")
                .body(Full::new(Bytes::from_static(b"{}")))
                .unwrap();
            client().request(request).await
        }
    });
    upstream.wait_for(1).await;
    proxy.terminate();
    assert!(proxy.wait().await.success());
    assert!(cut_off.await.unwrap().is_err(), "the sender got no answer");
    let events: Vec<Value> = proxy
        .all_log_lines()
        .await
        .iter()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .collect();
    let released: Vec<&Value> = events
        .iter()
        .filter(|event| {
            event["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("released at shutdown"))
        })
        .collect();
    assert_eq!(released.len(), 1, "{events:#?}");
    assert_eq!(released[0]["level"], "WARN");
    assert_eq!(released[0]["route"], "orders");
    assert_eq!(released[0]["key"], "evt_cut");
    assert_eq!(released[0]["attempt"], 1);
    let summary = events
        .iter()
        .find(|event| {
            event["message"]
                == "claims still open at shutdown: known outcomes written, the rest released"
        })
        .expect("the summary line");
    assert_eq!(
        (
            &summary["released"],
            &summary["outcomes_written"],
            &summary["already_settled"]
        ),
        (&Value::from(1), &Value::from(0), &Value::from(0)),
        "{summary}"
    );
}

/// A proxy on a new PostgreSQL test database, ready.
async fn ready_on_postgres() -> (TestStore, Upstream, ProxyProcess) {
    let store = TestStore::new(Backend::Postgres).await;
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::start(&config(&upstream, &store.url, "")).await;
    proxy.wait_ready().await;
    (store, upstream, proxy)
}

/// The `claim failed` line the proxy logged, once it has stopped.
async fn claim_failed_line(mut proxy: ProxyProcess) -> String {
    proxy.terminate();
    proxy
        .all_log_lines()
        .await
        .into_iter()
        .find(|line| line.contains("claim failed"))
        .expect("a claim failure was logged")
}

/// A connection the server ends is logged with the server's reason, not
/// only tokio-postgres's "db error".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_server_ends_is_logged_with_its_reason() {
    let (store, _upstream, mut proxy) = ready_on_postgres().await;
    assert_eq!(deliver(&proxy, "evt_before").await.outcome(), "forwarded");
    store
        .postgres()
        .await
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .await
        .unwrap();
    proxy
        .wait_for_log("terminating connection due to administrator command")
        .await;
    proxy.terminate();
    let lines = proxy.all_log_lines().await;
    assert!(
        lines.iter().any(
            |line| line.contains("PostgreSQL connection ended with an error")
                && line.contains("terminating connection due to administrator command")
        ),
        "{lines:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_errors_are_logged_with_the_servers_message() {
    let store = TestStore::new(Backend::Postgres).await;
    let missing = store.url.rsplit_once('/').unwrap().0.to_owned() + "/dedupe_no_such_database";
    let upstream = Upstream::start().await;
    let proxy = ProxyProcess::start(&config(&upstream, &missing, "")).await;
    let refused = deliver(&proxy, "evt_nodb").await;
    assert_eq!(refused.status, 503);
    let claim_failed = claim_failed_line(proxy).await;
    assert!(
        claim_failed.contains(r#"database \"dedupe_no_such_database\" does not exist"#),
        "{claim_failed}"
    );
    // No connection was had, so nothing was sent that could have been
    // committed: the line names the key, and no key to free.
    assert!(
        claim_failed.contains(r#""key":"evt_nodb""#)
            && !claim_failed.contains("dedupe-proxy keys release frees it"),
        "{claim_failed}"
    );
}

/// Delivers `key` while another transaction holds its row, calls `stop`
/// (`pg_terminate_backend` or `pg_cancel_backend`) on the backend whose
/// claim waits for that row, then lets the row go; the delivery's status.
async fn claim_stopped_while_waiting(
    store: &TestStore,
    proxy: &ProxyProcess,
    key: &'static str,
    stop: &str,
) -> u16 {
    let mut holder = store.postgres().await;
    let insert = holder.transaction().await.unwrap();
    insert
        .execute(
            "INSERT INTO processed_events (source, event_id, status) VALUES ('orders', $1, 'processing')",
            &[&key],
        )
        .await
        .unwrap();
    let addr = proxy.addr;
    let delivery = tokio::spawn(async move { post_webhook(addr, key, "{}".into()).await });
    let observer = store.postgres().await;
    until_waiting_on_locks(&observer, 1).await;
    observer
        .batch_execute(&format!(
            "SELECT {stop}(pid) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ))
        .await
        .unwrap();
    let status = delivery.await.unwrap().status;
    insert.rollback().await.unwrap();
    status
}

/// A claim whose connection fails while its statement is at the database
/// may have been committed with its answer lost: its line names the key and
/// how to free it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_cut_off_at_the_database_says_how_to_free_its_key() {
    let (store, _upstream, proxy) = ready_on_postgres().await;
    let status =
        claim_stopped_while_waiting(&store, &proxy, "evt_cut", "pg_terminate_backend").await;
    assert_eq!(status, 503);
    let claim_failed = claim_failed_line(proxy).await;
    assert!(
        claim_failed.contains(r#""key":"evt_cut""#)
            && claim_failed.contains("dedupe-proxy keys release frees it"),
        "{claim_failed}"
    );
}

/// A claim whose statement the database cancels (`statement_timeout`,
/// `pg_cancel_backend`) was rolled back: its line names no key to free, and
/// the retry is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_database_canceled_leaves_no_key_to_free() {
    let (store, _upstream, proxy) = ready_on_postgres().await;
    let status =
        claim_stopped_while_waiting(&store, &proxy, "evt_canceled", "pg_cancel_backend").await;
    assert_eq!(status, 503);
    assert_eq!(deliver(&proxy, "evt_canceled").await.outcome(), "forwarded");
    let claim_failed = claim_failed_line(proxy).await;
    assert!(
        claim_failed.contains(r#""key":"evt_canceled""#)
            && claim_failed.contains("canceling statement due to user request")
            && !claim_failed.contains("keys release frees it"),
        "{claim_failed}"
    );
}

/// `log_level` filters when `RUST_LOG` is unset; when set, `RUST_LOG` wins,
/// unless it is not a filter, which is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_log_wins_over_the_configured_log_level() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    // Webhook lines are logged by the proxy module at info: this level keeps
    // the start-up line (readiness) and drops them.
    let config = config(
        &upstream,
        &store.url,
        "log_level: 'info,dedupe_proxy::proxy=warn'\n",
    );
    let webhook_lines = |lines: &[String]| {
        lines
            .iter()
            .filter(|line| line.contains(r#""message":"webhook""#))
            .count()
    };

    let mut configured = ProxyProcess::start_with_configured_log_level(&config).await;
    configured.wait_ready().await;
    assert_eq!(deliver(&configured, "evt_a").await.outcome(), "forwarded");
    configured.terminate();
    assert_eq!(webhook_lines(&configured.all_log_lines().await), 0);

    let mut overridden = ProxyProcess::start_with_log_filter(&config, "info").await;
    overridden.wait_ready().await;
    assert_eq!(deliver(&overridden, "evt_b").await.outcome(), "forwarded");
    overridden.terminate();
    assert_eq!(webhook_lines(&overridden.all_log_lines().await), 1);

    // An unusable RUST_LOG is reported, and log_level filters instead. That
    // includes a mistyped level, which EnvFilter would take as a target and
    // so turn off every line, the start-up line (readiness) included.
    for (filter, key) in [("info,[unclosed", "evt_c"), ("warning", "evt_d")] {
        let mut unusable = ProxyProcess::start_with_log_filter(&config, filter).await;
        unusable.wait_ready().await;
        assert_eq!(deliver(&unusable, key).await.outcome(), "forwarded");
        unusable.terminate();
        let lines = unusable.all_log_lines().await;
        assert_eq!(webhook_lines(&lines), 0, "{lines:?}");
        assert!(
            lines
                .iter()
                .any(|line| line.contains("RUST_LOG is not a log filter")
                    && line.contains(&format!(r#""rust_log":"{filter}""#))),
            "{lines:?}"
        );
    }
}

/// The error that stops the binary is, under `--log-format json`, a JSON
/// line like the rest, the last, and written whatever `RUST_LOG` says: a
/// configuration refused, and a listen address already taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_error_that_stops_the_binary_is_a_json_line_whatever_the_filter() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = config(&upstream, &store.url, "").replacen(
        "listen: 127.0.0.1:0",
        &format!("listen: {}", taken.local_addr().unwrap()),
        1,
    );
    let refused = config(&upstream, &store.url, "log_level: warning\n");
    for (config, exit_code, naming) in [(busy, 1, "cannot listen on"), (refused, 2, "log_level")] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, config).unwrap();
        let ran = tokio::process::Command::new(crate::cli::BINARY)
            .args(["run", "--log-format", "json", "--config"])
            .arg(&path)
            .env("RUST_LOG", "off")
            .output()
            .await
            .unwrap();
        assert_eq!(ran.status.code(), Some(exit_code));
        let stderr = String::from_utf8(ran.stderr).unwrap();
        let lines: Vec<Value> = stderr
            .lines()
            .map(|line| {
                serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("not one JSON object ({e}): {line}"))
            })
            .collect();
        let last = lines.last().expect("a line");
        assert_eq!(last["level"], "ERROR", "{stderr}");
        let message = last["message"].as_str().unwrap();
        assert!(message.contains(naming), "{stderr}");
        assert!(
            last["timestamp"].as_str().unwrap().ends_with('Z'),
            "{stderr}"
        );
        let fields = stderr.lines().last().unwrap();
        assert!(
            fields.starts_with(r#"{"timestamp":"#)
                && fields.contains(r#","level":"ERROR","message":"#),
            "in the order of every other line's: {fields}"
        );
    }
}

/// `--log-format text` gives human-readable lines, not JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_format_logs_plain_lines() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, config(&upstream, &store.url, "")).unwrap();
    let mut child = tokio::process::Command::new(crate::cli::BINARY)
        .args(["--log-format", "text", "--config"])
        .arg(&path)
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let serving = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("dedupe-proxy serving") {
                return line;
            }
        }
        panic!("the binary exited before serving");
    };
    let line = tokio::time::timeout(std::time::Duration::from_secs(20), serving)
        .await
        .expect("serving line");
    assert!(serde_json::from_str::<Value>(&line).is_err(), "{line}");
    assert!(line.contains("INFO") && line.contains("listen="), "{line}");
    child.kill().await.unwrap();
}

/// A refused webhook's line says why, as its response does: the outcome
/// alone (`rejected_bad_request`) does not tell a missing key from a body
/// that is not JSON or one that stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_webhook_logs_the_reason_it_was_refused() {
    let store = TestStore::new(Backend::Sqlite).await;
    let upstream = Upstream::start().await;
    let config = config(&upstream, &store.url, "");
    let mut proxy = ProxyProcess::start(&config).await;
    proxy.wait_ready().await;
    let refused = deliver(&proxy, "").await;
    assert_eq!((refused.status, refused.outcome()), (400, "rejected"));
    proxy.terminate();
    let lines = proxy.all_log_lines().await;
    let webhooks: Vec<Value> = lines
        .iter()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|event| event["message"] == "webhook")
        .collect();
    assert_eq!(webhooks.len(), 1, "{lines:#?}");
    let reason = webhooks[0]["reason"].as_str().unwrap_or_default();
    assert!(!reason.is_empty(), "{}", webhooks[0]);
    let answered: Value = serde_json::from_str(&refused.body).unwrap();
    assert_eq!(answered["detail"], reason, "the response says the same");
    assert_eq!(upstream.count(), 0);
}

/// With `store.migrate: false` and no claims table, start-up says so, as the
/// migration would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_logged_at_start_up_without_the_migration() {
    let store = TestStore::new(Backend::Postgres).await;
    let upstream = Upstream::start().await;
    let config = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nupstream: {{ url: '{}' }}\nstore: {{ url: '{}', migrate: false }}\n",
        upstream.url(),
        store.url
    );
    let mut proxy = ProxyProcess::start(&config).await;
    proxy.wait_for_log("the store cannot take claims yet").await;
    proxy.terminate();
    let lines = proxy.all_log_lines().await;
    let line = lines
        .iter()
        .find(|line| line.contains("the store cannot take claims yet"))
        .unwrap();
    assert!(
        line.contains("the claims table is missing") && line.contains(r#""level":"WARN""#),
        "{line}"
    );
}
