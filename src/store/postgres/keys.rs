//! PostgreSQL statements for the operator's commands and the pruner: list,
//! show, forget, release, and pruning in small batches under a
//! transaction-scoped advisory lock (so it works through a transaction
//! pooler, and a replica that finds the lock taken skips its turn).

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use tokio_postgres::Row;
use tokio_postgres::types::Type;

use super::{Params, PostgresStore, postgres_error, read_committed};
use crate::store::sql_identifier;
use crate::store::{
    Forget, KeyFilter, KeyRecord, KeyStatus, PruneBatch, PruneGroup, Release, Sources, StoreError,
};

const COLUMNS: &str = "source, event_id, status, attempts, payload_sha256, response_status, \
                       received_at, claimed_at, lease_expires_at, completed_at";

/// `now() - interval` overflows past the calendar's start; nothing is older
/// than this anyway.
const LONGEST_HORIZON: Duration = Duration::from_secs(1000 * 365 * 86400);

pub(super) struct Statements {
    list: String,
    show: String,
    forget: String,
    live_lease_for_update: String,
    status_for_update: String,
    release: String,
    prune_only: String,
    prune_except: String,
    prune_lock: String,
}

impl Statements {
    pub(super) fn new(table_name: &str) -> Self {
        let table = &sql_identifier(table_name);
        Self {
            list: format!(
                "SELECT {COLUMNS} FROM {table}
                  WHERE ($1::text IS NULL OR source = $1) AND ($2::text IS NULL OR status = $2)
                  ORDER BY received_at DESC, source, event_id
                  LIMIT $3"
            ),
            show: format!("SELECT {COLUMNS} FROM {table} WHERE source = $1 AND event_id = $2"),
            forget: format!("DELETE FROM {table} WHERE source = $1 AND event_id = $2"),
            live_lease_for_update: format!(
                "SELECT CASE WHEN status = 'processing' AND lease_expires_at > now()
                             THEN lease_expires_at END
                   FROM {table} WHERE source = $1 AND event_id = $2 FOR UPDATE"
            ),
            status_for_update: format!(
                "SELECT status FROM {table} WHERE source = $1 AND event_id = $2 FOR UPDATE"
            ),
            release: format!(
                "UPDATE {table}
                    SET status = 'failed', response_status = NULL, completed_at = now(),
                        lease_expires_at = NULL
                  WHERE source = $1 AND event_id = $2 AND status = 'processing'
                  RETURNING attempts"
            ),
            prune_only: prune_statement(table, "source = ANY($2)"),
            prune_except: prune_statement(table, "source <> ALL($2)"),
            prune_lock: format!("dedupe-proxy prune {table_name}"),
        }
    }
}

/// One batch: victims found through the `received_at` index, oldest first;
/// rows a claim has locked are skipped rather than waited for.
fn prune_statement(table: &str, sources: &str) -> String {
    format!(
        "DELETE FROM {table} WHERE ctid IN (
           SELECT ctid FROM {table}
            WHERE received_at < now() - $1::bigint * interval '1 millisecond'
              AND {sources}
              AND (status <> 'processing' OR lease_expires_at <= now())
            ORDER BY received_at
            LIMIT $3
            FOR UPDATE SKIP LOCKED
         )"
    )
}

impl PostgresStore {
    pub(super) async fn list_keys(&self, filter: &KeyFilter) -> Result<Vec<KeyRecord>, StoreError> {
        let status = filter.status.map(KeyStatus::as_str);
        let rows = self
            .query_unnamed(
                &self.keys.list,
                &[
                    (&filter.source, Type::TEXT),
                    (&status, Type::TEXT),
                    (&i64::from(filter.limit), Type::INT8),
                ],
            )
            .await?;
        rows.iter().map(record).collect()
    }

    pub(super) async fn show_key(
        &self,
        source: &str,
        key: &str,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let rows = self
            .query_unnamed(
                &self.keys.show,
                &[(&source, Type::TEXT), (&key, Type::TEXT)],
            )
            .await?;
        rows.first().map(record).transpose()
    }

    pub(super) async fn forget_key(
        &self,
        source: &str,
        key: &str,
        force: bool,
    ) -> Result<Forget, StoreError> {
        let deadline = Instant::now() + self.claim_timeout;
        let mut client = self.by(deadline, self.client()).await?;
        let transaction = self.by(deadline, read_committed(&mut client)).await?;
        let params: &Params<'_> = &[(&source, Type::TEXT), (&key, Type::TEXT)];
        let decide = async {
            // Locked, so that no claim takes the key between the look and the
            // delete.
            let lease = transaction
                .query_typed_opt(&self.keys.live_lease_for_update, params)
                .await
                .map_err(postgres_error)?;
            Ok(match lease.map(|row| row.get::<_, Option<SystemTime>>(0)) {
                None => Forget::Missing,
                Some(Some(lease_expires_at)) if !force => Forget::InFlight { lease_expires_at },
                Some(_) => {
                    transaction
                        .execute_typed(&self.keys.forget, params)
                        .await
                        .map_err(postgres_error)?;
                    Forget::Forgotten
                }
            })
        };
        let outcome = self.by(deadline, decide).await?;
        self.commit(transaction).await?;
        Ok(outcome)
    }

    pub(super) async fn release_key(&self, source: &str, key: &str) -> Result<Release, StoreError> {
        let deadline = Instant::now() + self.claim_timeout;
        let mut client = self.by(deadline, self.client()).await?;
        let transaction = self.by(deadline, read_committed(&mut client)).await?;
        let params: &Params<'_> = &[(&source, Type::TEXT), (&key, Type::TEXT)];
        let decide = async {
            // Locking the row first makes "missing", "not processing" and the
            // update one decision.
            let status = transaction
                .query_typed_opt(&self.keys.status_for_update, params)
                .await
                .map_err(postgres_error)?;
            Ok(match status.as_ref().map(|row| row.get::<_, &str>(0)) {
                None => Release::Missing,
                Some("processing") => {
                    let row = transaction
                        .query_typed_one(&self.keys.release, params)
                        .await
                        .map_err(postgres_error)?;
                    Release::Released {
                        attempt: row.get(0),
                    }
                }
                Some(other) => Release::NotProcessing(status_from(other)?),
            })
        };
        let outcome = self.by(deadline, decide).await?;
        self.commit(transaction).await?;
        Ok(outcome)
    }

    pub(super) async fn prune_batch(
        &self,
        group: &PruneGroup,
        limit: u32,
    ) -> Result<PruneBatch, StoreError> {
        let (sql, sources) = match &group.sources {
            Sources::Only(sources) => (&self.keys.prune_only, sources),
            Sources::AllExcept(sources) => (&self.keys.prune_except, sources),
        };
        let older_than_ms =
            i64::try_from(group.older_than.min(LONGEST_HORIZON).as_millis()).unwrap_or(i64::MAX);
        let deadline = Instant::now() + self.claim_timeout;
        let mut client = self.by(deadline, self.client()).await?;
        let transaction = self.by(deadline, read_committed(&mut client)).await?;
        let decide = async {
            let locked: bool = transaction
                .query_typed_one(
                    "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))",
                    &[(&self.keys.prune_lock, Type::TEXT)],
                )
                .await
                .map_err(postgres_error)?
                .get(0);
            if !locked {
                return Ok(None);
            }
            transaction
                .execute_typed(
                    sql,
                    &[
                        (&older_than_ms, Type::INT8),
                        (sources, Type::TEXT_ARRAY),
                        (&i64::from(limit), Type::INT8),
                    ],
                )
                .await
                .map(Some)
                .map_err(postgres_error)
        };
        match self.by(deadline, decide).await? {
            None => {
                transaction.rollback().await.map_err(postgres_error)?;
                Ok(PruneBatch::Busy)
            }
            Some(deleted) => {
                self.commit(transaction).await?;
                Ok(PruneBatch::Deleted(deleted))
            }
        }
    }

    /// `step`, unless `deadline` passes first: then `store.timeout`'s error.
    /// An operator's write is bounded this way up to its `COMMIT`; a step
    /// cut short leaves its transaction to be rolled back.
    async fn by<T>(
        &self,
        deadline: Instant,
        step: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout_at(deadline, step)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.claim_timeout)))
    }

    /// Commits an operator's write. Once sent, a `COMMIT` may take effect
    /// whatever its sender does, so it is not cut short by the write's
    /// deadline: its answer is waited for, up to `store.timeout` more (a
    /// synchronous standby that is down holds it for ever), and without one
    /// the error says the change may have been made.
    async fn commit(
        &self,
        transaction: deadpool_postgres::Transaction<'_>,
    ) -> Result<(), StoreError> {
        let waited = self.claim_timeout;
        match tokio::time::timeout(waited, transaction.commit()).await {
            Ok(committed) => committed.map_err(postgres_error),
            Err(_) => Err(StoreError::Postgres(format!(
                "COMMIT was sent and not answered within {waited:?}: the change may or may not have been made (`dedupe-proxy keys show` tells)"
            ))),
        }
    }
}

fn record(row: &Row) -> Result<KeyRecord, StoreError> {
    Ok(KeyRecord {
        source: row.get(0),
        key: row.get(1),
        status: status_from(row.get(2))?,
        attempts: row.get(3),
        payload_sha256: row.get(4),
        response_status: row
            .get::<_, Option<i16>>(5)
            .and_then(|status| u16::try_from(status).ok()),
        received_at: row.get(6),
        claimed_at: row.get(7),
        lease_expires_at: row.get(8),
        completed_at: row.get(9),
    })
}

fn status_from(text: &str) -> Result<KeyStatus, StoreError> {
    KeyStatus::parse(text)
        .ok_or_else(|| StoreError::Postgres(format!("unknown status `{text}` in the table")))
}
