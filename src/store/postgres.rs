//! The PostgreSQL backend: a deadpool pool of tokio-postgres connections, the
//! schema of SPEC section 2, and the claim as one data-modifying statement.
//! Holds no session state between transactions, so it works through a
//! transaction-pooling PgBouncer: named prepared statements only for the
//! claim and the settle, and only while they work (see [`Params`]). The
//! operator's statements are in `postgres/keys.rs`.

mod keys;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::coalesce::Coalescer;
use super::{
    Backend, Claim, ClaimRequest, KeyFilter, KeyRecord, PendingClaim, PruneBatch, PruneGroup,
    Release, Settlement, StoreError, WonFrom, sql_identifier,
};
use crate::config::StoreConfig;
use crate::error_chain;

/// Claims recorded in PostgreSQL.
pub struct PostgresStore {
    session: Arc<Session>,
    sql: Arc<Statements>,
    keys: keys::Statements,
    table: String,
    batches: OnceLock<Batches>,
}

/// The pool and how statements are sent through it, shared with the batches.
struct Session {
    pool: Pool,
    statement_cache: bool,
    /// Set when named statements turned out not to survive the way to the
    /// server; every statement is unnamed from then on.
    named_statements_lost: AtomicBool,
    growth: Growth,
}

/// Rows this process has inserted, and when it next analyzes the table.
///
/// A prepared statement keeps the plan PostgreSQL made for it until the
/// table's statistics change. Planned against a new, empty table, the claim
/// and settle statements scan it sequentially, and go on doing so as it
/// grows unless the table is analyzed: autovacuum does that, but where it is
/// off nothing would (first deliveries fell to a quarter of their rate at
/// 100,000 rows). So the proxy analyzes the table itself after inserting
/// `ANALYZE_FIRST_AT` rows, and again each time that count has grown
/// `ANALYZE_GROWTH` times: a handful of times in the life of a table.
struct Growth {
    inserted: AtomicU64,
    next_analyze_at: AtomicU64,
}

const ANALYZE_FIRST_AT: u64 = 1_000;
const ANALYZE_GROWTH: u64 = 8;

impl Growth {
    fn new() -> Self {
        Self {
            inserted: AtomicU64::new(0),
            next_analyze_at: AtomicU64::new(ANALYZE_FIRST_AT),
        }
    }

    /// Counts `rows` more inserted rows; true when the table is due an
    /// ANALYZE (once per threshold, whichever batch crosses it).
    fn add(&self, rows: u64) -> bool {
        let inserted = self.inserted.fetch_add(rows, Ordering::Relaxed) + rows;
        let due = self.next_analyze_at.load(Ordering::Relaxed);
        inserted >= due
            && self
                .next_analyze_at
                .compare_exchange(
                    due,
                    due.saturating_mul(ANALYZE_GROWTH),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }
}

/// The coalescing queues, started on first use (they need a runtime).
struct Batches {
    claims: Coalescer<ClaimRequest, Claim>,
    settles: Coalescer<SettleRequest, bool>,
}

/// One queued settle.
struct SettleRequest {
    source: String,
    key: String,
    attempt: i32,
    settlement: Settlement,
}

/// Most keys one statement claims or settles.
const MAX_BATCH: usize = 256;

/// Claim statements (and, separately, settle statements) one replica runs at
/// once. Few and large beats many and small: while two batches are at the
/// database, everything arriving queues for the next one, so under load the
/// database runs one statement and one commit for dozens of keys instead of
/// one each, and spends its CPU on rows rather than on round trips. Under
/// light load a request still finds a free slot and goes out alone. Two, not
/// one, so that a batch waiting on a row another replica is inserting does
/// not stall every claim behind it.
const BATCHES_IN_FLIGHT: usize = 2;

struct Statements {
    migrate: String,
    claim: String,
    settle: String,
    /// The same decisions for a batch of one, with the same result columns:
    /// a plain statement PostgreSQL plans once, where the batch statement is
    /// planned for its arrays on every run.
    claim_one: String,
    settle_one: String,
    /// Reads the keys a claim lost to a row it could not see (see
    /// `BatchRunner::recheck_lost`).
    recheck: String,
    /// Reads nothing from the table: fails if it does not exist.
    probe: String,
    /// Refreshes the table's statistics (see `Growth`).
    analyze: String,
}

impl Statements {
    fn new(table_name: &str) -> Self {
        let unqualified = table_name.rsplit('.').next().unwrap_or(table_name);
        let index = sql_identifier(&format!("{unqualified}_received_at_idx"));
        let table = sql_identifier(table_name);
        Self {
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
            // its lease expired, by an UPDATE that re-checks that condition
            // on the row's latest version after locking it, so two
            // statements cannot both take it. A `done` or live key is
            // neither written nor locked: a duplicate's statement is
            // read-only and its commit waits for no WAL flush.
            //
            // `prior` reads the statement's snapshot, i.e. the rows as they
            // were before it: it only classifies results. A row committed by
            // a concurrent claim after the snapshot is invisible to `prior`
            // and to the UPDATE; losing to it means in flight (its status
            // and payload hash are read afterwards, by `recheck`). New rows are
            // inserted, and rows to take back locked (`retakable`, sorted
            // before it locks), in key order, byte by byte as settle batches
            // are sorted, so concurrent batches wait on shared keys in the
            // same order instead of deadlocking: each deadlock costs the
            // server's `deadlock_timeout` (1 s) before it refuses one
            // statement. Should one still happen, the refused statement's
            // keys are then claimed one by one.
            claim: format!(
                "WITH input AS (
                   SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int8[])
                     WITH ORDINALITY AS i(source, event_id, payload_sha256, lease_ms, ord)
                 ), prior AS (
                   SELECT e.source, e.event_id, e.status, e.payload_sha256, e.received_at
                     FROM {table} e JOIN input i USING (source, event_id)
                 ), inserted AS (
                   INSERT INTO {table} AS e (source, event_id, status, attempts, payload_sha256, lease_expires_at)
                   SELECT source, event_id, 'processing', 1, payload_sha256,
                          now() + lease_ms * interval '1 millisecond'
                     FROM input ORDER BY source COLLATE \"C\", event_id COLLATE \"C\"
                   ON CONFLICT (source, event_id) DO NOTHING
                   RETURNING e.source, e.event_id, e.attempts, e.payload_sha256
                 ), retakable AS (
                   SELECT e.source, e.event_id, i.lease_ms
                     FROM {table} e JOIN input i USING (source, event_id)
                    WHERE e.status = 'failed'
                       OR (e.status = 'processing' AND e.lease_expires_at <= now())
                    ORDER BY e.source COLLATE \"C\", e.event_id COLLATE \"C\"
                      FOR UPDATE OF e
                 ), retaken AS (
                   UPDATE {table} AS e
                      SET status = 'processing', attempts = e.attempts + 1, claimed_at = now(),
                          lease_expires_at = now() + r.lease_ms * interval '1 millisecond',
                          response_status = NULL, completed_at = NULL
                     FROM retakable r
                    WHERE e.source = r.source AND e.event_id = r.event_id
                      AND (e.status = 'failed'
                           OR (e.status = 'processing' AND e.lease_expires_at <= now()))
                      AND NOT EXISTS (SELECT 1 FROM inserted n
                                       WHERE n.source = r.source AND n.event_id = r.event_id)
                   RETURNING e.source, e.event_id, e.attempts, e.payload_sha256
                 ), claimed AS (
                   SELECT * FROM inserted UNION ALL SELECT * FROM retaken
                 )
                 SELECT i.ord, c.attempts IS NOT NULL, coalesce(c.attempts, 0),
                        coalesce(c.payload_sha256, p.payload_sha256), p.status,
                        coalesce(extract(epoch FROM now() - p.received_at)::float8, 0)
                   FROM input i
                   LEFT JOIN claimed c USING (source, event_id)
                   LEFT JOIN prior p USING (source, event_id)"
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
            claim_one: format!(
                "WITH prior AS (
                   SELECT status, payload_sha256, received_at FROM {table}
                    WHERE source = $1 AND event_id = $2
                 ), inserted AS (
                   INSERT INTO {table} (source, event_id, status, attempts, payload_sha256, lease_expires_at)
                   VALUES ($1, $2, 'processing', 1, $3, now() + $4 * interval '1 millisecond')
                   ON CONFLICT (source, event_id) DO NOTHING
                   RETURNING attempts, payload_sha256
                 ), retaken AS (
                   UPDATE {table} AS e
                      SET status = 'processing', attempts = e.attempts + 1, claimed_at = now(),
                          lease_expires_at = now() + $4 * interval '1 millisecond',
                          response_status = NULL, completed_at = NULL
                    WHERE e.source = $1 AND e.event_id = $2
                      AND (e.status = 'failed'
                           OR (e.status = 'processing' AND e.lease_expires_at <= now()))
                      AND NOT EXISTS (SELECT 1 FROM inserted)
                   RETURNING e.attempts, e.payload_sha256
                 ), claimed AS (
                   SELECT * FROM inserted UNION ALL SELECT * FROM retaken
                 )
                 SELECT 1::int8, c.attempts IS NOT NULL, coalesce(c.attempts, 0),
                        coalesce(c.payload_sha256, p.payload_sha256), p.status,
                        coalesce(extract(epoch FROM now() - p.received_at)::float8, 0)
                   FROM (SELECT 1) one
                   LEFT JOIN claimed c ON true
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

impl PostgresStore {
    /// A pool for `url`; connections are made on first use.
    pub fn new(url: &str, config: &StoreConfig) -> Result<Self, StoreError> {
        let (mut pg_config, tls) =
            crate::tls::postgres_config(url).map_err(StoreError::Postgres)?;
        if pg_config.get_connect_timeout().is_none() {
            pg_config.connect_timeout(config.timeout);
        }
        if pg_config.get_application_name().is_none() {
            pg_config.application_name("dedupe-proxy");
        }
        let manager = Manager::from_config(
            pg_config,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(config.timeout))
            .create_timeout(Some(config.timeout))
            .recycle_timeout(Some(config.timeout))
            .build()
            .map_err(|error| StoreError::Postgres(error_chain(&error)))?;
        Ok(Self {
            session: Arc::new(Session {
                pool,
                statement_cache: config.statement_cache,
                named_statements_lost: AtomicBool::new(false),
                growth: Growth::new(),
            }),
            sql: Arc::new(Statements::new(&config.table)),
            keys: keys::Statements::new(&config.table),
            table: config.table.clone(),
            batches: OnceLock::new(),
        })
    }

    fn batches(&self) -> &Batches {
        self.batches.get_or_init(|| {
            let in_flight = BATCHES_IN_FLIGHT.min(self.session.pool.status().max_size);
            let runner = BatchRunner {
                session: Arc::clone(&self.session),
                sql: Arc::clone(&self.sql),
            };
            let settle_runner = runner.clone();
            Batches {
                claims: Coalescer::start(in_flight, MAX_BATCH, move |batch| {
                    runner.clone().claim_batch(batch)
                }),
                settles: Coalescer::start(in_flight, MAX_BATCH, move |batch| {
                    settle_runner.clone().settle_batch(batch)
                }),
            }
        })
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.session.client().await
    }

    /// Runs an operator's one-off statement, always unnamed: caching gains
    /// nothing there, and an unnamed statement cannot meet another client's
    /// statement of the same name on a pooled server connection.
    async fn query_unnamed(&self, sql: &str, params: &Params<'_>) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await?;
        client
            .query_typed(sql, params)
            .await
            .map_err(postgres_error)
    }
}

impl Session {
    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool
            .get()
            .await
            .map_err(|error| StoreError::Postgres(error_chain(&error)))
    }

    /// Runs a claim or settle statement: a cached named statement, or with
    /// `statement_cache: false` (or once named statements were lost) an
    /// unnamed one.
    async fn query(&self, sql: &str, params: &Params<'_>) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await?;
        if self.named_statements() {
            let named = async {
                let statement = client.prepare_typed_cached(sql, &types(params)).await?;
                client.query(&statement, &values(params)).await
            };
            match named.await {
                Err(error) if lost_named_statement(&error) => self.lose_named_statements(&error),
                rows => return rows.map_err(postgres_error),
            }
        }
        client
            .query_typed(sql, params)
            .await
            .map_err(postgres_error)
    }

    fn named_statements(&self) -> bool {
        self.statement_cache && !self.named_statements_lost.load(Ordering::Relaxed)
    }

    fn lose_named_statements(&self, error: &tokio_postgres::Error) {
        if !self.named_statements_lost.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                %error,
                "named prepared statements do not survive the way to the server (a \
                 transaction-pooling PgBouncer older than 1.21?); using unnamed statements \
                 from now on: set store.statement_cache: false"
            );
        }
    }
}

/// Whether the error says a named statement was not on the server connection
/// the statement reached, or another one had its name: what a transaction
/// pooler that does not track prepared statements does to them. The statement
/// did not run, so running it again unnamed is safe.
fn lost_named_statement(error: &tokio_postgres::Error) -> bool {
    [
        SqlState::INVALID_SQL_STATEMENT_NAME,
        SqlState::DUPLICATE_PSTATEMENT,
        SqlState::PROTOCOL_VIOLATION,
    ]
    .iter()
    .any(|code| error.code() == Some(code))
}

/// A statement's parameters with their types.
///
/// Given the types, an unnamed statement is parsed, bound and run in one
/// round trip, so it never leaves the server connection it started on. That
/// is the only form a transaction-pooling PgBouncer without prepared
/// statement support (before 1.21) can carry: it may run each round trip on
/// another server connection, where a named statement prepared in an earlier
/// one does not exist, or another client's statement has the same name.
/// Statements inside transactions and the operator's statements are always
/// unnamed; `statement_cache` chooses for the claim and the settle, and a
/// named statement that turns out lost switches the store to unnamed ones.
pub(super) type Params<'a> = [(&'a (dyn ToSql + Sync), Type)];

fn types(params: &Params<'_>) -> Vec<Type> {
    params.iter().map(|(_, ty)| ty.clone()).collect()
}

fn values<'a>(params: &'a Params<'a>) -> Vec<&'a (dyn ToSql + Sync)> {
    params.iter().map(|(value, _)| *value).collect()
}

impl Backend for PostgresStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let transaction = client.transaction().await.map_err(postgres_error)?;
        // Transaction-scoped, so the lock cannot leak through a pooler.
        transaction
            .execute_typed(
                "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                &[(&format!("dedupe-proxy migrate {}", self.table), Type::TEXT)],
            )
            .await
            .map_err(postgres_error)?;
        transaction
            .batch_execute(&self.sql.migrate)
            .await
            .map_err(postgres_error)?;
        transaction.commit().await.map_err(postgres_error)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .simple_query(&self.sql.probe)
            .await
            .map(drop)
            .map_err(postgres_error)
    }

    fn queue_claim(&self, request: &ClaimRequest) -> Result<PendingClaim, StoreError> {
        self.batches().claims.enqueue(request.clone())
    }

    async fn settle(
        &self,
        source: &str,
        key: &str,
        attempt: i32,
        settlement: Settlement,
    ) -> Result<bool, StoreError> {
        let request = SettleRequest {
            source: source.to_owned(),
            key: key.to_owned(),
            attempt,
            settlement,
        };
        self.batches().settles.call(request).await
    }

    async fn list(&self, filter: &KeyFilter) -> Result<Vec<KeyRecord>, StoreError> {
        self.list_keys(filter).await
    }

    async fn show(&self, source: &str, key: &str) -> Result<Option<KeyRecord>, StoreError> {
        self.show_key(source, key).await
    }

    async fn forget(&self, source: &str, key: &str) -> Result<bool, StoreError> {
        self.forget_key(source, key).await
    }

    async fn release(&self, source: &str, key: &str) -> Result<Release, StoreError> {
        self.release_key(source, key).await
    }

    async fn prune(&self, group: &PruneGroup, limit: u32) -> Result<PruneBatch, StoreError> {
        self.prune_batch(group, limit).await
    }
}

/// What a batch needs of the store, owned so batches can run on their own.
#[derive(Clone)]
struct BatchRunner {
    session: Arc<Session>,
    sql: Arc<Statements>,
}

impl BatchRunner {
    /// Claims a batch. A key queued twice is claimed again in a later round,
    /// after the first claim's outcome is committed, since one statement
    /// cannot decide the same key twice.
    async fn claim_batch(self, requests: Vec<ClaimRequest>) -> Vec<Result<Claim, StoreError>> {
        let mut claims: Vec<Option<Result<Claim, StoreError>>> = vec![None; requests.len()];
        let mut pending: Vec<usize> = (0..requests.len()).collect();
        while !pending.is_empty() {
            let mut keys = HashSet::new();
            let (round, later): (Vec<usize>, Vec<usize>) = pending
                .into_iter()
                .partition(|&i| keys.insert((&*requests[i].source, requests[i].key.as_str())));
            let round_requests: Vec<&ClaimRequest> = round.iter().map(|&i| &requests[i]).collect();
            for (slot, claim) in round.iter().zip(self.isolated(&round_requests).await) {
                claims[*slot] = Some(claim);
            }
            pending = later;
        }
        let claims: Vec<Result<Claim, StoreError>> = claims
            .into_iter()
            .map(|claim| claim.expect("every key claimed"))
            .collect();
        let inserted = claims
            .iter()
            .filter(|claim| {
                matches!(
                    claim,
                    Ok(Claim::Won {
                        from: WonFrom::New,
                        ..
                    })
                )
            })
            .count();
        if inserted > 0 && self.session.growth.add(inserted as u64) {
            tokio::spawn(self.analyze());
        }
        claims
    }

    /// Refreshes the table's statistics, so that every connection's cached
    /// plans are made again for the table as it now is (see `Growth`). A
    /// failure (the proxy's user may not own the table) costs only that.
    async fn analyze(self) {
        let analyzed = async {
            let client = self.session.client().await?;
            client
                .batch_execute(&self.sql.analyze)
                .await
                .map_err(postgres_error)
        };
        match analyzed.await {
            Ok(()) => tracing::debug!("analyzed the claims table as it grew"),
            Err(error) => {
                tracing::warn!(%error, "cannot analyze the claims table; with autovacuum off, its cached query plans may stay those made when it was empty");
            }
        }
    }

    /// One statement for the round; if the database refuses it (rather than
    /// being unreachable), each key is retried alone, so that a row it cannot
    /// take fails only its own request.
    async fn isolated<R: Round>(&self, requests: &[&R]) -> Vec<Result<R::Outcome, StoreError>> {
        match R::run(self, requests).await {
            Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
            Err(StoreError::Refused(_)) if requests.len() > 1 => {
                let mut outcomes = Vec::with_capacity(requests.len());
                for request in requests {
                    let outcome = R::run(self, &[*request]).await;
                    outcomes.push(outcome.map(|mut one| one.remove(0)));
                }
                outcomes
            }
            Err(error) => vec![Err(error); requests.len()],
        }
    }

    async fn claim_round(&self, requests: &[&ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        let rows = match requests {
            [one] => {
                let params: &Params<'_> = &[
                    (&&*one.source, Type::TEXT),
                    (&one.key, Type::TEXT),
                    (&&one.payload_sha256[..], Type::BYTEA),
                    (&lease_ms(one), Type::INT8),
                ];
                self.session.query(&self.sql.claim_one, params).await?
            }
            _ => {
                let sources: Vec<&str> = requests.iter().map(|r| &*r.source).collect();
                let keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
                let hashes: Vec<&[u8]> = requests.iter().map(|r| &r.payload_sha256[..]).collect();
                let leases: Vec<i64> = requests.iter().map(|r| lease_ms(r)).collect();
                let params: &Params<'_> = &[
                    (&sources, Type::TEXT_ARRAY),
                    (&keys, Type::TEXT_ARRAY),
                    (&hashes, Type::BYTEA_ARRAY),
                    (&leases, Type::INT8_ARRAY),
                ];
                self.session.query(&self.sql.claim, params).await?
            }
        };
        let mut claims = vec![None; requests.len()];
        let mut unseen = Vec::new();
        for row in &rows {
            let index = usize::try_from(row.get::<_, i64>(0) - 1).unwrap_or(usize::MAX);
            if let Some(slot) = claims.get_mut(index) {
                if lost_to_an_unseen_row(row) {
                    unseen.push(index);
                }
                *slot = Some(claim_from_row(row, &requests[index].payload_sha256));
            }
        }
        if !unseen.is_empty() {
            self.recheck_lost(requests, &unseen, &mut claims).await;
        }
        claims
            .into_iter()
            .map(|claim| {
                claim.ok_or_else(|| StoreError::Postgres("a claim got no result row".into()))
            })
            .collect()
    }

    /// A claim that lost to a row inserted by a concurrent claim committed
    /// after its snapshot saw no row to take the payload hash (or status)
    /// from: it waited for that insert, then left the key alone. A new
    /// statement sees the row, so a different body still counts as a
    /// mismatch. The claim is decided and committed either way; if this read
    /// fails, the key is answered in flight without the body check.
    async fn recheck_lost(
        &self,
        requests: &[&ClaimRequest],
        unseen: &[usize],
        claims: &mut [Option<Claim>],
    ) {
        let sources: Vec<&str> = unseen.iter().map(|&i| &*requests[i].source).collect();
        let keys: Vec<&str> = unseen.iter().map(|&i| requests[i].key.as_str()).collect();
        let params: &Params<'_> = &[(&sources, Type::TEXT_ARRAY), (&keys, Type::TEXT_ARRAY)];
        let rows = match self.session.query(&self.sql.recheck, params).await {
            Ok(rows) => rows,
            Err(error) => {
                tracing::warn!(%error, "cannot re-read keys claimed concurrently; answered in flight without comparing their bodies");
                return;
            }
        };
        for row in &rows {
            let ord = usize::try_from(row.get::<_, i64>(0) - 1).unwrap_or(usize::MAX);
            let Some(&index) = unseen.get(ord) else {
                continue;
            };
            let stored_sha: Option<&[u8]> = row.get(2);
            claims[index] = Some(lost_claim(
                row.get(1),
                row.get(3),
                stored_sha.is_some_and(|stored| stored != requests[index].payload_sha256),
            ));
        }
    }

    /// Settles a batch; as with claims, a refused statement is retried one
    /// key at a time.
    ///
    /// The batch goes out in key order (byte order, as claims lock theirs):
    /// the statement locks rows in the order of its input, so two batches
    /// sharing keys, or a settle and a claim taking back the same expired
    /// keys, wait on each other instead of deadlocking. Sorting here, not
    /// in the statement, costs the database nothing: a locking sort there
    /// would write a lock record for every row it then updates anyway.
    async fn settle_batch(self, requests: Vec<SettleRequest>) -> Vec<Result<bool, StoreError>> {
        let mut order: Vec<usize> = (0..requests.len()).collect();
        order.sort_unstable_by_key(|&i| (&requests[i].source, &requests[i].key));
        let sorted: Vec<&SettleRequest> = order.iter().map(|&i| &requests[i]).collect();
        let mut outcomes = vec![Ok(false); requests.len()];
        for (index, outcome) in order.into_iter().zip(self.isolated(&sorted).await) {
            outcomes[index] = outcome;
        }
        outcomes
    }

    async fn settle_round(&self, requests: &[&SettleRequest]) -> Result<Vec<bool>, StoreError> {
        let rows = match requests {
            [one] => {
                let params: &Params<'_> = &[
                    (&one.source, Type::TEXT),
                    (&one.key, Type::TEXT),
                    (&one.attempt, Type::INT4),
                    (&one.settlement.status.as_str(), Type::TEXT),
                    (&response_status(one), Type::INT2),
                ];
                self.session.query(&self.sql.settle_one, params).await?
            }
            _ => {
                let sources: Vec<&str> = requests.iter().map(|r| r.source.as_str()).collect();
                let keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
                let attempts: Vec<i32> = requests.iter().map(|r| r.attempt).collect();
                let statuses: Vec<&str> = requests
                    .iter()
                    .map(|r| r.settlement.status.as_str())
                    .collect();
                let response_statuses: Vec<Option<i16>> =
                    requests.iter().map(|r| response_status(r)).collect();
                let params: &Params<'_> = &[
                    (&sources, Type::TEXT_ARRAY),
                    (&keys, Type::TEXT_ARRAY),
                    (&attempts, Type::INT4_ARRAY),
                    (&statuses, Type::TEXT_ARRAY),
                    (&response_statuses, Type::INT2_ARRAY),
                ];
                self.session.query(&self.sql.settle, params).await?
            }
        };
        let mut settled = vec![false; requests.len()];
        for row in &rows {
            let index = usize::try_from(row.get::<_, i64>(0) - 1).unwrap_or(usize::MAX);
            if let Some(slot) = settled.get_mut(index) {
                *slot = true;
            }
        }
        Ok(settled)
    }
}

/// What one round of a batch runs: claims or settles, as one statement for
/// the round's keys (none twice).
trait Round: Sized {
    /// Each key's result.
    type Outcome: Clone;

    async fn run(
        runner: &BatchRunner,
        requests: &[&Self],
    ) -> Result<Vec<Self::Outcome>, StoreError>;
}

impl Round for ClaimRequest {
    type Outcome = Claim;

    async fn run(runner: &BatchRunner, requests: &[&Self]) -> Result<Vec<Claim>, StoreError> {
        runner.claim_round(requests).await
    }
}

impl Round for SettleRequest {
    type Outcome = bool;

    async fn run(runner: &BatchRunner, requests: &[&Self]) -> Result<Vec<bool>, StoreError> {
        runner.settle_round(requests).await
    }
}

fn lease_ms(request: &ClaimRequest) -> i64 {
    i64::try_from(request.lease.as_millis()).unwrap_or(i64::MAX)
}

fn response_status(request: &SettleRequest) -> Option<i16> {
    request
        .settlement
        .response_status
        .map(|status| i16::try_from(status).unwrap_or(i16::MAX))
}

fn claim_from_row(row: &Row, payload_sha256: &[u8; 32]) -> Claim {
    let won: bool = row.get(1);
    let attempt: i32 = row.get(2);
    let stored_sha: Option<&[u8]> = row.get(3);
    let prior_status: Option<&str> = row.get(4);
    let age_seconds: f64 = row.get(5);
    let payload_mismatch = stored_sha.is_some_and(|stored| stored != payload_sha256);
    match (won, prior_status) {
        (true, prior) => Claim::Won {
            attempt,
            from: match prior {
                None if attempt == 1 => WonFrom::New,
                Some("processing") => WonFrom::ExpiredLease,
                _ => WonFrom::Failed,
            },
            payload_mismatch,
        },
        (false, prior) => lost_claim(prior, age_seconds, payload_mismatch),
    }
}

/// A claim that did not win, by the status of the row that beat it.
fn lost_claim(status: Option<&str>, age_seconds: f64, payload_mismatch: bool) -> Claim {
    match status {
        Some("done") => Claim::Done {
            age: Duration::from_secs_f64(age_seconds.max(0.0)),
            payload_mismatch,
        },
        _ => Claim::InFlight { payload_mismatch },
    }
}

/// Whether a claim lost to a row its statement's snapshot did not hold.
fn lost_to_an_unseen_row(row: &Row) -> bool {
    let won: bool = row.get(1);
    let prior_status: Option<&str> = row.get(4);
    !won && prior_status.is_none()
}

fn postgres_error(error: tokio_postgres::Error) -> StoreError {
    match error.code() {
        Some(&SqlState::UNDEFINED_TABLE) => StoreError::MissingTable,
        // The server answered and refused this statement (bad data, deadlock,
        // serialization); connection and shutdown classes aside, the
        // connection itself is fine.
        Some(code) if !code.code().starts_with("08") && !code.code().starts_with("57") => {
            StoreError::Refused(error_chain(&error))
        }
        _ => StoreError::Postgres(error_chain(&error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_analyzed_once_per_threshold_as_inserted_rows_grow() {
        let growth = Growth::new();
        assert!(!growth.add(ANALYZE_FIRST_AT - 1));
        assert!(growth.add(1), "the first threshold");
        assert!(!growth.add(1), "only once");
        let next = ANALYZE_FIRST_AT * ANALYZE_GROWTH;
        assert!(!growth.add(next - ANALYZE_FIRST_AT - 2));
        assert!(
            growth.add(1),
            "the next threshold, {ANALYZE_GROWTH} times the first"
        );
        assert!(!growth.add(next));
    }
}
