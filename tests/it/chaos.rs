//! Chaos: several real proxy binaries on one PostgreSQL database in front of
//! one application, fed by a simulated provider that delivers every event
//! until it is acknowledged, while replicas are SIGKILLed (or SIGTERMed) and
//! restarted, the store is cut off and its connections terminated, and the
//! application fails, hangs and stalls. Then a checker reads the application's record of
//! what it did (see `chaos/checker.rs` for what is and is not guaranteed).
//!
//! The run is seeded: the seed is printed, and `DEDUPE_CHAOS_SEED=<seed>`
//! replays the same decisions (timing still varies). The soak variant is
//! ignored by default; `DEDUPE_SOAK_EVENTS` and `DEDUPE_SOAK_REPLICAS` size it:
//! `cargo test chaos::soak -- --ignored --nocapture`.

mod app;
mod checker;
mod faults;
mod provider;
mod replicas;
mod rng;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::support::{Backend, Relay, TestStore};
use app::{App, AppBehavior};
use faults::{FaultTally, Faults, ms};
use provider::{Policy, Provider, Tally};
use replicas::Replicas;
use rng::Rng;

/// The proxies' timing: short, so a run takes minutes, in the proportions a
/// production configuration would have.
const LEASE: Duration = Duration::from_secs(3);
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(1);

struct Size {
    events: u64,
    replicas: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_under_chaos_act_on_every_event_exactly_once() {
    run(Size {
        events: 300,
        replicas: 3,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a long soak: DEDUPE_SOAK_EVENTS, DEDUPE_SOAK_REPLICAS; run with --ignored"]
async fn soak() {
    let number = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .map(|text| text.parse().unwrap_or_else(|_| panic!("{name}={text}")))
            .unwrap_or(default)
    };
    run(Size {
        events: number("DEDUPE_SOAK_EVENTS", 3000),
        replicas: number("DEDUPE_SOAK_REPLICAS", 5) as usize,
    })
    .await;
}

fn replica_config(app_url: &str, store_url: &str) -> String {
    format!(
        "listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
upstream: {{ url: '{app_url}', timeout: {upstream}ms, connect_timeout: 500ms }}
store: {{ url: '{store_url}', lease: {lease}ms, timeout: 1s, retry_after: 1s, pool_size: 4 }}
shutdown_grace: 2s
routes:
  - {{ name: orders, path: /hooks/orders, key: {{ header: X-Event-Id }}, in_flight_retry_after: 1s }}
",
        upstream = UPSTREAM_TIMEOUT.as_millis(),
        lease = LEASE.as_millis(),
    )
}

async fn run(size: Size) {
    let seed = rng::seed_from_env();
    println!("chaos: seed {seed} (DEDUPE_CHAOS_SEED={seed} replays its decisions)");
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let relay = Arc::new(Relay::start(store.postgres_addr(), true).await);
    let app = Arc::new(
        App::start(AppBehavior {
            seed,
            fail_probability: 0.15,
            hang_probability: 0.08,
            hang_for: UPSTREAM_TIMEOUT + ms(500),
            max_work: ms(200),
        })
        .await,
    );
    let config = replica_config(&app.url(), &store.url_via(relay.addr));
    let replicas = Arc::new(Replicas::start(size.replicas, config).await);
    replicas.wait_ready().await;

    let policy = Policy {
        delivery_timeout: Duration::from_secs(4),
        first_backoff: ms(250),
        max_backoff: Duration::from_secs(4),
        // Well past the lease plus the longest outage, so every event that
        // is retried gets a delivery after its claim became reclaimable.
        give_up_after: Duration::from_secs(60),
        spread: ms(100) * size.events as u32,
        duplicate_probability: 0.1,
        replay_probability: 0.1,
        max_replay_delay: Duration::from_secs(10),
    };
    let provider = Arc::new(Provider::new(Arc::clone(&replicas), policy, seed));
    let faults = Arc::new(Faults {
        replicas: Arc::clone(&replicas),
        relay,
        app: Arc::clone(&app),
        store: Arc::clone(&store),
        tally: FaultTally::default(),
        max_store_cut: LEASE + ms(2000),
    });
    let stop = CancellationToken::new();
    let crashes =
        tokio::spawn(Arc::clone(&faults).crash_loop(Rng::derive(seed, 0xC4A5, 0), stop.clone()));
    let outages = tokio::spawn(
        Arc::clone(&faults).infrastructure_loop(Rng::derive(seed, 0x1AF, 0), stop.clone()),
    );
    let events: Vec<_> = (0..size.events)
        .map(|index| tokio::spawn(Arc::clone(&provider).run_event(index)))
        .collect();
    let mut reports = Vec::with_capacity(events.len());
    for event in events {
        reports.push(event.await.expect("event task"));
    }
    stop.cancel();
    crashes.await.expect("crash loop");
    outages.await.expect("outage loop");
    let logs = replicas.stop_all().await;

    let verdicts = checker::check(&app.records(), &reports, &logs);
    let (tally, faults) = (&provider.tally, &faults.tally);
    let get = Tally::get;
    println!(
        "chaos figures: seed={seed} replicas={} events={} acknowledged={} deliveries={} \
         forwarded_2xx={} duplicates_suppressed={} in_flight={} unavailable_503={} \
         upstream_errors={} forwarded_5xx={} transport_errors={} duplicate_sends={} replays={} \
         crashes={} graceful_restarts={} store_cuts={} backend_terminations={} upstream_stalls={} effects={} \
         acted_on={} double_effects_crash_during_upstream={} \
         double_effects_crash_after_2xx={} double_effects_store={} violations={}",
        size.replicas,
        verdicts.events,
        verdicts.acknowledged,
        get(&tally.deliveries),
        get(&tally.forwarded_2xx),
        get(&tally.duplicates),
        get(&tally.in_flight),
        get(&tally.unavailable),
        get(&tally.upstream_errors),
        get(&tally.forwarded_failures),
        get(&tally.transport_errors),
        get(&tally.duplicate_copies),
        get(&tally.replays),
        faults.crashes.load(Ordering::Relaxed),
        faults.graceful_restarts.load(Ordering::Relaxed),
        faults.store_cuts.load(Ordering::Relaxed),
        faults.backend_terminations.load(Ordering::Relaxed),
        faults.upstream_stalls.load(Ordering::Relaxed),
        verdicts.effects,
        verdicts.acted_on,
        verdicts.unrecorded_crash_during_upstream,
        verdicts.unrecorded_crash_after_answer,
        verdicts.unrecorded_store,
        verdicts.violations.len(),
    );
    for explained in &verdicts.explained {
        println!("chaos double effect: {explained}");
    }
    for violation in verdicts.violations.iter().take(20) {
        println!("chaos violation: {violation}");
    }
    assert_eq!(
        get(&tally.other),
        0,
        "answers outside the proxy's contract (e.g. a passthrough)"
    );
    assert!(
        faults.crashes.load(Ordering::Relaxed) > 0
            && faults.store_cuts.load(Ordering::Relaxed)
                + faults.backend_terminations.load(Ordering::Relaxed)
                > 0,
        "the schedule injected no crash or no store fault"
    );
    assert!(
        get(&tally.duplicates) > 0,
        "no duplicate was suppressed: the run exercised nothing"
    );
    assert!(
        verdicts.violations.is_empty(),
        "{} violations (seed {seed}); first: {:?}",
        verdicts.violations.len(),
        verdicts.violations.first()
    );
}
