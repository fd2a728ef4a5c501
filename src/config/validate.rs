//! Validation of a parsed configuration: every value and cross-field
//! problem at once, each naming its field, and the warnings for settings that
//! work but are probably not what the operator wants. Parsing and defaults
//! are the parent module's.

use std::net::SocketAddr;
use std::time::Duration;

use super::{Config, RouteConfig, Secrets, StatusMatch, UNMATCHED_ROUTE, Unmatched, duration};
use crate::provider::Provider;
use crate::secret::SecretRef;

impl Config {
    /// Every cross-field and value problem, each naming its field.
    pub fn validate(&self) -> Vec<String> {
        self.validate_with(Secrets::Resolve)
    }

    /// [`Config::validate`], reading the routes' secrets or not.
    pub(super) fn validate_with(&self, secrets: Secrets) -> Vec<String> {
        let store_url = crate::store::StoreUrl::parse(&self.store.url);
        let mut problems = Vec::new();
        if secrets == Secrets::Resolve {
            self.validate_files(&mut problems);
        }
        let mut check = |ok: bool, message: String| {
            if !ok {
                problems.push(message);
            }
        };
        let upstream_uri = self.upstream.url.parse::<http::Uri>().ok();
        let upstream_url = crate::store::StoreUrl::redact(&self.upstream.url);
        check(
            self.upstream.url.starts_with("http://") || self.upstream.url.starts_with("https://"),
            format!("upstream.url: `{upstream_url}` must be an http:// or https:// URL"),
        );
        check(
            upstream_uri
                .as_ref()
                .is_some_and(|uri| uri.host().is_some()),
            format!("upstream.url: `{upstream_url}` is not a valid URL with a host"),
        );
        // Credentials in the URL would be printed by check-config and sent
        // nowhere: hyper's client does not turn them into an Authorization
        // field, and the sender's own is forwarded as it is.
        check(
            !upstream_uri
                .as_ref()
                .and_then(http::Uri::authority)
                .is_some_and(|authority| authority.as_str().contains('@')),
            format!(
                "upstream.url: `{upstream_url}`: credentials in the URL are not supported (the sender's Authorization field is forwarded as it is)"
            ),
        );
        // Requests keep their own query; one in the URL would be printed by
        // check-config and dropped on the way out.
        check(
            !self.upstream.url.contains(['?', '#']) || upstream_uri.is_none(),
            format!(
                "upstream.url: `{upstream_url}`: a query or fragment is not supported (each request is forwarded with its own query)"
            ),
        );
        // Shorter than any round trip: a unit mistyped (`us` for `s`) that
        // would fail every request, forget every key at once or prune
        // without a pause.
        for (field, value) in [
            ("store.retention", self.store.retention),
            ("store.prune_interval", self.store.prune_interval),
            ("upstream.timeout", self.upstream.timeout),
            ("upstream.connect_timeout", self.upstream.connect_timeout),
            (
                "limits.header_read_timeout",
                self.limits.header_read_timeout,
            ),
            ("limits.body_read_timeout", self.limits.body_read_timeout),
            ("store.timeout", self.store.timeout),
        ] {
            check(
                value >= Duration::from_millis(1),
                format!("{field}: must be at least 1ms"),
            );
        }
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
                "store.table: `{}` must be an SQL identifier of at most {MAX_TABLE_NAME_BYTES} characters (letters, digits, _; optionally schema.table)",
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
        // SQLite takes its busy timeout in milliseconds as an i32 (24.8 days);
        // a store operation allowed a day is already no timeout at all.
        check(
            self.store.timeout <= MAX_STORE_TIMEOUT,
            format!(
                "store.timeout: must be at most {}",
                duration::format(MAX_STORE_TIMEOUT)
            ),
        );
        check(
            self.limits.max_concurrent_requests <= tokio::sync::Semaphore::MAX_PERMITS,
            format!(
                "limits.max_concurrent_requests: must be at most {}",
                tokio::sync::Semaphore::MAX_PERMITS
            ),
        );
        check(
            self.limits.max_buffered_body_bytes >= self.limits.max_body_bytes
                && self.limits.max_buffered_body_bytes <= tokio::sync::Semaphore::MAX_PERMITS,
            format!(
                "limits.max_buffered_body_bytes: must be at least limits.max_body_bytes ({}), and at most {}",
                self.limits.max_body_bytes,
                tokio::sync::Semaphore::MAX_PERMITS
            ),
        );
        check(
            self.limits.max_key_bytes <= MAX_KEY_BYTES_CEILING,
            format!("limits.max_key_bytes: must be at most {MAX_KEY_BYTES_CEILING}"),
        );
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
        let log_filter = crate::telemetry::log_filter(&self.log_level);
        check(
            log_filter.is_ok(),
            format!("log_level: {}", log_filter.err().unwrap_or_default()),
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
            Some(&self.defaults.done_on),
            Some(self.defaults.duplicate_status),
            Some(self.defaults.in_flight_status),
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

    /// TLS material named by the configuration must load: serving reads it.
    /// So must the roots an `https://` upstream is verified against, the
    /// system's included.
    fn validate_files(&self, problems: &mut Vec<String>) {
        crate::tls::install_crypto_provider();
        if let Some(tls) = &self.tls
            && let Err(error) = crate::tls::CertificateReloader::load(&tls.cert_file, &tls.key_file)
        {
            problems.push(error.to_string());
        }
        // Lower case only: the URL's own check refuses any other.
        let https = self.upstream.url.starts_with("https://");
        if (https || self.upstream.ca_file.is_some())
            && let Err(error) = crate::tls::client_config(self.upstream.ca_file.as_deref())
        {
            problems.push(error.to_string());
        }
    }

    fn validate_route(
        &self,
        at: &str,
        route: &RouteConfig,
        secrets: Secrets,
        problems: &mut Vec<String>,
    ) {
        let before_route = problems.len();
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
            (Some(path), None) => check_route_path(&format!("{at}.path"), path, problems),
            (None, Some(prefix)) => {
                check_route_path(&format!("{at}.path_prefix"), prefix, problems)
            }
            (Some(_), Some(_)) => {
                problems.push(format!("{at}: set either path or path_prefix, not both"))
            }
            (None, None) => problems.push(format!("{at}: needs path or path_prefix")),
        }
        if route.methods.is_empty() {
            problems.push(format!("{at}.methods: must name at least one method"));
        }
        for method in &route.methods {
            // `*` is a token, so a method by HTTP's grammar, but no sender
            // uses it: written as a wildcard, it would match nothing.
            if method == "*" {
                problems.push(format!(
                    "{at}.methods: `*` is not a wildcard: list the methods, e.g. [POST, PUT]"
                ));
            } else if http::Method::from_bytes(method.to_ascii_uppercase().as_bytes()).is_err() {
                problems.push(format!("{at}.methods: `{method}` is not an HTTP method"));
            }
        }
        match &route.key {
            None if route
                .provider
                .is_none_or(|provider| provider.preset().key.is_none()) =>
            {
                problems.push(format!(
                    "{at}.{}",
                    crate::route::missing_key(route.provider)
                ));
            }
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
        if route
            .retention
            .is_some_and(|retention| retention < Duration::from_millis(1))
        {
            problems.push(format!("{at}.retention: must be at least 1ms"));
        }
        // A timestamp is in seconds: no tolerance would refuse a signature
        // made a second before it arrived.
        if route
            .tolerance
            .is_some_and(|tolerance| tolerance < Duration::from_secs(1))
        {
            problems.push(format!("{at}.tolerance: must be at least 1s"));
        }
        // What the route inherits was checked once, under `defaults`.
        validate_statuses(
            at,
            route.done_on.as_deref(),
            route.duplicate_status,
            route.in_flight_status,
            problems,
        );
        let mut effective = self.effective_route(route);
        // Secrets are resolved and schemes built only for a route found valid
        // so far, what it inherits included: compiling trusts what was
        // checked above, and would report a bad key or status again.
        let mut inherited = Vec::new();
        validate_statuses(
            at,
            effective.done_on.as_deref(),
            effective.duplicate_status,
            effective.in_flight_status,
            &mut inherited,
        );
        if problems.len() > before_route || !inherited.is_empty() {
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
        if self.routes.is_empty() {
            warnings.push(match self.unmatched {
                Unmatched::Forward => "routes: none configured, so every request is forwarded to the upstream unverified and not deduplicated",
                Unmatched::Reject => "routes: none configured, so every request is answered 404 (unmatched: reject)",
            }.to_owned());
        }
        // A claim is forwarded only while its lease has upstream.timeout
        // left; one that took longer than the rest of the lease is released.
        let margin = self.store.lease.saturating_sub(self.upstream.timeout);
        if !margin.is_zero() && margin < self.store.timeout {
            warnings.push(format!(
                "store.lease: {} leaves {} beyond upstream.timeout ({}), less than store.timeout ({}): a claim slower than that is released and answered 503; give it at least upstream.timeout + store.timeout",
                duration::format(self.store.lease),
                duration::format(margin),
                duration::format(self.upstream.timeout),
                duration::format(self.store.timeout),
            ));
        }
        for (index, route) in self.routes.iter().enumerate() {
            let at = format!("routes[{index}] ({})", route.name);
            let path = match (&route.path, &route.path_prefix) {
                (Some(path), _) => Some(("path", path)),
                (None, Some(prefix)) => Some(("path_prefix", prefix)),
                (None, None) => None,
            };
            if let Some((field, path)) = path
                && let Some(doubt) = route_path_doubt(path)
            {
                warnings.push(format!("{at}.{field}: {doubt}"));
            }
            if route.secrets.iter().any(SecretRef::is_literal) {
                warnings.push(format!(
                    "{at}.secrets: a literal `value` is for local testing only; use `env` or `file`"
                ));
            }
            let timestamped = crate::route::signature_scheme(route)
                .ok()
                .flatten()
                .is_some_and(|scheme| scheme.signs_a_timestamp());
            // The default is left alone: `check-config` prints it on every
            // route, and its output must check clean.
            if route
                .tolerance
                .is_some_and(|set| set != crate::verify::DEFAULT_TOLERANCE)
                && !timestamped
            {
                warnings.push(format!(
                    "{at}.tolerance: has no effect: this route's signature carries no timestamp"
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
            if provider == Provider::Stripe {
                for (index, secret) in route.secrets.iter().enumerate() {
                    // An unresolvable secret is an error reported elsewhere.
                    if let Ok(secret) = secret.resolve()
                        && !secret.expose().starts_with(b"whsec_")
                    {
                        warnings.push(format!(
                            "{at}.secrets[{index}]: does not start with `whsec_`: Stripe signs with the endpoint's signing secret (whsec_...), so no delivery verifies with this one, and without another secret every delivery is answered 401"
                        ));
                    }
                }
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
}

/// Checks the statuses that are set.
fn validate_statuses(
    at: &str,
    done_on: Option<&[StatusMatch]>,
    duplicate_status: Option<u16>,
    in_flight_status: Option<u16>,
    problems: &mut Vec<String>,
) {
    if done_on.is_some_and(<[StatusMatch]>::is_empty) {
        problems.push(format!("{at}.done_on: must list at least one status"));
    }
    if let Some(duplicate_status) = duplicate_status
        && !(200..=599).contains(&duplicate_status)
    {
        problems.push(format!(
            "{at}.duplicate_status: {duplicate_status} is not a final status (200-599)"
        ));
    }
    match in_flight_status {
        Some(status @ 200..=299) => problems.push(format!(
            "{at}.in_flight_status: {status} must be 300-599: a 2xx would tell the sender to stop retrying an event that may still fail"
        )),
        Some(status) if !(300..=599).contains(&status) => problems.push(format!(
            "{at}.in_flight_status: {status} must be 300-599: a final status, and not a 2xx"
        )),
        _ => {}
    }
}

/// Routes match a request's path byte for byte, as the sender wrote it: a
/// path no request line can hold (a query or fragment, a space or a control
/// character) would never match, and its webhooks would go through
/// unmatched, unverified.
fn check_route_path(at: &str, path: &str, problems: &mut Vec<String>) {
    let problem = if !path.starts_with('/') {
        "must start with `/`".to_owned()
    } else if let Some(at) = path.find(['?', '#']) {
        format!(
            "`{path}`: a path holds no `{}`: routes match the path alone",
            &path[at..=at]
        )
    } else if let Some(found) = path.chars().find(|c| c.is_whitespace() || c.is_control()) {
        format!(
            "`{path}`: `{}` cannot stand in a request's path (percent-encode it)",
            found.escape_default()
        )
    } else {
        return;
    };
    problems.push(format!("{at}: {problem}"));
}

/// What a route's path holds that a sender may well not send as written,
/// since routes match byte for byte: `*` (taken literally, not as a
/// wildcard), letters outside ASCII and other characters RFC 3986 has
/// senders percent-encode, or a `%` that starts no escape.
fn route_path_doubt(path: &str) -> Option<String> {
    if path.contains('*') {
        return Some(format!(
            "`{path}`: `*` is matched as written, not as a wildcard (path_prefix matches everything under a path)"
        ));
    }
    let encoded_as_senders_would =
        path.bytes().any(|byte| !is_path_byte(byte)) || !percent_escapes_are_whole(path);
    encoded_as_senders_would.then(|| {
        let encoded = percent_encoding::utf8_percent_encode(path, PATH_ESCAPES).to_string();
        format!(
            "`{path}` is matched byte for byte, and most senders percent-encode such characters (`{encoded}`): give the route the path as senders send it"
        )
    })
}

/// What senders percent-encode in a path: all but RFC 3986's unreserved
/// characters, sub-delims, `:`, `@` and `/`.
const PATH_ESCAPES: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'!')
    .remove(b'$')
    .remove(b'&')
    .remove(b'\'')
    .remove(b'(')
    .remove(b')')
    .remove(b'*')
    .remove(b'+')
    .remove(b',')
    .remove(b';')
    .remove(b'=')
    .remove(b':')
    .remove(b'@')
    .remove(b'/');

/// A byte RFC 3986 allows in a path: unreserved, sub-delims, `:`, `@`, `/`
/// and the `%` of an escape.
fn is_path_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/%".contains(&byte)
}

fn percent_escapes_are_whole(path: &str) -> bool {
    let bytes = path.as_bytes();
    bytes.iter().enumerate().all(|(at, &byte)| {
        byte != b'%'
            || bytes
                .get(at + 1..at + 3)
                .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    })
}

fn is_route_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The longest key a claim can store: PostgreSQL's primary key index takes
/// entries of at most a third of a page (2,704 bytes), and a key of this
/// length with a route name of 64 bytes stays under it, compressible or not.
const MAX_KEY_BYTES_CEILING: usize = 2048;

const MAX_STORE_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// So that the table's index is named `<table>_received_at_idx` in full, as
/// the schema has it: PostgreSQL truncates names past 63 bytes.
const MAX_TABLE_NAME_BYTES: usize = 63 - "_received_at_idx".len();

fn is_table_name(name: &str) -> bool {
    let identifier = |part: &str, max: usize| {
        (1..=max).contains(&part.len())
            && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !part.as_bytes()[0].is_ascii_digit()
    };
    match name.split_once('.') {
        Some((schema, table)) => identifier(schema, 63) && identifier(table, MAX_TABLE_NAME_BYTES),
        None => identifier(name, MAX_TABLE_NAME_BYTES),
    }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::Problem;
    use crate::verify::DEFAULT_TOLERANCE;

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

    /// A timeout shorter than any round trip is a mistyped unit, and would
    /// fail every request; a retention that short forgets every key at
    /// once, and a prune interval that short prunes without a pause.
    #[test]
    fn timeouts_retentions_and_the_prune_interval_are_at_least_a_millisecond() {
        let timeouts = "upstream: { timeout: 500us, connect_timeout: 0s }\nlimits: { header_read_timeout: 999us, body_read_timeout: 0ms }\nstore: { timeout: 1us, retention: 1us, prune_interval: 0s }\nroutes: [{ name: orders, path: /hooks/orders, key: { header: X-Event-Id }, retention: 999us }]\n";
        let found = problems(timeouts);
        for field in [
            "routes[0] (orders).retention",
            "store.retention",
            "store.prune_interval",
            "upstream.timeout",
            "upstream.connect_timeout",
            "limits.header_read_timeout",
            "limits.body_read_timeout",
            "store.timeout",
        ] {
            assert!(
                found.iter().any(|problem| problem.starts_with(field)
                    && problem.ends_with("must be at least 1ms")),
                "{field}: {found:?}"
            );
        }
        let shortest = "upstream: { timeout: 1ms, connect_timeout: 1ms }\nlimits: { header_read_timeout: 1ms, body_read_timeout: 1ms }\nstore: { timeout: 1ms, lease: 1s, retention: 1ms, prune_interval: 1ms }\nroutes: [{ name: orders, path: /hooks/orders, key: { header: X-Event-Id }, retention: 1ms }]\n";
        parse(shortest).unwrap();
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
    fn a_bad_default_is_reported_once_under_defaults_and_a_routes_own_under_it() {
        let found = problems(&format!(
            "defaults: {{ duplicate_status: 199, done_on: [] }}\n{ROUTE}"
        ));
        assert_eq!(
            found,
            [
                "defaults.done_on (line 1): must list at least one status",
                "defaults.duplicate_status (line 1): 199 is not a final status (200-599)",
            ]
        );
        let found = problems(
            "routes: [{ name: orders, path: /o, key: { header: X }, in_flight_status: 200 }]",
        );
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("routes[0] (orders).in_flight_status (line 1): 200 must be"),
            "{found:?}"
        );
    }

    #[test]
    fn a_secret_is_named_by_its_index_as_written() {
        let found = problems(
            "routes: [{ name: s, path: /s, provider: standard-webhooks, secrets: [{ value: whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw }, { value: 'whsec_%%%' }] }]",
        );
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("routes[0] (s).secrets[1]") && found[0].contains("not base64"),
            "{found:?}"
        );
    }

    #[test]
    fn a_configuration_without_routes_is_valid_and_warned_about() {
        for text in ["", "listen: 127.0.0.1:8080"] {
            let warnings = parse(text).expect("valid").warnings();
            assert!(
                warnings
                    .iter()
                    .any(|w| w.starts_with("routes: none configured")),
                "{text:?}: {warnings:?}"
            );
        }
        let rejecting = parse("unmatched: reject").expect("valid").warnings();
        assert_eq!(
            rejecting,
            ["routes: none configured, so every request is answered 404 (unmatched: reject)"]
        );
        let routed = parse(ROUTE).expect("valid").warnings();
        assert!(routed.is_empty(), "{routed:?}");
    }

    #[test]
    fn a_route_without_a_path_or_with_a_bad_method_is_an_error_not_a_crash() {
        let found = problems("routes:\n  - { name: a, key: { header: X } }");
        assert_eq!(found, ["routes[0] (a) (line 2): needs path or path_prefix"]);
        for (field, path, said) in [
            ("path", "hooks", "must start with `/`"),
            ("path_prefix", "hooks/", "must start with `/`"),
            (
                "path",
                "/hooks/q?x=1",
                "`/hooks/q?x=1`: a path holds no `?`: routes match the path alone",
            ),
            (
                "path",
                "/hooks#a",
                "`/hooks#a`: a path holds no `#`: routes match the path alone",
            ),
            (
                "path",
                "/hooks/a b",
                "`/hooks/a b`: ` ` cannot stand in a request's path (percent-encode it)",
            ),
            (
                "path",
                "/hooks/a\tb",
                "`/hooks/a\tb`: `\\t` cannot stand in a request's path (percent-encode it)",
            ),
        ] {
            let found = problems(&format!(
                "routes: [{{ name: a, {field}: \"{path}\", key: {{ header: X }} }}]"
            ));
            assert_eq!(
                found,
                [format!("routes[0] (a).{field} (line 1): {said}")],
                "{path}"
            );
        }
        // Such paths can match a sender that sends them raw: warned about.
        for (field, path, said) in [
            (
                "path_prefix",
                "/hooks/*",
                "`/hooks/*`: `*` is matched as written, not as a wildcard (path_prefix matches everything under a path)",
            ),
            (
                "path",
                "/hooks/café",
                "`/hooks/café` is matched byte for byte, and most senders percent-encode such characters (`/hooks/caf%C3%A9`): give the route the path as senders send it",
            ),
            (
                "path",
                "/hooks/{id}",
                "`/hooks/{id}` is matched byte for byte, and most senders percent-encode such characters (`/hooks/%7Bid%7D`): give the route the path as senders send it",
            ),
            (
                "path",
                "/hooks/100%",
                "`/hooks/100%` is matched byte for byte, and most senders percent-encode such characters (`/hooks/100%25`): give the route the path as senders send it",
            ),
        ] {
            let config = parse(&format!(
                "routes: [{{ name: a, {field}: \"{path}\", key: {{ header: X }} }}]"
            ))
            .expect("valid");
            assert_eq!(
                config.warnings(),
                [format!("routes[0] (a).{field} (line 1): {said}")],
                "{path}"
            );
        }
        for path in ["/hooks/caf%C3%A9", "/a-b_c.d~e!$&'()+,;=:@/x", "/"] {
            let config = parse(&format!(
                "routes: [{{ name: a, path: \"{path}\", key: {{ header: X }} }}]"
            ))
            .expect("valid");
            assert!(
                config.warnings().is_empty(),
                "{path}: {:?}",
                config.warnings()
            );
        }
        let wildcard =
            problems("routes: [{ name: a, path: /a, key: { header: X }, methods: ['*'] }]");
        assert_eq!(
            wildcard,
            [
                "routes[0] (a).methods (line 1): `*` is not a wildcard: list the methods, e.g. [POST, PUT]"
            ]
        );
        let instant =
            problems("routes: [{ name: a, path: /a, key: { header: X }, tolerance: 0s }]");
        assert_eq!(
            instant,
            ["routes[0] (a).tolerance (line 1): must be at least 1s"]
        );
        for method in ["B@D", "GET POST"] {
            let found = problems(&format!(
                "routes: [{{ name: a, path: /a, key: {{ header: X }}, methods: ['{method}'] }}]"
            ));
            assert_eq!(
                found,
                [format!(
                    "routes[0] (a).methods (line 1): `{method}` is not an HTTP method"
                )]
            );
        }
    }

    #[test]
    fn a_store_timeout_or_concurrency_limit_past_what_the_runtime_takes_is_an_error() {
        let found = problems(&format!("store: {{ timeout: 25d }}\n{ROUTE}"));
        assert!(
            found
                .iter()
                .any(|p| p.starts_with("store.timeout (line 1): must be at most 1d")),
            "{found:?}"
        );
        assert!(parse(&format!("store: {{ timeout: 24h }}\n{ROUTE}")).is_ok());
        let found = problems(&format!(
            "limits: {{ max_concurrent_requests: 18446744073709551615 }}\n{ROUTE}"
        ));
        assert!(
            found
                .iter()
                .any(|p| p.starts_with("limits.max_concurrent_requests (line 1): must be at most")),
            "{found:?}"
        );
        let found = problems(&format!("limits: {{ max_key_bytes: 2049 }}\n{ROUTE}"));
        assert!(
            found
                .iter()
                .any(|p| p == "limits.max_key_bytes (line 1): must be at most 2048"),
            "{found:?}"
        );
        assert!(parse(&format!("limits: {{ max_key_bytes: 2048 }}\n{ROUTE}")).is_ok());
        let found = problems(&format!(
            "limits: {{ max_body_bytes: 2000, max_buffered_body_bytes: 1999 }}\n{ROUTE}"
        ));
        assert!(
            found.iter().any(|p| p.starts_with(
                "limits.max_buffered_body_bytes (line 1): must be at least limits.max_body_bytes (2000)"
            )),
            "{found:?}"
        );
        assert!(
            parse(&format!(
                "limits: {{ max_body_bytes: 2000, max_buffered_body_bytes: 2000 }}\n{ROUTE}"
            ))
            .is_ok()
        );
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
    fn credentials_in_the_upstream_url_are_refused_without_printing_the_password() {
        let problems = problems("upstream: { url: 'http://app:s3cret@127.0.0.1:3000' }");
        assert!(
            problems.iter().any(|problem| problem.starts_with(
                "upstream.url (line 1): `http://app:REDACTED@127.0.0.1:3000`: credentials in the URL are not supported"
            )),
            "{problems:?}"
        );
        assert!(
            problems.iter().all(|problem| !problem.contains("s3cret")),
            "{problems:?}"
        );
    }

    #[test]
    fn a_query_in_the_upstream_url_is_refused() {
        for url in [
            "http://127.0.0.1:3000/base?token=abc",
            "http://127.0.0.1:3000/#top",
        ] {
            let found = problems(&format!("upstream: {{ url: '{url}' }}\n{ROUTE}"));
            assert_eq!(
                found,
                [format!(
                    "upstream.url (line 1): `{url}`: a query or fragment is not supported (each request is forwarded with its own query)"
                )]
            );
        }
        let config = parse(&format!(
            "upstream: {{ url: 'http://127.0.0.1:3000/base/' }}\n{ROUTE}"
        ));
        assert!(config.is_ok(), "{config:?}");
    }

    #[test]
    fn durations_in_months_or_of_millennia_are_refused() {
        for (text, said) in [
            ("store:\n  lease: 5M\n", "`M` is months"),
            ("store:\n  lease: 999999999d\n", "longer than 36500d"),
            (
                "routes: [{ name: a, path: /a, key: { header: X }, retention: 40000d }]",
                "longer than 36500d",
            ),
        ] {
            match parse(text) {
                Err(Problem::Parse(problem)) => assert!(
                    (problem.contains("store.lease") || problem.contains("retention"))
                        && problem.contains(said),
                    "{problem}"
                ),
                other => panic!("expected a parse problem, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_lease_barely_over_the_upstream_timeout_is_a_warning() {
        let tight =
            parse("store: { lease: 1001ms, timeout: 2s }\nupstream: { timeout: 1s }").unwrap();
        let warnings = tight.warnings();
        assert!(
            warnings.iter().any(|w| w.starts_with("store.lease")
                && w.contains(
                    "leaves 1ms beyond upstream.timeout (1s), less than store.timeout (2s)"
                )),
            "{warnings:?}"
        );
        let roomy = parse("store: { lease: 3s, timeout: 2s }\nupstream: { timeout: 1s }").unwrap();
        assert!(
            roomy
                .warnings()
                .iter()
                .all(|w| !w.starts_with("store.lease"))
        );
        assert!(
            parse("")
                .unwrap()
                .warnings()
                .iter()
                .all(|w| !w.starts_with("store.lease"))
        );
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
    fn a_bad_key_is_reported_once() {
        for route in [
            "{ name: a, path: /a }",
            "{ name: a, path: /a, key: { json: no-slash } }",
            "{ name: a, path: /a, key: { header: 'bad name' } }",
        ] {
            let problems = problems(&format!("routes: [{route}]"));
            assert_eq!(problems.len(), 1, "{route}: {problems:?}");
            assert!(problems[0].starts_with("routes[0] (a).key"), "{problems:?}");
        }
    }

    #[test]
    fn in_flight_status_may_not_be_2xx() {
        let problems = problems(&format!("defaults: {{ in_flight_status: 202 }}\n{ROUTE}"));
        assert!(
            problems
                .iter()
                .any(|p| p.contains("in_flight_status") && p.contains("a 2xx would tell")),
            "{problems:?}"
        );
        for status in [100, 600] {
            let found = self::problems(&format!(
                "defaults: {{ in_flight_status: {status} }}\n{ROUTE}"
            ));
            assert!(
                found
                    .iter()
                    .any(|p| p.contains("in_flight_status") && p.contains("not a 2xx")),
                "{found:?}"
            );
        }
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
    fn a_zoom_route_names_its_key() {
        let keyless = problems(
            "routes: [{ name: zoom, path: /z, provider: zoom, secrets: [{ value: token }] }]",
        );
        assert!(
            keyless
                .iter()
                .any(|p| p.starts_with("routes[0] (zoom).key") && p.contains("sends no event id")),
            "{keyless:?}"
        );
        let config = parse(
            "routes: [{ name: zoom, path: /z, provider: zoom, key: { json: /payload/object/uuid }, secrets: [{ value: token }] }]",
        )
        .unwrap();
        let route = crate::route::Route::compile(&config.effective_route(&config.routes[0]));
        assert!(route.is_ok());
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
               - { name: short, path: /c, provider: stripe, secrets: [{ value: x }], retention: 1d }
               - { name: untimed, path: /d, provider: github, secrets: [{ env: HOME }], tolerance: 1m }
               - { name: plain, path: /e, key: { header: X-Id }, tolerance: 1m }
               - { name: timed, path: /f, provider: slack, secrets: [{ env: HOME }], tolerance: 1m }
               - { name: printed, path: /g, key: { header: X-Id }, tolerance: 5m }
               - { name: keyed, path: /h, provider: stripe, secrets: [{ value: whsec_x }, { value: sk_live_x }] }",
        )
        .unwrap();
        let warnings = config.warnings();
        let not_signing: Vec<_> = warnings
            .iter()
            .filter(|w| w.contains("does not start with `whsec_`"))
            .collect();
        assert!(
            not_signing.len() == 2
                && not_signing[0].starts_with("routes[2] (short).secrets[0] (line 4):")
                && not_signing[1].starts_with("routes[7] (keyed).secrets[1] (line 9):"),
            "{warnings:?}"
        );
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
        let no_effect: Vec<_> = warnings
            .iter()
            .filter(|w| w.contains(".tolerance") && w.contains("no timestamp"))
            .collect();
        assert!(
            no_effect.len() == 2
                && no_effect[0].starts_with("routes[3] (untimed).tolerance (line 5):")
                && no_effect[1].starts_with("routes[4] (plain).tolerance (line 6):"),
            "{warnings:?}"
        );
        assert!(parse(ROUTE).unwrap().warnings().is_empty());
    }

    #[test]
    fn tls_files_must_load_to_serve() {
        const MISSING_FILES: &str = "tls: { cert_file: /nonexistent/tls.crt, key_file: /nonexistent/tls.key }\nupstream: { url: 'https://app:443', ca_file: /nonexistent/ca.pem }";
        let problems = problems(MISSING_FILES);
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("tls.cert_file (line 1): /nonexistent/tls.crt")),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("upstream.ca_file (line 2): /nonexistent/ca.pem")),
            "{problems:?}"
        );
        assert!(
            Config::from_yaml_with(MISSING_FILES, None, Secrets::Ignore).is_ok(),
            "the store's commands do not read them"
        );
    }

    /// Each unusable file is named by its field, and says what is wrong
    /// with it in the operator's terms.
    #[test]
    fn unusable_tls_files_say_why() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, content: &[u8]| {
            let path = dir.path().join(name);
            std::fs::write(&path, content).unwrap();
            path.display().to_string()
        };
        let (first, second) = (
            rcgen::KeyPair::generate().unwrap(),
            rcgen::KeyPair::generate().unwrap(),
        );
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&first)
            .unwrap();
        let cert_pem = file("tls.crt", cert.pem().as_bytes());
        let cert_der = file("tls.der", cert.der());
        let other_key = file("other.key", second.serialize_pem().as_bytes());
        let encrypted = file(
            "encrypted.key",
            b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n",
        );
        let key_der = file("key.der", &first.serialize_der());
        for (cert, key, field, reason) in [
            (
                &cert_pem,
                &other_key,
                "tls.cert_file and tls.key_file",
                "the key is not the certificate's",
            ),
            (
                &cert_pem,
                &encrypted,
                "tls.key_file (line 1): ",
                "the private key is encrypted",
            ),
            (
                &cert_pem,
                &key_der,
                "tls.key_file (line 1): ",
                "no PEM private key",
            ),
            (
                &cert_der,
                &other_key,
                "tls.cert_file (line 1): ",
                "no PEM certificate",
            ),
        ] {
            let found = problems(&format!(
                "tls: {{ cert_file: '{cert}', key_file: '{key}' }}\n"
            ));
            assert!(
                found[0].starts_with(field) && found[0].contains(reason),
                "{found:?}"
            );
        }
    }

    /// A `tls:` whose fields are commented out is not taken for no TLS.
    #[test]
    fn an_empty_tls_section_is_an_error() {
        let error = parse("tls:\n  # cert_file: /etc/tls/tls.crt\n").unwrap_err();
        assert!(
            matches!(&error, Problem::Parse(text) if text.contains("tls is empty: give cert_file and key_file")),
            "{error:?}"
        );
    }

    #[test]
    fn table_names_must_be_identifiers() {
        assert!(is_table_name("processed_events"));
        assert!(is_table_name("dedupe.events"));
        assert!(!is_table_name("events; drop table x"));
        assert!(!is_table_name("1events"));
        assert!(!is_table_name(""));
        let longest = "t".repeat(MAX_TABLE_NAME_BYTES);
        assert!(is_table_name(&longest));
        assert!(is_table_name(&format!("{}.{longest}", "s".repeat(63))));
        assert!(
            !is_table_name(&format!("{longest}t")),
            "its index name would be cut"
        );
        assert!(!is_table_name(&format!("s.{longest}t")));
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
