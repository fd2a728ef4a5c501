//! Retention on both stores: what a pruning round deletes and keeps, the
//! `--older-than` override, batches, claims running alongside, the prune
//! lock on PostgreSQL, and the background pruner inside the proxy.

use std::sync::Arc;
use std::time::Duration;

use dedupe_proxy::Config;
use dedupe_proxy::metrics::Metrics;
use dedupe_proxy::prune::{PrunePlan, Pruner, Round};
use dedupe_proxy::store::{Claim, ClaimRequest, Fence, SettledStatus, Settlement, Store};

use crate::exposition::Exposition;
use crate::on_both_stores;
use crate::rows;
use crate::support::{Backend, TestApp, TestStore, Upstream, settle_attempt};

on_both_stores!(
    keys_past_their_routes_retention_are_pruned_and_younger_ones_kept,
    a_live_processing_key_is_never_pruned_but_an_abandoned_one_is,
    older_than_overrides_every_routes_retention,
    pruning_deletes_in_batches_until_a_batch_comes_back_short,
    claims_keep_working_while_pruning_runs,
    the_background_pruner_deletes_expired_keys_and_counts_them,
    a_failing_prune_round_counts_as_a_store_error,
);

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(86400);

/// Routes with their own retention (`short`: 1h, `long`: 30d) and one with
/// the store's (`plain`: 1d).
fn config(store: &TestStore) -> Config {
    let yaml = format!(
        "store: {{ url: '{}', retention: 1d }}
routes:
  - {{ name: short, path: /short, key: {{ header: X-Id }}, retention: 1h }}
  - {{ name: long, path: /long, key: {{ header: X-Id }}, retention: 30d }}
  - {{ name: plain, path: /plain, key: {{ header: X-Id }} }}
",
        store.url
    );
    Config::from_yaml(&yaml, None).expect("test config")
}

async fn open(backend: Backend) -> (TestStore, Config, Store) {
    let test_store = TestStore::new(backend).await;
    let config = config(&test_store);
    let store = Store::open(&config.store).expect("open store");
    store.migrate().await.expect("migrate");
    (test_store, config, store)
}

fn claim(source: &str, key: &str, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        source: Arc::from(source),
        key: key.into(),
        payload_sha256: [7; 32],
        lease,
        reject_mismatch: false,
    }
}

/// A key processed `ago`.
async fn done(test_store: &TestStore, store: &Store, source: &str, key: &str, ago: Duration) {
    assert!(matches!(
        store.claim(&claim(source, key, HOUR)).await.unwrap(),
        Claim::Won {
            fence: Fence { attempt: 1, .. },
            ..
        }
    ));
    let settlement = Settlement {
        status: SettledStatus::Done,
        response_status: Some(200),
    };
    assert!(
        settle_attempt(store, source, key, 1, settlement)
            .await
            .unwrap()
    );
    rows::age(test_store, source, key, ago).await;
}

fn pruner(config: &Config, store: &Store, older_than: Option<Duration>) -> (Pruner, Metrics) {
    let metrics = Metrics::new();
    let plan = PrunePlan::new(config, older_than);
    (Pruner::new(store.clone(), plan, metrics.clone()), metrics)
}

async fn keys_past_their_routes_retention_are_pruned_and_younger_ones_kept(backend: Backend) {
    let (db, config, store) = open(backend).await;
    for (source, key, ago) in [
        ("short", "young", 30 * 60),
        ("short", "old", 2 * 3600),
        ("plain", "young", 2 * 3600),
        ("plain", "old", 2 * 86400),
        ("long", "young", 2 * 86400),
        ("long", "old", 31 * 86400),
        // A route since removed from the configuration: store.retention.
        ("removed", "young", 2 * 3600),
        ("removed", "old", 2 * 86400),
    ] {
        done(&db, &store, source, key, Duration::from_secs(ago)).await;
    }
    let (pruner, metrics) = pruner(&config, &store, None);
    assert_eq!(
        pruner.run_once().await.unwrap(),
        Round::Pruned { deleted: 4 }
    );
    assert_eq!(
        rows::keys(&db).await,
        ["long/young", "plain/young", "removed/young", "short/young"]
    );
    assert_eq!(metrics.keys_pruned.get(), 4);
    assert_eq!(
        pruner.run_once().await.unwrap(),
        Round::Pruned { deleted: 0 },
        "a second round finds nothing"
    );
}

async fn a_live_processing_key_is_never_pruned_but_an_abandoned_one_is(backend: Backend) {
    let (db, config, store) = open(backend).await;
    for key in ["live", "abandoned"] {
        store.claim(&claim("plain", key, HOUR)).await.unwrap();
        rows::age(&db, "plain", key, 2 * DAY).await;
    }
    rows::expire_lease(&db, "plain", "abandoned").await;
    store.claim(&claim("plain", "failed", HOUR)).await.unwrap();
    settle_attempt(&store, "plain", "failed", 1, Settlement::RELEASED)
        .await
        .unwrap();
    rows::age(&db, "plain", "failed", 2 * DAY).await;

    let (pruner, _) = pruner(&config, &store, None);
    assert_eq!(
        pruner.run_once().await.unwrap(),
        Round::Pruned { deleted: 2 }
    );
    assert_eq!(rows::keys(&db).await, ["plain/live"]);
    // Not even an override that covers everything touches a live lease.
    let (everything, _) = self::pruner(&config, &store, Some(Duration::ZERO));
    assert_eq!(
        everything.run_once().await.unwrap(),
        Round::Pruned { deleted: 0 }
    );
    assert_eq!(rows::keys(&db).await, ["plain/live"]);
}

async fn older_than_overrides_every_routes_retention(backend: Backend) {
    let (db, config, store) = open(backend).await;
    done(&db, &store, "long", "hour", HOUR).await;
    done(
        &db,
        &store,
        "short",
        "minutes",
        Duration::from_secs(10 * 60),
    )
    .await;
    done(&db, &store, "plain", "hour", HOUR).await;
    let (pruner, _) = pruner(&config, &store, Some(Duration::from_secs(30 * 60)));
    assert_eq!(
        pruner.run_once().await.unwrap(),
        Round::Pruned { deleted: 2 }
    );
    assert_eq!(rows::keys(&db).await, ["short/minutes"]);
}

async fn pruning_deletes_in_batches_until_a_batch_comes_back_short(backend: Backend) {
    let (db, config, store) = open(backend).await;
    rows::insert_old(&db, "plain", 25, 2 * DAY).await;
    let (pruner, metrics) = pruner(&config, &store, Some(DAY));
    let pruner = pruner.with_batch_size(10);
    assert_eq!(
        pruner.run_once().await.unwrap(),
        Round::Pruned { deleted: 25 }
    );
    let statements = metrics
        .store_duration
        .with_label_values(&["prune"])
        .get_sample_count();
    assert_eq!(statements, 3, "10 + 10 + 5");
    assert!(rows::keys(&db).await.is_empty());
}

async fn claims_keep_working_while_pruning_runs(backend: Backend) {
    let (db, config, store) = open(backend).await;
    rows::insert_old(&db, "plain", 300, 2 * DAY).await;
    let (pruner, _) = pruner(&config, &store, None);
    let pruner = pruner.with_batch_size(10);
    let pruning = tokio::spawn({
        let pruner = pruner.clone();
        async move { pruner.run_once().await }
    });
    // New keys, and old keys that the pruner may or may not have reached.
    let claims: Vec<_> = (1..=100)
        .flat_map(|i| [format!("new_{i}"), format!("old_{i}")])
        .map(|key| {
            let store = store.clone();
            tokio::spawn(async move {
                let result = store.claim(&claim("plain", &key, HOUR)).await;
                (key, result)
            })
        })
        .collect();
    let mut expected = Vec::new();
    for task in claims {
        let (key, result) = task.await.unwrap();
        match result.unwrap_or_else(|error| panic!("claim of {key} failed: {error}")) {
            Claim::Won {
                fence: Fence { attempt: 1, .. },
                ..
            } => expected.push(format!("plain/{key}")),
            Claim::Done { .. } if key.starts_with("old_") => {}
            other => panic!("{key}: unexpected {other:?}"),
        }
    }
    let mut deleted = match pruning.await.unwrap().unwrap() {
        Round::Pruned { deleted } => deleted,
        Round::Skipped => panic!("nothing else prunes"),
    };
    // Rows a claim had locked were skipped; later rounds finish the job.
    loop {
        match pruner.run_once().await.unwrap() {
            Round::Pruned { deleted: 0 } => break,
            Round::Pruned { deleted: more } => deleted += more,
            Round::Skipped => panic!("nothing else prunes"),
        }
    }
    assert_eq!(deleted, 300, "every old row, once");
    expected.sort();
    assert_eq!(rows::keys(&db).await, expected);
    assert!(expected.iter().filter(|k| k.contains("new_")).count() == 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pruner_skips_its_round_while_another_holds_the_prune_lock() {
    let (db, config, store) = open(Backend::Postgres).await;
    done(&db, &store, "plain", "old", 2 * DAY).await;
    let holder = rows::hold_prune_lock(&db).await;
    let (pruner, metrics) = pruner(&config, &store, None);
    assert_eq!(pruner.run_once().await.unwrap(), Round::Skipped);
    assert_eq!(rows::keys(&db).await, ["plain/old"]);
    assert_eq!(metrics.keys_pruned.get(), 0);

    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        pruner.run_once().await.unwrap(),
        Round::Pruned { deleted: 1 }
    );
    assert!(rows::keys(&db).await.is_empty());
}

async fn the_background_pruner_deletes_expired_keys_and_counts_them(backend: Backend) {
    let mut app = TestApp::spawn(backend, |config| {
        config.store.retention = HOUR;
        config.store.prune_interval = Duration::from_millis(100);
    })
    .await;
    for key in ["evt_old", "evt_new"] {
        assert_eq!(app.deliver(key, "{}").await.outcome(), "forwarded");
    }
    rows::age(&app.store, "orders", "evt_old", 2 * HOUR).await;
    let pruned = async {
        loop {
            let metrics = Exposition::parse(&app.admin_get("/metrics").await.body);
            if metrics.value("dedupe_keys_pruned_total", &[]) == Some(1.0) {
                return metrics;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let metrics = tokio::time::timeout(Duration::from_secs(20), pruned)
        .await
        .expect("the pruner ran");
    let rounds = metrics.value("dedupe_store_duration_seconds_count", &[("op", "prune")]);
    assert!(rounds.is_some_and(|n| n >= 1.0), "{rounds:?}");
    assert_eq!(rows::keys(&app.store).await, ["orders/evt_new"]);
    assert_eq!(app.deliver("evt_old", "{}").await.outcome(), "forwarded");
    app.shutdown().await;
}

async fn a_failing_prune_round_counts_as_a_store_error(backend: Backend) {
    // No schema: every prune statement fails (and the proxy is never ready).
    let store = Arc::new(TestStore::new(backend).await);
    let app = TestApp::start(store, Upstream::start().await, |config| {
        config.store.migrate = false;
        config.store.prune_interval = Duration::from_millis(50);
    })
    .await;
    let failed = async {
        loop {
            let metrics = Exposition::parse(&app.admin_get("/metrics").await.body);
            let errors = metrics.value("dedupe_store_errors_total", &[("op", "prune")]);
            if let Some(errors) = errors.filter(|errors| *errors > 0.0) {
                return (errors, metrics);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (errors, metrics) = tokio::time::timeout(Duration::from_secs(20), failed)
        .await
        .expect("a prune round failed");
    assert!(errors >= 1.0);
    assert_eq!(metrics.value("dedupe_keys_pruned_total", &[]), Some(0.0));
    assert!(
        !rows::table_exists(&app.store).await,
        "pruning created no schema"
    );
}
