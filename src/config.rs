//! The configuration file: serde types that are the user documentation, strict
//! parsing (unknown keys are errors), defaults, and cross-field validation that
//! reports every problem at once (`validate`). Turning the validated file into runtime types
//! (compiled routes, store URLs, secrets) is done by the modules that own them.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod duration;
mod locate;
mod routes;
mod validate;

pub use duration::{format as format_duration, parse as parse_duration};
pub use routes::{
    KeyConfig, Mode, OnMissingKey, OnPayloadMismatch, RouteConfig, RouteDefaults, StatusMatch,
};

use crate::verify::DEFAULT_TOLERANCE;

/// The environment variable that, when set, replaces `store.url`.
pub const STORE_URL_ENV: &str = "DEDUPE_STORE_URL";

/// The route name reserved for requests that match no route (a metrics label).
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address the webhook listener binds, as `IP:PORT`.
    #[serde(default = "default_listen", deserialize_with = "listen_address")]
    pub listen: SocketAddr,
    /// Address of the admin listener (`/metrics`, `/healthz`, `/readyz`), as
    /// `IP:PORT`. Loopback by default: it is not meant to be reachable by
    /// senders.
    #[serde(default = "default_admin_listen", deserialize_with = "listen_address")]
    pub admin_listen: SocketAddr,
    /// Optional inbound TLS on `listen`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "tls_if_given"
    )]
    pub tls: Option<TlsConfig>,
    /// The application the proxy forwards to.
    #[serde(default, deserialize_with = "null_as_default")]
    pub upstream: UpstreamConfig,
    /// Where claims are recorded.
    #[serde(default, deserialize_with = "null_as_default")]
    pub store: StoreConfig,
    /// Log filter when `RUST_LOG` is not set (`info`, `debug`, or a full
    /// `tracing` filter directive).
    #[serde(default = "default_log_level")]
    pub log_level: String,
    /// Request limits.
    #[serde(default, deserialize_with = "null_as_default")]
    pub limits: Limits,
    /// How long in-flight requests may run after SIGTERM/SIGINT.
    #[serde(default = "default_shutdown_grace", with = "duration")]
    pub shutdown_grace: Duration,
    /// Per-route behaviour that routes inherit unless they override it.
    #[serde(default, deserialize_with = "null_as_default")]
    pub defaults: RouteDefaults,
    /// What to do with requests that match no route.
    #[serde(default)]
    pub unmatched: Unmatched,
    /// The webhook endpoints to deduplicate.
    #[serde(default, deserialize_with = "null_as_default")]
    pub routes: Vec<RouteConfig>,
    /// Where each field is written in the file, for messages about them.
    #[serde(skip)]
    lines: Arc<locate::Lines>,
}

/// Inbound TLS certificate and key (PEM files).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain.
    pub cert_file: PathBuf,
    /// PEM private key.
    pub key_file: PathBuf,
}

/// The upstream application.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL; the request's path and query are appended to its path.
    #[serde(default = "default_upstream_url")]
    pub url: String,
    /// Longest wait for the upstream's response headers; past it the sender
    /// gets 504, the claim is settled `failed` and the connection is reset
    /// (so that no part of the request still unsent reaches the upstream
    /// later). The body that follows the headers is streamed as long as it
    /// keeps coming: one that stalls for this long between two pieces is cut
    /// off, and so is a sender that takes nothing written to it for as long.
    #[serde(default = "default_upstream_timeout", with = "duration")]
    pub timeout: Duration,
    /// Longest wait for a TCP connection to the upstream.
    #[serde(default = "default_connect_timeout", with = "duration")]
    pub connect_timeout: Duration,
    /// CA bundle (PEM) for `https://` upstreams instead of the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            url: default_upstream_url(),
            timeout: default_upstream_timeout(),
            connect_timeout: default_connect_timeout(),
            ca_file: None,
        }
    }
}

/// The claim store.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// `sqlite://PATH` or `postgres://…`; `DEDUPE_STORE_URL` overrides it.
    #[serde(default = "default_store_url")]
    pub url: String,
    /// Table holding the claims.
    #[serde(default = "default_table")]
    pub table: String,
    /// How long a claim stays exclusively owned while its request is in
    /// flight. Must exceed `upstream.timeout`.
    #[serde(default = "default_lease", with = "duration")]
    pub lease: Duration,
    /// How long keys are kept after their first delivery (routes may override).
    #[serde(default = "default_retention", with = "duration")]
    pub retention: Duration,
    /// How often each replica deletes keys past their retention, starting
    /// one interval after start-up. On PostgreSQL a replica that finds
    /// another one pruning skips its turn.
    #[serde(default = "default_prune_interval", with = "duration")]
    pub prune_interval: Duration,
    /// Maximum connections to PostgreSQL.
    #[serde(default = "default_pool_size")]
    pub pool_size: usize,
    /// What webhooks get while the store cannot be reached.
    #[serde(default)]
    pub on_unavailable: OnUnavailable,
    /// Longest time any single store operation may take before the store
    /// counts as unavailable.
    #[serde(default = "default_store_timeout", with = "duration")]
    pub timeout: Duration,
    /// `Retry-After` sent with 503 answers.
    #[serde(default = "default_retry_after", with = "duration")]
    pub retry_after: Duration,
    /// Create or upgrade the schema at start-up.
    #[serde(default = "default_true")]
    pub migrate: bool,
    /// Use named prepared statements for the claim and the settle; turn off
    /// behind a transaction-pooling PgBouncer older than 1.21 (a proxy that
    /// finds its named statements lost switches to unnamed ones by itself,
    /// with a warning).
    #[serde(default = "default_true")]
    pub statement_cache: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            url: default_store_url(),
            table: default_table(),
            lease: default_lease(),
            retention: default_retention(),
            prune_interval: default_prune_interval(),
            pool_size: default_pool_size(),
            on_unavailable: OnUnavailable::default(),
            timeout: default_store_timeout(),
            retry_after: default_retry_after(),
            migrate: true,
            statement_cache: true,
        }
    }
}

/// Behaviour while the store is unreachable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnavailable {
    /// Answer 503 with `Retry-After`; the sender retries later.
    #[default]
    Reject,
    /// Forward without deduplication (availability over exactly-once).
    Forward,
}

/// Request limits.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Largest accepted request body; larger ones get 413.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Longest accepted idempotency key; longer ones get 400.
    #[serde(default = "default_max_key_bytes")]
    pub max_key_bytes: usize,
    /// Requests handled at once; more get 503.
    #[serde(default = "default_max_concurrent_requests")]
    pub max_concurrent_requests: usize,
    /// Bytes of request bodies held at once, read or being read; a request
    /// whose body would go past it gets 503. Bodies are read whole before
    /// their signature is checked, so this bounds the memory unverified
    /// senders can take.
    #[serde(default = "default_max_buffered_body_bytes")]
    pub max_buffered_body_bytes: usize,
    /// Longest time a client may take to send its request headers; slower
    /// connections are closed (slowloris protection).
    #[serde(default = "default_read_timeout", with = "duration")]
    pub header_read_timeout: Duration,
    /// Longest time a client may take to send a request's body, from the
    /// end of its head (an unmatched one's is streamed and cut off); slower
    /// requests get 408.
    #[serde(default = "default_read_timeout", with = "duration")]
    pub body_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: default_max_body_bytes(),
            max_key_bytes: default_max_key_bytes(),
            max_concurrent_requests: default_max_concurrent_requests(),
            max_buffered_body_bytes: default_max_buffered_body_bytes(),
            header_read_timeout: default_read_timeout(),
            body_read_timeout: default_read_timeout(),
        }
    }
}

/// Requests that match no route.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Unmatched {
    /// Forward untouched (but for the proxy's own headers).
    #[default]
    Forward,
    /// Answer 404.
    Reject,
}

/// Everything wrong with a configuration file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The YAML does not fit the schema (serde names the field and line).
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// serde_yaml's message, with the field path and location.
        message: String,
    },
    /// The file parsed, but values are invalid or inconsistent.
    #[error("{path}: invalid configuration:\n  {}", .problems.join("\n  "))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// One line per problem, each naming its field.
        problems: Vec<String>,
    },
}

/// Whether validation reads the routes' secrets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Secrets {
    /// Read every `env`/`file` secret and the TLS files (`tls`,
    /// `upstream.ca_file`): serving and `check-config` need them.
    Resolve,
    /// Leave them unread: commands that only work on the store never verify
    /// a signature, accept a connection or call the upstream, and an operator
    /// repairing keys should not need the webhook secrets or the listener's
    /// private key to do it.
    Ignore,
}

impl Config {
    /// Reads, parses and validates a configuration file, applying the
    /// `DEDUPE_STORE_URL` override, reading the routes' secrets or not.
    pub fn load(path: &Path, secrets: Secrets) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let store_url = std::env::var(STORE_URL_ENV)
            .ok()
            .filter(|url| !url.is_empty());
        Self::from_yaml_with(&text, store_url, secrets).map_err(|problem| match problem {
            Problem::Parse(message) => ConfigError::Parse {
                path: path.to_owned(),
                message,
            },
            Problem::Invalid(problems) => ConfigError::Invalid {
                path: path.to_owned(),
                problems,
            },
        })
    }

    /// Parses and validates YAML text; `store_url` replaces `store.url`.
    pub fn from_yaml(text: &str, store_url: Option<String>) -> Result<Self, Problem> {
        Self::from_yaml_with(text, store_url, Secrets::Resolve)
    }

    fn from_yaml_with(
        text: &str,
        store_url: Option<String>,
        secrets: Secrets,
    ) -> Result<Self, Problem> {
        let mut config = parse_document(text)?;
        let mut lines = locate::Lines::of(text);
        if let Some(url) = store_url {
            config.store.url = url;
            lines.set_by_environment("store.url", STORE_URL_ENV);
        }
        config.lines = Arc::new(lines);
        let problems = config.validate_with(secrets);
        if problems.is_empty() {
            return Ok(config);
        }
        Err(Problem::Invalid(
            problems
                .into_iter()
                .map(|problem| config.lines.annotate(problem))
                .collect(),
        ))
    }

    /// The route with every inherited field filled in from `defaults` and
    /// `store.retention`.
    pub fn effective_route(&self, route: &RouteConfig) -> RouteConfig {
        let defaults = &self.defaults;
        let mut route = route.clone();
        let preset_retention = route.provider.map(|provider| provider.preset().retention);
        route.retention.get_or_insert(
            self.store
                .retention
                .max(preset_retention.unwrap_or_default()),
        );
        route.tolerance.get_or_insert(DEFAULT_TOLERANCE);
        // Routes match methods case-insensitively, so print them as matched.
        for method in &mut route.methods {
            method.make_ascii_uppercase();
        }
        route
            .done_on
            .get_or_insert_with(|| defaults.done_on.clone());
        route
            .duplicate_status
            .get_or_insert(defaults.duplicate_status);
        route
            .in_flight_status
            .get_or_insert(defaults.in_flight_status);
        route
            .in_flight_retry_after
            .get_or_insert(defaults.in_flight_retry_after);
        route.on_missing_key.get_or_insert(defaults.on_missing_key);
        route
            .on_payload_mismatch
            .get_or_insert(defaults.on_payload_mismatch);
        route
    }

    /// The configuration as `check-config` prints it: inherited route fields
    /// filled in, secrets and the store password redacted.
    pub fn effective(&self) -> Config {
        let mut config = self.clone();
        config.routes = self
            .routes
            .iter()
            .map(|r| self.effective_route(r))
            .collect();
        config.store.url = crate::store::StoreUrl::redact(&config.store.url);
        config
    }
}

/// The document as a configuration. Read straight from the text, so that
/// errors carry their line, unless the document is empty or null (all
/// defaults) or shares fields through YAML merge keys (`<<: *anchor`),
/// which serde_yaml applies only to a parsed value.
fn parse_document(text: &str) -> Result<Config, Problem> {
    let error = match serde_yaml::from_str::<Config>(text) {
        Ok(config) => return Ok(config),
        Err(error) => error,
    };
    let mut merged = match serde_yaml::from_str::<serde_yaml::Value>(text) {
        // Empty, comments only, `---` or `~`.
        Ok(serde_yaml::Value::Null) => {
            return serde_yaml::from_str("{}").map_err(|e| Problem::Parse(parse_message(&e)));
        }
        // The first error, in the file's order, is the merge key's own
        // unless the file has another mistake before it.
        Ok(value) if error.to_string().contains("unknown field `<<`") => value,
        _ => return Err(Problem::Parse(parse_message(&error))),
    };
    merged
        .apply_merge()
        .map_err(|error| Problem::Parse(parse_message(&error)))?;
    // Read back from text, so that an error names the field's path; its
    // line would be that of the merged text, so it is left out.
    let merged = serde_yaml::to_string(&merged).expect("a parsed value prints");
    serde_yaml::from_str(&merged).map_err(|error| {
        let mut message = parse_message(&error);
        if let Some(at) = error.location() {
            let suffix = format!(" at line {} column {}", at.line(), at.column());
            if let Some(start) = message.rfind(&suffix) {
                message.replace_range(start..start + suffix.len(), "");
            }
        }
        Problem::Parse(format!("{message} (with merge keys applied)"))
    })
}

/// serde_yaml's message in the file's terms rather than Rust's.
fn parse_message(error: &serde_yaml::Error) -> String {
    let mut message = error.to_string();
    for (rust, plain) in [
        // Every `usize` field is a count or size that validate.rs refuses
        // at 0 too.
        ("usize", "a whole number, 1 or more"),
        ("u64", "a whole number, 0 or more"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("u16", "a whole number from 0 to 65535"),
        ("u8", "a whole number from 0 to 255"),
    ] {
        message = message.replace(&format!("expected {rust}"), &format!("expected {plain}"));
    }
    // `expected struct Name`, not `expected struct variant Enum::Name`.
    const STRUCT: &str = "expected struct ";
    if let Some(start) = message.find(STRUCT)
        && !message[start..].starts_with("expected struct variant")
    {
        let name_start = start + STRUCT.len();
        let name_end = message[name_start..]
            .find(|c: char| !c.is_alphanumeric() && c != '_')
            .map_or(message.len(), |end| name_start + end);
        message.replace_range(start..name_end, "expected a mapping of fields");
    }
    // serde_yaml leaves out a location at the very start of the file, which
    // is where an unknown first key is.
    if message.starts_with("unknown field")
        && !message.contains(" at line ")
        && let Some(location) = error.location()
    {
        let (line, column) = (location.line(), location.column());
        message.push_str(&format!(" at line {line} column {column}"));
    }
    message
}

/// Why YAML text is not a valid configuration.
#[derive(Debug)]
pub enum Problem {
    /// The YAML does not fit the schema.
    Parse(String),
    /// Values are invalid; one line each.
    Invalid(Vec<String>),
}

/// A section written empty (`store:`) or as null (`store: ~`) is the same
/// in YAML, and both mean the defaults.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// `tls`, which unlike the other sections is not taken empty for its
/// defaults: a `tls:` whose fields are commented out would otherwise serve
/// plain HTTP where TLS was meant, without a word.
fn tls_if_given<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<TlsConfig>, D::Error> {
    match Option::<TlsConfig>::deserialize(deserializer)? {
        Some(tls) => Ok(Some(tls)),
        None => Err(serde::de::Error::custom(
            "tls is empty: give cert_file and key_file, or leave tls out to serve plain HTTP",
        )),
    }
}

/// An `IP:PORT` address, refused with an example of one: a port alone or a
/// host name is the usual slip.
fn listen_address<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<SocketAddr, D::Error> {
    struct Address;
    impl serde::de::Visitor<'_> for Address {
        type Value = SocketAddr;

        fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
            formatter.write_str("an IP:PORT address such as 0.0.0.0:8080")
        }

        fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<SocketAddr, E> {
            if let Ok(port) = text.trim().parse::<u64>() {
                return self.visit_u64(port);
            }
            text.parse().map_err(|_| {
                E::custom(format!(
                    "`{text}` is not an IP:PORT address such as 0.0.0.0:8080 or [::]:8080 (an IP, not a host name, and a port from 0 to 65535)"
                ))
            })
        }

        fn visit_u64<E: serde::de::Error>(self, port: u64) -> Result<SocketAddr, E> {
            Err(E::custom(format!(
                "`{port}` is not an IP:PORT address: write 0.0.0.0:{port} to listen on every interface"
            )))
        }
    }
    deserializer.deserialize_any(Address)
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}
fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}
fn default_upstream_url() -> String {
    "http://127.0.0.1:3000".into()
}
fn default_upstream_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(2)
}
fn default_store_url() -> String {
    "sqlite://dedupe.db".into()
}
fn default_table() -> String {
    "processed_events".into()
}
fn default_lease() -> Duration {
    Duration::from_secs(5 * 60)
}
fn default_retention() -> Duration {
    Duration::from_secs(7 * 24 * 3600)
}
fn default_prune_interval() -> Duration {
    Duration::from_secs(10 * 60)
}
fn default_pool_size() -> usize {
    16
}
fn default_store_timeout() -> Duration {
    Duration::from_secs(2)
}
fn default_retry_after() -> Duration {
    Duration::from_secs(5)
}
fn default_true() -> bool {
    true
}
fn default_log_level() -> String {
    "info".into()
}
fn default_max_body_bytes() -> usize {
    1024 * 1024
}
fn default_max_buffered_body_bytes() -> usize {
    64 * 1024 * 1024
}
fn default_max_key_bytes() -> usize {
    256
}
fn default_max_concurrent_requests() -> usize {
    1024
}
fn default_read_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_shutdown_grace() -> Duration {
    Duration::from_secs(25)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, Problem> {
        Config::from_yaml(text, None)
    }

    const ROUTE: &str =
        "routes: [{ name: orders, path: /hooks/orders, key: { header: X-Event-Id } }]";

    #[test]
    fn empty_file_gives_the_documented_defaults() {
        let config = parse("").unwrap();
        assert_eq!(config.listen, "0.0.0.0:8080".parse().unwrap());
        assert_eq!(config.admin_listen, "127.0.0.1:9090".parse().unwrap());
        assert_eq!(config.upstream.url, "http://127.0.0.1:3000");
        assert_eq!(config.upstream.timeout, Duration::from_secs(30));
        assert_eq!(config.store.url, "sqlite://dedupe.db");
        assert_eq!(config.store.table, "processed_events");
        assert_eq!(config.store.lease, Duration::from_secs(300));
        assert_eq!(config.store.retention, Duration::from_secs(7 * 86400));
        assert_eq!(config.store.pool_size, 16);
        assert_eq!(config.store.on_unavailable, OnUnavailable::Reject);
        assert_eq!(config.limits.max_body_bytes, 1_048_576);
        assert_eq!(config.limits.max_key_bytes, 256);
        assert_eq!(config.limits.max_concurrent_requests, 1024);
        assert_eq!(config.shutdown_grace, Duration::from_secs(25));
        assert_eq!(config.defaults.done_on, vec![StatusMatch::Class(2)]);
        assert_eq!(config.defaults.duplicate_status, 200);
        assert_eq!(config.defaults.in_flight_status, 409);
        assert_eq!(config.unmatched, Unmatched::Forward);
    }

    fn parse_error(text: &str) -> String {
        match parse(text) {
            Err(Problem::Parse(message)) => message,
            other => panic!("{text:?} parsed: {other:?}"),
        }
    }

    #[test]
    fn parse_errors_speak_of_the_file_not_of_rust_types() {
        assert_eq!(
            parse_error("listen: 8080"),
            "listen: `8080` is not an IP:PORT address: write 0.0.0.0:8080 to listen on every interface at line 1 column 9"
        );
        assert!(parse_error("admin_listen: localhost:9090").starts_with(
            "admin_listen: `localhost:9090` is not an IP:PORT address such as 0.0.0.0:8080"
        ),);
        let upstream = parse_error("upstream: http://app:3000");
        assert!(
            upstream.contains("expected a mapping of fields at line 1"),
            "{upstream}"
        );
        let number = parse_error("limits: { max_body_bytes: lots }");
        assert!(
            number.contains("expected a whole number, 1 or more at line 1"),
            "{number}"
        );
        let pool = parse_error("store: { pool_size: -1 }");
        assert!(
            pool.starts_with(
                "store.pool_size: invalid type: integer `-1`, expected a whole number, 1 or more"
            ),
            "{pool}"
        );
        let status = parse_error("defaults: { duplicate_status: 70000 }");
        assert!(
            status.contains("expected a whole number from 0 to 65535"),
            "{status}"
        );
        assert_eq!(
            parse_error("listen: '8080'"),
            parse_error("listen: 8080"),
            "quoted or not, a port alone gets the same hint"
        );
        assert!(parse_error("listen: 0.0.0.0:99999").contains("a port from 0 to 65535"));
        let first = parse_error("lisen: 0.0.0.0:8080");
        assert!(first.ends_with(" at line 1 column 1"), "{first}");
        assert_eq!(
            parse("listen: '[::1]:8080'").unwrap().listen,
            "[::1]:8080".parse().unwrap()
        );
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_field() {
        let Err(Problem::Parse(message)) = parse("store: { urll: sqlite://x.db }") else {
            panic!("unknown key accepted");
        };
        assert!(message.contains("urll"), "{message}");
        assert!(message.contains("store"), "{message}");
        assert!(message.contains("line"), "{message}");
    }

    #[test]
    fn durations_are_human_readable() {
        let config =
            parse("store: { lease: 10m, retention: 72h }\nupstream: { timeout: 45s }").unwrap();
        assert_eq!(config.store.lease, Duration::from_secs(600));
        assert_eq!(config.store.retention, Duration::from_secs(72 * 3600));
        assert_eq!(config.upstream.timeout, Duration::from_secs(45));
    }

    #[test]
    fn done_on_takes_classes_and_codes() {
        let config = parse(&format!(
            "defaults: {{ done_on: [2xx, 410, \"409\"] }}\n{ROUTE}"
        ))
        .unwrap();
        let done_on = &config.defaults.done_on;
        assert_eq!(
            done_on,
            &[
                StatusMatch::Class(2),
                StatusMatch::Exact(410),
                StatusMatch::Exact(409)
            ]
        );
        assert!(done_on.iter().any(|m| m.matches(204)));
        assert!(done_on.iter().any(|m| m.matches(410)));
        assert!(!done_on.iter().any(|m| m.matches(500)));
        assert!(matches!(
            parse("defaults: { done_on: [6xx] }"),
            Err(Problem::Parse(_))
        ));
        assert!(matches!(
            parse("defaults: { done_on: [99] }"),
            Err(Problem::Parse(_))
        ));
        for (other, found) in [("true", "`true`"), ("[2xx]", "`- 2xx`"), ("~", "`null`")] {
            let refused = parse(&format!("defaults: {{ done_on: [{other}] }}"));
            assert!(
                matches!(&refused, Err(Problem::Parse(said))
                    if said.contains(&format!("expected a status code (200) or class (2xx), found {found}"))),
                "{other}: {refused:?}"
            );
        }
        // No claim is settled by an informational status.
        for informational in ["1xx", "100", "103"] {
            let refused = parse(&format!("defaults: {{ done_on: [\"{informational}\"] }}"));
            assert!(
                matches!(&refused, Err(Problem::Parse(said)) if said.contains("final status")),
                "{informational}: {refused:?}"
            );
        }
    }

    #[test]
    fn routes_inherit_defaults() {
        let config = parse(&format!(
            "defaults: {{ duplicate_status: 208 }}\nstore: {{ retention: 1d }}\n{ROUTE}"
        ))
        .unwrap();
        let route = config.effective_route(&config.routes[0]);
        assert_eq!(route.duplicate_status, Some(208));
        assert_eq!(route.retention, Some(Duration::from_secs(86400)));
        assert_eq!(route.methods, vec!["POST".to_string()]);
    }

    #[test]
    fn store_url_override_wins() {
        let config = Config::from_yaml(
            "store: { url: sqlite://a.db }",
            Some("sqlite://b.db".into()),
        )
        .unwrap();
        assert_eq!(config.store.url, "sqlite://b.db");
    }

    #[test]
    fn a_bad_store_url_says_whether_it_came_from_the_environment() {
        let invalid =
            |text: &str, env: Option<&str>| match Config::from_yaml(text, env.map(Into::into)) {
                Err(Problem::Invalid(problems)) => problems.join("\n"),
                other => panic!("{other:?}"),
            };
        let from_env = invalid("store: { url: sqlite://a.db }", Some("mysql://db"));
        assert!(
            from_env.starts_with(&format!("store.url (from {STORE_URL_ENV}): ")),
            "{from_env}"
        );
        let from_file = invalid("store:\n  url: mysql://db\n", None);
        assert!(from_file.starts_with("store.url (line 2): "), "{from_file}");
    }

    #[test]
    fn a_null_section_means_its_defaults() {
        for text in [
            "store: ~\nroutes: ~\nlimits: ~\ndefaults: ~\nupstream: ~",
            "store:\nroutes:\nlimits:\ndefaults:\nupstream:",
        ] {
            let config = parse(text).unwrap();
            assert_eq!(config.store.url, "sqlite://dedupe.db", "{text}");
            assert!(config.routes.is_empty());
            assert_eq!(config.limits.max_body_bytes, 1_048_576);
            assert_eq!(config.upstream.url, "http://127.0.0.1:3000");
        }
    }

    #[test]
    fn a_null_or_comment_only_file_means_the_defaults() {
        for text in ["~", "null", "# nothing set yet", "---", ""] {
            let config = parse(text).unwrap_or_else(|p| panic!("{text:?}: {p:?}"));
            assert_eq!(config.store.url, "sqlite://dedupe.db", "{text:?}");
        }
    }

    #[test]
    fn routes_may_share_fields_through_merge_keys() {
        let config = parse(
            "routes:
               - &orders { name: a, path: /a, key: { header: X-Id }, retention: 3d }
               - <<: *orders
                 name: b
                 path: /b",
        )
        .unwrap();
        let second = config.effective_route(&config.routes[1]);
        assert_eq!(
            (second.name.as_str(), second.path.as_deref()),
            ("b", Some("/b"))
        );
        assert_eq!(second.retention, Some(Duration::from_secs(3 * 86400)));
        assert_eq!(
            second.key.and_then(|key| key.header).as_deref(),
            Some("X-Id")
        );

        let merged_mistake = parse_error(
            "routes:\n  - &a { name: a, path: /a, key: { header: X } }\n  - <<: *a\n    name: b\n    bogus: 1",
        );
        assert!(
            merged_mistake.starts_with("routes[1]: unknown field `bogus`")
                && merged_mistake.ends_with("(with merge keys applied)")
                && !merged_mistake.contains("line"),
            "{merged_mistake}"
        );
        // A value spelled `<<` is a mistake of its own, not a merge key.
        let odd_value = parse_error(
            "routes:\n  - &a { name: a, path: /a, key: { header: X }, mode: '<<' }\n  - <<: *a\n    name: b",
        );
        assert!(
            odd_value.starts_with("routes[0].mode: unknown variant `<<`")
                && odd_value.contains("at line 2"),
            "{odd_value}"
        );
        // A mistake before any merge key keeps its line.
        let earlier_mistake =
            parse_error("stray: 1\nroutes:\n  - &a { name: a, path: /a }\n  - <<: *a\n    name: b");
        assert!(
            earlier_mistake.starts_with("unknown field `stray`")
                && earlier_mistake.contains("at line 1"),
            "{earlier_mistake}"
        );
    }

    #[test]
    fn methods_print_as_they_match() {
        let config =
            parse("routes: [{ name: a, path: /a, methods: [get, Post], key: { header: X-Id } }]")
                .unwrap();
        assert_eq!(config.effective().routes[0].methods, ["GET", "POST"]);
    }

    #[test]
    fn the_example_configuration_is_valid() {
        let config = parse(include_str!("../config.example.yaml")).unwrap();
        assert!(!config.routes.is_empty());
        // Printing and re-reading the effective configuration round-trips.
        let printed = serde_yaml::to_string(&config.effective()).unwrap();
        parse(&printed).unwrap();
    }
}
