//! SQLite statements for the operator's commands and the pruner, with the
//! same semantics as PostgreSQL's. Each runs as one job on the store's
//! thread, so a prune batch holds the write lock only for its own rows and
//! claims run between batches. Only one process writes an SQLite store, so
//! pruning needs no lock of its own.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::types::Type;
use rusqlite::{Connection, OptionalExtension, Row, params};

use crate::store::{
    Forget, KeyFilter, KeyRecord, KeyStatus, PruneBatch, PruneGroup, Release, Sources,
    sql_identifier,
};

const COLUMNS: &str = "source, event_id, status, attempts, payload_sha256, response_status, \
                       received_at, claimed_at, lease_expires_at, completed_at";

pub(super) struct Statements {
    list: String,
    show: String,
    forget: String,
    live_lease: String,
    status: String,
    release: String,
    prune_only: String,
    prune_except: String,
}

impl Statements {
    pub(super) fn new(table_name: &str) -> Self {
        let table = &sql_identifier(table_name);
        Self {
            list: format!(
                "SELECT {COLUMNS} FROM {table}
                  WHERE (?1 IS NULL OR source = ?1) AND (?2 IS NULL OR status = ?2)
                  ORDER BY received_at DESC, source, event_id
                  LIMIT ?3"
            ),
            show: format!("SELECT {COLUMNS} FROM {table} WHERE source = ?1 AND event_id = ?2"),
            forget: format!("DELETE FROM {table} WHERE source = ?1 AND event_id = ?2"),
            live_lease: format!(
                "SELECT CASE WHEN status = 'processing' AND lease_expires_at > ?3
                             THEN lease_expires_at END
                   FROM {table} WHERE source = ?1 AND event_id = ?2"
            ),
            status: format!("SELECT status FROM {table} WHERE source = ?1 AND event_id = ?2"),
            release: format!(
                "UPDATE {table}
                    SET status = 'failed', response_status = NULL, completed_at = ?3,
                        lease_expires_at = NULL
                  WHERE source = ?1 AND event_id = ?2 AND status = 'processing'
                  RETURNING attempts"
            ),
            prune_only: prune_statement(table, "IN"),
            prune_except: prune_statement(table, "NOT IN"),
        }
    }

    pub(super) fn list(
        &self,
        connection: &Connection,
        filter: &KeyFilter,
    ) -> rusqlite::Result<Vec<KeyRecord>> {
        let status = filter.status.map(KeyStatus::as_str);
        let mut statement = connection.prepare_cached(&self.list)?;
        let records = statement.query_map(params![filter.source, status, filter.limit], record)?;
        records.collect()
    }

    pub(super) fn show(
        &self,
        connection: &Connection,
        source: &str,
        key: &str,
    ) -> rusqlite::Result<Option<KeyRecord>> {
        connection
            .prepare_cached(&self.show)?
            .query_row(params![source, key], record)
            .optional()
    }

    /// In the caller's transaction, which holds the write lock: the look and
    /// the delete are one decision.
    pub(super) fn forget(
        &self,
        connection: &Connection,
        source: &str,
        key: &str,
        force: bool,
        now: i64,
    ) -> rusqlite::Result<Forget> {
        let lease: Option<Option<i64>> = connection
            .prepare_cached(&self.live_lease)?
            .query_row(params![source, key, now], |row| row.get(0))
            .optional()?;
        Ok(match lease {
            None => Forget::Missing,
            Some(Some(lease_expires_at)) if !force => Forget::InFlight {
                lease_expires_at: from_ms(lease_expires_at),
            },
            Some(_) => {
                connection
                    .prepare_cached(&self.forget)?
                    .execute(params![source, key])?;
                Forget::Forgotten
            }
        })
    }

    /// In the caller's transaction, which holds the write lock: the status
    /// read and the update are one decision.
    pub(super) fn release(
        &self,
        connection: &Connection,
        source: &str,
        key: &str,
        now: i64,
    ) -> rusqlite::Result<Release> {
        let status: Option<String> = connection
            .prepare_cached(&self.status)?
            .query_row(params![source, key], |row| row.get(0))
            .optional()?;
        Ok(match status.as_deref() {
            None => Release::Missing,
            Some("processing") => Release::Released {
                attempt: connection
                    .prepare_cached(&self.release)?
                    .query_row(params![source, key, now], |row| row.get(0))?,
            },
            Some(other) => Release::NotProcessing(status_from(other, 0)?),
        })
    }

    pub(super) fn prune(
        &self,
        connection: &Connection,
        group: &PruneGroup,
        limit: u32,
        now: i64,
    ) -> rusqlite::Result<PruneBatch> {
        let (sql, sources) = match &group.sources {
            Sources::Only(sources) => (&self.prune_only, sources),
            Sources::AllExcept(sources) => (&self.prune_except, sources),
        };
        let older_than = i64::try_from(group.older_than.as_millis()).unwrap_or(i64::MAX);
        let sources = serde_json::to_string(sources).expect("strings serialize");
        let deleted = connection.prepare_cached(sql)?.execute(params![
            now.saturating_sub(older_than),
            sources,
            now,
            limit
        ])?;
        Ok(PruneBatch::Deleted(deleted as u64))
    }
}

/// One batch: the table is WITHOUT ROWID, so victims are named by primary
/// key, found through the `received_at` index, oldest first.
fn prune_statement(table: &str, membership: &str) -> String {
    format!(
        "DELETE FROM {table} WHERE (source, event_id) IN (
           SELECT source, event_id FROM {table}
            WHERE received_at < ?1
              AND source {membership} (SELECT value FROM json_each(?2))
              AND (status <> 'processing' OR lease_expires_at <= ?3)
            ORDER BY received_at
            LIMIT ?4
         )"
    )
}

fn record(row: &Row<'_>) -> rusqlite::Result<KeyRecord> {
    let time = |index: usize| row.get::<_, i64>(index).map(from_ms);
    let optional_time = |index: usize| row.get::<_, Option<i64>>(index).map(|t| t.map(from_ms));
    Ok(KeyRecord {
        source: row.get(0)?,
        key: row.get(1)?,
        status: status_from(&row.get::<_, String>(2)?, 2)?,
        attempts: row.get(3)?,
        payload_sha256: row.get(4)?,
        response_status: row.get(5)?,
        received_at: time(6)?,
        claimed_at: time(7)?,
        lease_expires_at: optional_time(8)?,
        completed_at: optional_time(9)?,
    })
}

fn status_from(text: &str, column: usize) -> rusqlite::Result<KeyStatus> {
    KeyStatus::parse(text)
        .ok_or_else(|| rusqlite::Error::InvalidColumnType(column, "status".into(), Type::Text))
}

pub(super) fn from_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
