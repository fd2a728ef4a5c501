//! Every signature scheme against arbitrary header values and bodies: a
//! verdict, never a panic, and never an acceptance of input signed with
//! nothing but guesses.
#![no_main]

use std::time::{Duration, UNIX_EPOCH};

use dedupe_proxy::secret::Secret;
use dedupe_proxy::verify::{Algorithm, BodyHmac, Encoding, Scheme, SignatureConfig};
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;

const HEADERS: [&str; 11] = [
    "stripe-signature",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "svix-signature",
    "x-slack-signature",
    "x-slack-request-timestamp",
    "x-hub-signature-256",
    "x-shopify-hmac-sha256",
    "x-custom-signature",
    "x-custom-timestamp",
];

fuzz_target!(|input: (Vec<(u8, Vec<u8>)>, &[u8], u32)| {
    let (fields, body, clock) = input;
    let mut headers = HeaderMap::new();
    for (which, value) in fields {
        let name = HeaderName::from_static(HEADERS[usize::from(which) % HEADERS.len()]);
        if let Ok(value) = HeaderValue::from_bytes(&value) {
            headers.append(name, value);
        }
    }
    let custom = SignatureConfig {
        header: "x-custom-signature".into(),
        algorithm: Algorithm::HmacSha1,
        encoding: Encoding::Base64,
        prefix: "sha1=".into(),
        timestamp_header: None,
        signed_payload: None,
    };
    let timestamped = SignatureConfig {
        header: "x-custom-signature".into(),
        algorithm: Algorithm::HmacSha256,
        encoding: Encoding::Hex,
        prefix: "v0=".into(),
        timestamp_header: Some("x-custom-timestamp".into()),
        signed_payload: Some("v0:{timestamp}:{body}".into()),
    };
    let schemes = [
        Scheme::Stripe,
        Scheme::StandardWebhooks,
        Scheme::slack(),
        Scheme::github(),
        Scheme::shopify(),
        Scheme::Body(BodyHmac::from_config(&custom).expect("valid scheme")),
        Scheme::Body(BodyHmac::from_config(&timestamped).expect("valid scheme")),
    ];
    let secrets = [Secret::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")];
    let now = UNIX_EPOCH + Duration::from_secs(u64::from(clock));
    for scheme in &schemes {
        // A random input matching a real HMAC would be a forgery.
        assert!(scheme.check(&headers, body, &secrets, Duration::from_secs(300), now).is_err());
    }
});
