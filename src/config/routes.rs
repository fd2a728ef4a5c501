//! The routes' part of the configuration: each route, the defaults every
//! route inherits, and the statuses that settle a claim `done`.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::duration;
use crate::provider::{Handshake, Provider};
use crate::secret::SecretRef;
use crate::verify::SignatureConfig;

/// Behaviour every route inherits unless it sets its own.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteDefaults {
    /// Upstream statuses that settle a claim `done`: classes (`"2xx"`) or
    /// exact codes (`410` or `"410"`). Anything else settles `failed`.
    #[serde(default = "default_done_on")]
    pub done_on: Vec<StatusMatch>,
    /// Status answered to a duplicate of a `done` key.
    #[serde(default = "default_duplicate_status")]
    pub duplicate_status: u16,
    /// Status answered while another delivery of the key is in flight; never
    /// a 2xx, so the sender keeps retrying.
    #[serde(default = "default_in_flight_status")]
    pub in_flight_status: u16,
    /// `Retry-After` sent with the in-flight answer.
    #[serde(default = "default_in_flight_retry_after", with = "duration")]
    pub in_flight_retry_after: Duration,
    /// What to do when a route needs a key and the request has none.
    #[serde(default)]
    pub on_missing_key: OnMissingKey,
    /// What to do when a key arrives again with a different body.
    #[serde(default)]
    pub on_payload_mismatch: OnPayloadMismatch,
}

impl Default for RouteDefaults {
    fn default() -> Self {
        Self {
            done_on: default_done_on(),
            duplicate_status: default_duplicate_status(),
            in_flight_status: default_in_flight_status(),
            in_flight_retry_after: default_in_flight_retry_after(),
            on_missing_key: OnMissingKey::default(),
            on_payload_mismatch: OnPayloadMismatch::default(),
        }
    }
}

/// Requests without a key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMissingKey {
    /// Answer 400.
    #[default]
    Reject,
    /// Forward without deduplication.
    Forward,
}

/// A key seen again with a different body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPayloadMismatch {
    /// Count it, log a warning, and handle the request by its key.
    #[default]
    Warn,
    /// Answer 422 and forward nothing.
    Reject,
}

/// Whether a route suppresses duplicates or only records them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Forward only won claims.
    #[default]
    Enforce,
    /// Forward every delivery, but claim and record as `enforce` would.
    Shadow,
}

/// One webhook endpoint.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Unique name; the `source` namespace of its keys and its metrics label.
    pub name: String,
    /// Exact request path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Path prefix, instead of `path`, matched at a segment boundary:
    /// `/hooks/pay` matches `/hooks/pay` and `/hooks/pay/stripe`, not
    /// `/hooks/payments`. The longest matching prefix wins; an exact `path`
    /// wins over any prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Methods the route applies to, listed (`*` is not a wildcard).
    #[serde(default = "default_methods")]
    pub methods: Vec<String>,
    /// Where the idempotency key is; a `provider` supplies it otherwise
    /// (except `zoom`, which sends no event id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeyConfig>,
    /// A provider preset (`stripe`, `github`, `standard-webhooks` or `svix`,
    /// `shopify`, `slack`, `zoom`): key location, signature scheme, default retention
    /// and handshakes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<Provider>,
    /// Signing secrets (`{ env: NAME }`, `{ file: PATH }`, or for local
    /// testing `{ value: … }`); a signature by any of them is accepted, so a
    /// secret can be rotated. Without secrets, signatures are not checked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SecretRef>,
    /// A custom signature scheme, for routes without a `provider`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<SignatureConfig>,
    /// How far a signed timestamp may be from the local clock, either way;
    /// at least 1s (timestamps are in seconds).
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub tolerance: Option<Duration>,
    /// Keyless requests (such as endpoint validations) that are verified and
    /// forwarded without a claim: `{ json: /pointer, equals: value }`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handshakes: Vec<Handshake>,
    /// `enforce` or `shadow`.
    #[serde(default)]
    pub mode: Mode,
    /// How long this route's keys are kept (default `store.retention`).
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub retention: Option<Duration>,
    /// Overrides `defaults.done_on`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done_on: Option<Vec<StatusMatch>>,
    /// Overrides `defaults.duplicate_status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duplicate_status: Option<u16>,
    /// Overrides `defaults.in_flight_status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight_status: Option<u16>,
    /// Overrides `defaults.in_flight_retry_after`.
    #[serde(
        default,
        with = "duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub in_flight_retry_after: Option<Duration>,
    /// Overrides `defaults.on_missing_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_missing_key: Option<OnMissingKey>,
    /// Overrides `defaults.on_payload_mismatch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_payload_mismatch: Option<OnPayloadMismatch>,
}

/// Where a route finds its key: exactly one of `header` or `json`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// A request header; the key is its value verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A JSON pointer (RFC 6901) into the body, e.g. `/id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<String>,
}

/// A `done_on` entry: a status class such as `2xx`, or one exact status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMatch {
    /// Every status whose first digit is this (1 to 5).
    Class(u8),
    /// One status code.
    Exact(u16),
}

impl StatusMatch {
    /// Whether `status` is covered by this entry.
    pub fn matches(self, status: u16) -> bool {
        match self {
            StatusMatch::Class(class) => status / 100 == u16::from(class),
            StatusMatch::Exact(code) => status == code,
        }
    }

    fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let class = text.strip_suffix("xx").or_else(|| text.strip_suffix("XX"));
        // An informational (1xx) status is never the answer a claim is
        // settled by, so an entry for one could never match.
        match class.map(str::parse::<u8>) {
            Some(Ok(digit @ 2..=5)) => Ok(StatusMatch::Class(digit)),
            Some(_) => Err(format!(
                "`{text}` is not a class of final statuses (2xx to 5xx)"
            )),
            None => match text.parse::<u16>() {
                Ok(code @ 200..=599) => Ok(StatusMatch::Exact(code)),
                _ => Err(format!(
                    "`{text}` is neither a status class like 2xx nor a final status code 200-599"
                )),
            },
        }
    }
}

impl fmt::Display for StatusMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatusMatch::Class(digit) => write!(f, "{digit}xx"),
            StatusMatch::Exact(code) => write!(f, "{code}"),
        }
    }
}

impl<'de> Deserialize<'de> for StatusMatch {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = match serde_yaml::Value::deserialize(deserializer)? {
            serde_yaml::Value::Number(number) => number.to_string(),
            serde_yaml::Value::String(text) => text,
            other => {
                return Err(serde::de::Error::custom(format!(
                    "expected a status code (200) or class (2xx), found {}",
                    serde_yaml::to_string(&other).map_or_else(
                        |_| "something else".to_owned(),
                        |yaml| format!("`{}`", yaml.trim_end())
                    )
                )));
            }
        };
        StatusMatch::parse(&text).map_err(serde::de::Error::custom)
    }
}

impl Serialize for StatusMatch {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            StatusMatch::Class(_) => serializer.collect_str(self),
            StatusMatch::Exact(code) => serializer.serialize_u16(*code),
        }
    }
}

fn default_done_on() -> Vec<StatusMatch> {
    vec![StatusMatch::Class(2)]
}

fn default_duplicate_status() -> u16 {
    200
}

fn default_in_flight_status() -> u16 {
    409
}

fn default_in_flight_retry_after() -> Duration {
    Duration::from_secs(5)
}

fn default_methods() -> Vec<String> {
    vec!["POST".into()]
}
