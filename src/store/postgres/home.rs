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

use deadpool_postgres::Connect;
use futures_util::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
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
}

type Opened = Result<(Client, JoinHandle<()>), Error>;

impl Connect for HomeConnect {
    fn connect(&self, config: &Config) -> BoxFuture<'_, Opened> {
        let (config, tls) = (config.clone(), self.tls.clone());
        let home = self.home.runtime().cloned();
        Box::pin(async move {
            if let Some(home) = home
                && let Some(opened) = open_on(&home, config.clone(), tls.clone()).await
            {
                return opened;
            }
            // No home, or it has stopped (the process is shutting down and
            // settling what is left): the caller's runtime will do.
            let (client, connection) = config.connect(tls).await?;
            Ok((client, tokio::spawn(drive(connection))))
        })
    }
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
