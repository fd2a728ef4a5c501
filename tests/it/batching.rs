//! The coalesced claim and settle path: many concurrent requests share a
//! statement and a commit without weakening any per-key guarantee.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dedupe_proxy::config::StoreConfig;
use dedupe_proxy::store::{
    Claim, ClaimRequest, Fence, KeyStatus, SettledStatus, Settlement, Store, StoreError, WonFrom,
};

use crate::on_both_stores;
use crate::support::{
    Backend, Relay, TestStore, settle_attempt, until_waiting_on_locks, won_attempt,
};

on_both_stores!(
    keys_repeated_within_a_batch_are_each_won_exactly_once,
    concurrent_settles_are_each_fenced_by_their_own_attempt,
    a_done_queued_beside_its_own_attempts_release_wins_either_way,
    replicas_racing_for_failed_keys_take_each_back_exactly_once,
    in_one_batch_only_the_first_body_takes_failed_keys_back_where_others_are_rejected,
    one_batch_decides_each_key_by_its_own_row,
);

fn request(key: &str) -> ClaimRequest {
    ClaimRequest {
        source: Arc::from("src"),
        key: key.into(),
        payload_sha256: [7; 32],
        lease: Duration::from_secs(60),
        reject_mismatch: false,
    }
}

async fn open(url: &str) -> Store {
    open_with_timeout(url, StoreConfig::default().timeout).await
}

/// A store whose operations may take `timeout`: tests that hold claims on
/// row locks give the others room to be decided on a loaded machine.
async fn open_with_timeout(url: &str, timeout: Duration) -> Store {
    let config = StoreConfig {
        url: url.into(),
        timeout,
        ..StoreConfig::default()
    };
    let store = Store::open(&config).expect("open store");
    store.migrate().await.expect("migrate");
    store
}

/// Claims every key concurrently, so they coalesce into shared batches.
/// Claims new keys at once, and returns each one's fence.
async fn first_fences(store: &Store, keys: &[String]) -> HashMap<String, Fence> {
    let mut fences = HashMap::new();
    for (key, claim) in claim_all(store, keys).await {
        match claim {
            Ok(Claim::Won { fence, .. }) if fence.attempt == 1 => fences.insert(key, fence),
            other => panic!("{key}: {other:?}"),
        };
    }
    fences
}

async fn claim_all(store: &Store, keys: &[String]) -> Vec<(String, Result<Claim, String>)> {
    let calls: Vec<_> = keys
        .iter()
        .map(|key| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move {
                let claim = store.claim(&request(&key)).await.map_err(|e| e.to_string());
                (key, claim)
            })
        })
        .collect();
    let mut results = Vec::new();
    for call in calls {
        results.push(call.await.unwrap());
    }
    results
}

/// Every replica claims every key twice at once, each in its own (rotated)
/// order; every claim's result.
async fn race_replicas(
    replicas: &[Store],
    keys: &[String],
) -> Vec<(String, Result<Claim, String>)> {
    let races: Vec<_> = replicas
        .iter()
        .enumerate()
        .map(|(n, replica)| {
            let mut mine: Vec<String> = keys.iter().chain(keys).cloned().collect();
            mine.rotate_left(n * 7);
            let replica = replica.clone();
            tokio::spawn(async move { claim_all(&replica, &mine).await })
        })
        .collect();
    let mut results = Vec::new();
    for race in races {
        results.extend(race.await.unwrap());
    }
    results
}

async fn keys_repeated_within_a_batch_are_each_won_exactly_once(backend: Backend) {
    let test_store = TestStore::new(backend).await;
    let store = open(&test_store.url).await;
    let keys: Vec<String> = (0..300).map(|i| format!("k{}", i % 30)).collect();
    let mut wins: HashMap<String, usize> = HashMap::new();
    for (key, claim) in claim_all(&store, &keys).await {
        match claim.unwrap() {
            Claim::Won {
                fence: Fence { attempt: 1, .. },
                ..
            } => *wins.entry(key).or_default() += 1,
            Claim::InFlight {
                payload_mismatch: false,
            } => {}
            other => panic!("{key}: unexpected {other:?}"),
        }
    }
    assert_eq!(wins.len(), 30, "every key won once: {wins:?}");
    assert!(wins.values().all(|&n| n == 1), "{wins:?}");
}

/// New, done, failed, expired and live keys claimed together: each is
/// decided by its own row, and the done and live rows are left as they were.
async fn one_batch_decides_each_key_by_its_own_row(backend: Backend) {
    let test_store = TestStore::new(backend).await;
    let store = open(&test_store.url).await;
    let named = |kind: &'static str| (0..8).map(move |i| format!("{kind}{i}"));
    let done = Settlement {
        status: SettledStatus::Done,
        response_status: Some(200),
    };
    for key in named("done").chain(named("failed")).chain(named("live")) {
        let claim = store.claim(&request(&key)).await.unwrap();
        assert!(won_attempt(&claim) == Some(1), "{key}");
        let outcome = match &key[..4] {
            "done" => done,
            "fail" => Settlement::RELEASED,
            _ => continue,
        };
        assert!(
            settle_attempt(&store, "src", &key, 1, outcome)
                .await
                .unwrap(),
            "{key}"
        );
    }
    for key in named("expired") {
        let lapsing = ClaimRequest {
            lease: Duration::ZERO,
            ..request(&key)
        };
        let claim = store.claim(&lapsing).await.unwrap();
        assert!(won_attempt(&claim) == Some(1), "{key}");
    }
    let mut rows_before = HashMap::new();
    for key in named("done").chain(named("live")) {
        let row = store.show("src", &key).await.unwrap().unwrap();
        rows_before.insert(key, row);
    }
    let keys: Vec<String> = ["new", "done", "failed", "expired", "live"]
        .into_iter()
        .flat_map(named)
        .collect();
    for (key, claim) in claim_all(&store, &keys).await {
        let claim = claim.unwrap();
        let decided = match &key[..3] {
            "new" => matches!(
                claim,
                Claim::Won {
                    fence: Fence { attempt: 1, .. },
                    from: WonFrom::New,
                    ..
                }
            ),
            "don" => matches!(
                claim,
                Claim::Done {
                    payload_mismatch: false,
                    ..
                }
            ),
            "fai" => matches!(
                claim,
                Claim::Won {
                    fence: Fence { attempt: 2, .. },
                    from: WonFrom::Failed,
                    ..
                }
            ),
            "exp" => matches!(
                claim,
                Claim::Won {
                    fence: Fence { attempt: 2, .. },
                    from: WonFrom::ExpiredLease,
                    ..
                }
            ),
            _ => matches!(
                claim,
                Claim::InFlight {
                    payload_mismatch: false
                }
            ),
        };
        assert!(decided, "{key}: {claim:?}");
    }
    for (key, row) in rows_before {
        let after = store.show("src", &key).await.unwrap().unwrap();
        assert_eq!(
            (
                after.status,
                after.attempts,
                after.claimed_at,
                after.lease_expires_at
            ),
            (
                row.status,
                row.attempts,
                row.claimed_at,
                row.lease_expires_at
            ),
            "{key} was written"
        );
    }
}

async fn concurrent_settles_are_each_fenced_by_their_own_attempt(backend: Backend) {
    let test_store = TestStore::new(backend).await;
    let store = open(&test_store.url).await;
    let keys: Vec<String> = (0..100).map(|i| format!("s{i}")).collect();
    let fences = first_fences(&store, &keys).await;
    // Half the settles carry the owner's fence; the others another attempt
    // number, or another claim time (a claim of the key before it was
    // deleted and claimed anew).
    let settles: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let (store, key) = (store.clone(), key.clone());
            let owner = fences[&key];
            let fence = match i % 4 {
                0 | 2 => owner,
                1 => Fence {
                    attempt: 2,
                    ..owner
                },
                _ => Fence {
                    claimed_at: owner.claimed_at - Duration::from_millis(1),
                    ..owner
                },
            };
            tokio::spawn(async move {
                let done = Settlement {
                    status: SettledStatus::Done,
                    response_status: Some(200),
                };
                let written = store.settle("src", &key, fence, done).await.unwrap();
                (fence == owner, written)
            })
        })
        .collect();
    for settle in settles {
        let (owner, written) = settle.await.unwrap();
        assert_eq!(written, owner, "only the owning attempt settles");
    }
    for (index, (_, claim)) in claim_all(&store, &keys).await.into_iter().enumerate() {
        let claim = claim.unwrap();
        if index % 2 == 0 {
            assert!(matches!(claim, Claim::Done { .. }), "{claim:?}");
        } else {
            assert!(matches!(claim, Claim::InFlight { .. }), "{claim:?}");
        }
    }
}

/// Shutdown releases a claim whose upstream answers just then: the two
/// settles of one attempt may share a batch, in either order, and the
/// upstream's `done` must be what stays.
async fn a_done_queued_beside_its_own_attempts_release_wins_either_way(backend: Backend) {
    let test_store = TestStore::new(backend).await;
    let store = open(&test_store.url).await;
    let keys: Vec<String> = (0..100).map(|i| format!("r{i}")).collect();
    let fences = first_fences(&store, &keys).await;
    let done = Settlement {
        status: SettledStatus::Done,
        response_status: Some(200),
    };
    let settle = |key: &String, settlement: Settlement| {
        let (store, key, fence) = (store.clone(), key.clone(), fences[key]);
        tokio::spawn(async move { store.settle("src", &key, fence, settlement).await.unwrap() })
    };
    let settles: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            if i % 2 == 0 {
                let release = settle(key, Settlement::RELEASED);
                (settle(key, done), release)
            } else {
                let done = settle(key, done);
                (done, settle(key, Settlement::RELEASED))
            }
        })
        .collect();
    for (key, (done, release)) in keys.iter().zip(settles) {
        assert!(done.await.unwrap(), "{key}: the done is written");
        release.await.unwrap();
        let row = store.show("src", key).await.unwrap().unwrap();
        assert_eq!(
            (row.status, row.response_status),
            (KeyStatus::Done, Some(200)),
            "{key}"
        );
    }
}

/// Several replicas (each its own store and connections) claim the same
/// failed keys at once, in batches: each key is taken back by one of them.
async fn replicas_racing_for_failed_keys_take_each_back_exactly_once(backend: Backend) {
    let test_store = TestStore::new(backend).await;
    let replicas = [
        open(&test_store.url).await,
        open(&test_store.url).await,
        open(&test_store.url).await,
    ];
    let keys: Vec<String> = (0..30).map(|i| format!("f{i}")).collect();
    for (key, fence) in first_fences(&replicas[0], &keys).await {
        let released = replicas[0].settle("src", &key, fence, Settlement::RELEASED);
        assert!(released.await.unwrap(), "{key}");
    }
    let mut winners: HashMap<String, usize> = HashMap::new();
    for (key, claim) in race_replicas(&replicas, &keys).await {
        match claim {
            Ok(Claim::Won {
                fence: Fence { attempt, .. },
                ..
            }) => {
                assert_eq!(attempt, 2, "{key}");
                *winners.entry(key).or_default() += 1;
            }
            Ok(Claim::InFlight { .. }) => {}
            other => panic!("{key}: {other:?}"),
        }
    }
    for key in &keys {
        assert_eq!(winners.get(key), Some(&1), "{key} is taken back once");
    }
}

/// Each row of a batch is judged by its own body and its own route's setting.
async fn in_one_batch_only_the_first_body_takes_failed_keys_back_where_others_are_rejected(
    backend: Backend,
) {
    let test_store = TestStore::new(backend).await;
    let store = open(&test_store.url).await;
    let keys: Vec<String> = (0..40).map(|i| format!("m{i}")).collect();
    for (key, fence) in first_fences(&store, &keys).await {
        let released = store.settle("src", &key, fence, Settlement::RELEASED);
        assert!(released.await.unwrap(), "{key}");
    }
    let calls: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let claim = ClaimRequest {
                payload_sha256: if i % 2 == 0 { [7; 32] } else { [8; 32] },
                reject_mismatch: i % 4 != 3,
                ..request(key)
            };
            let store = store.clone();
            tokio::spawn(async move { store.claim(&claim).await.unwrap() })
        })
        .collect();
    for (i, call) in calls.into_iter().enumerate() {
        let claim = call.await.unwrap();
        let expected = match i % 4 {
            // The first body, and another body where it is only counted.
            0 | 2 => (true, false, 2),
            3 => (true, true, 2),
            // Another body where it is rejected: the row is left alone.
            _ => (false, true, 1),
        };
        let attempts = store.show("src", &keys[i]).await.unwrap().unwrap().attempts;
        let won = won_attempt(&claim) == Some(2);
        assert_eq!(
            (won, claim.payload_mismatch(), attempts),
            expected,
            "{i}: {claim:?}"
        );
    }
}

/// A duplicate of a `done` key is decided without writing: it does not lock
/// the row, so it cannot wait behind whoever holds it (and its commit waits
/// for no WAL flush). Batched or alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_claim_takes_no_row_lock() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open(&test_store.url).await;
    assert!(matches!(
        store.claim(&request("d1")).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            ..
        }
    ));
    let done = Settlement {
        status: SettledStatus::Done,
        response_status: Some(200),
    };
    assert!(settle_attempt(&store, "src", "d1", 1, done).await.unwrap());

    let mut holder = test_store.postgres().await;
    let lock = lock_key(&mut holder, "d1").await;
    let alone = store.claim(&request("d1")).await;
    assert!(matches!(alone, Ok(Claim::Done { .. })), "{alone:?}");
    let keys: Vec<String> = ["d1", "n1", "d1", "n2", "n3"].map(String::from).into();
    for (key, claim) in claim_all(&store, &keys).await {
        match key.as_str() {
            "d1" => assert!(matches!(claim, Ok(Claim::Done { .. })), "{claim:?}"),
            _ => assert!(
                matches!(
                    claim,
                    Ok(Claim::Won {
                        fence: Fence { attempt: 1, .. },
                        ..
                    })
                ),
                "{claim:?}"
            ),
        }
    }
    lock.rollback().await.unwrap();
}

/// A database whose transactions default to `serializable` (or
/// `repeatable read`) rolls back a claim that races another replica's for
/// the same key, where `read committed` makes it wait: such a statement is
/// run again, so racing replicas still each get an answer, and each key
/// one owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_racing_on_a_serializable_database_each_get_an_answer() {
    let test_store = TestStore::new(Backend::Postgres).await;
    test_store
        .postgres()
        .await
        .batch_execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = serializable', current_database()); END $$",
        )
        .await
        .unwrap();
    let replicas = [
        open(&test_store.url).await,
        open(&test_store.url).await,
        open(&test_store.url).await,
    ];
    let keys: Vec<String> = (0..40).map(|i| format!("s{i}")).collect();
    let (replicas, keys) = (&replicas, &keys);
    let race = |attempt: i32| async move {
        let mut winners: HashMap<String, Fence> = HashMap::new();
        for (key, claim) in race_replicas(replicas, keys).await {
            match claim {
                Ok(Claim::Won { fence, .. }) => {
                    assert_eq!(fence.attempt, attempt, "{key}");
                    assert!(
                        winners.insert(key.clone(), fence).is_none(),
                        "{key} won twice"
                    );
                }
                Ok(Claim::InFlight { .. }) => {}
                other => panic!("{key}: {other:?}"),
            }
        }
        winners
    };
    let first = race(1).await;
    assert_eq!(first.len(), keys.len(), "every new key is won once");
    let releases: Vec<_> = first
        .into_iter()
        .map(|(key, fence)| {
            let replica = replicas[0].clone();
            tokio::spawn(async move {
                replica
                    .settle("src", &key, fence, Settlement::RELEASED)
                    .await
            })
        })
        .collect();
    for release in releases {
        assert!(release.await.unwrap().unwrap());
    }
    let second = race(2).await;
    assert_eq!(
        second.len(),
        keys.len(),
        "every failed key is taken back once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_database_refuses_fails_alone() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open(&test_store.url).await;
    // PostgreSQL text cannot hold NUL: that row fails, the others must not.
    let mut keys: Vec<String> = (0..40).map(|i| format!("good{i}")).collect();
    keys.insert(20, "bad\0key".into());
    for (key, claim) in claim_all(&store, &keys).await {
        if key.contains('\0') {
            assert!(claim.is_err(), "the refused key fails");
        } else {
            assert!(
                matches!(
                    claim,
                    Ok(Claim::Won {
                        fence: Fence { attempt: 1, .. },
                        ..
                    })
                ),
                "{key}: {claim:?}"
            );
        }
    }
}

/// New keys are committed by the claim statement before the keys it found
/// failed are taken back by another: when the database refuses the take-back
/// (here, a trigger that refuses to update the row), only the failed key's
/// claim fails. The new keys of its batch stay won, and the failed key is
/// still there to be taken back once the database lets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_back_the_database_refuses_fails_only_its_own_key() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open(&test_store.url).await;
    assert!(matches!(
        store.claim(&request("failed")).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            ..
        }
    ));
    assert!(
        settle_attempt(&store, "src", "failed", 1, Settlement::RELEASED)
            .await
            .unwrap()
    );
    let client = test_store.postgres().await;
    client
        .batch_execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql
               AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$;
             CREATE TRIGGER refuse BEFORE UPDATE ON processed_events FOR EACH ROW
               WHEN (OLD.event_id = 'failed') EXECUTE FUNCTION refuse()",
        )
        .await
        .unwrap();

    // `new0` goes out alone; the rest queue behind it as one batch.
    let mut keys: Vec<String> = (0..10).map(|i| format!("new{i}")).collect();
    keys.insert(1, "failed".into());
    for (key, claim) in claim_all(&store, &keys).await {
        if key == "failed" {
            assert!(claim.is_err(), "the key that cannot be taken back fails");
        } else {
            assert!(
                matches!(
                    claim,
                    Ok(Claim::Won {
                        fence: Fence { attempt: 1, .. },
                        from: WonFrom::New,
                        ..
                    })
                ),
                "{key}: {claim:?}"
            );
            let row = store.show("src", &key).await.unwrap().unwrap();
            assert_eq!(
                (row.status, row.attempts),
                (KeyStatus::Processing, 1),
                "{key}"
            );
        }
    }
    let row = store.show("src", "failed").await.unwrap().unwrap();
    assert_eq!((row.status, row.attempts), (KeyStatus::Failed, 1));

    client
        .batch_execute("DROP TRIGGER refuse ON processed_events")
        .await
        .unwrap();
    assert!(matches!(
        store.claim(&request("failed")).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 2, .. },
            from: WonFrom::Failed,
            ..
        }
    ));
}

/// A runtime on a thread of its own, as a serving thread's is, until
/// stopped.
struct HomeThread {
    runtime: tokio::runtime::Handle,
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl HomeThread {
    fn start() -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                let _ = stopped.await;
            });
        });
        Self {
            runtime: handle,
            stop,
            thread,
        }
    }

    /// Ends the runtime, dropping every task it still runs.
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::task::spawn_blocking(move || self.thread.join().unwrap())
            .await
            .unwrap();
    }
}

/// Given a home runtime, the store opens and drives its connections there,
/// whoever asks first (here the migration, from the test's runtime), and runs
/// its batches there: stopping that runtime closes them all. Outside it the
/// store still works on a connection of the caller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_talks_to_postgres_from_its_home_runtime() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let relay = Relay::start(test_store.postgres_addr(), true).await;
    let config = StoreConfig {
        url: test_store.url_via(relay.addr),
        ..StoreConfig::default()
    };
    let store = Store::open(&config).unwrap();
    let home = HomeThread::start();
    store.set_home(home.runtime.clone());
    store.migrate().await.unwrap();
    let claim = store.claim(&request("k1")).await.unwrap();
    assert!(won_attempt(&claim) == Some(1), "{claim:?}");
    assert!(relay.open_connections() > 0);
    home.stop().await;
    relay.wait_until_all_closed().await;
    let after = store.claim(&request("k2")).await;
    assert!(
        matches!(&after, Err(StoreError::Postgres(message)) if message.contains("dispatcher has stopped")),
        "the batches stopped with their runtime: {after:?}"
    );
    store.ping().await.unwrap();
    assert_eq!(relay.open_connections(), 1);
    let row = store.show("src", "k1").await.unwrap().unwrap();
    assert_eq!(row.status, KeyStatus::Processing);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_mid_batch_never_yields_two_owners() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let relay = Relay::start(test_store.postgres_addr(), true).await;
    let url = test_store.url_via(relay.addr);
    let store = open(&url).await;
    let keys: Vec<String> = (0..400).map(|i| format!("o{}", i % 100)).collect();
    let claims = tokio::spawn({
        let store = store.clone();
        async move { claim_all(&store, &keys).await }
    });
    relay.cut().await;
    let results = claims.await.unwrap();
    relay.restore();

    let mut owners: HashMap<String, i32> = HashMap::new();
    for (key, claim) in &results {
        if let Ok(Claim::Won {
            fence: Fence { attempt, .. },
            ..
        }) = claim
        {
            assert!(
                owners.insert(key.clone(), *attempt).is_none(),
                "{key} won twice"
            );
        }
    }
    // Every reported owner really holds its key; keys whose claim errored are
    // either absent or held (committed before the connection broke), never
    // owned twice.
    let client = test_store.postgres().await;
    let rows = client
        .query(
            "SELECT event_id, status, attempts FROM processed_events",
            &[],
        )
        .await
        .unwrap();
    let stored: HashMap<String, (String, i32)> = rows
        .iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect();
    for (key, (status, attempts)) in &stored {
        assert_eq!((status.as_str(), *attempts), ("processing", 1), "{key}");
    }
    for (key, attempt) in &owners {
        assert_eq!(
            stored.get(key).map(|(_, attempts)| attempts),
            Some(attempt),
            "{key}'s owner holds it"
        );
    }
    let failed = results.iter().filter(|(_, claim)| claim.is_err()).count();
    println!(
        "outage mid-batch: {} won, {failed} failed of {}",
        owners.len(),
        results.len()
    );
}

/// A duplicate that arrives while the first delivery's insert is still
/// uncommitted waits for it, then loses to a row its statement's snapshot
/// does not hold: the key's payload hash is still compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_loses_to_an_uncommitted_insert_still_compares_bodies() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open(&test_store.url).await;
    let mut first = test_store.postgres().await;
    let (insert, duplicate) =
        claim_behind_uncommitted_insert(&test_store, &store, &mut first, "r1").await;
    insert.commit().await.unwrap();
    assert_eq!(
        duplicate.await.unwrap().unwrap(),
        Claim::InFlight {
            payload_mismatch: true
        }
    );
}

/// A batch waiting on a row another replica is inserting holds back the
/// claims queued behind it only briefly: they go out beside it and are
/// decided while it still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_behind_a_batch_waiting_on_a_row_lock_still_go_out() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open(&test_store.url).await;
    let mut other_replica = test_store.postgres().await;
    let (insert, held) =
        claim_behind_uncommitted_insert(&test_store, &store, &mut other_replica, "held").await;
    // Held back until the other batch's lock is released, the claim would
    // end in `store.timeout` instead.
    claim_a_free_key(&store, "the other batch waits").await;
    assert!(!held.is_finished());
    insert.commit().await.unwrap();
    assert!(matches!(
        held.await.unwrap().unwrap(),
        Claim::InFlight { .. }
    ));
}

/// A key found failed whose row another transaction holds (a take-back on
/// another replica, a settle, a `keys` command, a transaction left open) is
/// answered in flight at once rather than sent to wait on the lock, holding
/// a claim slot for as long as the row is held: its sender retries, and
/// takes the key back once the row is let go. The other keys of its batch
/// are decided as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_key_whose_row_another_transaction_holds_is_answered_in_flight() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open_with_timeout(&test_store.url, Duration::from_secs(10)).await;
    for key in ["held", "free"] {
        assert!(won_attempt(&store.claim(&request(key)).await.unwrap()) == Some(1));
        assert!(
            settle_attempt(&store, "src", key, 1, Settlement::RELEASED)
                .await
                .unwrap()
        );
    }
    let mut holder = test_store.postgres().await;
    let hold = lock_key(&mut holder, "held").await;

    let keys: Vec<String> = ["new", "held", "free"].map(String::from).to_vec();
    let claims = tokio::time::timeout(Duration::from_secs(10), claim_all(&store, &keys))
        .await
        .expect("answered while the row is held");
    for (key, claim) in claims {
        let expected = match key.as_str() {
            "held" => matches!(
                claim,
                Ok(Claim::InFlight {
                    payload_mismatch: false
                })
            ),
            "free" => matches!(
                claim,
                Ok(Claim::Won {
                    fence: Fence { attempt: 2, .. },
                    from: WonFrom::Failed,
                    ..
                })
            ),
            _ => matches!(
                claim,
                Ok(Claim::Won {
                    fence: Fence { attempt: 1, .. },
                    from: WonFrom::New,
                    ..
                })
            ),
        };
        assert!(expected, "{key}: {claim:?}");
    }
    let row = store.show("src", "held").await.unwrap().unwrap();
    assert_eq!((row.status, row.attempts), (KeyStatus::Failed, 1));

    hold.commit().await.unwrap();
    assert!(matches!(
        store.claim(&request("held")).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 2, .. },
            from: WonFrom::Failed,
            ..
        }
    ));
}

/// While claims come back read-only (duplicates), the next batches are
/// pipelined on the connection of those still at the database. A batch that
/// then takes a key back, a write whose commit may be slow (a synchronous
/// standby lagging, say; here, a trigger that waits on a lock), first takes
/// its connection out of the pipeline: the claims sent after it go out on
/// another connection and are decided while it still waits, and a second
/// delivery of that key is answered in flight rather than sent to wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_sent_while_a_take_back_is_slow_still_go_out() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open_with_timeout(&test_store.url, Duration::from_secs(10)).await;
    let done = Settlement {
        status: SettledStatus::Done,
        response_status: Some(200),
    };
    for (key, outcome) in [("done", done), ("failed", Settlement::RELEASED)] {
        let claim = store.claim(&request(key)).await.unwrap();
        assert!(won_attempt(&claim) == Some(1), "{key}");
        assert!(
            settle_attempt(&store, "src", key, 1, outcome)
                .await
                .unwrap(),
            "{key}"
        );
    }
    assert!(
        matches!(
            store.claim(&request("done")).await.unwrap(),
            Claim::Done { .. }
        ),
        "a read-only batch came back"
    );
    let holder = test_store.postgres().await;
    holder
        .batch_execute(
            "CREATE FUNCTION stall() RETURNS trigger LANGUAGE plpgsql
               AS $$ BEGIN PERFORM pg_advisory_xact_lock(7); RETURN NEW; END $$;
             CREATE TRIGGER stall BEFORE UPDATE ON processed_events FOR EACH ROW
               WHEN (OLD.event_id = 'failed') EXECUTE FUNCTION stall();
             SELECT pg_advisory_lock(7)",
        )
        .await
        .unwrap();
    let taking_back = tokio::spawn({
        let store = store.clone();
        async move { store.claim(&request("failed")).await }
    });
    until_waiting_on_locks(&test_store.postgres().await, 1).await;

    // A second delivery of the key would only wait beside the first, and
    // two such batches would hold every claim slot: it is answered in
    // flight at once (at most one of the two could win).
    let second = tokio::time::timeout(Duration::from_secs(10), store.claim(&request("failed")))
        .await
        .expect("answered while the first take-back waits");
    assert!(
        matches!(
            second,
            Ok(Claim::InFlight {
                payload_mismatch: false
            })
        ),
        "{second:?}"
    );
    claim_a_free_key(&store, "the take-back waits").await;
    assert!(!taking_back.is_finished());
    holder
        .batch_execute("SELECT pg_advisory_unlock(7)")
        .await
        .unwrap();
    assert!(matches!(
        taking_back.await.unwrap().unwrap(),
        Claim::Won {
            fence: Fence { attempt: 2, .. },
            from: WonFrom::Failed,
            ..
        }
    ));
    let third = store.claim(&request("failed")).await.unwrap();
    assert!(matches!(third, Claim::InFlight { .. }), "{third:?}");
}

/// Two claim batches waiting on rows another replica is inserting hold both
/// claim slots: once they have waited long enough to be judged stuck, not
/// slow, the claims queued behind them go out beside them and are decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_behind_two_batches_waiting_on_row_locks_still_go_out() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open_with_timeout(&test_store.url, Duration::from_secs(10)).await;
    let mut other_replica = test_store.postgres().await;
    let insert = other_replica.transaction().await.unwrap();
    insert
        .execute(
            "INSERT INTO processed_events (source, event_id, status, lease_expires_at)
             SELECT 'src', k, 'processing', now() + interval '1 minute'
               FROM unnest(ARRAY['held_a', 'held_b']) k",
            &[],
        )
        .await
        .unwrap();
    let observer = test_store.postgres().await;
    let mut waiting = Vec::new();
    for (number, key) in [(1, "held_a"), (2, "held_b")] {
        waiting.push(tokio::spawn({
            let store = store.clone();
            async move { store.claim(&request(key)).await }
        }));
        until_waiting_on_locks(&observer, number).await;
    }

    claim_a_free_key(&store, "two batches wait").await;
    insert.commit().await.unwrap();
    for claim in waiting {
        let claim = claim.await.unwrap();
        assert!(matches!(claim, Ok(Claim::InFlight { .. })), "{claim:?}");
    }
}

/// A claim answered `store.timeout` is still decided once its statement
/// runs; when it wins, nobody forwards it, so it is released at once instead
/// of holding the key `processing` (and the sender's retries `in-flight`)
/// until its lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_times_out_and_then_wins_is_released() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let config = StoreConfig {
        url: test_store.url.clone(),
        timeout: Duration::from_millis(300),
        ..StoreConfig::default()
    };
    let store = Store::open(&config).expect("open store");
    store.migrate().await.expect("migrate");
    let mut blocker = test_store.postgres().await;
    let insert = insert_uncommitted(&mut blocker, "late", [7; 32]).await;
    let timed_out = store.claim(&request("late")).await;
    assert!(
        matches!(timed_out, Err(StoreError::Timeout(_))),
        "{timed_out:?}"
    );
    let observer = test_store.postgres().await;
    until_waiting_on_locks(&observer, 1).await;
    insert.rollback().await.unwrap();

    let released = async {
        loop {
            let record = store.show("src", "late").await.unwrap();
            if let Some(record) = record.filter(|r| r.status != KeyStatus::Processing) {
                return record;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let record = tokio::time::timeout(Duration::from_secs(10), released)
        .await
        .expect("the late win is released");
    assert_eq!((record.status, record.attempts), (KeyStatus::Failed, 1));
    assert!(
        matches!(
            store.claim(&request("late")).await.unwrap(),
            Claim::Won {
                fence: Fence { attempt: 2, .. },
                ..
            }
        ),
        "the sender's retry takes the key over"
    );
}

/// Claims a key nobody holds, and checks that it is won while `waiting`
/// (bounded: a claim held back behind the waiting one fails the test).
async fn claim_a_free_key(store: &Store, waiting: &str) {
    let free = tokio::time::timeout(Duration::from_secs(10), store.claim(&request("free")))
        .await
        .unwrap_or_else(|_| panic!("a key nobody holds is claimed while {waiting}"));
    assert!(won_attempt(&free.unwrap()) == Some(1));
}

/// Locks the row of `src`/`key` in a transaction left open.
async fn lock_key<'a>(
    client: &'a mut tokio_postgres::Client,
    key: &str,
) -> tokio_postgres::Transaction<'a> {
    let lock = client.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM processed_events WHERE source = 'src' AND event_id = $1 FOR UPDATE",
        &[&key],
    )
    .await
    .unwrap();
    lock
}

/// Inserts `src`/`key` as `processing` in a transaction left open: a claim
/// of the key waits on it until it commits or rolls back.
async fn insert_uncommitted<'a>(
    client: &'a mut tokio_postgres::Client,
    key: &str,
    payload_sha256: [u8; 32],
) -> tokio_postgres::Transaction<'a> {
    let insert = client.transaction().await.unwrap();
    insert
        .execute(
            "INSERT INTO processed_events (source, event_id, status, payload_sha256, lease_expires_at)
             VALUES ('src', $1, 'processing', $2, now() + interval '1 minute')",
            &[&key, &&payload_sha256[..]],
        )
        .await
        .unwrap();
    insert
}

/// Starts a claim of `key` behind `client`'s uncommitted insert of it, and
/// returns the insert's transaction and the claim once the claim waits on it.
async fn claim_behind_uncommitted_insert<'a>(
    test_store: &TestStore,
    store: &Store,
    client: &'a mut tokio_postgres::Client,
    key: &'static str,
) -> (
    tokio_postgres::Transaction<'a>,
    tokio::task::JoinHandle<Result<Claim, StoreError>>,
) {
    let insert = insert_uncommitted(client, key, [1; 32]).await;
    let claim = tokio::spawn({
        let store = store.clone();
        async move { store.claim(&request(key)).await }
    });
    let observer = test_store.postgres().await;
    until_waiting_on_locks(&observer, 1).await;
    (insert, claim)
}

/// What a write-order test batches: a claim or a settle of one key (by the
/// fence of its first claim, where it has one), answering whether it took
/// effect.
type KeyOperation =
    fn(Store, &'static str, Option<Fence>) -> futures_util::future::BoxFuture<'static, bool>;

/// How a write-order test holds a key's row in a transaction of its own: a
/// settle waits on a row locked, a claim of a new key on a row inserted and
/// not yet committed.
#[derive(Clone, Copy)]
enum Hold {
    Locked,
    Inserted,
}

impl Hold {
    async fn row(
        self,
        transaction: &tokio_postgres::Transaction<'_>,
        key: &str,
    ) -> Result<u64, tokio_postgres::Error> {
        let statement = match self {
            Hold::Locked => {
                "SELECT 1 FROM processed_events WHERE source = 'src' AND event_id = $1 FOR UPDATE"
            }
            Hold::Inserted => {
                "INSERT INTO processed_events (source, event_id, status, lease_expires_at)
                 VALUES ('src', $1, 'processing', now() + interval '1 minute')"
            }
        };
        transaction.execute(statement, &[&key]).await
    }
}

/// A batch writes its rows in key order, whatever order its requests were
/// queued in: while it waits for the first key, held by another
/// transaction, that transaction can still write the second. Written in
/// queue order instead, the batch would hold the second key while waiting
/// for the first, and two such batches (two replicas, or one replica's two
/// batches in flight) would deadlock, each deadlock costing the server's
/// `deadlock_timeout` before it refused one of them. `effect` is whether
/// the operations take effect once the holding transaction commits.
async fn a_batch_writes_its_rows_in_key_order(
    hold: Hold,
    fences: HashMap<String, Fence>,
    store: Store,
    test_store: &TestStore,
    operation: KeyOperation,
    effect: bool,
) {
    let operation = move |store, key: &'static str| operation(store, key, fences.get(key).copied());
    let observer = test_store.postgres().await;

    // Both batches in flight wait on rows held here, so `b` and `a`, queued
    // behind them in that order, go out together as one batch.
    let mut holder_cd = test_store.postgres().await;
    let hold_cd = holder_cd.transaction().await.unwrap();
    hold.row(&hold_cd, "c").await.unwrap();
    hold.row(&hold_cd, "d").await.unwrap();
    let c = tokio::spawn(operation(store.clone(), "c"));
    until_waiting_on_locks(&observer, 1).await;
    let d = tokio::spawn(operation(store.clone(), "d"));
    until_waiting_on_locks(&observer, 2).await;
    let mut holder_a = test_store.postgres().await;
    let hold_a = holder_a.transaction().await.unwrap();
    hold.row(&hold_a, "a").await.unwrap();
    let b_then_a =
        tokio::spawn(
            async move { tokio::join!(operation(store.clone(), "b"), operation(store, "a")) },
        );
    // The two are queued as soon as that task first runs; the query text
    // checked below shows whether they went out together.
    tokio::task::yield_now().await;
    hold_cd.commit().await.unwrap();
    assert_eq!((c.await.unwrap(), d.await.unwrap()), (effect, effect));

    let waiting = until_waiting_on_locks(&observer, 1).await;
    assert!(
        waiting.iter().any(|query| query.contains("unnest")),
        "`b` and `a` wait as one batch: {waiting:?}"
    );
    // Bounded, not timed: `b` is free unless the batch took it out of key
    // order, and then this waits on a deadlock the server would only break
    // after `deadlock_timeout` (1 s).
    hold_a
        .batch_execute("SET LOCAL lock_timeout = '500ms'")
        .await
        .unwrap();
    hold.row(&hold_a, "b")
        .await
        .expect("`b` is not written while the batch waits for `a`");
    hold_a.commit().await.unwrap();
    assert_eq!(b_then_a.await.unwrap(), (effect, effect));
}

/// Four keys, `a` to `d`, each claimed once (`processing`, attempt 1).
///
/// The table is analyzed, as the proxy's is once it grows: without
/// statistics PostgreSQL takes it for a large one and hashes the statement's
/// input instead, and then the update follows the rows' places in the table,
/// which the claims' batching left in no particular order, not the input's.
async fn store_with_four_keys(test_store: &TestStore) -> (Store, HashMap<String, Fence>) {
    let store = open(&test_store.url).await;
    let keys: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
    let fences = first_fences(&store, &keys).await;
    let client = test_store.postgres().await;
    client
        .batch_execute("ANALYZE processed_events")
        .await
        .unwrap();
    (store, fences)
}

/// Claims of new keys, which another replica inserts meanwhile and which
/// the claims therefore lose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_batch_inserts_its_keys_in_key_order() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open(&test_store.url).await;
    let claim: KeyOperation = |store, key, _| {
        Box::pin(async move {
            let claim = store.claim(&request(key)).await;
            matches!(claim, Ok(Claim::Won { .. }))
        })
    };
    a_batch_writes_its_rows_in_key_order(
        Hold::Inserted,
        HashMap::new(),
        store,
        &test_store,
        claim,
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_batch_writes_its_keys_in_key_order() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let (store, fences) = store_with_four_keys(&test_store).await;
    let settle: KeyOperation = |store, key, fence| {
        Box::pin(async move {
            let done = Settlement {
                status: SettledStatus::Done,
                response_status: Some(200),
            };
            let fence = fence.expect("each key has its first claim's fence");
            store.settle("src", key, fence, done).await.unwrap()
        })
    };
    a_batch_writes_its_rows_in_key_order(Hold::Locked, fences, store, &test_store, settle, true)
        .await;
}

/// Planned against an empty table, the claim and settle statements would
/// scan it sequentially for as long as their connections live unless the
/// table is analyzed, and this server runs without autovacuum: the proxy
/// analyzes it itself once it has inserted enough rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_table_is_analyzed_once_it_has_grown() {
    let test_store = TestStore::new(Backend::Postgres).await;
    let store = open(&test_store.url).await;
    let observer = test_store.postgres().await;
    let last_analyze = "SELECT coalesce(last_analyze, last_autoanalyze) IS NOT NULL
                          FROM pg_stat_user_tables WHERE relname = 'processed_events'";
    assert!(
        !observer
            .query_one(last_analyze, &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    );
    let keys: Vec<String> = (0..1_000).map(|i| format!("g{i}")).collect();
    first_fences(&store, &keys).await;
    // The ANALYZE runs in the background; bounded so a missing one fails.
    for _ in 0..3_000 {
        if observer
            .query_one(last_analyze, &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the table was never analyzed");
}

/// A claim answered as timed out that then wins is released however long
/// the release waits at the database: shutdown, which waits for that
/// release, does not take it for done while it is still waiting (it was
/// given up after `store.timeout`, then written anyway, and reported as
/// never written).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_claims_release_is_waited_for_past_the_store_timeout() {
    let test = TestStore::new(Backend::Postgres).await;
    let store = open_with_timeout(&test.url, Duration::from_millis(200)).await;
    let observer = test.postgres().await;
    let row_holder = test.postgres().await;
    row_holder
        .batch_execute(
            "BEGIN; INSERT INTO processed_events (source, event_id, status) VALUES ('src', 'late', 'failed')",
        )
        .await
        .unwrap();
    let answer = store.claim(&request("late")).await;
    assert!(matches!(answer, Err(StoreError::Timeout(_))), "{answer:?}");
    // Queued behind the claim's insert: once the claim has committed, this
    // holds the table, and the release waits behind it.
    let table_holder = test.postgres().await;
    let locked = tokio::spawn(async move {
        table_holder
            .batch_execute("BEGIN; LOCK TABLE processed_events IN SHARE MODE")
            .await
            .unwrap();
        table_holder
    });
    until_waiting_on_locks(&observer, 2).await;
    row_holder.batch_execute("ROLLBACK").await.unwrap();
    let table_holder = locked.await.unwrap();
    let waiting = until_waiting_on_locks(&observer, 1).await;
    assert!(waiting[0].contains("UPDATE"), "{waiting:?}");
    let soon = tokio::time::Instant::now() + Duration::from_millis(500);
    assert!(
        !store.finish_releases(soon).await,
        "the release is still waiting to be written"
    );
    table_holder.batch_execute("COMMIT").await.unwrap();
    let later = tokio::time::Instant::now() + Duration::from_secs(30);
    assert!(store.finish_releases(later).await);
    let key = store.show("src", "late").await.unwrap().unwrap();
    assert_eq!((key.status, key.attempts), (KeyStatus::Failed, 1));
}
