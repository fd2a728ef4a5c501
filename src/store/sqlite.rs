//! The embedded SQLite backend for a single replica: one connection owned by
//! a dedicated thread (SQLite has one writer at a time anyway), WAL with
//! synchronous commits. Times are stored as Unix milliseconds. The request
//! path's statements are in `sqlite/sql.rs`, the operator's in
//! `sqlite/keys.rs`, and opening the file in `sqlite/file.rs`.

mod file;
mod keys;
mod sql;

use std::path::Path;
use std::sync::{Arc, OnceLock, mpsc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, params};
use tokio::sync::oneshot;

use super::{
    Backend, Claim, ClaimRequest, Fence, Forget, KeyFilter, KeyRecord, Migration, PendingClaim,
    PruneBatch, PruneGroup, Release, Settlement, StoreError, WonFrom,
};
use crate::config::StoreConfig;
use file::{OpenedFile, creatable, from_root, open_connection, writable};
use sql::Statements;

/// Work for the store's thread.
enum Job {
    /// Runs on its own, managing its own transaction.
    Alone(Box<dyn FnOnce(&mut Connection) + Send>),
    /// Joins a group commit: claims and settles queued together share one
    /// transaction and one fsync, each inside its own savepoint, and are
    /// answered only once the group has committed.
    Grouped(Grouped),
}

/// Runs a grouped job (or learns that the group could not begin) and returns
/// what answers it once the commit's fate is known.
type Grouped = Box<dyn FnOnce(Result<&Connection, &str>) -> Answer + Send>;
type Answer = Box<dyn FnOnce(Result<(), &str>) + Send>;

/// Most jobs one group commit takes.
const MAX_GROUP: usize = 256;

/// Claims recorded in an SQLite file.
pub struct SqliteStore {
    jobs: mpsc::Sender<Job>,
    /// The database's files as opened, to notice them deleted or replaced.
    files: Vec<OpenedFile>,
    table: String,
    sql: Statements,
    keys: Arc<keys::Statements>,
    /// `store.timeout`: a claim still queued this long after it was queued
    /// has had its answer (503) and is not run.
    give_up_after: Duration,
}

struct Prior {
    status: String,
    payload_sha256: Option<Vec<u8>>,
    received_at: i64,
}

impl SqliteStore {
    /// Which of the database's files its path no longer leads to, if one,
    /// and what that means.
    pub(super) fn file_gone(&self) -> Option<String> {
        let gone = self.files.iter().find(|file| !file.still_there())?;
        Some(format!(
            "{} was deleted, moved or replaced while the proxy had it open: the proxy goes on using the file it opened, which is lost when it stops, and another process opening the path would not see its keys (or would corrupt the database, for a -wal or -shm file); stop the proxy and put the files back",
            gone.path
        ))
    }

    /// Opens (creating if needed) the database file and starts its thread.
    pub fn open(path: &str, config: &StoreConfig) -> Result<Self, StoreError> {
        Self::open_with(path, config, true)
    }

    /// Opens the database file, creating it only if `create`; a missing
    /// file without `create` is a missing table (or an error, when its
    /// directory is missing too).
    pub fn open_with(path: &str, config: &StoreConfig, create: bool) -> Result<Self, StoreError> {
        if let Some(log) = file::orphaned_log(path) {
            return Err(StoreError::Sqlite(format!(
                "there is no SQLite file at {}, but its write-ahead log {} is there: the database was moved or deleted while a process had it open, and its latest writes are in that log. Stop whatever still has it open, then put the file back; a new database created here would discard them (if the file was deleted rather than moved, its keys are lost but for that log: removing the -wal and -shm files lets a new, empty database start)",
                from_root(Path::new(path)).display(),
                log.display()
            )));
        }
        if !create && !Path::new(path).exists() {
            // Start-up would create the file, but not its directory, nor a
            // file in a directory it may not write to.
            return match creatable(path) {
                Ok(()) => Err(StoreError::MissingTable(format!(
                    "no such table: {}",
                    config.table
                ))),
                Err(reason) => Err(StoreError::Sqlite(format!(
                    "cannot open {}: {reason}",
                    from_root(Path::new(path)).display()
                ))),
            };
        }
        if config.table.contains('.') {
            return Err(StoreError::Sqlite(format!(
                "store.table `{}`: SQLite tables cannot be schema-qualified",
                config.table
            )));
        }
        let connection =
            open_connection(Path::new(path), config.timeout, create).map_err(|error| {
                StoreError::Sqlite(format!(
                    "cannot open {}: {}",
                    from_root(Path::new(path)).display(),
                    open_failure(path, create, &error)
                ))
            })?;
        if create {
            writable(&connection).map_err(|reason| {
                StoreError::Sqlite(format!("cannot write to {path}: {reason}"))
            })?;
        }
        // While a connection is open, SQLite keeps the -wal and -shm files.
        let files = ["", "-wal", "-shm"]
            .into_iter()
            .filter_map(|suffix| OpenedFile::at(format!("{path}{suffix}")))
            .collect();
        let (jobs, queue) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("dedupe-sqlite".into())
            .spawn(move || serve(connection, &queue))
            .map_err(|error| StoreError::Sqlite(error.to_string()))?;
        Ok(Self {
            jobs,
            files,
            table: config.table.clone(),
            sql: Statements::new(&config.table),
            keys: Arc::new(keys::Statements::new(&config.table)),
            give_up_after: config.timeout,
        })
    }

    /// Whether claims could be written now: the database's write lock can be
    /// had within `store.timeout`, and a write commits. A reader's probe
    /// passes while another process holds the lock (WAL lets reads
    /// through), and taking the lock alone while the disk refuses writes (it
    /// is full, or was remounted read-only), and every claim fails
    /// meanwhile. The write sets the header's `user_version` to the value it
    /// has: one page committed, nothing changed.
    pub(super) async fn take_write_lock(&self) -> Result<(), StoreError> {
        self.call(|connection| {
            let transaction =
                connection.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let version: i64 =
                transaction.pragma_query_value(None, "user_version", |row| row.get(0))?;
            transaction.pragma_update(None, "user_version", version)?;
            transaction.commit()
        })
        .await
    }

    /// Runs `work` on the store's thread, on its own.
    async fn call<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, result) = oneshot::channel();
        let job = Job::Alone(Box::new(move |connection| {
            let _ = reply.send(work(connection).map_err(sqlite_error));
        }));
        self.jobs.send(job).map_err(|_| stopped())?;
        result.await.map_err(|_| stopped())?
    }

    /// Runs `work` on the store's thread in a transaction that takes the
    /// write lock first, and commits it only if its caller still waits for
    /// the answer. The caller waits `store.timeout`; past it, a write not yet
    /// committing is abandoned (rolled back, or never begun) and answered
    /// [`StoreError::Timeout`], and a commit already begun is waited for.
    /// SQLite's own wait for the lock is as long, so without this a lock
    /// freed at the last moment let the write commit after its caller had
    /// been told it timed out: an operator's `keys forget` said it failed
    /// and had forgotten the key.
    async fn call_decisive<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let verdict = Arc::new(Verdict::default());
        let (reply, mut result) = oneshot::channel();
        let job_verdict = Arc::clone(&verdict);
        let job = Job::Alone(Box::new(move |connection| {
            let _ = reply.send(commit_unless_abandoned(connection, &job_verdict, work));
        }));
        // A caller dropped before the write commits (its own deadline, the
        // operator's Ctrl-C) abandons it too: no one would be told.
        let abandon_if_dropped = AbandonOnDrop(verdict);
        self.jobs.send(job).map_err(|_| stopped())?;
        let answer = match tokio::time::timeout(self.give_up_after, &mut result).await {
            Ok(answer) => answer,
            Err(_) if abandon_if_dropped.0.decide(Verdict::ABANDON) => {
                return Err(StoreError::Timeout(self.give_up_after));
            }
            Err(_) => result.await,
        };
        answer.map_err(|_| stopped())?
    }

    /// Runs `work` on the store's thread as part of a group commit; the
    /// result is returned only once it is durable.
    async fn call_grouped<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.queue_grouped(None, work)?
            .await
            .map_err(|_| stopped())?
    }

    /// Queues `work` for a group commit; its result arrives on the receiver
    /// once durable. The work is run even if the receiver is dropped first,
    /// unless it is still queued `give_up_after` after it was queued: then
    /// it is answered [`StoreError::Timeout`] and not run.
    fn queue_grouped<T: Send + 'static>(
        &self,
        give_up_after: Option<Duration>,
        work: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<oneshot::Receiver<Result<T, StoreError>>, StoreError> {
        let (reply, result) = oneshot::channel();
        let queued_at = Instant::now();
        let job = Job::Grouped(Box::new(move |connection| {
            let outcome = match connection {
                Err(error) => Err(StoreError::Sqlite(format!("cannot begin: {error}"))),
                Ok(_)
                    if let Some(limit) =
                        give_up_after.filter(|&limit| queued_at.elapsed() >= limit) =>
                {
                    Err(StoreError::Timeout(limit))
                }
                // SQLite rolls a whole transaction back on some errors (a
                // full disk, an I/O error): run now, the work would be
                // committed on its own, and then answered as failed with
                // the rest of the group.
                Ok(connection) if connection.is_autocommit() => Err(StoreError::Sqlite(
                    "the group's transaction was rolled back by an earlier error".into(),
                )),
                Ok(connection) => in_savepoint(connection, work).map_err(sqlite_error),
            };
            Box::new(move |committed: Result<(), &str>| {
                let answer = match committed {
                    Ok(()) => outcome,
                    Err(error) => Err(StoreError::Sqlite(format!("commit failed: {error}"))),
                };
                let _ = reply.send(answer);
            })
        }));
        self.jobs.send(job).map_err(|_| stopped())?;
        Ok(result)
    }

    /// A column missing from an existing table: `store.table` names some
    /// other table.
    fn shape_error(&self, error: StoreError) -> StoreError {
        match error {
            StoreError::Sqlite(problem) if problem.starts_with("no such column") => {
                self.not_claims_table(problem)
            }
            other => other,
        }
    }

    fn not_claims_table(&self, problem: String) -> StoreError {
        StoreError::NotClaimsTable {
            // As `migrate` says it: `store.table` is case-insensitive.
            table: self.table.to_ascii_lowercase(),
            problem,
        }
    }
}

/// Why the file at `path` could not be opened (created if `create`).
fn open_failure(path: &str, create: bool, error: &rusqlite::Error) -> String {
    // SQLite says only "unable to open database file", whatever the cause.
    // A parent that is a file makes `try_exists` fail.
    match Path::new(path).try_exists() {
        Ok(true) if Path::new(path).is_dir() => "it is a directory".to_owned(),
        Ok(false) | Err(_) if create => creatable(path).err().unwrap_or(error.to_string()),
        // A file this process may read but not write, or one whose -wal and
        // -shm files it may not create beside it.
        _ if error.sqlite_error_code() == Some(rusqlite::ErrorCode::ReadOnly) => {
            format!("{error} ({})", file::PERMISSIONS_HINT)
        }
        _ => error.to_string(),
    }
}

pub(super) fn stopped() -> StoreError {
    StoreError::Sqlite("the store thread has stopped".into())
}

/// The store thread: runs jobs in order, gathering consecutive grouped jobs
/// into one transaction.
fn serve(mut connection: Connection, queue: &mpsc::Receiver<Job>) {
    let mut next = None;
    loop {
        let job = match next.take() {
            Some(job) => job,
            None => match queue.recv() {
                Ok(job) => job,
                Err(_) => return,
            },
        };
        match job {
            Job::Alone(work) => work(&mut connection),
            Job::Grouped(first) => {
                let mut group = vec![first];
                while group.len() < MAX_GROUP {
                    match queue.try_recv() {
                        Ok(Job::Grouped(job)) => group.push(job),
                        Ok(other) => {
                            next = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                commit_group(&connection, group);
            }
        }
    }
}

fn commit_group(connection: &Connection, group: Vec<Grouped>) {
    // IMMEDIATE takes the write lock first, so every read in the group sees
    // the rows its own statement then decides on.
    if let Err(error) = connection.execute_batch("BEGIN IMMEDIATE") {
        let error = error.to_string();
        for job in group {
            job(Err(&error))(Err(&error));
        }
        return;
    }
    let answers: Vec<Answer> = group.into_iter().map(|job| job(Ok(connection))).collect();
    let committed = connection.execute_batch("COMMIT").map_err(|error| {
        let _ = connection.execute_batch("ROLLBACK");
        error.to_string()
    });
    for answer in answers {
        answer(committed.as_ref().map(|_| ()).map_err(String::as_str));
    }
}

/// What keeps `table`, which has the claims table's columns, from being the
/// claims table: a view, or no unique index for the claims' `ON CONFLICT`.
fn shape_problem(connection: &Connection, table: &str) -> rusqlite::Result<Option<String>> {
    let (kind, keyed): (String, bool) =
        connection.query_row(sql::SHAPE, [table], |row| Ok((row.get(0)?, row.get(1)?)))?;
    Ok(sql::shape_problem(&kind, keyed))
}

/// Whether an operator's write commits: decided once, by the write about to
/// commit or by its caller giving up, whichever comes first.
#[derive(Default)]
struct Verdict(OnceLock<bool>);

impl Verdict {
    const COMMIT: bool = true;
    const ABANDON: bool = false;

    /// Whether this decision is the one that counts.
    fn decide(&self, commit: bool) -> bool {
        self.0.set(commit).is_ok()
    }
}

struct AbandonOnDrop(Arc<Verdict>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        self.0.decide(Verdict::ABANDON);
    }
}

fn commit_unless_abandoned<T>(
    connection: &mut Connection,
    verdict: &Verdict,
    work: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> Result<T, StoreError> {
    let abandoned = || StoreError::Sqlite("abandoned by its caller, nothing was written".into());
    // Not begun at all when the caller has already gone: beginning would
    // wait for the write lock to no purpose, holding up the jobs behind.
    if verdict.0.get() == Some(&Verdict::ABANDON) {
        return Err(abandoned());
    }
    let transaction = connection
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(sqlite_error)?;
    let value = work(&transaction).map_err(sqlite_error)?;
    if !verdict.decide(Verdict::COMMIT) {
        // Dropping the transaction rolls it back.
        return Err(abandoned());
    }
    transaction.commit().map_err(sqlite_error)?;
    Ok(value)
}

/// Runs `work` so that its failure undoes only its own writes.
fn in_savepoint<T>(
    connection: &Connection,
    work: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    connection.execute_batch("SAVEPOINT job")?;
    match work(connection) {
        Ok(value) => {
            connection.execute_batch("RELEASE job")?;
            Ok(value)
        }
        Err(error) => {
            connection.execute_batch("ROLLBACK TO job; RELEASE job")?;
            Err(error)
        }
    }
}

fn sqlite_error(error: rusqlite::Error) -> StoreError {
    match &error {
        rusqlite::Error::SqliteFailure(_, Some(message))
            if message.starts_with("no such table") =>
        {
            StoreError::MissingTable(message.clone())
        }
        _ => StoreError::Sqlite(error.to_string()),
    }
}

fn now_ms() -> i64 {
    ms_since_epoch(SystemTime::now())
}

/// A time as the table stores it.
fn ms_since_epoch(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |since| {
        i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
    })
}

impl Backend for SqliteStore {
    async fn migrate(&self) -> Result<Migration, StoreError> {
        let (create_table, probe) = (self.sql.create_table.clone(), self.sql.probe.clone());
        let table = self.table.clone();
        self.call(move |connection| {
            // Under the write lock, so that of several processes migrating
            // one new file, one finds no table and creates it.
            let transaction =
                connection.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let existed: bool = transaction.query_row(
                "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND lower(name) = lower(?1))",
                [&table],
                |row| row.get(0),
            )?;
            transaction.execute_batch(&create_table)?;
            transaction.prepare(&probe).map(drop)?;
            if let Some(problem) = shape_problem(&transaction, &table)? {
                return Ok(Err(problem));
            }
            let has_index: bool = transaction.query_row(sql::INDEXED, [&table], |row| row.get(0))?;
            if !has_index {
                let mut name_taken = transaction.prepare(
                    "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE lower(name) = lower(?1))",
                )?;
                let create_index = sql::create_index(&table, |name| {
                    name_taken.query_row([name], |row| row.get(0))
                })?;
                drop(name_taken);
                transaction.execute_batch(&create_index)?;
            }
            transaction.commit()?;
            Ok(Ok(Migration::after(existed, has_index)))
        })
        .await
        .map_err(|error| self.shape_error(error))?
        .map_err(|problem| self.not_claims_table(problem))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let (probe, table) = (self.sql.probe.clone(), self.table.clone());
        let problem = self
            .call(move |connection| {
                connection.prepare(&probe)?.query([]).map(drop)?;
                shape_problem(connection, &table)
            })
            .await
            .map_err(|error| self.shape_error(error))?;
        if let Some(problem) = problem {
            return Err(self.not_claims_table(problem));
        }
        match self.file_gone() {
            None => Ok(()),
            Some(gone) => Err(StoreError::Sqlite(gone)),
        }
    }

    fn queue_claim(&self, request: &ClaimRequest) -> Result<PendingClaim, StoreError> {
        let (prior_sql, claim_sql) = (self.sql.prior.clone(), self.sql.claim.clone());
        let request = request.clone();
        self.queue_grouped(Some(self.give_up_after), move |connection| {
            let now = now_ms();
            let lease_ms = i64::try_from(request.lease.as_millis()).unwrap_or(i64::MAX);
            let source: &str = &request.source;
            // Only classifies the result; the INSERT below decides, and no
            // other writer can run in between (the group holds the write lock).
            let prior = connection
                .prepare_cached(&prior_sql)?
                .query_row(params![source, request.key], |row| {
                    Ok(Prior {
                        status: row.get(0)?,
                        payload_sha256: row.get(1)?,
                        received_at: row.get(2)?,
                    })
                })
                .optional()?;
            let won: Option<i32> = connection
                .prepare_cached(&claim_sql)?
                .query_row(
                    params![
                        source,
                        request.key,
                        &request.payload_sha256[..],
                        now,
                        now.saturating_add(lease_ms),
                        request.reject_mismatch
                    ],
                    |row| row.get(0),
                )
                .optional()?;
            Ok(classify(won, prior, &request.payload_sha256, now))
        })
    }

    async fn settle(
        &self,
        source: &str,
        key: &str,
        fence: Fence,
        settlement: Settlement,
    ) -> Result<bool, StoreError> {
        let sql = self.sql.settle.clone();
        let (source, key) = (source.to_owned(), key.to_owned());
        self.call_grouped(move |connection| {
            let updated = connection.prepare_cached(&sql)?.execute(params![
                source,
                key,
                fence.attempt,
                ms_since_epoch(fence.claimed_at),
                settlement.status.as_str(),
                settlement.response_status,
                now_ms()
            ])?;
            Ok(updated == 1)
        })
        .await
    }

    async fn list(&self, filter: &KeyFilter) -> Result<Vec<KeyRecord>, StoreError> {
        let (keys, filter) = (Arc::clone(&self.keys), filter.clone());
        self.call(move |connection| keys.list(connection, &filter))
            .await
    }

    async fn show(&self, source: &str, key: &str) -> Result<Option<KeyRecord>, StoreError> {
        let (keys, source, key) = (Arc::clone(&self.keys), source.to_owned(), key.to_owned());
        self.call(move |connection| keys.show(connection, &source, &key))
            .await
    }

    async fn forget(&self, source: &str, key: &str, force: bool) -> Result<Forget, StoreError> {
        let (keys, source, key) = (Arc::clone(&self.keys), source.to_owned(), key.to_owned());
        self.call_decisive(move |connection| {
            keys.forget(connection, &source, &key, force, now_ms())
        })
        .await
    }

    async fn release(&self, source: &str, key: &str) -> Result<Release, StoreError> {
        let (keys, source, key) = (Arc::clone(&self.keys), source.to_owned(), key.to_owned());
        self.call_decisive(move |connection| keys.release(connection, &source, &key, now_ms()))
            .await
    }

    async fn prune(&self, group: &PruneGroup, limit: u32) -> Result<PruneBatch, StoreError> {
        let (keys, group) = (Arc::clone(&self.keys), group.clone());
        self.call_decisive(move |connection| keys.prune(connection, &group, limit, now_ms()))
            .await
    }
}

fn classify(won: Option<i32>, prior: Option<Prior>, payload_sha256: &[u8; 32], now: i64) -> Claim {
    let payload_mismatch = prior
        .as_ref()
        .and_then(|prior| prior.payload_sha256.as_deref())
        .is_some_and(|stored| stored != payload_sha256);
    match (won, prior) {
        (Some(attempt), prior) => Claim::Won {
            fence: Fence {
                attempt,
                claimed_at: keys::from_ms(now),
            },
            from: match prior.as_ref().map(|prior| prior.status.as_str()) {
                None => WonFrom::New,
                Some("processing") => WonFrom::ExpiredLease,
                Some(_) => WonFrom::Failed,
            },
            payload_mismatch,
        },
        (None, Some(prior)) if prior.status == "done" => Claim::Done {
            age: Duration::from_millis(u64::try_from(now - prior.received_at).unwrap_or(0)),
            payload_mismatch,
        },
        (None, _) => Claim::InFlight { payload_mismatch },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &tempfile::TempDir, timeout: Duration) -> SqliteStore {
        let config = StoreConfig {
            timeout,
            ..StoreConfig::default()
        };
        let path = dir.path().join("dedupe.db");
        SqliteStore::open(path.to_str().unwrap(), &config).unwrap()
    }

    #[test]
    fn a_file_this_process_may_not_write_is_opened_with_what_to_check() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedupe.db");
        Connection::open(&path).unwrap();
        // What opening for writes meets where the file is read-only to it.
        let read_only =
            Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
        let error = read_only
            .pragma_update(None, "journal_mode", "WAL")
            .unwrap_err();
        let reason = open_failure(path.to_str().unwrap(), true, &error);
        assert!(
            reason.contains("readonly") && reason.contains(file::PERMISSIONS_HINT),
            "{reason}"
        );
    }

    /// Keeps the store's thread busy until the sender is dropped, so that
    /// what is queued meanwhile runs together afterwards.
    fn hold_thread(store: &SqliteStore) -> mpsc::Sender<()> {
        let (release, released) = mpsc::channel::<()>();
        let hold = Job::Alone(Box::new(move |_| {
            let _ = released.recv();
        }));
        assert!(store.jobs.send(hold).is_ok());
        release
    }

    async fn rows(store: &SqliteStore) -> i64 {
        store
            .call(|connection| {
                connection.query_row("SELECT count(*) FROM processed_events", [], |row| {
                    row.get(0)
                })
            })
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_claim_still_queued_when_its_caller_has_given_up_is_not_run() {
        let dir = tempfile::tempdir().unwrap();
        let give_up_after = Duration::from_millis(50);
        let store = open(&dir, give_up_after);
        store.migrate().await.unwrap();
        let release = hold_thread(&store);
        let pending = store.queue_claim(&ClaimRequest::for_test("late")).unwrap();
        // Past the point where its caller was answered 503.
        tokio::time::sleep(give_up_after).await;
        drop(release);
        let answer = pending.await.unwrap();
        assert!(
            matches!(answer, Err(StoreError::Timeout(limit)) if limit == give_up_after),
            "{answer:?}"
        );
        assert_eq!(rows(&store).await, 0);
    }

    #[tokio::test]
    async fn an_operator_write_still_queued_when_its_caller_gives_up_is_not_made() {
        let dir = tempfile::tempdir().unwrap();
        let give_up_after = Duration::from_millis(50);
        let store = open(&dir, give_up_after);
        store.migrate().await.unwrap();
        store
            .queue_claim(&ClaimRequest::for_test("kept"))
            .unwrap()
            .await
            .unwrap()
            .unwrap();
        let release = hold_thread(&store);
        let answer = store.forget("orders", "kept", true).await;
        assert!(
            matches!(answer, Err(StoreError::Timeout(limit)) if limit == give_up_after),
            "{answer:?}"
        );
        drop(release);
        assert_eq!(
            rows(&store).await,
            1,
            "answered as timed out, so not deleted"
        );
    }

    #[tokio::test]
    async fn an_operator_write_that_outlasts_its_caller_is_rolled_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir, Duration::from_millis(50));
        store.migrate().await.unwrap();
        let (finish, finished) = mpsc::channel::<()>();
        let answer = store
            .call_decisive(move |connection| {
                connection.execute_batch(
                    "INSERT INTO processed_events (source, event_id, status, attempts, received_at, claimed_at) VALUES ('src', 'late', 'done', 1, 0, 0)",
                )?;
                // Still writing when the caller's wait ends.
                let _ = finished.recv();
                Ok(())
            })
            .await;
        assert!(matches!(answer, Err(StoreError::Timeout(_))), "{answer:?}");
        drop(finish);
        assert_eq!(
            rows(&store).await,
            0,
            "answered as timed out, so not written"
        );
    }

    #[test]
    fn a_write_that_has_begun_to_commit_cannot_be_abandoned_and_the_reverse() {
        let committing = Verdict::default();
        assert!(committing.decide(Verdict::COMMIT));
        assert!(
            !committing.decide(Verdict::ABANDON),
            "the caller waits for the commit"
        );
        let abandoned = Arc::new(Verdict::default());
        drop(AbandonOnDrop(Arc::clone(&abandoned)));
        assert!(!abandoned.decide(Verdict::COMMIT), "the write rolls back");
    }

    #[tokio::test]
    async fn work_queued_behind_a_rolled_back_group_is_not_committed_on_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir, Duration::from_secs(10));
        store.migrate().await.unwrap();
        let release = hold_thread(&store);
        // As SQLite does itself on some errors (a full disk, an I/O error).
        let rolled_back = store
            .queue_grouped(None, |connection| connection.execute_batch("ROLLBACK"))
            .unwrap();
        let after = store.queue_claim(&ClaimRequest::for_test("after")).unwrap();
        drop(release);
        assert!(rolled_back.await.unwrap().is_err());
        let answer = after.await.unwrap();
        assert!(answer.is_err(), "{answer:?}");
        assert_eq!(rows(&store).await, 0, "answered as failed, so not written");
    }
}
