//! The claim side of a batch: the claim statement for the round's keys, the
//! take-back of keys it found failed or expired, and the claims read from
//! their rows.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use super::super::Params;
use super::{BatchRunner, Round, analyze, ordinals, rounds};
use crate::store::coalesce::{Lane, Replies};
use crate::store::{Claim, ClaimRequest, Fence, StoreError, WonFrom};

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
    pub(super) async fn claim_batch(
        mut self,
        requests: Vec<ClaimRequest>,
        lane: Lane,
        replies: Replies<Claim>,
    ) -> Vec<Result<Claim, StoreError>> {
        let held = self.session.held_claims.held_among(&requests);
        let all_held = held.as_ref().is_some_and(|held| !held.contains(&false));
        if lane != Lane::Beside && !all_held {
            match self.session.pipeline().await {
                Ok(connection) => self.connection = Some(connection),
                Err(error) => return vec![Err(error); requests.len()],
            }
        }
        self.claim_rounds(&requests, held.as_deref(), &replies)
            .await
    }

    /// A key decided before the rest of its round (see `claim_round`) has
    /// its reply at once, and so has a key in `held` (see `HeldClaims`),
    /// which is answered in flight without a statement.
    async fn claim_rounds(
        &self,
        requests: &[ClaimRequest],
        held: Option<&[bool]>,
        replies: &Replies<Claim>,
    ) -> Vec<Result<Claim, StoreError>> {
        let mut claims: Vec<Option<Result<Claim, StoreError>>> = vec![None; requests.len()];
        for (index, _) in held
            .into_iter()
            .flatten()
            .enumerate()
            .filter(|&(_, &held)| held)
        {
            // The held statement's outcome goes to the request it was sent
            // for; this one only learns that the key is in flight, without
            // its body compared with the first delivery's.
            let in_flight = Ok(Claim::InFlight {
                payload_mismatch: false,
            });
            replies.send(index, in_flight.clone());
            claims[index] = Some(in_flight);
        }
        for round in rounds(requests, |r| (&r.source, &r.key)) {
            let round: Vec<usize> = round
                .into_iter()
                .filter(|&index| claims[index].is_none())
                .collect();
            if round.is_empty() {
                continue;
            }
            let round_requests: Vec<&ClaimRequest> = round.iter().map(|&i| &requests[i]).collect();
            let decided_early = |position: usize, claim: &Result<Claim, StoreError>| {
                replies.send(round[position], claim.clone());
            };
            let decided = self.isolated(&round_requests, &decided_early).await;
            for (slot, claim) in round.iter().zip(decided) {
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

    /// Claims the round's keys. Its new keys are decided, and committed, by
    /// the claim statement; what happens to keys it found failed or expired
    /// (taken back by a statement of their own) cannot undo that, so the
    /// round's result is per key. Every other key is decided by then, and
    /// passed to `decided_early` before the take-back, a second round trip
    /// and a commit that waits for a WAL flush: a duplicate of a `done` key,
    /// or a new key won, need not wait for them.
    async fn claim_round(
        &self,
        requests: &[&ClaimRequest],
        decided_early: &(dyn Fn(usize, &Result<Claim, StoreError>) + Sync),
    ) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        let statement = async {
            match requests {
                [one] => {
                    let params: &Params<'_> = &[
                        (&&*one.source, Type::TEXT),
                        (&one.key, Type::TEXT),
                        (&&one.payload_sha256[..], Type::BYTEA),
                        (&lease_ms(one), Type::INT8),
                        (&one.reject_mismatch, Type::BOOL),
                    ];
                    self.query(&self.sql.claim_one, params).await
                }
                _ => {
                    let columns = ClaimColumns::of(requests);
                    self.query(&self.sql.claim, &columns.params()).await
                }
            }
        };
        let rows = self
            .session
            .held_claims
            .marked_while_stuck(requests, self.stuck_after, statement)
            .await?;
        let mut claims = vec![None; requests.len()];
        let mut unseen = Vec::new();
        let mut retakable = Vec::new();
        for (index, row) in ordinals(&rows, requests.len()) {
            if lost_to_an_unseen_row(row) {
                unseen.push(index);
            }
            if row.get::<_, bool>(6) {
                retakable.push(index);
            }
            claims[index] = Some(Ok(claim_from_row(row, &requests[index].payload_sha256)));
        }
        if !unseen.is_empty() {
            self.recheck_lost(requests, &unseen, &mut claims).await;
        }
        if !retakable.is_empty() {
            let mut decided = vec![true; claims.len()];
            for &index in &retakable {
                decided[index] = false;
            }
            for (index, claim) in claims.iter().enumerate() {
                if let Some(claim) = claim.as_ref().filter(|_| decided[index]) {
                    decided_early(index, claim);
                }
            }
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
    /// key another replica took first, or whose row another transaction
    /// holds, stays in flight (see `retake` in `Statements::new`); a refused
    /// statement is retried key by key, so a key that cannot be taken back
    /// fails alone.
    ///
    /// So does a key this replica is already taking back in another batch,
    /// with no statement of its own: at most one of the two could win.
    async fn take_back(
        &self,
        requests: &[&ClaimRequest],
        retakable: &[usize],
        claims: &mut [Option<Result<Claim, StoreError>>],
    ) {
        let taking_back = self
            .session
            .taking_back
            .enter(retakable.iter().map(|&i| requests[i]));
        let retakable: Vec<usize> = retakable
            .iter()
            .zip(&taking_back.entered)
            .filter_map(|(&index, &entered)| entered.then_some(index))
            .collect();
        if retakable.is_empty() {
            return;
        }
        // It writes, and its commit waits for a WAL flush (for a synchronous
        // standby, too, where there is one) that the read-only batches
        // pipelined behind it need not wait for: later batches go to another
        // connection.
        if let Some(connection) = &self.connection {
            self.session.withdraw(connection);
        }
        let take_backs: Vec<TakeBack<'_>> =
            retakable.iter().map(|&i| TakeBack(requests[i])).collect();
        let take_backs: Vec<&TakeBack<'_>> = take_backs.iter().collect();
        let taken = self.isolated(&take_backs, &|_, _| {}).await;
        for (&index, taken) in retakable.iter().zip(taken) {
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
        for (index, row) in ordinals(&rows, requests.len()) {
            let from = match row.get(3) {
                "processing" => WonFrom::ExpiredLease,
                _ => WonFrom::Failed,
            };
            taken[index] = Some(Claim::Won {
                fence: Fence {
                    attempt: row.get(1),
                    claimed_at: row.get(4),
                },
                from,
                payload_mismatch: differs(row.get(2), &requests[index].payload_sha256),
            });
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
        for (ord, row) in ordinals(&rows, unseen.len()) {
            let index = unseen[ord];
            claims[index] = Some(Ok(lost_claim(
                row.get(1),
                row.get(3),
                differs(row.get(2), &requests[index].payload_sha256),
            )));
        }
    }
}

impl Round for ClaimRequest {
    type Outcome = Result<Claim, StoreError>;

    async fn run(
        runner: &BatchRunner,
        requests: &[&Self],
        decided_early: &(dyn Fn(usize, &Self::Outcome) + Sync),
    ) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        runner.claim_round(requests, decided_early).await
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
        _decided_early: &(dyn Fn(usize, &Self::Outcome) + Sync),
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

fn lease_ms(request: &ClaimRequest) -> i64 {
    i64::try_from(request.lease.as_millis()).unwrap_or(i64::MAX)
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

/// The keys this replica is taking back, so that it sends no second
/// take-back of a key while the first is at the database.
#[derive(Default)]
pub(in crate::store::postgres) struct TakingBack {
    keys: Mutex<HashSet<(Arc<str>, String)>>,
}

impl TakingBack {
    /// Marks the keys of `requests` not already being taken back; which ones
    /// were is in the guard, which unmarks them when dropped.
    fn enter<'a>(&'a self, requests: impl Iterator<Item = &'a ClaimRequest>) -> Entered<'a> {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let mut mine = Vec::new();
        let entered = requests
            .map(|request| {
                let key = (Arc::clone(&request.source), request.key.clone());
                let entered = keys.insert(key.clone());
                if entered {
                    mine.push(key);
                }
                entered
            })
            .collect();
        Entered {
            taking_back: self,
            mine,
            entered,
        }
    }
}

/// Keys marked as being taken back, until dropped.
struct Entered<'a> {
    taking_back: &'a TakingBack,
    mine: Vec<(Arc<str>, String)>,
    /// For each request given, whether it was marked here (not already).
    entered: Vec<bool>,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let mut keys = self
            .taking_back
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for key in &self.mine {
            keys.remove(key);
        }
    }
}
