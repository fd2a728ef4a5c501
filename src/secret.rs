//! Signing secrets: where the configuration says to find them ([`SecretRef`])
//! and the resolved bytes ([`Secret`]), which never print. Owns reading
//! environment variables and secret files; does not decide what a secret is
//! used for (the signature schemes in [`crate::verify`] do).

use std::fmt;
use std::path::PathBuf;

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize};

/// What a redacted secret prints as.
const REDACTED: &str = "REDACTED";

/// Where a route's secret comes from: exactly one of `env`, `file` or `value`.
///
/// ```yaml
/// secrets:
///   - { env: STRIPE_WEBHOOK_SECRET }
///   - { file: /run/secrets/stripe }
///   - { value: whsec_for_local_testing_only }
/// ```
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RawSecretRef")]
pub enum SecretRef {
    /// An environment variable holding the secret.
    Env(String),
    /// A file holding the secret; surrounding whitespace is ignored.
    File(PathBuf),
    /// The secret itself, written in the configuration file: for local
    /// testing only (it ends up in version control and process listings).
    Value(String),
}

/// The shape `SecretRef` is parsed from, so unknown keys and "none or
/// several of env/file/value" get clear messages.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSecretRef {
    /// An environment variable holding the secret.
    env: Option<String>,
    /// A file holding the secret.
    file: Option<PathBuf>,
    /// The secret itself.
    value: Option<String>,
}

impl TryFrom<RawSecretRef> for SecretRef {
    type Error = String;

    fn try_from(raw: RawSecretRef) -> Result<Self, String> {
        match (raw.env, raw.file, raw.value) {
            (Some(name), None, None) if !name.is_empty() => Ok(SecretRef::Env(name)),
            (None, Some(path), None) if !path.as_os_str().is_empty() => Ok(SecretRef::File(path)),
            (None, None, Some(value)) => Ok(SecretRef::Value(value)),
            (Some(_), None, None) => Err("secret `env` must name a variable".into()),
            (None, Some(_), None) => Err("secret `file` must name a file".into()),
            _ => Err("a secret needs exactly one of `env`, `file` or `value`".into()),
        }
    }
}

impl Serialize for SecretRef {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(1))?;
        match self {
            SecretRef::Env(name) => map.serialize_entry("env", name)?,
            SecretRef::File(path) => map.serialize_entry("file", path)?,
            SecretRef::Value(_) => map.serialize_entry("value", REDACTED)?,
        }
        map.end()
    }
}

impl fmt::Debug for SecretRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SecretRef::Env(name) => f.debug_tuple("Env").field(name).finish(),
            SecretRef::File(path) => f.debug_tuple("File").field(path).finish(),
            SecretRef::Value(_) => f.debug_tuple("Value").field(&REDACTED).finish(),
        }
    }
}

impl SecretRef {
    /// Whether the secret is written in the configuration itself, which
    /// `check-config` warns about.
    pub fn is_literal(&self) -> bool {
        matches!(self, SecretRef::Value(_))
    }

    /// Reads the secret. Surrounding whitespace is dropped (a trailing
    /// newline in a file or variable is never part of a provider's secret);
    /// a missing variable, an unreadable file or an empty secret is an error
    /// naming the variable or file, never the secret.
    pub fn resolve(&self) -> Result<Secret, String> {
        let (bytes, origin) = match self {
            SecretRef::Env(name) => (read_env(name)?, format!("environment variable `{name}`")),
            SecretRef::File(path) => (
                std::fs::read(path).map_err(|error| {
                    format!("cannot read secret file `{}`: {error}", path.display())
                })?,
                format!("secret file `{}`", path.display()),
            ),
            SecretRef::Value(value) => (value.clone().into_bytes(), "secret `value`".into()),
        };
        let trimmed = bytes.trim_ascii();
        if trimmed.is_empty() {
            return Err(format!("{origin} is empty"));
        }
        Ok(Secret::new(trimmed))
    }
}

fn read_env(name: &str) -> Result<Vec<u8>, String> {
    match std::env::var(name) {
        Ok(value) => Ok(value.into_bytes()),
        Err(std::env::VarError::NotPresent) => {
            Err(format!("environment variable `{name}` is not set"))
        }
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(format!("environment variable `{name}` is not valid UTF-8"))
        }
    }
}

/// A resolved secret. Its bytes never appear in `Debug` or `Display` output,
/// so a secret cannot leak through a log line or an error message. It has no
/// `==`, which would not compare in constant time.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Wraps secret bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Secret(bytes.into())
    }

    /// The secret bytes, to key a MAC with; never to log or answer with.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({REDACTED})")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<SecretRef, String> {
        serde_yaml::from_str(yaml).map_err(|error| error.to_string())
    }

    #[test]
    fn parses_each_source() {
        assert_eq!(parse("{ env: HOOK }"), Ok(SecretRef::Env("HOOK".into())));
        assert_eq!(
            parse("{ file: /run/secrets/hook }"),
            Ok(SecretRef::File("/run/secrets/hook".into()))
        );
        assert_eq!(
            parse("{ value: s3cr3t }"),
            Ok(SecretRef::Value("s3cr3t".into()))
        );
    }

    #[test]
    fn rejects_none_several_or_unknown_sources() {
        for yaml in ["{}", "{ env: A, file: /b }", "{ env: A, value: b }"] {
            let error = parse(yaml).unwrap_err();
            assert!(error.contains("exactly one of"), "{yaml}: {error}");
        }
        let error = parse("{ vault: x }").unwrap_err();
        assert!(error.contains("unknown field `vault`"), "{error}");
        assert!(parse("{ env: '' }").unwrap_err().contains("must name"));
        assert!(parse("x").is_err());
    }

    #[test]
    fn serializes_literals_redacted_and_references_as_is() {
        let yaml = |secret: &SecretRef| serde_yaml::to_string(secret).unwrap();
        assert_eq!(yaml(&SecretRef::Env("HOOK".into())), "env: HOOK\n");
        assert_eq!(yaml(&SecretRef::File("/run/s".into())), "file: /run/s\n");
        assert_eq!(
            yaml(&SecretRef::Value("s3cr3t".into())),
            "value: REDACTED\n"
        );
        let debug = format!("{:?}", SecretRef::Value("s3cr3t".into()));
        assert!(!debug.contains("s3cr3t"), "{debug}");
    }

    #[test]
    fn only_values_are_literal() {
        assert!(SecretRef::Value("x".into()).is_literal());
        assert!(!SecretRef::Env("X".into()).is_literal());
        assert!(!SecretRef::File("/x".into()).is_literal());
    }

    #[test]
    fn resolves_a_literal() {
        let secret = SecretRef::Value("whsec_abc".into()).resolve().unwrap();
        assert_eq!(secret.expose(), b"whsec_abc");
        let error = SecretRef::Value("  ".into()).resolve().unwrap_err();
        assert!(error.contains("empty"), "{error}");
    }

    #[test]
    fn resolves_a_file_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, " whsec_abc\r\n\n").unwrap();
        let secret = SecretRef::File(path.clone()).resolve().unwrap();
        assert_eq!(secret.expose(), b"whsec_abc");

        std::fs::write(&path, "\n").unwrap();
        let error = SecretRef::File(path.clone()).resolve().unwrap_err();
        assert!(
            error.contains("is empty") && error.contains("secret"),
            "{error}"
        );

        let missing = dir.path().join("missing");
        let error = SecretRef::File(missing.clone()).resolve().unwrap_err();
        assert!(error.contains(&missing.display().to_string()), "{error}");
    }

    #[test]
    fn resolves_an_environment_variable() {
        // PATH is set in every test environment; its value is irrelevant.
        assert!(SecretRef::Env("PATH".into()).resolve().is_ok());
        let name = "DEDUPE_PROXY_TEST_SECRET_THAT_IS_NEVER_SET";
        let error = SecretRef::Env(name.into()).resolve().unwrap_err();
        assert!(error.contains(name) && error.contains("not set"), "{error}");
    }

    #[test]
    fn secrets_never_print() {
        let secret = Secret::new("whsec_abc");
        assert_eq!(format!("{secret:?}"), "Secret(REDACTED)");
        assert_eq!(format!("{secret}"), "Secret(REDACTED)");
        assert_eq!(format!("{:?}", vec![secret]), "[Secret(REDACTED)]");
    }
}
