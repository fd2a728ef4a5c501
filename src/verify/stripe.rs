//! Stripe: `Stripe-Signature: t=<unix seconds>,v1=<hex>[,v1=<hex>…][,v0=…]`,
//! an HMAC-SHA256 of `<t>.<body>` keyed with the whole `whsec_…` secret
//! string, as Stripe's libraries use it. Several `v1` entries appear while a
//! secret is being rolled; any of them matching any secret is enough. `v0`
//! (test-mode legacy) and unknown entries are ignored.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName};

use super::headers::{check_timestamp, entries, header, malformed};
use super::{VerifyError, hmac_sha256, match_any};
use crate::secret::Secret;

const SIGNATURE: HeaderName = HeaderName::from_static("stripe-signature");

pub(super) fn verify(
    headers: &HeaderMap,
    body: &[u8],
    secrets: &[Secret],
    tolerance: Duration,
    now: SystemTime,
) -> Result<(), VerifyError> {
    let value = header(headers, &SIGNATURE)?;
    let (timestamp, signatures) = parse(value)?;
    check_timestamp(timestamp, &SIGNATURE, tolerance, now)?;
    match_any(secrets, &signatures, |secret| {
        Some(hmac_sha256(
            secret.expose(),
            &[timestamp.as_bytes(), b".", body],
        ))
    })
}

/// The timestamp text and the decoded `v1` signatures. A `v1` that is not
/// hex cannot match and is skipped; a header left with no `t` or no usable
/// `v1` is malformed.
fn parse(value: &str) -> Result<(&str, Vec<Vec<u8>>), VerifyError> {
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for entry in entries(value, ',', &SIGNATURE)? {
        match entry.split_once('=') {
            Some(("t", text)) if timestamp.is_none() => timestamp = Some(text),
            Some(("v1", hex)) => signatures.extend(hex::decode(hex).ok()),
            _ => {}
        }
    }
    signatures.retain(|signature| !signature.is_empty());
    match timestamp {
        Some(timestamp) if !signatures.is_empty() => Ok((timestamp, signatures)),
        _ => Err(malformed(&SIGNATURE)),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Scheme;
    use super::super::testing::{at, headers, refuses_hostile_values, requires_headers, secrets};
    use super::*;

    // Stripe publishes no fixed vector (its libraries' tests sign at run
    // time). Computed independently with Python's hmac module:
    // hmac.new(SECRET, b"1686089970." + BODY, hashlib.sha256).hexdigest()
    const SECRET: &str = "whsec_test_secret_for_dedupe_proxy";
    const BODY: &[u8] =
        br#"{"id":"evt_1NG8Du2eZvKYlo2CUI79vXWy","object":"event","type":"payment_intent.succeeded"}"#;
    const TIMESTAMP: u64 = 1_686_089_970;
    const SIGNATURE_HEX: &str = "6b1b240788264ca7a513e96a59c8fc296f5eef17a491274be89c17b5c6dc1a22";
    const TOLERANCE: Duration = Duration::from_secs(300);

    fn signed(value: &str) -> HeaderMap {
        headers(&[("stripe-signature", value)])
    }

    fn valid() -> HeaderMap {
        signed(&format!("t={TIMESTAMP},v1={SIGNATURE_HEX}"))
    }

    fn check(request: &HeaderMap, body: &[u8], keys: &[&str], now: u64) -> Result<(), VerifyError> {
        Scheme::Stripe.check(request, body, &secrets(keys), TOLERANCE, at(now))
    }

    /// A header as Stripe would send it, signed by `secret` at `t`.
    fn sign(secret: &str, t: u64, body: &[u8]) -> String {
        let mac = hmac_sha256(secret.as_bytes(), &[t.to_string().as_bytes(), b".", body]);
        format!("t={t},v1={}", hex::encode(mac))
    }

    #[test]
    fn known_answer() {
        assert_eq!(check(&valid(), BODY, &[SECRET], TIMESTAMP), Ok(()));
        assert_eq!(
            sign(SECRET, TIMESTAMP, BODY),
            format!("t={TIMESTAMP},v1={SIGNATURE_HEX}")
        );
    }

    #[test]
    fn the_key_is_the_whole_whsec_string() {
        let without_prefix = SECRET.trim_start_matches("whsec_");
        let result = check(&valid(), BODY, &[without_prefix], TIMESTAMP);
        assert_eq!(result, Err(VerifyError::NoMatch));
    }

    #[test]
    fn tampered_body_and_wrong_secret_are_refused() {
        let mut tampered = BODY.to_vec();
        tampered.push(b' ');
        assert_eq!(
            check(&valid(), &tampered, &[SECRET], TIMESTAMP),
            Err(VerifyError::NoMatch)
        );
        assert_eq!(
            check(&valid(), BODY, &["whsec_other"], TIMESTAMP),
            Err(VerifyError::NoMatch)
        );
        let shifted = signed(&format!("t={},v1={SIGNATURE_HEX}", TIMESTAMP + 1));
        assert_eq!(
            check(&shifted, BODY, &[SECRET], TIMESTAMP),
            Err(VerifyError::NoMatch)
        );
    }

    #[test]
    fn any_v1_matching_any_secret_passes() {
        let rotated = check(&valid(), BODY, &["whsec_old", SECRET], TIMESTAMP);
        assert_eq!(rotated, Ok(()));
        let old = sign("whsec_old", TIMESTAMP, BODY);
        let old_v1 = old.split_once(",v1=").unwrap().1;
        let two = signed(&format!(
            "t={TIMESTAMP},v1={old_v1},v1={SIGNATURE_HEX},v0=abc"
        ));
        assert_eq!(check(&two, BODY, &[SECRET], TIMESTAMP), Ok(()));
        assert_eq!(check(&two, BODY, &["whsec_old"], TIMESTAMP), Ok(()));
        let v0_only = signed(&format!("t={TIMESTAMP},v0={SIGNATURE_HEX}"));
        let result = check(&v0_only, BODY, &[SECRET], TIMESTAMP);
        assert_eq!(result, Err(VerifyError::MalformedHeader(SIGNATURE)));
    }

    #[test]
    fn stale_and_future_timestamps_are_refused_the_boundary_is_not() {
        let request = valid();
        assert_eq!(check(&request, BODY, &[SECRET], TIMESTAMP + 300), Ok(()));
        assert_eq!(check(&request, BODY, &[SECRET], TIMESTAMP - 300), Ok(()));
        let late = check(&request, BODY, &[SECRET], TIMESTAMP + 301);
        assert_eq!(late, Err(VerifyError::OutsideTolerance));
        let early = check(&request, BODY, &[SECRET], TIMESTAMP - 301);
        assert_eq!(early, Err(VerifyError::OutsideTolerance));
    }

    #[test]
    fn missing_and_malformed_headers_are_refused() {
        let keys = secrets(&[SECRET]);
        requires_headers(
            &Scheme::Stripe,
            &valid(),
            &["stripe-signature"],
            BODY,
            &keys,
            at(TIMESTAMP),
        );
        refuses_hostile_values(
            &Scheme::Stripe,
            &valid(),
            &["stripe-signature"],
            BODY,
            &keys,
            at(TIMESTAMP),
        );
        for value in [
            format!("v1={SIGNATURE_HEX}"),
            format!("t={TIMESTAMP}"),
            format!("t=abc,v1={SIGNATURE_HEX}"),
            format!("t={TIMESTAMP},v1=not-hex"),
            format!("t={TIMESTAMP};v1={SIGNATURE_HEX}"),
            format!("t = {TIMESTAMP}, v1 = {SIGNATURE_HEX}"),
            format!("t={TIMESTAMP},{}", "v1=00,".repeat(40)),
        ] {
            let result = check(&signed(&value), BODY, &[SECRET], TIMESTAMP);
            assert!(
                matches!(result, Err(VerifyError::MalformedHeader(_))),
                "{value}: {result:?}"
            );
        }
    }
}
