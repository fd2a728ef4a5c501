//! Integration tests: the real proxy in front of a real HTTP upstream, on a
//! real PostgreSQL and a real SQLite file. Scenarios run on both stores.

mod cli;
mod delivery;
mod hostile;
mod lifecycle;
mod postgres_tls;
mod prometheus;
mod rejections;
mod signatures;
mod store;
mod support;
mod tls;
