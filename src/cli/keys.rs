//! The operator's commands on stored keys: `keys list|show|forget|release`
//! and `prune`, with their table and JSON output. They open the store without
//! creating anything: a store whose schema was never made is reported, not
//! made.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail};
use serde::Serialize;

use super::KeysCommand;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::prune::{PruneError, PrunePlan, Pruner, Round};
use crate::store::{Forget, KeyFilter, KeyRecord, Release, Store, StoreError, StoreUrl};

/// Runs one `keys` subcommand, printing its result on stdout.
pub async fn keys(config: &Config, command: KeysCommand) -> anyhow::Result<()> {
    let store = open(config).await?;
    let explain = |error| explain(config, error);
    match command {
        KeysCommand::List {
            source,
            status,
            limit,
            json,
        } => {
            // One more than shown, to tell whether the list was cut short.
            let filter = KeyFilter {
                source,
                status: status.map(Into::into),
                limit: limit.saturating_add(1),
            };
            let mut records = store.list(&filter).await.map_err(|error| match error {
                // On SQLite a read, which no write lock holds up: the rows
                // took long. (PostgreSQL's reads may queue behind a lock on
                // the table.)
                StoreError::Timeout(limit) if store.has_one_writer_at_a_time() => anyhow!(
                    "store {}: listing took longer than store.timeout ({}): a smaller --limit, or a larger store.timeout, lets it finish",
                    StoreUrl::redact(&config.store.url),
                    crate::config::format_duration(limit)
                ),
                error => explain(error),
            })?;
            let more = records.len() > limit as usize;
            records.truncate(limit as usize);
            super::print(&render_list(&records, json))?;
            // On stderr, like the note below: a script reading the table
            // must not take it for a row.
            if records.is_empty() && !json {
                eprintln!("no keys");
            }
            if more {
                // On stderr, which leaves stdout a table or a JSON array.
                eprintln!("more keys match: these are the newest {limit}; --limit shows more");
            }
        }
        KeysCommand::Show { source, key, json } => {
            match store.show(&source, &key).await.map_err(explain)? {
                Some(record) => super::print(&render_one(&record, json))?,
                None => return Err(missing(config, &source, &key)),
            }
        }
        KeysCommand::Forget { source, key, force } => {
            match store.forget(&source, &key, force).await.map_err(explain)? {
                Forget::Forgotten => {
                    super::print(&format!(
                        "forgot {source} {key}: its next delivery will be processed again\n"
                    ))?;
                }
                Forget::Missing => return Err(missing(config, &source, &key)),
                Forget::InFlight { lease_expires_at } => bail!(
                    "key `{key}` of source `{source}` is processing, leased until {}: its delivery may still be at the application, and forgotten now, the next delivery would reach the application beside that one. Wait for the lease to run out, or pass --force",
                    time(lease_expires_at)
                ),
            }
        }
        KeysCommand::Release { source, key } => {
            match store.release(&source, &key).await.map_err(explain)? {
                Release::Released { attempt } => super::print(&format!(
                    "released {source} {key}: attempt {attempt} is now failed, so the next delivery will be forwarded\n"
                ))?,
                Release::Missing => return Err(missing(config, &source, &key)),
                Release::NotProcessing(status) => bail!(
                    "key `{key}` of source `{source}` is {status}, not processing: nothing to release"
                ),
            }
        }
    }
    Ok(())
}

/// Runs one pruning round with the configured horizons, or `older_than`
/// for every source, and prints how many keys it deleted.
pub async fn prune(config: &Config, older_than: Option<Duration>) -> anyhow::Result<()> {
    let plan = PrunePlan::new(config, older_than);
    let store = open(config).await?;
    let mut pruner = Pruner::new(store.clone(), plan, Metrics::new());
    if store.has_one_writer_at_a_time() {
        pruner = pruner.yielding_between_batches();
    }
    match pruner.run_once().await {
        Ok(Round::Pruned { deleted }) => super::print(&format!(
            "pruned {deleted} {}\n",
            if deleted == 1 { "key" } else { "keys" }
        )),
        Ok(Round::Skipped) => bail!(
            "another process is pruning this table (it holds the prune lock); nothing was deleted, try again later"
        ),
        Err(PruneError { deleted, source }) => Err(explain(config, source)
            .context(format!("pruning stopped after deleting {deleted} keys"))),
    }
}

/// Opens the store and checks that its table is a claims table, so that a
/// missing or foreign table is named as such rather than by the first
/// statement that trips on it.
async fn open(config: &Config) -> anyhow::Result<Store> {
    let store = Store::open_existing(&config.store).map_err(|error| explain(config, error))?;
    store.ping().await.map_err(|error| explain(config, error))?;
    Ok(store)
}

fn explain(config: &Config, error: StoreError) -> anyhow::Error {
    let store = StoreUrl::redact(&config.store.url);
    match error {
        StoreError::MissingTable(_)
            if let Some(path) = StoreUrl::missing_sqlite_file(&config.store.url) =>
        {
            anyhow!(
                "there is no SQLite file at {} ({store}; a relative path is read from the working directory): run the command where the proxy runs, or write the path in full; `dedupe-proxy migrate` would create a new, empty database there",
                path.display()
            )
        }
        StoreError::MissingTable(_) => anyhow!(
            "the table `{}` does not exist in {store}: create it with `dedupe-proxy migrate`",
            config.store.table
        ),
        StoreError::Timeout(_)
            if matches!(StoreUrl::parse(&config.store.url), Ok(StoreUrl::Sqlite(_))) =>
        {
            anyhow::Error::new(error).context(format!(
                "store {store} (another process may be holding the file's write lock: an sqlite3 session with a transaction open, a VACUUM)"
            ))
        }
        other => anyhow::Error::new(other).context(format!("store {store}")),
    }
}

fn missing(config: &Config, source: &str, key: &str) -> anyhow::Error {
    let routes: Vec<&str> = config.routes.iter().map(|r| r.name.as_str()).collect();
    let hint = if routes.contains(&source) || routes.is_empty() {
        String::new()
    } else {
        format!(
            " (no route is named `{source}`; routes: {})",
            routes.join(", ")
        )
    };
    anyhow!("no key `{key}` for source `{source}`{hint}")
}

/// A record as `--json` prints it: every column under its name, RFC 3339
/// times, the hash in hex.
#[derive(Serialize)]
struct JsonRecord<'a> {
    source: &'a str,
    event_id: &'a str,
    /// `event_id` again, under the name the command's arguments and its
    /// table use.
    key: &'a str,
    status: &'static str,
    attempts: i32,
    payload_sha256: Option<String>,
    response_status: Option<u16>,
    received_at: String,
    claimed_at: String,
    lease_expires_at: Option<String>,
    completed_at: Option<String>,
}

impl<'a> JsonRecord<'a> {
    fn new(record: &'a KeyRecord) -> Self {
        Self {
            source: &record.source,
            event_id: &record.key,
            key: &record.key,
            status: record.status.as_str(),
            attempts: record.attempts,
            payload_sha256: record.payload_sha256.as_deref().map(hex),
            response_status: record.response_status,
            received_at: time(record.received_at),
            claimed_at: time(record.claimed_at),
            lease_expires_at: record.lease_expires_at.map(time),
            completed_at: record.completed_at.map(time),
        }
    }
}

fn render_list(records: &[KeyRecord], json: bool) -> String {
    if json {
        let records: Vec<JsonRecord<'_>> = records.iter().map(JsonRecord::new).collect();
        return to_json(&records);
    }
    if records.is_empty() {
        return String::new();
    }
    let header = [
        "SOURCE",
        "KEY",
        "STATUS",
        "ATTEMPTS",
        "RESPONSE",
        "RECEIVED",
        "COMPLETED",
        // Last, so the columns scripts may already read keep their places.
        // A `processing` key past this time is taken over by its next
        // delivery.
        "LEASE_EXPIRES",
    ];
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|record| {
            vec![
                record.source.clone(),
                visible(&record.key),
                record.status.to_string(),
                record.attempts.to_string(),
                or_dash(record.response_status),
                time(record.received_at),
                or_dash(record.completed_at.map(time)),
                or_dash(record.lease_expires_at.map(time)),
            ]
        })
        .collect();
    table(&header, &rows)
}

fn render_one(record: &KeyRecord, json: bool) -> String {
    if json {
        return to_json(&JsonRecord::new(record));
    }
    let fields = [
        ("source", record.source.clone()),
        ("key", visible(&record.key)),
        ("status", record.status.to_string()),
        ("attempts", record.attempts.to_string()),
        (
            "payload_sha256",
            or_dash(record.payload_sha256.as_deref().map(hex)),
        ),
        ("response_status", or_dash(record.response_status)),
        ("received_at", time(record.received_at)),
        ("claimed_at", time(record.claimed_at)),
        (
            "lease_expires_at",
            or_dash(record.lease_expires_at.map(time)),
        ),
        ("completed_at", or_dash(record.completed_at.map(time))),
    ];
    let rows: Vec<Vec<String>> = fields
        .into_iter()
        .map(|(name, value)| vec![name.to_owned(), value])
        .collect();
    table(&["FIELD", "VALUE"], &rows)
}

/// Columns padded to their widest cell, two spaces apart.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|cell| cell.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|cell| (*cell).to_owned()).collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            let padding = width - cell.chars().count();
            line.push_str(cell);
            line.push_str(&" ".repeat(padding + 2));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A key as a table shows it: control characters written as escapes
/// (`\t`, `\u{1b}`), so a key cannot break the table's lines or send a
/// terminal its control sequences. `--json` gives the key exactly.
fn visible(key: &str) -> String {
    let mut shown = String::with_capacity(key.len());
    for c in key.chars() {
        if c.is_control() {
            shown.extend(c.escape_default());
        } else {
            shown.push(c);
        }
    }
    shown
}

fn to_json(value: &impl Serialize) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("records serialize");
    text.push('\n');
    text
}

/// RFC 3339 in UTC. humantime prints years 1970 to 9999 only (and fails or
/// panics outside them); a time outside, which only a row written by hand
/// can hold, is printed as seconds from the epoch instead.
fn time(at: SystemTime) -> String {
    match at.duration_since(UNIX_EPOCH) {
        Ok(since) if since.as_secs() < crate::RFC3339_END_SECS => {
            humantime::format_rfc3339_millis(at).to_string()
        }
        Ok(since) => format!("{}s after 1970-01-01T00:00:00Z", since.as_secs()),
        Err(before) => format!(
            "{}s before 1970-01-01T00:00:00Z",
            before.duration().as_secs_f64().ceil()
        ),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn or_dash(value: Option<impl ToString>) -> String {
    value.map_or_else(|| "-".to_owned(), |value| value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::KeyStatus;

    fn record(key: &str, status: KeyStatus) -> KeyRecord {
        let at = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        KeyRecord {
            source: "orders".into(),
            key: key.into(),
            status,
            attempts: 2,
            payload_sha256: Some(vec![0x00, 0xab, 0xff]),
            response_status: Some(500),
            received_at: at,
            claimed_at: at,
            lease_expires_at: None,
            completed_at: Some(at + Duration::from_secs(1)),
        }
    }

    #[test]
    fn tables_align_columns_under_their_header() {
        let text = render_list(
            &[
                record("evt_1", KeyStatus::Done),
                record("a-much-longer-key", KeyStatus::Processing),
            ],
            false,
        );
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        let status_column = lines[0].find("STATUS").unwrap();
        assert_eq!(lines[1].find("done"), Some(status_column));
        assert_eq!(lines[2].find("processing"), Some(status_column));
        assert!(
            lines[1].contains("2023-11-14T22:13:20.123Z"),
            "{}",
            lines[1]
        );
        assert!(lines.iter().all(|line| !line.ends_with(' ')));
    }

    #[test]
    fn tables_write_control_characters_in_keys_as_escapes_and_json_gives_them_exactly() {
        let key = "evt\n1\t\u{1b}[2J é";
        let list = render_list(&[record(key, KeyStatus::Done)], false);
        assert_eq!(list.lines().count(), 2, "{list}");
        assert!(list.contains(r"evt\n1\t\u{1b}[2J é"), "{list}");
        assert!(!list.contains('\u{1b}'), "{list}");
        let one = render_one(&record(key, KeyStatus::Done), false);
        assert!(one.contains(r"evt\n1\t\u{1b}[2J é"), "{one}");
        let value: serde_json::Value =
            serde_json::from_str(&render_one(&record(key, KeyStatus::Done), true)).unwrap();
        assert_eq!(value["key"], key);
    }

    #[test]
    fn times_outside_rfc3339s_years_are_printed_not_panicked_on() {
        let at = |secs: u64| UNIX_EPOCH + Duration::from_secs(secs);
        assert_eq!(time(at(1_700_000_000)), "2023-11-14T22:13:20.000Z");
        assert_eq!(time(at(253_402_300_799)), "9999-12-31T23:59:59.000Z");
        assert_eq!(
            time(at(253_402_300_800)),
            "253402300800s after 1970-01-01T00:00:00Z"
        );
        assert_eq!(
            time(UNIX_EPOCH - Duration::from_millis(1_500)),
            "2s before 1970-01-01T00:00:00Z"
        );
    }

    #[test]
    fn json_has_rfc3339_times_and_a_hex_hash() {
        let value: serde_json::Value =
            serde_json::from_str(&render_one(&record("evt_1", KeyStatus::Failed), true)).unwrap();
        assert_eq!(value["payload_sha256"], "00abff");
        assert_eq!(value["received_at"], "2023-11-14T22:13:20.123Z");
        assert_eq!(value["completed_at"], "2023-11-14T22:13:21.123Z");
        assert_eq!(value["lease_expires_at"], serde_json::Value::Null);
        assert_eq!(value["status"], "failed");
        assert_eq!(value["response_status"], 500);
    }

    #[test]
    fn an_empty_list_is_nothing_or_an_empty_array() {
        assert_eq!(render_list(&[], false), "");
        assert_eq!(render_list(&[], true), "[]\n");
    }
}
