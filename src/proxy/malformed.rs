//! Requests refused before they are routed, because RFC 9112 or 9113 has a
//! server refuse them: framing that two servers could read two ways, a
//! tunnel, a missing, repeated or ill-formed `Host`, or a target that does
//! not agree with it.

use http::{Method, Request, Version, header};
use hyper::body::Incoming;

/// Why RFC 9112 or 9113 has a server refuse the request with 400, if it
/// does: its framing could be read two ways, its `Host` is missing,
/// repeated or not a host and port, it asks for a tunnel, its target does
/// not agree with its `Host`, or (over HTTP/2) a field value has whitespace
/// around it.
pub(super) fn malformation(request: &Request<Incoming>) -> Option<&'static str> {
    if let Some(problem) = framing_problem(request.headers()) {
        return Some(problem);
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
    // RFC 9112 section 3.2: a Host that is not a host and an optional port
    // (`a/b`, `a b`, `user@a`, `a:b`, `[::1`) would be passed on as one to
    // the application, and in X-Forwarded-Host.
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
    // RFC 9113 section 8.2.1. HTTP/1's parser trims such whitespace, so
    // taken as it comes a key would be another key over HTTP/2 than the
    // same delivery's over HTTP/1, and a value of spaces a key at all.
    if http2
        && request.headers().values().any(|value| {
            let value = value.as_bytes();
            [value.first(), value.last()]
                .into_iter()
                .flatten()
                .any(|&byte| byte == b' ' || byte == b'\t')
        })
    {
        return Some("a field value starts or ends with whitespace, which HTTP/2 does not allow");
    }
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

/// Whether `field` is a host and an optional port (RFC 3986 section 3.2.2
/// and 3.2.3): a name or IPv4 address, or an IP literal in brackets, then
/// `:` and digits, or nothing. Checked byte by byte, not with
/// `http::uri::Authority`, which copies the field to parse it.
fn is_host_and_port(field: &[u8]) -> bool {
    let (host_is_valid, port) = match field.strip_prefix(b"[") {
        Some(literal) => match literal.iter().position(|&byte| byte == b']') {
            Some(end) => (
                end > 0 && literal[..end].iter().all(|&byte| is_ip_literal_byte(byte)),
                &literal[end + 1..],
            ),
            None => return false,
        },
        None => {
            let end = field
                .iter()
                .position(|&byte| byte == b':')
                .unwrap_or(field.len());
            (
                field[..end].iter().all(|&byte| is_name_byte(byte)),
                &field[end..],
            )
        }
    };
    let port_is_valid = match port {
        [] => true,
        [b':', digits @ ..] => digits.iter().all(u8::is_ascii_digit),
        _ => false,
    };
    host_is_valid && port_is_valid
}

/// A registered name's unreserved characters, escapes and sub-delimiters
/// (an IPv4 address is one too).
fn is_name_byte(byte: u8) -> bool {
    NAME_BYTES[usize::from(byte)]
}

/// [`is_name_byte`] as a table looked up once per byte of every request's
/// Host.
const NAME_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = (byte as u8).is_ascii_alphanumeric();
        byte += 1;
    }
    let others = b"-._~%!$&'()*+,;=";
    let mut i = 0;
    while i < others.len() {
        table[others[i] as usize] = true;
        i += 1;
    }
    table
};

/// What an IPv6 address or an `IPvFuture` in brackets is made of.
fn is_ip_literal_byte(byte: u8) -> bool {
    byte == b':' || is_name_byte(byte)
}

/// Why the request's framing could be read two ways by two servers (the
/// request-smuggling pattern), if it could: a transfer coding other than
/// one `chunked`, or one beside `Content-Length`.
fn framing_problem(headers: &http::HeaderMap) -> Option<&'static str> {
    const CODING: &str =
        "ambiguous message framing: the only transfer coding accepted is a single `chunked`";
    let mut codings = headers.get_all(header::TRANSFER_ENCODING).iter();
    match (codings.next(), codings.next()) {
        (None, _) => None,
        (Some(coding), None) if coding.as_bytes().eq_ignore_ascii_case(b"chunked") => headers
            .contains_key(header::CONTENT_LENGTH)
            .then_some("ambiguous message framing: both Transfer-Encoding and Content-Length"),
        (Some(_), _) => Some(CODING),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_a_name_address_or_literal_and_an_optional_port() {
        for host in [
            "a.example",
            "a.example:8080",
            "a.example:",
            "127.0.0.1:80",
            "[::1]",
            "[::1]:8080",
            "[v1.x]",
            "a%2Db",
            "a,b",
            "",
        ] {
            assert!(is_host_and_port(host.as_bytes()), "{host}");
        }
        for host in [
            "a/b", "a b", "user@a", "a:b", "a:80:90", "a:+80", "::1", "[::1", "[::1]x", "[]",
            "[::1]:x", "a[b]", "a]", "a\\b",
        ] {
            assert!(!is_host_and_port(host.as_bytes()), "{host}");
        }
    }
}
