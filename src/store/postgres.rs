//! The PostgreSQL backend: a deadpool pool of tokio-postgres connections, the
//! schema of SPEC section 2, and the claim as one data-modifying statement.
//! Holds no session state between transactions, so it works through a
//! transaction-pooling PgBouncer: named prepared statements only for the
//! claim and the settle, and only while they work (see [`Params`]). The
//! statements are in `postgres/sql.rs`, how they are sent in
//! `postgres/session.rs`, their coalescing into batches in
//! `postgres/batch.rs`, the operator's statements in `postgres/keys.rs`.

mod batch;
mod home;
mod keys;
mod session;
mod shape;
mod sql;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{IsolationLevel, Row};

use super::{
    Backend, ClaimRequest, Fence, Forget, KeyFilter, KeyRecord, Migration, PendingClaim,
    PruneBatch, PruneGroup, Release, Settlement, StoreError,
};
use crate::config::StoreConfig;
use crate::error_chain;
use batch::{Batches, Growth, HeldClaims, SettleRequest, TakingBack};
use home::{Home, HomeConnect};
use session::{Params, Session, instance};
use shape::Shape;
use sql::Statements;

/// Claims recorded in PostgreSQL.
pub struct PostgresStore {
    session: Arc<Session>,
    sql: Arc<Statements>,
    keys: keys::Statements,
    table: String,
    batches: OnceLock<Batches>,
    home: Home,
    /// `store.timeout`: how long a claim's caller waits for it.
    claim_timeout: Duration,
    verdict: Arc<TableVerdict>,
}

/// What the last look at the table's shape found. Claims are refused while
/// it is not the claims table (a view, a column missing or of another
/// type): every other statement is checked against its shape, and a claim
/// written there could be forwarded and then never settled.
#[derive(Default)]
struct TableVerdict {
    /// `problem.is_some()`, read without the lock by every claim.
    refused: AtomicBool,
    /// The problem, and when the table was last read.
    problem: Mutex<Option<(StoreError, Instant)>>,
    rechecking: AtomicBool,
}

/// How often claims refused for the table's shape look at it again, so that
/// a table mended by hand takes claims again without a restart, whether or
/// not anything polls `/readyz`.
const RECHECK_TABLE_AFTER: Duration = Duration::from_secs(1);

impl TableVerdict {
    fn record(&self, result: &Result<Shape, StoreError>) {
        let mut problem = self.problem.lock().unwrap_or_else(PoisonError::into_inner);
        let refusal = match result {
            // A missing table fails every claim on its own, saying so.
            Ok(_) | Err(StoreError::MissingTable(_)) => None,
            Err(error @ StoreError::NotClaimsTable { .. }) => Some(error.clone()),
            // The table was not read, so nothing new is known of it; the
            // next look waits its turn, or a store that is down would be
            // asked again at every claim.
            Err(_) => {
                if let Some((_, read_at)) = problem.as_mut() {
                    *read_at = Instant::now();
                }
                return;
            }
        };
        self.refused.store(refusal.is_some(), Ordering::Release);
        *problem = refusal.map(|error| (error, Instant::now()));
    }

    /// The problem, while there is one; whether the table is due another look.
    fn refusal(&self) -> Option<(StoreError, bool)> {
        if !self.refused.load(Ordering::Acquire) {
            return None;
        }
        let problem = self.problem.lock().unwrap_or_else(PoisonError::into_inner);
        let (error, read_at) = problem.as_ref()?;
        Some((error.clone(), read_at.elapsed() >= RECHECK_TABLE_AFTER))
    }
}

/// A pooled connection, given back to the pool when dropped.
type Connection = deadpool_postgres::Object;

impl PostgresStore {
    /// A pool for `url`; connections are made on first use.
    pub fn new(url: &str, config: &StoreConfig) -> Result<Self, StoreError> {
        let (pg_config, tls) = connection_config(url, config)?;
        let home = Home::default();
        let connect = HomeConnect {
            tls,
            home: home.clone(),
            host_share: config.timeout
                / u32::try_from(home::host_count(&pg_config)).unwrap_or(u32::MAX),
        };
        let manager = Manager::from_connect(
            pg_config.clone(),
            connect,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(config.timeout))
            .create_timeout(Some(config.timeout))
            .recycle_timeout(Some(config.timeout))
            .build()
            .map_err(|error| StoreError::Postgres(error_chain(&error)))?;
        let instance = instance();
        Ok(Self {
            session: Arc::new(Session {
                pool,
                pipeline: Mutex::new(Weak::new()),
                statement_cache: config.statement_cache,
                named_statements_lost: AtomicBool::new(false),
                instance: instance.clone(),
                growth: Growth::new(),
                taking_back: TakingBack::default(),
                held_claims: HeldClaims::default(),
                server: describe_server(&pg_config),
            }),
            sql: Arc::new(Statements::new(&config.table, &instance)),
            keys: keys::Statements::new(&config.table),
            table: config.table.clone(),
            batches: OnceLock::new(),
            home,
            claim_timeout: config.timeout,
            verdict: Arc::default(),
        })
    }

    /// Opens and drives connections, and runs the claim and settle batches,
    /// on `runtime` from now on (see `postgres/home.rs`). Connections
    /// opened before stay where they are, so this comes before the first
    /// statement.
    pub fn set_home(&self, runtime: tokio::runtime::Handle) {
        self.home.set(runtime);
    }

    fn batches(&self) -> &Batches {
        self.batches.get_or_init(|| {
            let _home = self.home.runtime().map(tokio::runtime::Handle::enter);
            Batches::start(&self.session, &self.sql, self.claim_timeout)
        })
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.session.client().await
    }

    /// Whether claims could be written now: the table lock every claim's
    /// `INSERT` takes can be had within half of `store.timeout` (the other
    /// half is the connection's and the catalog's). A catalog read passes
    /// while a transaction holds the table (an `ALTER TABLE`, a `VACUUM
    /// FULL`, a `LOCK TABLE`, a `CREATE INDEX` without `CONCURRENTLY`), and
    /// every claim times out meanwhile.
    pub(super) async fn take_table_lock(&self) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let transaction = read_committed(&mut client).await?;
        transaction
            .batch_execute(&format!(
                "SET LOCAL lock_timeout = {}; LOCK TABLE {} IN ROW EXCLUSIVE MODE",
                (self.claim_timeout / 2).as_millis().max(1),
                self.sql.table_regclass
            ))
            .await
            .map_err(postgres_error)?;
        transaction.rollback().await.map_err(postgres_error)
    }

    /// Runs an operator's one-off statement, always unnamed: caching gains
    /// nothing there, and an unnamed statement cannot meet another client's
    /// statement of the same name on a pooled server connection.
    async fn query_unnamed(&self, sql: &str, params: &Params<'_>) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await?;
        client
            .query_typed(sql, params)
            .await
            .map_err(postgres_error)
    }

    /// Reads the table's shape on `client` and refuses a table that is not
    /// the claims table, naming what differs: a column's type the
    /// statements would fail to decode, or a missing primary key that every
    /// claim's `ON CONFLICT` would trip on.
    async fn check_shape(
        &self,
        client: &impl tokio_postgres::GenericClient,
    ) -> Result<Shape, StoreError> {
        let shape = read_shape(client, &self.sql, &self.table).await;
        self.verdict.record(&shape);
        shape
    }

    /// Reads the table's shape again, in the background, for claims refused
    /// for it; one read at a time.
    fn recheck_table(&self) {
        if self.verdict.rechecking.swap(true, Ordering::AcqRel) {
            return;
        }
        let (session, sql) = (Arc::clone(&self.session), Arc::clone(&self.sql));
        let (table, verdict) = (self.table.clone(), Arc::clone(&self.verdict));
        tokio::spawn(async move {
            let shape = match session.client().await {
                Ok(client) => read_shape(&**client, &sql, &table).await,
                Err(error) => Err(error),
            };
            verdict.record(&shape);
            verdict.rechecking.store(false, Ordering::Release);
        });
    }
}

async fn read_shape(
    client: &impl tokio_postgres::GenericClient,
    sql: &Statements,
    table: &str,
) -> Result<Shape, StoreError> {
    let shape = Shape::read(client, &sql.table_regclass).await?;
    match shape.problem() {
        None => Ok(shape),
        Some(problem) => Err(StoreError::NotClaimsTable {
            // As the statements name it, and `migrate` says it.
            table: table.to_ascii_lowercase(),
            problem,
        }),
    }
}

impl Backend for PostgresStore {
    async fn migrate(&self) -> Result<Migration, StoreError> {
        let mut client = self.client().await?;
        // The catalog read after the lock wait must see the index another
        // replica's migration made meanwhile.
        let transaction = read_committed(&mut client).await?;
        // Transaction-scoped, so the lock cannot leak through a pooler. Taken
        // on the name the table is created under, so that replicas spelling
        // it differently (`processed_events`, `public.processed_events`)
        // still wait on each other.
        transaction
            .execute_typed(
                "SELECT pg_advisory_xact_lock(hashtextextended('dedupe-proxy migrate ' || \
                 array_to_string(CASE WHEN cardinality(parse_ident($1)) = 1 \
                 THEN current_schema()::text || parse_ident($1) ELSE parse_ident($1) END, '.'), 0))",
                &[(&self.sql.table_regclass, Type::TEXT)],
            )
            .await
            .map_err(postgres_error)?;
        // Past the wait for another replica's migration, a lock held on the
        // table (a long `ALTER`, a `LOCK TABLE`) fails the migration within
        // `store.timeout`, to be retried, instead of hanging it unseen.
        transaction
            .batch_execute(&format!(
                "SET LOCAL lock_timeout = {}",
                self.claim_timeout.as_millis().max(1)
            ))
            .await
            .map_err(postgres_error)?;
        // `CREATE … IF NOT EXISTS` needs the right to create in the schema
        // even when there is nothing to create, and a role that may only
        // read and write rows (the table created by its owner) must still
        // be able to start with `store.migrate: true`.
        let rows = transaction
            .query_typed(
                "SELECT to_regclass($1) IS NOT NULL",
                &[(&self.sql.table_regclass, Type::TEXT)],
            )
            .await
            .map_err(postgres_error)?;
        let table_existed = rows.first().is_some_and(|row| row.get(0));
        if !table_existed {
            transaction
                .batch_execute(&self.sql.create_table)
                .await
                .map_err(postgres_error)?;
        }
        let inner: &tokio_postgres::Transaction<'_> = &transaction;
        let shape = self.check_shape(inner).await?;
        if !shape.indexed {
            transaction
                .batch_execute(&self.sql.create_index)
                .await
                .map_err(postgres_error)?;
        }
        transaction.commit().await.map_err(postgres_error)?;
        Ok(Migration::after(table_existed, shape.indexed))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let client: &tokio_postgres::Client = &client;
        self.check_shape(client).await.map(drop)
    }

    fn queue_claim(&self, request: &ClaimRequest) -> Result<PendingClaim, StoreError> {
        if let Some((refusal, look_again)) = self.verdict.refusal() {
            if look_again {
                self.recheck_table();
            }
            return Err(refusal);
        }
        self.batches().claims.enqueue(request.clone())
    }

    async fn settle(
        &self,
        source: &str,
        key: &str,
        fence: Fence,
        settlement: Settlement,
    ) -> Result<bool, StoreError> {
        let request = SettleRequest {
            source: source.to_owned(),
            key: key.to_owned(),
            fence,
            settlement,
        };
        self.batches().settles.call(request).await
    }

    async fn list(&self, filter: &KeyFilter) -> Result<Vec<KeyRecord>, StoreError> {
        self.list_keys(filter).await
    }

    async fn show(&self, source: &str, key: &str) -> Result<Option<KeyRecord>, StoreError> {
        self.show_key(source, key).await
    }

    async fn forget(&self, source: &str, key: &str, force: bool) -> Result<Forget, StoreError> {
        self.forget_key(source, key, force).await
    }

    async fn release(&self, source: &str, key: &str) -> Result<Release, StoreError> {
        self.release_key(source, key).await
    }

    async fn prune(&self, group: &PruneGroup, limit: u32) -> Result<PruneBatch, StoreError> {
        self.prune_batch(group, limit).await
    }
}

/// How long sent data may go unacknowledged, and an idle connection
/// unprobed, before the connection is given up, unless the URL says
/// otherwise (`tcp_user_timeout`, `keepalives_idle`). A server that vanishes
/// without closing its connections (a failover, a dropped route) would
/// otherwise hold a statement for the kernel's retransmissions, about 15
/// minutes, and with it a batch slot of every claim or settle queue.
const DEAD_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// How often an idle connection is probed once `keepalives_idle` has passed:
/// the kernel checks `tcp_user_timeout` only when a probe is due, and its
/// own 75 s interval would let a dead idle connection linger about 105 s.
const KEEPALIVES_INTERVAL: Duration = Duration::from_secs(10);

/// tokio-postgres's `keepalives_idle` when the URL does not set it.
const LIBRARY_KEEPALIVES_IDLE: Duration = Duration::from_secs(2 * 60 * 60);

/// The connection settings for `url`, with the proxy's defaults where the
/// URL sets none.
fn connection_config(
    url: &str,
    config: &StoreConfig,
) -> Result<(tokio_postgres::Config, crate::tls::PostgresTls), StoreError> {
    let (mut pg_config, tls) = crate::tls::postgres_config(url, Some(DEAD_CONNECTION_TIMEOUT))
        .map_err(StoreError::Postgres)?;
    if pg_config.get_connect_timeout().is_none() {
        pg_config.connect_timeout(config.timeout);
    }
    if pg_config.get_application_name().is_none() {
        pg_config.application_name("dedupe-proxy");
    }
    if pg_config.get_keepalives_idle() == LIBRARY_KEEPALIVES_IDLE {
        pg_config.keepalives_idle(DEAD_CONNECTION_TIMEOUT);
    }
    if pg_config.get_keepalives_interval().is_none() {
        pg_config.keepalives_interval(KEEPALIVES_INTERVAL);
    }
    Ok((pg_config, tls))
}

fn postgres_error(error: tokio_postgres::Error) -> StoreError {
    match error.code() {
        Some(&SqlState::UNDEFINED_TABLE) => StoreError::MissingTable(
            error
                .as_db_error()
                .map_or_else(|| error_chain(&error), |db| db.message().to_owned()),
        ),
        Some(&SqlState::QUERY_CANCELED) => StoreError::Canceled(error_chain(&error)),
        // The server answered and refused this statement (bad data, deadlock,
        // serialization); connection and shutdown classes aside, the
        // connection itself is fine.
        Some(code) if !code.code().starts_with("08") && !code.code().starts_with("57") => {
            StoreError::Refused(error_chain(&error))
        }
        _ => StoreError::Postgres(error_chain(&error)),
    }
}

/// A transaction in which each statement sees what committed before it, as
/// under PostgreSQL's default isolation, whatever the database's or role's
/// default is: the migration and the operator's commands lock a row or wait
/// for a lock and then read what they waited for, which `repeatable read`
/// or `serializable` would refuse as a conflict instead.
async fn read_committed(
    client: &mut Connection,
) -> Result<deadpool_postgres::Transaction<'_>, StoreError> {
    client
        .build_transaction()
        .isolation_level(IsolationLevel::ReadCommitted)
        .start()
        .await
        .map_err(postgres_error)
}

/// `PostgreSQL at host:port/database`, each host of a multi-host URL listed.
fn describe_server(config: &tokio_postgres::Config) -> String {
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(index, host)| {
            let port = ports.get(index).or(ports.first()).copied().unwrap_or(5432);
            match host {
                tokio_postgres::config::Host::Tcp(name) if name.contains(':') => {
                    format!("[{name}]:{port}")
                }
                tokio_postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                tokio_postgres::config::Host::Unix(dir) => {
                    format!("{}/.s.PGSQL.{port}", dir.display())
                }
            }
        })
        .collect();
    let database = config
        .get_dbname()
        .or(config.get_user())
        .unwrap_or("postgres");
    format!("PostgreSQL at {}/{database}", hosts.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_is_described_by_where_it_is_never_by_who_connects() {
        let described = |url: &str| describe_server(&url.parse().unwrap());
        assert_eq!(
            described("postgres://app:hunter2@db.internal:6432/orders"),
            "PostgreSQL at db.internal:6432/orders"
        );
        assert_eq!(
            described("postgres://app@a,b:5433/orders"),
            "PostgreSQL at a:5432,b:5433/orders"
        );
        assert_eq!(
            described("postgres://app@%2Fvar%2Frun%2Fpostgresql/orders"),
            "PostgreSQL at /var/run/postgresql/.s.PGSQL.5432/orders"
        );
        assert_eq!(
            described("postgres://app@[::1]/orders"),
            "PostgreSQL at [::1]:5432/orders"
        );
    }

    #[test]
    fn a_dead_server_is_given_up_on_unless_the_url_says_otherwise() {
        let config = StoreConfig::default();
        let (defaults, _) = connection_config("postgres://u@db/app", &config).unwrap();
        assert_eq!(
            defaults.get_tcp_user_timeout(),
            Some(&DEAD_CONNECTION_TIMEOUT)
        );
        assert_eq!(defaults.get_keepalives_idle(), DEAD_CONNECTION_TIMEOUT);
        assert_eq!(
            defaults.get_keepalives_interval(),
            Some(KEEPALIVES_INTERVAL)
        );
        assert!(defaults.get_keepalives());
        let (chosen, _) = connection_config(
            "postgres://u@db/app?tcp_user_timeout=5000&keepalives_idle=60&keepalives_interval=3",
            &config,
        )
        .unwrap();
        assert_eq!(
            chosen.get_tcp_user_timeout(),
            Some(&Duration::from_secs(5)),
            "milliseconds, as libpq reads them"
        );
        assert_eq!(chosen.get_keepalives_idle(), Duration::from_secs(60));
        assert_eq!(
            chosen.get_keepalives_interval(),
            Some(Duration::from_secs(3))
        );
        let (kernel, _) = connection_config(
            "postgres://u@db/app?sslmode=disable&tcp_user_timeout=0",
            &config,
        )
        .unwrap();
        assert_eq!(kernel.get_tcp_user_timeout(), None, "0: the kernel's own");
        let bad = connection_config("postgres://u@db/app?tcp_user_timeout=5s", &config);
        assert!(
            matches!(&bad, Err(StoreError::Postgres(message)) if message.contains("milliseconds")),
            "{:?}",
            bad.err()
        );
    }
}
