//! Idempotency-key extraction: from a header or a JSON pointer into the body.
//! Owns the rules of SPEC section 8 ("Keys"); does not decide what a missing
//! key means (the route's `on_missing_key` does).

use std::collections::HashMap;

use bytes::Bytes;
use http::{HeaderMap, HeaderName};
use serde_json::value::RawValue;

use crate::config::KeyConfig;

/// Where a route reads its key.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// The first of these headers with a non-empty value.
    Header(Vec<HeaderName>),
    /// A JSON pointer into the body.
    Json(String),
}

/// Why a request's key cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The route reads a JSON key and the body is not JSON.
    #[error("body is not valid JSON: {0}")]
    NotJson(String),
    /// The key's header field appears more than once: the proxy and the
    /// application could each take a different one for the key.
    #[error("the `{0}` header appears more than once")]
    Repeated(HeaderName),
    /// The key is not UTF-8 text, or holds a NUL, which PostgreSQL's text
    /// cannot store (and SQLite keeps the same rules).
    #[error("key must be UTF-8 text without NUL characters")]
    NotText,
    /// The key is longer than `limits.max_key_bytes`.
    #[error("key is {len} bytes, longer than the {max}-byte limit")]
    TooLong {
        /// The key's length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

impl KeySource {
    /// Validates a route's `key:` block.
    pub fn from_config(config: &KeyConfig) -> Result<Self, String> {
        match (&config.header, &config.json) {
            (Some(header), None) => HeaderName::try_from(header.as_str())
                .map(|name| KeySource::Header(vec![name]))
                .map_err(|_| format!("`{header}` is not a valid header name")),
            (None, Some(pointer)) => {
                check_pointer(pointer, "/id")?;
                Ok(KeySource::Json(pointer.clone()))
            }
            _ => Err("set exactly one of `header` or `json`".into()),
        }
    }

    /// Where the key is looked for, as a sender without one is told.
    pub fn describe(&self) -> String {
        match self {
            KeySource::Header(names) => {
                let names: Vec<String> = names.iter().map(|name| format!("`{name}`")).collect();
                format!("a non-empty {} header", names.join(" or "))
            }
            KeySource::Json(pointer) => {
                format!("a non-empty string or a number at `{pointer}` in the JSON body")
            }
        }
    }

    /// The key of a request, `Ok(None)` when it has none, or why it is unusable.
    pub fn extract(
        &self,
        headers: &HeaderMap,
        body: &Bytes,
        max_len: usize,
    ) -> Result<Option<String>, KeyError> {
        let key = match self {
            KeySource::Header(names) => header_key(headers, names)?,
            KeySource::Json(pointer) => json_key(body, pointer)?,
        };
        let Some(key) = key else { return Ok(None) };
        if key.len() > max_len {
            return Err(KeyError::TooLong {
                len: key.len(),
                max: max_len,
            });
        }
        match String::from_utf8(key) {
            Ok(key) if !key.contains('\0') => Ok(Some(key)),
            _ => Err(KeyError::NotText),
        }
    }
}

fn header_key(headers: &HeaderMap, names: &[HeaderName]) -> Result<Option<Vec<u8>>, KeyError> {
    for name in names {
        let mut values = headers.get_all(name).iter();
        let Some(value) = values.next() else { continue };
        if values.next().is_some() {
            return Err(KeyError::Repeated(name.clone()));
        }
        if !value.is_empty() {
            return Ok(Some(value.as_bytes().to_vec()));
        }
    }
    Ok(None)
}

fn json_key(body: &[u8], pointer: &str) -> Result<Option<Vec<u8>>, KeyError> {
    let not_json = |error: serde_json::Error| KeyError::NotJson(error.to_string());
    if nests_deeper_than(body, MAX_NESTING) {
        return Err(KeyError::NotJson(format!(
            "arrays and objects nest more than {MAX_NESTING} deep"
        )));
    }
    let document: &RawValue = serde_json::from_slice(body).map_err(not_json)?;
    let Some(value) = pointed_at(document, pointer).map_err(not_json)? else {
        return Ok(None);
    };
    // Told apart by their raw text, not parsed into a `Value`: with the
    // `arbitrary_precision` feature, serde_json reads the object
    // `{"$serde_json::private::Number":"42"}` as the number 42, and a
    // sender could make an object collide with another event's key.
    let text = value.get();
    Ok(match text.as_bytes()[0] {
        b'"' => Some(serde_json::from_str::<String>(text).map_err(not_json)?)
            .filter(|text| !text.is_empty())
            .map(String::into_bytes),
        b'-' | b'0'..=b'9' => Some(
            serde_json::from_str::<serde_json::Number>(text)
                .map_err(not_json)?
                .to_string()
                .into_bytes(),
        ),
        _ => None,
    })
}

/// How deep a keyed body's arrays and objects may nest. A body past it is
/// refused rather than passed to an application whose parser might recurse
/// once per level; real webhook payloads nest a handful of levels.
const MAX_NESTING: usize = 128;

/// Whether the arrays and objects of `body` (JSON or not) nest more than
/// `limit` deep, brackets inside strings not counted.
fn nests_deeper_than(body: &[u8], limit: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &byte in body {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// The value a JSON pointer (RFC 6901) points at, walking the raw document:
/// only the objects and arrays on the pointer's path are opened. Of an
/// object's repeated member names the last counts, as serde_json's `Value`
/// has it.
fn pointed_at<'a>(
    document: &'a RawValue,
    pointer: &str,
) -> Result<Option<&'a RawValue>, serde_json::Error> {
    let mut value = document;
    for token in pointer.split('/').skip(1) {
        let token = token.replace("~1", "/").replace("~0", "~");
        let next = match value.get().as_bytes()[0] {
            b'{' => serde_json::from_str::<HashMap<String, &RawValue>>(value.get())?.remove(&token),
            b'[' => match array_index(&token) {
                Some(index) => serde_json::from_str::<Vec<&RawValue>>(value.get())?
                    .get(index)
                    .copied(),
                None => None,
            },
            _ => None,
        };
        match next {
            Some(next) => value = next,
            None => return Ok(None),
        }
    }
    Ok(Some(value))
}

/// An array index token: decimal digits without a leading zero (RFC 6901).
fn array_index(token: &str) -> Option<usize> {
    let well_formed = token.bytes().all(|byte| byte.is_ascii_digit())
        && (token == "0" || !token.starts_with('0'));
    well_formed.then(|| token.parse().ok()).flatten()
}

/// Whether `pointer` is a JSON pointer (RFC 6901) into a document: it
/// starts with `/`, and every `~` is followed by `0` or `1`. `example` names
/// a typical pointer for the message.
pub fn check_pointer(pointer: &str, example: &str) -> Result<(), String> {
    if !pointer.starts_with('/') {
        return Err(format!(
            "json: `{pointer}` is not a JSON pointer (it must start with `/`, e.g. {example})"
        ));
    }
    let mut tildes = pointer.match_indices('~');
    if tildes.any(|(at, _)| !matches!(pointer.as_bytes().get(at + 1), Some(b'0' | b'1'))) {
        return Err(format!(
            "json: `{pointer}` is not a JSON pointer (`~` must be followed by 0 or 1: `~0` is `~`, `~1` is `/`)"
        ));
    }
    Ok(())
}

/// The key as sent upstream in `X-Dedupe-Key`: bytes outside visible ASCII
/// (and `%` itself) percent-encoded, so any key fits a header value.
pub fn header_value(key: &[u8]) -> http::HeaderValue {
    const NOT_VISIBLE: &percent_encoding::AsciiSet =
        &percent_encoding::CONTROLS.add(b' ').add(b'%').add(0x7f);
    let encoded = percent_encoding::percent_encode(key, NOT_VISIBLE).to_string();
    http::HeaderValue::try_from(encoded).expect("percent-encoded text is a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_key_is_described_by_where_it_is_looked_for() {
        assert_eq!(
            header("X-Event-Id").describe(),
            "a non-empty `x-event-id` header"
        );
        let either = KeySource::Header(vec![
            HeaderName::from_static("webhook-id"),
            HeaderName::from_static("svix-id"),
        ]);
        assert_eq!(
            either.describe(),
            "a non-empty `webhook-id` or `svix-id` header"
        );
        assert_eq!(
            KeySource::Json("/event/id".into()).describe(),
            "a non-empty string or a number at `/event/id` in the JSON body"
        );
    }

    fn header(name: &str) -> KeySource {
        KeySource::from_config(&KeyConfig {
            header: Some(name.into()),
            json: None,
        })
        .unwrap()
    }

    fn json(pointer: &str) -> KeySource {
        KeySource::from_config(&KeyConfig {
            header: None,
            json: Some(pointer.into()),
        })
        .unwrap()
    }

    fn from_body(source: &KeySource, body: &str) -> Result<Option<String>, KeyError> {
        source.extract(&HeaderMap::new(), &Bytes::from(body.to_owned()), 256)
    }

    #[test]
    fn header_key_is_the_value_verbatim() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-event-id",
            http::HeaderValue::from_bytes("evt 1/ä".as_bytes()).unwrap(),
        );
        let key = header("X-Event-Id")
            .extract(&headers, &Bytes::new(), 256)
            .unwrap();
        assert_eq!(key.as_deref(), Some("evt 1/ä"));
    }

    #[test]
    fn a_repeated_key_header_is_refused() {
        let mut headers = HeaderMap::new();
        headers.append("x-event-id", "a".parse().unwrap());
        headers.append("x-event-id", "b".parse().unwrap());
        assert_eq!(
            header("X-Event-Id").extract(&headers, &Bytes::new(), 256),
            Err(KeyError::Repeated(HeaderName::from_static("x-event-id")))
        );
        // Only the field the key is taken from counts.
        let fallback = KeySource::Header(vec![
            HeaderName::from_static("x-event-id"),
            HeaderName::from_static("x-webhook-id"),
        ]);
        let mut headers = HeaderMap::new();
        headers.insert("x-event-id", "evt".parse().unwrap());
        headers.append("x-webhook-id", "w1".parse().unwrap());
        headers.append("x-webhook-id", "w2".parse().unwrap());
        assert_eq!(
            fallback.extract(&headers, &Bytes::new(), 256),
            Ok(Some("evt".into()))
        );
    }

    #[test]
    fn empty_or_absent_header_is_no_key() {
        let mut headers = HeaderMap::new();
        assert_eq!(
            header("X-Event-Id").extract(&headers, &Bytes::new(), 256),
            Ok(None)
        );
        headers.insert("x-event-id", "".parse().unwrap());
        assert_eq!(
            header("X-Event-Id").extract(&headers, &Bytes::new(), 256),
            Ok(None)
        );
    }

    #[test]
    fn json_strings_and_numbers_are_keys() {
        assert_eq!(
            from_body(&json("/id"), r#"{"id":"evt_1"}"#),
            Ok(Some("evt_1".into()))
        );
        assert_eq!(
            from_body(&json("/data/n"), r#"{"data":{"n":42}}"#),
            Ok(Some("42".into()))
        );
        assert_eq!(
            from_body(&json("/a~1b"), r#"{"a/b":"x"}"#),
            Ok(Some("x".into()))
        );
    }

    #[test]
    fn a_numeric_key_keeps_the_digits_it_was_sent_with() {
        for id in ["12345678901234567890123", "12345678901234567890124", "1.50"] {
            assert_eq!(
                from_body(&json("/id"), &format!(r#"{{"id":{id}}}"#)),
                Ok(Some(id.into()))
            );
        }
    }

    #[test]
    fn an_exponent_is_written_as_the_parser_normalizes_it() {
        for id in ["2685e3", "2685E+3", "2685e+3"] {
            assert_eq!(
                from_body(&json("/id"), &format!(r#"{{"id":{id}}}"#)),
                Ok(Some("2685e+3".into())),
                "{id}"
            );
        }
        assert_eq!(
            from_body(&json("/id"), r#"{"id":-1.5E-7}"#),
            Ok(Some("-1.5e-7".into()))
        );
    }

    #[test]
    fn other_json_values_are_no_key() {
        for body in [
            r#"{"id":""}"#,
            r#"{"id":null}"#,
            r#"{"id":true}"#,
            r#"{"id":{}}"#,
            r#"{"id":[1]}"#,
            r#"{}"#,
            "[]",
        ] {
            assert_eq!(from_body(&json("/id"), body), Ok(None), "{body}");
        }
    }

    #[test]
    fn an_object_spelled_like_serde_jsons_number_token_is_no_key() {
        for body in [
            r#"{"id":{"$serde_json::private::Number":"42"}}"#,
            r#"{"id":{"\u0024serde_json::private::Number":"42"}}"#,
        ] {
            assert_eq!(from_body(&json("/id"), body), Ok(None), "{body}");
        }
        assert_eq!(
            from_body(
                &json("/id/$serde_json::private::Number"),
                r#"{"id":{"$serde_json::private::Number":"42"}}"#
            ),
            Ok(Some("42".into())),
            "a string member is a key like any other"
        );
    }

    #[test]
    fn pointers_walk_objects_and_arrays_as_rfc_6901_has_it() {
        let body = r#"{"data":[{"id":"a"},{"id":"b"}],"i\u0064":"escaped","~/":"t","x":1,"x":2}"#;
        for (pointer, key) in [
            ("/data/1/id", Some("b")),
            ("/data/0/id", Some("a")),
            ("/data/2/id", None),
            ("/data/01/id", None),
            ("/data/-/id", None),
            ("/data/+1/id", None),
            ("/data/id", None),
            ("/id", Some("escaped")),
            ("/~0~1", Some("t")),
            ("/x", Some("2")),
            ("/x/y", None),
            ("/missing/y", None),
        ] {
            assert_eq!(
                from_body(&json(pointer), body),
                Ok(key.map(String::from)),
                "{pointer}"
            );
        }
    }

    #[test]
    fn whitespace_around_values_is_no_part_of_them() {
        let body = " {\n \"id\" : \"x\" ,\t\"n\" : [ 1 , { \"m\" : -2.5 } ] } \n";
        assert_eq!(from_body(&json("/id"), body), Ok(Some("x".into())));
        assert_eq!(from_body(&json("/n/1/m"), body), Ok(Some("-2.5".into())));
    }

    #[test]
    fn a_key_that_is_not_valid_text_makes_the_body_not_json() {
        assert!(matches!(
            from_body(&json("/id"), r#"{"id":"\ud800"}"#),
            Err(KeyError::NotJson(_))
        ));
    }

    #[test]
    fn arrays_and_objects_nest_at_most_128_deep() {
        let nested = |depth: usize| {
            format!(
                r#"{{"id":"evt_1","n":{}"[{{\"]"{}}}"#,
                "[".repeat(depth - 1),
                "]".repeat(depth - 1)
            )
        };
        assert_eq!(
            from_body(&json("/id"), &nested(128)),
            Ok(Some("evt_1".into()))
        );
        assert!(matches!(
            from_body(&json("/id"), &nested(129)),
            Err(KeyError::NotJson(_))
        ));
    }

    #[test]
    fn pointers_with_a_stray_tilde_are_refused() {
        for pointer in ["/a~2b", "/a~", "/~/x"] {
            let error = check_pointer(pointer, "/id").unwrap_err();
            assert!(error.contains("`~` must be followed by 0 or 1"), "{error}");
        }
        assert_eq!(check_pointer("/a~0~1b/0", "/id"), Ok(()));
    }

    #[test]
    fn non_json_body_is_an_error() {
        assert!(matches!(
            from_body(&json("/id"), "id=1"),
            Err(KeyError::NotJson(_))
        ));
        let deep = "[".repeat(10_000);
        assert!(matches!(
            from_body(&json("/id"), &deep),
            Err(KeyError::NotJson(_))
        ));
    }

    #[test]
    fn keys_must_be_text_without_nul_and_may_hold_other_control_characters() {
        assert_eq!(
            from_body(&json("/id"), r#"{"id":"a\u0000b"}"#),
            Err(KeyError::NotText)
        );
        assert_eq!(
            from_body(&json("/id"), r#"{"id":"a\nb\t\u001b\u007f"}"#),
            Ok(Some("a\nb\t\u{1b}\u{7f}".to_owned()))
        );
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-event-id",
            http::HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
        );
        assert_eq!(
            header("X-Event-Id").extract(&headers, &Bytes::new(), 256),
            Err(KeyError::NotText)
        );
        headers.insert("x-event-id", http::HeaderValue::from_static("a\tb"));
        assert_eq!(
            header("X-Event-Id").extract(&headers, &Bytes::new(), 256),
            Ok(Some("a\tb".to_owned()))
        );
    }

    #[test]
    fn long_keys_are_rejected() {
        let body = format!(r#"{{"id":"{}"}}"#, "k".repeat(300));
        assert_eq!(
            from_body(&json("/id"), &body),
            Err(KeyError::TooLong { len: 300, max: 256 })
        );
    }

    #[test]
    fn config_errors_are_explained() {
        let both = KeyConfig {
            header: Some("X".into()),
            json: Some("/id".into()),
        };
        assert!(KeySource::from_config(&both).is_err());
        let bad_pointer = KeyConfig {
            header: None,
            json: Some("id".into()),
        };
        assert!(
            KeySource::from_config(&bad_pointer)
                .unwrap_err()
                .contains("JSON pointer")
        );
        let bad_header = KeyConfig {
            header: Some("bad header".into()),
            json: None,
        };
        assert!(KeySource::from_config(&bad_header).is_err());
    }

    #[test]
    fn header_value_percent_encodes_invisible_bytes() {
        assert_eq!(header_value(b"evt_1").to_str().unwrap(), "evt_1");
        assert_eq!(
            header_value("a b\n%ä".as_bytes()).to_str().unwrap(),
            "a%20b%0A%25%C3%A4"
        );
    }
}
