//! Key extraction from any header value and any body: a key within the limit
//! that is UTF-8 text without NUL, no key, or an error; never a panic. Its
//! `X-Dedupe-Key` value is visible ASCII whatever control characters it
//! holds.
#![no_main]

use bytes::Bytes;
use dedupe_proxy::config::KeyConfig;
use dedupe_proxy::key::KeySource;
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

const MAX_KEY_BYTES: usize = 64;

fuzz_target!(|input: (&[u8], &[u8], bool)| {
    let (header, body, from_json) = input;
    let config = if from_json {
        KeyConfig { header: None, json: Some("/data/id".into()) }
    } else {
        KeyConfig { header: Some("x-event-id".into()), json: None }
    };
    let source = KeySource::from_config(&config).expect("valid key config");
    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::from_bytes(header) {
        headers.insert("x-event-id", value);
    }
    if let Ok(Some(key)) = source.extract(&headers, &Bytes::copy_from_slice(body), MAX_KEY_BYTES) {
        assert!(!key.is_empty() && key.len() <= MAX_KEY_BYTES);
        assert!(!key.contains('\0'));
        let encoded = dedupe_proxy::key::header_value(key.as_bytes());
        assert!(encoded.to_str().is_ok(), "the X-Dedupe-Key value is visible ASCII");
    }
});
