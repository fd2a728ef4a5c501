//! The claim, settle and schema statements for one table name, made once at
//! start-up. What each decides, and why, is in the statements' comments.

use crate::store::sql_identifier;

/// The statements the request path and `migrate` run.
///
/// The request path's seven (claim, settle, their one-key forms, retake,
/// recheck and the settle of unlocked keys) carry a guard: their last
/// parameter must be this process's `instance`, written into their text, or
/// the statement fails with division by zero before it changes anything.
/// A transaction-pooling PgBouncer that does not track prepared statements
/// can hand a named statement to a server connection where another process
/// prepared a different statement under the same name (every process names
/// its statements `s0`, `s1`, …). Without the guard that statement would run
/// with this one's parameters wherever their types fit: a claim made in
/// another table, or a settle taken for a claim. With it, such a run fails,
/// and the store switches to unnamed statements and runs it again (see
/// `lost_named_statement`).
pub(super) struct Statements {
    pub(super) create_table: String,
    /// Named by PostgreSQL: `<table>_received_at_idx` unless another index
    /// has that name.
    pub(super) create_index: String,
    /// The table as text for `regclass`, to find it and read its shape (see
    /// `PostgresStore::migrate`).
    pub(super) table_regclass: String,
    pub(super) claim: String,
    pub(super) settle: String,
    /// The same decisions for a batch of one, with the same result columns:
    /// a plain statement, with no arrays to unpack and join.
    pub(super) claim_one: String,
    pub(super) settle_one: String,
    /// Settles those of a settle statement's keys that no transaction holds
    /// locked, while that statement waits on one that is.
    pub(super) settle_unlocked: String,
    /// Takes back the keys a claim found failed or expired.
    pub(super) retake: String,
    /// Reads the keys a claim lost to a row it could not see (see
    /// `BatchRunner::recheck_lost`).
    pub(super) recheck: String,
    /// Refreshes the table's statistics (see `Growth`).
    pub(super) analyze: String,
}

impl Statements {
    /// `instance` names this process's statements apart from every other
    /// process's: hex digits, written into their text.
    pub(super) fn new(table_name: &str, instance: &str) -> Self {
        assert!(
            !instance.is_empty() && instance.bytes().all(|b| b.is_ascii_hexdigit()),
            "the instance is written into SQL as hex"
        );
        // A condition with no column in it: PostgreSQL checks it once, before
        // the statement reads or writes a row.
        let guard = |parameter: &str| format!("1 / ({parameter}::text = '{instance}')::int = 1");
        let sixth_guard = guard("$6");
        let seventh_guard = guard("$7");
        let third_guard = guard("$3");
        let table = sql_identifier(table_name);
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
        // Whether a row of the settling attempt takes the settle's
        // `status`: see `settle` below.
        let settleable = |row: &str, status: &str| {
            format!(
                "({row}status = 'processing'
                  OR ({row}status = 'failed' AND {row}response_status IS NULL AND {status} = 'done'))"
            )
        };
        let claim_arrays = unnest_parameters(&["text", "text", "bytea", "int8", "bool"]);
        let settle_arrays =
            unnest_parameters(&["text", "text", "int4", "timestamptz", "text", "int2"]);
        let recheck_arrays = unnest_parameters(&["text", "text"]);
        let prior_takeable = takeable("p", "i.reject_mismatch", "i.payload_sha256");
        let prior_one_takeable = takeable("p", "$5", "$3");
        let locked_takeable = takeable("e", "i.reject_mismatch", "i.payload_sha256");
        let latest_takeable = takeable("e", "r.reject_mismatch", "r.payload_sha256");
        let settleable_one = settleable("", "$5");
        let settleable_each = settleable("e.", "u.status");
        let guarded_input = format!(
            "SELECT * FROM {claim_arrays}
                     WITH ORDINALITY AS i(source, event_id, payload_sha256, lease_ms, reject_mismatch, ord)
                    WHERE {sixth_guard}"
        );
        Self {
            table_regclass: table.clone(),
            create_table: format!(
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
                 )"
            ),
            create_index: format!("CREATE INDEX ON {table} (received_at)"),
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
                   {guarded_input}
                 ), prior AS MATERIALIZED (
                   SELECT i.ord, e.status, e.payload_sha256, e.received_at, e.lease_expires_at
                     FROM input i JOIN {table} e USING (source, event_id)
                 ), inserted AS (
                   INSERT INTO {table} AS e (source, event_id, status, attempts, payload_sha256,
                                             received_at, claimed_at, lease_expires_at)
                   SELECT source, event_id, 'processing', 1, payload_sha256, now(), now(),
                          now() + lease_ms * interval '1 millisecond'
                     FROM input i
                    WHERE NOT EXISTS (SELECT 1 FROM prior p WHERE p.ord = i.ord)
                    ORDER BY source COLLATE \"C\", event_id COLLATE \"C\"
                   ON CONFLICT (source, event_id) DO NOTHING
                   RETURNING e.source, e.event_id, e.attempts, e.payload_sha256, e.claimed_at
                 )
                 SELECT i.ord, c.attempts IS NOT NULL, coalesce(c.attempts, 0)::int4,
                        coalesce(c.payload_sha256, p.payload_sha256), p.status,
                        coalesce(extract(epoch FROM now() - p.received_at)::float8, 0),
                        coalesce({prior_takeable}, false), c.claimed_at
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
            // So is a key whose row another transaction holds: a take-back
            // elsewhere, a settle, a `keys` command, or a transaction someone
            // left open. Its sender retries, and finds the row as that
            // transaction leaves it. Waiting on the lock instead would hold a
            // claim slot for as long as the row is held, and rows held long
            // enough would hold every slot and with them every claim queued
            // behind; it would also queue the take-back beside a settle
            // waiting on the same row, to take the key first when it is let
            // go. Waiting on no row lock, the take-back cannot deadlock either.
            retake: format!(
                "WITH input AS (
                   {guarded_input}
                 ), retakable AS (
                   SELECT i.ord, e.source, e.event_id, e.status, i.lease_ms, i.payload_sha256,
                          i.reject_mismatch
                     FROM input i
                     JOIN {table} e ON e.source = i.source AND e.event_id = i.event_id
                    WHERE {locked_takeable}
                      FOR UPDATE OF e SKIP LOCKED
                 )
                 UPDATE {table} AS e
                    SET status = 'processing', attempts = e.attempts + 1, claimed_at = now(),
                        lease_expires_at = now() + r.lease_ms * interval '1 millisecond',
                        response_status = NULL, completed_at = NULL
                   FROM retakable r
                  WHERE e.source = r.source AND e.event_id = r.event_id AND {latest_takeable}
                 RETURNING r.ord, e.attempts::int4, e.payload_sha256, r.status, e.claimed_at"
            ),
            // Fenced per row: only the attempt that owns a key settles it,
            // named by its number and its claim's time (see `Fence`).
            // A `done` may also land on its own attempt's release (`failed`
            // with no response: shutdown's deadline or `keys release`) as
            // long as no retry has taken the key since: the upstream did act
            // on it, and a `failed` key would be forwarded again.
            settle: format!(
                "UPDATE {table} AS e
                    SET status = u.status, response_status = u.response_status,
                        completed_at = now(), lease_expires_at = NULL
                   FROM {settle_arrays}
                          WITH ORDINALITY AS u(source, event_id, attempt, claimed_at, status,
                                               response_status, ord)
                  WHERE e.source = u.source AND e.event_id = u.event_id
                    AND e.attempts = u.attempt AND e.claimed_at = u.claimed_at
                    AND {settleable_each}
                    AND {seventh_guard}
                 RETURNING u.ord"
            ),
            // The batch statement's decisions for one key, shaped the same
            // way: `prior` reads the row once, and the INSERT runs only if it
            // found none.
            claim_one: format!(
                "WITH prior AS MATERIALIZED (
                   SELECT status, payload_sha256, received_at, lease_expires_at FROM {table}
                    WHERE source = $1 AND event_id = $2 AND {sixth_guard}
                 ), inserted AS (
                   INSERT INTO {table} (source, event_id, status, attempts, payload_sha256,
                                       received_at, claimed_at, lease_expires_at)
                   SELECT $1, $2, 'processing', 1, $3, now(), now(), now() + $4 * interval '1 millisecond'
                    WHERE NOT EXISTS (SELECT 1 FROM prior)
                   ON CONFLICT (source, event_id) DO NOTHING
                   RETURNING attempts, payload_sha256, claimed_at
                 )
                 SELECT 1::int8 AS ord, c.attempts IS NOT NULL AS won,
                        coalesce(c.attempts, 0)::int4 AS attempt,
                        coalesce(c.payload_sha256, p.payload_sha256) AS payload_sha256,
                        p.status AS status,
                        coalesce(extract(epoch FROM now() - p.received_at)::float8, 0) AS age,
                        coalesce({prior_one_takeable}, false) AS takeable,
                        c.claimed_at AS claimed_at
                   FROM (SELECT 1) one
                   LEFT JOIN inserted c ON true
                   LEFT JOIN prior p ON true"
            ),
            // Sent beside a settle statement that has waited long enough to
            // be waiting on a row another transaction holds, with the same
            // parameters (less any key a later round of its batch settles
            // again). The waiting statement has updated the rows before
            // that one in its order, and holds them until it can commit; the
            // rows after it are still as they were, and their leases run on.
            // This one settles those, each fenced as the settle fences it,
            // and skips every row another transaction holds: the waiting
            // statement's, and the one it waits on. It waits on no row lock,
            // so it cannot deadlock with the waiting statement. That one,
            // when it goes on, finds the rows settled here no longer
            // settleable and leaves them be (under `read committed`; under
            // `repeatable read` or `serializable` it is rolled back for the
            // conflict and run again, and then does the same). Run only for
            // a settle that has waited, so the locking, which writes a lock
            // record for every row it then updates, costs the normal course
            // nothing; and for a batch sent while every slot holds a stuck
            // one (`Lane::Unlocked`). Returns each key settled (`true`), and
            // each the statement's snapshot shows settleable but it skipped
            // (`false`: another transaction holds its row); a key in neither
            // is settled no longer by this attempt.
            settle_unlocked: format!(
                "WITH u AS (
                   SELECT * FROM {settle_arrays}
                            WITH ORDINALITY AS u(source, event_id, attempt, claimed_at, status,
                                                 response_status, ord)
                    WHERE {seventh_guard}
                 ), unlocked AS (
                   SELECT u.ord
                     FROM u JOIN {table} e ON e.source = u.source AND e.event_id = u.event_id
                    WHERE e.attempts = u.attempt AND e.claimed_at = u.claimed_at
                      AND {settleable_each}
                      FOR UPDATE OF e SKIP LOCKED
                 ), settled AS (
                   UPDATE {table} AS e
                      SET status = u.status, response_status = u.response_status,
                          completed_at = now(), lease_expires_at = NULL
                     FROM u JOIN unlocked USING (ord)
                    WHERE e.source = u.source AND e.event_id = u.event_id
                      AND e.attempts = u.attempt AND e.claimed_at = u.claimed_at
                      AND {settleable_each}
                   RETURNING u.ord
                 )
                 SELECT ord, true FROM settled
                 UNION ALL
                 SELECT u.ord, false
                   FROM u JOIN {table} e ON e.source = u.source AND e.event_id = u.event_id
                  WHERE e.attempts = u.attempt AND e.claimed_at = u.claimed_at
                    AND {settleable_each}
                    AND u.ord NOT IN (SELECT ord FROM settled)"
            ),
            settle_one: format!(
                "UPDATE {table}
                    SET status = $5, response_status = $6, completed_at = now(), lease_expires_at = NULL
                  WHERE source = $1 AND event_id = $2 AND attempts = $3 AND claimed_at = $4
                    AND {settleable_one}
                    AND {seventh_guard}
                 RETURNING 1::int8"
            ),
            recheck: format!(
                "SELECT i.ord, e.status, e.payload_sha256,
                        extract(epoch FROM now() - e.received_at)::float8
                   FROM {recheck_arrays} WITH ORDINALITY AS i(source, event_id, ord)
                   JOIN {table} e USING (source, event_id)
                  WHERE {third_guard}"
            ),
            analyze: format!("ANALYZE {table}"),
        }
    }
}

/// `unnest` over the statement's parameters `$1`, `$2`, … as arrays of
/// `element_types`, each read through a sub-select.
///
/// PostgreSQL plans a prepared statement for the values it is given for its
/// first five runs, and from then on uses its generic plan only if that
/// plan's estimated cost is below the average of those five. A custom plan
/// sees each array's length; the generic plan guesses ten elements. So a
/// connection whose first batches held a few keys each (a quiet start)
/// found its custom plans cheaper and planned every batch again for as long
/// as it lived: 0.15 ms of planning for a 0.05 ms batch of five duplicates.
/// Through a sub-select the lengths are hidden from both plans, the
/// estimates are the same, and the generic plan, which costs no planning,
/// is chosen from the sixth run on. Its shape is the one a batch of any size
/// wants: an index lookup per key.
fn unnest_parameters(element_types: &[&str]) -> String {
    let arrays: Vec<String> = element_types
        .iter()
        .enumerate()
        .map(|(index, element_type)| format!("(SELECT ${}::{element_type}[])", index + 1))
        .collect();
    format!("unnest({})", arrays.join(", "))
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use tokio_postgres::error::SqlState;
    use tokio_postgres::types::{ToSql, Type};

    use super::*;

    /// What a prepared statement's plans have been on its connection: the
    /// custom ones made for given values and the runs of its generic one.
    async fn plans_made(client: &tokio_postgres::Client, statement: &str) -> (i64, i64) {
        let row = client
            .query_one(
                "SELECT custom_plans, generic_plans FROM pg_prepared_statements WHERE statement = $1",
                &[&statement],
            )
            .await
            .expect("the statement is prepared on this connection");
        (row.get(0), row.get(1))
    }

    const OURS: &str = "0123456789abcdef";

    async fn connect() -> tokio_postgres::Client {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("DATABASE_URL names a reachable server");
        tokio::spawn(connection);
        client
    }

    #[tokio::test]
    async fn batches_of_a_few_keys_run_on_the_generic_plan_once_five_have_run() {
        let client = connect().await;
        // A temporary table: private to this connection, gone with it.
        let sql = Statements::new("pg_temp.claims", OURS);
        client.batch_execute(&sql.create_table).await.unwrap();
        // Rows enough that each key's index lookup has a cost: on an empty
        // table the planning a custom plan costs outweighs everything else.
        client
            .batch_execute(
                "INSERT INTO pg_temp.claims (source, event_id, status)
                   SELECT 'orders', 'old_' || n, 'done' FROM generate_series(1, 10000) n;
                 ANALYZE pg_temp.claims",
            )
            .await
            .unwrap();
        let claim = client.prepare(&sql.claim).await.unwrap();
        let settle = client.prepare(&sql.settle).await.unwrap();
        let recheck = client.prepare(&sql.recheck).await.unwrap();
        const RUNS: i64 = 12;
        for run in 0..RUNS {
            let sources = vec!["orders"; 2];
            let keys = vec![format!("evt_{run}_a"), format!("evt_{run}_b")];
            let hashes: Vec<&[u8]> = vec![b"sha"; 2];
            let claimed = client
                .query(
                    &claim,
                    &[
                        &sources,
                        &keys,
                        &hashes,
                        &vec![30_000_i64; 2],
                        &vec![false; 2],
                        &OURS,
                    ],
                )
                .await
                .unwrap();
            assert!(claimed.iter().all(|row| row.get::<_, bool>(1)), "both won");
            let claimed_at: Vec<SystemTime> = claimed.iter().map(|row| row.get(7)).collect();
            let settled = client
                .query(
                    &settle,
                    &[
                        &sources,
                        &keys,
                        &vec![1_i32; 2],
                        &claimed_at,
                        &vec!["done"; 2],
                        &vec![200_i16; 2],
                        &OURS,
                    ],
                )
                .await
                .unwrap();
            assert_eq!(settled.len(), 2, "both settled");
            let rechecked = client
                .query(&recheck, &[&sources, &keys, &OURS])
                .await
                .unwrap();
            assert_eq!(rechecked.len(), 2, "both read back");
        }
        for (name, statement) in [
            ("claim", &sql.claim),
            ("settle", &sql.settle),
            ("recheck", &sql.recheck),
        ] {
            let (custom, generic) = plans_made(&client, statement).await;
            assert_eq!(
                (custom, generic),
                (5, RUNS - 5),
                "{name}: custom and generic plans"
            );
        }
    }

    async fn run_with(
        client: &tokio_postgres::Client,
        statement: &tokio_postgres::Statement,
        params: &[Box<dyn ToSql + Sync>],
        instance: &str,
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        let mut values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|value| &**value).collect();
        values.push(&instance);
        client.query(statement, &values).await
    }

    /// Another process's statement reached under a shared name (through a
    /// transaction pooler) is given our parameters: its guard refuses them
    /// before it reads or writes a row, under its custom plans and under its
    /// generic one, and the refusal is one the store answers by running the
    /// statement again unnamed.
    #[tokio::test]
    async fn a_statement_refuses_another_instances_parameters_and_changes_nothing() {
        let client = connect().await;
        let theirs = Statements::new("pg_temp.claims", "fedcba9876543210");
        client.batch_execute(&theirs.create_table).await.unwrap();
        client
            .batch_execute(
                "INSERT INTO pg_temp.claims (source, event_id, status, attempts, lease_expires_at)
                   VALUES ('orders', 'done', 'done', 1, NULL),
                          ('orders', 'failed', 'failed', 1, NULL),
                          ('orders', 'open', 'processing', 1, now() + interval '1 hour')",
            )
            .await
            .unwrap();
        let snapshot = || async {
            let row = client
                .query_one(
                    "SELECT string_agg(concat_ws(',', source, event_id, status, attempts, response_status), ';'
                                       ORDER BY source, event_id)
                       FROM pg_temp.claims",
                    &[],
                )
                .await
                .unwrap();
            row.get::<_, String>(0)
        };
        let before = snapshot().await;
        let open_claimed_at: SystemTime = client
            .query_one(
                "SELECT claimed_at FROM pg_temp.claims WHERE event_id = 'open'",
                &[],
            )
            .await
            .unwrap()
            .get(0);

        let one = |key: &'static str| -> Vec<Box<dyn ToSql + Sync>> {
            vec![
                Box::new("orders"),
                Box::new(key),
                Box::new(&b"sha"[..]),
                Box::new(30_000_i64),
                Box::new(false),
            ]
        };
        let batch = |key: &'static str| -> Vec<Box<dyn ToSql + Sync>> {
            vec![
                Box::new(vec!["orders"; 2]),
                Box::new(vec![key, "open"]),
                Box::new(vec![&b"sha"[..]; 2]),
                Box::new(vec![30_000_i64; 2]),
                Box::new(vec![false; 2]),
            ]
        };
        let settle_one = |attempt: i32| -> Vec<Box<dyn ToSql + Sync>> {
            vec![
                Box::new("orders"),
                Box::new("open"),
                Box::new(attempt),
                Box::new(open_claimed_at),
                Box::new("done"),
                Box::new(200_i16),
            ]
        };
        let settle = |attempt: i32| -> Vec<Box<dyn ToSql + Sync>> {
            vec![
                Box::new(vec!["orders"; 2]),
                Box::new(vec!["open", "other"]),
                Box::new(vec![attempt; 2]),
                Box::new(vec![open_claimed_at; 2]),
                Box::new(vec!["done"; 2]),
                Box::new(vec![200_i16; 2]),
            ]
        };
        let recheck = || -> Vec<Box<dyn ToSql + Sync>> {
            vec![Box::new(vec!["orders"]), Box::new(vec!["done"])]
        };
        // Parameters that would change rows if the statement ran, and
        // parameters under which it changes nothing (to run it until its
        // generic plan is in use).
        type Params = Vec<Box<dyn ToSql + Sync>>;
        let cases: [(&str, &str, Params, Params); 7] = [
            ("claim", &theirs.claim, batch("new"), batch("done")),
            ("claim_one", &theirs.claim_one, one("new"), one("done")),
            ("retake", &theirs.retake, batch("failed"), batch("done")),
            ("settle", &theirs.settle, settle(1), settle(9)),
            (
                "settle_unlocked",
                &theirs.settle_unlocked,
                settle(1),
                settle(9),
            ),
            (
                "settle_one",
                &theirs.settle_one,
                settle_one(1),
                settle_one(9),
            ),
            ("recheck", &theirs.recheck, recheck(), recheck()),
        ];
        for (name, statement, effective, harmless) in cases {
            // Typed as the store prepares them: `$4 * interval` alone would
            // make the one-key claim's lease a float.
            let prepared = match name {
                "claim_one" => {
                    let types = [Type::TEXT, Type::TEXT, Type::BYTEA, Type::INT8, Type::BOOL];
                    client.prepare_typed(statement, &types).await.unwrap()
                }
                _ => client.prepare(statement).await.unwrap(),
            };
            let run = |params, instance| run_with(&client, &prepared, params, instance);
            for plan in ["a custom plan", "the generic plan"] {
                let refused = run(&effective, OURS).await.unwrap_err();
                assert_eq!(
                    refused.code(),
                    Some(&SqlState::DIVISION_BY_ZERO),
                    "{name}, {plan}: {refused}"
                );
                assert!(super::super::session::lost_named_statement(&refused));
                assert_eq!(snapshot().await, before, "{name}, {plan}: nothing changed");
                for _ in 0..6 {
                    run(&harmless, "fedcba9876543210").await.unwrap();
                }
            }
            let (_, generic) = plans_made(&client, statement).await;
            assert!(generic > 0, "{name}: the generic plan ran");
        }
        let applied = client
            .query(
                &client.prepare(&theirs.settle_one).await.unwrap(),
                &[
                    &"orders",
                    &"open",
                    &1_i32,
                    &open_claimed_at,
                    &"done",
                    &200_i16,
                    &"fedcba9876543210",
                ],
            )
            .await
            .unwrap();
        assert_eq!(applied.len(), 1, "its own instance's parameters run it");
    }
}
