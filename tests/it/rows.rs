//! Direct edits of a test store's rows, behind the proxy's back: making keys
//! old or leases expired without waiting, inserting many old keys at once,
//! and reading back which keys are left.

use std::time::Duration;

use crate::support::TestStore;

const TABLE: &str = "processed_events";
/// "Parameter 3 milliseconds ago", in each dialect (SQLite stores Unix ms).
const PG_AGO: &str = "now() - $3::bigint * interval '1 millisecond'";
const SQLITE_AGO: &str = "(CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?3)";

fn sqlite_path(store: &TestStore) -> Option<&str> {
    store.url.strip_prefix("sqlite://")
}

fn sqlite(path: &str) -> rusqlite::Connection {
    let connection = rusqlite::Connection::open(path).expect("open the SQLite store");
    connection
        .busy_timeout(Duration::from_secs(5))
        .expect("busy timeout");
    connection
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).expect("a test duration")
}

/// Runs one statement with `(source, event_id, milliseconds)` parameters,
/// written once per dialect; returns the rows changed.
async fn execute(
    store: &TestStore,
    postgres: &str,
    sqlite_sql: &str,
    source: &str,
    key: &str,
    ms: i64,
) -> u64 {
    match sqlite_path(store) {
        Some(path) => sqlite(path)
            .execute(sqlite_sql, rusqlite::params![source, key, ms])
            .expect("sqlite update") as u64,
        None => store
            .postgres()
            .await
            .execute(postgres, &[&source, &key, &ms])
            .await
            .expect("postgres update"),
    }
}

/// Runs SQL text that both dialects read alike.
pub async fn batch(store: &TestStore, sql: &str) {
    match sqlite_path(store) {
        Some(path) => sqlite(path).execute_batch(sql).expect(sql),
        None => store.postgres().await.batch_execute(sql).await.expect(sql),
    }
}

/// Moves a key's first delivery (and its claim) `ago` into the past.
pub async fn age(store: &TestStore, source: &str, key: &str, ago: Duration) {
    let changed = execute(
        store,
        &format!("UPDATE {TABLE} SET received_at = {PG_AGO}, claimed_at = {PG_AGO} WHERE source = $1 AND event_id = $2"),
        &format!("UPDATE {TABLE} SET received_at = {SQLITE_AGO}, claimed_at = {SQLITE_AGO} WHERE source = ?1 AND event_id = ?2"),
        source,
        key,
        millis(ago),
    )
    .await;
    assert_eq!(changed, 1, "no row {source}/{key} to age");
}

/// Makes a `processing` key's lease expired a second ago.
pub async fn expire_lease(store: &TestStore, source: &str, key: &str) {
    let changed = execute(
        store,
        &format!(
            "UPDATE {TABLE} SET lease_expires_at = {PG_AGO} WHERE source = $1 AND event_id = $2"
        ),
        &format!(
            "UPDATE {TABLE} SET lease_expires_at = {SQLITE_AGO} WHERE source = ?1 AND event_id = ?2"
        ),
        source,
        key,
        1000,
    )
    .await;
    assert_eq!(changed, 1, "no row {source}/{key} to expire");
}

/// Inserts `count` done keys `old_1`… of `source`, first delivered `ago`.
pub async fn insert_old(store: &TestStore, source: &str, count: i64, ago: Duration) {
    match sqlite_path(store) {
        Some(path) => {
            sqlite(path)
                .execute(
                    &format!(
                        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?2)
                         INSERT INTO {TABLE} (source, event_id, status, attempts, received_at, claimed_at, completed_at)
                         SELECT ?1, 'old_' || i, 'done', 1, t, t, t
                           FROM n, (SELECT {SQLITE_AGO} AS t)"
                    ),
                    rusqlite::params![source, count, millis(ago)],
                )
                .expect("insert old rows");
        }
        None => {
            store
                .postgres()
                .await
                .execute(
                    &format!(
                        "INSERT INTO {TABLE} (source, event_id, status, attempts, received_at, claimed_at, completed_at)
                         SELECT $1, 'old_' || i, 'done', 1, t, t, t
                           FROM generate_series(1, $2::bigint) i,
                                (SELECT {PG_AGO} AS t) at"
                    ),
                    &[&source, &count, &millis(ago)],
                )
                .await
                .expect("insert old rows");
        }
    }
}

/// Every stored `source/key`, sorted.
pub async fn keys(store: &TestStore) -> Vec<String> {
    let sql = format!("SELECT source || '/' || event_id FROM {TABLE} ORDER BY 1");
    let mut keys: Vec<String> = match sqlite_path(store) {
        Some(path) => {
            let connection = sqlite(path);
            let mut statement = connection.prepare(&sql).expect("prepare");
            statement
                .query_map([], |row| row.get(0))
                .expect("query")
                .map(|key| key.expect("row"))
                .collect()
        }
        None => store
            .postgres()
            .await
            .query(&sql, &[])
            .await
            .expect("query")
            .iter()
            .map(|row| row.get(0))
            .collect(),
    };
    // The two databases collate differently; compare in one order.
    keys.sort();
    keys
}

/// Whether the claims table exists.
pub async fn table_exists(store: &TestStore) -> bool {
    match sqlite_path(store) {
        Some(path) => {
            std::path::Path::new(path).exists()
                && sqlite(path)
                    .query_row(
                        "SELECT count(*) FROM sqlite_master WHERE name = ?1",
                        [TABLE],
                        |row| row.get::<_, i64>(0),
                    )
                    .expect("query")
                    == 1
        }
        None => store
            .postgres()
            .await
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE tablename = $1)",
                &[&TABLE],
            )
            .await
            .expect("query")
            .get(0),
    }
}

/// The names of the claims table's indexes that lead with `received_at`.
pub async fn received_at_indexes(store: &TestStore) -> Vec<String> {
    match sqlite_path(store) {
        Some(path) => {
            let connection = sqlite(path);
            let mut statement = connection
                .prepare(
                    "SELECT l.name FROM pragma_index_list(?1) AS l, pragma_index_info(l.name) AS i
                      WHERE i.seqno = 0 AND i.name = 'received_at'",
                )
                .expect("prepare");
            statement
                .query_map([TABLE], |row| row.get(0))
                .expect("query")
                .map(|name| name.expect("row"))
                .collect()
        }
        None => store
            .postgres()
            .await
            .query(
                "SELECT c.relname::text FROM pg_index i
                   JOIN pg_class c ON c.oid = i.indexrelid
                   JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                  WHERE i.indrelid = $1::text::regclass AND a.attname = 'received_at'",
                &[&TABLE],
            )
            .await
            .expect("query")
            .iter()
            .map(|row| row.get(0))
            .collect(),
    }
}

/// Takes the table's prune lock in a transaction left open on another
/// connection, as a replica in the middle of a prune batch would; `COMMIT`
/// on the returned client releases it (PostgreSQL only).
pub async fn hold_prune_lock(store: &TestStore) -> tokio_postgres::Client {
    let client = store.postgres().await;
    client
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock(hashtextextended('dedupe-proxy prune {TABLE}', 0));"
        ))
        .await
        .expect("take the prune lock");
    client
}
