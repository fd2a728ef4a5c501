//! Logging set-up: `tracing` to stderr, text or JSON, filtered by `RUST_LOG`
//! when set and by `log_level` otherwise. Lines are written by a background
//! thread, so a slow stderr never stalls a request; none are dropped.

use std::io::{self, BufWriter, IsTerminal, Write};
use std::time::Duration;

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

/// How long the writer thread rests after each write to stderr. Lines logged
/// meanwhile wait in the queue and go out together in the next write, so
/// under load a request that logs finds the thread busy rather than asleep
/// and does not have to wake it, and stderr takes one write per batch instead
/// of one per line. A line reaches stderr at most this much later.
const WRITE_PAUSE: Duration = Duration::from_millis(5);

/// Installs the global subscriber; later calls are ignored. Keep the guard
/// until exit: dropping it flushes the lines not yet written.
#[must_use = "dropping the guard stops the log writer"]
pub fn init(format: LogFormat, log_level: &str) -> WorkerGuard {
    let configured = || EnvFilter::try_new(log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, unusable) = match std::env::var("RUST_LOG") {
        Ok(value) if !value.is_empty() => match EnvFilter::try_new(&value) {
            Ok(filter) => (filter, None),
            Err(error) => (configured(), Some((value, error))),
        },
        _ => (configured(), None),
    };
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .buffered_lines_limit(BUFFERED_LINES)
        .finish(BatchingWriter::new(io::stderr(), WRITE_PAUSE));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(io::stderr().is_terminal())
        .with_writer(writer);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    if let Some((value, error)) = unusable {
        tracing::warn!(rust_log = %value, %error, "RUST_LOG is not a log filter; using log_level");
    }
    guard
}

/// The writer thread's end of the log queue: lines are gathered while the
/// thread drains the queue, written when it has drained it (the library calls
/// `flush` then), and each write is followed by [`WRITE_PAUSE`].
struct BatchingWriter<W: Write> {
    lines: BufWriter<W>,
    pause: Duration,
}

impl<W: Write> BatchingWriter<W> {
    fn new(output: W, pause: Duration) -> Self {
        Self {
            lines: BufWriter::with_capacity(64 * 1024, output),
            pause,
        }
    }
}

impl<W: Write> Write for BatchingWriter<W> {
    fn write(&mut self, line: &[u8]) -> io::Result<usize> {
        self.lines.write(line)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.lines.flush()?;
        std::thread::sleep(self.pause);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records each write it is given, so a test can see how lines were
    /// grouped.
    #[derive(Default)]
    struct Writes(Vec<Vec<u8>>);

    impl Write for Writes {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.push(bytes.to_vec());
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_are_held_until_flush_then_written_together() {
        let mut writer = BatchingWriter::new(Writes::default(), Duration::ZERO);
        writer.write_all(b"first\n").unwrap();
        writer.write_all(b"second\n").unwrap();
        assert!(writer.lines.get_ref().0.is_empty());
        writer.flush().unwrap();
        assert_eq!(writer.lines.get_ref().0, [b"first\nsecond\n".to_vec()]);
    }

    #[test]
    fn a_batch_larger_than_the_buffer_is_written_whole_lines_at_a_time() {
        let mut writer = BatchingWriter::new(Writes::default(), Duration::ZERO);
        let line = [b'x'; 40 * 1024];
        writer.write_all(&line).unwrap();
        writer.write_all(&line).unwrap();
        writer.flush().unwrap();
        let writes = &writer.lines.get_ref().0;
        assert_eq!(writes.len(), 2);
        assert!(writes.iter().all(|write| write.len() == line.len()));
    }
}
