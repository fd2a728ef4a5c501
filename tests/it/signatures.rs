//! Signature verification through the running proxy: real signatures made
//! the way each provider makes them, and for every rejection, proof that the
//! upstream received nothing and no key was claimed.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::on_both_stores;
use crate::support::{Backend, TestApp};
use dedupe_proxy::Config;

on_both_stores!(
    a_valid_stripe_delivery_is_forwarded_and_its_duplicate_suppressed,
    a_tampered_body_is_rejected_without_claiming_the_key,
    stale_and_future_timestamps_are_rejected,
    a_rotated_second_secret_is_accepted,
    a_missing_or_malformed_signature_header_is_rejected,
    every_preset_accepts_its_own_signature_and_rejects_another_secret,
    slack_url_verification_is_forwarded_without_a_claim,
    slack_commands_and_interactions_are_forwarded_without_a_claim,
    a_custom_signature_scheme_is_verified,
    zoom_routes_verify_their_timestamped_signature_and_handshake,
);

const STRIPE_SECRET: &str = "whsec_test_primary";
const STRIPE_OLD_SECRET: &str = "whsec_test_rotated_out";
const SVIX_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// Makes a provider's headers for one signing key.
type Signer<'a> = dyn Fn(&[u8]) -> Vec<(String, String)> + 'a;

fn hmac256(key: &[u8], message: &[u8]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
    mac.update(message);
    mac.finalize().into_bytes().to_vec()
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn stripe_header(secret: &str, timestamp: i64, body: &str) -> String {
    let signature = hmac256(secret.as_bytes(), format!("{timestamp}.{body}").as_bytes());
    format!("t={timestamp},v1={}", hex::encode(signature))
}

/// `X-Slack-Signature` (as Zoom's `x-zm-signature`): `v0=` and the hex
/// HMAC-SHA256 of `v0:{timestamp}:{body}`.
fn slack_signature(key: &[u8], timestamp: &str, body: &str) -> String {
    let signed = format!("v0:{timestamp}:{body}");
    format!("v0={}", hex::encode(hmac256(key, signed.as_bytes())))
}

fn add_routes(config: &mut Config, yaml: &str) {
    let routes: Vec<dedupe_proxy::config::RouteConfig> = serde_yaml::from_str(yaml).unwrap();
    config.routes.extend(routes);
}

async fn app(backend: Backend) -> TestApp {
    TestApp::spawn(backend, |config| {
        add_routes(
            config,
            &format!(
                r#"
- {{ name: stripe, path: /webhooks/stripe, provider: stripe, secrets: [{{ value: {STRIPE_SECRET} }}, {{ value: {STRIPE_OLD_SECRET} }}] }}
- {{ name: github, path: /webhooks/github, provider: github, secrets: [{{ value: gh-secret }}] }}
- {{ name: svix, path: /webhooks/svix, provider: svix, secrets: [{{ value: {SVIX_SECRET} }}] }}
- {{ name: shopify, path: /webhooks/shopify, provider: shopify, secrets: [{{ value: shop-secret }}] }}
- {{ name: slack, path: /slack/events, provider: slack, secrets: [{{ value: slack-secret }}] }}
- {{ name: partner, path: /hooks/partner, key: {{ header: X-Partner-Event }}, signature: {{ header: X-Partner-Signature, algorithm: hmac-sha256, encoding: base64, prefix: "v2:" }}, secrets: [{{ value: partner-secret }}] }}
- {{ name: zoom, path: /webhooks/zoom, provider: zoom, key: {{ json: /payload/object/uuid }}, secrets: [{{ value: zoom-secret }}] }}
- {{ name: zoom-custom, path: /webhooks/zoom-custom, key: {{ json: /payload/object/uuid }}, signature: {{ header: x-zm-signature, algorithm: hmac-sha256, encoding: hex, prefix: "v0=", timestamp_header: x-zm-request-timestamp, signed_payload: "v0:{{timestamp}}:{{body}}" }}, handshakes: [{{ json: /event, equals: endpoint.url_validation }}], secrets: [{{ value: zoom-secret }}] }}
"#
            ),
        );
    })
    .await
}

async fn deliver_stripe(
    app: &TestApp,
    signature: &str,
    body: &str,
) -> crate::support::TestResponse {
    app.post(
        "/webhooks/stripe",
        &[
            ("stripe-signature", signature),
            ("content-type", "application/json"),
        ],
        body,
    )
    .await
}

/// The upstream got nothing and the key is unclaimed: a correctly signed
/// delivery of it is forwarded as attempt 1.
async fn assert_rejected_without_trace(
    app: &TestApp,
    response: &crate::support::TestResponse,
    id: &str,
) {
    assert_eq!(
        (response.status, response.outcome()),
        (401, "rejected"),
        "{}",
        response.body
    );
    let before = app.upstream.count();
    let body = format!(r#"{{"id":"{id}","type":"charge.succeeded"}}"#);
    let valid = deliver_stripe(app, &stripe_header(STRIPE_SECRET, now(), &body), &body).await;
    assert_eq!(valid.outcome(), "forwarded");
    assert_eq!(app.upstream.count(), before + 1);
    assert_eq!(
        app.upstream
            .seen()
            .last()
            .unwrap()
            .header("x-dedupe-attempt"),
        Some("1")
    );
}

async fn a_valid_stripe_delivery_is_forwarded_and_its_duplicate_suppressed(backend: Backend) {
    let app = app(backend).await;
    let body = r#"{"id":"evt_1","type":"charge.succeeded"}"#;
    let signature = stripe_header(STRIPE_SECRET, now(), body);
    let first = deliver_stripe(&app, &signature, body).await;
    assert_eq!((first.status, first.outcome()), (200, "forwarded"));
    assert_eq!(app.upstream.seen()[0].header("x-dedupe-key"), Some("evt_1"));
    assert_eq!(
        app.upstream.seen()[0].header("stripe-signature"),
        Some(signature.as_str()),
        "signature passed on"
    );
    let again = deliver_stripe(&app, &stripe_header(STRIPE_SECRET, now(), body), body).await;
    assert_eq!(again.outcome(), "duplicate");
    assert_eq!(app.upstream.count(), 1);
}

async fn a_tampered_body_is_rejected_without_claiming_the_key(backend: Backend) {
    let app = app(backend).await;
    let signed = r#"{"id":"evt_t","amount":100}"#;
    let tampered = r#"{"id":"evt_t","amount":999}"#;
    let response =
        deliver_stripe(&app, &stripe_header(STRIPE_SECRET, now(), signed), tampered).await;
    assert!(
        response.body.contains("no signature matched"),
        "{}",
        response.body
    );
    assert_eq!(app.upstream.count(), 0);
    assert_rejected_without_trace(&app, &response, "evt_t").await;
    let metrics = app.admin_get("/metrics").await.body;
    assert!(
        metrics.contains(r#"dedupe_requests_total{outcome="rejected_signature",route="stripe"} 1"#),
        "{metrics}"
    );
}

async fn stale_and_future_timestamps_are_rejected(backend: Backend) {
    let app = app(backend).await;
    let body = r#"{"id":"evt_time"}"#;
    for skew in [-6 * 60, 6 * 60] {
        let response = deliver_stripe(
            &app,
            &stripe_header(STRIPE_SECRET, now() + skew, body),
            body,
        )
        .await;
        assert!(response.body.contains("tolerance"), "{}", response.body);
        assert_eq!(response.status, 401);
    }
    assert_eq!(app.upstream.count(), 0);
    let within = deliver_stripe(
        &app,
        &stripe_header(STRIPE_SECRET, now() - 4 * 60, body),
        body,
    )
    .await;
    assert_eq!(
        within.outcome(),
        "forwarded",
        "4 minutes old is inside the 5-minute tolerance"
    );
}

async fn a_rotated_second_secret_is_accepted(backend: Backend) {
    let app = app(backend).await;
    let body = r#"{"id":"evt_rot"}"#;
    let old = deliver_stripe(&app, &stripe_header(STRIPE_OLD_SECRET, now(), body), body).await;
    assert_eq!(old.outcome(), "forwarded");
    // Stripe sends one v1 per active secret during a rotation.
    let both = format!(
        "{},v1={}",
        stripe_header("whsec_unknown", now(), r#"{"id":"evt_rot2"}"#),
        hex::encode(hmac256(
            STRIPE_SECRET.as_bytes(),
            format!("{}.{}", now(), r#"{"id":"evt_rot2"}"#).as_bytes()
        ))
    );
    let rotated = deliver_stripe(&app, &both, r#"{"id":"evt_rot2"}"#).await;
    assert_eq!(rotated.outcome(), "forwarded", "{}", rotated.body);
    let wrong = deliver_stripe(&app, &stripe_header("whsec_attacker", now(), body), body).await;
    assert_eq!(wrong.status, 401);
    assert_eq!(app.upstream.count(), 2);
}

async fn a_missing_or_malformed_signature_header_is_rejected(backend: Backend) {
    let app = app(backend).await;
    let body = r#"{"id":"evt_h"}"#;
    let missing = app.post("/webhooks/stripe", &[], body).await;
    assert!(
        missing.body.contains("missing stripe-signature"),
        "{}",
        missing.body
    );
    let huge = format!("t={},{}", now(), "v1=00,".repeat(5000));
    for malformed in [
        "",
        "garbage",
        "t=,v1=",
        "v1=abc",
        "t=notanumber,v1=00",
        huge.as_str(),
    ] {
        let response = deliver_stripe(&app, malformed, body).await;
        assert_eq!(
            (response.status, response.outcome()),
            (401, "rejected"),
            "{malformed:.40}"
        );
    }
    assert_eq!(app.upstream.count(), 0);
    assert_rejected_without_trace(&app, &missing, "evt_h").await;
    assert_eq!(app.admin_get("/healthz").await.status, 200);
}

async fn every_preset_accepts_its_own_signature_and_rejects_another_secret(backend: Backend) {
    let app = app(backend).await;
    let ts = now().to_string();
    let body = r#"{"event_id":"Ev1","type":"event_callback"}"#;
    let svix_key = BASE64
        .decode(SVIX_SECRET.trim_start_matches("whsec_"))
        .unwrap();
    let cases: Vec<(&str, Box<Signer<'_>>)> = vec![
        (
            "/webhooks/github",
            Box::new(|key: &[u8]| {
                vec![
                    (
                        "x-github-delivery".into(),
                        "72d3162e-cc78-11e3-81ab-4c9367dc0958".into(),
                    ),
                    (
                        "x-hub-signature-256".into(),
                        format!("sha256={}", hex::encode(hmac256(key, body.as_bytes()))),
                    ),
                ]
            }),
        ),
        (
            "/webhooks/svix",
            Box::new(|key: &[u8]| {
                vec![
                    (
                        "webhook-id".into(),
                        "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W".into(),
                    ),
                    ("webhook-timestamp".into(), ts.clone()),
                    (
                        "webhook-signature".into(),
                        format!(
                            "v1,{}",
                            BASE64.encode(hmac256(
                                key,
                                format!("msg_2KWPBgLlAfxdpx2AI54pPJ85f4W.{ts}.{body}").as_bytes()
                            ))
                        ),
                    ),
                ]
            }),
        ),
        (
            "/webhooks/shopify",
            Box::new(|key: &[u8]| {
                vec![
                    (
                        "x-shopify-event-id".into(),
                        "98880550-7158-44d4-b7cd-2c97c8a091b5".into(),
                    ),
                    (
                        "x-shopify-hmac-sha256".into(),
                        BASE64.encode(hmac256(key, body.as_bytes())),
                    ),
                ]
            }),
        ),
        (
            "/slack/events",
            Box::new(|key: &[u8]| {
                vec![
                    ("x-slack-request-timestamp".into(), ts.clone()),
                    ("x-slack-signature".into(), slack_signature(key, &ts, body)),
                ]
            }),
        ),
    ];
    let keys: [&[u8]; 4] = [b"gh-secret", &svix_key, b"shop-secret", b"slack-secret"];
    for ((path, sign), key) in cases.iter().zip(keys) {
        let forged = sign(b"not-the-secret");
        let forged: Vec<(&str, &str)> = forged
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let rejected = app.post(path, &forged, body).await;
        assert_eq!(
            (rejected.status, rejected.outcome()),
            (401, "rejected"),
            "{path}"
        );
        let signed = sign(key);
        let signed: Vec<(&str, &str)> = signed
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let accepted = app.post(path, &signed, body).await;
        assert_eq!(
            (accepted.status, accepted.outcome()),
            (200, "forwarded"),
            "{path}: {}",
            accepted.body
        );
        assert_eq!(
            app.post(path, &signed, body).await.outcome(),
            "duplicate",
            "{path}"
        );
    }
    let keys_seen: Vec<_> = app
        .upstream
        .seen()
        .iter()
        .map(|s| s.header("x-dedupe-key").unwrap().to_string())
        .collect();
    assert_eq!(
        keys_seen,
        [
            "72d3162e-cc78-11e3-81ab-4c9367dc0958",
            "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W",
            "98880550-7158-44d4-b7cd-2c97c8a091b5",
            "Ev1"
        ]
    );
}

async fn slack_url_verification_is_forwarded_without_a_claim(backend: Backend) {
    let app = app(backend).await;
    let ts = now().to_string();
    let body = r#"{"token":"x","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P","type":"url_verification"}"#;
    let signature = slack_signature(b"slack-secret", &ts, body);
    let headers = [
        ("x-slack-request-timestamp", ts.as_str()),
        ("x-slack-signature", signature.as_str()),
    ];
    for _ in 0..2 {
        let response = app.post("/slack/events", &headers, body).await;
        assert_eq!((response.status, response.outcome()), (200, "passthrough"));
    }
    assert_eq!(app.upstream.count(), 2);
    assert_eq!(app.upstream.seen()[0].header("x-dedupe-key"), None);
    let unsigned = app.post("/slack/events", &[], body).await;
    assert_eq!(
        unsigned.status, 401,
        "a handshake is verified like any request"
    );
}

/// Slack's Bolt apps take events, slash commands and interactive payloads on
/// one URL; the last two are form-encoded and carry no event id.
async fn slack_commands_and_interactions_are_forwarded_without_a_claim(backend: Backend) {
    let app = app(backend).await;
    let ts = now().to_string();
    let form = "application/x-www-form-urlencoded";
    let command = "token=x&team_id=T1&command=%2Fweather&text=94070&trigger_id=13345224609.7";
    let interaction = "payload=%7B%22type%22%3A%22block_actions%22%2C%22trigger_id%22%3A%221%22%7D";
    for body in [command, command, interaction] {
        let signature = slack_signature(b"slack-secret", &ts, body);
        let headers = [
            ("content-type", form),
            ("x-slack-request-timestamp", ts.as_str()),
            ("x-slack-signature", signature.as_str()),
        ];
        let response = app.post("/slack/events", &headers, body).await;
        assert_eq!(
            (response.status, response.outcome()),
            (200, "passthrough"),
            "{body}: {}",
            response.body
        );
    }
    let seen = app.upstream.seen();
    assert_eq!(seen.len(), 3, "a repeated command is forwarded again");
    assert!(seen.iter().all(|s| s.header("x-dedupe-key").is_none()));

    let forged = [
        ("content-type", form),
        ("x-slack-request-timestamp", ts.as_str()),
        ("x-slack-signature", "v0=00"),
    ];
    let response = app.post("/slack/events", &forged, command).await;
    assert_eq!(response.status, 401, "a form is verified like any request");

    // `Content-Type` is not signed: an event re-sent as a "form" still has
    // its event id, and is claimed like any other delivery of it.
    let event = r#"{"type":"event_callback","event_id":"Ev0001","event":{"type":"message"}}"#;
    let signature = slack_signature(b"slack-secret", &ts, event);
    for (content_type, outcome) in [
        ("application/json", "forwarded"),
        (form, "duplicate"),
        (form, "duplicate"),
    ] {
        let headers = [
            ("content-type", content_type),
            ("x-slack-request-timestamp", ts.as_str()),
            ("x-slack-signature", signature.as_str()),
        ];
        let response = app.post("/slack/events", &headers, event).await;
        assert_eq!(
            (response.status, response.outcome()),
            (200, outcome),
            "{content_type}: {}",
            response.body
        );
    }
    assert_eq!(app.upstream.count(), 4, "the event reached the app once");
    assert_eq!(
        app.upstream.seen()[3].header("x-dedupe-key"),
        Some("Ev0001")
    );

    // Only Slack's preset takes forms as keyless: elsewhere a JSON key still
    // needs a JSON body.
    let t = now();
    let stripe = [
        ("content-type", form),
        (
            "stripe-signature",
            &stripe_header(STRIPE_SECRET, t, command),
        ),
    ];
    let response = app.post("/webhooks/stripe", &stripe, command).await;
    assert_eq!(response.status, 400, "{}", response.body);
    assert_eq!(app.upstream.count(), 4);
}

async fn a_custom_signature_scheme_is_verified(backend: Backend) {
    let app = app(backend).await;
    let body = "order=42";
    let signature = format!(
        "v2:{}",
        BASE64.encode(hmac256(b"partner-secret", body.as_bytes()))
    );
    let headers = [
        ("x-partner-event", "p-1"),
        ("x-partner-signature", signature.as_str()),
    ];
    assert_eq!(
        app.post("/hooks/partner", &headers, body).await.outcome(),
        "forwarded"
    );
    assert_eq!(
        app.post("/hooks/partner", &headers, body).await.outcome(),
        "duplicate"
    );
    let unprefixed = BASE64.encode(hmac256(b"partner-secret", body.as_bytes()));
    let bad = app
        .post(
            "/hooks/partner",
            &[
                ("x-partner-event", "p-2"),
                ("x-partner-signature", &unprefixed),
            ],
            body,
        )
        .await;
    assert_eq!(bad.status, 401);
    assert_eq!(app.upstream.count(), 1);
}

/// Zoom signs `v0:{x-zm-request-timestamp}:{body}`: the `zoom` preset, and
/// a custom signature with a timestamp header spelling out the same scheme,
/// verify it, the URL validation handshake included.
async fn zoom_routes_verify_their_timestamped_signature_and_handshake(backend: Backend) {
    let app = app(backend).await;
    for path in ["/webhooks/zoom", "/webhooks/zoom-custom"] {
        let forwarded_before = app.upstream.count();
        zoom_route_verifies(&app, path).await;
        assert_eq!(app.upstream.count() - forwarded_before, 2, "{path}");
    }
}

async fn zoom_route_verifies(app: &TestApp, path: &str) {
    let zoom = |body: &str, timestamp: i64, secret: &[u8]| {
        let timestamp = timestamp.to_string();
        let signature = slack_signature(secret, &timestamp, body);
        [
            ("x-zm-request-timestamp".to_string(), timestamp),
            ("x-zm-signature".to_string(), signature),
        ]
    };
    let post = |body: &'static str, headers: [(String, String); 2]| async move {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        app.post(path, &headers, body).await
    };
    let handshake = r#"{"event":"endpoint.url_validation","payload":{"plainToken":"qgg8vlvZRS6UYooatFL8Aw"},"event_ts":1700000000000}"#;
    let answered = post(handshake, zoom(handshake, now(), b"zoom-secret")).await;
    assert_eq!((answered.status, answered.outcome()), (200, "passthrough"));
    let handshake_seen = app.upstream.seen().last().cloned().unwrap();
    assert_eq!(handshake_seen.header("x-dedupe-key"), None, "{path}");
    let event =
        r#"{"event":"meeting.ended","payload":{"object":{"uuid":"m-1"}},"event_ts":1700000000001}"#;
    let first = post(event, zoom(event, now(), b"zoom-secret")).await;
    assert_eq!(first.outcome(), "forwarded", "{path}");
    let event_seen = app.upstream.seen().last().cloned().unwrap();
    assert_eq!(event_seen.header("x-dedupe-key"), Some("m-1"), "{path}");
    let again = post(event, zoom(event, now(), b"zoom-secret")).await;
    assert_eq!(again.outcome(), "duplicate", "{path}");
    for (headers, why) in [
        (zoom(handshake, now(), b"other-secret"), "another secret"),
        (
            zoom(handshake, now() - 600, b"zoom-secret"),
            "a stale timestamp",
        ),
        (
            zoom(handshake, now() + 600, b"zoom-secret"),
            "a future timestamp",
        ),
    ] {
        let refused = post(handshake, headers).await;
        assert_eq!(refused.status, 401, "{path}: {why}");
    }
}
