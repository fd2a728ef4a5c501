//! The request path's statements, for the configured table; the operator's
//! are in `keys.rs`.

use crate::store::{COLUMNS, sql_identifier};

/// The statements, with the table's name in them.
pub(super) struct Statements {
    pub(super) create_table: String,
    pub(super) prior: String,
    pub(super) claim: String,
    pub(super) settle: String,
    /// Reads nothing from the table: fails if it does not exist or lacks a
    /// column.
    pub(super) probe: String,
}

impl Statements {
    pub(super) fn new(table_name: &str) -> Self {
        let table = sql_identifier(table_name);
        Self {
            create_table: format!(
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
                 ) WITHOUT ROWID"
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

/// With `?1` the table: whether an index leads with `received_at`, whatever
/// its name (a table renamed away keeps its index's name).
pub(super) const INDEXED: &str =
    "SELECT EXISTS (SELECT 1 FROM pragma_index_list(?1) AS l, pragma_index_info(l.name) AS i
                        WHERE l.partial = 0 AND i.seqno = 0 AND i.name = 'received_at')";

/// With `?1` the table: what kind of object it is (`table`, `view`; no row
/// when there is none), and whether a unique index covers exactly `source`
/// and `event_id` (the primary key counts), without which every claim's
/// `ON CONFLICT (source, event_id)` fails.
pub(super) const SHAPE: &str = "SELECT type, EXISTS (
              SELECT 1 FROM pragma_index_list(?1) AS l
               WHERE l.\"unique\" AND NOT l.partial
                 AND (SELECT count(*) FROM pragma_index_info(l.name)) = 2
                 AND (SELECT count(DISTINCT lower(i.name)) FROM pragma_index_info(l.name) AS i
                       WHERE lower(i.name) IN ('source', 'event_id')) = 2)
       FROM sqlite_master WHERE type IN ('table', 'view') AND lower(name) = lower(?1)";

/// What keeps the object found by [`SHAPE`] from being the claims table.
pub(super) fn shape_problem(kind: &str, keyed: bool) -> Option<String> {
    if kind != "table" {
        Some(format!("it is a {kind}"))
    } else if !keyed {
        Some("no primary key or unique index on (source, event_id)".into())
    } else {
        None
    }
}

/// `CREATE INDEX` for `table`'s `received_at`, named `<table>_received_at_idx`
/// unless that name is `taken` (by a table renamed away, say), then with the
/// first free number after it, as PostgreSQL names one.
pub(super) fn create_index<E>(
    table: &str,
    mut taken: impl FnMut(&str) -> Result<bool, E>,
) -> Result<String, E> {
    let base = format!("{table}_received_at_idx");
    for name in std::iter::once(base.clone()).chain((1..).map(|n| format!("{base}{n}"))) {
        if !taken(&name)? {
            return Ok(format!(
                "CREATE INDEX {} ON {} (received_at)",
                sql_identifier(&name),
                sql_identifier(table)
            ));
        }
    }
    unreachable!("the numbers run out before the names do")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_takes_the_first_free_name() {
        assert_eq!(
            create_index("processed_events", |_| Ok::<_, ()>(false)),
            Ok(format!(
                "CREATE INDEX {} ON {} (received_at)",
                sql_identifier("processed_events_received_at_idx"),
                sql_identifier("processed_events")
            ))
        );
        assert_eq!(
            create_index("events", |_| Err("no catalog")),
            Err("no catalog")
        );
        let taken = ["events_received_at_idx", "events_received_at_idx1"];
        assert!(
            create_index("events", |name| Ok::<_, ()>(taken.contains(&name)))
                .unwrap()
                .starts_with(&format!(
                    "CREATE INDEX {} ",
                    sql_identifier("events_received_at_idx2")
                ))
        );
    }
}
