//! Helpers shared by the signature schemes' tests.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};

use super::{Scheme, VerifyError};
use crate::secret::Secret;

/// `seconds` after the Unix epoch.
pub(super) fn at(seconds: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(seconds)
}

/// Headers from name/value pairs (later pairs with the same name are added).
pub(super) fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(
            HeaderName::try_from(*name).unwrap(),
            HeaderValue::try_from(*value).unwrap(),
        );
    }
    map
}

pub(super) fn secrets(texts: &[&str]) -> Vec<Secret> {
    texts.iter().map(|text| Secret::new(*text)).collect()
}

/// Values no well-behaved sender produces: each must be refused, not panic.
pub(super) fn hostile_values() -> Vec<HeaderValue> {
    let texts = [
        String::from(","),
        String::from("="),
        String::from(" "),
        String::from("t="),
        String::from("v1="),
        String::from("v1,"),
        String::from("v0="),
        String::from("sha256="),
        String::from("t=1,v1=zz"),
        String::from("v1,!!!"),
        "a".repeat(8 * 1024 + 1),
        "v1=00,".repeat(2000),
        "v1,AAAA ".repeat(1000),
        "t=1,".repeat(1000),
        "=".repeat(4000),
        "\u{7f}".repeat(3),
    ];
    let mut values: Vec<HeaderValue> = texts
        .iter()
        .filter_map(|text| HeaderValue::try_from(text.as_str()).ok())
        .collect();
    values.push(HeaderValue::from_bytes(b"\xff\xfe\x80").unwrap());
    values.push(HeaderValue::from_bytes(b"t=1\xff,v1=\xc3").unwrap());
    values
}

/// Replaces each of `names` in `valid` by every hostile value in turn and
/// checks that `scheme` refuses the request without panicking.
pub(super) fn refuses_hostile_values(
    scheme: &Scheme,
    valid: &HeaderMap,
    names: &[&str],
    body: &[u8],
    secrets: &[Secret],
    now: SystemTime,
) {
    for name in names {
        for value in hostile_values() {
            let mut request = valid.clone();
            request.insert(HeaderName::try_from(*name).unwrap(), value.clone());
            let result = scheme.check(&request, body, secrets, Duration::from_secs(300), now);
            assert!(result.is_err(), "{name}: {value:?} was accepted");
        }
    }
}

/// Checks that removing each of `names` gives `MissingHeader`.
pub(super) fn requires_headers(
    scheme: &Scheme,
    valid: &HeaderMap,
    names: &[&str],
    body: &[u8],
    secrets: &[Secret],
    now: SystemTime,
) {
    for name in names {
        let mut request = valid.clone();
        request.remove(*name);
        let result = scheme.check(&request, body, secrets, Duration::from_secs(300), now);
        assert!(
            matches!(result, Err(VerifyError::MissingHeader(_))),
            "without {name}: {result:?}"
        );
    }
}
