//! Integration tests: the real proxy in front of a real HTTP upstream, on a
//! real PostgreSQL and a real SQLite file. Scenarios run on both stores.

mod batching;
mod chaos;
mod cli;
mod delivery;
mod exposition;
mod hostile;
mod keys;
mod lifecycle;
mod logs;
mod metrics;
mod pgbouncer;
mod postgres_tls;
mod prometheus;
mod prune;
mod recovery;
mod rejections;
mod rows;
mod signatures;
mod store;
mod support;
mod tls;
