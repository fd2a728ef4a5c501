//! Webhook signature verification: the schemes of SPEC section 4 (Stripe,
//! Standard Webhooks/Svix, and one MAC in one header for GitHub, Shopify,
//! Slack and custom routes), each a pure function of the request's
//! headers and body, the route's secrets, a timestamp tolerance and the
//! current time. A request becomes [`Verified`] only through this module.
//!
//! Owns parsing signature headers defensively (size and entry caps, no
//! panics on any input) and comparing MACs in constant time. Does not decide
//! which route uses which scheme ([`crate::provider`] and the configuration
//! do) nor how a failure is answered (the proxy answers 401 with the error's
//! text, which names a header but never a secret or an expected value).

mod body;
mod headers;
#[cfg(test)]
mod slack;
mod standard;
mod stripe;
#[cfg(test)]
mod testing;

use std::time::{Duration, SystemTime};

use hmac::digest::KeyInit;
use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderName};
use subtle::ConstantTimeEq;

use crate::secret::Secret;

pub use body::{Algorithm, BodyHmac, Encoding, SignatureConfig};

/// How far a signed timestamp may be from the local clock, either way,
/// unless the route sets its own tolerance.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// Why a request's signature was not accepted. The text is short and safe to
/// send back in a 401 body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// A header the scheme needs is absent or empty.
    #[error("missing {0} header")]
    MissingHeader(HeaderName),
    /// A header is present but cannot be parsed (or is over the size caps).
    #[error("malformed {0} header")]
    MalformedHeader(HeaderName),
    /// The signed timestamp is further from now than the tolerance.
    #[error("signature timestamp outside tolerance")]
    OutsideTolerance,
    /// The header is well-formed but no signature matches any secret.
    #[error("no signature matched")]
    NoMatch,
}

/// A signature scheme, with everything about it that is not a secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheme {
    /// `Stripe-Signature: t=…,v1=…`: HMAC-SHA256 of `t.body`, hex.
    Stripe,
    /// `webhook-signature: v1,<base64> …` (or `svix-signature`): HMAC-SHA256
    /// of `id.timestamp.body` keyed with the base64 after `whsec_`.
    StandardWebhooks,
    /// One MAC in one header, of the body or of a payload around it and a
    /// timestamp: GitHub, Shopify, Slack, custom.
    Body(BodyHmac),
}

impl Scheme {
    /// GitHub's `X-Hub-Signature-256: sha256=<hex>`.
    pub fn github() -> Self {
        Scheme::Body(BodyHmac::github())
    }

    /// Shopify's `X-Shopify-Hmac-Sha256: <base64>`.
    pub fn shopify() -> Self {
        Scheme::Body(BodyHmac::shopify())
    }

    /// Slack's `X-Slack-Signature: v0=<hex>` of `v0:timestamp:body`.
    pub fn slack() -> Self {
        Scheme::Body(BodyHmac::slack())
    }

    /// Zoom's `x-zm-signature: v0=<hex>` of `v0:timestamp:body`.
    pub fn zoom() -> Self {
        Scheme::Body(BodyHmac::zoom())
    }

    /// Whether the signature covers a timestamp, which `tolerance` bounds.
    pub fn signs_a_timestamp(&self) -> bool {
        match self {
            Scheme::Stripe | Scheme::StandardWebhooks => true,
            Scheme::Body(scheme) => scheme.signs_a_timestamp(),
        }
    }

    /// Checks one request against every secret; `Ok` when any signature in
    /// the request matches any secret and its timestamp (for the schemes
    /// that sign one) is within `tolerance` of `now`.
    pub fn check(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        secrets: &[Secret],
        tolerance: Duration,
        now: SystemTime,
    ) -> Result<(), VerifyError> {
        match self {
            Scheme::Stripe => stripe::verify(headers, body, secrets, tolerance, now),
            Scheme::StandardWebhooks => standard::verify(headers, body, secrets, tolerance, now),
            Scheme::Body(scheme) => scheme.verify(headers, body, secrets, tolerance, now),
        }
    }

    /// Whether `secret` can key this scheme (Standard Webhooks secrets must
    /// be base64, optionally after `whsec_`).
    pub fn validate_secret(&self, secret: &Secret) -> Result<(), String> {
        match self {
            Scheme::StandardWebhooks => standard::signing_key(secret)
                .map(drop)
                .ok_or_else(|| "is not base64 (after an optional `whsec_`)".into()),
            _ => Ok(()),
        }
    }
}

/// Proof that a request's signature was checked: only [`Verifier::verify`]
/// and [`verify_route`] make one, so code that requires it cannot forward a
/// request whose signature was skipped. Neither `Clone` nor `Copy`: one
/// proof per request.
#[derive(Debug)]
#[must_use]
pub struct Verified {
    signed: bool,
}

impl Verified {
    /// Whether a signature was actually checked (`false` on routes with no
    /// secrets, see [`verify_route`]).
    pub fn signature_checked(&self) -> bool {
        self.signed
    }
}

/// A route's scheme with its resolved secrets and tolerance.
#[derive(Debug, Clone)]
pub struct Verifier {
    scheme: Scheme,
    secrets: Vec<Secret>,
    tolerance: Duration,
}

impl Verifier {
    /// A verifier accepting signatures by any of `secrets` (several allow
    /// rotation). Errors name the secret by its index in `secrets`, never
    /// by content.
    pub fn new(scheme: Scheme, secrets: Vec<Secret>, tolerance: Duration) -> Result<Self, String> {
        if secrets.is_empty() {
            return Err("secrets: at least one secret is needed to verify signatures".into());
        }
        for (index, secret) in secrets.iter().enumerate() {
            if secret.expose().is_empty() {
                return Err(format!("secrets[{index}]: is empty"));
            }
            scheme
                .validate_secret(secret)
                .map_err(|problem| format!("secrets[{index}]: {problem}"))?;
        }
        Ok(Self {
            scheme,
            secrets,
            tolerance,
        })
    }

    /// Checks a request's signature at time `now`.
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: SystemTime,
    ) -> Result<Verified, VerifyError> {
        self.scheme
            .check(headers, body, &self.secrets, self.tolerance, now)
            .map(|()| Verified { signed: true })
    }

    /// The scheme this verifier checks.
    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }

    /// How far a signed timestamp may be from now.
    pub fn tolerance(&self) -> Duration {
        self.tolerance
    }
}

/// Applies a route's signature policy: its verifier when it has one, or
/// nothing for a route configured without secrets.
pub fn verify_route(
    verifier: Option<&Verifier>,
    headers: &HeaderMap,
    body: &[u8],
    now: SystemTime,
) -> Result<Verified, VerifyError> {
    match verifier {
        Some(verifier) => verifier.verify(headers, body, now),
        None => Ok(Verified { signed: false }),
    }
}

/// The HMAC of the concatenated `parts`.
fn mac<M: Mac + KeyInit>(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    // HMAC hashes long keys and pads short ones: every length is valid.
    let mut mac = <M as KeyInit>::new_from_slice(key).expect("HMAC accepts keys of any length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().to_vec()
}

fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    mac::<Hmac<sha2::Sha256>>(key, parts)
}

/// `Ok` when the MAC `sign` computes for any secret equals any candidate, in
/// constant time per comparison. `sign` returns `None` for a secret that
/// cannot key the scheme, which then matches nothing.
fn match_any(
    secrets: &[Secret],
    candidates: &[Vec<u8>],
    sign: impl Fn(&Secret) -> Option<Vec<u8>>,
) -> Result<(), VerifyError> {
    let matched = secrets.iter().filter_map(sign).any(|expected| {
        candidates
            .iter()
            .any(|candidate| bool::from(expected.as_slice().ct_eq(candidate)))
    });
    if matched {
        Ok(())
    } else {
        Err(VerifyError::NoMatch)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{at, headers, secrets};
    use super::*;

    const GITHUB_SECRET: &str = "It's a Secret to Everybody";
    const GITHUB_SIGNATURE: &str =
        "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";

    fn github_verifier() -> Verifier {
        Verifier::new(
            Scheme::github(),
            secrets(&[GITHUB_SECRET]),
            DEFAULT_TOLERANCE,
        )
        .unwrap()
    }

    #[test]
    fn a_verifier_turns_a_signed_request_into_proof() {
        let signed = headers(&[("x-hub-signature-256", GITHUB_SIGNATURE)]);
        let proof = github_verifier()
            .verify(&signed, b"Hello, World!", at(0))
            .unwrap();
        assert!(proof.signature_checked());
        let error = github_verifier()
            .verify(&signed, b"Hello, World?", at(0))
            .unwrap_err();
        assert_eq!(error, VerifyError::NoMatch);
    }

    #[test]
    fn routes_without_a_verifier_pass_unchecked() {
        let proof = verify_route(None, &HeaderMap::new(), b"", at(0)).unwrap();
        assert!(!proof.signature_checked());
        let verifier = github_verifier();
        let error = verify_route(Some(&verifier), &HeaderMap::new(), b"", at(0)).unwrap_err();
        assert!(matches!(error, VerifyError::MissingHeader(_)));
    }

    #[test]
    fn verifiers_need_usable_secrets() {
        let error = Verifier::new(Scheme::Stripe, vec![], DEFAULT_TOLERANCE).unwrap_err();
        assert!(error.contains("at least one"), "{error}");
        let error = Verifier::new(Scheme::slack(), secrets(&["a", ""]), DEFAULT_TOLERANCE);
        assert_eq!(error.unwrap_err(), "secrets[1]: is empty");
        let bad = secrets(&["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_%%%%"]);
        let error = Verifier::new(Scheme::StandardWebhooks, bad, DEFAULT_TOLERANCE).unwrap_err();
        assert!(
            error.starts_with("secrets[1]: ") && !error.contains("%%%%"),
            "{error}"
        );
    }

    #[test]
    fn errors_are_short_and_name_no_secret() {
        let texts = [
            VerifyError::MissingHeader(HeaderName::from_static("stripe-signature")).to_string(),
            VerifyError::MalformedHeader(HeaderName::from_static("webhook-id")).to_string(),
            VerifyError::OutsideTolerance.to_string(),
            VerifyError::NoMatch.to_string(),
        ];
        assert_eq!(texts[0], "missing stripe-signature header");
        assert_eq!(texts[1], "malformed webhook-id header");
        assert!(texts.iter().all(|text| text.len() < 64));
    }

    #[test]
    fn a_secret_that_cannot_key_the_scheme_matches_nothing() {
        let result = match_any(&secrets(&["x"]), &[Vec::new()], |_| None);
        assert_eq!(result, Err(VerifyError::NoMatch));
    }
}
