//! The operator's commands through the binary, on both stores: `keys list`,
//! `show`, `forget`, `release` and `prune`, their table and JSON output, and
//! their exit codes for missing keys, a missing schema and bad arguments.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dedupe_proxy::config::StoreConfig;
use dedupe_proxy::store::{ClaimRequest, KeyStatus, SettledStatus, Settlement, Store};
use sha2::{Digest, Sha256};

use crate::cli::{Output, run};
use crate::on_both_stores;
use crate::rows;
use crate::support::{Backend, TestStore, settle_attempt};

on_both_stores!(
    the_store_commands_run_without_the_webhook_secrets_or_tls_files,
    keys_list_prints_a_table_newest_first_and_filters_it,
    keys_list_and_show_print_json_with_rfc3339_times_and_a_hex_hash,
    keys_show_prints_every_column,
    keys_forget_deletes_a_key_and_a_missing_key_exits_1,
    keys_forget_keeps_a_key_in_flight_unless_forced,
    keys_release_fails_a_processing_key_and_nothing_else,
    the_commands_report_a_missing_table_without_creating_it,
    output_to_a_closed_pipe_ends_quietly_and_to_a_full_disk_fails,
    prune_deletes_keys_past_their_horizon_or_the_override,
);

const HOUR: Duration = Duration::from_secs(3600);

/// A store holding, newest first: `json/evt_processing` (live lease, 1h old),
/// `orders/evt_failed` (500, 2h old), `orders/evt_done` (200, 3h old).
async fn seeded(backend: Backend) -> (TestStore, String) {
    let db = TestStore::new(backend).await;
    let store = Store::open(&StoreConfig {
        url: db.url.clone(),
        ..StoreConfig::default()
    })
    .unwrap();
    store.migrate().await.unwrap();
    for (source, key, outcome, ago) in [
        ("orders", "evt_done", Some((SettledStatus::Done, 200)), 3),
        (
            "orders",
            "evt_failed",
            Some((SettledStatus::Failed, 500)),
            2,
        ),
        ("json", "evt_processing", None, 1),
    ] {
        let claim = ClaimRequest {
            source: Arc::from(source),
            key: key.into(),
            payload_sha256: Sha256::digest(key).into(),
            lease: HOUR,
            reject_mismatch: false,
        };
        store.claim(&claim).await.unwrap();
        if let Some((status, code)) = outcome {
            let settlement = Settlement {
                status,
                response_status: Some(code),
            };
            assert!(
                settle_attempt(&store, source, key, 1, settlement)
                    .await
                    .unwrap()
            );
        }
        rows::age(&db, source, key, HOUR * ago).await;
    }
    let config = config(&db);
    (db, config)
}

fn config(db: &TestStore) -> String {
    format!(
        "store: {{ url: '{}' }}\nroutes:\n  - {{ name: orders, path: /o, key: {{ header: X-Id }} }}\n  - {{ name: json, path: /j, key: {{ json: /id }} }}\n",
        db.url
    )
}

async fn the_store_commands_run_without_the_webhook_secrets_or_tls_files(backend: Backend) {
    let (_db, config) = seeded(backend).await;
    let config = format!(
        "tls: {{ cert_file: /nonexistent/tls.crt, key_file: /nonexistent/tls.key }}\n{config}  - {{ name: stripe, path: /s, provider: stripe, secrets: [{{ env: DEDUPE_TEST_SECRET_NEVER_SET }}] }}\n"
    );
    for args in [
        &["migrate"][..],
        &["keys", "list"],
        &["keys", "forget", "orders", "evt_done"],
        &["prune"],
    ] {
        let out = keys(args, &config);
        assert_eq!(out.code, 0, "{args:?}: {}", out.stderr);
    }
    let check = keys(&["check-config"], &config);
    assert_eq!(check.code, 2);
    for unread_by_the_store_commands in ["DEDUPE_TEST_SECRET_NEVER_SET", "/nonexistent/tls.crt"] {
        assert!(
            check.stderr.contains(unread_by_the_store_commands),
            "{}",
            check.stderr
        );
    }
    let broken = config.replace("key: { json: /id }", "key: { json: id }");
    assert_eq!(
        keys(&["keys", "list"], &broken).code,
        2,
        "other problems still count"
    );
}

fn keys(args: &[&str], config: &str) -> Output {
    let out = run(args, Some(config), &[]);
    assert!(
        out.code == 0 || !out.stderr.is_empty(),
        "a failure says why: {args:?}"
    );
    out
}

/// The first two columns (source, key) of a table's rows.
fn listed(out: &Output) -> Vec<String> {
    assert_eq!(out.code, 0, "{}", out.stderr);
    out.stdout
        .lines()
        .skip(1)
        .map(|line| {
            let cells: Vec<&str> = line.split_whitespace().collect();
            format!("{}/{}", cells[0], cells[1])
        })
        .collect()
}

async fn keys_list_prints_a_table_newest_first_and_filters_it(backend: Backend) {
    let (_db, config) = seeded(backend).await;
    let all = keys(&["keys", "list"], &config);
    let header: Vec<&str> = all
        .stdout
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "SOURCE",
            "KEY",
            "STATUS",
            "ATTEMPTS",
            "RESPONSE",
            "RECEIVED",
            "COMPLETED",
            "LEASE_EXPIRES"
        ]
    );
    assert_eq!(
        listed(&all),
        [
            "json/evt_processing",
            "orders/evt_failed",
            "orders/evt_done"
        ]
    );
    let failed_row: Vec<&str> = all
        .stdout
        .lines()
        .nth(2)
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(failed_row[2..5], ["failed", "1", "500"]);
    let lease_cells: Vec<&str> = all
        .stdout
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().last().unwrap())
        .collect();
    assert!(
        lease_cells[0].ends_with('Z'),
        "a processing key shows when its lease expires: {lease_cells:?}"
    );
    assert_eq!(lease_cells[1..], ["-", "-"], "settled keys hold no lease");
    let status_column = all.stdout.lines().next().unwrap().find("STATUS").unwrap();
    for line in all.stdout.lines().skip(1) {
        assert!(
            line[status_column..].starts_with(|c: char| c.is_ascii_lowercase()),
            "columns are aligned: {line}"
        );
    }

    let orders = keys(&["keys", "list", "--source", "orders"], &config);
    assert_eq!(listed(&orders), ["orders/evt_failed", "orders/evt_done"]);
    let done = keys(&["keys", "list", "--status", "done"], &config);
    assert_eq!(listed(&done), ["orders/evt_done"]);
    let newest = keys(&["keys", "list", "--limit", "1"], &config);
    assert_eq!(listed(&newest), ["json/evt_processing"]);
    assert_eq!(
        newest.stderr,
        "more keys match: these are the newest 1; --limit shows more\n"
    );
    let exactly = keys(&["keys", "list", "--limit", "3"], &config);
    assert_eq!(listed(&exactly).len(), 3);
    assert_eq!(exactly.stderr, "", "nothing more matches");
    let none = keys(
        &[
            "keys",
            "list",
            "--source",
            "orders",
            "--status",
            "processing",
        ],
        &config,
    );
    assert_eq!(
        (none.code, none.stdout.as_str(), none.stderr.as_str()),
        (0, "", "no keys\n")
    );
}

async fn keys_list_and_show_print_json_with_rfc3339_times_and_a_hex_hash(backend: Backend) {
    let (_db, config) = seeded(backend).await;
    let out = keys(&["keys", "list", "--json"], &config);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let list: Vec<serde_json::Value> = serde_json::from_str(&out.stdout).unwrap();
    let names: Vec<&str> = list.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(names, ["evt_processing", "evt_failed", "evt_done"]);

    let out = keys(&["keys", "show", "orders", "evt_done", "--json"], &config);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let shown: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(shown, list[2], "show and list agree");
    let expected_hash: String = Sha256::digest("evt_done")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(shown["payload_sha256"], expected_hash.as_str());
    assert_eq!(shown["event_id"], "evt_done");
    assert_eq!(shown["key"], shown["event_id"]);
    assert_eq!(shown["source"], "orders");
    assert_eq!(shown["status"], "done");
    assert_eq!(shown["attempts"], 1);
    assert_eq!(shown["response_status"], 200);
    assert_eq!(shown["lease_expires_at"], serde_json::Value::Null);
    let time = |field: &str| {
        let text = shown[field].as_str().unwrap_or_else(|| panic!("{field}"));
        humantime::parse_rfc3339(text).unwrap_or_else(|e| panic!("{field} {text}: {e}"))
    };
    let age = SystemTime::now()
        .duration_since(time("received_at"))
        .unwrap();
    assert!(age > HOUR * 3 - Duration::from_secs(60) && age < HOUR * 3 + Duration::from_secs(60));
    assert!(time("completed_at") > time("received_at"));
    let processing = &list[0];
    assert_eq!(processing["status"], "processing");
    assert!(processing["lease_expires_at"].is_string());
    assert_eq!(processing["completed_at"], serde_json::Value::Null);
}

async fn keys_show_prints_every_column(backend: Backend) {
    let (_db, config) = seeded(backend).await;
    let out = keys(&["keys", "show", "orders", "evt_failed"], &config);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let fields: Vec<(String, String)> = out
        .stdout
        .lines()
        .skip(1)
        .map(|line| {
            let (name, value) = line.split_once(' ').unwrap();
            (name.to_owned(), value.trim().to_owned())
        })
        .collect();
    let names: Vec<&str> = fields.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "source",
            "key",
            "status",
            "attempts",
            "payload_sha256",
            "response_status",
            "received_at",
            "claimed_at",
            "lease_expires_at",
            "completed_at"
        ]
    );
    let value = |name: &str| &fields.iter().find(|(n, _)| n == name).unwrap().1;
    assert_eq!(value("status"), "failed");
    assert_eq!(value("response_status"), "500");
    assert_eq!(value("lease_expires_at"), "-");
    assert_eq!(value("payload_sha256").len(), 64);
}

async fn keys_forget_deletes_a_key_and_a_missing_key_exits_1(backend: Backend) {
    let (db, config) = seeded(backend).await;
    let out = keys(&["keys", "forget", "orders", "evt_done"], &config);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("forgot orders evt_done"),
        "{}",
        out.stdout
    );
    assert_eq!(
        rows::keys(&db).await,
        ["json/evt_processing", "orders/evt_failed"]
    );
    for command in ["forget", "show", "release"] {
        let out = keys(&["keys", command, "orders", "evt_done"], &config);
        assert_eq!(out.code, 1, "{command}: {}", out.stdout);
        assert!(
            out.stderr.contains("no key `evt_done` for source `orders`"),
            "{command}: {}",
            out.stderr
        );
    }
    let unknown = keys(&["keys", "show", "ordrs", "evt_failed"], &config);
    assert_eq!(unknown.code, 1);
    assert!(
        unknown.stderr.contains("no route is named `ordrs`"),
        "{}",
        unknown.stderr
    );
}

async fn keys_forget_keeps_a_key_in_flight_unless_forced(backend: Backend) {
    let (db, config) = seeded(backend).await;
    let kept = keys(&["keys", "forget", "json", "evt_processing"], &config);
    assert_eq!(kept.code, 1, "{}", kept.stdout);
    assert!(
        kept.stderr
            .contains("key `evt_processing` of source `json` is processing, leased until")
            && kept.stderr.contains("--force"),
        "{}",
        kept.stderr
    );
    assert_eq!(rows::keys(&db).await.len(), 3, "nothing deleted");
    let forced = keys(
        &["keys", "forget", "--force", "json", "evt_processing"],
        &config,
    );
    assert_eq!(forced.code, 0, "{}", forced.stderr);
    assert_eq!(
        rows::keys(&db).await,
        ["orders/evt_done", "orders/evt_failed"]
    );
}

async fn keys_release_fails_a_processing_key_and_nothing_else(backend: Backend) {
    let (_db, config) = seeded(backend).await;
    let out = keys(&["keys", "release", "json", "evt_processing"], &config);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("attempt 1 is now failed"),
        "{}",
        out.stdout
    );
    let shown = keys(
        &["keys", "show", "json", "evt_processing", "--json"],
        &config,
    );
    let shown: serde_json::Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(shown["status"], KeyStatus::Failed.as_str());
    assert_eq!(shown["lease_expires_at"], serde_json::Value::Null);
    assert_eq!(shown["attempts"], 1);

    for (key, status) in [("evt_processing", "failed"), ("evt_done", "done")] {
        let source = if key == "evt_done" { "orders" } else { "json" };
        let again = keys(&["keys", "release", source, key], &config);
        assert_eq!(again.code, 1, "{key}");
        assert!(
            again
                .stderr
                .contains(&format!("is {status}, not processing")),
            "{}",
            again.stderr
        );
    }
}

async fn the_commands_report_a_missing_table_without_creating_it(backend: Backend) {
    let db = TestStore::new(backend).await;
    let config = config(&db);
    let commands = [
        &["keys", "list"][..],
        &["keys", "show", "orders", "k"],
        &["keys", "forget", "orders", "k"],
        &["keys", "release", "orders", "k"],
        &["prune"],
    ];
    // A SQLite file that is not there is most likely a relative path read
    // from another working directory: the message names the full path.
    if let Some(path) = db.url.strip_prefix("sqlite://") {
        for args in commands {
            let out = keys(args, &config);
            assert_eq!(out.code, 1, "{args:?}: {}", out.stdout);
            assert!(
                out.stderr
                    .contains(&format!("there is no SQLite file at {path} ")),
                "{args:?}: {}",
                out.stderr
            );
        }
        assert!(!std::path::Path::new(path).exists(), "a file was created");
        // An empty file is an empty database.
        std::fs::write(path, "").unwrap();
    }
    for args in commands {
        let out = keys(args, &config);
        assert_eq!(out.code, 1, "{args:?}: {}", out.stdout);
        assert!(
            out.stderr.contains("`processed_events` does not exist")
                && out.stderr.contains("dedupe-proxy migrate"),
            "{args:?}: {}",
            out.stderr
        );
    }
    assert!(!rows::table_exists(&db).await);
}

/// A reader that stops early (`keys list | head`) ends the output without a
/// panic or a failure; a stdout that cannot be written to is a failure.
async fn output_to_a_closed_pipe_ends_quietly_and_to_a_full_disk_fails(backend: Backend) {
    let (db, config) = seeded(backend).await;
    // More than a pipe's buffer holds, so the writes must meet the closed end.
    rows::insert_old(&db, "orders", 3_000, HOUR).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, config).unwrap();
    let command = || {
        let mut command = std::process::Command::new(crate::cli::BINARY);
        command
            .args(["keys", "list", "--limit", "5000", "--config"])
            .arg(&path)
            .stderr(std::process::Stdio::piped());
        command
    };
    let mut closed = command()
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(closed.stdout.take());
    let closed = closed.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&closed.stderr);
    assert_eq!(closed.status.code(), Some(0), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");

    let full = command()
        .stdout(std::fs::File::create("/dev/full").unwrap())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&full.stderr);
    assert_eq!(full.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot write to stdout"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

async fn prune_deletes_keys_past_their_horizon_or_the_override(backend: Backend) {
    let (db, config) = seeded(backend).await;
    let out = keys(&["prune"], &config);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "pruned 0 keys\n", "the default retention is 7d");
    assert_eq!(rows::keys(&db).await.len(), 3);
    let out = keys(&["prune", "--older-than", "150m"], &config);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout, "pruned 1 key\n", "{}", out.stderr);
    assert_eq!(
        rows::keys(&db).await,
        ["json/evt_processing", "orders/evt_failed"]
    );
}

#[test]
fn bad_arguments_exit_2_with_clap_s_message() {
    let config = "store: { url: 'sqlite:///nonexistent/dedupe.db' }\n";
    for (args, says) in [
        (
            &["keys", "list", "--status", "finished"][..],
            "possible values",
        ),
        (&["keys", "list", "--limit", "0"], "--limit"),
        (&["keys", "list", "--limit", "many"], "--limit"),
        (&["keys", "show", "orders"], "<KEY>"),
        (&["keys", "forget"], "<SOURCE>"),
        (&["keys", "release", "orders"], "<KEY>"),
        (&["keys"], "Usage"),
        (&["prune", "--older-than", "soon"], "--older-than"),
    ] {
        let out = run(args, Some(config), &[]);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains(says), "{args:?}: {}", out.stderr);
    }
}

#[tokio::test]
async fn prune_exits_1_while_another_process_holds_the_prune_lock() {
    let (db, config) = seeded(Backend::Postgres).await;
    let _holder = rows::hold_prune_lock(&db).await;
    let out = keys(&["prune", "--older-than", "1m"], &config);
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(
        out.stderr.contains("another process is pruning"),
        "{}",
        out.stderr
    );
    assert_eq!(rows::keys(&db).await.len(), 3);
}

/// Another process holding the SQLite file's write lock (an `sqlite3`
/// session, say) makes a command that writes wait `store.timeout` and fail,
/// saying what may be holding it.
#[tokio::test]
async fn a_held_sqlite_write_lock_is_named_when_a_command_gives_up() {
    let (db, _) = seeded(Backend::Sqlite).await;
    let holder = rusqlite::Connection::open(db.url.strip_prefix("sqlite://").unwrap()).unwrap();
    holder.execute_batch("BEGIN IMMEDIATE").unwrap();
    let config = format!("store: {{ url: '{}', timeout: 300ms }}\n", db.url);
    let out = keys(&["keys", "forget", "orders", "evt_done"], &config);
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(out.stderr.contains("lock"), "{}", out.stderr);
    holder.execute_batch("ROLLBACK").unwrap();
    assert_eq!(
        keys(&["keys", "forget", "orders", "evt_done"], &config).code,
        0
    );
}

/// A write that gives up while another transaction holds the key's row
/// (an application's own transaction on the table, say) is rolled back:
/// the operator told it timed out can trust nothing changed.
#[tokio::test]
async fn a_forget_that_gives_up_on_a_held_row_changes_nothing() {
    let (db, _) = seeded(Backend::Postgres).await;
    let holder = db.postgres().await;
    holder
        .batch_execute(
            "BEGIN; SELECT 1 FROM processed_events WHERE source = 'orders' AND event_id = 'evt_done' FOR UPDATE",
        )
        .await
        .unwrap();
    let config = format!(
        "store: {{ url: '{}', timeout: 300ms }}\nroutes:\n  - {{ name: orders, path: /o, key: {{ header: X-Id }} }}\n",
        db.url
    );
    let out = keys(&["keys", "forget", "orders", "evt_done"], &config);
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(out.stderr.contains("timed out"), "{}", out.stderr);
    holder.batch_execute("COMMIT").await.unwrap();
    assert!(
        rows::keys(&db)
            .await
            .iter()
            .any(|key| key.contains("evt_done")),
        "{:?}",
        rows::keys(&db).await
    );
    assert_eq!(
        keys(&["keys", "forget", "orders", "evt_done"], &config).code,
        0
    );
}
