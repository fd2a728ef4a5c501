//! dedupe-proxy: a reverse proxy that makes webhook endpoints idempotent.
//!
//! A webhook takes one path through the code:
//!
//! ```text
//! server -> route -> verify -> key -> store.claim -> upstream -> store.settle -> answer
//! ```
//!
//! - [`server`] accepts connections (plain or [`tls`]) and owns start-up and
//!   shutdown;
//! - [`proxy`] runs the flow above for each request and maps every ending to
//!   one HTTP answer;
//! - [`route`] matches a request to a configured route; [`verify`] checks its
//!   signature with the route's [`secret`]s; [`key`] extracts its idempotency
//!   key; [`provider`] presets supply both for known senders;
//! - [`store`] decides ownership of a key with one atomic statement and
//!   records the outcome, on PostgreSQL or SQLite;
//! - [`upstream`] forwards to the application;
//! - [`prune`] deletes keys past their retention, in the background and for
//!   the `prune` command;
//! - [`config`], [`cli`], [`metrics`], [`admin`] and [`telemetry`] are the
//!   operator's interfaces.

pub mod admin;
pub mod cli;
pub mod config;
pub mod key;
pub mod metrics;
pub mod provider;
pub mod proxy;
pub mod prune;
pub mod route;
pub mod secret;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod upstream;
pub mod verify;

pub use config::Config;
pub use server::Application;

/// Seconds from the Unix epoch to 10000-01-01T00:00:00Z, where RFC 3339's
/// four-digit years (and humantime's and tracing's formatting) end.
pub(crate) const RFC3339_END_SECS: u64 = 253_402_300_800;

/// An error and its causes, `: `-separated: libraries such as tokio-postgres
/// keep the server's message in the cause, not in the error's own text.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Many errors, tokio-postgres's and deadpool's among them, print
        // their source as well as returning it.
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
