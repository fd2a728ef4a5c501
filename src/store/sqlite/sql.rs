//! The request path's statements, for the configured table; the operator's
//! are in `keys.rs`.

use crate::store::{COLUMNS, sql_identifier};

/// The statements, with the table's name in them.
pub(super) struct Statements {
    pub(super) migrate: String,
    pub(super) prior: String,
    pub(super) claim: String,
    pub(super) settle: String,
    /// Reads nothing from the table: fails if it does not exist or lacks a
    /// column.
    pub(super) probe: String,
}

impl Statements {
    pub(super) fn new(table_name: &str) -> Self {
        let index = sql_identifier(&format!("{table_name}_received_at_idx"));
        let table = sql_identifier(table_name);
        Self {
            migrate: format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                   source           TEXT    NOT NULL,
                   event_id         TEXT    NOT NULL,
                   status           TEXT    NOT NULL CHECK (status IN ('processing','done','failed')),
                   attempts         INTEGER NOT NULL DEFAULT 1,
                   payload_sha256   BLOB,
                   response_status  INTEGER,
                   received_at      INTEGER NOT NULL,
                   claimed_at       INTEGER NOT NULL,
                   lease_expires_at INTEGER,
                   completed_at     INTEGER,
                   PRIMARY KEY (source, event_id)
                 ) WITHOUT ROWID;
                 CREATE INDEX IF NOT EXISTS {index} ON {table} (received_at);"
            ),
            prior: format!(
                "SELECT status, payload_sha256, received_at FROM {table}
                  WHERE source = ?1 AND event_id = ?2"
            ),
            claim: format!(
                "INSERT INTO {table} (source, event_id, status, attempts, payload_sha256,
                                      received_at, claimed_at, lease_expires_at)
                 VALUES (?1, ?2, 'processing', 1, ?3, ?4, ?4, ?5)
                 ON CONFLICT (source, event_id) DO UPDATE
                    SET status = 'processing', attempts = attempts + 1,
                        claimed_at = excluded.claimed_at,
                        lease_expires_at = excluded.lease_expires_at,
                        response_status = NULL, completed_at = NULL
                  WHERE (status = 'failed'
                         OR (status = 'processing' AND lease_expires_at <= excluded.claimed_at))
                    AND (NOT ?6 OR payload_sha256 IS NULL
                         OR payload_sha256 = excluded.payload_sha256)
                 RETURNING attempts"
            ),
            // Fenced as PostgreSQL's is (see `Fence`): a `done` may also
            // land on its own attempt's release.
            settle: format!(
                "UPDATE {table}
                    SET status = ?5, response_status = ?6, completed_at = ?7, lease_expires_at = NULL
                  WHERE source = ?1 AND event_id = ?2 AND attempts = ?3 AND claimed_at = ?4
                    AND (status = 'processing'
                         OR (status = 'failed' AND response_status IS NULL AND ?5 = 'done'))"
            ),
            probe: format!("SELECT {COLUMNS} FROM {table} LIMIT 0"),
        }
    }
}
