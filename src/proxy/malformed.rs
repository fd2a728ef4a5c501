//! Requests refused before they are routed, because RFC 9112 or 9113 has a
//! server refuse them: framing that two servers could read two ways, a
//! tunnel, a missing, repeated or ill-formed `Host`, or a target that does
//! not agree with it.

use http::{Method, Request, Version, header};
use hyper::body::Incoming;

/// Why RFC 9112 has a server refuse the request with 400, if it does: its
/// framing could be read two ways, or its `Host` is missing or repeated.
pub(super) fn malformation(request: &Request<Incoming>) -> Option<&'static str> {
    if is_ambiguously_framed(request.headers()) {
        return Some(
            "ambiguous message framing: Transfer-Encoding must be exactly `chunked`, without Content-Length",
        );
    }
    if request.method() == Method::CONNECT {
        return Some(
            "CONNECT is not served: the proxy forwards requests, it does not open tunnels",
        );
    }
    let mut hosts = request.headers().get_all(header::HOST).iter();
    let host = match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => return Some("more than one Host field"),
        // HTTP/1.0 may leave it out; HTTP/2 carries `:authority` instead.
        (None, _) if request.version() == Version::HTTP_11 => {
            return Some("an HTTP/1.1 request needs a Host field");
        }
        (host, _) => host,
    };
    let is_host_and_port = |name: &[u8]| name.iter().all(|&byte| HOST_BYTES[usize::from(byte)]);
    // RFC 9112 section 3.2: a Host that is not a host and an optional port
    // (`a/b`, `a b`, `user@a`) would be passed on as one to the application,
    // and in X-Forwarded-Host.
    if host.is_some_and(|host| !is_host_and_port(host.as_bytes())) {
        return Some("the Host field is not a host with an optional port");
    }
    let target = request.uri();
    // Without a Host field, the target's authority (HTTP/2's `:authority`)
    // is passed on as the Host; RFC 9113 section 8.3.1 forbids a user part
    // in it.
    if host.is_none()
        && target
            .authority()
            .is_some_and(|authority| !is_host_and_port(authority.as_str().as_bytes()))
    {
        return Some("the request target's authority is not a host with an optional port");
    }
    let http2 = request.version() >= Version::HTTP_2;
    if !http2 && target.scheme().is_none() && target.authority().is_some() {
        return Some("a request target in authority form is for CONNECT only");
    }
    // RFC 9112 section 3.2.2 and RFC 9113 section 8.3.1: the target's
    // authority (HTTP/2's `:authority`), not Host, names the resource;
    // forwarded with the sender's Host, the application would read another.
    if let (Some(authority), Some(host)) = (target.authority(), host)
        && !host
            .as_bytes()
            .eq_ignore_ascii_case(authority.as_str().as_bytes())
    {
        return Some(if http2 {
            "the :authority and Host fields differ"
        } else {
            "the request target's authority and the Host field differ"
        });
    }
    if target.path() == "*" && request.method() != Method::OPTIONS {
        return Some("a request target of `*` is for OPTIONS only");
    }
    None
}

/// The bytes that may appear in a host and port (RFC 3986 section 3.2.2: a
/// name's unreserved characters, escapes and sub-delimiters, an IP
/// literal's brackets and colons, the port's colon), as a table looked up
/// once per byte of every request's Host. Not `http::uri::Authority`, which
/// copies the field to parse it.
const HOST_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = (byte as u8).is_ascii_alphanumeric();
        byte += 1;
    }
    let others = b"-._~%!$&'()*+,;=:[]";
    let mut i = 0;
    while i < others.len() {
        table[others[i] as usize] = true;
        i += 1;
    }
    table
};

/// Whether the request's framing could be read two ways by two servers (the
/// request-smuggling pattern): both `Content-Length` and `Transfer-Encoding`,
/// or a transfer coding other than one `chunked`.
fn is_ambiguously_framed(headers: &http::HeaderMap) -> bool {
    let mut codings = headers.get_all(header::TRANSFER_ENCODING).iter();
    match (codings.next(), codings.next()) {
        (None, _) => false,
        (Some(coding), None) => {
            headers.contains_key(header::CONTENT_LENGTH)
                || !coding.as_bytes().eq_ignore_ascii_case(b"chunked")
        }
        (Some(_), Some(_)) => true,
    }
}
