//! The PostgreSQL backend: a deadpool pool of tokio-postgres connections, the
//! schema of SPEC section 2, and the claim as one data-modifying statement.
//! Holds no session state between transactions, so it works through a
//! transaction-pooling PgBouncer: named prepared statements only for the
//! claim and the settle, and only while they work (see [`Params`]). The
//! operator's statements are in `postgres/keys.rs`.

mod keys;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::{
    Backend, Claim, ClaimRequest, KeyFilter, KeyRecord, PruneBatch, PruneGroup, Release,
    Settlement, StoreError, WonFrom,
};
use crate::config::StoreConfig;
use crate::error_chain;

/// Claims recorded in PostgreSQL.
pub struct PostgresStore {
    pool: Pool,
    sql: Statements,
    keys: keys::Statements,
    table: String,
    statement_cache: bool,
    /// Set when named statements turned out not to survive the way to the
    /// server; every statement is unnamed from then on.
    named_statements_lost: AtomicBool,
}

struct Statements {
    migrate: String,
    claim: String,
    settle: String,
}

impl Statements {
    fn new(table: &str) -> Self {
        let index = table.rsplit('.').next().unwrap_or(table);
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
                 CREATE INDEX IF NOT EXISTS {index}_received_at_idx ON {table} (received_at);"
            ),
            // `prior` reads the statement's snapshot, i.e. the row as it was
            // before this statement: it only classifies the result. The
            // decision itself is the ON CONFLICT clause. A row committed by a
            // concurrent claim after the snapshot is invisible to `prior`;
            // losing to it yields no row at all, which means in flight.
            claim: format!(
                "WITH prior AS (
                   SELECT status, payload_sha256, received_at FROM {table}
                    WHERE source = $1 AND event_id = $2
                 ), claimed AS (
                   INSERT INTO {table} AS e (source, event_id, status, attempts, payload_sha256, lease_expires_at)
                   VALUES ($1, $2, 'processing', 1, $3, now() + $4::bigint * interval '1 millisecond')
                   ON CONFLICT (source, event_id) DO UPDATE
                      SET status = 'processing', attempts = e.attempts + 1, claimed_at = now(),
                          lease_expires_at = excluded.lease_expires_at,
                          response_status = NULL, completed_at = NULL
                    WHERE e.status = 'failed'
                       OR (e.status = 'processing' AND e.lease_expires_at <= now())
                   RETURNING attempts, payload_sha256
                 )
                 SELECT true AS won, c.attempts, c.payload_sha256, p.status,
                        0::float8 AS age_seconds
                   FROM claimed c LEFT JOIN prior p ON true
                 UNION ALL
                 SELECT false, 0, p.payload_sha256, p.status,
                        extract(epoch FROM now() - p.received_at)::float8
                   FROM prior p WHERE NOT EXISTS (SELECT 1 FROM claimed)"
            ),
            settle: format!(
                "UPDATE {table}
                    SET status = $4, response_status = $5, completed_at = now(), lease_expires_at = NULL
                  WHERE source = $1 AND event_id = $2 AND status = 'processing' AND attempts = $3
                 RETURNING 1"
            ),
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
            pool,
            sql: Statements::new(&config.table),
            keys: keys::Statements::new(&config.table),
            table: config.table.clone(),
            statement_cache: config.statement_cache,
            named_statements_lost: AtomicBool::new(false),
        })
    }

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
            .simple_query("SELECT 1")
            .await
            .map(drop)
            .map_err(postgres_error)
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let lease_ms = i64::try_from(request.lease.as_millis()).unwrap_or(i64::MAX);
        let rows = self
            .query(
                &self.sql.claim,
                &[
                    (&&*request.source, Type::TEXT),
                    (&request.key, Type::TEXT),
                    (&&request.payload_sha256[..], Type::BYTEA),
                    (&lease_ms, Type::INT8),
                ],
            )
            .await?;
        Ok(match rows.first() {
            Some(row) => claim_from_row(row, &request.payload_sha256),
            None => Claim::InFlight {
                payload_mismatch: false,
            },
        })
    }

    async fn settle(
        &self,
        source: &str,
        key: &str,
        attempt: i32,
        settlement: Settlement,
    ) -> Result<bool, StoreError> {
        let response_status = settlement
            .response_status
            .map(|status| i16::try_from(status).unwrap_or(i16::MAX));
        let updated = self
            .query(
                &self.sql.settle,
                &[
                    (&source, Type::TEXT),
                    (&key, Type::TEXT),
                    (&attempt, Type::INT4),
                    (&settlement.status.as_str(), Type::TEXT),
                    (&response_status, Type::INT2),
                ],
            )
            .await?;
        Ok(updated.len() == 1)
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

fn claim_from_row(row: &Row, payload_sha256: &[u8; 32]) -> Claim {
    let won: bool = row.get(0);
    let attempt: i32 = row.get(1);
    let stored_sha: Option<&[u8]> = row.get(2);
    let prior_status: Option<&str> = row.get(3);
    let age_seconds: f64 = row.get(4);
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
        (false, Some("done")) => Claim::Done {
            age: Duration::from_secs_f64(age_seconds.max(0.0)),
            payload_mismatch,
        },
        (false, _) => Claim::InFlight { payload_mismatch },
    }
}

fn postgres_error(error: tokio_postgres::Error) -> StoreError {
    if error.code() == Some(&SqlState::UNDEFINED_TABLE) {
        return StoreError::MissingTable;
    }
    StoreError::Postgres(error_chain(&error))
}
