//! The upstream application: kept-alive connections (a set per serving
//! thread) with connect and response timeouts, and the header rewriting a
//! forwarding proxy owes both sides (hop-by-hop fields per RFC 9110 section
//! 7.6.1, `X-Forwarded-*`, the proxy's own `X-Dedupe-*` fields). Knows
//! nothing about claims.

mod body;
mod pool;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, GetAll, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Request, Response, Uri};
use http_body_util::BodyExt;

use crate::config::UpstreamConfig;
use crate::tls::TlsError;
use body::BodyEnd;
pub use body::{RequestBody, ResponseBody, ResponseBodyError, SenderBodyError, StreamedBody};
use pool::Pool;
pub use pool::use_lane;

/// Why the upstream gave no response.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection could be made (refused, unreachable, connect timeout).
    #[error("cannot connect to the upstream: {0}")]
    Connect(String),
    /// The connection failed after the request was sent.
    #[error("the upstream failed: {0}")]
    Failed(String),
    /// No response headers within `upstream.timeout` of the request's end.
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The sender's streamed body failed on its way: the sender's fault, not
    /// the upstream's.
    #[error(transparent)]
    SenderBody(SenderBodyError),
}

/// A request's body as the upstream is sent it.
pub enum Outgoing {
    /// Read whole before forwarding (a webhook's).
    Whole(bytes::Bytes),
    /// Streamed through from the sender (an unmatched request's).
    Streamed(StreamedBody),
}

/// How long a kept-alive upstream connection may sit unused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The upstream's connections and where requests go.
pub struct Upstream {
    pool: Pool,
    /// `upstream.timeout`, also the longest wait for a response body's next
    /// piece.
    timeout: Duration,
    /// `Host` for a request that came without one (HTTP/1.0).
    default_host: HeaderValue,
    base_path: String,
}

/// The route and delivery a response answers, for its warnings.
#[derive(Debug)]
pub struct Origin {
    route: Arc<str>,
    /// `X-Dedupe-Key`, percent-encoded; none for a request without a key.
    key: Option<HeaderValue>,
    attempt: Option<i32>,
}

/// The `X-Dedupe-*` fields the upstream gets with a deduplicated request.
pub struct DedupeHeaders {
    /// `X-Dedupe-Key`, already percent-encoded.
    pub key: HeaderValue,
    /// `X-Dedupe-Source`: the route name.
    pub source: HeaderValue,
    /// `X-Dedupe-Attempt`: none for a shadowed delivery, which holds no
    /// claim.
    pub attempt: Option<i32>,
}

/// How the request reached the proxy, for `X-Forwarded-*`. Made once per
/// connection and cloned for each of its requests.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Whether the listener terminated TLS.
    tls: bool,
    /// The sender's address as a field value: formatted once, and a clone
    /// shares its bytes.
    ip: HeaderValue,
}

impl Peer {
    /// The sender at `addr`, on a listener that terminates TLS or not. An
    /// IPv4 sender on a dual-stack listener (`[::]`) is written as IPv4, as
    /// the application's address lists have it.
    pub fn new(addr: SocketAddr, tls: bool) -> Self {
        let ip = HeaderValue::try_from(addr.ip().to_canonical().to_string())
            .expect("an IP address is a valid field value");
        Self { tls, ip }
    }
}

// Names built at compile time: one parsed from a string costs a parse per
// request.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_DEDUPE_KEY: HeaderName = HeaderName::from_static("x-dedupe-key");
const X_DEDUPE_SOURCE: HeaderName = HeaderName::from_static("x-dedupe-source");
const X_DEDUPE_ATTEMPT: HeaderName = HeaderName::from_static("x-dedupe-attempt");
const DEDUPE_PREFIX: &str = "x-dedupe-";

// A static, not a const: a const array would be built and dropped at every
// use.
static HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

impl Upstream {
    /// Forwards to `config.url` (validated by the configuration), with a set
    /// of connections for each of `lanes` serving threads. An `https://`
    /// upstream is verified against `ca_file` or the system roots.
    pub fn new(config: &UpstreamConfig, lanes: usize) -> Result<Self, TlsError> {
        let url: Uri = config.url.parse().expect("validated upstream.url");
        let authority = url.authority().expect("validated: url has a host");
        Ok(Self {
            pool: Pool::new(config, &url, lanes, IDLE_TIMEOUT)?,
            timeout: config.timeout,
            default_host: HeaderValue::from_str(authority.as_str())
                .expect("an authority is a valid header value"),
            base_path: url.path().trim_end_matches('/').to_owned(),
        })
    }

    /// Sends the request and waits for the response headers; the body is
    /// left to stream.
    pub fn send(
        &self,
        mut parts: Parts,
        body: Outgoing,
        peer: Peer,
        route: Option<&Arc<str>>,
        dedupe: Option<DedupeHeaders>,
    ) -> impl Future<Output = Result<Response<ResponseBody>, UpstreamError>> + '_ {
        // The request is prepared before the future is made, so the future
        // holds only the finished request: it is boxed or moved on every
        // request, and a smaller one is cheaper to allocate and copy.
        // Kept for the response body's warnings, which come after the
        // request's own log line: boxed, and for a route's requests only.
        let origin = route.map(|route| {
            Box::new(Origin {
                route: Arc::clone(route),
                key: dedupe.as_ref().map(|dedupe| dedupe.key.clone()),
                attempt: dedupe.as_ref().and_then(|dedupe| dedupe.attempt),
            })
        });
        prepare_request_headers(&mut parts, &peer, dedupe, &self.default_host);
        parts.uri = self.target(&parts.uri);
        parts.version = http::Version::HTTP_11;
        let (body, end) = match body {
            Outgoing::Whole(body) => (
                http_body_util::Full::new(body)
                    .map_err(|never| match never {})
                    .boxed(),
                None,
            ),
            Outgoing::Streamed(body) => {
                let end = body.end();
                (body.boxed(), end)
            }
        };
        self.exchange(Request::from_parts(parts, body), end, origin)
    }

    async fn exchange(
        &self,
        request: Request<RequestBody>,
        end: Option<Arc<BodyEnd>>,
        origin: Option<Box<Origin>>,
    ) -> Result<Response<ResponseBody>, UpstreamError> {
        let mut response = self.pool.send(request, end.as_deref()).await?;
        // Only an answer to `Upgrade`, which is never forwarded: passed on,
        // it would leave the sender waiting on a protocol nobody speaks.
        if response.status() == http::StatusCode::SWITCHING_PROTOCOLS {
            return Err(UpstreamError::Failed(
                "the upstream switched protocols (101), which the proxy does not tunnel".into(),
            ));
        }
        let status = response.status();
        reframe(status, response.headers_mut())?;
        strip_hop_by_hop(response.headers_mut());
        let timeout = self.timeout;
        Ok(response.map(|body| ResponseBody::new(body, timeout, origin)))
    }

    /// The origin-form target on the upstream: its base path, then the
    /// request's path and query.
    fn target(&self, uri: &Uri) -> Uri {
        let path_and_query = match uri.path_and_query() {
            // `*` (`OPTIONS *`) asks about the server, not a path under it.
            Some(path_and_query) if self.base_path.is_empty() || path_and_query == "*" => {
                path_and_query.clone()
            }
            path_and_query => {
                let path_and_query = path_and_query.map_or("/", |pq| pq.as_str());
                format!("{}{}", self.base_path, path_and_query)
                    .parse()
                    .expect("a valid base and a valid path make a valid path")
            }
        };
        Uri::from(path_and_query)
    }
}

/// `default_host` is the `Host` for a request that came with none (HTTP/1.0
/// allows that; HTTP/1.1 to the upstream does not).
fn prepare_request_headers(
    parts: &mut Parts,
    peer: &Peer,
    dedupe: Option<DedupeHeaders>,
    default_host: &HeaderValue,
) {
    let headers = &mut parts.headers;
    strip_hop_by_hop(headers);
    strip_dedupe_headers(headers);
    let original_host = headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    match original_host {
        Some(host) => {
            headers.insert(header::HOST, host.clone());
            headers.insert(X_FORWARDED_HOST, host);
        }
        None => {
            headers.insert(header::HOST, default_host.clone());
            // The sender named no host, so none was forwarded for.
            headers.remove(X_FORWARDED_HOST);
        }
    }
    join_cookie_fields(headers);
    let forwarded = forwarded_for(headers.get_all(X_FORWARDED_FOR), &peer.ip);
    headers.insert(X_FORWARDED_FOR, forwarded);
    headers.insert(
        X_FORWARDED_PROTO,
        if peer.tls {
            HeaderValue::from_static("https")
        } else {
            HeaderValue::from_static("http")
        },
    );
    if let Some(dedupe) = dedupe {
        headers.insert(X_DEDUPE_KEY, dedupe.key);
        headers.insert(X_DEDUPE_SOURCE, dedupe.source);
        if let Some(attempt) = dedupe.attempt {
            headers.insert(X_DEDUPE_ATTEMPT, attempt.into());
        }
    }
}

/// RFC 9113 section 8.2.3: an HTTP/2 sender may split `Cookie` into one
/// field per cookie, which must be joined with `; ` before they go on over
/// HTTP/1.1, where many applications read only the first `Cookie` line.
fn join_cookie_fields(headers: &mut HeaderMap) {
    let mut cookies = headers.get_all(header::COOKIE).iter();
    if cookies.nth(1).is_none() {
        return;
    }
    let joined = headers
        .get_all(header::COOKIE)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect::<Vec<_>>()
        .join(&b"; "[..]);
    let joined =
        HeaderValue::from_bytes(&joined).expect("field values joined by `; ` make a value");
    headers.insert(header::COOKIE, joined);
}

/// Fits a response's framing fields to how it is passed on: hyper has read
/// the body by its framing and frames it anew for the sender, so a
/// `Content-Length` beside `Transfer-Encoding` (which wins, RFC 9112 section
/// 6.3) would announce a length the body does not have, a repeated one is
/// written once, and a 204's is dropped (it has no body). A transfer coding
/// other than chunked cannot be undone here, and is a failed upstream.
fn reframe(status: http::StatusCode, headers: &mut HeaderMap) -> Result<(), UpstreamError> {
    if let Some(coding) = headers.get(header::TRANSFER_ENCODING) {
        if headers.get_all(header::TRANSFER_ENCODING).iter().count() > 1
            || !coding.as_bytes().eq_ignore_ascii_case(b"chunked")
        {
            return Err(UpstreamError::Failed(format!(
                "the upstream's response has the transfer coding {coding:?}, which the proxy cannot pass on"
            )));
        }
        headers.remove(header::CONTENT_LENGTH);
        return Ok(());
    }
    if status == http::StatusCode::NO_CONTENT {
        headers.remove(header::CONTENT_LENGTH);
        return Ok(());
    }
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    let single = match (lengths.next(), lengths.next()) {
        (Some(only), None) if !only.as_bytes().contains(&b',') => return Ok(()),
        (Some(first), _) => first.clone(),
        (None, _) => return Ok(()),
    };
    // hyper took the response only if every value is the same length.
    let length = single
        .to_str()
        .ok()
        .and_then(|list| list.split(',').next())
        .map(str::trim)
        .and_then(|length| HeaderValue::from_str(length).ok())
        .ok_or_else(|| {
            UpstreamError::Failed("the upstream's Content-Length is unreadable".into())
        })?;
    headers.insert(header::CONTENT_LENGTH, length);
    Ok(())
}

/// `X-Forwarded-For`: the hops the request came through, in order, whether
/// they came as one field or several, then the sender.
fn forwarded_for(previous: GetAll<'_, HeaderValue>, client: &HeaderValue) -> HeaderValue {
    let mut joined = Vec::new();
    for hop in previous.iter().filter(|hop| !hop.is_empty()) {
        joined.extend_from_slice(hop.as_bytes());
        joined.extend_from_slice(b", ");
    }
    if joined.is_empty() {
        return client.clone();
    }
    joined.extend_from_slice(client.as_bytes());
    // Field values joined by commas are a field value: nothing is added that
    // a field value may not hold.
    HeaderValue::from_bytes(&joined).unwrap_or_else(|_| client.clone())
}

/// Fields kept whatever `Connection` names: RFC 9110 section 7.6.1 forbids
/// naming a field meant for every recipient, and a sender that names these
/// anyway must not take the request's `Host`, or the chain of addresses the
/// proxy appends to, away from the upstream.
const END_TO_END: [&str; 2] = ["host", "x-forwarded-for"];

/// Removes the fields that describe one connection, not the message: the
/// fixed hop-by-hop set and every field the `Connection` header names
/// (except the `END_TO_END` ones: `Host` and `X-Forwarded-For`).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let present = headers
        .keys()
        .fold(0, |present, name| present | hop_by_hop_bit(name));
    remove_hop_by_hop(headers, present);
}

/// Removes from trailers, either way, what is removed from heads: the
/// hop-by-hop fields and the proxy's own, and the forwarding fields it sets
/// in the head, which an application merging trailers into the head would
/// otherwise take from the sender.
fn strip_trailers(trailers: &mut HeaderMap) {
    strip_hop_by_hop(trailers);
    strip_dedupe_headers(trailers);
    for field in [X_FORWARDED_FOR, X_FORWARDED_HOST, X_FORWARDED_PROTO] {
        trailers.remove(field);
    }
}

/// Removes every `X-Dedupe-*` field, so a sender cannot forge them, and
/// every field that reads as one of the proxy's own once `_` is read as `-`.
fn strip_dedupe_headers(headers: &mut HeaderMap) {
    // Collecting none (the usual request) allocates nothing.
    let forged: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with(DEDUPE_PREFIX) || poses_as_proxy_field(name))
        .cloned()
        .collect();
    for name in forged {
        headers.remove(name);
    }
}

/// CGI-style application servers (WSGI, Rack, PHP's) read `X_Dedupe_Key`
/// and `X-Dedupe-Key` as the same variable, and would take the sender's
/// for the proxy's, or join the two.
fn poses_as_proxy_field(name: &HeaderName) -> bool {
    let name = name.as_str();
    if !name.starts_with('x') || !name.contains('_') {
        return false;
    }
    let read = name.replace('_', "-");
    read.starts_with(DEDUPE_PREFIX)
        || [&X_FORWARDED_FOR, &X_FORWARDED_HOST, &X_FORWARDED_PROTO]
            .iter()
            .any(|field| field.as_str() == read)
}

/// Bit `i` stands for `HOP_BY_HOP[i]`. Found in one pass over the names:
/// most messages carry none or one of these, and a lookup per field would
/// hash every name in the set.
fn hop_by_hop_bit(name: &HeaderName) -> u8 {
    // A match on the text rejects most names on their length alone.
    match name.as_str() {
        "connection" => 1,
        "keep-alive" => 1 << 1,
        "proxy-connection" => 1 << 2,
        "te" => 1 << 3,
        "transfer-encoding" => 1 << 4,
        "upgrade" => 1 << 5,
        _ => 0,
    }
}

/// `present`: the fields of `HOP_BY_HOP` the message has, from
/// [`hop_by_hop_bit`].
fn remove_hop_by_hop(headers: &mut HeaderMap, present: u8) {
    if present & hop_by_hop_bit(&header::CONNECTION) != 0 {
        // Most `Connection` fields are just `keep-alive` (or `close`): they
        // name no field to remove, and are passed over without being parsed.
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter(|value| {
                let value = value.as_bytes();
                !(value.eq_ignore_ascii_case(b"keep-alive") || value.eq_ignore_ascii_case(b"close"))
            })
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .map(str::trim)
            // The fixed set is removed below; an invalid name matches no
            // field.
            .filter(|name| {
                !HOP_BY_HOP
                    .iter()
                    .map(HeaderName::as_str)
                    .chain(END_TO_END)
                    .any(|field| name.eq_ignore_ascii_case(field))
            })
            .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for (index, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << index) != 0 {
            headers.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut builder = Request::post("/hooks/a?x=1");
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    fn peer() -> Peer {
        Peer::new("10.1.2.3:5555".parse().unwrap(), false)
    }

    fn default_host() -> HeaderValue {
        HeaderValue::from_static("app:3000")
    }

    #[test]
    fn a_response_is_reframed_for_the_way_it_is_passed_on() {
        let reframed = |status: u16, fields: &[(&str, &str)]| {
            let mut headers = HeaderMap::new();
            for (name, value) in fields {
                headers.append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(value).unwrap(),
                );
            }
            let status = http::StatusCode::from_u16(status).unwrap();
            reframe(status, &mut headers).map(|()| {
                headers
                    .get_all(header::CONTENT_LENGTH)
                    .iter()
                    .map(|value| value.to_str().unwrap().to_owned())
                    .collect::<Vec<_>>()
            })
        };
        let chunked = [("content-length", "3"), ("transfer-encoding", "chunked")];
        assert_eq!(reframed(200, &chunked).unwrap(), Vec::<String>::new());
        assert_eq!(reframed(200, &[("content-length", "5, 5")]).unwrap(), ["5"]);
        assert_eq!(
            reframed(200, &[("content-length", "5"), ("content-length", "5")]).unwrap(),
            ["5"]
        );
        assert_eq!(reframed(200, &[("content-length", "5")]).unwrap(), ["5"]);
        assert_eq!(
            reframed(204, &[("content-length", "5")]).unwrap(),
            Vec::<String>::new()
        );
        // A 304's length is the representation's, as a HEAD's is.
        assert_eq!(reframed(304, &[("content-length", "5")]).unwrap(), ["5"]);
        for codings in [&["gzip, chunked"][..], &["gzip"], &["chunked", "chunked"]] {
            let fields: Vec<(&str, &str)> = codings
                .iter()
                .map(|coding| ("transfer-encoding", *coding))
                .collect();
            assert!(
                matches!(reframed(200, &fields), Err(UpstreamError::Failed(_))),
                "{codings:?}"
            );
        }
    }

    #[test]
    fn hop_by_hop_and_connection_named_fields_are_removed() {
        let mut parts = parts(&[
            ("connection", "keep-alive, x-private"),
            ("keep-alive", "timeout=5"),
            ("x-private", "1"),
            ("te", "trailers"),
            ("upgrade", "h2c"),
            ("x-kept", "yes"),
        ]);
        prepare_request_headers(&mut parts, &peer(), None, &default_host());
        for gone in ["connection", "keep-alive", "x-private", "te", "upgrade"] {
            assert!(!parts.headers.contains_key(gone), "{gone} kept");
        }
        assert_eq!(parts.headers["x-kept"], "yes");
    }

    #[test]
    fn a_request_without_host_forwards_no_host_of_the_senders_choosing() {
        let mut parts = parts(&[("x-forwarded-host", "evil.example")]);
        prepare_request_headers(&mut parts, &peer(), None, &default_host());
        assert_eq!(parts.headers["host"], default_host());
        assert!(!parts.headers.contains_key("x-forwarded-host"));
    }

    #[test]
    fn split_cookie_fields_are_joined_into_one() {
        let mut split = parts(&[("cookie", "a=1"), ("cookie", "b=2"), ("cookie", "c=3")]);
        prepare_request_headers(&mut split, &peer(), None, &default_host());
        let cookies: Vec<_> = split.headers.get_all("cookie").iter().collect();
        assert_eq!(cookies, ["a=1; b=2; c=3"]);
        let mut single = parts(&[("cookie", "a=1; b=2")]);
        prepare_request_headers(&mut single, &peer(), None, &default_host());
        assert_eq!(single.headers["cookie"], "a=1; b=2");
    }

    #[test]
    fn connection_names_are_matched_without_case_and_bad_names_are_skipped() {
        let mut headers = HeaderMap::new();
        headers.append(
            header::CONNECTION,
            HeaderValue::from_static("X-Private, bad name,, TE"),
        );
        headers.append(header::CONNECTION, HeaderValue::from_static("x-other"));
        headers.insert("x-private", HeaderValue::from_static("1"));
        headers.insert("x-other", HeaderValue::from_static("2"));
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        headers.insert("x-kept", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-kept"]);
    }

    #[test]
    fn connection_cannot_remove_host_or_the_forwarded_for_chain() {
        let mut parts = parts(&[
            ("host", "hooks.example"),
            ("connection", "Host, X-Forwarded-For, x-private"),
            ("x-forwarded-for", "192.0.2.1"),
            ("x-private", "1"),
        ]);
        prepare_request_headers(&mut parts, &peer(), None, &default_host());
        assert_eq!(parts.headers["host"], "hooks.example");
        assert_eq!(parts.headers["x-forwarded-host"], "hooks.example");
        assert_eq!(parts.headers["x-forwarded-for"], "192.0.2.1, 10.1.2.3");
        assert!(!parts.headers.contains_key("x-private"));
    }

    #[test]
    fn a_bare_keep_alive_or_close_removes_only_the_connection_fields() {
        for value in ["keep-alive", "Keep-Alive", "close", "CLOSE"] {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONNECTION, HeaderValue::from_static(value));
            headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
            headers.insert("x-kept", HeaderValue::from_static("yes"));
            strip_hop_by_hop(&mut headers);
            let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
            assert_eq!(left, ["x-kept"], "{value}");
        }
    }

    #[test]
    fn each_hop_by_hop_field_has_the_bit_of_its_place() {
        for (index, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_bit(name), 1 << index, "{name}");
        }
        assert_eq!(hop_by_hop_bit(&header::CONTENT_TYPE), 0);
        assert_eq!(hop_by_hop_bit(&HeaderName::from_static("x-te")), 0);
    }

    #[test]
    fn a_message_without_hop_by_hop_fields_is_left_as_it_is() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        headers.append("x-a", HeaderValue::from_static("1"));
        headers.append("x-a", HeaderValue::from_static("2"));
        let before = headers.clone();
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers, before);
    }

    #[test]
    fn forwarded_for_takes_an_ipv6_sender_of_any_length() {
        for (client, expected) in [
            ("[::1]:5555", "::1"),
            (
                "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:5555",
                "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            ),
            ("[::ffff:192.0.2.255]:5555", "192.0.2.255"),
            ("[::ffff:c000:2ff]:5555", "192.0.2.255"),
            ("[64:ff9b::c000:2ff]:5555", "64:ff9b::c000:2ff"),
        ] {
            let mut parts = parts(&[("x-forwarded-for", "192.0.2.1")]);
            let peer = Peer::new(client.parse().unwrap(), false);
            prepare_request_headers(&mut parts, &peer, None, &default_host());
            assert_eq!(
                parts.headers["x-forwarded-for"],
                format!("192.0.2.1, {expected}")
            );
            let mut first_hop = self::parts(&[]);
            prepare_request_headers(&mut first_hop, &peer, None, &default_host());
            assert_eq!(first_hop.headers["x-forwarded-for"], expected);
        }
    }

    #[test]
    fn forwarded_for_keeps_every_earlier_hop_in_order() {
        let peer = Peer::new("198.51.100.7:5555".parse().unwrap(), false);
        let mut parts = parts(&[
            ("x-forwarded-for", "192.0.2.1, 192.0.2.2"),
            ("x-forwarded-for", "192.0.2.3"),
        ]);
        prepare_request_headers(&mut parts, &peer, None, &default_host());
        let forwarded: Vec<_> = parts.headers.get_all("x-forwarded-for").iter().collect();
        assert_eq!(forwarded, ["192.0.2.1, 192.0.2.2, 192.0.2.3, 198.51.100.7"]);
        let mut opaque = self::parts(&[]);
        let obs_text = HeaderValue::from_bytes(b"h\xe9te").unwrap();
        opaque.headers.insert("x-forwarded-for", obs_text);
        prepare_request_headers(&mut opaque, &peer, None, &default_host());
        assert_eq!(
            opaque.headers["x-forwarded-for"].as_bytes(),
            b"h\xe9te, 198.51.100.7"
        );
    }

    #[test]
    fn forged_dedupe_fields_are_replaced() {
        let mut parts = parts(&[
            ("x-dedupe-key", "forged"),
            ("x-dedupe-attempt", "9"),
            ("x-dedupe-other", "x"),
        ]);
        let dedupe = DedupeHeaders {
            key: HeaderValue::from_static("evt_1"),
            source: HeaderValue::from_static("orders"),
            attempt: Some(2),
        };
        prepare_request_headers(&mut parts, &peer(), Some(dedupe), &default_host());
        assert_eq!(parts.headers["x-dedupe-key"], "evt_1");
        assert_eq!(parts.headers["x-dedupe-source"], "orders");
        assert_eq!(parts.headers["x-dedupe-attempt"], "2");
        assert!(!parts.headers.contains_key("x-dedupe-other"));
        let mut unclaimed = self::parts(&[("x-dedupe-attempt", "9")]);
        let shadowed = DedupeHeaders {
            key: HeaderValue::from_static("evt_1"),
            source: HeaderValue::from_static("orders"),
            attempt: None,
        };
        prepare_request_headers(&mut unclaimed, &peer(), Some(shadowed), &default_host());
        assert_eq!(unclaimed.headers["x-dedupe-key"], "evt_1");
        assert!(!unclaimed.headers.contains_key("x-dedupe-attempt"));
        let mut unmatched = self::parts(&[("x-dedupe-key", "forged")]);
        prepare_request_headers(&mut unmatched, &peer(), None, &default_host());
        assert!(!unmatched.headers.contains_key("x-dedupe-key"));
    }

    #[test]
    fn fields_a_cgi_server_would_read_as_the_proxys_are_dropped() {
        let mut parts = parts(&[
            ("x_dedupe_key", "forged"),
            ("x-dedupe_attempt", "1"),
            ("x_forwarded_for", "192.0.2.66"),
            ("x_forwarded_host", "evil.example"),
            ("x_request_id", "kept"),
            ("x-forwarded_by", "kept"),
        ]);
        prepare_request_headers(&mut parts, &peer(), None, &default_host());
        let mut names: Vec<&str> = parts
            .headers
            .keys()
            .map(HeaderName::as_str)
            .filter(|name| name.contains('_'))
            .collect();
        names.sort_unstable();
        assert_eq!(names, ["x-forwarded_by", "x_request_id"]);
        assert_eq!(parts.headers["x-forwarded-for"], "10.1.2.3");
    }

    #[test]
    fn forwarded_fields_are_appended_and_host_preserved() {
        let mut parts = parts(&[
            ("host", "hooks.example.com"),
            ("x-forwarded-for", "192.0.2.1"),
        ]);
        let peer = Peer::new("10.1.2.3:5555".parse().unwrap(), true);
        prepare_request_headers(&mut parts, &peer, None, &default_host());
        assert_eq!(parts.headers["host"], "hooks.example.com");
        assert_eq!(parts.headers["x-forwarded-host"], "hooks.example.com");
        assert_eq!(parts.headers["x-forwarded-for"], "192.0.2.1, 10.1.2.3");
        assert_eq!(parts.headers["x-forwarded-proto"], "https");
    }

    #[test]
    fn target_keeps_the_base_path_and_query() {
        crate::tls::install_crypto_provider();
        let upstream = Upstream::new(
            &UpstreamConfig {
                url: "http://app:3000/base/".into(),
                ..Default::default()
            },
            1,
        )
        .unwrap();
        assert_eq!(
            upstream
                .target(&"/hooks/a?x=1".parse().unwrap())
                .to_string(),
            "/base/hooks/a?x=1"
        );
        assert_eq!(upstream.target(&"*".parse().unwrap()).to_string(), "*");
    }
}
