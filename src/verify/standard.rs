//! Standard Webhooks (Svix): headers `webhook-id`, `webhook-timestamp` and
//! `webhook-signature`, or Svix's `svix-` names when the `webhook-` ones are
//! absent. The signature header holds space-separated `v1,<base64>` entries,
//! each an HMAC-SHA256 of `<id>.<timestamp>.<body>` keyed with the base64
//! after the secret's `whsec_` prefix. Other versions (such as the asymmetric
//! `v1a`) are ignored.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use http::{HeaderMap, HeaderName};

use super::headers::{check_timestamp, entries, first_header, malformed};
use super::{VerifyError, hmac_sha256, match_any};
use crate::secret::Secret;

const ID: HeaderName = HeaderName::from_static("webhook-id");
const TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
const SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");
const SVIX_ID: HeaderName = HeaderName::from_static("svix-id");
const SVIX_TIMESTAMP: HeaderName = HeaderName::from_static("svix-timestamp");
const SVIX_SIGNATURE: HeaderName = HeaderName::from_static("svix-signature");

const SECRET_PREFIX: &[u8] = b"whsec_";

/// Secrets are often pasted without their base64 padding; accept both.
const LENIENT_BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

pub(super) fn verify(
    headers: &HeaderMap,
    body: &[u8],
    secrets: &[Secret],
    tolerance: Duration,
    now: SystemTime,
) -> Result<(), VerifyError> {
    // The id is read the way the preset's key is (first non-empty of
    // webhook-id, svix-id), so the key that is claimed is the id that is signed.
    let (_, id) = first_header(headers, &ID, &[SVIX_ID])?;
    let (timestamp_header, timestamp) = first_header(headers, &TIMESTAMP, &[SVIX_TIMESTAMP])?;
    let signatures = signatures(first_header(headers, &SIGNATURE, &[SVIX_SIGNATURE])?)?;
    check_timestamp(timestamp, &timestamp_header, tolerance, now)?;
    match_any(secrets, &signatures, |secret| {
        let key = signing_key(secret)?;
        Some(hmac_sha256(
            &key,
            &[id.as_bytes(), b".", timestamp.as_bytes(), b".", body],
        ))
    })
}

/// The decoded `v1` signatures; a header with none is malformed.
fn signatures((name, value): (HeaderName, &str)) -> Result<Vec<Vec<u8>>, VerifyError> {
    let signatures: Vec<Vec<u8>> = entries(value, ' ', &name)?
        .into_iter()
        .filter_map(|entry| entry.strip_prefix("v1,"))
        .filter_map(|encoded| {
            base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .ok()
        })
        .filter(|signature| !signature.is_empty())
        .collect();
    if signatures.is_empty() {
        return Err(malformed(&name));
    }
    Ok(signatures)
}

/// The HMAC key of a `whsec_<base64>` secret (a secret without the prefix is
/// decoded as base64 too); `None` when it is not base64 or decodes to nothing.
pub(super) fn signing_key(secret: &Secret) -> Option<Vec<u8>> {
    let text = secret.expose();
    let encoded = text.strip_prefix(SECRET_PREFIX).unwrap_or(text);
    LENIENT_BASE64
        .decode(encoded)
        .ok()
        .filter(|key| !key.is_empty())
}

#[cfg(test)]
mod tests {
    use super::super::Scheme;
    use super::super::testing::{at, headers, refuses_hostile_values, requires_headers, secrets};
    use super::*;

    // From the standard-webhooks repository's library tests
    // (libraries/go/webhook_test.go, TestWebhookSign).
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const MSG_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TIMESTAMP: u64 = 1_614_265_330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SIGNATURE_VALUE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    // From the same repository's Rust library tests (libraries/rust/src/lib.rs,
    // test_sign).
    const RUST_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
    const RUST_MSG_ID: &str = "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk";
    const RUST_TIMESTAMP: u64 = 1_649_367_553;
    const RUST_BODY: &[u8] = br#"{"email":"test@example.com","username":"test_user"}"#;
    const RUST_SIGNATURE: &str = "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=";

    const TOLERANCE: Duration = Duration::from_secs(300);

    fn request(prefix: &str, id: &str, timestamp: u64, signature: &str) -> HeaderMap {
        let timestamp = timestamp.to_string();
        headers(&[
            (&format!("{prefix}-id"), id),
            (&format!("{prefix}-timestamp"), &timestamp),
            (&format!("{prefix}-signature"), signature),
        ])
    }

    fn valid() -> HeaderMap {
        request("webhook", MSG_ID, TIMESTAMP, SIGNATURE_VALUE)
    }

    fn check(request: &HeaderMap, body: &[u8], keys: &[&str], now: u64) -> Result<(), VerifyError> {
        Scheme::StandardWebhooks.check(request, body, &secrets(keys), TOLERANCE, at(now))
    }

    #[test]
    fn known_answers() {
        assert_eq!(check(&valid(), BODY, &[SECRET], TIMESTAMP), Ok(()));
        let rust = request("webhook", RUST_MSG_ID, RUST_TIMESTAMP, RUST_SIGNATURE);
        assert_eq!(
            check(&rust, RUST_BODY, &[RUST_SECRET], RUST_TIMESTAMP),
            Ok(())
        );
    }

    #[test]
    fn svix_names_and_unprefixed_secrets_work() {
        let svix = request("svix", MSG_ID, TIMESTAMP, SIGNATURE_VALUE);
        assert_eq!(check(&svix, BODY, &[SECRET], TIMESTAMP), Ok(()));
        let unprefixed = SECRET.trim_start_matches("whsec_");
        assert_eq!(check(&valid(), BODY, &[unprefixed], TIMESTAMP), Ok(()));
        let mut both = valid();
        both.insert("svix-id", "msg_other".parse().unwrap());
        assert_eq!(check(&both, BODY, &[SECRET], TIMESTAMP), Ok(()));
    }

    #[test]
    fn tampering_and_wrong_secrets_are_refused() {
        assert_eq!(
            check(&valid(), br#"{"test": 2432232315}"#, &[SECRET], TIMESTAMP),
            Err(VerifyError::NoMatch)
        );
        assert_eq!(
            check(&valid(), BODY, &[RUST_SECRET], TIMESTAMP),
            Err(VerifyError::NoMatch)
        );
        let other_id = request("webhook", "msg_other", TIMESTAMP, SIGNATURE_VALUE);
        assert_eq!(
            check(&other_id, BODY, &[SECRET], TIMESTAMP),
            Err(VerifyError::NoMatch)
        );
        let other_time = request("webhook", MSG_ID, TIMESTAMP + 1, SIGNATURE_VALUE);
        assert_eq!(
            check(&other_time, BODY, &[SECRET], TIMESTAMP),
            Err(VerifyError::NoMatch)
        );
    }

    #[test]
    fn any_entry_matching_any_secret_passes() {
        assert_eq!(
            check(&valid(), BODY, &[RUST_SECRET, SECRET], TIMESTAMP),
            Ok(())
        );
        let several = format!(
            "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc= v2,abc  {SIGNATURE_VALUE} v1a,xyz"
        );
        let request = request("webhook", MSG_ID, TIMESTAMP, &several);
        assert_eq!(check(&request, BODY, &[SECRET], TIMESTAMP), Ok(()));
    }

    #[test]
    fn stale_and_future_timestamps_are_refused_the_boundary_is_not() {
        assert_eq!(check(&valid(), BODY, &[SECRET], TIMESTAMP + 300), Ok(()));
        assert_eq!(check(&valid(), BODY, &[SECRET], TIMESTAMP - 300), Ok(()));
        assert_eq!(
            check(&valid(), BODY, &[SECRET], TIMESTAMP + 301),
            Err(VerifyError::OutsideTolerance)
        );
        assert_eq!(
            check(&valid(), BODY, &[SECRET], TIMESTAMP - 301),
            Err(VerifyError::OutsideTolerance)
        );
    }

    #[test]
    fn missing_and_malformed_headers_are_refused() {
        let names = ["webhook-id", "webhook-timestamp", "webhook-signature"];
        let keys = secrets(&[SECRET]);
        let scheme = Scheme::StandardWebhooks;
        requires_headers(&scheme, &valid(), &names, BODY, &keys, at(TIMESTAMP));
        refuses_hostile_values(&scheme, &valid(), &names[1..], BODY, &keys, at(TIMESTAMP));
        for signature in [
            "v1",
            "v1 g0hM9SsE",
            "v2,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
            "v1,@@@",
        ] {
            let request = request("webhook", MSG_ID, TIMESTAMP, signature);
            let result = check(&request, BODY, &[SECRET], TIMESTAMP);
            assert_eq!(
                result,
                Err(VerifyError::MalformedHeader(SIGNATURE)),
                "{signature}"
            );
        }
    }

    #[test]
    fn hostile_ids_are_refused() {
        // Any visible text is a valid id; hostile ids must still not pass.
        let keys = secrets(&[SECRET]);
        refuses_hostile_values(
            &Scheme::StandardWebhooks,
            &valid(),
            &["webhook-id"],
            BODY,
            &keys,
            at(TIMESTAMP),
        );
    }

    #[test]
    fn secrets_must_be_base64() {
        assert!(signing_key(&Secret::new(SECRET)).is_some());
        assert!(signing_key(&Secret::new("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD")).is_some());
        assert!(signing_key(&Secret::new("whsec_not base64")).is_none());
        assert!(signing_key(&Secret::new("whsec_")).is_none());
        assert_eq!(
            check(&valid(), BODY, &["whsec_***"], TIMESTAMP),
            Err(VerifyError::NoMatch)
        );
    }
}
