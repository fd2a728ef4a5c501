//! The command line of SPEC section 6. `--config` and `--log-format` are
//! global, so they may stand before or after the subcommand. The operator's
//! commands on stored keys are implemented in [`keys`].

pub mod keys;

use std::io::{self, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use crate::store::KeyStatus;
use crate::telemetry::LogFormat;

/// A reverse proxy that makes webhook endpoints idempotent.
#[derive(Debug, Parser)]
#[command(name = "dedupe-proxy", version, about)]
pub struct Cli {
    /// The configuration file [env: DEDUPE_CONFIG]
    #[arg(long, short = 'c', global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log line format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// What to do (default: run).
    #[command(subcommand)]
    pub command: Option<Command>,
}

impl Cli {
    /// `--config`, or else `DEDUPE_CONFIG` unless it is empty: a
    /// deployment that sets it from an unset variable means no file, as
    /// with `DEDUPE_STORE_URL`.
    pub fn config_path(&self) -> Option<PathBuf> {
        self.config.clone().or_else(|| {
            std::env::var_os(CONFIG_ENV)
                .filter(|path| !path.is_empty())
                .map(PathBuf::from)
        })
    }
}

/// The environment variable naming the configuration file.
pub const CONFIG_ENV: &str = "DEDUPE_CONFIG";

/// The log format `args` (the program's name left out) ask for, read without
/// clap: for an error in the arguments themselves, which clap could not
/// parse. The last `--log-format` wins, as it does with clap.
pub fn log_format_asked<A: AsRef<std::ffi::OsStr>>(args: &[A]) -> LogFormat {
    let mut format = LogFormat::Text;
    let mut args = args.iter().map(AsRef::as_ref);
    while let Some(arg) = args.next() {
        let value = match arg.to_str() {
            Some("--") => break,
            Some("--log-format") => args.next().and_then(std::ffi::OsStr::to_str),
            Some(arg) => arg.strip_prefix("--log-format="),
            None => None,
        };
        if let Some(value) = value {
            format = LogFormat::from_str(value, false).unwrap_or(LogFormat::Text);
        }
    }
    format
}

/// A usage error's text on one line, for a JSON log line: clap's own
/// without its `error: ` and its pointer to `--help`; for a subcommand
/// left out, where clap prints the help, a line saying so.
pub fn usage_message(error: &clap::Error) -> String {
    let rendered = error.render().to_string();
    if error.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        // clap prints the command's help: its usage and subcommands say it.
        let usage = rendered
            .lines()
            .find_map(|line| line.strip_prefix("Usage: "))
            .unwrap_or("dedupe-proxy");
        let subcommands: Vec<&str> = rendered
            .lines()
            .skip_while(|line| line.trim() != "Commands:")
            .skip(1)
            .take_while(|line| !line.trim().is_empty())
            .filter_map(|line| line.split_whitespace().next())
            .filter(|name| *name != "help")
            .collect();
        return format!(
            "a subcommand is missing: {usage} (subcommands: {})",
            subcommands.join(", ")
        );
    }
    rendered
        .trim()
        .strip_prefix("error: ")
        .unwrap_or(rendered.trim())
        .split("\n\n")
        .filter(|paragraph| !paragraph.starts_with("For more information"))
        .map(|paragraph| {
            paragraph
                .lines()
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("; ")
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
    /// Inspect or change stored keys.
    Keys {
        /// What to do with them.
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Delete keys past their route's retention once, then exit.
    Prune {
        /// Delete keys first delivered longer ago than this (e.g. `72h`),
        /// whatever their route's retention.
        #[arg(long, value_name = "DURATION", value_parser = parse_horizon)]
        older_than: Option<Duration>,
    },
}

/// `prune --older-than`: a duration, as in the configuration, of at least a
/// millisecond: anything shorter (a mistyped unit, or 0) would delete every
/// key not under a live lease (the configuration refuses such a
/// `retention` alike).
fn parse_horizon(text: &str) -> Result<Duration, String> {
    match crate::config::parse_duration(text)? {
        horizon if horizon < Duration::from_millis(1) => Err(
            "must be at least 1ms: a shorter one is a mistyped unit (`us` for `s`), or 0, and would delete every key not under a live lease"
                .into(),
        ),
        horizon => Ok(horizon),
    }
}

/// The `keys` subcommands.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// List keys, newest first delivery first.
    List {
        /// Only this route's keys.
        #[arg(long, value_name = "SOURCE")]
        source: Option<String>,
        /// Only keys in this state.
        #[arg(long, value_enum)]
        status: Option<StatusArg>,
        /// At most this many keys.
        #[arg(long, value_name = "N", default_value_t = 100,
              value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one key: status, attempts, times, response.
    Show {
        /// The route name.
        source: String,
        /// The idempotency key (`--` before one that starts with `-`, unless
        /// it is a number without an exponent).
        #[arg(allow_negative_numbers = true)]
        key: String,
        /// Print a JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete a key: its next delivery is processed again. A key still
    /// `processing` under a live lease is kept unless `--force` is given.
    Forget {
        /// The route name.
        source: String,
        /// The idempotency key (`--` before one that starts with `-`, unless
        /// it is a number without an exponent).
        #[arg(allow_negative_numbers = true)]
        key: String,
        /// Delete a key even while its delivery may still be at the
        /// application.
        #[arg(long)]
        force: bool,
    },
    /// Turn a `processing` key into `failed`: its next delivery is forwarded
    /// now rather than when the lease expires.
    Release {
        /// The route name.
        source: String,
        /// The idempotency key (`--` before one that starts with `-`, unless
        /// it is a number without an exponent).
        #[arg(allow_negative_numbers = true)]
        key: String,
    },
}

/// The values of `keys list --status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StatusArg {
    /// Held by a delivery in flight (or abandoned, until its lease expires).
    Processing,
    /// Processed: duplicates are answered by the proxy.
    Done,
    /// The last attempt failed: the next delivery is forwarded.
    Failed,
}

impl From<StatusArg> for KeyStatus {
    fn from(status: StatusArg) -> Self {
        match status {
            StatusArg::Processing => KeyStatus::Processing,
            StatusArg::Done => KeyStatus::Done,
            StatusArg::Failed => KeyStatus::Failed,
        }
    }
}

/// Writes a command's output to stdout. A reader that stops reading early
/// (`| head`) ends the output quietly, as it does for other command-line
/// tools; any other failure to write (a full disk) is an error.
pub fn print(text: &str) -> anyhow::Result<()> {
    let mut stdout = io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        written => written.context("cannot write to stdout"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(args: &[&str]) -> String {
        let cli = Cli::try_parse_from(args).unwrap_or_else(|error| panic!("{args:?}: {error}"));
        match cli.command {
            Some(Command::Keys {
                command:
                    KeysCommand::Show { key, .. }
                    | KeysCommand::Forget { key, .. }
                    | KeysCommand::Release { key, .. },
            }) => key,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    /// A JSON pointer to a number gives its text as the key, which may be
    /// negative.
    #[test]
    fn a_negative_numeric_key_is_a_key_not_a_flag() {
        for action in ["show", "forget", "release"] {
            assert_eq!(
                key_of(&["dedupe-proxy", "keys", action, "json", "-42"]),
                "-42"
            );
            assert_eq!(
                key_of(&[
                    "dedupe-proxy",
                    "keys",
                    action,
                    "json",
                    "-4.5",
                    "-c",
                    "f.yaml"
                ]),
                "-4.5"
            );
        }
        assert_eq!(
            key_of(&["dedupe-proxy", "keys", "show", "json", "--", "-x"]),
            "-x"
        );
        assert!(Cli::try_parse_from(["dedupe-proxy", "keys", "show", "json", "-x"]).is_err());
    }

    #[test]
    fn the_log_format_asked_for_is_found_without_clap() {
        assert_eq!(log_format_asked::<&str>(&[]), LogFormat::Text);
        for args in [
            &["--log-format", "json", "keys", "list"][..],
            &["keys", "list", "--status", "bogus", "--log-format=json"],
            &["--log-format", "text", "--log-format", "json"],
        ] {
            assert_eq!(log_format_asked(args), LogFormat::Json, "{args:?}");
        }
        for args in [
            &["--log-format", "json", "--log-format", "text"][..],
            &["--log-format"],
            &["--log-format", "yaml"],
            &["keys", "show", "--", "--log-format", "json"],
        ] {
            assert_eq!(log_format_asked(args), LogFormat::Text, "{args:?}");
        }
    }

    #[test]
    fn a_usage_error_is_put_on_one_line() {
        let error =
            Cli::try_parse_from(["dedupe-proxy", "keys", "list", "--status", "bogus"]).unwrap_err();
        let message = usage_message(&error);
        assert!(
            message.starts_with("invalid value 'bogus' for '--status <STATUS>'"),
            "{message}"
        );
        assert!(
            !message.contains('\n') && !message.contains("--help"),
            "{message}"
        );
        let missing = Cli::try_parse_from(["dedupe-proxy", "keys", "show"]).unwrap_err();
        let message = usage_message(&missing);
        assert!(
            message.starts_with("the following required arguments were not provided:"),
            "{message}"
        );
        assert!(
            message.contains("Usage: dedupe-proxy keys show"),
            "{message}"
        );
        let no_subcommand = Cli::try_parse_from(["dedupe-proxy", "keys"]).unwrap_err();
        assert_eq!(
            usage_message(&no_subcommand),
            "a subcommand is missing: dedupe-proxy keys [OPTIONS] <COMMAND> (subcommands: list, show, forget, release)"
        );
    }

    #[test]
    fn prune_takes_durations_as_the_configuration_does() {
        let older_than = |text: &str| {
            Cli::try_parse_from(["dedupe-proxy", "prune", "--older-than", text]).map(
                |cli| match cli.command {
                    Some(Command::Prune { older_than }) => older_than,
                    other => panic!("{other:?}"),
                },
            )
        };
        assert_eq!(
            older_than("30d").unwrap(),
            Some(Duration::from_secs(30 * 86_400))
        );
        let error = older_than("1M").unwrap_err().to_string();
        assert!(error.contains("`M` is months"), "{error}");
        for too_short in ["0", "0s", "0d", "1ns", "999us"] {
            let error = older_than(too_short).unwrap_err();
            assert_eq!(error.kind(), clap::error::ErrorKind::ValueValidation);
            assert!(error.to_string().contains("at least 1ms"), "{error}");
        }
        assert_eq!(older_than("1ms").unwrap(), Some(Duration::from_millis(1)));
    }
}
