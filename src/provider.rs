//! Provider presets: what `provider: stripe` (and the others) stands for, as
//! data: where the idempotency key is, which signature scheme applies, how
//! long the provider may deliver an event again and the default retention
//! that covers it, and which keyless requests (handshakes) are verified and
//! forwarded without a claim. Owns no request handling: the proxy uses a
//! preset exactly like a route that spelled these values out.

use std::fmt;
use std::time::Duration;

use http::{HeaderMap, HeaderName};
use serde::{Deserialize, Serialize};

use crate::key::KeySource;
use crate::verify::Scheme;

const HOUR: u64 = 60 * 60;
const DAY: u64 = 24 * HOUR;

/// Retention no preset goes below: the store's default, so a preset never
/// keeps keys for less time than a hand-written route would.
const MIN_RETENTION: Duration = Duration::from_secs(7 * DAY);

/// A webhook sender with a preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Provider {
    /// Stripe: key `/id` in the body, `Stripe-Signature`.
    Stripe,
    /// GitHub: key `X-GitHub-Delivery`, `X-Hub-Signature-256`.
    Github,
    /// Standard Webhooks, as sent by Svix and others: key `webhook-id`
    /// (or `svix-id`), `webhook-signature` (or `svix-signature`).
    #[serde(alias = "svix")]
    StandardWebhooks,
    /// Shopify: key `X-Shopify-Event-Id` (or `X-Shopify-Webhook-Id`),
    /// `X-Shopify-Hmac-Sha256`.
    Shopify,
    /// Slack Events API: key `/event_id` in the body, `X-Slack-Signature`.
    Slack,
    /// Zoom: `x-zm-signature`. Zoom sends no event id, so the route names
    /// its key.
    Zoom,
}

/// Everything a provider preset fixes for a route.
#[derive(Debug, Clone)]
pub struct Preset {
    /// Where the idempotency key is; `None` for a provider that sends no
    /// event id, whose routes must name their key.
    pub key: Option<KeySource>,
    /// How the provider signs requests.
    pub scheme: Scheme,
    /// How long after an event's first delivery the provider documents that
    /// it may deliver the same event again (automatic retries and manual
    /// redelivery).
    pub retry_horizon: Duration,
    /// Default retention of the route's keys: at least `retry_horizon`, so a
    /// late retry is still recognised as a duplicate.
    pub retention: Duration,
    /// Requests without an event id that are forwarded without a claim once
    /// their signature is verified.
    pub handshakes: Vec<Handshake>,
    /// Whether a verified form-encoded request is keyless too. Slack signs
    /// slash commands and interactive payloads (buttons, modals) like events
    /// and sends them to the same URL in apps built on its Bolt framework,
    /// but as `application/x-www-form-urlencoded` without an event id, and
    /// never retries them.
    pub keyless_forms: bool,
}

/// A keyless request recognised by one string in its JSON body, such as
/// Slack's `{"type": "url_verification", ...}`.
///
/// ```yaml
/// handshakes: [{ json: /event, equals: endpoint.url_validation }]
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Handshake {
    /// A JSON pointer (RFC 6901) into the body, e.g. `/type`.
    pub json: String,
    /// The string the pointed-to value must be.
    pub equals: String,
}

impl Provider {
    /// Every provider with a preset.
    pub const ALL: [Provider; 6] = [
        Provider::Stripe,
        Provider::Github,
        Provider::StandardWebhooks,
        Provider::Shopify,
        Provider::Slack,
        Provider::Zoom,
    ];

    /// The name used in the configuration file.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Stripe => "stripe",
            Provider::Github => "github",
            Provider::StandardWebhooks => "standard-webhooks",
            Provider::Shopify => "shopify",
            Provider::Slack => "slack",
            Provider::Zoom => "zoom",
        }
    }

    /// The provider's preset.
    pub fn preset(self) -> Preset {
        let retry_horizon = retry_horizon(self);
        Preset {
            key: key_source(self),
            scheme: scheme(self),
            retry_horizon,
            retention: retry_horizon
                .saturating_add(Duration::from_secs(DAY))
                .max(MIN_RETENTION),
            handshakes: handshakes(self),
            keyless_forms: self == Provider::Slack,
        }
    }

    /// A warning when `retention` is shorter than the provider's retry
    /// horizon: a late retry would then be processed a second time.
    pub fn retention_warning(self, retention: Duration) -> Option<String> {
        let horizon = retry_horizon(self);
        (retention < horizon).then(|| {
            format!(
                "retention {} is shorter than the retry horizon of provider {} ({}): a retry arriving later would be processed again",
                crate::config::format_duration(retention),
                self.name(),
                crate::config::format_duration(horizon),
            )
        })
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn key_source(provider: Provider) -> Option<KeySource> {
    let headers = |names: &[&'static str]| {
        KeySource::Header(
            names
                .iter()
                .map(|name| HeaderName::from_static(name))
                .collect(),
        )
    };
    Some(match provider {
        Provider::Stripe => KeySource::Json("/id".into()),
        Provider::Github => headers(&["x-github-delivery"]),
        Provider::StandardWebhooks => headers(&["webhook-id", "svix-id"]),
        Provider::Shopify => headers(&["x-shopify-event-id", "x-shopify-webhook-id"]),
        Provider::Slack => KeySource::Json("/event_id".into()),
        // Zoom's body has the event's name, its time and the object it is
        // about; its `x-zm-trackingid` header is documented for support
        // requests, not as stable across retries. What identifies one event
        // depends on the subscription (a recording's uuid for
        // `recording.completed`), so the route has to say.
        Provider::Zoom => return None,
    })
}

fn scheme(provider: Provider) -> Scheme {
    match provider {
        Provider::Stripe => Scheme::Stripe,
        Provider::Github => Scheme::github(),
        Provider::StandardWebhooks => Scheme::StandardWebhooks,
        Provider::Shopify => Scheme::shopify(),
        Provider::Slack => Scheme::slack(),
        Provider::Zoom => Scheme::zoom(),
    }
}

fn retry_horizon(provider: Provider) -> Duration {
    Duration::from_secs(match provider {
        // Stripe docs ("Process undelivered webhook events"): in live mode
        // Stripe resends an undelivered event for up to three days on its
        // own; any event created in the last 30 days can also be resent by
        // hand to an endpoint (Stripe CLI `events resend --webhook-endpoint`,
        // the Dashboard), with its original id.
        Provider::Stripe => 30 * DAY,
        // GitHub docs ("Redelivering webhooks"): GitHub never retries on its
        // own, but deliveries from the past 3 days can be redelivered by hand
        // or through the API on github.com; GitHub Enterprise Server keeps 7
        // days, and this preset serves both.
        Provider::Github => 7 * DAY,
        // Svix docs ("Retry Schedule"): attempts immediately, then after 5s,
        // 5m, 30m, 2h, 5h, 10h and 10h, each counted from the previous
        // failure: 27h35m05s plus the attempts' own timeouts, so 28 hours.
        Provider::StandardWebhooks => 28 * HOUR,
        // Shopify changelog ("Updates to webhook retry mechanism", 2024-09):
        // a failed webhook is retried 8 times over 4 hours.
        Provider::Shopify => 4 * HOUR,
        // Slack Events API docs: a failed event is retried up to 3 times
        // (nearly immediately, after 1 minute, after 5 minutes); an hour
        // covers that with room for Slack's own delays.
        Provider::Slack => HOUR,
        // Zoom developer support ("Webhook delays"): an event not answered
        // 200 or 204 within three seconds is sent 3 more times, 5 minutes
        // after the first attempt, then 20 and 60 minutes after the previous
        // retry: 85 minutes, rounded up for Zoom's own delays.
        Provider::Zoom => 2 * HOUR,
    })
}

fn handshakes(provider: Provider) -> Vec<Handshake> {
    match provider {
        // Both are signed like events but carry no `event_id`: the request
        // URL challenge, and the notice Slack sends when it drops events.
        Provider::Slack => vec![
            Handshake::new("/type", "url_verification"),
            Handshake::new("/type", "app_rate_limited"),
        ],
        // Zoom checks the endpoint with a signed challenge when it is set up
        // and every 72 hours; the application answers it.
        Provider::Zoom => vec![Handshake::zoom_url_validation()],
        _ => Vec::new(),
    }
}

impl Preset {
    /// Whether a (verified) request is one of the preset's handshakes, to be
    /// forwarded without looking for a key or claiming one.
    pub fn is_handshake(&self, body: &[u8]) -> bool {
        is_handshake(&self.handshakes, body)
    }
}

impl Handshake {
    /// A rule matching bodies whose value at `json` is the string `equals`.
    pub fn new(json: &str, equals: &str) -> Self {
        Self {
            json: json.into(),
            equals: equals.into(),
        }
    }

    /// Zoom's endpoint validation request (`"event": "endpoint.url_validation"`).
    pub fn zoom_url_validation() -> Self {
        Self::new("/event", "endpoint.url_validation")
    }

    /// Checks a configured rule.
    pub fn validate(&self) -> Result<(), String> {
        crate::key::check_pointer(&self.json, "/type")?;
        if self.equals.is_empty() {
            return Err("equals: must not be empty".into());
        }
        Ok(())
    }

    fn matches(&self, document: &serde_json::Value) -> bool {
        document
            .pointer(&self.json)
            .and_then(serde_json::Value::as_str)
            == Some(self.equals.as_str())
    }
}

/// Whether `body` is JSON matching any of `rules`. The body is parsed only
/// when there are rules, so routes without handshakes pay nothing.
pub fn is_handshake(rules: &[Handshake], body: &[u8]) -> bool {
    if rules.is_empty() {
        return false;
    }
    serde_json::from_slice::<serde_json::Value>(body)
        .is_ok_and(|document| rules.iter().any(|rule| rule.matches(&document)))
}

/// Whether a request's body is form-encoded (`application/x-www-form-urlencoded`,
/// parameters allowed), by its `Content-Type`.
pub fn is_form(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media_type| {
            media_type
                .trim()
                .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        })
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    #[test]
    fn names_parse_and_print_in_kebab_case() {
        for provider in Provider::ALL {
            let yaml = serde_yaml::to_string(&provider).unwrap();
            assert_eq!(yaml.trim(), provider.name());
            assert_eq!(serde_yaml::from_str::<Provider>(&yaml).unwrap(), provider);
            assert_eq!(provider.to_string(), provider.name());
        }
        let svix: Provider = serde_yaml::from_str("svix").unwrap();
        assert_eq!(svix, Provider::StandardWebhooks);
        for unknown in ["GitHub", "standard_webhooks", "Zoom", ""] {
            let parsed = serde_yaml::from_str::<Provider>(unknown);
            assert!(parsed.is_err(), "{unknown}");
        }
    }

    #[test]
    fn keys_are_where_each_provider_puts_its_event_id() {
        let (std, shop) = (Provider::StandardWebhooks, Provider::Shopify);
        let shop_both = [("x-shopify-webhook-id", "w"), ("x-shopify-event-id", "e")];
        type Headers<'a> = &'a [(&'a str, &'a str)];
        let cases: [(Provider, Headers<'_>, &str, &str); 7] = [
            (Provider::Stripe, &[], r#"{"id":"evt_1"}"#, "evt_1"),
            (
                Provider::Github,
                &[("x-github-delivery", "72d3")],
                "",
                "72d3",
            ),
            (Provider::Slack, &[], r#"{"event_id":"Ev08"}"#, "Ev08"),
            (std, &[("svix-id", "s"), ("webhook-id", "w")], "", "w"),
            (std, &[("svix-id", "s")], "", "s"),
            (shop, &shop_both, "", "e"),
            (shop, &[("x-shopify-webhook-id", "w")], "", "w"),
        ];
        for (provider, pairs, body, expected) in cases {
            let mut headers = HeaderMap::new();
            for (name, value) in pairs {
                headers.append(HeaderName::try_from(*name).unwrap(), value.parse().unwrap());
            }
            let body = Bytes::from(body.to_owned());
            let source = provider.preset().key.unwrap();
            let key = source.extract(&headers, &body, 256).unwrap();
            assert_eq!(key.as_deref(), Some(expected), "{provider}");
        }
        assert!(
            Provider::Zoom.preset().key.is_none(),
            "Zoom sends no event id"
        );
    }

    #[test]
    fn each_preset_uses_its_provider_s_scheme() {
        let expected = [
            Scheme::Stripe,
            Scheme::github(),
            Scheme::StandardWebhooks,
            Scheme::shopify(),
            Scheme::slack(),
            Scheme::zoom(),
        ];
        for (provider, scheme) in Provider::ALL.into_iter().zip(expected) {
            assert_eq!(provider.preset().scheme, scheme, "{provider}");
        }
    }

    #[test]
    fn retention_covers_the_retry_horizon() {
        for provider in Provider::ALL {
            let preset = provider.preset();
            assert!(preset.retention > preset.retry_horizon, "{provider}");
            assert!(preset.retention >= MIN_RETENTION, "{provider}");
            assert_eq!(provider.retention_warning(preset.retention), None);
        }
        let github = Provider::Github.preset();
        assert_eq!(github.retention, Duration::from_secs(8 * DAY));
        let stripe = Provider::Stripe.preset();
        assert_eq!(stripe.retention, Duration::from_secs(31 * DAY));
        let zoom = Provider::Zoom.preset();
        assert_eq!(zoom.retention, MIN_RETENTION);
    }

    #[test]
    fn short_retention_is_warned_about() {
        let warning = Provider::Stripe.retention_warning(Duration::from_secs(DAY));
        let warning = warning.unwrap();
        assert!(
            warning.contains("stripe") && warning.contains("30d"),
            "{warning}"
        );
        let hour = Duration::from_secs(HOUR);
        assert_eq!(Provider::Slack.retention_warning(hour), None);
    }

    #[test]
    fn slack_handshakes_are_recognised() {
        let slack = Provider::Slack.preset();
        let challenge =
            br#"{"token":"Jhj5dZrV","challenge":"3eZbrw1aBm2rZgRN","type":"url_verification"}"#;
        assert!(slack.is_handshake(challenge));
        let limited =
            br#"{"token":"x","type":"app_rate_limited","minute_rate_limited":1518467820}"#;
        assert!(slack.is_handshake(limited));
        let event =
            r#"{"type":"event_callback","event_id":"Ev08","event":{"type":"url_verification"}}"#;
        let not_handshakes = [
            "",
            "type=url_verification",
            "[]",
            r#"{"type":["url_verification"]}"#,
            event,
        ];
        for body in not_handshakes {
            assert!(!slack.is_handshake(body.as_bytes()), "{body}");
        }
    }

    #[test]
    fn only_slack_forwards_verified_forms_unclaimed() {
        for provider in Provider::ALL {
            assert_eq!(
                provider.preset().keyless_forms,
                provider == Provider::Slack,
                "{provider}"
            );
        }
    }

    #[test]
    fn form_bodies_are_recognised_by_their_media_type() {
        let with = |content_type: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(http::header::CONTENT_TYPE, content_type.parse().unwrap());
            headers
        };
        for form in [
            "application/x-www-form-urlencoded",
            "Application/X-WWW-Form-Urlencoded",
            "application/x-www-form-urlencoded; charset=utf-8",
            " application/x-www-form-urlencoded ;charset=utf-8",
        ] {
            assert!(is_form(&with(form)), "{form}");
        }
        for other in [
            "application/json",
            "multipart/form-data; boundary=x",
            "application/x-www-form-urlencoded-extra",
            "text/plain; application/x-www-form-urlencoded",
            "",
        ] {
            assert!(!is_form(&with(other)), "{other}");
        }
        assert!(!is_form(&HeaderMap::new()));
    }

    #[test]
    fn other_presets_have_no_handshakes() {
        let body = br#"{"type":"url_verification","event":"endpoint.url_validation"}"#;
        let with_handshakes = [Provider::Slack, Provider::Zoom];
        for provider in Provider::ALL {
            if !with_handshakes.contains(&provider) {
                assert!(!provider.preset().is_handshake(body), "{provider}");
            }
        }
    }

    #[test]
    fn zoom_handshake_is_its_endpoint_validation() {
        let zoom = Provider::Zoom.preset();
        let body = br#"{"payload":{"plainToken":"qgg8vlvZRS6UYooatFL8Aw"},"event_ts":1654503849680,"event":"endpoint.url_validation"}"#;
        assert!(zoom.is_handshake(body));
        assert!(is_handshake(&[Handshake::zoom_url_validation()], body));
        assert!(!zoom.is_handshake(br#"{"event":"meeting.started"}"#));
        assert!(!zoom.is_handshake(br#"{"type":"url_verification"}"#));
        assert!(!is_handshake(&[], body));
    }

    #[test]
    fn handshake_rules_are_strict() {
        let parse = |yaml: &str| serde_yaml::from_str::<Handshake>(yaml);
        let rule = parse("{ json: /event, equals: endpoint.url_validation }").unwrap();
        assert_eq!(rule, Handshake::zoom_url_validation());
        assert_eq!(rule.validate(), Ok(()));
        assert!(parse("{ json: /a, equals: b, or: c }").is_err());
        assert!(parse("{ json: /a }").is_err());
        let error = Handshake::new("type", "x").validate().unwrap_err();
        assert!(error.contains("JSON pointer"), "{error}");
        assert!(Handshake::new("/type", "").validate().is_err());
    }
}
