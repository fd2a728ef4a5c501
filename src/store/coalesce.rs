//! Coalescing of concurrent store calls into multi-row statements. Requests
//! queue; whenever no batch is at the database, everything queued so far (up
//! to a batch limit) goes out as one statement and one commit. Under light
//! load a batch is one request and nothing waits; under load the database
//! does far more work per round trip and per commit. A batch that stays at
//! the database too long (waiting on a row another transaction holds) no
//! longer holds back the next. While batches come back read-only (a burst of
//! duplicates), the next may be sent right behind the one at the database, on
//! its connection. Owns the queue and the fan-out of results; what a batch
//! means is up to the `run` function it is given.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use super::StoreError;

/// One queued call.
struct Job<Request, Response> {
    request: Request,
    reply: ReplySender<Response>,
    queued_at: Instant,
}

/// How a queue's batches go out.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most batches at the database at once.
    pub in_flight: usize,
    /// Most requests in one batch.
    pub max_batch: usize,
    /// How long a batch runs alone before the next may go out beside it.
    pub stalled_after: Duration,
    /// Most batches out beyond `in_flight`, each on a connection of its own,
    /// once every batch in the regular slots has been at the database for
    /// `stuck_after`: batches that long are waiting on rows another
    /// transaction holds, not slow, and the requests queued behind them
    /// would otherwise wait for as long as those rows are held.
    pub stuck: usize,
    pub stuck_after: Duration,
    /// Whether, once every slot has held a batch for `stuck_after` beyond
    /// when the stuck slots opened, batches go out [`Lane::Unlocked`], with
    /// no slot: for batches that can be run without waiting on any row
    /// lock (settles), which slots full of batches waiting on held rows
    /// would otherwise keep from the database for as long as those rows are
    /// held.
    pub unlocked: bool,
    /// Most batches sent behind the one running alone while the last batch
    /// to come back was read-only.
    pub behind: usize,
    /// How long a request may wait in the queue: its caller gives up then,
    /// so one still queued is answered [`StoreError::Timeout`] and not run.
    /// `None`: every request runs, however late.
    pub give_up_after: Option<Duration>,
}

/// How a batch goes out, which says which connection it may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The one batch at the database in the normal course.
    Alone,
    /// Right behind the batch running alone, pipelined on its connection:
    /// the database runs it as soon as that one is done, with no round trip
    /// in between.
    Behind,
    /// Beside a batch that has stalled, on a connection of its own.
    Beside,
    /// With every slot held by a stuck batch, on a connection of its own if
    /// one is free at once, waiting on no row lock (see
    /// [`Limits::unlocked`]).
    Unlocked,
}

/// A batch's result for one request.
pub trait Outcome {
    /// Whether the database wrote nothing for it.
    fn read_only(&self) -> bool {
        false
    }
}

impl Outcome for bool {}

/// A batch's replies, which it may send one at a time before it returns: a
/// request the database has decided need not wait for the rest of its
/// batch. A request's first reply is the one its caller gets.
pub struct Replies<Response> {
    senders: Arc<Mutex<Vec<Option<ReplySender<Response>>>>>,
}

type ReplySender<Response> = oneshot::Sender<Result<Response, StoreError>>;

impl<Response> Clone for Replies<Response> {
    fn clone(&self) -> Self {
        Self {
            senders: Arc::clone(&self.senders),
        }
    }
}

impl<Response> Replies<Response> {
    fn new(senders: Vec<ReplySender<Response>>) -> Self {
        Self {
            senders: Arc::new(Mutex::new(senders.into_iter().map(Some).collect())),
        }
    }

    /// Replies to the batch's `index`th request, unless it has had its reply.
    pub fn send(&self, index: usize, result: Result<Response, StoreError>) {
        let sender = self
            .senders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(index)
            .and_then(Option::take);
        if let Some(sender) = sender {
            let _ = sender.send(result);
        }
    }

    /// Replies for a batch run outside a queue, and their receiving ends.
    #[cfg(test)]
    pub fn for_test(count: usize) -> (Self, Vec<oneshot::Receiver<Result<Response, StoreError>>>) {
        let (senders, receivers) = (0..count).map(|_| oneshot::channel()).unzip();
        (Self::new(senders), receivers)
    }
}

/// A handle to a coalescing queue; cheap to clone.
pub struct Coalescer<Request, Response> {
    queue: mpsc::UnboundedSender<Job<Request, Response>>,
}

impl<Request, Response> Clone for Coalescer<Request, Response> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
        }
    }
}

impl<Request, Response> Coalescer<Request, Response>
where
    Request: Send + 'static,
    Response: Outcome + Send + 'static,
{
    /// Starts the dispatcher. Batches of at most `limits.max_batch` requests
    /// run one at a time, and up to `limits.in_flight` at once (one per
    /// connection) while the oldest has been running for `limits.stalled_after`
    /// or longer. While the last batch to come back was read-only, up to
    /// `limits.behind` more go out behind the one running alone. `run` gets
    /// the batch's requests, its lane and its [`Replies`] (to answer some of
    /// its requests before it returns), and returns one result per request,
    /// in order; a batch that fails as a whole fails its own requests and no
    /// other.
    pub fn start<Run, Fut>(limits: Limits, run: Run) -> Self
    where
        Run: Fn(Vec<Request>, Lane, Replies<Response>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Result<Response, StoreError>>> + Send + 'static,
    {
        let (queue, jobs) = mpsc::unbounded_channel();
        tokio::spawn(dispatch(jobs, limits, run));
        Self { queue }
    }

    /// Queues a request and waits for its result.
    pub async fn call(&self, request: Request) -> Result<Response, StoreError> {
        self.enqueue(request)?.await.map_err(|_| stopped())?
    }

    /// Queues a request; its result arrives on the receiver, and the request
    /// is run even if the receiver is dropped first.
    pub fn enqueue(
        &self,
        request: Request,
    ) -> Result<oneshot::Receiver<Result<Response, StoreError>>, StoreError> {
        let (reply, response) = oneshot::channel();
        let queued_at = Instant::now();
        self.queue
            .send(Job {
                request,
                reply,
                queued_at,
            })
            .map_err(|_| stopped())?;
        Ok(response)
    }
}

/// The slots of a queue.
struct Slots {
    alone: Arc<Semaphore>,
    behind: Arc<Semaphore>,
    beside: Arc<Semaphore>,
    stuck: Arc<Semaphore>,
}

impl Slots {
    /// A slot beside the batch running alone, once it has run until
    /// `stalled_at`; or, with that slot taken too, one of the slots for
    /// stuck batches, once the last batch sent in the regular slots has run
    /// until `stuck_at`; or, where `unlocked_at` is given and every slot is
    /// taken then, none ([`Lane::Unlocked`]). Says whether the slot is one
    /// for stuck batches (or none).
    async fn beside_a_stalled_batch(
        &self,
        stalled_at: Instant,
        stuck_at: Instant,
        unlocked_at: Option<Instant>,
    ) -> Result<(Option<OwnedSemaphorePermit>, Lane, bool), tokio::sync::AcquireError> {
        tokio::time::sleep_until(stalled_at).await;
        // Made only once the batch alone has stalled: the normal course sets
        // no second timer.
        let beside_the_stuck = async {
            tokio::time::sleep_until(stuck_at).await;
            Arc::clone(&self.stuck).acquire_owned().await
        };
        let without_a_slot = async {
            let Some(unlocked_at) = unlocked_at else {
                return std::future::pending().await;
            };
            tokio::time::sleep_until(unlocked_at).await;
            let taken = [&self.alone, &self.beside, &self.stuck];
            if taken.iter().any(|slot| slot.available_permits() > 0) {
                // Taken in the other branches; the next round looks again.
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            biased;
            slot = Arc::clone(&self.beside).acquire_owned() => Ok((Some(slot?), Lane::Beside, false)),
            slot = beside_the_stuck => Ok((Some(slot?), Lane::Beside, true)),
            () = without_a_slot => Ok((None, Lane::Unlocked, true)),
        }
    }
}

pub(super) fn stopped() -> StoreError {
    StoreError::Postgres("the store's dispatcher has stopped".into())
}

async fn dispatch<Request, Response, Run, Fut>(
    mut jobs: mpsc::UnboundedReceiver<Job<Request, Response>>,
    limits: Limits,
    run: Run,
) where
    Request: Send + 'static,
    Response: Outcome + Send + 'static,
    Run: Fn(Vec<Request>, Lane, Replies<Response>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<Result<Response, StoreError>>> + Send + 'static,
{
    // One batch at a time is the fastest way through the database: a second
    // concurrent commit does not halve the wait, it lengthens both (measured:
    // fewer first deliveries and slower ones at 16, 64 and 256 senders with
    // two or more batches always allowed out). The other slots are for a
    // batch stuck behind a row lock, so that the requests queued behind it
    // are not stuck too.
    //
    // A read-only batch commits nothing to wait for, so batches sent behind
    // it cost no one a longer commit; while the last batch to come back was
    // read-only, the next goes out at once, behind the one running alone
    // (not behind one that has stalled).
    let slots = Slots {
        alone: Arc::new(Semaphore::new(1)),
        behind: Arc::new(Semaphore::new(limits.behind)),
        beside: Arc::new(Semaphore::new(limits.in_flight.max(1) - 1)),
        stuck: Arc::new(Semaphore::new(limits.stuck)),
    };
    let read_only = Arc::new(AtomicBool::new(false));
    let max_batch = limits.max_batch.max(1);
    let mut alone_since = Instant::now();
    // When the last batch went out in the regular slots (alone, behind or
    // beside): once every one of those is stuck, the stuck slots open, and
    // stay open while they are, for batches that may well come back at once.
    let mut regular_sent = Instant::now();
    let run = Arc::new(run);
    loop {
        let Some(first) = jobs.recv().await else {
            return;
        };
        let stalled_at = alone_since + limits.stalled_after;
        let stuck_at = regular_sent + limits.stuck_after;
        let behind_open = read_only.load(Ordering::Relaxed) && Instant::now() < stalled_at;
        let unlocked_at = limits.unlocked.then_some(stuck_at + limits.stuck_after);
        let sent = tokio::select! {
            biased;
            slot = Arc::clone(&slots.alone).acquire_owned() => {
                alone_since = Instant::now();
                slot.map(|slot| (Some(slot), Lane::Alone, false))
            }
            slot = Arc::clone(&slots.behind).acquire_owned(), if behind_open => {
                slot.map(|slot| (Some(slot), Lane::Behind, false))
            }
            sent = slots.beside_a_stalled_batch(stalled_at, stuck_at, unlocked_at) => sent,
        };
        let Ok((slot, lane, in_a_stuck_slot)) = sent else {
            return;
        };
        if !in_a_stuck_slot {
            regular_sent = Instant::now();
        }
        // Everything that queued while no slot was free goes with it.
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        // A claim whose caller gave up while a stuck batch held the slots
        // would only be won to be released again.
        if let Some(limit) = limits.give_up_after {
            let now = Instant::now();
            let (late, in_time): (Vec<_>, Vec<_>) = batch
                .into_iter()
                .partition(|job| now.duration_since(job.queued_at) >= limit);
            for job in late {
                let _ = job.reply.send(Err(StoreError::Timeout(limit)));
            }
            batch = in_time;
            if batch.is_empty() {
                continue;
            }
        }
        let run = Arc::clone(&run);
        let read_only = Arc::clone(&read_only);
        tokio::spawn(async move {
            let (requests, replies): (Vec<_>, Vec<_>) = batch
                .into_iter()
                .map(|job| (job.request, job.reply))
                .unzip();
            let expected = requests.len();
            let replies = Replies::new(replies);
            let mut results = run(requests, lane, replies.clone()).await;
            if results.len() != expected {
                let error = StoreError::Postgres(format!(
                    "a batch of {expected} returned {} results",
                    results.len()
                ));
                results = (0..expected).map(|_| Err(error.clone())).collect();
            }
            read_only.store(
                results
                    .iter()
                    .all(|result| result.as_ref().is_ok_and(Outcome::read_only)),
                Ordering::Relaxed,
            );
            drop(slot);
            for (index, result) in results.into_iter().enumerate() {
                replies.send(index, result);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;

    impl Outcome for u32 {}

    fn one_at_a_time(max_batch: usize) -> Limits {
        Limits {
            in_flight: 1,
            max_batch,
            stalled_after: Duration::from_millis(10),
            stuck: 0,
            stuck_after: Duration::ZERO,
            unlocked: false,
            behind: 0,
            give_up_after: None,
        }
    }

    /// Two regular slots, one batch each, the second open after 20 ms, and
    /// `stuck` more once those have waited `STUCK_AFTER`.
    fn two_slots(stuck: usize, unlocked: bool) -> Limits {
        Limits {
            in_flight: 2,
            max_batch: 1,
            stalled_after: Duration::from_millis(20),
            stuck,
            stuck_after: STUCK_AFTER,
            unlocked,
            behind: 0,
            give_up_after: None,
        }
    }

    const STUCK_AFTER: Duration = Duration::from_millis(250);

    /// A gated batch's result: its first request, and whether the test said
    /// it wrote nothing.
    struct Ran {
        n: u32,
        read_only: bool,
    }

    impl Outcome for Ran {
        fn read_only(&self) -> bool {
            self.read_only
        }
    }

    /// Runs each batch until the test lets it finish, and tells the test
    /// which batch (its first request) has started, and in which lane.
    struct Gated {
        started: mpsc::UnboundedReceiver<(u32, Lane)>,
        lanes: HashMap<u32, Lane>,
        finish: HashMap<u32, oneshot::Sender<bool>>,
        queue: Coalescer<(u32, oneshot::Receiver<bool>), Ran>,
    }

    impl Gated {
        fn start(in_flight: usize, stalled_after: Duration) -> Self {
            Self::with_behind(in_flight, stalled_after, 0)
        }

        fn with_behind(in_flight: usize, stalled_after: Duration, behind: usize) -> Self {
            Self::with_limits(Limits {
                in_flight,
                max_batch: 1,
                stalled_after,
                stuck: 0,
                stuck_after: Duration::ZERO,
                unlocked: false,
                behind,
                give_up_after: None,
            })
        }

        fn with_limits(limits: Limits) -> Self {
            let (started_tx, started) = mpsc::unbounded_channel();
            let queue = Coalescer::start(
                limits,
                move |batch: Vec<(u32, oneshot::Receiver<bool>)>, lane, _replies| {
                    started_tx.send((batch[0].0, lane)).unwrap();
                    async move {
                        let mut results = Vec::new();
                        for (n, gate) in batch {
                            let read_only = gate.await.unwrap_or(false);
                            results.push(Ok(Ran { n, read_only }));
                        }
                        results
                    }
                },
            );
            Self {
                started,
                lanes: HashMap::new(),
                finish: HashMap::new(),
                queue,
            }
        }

        fn call(&mut self, n: u32) -> tokio::task::JoinHandle<u32> {
            let answer = self.call_answered(n);
            tokio::spawn(async move { answer.await.unwrap().unwrap() })
        }

        fn call_answered(&mut self, n: u32) -> tokio::task::JoinHandle<Result<u32, StoreError>> {
            let (finish, gate) = oneshot::channel();
            self.finish.insert(n, finish);
            let queue = self.queue.clone();
            tokio::spawn(async move { queue.call((n, gate)).await.map(|ran| ran.n) })
        }

        /// The next batch to start. Bounded, so that a batch that never
        /// starts fails the test instead of hanging it: on a paused clock
        /// the bound passes as soon as nothing else can run.
        async fn next_started(&mut self) -> Option<u32> {
            let (n, lane) = tokio::time::timeout(Duration::from_secs(86_400), self.started.recv())
                .await
                .expect("a batch started")?;
            self.lanes.insert(n, lane);
            Some(n)
        }

        fn lane(&self, n: u32) -> Lane {
            self.lanes[&n]
        }

        /// Checks that no batch starts for a minute. Paused, the clock jumps
        /// to the next timer whenever every task waits, so a minute passes at
        /// once, yet a stall timer set further out stays unfired.
        async fn assert_none_starts(&mut self, why: &str) {
            tokio::time::sleep(Duration::from_secs(60)).await;
            assert!(self.started.try_recv().is_err(), "{why}");
        }

        /// Lets batch `n` finish, having written.
        fn finish(&mut self, n: u32) {
            self.finish.remove(&n).unwrap().send(false).unwrap();
        }

        /// Lets batch `n` finish, having written nothing.
        fn finish_read_only(&mut self, n: u32) {
            self.finish.remove(&n).unwrap().send(true).unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn while_batches_come_back_read_only_the_next_goes_out_behind_the_one_running() {
        let mut gated = Gated::with_behind(1, Duration::from_secs(3600), 1);
        let wrote = gated.call(0);
        assert_eq!(gated.next_started().await, Some(0));
        gated.finish(0);
        assert_eq!(wrote.await.unwrap(), 0);
        let running = gated.call(1);
        assert_eq!(gated.next_started().await, Some(1));
        let waiting = gated.call(2);
        gated
            .assert_none_starts("after a batch that wrote, the next waits")
            .await;
        gated.finish_read_only(1);
        assert_eq!(running.await.unwrap(), 1);
        assert_eq!(gated.next_started().await, Some(2));
        assert_eq!(gated.lane(2), Lane::Alone);
        let behind = gated.call(3);
        assert_eq!(gated.next_started().await, Some(3));
        assert_eq!(gated.lane(3), Lane::Behind);
        let fourth = gated.call(4);
        gated.assert_none_starts("one batch behind at most").await;
        gated.finish_read_only(3);
        assert_eq!(behind.await.unwrap(), 3);
        assert_eq!(gated.next_started().await, Some(4));
        assert_eq!(gated.lane(4), Lane::Behind);
        gated.finish_read_only(4);
        gated.finish_read_only(2);
        assert_eq!(fourth.await.unwrap(), 4);
        assert_eq!(waiting.await.unwrap(), 2);
    }

    /// Claims queued behind a batch stuck at the database past the time
    /// their callers wait are answered timed out, not run: they would only
    /// be won to be released.
    #[tokio::test(start_paused = true)]
    async fn a_request_queued_past_the_time_its_caller_waits_is_not_run() {
        let limit = Duration::from_secs(1);
        let mut gated = Gated::with_limits(Limits {
            in_flight: 1,
            max_batch: 1,
            stalled_after: Duration::from_secs(3600),
            stuck: 0,
            stuck_after: Duration::ZERO,
            unlocked: false,
            behind: 0,
            give_up_after: Some(limit),
        });
        let stuck = gated.call(0);
        assert_eq!(gated.next_started().await, Some(0));
        let late = gated.call_answered(1);
        tokio::time::sleep(limit).await;
        let in_time = gated.call(2);
        gated.finish(0);
        assert_eq!(stuck.await.unwrap(), 0);
        assert_eq!(gated.next_started().await, Some(2));
        assert!(matches!(
            late.await.unwrap(),
            Err(StoreError::Timeout(waited)) if waited == limit
        ));
        gated.finish(2);
        assert_eq!(in_time.await.unwrap(), 2);
        gated
            .assert_none_starts("the late request never runs")
            .await;
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_goes_behind_a_stalled_batch() {
        let mut gated = Gated::with_behind(2, Duration::from_millis(20), 1);
        let read_only = gated.call(0);
        assert_eq!(gated.next_started().await, Some(0));
        gated.finish_read_only(0);
        assert_eq!(read_only.await.unwrap(), 0);
        let stalled = gated.call(1);
        assert_eq!(gated.next_started().await, Some(1));
        tokio::time::sleep(Duration::from_millis(30)).await;
        let next = gated.call(2);
        assert_eq!(gated.next_started().await, Some(2));
        assert_eq!(gated.lane(2), Lane::Beside);
        gated.finish(2);
        gated.finish(1);
        assert_eq!(next.await.unwrap(), 2);
        assert_eq!(stalled.await.unwrap(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_waits_for_the_one_at_the_database_while_it_is_quick() {
        let mut gated = Gated::start(2, Duration::from_secs(3600));
        let first = gated.call(0);
        assert_eq!(gated.next_started().await, Some(0));
        let second = gated.call(1);
        gated.assert_none_starts("the second batch waits").await;
        gated.finish(0);
        assert_eq!(first.await.unwrap(), 0);
        assert_eq!(gated.next_started().await, Some(1));
        gated.finish(1);
        assert_eq!(second.await.unwrap(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_batch_lets_the_next_go_out_beside_it() {
        let mut gated = Gated::start(2, Duration::from_millis(20));
        let stalled = gated.call(0);
        assert_eq!(gated.next_started().await, Some(0));
        let started_at = Instant::now();
        let beside = gated.call(1);
        assert_eq!(gated.next_started().await, Some(1));
        assert!(started_at.elapsed() >= Duration::from_millis(20));
        gated.finish(1);
        assert_eq!(beside.await.unwrap(), 1);
        // Both slots are taken once more: a third waits for one of them.
        let third = gated.call(2);
        let fourth = gated.call(3);
        assert_eq!(gated.next_started().await, Some(2));
        gated.assert_none_starts("no third slot").await;
        gated.finish(2);
        assert_eq!(third.await.unwrap(), 2);
        assert_eq!(gated.next_started().await, Some(3));
        gated.finish(3);
        gated.finish(0);
        assert_eq!(fourth.await.unwrap(), 3);
        assert_eq!(stalled.await.unwrap(), 0);
    }

    /// Batches in the regular slots still out `stuck_after` after the last
    /// of them went out are waiting on rows another transaction holds: more
    /// go out beside them, up to `stuck` at once, so the requests queued
    /// behind them are not stuck too.
    #[tokio::test(start_paused = true)]
    async fn stuck_batches_let_more_go_out_beside_them_up_to_a_limit() {
        let stuck_after = STUCK_AFTER;
        let mut gated = Gated::with_limits(two_slots(2, false));
        let calls: Vec<_> = (0..5).map(|n| gated.call(n)).collect();
        assert_eq!(gated.next_started().await, Some(0));
        assert_eq!(gated.next_started().await, Some(1));
        let regular_sent = Instant::now();
        assert_eq!(gated.next_started().await, Some(2));
        assert!(regular_sent.elapsed() >= stuck_after, "2 went out early");
        let stuck_sent = Instant::now();
        assert_eq!(gated.next_started().await, Some(3));
        assert_eq!(
            stuck_sent.elapsed(),
            Duration::ZERO,
            "the stuck slots are open"
        );
        for n in [2, 3] {
            assert_eq!(gated.lane(n), Lane::Beside);
        }
        gated
            .assert_none_starts("no more than two stuck slots")
            .await;
        // The regular slots' batches are still stuck: a freed stuck slot is
        // taken at once, however recently its batch went out.
        gated.finish(3);
        assert_eq!(gated.next_started().await, Some(4));
        assert_eq!(gated.lane(4), Lane::Beside);
        gated.finish(4);
        let quick = gated.call(5);
        let sent = Instant::now();
        assert_eq!(gated.next_started().await, Some(5));
        assert_eq!(sent.elapsed(), Duration::ZERO);
        gated.finish(5);
        assert_eq!(quick.await.unwrap(), 5);
        for n in [0, 1, 2] {
            gated.finish(n);
        }
        for (n, call) in (0..).zip(calls) {
            assert_eq!(call.await.unwrap(), n);
        }
    }

    /// With every slot held by a stuck batch `stuck_after` beyond when the
    /// stuck slots opened, a queue whose batches can run without waiting on
    /// a row lock sends them without a slot; a slot freed is taken first.
    #[tokio::test(start_paused = true)]
    async fn with_every_slot_stuck_batches_that_wait_on_no_lock_go_out_without_one() {
        let stuck_after = STUCK_AFTER;
        let mut gated = Gated::with_limits(two_slots(1, true));
        let calls: Vec<_> = (0..5).map(|n| gated.call(n)).collect();
        assert_eq!(gated.next_started().await, Some(0));
        assert_eq!(gated.next_started().await, Some(1));
        let regular_sent = Instant::now();
        assert_eq!(gated.next_started().await, Some(2));
        assert_eq!(gated.lane(2), Lane::Beside, "in the stuck slot");
        assert_eq!(gated.next_started().await, Some(3));
        assert!(
            regular_sent.elapsed() >= 2 * stuck_after,
            "3 went out early"
        );
        assert_eq!(gated.lane(3), Lane::Unlocked);
        let unlocked_sent = Instant::now();
        assert_eq!(gated.next_started().await, Some(4));
        assert_eq!(gated.lane(4), Lane::Unlocked);
        assert_eq!(
            unlocked_sent.elapsed(),
            Duration::ZERO,
            "no slot to wait for"
        );
        gated.finish(2);
        let next = gated.call(5);
        assert_eq!(gated.next_started().await, Some(5));
        assert_eq!(gated.lane(5), Lane::Beside, "the freed stuck slot first");
        for n in [0, 1, 3, 4, 5] {
            gated.finish(n);
        }
        assert_eq!(next.await.unwrap(), 5);
        for (n, call) in (0..).zip(calls) {
            assert_eq!(call.await.unwrap(), n);
        }
    }

    /// A queue whose batches may wait on row locks never sends one without
    /// a slot.
    #[tokio::test(start_paused = true)]
    async fn with_every_slot_stuck_other_batches_wait_for_one() {
        let mut gated = Gated::with_limits(two_slots(0, false));
        let calls: Vec<_> = (0..3).map(|n| gated.call(n)).collect();
        assert_eq!(gated.next_started().await, Some(0));
        assert_eq!(gated.next_started().await, Some(1));
        gated.assert_none_starts("no slot free").await;
        gated.finish(1);
        assert_eq!(gated.next_started().await, Some(2));
        for n in [0, 2] {
            gated.finish(n);
        }
        for (n, call) in (0..).zip(calls) {
            assert_eq!(call.await.unwrap(), n);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn with_one_slot_a_stalled_batch_holds_the_rest() {
        let mut gated = Gated::start(1, Duration::from_millis(20));
        let stalled = gated.call(0);
        assert_eq!(gated.next_started().await, Some(0));
        let next = gated.call(1);
        gated.assert_none_starts("nothing beside it").await;
        gated.finish(0);
        assert_eq!(stalled.await.unwrap(), 0);
        assert_eq!(gated.next_started().await, Some(1));
        gated.finish(1);
        assert_eq!(next.await.unwrap(), 1);
    }

    #[tokio::test]
    async fn results_go_back_in_order_and_batches_grow_under_load() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&sizes);
        let doubler =
            Coalescer::start(one_at_a_time(8), move |batch: Vec<u32>, _lane, _replies| {
                seen.lock().unwrap().push(batch.len());
                async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    batch.into_iter().map(|n| Ok(n * 2)).collect()
                }
            });
        let calls: Vec<_> = (0..20)
            .map(|n| {
                let doubler = doubler.clone();
                tokio::spawn(async move { (n, doubler.call(n).await.unwrap()) })
            })
            .collect();
        for call in calls {
            let (n, doubled) = call.await.unwrap();
            assert_eq!(doubled, n * 2);
        }
        let sizes = sizes.lock().unwrap();
        assert_eq!(sizes.iter().sum::<usize>(), 20);
        assert!(sizes.iter().all(|&size| size <= 8), "{sizes:?}");
        assert!(
            sizes.len() < 20,
            "concurrent calls were coalesced: {sizes:?}"
        );
    }

    #[tokio::test]
    async fn a_request_answered_early_has_its_reply_before_its_batch_is_done() {
        let (finish, finished) = oneshot::channel::<()>();
        let finished = Arc::new(Mutex::new(Some(finished)));
        let queue = Coalescer::start(
            one_at_a_time(4),
            move |batch: Vec<u32>, _lane, replies: Replies<u32>| {
                let finished = finished.lock().unwrap().take();
                async move {
                    let early = batch.iter().position(|&n| n == 2).unwrap();
                    replies.send(early, Ok(20));
                    if let Some(finished) = finished {
                        finished.await.unwrap();
                    }
                    // Already answered: this one is not the reply it gets.
                    batch.into_iter().map(|n| Ok(n * 100)).collect()
                }
            },
        );
        let (first, second) = (queue.enqueue(1).unwrap(), queue.enqueue(2).unwrap());
        let early = tokio::time::timeout(Duration::from_secs(10), second)
            .await
            .expect("replied to before its batch is done");
        assert_eq!(early.unwrap().unwrap(), 20);
        finish.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap(), 100);
    }

    #[tokio::test]
    async fn a_failed_request_fails_alone() {
        let flaky = Coalescer::start(
            one_at_a_time(4),
            |batch: Vec<u32>, _lane, _replies| async move {
                batch
                    .into_iter()
                    .map(|n| match n {
                        13 => Err(StoreError::Postgres("unlucky".into())),
                        n => Ok(n),
                    })
                    .collect()
            },
        );
        let (unlucky, lucky) = tokio::join!(flaky.call(13), flaky.call(7));
        assert!(unlucky.is_err());
        assert_eq!(lucky.unwrap(), 7);
    }

    #[tokio::test]
    async fn a_wrong_number_of_results_is_an_error_not_a_mismatch() {
        let broken = Coalescer::start(
            one_at_a_time(4),
            |_batch: Vec<u32>, _lane, _replies| async move { Vec::<Result<u32, _>>::new() },
        );
        assert!(broken.call(1).await.is_err());
    }
}
