//! Schemes that sign the body alone and send one MAC in one header: GitHub
//! (`X-Hub-Signature-256: sha256=<hex>`), Shopify (`X-Shopify-Hmac-Sha256:
//! <base64>`) and custom routes' `signature:` blocks. None of them signs a
//! timestamp, so none can refuse a replay; the idempotency key does that.

use base64::Engine as _;
use hmac::Hmac;
use http::{HeaderMap, HeaderName};
use serde::{Deserialize, Serialize};

use super::headers::{header, malformed};
use super::{VerifyError, match_any};
use crate::secret::Secret;

/// A custom route's signature: one header holding an HMAC of the body.
///
/// ```yaml
/// signature: { header: X-Signature, algorithm: hmac-sha256, encoding: hex, prefix: "sha256=" }
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
    fn mac(self, key: &[u8], body: &[u8]) -> Vec<u8> {
        match self {
            Algorithm::HmacSha256 => super::mac::<Hmac<sha2::Sha256>>(key, &[body]),
            Algorithm::HmacSha1 => super::mac::<Hmac<sha1::Sha1>>(key, &[body]),
        }
    }
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

/// A validated body-signing scheme.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyHmac {
    header: HeaderName,
    algorithm: Algorithm,
    encoding: Encoding,
    prefix: String,
}

impl BodyHmac {
    /// GitHub: `X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>`.
    pub fn github() -> Self {
        Self {
            header: HeaderName::from_static("x-hub-signature-256"),
            algorithm: Algorithm::HmacSha256,
            encoding: Encoding::Hex,
            prefix: "sha256=".into(),
        }
    }

    /// Shopify: `X-Shopify-Hmac-Sha256: <base64 HMAC-SHA256 of the body>`.
    pub fn shopify() -> Self {
        Self {
            header: HeaderName::from_static("x-shopify-hmac-sha256"),
            algorithm: Algorithm::HmacSha256,
            encoding: Encoding::Base64,
            prefix: String::new(),
        }
    }

    /// Validates a route's `signature:` block.
    pub fn from_config(config: &SignatureConfig) -> Result<Self, String> {
        let header = HeaderName::try_from(config.header.as_str())
            .map_err(|_| format!("`{}` is not a valid header name", config.header))?;
        Ok(Self {
            header,
            algorithm: config.algorithm,
            encoding: config.encoding,
            prefix: config.prefix.clone(),
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
    ) -> Result<(), VerifyError> {
        let value = header(headers, &self.header)?;
        let signature = value
            .strip_prefix(self.prefix.as_str())
            .and_then(|encoded| self.encoding.decode(encoded))
            .filter(|signature| !signature.is_empty())
            .ok_or_else(|| malformed(&self.header))?;
        match_any(secrets, &[signature], |secret| {
            Some(self.algorithm.mac(secret.expose(), body))
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
        let tolerance = std::time::Duration::ZERO;
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
