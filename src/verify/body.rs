//! Schemes that send one MAC in one header: GitHub (`X-Hub-Signature-256:
//! sha256=<hex>` of the body), Shopify (`X-Shopify-Hmac-Sha256: <base64>` of
//! the body), Slack (`X-Slack-Signature: v0=<hex>` of
//! `v0:{timestamp}:{body}`) and custom routes' `signature:` blocks, which
//! sign the body or, with a timestamp header, a payload built around it (Zoom
//! signs as Slack does, in its own headers). A scheme without a timestamp cannot refuse a
//! replay: the idempotency key answers a replay as a duplicate only when the
//! key is signed too, and GitHub's and Shopify's are in headers they do not
//! sign, so a captured body resent under a new id is forwarded.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use hmac::Hmac;
use http::{HeaderMap, HeaderName};
use serde::{Deserialize, Serialize};

use super::headers::{check_timestamp, header, malformed};
use super::{VerifyError, match_any};
use crate::secret::Secret;

/// A custom route's signature: one header holding an HMAC of the body, or of
/// a payload that also signs a timestamp header.
///
/// ```yaml
/// signature: { header: X-Signature, algorithm: hmac-sha256, encoding: hex, prefix: "sha256=" }
/// signature: { header: x-zm-signature, algorithm: hmac-sha256, encoding: hex, prefix: "v0=",
///              timestamp_header: x-zm-request-timestamp, signed_payload: "v0:{timestamp}:{body}" }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SignatureConfig {
    /// The request header carrying the signature.
    pub header: String,
    /// The MAC: `hmac-sha256` or `hmac-sha1`.
    pub algorithm: Algorithm,
    /// How the MAC is written: `hex` or `base64` (standard alphabet, padded).
    pub encoding: Encoding,
    /// Text before the encoded MAC, such as `sha256=`; a header without it
    /// is refused. Empty by default.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prefix: String,
    /// A request header holding the Unix time, in seconds, the sender signed
    /// at: refused outside the route's `tolerance`, and signed through
    /// `{timestamp}` in `signed_payload`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_header: Option<String>,
    /// What the MAC is of: `{body}` (the default), with `{timestamp}` when
    /// there is a `timestamp_header`, and any text around them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_payload: Option<String>,
}

/// The MAC of a body-signing scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Algorithm {
    /// HMAC with SHA-256.
    HmacSha256,
    /// HMAC with SHA-1, for senders that still use it.
    HmacSha1,
}

/// How a MAC is written in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Encoding {
    /// Hexadecimal, either case.
    Hex,
    /// Standard base64 with padding.
    Base64,
}

impl Algorithm {
    fn mac(self, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        match self {
            Algorithm::HmacSha256 => super::mac::<Hmac<sha2::Sha256>>(key, parts),
            Algorithm::HmacSha1 => super::mac::<Hmac<sha1::Sha1>>(key, parts),
        }
    }
}

/// One piece of a signed payload.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Timestamp,
    Body,
}

/// Splits a `signed_payload` template into its pieces: exactly one `{body}`,
/// at most one `{timestamp}`, no other `{`.
fn signed_payload(template: &str) -> Result<Vec<Piece>, String> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut rest = template;
    while let Some(next) = rest.chars().next() {
        let placeholder = [("{body}", Piece::Body), ("{timestamp}", Piece::Timestamp)]
            .into_iter()
            .find(|(name, _)| rest.starts_with(name));
        match placeholder {
            Some((name, piece)) => {
                if !text.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut text)));
                }
                if pieces.contains(&piece) {
                    return Err(format!("`{name}` appears more than once"));
                }
                pieces.push(piece);
                rest = &rest[name.len()..];
            }
            None if next == '{' => {
                return Err("only `{body}` and `{timestamp}` may appear between braces".into());
            }
            None => {
                text.push(next);
                rest = &rest[next.len_utf8()..];
            }
        }
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    if !pieces.contains(&Piece::Body) {
        return Err("must contain `{body}`".into());
    }
    Ok(pieces)
}

impl Encoding {
    /// The bytes `text` encodes, or `None` when it is not valid.
    pub(super) fn decode(self, text: &str) -> Option<Vec<u8>> {
        match self {
            Encoding::Hex => hex::decode(text).ok(),
            Encoding::Base64 => base64::engine::general_purpose::STANDARD.decode(text).ok(),
        }
    }
}

/// A validated one-header MAC scheme.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyHmac {
    header: HeaderName,
    algorithm: Algorithm,
    encoding: Encoding,
    prefix: String,
    timestamp: Option<HeaderName>,
    payload: Vec<Piece>,
}

impl BodyHmac {
    pub fn signs_a_timestamp(&self) -> bool {
        self.timestamp.is_some()
    }

    /// GitHub: `X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>`.
    pub fn github() -> Self {
        Self {
            header: HeaderName::from_static("x-hub-signature-256"),
            algorithm: Algorithm::HmacSha256,
            encoding: Encoding::Hex,
            prefix: "sha256=".into(),
            timestamp: None,
            payload: vec![Piece::Body],
        }
    }

    /// Shopify: `X-Shopify-Hmac-Sha256: <base64 HMAC-SHA256 of the body>`.
    pub fn shopify() -> Self {
        Self {
            header: HeaderName::from_static("x-shopify-hmac-sha256"),
            algorithm: Algorithm::HmacSha256,
            encoding: Encoding::Base64,
            prefix: String::new(),
            timestamp: None,
            payload: vec![Piece::Body],
        }
    }

    /// Slack: `X-Slack-Signature: v0=<hex HMAC-SHA256 of v0:ts:body>`, where
    /// `ts` is `X-Slack-Request-Timestamp`.
    pub fn slack() -> Self {
        Self::v0_timestamped("x-slack-signature", "x-slack-request-timestamp")
    }

    /// Zoom: `x-zm-signature: v0=<hex HMAC-SHA256 of v0:ts:body>`, where `ts`
    /// is `x-zm-request-timestamp`.
    pub fn zoom() -> Self {
        Self::v0_timestamped("x-zm-signature", "x-zm-request-timestamp")
    }

    /// Slack's scheme, which Zoom copied under other header names.
    fn v0_timestamped(signature: &'static str, timestamp: &'static str) -> Self {
        Self {
            header: HeaderName::from_static(signature),
            algorithm: Algorithm::HmacSha256,
            encoding: Encoding::Hex,
            prefix: "v0=".into(),
            timestamp: Some(HeaderName::from_static(timestamp)),
            payload: vec![
                Piece::Text("v0:".into()),
                Piece::Timestamp,
                Piece::Text(":".into()),
                Piece::Body,
            ],
        }
    }

    /// Validates a route's `signature:` block.
    pub fn from_config(config: &SignatureConfig) -> Result<Self, String> {
        let header_name = |name: &str| {
            HeaderName::try_from(name).map_err(|_| format!("`{name}` is not a valid header name"))
        };
        let header = header_name(&config.header)?;
        let timestamp = config
            .timestamp_header
            .as_deref()
            .map(header_name)
            .transpose()?;
        let payload = signed_payload(config.signed_payload.as_deref().unwrap_or("{body}"))
            .map_err(|problem| format!("signed_payload: {problem}"))?;
        match (&timestamp, payload.contains(&Piece::Timestamp)) {
            (Some(_), false) => {
                return Err(
                    "timestamp_header: the timestamp must be signed: put `{timestamp}` in signed_payload"
                        .into(),
                );
            }
            (None, true) => {
                return Err("signed_payload: `{timestamp}` needs a timestamp_header".into());
            }
            _ => {}
        }
        Ok(Self {
            header,
            algorithm: config.algorithm,
            encoding: config.encoding,
            prefix: config.prefix.clone(),
            timestamp,
            payload,
        })
    }

    /// The header carrying the signature.
    pub fn header(&self) -> &HeaderName {
        &self.header
    }

    pub(super) fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        secrets: &[Secret],
        tolerance: Duration,
        now: SystemTime,
    ) -> Result<(), VerifyError> {
        let timestamp = match &self.timestamp {
            Some(name) => header(headers, name)?,
            None => "",
        };
        let value = header(headers, &self.header)?;
        let signature = value
            .strip_prefix(self.prefix.as_str())
            .and_then(|encoded| self.encoding.decode(encoded))
            .filter(|signature| !signature.is_empty())
            .ok_or_else(|| malformed(&self.header))?;
        if let Some(name) = &self.timestamp {
            check_timestamp(timestamp, name, tolerance, now)?;
        }
        let parts: Vec<&[u8]> = self
            .payload
            .iter()
            .map(|piece| match piece {
                Piece::Text(text) => text.as_bytes(),
                Piece::Timestamp => timestamp.as_bytes(),
                Piece::Body => body,
            })
            .collect();
        match_any(secrets, &[signature], |secret| {
            Some(self.algorithm.mac(secret.expose(), &parts))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::Scheme;
    use super::super::testing::{at, headers, refuses_hostile_values, requires_headers, secrets};
    use super::*;

    const GITHUB: &str = "x-hub-signature-256";
    // GitHub's documented example ("Validating webhook deliveries"): secret
    // "It's a Secret to Everybody", payload "Hello, World!".
    const GITHUB_SECRET: &str = "It's a Secret to Everybody";
    const GITHUB_BODY: &[u8] = b"Hello, World!";
    const GITHUB_SIGNATURE: &str =
        "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";

    // Shopify publishes no test vector; this one was computed with Python:
    // base64.b64encode(hmac.new(SECRET, BODY, hashlib.sha256).digest()).
    const SHOPIFY: &str = "x-shopify-hmac-sha256";
    const SHOPIFY_SECRET: &str = "shpss_test_secret_for_dedupe_proxy";
    const SHOPIFY_BODY: &[u8] = br#"{"id":820982911946154508,"email":"jon@example.com"}"#;
    const SHOPIFY_SIGNATURE: &str = "4P/61GfegAtNvZ9cXOPHeh47pgsrnfSzeqT792aK2o0=";

    fn check(
        scheme: &Scheme,
        pairs: &[(&str, &str)],
        body: &[u8],
        keys: &[&str],
    ) -> Result<(), VerifyError> {
        let tolerance = Duration::ZERO;
        scheme.check(&headers(pairs), body, &secrets(keys), tolerance, at(0))
    }

    #[test]
    fn github_known_answer() {
        let signed = [(GITHUB, GITHUB_SIGNATURE)];
        assert_eq!(
            check(&Scheme::github(), &signed, GITHUB_BODY, &[GITHUB_SECRET]),
            Ok(())
        );
        let upper = GITHUB_SIGNATURE.replace("757107ea", "757107EA");
        let upper = [(GITHUB, upper.as_str())];
        assert_eq!(
            check(&Scheme::github(), &upper, GITHUB_BODY, &[GITHUB_SECRET]),
            Ok(())
        );
    }

    #[test]
    fn github_refuses_tampering_and_wrong_secrets() {
        let scheme = Scheme::github();
        let signed = [(GITHUB, GITHUB_SIGNATURE)];
        let result = check(&scheme, &signed, b"Hello, World?", &[GITHUB_SECRET]);
        assert_eq!(result, Err(VerifyError::NoMatch));
        let result = check(
            &scheme,
            &signed,
            GITHUB_BODY,
            &["It's a secret to everybody"],
        );
        assert_eq!(result, Err(VerifyError::NoMatch));
    }

    #[test]
    fn github_accepts_a_rotated_secret() {
        let signed = [(GITHUB, GITHUB_SIGNATURE)];
        let keys = ["the-new-secret", GITHUB_SECRET];
        assert_eq!(
            check(&Scheme::github(), &signed, GITHUB_BODY, &keys),
            Ok(())
        );
    }

    #[test]
    fn github_needs_the_prefix() {
        let bare = GITHUB_SIGNATURE.trim_start_matches("sha256=");
        for value in [
            bare,
            "sha1=757107ea",
            "sha256:757107ea",
            "sha256=",
            "sha256=xyz",
        ] {
            let result = check(
                &Scheme::github(),
                &[(GITHUB, value)],
                GITHUB_BODY,
                &[GITHUB_SECRET],
            );
            assert_eq!(
                result,
                Err(VerifyError::MalformedHeader(HeaderName::from_static(
                    GITHUB
                )))
            );
        }
    }

    #[test]
    fn shopify_known_answer_tampering_and_rotation() {
        let scheme = Scheme::shopify();
        let signed = [(SHOPIFY, SHOPIFY_SIGNATURE)];
        assert_eq!(
            check(&scheme, &signed, SHOPIFY_BODY, &[SHOPIFY_SECRET]),
            Ok(())
        );
        assert_eq!(
            check(&scheme, &signed, b"{}", &[SHOPIFY_SECRET]),
            Err(VerifyError::NoMatch)
        );
        assert_eq!(
            check(&scheme, &signed, SHOPIFY_BODY, &["other"]),
            Err(VerifyError::NoMatch)
        );
        let rotated = ["other", SHOPIFY_SECRET];
        assert_eq!(check(&scheme, &signed, SHOPIFY_BODY, &rotated), Ok(()));
        let unpadded = [(SHOPIFY, SHOPIFY_SIGNATURE.trim_end_matches('='))];
        assert!(check(&scheme, &unpadded, SHOPIFY_BODY, &[SHOPIFY_SECRET]).is_err());
    }

    #[test]
    fn missing_and_hostile_headers_are_refused() {
        for (scheme, name, value, body, key) in [
            (
                Scheme::github(),
                GITHUB,
                GITHUB_SIGNATURE,
                GITHUB_BODY,
                GITHUB_SECRET,
            ),
            (
                Scheme::shopify(),
                SHOPIFY,
                SHOPIFY_SIGNATURE,
                SHOPIFY_BODY,
                SHOPIFY_SECRET,
            ),
        ] {
            let valid = headers(&[(name, value)]);
            let keys = secrets(&[key]);
            requires_headers(&scheme, &valid, &[name], body, &keys, at(0));
            refuses_hostile_values(&scheme, &valid, &[name], body, &keys, at(0));
        }
    }

    fn custom(yaml: &str) -> Scheme {
        let config: SignatureConfig = serde_yaml::from_str(yaml).unwrap();
        Scheme::Body(BodyHmac::from_config(&config).unwrap())
    }

    #[test]
    fn custom_sha1_hex_with_prefix() {
        // Python: hmac.new(b"custom-secret", b"payload", hashlib.sha1).hexdigest()
        let scheme =
            custom("{ header: X-Sig, algorithm: hmac-sha1, encoding: hex, prefix: 'sha1=' }");
        let signed = [("x-sig", "sha1=f4b91cd28df8c281818bbeafc07a5f9f6a1828a6")];
        assert_eq!(
            check(&scheme, &signed, b"payload", &["custom-secret"]),
            Ok(())
        );
        assert_eq!(
            check(&scheme, &signed, b"payload!", &["custom-secret"]),
            Err(VerifyError::NoMatch)
        );
        assert_eq!(
            check(&scheme, &signed, b"payload", &["x", "custom-secret"]),
            Ok(())
        );
        let bare = [("x-sig", "f4b91cd28df8c281818bbeafc07a5f9f6a1828a6")];
        assert!(matches!(
            check(&scheme, &bare, b"payload", &["custom-secret"]),
            Err(VerifyError::MalformedHeader(_))
        ));
    }

    #[test]
    fn custom_sha256_base64_without_prefix() {
        // Python: base64.b64encode(hmac.new(b"custom-secret", b"payload", hashlib.sha256).digest())
        let scheme = custom("{ header: X-Sig, algorithm: hmac-sha256, encoding: base64 }");
        let signed = [("x-sig", "Xt9WgKNoxM8Ucq5m0yJHQMAyHeOCetFvD18DBpct9Rk=")];
        assert_eq!(
            check(&scheme, &signed, b"payload", &["custom-secret"]),
            Ok(())
        );
        assert_eq!(
            check(&scheme, &signed, b"payload", &["wrong"]),
            Err(VerifyError::NoMatch)
        );
    }

    // Zoom's scheme, as its docs describe it: `x-zm-signature: v0=<hex>` of
    // `v0:{x-zm-request-timestamp}:{body}`. Python:
    // hmac.new(SECRET, b"v0:1700000000:" + BODY, hashlib.sha256).hexdigest()
    const ZOOM: &str =
        "{ header: x-zm-signature, algorithm: hmac-sha256, encoding: hex, prefix: 'v0=',
        timestamp_header: x-zm-request-timestamp, signed_payload: 'v0:{timestamp}:{body}' }";
    const ZOOM_SECRET: &str = "zoom-secret-token";
    const ZOOM_BODY: &[u8] = br#"{"event":"endpoint.url_validation","payload":{"plainToken":"qgg8vlvZRS6UYooatFL8Aw"},"event_ts":1700000000000}"#;
    const ZOOM_SIGNATURE: &str =
        "v0=6df24cfb3e6a961b21f62d3f0e9f0d035ff0e516dcb8be598780ed33270601be";

    #[test]
    fn custom_timestamped_payload_known_answer_tolerance_and_tampering() {
        let scheme = custom(ZOOM);
        let tolerance = Duration::from_secs(300);
        let zoom = |timestamp: &str, body: &[u8], now: u64| {
            let request = headers(&[
                ("x-zm-request-timestamp", timestamp),
                ("x-zm-signature", ZOOM_SIGNATURE),
            ]);
            scheme.check(&request, body, &secrets(&[ZOOM_SECRET]), tolerance, at(now))
        };
        assert_eq!(zoom("1700000000", ZOOM_BODY, 1_700_000_000), Ok(()));
        assert_eq!(zoom("1700000000", ZOOM_BODY, 1_700_000_299), Ok(()));
        assert_eq!(
            zoom("1700000000", ZOOM_BODY, 1_700_000_301),
            Err(VerifyError::OutsideTolerance)
        );
        assert_eq!(
            zoom("1700000000", ZOOM_BODY, 1_699_999_699),
            Err(VerifyError::OutsideTolerance)
        );
        assert_eq!(
            zoom("1700000001", ZOOM_BODY, 1_700_000_000),
            Err(VerifyError::NoMatch),
            "the timestamp is signed"
        );
        assert_eq!(
            zoom("1700000000", b"{}", 1_700_000_000),
            Err(VerifyError::NoMatch)
        );
        let valid = headers(&[
            ("x-zm-request-timestamp", "1700000000"),
            ("x-zm-signature", ZOOM_SIGNATURE),
        ]);
        let names = ["x-zm-request-timestamp", "x-zm-signature"];
        let keys = secrets(&[ZOOM_SECRET]);
        requires_headers(&scheme, &valid, &names, ZOOM_BODY, &keys, at(1_700_000_000));
        refuses_hostile_values(&scheme, &valid, &names, ZOOM_BODY, &keys, at(1_700_000_000));
    }

    #[test]
    fn signed_payload_templates_are_checked() {
        let build = |extra: &str| {
            let yaml = format!("{{ header: X, algorithm: hmac-sha256, encoding: hex{extra} }}");
            let config: SignatureConfig = serde_yaml::from_str(&yaml).unwrap();
            BodyHmac::from_config(&config)
        };
        assert!(build("").is_ok());
        assert!(build(", signed_payload: 'raw:{body}'").is_ok());
        for (extra, problem) in [
            (", signed_payload: 'v0:{timestamp}'", "{body}"),
            (", signed_payload: '{body}{body}'", "more than once"),
            (", signed_payload: '{id}.{body}'", "between braces"),
            (
                ", signed_payload: '{timestamp}.{body}'",
                "needs a timestamp_header",
            ),
            (", timestamp_header: X-Ts", "must be signed"),
            (
                ", timestamp_header: 'bad header', signed_payload: '{timestamp}{body}'",
                "bad header",
            ),
        ] {
            let error = build(extra).unwrap_err();
            assert!(error.contains(problem), "{extra}: {error}");
        }
    }

    #[test]
    fn custom_config_is_strict() {
        let parse =
            |yaml: &str| serde_yaml::from_str::<SignatureConfig>(yaml).map_err(|e| e.to_string());
        assert!(parse("{ header: X, algorithm: hmac-md5, encoding: hex }").is_err());
        assert!(parse("{ header: X, algorithm: hmac-sha256, encoding: base32 }").is_err());
        assert!(parse("{ header: X, algorithm: hmac-sha256 }").is_err());
        let error =
            parse("{ header: X, algorithm: hmac-sha256, encoding: hex, salt: y }").unwrap_err();
        assert!(error.contains("unknown field `salt`"), "{error}");
        let config =
            parse("{ header: 'bad header', algorithm: hmac-sha256, encoding: hex }").unwrap();
        assert!(
            BodyHmac::from_config(&config)
                .unwrap_err()
                .contains("bad header")
        );
        let config = parse("{ header: X, algorithm: hmac-sha256, encoding: hex }").unwrap();
        assert_eq!(config.prefix, "");
        assert_eq!(
            serde_yaml::to_string(&config).unwrap(),
            "header: X\nalgorithm: hmac-sha256\nencoding: hex\n"
        );
    }
}
