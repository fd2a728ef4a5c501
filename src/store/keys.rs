//! The operator's side of the store: stored rows as records, and the
//! arguments and outcomes of listing, showing, forgetting, releasing and
//! pruning keys. The request flow never uses these; `keys` and `prune` do.

use std::fmt;
use std::time::{Duration, SystemTime};

/// The `status` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStatus {
    /// A delivery holds the key under a lease.
    Processing,
    /// The upstream acted on the event.
    Done,
    /// The last attempt failed; the next delivery is forwarded.
    Failed,
}

impl KeyStatus {
    /// The column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyStatus::Processing => "processing",
            KeyStatus::Done => "done",
            KeyStatus::Failed => "failed",
        }
    }

    /// Reads the column's value.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "processing" => Some(KeyStatus::Processing),
            "done" => Some(KeyStatus::Done),
            "failed" => Some(KeyStatus::Failed),
            _ => None,
        }
    }
}

impl fmt::Display for KeyStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One stored key, every column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    /// The route name the key belongs to.
    pub source: String,
    /// The idempotency key (`event_id`), verbatim.
    pub key: String,
    /// Where the key stands.
    pub status: KeyStatus,
    /// Attempts so far; the fencing token of the current one.
    pub attempts: i32,
    /// SHA-256 of the first delivery's body.
    pub payload_sha256: Option<Vec<u8>>,
    /// The upstream's status on the last attempt, when it answered.
    pub response_status: Option<u16>,
    /// The first delivery.
    pub received_at: SystemTime,
    /// The current attempt's claim.
    pub claimed_at: SystemTime,
    /// Until when the current attempt owns the key (`processing` only).
    pub lease_expires_at: Option<SystemTime>,
    /// When the last attempt was settled.
    pub completed_at: Option<SystemTime>,
}

/// Which keys `list` returns: newest first delivery first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFilter {
    /// Only this route's keys.
    pub source: Option<String>,
    /// Only keys in this state.
    pub status: Option<KeyStatus>,
    /// At most this many.
    pub limit: u32,
}

/// What `forget` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forget {
    /// The key was deleted.
    Forgotten,
    /// No such key.
    Missing,
    /// The key is `processing` under a live lease, and was kept: its delivery
    /// may still be at the application.
    InFlight {
        /// When the lease runs out.
        lease_expires_at: SystemTime,
    },
}

/// What `release` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The key was `processing` and is now `failed`.
    Released {
        /// The attempt that lost its claim. Its `done`, if it lands before a
        /// retry takes the key, is still recorded (the event was processed);
        /// its `failed` changes nothing, and once a retry has the key
        /// neither lands.
        attempt: i32,
    },
    /// No such key.
    Missing,
    /// The key exists but is not `processing`; nothing changed.
    NotProcessing(KeyStatus),
}

/// The keys one prune statement considers: those of `sources` whose first
/// delivery is older than `older_than`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneGroup {
    /// The retention horizon.
    pub older_than: Duration,
    /// The sources it applies to.
    pub sources: Sources,
}

/// A set of sources, open-ended so that keys of routes since removed from
/// the configuration are still pruned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sources {
    /// Exactly these.
    Only(Vec<String>),
    /// Every source but these.
    AllExcept(Vec<String>),
}

/// What one prune statement did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PruneBatch {
    /// It deleted this many rows.
    Deleted(u64),
    /// Another process is pruning the same table; nothing was done.
    Busy,
}
