//! Recovery without a restart: a settle that outlives a store outage longer
//! than the lease.

use std::sync::Arc;
use std::time::Duration;

use crate::support::{Backend, Behavior, Gate, Relay, TestApp, TestStore, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_that_failed_is_written_when_the_store_returns_after_the_lease() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    let relay = Relay::start(store.postgres_addr(), true).await;
    let url = store.url_via(relay.addr);
    let lease = Duration::from_secs(2);
    let app = Arc::new(
        TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
            config.store.url = url;
            config.store.lease = lease;
            config.upstream.timeout = Duration::from_secs(1);
            config.store.timeout = Duration::from_millis(500);
        })
        .await,
    );
    let gate = Gate::new();
    app.upstream
        .script("evt_outage", [Behavior::Gate(Arc::clone(&gate))]);
    let delivery = tokio::spawn({
        let app = Arc::clone(&app);
        async move { app.deliver("evt_outage", "{}").await }
    });
    app.upstream.wait_for(1).await;
    relay.cut().await;
    gate.open();
    let response = delivery.await.unwrap();
    assert_eq!((response.status, response.outcome()), (200, "forwarded"));

    // The outage outlasts the lease: the claim is reclaimable in the table,
    // but the proxy knows the application acted.
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    relay.restore();
    let client = store.postgres().await;
    let settled = async {
        loop {
            let status: String = client
                .query_one(
                    "SELECT status FROM processed_events WHERE event_id = 'evt_outage'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if status == "done" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), settled)
        .await
        .expect("the known outcome is written once the store answers");
    assert_eq!(app.deliver("evt_outage", "{}").await.outcome(), "duplicate");
    assert_eq!(app.upstream.count(), 1, "acted on once");
}
