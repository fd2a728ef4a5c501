//! dedupe-proxy: a reverse proxy that makes webhook endpoints idempotent.
//!
//! A webhook takes one path through the code:
//!
//! ```text
//! server -> route -> key -> store.claim -> upstream -> store.settle -> answer
//! ```
//!
//! - [`server`] accepts connections and owns start-up and shutdown;
//! - [`proxy`] runs the flow above for each request and maps every ending to
//!   one HTTP answer;
//! - [`route`] matches a request to a configured route; [`key`] extracts its
//!   idempotency key;
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
pub mod proxy;
pub mod prune;
pub mod route;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod upstream;

pub use config::Config;
pub use server::Application;
