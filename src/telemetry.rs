//! Logging set-up: `tracing` to stderr, text or JSON, filtered by `RUST_LOG`
//! when set and by `log_level` otherwise. Lines are written by a background
//! thread, so a slow stderr never stalls a request. When stderr stops taking
//! lines altogether and the queue is full, new lines are dropped rather than
//! waited for, and a warning says how many once lines go through again: the
//! serving threads also drive the store's statements, and a stalled claim or
//! settle costs more than a log line.

use std::cell::Cell;
use std::fmt;
use std::io::{self, BufWriter, IsTerminal, Write};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_util::sync::CancellationToken;
use tracing_appender::non_blocking::{ErrorCounter, NonBlocking, WorkerGuard};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;

/// The log line format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Log lines queued for the writer thread; past them, lines are dropped. The
/// queue is allocated and touched whole at start-up (32 bytes a
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
    let configured = || log_filter(log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, unusable) = match std::env::var("RUST_LOG") {
        Ok(value) if !value.is_empty() => match log_filter(&value) {
            Ok(filter) => (filter, None),
            Err(error) => (configured(), Some((value, error))),
        },
        _ => (configured(), None),
    };
    let (writer, guard) = non_blocking(io::stderr());
    let _ = DROPPED.set(writer.error_counter());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(io::stderr().is_terminal())
        .with_timer(Timestamp)
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

/// Writes the error that ends the process to stderr, after every line
/// queued before it (`queued` is dropped first, which flushes them), in the
/// log's format and whatever the log filter: the last thing a process says
/// must reach its operator, and under `--log-format json` must not be the
/// one line a log pipeline cannot parse.
pub fn fatal(format: LogFormat, queued: Option<WorkerGuard>, message: &str) {
    drop(queued);
    eprintln!("{}", unfiltered_line(format, Unfiltered::Error, message));
}

/// What a line written past the log filter says it is.
#[derive(Debug, Clone, Copy)]
pub enum Unfiltered {
    Warning,
    Error,
}

/// A line for stderr in `format`, whatever the log filter lets through:
/// for what a command exists to say (a fatal error, `check-config`'s
/// warnings), which a quiet `log_level` must not hide.
pub fn unfiltered_line(format: LogFormat, kind: Unfiltered, message: &str) -> String {
    let (word, level) = match kind {
        Unfiltered::Warning => ("warning", "WARN"),
        Unfiltered::Error => ("error", "ERROR"),
    };
    match format {
        LogFormat::Text => format!("{word}: {message}"),
        // Written field by field, in the order of every other line's (a
        // `serde_json` map would sort them).
        LogFormat::Json => {
            let text = |value: &str| serde_json::Value::from(value).to_string();
            let now = humantime::format_rfc3339_micros(SystemTime::now()).to_string();
            format!(
                r#"{{"timestamp":{},"level":"{level}","message":{},"target":{}}}"#,
                text(&now),
                text(message),
                text(env!("CARGO_CRATE_NAME")),
            )
        }
    }
}

/// Each line's time, written as tracing-subscriber's own timer writes it
/// (`2026-12-06T17:40:08.123456Z`, UTC), with the date and time of day made
/// once a second per thread instead of for every line: working out the date
/// was a fifth of what a webhook's log line cost.
struct Timestamp;

impl FormatTime for Timestamp {
    fn format_time(&self, writer: &mut Writer<'_>) -> fmt::Result {
        thread_local! {
            static SECOND: Cell<(u64, [u8; SECOND_LEN])> = const { Cell::new((u64::MAX, [0; SECOND_LEN])) };
        }
        let now = SystemTime::now();
        match SECOND.with(|cached| stamp(now, cached)) {
            Some(stamp) => writer.write_str(std::str::from_utf8(&stamp).expect("ASCII")),
            // Before 1970 or after 9999: the library's own timer words those.
            None => tracing_subscriber::fmt::time::SystemTime.format_time(writer),
        }
    }
}

/// `2026-12-06T17:40:08`.
const SECOND_LEN: usize = 19;

/// `now` as `2026-12-06T17:40:08.123456Z`, the part up to the second taken
/// from `cached` when it holds `now`'s second; `None` outside 1970–9999.
fn stamp(now: SystemTime, cached: &Cell<(u64, [u8; SECOND_LEN])>) -> Option<[u8; SECOND_LEN + 8]> {
    let since = now.duration_since(UNIX_EPOCH).ok()?;
    let seconds = since.as_secs();
    if seconds >= crate::RFC3339_END_SECS {
        return None;
    }
    let second = match cached.get() {
        (at, text) if at == seconds => text,
        _ => {
            let whole = UNIX_EPOCH + Duration::from_secs(seconds);
            let text = humantime::format_rfc3339_seconds(whole).to_string();
            let second: [u8; SECOND_LEN] = text.as_bytes()[..SECOND_LEN].try_into().ok()?;
            cached.set((seconds, second));
            second
        }
    };
    let mut stamp = [0; SECOND_LEN + 8];
    stamp[..SECOND_LEN].copy_from_slice(&second);
    stamp[SECOND_LEN..].copy_from_slice(b".000000Z");
    let mut micros = since.subsec_micros();
    for digit in stamp[SECOND_LEN + 1..SECOND_LEN + 7].iter_mut().rev() {
        *digit = b'0' + (micros % 10) as u8;
        micros /= 10;
    }
    Some(stamp)
}

/// Parses a log filter: comma-separated levels (`trace`, `debug`, `info`,
/// `warn`, `error`, `off`) and `target=level` directives.
///
/// A bare word is refused although `EnvFilter` takes it as a target to log
/// at every level: written where a level was meant (`warning`, `verbose`) it
/// would turn off every other line, errors included, without a word.
pub fn log_filter(directives: &str) -> Result<EnvFilter, String> {
    if let Some(bare) = directives
        .split(',')
        .map(str::trim)
        .find(|directive| !directive.contains('=') && !is_level(directive))
    {
        return Err(format!(
            "`{bare}` is neither a level (trace, debug, info, warn, error, off) nor a `target=level` directive"
        ));
    }
    // `EnvFilter` refuses a directive with a space around it, as in
    // `info, hyper=warn`, which reads as intended.
    let mut trimmed: Vec<&str> = directives.split(',').map(str::trim).collect();
    // The pool's only lines say that a connection which failed could not be
    // reused, after the store's own warning about the same connection has
    // said why and where; a filter naming the pool still has them.
    if !directives.contains("deadpool") {
        trimmed.push(QUIET_POOL);
    }
    EnvFilter::try_new(trimmed.join(","))
        .map_err(|error| format!("`{directives}` is not a log filter: {error}"))
}

/// Keeps the PostgreSQL pool's own lines out unless a filter names it.
const QUIET_POOL: &str = "deadpool.postgres=off";

fn is_level(word: &str) -> bool {
    ["trace", "debug", "info", "warn", "error", "off"]
        .iter()
        .any(|level| word.eq_ignore_ascii_case(level))
}

/// Lines dropped because the queue to stderr was full, since start-up.
static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// How many log lines have been dropped since start-up.
fn dropped_lines() -> usize {
    DROPPED.get().map_or(0, ErrorCounter::dropped_lines)
}

/// Every `interval` until `stop`, logs how many lines were dropped since the
/// last look, if any. The warning is queued like any line: it reaches stderr
/// once stderr takes lines again.
pub async fn report_dropped_lines(interval: Duration, stop: CancellationToken) {
    let mut report = DroppedLines::since(dropped_lines());
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while stop.run_until_cancelled(ticks.tick()).await.is_some() {
        let before = dropped_lines();
        if let Some(dropped) = report.unreported(before) {
            tracing::warn!(
                dropped,
                "log lines dropped: stderr did not take them, and the queue to it was full"
            );
            report.warned(before, dropped_lines());
        }
    }
}

/// The count of dropped lines still to be reported. A warning queued while
/// the queue is still full is dropped itself: its count is then carried to
/// the next warning, and the warning is not counted among the lines dropped.
#[derive(Debug)]
struct DroppedLines {
    /// Of the lines the counter has counted, those already reported.
    reported: usize,
    /// Of them, this report's own warnings.
    own: usize,
}

impl DroppedLines {
    fn since(counted: usize) -> Self {
        Self {
            reported: counted,
            own: 0,
        }
    }

    /// How many lines, not counting this report's own warnings, were
    /// dropped and not yet reported, given the counter's count.
    fn unreported(&self, counted: usize) -> Option<usize> {
        let dropped = counted - self.own - self.reported;
        (dropped > 0).then_some(dropped)
    }

    /// Takes the counter's count before and after a warning was queued. A
    /// line dropped meanwhile is taken for the warning: were it another,
    /// the count is reported a second time rather than lost.
    fn warned(&mut self, before: usize, after: usize) {
        if after > before {
            self.own += 1;
        } else {
            self.reported = before - self.own;
        }
    }
}

/// A queue of [`BUFFERED_LINES`] lines to a writer thread writing to
/// `output`, dropping lines when it is full.
fn non_blocking<W: Write + Send + 'static>(output: W) -> (NonBlocking, WorkerGuard) {
    tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(BUFFERED_LINES)
        .finish(BatchingWriter::new(output, WRITE_PAUSE))
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

    /// Stderr blocked for longer than an interval: the first warnings find
    /// the queue full and are dropped too; the first to get through says how
    /// many lines were dropped in all, not counting the dropped warnings.
    #[test]
    fn a_dropped_warning_carries_its_count_to_the_next() {
        let mut report = DroppedLines::since(3);
        assert_eq!(report.unreported(3), None);
        // 100 lines dropped; the warning about them is dropped too.
        assert_eq!(report.unreported(103), Some(100));
        report.warned(103, 104);
        // 50 more, and that warning too.
        assert_eq!(report.unreported(154), Some(150));
        report.warned(154, 155);
        // Stderr takes lines again: this warning gets through.
        assert_eq!(report.unreported(155), Some(150));
        report.warned(155, 155);
        assert_eq!(report.unreported(155), None);
        assert_eq!(report.unreported(162), Some(7));
        report.warned(162, 162);
        assert_eq!(report.unreported(162), None);
    }

    #[test]
    fn timestamps_are_utc_to_the_microsecond_and_the_second_is_cached() {
        let cached = Cell::new((u64::MAX, [0; SECOND_LEN]));
        let text = |stamp: Option<[u8; SECOND_LEN + 8]>| {
            String::from_utf8(stamp.unwrap().to_vec()).unwrap()
        };
        let at = |micros: u64| UNIX_EPOCH + Duration::from_micros(micros);
        assert_eq!(
            text(stamp(at(1_700_000_000_012_345), &cached)),
            "2023-11-14T22:13:20.012345Z"
        );
        assert_eq!(cached.get().0, 1_700_000_000);
        assert_eq!(
            text(stamp(at(1_700_000_000_999_999), &cached)),
            "2023-11-14T22:13:20.999999Z"
        );
        assert_eq!(
            text(stamp(at(1_700_000_001_000_000), &cached)),
            "2023-11-14T22:13:21.000000Z"
        );
        assert_eq!(
            text(stamp(UNIX_EPOCH, &cached)),
            "1970-01-01T00:00:00.000000Z"
        );
        assert_eq!(
            text(stamp(at(253_402_300_799_000_001), &cached)),
            "9999-12-31T23:59:59.000001Z"
        );
        assert_eq!(stamp(at(253_402_300_800_000_000), &cached), None);
        assert_eq!(stamp(UNIX_EPOCH - Duration::from_secs(1), &cached), None);
    }

    #[test]
    fn a_log_filter_is_levels_and_target_directives_and_not_bare_words() {
        for accepted in [
            "info",
            "WARN",
            "off",
            "info,hyper=warn",
            " warn , hyper=debug ",
            "dedupe_proxy::proxy=trace",
            "[request]=debug",
        ] {
            assert!(log_filter(accepted).is_ok(), "{accepted}");
        }
        for (refused, naming) in [
            ("warning", "`warning` is neither a level"),
            ("verbose", "`verbose` is neither a level"),
            ("info, dedupe_proxy", "`dedupe_proxy` is neither a level"),
            ("info,[unclosed", "`[unclosed` is neither a level"),
            ("hyper=loud", "hyper=loud"),
        ] {
            let error = log_filter(refused).expect_err(refused);
            assert!(error.contains(naming), "{refused}: {error}");
        }
    }

    #[test]
    fn the_pools_repetitions_are_filtered_out_unless_named() {
        let filter = |directives: &str| log_filter(directives).unwrap().to_string();
        for quiet in ["info", "debug", "warn,hyper=debug", "trace"] {
            assert!(
                filter(quiet).contains(QUIET_POOL),
                "{quiet}: {}",
                filter(quiet)
            );
        }
        let named = filter("info,deadpool=debug");
        assert!(!named.contains("=off"), "{named}");
    }

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

    /// Blocks every write until the test lets it go, like a stderr nobody
    /// reads.
    struct Stuck(std::sync::mpsc::Receiver<()>);

    impl Write for Stuck {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            let _ = self.0.recv();
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stderr_that_takes_nothing_costs_lines_not_waits() {
        use tracing_subscriber::fmt::MakeWriter;
        let (unblock, blocked) = std::sync::mpsc::channel();
        let (writer, guard) = non_blocking(Stuck(blocked));
        let line = [b'x'; 100];
        let lines = BUFFERED_LINES + 5_000;
        let (written, all_written) = std::sync::mpsc::channel();
        let logging = writer.clone();
        std::thread::spawn(move || {
            for _ in 0..lines {
                logging.make_writer().write_all(&line).unwrap();
            }
            let _ = written.send(());
        });
        // Bounded, so that a writer that waits fails the test.
        all_written
            .recv_timeout(Duration::from_secs(20))
            .expect("logging never waits for stderr");
        // Besides the queue, the writer thread holds what its buffer took
        // before the write that blocks.
        let held = 64 * 1024 / line.len() + 2;
        let dropped = writer.error_counter().dropped_lines();
        assert!(
            (lines - BUFFERED_LINES - held..=lines - BUFFERED_LINES).contains(&dropped),
            "{dropped} of {lines} dropped"
        );
        drop(unblock);
        drop(guard);
    }
}
