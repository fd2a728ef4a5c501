//! TLS to PostgreSQL: libpq's sslmodes, checked against the local server's
//! certificate (Debian's snakeoil certificate, issued to `localhost`).

use std::sync::Arc;

use dedupe_proxy::config::StoreConfig;
use dedupe_proxy::store::{Store, StoreError};

use crate::support::{Backend, TestApp, TestStore, Upstream};

const SERVER_CERTIFICATE: &str = "/etc/ssl/certs/ssl-cert-snakeoil.pem";

/// The test database's URL with another host and query string.
fn url(store: &TestStore, host: &str, query: &str) -> String {
    let addr = store.postgres_addr();
    let base = store.url_via(addr);
    let (userinfo, rest) = base.split_once('@').unwrap();
    let (_, database) = rest.split_once('/').unwrap();
    format!("{userinfo}@{host}:{}/{database}?{query}", addr.port())
}

async fn server_has_tls(store: &TestStore) {
    let client = store.postgres().await;
    let ssl: String = client.query_one("SHOW ssl", &[]).await.unwrap().get(0);
    assert_eq!(
        ssl, "on",
        "these tests need PostgreSQL with ssl = on (Debian's default)"
    );
    assert!(
        std::path::Path::new(SERVER_CERTIFICATE).exists(),
        "missing {SERVER_CERTIFICATE}"
    );
}

async fn ping(url: &str) -> Result<(), String> {
    dedupe_proxy::tls::install_crypto_provider();
    let config = StoreConfig {
        url: url.into(),
        timeout: std::time::Duration::from_secs(3),
        ..StoreConfig::default()
    };
    let store = Store::open(&config).map_err(|e| e.to_string())?;
    match store.ping().await {
        // The server answered over the connection: only the table is missing.
        Ok(()) | Err(StoreError::MissingTable(_)) => Ok(()),
        Err(error) => Err(error.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmodes_verify_as_libpq_does() {
    let store = TestStore::new(Backend::Postgres).await;
    server_has_tls(&store).await;
    let root = format!("sslrootcert={SERVER_CERTIFICATE}");
    ping(&url(&store, "127.0.0.1", "sslmode=require"))
        .await
        .expect("require encrypts without verifying");
    ping(&url(
        &store,
        "127.0.0.1",
        &format!("sslmode=verify-ca&{root}"),
    ))
    .await
    .expect("verify-ca ignores the name");
    ping(&url(
        &store,
        "localhost",
        &format!("sslmode=verify-full&{root}"),
    ))
    .await
    .expect("verify-full with the right name");
    let wrong_name = ping(&url(
        &store,
        "127.0.0.1",
        &format!("sslmode=verify-full&{root}"),
    ))
    .await;
    assert!(
        wrong_name.is_err(),
        "the certificate is not issued to 127.0.0.1"
    );
    let dir = tempfile::tempdir().unwrap();
    let other_ca = dir.path().join("ca.pem");
    std::fs::write(&other_ca, crate::tls::TestPki::new().ca_pem()).unwrap();
    let untrusted = ping(&url(
        &store,
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", other_ca.display()),
    ))
    .await;
    assert!(
        untrusted.is_err(),
        "a server certificate from another CA is refused"
    );
    // As libpq: a root given under `prefer` (the default) checks the chain.
    ping(&url(&store, "127.0.0.1", &root))
        .await
        .expect("prefer with a root checks the chain, not the name");
    let untrusted_by_default = ping(&url(
        &store,
        "localhost",
        &format!("sslrootcert={}", other_ca.display()),
    ))
    .await;
    assert!(
        untrusted_by_default.is_err(),
        "under prefer too, a server certificate from another CA is refused"
    );
}

/// libpq ignores `sslmode` on a Unix socket, where there is no TLS: a URL
/// copied from a TCP one, with `verify-full`, still connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_is_ignored_on_a_unix_socket() {
    let store = TestStore::new(Backend::Postgres).await;
    let client = store.postgres().await;
    let directories: String = client
        .query_one("SHOW unix_socket_directories", &[])
        .await
        .unwrap()
        .get(0);
    let directory = directories.split(',').next().unwrap().trim().to_owned();
    assert!(
        !directory.is_empty(),
        "these tests need PostgreSQL listening on a Unix socket (Debian's default)"
    );
    let socket =
        percent_encoding::utf8_percent_encode(&directory, percent_encoding::NON_ALPHANUMERIC)
            .to_string();
    for sslmode in ["require", "verify-full"] {
        let over_socket = url(
            &store,
            &socket,
            &format!("sslmode={sslmode}&sslrootcert={SERVER_CERTIFICATE}"),
        );
        ping(&over_socket)
            .await
            .unwrap_or_else(|error| panic!("{over_socket}: {error}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_claims_over_a_verified_tls_connection() {
    let store = Arc::new(TestStore::new(Backend::Postgres).await);
    server_has_tls(&store).await;
    let tls_url = url(
        &store,
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={SERVER_CERTIFICATE}"),
    );
    let app = TestApp::spawn_on(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.url = tls_url
    })
    .await;
    assert_eq!(
        app.deliver("evt_tls_store", "{}").await.outcome(),
        "forwarded"
    );
    assert_eq!(
        app.deliver("evt_tls_store", "{}").await.outcome(),
        "duplicate"
    );
    let client = store.postgres().await;
    let database = store.url.rsplit('/').next().unwrap().to_string();
    let encrypted: Option<bool> = client
        .query_one(
            "SELECT bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
              WHERE a.datname = $1 AND a.application_name = 'dedupe-proxy'",
            &[&database],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(encrypted, Some(true), "every proxy connection is encrypted");

    // A store reachable only over an unverifiable TLS connection counts as down.
    let refused = TestApp::start(Arc::clone(&store), Upstream::start().await, |config| {
        config.store.url = url(
            &store,
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={SERVER_CERTIFICATE}"),
        );
    })
    .await;
    let answer = refused.deliver("evt_tls_refused", "{}").await;
    assert_eq!((answer.status, answer.outcome()), (503, "unavailable"));
    assert_eq!(refused.admin_get("/readyz").await.status, 503);
}
