//! The claim, settle and schema statements for one table name, made once at
//! start-up. What each decides, and why, is in the statements' comments.

use crate::store::sql_identifier;

/// The statements the request path and `migrate` run.
pub(super) struct Statements {
    pub(super) migrate: String,
    /// The table and its index as text for `to_regclass`, to find a schema
    /// that is already in place (see `PostgresStore::migrate`).
    pub(super) table_regclass: String,
    pub(super) index_regclass: String,
    pub(super) claim: String,
    pub(super) settle: String,
    /// The same decisions for a batch of one, with the same result columns:
    /// a plain statement PostgreSQL plans once, where the batch statement is
    /// planned for its arrays on every run.
    pub(super) claim_one: String,
    pub(super) settle_one: String,
    /// Takes back the keys a claim found failed or expired.
    pub(super) retake: String,
    /// Reads the keys a claim lost to a row it could not see (see
    /// `BatchRunner::recheck_lost`).
    pub(super) recheck: String,
    /// Reads nothing from the table: fails if it does not exist.
    pub(super) probe: String,
    /// Refreshes the table's statistics (see `Growth`).
    pub(super) analyze: String,
}

impl Statements {
    pub(super) fn new(table_name: &str) -> Self {
        let (schema, unqualified) = match table_name.rsplit_once('.') {
            Some((schema, unqualified)) => (Some(schema), unqualified),
            None => (None, table_name),
        };
        let index = sql_identifier(&format!("{unqualified}_received_at_idx"));
        let table = sql_identifier(table_name);
        // An index lives in its table's schema.
        let index_regclass = match schema {
            Some(schema) => format!("{}.{index}", sql_identifier(schema)),
            None => index.clone(),
        };
        // Whether `row` may be taken back by a delivery with the body hash
        // `sha`, where `reject` says its route rejects another body: the
        // claim marks keys by it, and the take-back locks and updates only
        // rows that still meet it.
        let takeable = |row: &str, reject: &str, sha: &str| {
            format!(
                "({row}.status = 'failed'
                  OR ({row}.status = 'processing' AND {row}.lease_expires_at <= now()))
                 AND (NOT {reject} OR {row}.payload_sha256 IS NULL OR {row}.payload_sha256 = {sha})"
            )
        };
        let prior_takeable = takeable("p", "i.reject_mismatch", "i.payload_sha256");
        let prior_one_takeable = takeable("p", "$5", "$3");
        let locked_takeable = takeable("e", "i.reject_mismatch", "i.payload_sha256");
        let latest_takeable = takeable("e", "r.reject_mismatch", "r.payload_sha256");
        Self {
            table_regclass: table.clone(),
            index_regclass,
            migrate: format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                   source           text        NOT NULL,
                   event_id         text        NOT NULL,
                   status           text        NOT NULL CHECK (status IN ('processing','done','failed')),
                   attempts         integer     NOT NULL DEFAULT 1,
                   payload_sha256   bytea,
                   response_status  smallint,
                   received_at      timestamptz NOT NULL DEFAULT now(),
                   claimed_at       timestamptz NOT NULL DEFAULT now(),
                   lease_expires_at timestamptz,
                   completed_at     timestamptz,
                   PRIMARY KEY (source, event_id)
                 );
                 CREATE INDEX IF NOT EXISTS {index} ON {table} (received_at);"
            ),
            // One statement claims a whole batch of keys (no key twice). A new
            // key is decided by the primary key: the INSERT takes it or
            // conflicts. A key that exists is taken back only if it failed or
            // its lease expired (and, where the route rejects another body,
            // only by a delivery with the first one's): this statement marks
            // such keys `retakable`, and `retake` takes them back. A `done` or
            // live key is neither written nor locked: a duplicate's statement
            // is read-only and its commit waits for no WAL flush.
            //
            // `prior` reads each key's row once, in the statement's snapshot
            // (the rows as they were before it), and everything else works
            // from it: only keys it did not find are inserted. A duplicate
            // costs one index lookup; the other CTE joins on `ord`, a number,
            // so nothing is compared key by key with every other key of the
            // batch. A row the snapshot holds is there for the INSERT to
            // conflict with (or was deleted after the snapshot, and the
            // statement is decided as if it ran before the delete). A row
            // committed by a concurrent claim after the snapshot is invisible
            // to `prior`; the INSERT conflicts with it, and losing to it means
            // in flight (its status and payload hash are read afterwards, by
            // `recheck`).
            //
            // New rows are inserted in key order, byte by byte as settle
            // batches are sorted, so concurrent batches wait on shared keys in
            // the same order instead of deadlocking: each deadlock costs the
            // server's `deadlock_timeout` (1 s) before it refuses one
            // statement. Should one still happen, the refused statement's
            // keys are then claimed one by one.
            claim: format!(
                "WITH input AS (
                   SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int8[], $5::bool[])
                     WITH ORDINALITY AS i(source, event_id, payload_sha256, lease_ms, reject_mismatch, ord)
                 ), prior AS MATERIALIZED (
                   SELECT i.ord, e.status, e.payload_sha256, e.received_at, e.lease_expires_at
                     FROM input i JOIN {table} e USING (source, event_id)
                 ), inserted AS (
                   INSERT INTO {table} AS e (source, event_id, status, attempts, payload_sha256, lease_expires_at)
                   SELECT source, event_id, 'processing', 1, payload_sha256,
                          now() + lease_ms * interval '1 millisecond'
                     FROM input i
                    WHERE NOT EXISTS (SELECT 1 FROM prior p WHERE p.ord = i.ord)
                    ORDER BY source COLLATE \"C\", event_id COLLATE \"C\"
                   ON CONFLICT (source, event_id) DO NOTHING
                   RETURNING e.source, e.event_id, e.attempts, e.payload_sha256
                 )
                 SELECT i.ord, c.attempts IS NOT NULL, coalesce(c.attempts, 0),
                        coalesce(c.payload_sha256, p.payload_sha256), p.status,
                        coalesce(extract(epoch FROM now() - p.received_at)::float8, 0),
                        coalesce({prior_takeable}, false)
                   FROM input i
                   LEFT JOIN inserted c USING (source, event_id)
                   LEFT JOIN prior p USING (ord)"
            ),
            // Takes back the keys a claim found failed or expired, in a
            // statement of their own, run only for a batch that has such keys
            // (deliveries retried after a failure or a crash). Inside the
            // claim statement, the locking and the UPDATE cost every batch
            // about 25 µs at the database even when they took nothing back: a
            // third of the time of a batch of eight duplicates (measured: 10%
            // more duplicates at 16 senders and 8% more at 64 without them).
            // Each row is locked, and its latest version checked again,
            // before it is updated, so two statements cannot both take a key;
            // a key another replica took (or settled, or deleted) since the
            // claim read it is left alone, and its delivery is in flight, as
            // it would have been had the claim taken back its keys itself.
            // Rows are locked in key order, for the reason new rows are
            // inserted in it.
            retake: format!(
                "WITH input AS (
                   SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int8[], $5::bool[])
                     WITH ORDINALITY AS i(source, event_id, payload_sha256, lease_ms, reject_mismatch, ord)
                 ), retakable AS (
                   SELECT i.ord, e.source, e.event_id, e.status, i.lease_ms, i.payload_sha256,
                          i.reject_mismatch
                     FROM input i
                     JOIN {table} e ON e.source = i.source AND e.event_id = i.event_id
                    WHERE {locked_takeable}
                    ORDER BY e.source COLLATE \"C\", e.event_id COLLATE \"C\"
                      FOR UPDATE OF e
                 )
                 UPDATE {table} AS e
                    SET status = 'processing', attempts = e.attempts + 1, claimed_at = now(),
                        lease_expires_at = now() + r.lease_ms * interval '1 millisecond',
                        response_status = NULL, completed_at = NULL
                   FROM retakable r
                  WHERE e.source = r.source AND e.event_id = r.event_id AND {latest_takeable}
                 RETURNING r.ord, e.attempts, e.payload_sha256, r.status"
            ),
            // Fenced per row: only the attempt that owns a key settles it.
            settle: format!(
                "UPDATE {table} AS e
                    SET status = u.status, response_status = u.response_status,
                        completed_at = now(), lease_expires_at = NULL
                   FROM unnest($1::text[], $2::text[], $3::int4[], $4::text[], $5::int2[])
                          WITH ORDINALITY AS u(source, event_id, attempt, status, response_status, ord)
                  WHERE e.source = u.source AND e.event_id = u.event_id
                    AND e.status = 'processing' AND e.attempts = u.attempt
                 RETURNING u.ord"
            ),
            // The batch statement's decisions for one key, shaped the same
            // way: `prior` reads the row once, and the INSERT runs only if it
            // found none.
            claim_one: format!(
                "WITH prior AS MATERIALIZED (
                   SELECT status, payload_sha256, received_at, lease_expires_at FROM {table}
                    WHERE source = $1 AND event_id = $2
                 ), inserted AS (
                   INSERT INTO {table} (source, event_id, status, attempts, payload_sha256, lease_expires_at)
                   SELECT $1, $2, 'processing', 1, $3, now() + $4 * interval '1 millisecond'
                    WHERE NOT EXISTS (SELECT 1 FROM prior)
                   ON CONFLICT (source, event_id) DO NOTHING
                   RETURNING attempts, payload_sha256
                 )
                 SELECT 1::int8, c.attempts IS NOT NULL, coalesce(c.attempts, 0),
                        coalesce(c.payload_sha256, p.payload_sha256), p.status,
                        coalesce(extract(epoch FROM now() - p.received_at)::float8, 0),
                        coalesce({prior_one_takeable}, false)
                   FROM (SELECT 1) one
                   LEFT JOIN inserted c ON true
                   LEFT JOIN prior p ON true"
            ),
            settle_one: format!(
                "UPDATE {table}
                    SET status = $4, response_status = $5, completed_at = now(), lease_expires_at = NULL
                  WHERE source = $1 AND event_id = $2 AND status = 'processing' AND attempts = $3
                 RETURNING 1::int8"
            ),
            recheck: format!(
                "SELECT i.ord, e.status, e.payload_sha256,
                        extract(epoch FROM now() - e.received_at)::float8
                   FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS i(source, event_id, ord)
                   JOIN {table} e USING (source, event_id)"
            ),
            probe: format!("SELECT 1 FROM {table} LIMIT 0"),
            analyze: format!("ANALYZE {table}"),
        }
    }
}
