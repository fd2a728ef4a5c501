//! Which runtime opens and drives the pool's connections. A tokio socket
//! wakes the runtime it was opened on, so a connection first opened by the
//! start-up migration or a readiness probe, on the main runtime, made every
//! batch that later ran on it wake a thread of that runtime on the way out,
//! and the batch's own thread on the way back. Once the proxy names a home
//! runtime (the one that also runs the claim and settle batches),
//! connections are opened and driven there, and the requests its thread
//! serves reach the database without waking another thread.

use std::sync::{Arc, OnceLock};

use deadpool_postgres::Connect;
use futures_util::future::BoxFuture;
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Config, Error};

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

async fn drive(connection: impl Future<Output = Result<(), Error>>) {
    if let Err(error) = connection.await {
        // tokio-postgres's own text is only "db error"; the server's
        // reason (a terminated backend, an idle session timeout) is its source.
        let error = crate::error_chain(&error);
        tracing::warn!(%error, "PostgreSQL connection ended with an error");
    }
}
