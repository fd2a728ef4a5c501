//! The pool and how statements go through it: a connection from the pool
//! or the claim batches' pipeline, and each claim or settle statement sent
//! named (cached) or unnamed, with this process's guard as its last
//! parameter.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use std::time::Duration;

use deadpool_postgres::{Pool, PoolError, TimeoutType, Timeouts};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::batch::{Growth, HeldClaims, TakingBack};
use super::{Connection, postgres_error};
use crate::error_chain;
use crate::store::StoreError;

/// The pool and how statements are sent through it, shared with the batches.
pub(super) struct Session {
    pub(super) pool: Pool,
    /// The connection of the claim batches at the database, while any is;
    /// it goes back to the pool with the last of them.
    pub(super) pipeline: Mutex<Weak<Connection>>,
    pub(super) statement_cache: bool,
    /// Set when named statements turned out not to survive the way to the
    /// server; every statement is unnamed from then on.
    pub(super) named_statements_lost: AtomicBool,
    /// The last parameter of every claim and settle statement (see
    /// `sql::Statements`).
    pub(super) instance: String,
    pub(super) growth: Growth,
    pub(super) taking_back: TakingBack,
    pub(super) held_claims: HeldClaims,
    /// The server as errors name it: where it is, not who connects to it
    /// (a `/readyz` body may travel further than a log line).
    pub(super) server: String,
}

impl Session {
    pub(super) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(|error| {
            let server = &self.server;
            StoreError::Unreachable(match error {
                // deadpool words these as a pool of "objects".
                PoolError::Backend(error) => {
                    let said = error_chain(&error);
                    // tokio-postgres's words for a server that is read-only
                    // (`target_session_attrs=read-write`, the default).
                    let hint = if said.contains("database does not allow writes") {
                        " (a standby, or a server read-only by default: point store.url at the primary, or list every server, postgres://host1,host2/db, and the proxy takes the one that accepts writes)"
                    } else {
                        ""
                    };
                    format!("cannot connect to {server}: {said}{hint}")
                }
                PoolError::Timeout(TimeoutType::Create) => {
                    format!("cannot connect to {server}: timed out")
                }
                PoolError::Timeout(TimeoutType::Wait) => {
                    format!("no connection to {server} came free in time")
                }
                other => format!("{server}: {}", error_chain(&other)),
            })
        })
    }

    /// A connection from the pool if one is free now (or may be opened),
    /// without waiting for one to be given back.
    pub(super) async fn spare_client(&self) -> Option<deadpool_postgres::Object> {
        let now = Timeouts {
            wait: Some(Duration::ZERO),
            ..self.pool.timeouts()
        };
        self.pool.timeout_get(&now).await.ok()
    }

    /// The connection claim batches are pipelined on: the one the batches
    /// still at the database use, or, when none is, a new one from the pool.
    pub(super) async fn pipeline(&self) -> Result<Arc<Connection>, StoreError> {
        let shared = self.pipeline_slot().upgrade();
        if let Some(connection) = shared.filter(|connection| !connection.is_closed()) {
            return Ok(connection);
        }
        let connection = Arc::new(self.client().await?);
        *self.pipeline_slot() = Arc::downgrade(&connection);
        Ok(connection)
    }

    /// Pipelines no more claims on `connection` (if they still go to it).
    pub(super) fn withdraw(&self, connection: &Arc<Connection>) {
        let mut pipeline = self.pipeline_slot();
        if std::ptr::eq(pipeline.as_ptr(), Arc::as_ptr(connection)) {
            *pipeline = Weak::new();
        }
    }

    fn pipeline_slot(&self) -> MutexGuard<'_, Weak<Connection>> {
        self.pipeline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs a claim or settle statement on a connection from the pool.
    pub(super) async fn query(
        &self,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Vec<Row>, StoreError> {
        self.query_on(&self.client().await?, sql, params).await
    }

    /// Runs a claim or settle statement on `client`: a cached named
    /// statement, or with `statement_cache: false` (or once named statements
    /// were lost) an unnamed one. `params` are the statement's own; the
    /// guard's (this process's instance) is added last.
    ///
    /// Each statement is a transaction of its own, so one the server rolled
    /// back for a conflict with another transaction changed nothing and is
    /// run again: a database whose `default_transaction_isolation` is
    /// `serializable` or `repeatable read` refuses concurrent claims of a key
    /// that way where `read committed` (which the statements are written
    /// for) waits.
    pub(super) async fn query_on(
        &self,
        client: &Connection,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Vec<Row>, StoreError> {
        let mut guarded = params.to_vec();
        guarded.push((&self.instance, Type::TEXT));
        let mut conflicts = 0;
        loop {
            match self.query_guarded(client, sql, &guarded).await {
                Err(error)
                    if rolled_back_for_a_conflict(&error) && conflicts < CONFLICT_RETRIES =>
                {
                    conflicts += 1;
                    tokio::time::sleep(conflict_backoff(conflicts)).await;
                }
                rows => return rows.map_err(postgres_error),
            }
        }
    }

    async fn query_guarded(
        &self,
        client: &Connection,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        if self.named_statements() {
            let named = async {
                let statement = client.prepare_typed_cached(sql, &types(params)).await?;
                client.query(&statement, &values(params)).await
            };
            match named.await {
                // Given up on only once the statement has run unnamed on the
                // same connection: a pooler's own fatal errors share one of
                // these codes (PgBouncer's `query_timeout` or `server conn
                // crashed?`, 08P01) and close the connection, which says
                // nothing about named statements.
                Err(error) if lost_named_statement(&error) => {
                    return match client.query_typed(sql, params).await {
                        Ok(rows) => {
                            self.lose_named_statements(&error);
                            Ok(rows)
                        }
                        // The pooler's error says why the connection ended
                        // (`query_timeout`); the rerun's says only that it did.
                        // Only a connection-class error may stand for the
                        // rerun: either says the outcome is unknown, where a
                        // lost statement's own error would say nothing ran.
                        Err(rerun) if rerun.is_closed() && connection_class(&error) => Err(error),
                        Err(rerun) => Err(rerun),
                    };
                }
                // A column's type changed under the statement (ALTER TABLE),
                // and PostgreSQL will not plan it again with another result
                // type: it is prepared anew next time, and runs unnamed now.
                Err(error) if result_type_changed(&error) => {
                    client.statement_cache.remove(sql, &types(params));
                }
                rows => return rows,
            }
        }
        client.query_typed(sql, params).await
    }

    fn named_statements(&self) -> bool {
        self.statement_cache && !self.named_statements_lost.load(Ordering::Relaxed)
    }

    fn lose_named_statements(&self, error: &tokio_postgres::Error) {
        if !self.named_statements_lost.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                error = error_chain(error),
                "named prepared statements do not survive the way to the server (a \
                 transaction-pooling PgBouncer older than 1.21?); using unnamed statements \
                 from now on: set store.statement_cache: false"
            );
        }
    }
}

/// Whether the error says a named statement was not on the server connection
/// the statement reached, or another statement had its name there: what a
/// transaction pooler that does not track prepared statements does to them.
/// Another process's statement under the name refuses these parameters when
/// they do not decode as its own (bad binary data, array or parameter count),
/// and its guard refuses them when they do (division by zero; see
/// `sql::Statements`). Either way nothing ran, and the statement is safely
/// run again unnamed. Our own statements, given the parameters they were
/// prepared for, raise none of these. A pooler's fatal errors may share a
/// code (08P01) and follow a statement that ran, but they close the
/// connection, so the statement cannot run again on it.
pub(super) fn lost_named_statement(error: &tokio_postgres::Error) -> bool {
    [
        SqlState::INVALID_SQL_STATEMENT_NAME,
        SqlState::DUPLICATE_PSTATEMENT,
        SqlState::PROTOCOL_VIOLATION,
        SqlState::DIVISION_BY_ZERO,
        SqlState::INVALID_BINARY_REPRESENTATION,
        SqlState::DATATYPE_MISMATCH,
        SqlState::PROGRAM_LIMIT_EXCEEDED,
    ]
    .iter()
    .any(|code| error.code() == Some(code))
}

/// Whether the error is of SQLSTATE class 08, connection exception.
fn connection_class(error: &tokio_postgres::Error) -> bool {
    error
        .code()
        .is_some_and(|code| code.code().starts_with("08"))
}

/// How many times a statement rolled back for a conflict is run again. Each
/// run sees the rows the conflicting transaction committed, so the next one
/// normally goes through.
const CONFLICT_RETRIES: u32 = 10;

/// How long to wait before running a statement again after its `conflicts`th
/// rollback: a random time up to a bound that doubles with each, from 1 ms
/// to 32 ms (191 ms over all ten at most). Replicas whose statements
/// conflicted, run again at once, meet again: the claims and take-backs of
/// keys several replicas are claiming, on a `serializable` database, could
/// roll each other back every time. At random times they run one after
/// another.
fn conflict_backoff(conflicts: u32) -> Duration {
    let bound_us = 1000u64 << conflicts.saturating_sub(1).min(5);
    Duration::from_micros(fastrand::u64(0..=bound_us))
}

/// Whether the server rolled the statement back because of a concurrent
/// transaction: a serialization failure or a deadlock.
fn rolled_back_for_a_conflict(error: &tokio_postgres::Error) -> bool {
    [
        SqlState::T_R_SERIALIZATION_FAILURE,
        SqlState::T_R_DEADLOCK_DETECTED,
    ]
    .iter()
    .any(|code| error.code() == Some(code))
}

/// Whether a cached statement was refused because the table it reads
/// changed the type of a column it returns.
fn result_type_changed(error: &tokio_postgres::Error) -> bool {
    error.as_db_error().is_some_and(|db| {
        db.code() == &SqlState::FEATURE_NOT_SUPPORTED
            && db.message() == "cached plan must not change result type"
    })
}

/// This process's instance, for the statements' guard: random, so that no
/// two processes share one.
pub(super) fn instance() -> String {
    use std::hash::{BuildHasher, Hasher};
    // Each RandomState is keyed from the operating system's randomness.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    format!("{:016x}", hasher.finish())
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

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn a_statement_run_again_after_a_conflict_waits_a_bounded_random_time() {
        let longest = |conflicts: u32| {
            (0..2000)
                .map(|_| conflict_backoff(conflicts))
                .max()
                .unwrap()
        };
        assert!(longest(1) <= Duration::from_millis(1));
        assert!(longest(2) <= Duration::from_millis(2));
        assert!(longest(6) <= Duration::from_millis(32));
        assert!(longest(CONFLICT_RETRIES) <= Duration::from_millis(32));
        let waits: HashSet<Duration> = (0..50).map(|_| conflict_backoff(3)).collect();
        assert!(waits.len() > 1, "random, so replicas part: {waits:?}");
    }
}
