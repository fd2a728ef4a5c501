//! Slack: `X-Slack-Signature: v0=<hex>`, an HMAC-SHA256 of
//! `v0:<timestamp>:<body>` keyed with the app's signing secret, where the
//! timestamp is `X-Slack-Request-Timestamp`. The scheme is a timestamped
//! one-header MAC ([`super::body::BodyHmac::slack`]); these are its checks
//! against Slack's documented example.

use std::time::Duration;

use http::{HeaderMap, HeaderName};

use super::testing::{at, headers, refuses_hostile_values, requires_headers, secrets};
use super::{Scheme, VerifyError};

const SIGNATURE: HeaderName = HeaderName::from_static("x-slack-signature");

// Slack's documented example ("Verifying requests from Slack").
const SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";
const TIMESTAMP_SECS: u64 = 1_531_420_618;
const BODY: &[u8] = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
const SIGNATURE_VALUE: &str = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503";
const TOLERANCE: Duration = Duration::from_secs(300);

fn request(timestamp: u64, signature: &str) -> HeaderMap {
    let timestamp = timestamp.to_string();
    headers(&[
        ("x-slack-request-timestamp", &timestamp),
        ("x-slack-signature", signature),
    ])
}

fn valid() -> HeaderMap {
    request(TIMESTAMP_SECS, SIGNATURE_VALUE)
}

fn check(request: &HeaderMap, body: &[u8], keys: &[&str], now: u64) -> Result<(), VerifyError> {
    Scheme::slack().check(request, body, &secrets(keys), TOLERANCE, at(now))
}

#[test]
fn known_answer() {
    assert_eq!(check(&valid(), BODY, &[SECRET], TIMESTAMP_SECS), Ok(()));
}

#[test]
fn tampering_and_wrong_secrets_are_refused() {
    let tampered = [BODY, b"&x=1"].concat();
    assert_eq!(
        check(&valid(), &tampered, &[SECRET], TIMESTAMP_SECS),
        Err(VerifyError::NoMatch)
    );
    assert_eq!(
        check(
            &valid(),
            BODY,
            &["8f742231b10e8888abcd99yyyzzz85a6"],
            TIMESTAMP_SECS
        ),
        Err(VerifyError::NoMatch)
    );
    let shifted = request(TIMESTAMP_SECS + 1, SIGNATURE_VALUE);
    assert_eq!(
        check(&shifted, BODY, &[SECRET], TIMESTAMP_SECS),
        Err(VerifyError::NoMatch)
    );
}

#[test]
fn a_rotated_secret_is_accepted() {
    assert_eq!(
        check(&valid(), BODY, &["new-secret", SECRET], TIMESTAMP_SECS),
        Ok(())
    );
}

#[test]
fn stale_and_future_timestamps_are_refused_the_boundary_is_not() {
    assert_eq!(
        check(&valid(), BODY, &[SECRET], TIMESTAMP_SECS + 300),
        Ok(())
    );
    assert_eq!(
        check(&valid(), BODY, &[SECRET], TIMESTAMP_SECS - 300),
        Ok(())
    );
    assert_eq!(
        check(&valid(), BODY, &[SECRET], TIMESTAMP_SECS + 301),
        Err(VerifyError::OutsideTolerance)
    );
    assert_eq!(
        check(&valid(), BODY, &[SECRET], TIMESTAMP_SECS - 301),
        Err(VerifyError::OutsideTolerance)
    );
}

#[test]
fn missing_and_malformed_headers_are_refused() {
    let names = ["x-slack-request-timestamp", "x-slack-signature"];
    let (scheme, keys, now) = (Scheme::slack(), secrets(&[SECRET]), at(TIMESTAMP_SECS));
    requires_headers(&scheme, &valid(), &names, BODY, &keys, now);
    refuses_hostile_values(&scheme, &valid(), &names, BODY, &keys, now);
    let bare = SIGNATURE_VALUE.trim_start_matches("v0=");
    for signature in [bare, "v1=a2114d57", "v0=", "v0=xyz"] {
        let result = check(
            &request(TIMESTAMP_SECS, signature),
            BODY,
            &[SECRET],
            TIMESTAMP_SECS,
        );
        assert_eq!(
            result,
            Err(VerifyError::MalformedHeader(SIGNATURE)),
            "{signature}"
        );
    }
}
