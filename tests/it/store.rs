//! Store conformance: the same claim and settle semantics on both backends.

use std::sync::Arc;
use std::time::Duration;

use dedupe_proxy::config::StoreConfig;
use dedupe_proxy::store::{
    Claim, ClaimRequest, Fence, Forget, KeyStatus, Migration, PruneBatch, PruneGroup, Release,
    SettledStatus, Settlement, Sources, Store, WonFrom,
};

use crate::on_both_stores;
use crate::support::{Backend, TestStore, settle_attempt, until_waiting_on_locks};

on_both_stores!(
    a_new_key_is_won_then_in_flight_then_done,
    a_failed_key_is_won_again_with_the_next_attempt,
    an_expired_lease_is_taken_over_and_the_old_owner_is_fenced_out,
    only_one_of_many_concurrent_claims_wins,
    a_different_body_is_reported_as_a_mismatch,
    another_body_never_takes_a_key_over_where_it_is_rejected,
    migration_is_idempotent,
    a_released_claim_fences_out_its_owner_and_the_next_delivery_wins,
    a_done_outcome_lands_on_its_own_release_until_a_retry_takes_the_key,
    show_returns_every_column_and_forget_deletes,
    a_table_named_by_a_reserved_word_works,
    the_longest_key_and_route_name_allowed_are_claimed_and_settled,
    a_key_in_flight_is_forgotten_only_by_force_until_its_lease_runs_out,
    a_key_deleted_and_claimed_anew_fences_out_its_old_owner,
    a_table_renamed_away_keeps_its_index_and_the_new_one_gets_its_own,
);

async fn open(backend: Backend) -> (TestStore, Store) {
    let test_store = TestStore::new(backend).await;
    let config = StoreConfig {
        url: test_store.url.clone(),
        ..StoreConfig::default()
    };
    let store = Store::open(&config).expect("open store");
    store.migrate().await.expect("migrate");
    (test_store, store)
}

fn request(key: &str, body: &[u8], lease: Duration) -> ClaimRequest {
    use sha2::Digest;
    ClaimRequest {
        source: Arc::from("src"),
        key: key.into(),
        payload_sha256: sha2::Sha256::digest(body).into(),
        lease,
        reject_mismatch: false,
    }
}

const DONE: Settlement = Settlement {
    status: SettledStatus::Done,
    response_status: Some(200),
};
const MINUTE: Duration = Duration::from_secs(60);

async fn a_new_key_is_won_then_in_flight_then_done(backend: Backend) {
    let (_db, store) = open(backend).await;
    let claim = request("k1", b"body", MINUTE);
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            from: WonFrom::New,
            payload_mismatch: false
        }
    ));
    assert_eq!(
        store.claim(&claim).await.unwrap(),
        Claim::InFlight {
            payload_mismatch: false
        }
    );
    assert!(
        !settle_attempt(&store, "src", "k1", 2, DONE).await.unwrap(),
        "a wrong attempt is fenced out"
    );
    assert!(settle_attempt(&store, "src", "k1", 1, DONE).await.unwrap());
    assert!(
        !settle_attempt(&store, "src", "k1", 1, DONE).await.unwrap(),
        "settled twice"
    );
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Done {
            payload_mismatch: false,
            ..
        }
    ));
    // Keys are namespaced by source.
    let other_source = ClaimRequest {
        source: Arc::from("other"),
        ..claim
    };
    assert!(matches!(
        store.claim(&other_source).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            ..
        }
    ));
}

/// A route with `on_payload_mismatch: reject` answers another body 422: its
/// claim leaves a failed or expired key as it was, so the next delivery with
/// the first body is attempt 2, not 3.
async fn another_body_never_takes_a_key_over_where_it_is_rejected(backend: Backend) {
    let (_db, store) = open(backend).await;
    let rejecting = |key: &str, body: &[u8], lease| ClaimRequest {
        reject_mismatch: true,
        ..request(key, body, lease)
    };
    for (key, lease) in [("failed", MINUTE), ("expired", Duration::ZERO)] {
        let first = rejecting(key, b"first", lease);
        assert!(matches!(
            store.claim(&first).await.unwrap(),
            Claim::Won {
                fence: Fence { attempt: 1, .. },
                ..
            }
        ));
        if lease == MINUTE {
            assert!(
                settle_attempt(&store, "src", key, 1, Settlement::RELEASED)
                    .await
                    .unwrap()
            );
        }
        assert_eq!(
            store
                .claim(&rejecting(key, b"other", MINUTE))
                .await
                .unwrap(),
            Claim::InFlight {
                payload_mismatch: true
            },
            "{key}"
        );
        let record = store.show("src", key).await.unwrap().unwrap();
        assert_eq!(record.attempts, 1, "{key}: the row was left as it was");
        let again = store
            .claim(&rejecting(key, b"first", MINUTE))
            .await
            .unwrap();
        assert!(
            matches!(
                again,
                Claim::Won {
                    fence: Fence { attempt: 2, .. },
                    payload_mismatch: false,
                    ..
                }
            ),
            "{key}: {again:?}"
        );
        assert!(
            settle_attempt(&store, "src", key, 2, Settlement::RELEASED)
                .await
                .unwrap()
        );
        // Where another body is only counted, it takes the key over.
        let warned = store.claim(&request(key, b"other", MINUTE)).await.unwrap();
        assert!(
            matches!(
                warned,
                Claim::Won {
                    fence: Fence { attempt: 3, .. },
                    payload_mismatch: true,
                    ..
                }
            ),
            "{key}: {warned:?}"
        );
    }
}

async fn a_failed_key_is_won_again_with_the_next_attempt(backend: Backend) {
    let (_db, store) = open(backend).await;
    let claim = request("k2", b"body", MINUTE);
    store.claim(&claim).await.unwrap();
    assert!(
        settle_attempt(&store, "src", "k2", 1, Settlement::RELEASED)
            .await
            .unwrap()
    );
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 2, .. },
            from: WonFrom::Failed,
            payload_mismatch: false
        }
    ));
    assert_eq!(
        store.claim(&claim).await.unwrap(),
        Claim::InFlight {
            payload_mismatch: false
        }
    );
}

async fn an_expired_lease_is_taken_over_and_the_old_owner_is_fenced_out(backend: Backend) {
    let (_db, store) = open(backend).await;
    let short = request("k3", b"body", Duration::from_millis(50));
    assert!(matches!(
        store.claim(&short).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            ..
        }
    ));
    assert_eq!(
        store.claim(&short).await.unwrap(),
        Claim::InFlight {
            payload_mismatch: false
        },
        "lease still live"
    );
    tokio::time::sleep(Duration::from_millis(120)).await;
    let taken = store.claim(&request("k3", b"body", MINUTE)).await.unwrap();
    assert!(matches!(
        taken,
        Claim::Won {
            fence: Fence { attempt: 2, .. },
            from: WonFrom::ExpiredLease,
            payload_mismatch: false
        }
    ));
    assert!(
        !settle_attempt(&store, "src", "k3", 1, DONE).await.unwrap(),
        "the expired owner cannot settle"
    );
    assert!(settle_attempt(&store, "src", "k3", 2, DONE).await.unwrap());
}

async fn only_one_of_many_concurrent_claims_wins(backend: Backend) {
    let (_db, store) = open(backend).await;
    let claims: Vec<_> = (0..40)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&request("k4", b"body", MINUTE)).await.unwrap() })
        })
        .collect();
    let mut won = 0;
    for claim in claims {
        match claim.await.unwrap() {
            Claim::Won { .. } => won += 1,
            Claim::InFlight { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(won, 1);
}

async fn a_different_body_is_reported_as_a_mismatch(backend: Backend) {
    let (_db, store) = open(backend).await;
    store.claim(&request("k5", b"first", MINUTE)).await.unwrap();
    assert_eq!(
        store
            .claim(&request("k5", b"second", MINUTE))
            .await
            .unwrap(),
        Claim::InFlight {
            payload_mismatch: true
        }
    );
    settle_attempt(&store, "src", "k5", 1, Settlement::RELEASED)
        .await
        .unwrap();
    // The retry with another body wins, and the stored hash stays the first one's.
    assert!(matches!(
        store
            .claim(&request("k5", b"second", MINUTE))
            .await
            .unwrap(),
        Claim::Won {
            fence: Fence { attempt: 2, .. },
            from: WonFrom::Failed,
            payload_mismatch: true
        }
    ));
    settle_attempt(&store, "src", "k5", 2, DONE).await.unwrap();
    assert!(matches!(
        store.claim(&request("k5", b"first", MINUTE)).await.unwrap(),
        Claim::Done {
            payload_mismatch: false,
            ..
        }
    ));
}

async fn migration_is_idempotent(backend: Backend) {
    let (_db, store) = open(backend).await;
    store.migrate().await.unwrap();
    let concurrent: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for migration in concurrent {
        migration.await.unwrap().unwrap();
    }
    store.ping().await.unwrap();
}

async fn a_released_claim_fences_out_its_owner_and_the_next_delivery_wins(backend: Backend) {
    let (_db, store) = open(backend).await;
    let claim = request("k6", b"body", MINUTE);
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            ..
        }
    ));
    assert_eq!(
        store.release("src", "k6").await.unwrap(),
        Release::Released { attempt: 1 }
    );
    assert_eq!(
        store.release("src", "k6").await.unwrap(),
        Release::NotProcessing(KeyStatus::Failed)
    );
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 2, .. },
            from: WonFrom::Failed,
            payload_mismatch: false
        }
    ));
    assert!(
        !settle_attempt(&store, "src", "k6", 1, DONE).await.unwrap(),
        "the released owner cannot settle once the key is taken again"
    );
    assert!(settle_attempt(&store, "src", "k6", 2, DONE).await.unwrap());
    assert_eq!(
        store.release("src", "k6").await.unwrap(),
        Release::NotProcessing(KeyStatus::Done)
    );
    assert_eq!(
        store.release("src", "nope").await.unwrap(),
        Release::Missing
    );
}

/// A claim released while its delivery is still at the upstream (by
/// shutdown's deadline, or `keys release`): if the upstream then answers
/// with success before a retry takes the key, the event was processed, and
/// the key must say so rather than be forwarded again.
async fn a_done_outcome_lands_on_its_own_release_until_a_retry_takes_the_key(backend: Backend) {
    let (_db, store) = open(backend).await;
    let failed_500 = Settlement {
        status: SettledStatus::Failed,
        response_status: Some(500),
    };
    for key in ["released", "answered"] {
        let claim = request(key, b"body", MINUTE);
        assert!(matches!(
            store.claim(&claim).await.unwrap(),
            Claim::Won {
                fence: Fence { attempt: 1, .. },
                ..
            }
        ));
    }
    assert_eq!(
        store.release("src", "released").await.unwrap(),
        Release::Released { attempt: 1 }
    );
    assert!(
        !settle_attempt(&store, "src", "released", 1, Settlement::RELEASED)
            .await
            .unwrap(),
        "a failure changes nothing"
    );
    assert!(
        !settle_attempt(&store, "src", "released", 1, failed_500)
            .await
            .unwrap(),
        "a failure changes nothing"
    );
    assert!(
        !settle_attempt(&store, "src", "released", 2, DONE)
            .await
            .unwrap()
    );
    assert!(
        settle_attempt(&store, "src", "released", 1, DONE)
            .await
            .unwrap()
    );
    let row = store.show("src", "released").await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.attempts, row.response_status),
        (KeyStatus::Done, 1, Some(200))
    );
    assert!(matches!(
        store
            .claim(&request("released", b"body", MINUTE))
            .await
            .unwrap(),
        Claim::Done { .. }
    ));

    // A failure the upstream answered is that attempt's own outcome: a
    // `done` for the same attempt cannot follow it.
    assert!(
        settle_attempt(&store, "src", "answered", 1, failed_500)
            .await
            .unwrap()
    );
    assert!(
        !settle_attempt(&store, "src", "answered", 1, DONE)
            .await
            .unwrap()
    );
    let row = store.show("src", "answered").await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.response_status),
        (KeyStatus::Failed, Some(500))
    );
}

/// `limits.max_key_bytes` may be at most 2048, route names 64 bytes: such a
/// key, incompressible, must fit PostgreSQL's primary key index.
async fn the_longest_key_and_route_name_allowed_are_claimed_and_settled(backend: Backend) {
    let (_db, store) = open(backend).await;
    let source = "r".repeat(64);
    let mut state: u32 = 7;
    let key: String = (0..2048)
        .map(|_| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            char::from(b'!' + u8::try_from((state >> 16) % 94).unwrap())
        })
        .collect();
    let claim = ClaimRequest {
        source: Arc::from(source.as_str()),
        ..request(&key, b"body", MINUTE)
    };
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            ..
        }
    ));
    assert!(
        settle_attempt(&store, &source, &key, 1, DONE)
            .await
            .unwrap()
    );
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Done { .. }
    ));
}

/// Forgotten while its delivery may still be at the application, a key
/// would be claimed again as attempt 1, and the first delivery's late
/// outcome would pass the second's fence.
async fn a_key_in_flight_is_forgotten_only_by_force_until_its_lease_runs_out(backend: Backend) {
    let (_db, store) = open(backend).await;
    store
        .claim(&request("live", b"body", MINUTE))
        .await
        .unwrap();
    let lease = store
        .show("src", "live")
        .await
        .unwrap()
        .unwrap()
        .lease_expires_at
        .unwrap();
    assert_eq!(
        store.forget("src", "live", false).await.unwrap(),
        Forget::InFlight {
            lease_expires_at: lease
        }
    );
    assert!(store.show("src", "live").await.unwrap().is_some(), "kept");
    assert_eq!(
        store.forget("src", "live", true).await.unwrap(),
        Forget::Forgotten
    );
    assert_eq!(store.show("src", "live").await.unwrap(), None);

    store
        .claim(&request("lapsed", b"body", Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(
        store.forget("src", "lapsed", false).await.unwrap(),
        Forget::Forgotten,
        "a lapsed lease holds nothing back"
    );
}

async fn show_returns_every_column_and_forget_deletes(backend: Backend) {
    let (_db, store) = open(backend).await;
    let claim = request("k7", b"body", MINUTE);
    store.claim(&claim).await.unwrap();
    let processing = store.show("src", "k7").await.unwrap().expect("stored");
    assert_eq!(processing.status, KeyStatus::Processing);
    assert_eq!(
        processing.payload_sha256.as_deref(),
        Some(&claim.payload_sha256[..])
    );
    let lease = processing.lease_expires_at.expect("a lease");
    let lease_left = lease.duration_since(processing.claimed_at).unwrap();
    assert!(
        lease_left > MINUTE - Duration::from_secs(5)
            && lease_left <= MINUTE + Duration::from_secs(5)
    );
    assert_eq!(processing.completed_at, None);

    settle_attempt(&store, "src", "k7", 1, DONE).await.unwrap();
    let done = store.show("src", "k7").await.unwrap().expect("stored");
    assert_eq!((done.source.as_str(), done.key.as_str()), ("src", "k7"));
    assert_eq!((done.status, done.attempts), (KeyStatus::Done, 1));
    assert_eq!(done.response_status, Some(200));
    assert_eq!(done.lease_expires_at, None);
    assert!(done.completed_at.expect("completed") >= done.received_at);
    assert_eq!(done.received_at, processing.received_at);

    assert_eq!(
        store.forget("src", "k7", false).await.unwrap(),
        Forget::Forgotten
    );
    assert_eq!(
        store.forget("src", "k7", false).await.unwrap(),
        Forget::Missing
    );
    assert_eq!(store.show("src", "k7").await.unwrap(), None);
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            from: WonFrom::New,
            ..
        }
    ));
}

/// `store.table` is quoted in SQL, so a reserved word is a usable name; it
/// is lowercased, as the same name unquoted always was.
async fn a_table_named_by_a_reserved_word_works(backend: Backend) {
    let test_store = TestStore::new(backend).await;
    let config = StoreConfig {
        url: test_store.url.clone(),
        table: "Order".into(),
        ..StoreConfig::default()
    };
    let store = Store::open(&config).expect("open store");
    store.migrate().await.expect("migrate");
    store.migrate().await.expect("migrate again");
    store.ping().await.expect("the table is found");
    let claim = request("k9", b"body", MINUTE);
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            ..
        }
    ));
    settle_attempt(&store, "src", "k9", 1, DONE).await.unwrap();
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        Claim::Done { .. }
    ));
    assert_eq!(
        store.show("src", "k9").await.unwrap().map(|k| k.status),
        Some(KeyStatus::Done)
    );
    assert_eq!(
        store.forget("src", "k9", false).await.unwrap(),
        Forget::Forgotten
    );
}

/// Applications often run with a role that may read and write rows but not
/// create anything, the table having been created by its owner. `CREATE …
/// IF NOT EXISTS` fails for such a role even when the table exists, so the
/// migration must see the schema in place and create nothing: the proxy
/// becomes ready with the default `store.migrate: true`, and `migrate` as
/// that role succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_only_use_rows_starts_on_a_migrated_table_and_is_told_why_not_without_one()
{
    use crate::support::{TestApp, Upstream};

    let test_store = Arc::new(TestStore::new(Backend::Postgres).await);
    let owner = test_store.postgres().await;
    let config = StoreConfig {
        url: test_store.url.clone(),
        ..StoreConfig::default()
    };
    Store::open(&config)
        .expect("open store")
        .migrate()
        .await
        .expect("migrate as the owner");
    let role = format!("dedupe_rows_only_{}", std::process::id());
    let database: String = owner
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    // One left by an interrupted run held rights only in its own database,
    // which is gone.
    owner
        .batch_execute(&format!("DROP ROLE IF EXISTS {role}"))
        .await
        .expect("no leftover role");
    owner
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN PASSWORD 'rows';
             REVOKE CREATE ON SCHEMA public FROM PUBLIC;
             GRANT CONNECT ON DATABASE {database} TO {role};
             GRANT USAGE ON SCHEMA public TO {role};
             GRANT SELECT, INSERT, UPDATE, DELETE ON processed_events TO {role};"
        ))
        .await
        .expect("a role that may only use rows");
    let rows_only_url = format!(
        "postgres://{role}:rows@{}/{database}",
        test_store.postgres_addr()
    );

    let rows_only = StoreConfig {
        url: rows_only_url.clone(),
        ..StoreConfig::default()
    };
    let store = Store::open(&rows_only).expect("open store");
    store
        .migrate()
        .await
        .expect("migrate as the rows-only role");
    let mut app = TestApp::spawn_on(Arc::clone(&test_store), Upstream::start().await, |config| {
        config.store.url = rows_only_url.clone();
    })
    .await;
    let first = app.deliver("evt_rows", "{}").await;
    assert_eq!((first.status, first.outcome()), (200, "forwarded"));
    let again = app.deliver("evt_rows", "{}").await;
    assert_eq!(again.outcome(), "duplicate");
    app.shutdown().await;
    drop(store);

    // Without the table, the start-up migration fails for want of the right
    // to create it, and /readyz gives that reason, not only that the
    // migration has not finished.
    owner
        .batch_execute("DROP TABLE processed_events")
        .await
        .expect("drop the table as its owner");
    let mut app = TestApp::start(Arc::clone(&test_store), Upstream::start().await, |config| {
        config.store.url = rows_only_url.clone();
    })
    .await;
    let failed = async {
        loop {
            let not_ready = app.admin_get("/readyz").await;
            assert_eq!(not_ready.status, 503, "{}", not_ready.body);
            if not_ready.body.contains("failed") {
                return not_ready.body;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let body = tokio::time::timeout(Duration::from_secs(20), failed)
        .await
        .expect("the migration's failure was reported");
    assert!(
        body.starts_with("store schema not ready: the start-up migration failed, and is retried: ")
            && body.contains("permission denied for schema public"),
        "{body}"
    );
    app.shutdown().await;

    // Still a role that may not create: the check above proved something.
    let refused = owner
        .batch_execute(&format!("SET ROLE {role}; CREATE TABLE t (x int);"))
        .await;
    assert!(refused.is_err(), "the role may not create tables");
    owner
        .batch_execute(&format!(
            "RESET ROLE; DROP OWNED BY {role} CASCADE; DROP ROLE {role};"
        ))
        .await
        .expect("drop the role");
}

/// `keys forget` and `prune` delete a `processing` key once its lease has run
/// out, and its next claim is attempt 1 again. The old owner, stalled past its
/// lease (a paused process), must not settle the new owner's claim, though
/// their attempt numbers are the same: the claim's time tells them apart.
async fn a_key_deleted_and_claimed_anew_fences_out_its_old_owner(backend: Backend) {
    let (_db, store) = open(backend).await;
    let won_fence = |claim: Claim| match claim {
        Claim::Won { fence, .. } => fence,
        other => panic!("not won: {other:?}"),
    };
    for (key, deletion) in [("pruned", "prune"), ("forgotten", "forget")] {
        let stalled = won_fence(
            store
                .claim(&request(key, b"body", Duration::ZERO))
                .await
                .unwrap(),
        );
        assert_eq!(stalled.attempt, 1);
        // Claims of a key are at least a lease apart, and this lease is
        // zero: the stored times (milliseconds, in SQLite) must differ.
        tokio::time::sleep(Duration::from_millis(2)).await;
        match deletion {
            "forget" => assert_eq!(
                store.forget("src", key, false).await.unwrap(),
                Forget::Forgotten
            ),
            _ => {
                let everything = PruneGroup {
                    older_than: Duration::ZERO,
                    sources: Sources::AllExcept(Vec::new()),
                };
                assert_eq!(
                    store.prune(&everything, 1000).await.unwrap(),
                    PruneBatch::Deleted(1)
                );
            }
        }
        let owner = won_fence(store.claim(&request(key, b"body", MINUTE)).await.unwrap());
        assert_eq!(owner.attempt, 1, "{key}: a new row starts again at 1");
        assert_ne!(owner, stalled, "{key}");
        assert!(
            !store.settle("src", key, stalled, DONE).await.unwrap(),
            "{key}: the stalled owner is fenced out"
        );
        let row = store.show("src", key).await.unwrap().unwrap();
        assert_eq!(
            (row.status, row.attempts, row.response_status),
            (KeyStatus::Processing, 1, None),
            "{key}"
        );
        assert_eq!(
            store.claim(&request(key, b"body", MINUTE)).await.unwrap(),
            Claim::InFlight {
                payload_mismatch: false
            },
            "{key}: the new owner's delivery is still in flight"
        );
        assert!(
            store.settle("src", key, owner, DONE).await.unwrap(),
            "{key}"
        );
    }
}

/// Renaming the claims table away (to keep an old one, say) keeps its
/// index's name: the new table's index is found by what it indexes, not by
/// that name, and made under the next free one; without it every prune
/// would read the whole table.
async fn a_table_renamed_away_keeps_its_index_and_the_new_one_gets_its_own(backend: Backend) {
    let (test_store, store) = open(backend).await;
    assert_eq!(
        crate::rows::received_at_indexes(&test_store).await,
        ["processed_events_received_at_idx"]
    );
    crate::rows::batch(
        &test_store,
        "ALTER TABLE processed_events RENAME TO processed_events_2025",
    )
    .await;
    assert_eq!(store.migrate().await.unwrap(), Migration::CreatedTable);
    assert_eq!(
        crate::rows::received_at_indexes(&test_store).await,
        ["processed_events_received_at_idx1"]
    );
    assert_eq!(store.migrate().await.unwrap(), Migration::UpToDate);
    crate::rows::batch(&test_store, "DROP INDEX processed_events_received_at_idx1").await;
    assert_eq!(store.migrate().await.unwrap(), Migration::CreatedIndex);
    assert_eq!(crate::rows::received_at_indexes(&test_store).await.len(), 1);
}

/// A claims table made by hand without the columns' defaults still takes
/// claims: they write every timestamp themselves.
#[tokio::test]
async fn a_table_made_without_defaults_takes_claims() {
    let test_store = TestStore::new(Backend::Postgres).await;
    crate::rows::batch(
        &test_store,
        "CREATE TABLE processed_events (
           source text NOT NULL, event_id text NOT NULL, status text NOT NULL,
           attempts integer NOT NULL, payload_sha256 bytea, response_status smallint,
           received_at timestamptz NOT NULL, claimed_at timestamptz NOT NULL,
           lease_expires_at timestamptz, completed_at timestamptz,
           PRIMARY KEY (source, event_id))",
    )
    .await;
    let config = StoreConfig {
        url: test_store.url.clone(),
        ..StoreConfig::default()
    };
    let store = Store::open(&config).expect("open store");
    assert_eq!(store.migrate().await.unwrap(), Migration::CreatedIndex);
    assert!(matches!(
        store
            .claim(&request("alone", b"body", MINUTE))
            .await
            .unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            ..
        }
    ));
    let together: Vec<_> = ["b1", "b2", "b3"]
        .map(|key| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&request(key, b"body", MINUTE)).await })
        })
        .into();
    for claim in together {
        assert!(matches!(
            claim.await.unwrap().unwrap(),
            Claim::Won {
                fence: Fence { attempt: 1, .. },
                ..
            }
        ));
    }
}

/// Replicas migrating at once on a database whose transactions default to
/// `serializable` make one index: each reads the catalog after waiting for
/// the others, under `read committed`, and finds the one made meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_on_a_serializable_database_make_one_index() {
    let (test_store, store) = open(Backend::Postgres).await;
    crate::rows::batch(
        &test_store,
        "DROP INDEX processed_events_received_at_idx;
         DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = serializable', current_database()); END $$",
    )
    .await;
    drop(store);
    let migrations: Vec<_> = (0..4)
        .map(|_| {
            let url = test_store.url.clone();
            tokio::spawn(async move {
                let config = StoreConfig {
                    url,
                    ..StoreConfig::default()
                };
                Store::open(&config).expect("open store").migrate().await
            })
        })
        .collect();
    let mut created = 0;
    for migration in migrations {
        if migration.await.unwrap().unwrap() == Migration::CreatedIndex {
            created += 1;
        }
    }
    assert_eq!(created, 1);
    assert_eq!(crate::rows::received_at_indexes(&test_store).await.len(), 1);
}

/// The operator's commands lock a key's row, waiting for whoever holds it,
/// and then work on what they waited for: under a `serializable` default
/// that would be refused as a conflict, so they run under `read committed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_waits_for_a_held_row_under_a_serializable_default() {
    let (test_store, store) = open(Backend::Postgres).await;
    let claim = store.claim(&request("k", b"body", MINUTE)).await.unwrap();
    assert!(matches!(claim, Claim::Won { .. }));
    let done = Settlement {
        status: SettledStatus::Done,
        response_status: Some(200),
    };
    assert!(settle_attempt(&store, "src", "k", 1, done).await.unwrap());
    crate::rows::batch(
        &test_store,
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = serializable', current_database()); END $$",
    )
    .await;
    // Connections opened from now on take the new default.
    let config = StoreConfig {
        url: test_store.url.clone(),
        ..StoreConfig::default()
    };
    let fresh = Store::open(&config).expect("open store");
    let holder = test_store.postgres().await;
    holder
        .batch_execute(
            "BEGIN; UPDATE processed_events SET response_status = 201 WHERE event_id = 'k'",
        )
        .await
        .unwrap();
    let forget = tokio::spawn(async move { fresh.forget("src", "k", false).await });
    until_waiting_on_locks(&test_store.postgres().await, 1).await;
    holder.batch_execute("COMMIT").await.unwrap();
    assert!(
        matches!(forget.await.unwrap(), Ok(Forget::Forgotten)),
        "forgotten once the row is let go"
    );
    assert!(crate::rows::keys(&test_store).await.is_empty());
}

/// A first host that accepts connections and never answers them (a hung
/// server, a load balancer with nothing behind it) does not keep the store
/// from the next host listed: the failover the multi-host URL is for.
#[tokio::test]
async fn a_first_host_that_never_answers_is_passed_over_for_the_next() {
    let db = TestStore::new(Backend::Postgres).await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&accepted);
    let _silent_host = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(connection);
        }
    });
    let real = db.postgres_addr();
    let one_host = db.url_via(real);
    let both = one_host.replacen(&format!("@{real}"), &format!("@{silent_addr},{real}"), 1);
    assert_ne!(both, one_host);
    let store = Store::open(&StoreConfig {
        url: both,
        timeout: Duration::from_secs(1),
        ..StoreConfig::default()
    })
    .unwrap();
    store.migrate().await.expect("migrated on the second host");
    let claim = store.claim(&request("evt", b"{}", MINUTE)).await.unwrap();
    assert!(matches!(claim, Claim::Won { .. }), "{claim:?}");
    assert!(
        accepted.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the silent host was tried first"
    );
}
