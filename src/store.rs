//! The claim store: one small trait, the claim and settle types, and the
//! choice between PostgreSQL and the embedded SQLite store by URL. Both
//! backends keep the same table and the same semantics; the atomic decision
//! (who owns a key) is always one `INSERT … ON CONFLICT … RETURNING`.
//! The operator's operations (list, show, forget, release, prune) are part of
//! the same trait, with their types in `store/keys.rs`.

mod coalesce;
mod keys;
mod postgres;
mod sqlite;
mod url;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use crate::config::StoreConfig;
use crate::metrics::Metrics;

pub use keys::{Forget, KeyFilter, KeyRecord, KeyStatus, PruneBatch, PruneGroup, Release, Sources};
pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;
pub use url::StoreUrl;

/// What the store decided about one delivery of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This request owns the key until `settle` or lease expiry.
    Won {
        /// What `settle` must present to write this attempt's outcome.
        fence: Fence,
        /// What the key was before this request took it.
        from: WonFrom,
        /// The key's first delivery had another body.
        payload_mismatch: bool,
    },
    /// The key was processed already.
    Done {
        /// Time since the key's first delivery, by the store's clock.
        age: Duration,
        /// This delivery's body differs from the first one's.
        payload_mismatch: bool,
    },
    /// Another delivery holds a live lease on the key.
    InFlight {
        /// This delivery's body differs from the first one's.
        payload_mismatch: bool,
    },
}

/// A won claim's fencing token: the attempt number (`attempts`, shown to the
/// upstream as `X-Dedupe-Attempt`) and the claim's time (`claimed_at`). A
/// settle writes only a row that still holds both. The attempt alone would
/// not do: it starts again at 1 when a key is deleted (`keys forget`,
/// `prune`) and claimed anew, and the outcome of an attempt stalled past its
/// lease (a paused process, say) would then land on the new owner's row.
/// Two claims of one key are a lease apart, or one of them was forgotten
/// with `--force` in between, so their times differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    /// The attempt number, 1 for a key's first claim.
    pub attempt: i32,
    /// When the attempt claimed the key, by the store's clock, as stored.
    pub claimed_at: SystemTime,
}

/// How a won claim came about (the `result` label of `dedupe_claims_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WonFrom {
    /// The key was new.
    New,
    /// The key's last attempt had failed.
    Failed,
    /// The key's previous owner let its lease expire.
    ExpiredLease,
}

impl Claim {
    /// Whether this delivery's body differs from the key's first delivery.
    pub fn payload_mismatch(&self) -> bool {
        match *self {
            Claim::Won {
                payload_mismatch, ..
            }
            | Claim::Done {
                payload_mismatch, ..
            }
            | Claim::InFlight { payload_mismatch } => payload_mismatch,
        }
    }
}

/// One delivery's claim request.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The route name.
    pub source: Arc<str>,
    /// The idempotency key, verbatim.
    pub key: String,
    /// SHA-256 of the body.
    pub payload_sha256: [u8; 32],
    /// How long the claim is exclusively held.
    pub lease: Duration,
    /// The route answers a delivery whose body differs from the key's first
    /// delivery with 422: such a delivery never takes a `failed` or expired
    /// key over, so the rejection leaves the row as it was.
    pub reject_mismatch: bool,
}

#[cfg(test)]
impl ClaimRequest {
    /// A claim of `key` on the `orders` route, with a minute's lease.
    pub(crate) fn for_test(key: &str) -> Self {
        Self {
            source: Arc::from("orders"),
            key: key.into(),
            payload_sha256: [0; 32],
            lease: Duration::from_secs(60),
            reject_mismatch: false,
        }
    }
}

/// The outcome written by `settle`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    /// `done` or `failed`.
    pub status: SettledStatus,
    /// The upstream's status, when it answered.
    pub response_status: Option<u16>,
}

impl Settlement {
    /// A claim given back without an upstream answer: the next delivery is
    /// forwarded again.
    pub const RELEASED: Settlement = Settlement {
        status: SettledStatus::Failed,
        response_status: None,
    };
}

/// The final states of a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettledStatus {
    /// The upstream acted on the event; duplicates are answered by the proxy.
    Done,
    /// The attempt failed; the next delivery is forwarded.
    Failed,
}

impl SettledStatus {
    /// The `status` column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            SettledStatus::Done => "done",
            SettledStatus::Failed => "failed",
        }
    }
}

/// A store failure: every one means "the store is unavailable" to a webhook.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The operation took longer than `store.timeout`.
    #[error("store operation timed out after {0:?}")]
    Timeout(Duration),
    /// PostgreSQL answered with an error, or the connection failed with a
    /// statement on it.
    #[error("postgres: {0}")]
    Postgres(String),
    /// No connection to PostgreSQL could be had, so nothing was sent.
    #[error("postgres: {0}")]
    Unreachable(String),
    /// PostgreSQL refused a statement (bad data, deadlock, serialization
    /// failure); the connection is healthy.
    #[error("postgres refused the statement: {0}")]
    Refused(String),
    /// PostgreSQL canceled the statement (`statement_timeout`,
    /// `pg_cancel_backend`): its transaction was rolled back, so nothing of
    /// it was committed, and the connection is healthy.
    #[error("postgres canceled the statement: {0}")]
    Canceled(String),
    /// A settle sent while every settle statement waits on a held row
    /// skipped its key's row, which another transaction holds locked;
    /// nothing was written.
    #[error("the key's row is locked by another transaction")]
    RowLocked,
    /// SQLite failed.
    #[error("sqlite: {0}")]
    Sqlite(String),
    /// The claims table does not exist: the schema was never created, or
    /// `store.table` names another table. With the database's own words,
    /// which name the table in the server's language.
    #[error("the claims table is missing ({0}): `dedupe-proxy migrate` creates it")]
    MissingTable(String),
    /// `store.table` names a table that lacks the claims table's columns.
    #[error(
        "the table `{table}` is not a dedupe-proxy claims table ({problem}): set store.table to the claims table, or to a new name for `dedupe-proxy migrate` to create"
    )]
    NotClaimsTable { table: String, problem: String },
}

impl StoreError {
    /// Whether a statement that failed this way may still have been
    /// committed: the connection to PostgreSQL failed, perhaps after the
    /// statement reached it, and its answer was lost with it. SQLite's
    /// statements run in this process, and commit or not before they answer.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, StoreError::Postgres(_))
    }
}

/// Every column of the claims table, in both stores.
pub(crate) const COLUMNS: &str = "source, event_id, status, attempts, payload_sha256, \
     response_status, received_at, claimed_at, lease_expires_at, completed_at";

/// What a migration did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Migration {
    /// Created the claims table (and its index).
    CreatedTable,
    /// Created the `received_at` index of a table that had none.
    CreatedIndex,
    UpToDate,
}

impl Migration {
    /// What a migration that found the table and its index, or not, did.
    pub(crate) fn after(table_existed: bool, index_existed: bool) -> Self {
        match (table_existed, index_existed) {
            (false, _) => Migration::CreatedTable,
            (true, false) => Migration::CreatedIndex,
            (true, true) => Migration::UpToDate,
        }
    }
}

/// A settle's write, owned, so that it can outlive the request that began it.
pub type SettleWrite = std::pin::Pin<Box<dyn Future<Output = Result<bool, StoreError>> + Send>>;

/// A queued claim's answer, sent once its statement has committed.
pub type PendingClaim = oneshot::Receiver<Result<Claim, StoreError>>;

/// The operations a backend provides. Every call is one short transaction;
/// none is held across the upstream call.
pub trait Backend: Send + Sync + 'static {
    /// Creates or upgrades the schema; says what it did (under concurrent
    /// migrations, only the one that did it says so).
    fn migrate(&self) -> impl Future<Output = Result<Migration, StoreError>> + Send;
    /// Answers when the store is reachable and the claims table exists
    /// ([`StoreError::MissingTable`] when only the table is missing).
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Queues a claim: insert the key, or take over a `failed` or
    /// lease-expired row, in one atomic statement decided by the primary
    /// key. Once queued it is decided whether or not anyone still waits for
    /// the answer.
    fn queue_claim(&self, request: &ClaimRequest) -> Result<PendingClaim, StoreError>;
    /// Writes the outcome only if the attempt `fence` names still owns the
    /// key. Returns whether it was written.
    fn settle(
        &self,
        source: &str,
        key: &str,
        fence: Fence,
        settlement: Settlement,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
    /// The keys matching `filter`, newest first delivery first.
    fn list(
        &self,
        filter: &KeyFilter,
    ) -> impl Future<Output = Result<Vec<KeyRecord>, StoreError>> + Send;
    /// One key, if stored.
    fn show(
        &self,
        source: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<KeyRecord>, StoreError>> + Send;
    /// Deletes a key, unless it is `processing` under a live lease and
    /// `force` is false.
    fn forget(
        &self,
        source: &str,
        key: &str,
        force: bool,
    ) -> impl Future<Output = Result<Forget, StoreError>> + Send;
    /// Turns a `processing` key into `failed`, so the next delivery is
    /// forwarded without waiting for the lease to expire.
    fn release(
        &self,
        source: &str,
        key: &str,
    ) -> impl Future<Output = Result<Release, StoreError>> + Send;
    /// Deletes at most `limit` of the group's rows whose first delivery is
    /// past the horizon, oldest first, in one short transaction. A
    /// `processing` row whose lease is live is never deleted. Busy when
    /// another process holds the table's prune lock.
    fn prune(
        &self,
        group: &PruneGroup,
        limit: u32,
    ) -> impl Future<Output = Result<PruneBatch, StoreError>> + Send;
}

/// The configured backend, with `store.timeout` applied to every call.
#[derive(Clone)]
pub struct Store {
    backend: Arc<AnyBackend>,
    timeout: Duration,
    /// Where the writes the store makes on its own (a late claim's
    /// release) and [`Store::settle_counted`] are timed and counted.
    metrics: Option<Metrics>,
    /// Claims answered as timed out, awaited to release them should they
    /// win: shutdown waits for them (see [`Store::finish_releases`]).
    late_claims: TaskTracker,
}

enum AnyBackend {
    Postgres(PostgresStore),
    Sqlite(SqliteStore),
}

macro_rules! dispatch {
    // For writes whose backends bound themselves by `store.timeout` and
    // answer what happened: cut short from outside, a write could commit
    // after its caller was told it timed out.
    (own_deadline $self:ident, $backend:ident => $call:expr) => {{
        match &*$self.backend {
            AnyBackend::Postgres($backend) => $call.await,
            AnyBackend::Sqlite($backend) => $call.await,
        }
    }};
    ($self:ident, $backend:ident => $call:expr) => {{
        let call = async {
            match &*$self.backend {
                AnyBackend::Postgres($backend) => $call.await,
                AnyBackend::Sqlite($backend) => $call.await,
            }
        };
        tokio::time::timeout($self.timeout, call)
            .await
            .unwrap_or(Err(StoreError::Timeout($self.timeout)))
    }};
}

impl Store {
    /// Opens the store named by `config.url`. PostgreSQL connects lazily, so
    /// this succeeds while the server is down; SQLite opens its file now.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        Self::open_with(config, true)
    }

    /// Like [`Store::open`], but never creates an SQLite file: for commands
    /// that inspect a store and must not conjure up an empty one.
    pub fn open_existing(config: &StoreConfig) -> Result<Self, StoreError> {
        Self::open_with(config, false)
    }

    fn open_with(config: &StoreConfig, create: bool) -> Result<Self, StoreError> {
        let backend = match StoreUrl::parse(&config.url).map_err(StoreError::Postgres)? {
            StoreUrl::Postgres(url) => AnyBackend::Postgres(PostgresStore::new(&url, config)?),
            StoreUrl::Sqlite(path) => {
                AnyBackend::Sqlite(SqliteStore::open_with(&path, config, create)?)
            }
        };
        Ok(Self {
            backend: Arc::new(backend),
            timeout: config.timeout,
            metrics: None,
            late_claims: TaskTracker::new(),
        })
    }

    /// The store, with the settles it makes on its own, and those made
    /// through [`Store::settle_counted`], timed and counted in `metrics`
    /// (`op="settle"`).
    pub fn counted_in(self, metrics: Metrics) -> Self {
        Self {
            metrics: Some(metrics),
            ..self
        }
    }

    /// Whether one writer at a time holds the whole store (SQLite's write
    /// lock), so that another process's writes hold up every claim.
    pub fn has_one_writer_at_a_time(&self) -> bool {
        matches!(&*self.backend, AnyBackend::Sqlite(_))
    }

    /// For SQLite, which of the database's files its path no longer leads
    /// to (deleted, moved or replaced under the running process), if one,
    /// and what that means; never for PostgreSQL.
    pub fn file_gone(&self) -> Option<String> {
        match &*self.backend {
            AnyBackend::Sqlite(backend) => backend.file_gone(),
            AnyBackend::Postgres(_) => None,
        }
    }

    /// Makes `runtime` the one that talks to the database from now on: for
    /// PostgreSQL, the runtime that opens and drives its connections and
    /// runs its claim and settle batches, so the requests served on its
    /// thread reach the server without waking another thread. SQLite runs
    /// its statements on a thread of its own, whoever sends them. Called
    /// before the store's first statement.
    pub fn set_home(&self, runtime: tokio::runtime::Handle) {
        match &*self.backend {
            AnyBackend::Postgres(backend) => backend.set_home(runtime),
            AnyBackend::Sqlite(_) => {}
        }
    }

    /// See [`Backend::migrate`]; not bounded by `store.timeout`, since a
    /// migration may wait for another replica's.
    pub async fn migrate(&self) -> Result<Migration, StoreError> {
        match &*self.backend {
            AnyBackend::Postgres(backend) => backend.migrate().await,
            AnyBackend::Sqlite(backend) => backend.migrate().await,
        }
    }

    /// See [`Backend::ping`].
    pub async fn ping(&self) -> Result<(), StoreError> {
        dispatch!(self, backend => backend.ping())
    }

    /// Whether the store would take claims now, as `/readyz` tells it: it
    /// answers ([`Store::ping`]), and the lock a claim takes (SQLite's write
    /// lock, the PostgreSQL table's) can be had.
    pub async fn ready(&self) -> Result<(), StoreError> {
        self.ping().await?;
        match &*self.backend {
            AnyBackend::Postgres(backend) => {
                tokio::time::timeout(self.timeout, backend.take_table_lock())
                    .await
                    .unwrap_or(Err(StoreError::Timeout(self.timeout)))
            }
            AnyBackend::Sqlite(backend) => backend.take_write_lock().await,
        }
    }

    /// See [`Backend::queue_claim`]. A claim that outlasts `store.timeout`
    /// is answered [`StoreError::Timeout`] but still decided; should it win,
    /// it is released at once, since no request will forward it, and the
    /// key would otherwise stay `processing` until its lease ran out,
    /// answering the sender's retries `in-flight`.
    pub async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let (mut pending, stopped): (_, fn() -> StoreError) = match &*self.backend {
            AnyBackend::Postgres(backend) => (backend.queue_claim(request)?, coalesce::stopped),
            AnyBackend::Sqlite(backend) => (backend.queue_claim(request)?, sqlite::stopped),
        };
        match tokio::time::timeout(self.timeout, &mut pending).await {
            Ok(answer) => answer.unwrap_or_else(|_| Err(stopped())),
            Err(_) => {
                self.late_claims.spawn(self.clone().release_if_won(
                    pending,
                    Arc::clone(&request.source),
                    request.key.clone(),
                ));
                Err(StoreError::Timeout(self.timeout))
            }
        }
    }

    /// Waits, until `deadline`, for the claims answered as timed out that
    /// are still at the store: dropped with the process, one that won would
    /// leave its key `processing` until its lease ran out. Whether none is
    /// left.
    pub async fn finish_releases(&self, deadline: tokio::time::Instant) -> bool {
        self.late_claims.close();
        if self.late_claims.is_empty() {
            return true;
        }
        tracing::info!(
            claims = self.late_claims.len(),
            "shutdown waits for claims answered as timed out, to release any that win"
        );
        tokio::time::timeout_at(deadline, self.late_claims.wait())
            .await
            .is_ok()
    }

    async fn release_if_won(self, pending: PendingClaim, source: Arc<str>, key: String) {
        let fence = match pending.await {
            Ok(Ok(Claim::Won { fence, .. })) => fence,
            Ok(Err(error)) if error.outcome_unknown() => {
                tracing::warn!(
                    route = %source, key = key.as_str(), %error,
                    "a claim answered as timed out then lost its connection; had it been committed, the key stays processing until its lease expires (dedupe-proxy keys release frees it)"
                );
                return;
            }
            _ => return,
        };
        // Not bounded by `store.timeout`: a write given up on would still be
        // made once the store gets to it, so that giving up would only end
        // this task (which shutdown waits for) early, and misreport it.
        let write = self.settle_write(
            Arc::clone(&source),
            key.clone(),
            fence,
            Settlement::RELEASED,
        );
        match self.counted_settle(write).await {
            Ok(_) => tracing::warn!(
                route = %source, key = key.as_str(), attempt = fence.attempt,
                "a claim answered as timed out won later; released it for the sender's retry"
            ),
            Err(error) => tracing::warn!(
                route = %source, key = key.as_str(), attempt = fence.attempt, %error,
                "a claim answered as timed out won later and cannot be released; the key waits for its lease to expire"
            ),
        }
    }

    /// See [`Backend::settle`]: the write as a future of its own, not
    /// bounded by `store.timeout` (see [`Store::within_timeout`]).
    pub fn settle_write(
        &self,
        source: Arc<str>,
        key: String,
        fence: Fence,
        settlement: Settlement,
    ) -> SettleWrite {
        let store = self.clone();
        Box::pin(async move {
            match &*store.backend {
                AnyBackend::Postgres(backend) => {
                    backend.settle(&source, &key, fence, settlement).await
                }
                AnyBackend::Sqlite(backend) => {
                    backend.settle(&source, &key, fence, settlement).await
                }
            }
        })
    }

    /// Waits for `write` for at most `store.timeout`: `None` when it
    /// outlasts that, and is still at the store (waiting on a row another
    /// transaction has locked, say), to be awaited again for its outcome.
    pub async fn within_timeout(
        &self,
        write: &mut SettleWrite,
    ) -> Option<Result<bool, StoreError>> {
        tokio::time::timeout(self.timeout, write).await.ok()
    }

    /// `store.timeout`.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// See [`Backend::settle`].
    pub async fn settle(
        &self,
        source: &str,
        key: &str,
        fence: Fence,
        settlement: Settlement,
    ) -> Result<bool, StoreError> {
        let mut write = self.settle_write(Arc::from(source), key.to_owned(), fence, settlement);
        self.within_timeout(&mut write)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.timeout)))
    }

    /// [`Store::settle`], timed and counted in the metrics given to
    /// [`Store::counted_in`], for settles no request's path times.
    pub async fn settle_counted(
        &self,
        source: &str,
        key: &str,
        fence: Fence,
        settlement: Settlement,
    ) -> Result<bool, StoreError> {
        self.counted_settle(self.settle(source, key, fence, settlement))
            .await
    }

    /// `settle`, timed and counted in the metrics given to
    /// [`Store::counted_in`], if any.
    async fn counted_settle(
        &self,
        settle: impl Future<Output = Result<bool, StoreError>>,
    ) -> Result<bool, StoreError> {
        match &self.metrics {
            Some(metrics) => metrics.time_store("settle", settle).await,
            None => settle.await,
        }
    }

    /// See [`Backend::list`].
    pub async fn list(&self, filter: &KeyFilter) -> Result<Vec<KeyRecord>, StoreError> {
        dispatch!(self, backend => backend.list(filter))
    }

    /// See [`Backend::show`].
    pub async fn show(&self, source: &str, key: &str) -> Result<Option<KeyRecord>, StoreError> {
        dispatch!(self, backend => backend.show(source, key))
    }

    /// See [`Backend::forget`].
    pub async fn forget(&self, source: &str, key: &str, force: bool) -> Result<Forget, StoreError> {
        dispatch!(own_deadline self, backend => backend.forget(source, key, force))
    }

    /// See [`Backend::release`].
    pub async fn release(&self, source: &str, key: &str) -> Result<Release, StoreError> {
        dispatch!(own_deadline self, backend => backend.release(source, key))
    }

    /// See [`Backend::prune`]; the loop over batches is [`crate::prune`]'s.
    pub async fn prune(&self, group: &PruneGroup, limit: u32) -> Result<PruneBatch, StoreError> {
        dispatch!(own_deadline self, backend => backend.prune(group, limit))
    }
}

/// `store.table` (checked to be letters, digits and `_`, optionally
/// schema-qualified) as SQL: each part quoted, so a reserved word such as
/// `user` or `order` names a table too, and lowercased, which is the table the
/// same name unquoted has always meant.
pub(crate) fn sql_identifier(name: &str) -> String {
    name.split('.')
        .map(|part| format!("\"{}\"", part.to_ascii_lowercase()))
        .collect::<Vec<_>>()
        .join(".")
}
