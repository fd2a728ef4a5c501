//! The binary: parse the command line, load the configuration, set up logs,
//! and run one subcommand. Exit codes: 0 success, 1 runtime failure,
//! 2 usage or configuration error.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use dedupe_proxy::cli::{self, Cli, Command, keys};
use dedupe_proxy::config::Secrets;
use dedupe_proxy::store::{Migration, Store, StoreError, StoreUrl};
use dedupe_proxy::telemetry::Unfiltered;
use dedupe_proxy::{Application, Config, telemetry};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const RUNTIME_FAILURE: u8 = 1;
const CONFIG_ERROR: u8 = 2;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return usage_error(&error),
    };
    let Some(path) = cli.config_path() else {
        telemetry::fatal(
            cli.log_format,
            None,
            "no configuration: pass --config FILE or set DEDUPE_CONFIG",
        );
        return ExitCode::from(CONFIG_ERROR);
    };
    let command = cli.command.unwrap_or(Command::Run);
    let secrets = match command {
        Command::Run | Command::CheckConfig { .. } => Secrets::Resolve,
        Command::Migrate | Command::Keys { .. } | Command::Prune { .. } => Secrets::Ignore,
    };
    let config = match Config::load(&path, secrets) {
        Ok(config) => config,
        Err(error) => {
            telemetry::fatal(cli.log_format, None, &error.to_string());
            return ExitCode::from(CONFIG_ERROR);
        }
    };
    let log_writer = telemetry::init(cli.log_format, &config.log_level);
    // The warnings are about serving; the store's commands leave them out.
    let warnings = match command {
        Command::Run | Command::CheckConfig { .. } => config.warnings(),
        Command::Migrate | Command::Keys { .. } | Command::Prune { .. } => Vec::new(),
    };
    for warning in warnings {
        // check-config exists to show them: a quiet log filter must not.
        if matches!(command, Command::CheckConfig { .. }) {
            let line = telemetry::unfiltered_line(cli.log_format, Unfiltered::Warning, &warning);
            eprintln!("{line}");
        } else {
            tracing::warn!("{warning}");
        }
    }
    let outcome = match command {
        Command::Run => run(&config).await,
        Command::CheckConfig { connect } => check_config(&config, connect).await,
        Command::Migrate => migrate(&config).await,
        Command::Keys { command } => keys::keys(&config, command).await,
        Command::Prune { older_than } => keys::prune(&config, older_than).await,
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            telemetry::fatal(cli.log_format, Some(log_writer), &format!("{error:#}"));
            ExitCode::from(RUNTIME_FAILURE)
        }
    }
}

/// Prints an error in the arguments as clap does, or, where they ask for
/// JSON logs, as the one JSON line any other fatal error is; help and the
/// version are for people, and stay as clap prints them.
fn usage_error(error: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let for_people = matches!(
        error.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
    );
    if for_people || cli::log_format_asked(&args) == telemetry::LogFormat::Text {
        error.exit();
    }
    telemetry::fatal(telemetry::LogFormat::Json, None, &cli::usage_message(error));
    ExitCode::from(CONFIG_ERROR)
}

async fn run(config: &Config) -> anyhow::Result<()> {
    // Listened for before start-up, so that a SIGTERM or SIGINT arriving
    // meanwhile (a rollout that changes its mind) is a shutdown, exit 0,
    // rather than the signal's default: killed.
    let signals = ShutdownSignals::listen()?;
    let application = Application::build(config).await?;
    let stop = CancellationToken::new();
    tokio::spawn(signals.stop_on_first(stop.clone()));
    application.run_until_stopped(stop).await;
    Ok(())
}

async fn check_config(config: &Config, connect: bool) -> anyhow::Result<()> {
    cli::print(&serde_yaml::to_string(&config.effective())?)?;
    // Warnings went to stderr, which keeps stdout parseable YAML.
    if connect {
        // A check leaves no empty SQLite file behind (at a mistyped path,
        // say); start-up creates it.
        let reached = async { Store::open_existing(&config.store)?.ping().await };
        match reached.await {
            Ok(()) => eprintln!("store: reachable"),
            Err(StoreError::MissingTable(_))
                if let Some(path) = StoreUrl::missing_sqlite_file(&config.store.url) =>
            {
                eprintln!(
                    "store: there is no SQLite file at {} yet (`dedupe-proxy migrate`, or start-up, creates it)",
                    path.display()
                );
            }
            // Before the first start or `migrate`, that is expected.
            Err(StoreError::MissingTable(said)) => eprintln!(
                "store: reachable; the claims table `{}` does not exist yet ({said}; `dedupe-proxy migrate`, or start-up with store.migrate: true, creates it)",
                config.store.table
            ),
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

async fn migrate(config: &Config) -> anyhow::Result<()> {
    let store = Store::open(&config.store)?;
    // As the statements name it: `store.table` is case-insensitive.
    let table = config.store.table.to_ascii_lowercase();
    // The result on stdout, as the other commands print theirs.
    cli::print(&match store.migrate().await? {
        Migration::CreatedTable => format!("store: created the claims table `{table}`\n"),
        Migration::CreatedIndex => {
            format!("store: created the received_at index of the claims table `{table}`\n")
        }
        Migration::UpToDate => "store: schema is up to date\n".to_owned(),
    })
}

/// SIGTERM and SIGINT, listened for from the moment this is made.
struct ShutdownSignals {
    terminate: Signal,
    interrupt: Signal,
}

impl ShutdownSignals {
    fn listen() -> anyhow::Result<Self> {
        let listen = |kind| signal(kind).context("cannot listen for shutdown signals");
        // SIGHUP's default action would end the process on the spot if one
        // came during start-up (a configuration reloader signalling every
        // process as a pod starts); once listened for, it never does again.
        // The server listens for it itself to reload certificates.
        drop(listen(SignalKind::hangup())?);
        Ok(Self {
            terminate: listen(SignalKind::terminate())?,
            interrupt: listen(SignalKind::interrupt())?,
        })
    }

    async fn stop_on_first(mut self, stop: CancellationToken) {
        tokio::select! {
            _ = self.interrupt.recv() => tracing::info!("SIGINT: shutting down"),
            _ = self.terminate.recv() => tracing::info!("SIGTERM: shutting down"),
        }
        stop.cancel();
    }
}
