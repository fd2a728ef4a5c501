//! Claims and settles coalesced into multi-row statements: the queues, the
//! rounds that keep a key out of a statement twice, the take-back of keys a
//! claim found failed or expired, and a refused statement retried key by key
//! so that it fails only its own requests.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use super::sql::Statements;
use super::{Connection, Params, Session, postgres_error};
use crate::store::coalesce::{Coalescer, Lane, Limits, Outcome};
use crate::store::{Claim, ClaimRequest, Fence, Settlement, StoreError, WonFrom};

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
        let settle_limits = Limits {
            in_flight: BATCHES_IN_FLIGHT.min(pool_size),
            max_batch: MAX_BATCH,
            stalled_after: STALLED_AFTER,
            behind: 0,
            give_up_after: None,
        };
        // The pipeline holds one connection for as long as batches overlap;
        // a small pool keeps it for the stalled batch's slot and the settles.
        let pipelining = pool_size >= BATCHES_IN_FLIGHT + 2;
        let claim_limits = Limits {
            behind: if pipelining { CLAIMS_BEHIND } else { 0 },
            give_up_after: Some(claim_timeout),
            ..settle_limits
        };
        let runner = BatchRunner {
            session: Arc::clone(session),
            sql: Arc::clone(sql),
            connection: None,
        };
        let settle_runner = runner.clone();
        Self {
            claims: Coalescer::start(claim_limits, move |batch, lane| {
                runner.clone().claim_batch(batch, lane)
            }),
            settles: Coalescer::start(settle_limits, move |batch, _lane| {
                settle_runner.clone().settle_batch(batch)
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
}

impl BatchRunner {
    /// Claims a batch. A key queued twice is claimed again in a later round,
    /// after the first claim's outcome is committed, since one statement
    /// cannot decide the same key twice.
    ///
    /// A batch goes to the connection of the claim batches still at the
    /// database, pipelined behind them (see `Lane::Behind`), or to a new one
    /// when none is; under a load of new keys one batch is out at a time, so
    /// each takes a connection from the pool. A batch beside a stalled one
    /// takes its own.
    async fn claim_batch(
        mut self,
        requests: Vec<ClaimRequest>,
        lane: Lane,
    ) -> Vec<Result<Claim, StoreError>> {
        if lane != Lane::Beside {
            match self.session.pipeline().await {
                Ok(connection) => self.connection = Some(connection),
                Err(error) => return vec![Err(error); requests.len()],
            }
        }
        self.claim_rounds(&requests).await
    }

    async fn claim_rounds(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, StoreError>> {
        let mut claims: Vec<Option<Result<Claim, StoreError>>> = vec![None; requests.len()];
        for round in rounds(requests, |r| (&r.source, &r.key)) {
            let round_requests: Vec<&ClaimRequest> = round.iter().map(|&i| &requests[i]).collect();
            for (slot, claim) in round.iter().zip(self.isolated(&round_requests).await) {
                claims[*slot] = Some(claim.and_then(std::convert::identity));
            }
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
            tokio::spawn(analyze(Arc::clone(&self.session), Arc::clone(&self.sql)));
        }
        claims
    }

    /// Runs a claim or settle statement on the batch's connection, or on one
    /// from the pool.
    async fn query(&self, sql: &str, params: &Params<'_>) -> Result<Vec<Row>, StoreError> {
        match &self.connection {
            Some(connection) => self.session.query_on(connection, sql, params).await,
            None => self.session.query(sql, params).await,
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

    /// Claims the round's keys. Its new keys are decided, and committed, by
    /// the claim statement; what happens to keys it found failed or expired
    /// (taken back by a statement of their own) cannot undo that, so the
    /// round's result is per key.
    async fn claim_round(
        &self,
        requests: &[&ClaimRequest],
    ) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        let rows = match requests {
            [one] => {
                let params: &Params<'_> = &[
                    (&&*one.source, Type::TEXT),
                    (&one.key, Type::TEXT),
                    (&&one.payload_sha256[..], Type::BYTEA),
                    (&lease_ms(one), Type::INT8),
                    (&one.reject_mismatch, Type::BOOL),
                ];
                self.query(&self.sql.claim_one, params).await?
            }
            _ => {
                let columns = ClaimColumns::of(requests);
                self.query(&self.sql.claim, &columns.params()).await?
            }
        };
        let mut claims = vec![None; requests.len()];
        let mut unseen = Vec::new();
        let mut retakable = Vec::new();
        for row in &rows {
            let index = usize::try_from(row.get::<_, i64>(0) - 1).unwrap_or(usize::MAX);
            if let Some(slot) = claims.get_mut(index) {
                if lost_to_an_unseen_row(row) {
                    unseen.push(index);
                }
                if row.get::<_, bool>(6) {
                    retakable.push(index);
                }
                *slot = Some(Ok(claim_from_row(row, &requests[index].payload_sha256)));
            }
        }
        if !unseen.is_empty() {
            self.recheck_lost(requests, &unseen, &mut claims).await;
        }
        if !retakable.is_empty() {
            self.take_back(requests, &retakable, &mut claims).await;
        }
        Ok(claims
            .into_iter()
            .map(|claim| {
                claim.unwrap_or_else(|| {
                    Err(StoreError::Postgres("a claim got no result row".into()))
                })
            })
            .collect())
    }

    /// Takes back the keys the claim statement found failed or expired. A
    /// key another replica took first stays in flight, as the claim found
    /// it; a refused statement is retried key by key, so a key that cannot
    /// be taken back fails alone.
    async fn take_back(
        &self,
        requests: &[&ClaimRequest],
        retakable: &[usize],
        claims: &mut [Option<Result<Claim, StoreError>>],
    ) {
        // Its row locks may wait on another transaction, and claims sent
        // behind it would wait too: later batches go to another connection.
        if let Some(connection) = &self.connection {
            self.session.withdraw(connection);
        }
        let take_backs: Vec<TakeBack<'_>> =
            retakable.iter().map(|&i| TakeBack(requests[i])).collect();
        let take_backs: Vec<&TakeBack<'_>> = take_backs.iter().collect();
        for (&index, taken) in retakable.iter().zip(self.isolated(&take_backs).await) {
            match taken {
                Ok(Some(won)) => claims[index] = Some(Ok(won)),
                Ok(None) => {}
                Err(error) => claims[index] = Some(Err(error)),
            }
        }
    }

    async fn retake_round(
        &self,
        take_backs: &[&TakeBack<'_>],
    ) -> Result<Vec<Option<Claim>>, StoreError> {
        let requests: Vec<&ClaimRequest> = take_backs.iter().map(|take_back| take_back.0).collect();
        let columns = ClaimColumns::of(&requests);
        let rows = self.query(&self.sql.retake, &columns.params()).await?;
        let mut taken = vec![None; requests.len()];
        for row in &rows {
            let index = usize::try_from(row.get::<_, i64>(0) - 1).unwrap_or(usize::MAX);
            if let Some(slot) = taken.get_mut(index) {
                let from = match row.get(3) {
                    "processing" => WonFrom::ExpiredLease,
                    _ => WonFrom::Failed,
                };
                *slot = Some(Claim::Won {
                    fence: Fence {
                        attempt: row.get(1),
                        claimed_at: row.get(4),
                    },
                    from,
                    payload_mismatch: differs(row.get(2), &requests[index].payload_sha256),
                });
            }
        }
        Ok(taken)
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
        claims: &mut [Option<Result<Claim, StoreError>>],
    ) {
        let sources: Vec<&str> = unseen.iter().map(|&i| &*requests[i].source).collect();
        let keys: Vec<&str> = unseen.iter().map(|&i| requests[i].key.as_str()).collect();
        let params: &Params<'_> = &[(&sources, Type::TEXT_ARRAY), (&keys, Type::TEXT_ARRAY)];
        let rows = match self.query(&self.sql.recheck, params).await {
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
            claims[index] = Some(Ok(lost_claim(
                row.get(1),
                row.get(3),
                differs(row.get(2), &requests[index].payload_sha256),
            )));
        }
    }

    /// Settles a batch; as with claims, a refused statement is retried one
    /// key at a time, and a key queued twice is settled in a later round:
    /// one statement updates a row once, with whichever of its input rows
    /// PostgreSQL picks, and a `done` must win over its own attempt's
    /// release whichever comes first.
    ///
    /// A round goes out in key order (byte order, as claims lock theirs):
    /// the statement locks rows in the order of its input, so two batches
    /// sharing keys, or a settle and a claim taking back the same expired
    /// keys, wait on each other instead of deadlocking. Sorting here, not
    /// in the statement, costs the database nothing: a locking sort there
    /// would write a lock record for every row it then updates anyway.
    async fn settle_batch(self, requests: Vec<SettleRequest>) -> Vec<Result<bool, StoreError>> {
        let mut outcomes = vec![Ok(false); requests.len()];
        for mut round in rounds(&requests, |r| (&r.source, &r.key)) {
            round.sort_unstable_by_key(|&i| (&requests[i].source, &requests[i].key));
            let sorted: Vec<&SettleRequest> = round.iter().map(|&i| &requests[i]).collect();
            for (index, outcome) in round.into_iter().zip(self.isolated(&sorted).await) {
                outcomes[index] = outcome;
            }
        }
        outcomes
    }

    async fn settle_round(&self, requests: &[&SettleRequest]) -> Result<Vec<bool>, StoreError> {
        let rows = match requests {
            [one] => {
                let params: &Params<'_> = &[
                    (&one.source, Type::TEXT),
                    (&one.key, Type::TEXT),
                    (&one.fence.attempt, Type::INT4),
                    (&one.fence.claimed_at, Type::TIMESTAMPTZ),
                    (&one.settlement.status.as_str(), Type::TEXT),
                    (&response_status(one), Type::INT2),
                ];
                self.query(&self.sql.settle_one, params).await?
            }
            _ => {
                let sources: Vec<&str> = requests.iter().map(|r| r.source.as_str()).collect();
                let keys: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
                let attempts: Vec<i32> = requests.iter().map(|r| r.fence.attempt).collect();
                let claimed_at: Vec<SystemTime> =
                    requests.iter().map(|r| r.fence.claimed_at).collect();
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
                    (&claimed_at, Type::TIMESTAMPTZ_ARRAY),
                    (&statuses, Type::TEXT_ARRAY),
                    (&response_statuses, Type::INT2_ARRAY),
                ];
                self.query(&self.sql.settle, params).await?
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
    type Outcome = Result<Claim, StoreError>;

    async fn run(
        runner: &BatchRunner,
        requests: &[&Self],
    ) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        runner.claim_round(requests).await
    }
}

/// A claim for a key the claim statement found failed or expired; its
/// outcome is the won claim, or none if the key was not there to take.
struct TakeBack<'a>(&'a ClaimRequest);

impl Round for TakeBack<'_> {
    type Outcome = Option<Claim>;

    async fn run(
        runner: &BatchRunner,
        requests: &[&Self],
    ) -> Result<Vec<Option<Claim>>, StoreError> {
        runner.retake_round(requests).await
    }
}

/// A batch of claims as the columns the claim and take-back statements
/// unnest.
struct ClaimColumns<'a> {
    sources: Vec<&'a str>,
    keys: Vec<&'a str>,
    hashes: Vec<&'a [u8]>,
    leases: Vec<i64>,
    rejects: Vec<bool>,
}

impl<'a> ClaimColumns<'a> {
    fn of(requests: &[&'a ClaimRequest]) -> Self {
        Self {
            sources: requests.iter().map(|r| &*r.source).collect(),
            keys: requests.iter().map(|r| r.key.as_str()).collect(),
            hashes: requests.iter().map(|r| &r.payload_sha256[..]).collect(),
            leases: requests.iter().map(|r| lease_ms(r)).collect(),
            rejects: requests.iter().map(|r| r.reject_mismatch).collect(),
        }
    }

    fn params(&self) -> [(&(dyn ToSql + Sync), Type); 5] {
        [
            (&self.sources, Type::TEXT_ARRAY),
            (&self.keys, Type::TEXT_ARRAY),
            (&self.hashes, Type::BYTEA_ARRAY),
            (&self.leases, Type::INT8_ARRAY),
            (&self.rejects, Type::BOOL_ARRAY),
        ]
    }
}

impl Round for SettleRequest {
    type Outcome = bool;

    async fn run(runner: &BatchRunner, requests: &[&Self]) -> Result<Vec<bool>, StoreError> {
        runner.settle_round(requests).await
    }
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

fn lease_ms(request: &ClaimRequest) -> i64 {
    i64::try_from(request.lease.as_millis()).unwrap_or(i64::MAX)
}

fn response_status(request: &SettleRequest) -> Option<i16> {
    request
        .settlement
        .response_status
        .map(|status| i16::try_from(status).unwrap_or(i16::MAX))
}

/// A claim statement's row: the claim statement wins only by inserting,
/// so a won key was new (taking back is `retake_round`'s).
fn claim_from_row(row: &Row, payload_sha256: &[u8; 32]) -> Claim {
    let payload_mismatch = differs(row.get(3), payload_sha256);
    if row.get::<_, bool>(1) {
        Claim::Won {
            fence: Fence {
                attempt: row.get(2),
                claimed_at: row.get(7),
            },
            from: WonFrom::New,
            payload_mismatch,
        }
    } else {
        lost_claim(row.get(4), row.get(5), payload_mismatch)
    }
}

/// Whether the body stored with a key differs from this delivery's.
fn differs(stored_sha: Option<&[u8]>, payload_sha256: &[u8; 32]) -> bool {
    stored_sha.is_some_and(|stored| stored != payload_sha256)
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
