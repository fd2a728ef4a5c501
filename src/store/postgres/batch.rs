//! Claims and settles coalesced into multi-row statements: the queues, the
//! rounds that keep a key out of a statement twice, a refused statement
//! retried key by key so that it fails only its own requests, and the
//! settles. The claims, with the take-back of keys a claim found failed or
//! expired, are in `batch/claim.rs`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};
use tokio_util::sync::CancellationToken;

mod claim;
mod held;

pub(super) use claim::TakingBack;
pub(super) use held::HeldClaims;

use super::sql::Statements;
use super::{Connection, Params, Session, postgres_error};
use crate::store::coalesce::{Coalescer, Lane, Limits, Outcome, Replies};
use crate::store::{Claim, ClaimRequest, Fence, Settlement, StoreError};

/// The coalescing queues, started on first use (they need a runtime).
pub(super) struct Batches {
    pub(super) claims: Coalescer<ClaimRequest, Claim>,
    pub(super) settles: Coalescer<SettleRequest, bool>,
}

/// One queued settle.
pub(super) struct SettleRequest {
    pub(super) source: String,
    pub(super) key: String,
    pub(super) fence: Fence,
    pub(super) settlement: Settlement,
}

/// Most keys one statement claims or settles.
const MAX_BATCH: usize = 256;

/// Claim statements (and, separately, settle statements) one replica runs at
/// once on connections of their own, at most; batches pipelined behind one
/// share its connection ([`CLAIMS_BEHIND`]). Normally one: while it is at
/// the database, everything arriving queues for the next, so under load the
/// database runs one statement and one commit for dozens of keys instead of
/// one each, and spends its CPU on rows rather than on round trips. Under
/// light load a request still finds the slot free and goes out alone. The
/// second slot opens only for [`STALLED_AFTER`].
const BATCHES_IN_FLIGHT: usize = 2;

/// How long a batch may be at the database before the next goes out beside
/// it: long enough that a busy database's commits never reach it (a batch of
/// 256 keys commits in a few milliseconds), short enough that a batch
/// waiting on a row another replica is inserting, or on a lock a client
/// holds, delays the claims queued behind it by no more than this.
const STALLED_AFTER: Duration = Duration::from_millis(20);

/// How long every batch out must have been at the database before one more
/// goes out beside them: far past what a busy database takes for any batch
/// (a few milliseconds), so only batches waiting on rows another
/// transaction holds (an operator's open transaction, a long `UPDATE`) are
/// counted stuck; one such row, or one key claimed twice, holds one batch,
/// but two would hold both slots, and every claim or settle behind them.
const STUCK_AFTER: Duration = Duration::from_millis(250);

/// Most batches out beyond [`BATCHES_IN_FLIGHT`] while those are stuck.
const MAX_STUCK: usize = 4;

/// Claim batches sent behind the one at the database while claims come back
/// read-only (see `Lane::Behind`).
const CLAIMS_BEHIND: usize = 2;

impl Batches {
    /// Starts the claim and settle queues on the current runtime.
    /// Claims still queued `claim_timeout` after they were queued are
    /// answered timed out (their requests have been answered 503); settles
    /// always run.
    pub(super) fn start(
        session: &Arc<Session>,
        sql: &Arc<Statements>,
        claim_timeout: Duration,
    ) -> Self {
        let pool_size = session.pool.status().max_size;
        // What the pool holds beyond the claims' and settles' own slots,
        // their pipeline and a spare (the pruner, a readiness probe), shared
        // between the two queues.
        let stuck = (pool_size.saturating_sub(2 * BATCHES_IN_FLIGHT + 2) / 2).min(MAX_STUCK);
        let settle_limits = Limits {
            in_flight: BATCHES_IN_FLIGHT.min(pool_size),
            max_batch: MAX_BATCH,
            stalled_after: STALLED_AFTER,
            stuck,
            // Well before a request queued behind them is given up on.
            stuck_after: STUCK_AFTER.min(claim_timeout / 2),
            unlocked: true,
            behind: 0,
            give_up_after: None,
        };
        // The pipeline holds one connection for as long as batches overlap;
        // a small pool keeps it for the stalled batch's slot and the settles.
        let pipelining = pool_size >= BATCHES_IN_FLIGHT + 2;
        let claim_limits = Limits {
            behind: if pipelining { CLAIMS_BEHIND } else { 0 },
            // A claim's insert may wait on a row another transaction is
            // inserting, and cannot skip it: the key is that row's to decide.
            unlocked: false,
            give_up_after: Some(claim_timeout),
            ..settle_limits
        };
        let runner = BatchRunner {
            session: Arc::clone(session),
            sql: Arc::clone(sql),
            connection: None,
            stuck_after: settle_limits.stuck_after,
        };
        let settle_runner = runner.clone();
        Self {
            claims: Coalescer::start(claim_limits, move |batch, lane, replies| {
                runner.clone().claim_batch(batch, lane, replies)
            }),
            settles: Coalescer::start(settle_limits, move |batch, lane, replies| {
                settle_runner.clone().settle_batch(batch, lane, replies)
            }),
        }
    }
}

/// The indices of `requests` in rounds in which no key comes twice, each
/// round holding the first of every key still left, in queue order: one
/// statement decides a row once, so a key's second request waits for the
/// first's outcome to be committed.
fn rounds<'a, R, S, K>(requests: &'a [R], key: impl Fn(&'a R) -> (&'a S, &'a K)) -> Vec<Vec<usize>>
where
    S: Eq + std::hash::Hash + ?Sized + 'a,
    K: Eq + std::hash::Hash + ?Sized + 'a,
{
    let mut rounds = Vec::new();
    let mut pending: Vec<usize> = (0..requests.len()).collect();
    while !pending.is_empty() {
        let mut keys = HashSet::new();
        let (round, later): (Vec<usize>, Vec<usize>) = pending
            .into_iter()
            .partition(|&i| keys.insert(key(&requests[i])));
        rounds.push(round);
        pending = later;
    }
    rounds
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
pub(super) struct Growth {
    inserted: AtomicU64,
    next_analyze_at: AtomicU64,
}

const ANALYZE_FIRST_AT: u64 = 1_000;
const ANALYZE_GROWTH: u64 = 8;

impl Growth {
    pub(super) fn new() -> Self {
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

impl Outcome for Claim {
    fn read_only(&self) -> bool {
        !matches!(self, Claim::Won { .. })
    }
}

/// What a batch needs of the store, owned so batches can run on their own.
#[derive(Clone)]
struct BatchRunner {
    session: Arc<Session>,
    sql: Arc<Statements>,
    /// The connection the batch's statements go to; without one, each takes
    /// a connection from the pool.
    connection: Option<Arc<Connection>>,
    /// How long a settle statement may wait before the keys it has not
    /// reached are settled beside it (see `settle_unlocked`), and a claim
    /// statement before its keys are held (see [`HeldClaims`]).
    stuck_after: Duration,
}

impl BatchRunner {
    /// Runs a claim or settle statement on the batch's connection, or on one
    /// from the pool.
    async fn query(&self, sql: &str, params: &Params<'_>) -> Result<Vec<Row>, StoreError> {
        match &self.connection {
            Some(connection) => self.session.query_on(connection, sql, params).await,
            None => self.session.query(sql, params).await,
        }
    }

    /// One claim statement for the round; if the database refuses it (rather
    /// than being unreachable), each key is retried alone, so that a row it
    /// cannot take fails only its own request.
    /// `decided_early` is given a key's outcome as soon as it is final, if
    /// that is before the round is done.
    async fn isolated<R: Round>(
        &self,
        requests: &[&R],
        decided_early: &(dyn Fn(usize, &R::Outcome) + Sync),
    ) -> Vec<Result<R::Outcome, StoreError>> {
        match R::run(self, requests, decided_early).await {
            Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
            Err(StoreError::Refused(_)) if requests.len() > 1 => {
                let mut outcomes = Vec::with_capacity(requests.len());
                for request in requests {
                    let outcome = R::run(self, &[*request], &|_, _| {}).await;
                    outcomes.push(outcome.map(|mut one| one.remove(0)));
                }
                outcomes
            }
            Err(error) => vec![Err(error); requests.len()],
        }
    }

    /// Settles a batch; as with claims, a refused statement is retried one
    /// key at a time, and a key queued twice is settled in a later round:
    /// one statement updates a row once, with whichever of its input rows
    /// PostgreSQL picks, and a `done` must win over its own attempt's
    /// release whichever comes first. A key settled before the rest of its
    /// round (see `settle_several`) has its reply at once.
    ///
    /// A round goes out in key order (byte order, as claims lock theirs):
    /// the statement locks rows in the order of its input, so two batches
    /// sharing keys wait on each other instead of deadlocking. (That is the
    /// plan of an analyzed table, an index lookup per input row. A table too
    /// young to have been analyzed may be joined by hash, in the heap's
    /// order; a deadlock then costs the server's `deadlock_timeout` and a
    /// rerun.) Sorting here, not in the statement, costs the database
    /// nothing: a locking sort there would write a lock record for every row
    /// it then updates anyway.
    ///
    /// A batch sent while every slot holds a stuck one ([`Lane::Unlocked`])
    /// waits on no row lock: see `settle_without_waiting`.
    async fn settle_batch(
        self,
        requests: Vec<SettleRequest>,
        lane: Lane,
        replies: Replies<bool>,
    ) -> Vec<Result<bool, StoreError>> {
        fn key(r: &SettleRequest) -> (&str, &str) {
            (r.source.as_str(), r.key.as_str())
        }
        let rounds = rounds(&requests, |r| (&r.source, &r.key));
        // A key queued twice is in the first rounds, once each.
        let queued: HashMap<(&str, &str), usize> = if rounds.len() > 1 {
            requests.iter().fold(HashMap::new(), |mut counts, r| {
                *counts.entry(key(r)).or_default() += 1;
                counts
            })
        } else {
            HashMap::new()
        };
        let mut outcomes = vec![Ok(false); requests.len()];
        for (number, mut round) in rounds.into_iter().enumerate() {
            round.sort_unstable_by_key(|&i| key(&requests[i]));
            let sorted: Vec<&SettleRequest> = round.iter().map(|&i| &requests[i]).collect();
            // Not early, where a later round settles the key again: its
            // release alone would leave the key `failed`, to be taken back
            // and forwarded again, until the `done` after it can land.
            let alone_in_batch: Vec<bool> = sorted
                .iter()
                .map(|r| queued.get(&key(r)).is_none_or(|&count| count <= number + 1))
                .collect();
            let settled_early = |position: usize| replies.send(round[position], Ok(true));
            let round_outcomes = if lane == Lane::Unlocked {
                self.settle_without_waiting(&sorted).await
            } else {
                self.settle_isolated(&sorted, &alone_in_batch, settled_early)
                    .await
            };
            for (&index, outcome) in round.iter().zip(round_outcomes) {
                outcomes[index] = outcome;
            }
        }
        outcomes
    }

    /// One settle statement for the round; if the database refuses it, each
    /// key not settled beside it is retried alone, so that a row it cannot
    /// settle fails only its own request.
    async fn settle_isolated(
        &self,
        requests: &[&SettleRequest],
        may_go_early: &[bool],
        settled_early: impl Fn(usize),
    ) -> Vec<Result<bool, StoreError>> {
        let (outcome, beside) = match requests {
            [one] => (
                self.settle_one(one).await.map(|settled| vec![settled]),
                None,
            ),
            _ => {
                self.settle_several(requests, may_go_early, settled_early)
                    .await
            }
        };
        let beside = beside.unwrap_or_else(|| Beside::nothing(requests.len()));
        match outcome {
            Ok(settled) => settled
                .into_iter()
                .enumerate()
                .map(|(position, settled)| beside.or(position, settled))
                .collect(),
            Err(StoreError::Refused(_)) if requests.len() > 1 => {
                let mut outcomes = Vec::with_capacity(requests.len());
                for (position, request) in requests.iter().enumerate() {
                    outcomes.push(if beside.settled[position] {
                        Ok(true)
                    } else {
                        match self.settle_one(request).await {
                            Ok(settled) => beside.or(position, settled),
                            Err(error) => Err(error),
                        }
                    });
                }
                outcomes
            }
            Err(error) => (0..requests.len())
                .map(|position| {
                    if beside.settled[position] {
                        Ok(true)
                    } else {
                        Err(error.clone())
                    }
                })
                .collect(),
        }
    }

    /// Settles one key: whether it was settled.
    async fn settle_one(&self, one: &SettleRequest) -> Result<bool, StoreError> {
        let params: &Params<'_> = &[
            (&one.source, Type::TEXT),
            (&one.key, Type::TEXT),
            (&one.fence.attempt, Type::INT4),
            (&one.fence.claimed_at, Type::TIMESTAMPTZ),
            (&one.settlement.status.as_str(), Type::TEXT),
            (&response_status(one), Type::INT2),
        ];
        Ok(!self.query(&self.sql.settle_one, params).await?.is_empty())
    }

    /// Settles the round's keys in one statement: whether each was settled,
    /// and what was settled beside it, if anything was tried.
    ///
    /// A statement of several keys still at the database `stuck_after` it
    /// began is most likely waiting on a row another transaction holds (an
    /// operator's open transaction, a long `UPDATE`), and every key after
    /// that row in its order waits with it, unsettled for as long as the
    /// row is held: past their leases another replica would take them back
    /// and forward them again. So the keys in `may_go_early` that no one
    /// holds are then settled beside it (`settle_unlocked`), on a connection
    /// of their own if one is free, and passed to `settled_early`; the
    /// waiting statement finds them settled when it gets to them. Were it
    /// only slow (a slow commit), this settles what it has not yet locked,
    /// which is as correct and costs one more statement.
    async fn settle_several(
        &self,
        requests: &[&SettleRequest],
        may_go_early: &[bool],
        settled_early: impl Fn(usize),
    ) -> (Result<Vec<bool>, StoreError>, Option<Beside>) {
        let arrays = SettleArrays::of(requests.iter().copied());
        // Settle batches have no pipeline: each takes a connection.
        let connection = match self.session.client().await {
            Ok(connection) => connection,
            Err(error) => return (Err(error), None),
        };
        let params = arrays.params();
        let mut statement = std::pin::pin!(self.session.query_on(
            &connection,
            &self.sql.settle,
            &params
        ));
        let (rows, beside) = match tokio::time::timeout(self.stuck_after, &mut statement).await {
            Ok(rows) => (rows, None),
            Err(_stuck) => {
                let done = CancellationToken::new();
                let waited = async {
                    let rows = statement.await;
                    done.cancel();
                    rows
                };
                let beside = self.settle_beside(requests, may_go_early, &settled_early, &done);
                let (rows, beside) = tokio::join!(waited, beside);
                (rows, Some(beside))
            }
        };
        let settled = rows.map(|rows| {
            let mut settled = vec![false; requests.len()];
            for (position, _) in ordinals(&rows, requests.len()) {
                settled[position] = true;
            }
            settled
        });
        (settled, beside)
    }

    /// Settles, beside a waiting settle statement, those of its keys in
    /// `may_go_early` that no transaction holds, and again every
    /// `stuck_after` until `done` (the waiting statement is back) or none
    /// is left: a row another transaction held at one try (the same one, or
    /// a second held row) may be free at the next, and its key's lease runs
    /// on meanwhile. A try that has begun is always finished, since it may
    /// have committed.
    async fn settle_beside(
        &self,
        requests: &[&SettleRequest],
        may_go_early: &[bool],
        settled_early: &impl Fn(usize),
        done: &CancellationToken,
    ) -> Beside {
        let mut beside = Beside::nothing(requests.len());
        loop {
            let left: Vec<usize> = (0..requests.len())
                .filter(|&p| may_go_early[p] && !beside.settled[p] && beside.unknown[p].is_none())
                .collect();
            if left.is_empty() || done.is_cancelled() {
                return beside;
            }
            self.settle_unlocked(requests, &left, settled_early, &mut beside)
                .await;
            tokio::select! {
                () = done.cancelled() => return beside,
                () = tokio::time::sleep(self.stuck_after) => {}
            }
        }
    }

    /// One try of [`BatchRunner::settle_beside`] for the keys at
    /// `positions`, if a connection is free for it at once: the waiting
    /// statement holds one, and waiting for another could hold up every
    /// statement behind.
    async fn settle_unlocked(
        &self,
        requests: &[&SettleRequest],
        positions: &[usize],
        settled_early: &impl Fn(usize),
        beside: &mut Beside,
    ) {
        let Some(connection) = self.session.spare_client().await else {
            tracing::debug!(
                "no connection free to settle the keys of a waiting settle statement beside it"
            );
            return;
        };
        let these: Vec<&SettleRequest> = positions.iter().map(|&p| requests[p]).collect();
        match self.run_settle_unlocked(&connection, &these).await {
            Ok(outcomes) => {
                for (&position, outcome) in positions.iter().zip(outcomes) {
                    if outcome == Unlocked::Settled {
                        beside.settled[position] = true;
                        settled_early(position);
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot settle the keys of a waiting settle statement beside it; they wait with it");
                if error.outcome_unknown() {
                    for &position in positions {
                        beside.unknown[position] = Some(error.clone());
                    }
                }
            }
        }
    }
}

impl BatchRunner {
    /// Settles a round sent while every slot holds a settle statement
    /// waiting on a row another transaction holds, without waiting on any
    /// row lock, on a connection the pool has free at once: otherwise it
    /// would wait behind them for as long as those rows are held, and past
    /// its keys' leases. A key whose row another transaction holds fails,
    /// and is retried in the background like any settle that failed.
    async fn settle_without_waiting(
        &self,
        requests: &[&SettleRequest],
    ) -> Vec<Result<bool, StoreError>> {
        let Some(connection) = self.session.spare_client().await else {
            let error = StoreError::Unreachable(
                "no connection free for a settle while every settle statement waits on a lock another transaction holds (on a row, or the whole table)".into(),
            );
            return vec![Err(error); requests.len()];
        };
        match self.run_settle_unlocked(&connection, requests).await {
            Ok(outcomes) => outcomes
                .into_iter()
                .map(|outcome| match outcome {
                    Unlocked::Settled => Ok(true),
                    Unlocked::NoLongerHeld => Ok(false),
                    Unlocked::Locked => Err(StoreError::RowLocked),
                })
                .collect(),
            Err(error) => vec![Err(error); requests.len()],
        }
    }

    /// Runs `settle_unlocked` for `requests` on `connection`.
    async fn run_settle_unlocked(
        &self,
        connection: &Connection,
        requests: &[&SettleRequest],
    ) -> Result<Vec<Unlocked>, StoreError> {
        let arrays = SettleArrays::of(requests.iter().copied());
        let rows = self
            .session
            .query_on(connection, &self.sql.settle_unlocked, &arrays.params())
            .await?;
        let mut outcomes = vec![Unlocked::NoLongerHeld; requests.len()];
        for (position, row) in ordinals(&rows, requests.len()) {
            outcomes[position] = if row.get::<_, bool>(1) {
                Unlocked::Settled
            } else {
                Unlocked::Locked
            };
        }
        Ok(outcomes)
    }
}

/// What `settle_unlocked` did with a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unlocked {
    Settled,
    /// Another transaction holds its row; it was skipped.
    Locked,
    /// This attempt no longer holds the key (see `Fence`).
    NoLongerHeld,
}

/// What was settled beside a waiting settle statement.
struct Beside {
    settled: Vec<bool>,
    /// Keys whose settle beside it may or may not have been committed: the
    /// connection was lost before its answer.
    unknown: Vec<Option<StoreError>>,
}

impl Beside {
    fn nothing(round: usize) -> Self {
        Self {
            settled: vec![false; round],
            unknown: vec![None; round],
        }
    }

    /// A key's outcome, given whether the waiting statement settled it: a
    /// key the statement found already settled was settled beside it, if
    /// that settle's outcome is unknown.
    fn or(&self, position: usize, settled_by_statement: bool) -> Result<bool, StoreError> {
        if settled_by_statement || self.settled[position] {
            return Ok(true);
        }
        match &self.unknown[position] {
            Some(error) => Err(error.clone()),
            None => Ok(false),
        }
    }
}

/// A settle statement's parameters, one array per column.
struct SettleArrays<'a> {
    sources: Vec<&'a str>,
    keys: Vec<&'a str>,
    attempts: Vec<i32>,
    claimed_at: Vec<SystemTime>,
    statuses: Vec<&'a str>,
    response_statuses: Vec<Option<i16>>,
}

impl<'a> SettleArrays<'a> {
    fn of(requests: impl Iterator<Item = &'a SettleRequest> + Clone) -> Self {
        Self {
            sources: requests.clone().map(|r| r.source.as_str()).collect(),
            keys: requests.clone().map(|r| r.key.as_str()).collect(),
            attempts: requests.clone().map(|r| r.fence.attempt).collect(),
            claimed_at: requests.clone().map(|r| r.fence.claimed_at).collect(),
            statuses: requests
                .clone()
                .map(|r| r.settlement.status.as_str())
                .collect(),
            response_statuses: requests.map(response_status).collect(),
        }
    }

    fn params(&self) -> [(&(dyn ToSql + Sync), Type); 6] {
        [
            (&self.sources, Type::TEXT_ARRAY),
            (&self.keys, Type::TEXT_ARRAY),
            (&self.attempts, Type::INT4_ARRAY),
            (&self.claimed_at, Type::TIMESTAMPTZ_ARRAY),
            (&self.statuses, Type::TEXT_ARRAY),
            (&self.response_statuses, Type::INT2_ARRAY),
        ]
    }
}

/// The positions in a round named by `rows`' first column, the input's
/// ordinal (from 1), each with its row; a row naming no position in the
/// round is skipped.
fn ordinals(rows: &[Row], round: usize) -> impl Iterator<Item = (usize, &Row)> {
    rows.iter()
        .filter_map(|row| Some((usize::try_from(row.get::<_, i64>(0) - 1).ok()?, row)))
        .filter(move |&(position, _)| position < round)
}

/// What one round of a batch runs: claims or settles, as one statement for
/// the round's keys (none twice).
trait Round: Sized {
    /// Each key's result.
    type Outcome: Clone;

    /// `decided_early` as for [`BatchRunner::isolated`].
    async fn run(
        runner: &BatchRunner,
        requests: &[&Self],
        decided_early: &(dyn Fn(usize, &Self::Outcome) + Sync),
    ) -> Result<Vec<Self::Outcome>, StoreError>;
}

/// Refreshes the table's statistics, so that every connection's cached
/// plans are made again for the table as it now is (see `Growth`). A
/// failure (the proxy's user may not own the table) costs only that.
async fn analyze(session: Arc<Session>, sql: Arc<Statements>) {
    let analyzed = async {
        let client = session.client().await?;
        client
            .batch_execute(&sql.analyze)
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

fn response_status(request: &SettleRequest) -> Option<i16> {
    request
        .settlement
        .response_status
        .map(|status| i16::try_from(status).unwrap_or(i16::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StoreConfig;
    use crate::store::coalesce::Lane;
    use crate::store::postgres::PostgresStore;
    use crate::store::{Backend, SettledStatus, WonFrom};

    async fn connect(url: &str) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .expect("DATABASE_URL names a reachable server");
        tokio::spawn(connection);
        client
    }

    const DONE: Settlement = Settlement {
        status: SettledStatus::Done,
        response_status: Some(200),
    };

    /// A store on a table of its own, on connections whose transactions
    /// default to `isolation`, and a client beside it.
    struct Scratch {
        store: PostgresStore,
        client: tokio_postgres::Client,
        table: String,
        url: String,
    }

    impl Scratch {
        async fn new(isolation: &str) -> Self {
            Self::with_settings(isolation, &[]).await
        }

        /// With server `settings` beside the isolation, for every connection.
        async fn with_settings(isolation: &str, settings: &[(&str, &str)]) -> Self {
            let base = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
            let separator = if base.contains('?') { '&' } else { '?' };
            let options: Vec<String> = [("default_transaction_isolation", isolation)]
                .iter()
                .chain(settings)
                // A space in a server option is escaped with a backslash.
                .map(|(name, value)| format!("-c%20{name}%3D{}", value.replace(' ', "%5C%20")))
                .collect();
            let url = format!("{base}{separator}options={}", options.join("%20"));
            let table = format!(
                "scratch_claims_{}_{}",
                std::process::id(),
                SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            );
            let config = StoreConfig {
                table: table.clone(),
                ..StoreConfig::default()
            };
            let store = PostgresStore::new(&url, &config).unwrap();
            store.migrate().await.unwrap();
            let client = connect(&url).await;
            let isolation_in_use: String = client
                .query_one("SHOW default_transaction_isolation", &[])
                .await
                .unwrap()
                .get(0);
            assert_eq!(isolation_in_use, isolation);
            Self {
                store,
                client,
                table,
                url,
            }
        }

        fn runner(&self, stuck_after: Duration) -> BatchRunner {
            BatchRunner {
                session: Arc::clone(&self.store.session),
                sql: Arc::clone(&self.store.sql),
                connection: None,
                stuck_after,
            }
        }

        /// Claims `keys` as first attempts, `processing`; a settle of one
        /// with `attempt` and `settlement`.
        async fn processing(
            &self,
            keys: &[&str],
        ) -> impl Fn(&str, i32, Settlement) -> SettleRequest {
            let claimed: HashMap<String, SystemTime> = self
                .client
                .query(
                    &format!(
                        "INSERT INTO {} (source, event_id, status, claimed_at, lease_expires_at)
                         SELECT 'orders', k, 'processing', now(), now() + interval '5 minutes'
                           FROM unnest($1::text[]) k
                         RETURNING event_id, claimed_at",
                        self.table
                    ),
                    &[&keys],
                )
                .await
                .unwrap()
                .iter()
                .map(|row| (row.get(0), row.get(1)))
                .collect();
            move |key, attempt, settlement| SettleRequest {
                source: "orders".into(),
                key: key.into(),
                fence: Fence {
                    attempt,
                    claimed_at: claimed[key],
                },
                settlement,
            }
        }

        /// A transaction that holds `key`'s row locked until it ends.
        async fn hold(&self, key: &str) -> tokio_postgres::Client {
            let holder = connect(&self.url).await;
            holder
                .batch_execute(&format!(
                    "BEGIN; SELECT 1 FROM {} WHERE event_id = '{key}' FOR UPDATE",
                    self.table
                ))
                .await
                .unwrap();
            holder
        }

        async fn status(&self, key: &str) -> String {
            self.client
                .query_one(
                    &format!("SELECT status FROM {} WHERE event_id = $1", self.table),
                    &[&key],
                )
                .await
                .unwrap()
                .get(0)
        }

        /// Makes every update of `key`'s row wait, inside the statement,
        /// until the returned session lets it go (`let_updates_go`): a
        /// trigger that waits on an advisory lock that session holds.
        async fn stall_updates_of(&self, key: &str) -> tokio_postgres::Client {
            let holder = connect(&self.url).await;
            holder
                .batch_execute(&format!(
                    "CREATE FUNCTION {table}_stall() RETURNS trigger LANGUAGE plpgsql
                       AS $$ BEGIN PERFORM pg_advisory_xact_lock(hashtext('{table}')); RETURN NEW; END $$;
                     CREATE TRIGGER stall BEFORE UPDATE ON {table} FOR EACH ROW
                       WHEN (OLD.event_id = '{key}') EXECUTE FUNCTION {table}_stall();
                     SELECT pg_advisory_lock(hashtext('{table}'))",
                    table = self.table
                ))
                .await
                .unwrap();
            holder
        }

        async fn let_updates_go(&self, holder: &tokio_postgres::Client) {
            holder
                .batch_execute(&format!(
                    "SELECT pg_advisory_unlock(hashtext('{}'))",
                    self.table
                ))
                .await
                .unwrap();
        }

        /// The backend of a statement stalled by `stall_updates_of`.
        async fn stalled_backend(&self) -> i32 {
            let stalled = async {
                loop {
                    let pids = self
                        .client
                        .query(
                            "SELECT pid FROM pg_stat_activity
                              WHERE wait_event = 'advisory' AND strpos(query, $1) > 0",
                            &[&self.table],
                        )
                        .await
                        .unwrap();
                    if let Some(row) = pids.first() {
                        return row.get(0);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(10), stalled)
                .await
                .expect("a statement stalls on the trigger")
        }

        async fn drop_table(&self) {
            self.client
                .batch_execute(&format!(
                    "DROP TABLE {table}; DROP FUNCTION IF EXISTS {table}_stall()",
                    table = self.table
                ))
                .await
                .unwrap();
        }
    }

    /// The settle statement locks its rows in key order, so one waiting on
    /// `b` has updated `a` (and holds it until it commits) and not reached
    /// `c`, `d` or `e`. `d` is settled beside it, and its reply goes at
    /// once; `e`, held by another transaction at first, once that lets it
    /// go; `c` is not, since a later round settles it again: its release
    /// alone would leave it `failed` until the `done` after it lands.
    async fn keys_a_waiting_settle_has_not_reached_are_settled_beside_it(isolation: &str) {
        let scratch = Scratch::new(isolation).await;
        let settle = scratch.processing(&["a", "b", "c", "d", "e"]).await;
        let request = |key: &str, settlement| settle(key, 1, settlement);
        let (holder, holder_of_e) = (scratch.hold("b").await, scratch.hold("e").await);
        // Long enough for the statement to have locked `a` by then.
        let runner = scratch.runner(Duration::from_secs(1));
        // In queue order, not key order: replies go by queue position.
        let (replies, mut receivers) = Replies::for_test(6);
        let batch = tokio::spawn(runner.settle_batch(
            vec![
                request("d", DONE),
                request("c", Settlement::RELEASED),
                request("b", DONE),
                request("a", DONE),
                request("c", DONE),
                request("e", DONE),
            ],
            Lane::Alone,
            replies,
        ));
        let e = receivers.pop().unwrap();
        let d = tokio::time::timeout(Duration::from_secs(10), receivers.remove(0))
            .await
            .expect("d's reply comes while b is held")
            .unwrap();
        assert!(matches!(d, Ok(true)), "{d:?}");
        assert_eq!(
            scratch.status("d").await,
            "done",
            "committed beside the waiting statement"
        );
        assert_eq!(
            scratch.status("a").await,
            "processing",
            "held by the waiting statement"
        );
        assert_eq!(
            scratch.status("c").await,
            "processing",
            "left to its two rounds"
        );
        assert_eq!(scratch.status("e").await, "processing", "held");

        holder_of_e.batch_execute("COMMIT").await.unwrap();
        let e = tokio::time::timeout(Duration::from_secs(10), e)
            .await
            .expect("e's reply comes while b is held, once e is not")
            .unwrap();
        assert!(matches!(e, Ok(true)), "{e:?}");
        assert_eq!(scratch.status("e").await, "done");
        assert_eq!(
            scratch.status("c").await,
            "processing",
            "left to its two rounds"
        );
        assert!(!batch.is_finished(), "the statement still waits on b");

        holder.batch_execute("COMMIT").await.unwrap();
        let outcomes = batch.await.unwrap();
        assert!(
            outcomes.iter().all(|outcome| matches!(outcome, Ok(true))),
            "{outcomes:?}"
        );
        for mut receiver in receivers {
            assert!(
                receiver.try_recv().is_err(),
                "only d and e had their replies early; the queue sends the others the batch's outcomes"
            );
        }
        for key in ["a", "b", "c", "d", "e"] {
            assert_eq!(scratch.status(key).await, "done", "{key}");
        }
        scratch.drop_table().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_a_waiting_settle_has_not_reached_are_settled_beside_it_under_read_committed() {
        keys_a_waiting_settle_has_not_reached_are_settled_beside_it("read committed").await;
    }

    /// There the waiting statement, on reaching a row settled beside it, is
    /// rolled back for the conflict and run again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_a_waiting_settle_has_not_reached_are_settled_beside_it_under_serializable() {
        keys_a_waiting_settle_has_not_reached_are_settled_beside_it("serializable").await;
    }

    /// A waiting settle statement the database refuses (here, for waiting
    /// longer than `lock_timeout`) is run again key by key; the keys
    /// settled beside it meanwhile keep their answers, and only the held
    /// key fails.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_settle_the_database_refuses_keeps_what_was_settled_beside_it() {
        let scratch = Scratch::with_settings("read committed", &[("lock_timeout", "2500ms")]).await;
        let settle = scratch.processing(&["a", "b", "c", "d"]).await;
        let holder = scratch.hold("b").await;
        let (replies, mut receivers) = Replies::for_test(4);
        // In queue order, not key order: replies go by queue position.
        let batch = tokio::spawn(scratch.runner(Duration::from_millis(200)).settle_batch(
            vec![
                settle("d", 1, DONE),
                settle("b", 1, DONE),
                settle("a", 1, DONE),
                settle("c", 1, DONE),
            ],
            Lane::Alone,
            replies,
        ));
        for (position, key) in [(3, "c"), (0, "d")] {
            let receiver = receivers.remove(position);
            let early = tokio::time::timeout(Duration::from_secs(10), receiver)
                .await
                .unwrap_or_else(|_| panic!("{key}'s reply comes while b is held"))
                .unwrap();
            assert!(matches!(early, Ok(true)), "{key}: {early:?}");
        }

        let outcomes = tokio::time::timeout(Duration::from_secs(30), batch)
            .await
            .expect("refused by lock_timeout, then run key by key")
            .unwrap();
        assert!(
            matches!(&outcomes[1], Err(StoreError::Refused(_))),
            "{outcomes:?}"
        );
        for position in [0, 2, 3] {
            assert!(matches!(outcomes[position], Ok(true)), "{outcomes:?}");
        }
        for mut receiver in receivers {
            assert!(receiver.try_recv().is_err(), "a and b had no reply early");
        }
        for key in ["a", "c", "d"] {
            assert_eq!(scratch.status(key).await, "done", "{key}");
        }
        holder.batch_execute("COMMIT").await.unwrap();
        assert_eq!(scratch.status("b").await, "processing");
        scratch.drop_table().await;
    }

    /// A settle beside a waiting statement whose connection is lost before
    /// its answer comes may or may not have committed: its keys get no
    /// early reply, and are left to the waiting statement (here the lost
    /// one had not committed, and the waiting statement settles them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_of_a_settle_beside_whose_connection_is_lost_get_no_early_reply() {
        let scratch = Scratch::new("read committed").await;
        let settle = scratch.processing(&["a", "b", "d"]).await;
        let stall = scratch.stall_updates_of("d").await;
        let holder = scratch.hold("b").await;
        let (replies, mut receivers) = Replies::for_test(3);
        let batch = tokio::spawn(scratch.runner(Duration::from_millis(200)).settle_batch(
            vec![
                settle("a", 1, DONE),
                settle("b", 1, DONE),
                settle("d", 1, DONE),
            ],
            Lane::Alone,
            replies,
        ));
        // The statement beside reaches `d` while the waiting one is held at `b`.
        let beside = scratch.stalled_backend().await;
        scratch
            .client
            .execute("SELECT pg_terminate_backend($1)", &[&beside])
            .await
            .unwrap();

        scratch.let_updates_go(&stall).await;
        holder.batch_execute("COMMIT").await.unwrap();
        let outcomes = tokio::time::timeout(Duration::from_secs(10), batch)
            .await
            .expect("the waiting statement goes on once b is let go")
            .unwrap();
        assert!(
            outcomes.iter().all(|outcome| matches!(outcome, Ok(true))),
            "{outcomes:?}"
        );
        for mut receiver in receivers.drain(..) {
            assert!(receiver.try_recv().is_err(), "no reply went early");
        }
        for key in ["a", "b", "d"] {
            assert_eq!(scratch.status(key).await, "done", "{key}");
        }
        scratch.drop_table().await;
    }

    /// Sent while every slot holds a stuck settle, a settle waits on no row
    /// lock: a key another transaction holds fails at once (to be retried
    /// in the background), the others are settled, and one this attempt no
    /// longer holds is answered so.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_settle_sent_while_every_slot_is_stuck_waits_on_no_row_lock() {
        let scratch = Scratch::new("read committed").await;
        let settle = scratch.processing(&["free", "held", "taken"]).await;
        let request = |key: &str, attempt| settle(key, attempt, DONE);
        let holder = scratch.hold("held").await;
        let (replies, _receivers) = Replies::for_test(3);
        let outcomes = tokio::time::timeout(
            Duration::from_secs(10),
            scratch.runner(Duration::from_secs(1)).settle_batch(
                // `taken` as by an attempt another has since taken over.
                vec![request("held", 1), request("free", 1), request("taken", 2)],
                Lane::Unlocked,
                replies,
            ),
        )
        .await
        .expect("answered while held is held");
        assert!(
            matches!(&outcomes[0], Err(StoreError::RowLocked)),
            "{outcomes:?}"
        );
        assert!(matches!(outcomes[1], Ok(true)), "{outcomes:?}");
        assert!(matches!(outcomes[2], Ok(false)), "{outcomes:?}");
        assert_eq!(scratch.status("free").await, "done");
        assert_eq!(scratch.status("taken").await, "processing");
        holder.batch_execute("COMMIT").await.unwrap();
        assert_eq!(scratch.status("held").await, "processing");
        scratch.drop_table().await;
    }

    /// A claim batch that found a key failed takes it back in a statement
    /// of its own, a write, whose commit may be slow (here a trigger makes
    /// it wait on a lock another session holds); the batch's other keys
    /// were decided by the claim statement, and are answered without
    /// waiting for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_a_claim_batch_has_decided_are_answered_before_its_take_back_commits() {
        let scratch = Scratch::new("read committed").await;
        scratch
            .client
            .batch_execute(&format!(
                "INSERT INTO {} (source, event_id, status) VALUES ('orders', 'old', 'done'), ('orders', 'gone', 'failed')",
                scratch.table
            ))
            .await
            .unwrap();
        let holder = scratch.stall_updates_of("gone").await;
        let request = |key: &str| ClaimRequest {
            source: "orders".into(),
            key: key.into(),
            payload_sha256: [7; 32],
            lease: Duration::from_secs(300),
            reject_mismatch: false,
        };
        let runner = scratch.runner(Duration::from_secs(1));
        let (replies, mut receivers) = Replies::for_test(3);
        let batch = tokio::spawn(runner.claim_batch(
            vec![request("old"), request("gone"), request("new")],
            Lane::Beside,
            replies,
        ));
        let new = receivers.pop().unwrap();
        let old = tokio::time::timeout(Duration::from_secs(10), receivers.remove(0))
            .await
            .expect("the duplicate is answered while the take-back waits")
            .unwrap();
        assert!(matches!(old, Ok(Claim::Done { .. })), "{old:?}");
        let new = new.await.unwrap();
        assert!(
            matches!(
                new,
                Ok(Claim::Won {
                    from: WonFrom::New,
                    ..
                })
            ),
            "{new:?}"
        );
        assert_eq!(scratch.status("new").await, "processing", "committed");
        assert!(!batch.is_finished(), "the take-back still waits");

        scratch.let_updates_go(&holder).await;
        let outcomes = batch.await.unwrap();
        assert!(
            matches!(
                outcomes[1],
                Ok(Claim::Won {
                    from: WonFrom::Failed,
                    ..
                })
            ),
            "{outcomes:?}"
        );
        assert!(
            receivers[0].try_recv().is_err(),
            "gone's claim had no reply early"
        );
        scratch.drop_table().await;
    }

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
