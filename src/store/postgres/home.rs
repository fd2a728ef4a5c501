//! Which runtime opens and drives the pool's connections. A tokio socket
//! wakes the runtime it was opened on, so a connection first opened by the
//! start-up migration or a readiness probe, on the main runtime, made every
//! batch that later ran on it wake a thread of that runtime on the way out,
//! and the batch's own thread on the way back. Once the proxy names a home
//! runtime (the one that also runs the claim and settle batches),
//! connections are opened and driven there, and the requests its thread
//! serves reach the database without waking another thread.

use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::Duration;

use deadpool_postgres::Connect;
use futures_util::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_postgres::config::{Host, LoadBalanceHosts};
use tokio_postgres::error::{DbError, Severity};
use tokio_postgres::{AsyncMessage, Client, Config, Connection, Error};

use crate::tls::PostgresTls;

/// The runtime the store's connections and batches belong to, once named.
#[derive(Clone, Default)]
pub(super) struct Home(Arc<OnceLock<Handle>>);

impl Home {
    /// Names the home runtime; the first one named stays.
    pub(super) fn set(&self, runtime: Handle) {
        let _ = self.0.set(runtime);
    }

    pub(super) fn runtime(&self) -> Option<&Handle> {
        self.0.get()
    }
}

/// Opens connections on the home runtime, or, until one is named (commands
/// other than `run` never name one), on the caller's.
pub(super) struct HomeConnect {
    pub(super) tls: PostgresTls,
    pub(super) home: Home,
    /// With several hosts in the URL, how long each but the last may take
    /// to connect, TCP and start-up both, before the next is tried: an equal
    /// share of `store.timeout`, within which the pool wants a connection.
    pub(super) host_share: Duration,
}

type Opened = Result<(Client, JoinHandle<()>), Error>;

impl Connect for HomeConnect {
    fn connect(&self, config: &Config) -> BoxFuture<'_, Opened> {
        let mut hosts = one_config_per_host(config);
        if config.get_load_balance_hosts() == LoadBalanceHosts::Random {
            fastrand::shuffle(&mut hosts);
        }
        Box::pin(async move {
            // tokio-postgres tries the hosts in turn too, but bounds only each
            // TCP connect, not the start-up that follows: a first host that
            // accepted and never answered (a hung server, a load balancer
            // with nothing behind it) or took the pool's whole wait to refuse
            // kept every later one, the one to fail over to, from being
            // tried. The last host has the rest of the pool's wait.
            let last = hosts.pop().expect("a parsed URL names a host");
            for host in hosts {
                match tokio::time::timeout(self.host_share, self.open(host.clone())).await {
                    Ok(Ok(opened)) => return Ok(opened),
                    Ok(Err(error)) => tracing::debug!(
                        host = ?host.get_hosts(), error = %crate::error_chain(&error),
                        "PostgreSQL host refused; trying the next"
                    ),
                    Err(_) => tracing::debug!(
                        host = ?host.get_hosts(), waited = ?self.host_share,
                        "PostgreSQL host did not answer in time; trying the next"
                    ),
                }
            }
            self.open(last).await
        })
    }
}

impl HomeConnect {
    async fn open(&self, config: Config) -> Opened {
        let tls = self.tls.clone();
        if let Some(home) = self.home.runtime()
            && let Some(opened) = open_on(home, config.clone(), tls.clone()).await
        {
            return opened;
        }
        // No home, or it has stopped (the process is shutting down and
        // settling what is left): the caller's runtime will do.
        let (client, connection) = config.connect(tls).await?;
        Ok((client, tokio::spawn(drive(connection))))
    }
}

/// How many hosts `config` lists (a host, a `hostaddr`, or both).
pub(super) fn host_count(config: &Config) -> usize {
    config
        .get_hosts()
        .len()
        .max(config.get_hostaddrs().len())
        .max(1)
}

/// `config` once for each host it lists, in order, each naming that host
/// alone (its `hostaddr` and port with it) and keeping every other setting.
fn one_config_per_host(config: &Config) -> Vec<Config> {
    if host_count(config) == 1 {
        return vec![config.clone()];
    }
    (0..host_count(config))
        .map(|index| {
            let mut one = Config::new();
            if let Some(user) = config.get_user() {
                one.user(user);
            }
            if let Some(password) = config.get_password() {
                one.password(password);
            }
            if let Some(dbname) = config.get_dbname() {
                one.dbname(dbname);
            }
            if let Some(options) = config.get_options() {
                one.options(options);
            }
            if let Some(name) = config.get_application_name() {
                one.application_name(name);
            }
            one.ssl_mode(config.get_ssl_mode())
                .ssl_negotiation(config.get_ssl_negotiation());
            match config.get_hosts().get(index) {
                Some(Host::Tcp(host)) => drop(one.host(host)),
                Some(Host::Unix(path)) => drop(one.host_path(path)),
                None => {}
            }
            if let Some(&address) = config.get_hostaddrs().get(index) {
                one.hostaddr(address);
            }
            let ports = config.get_ports();
            if let Some(&port) = ports.get(index).or(ports.first()) {
                one.port(port);
            }
            if let Some(&timeout) = config.get_connect_timeout() {
                one.connect_timeout(timeout);
            }
            if let Some(&timeout) = config.get_tcp_user_timeout() {
                one.tcp_user_timeout(timeout);
            }
            one.keepalives(config.get_keepalives())
                .keepalives_idle(config.get_keepalives_idle());
            if let Some(interval) = config.get_keepalives_interval() {
                one.keepalives_interval(interval);
            }
            if let Some(retries) = config.get_keepalives_retries() {
                one.keepalives_retries(retries);
            }
            one.target_session_attrs(config.get_target_session_attrs())
                .channel_binding(config.get_channel_binding())
                .load_balance_hosts(config.get_load_balance_hosts());
            one
        })
        .collect()
}

/// Opens a connection in a task on `runtime`, which then drives it; `None`
/// if that runtime has stopped.
async fn open_on(runtime: &Handle, config: Config, tls: PostgresTls) -> Option<Opened> {
    let (opened_tx, opened) = oneshot::channel();
    let task = runtime.spawn(async move {
        match config.connect(tls).await {
            // A client nobody waits for any more (the pool gave up on
            // it) is closed at once.
            Ok((client, connection)) => {
                if opened_tx.send(Ok(client)).is_ok() {
                    drive(connection).await;
                }
            }
            Err(error) => drop(opened_tx.send(Err(error))),
        }
    });
    let opened = opened.await.ok()?;
    Some(opened.map(|client| (client, task)))
}

/// Drives a connection until it ends, logging the server's warnings.
async fn drive<S, T>(mut connection: Connection<S, T>)
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    let ended = std::future::poll_fn(|cx| {
        loop {
            match std::task::ready!(connection.poll_message(cx)) {
                Some(Ok(AsyncMessage::Notice(notice))) => log_notice(&notice),
                Some(Ok(_)) => {}
                Some(Err(error)) => return Poll::Ready(Err(error)),
                None => return Poll::Ready(Ok(())),
            }
        }
    });
    if let Err(error) = ended.await {
        // tokio-postgres's own text is only "db error"; the server's
        // reason (a terminated backend, an idle session timeout) is its source.
        let error = crate::error_chain(&error);
        tracing::warn!(%error, "PostgreSQL connection ended with an error");
    }
}

/// A server's `WARNING` (an `ANALYZE` this role may not run, say) is the
/// operator's to see, at `warn`; tokio-postgres would log it at `info` under
/// its own name. Lesser notices are for debugging.
fn log_notice(notice: &DbError) {
    if notice.parsed_severity() == Some(Severity::Warning) {
        tracing::warn!(warning = notice.message(), "PostgreSQL warned");
    } else {
        tracing::debug!(
            severity = notice.severity(),
            notice = notice.message(),
            "PostgreSQL notice"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Mutex;

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn each_host_s_config_keeps_every_other_setting() {
        let settings = "sslmode=disable&connect_timeout=3&keepalives_idle=20&keepalives_interval=4&keepalives_retries=2&application_name=x&target_session_attrs=read-write&options=-c%20a%3Db&tcp_user_timeout=5000&channel_binding=disable&load_balance_hosts=random";
        let all: Config = format!("postgres://u:pw@db1:5433,db2:5434/app?{settings}")
            .parse()
            .unwrap();
        let hosts = one_config_per_host(&all);
        assert_eq!(hosts.len(), 2);
        for (one, host) in hosts.iter().zip(["db1:5433", "db2:5434"]) {
            let alone: Config = format!("postgres://u:pw@{host}/app?{settings}")
                .parse()
                .unwrap();
            assert_eq!(format!("{one:?}"), format!("{alone:?}"));
            assert_eq!(one.get_password(), Some(&b"pw"[..]));
        }
        let one_port: Config = "host=db1,db2 hostaddr=10.0.0.1,10.0.0.2 port=6000 user=u"
            .parse()
            .unwrap();
        let hosts = one_config_per_host(&one_port);
        assert_eq!(hosts[1].get_ports(), [6000]);
        assert_eq!(
            hosts[1].get_hostaddrs(),
            ["10.0.0.2".parse::<std::net::IpAddr>().unwrap()]
        );
        assert_eq!(hosts[1].get_hosts(), [Host::Tcp("db2".into())]);
    }

    #[tokio::test]
    async fn the_servers_warnings_are_logged_as_warnings() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _logging = tracing::subscriber::set_default(subscriber);
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("DATABASE_URL names a reachable server");
        // On this (current) thread, so that the subscriber sees its lines.
        tokio::spawn(drive(connection));
        client
            .batch_execute(
                "DO $$ BEGIN RAISE WARNING 'the table was not analyzed'; RAISE NOTICE 'nothing to see'; END $$",
            )
            .await
            .unwrap();
        let logged = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(
            logged.contains("WARN")
                && logged.contains("PostgreSQL warned")
                && logged.contains("the table was not analyzed"),
            "{logged}"
        );
        assert!(!logged.contains("nothing to see"), "{logged}");
    }
}
