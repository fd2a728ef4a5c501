//! Logging set-up: `tracing` to stderr, text or JSON, filtered by `RUST_LOG`
//! when set and by `log_level` otherwise. Lines are written by a background
//! thread, so a slow stderr never stalls a request; none are dropped.

use std::io::IsTerminal;

use tracing_appender::non_blocking::WorkerGuard;
use tracing_subscriber::EnvFilter;

/// The log line format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Log lines queued for the writer thread before a request that logs waits
/// for it. The queue is allocated and touched whole at start-up (32 bytes a
/// line), so the library's default of 128,000 would cost 4 MiB of resident
/// memory for a burst the writer drains in a fraction of a second anyway.
const BUFFERED_LINES: usize = 16_384;

/// Installs the global subscriber; later calls are ignored. Keep the guard
/// until exit: dropping it flushes the lines not yet written.
#[must_use = "dropping the guard stops the log writer"]
pub fn init(format: LogFormat, log_level: &str) -> WorkerGuard {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .buffered_lines_limit(BUFFERED_LINES)
        .finish(std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(writer);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    guard
}
