//! The configuration file: serde types that are the user documentation, strict
//! parsing (unknown keys are errors), defaults, and cross-field validation that
//! reports every problem at once. Turning the validated file into runtime types
//! (compiled routes, store URLs, secrets) is done by the modules that own them.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod duration;
mod locate;

pub use duration::format as format_duration;

use crate::provider::{Handshake, Provider};
use crate::secret::SecretRef;
use crate::verify::{DEFAULT_TOLERANCE, SignatureConfig};

/// The environment variable that, when set, replaces `store.url`.
pub const STORE_URL_ENV: &str = "DEDUPE_STORE_URL";

/// The route name reserved for requests that match no route (a metrics label).
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address the webhook listener binds.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Address of the admin listener (`/metrics`, `/healthz`, `/readyz`).
    /// Loopback by default: it is not meant to be reachable by senders.
    #[serde(default = "default_admin_listen")]
    pub admin_listen: SocketAddr,
    /// Optional inbound TLS on `listen`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
    /// The application the proxy forwards to.
    #[serde(default)]
    pub upstream: UpstreamConfig,
    /// Where claims are recorded.
    #[serde(default)]
    pub store: StoreConfig,
    /// Log filter when `RUST_LOG` is not set (`info`, `debug`, or a full
    /// `tracing` filter directive).
    #[serde(default = "default_log_level")]
    pub log_level: String,
    /// Request limits.
    #[serde(default)]
    pub limits: Limits,
    /// How long in-flight requests may run after SIGTERM/SIGINT.
    #[serde(default = "default_shutdown_grace", with = "duration")]
    pub shutdown_grace: Duration,
    /// Per-route behaviour that routes inherit unless they override it.
    #[serde(default)]
    pub defaults: RouteDefaults,
    /// What to do with requests that match no route.
    #[serde(default)]
    pub unmatched: Unmatched,
    /// The webhook endpoints to deduplicate.
    #[serde(default)]
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
    /// gets 504 and the claim is settled `failed`.
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
    /// Longest time a client may take to send its request headers; slower
    /// connections are closed (slowloris protection).
    #[serde(default = "default_read_timeout", with = "duration")]
    pub header_read_timeout: Duration,
    /// Longest time a client may take to send a matched request's body;
    /// slower requests get 408.
    #[serde(default = "default_read_timeout", with = "duration")]
    pub body_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: default_max_body_bytes(),
            max_key_bytes: default_max_key_bytes(),
            max_concurrent_requests: default_max_concurrent_requests(),
            header_read_timeout: default_read_timeout(),
            body_read_timeout: default_read_timeout(),
        }
    }
}

/// Behaviour every route inherits unless it sets its own.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteDefaults {
    /// Upstream statuses that settle a claim `done`: classes (`"2xx"`) or
    /// exact codes (`410` or `"410"`). Anything else settles `failed`.
    #[serde(default = "default_done_on")]
    pub done_on: Vec<StatusMatch>,
    /// Status answered to a duplicate of a `done` key.
    #[serde(default = "default_duplicate_status")]
    pub duplicate_status: u16,
    /// Status answered while another delivery of the key is in flight; never
    /// a 2xx, so the sender keeps retrying.
    #[serde(default = "default_in_flight_status")]
    pub in_flight_status: u16,
    /// `Retry-After` sent with the in-flight answer.
    #[serde(default = "default_in_flight_retry_after", with = "duration")]
    pub in_flight_retry_after: Duration,
    /// What to do when a route needs a key and the request has none.
    #[serde(default)]
    pub on_missing_key: OnMissingKey,
    /// What to do when a key arrives again with a different body.
    #[serde(default)]
    pub on_payload_mismatch: OnPayloadMismatch,
}

impl Default for RouteDefaults {
    fn default() -> Self {
        Self {
            done_on: default_done_on(),
            duplicate_status: default_duplicate_status(),
            in_flight_status: default_in_flight_status(),
            in_flight_retry_after: default_in_flight_retry_after(),
            on_missing_key: OnMissingKey::default(),
            on_payload_mismatch: OnPayloadMismatch::default(),
        }
    }
}

/// Requests without a key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMissingKey {
    /// Answer 400.
    #[default]
    Reject,
    /// Forward without deduplication.
    Forward,
}

/// A key seen again with a different body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPayloadMismatch {
    /// Count it, log a warning, and handle the request by its key.
    #[default]
    Warn,
    /// Answer 422 and forward nothing.
    Reject,
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

/// Whether a route suppresses duplicates or only records them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Forward only won claims.
    #[default]
    Enforce,
    /// Forward every delivery, but claim and record as `enforce` would.
    Shadow,
}

/// One webhook endpoint.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Unique name; the `source` namespace of its keys and its metrics label.
    pub name: String,
    /// Exact request path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Path prefix, instead of `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Methods the route applies to.
    #[serde(default = "default_methods")]
    pub methods: Vec<String>,
    /// Where the idempotency key is; a `provider` supplies it otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeyConfig>,
    /// A provider preset (`stripe`, `github`, `standard-webhooks` or `svix`,
    /// `shopify`, `slack`): key location, signature scheme, default retention
    /// and handshakes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<Provider>,
    /// Signing secrets (`{ env: NAME }`, `{ file: PATH }`, or for local
    /// testing `{ value: … }`); a signature by any of them is accepted, so a
    /// secret can be rotated. Without secrets, signatures are not checked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SecretRef>,
    /// A custom signature scheme, for routes without a `provider`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<SignatureConfig>,
    /// How far a signed timestamp may be from the local clock, either way.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub tolerance: Option<Duration>,
    /// Keyless requests (such as endpoint validations) that are verified and
    /// forwarded without a claim: `{ json: /pointer, equals: value }`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handshakes: Vec<Handshake>,
    /// `enforce` or `shadow`.
    #[serde(default)]
    pub mode: Mode,
    /// How long this route's keys are kept (default `store.retention`).
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub retention: Option<Duration>,
    /// Overrides `defaults.done_on`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done_on: Option<Vec<StatusMatch>>,
    /// Overrides `defaults.duplicate_status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duplicate_status: Option<u16>,
    /// Overrides `defaults.in_flight_status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight_status: Option<u16>,
    /// Overrides `defaults.in_flight_retry_after`.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub in_flight_retry_after: Option<Duration>,
    /// Overrides `defaults.on_missing_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_missing_key: Option<OnMissingKey>,
    /// Overrides `defaults.on_payload_mismatch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_payload_mismatch: Option<OnPayloadMismatch>,
}

/// Where a route finds its key: exactly one of `header` or `json`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// A request header; the key is its value verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A JSON pointer (RFC 6901) into the body, e.g. `/id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<String>,
}

/// A `done_on` entry: a status class such as `2xx`, or one exact status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMatch {
    /// Every status whose first digit is this (1 to 5).
    Class(u8),
    /// One status code.
    Exact(u16),
}

impl StatusMatch {
    /// Whether `status` is covered by this entry.
    pub fn matches(self, status: u16) -> bool {
        match self {
            StatusMatch::Class(class) => status / 100 == u16::from(class),
            StatusMatch::Exact(code) => status == code,
        }
    }

    fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let class = text.strip_suffix("xx").or_else(|| text.strip_suffix("XX"));
        match class.map(str::parse::<u8>) {
            Some(Ok(digit @ 1..=5)) => Ok(StatusMatch::Class(digit)),
            Some(_) => Err(format!("`{text}` is not a status class (1xx to 5xx)")),
            None => match text.parse::<u16>() {
                Ok(code @ 100..=599) => Ok(StatusMatch::Exact(code)),
                _ => Err(format!(
                    "`{text}` is neither a status class like 2xx nor a status code 100-599"
                )),
            },
        }
    }
}

impl fmt::Display for StatusMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatusMatch::Class(digit) => write!(f, "{digit}xx"),
            StatusMatch::Exact(code) => write!(f, "{code}"),
        }
    }
}

impl<'de> Deserialize<'de> for StatusMatch {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Code(u64),
            Text(String),
        }
        let text = match Raw::deserialize(deserializer)? {
            Raw::Code(code) => code.to_string(),
            Raw::Text(text) => text,
        };
        StatusMatch::parse(&text).map_err(serde::de::Error::custom)
    }
}

impl Serialize for StatusMatch {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            StatusMatch::Class(_) => serializer.collect_str(self),
            StatusMatch::Exact(code) => serializer.serialize_u16(*code),
        }
    }
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
    /// Read every `env`/`file` secret: serving and `check-config` need them.
    Resolve,
    /// Leave them unread: commands that only work on the store never verify
    /// a signature, and an operator repairing keys should not need the
    /// webhook secrets to do it.
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
        // An empty file is a valid all-defaults configuration.
        let mut config: Config = if text.trim().is_empty() {
            serde_yaml::from_str("{}")
        } else {
            serde_yaml::from_str(text)
        }
        .map_err(|error| Problem::Parse(error.to_string()))?;
        let mut lines = locate::Lines::of(text);
        if let Some(url) = store_url {
            config.store.url = url;
            lines.not_in_file("store.url");
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

    /// Every cross-field and value problem, each naming its field.
    pub fn validate(&self) -> Vec<String> {
        self.validate_with(Secrets::Resolve)
    }

    /// [`Config::validate`], reading the routes' secrets or not.
    fn validate_with(&self, secrets: Secrets) -> Vec<String> {
        let store_url = crate::store::StoreUrl::parse(&self.store.url);
        let mut problems = Vec::new();
        self.validate_files(&mut problems);
        let mut check = |ok: bool, message: String| {
            if !ok {
                problems.push(message);
            }
        };
        check(
            self.upstream.url.starts_with("http://") || self.upstream.url.starts_with("https://"),
            format!(
                "upstream.url: `{}` must be an http:// or https:// URL",
                self.upstream.url
            ),
        );
        check(
            self.upstream
                .url
                .parse::<http::Uri>()
                .is_ok_and(|uri| uri.host().is_some()),
            format!(
                "upstream.url: `{}` is not a valid URL with a host",
                self.upstream.url
            ),
        );
        check(
            !self.upstream.timeout.is_zero(),
            "upstream.timeout: must be greater than zero".into(),
        );
        check(
            !self.upstream.connect_timeout.is_zero(),
            "upstream.connect_timeout: must be greater than zero".into(),
        );
        check(
            self.store.lease > self.upstream.timeout,
            format!(
                "store.lease: {} must exceed upstream.timeout ({}), or a slow upstream call would outlive its claim",
                duration::format(self.store.lease),
                duration::format(self.upstream.timeout)
            ),
        );
        check(
            store_url.is_ok(),
            format!(
                "store.url: {}",
                store_url.as_ref().err().cloned().unwrap_or_default()
            ),
        );
        check(
            is_table_name(&self.store.table),
            format!(
                "store.table: `{}` must be an SQL identifier (letters, digits, _; optionally schema.table)",
                self.store.table
            ),
        );
        check(
            !(self.store.table.contains('.')
                && matches!(store_url, Ok(crate::store::StoreUrl::Sqlite(_)))),
            format!(
                "store.table: `{}` is schema-qualified, which only a PostgreSQL store supports",
                self.store.table
            ),
        );
        for (field, value) in [
            (
                "limits.header_read_timeout",
                self.limits.header_read_timeout,
            ),
            ("limits.body_read_timeout", self.limits.body_read_timeout),
            ("store.retention", self.store.retention),
            ("store.prune_interval", self.store.prune_interval),
            ("store.timeout", self.store.timeout),
        ] {
            check(
                !value.is_zero(),
                format!("{field}: must be greater than zero"),
            );
        }
        check(
            self.store.pool_size > 0,
            "store.pool_size: must be at least 1".into(),
        );
        for (field, value) in [
            ("limits.max_body_bytes", self.limits.max_body_bytes),
            ("limits.max_key_bytes", self.limits.max_key_bytes),
            (
                "limits.max_concurrent_requests",
                self.limits.max_concurrent_requests,
            ),
        ] {
            check(value > 0, format!("{field}: must be at least 1"));
        }
        check(
            tracing_subscriber::EnvFilter::try_new(&self.log_level).is_ok()
                && self.log_level.split(',').all(is_level_or_target_directive),
            format!(
                "log_level: `{}` is not a log filter: use a level (trace, debug, info, warn, error, off) or `target=level` directives",
                self.log_level
            ),
        );
        check(
            !listeners_collide(self.listen, self.admin_listen),
            format!(
                "admin_listen: {} collides with listen ({}); the two listeners need different ports",
                self.admin_listen, self.listen
            ),
        );
        validate_statuses(
            "defaults",
            &self.defaults.done_on,
            self.defaults.duplicate_status,
            self.defaults.in_flight_status,
            &mut problems,
        );
        let mut names = std::collections::HashSet::new();
        for (index, route) in self.routes.iter().enumerate() {
            let at = format!("routes[{index}] ({})", route.name);
            if !names.insert(route.name.as_str()) {
                problems.push(format!("{at}.name: duplicate route name"));
            }
            self.validate_route(&at, route, secrets, &mut problems);
        }
        self.validate_route_overlap(&mut problems);
        problems
    }

    /// A route whose path (or prefix) and methods an earlier route already
    /// covers would never see a request: its keys, metrics and settings
    /// would silently go unused.
    fn validate_route_overlap(&self, problems: &mut Vec<String>) {
        let methods: Vec<std::collections::HashSet<String>> = self
            .routes
            .iter()
            .map(|route| {
                route
                    .methods
                    .iter()
                    .map(|m| m.to_ascii_uppercase())
                    .collect()
            })
            .collect();
        for (index, route) in self.routes.iter().enumerate() {
            let shadowed_by = (0..index).find(|&earlier| {
                let other = &self.routes[earlier];
                (&route.path, &route.path_prefix) == (&other.path, &other.path_prefix)
                    && !methods[index].is_disjoint(&methods[earlier])
            });
            if let Some(earlier) = shadowed_by {
                let field = if route.path.is_some() {
                    "path"
                } else {
                    "path_prefix"
                };
                problems.push(format!(
                    "routes[{index}] ({}).{field}: routes[{earlier}] ({}) already matches this {field} for some of the same methods, so this route would never be used",
                    route.name, self.routes[earlier].name
                ));
            }
        }
    }

    /// TLS material named by the configuration must load.
    fn validate_files(&self, problems: &mut Vec<String>) {
        if let Some(tls) = &self.tls {
            crate::tls::install_crypto_provider();
            if let Err(error) = crate::tls::CertificateReloader::load(&tls.cert_file, &tls.key_file)
            {
                problems.push(format!("tls: {error}"));
            }
        }
        if let Some(Err(error)) = self
            .upstream
            .ca_file
            .as_deref()
            .map(|ca_file| crate::tls::root_store(Some(ca_file)))
        {
            problems.push(format!("upstream.ca_file: {error}"));
        }
    }

    fn validate_route(
        &self,
        at: &str,
        route: &RouteConfig,
        secrets: Secrets,
        problems: &mut Vec<String>,
    ) {
        if !is_route_name(&route.name) {
            problems.push(format!(
                "{at}.name: must be 1-64 characters of letters, digits, `-`, `_` or `.`"
            ));
        }
        if route.name == UNMATCHED_ROUTE {
            problems.push(format!(
                "{at}.name: `{UNMATCHED_ROUTE}` is reserved for requests that match no route"
            ));
        }
        match (&route.path, &route.path_prefix) {
            (Some(path), None) | (None, Some(path)) if path.starts_with('/') => {}
            (Some(_), Some(_)) => {
                problems.push(format!("{at}: set either path or path_prefix, not both"))
            }
            (None, None) => problems.push(format!("{at}: needs path or path_prefix")),
            _ => problems.push(format!("{at}.path: must start with `/`")),
        }
        if route.methods.is_empty() {
            problems.push(format!("{at}.methods: must name at least one method"));
        }
        for method in &route.methods {
            if http::Method::from_bytes(method.to_ascii_uppercase().as_bytes()).is_err() {
                problems.push(format!("{at}.methods: `{method}` is not an HTTP method"));
            }
        }
        match &route.key {
            None if route.provider.is_none() => problems.push(format!(
                "{at}.key: required without a provider: `{{ header: NAME }}` or `{{ json: /pointer }}`"
            )),
            None => {}
            Some(key) => {
                if let Err(problem) = crate::key::KeySource::from_config(key) {
                    problems.push(format!("{at}.key: {problem}"));
                }
            }
        }
        match (&route.provider, &route.signature, route.secrets.is_empty()) {
            (Some(_), Some(_), _) => problems.push(format!(
                "{at}.signature: a provider brings its own signature scheme; remove one of them"
            )),
            (None, Some(_), true) => problems.push(format!(
                "{at}.secrets: a signature scheme needs at least one secret"
            )),
            (None, None, false) => problems.push(format!(
                "{at}.secrets: set a provider or a signature scheme to verify with"
            )),
            _ => {}
        }
        for (index, handshake) in route.handshakes.iter().enumerate() {
            if let Err(problem) = handshake.validate() {
                problems.push(format!("{at}.handshakes[{index}].{problem}"));
            }
        }
        if route.retention.is_some_and(|retention| retention.is_zero()) {
            problems.push(format!("{at}.retention: must be greater than zero"));
        }
        let mut effective = self.effective_route(route);
        let before = problems.len();
        validate_statuses(
            at,
            effective.done_on.as_deref().unwrap_or_default(),
            effective.duplicate_status.unwrap_or_default(),
            effective.in_flight_status.unwrap_or_default(),
            problems,
        );
        // Secrets are resolved and schemes built only for an otherwise valid
        // route, so each problem is reported once.
        if problems.len() > before {
            return;
        }
        if secrets == Secrets::Ignore {
            effective.secrets.clear();
        }
        if let Err(route_problems) = crate::route::Route::compile(&effective) {
            problems.extend(route_problems.into_iter().map(|p| format!("{at}.{p}")));
        }
    }

    /// Things that work but are probably not what the operator wants.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for (index, route) in self.routes.iter().enumerate() {
            let at = format!("routes[{index}] ({})", route.name);
            if route.secrets.iter().any(SecretRef::is_literal) {
                warnings.push(format!(
                    "{at}.secrets: a literal `value` is for local testing only; use `env` or `file`"
                ));
            }
            let Some(provider) = route.provider else {
                continue;
            };
            if route.secrets.is_empty() {
                warnings.push(format!(
                    "{at}: provider {provider} without secrets: signatures are NOT verified"
                ));
            }
            let retention = self.effective_route(route).retention.unwrap_or_default();
            if let Some(warning) = provider.retention_warning(retention) {
                warnings.push(format!("{at}.retention: {warning}"));
            }
        }
        warnings
            .into_iter()
            .map(|warning| self.lines.annotate(warning))
            .collect()
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

/// Why YAML text is not a valid configuration.
#[derive(Debug)]
pub enum Problem {
    /// The YAML does not fit the schema.
    Parse(String),
    /// Values are invalid; one line each.
    Invalid(Vec<String>),
}

fn validate_statuses(
    at: &str,
    done_on: &[StatusMatch],
    duplicate_status: u16,
    in_flight_status: u16,
    problems: &mut Vec<String>,
) {
    if done_on.is_empty() {
        problems.push(format!("{at}.done_on: must list at least one status"));
    }
    if !(200..=599).contains(&duplicate_status) {
        problems.push(format!(
            "{at}.duplicate_status: {duplicate_status} is not a final status (200-599)"
        ));
    }
    if !(300..=599).contains(&in_flight_status) {
        problems.push(format!(
            "{at}.in_flight_status: {in_flight_status} must be 300-599: a 2xx would tell the sender to stop retrying an event that may still fail"
        ));
    }
}

fn is_route_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn is_table_name(name: &str) -> bool {
    let identifier = |part: &str| {
        (1..=63).contains(&part.len())
            && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !part.as_bytes()[0].is_ascii_digit()
    };
    match name.split_once('.') {
        Some((schema, table)) => identifier(schema) && identifier(table),
        None => identifier(name),
    }
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}
/// `info` or `hyper=debug`, but not a bare word such as `verbose`, which
/// `tracing` would read as a target name and so log almost nothing.
fn is_level_or_target_directive(directive: &str) -> bool {
    let directive = directive.trim();
    directive.contains('=')
        || ["trace", "debug", "info", "warn", "error", "off"]
            .iter()
            .any(|level| directive.eq_ignore_ascii_case(level))
}

/// Whether binding both addresses must fail: the same port on the same
/// address, or on any address when either is a wildcard. Port 0 asks the
/// system for a free port, which never collides.
fn listeners_collide(listen: SocketAddr, admin: SocketAddr) -> bool {
    listen.port() != 0
        && listen.port() == admin.port()
        && (listen.ip() == admin.ip()
            || listen.ip().is_unspecified()
            || admin.ip().is_unspecified())
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
fn default_done_on() -> Vec<StatusMatch> {
    vec![StatusMatch::Class(2)]
}
fn default_duplicate_status() -> u16 {
    200
}
fn default_in_flight_status() -> u16 {
    409
}
fn default_in_flight_retry_after() -> Duration {
    Duration::from_secs(5)
}
fn default_methods() -> Vec<String> {
    vec!["POST".into()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, Problem> {
        Config::from_yaml(text, None)
    }

    fn problems(text: &str) -> Vec<String> {
        match parse(text) {
            Err(Problem::Invalid(problems)) => problems,
            other => panic!("expected validation problems, got {other:?}"),
        }
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

    #[test]
    fn a_log_level_that_is_neither_a_level_nor_a_directive_is_an_error() {
        let problems = problems("log_level: verbose");
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("log_level (line 1): `verbose`")),
            "{problems:?}"
        );
        for accepted in [
            "debug",
            "WARN",
            "info,hyper=warn",
            "dedupe_proxy::proxy=trace",
        ] {
            let config = parse(&format!("log_level: '{accepted}'"));
            assert!(config.is_ok(), "{accepted}: {config:?}");
        }
    }

    #[test]
    fn admin_listen_on_the_webhook_listeners_port_is_an_error() {
        for (listen, admin) in [
            ("127.0.0.1:8080", "127.0.0.1:8080"),
            ("0.0.0.0:8080", "127.0.0.1:8080"),
            ("127.0.0.1:9090", "[::]:9090"),
        ] {
            let problems = problems(&format!("listen: '{listen}'\nadmin_listen: '{admin}'"));
            assert!(
                problems
                    .iter()
                    .any(|p| p.starts_with("admin_listen (line 2):")),
                "{listen} {admin}: {problems:?}"
            );
        }
        for (listen, admin) in [
            ("127.0.0.1:0", "127.0.0.1:0"),
            ("127.0.0.1:8080", "127.0.0.2:8080"),
            ("0.0.0.0:8080", "127.0.0.1:9090"),
        ] {
            let config = parse(&format!("listen: '{listen}'\nadmin_listen: '{admin}'"));
            assert!(config.is_ok(), "{listen} {admin}: {config:?}");
        }
    }

    #[test]
    fn a_route_an_earlier_route_already_matches_is_an_error() {
        let problems = problems(
            "routes:
  - { name: a, path: /hooks, key: { header: X-Id } }
  - { name: b, path: /hooks, methods: [PUT, post], key: { header: X-Id } }
  - { name: c, path_prefix: /in/, key: { header: X-Id } }
  - { name: d, path_prefix: /in/, key: { header: X-Id } }",
        );
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].starts_with("routes[1] (b).path (line 3): routes[0] (a)"),
            "{problems:?}"
        );
        assert!(
            problems[1].starts_with("routes[3] (d).path_prefix (line 5): routes[2] (c)"),
            "{problems:?}"
        );
        let config = parse(
            "routes:
  - { name: a, path: /hooks, key: { header: X-Id } }
  - { name: b, path: /hooks, methods: [PUT], key: { header: X-Id } }
  - { name: c, path_prefix: /hooks, key: { header: X-Id } }",
        );
        assert!(config.is_ok(), "{config:?}");
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
    fn lease_must_exceed_upstream_timeout() {
        let problems = problems("store: { lease: 30s }\nupstream: { timeout: 30s }");
        assert!(
            problems.iter().any(|p| p.starts_with("store.lease")),
            "{problems:?}"
        );
    }

    #[test]
    fn all_problems_are_reported_together() {
        let problems = problems(
            "store: { pool_size: 0, url: mysql://x }\nlimits: { max_key_bytes: 0 }\nroutes: [{ name: a, path: nope }, { name: a, path: /b, key: { header: X } }]",
        );
        for field in [
            "store.pool_size",
            "store.url",
            "limits.max_key_bytes",
            "routes[0] (a).path",
            "routes[0] (a).key",
            "routes[1] (a).name",
        ] {
            assert!(
                problems.iter().any(|p| p.starts_with(field)),
                "{field} missing from {problems:?}"
            );
        }
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
    }

    #[test]
    fn in_flight_status_may_not_be_2xx() {
        let problems = problems(&format!("defaults: {{ in_flight_status: 202 }}\n{ROUTE}"));
        assert!(
            problems.iter().any(|p| p.contains("in_flight_status")),
            "{problems:?}"
        );
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
    fn reserved_and_invalid_names_are_rejected() {
        let problems = problems(
            "routes: [{ name: unmatched, path: /a, key: { header: X } }, { name: 'a b', path: /b, key: { header: X } }]",
        );
        assert!(
            problems.iter().any(|p| p.contains("reserved")),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("routes[1] (a b).name")),
            "{problems:?}"
        );
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
    fn provider_routes_need_no_key_and_check_their_secrets() {
        let config = parse(
            "routes: [{ name: gh, path: /gh, provider: github, secrets: [{ value: s3cret }] }]",
        )
        .unwrap();
        let route = config.effective_route(&config.routes[0]);
        assert_eq!(
            route.retention,
            Some(Duration::from_secs(8 * 86400)),
            "the preset's retention"
        );
        assert_eq!(route.tolerance, Some(DEFAULT_TOLERANCE));
        let printed = serde_yaml::to_string(&config.effective()).unwrap();
        assert!(!printed.contains("s3cret"), "{printed}");

        let missing = problems(
            "routes: [{ name: s, path: /s, provider: stripe, secrets: [{ env: DEDUPE_TEST_UNSET_SECRET_VAR }] }]",
        );
        assert!(
            missing
                .iter()
                .any(|p| p.starts_with("routes[0] (s).secrets[0]")
                    && p.contains("DEDUPE_TEST_UNSET_SECRET_VAR")),
            "{missing:?}"
        );
    }

    #[test]
    fn signature_schemes_and_secrets_must_fit_together() {
        let both = problems(
            "routes: [{ name: a, path: /a, provider: github, secrets: [{ value: x }], signature: { header: X-Sig, algorithm: hmac-sha256, encoding: hex } }]",
        );
        assert!(
            both.iter().any(|p| p.contains("brings its own")),
            "{both:?}"
        );
        let no_secret = problems(
            "routes: [{ name: a, path: /a, key: { header: X-Id }, signature: { header: X-Sig, algorithm: hmac-sha256, encoding: hex } }]",
        );
        assert!(
            no_secret
                .iter()
                .any(|p| p.contains("needs at least one secret")),
            "{no_secret:?}"
        );
        let no_scheme = problems(
            "routes: [{ name: a, path: /a, key: { header: X-Id }, secrets: [{ value: x }] }]",
        );
        assert!(
            no_scheme.iter().any(|p| p.contains("to verify with")),
            "{no_scheme:?}"
        );
        let bad_svix = problems(
            "routes: [{ name: a, path: /a, provider: svix, secrets: [{ value: 'whsec_%%%' }] }]",
        );
        assert!(
            bad_svix.iter().any(|p| p.contains("base64")),
            "{bad_svix:?}"
        );
        assert!(matches!(
            parse("routes: [{ name: a, path: /a, provider: paypal }]"),
            Err(Problem::Parse(_))
        ));
    }

    #[test]
    fn risky_but_valid_settings_are_warnings() {
        let config = parse(
            "routes:
               - { name: bare, path: /a, provider: stripe }
               - { name: literal, path: /b, provider: github, secrets: [{ value: x }] }
               - { name: short, path: /c, provider: stripe, secrets: [{ value: x }], retention: 1d }",
        )
        .unwrap();
        let warnings = config.warnings();
        assert!(
            warnings
                .iter()
                .any(|w| w.starts_with("routes[0] (bare)") && w.contains("NOT verified")),
            "{warnings:?}"
        );
        assert!(
            warnings
                .iter()
                .any(|w| w.starts_with("routes[1] (literal).secrets (line 3):")),
            "{warnings:?}"
        );
        assert!(
            warnings.iter().any(
                |w| w.starts_with("routes[2] (short).retention (line 4):") && w.contains("30d")
            ),
            "{warnings:?}"
        );
        assert!(parse(ROUTE).unwrap().warnings().is_empty());
    }

    #[test]
    fn tls_files_must_load() {
        let problems = problems(
            "tls: { cert_file: /nonexistent/tls.crt, key_file: /nonexistent/tls.key }\nupstream: { url: 'https://app:443', ca_file: /nonexistent/ca.pem }",
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("tls (line 1): /nonexistent/tls.crt")),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("upstream.ca_file (line 2): /nonexistent/ca.pem")),
            "{problems:?}"
        );
    }

    #[test]
    fn the_example_configuration_is_valid() {
        let config = parse(include_str!("../config.example.yaml")).unwrap();
        assert!(!config.routes.is_empty());
        // Printing and re-reading the effective configuration round-trips.
        let printed = serde_yaml::to_string(&config.effective()).unwrap();
        parse(&printed).unwrap();
    }

    #[test]
    fn table_names_must_be_identifiers() {
        assert!(is_table_name("processed_events"));
        assert!(is_table_name("dedupe.events"));
        assert!(!is_table_name("events; drop table x"));
        assert!(!is_table_name("1events"));
        assert!(!is_table_name(""));
    }

    #[test]
    fn only_a_postgresql_table_may_be_schema_qualified() {
        let store = |url: &str| format!("store: {{ url: '{url}', table: dedupe.events }}");
        let problems = problems(&store("sqlite:///var/lib/dedupe.db"));
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("store.table (line 1): `dedupe.events` is schema-qualified")),
            "{problems:?}"
        );
        parse(&store("postgres://db/app")).unwrap();
    }
}
