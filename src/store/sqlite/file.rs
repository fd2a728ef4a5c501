//! The database file: whether it can be created, opening it as the store
//! needs it (WAL, synchronous commits, writable), and noticing it deleted or
//! replaced under the running process.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

/// Why the file at `path` could not be created, if it could not. Names the
/// directory by its full path: a relative one is read from the working
/// directory, which is easy to get wrong when running a command by hand.
pub(super) fn creatable(path: &str) -> Result<(), String> {
    let dir = match Path::new(path).parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let dir = &from_root(dir);
    match dir.try_exists() {
        Ok(true) if !dir.is_dir() => Err(format!("{} is not a directory", dir.display())),
        Ok(true) => can_create_in(dir).map_err(|error| format!("{error} (in {})", dir.display())),
        Ok(false) => Err(format!("the directory {} does not exist", dir.display())),
        Err(error) => Err(format!("{error} (in {})", dir.display())),
    }
}

/// The write-ahead log left beside `path` where the database file itself is
/// gone: moved or deleted while a process had it open. Opening `path` then
/// would make a new, empty database, and SQLite would discard the log, with
/// the latest writes of the one that is gone.
pub(super) fn orphaned_log(path: &str) -> Option<std::path::PathBuf> {
    let log = from_root(Path::new(&format!("{path}-wal")));
    let orphaned = !Path::new(path).exists()
        && std::fs::metadata(&log).is_ok_and(|metadata| metadata.len() > 0);
    orphaned.then_some(log)
}

/// `path` from the root: a relative one is read from the working directory,
/// which is easy to get wrong when running a command by hand.
pub(super) fn from_root(path: &Path) -> std::path::PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Whether a file can be created in `dir`, found by creating one (and
/// removing it): permissions, a read-only mount and a full quota all count,
/// whoever the process runs as.
fn can_create_in(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(format!(".dedupe-proxy-check-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)?;
    std::fs::remove_file(&probe)
}

pub(super) fn open_connection(
    path: &Path,
    busy_timeout: Duration,
    create: bool,
) -> rusqlite::Result<Connection> {
    // A path, never a `file:` URI: the URL was checked to be a plain file.
    let mut flags = OpenFlags::default() - OpenFlags::SQLITE_OPEN_URI;
    if !create {
        flags.remove(OpenFlags::SQLITE_OPEN_CREATE);
    }
    let connection = Connection::open_with_flags(path, flags)?;
    connection.busy_timeout(busy_timeout)?;
    // Persistent, and set by the process that serves or migrates the file:
    // the commands that only look at a store (`keys`, `check-config`) leave a
    // file they were pointed at by mistake, another program's, as it was.
    if create {
        connection.pragma_update(None, "journal_mode", "WAL")?;
    }
    // FULL: a commit is on disk before the claim is answered, as in PostgreSQL.
    connection.pragma_update(None, "synchronous", "FULL")?;
    // A reader that holds a transaction open (a backup, an `sqlite3` session)
    // keeps the log from being checkpointed back to its start, so it grows
    // for as long as that lasts; without a limit it keeps that size for good.
    connection.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT)?;
    Ok(connection)
}

/// A file as it was opened: its path and which file that path named.
pub(super) struct OpenedFile {
    pub(super) path: String,
    identity: (u64, u64),
}

impl OpenedFile {
    pub(super) fn at(path: String) -> Option<Self> {
        let identity = identity(&path)?;
        Some(Self { path, identity })
    }

    /// Whether the path still names the file that was opened.
    pub(super) fn still_there(&self) -> bool {
        identity(&self.path) == Some(self.identity)
    }
}

fn identity(path: &str) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .ok()
        .map(|metadata| (metadata.dev(), metadata.ino()))
}

/// What the write-ahead log is cut back to once a checkpoint empties it:
/// far above the 4 MiB it reaches between SQLite's automatic checkpoints, so
/// that it is not cut and regrown in the normal course.
const WAL_SIZE_LIMIT: i64 = 64 << 20;

/// SQLite opens a file it may not write to read-only without a word, and
/// every claim would then fail; taking the write lock, as a claim would,
/// finds that out at start-up. The error says what to look at.
pub(super) fn writable(connection: &Connection) -> Result<(), String> {
    let read_only = connection
        .is_readonly(rusqlite::MAIN_DB)
        .map_err(|error| error.to_string())?;
    if read_only {
        return Err(format!(
            "the database is read-only to this process ({PERMISSIONS_HINT})"
        ));
    }
    connection
        .execute_batch("BEGIN IMMEDIATE; ROLLBACK")
        .map_err(|error| {
            let hint = match error.sqlite_error_code() {
                Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
                    "another process holds its write lock, such as an sqlite3 session with a write transaction open or a VACUUM"
                }
                _ => PERMISSIONS_HINT,
            };
            format!("{error} ({hint})")
        })
}

pub(super) const PERMISSIONS_HINT: &str =
    "check the permissions of the file, of its -wal and -shm files, and of its directory";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_opened_read_only_is_found_out_and_the_log_is_capped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedupe.db");
        let connection = open_connection(&path, Duration::from_secs(1), true).unwrap();
        writable(&connection).unwrap();
        let limit: i64 = connection
            .pragma_query_value(None, "journal_size_limit", |row| row.get(0))
            .unwrap();
        assert_eq!(limit, WAL_SIZE_LIMIT);
        // What SQLite falls back to for a file this process may not write.
        let read_only =
            Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
        let refused = writable(&read_only).unwrap_err();
        assert!(refused.contains("read-only"), "{refused}");
        assert!(refused.contains("permissions"), "{refused}");
    }

    #[test]
    fn only_a_process_that_may_create_the_file_sets_its_journal_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("other.db");
        Connection::open(&path)
            .unwrap()
            .execute_batch("CREATE TABLE users (id INTEGER)")
            .unwrap();
        let mode = |connection: &Connection| -> String {
            connection
                .pragma_query_value(None, "journal_mode", |row| row.get(0))
                .unwrap()
        };
        let looking = open_connection(&path, Duration::from_secs(1), false).unwrap();
        assert_eq!(mode(&looking), "delete");
        drop(looking);
        let serving = open_connection(&path, Duration::from_secs(1), true).unwrap();
        assert_eq!(mode(&serving), "wal");
    }

    #[test]
    fn a_held_write_lock_is_named_not_blamed_on_permissions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedupe.db");
        let holder = open_connection(&path, Duration::from_secs(1), true).unwrap();
        holder.execute_batch("BEGIN IMMEDIATE").unwrap();
        let waiter = open_connection(&path, Duration::from_millis(50), true).unwrap();
        let refused = writable(&waiter).unwrap_err();
        assert!(
            refused.contains("another process holds its write lock"),
            "{refused}"
        );
        assert!(!refused.contains("permissions"), "{refused}");
        holder.execute_batch("ROLLBACK").unwrap();
        writable(&waiter).unwrap();
    }
}
