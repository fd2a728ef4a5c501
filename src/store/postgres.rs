//! The PostgreSQL backend: a deadpool pool of tokio-postgres connections, the
//! schema of SPEC section 2, and the claim as one data-modifying statement.
//! Holds no session state between transactions, so it works through a
//! transaction-pooling PgBouncer. The operator's statements are in
//! `postgres/keys.rs`.

mod keys;

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::{
    Backend, Claim, ClaimRequest, KeyFilter, KeyRecord, PruneBatch, PruneGroup, Release,
    Settlement, StoreError, WonFrom,
};
use crate::config::StoreConfig;

/// Claims recorded in PostgreSQL.
pub struct PostgresStore {
    pool: Pool,
    sql: Statements,
    keys: keys::Statements,
    table: String,
    statement_cache: bool,
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
                  WHERE source = $1 AND event_id = $2 AND status = 'processing' AND attempts = $3"
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
            .map_err(|error| StoreError::Postgres(error.to_string()))?;
        Ok(Self {
            pool,
            sql: Statements::new(&config.table),
            keys: keys::Statements::new(&config.table),
            table: config.table.clone(),
            statement_cache: config.statement_cache,
        })
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool
            .get()
            .await
            .map_err(|error| StoreError::Postgres(error.to_string()))
    }

    async fn query(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await?;
        let rows = if self.statement_cache {
            let statement = client.prepare_cached(sql).await.map_err(postgres_error)?;
            client.query(&statement, params).await
        } else {
            client.query(sql, params).await
        };
        rows.map_err(postgres_error)
    }

    async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let count = if self.statement_cache {
            let statement = client.prepare_cached(sql).await.map_err(postgres_error)?;
            client.execute(&statement, params).await
        } else {
            client.execute(sql, params).await
        };
        count.map_err(postgres_error)
    }
}

impl Backend for PostgresStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let transaction = client.transaction().await.map_err(postgres_error)?;
        // Transaction-scoped, so the lock cannot leak through a pooler.
        transaction
            .execute(
                "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                &[&format!("dedupe-proxy migrate {}", self.table)],
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
                    &&*request.source,
                    &request.key,
                    &&request.payload_sha256[..],
                    &lease_ms,
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
            .execute(
                &self.sql.settle,
                &[
                    &source,
                    &key,
                    &attempt,
                    &settlement.status.as_str(),
                    &response_status,
                ],
            )
            .await?;
        Ok(updated == 1)
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
    StoreError::Postgres(error.to_string())
}
