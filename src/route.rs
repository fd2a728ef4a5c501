//! Routes compiled from the configuration, and matching a request to one.
//! A route carries everything the request flow needs to decide (key source,
//! status policy, mode); signature schemes slot in beside the key source.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, StatusCode};

use crate::config::{Config, Mode, OnMissingKey, OnPayloadMismatch, RouteConfig, StatusMatch};
use crate::key::KeySource;
use crate::provider::{self, Handshake, Provider};
use crate::store::Claim;
use crate::verify::{BodyHmac, Scheme, Verifier};

/// One webhook endpoint, validated.
#[derive(Debug)]
pub struct Route {
    /// The route's name: store namespace and metrics label.
    pub name: Arc<str>,
    path: PathMatch,
    methods: Vec<Method>,
    /// Where the key is.
    pub key: KeySource,
    /// The signature check, when the route has secrets.
    pub verifier: Option<Verifier>,
    /// Keyless requests forwarded without a claim once verified.
    pub handshakes: Vec<Handshake>,
    /// Whether verified form-encoded requests are keyless too (Slack's).
    pub keyless_forms: bool,
    /// `enforce` or `shadow`.
    pub mode: Mode,
    /// Statuses that settle `done`.
    pub done_on: Vec<StatusMatch>,
    /// Answer to a duplicate of a `done` key.
    pub duplicate_status: StatusCode,
    /// Answer while another delivery holds the key.
    pub in_flight_status: StatusCode,
    /// `Retry-After` with the in-flight answer.
    pub in_flight_retry_after: Duration,
    /// Requests without a key.
    pub on_missing_key: OnMissingKey,
    /// Keys seen again with another body.
    pub on_payload_mismatch: OnPayloadMismatch,
    /// How long keys are kept.
    pub retention: Duration,
}

/// A route's `path` or `path_prefix`.
#[derive(Debug)]
struct PathMatch {
    path: String,
    prefix: bool,
    /// The path as [`canonical_form`] reads it.
    canonical: Vec<u8>,
}

impl PathMatch {
    fn new(path: &str, prefix: bool) -> Self {
        Self {
            path: path.to_owned(),
            prefix,
            canonical: canonical_form(path).into_owned(),
        }
    }

    fn matches(&self, path: &str) -> bool {
        if !self.prefix {
            return path == self.path;
        }
        path.strip_prefix(self.path.as_str()).is_some_and(|rest| {
            rest.is_empty() || self.path.ends_with('/') || rest.starts_with('/')
        })
    }

    /// [`PathMatch::matches`], on paths in their canonical form.
    fn matches_canonical(&self, canonical: &[u8]) -> bool {
        if !self.prefix {
            return canonical == self.canonical;
        }
        canonical
            .strip_prefix(self.canonical.as_slice())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(b"/"))
    }
}

/// A path as web frameworks commonly read it before routing (see
/// [`canonical_path`]), borrowed when it is already in that form, as nearly
/// every path is.
fn canonical_form(path: &str) -> Cow<'_, [u8]> {
    if is_canonical(path) {
        Cow::Borrowed(path.as_bytes())
    } else {
        Cow::Owned(canonical_path(path))
    }
}

/// Whether [`canonical_path`] would return `path` unchanged: no escapes,
/// parameters, backslashes or capitals, no empty or dot-led segments, no
/// trailing slash.
fn is_canonical(path: &str) -> bool {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') || bytes.ends_with(b"/") {
        return false;
    }
    let mut previous = 0;
    for &byte in bytes {
        match byte {
            b'%' | b';' | b'\\' | b'A'..=b'Z' => return false,
            b'/' | b'.' if previous == b'/' => return false,
            _ => {}
        }
        previous = byte;
    }
    true
}

/// A path as web frameworks commonly read it before routing: percent-decoded
/// (`%2F` included), `\` taken for `/`, `;` parameters (`/a;v=1`), each
/// segment trimmed of spaces and control characters (as Spring's
/// `AntPathMatcher` did before 4.3.1, and Windows does with file names),
/// empty and `.` segments dropped, `..` applied, ASCII letters lower-cased,
/// with no trailing slash (the root is empty).
fn canonical_path(path: &str) -> Vec<u8> {
    let mut canonical = Vec::with_capacity(path.len() + 1);
    let mut segment_start = 1;
    let mut in_parameters = false;
    canonical.push(b'/');
    let end_segment = |canonical: &mut Vec<u8>, segment_start: usize| {
        let segment = &canonical[segment_start..];
        let first = segment.iter().position(|&byte| byte > b' ');
        let first = first.unwrap_or(segment.len());
        let end = segment.iter().rposition(|&byte| byte > b' ');
        let end = end.map_or(first, |last| last + 1);
        canonical.copy_within(segment_start + first..segment_start + end, segment_start);
        canonical.truncate(segment_start + end - first);
        match &canonical[segment_start..] {
            b"" | b"." => canonical.truncate(segment_start - 1),
            b".." => {
                canonical.truncate(segment_start - 1);
                let parent = canonical.iter().rposition(|&byte| byte == b'/');
                canonical.truncate(parent.unwrap_or(0));
            }
            _ => {}
        }
    };
    for byte in percent_encoding::percent_decode_str(path) {
        match byte {
            b'/' | b'\\' => {
                end_segment(&mut canonical, segment_start);
                canonical.push(b'/');
                segment_start = canonical.len();
                in_parameters = false;
            }
            b';' => in_parameters = true,
            _ if in_parameters => {}
            _ => canonical.push(byte.to_ascii_lowercase()),
        }
    }
    end_segment(&mut canonical, segment_start);
    canonical
}

/// A canonical path without the format suffix of its last segment
/// (`/orders.json` as `/orders`), which Rails routes take as the response
/// format and Spring MVC before 5.3 matched as any suffix; `None` if it has
/// none.
fn without_format(canonical: &[u8]) -> Option<&[u8]> {
    let segment = canonical.iter().rposition(|&byte| byte == b'/')? + 1;
    let dot = canonical[segment..].iter().position(|&byte| byte == b'.')?;
    (dot > 0).then(|| &canonical[..segment + dot])
}

/// The route's signature scheme: its own `signature`, else its provider's;
/// none for a route with neither. Whether it has secrets to check it with is
/// the caller's concern.
pub fn signature_scheme(route: &RouteConfig) -> Result<Option<Scheme>, String> {
    Ok(match (&route.signature, route.provider) {
        (Some(signature), _) => Some(Scheme::Body(
            BodyHmac::from_config(signature).map_err(|p| format!("signature: {p}"))?,
        )),
        (None, Some(provider)) => Some(provider.preset().scheme),
        (None, None) => None,
    })
}

impl Route {
    /// Builds a route from its effective configuration (see
    /// `Config::effective_route`), resolving its secrets. Problems are
    /// returned one per line, each starting with the field it concerns.
    pub fn compile(route: &RouteConfig) -> Result<Route, Vec<String>> {
        let preset = route.provider.map(|provider| provider.preset());
        let key = match (&route.key, &preset) {
            (Some(key), _) => KeySource::from_config(key).map_err(|p| vec![format!("key: {p}")])?,
            (None, preset) => preset
                .as_ref()
                .and_then(|preset| preset.key.clone())
                .ok_or_else(|| vec![missing_key(route.provider)])?,
        };
        let scheme = signature_scheme(route).map_err(|p| vec![p])?;
        let verifier = match scheme {
            Some(scheme) if !route.secrets.is_empty() => Some(verifier(route, scheme)?),
            _ => None,
        };
        let keyless_forms = preset.as_ref().is_some_and(|preset| preset.keyless_forms);
        let mut handshakes = preset.map(|preset| preset.handshakes).unwrap_or_default();
        handshakes.extend(route.handshakes.iter().cloned());
        Ok(compile_route(
            route,
            key,
            verifier,
            handshakes,
            keyless_forms,
        ))
    }

    /// The configured `path` or `path_prefix`.
    pub fn path(&self) -> &str {
        &self.path.path
    }

    /// Whether this route's settle status for an upstream answer is `done`.
    pub fn is_done(&self, status: StatusCode) -> bool {
        self.done_on.iter().any(|m| m.matches(status.as_u16()))
    }

    /// Whether a delivery whose body differs from the key's first one is
    /// answered 422 on this route.
    pub fn rejects(&self, claim: &Claim) -> bool {
        claim.payload_mismatch() && self.rejects_mismatched_bodies()
    }

    /// Whether a (verified) request is one of the route's handshakes, which
    /// carry no event id by design and are forwarded without a claim.
    pub fn is_handshake(&self, body: &[u8]) -> bool {
        provider::is_handshake(&self.handshakes, body)
    }

    /// Whether a request in which no key was found is forwarded without a
    /// claim because it is a form on a route that takes forms as keyless.
    /// Asked only once the key is known to be missing: `Content-Type` is not
    /// signed, so a keyed event re-sent as a "form" must still be claimed.
    pub fn takes_as_keyless_form(&self, headers: &HeaderMap) -> bool {
        self.keyless_forms && provider::is_form(headers)
    }

    /// Whether `on_payload_mismatch` is `reject`.
    pub fn rejects_mismatched_bodies(&self) -> bool {
        self.on_payload_mismatch == OnPayloadMismatch::Reject
    }
}

/// The problem with a route that names no key and has no preset's to use.
pub fn missing_key(provider: Option<Provider>) -> String {
    match provider {
        None => {
            "key: required without a provider: `{ header: NAME }` or `{ json: /pointer }`".into()
        }
        Some(provider) => format!(
            "key: required with provider {provider}, which sends no event id: name a field unique to each event, e.g. `{{ json: /payload/object/uuid }}` for Zoom's recording.completed"
        ),
    }
}

/// A request that names another route than the one it matched (see
/// [`Routes::near_miss`]).
#[derive(Debug, Clone, Copy)]
pub enum NearMiss<'a> {
    /// A variant of this route's path or method.
    Variant(&'a Arc<Route>),
    /// A path under this route's prefix whose dot segments lead out of it.
    OutOfPrefix(&'a Arc<Route>),
}

impl<'a> NearMiss<'a> {
    /// The route the request is refused as.
    pub fn route(self) -> &'a Arc<Route> {
        match self {
            NearMiss::Variant(route) | NearMiss::OutOfPrefix(route) => route,
        }
    }

    /// Why a request sent with `method` is refused, for its sender.
    pub fn refusal(self, method: &Method) -> String {
        match self {
            NearMiss::Variant(meant) => format!(
                "not route {}'s path ({} {}) but a variant of it (letter case, percent-encoding, dot segments, repeated or trailing slashes, `;` parameters, spaces around a segment, a format suffix such as `.json`): refused rather than forwarded unverified; send the route's path exactly",
                meant.name,
                method.as_str().to_ascii_uppercase(),
                meant.path()
            ),
            NearMiss::OutOfPrefix(prefix) => format!(
                "a path under route {}'s path_prefix ({}) whose dot segments lead out of it: refused rather than forwarded to another path with this route's checks",
                prefix.name,
                prefix.path()
            ),
        }
    }
}

/// All routes, in match order: exact paths first, then the longest prefix.
#[derive(Debug, Default)]
pub struct Routes {
    routes: Vec<Arc<Route>>,
}

impl Routes {
    /// Compiles validated configuration; fails only if a secret became
    /// unreadable since validation.
    pub fn compile(config: &Config) -> Result<Self, String> {
        let mut routes = Vec::with_capacity(config.routes.len());
        for route in &config.routes {
            let compiled = Route::compile(&config.effective_route(route))
                .map_err(|problems| format!("route {}: {}", route.name, problems.join("; ")))?;
            routes.push(compiled);
        }
        routes.sort_by_key(|route| match &route.path {
            PathMatch { prefix: false, .. } => (0, 0),
            PathMatch { path, .. } => (1, usize::MAX - path.len()),
        });
        Ok(Self {
            routes: routes.into_iter().map(Arc::new).collect(),
        })
    }

    /// The route for a request, if any.
    pub fn find(&self, method: &Method, path: &str) -> Option<&Arc<Route>> {
        self.routes
            .iter()
            .find(|route| route.path.matches(path) && route.methods.contains(method))
    }

    /// Whether a request names another route than the one it matched, the
    /// way an application may read its path (see `canonical_form`:
    /// `/Hooks/Orders/`, `/hooks/%6Frders`, `//hooks/./orders`, and
    /// `without_format`: `/hooks/orders.json`): another route's path, or a
    /// path under another route's prefix, with one of that route's methods in
    /// any letter case. Forwarded as matched or unmatched, such a request
    /// could reach that route's handler in the application without its
    /// signature checked or its key claimed. `found` is the route the request
    /// matched, if any: an exact match is the route's own path and is never a
    /// variant; a request under a prefix whose dot segments lead out of it
    /// would reach a path outside the prefix with the prefix route's checks.
    pub fn near_miss<'a>(
        &'a self,
        method: &Method,
        path: &str,
        found: Option<&'a Arc<Route>>,
    ) -> Option<NearMiss<'a>> {
        if found.is_some_and(|route| !route.path.prefix) {
            return None;
        }
        let same_method = |route: &&Arc<Route>| {
            route
                .methods
                .iter()
                .any(|own| own.as_str().eq_ignore_ascii_case(method.as_str()))
        };
        let mut candidates = self.routes.iter().filter(same_method).peekable();
        candidates.peek()?;
        let canonical = canonical_form(path);
        let without_format = without_format(&canonical);
        let meant = candidates.find(|route| {
            route.path.matches_canonical(&canonical)
                || without_format.is_some_and(|path| route.path.matches_canonical(path))
        });
        match (found, meant) {
            // Two routes whose paths differ only in what an application
            // ignores cannot be told apart by it either.
            (Some(found), Some(meant))
                if Arc::ptr_eq(found, meant) || found.path.canonical == meant.path.canonical =>
            {
                None
            }
            (Some(found), None) => Some(NearMiss::OutOfPrefix(found)),
            (_, meant) => meant.map(NearMiss::Variant),
        }
    }

    /// Every route.
    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter().map(|route| &**route)
    }
}

fn verifier(route: &RouteConfig, scheme: Scheme) -> Result<Verifier, Vec<String>> {
    let mut problems = Vec::new();
    let mut secrets = Vec::with_capacity(route.secrets.len());
    for (index, secret) in route.secrets.iter().enumerate() {
        match secret.resolve() {
            Ok(secret) => secrets.push(secret),
            Err(problem) => problems.push(format!("secrets[{index}]: {problem}")),
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let tolerance = route.tolerance.unwrap_or(crate::verify::DEFAULT_TOLERANCE);
    Verifier::new(scheme, secrets, tolerance).map_err(|problem| vec![problem])
}

fn compile_route(
    route: &RouteConfig,
    key: KeySource,
    verifier: Option<Verifier>,
    handshakes: Vec<Handshake>,
    keyless_forms: bool,
) -> Route {
    let status = |code: Option<u16>| {
        StatusCode::from_u16(code.expect("filled by effective_route")).expect("validated status")
    };
    let path = match (&route.path, &route.path_prefix) {
        (Some(path), _) => PathMatch::new(path, false),
        (None, Some(prefix)) => PathMatch::new(prefix, true),
        (None, None) => unreachable!("validated: a route has a path"),
    };
    Route {
        name: Arc::from(route.name.as_str()),
        path,
        methods: route
            .methods
            .iter()
            .map(|m| Method::from_bytes(m.to_ascii_uppercase().as_bytes()).expect("validated"))
            .collect(),
        key,
        verifier,
        handshakes,
        keyless_forms,
        mode: route.mode,
        done_on: route.done_on.clone().unwrap_or_default(),
        duplicate_status: status(route.duplicate_status),
        in_flight_status: status(route.in_flight_status),
        in_flight_retry_after: route.in_flight_retry_after.unwrap_or_default(),
        on_missing_key: route.on_missing_key.unwrap_or_default(),
        on_payload_mismatch: route.on_payload_mismatch.unwrap_or_default(),
        retention: route.retention.unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes(yaml: &str) -> Routes {
        Routes::compile(&Config::from_yaml(yaml, None).unwrap()).unwrap()
    }

    #[test]
    fn exact_paths_win_over_prefixes_and_longer_prefixes_win() {
        let routes = routes(
            "routes:
               - { name: any, path_prefix: /hooks, key: { header: X-Id } }
               - { name: orders, path_prefix: /hooks/orders, key: { header: X-Id } }
               - { name: exact, path: /hooks/orders/special, key: { header: X-Id } }",
        );
        let name = |path: &str| routes.find(&Method::POST, path).map(|r| r.name.to_string());
        assert_eq!(name("/hooks/orders/special").as_deref(), Some("exact"));
        assert_eq!(name("/hooks/orders/1").as_deref(), Some("orders"));
        assert_eq!(name("/hooks/orders").as_deref(), Some("orders"));
        assert_eq!(name("/hooks/other").as_deref(), Some("any"));
        assert_eq!(name("/hooksy"), None);
        assert_eq!(name("/elsewhere"), None);
    }

    #[test]
    fn canonical_paths_read_paths_the_way_applications_may() {
        let canonical = |path: &str| String::from_utf8(canonical_path(path)).unwrap();
        for (path, expected) in [
            ("/hooks/orders", "/hooks/orders"),
            ("/Hooks/ORDERS/", "/hooks/orders"),
            ("/hooks/%6Frders", "/hooks/orders"),
            ("/%68ooks%2Forders", "/hooks/orders"),
            ("//hooks///orders", "/hooks/orders"),
            ("/hooks/./orders/.", "/hooks/orders"),
            ("/x/../hooks/y/../orders", "/hooks/orders"),
            ("/../../hooks/orders", "/hooks/orders"),
            ("/hooks;a=1/orders;jsessionid=2", "/hooks/orders"),
            ("\\hooks\\orders", "/hooks/orders"),
            ("/hooks/orders%20", "/hooks/orders"),
            ("/hooks/%09orders%0D%0A", "/hooks/orders"),
            ("/hooks/%20/orders", "/hooks/orders"),
            ("/hooks/or%20ders", "/hooks/or ders"),
            ("/hooks/orders/.%20", "/hooks/orders"),
            ("/hooks/orders/..", "/hooks"),
            ("/hooks/orders/.", "/hooks/orders"),
            ("/hooks/orders%zz", "/hooks/orders%zz"),
            ("/", ""),
            ("", ""),
            ("/..", ""),
        ] {
            assert_eq!(canonical(path), expected, "{path}");
        }
    }

    #[test]
    fn a_format_suffix_is_the_last_segment_from_its_first_dot() {
        let without = |canonical: &str| {
            without_format(canonical.as_bytes())
                .map(|path| String::from_utf8(path.to_vec()).unwrap())
        };
        assert_eq!(
            without("/hooks/orders.json").as_deref(),
            Some("/hooks/orders")
        );
        assert_eq!(
            without("/hooks/orders.v2.xml").as_deref(),
            Some("/hooks/orders")
        );
        assert_eq!(without("/hooks.d/orders"), None);
        assert_eq!(without("/hooks/.json"), None);
        assert_eq!(without("/hooks/orders"), None);
        assert_eq!(without(""), None);
    }

    #[test]
    fn a_path_taken_as_canonical_is_its_own_canonical_form() {
        let alphabet = ['/', 'a', 'A', '.', '%', '6', 'F', ';', '\\'];
        let mut paths = vec![String::new()];
        for _ in 0..5 {
            let longer: Vec<String> = paths
                .iter()
                .flat_map(|path| alphabet.iter().map(move |c| format!("{path}{c}")))
                .collect();
            paths.extend(longer);
            paths.dedup();
        }
        let mut canonical = 0;
        for path in &paths {
            if is_canonical(path) {
                canonical += 1;
                assert_eq!(canonical_path(path), path.as_bytes(), "{path:?}");
            }
        }
        assert!(canonical > 100, "{canonical} of {}", paths.len());
        assert!(is_canonical("/hooks/unrouted"));
        assert!(is_canonical("/a.b/c-d_e~f"));
    }

    #[test]
    fn variants_of_a_route_are_near_misses_and_other_requests_are_not() {
        let routes = routes(
            "routes:
               - { name: orders, path: /hooks/orders, key: { header: X-Id } }
               - { name: github, path_prefix: /webhooks/github/, methods: [POST, PUT], key: { header: X-Id } }",
        );
        let method = |name: &str| Method::from_bytes(name.as_bytes()).unwrap();
        let near_miss = |verb: &str, path: &str| {
            assert!(
                routes.find(&method(verb), path).is_none(),
                "{verb} {path} is a route's"
            );
            routes
                .near_miss(&method(verb), path, None)
                .map(|miss| miss.route().name.to_string())
        };
        for path in [
            "/hooks/orders/",
            "/HOOKS/Orders",
            "/%68ooks/orders",
            "/hooks%2Forders",
            "//hooks/orders",
            "/hooks/./orders",
            "/x/../hooks/orders",
            "/hooks/orders;x",
            "/hooks/orders.json",
            "/hooks/orders%20",
            "/hooks/%09orders",
        ] {
            assert_eq!(near_miss("POST", path).as_deref(), Some("orders"), "{path}");
        }
        assert_eq!(
            near_miss("post", "/hooks/orders").as_deref(),
            Some("orders")
        );
        assert_eq!(
            near_miss("put", "/Webhooks/GitHub/push").as_deref(),
            Some("github")
        );
        assert_eq!(
            near_miss("POST", "/webhooks/github").as_deref(),
            Some("github")
        );
        for (verb, path) in [
            ("GET", "/hooks/orders/"),
            ("PUT", "/hooks/orders"),
            ("POST", "/hooks/orders/1"),
            ("POST", "/hooks/orders-2"),
            ("POST", "/hooks"),
            ("POST", "/webhooks/githubx"),
            ("POST", "/"),
        ] {
            assert_eq!(near_miss(verb, path), None, "{verb} {path}");
        }
    }

    #[test]
    fn a_request_under_a_prefix_that_names_another_route_or_leaves_the_prefix_is_a_near_miss() {
        let routes = routes(
            "routes:
               - { name: orders, path: /hooks/orders, key: { header: X-Id } }
               - { name: github, path_prefix: /hooks/github/, key: { header: X-Id } }
               - { name: hooks, path_prefix: /hooks, key: { header: X-Id } }",
        );
        let post = Method::POST;
        let near_miss = |path: &str| {
            let found = routes.find(&post, path);
            assert_eq!(
                found.map(|r| &*r.name),
                Some("hooks"),
                "{path} is under the hooks prefix"
            );
            routes
                .near_miss(&post, path, found)
                .map(|miss| miss.route().name.to_string())
        };
        for (path, meant) in [
            ("/hooks/x/../orders", "orders"),
            ("/hooks/%2e%2e/hooks/orders", "orders"),
            ("/hooks/Orders", "orders"),
            ("/hooks/orders/", "orders"),
            ("/hooks/GitHub/push", "github"),
            ("/hooks/x/../github/push", "github"),
            ("/hooks/..", "hooks"),
            ("/hooks/x/../../admin", "hooks"),
        ] {
            assert_eq!(near_miss(path).as_deref(), Some(meant), "{path}");
        }
        for path in [
            "/hooks",
            "/hooks/",
            "/hooks/other",
            "/hooks/Other/Case",
            "/hooks/x/../other",
            "/hooks/./other",
            "/hooks/orders-2",
        ] {
            assert_eq!(near_miss(path), None, "{path}");
        }
        let dotted = self::routes(
            "routes:
               - { name: api, path_prefix: /api/v1.2/, key: { header: X-Id } }",
        );
        for path in ["/api/v1.2/orders", "/api/v1.2/orders.json", "/api/v1.2/"] {
            let found = dotted.find(&post, path);
            assert!(found.is_some(), "{path}");
            assert!(dotted.near_miss(&post, path, found).is_none(), "{path}");
        }
        let exact = routes.find(&post, "/hooks/orders");
        assert!(routes.near_miss(&post, "/hooks/orders", exact).is_none());
        let github = routes.find(&post, "/hooks/github/x/../../orders");
        assert_eq!(github.map(|r| &*r.name), Some("github"));
        assert_eq!(
            routes
                .near_miss(&post, "/hooks/github/x/../../orders", github)
                .map(|miss| &*miss.route().name),
            Some("orders")
        );
    }

    #[test]
    fn methods_default_to_post() {
        let routes = routes(
            "routes: [{ name: a, path: /a, key: { header: X-Id } }, { name: b, path: /b, methods: [put, POST], key: { header: X-Id } }]",
        );
        assert!(routes.find(&Method::POST, "/a").is_some());
        assert!(routes.find(&Method::GET, "/a").is_none());
        assert!(routes.find(&Method::PUT, "/b").is_some());
    }

    #[test]
    fn done_on_decides_settlement() {
        let routes =
            routes("routes: [{ name: a, path: /a, key: { header: X-Id }, done_on: [2xx, 410] }]");
        let route = routes.find(&Method::POST, "/a").unwrap();
        assert!(route.is_done(StatusCode::OK));
        assert!(route.is_done(StatusCode::GONE));
        assert!(!route.is_done(StatusCode::INTERNAL_SERVER_ERROR));
        assert!(!route.is_done(StatusCode::NOT_FOUND));
    }
}
