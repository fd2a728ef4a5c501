//! The command line of SPEC section 6. `--config` and `--log-format` are
//! global, so they may stand before or after the subcommand.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::telemetry::LogFormat;

/// A reverse proxy that makes webhook endpoints idempotent.
#[derive(Debug, Parser)]
#[command(name = "dedupe-proxy", version, about)]
pub struct Cli {
    /// The configuration file.
    #[arg(
        long,
        short = 'c',
        global = true,
        env = "DEDUPE_CONFIG",
        value_name = "FILE"
    )]
    pub config: Option<PathBuf>,
    /// Log line format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// What to do (default: run).
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve webhooks (the default).
    Run,
    /// Validate the configuration and print it with defaults filled in and
    /// secrets redacted.
    CheckConfig {
        /// Also connect to the store and check that it answers.
        #[arg(long)]
        connect: bool,
    },
    /// Create or upgrade the store's schema, then exit.
    Migrate,
}
