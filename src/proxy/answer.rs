//! Every way a webhook can end, and the one place that turns each into an
//! HTTP response, an `X-Dedupe-Outcome` value and a metrics outcome label.

use std::sync::LazyLock;
use std::time::Duration;

use crate::upstream::{ResponseBody, ResponseBodyError, SenderBodyError, UpstreamError};
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde::Serialize;

/// The response body type of the webhook listener.
pub type Body = http_body_util::combinators::BoxBody<Bytes, ResponseBodyError>;

/// The header naming how the proxy handled a request.
pub const OUTCOME_HEADER: &str = "x-dedupe-outcome";
// Built at compile time: a name parsed from a string costs a parse per response.
const OUTCOME_HEADER_NAME: HeaderName = HeaderName::from_static(OUTCOME_HEADER);

/// How a webhook ended.
#[derive(Debug)]
pub enum Answer {
    /// A won claim, forwarded; the upstream's response.
    Forwarded(Response<ResponseBody>),
    /// Forwarded without deduplication (unmatched route, shadow mode, no
    /// key with `forward`, store down with `forward`).
    Passthrough(Response<ResponseBody>, PassReason),
    /// The key is `done`.
    Duplicate(StatusCode),
    /// Another delivery holds the key.
    InFlight(StatusCode, Duration),
    /// The request was refused before anything was claimed.
    Rejected(Rejection),
    /// The proxy cannot decide right now; the sender should retry.
    Unavailable(Unavailable, Duration),
    /// The upstream gave no response.
    UpstreamError(UpstreamError),
    /// In shadow mode, the upstream gave no response to a delivery that
    /// enforcing would have answered itself: the sender gets the upstream
    /// error, the metrics what enforcing would have done.
    ShadowedUpstreamError {
        error: UpstreamError,
        enforced: &'static str,
    },
}

/// Why a request was forwarded without deduplication (metrics outcome).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassReason {
    /// No route, or no key with `on_missing_key: forward`.
    NotDeduplicated,
    /// The store is down and `on_unavailable: forward`.
    StoreUnavailable,
    /// Shadow mode; holds the metrics outcome enforcing would have had.
    Shadow(&'static str),
}

/// 4xx reasons.
#[derive(Debug)]
pub enum Rejection {
    /// 400: the route needs a key and the request has none; where it was
    /// looked for.
    MissingKey(String),
    /// 400: malformed request (bad key, body not JSON, unreadable body).
    BadRequest(String),
    /// 401: signature missing or wrong.
    Signature(String),
    /// 404: no route and `unmatched: reject`.
    NoRoute,
    /// 408: the body did not arrive within `limits.body_read_timeout`.
    Timeout,
    /// 413: body over `limits.max_body_bytes`.
    TooLarge(usize),
    /// 422: key reused with another body and `on_payload_mismatch: reject`.
    PayloadMismatch,
}

/// A sender's streamed body that stalled (408) or could not be read (400).
impl From<SenderBodyError> for Rejection {
    fn from(fault: SenderBodyError) -> Self {
        match fault {
            SenderBodyError::Timeout(_) => Rejection::Timeout,
            SenderBodyError::Unreadable(_) => Rejection::BadRequest(fault.to_string()),
        }
    }
}

/// 503 reasons.
#[derive(Debug, Clone, Copy)]
pub enum Unavailable {
    /// The store could not be reached or failed.
    Store,
    /// Too little of the lease was left to forward safely.
    LeaseTooShort,
    /// Over `limits.max_concurrent_requests`, or a body past
    /// `limits.max_buffered_body_bytes`; `body_left` when part of the body
    /// was still to come (its HTTP/1 connection can carry nothing more).
    Overloaded { body_left: bool },
    /// Won after shutdown had settled the open claims: released instead.
    ShuttingDown,
}

/// The `outcome` of a request refused as malformed.
pub(super) const REJECTED_BAD_REQUEST: &str = "rejected_bad_request";

impl Answer {
    /// Whether the answer comes before the request's body was read to its
    /// end (too large, too slow, or broken on its way to the upstream): what
    /// follows on the connection cannot be told from the rest of the body, so
    /// the connection carries no other request, and the answer says so.
    pub fn leaves_body_unread(&self) -> bool {
        matches!(
            self,
            Answer::Rejected(Rejection::TooLarge(_) | Rejection::Timeout)
                | Answer::UpstreamError(UpstreamError::SenderBody(_))
                | Answer::Unavailable(Unavailable::Overloaded { body_left: true }, _)
        )
    }

    /// The `outcome` label of `dedupe_requests_total`.
    pub fn metric_outcome(&self) -> &'static str {
        match self {
            Answer::Forwarded(_) => "forwarded",
            Answer::Passthrough(_, PassReason::NotDeduplicated) => "passthrough",
            Answer::Passthrough(_, PassReason::StoreUnavailable) => "store_unavailable",
            Answer::Passthrough(_, PassReason::Shadow(enforced)) => enforced,
            Answer::Duplicate(_) => "duplicate",
            Answer::InFlight(..) => "in_flight",
            Answer::Rejected(Rejection::MissingKey(_)) => "rejected_missing_key",
            // An unmatched request refused with 404 is told apart by its
            // `route="unmatched"` label; the outcome stays one of the
            // documented values.
            Answer::Rejected(
                Rejection::BadRequest(_) | Rejection::Timeout | Rejection::NoRoute,
            ) => REJECTED_BAD_REQUEST,
            Answer::Rejected(Rejection::Signature(_)) => "rejected_signature",
            Answer::Rejected(Rejection::TooLarge(_)) => "rejected_too_large",
            Answer::Rejected(Rejection::PayloadMismatch) => "rejected_payload_mismatch",
            Answer::Unavailable(Unavailable::Overloaded { .. }, _) => "overloaded",
            Answer::Unavailable(..) => "store_unavailable",
            Answer::UpstreamError(_) => "upstream_error",
            Answer::ShadowedUpstreamError { enforced, .. } => enforced,
        }
    }

    /// The `X-Dedupe-Outcome` value.
    pub fn header_outcome(&self) -> &'static str {
        match self {
            Answer::Forwarded(_) => "forwarded",
            Answer::Passthrough(..) => "passthrough",
            Answer::Duplicate(_) => "duplicate",
            Answer::InFlight(..) => "in-flight",
            Answer::Rejected(_) => "rejected",
            Answer::Unavailable(..) => "unavailable",
            Answer::UpstreamError(_) | Answer::ShadowedUpstreamError { .. } => "upstream-error",
        }
    }

    /// Why the proxy answered as it did, for the request's log line, where
    /// the outcome alone does not say: a rejection's detail (which header,
    /// which signature check, what about the body), the upstream's failure.
    pub fn reason(&self) -> Option<String> {
        match self {
            Answer::Rejected(rejection) => Some(rejection.status_and_detail().1),
            Answer::UpstreamError(error) | Answer::ShadowedUpstreamError { error, .. } => {
                Some(format!(
                    "the upstream gave no response: {}",
                    crate::error_chain(error)
                ))
            }
            Answer::Unavailable(Unavailable::LeaseTooShort, _) => {
                Some("the claim's lease ran short before forwarding".into())
            }
            _ => None,
        }
    }

    /// The upstream's status, when it answered.
    pub fn upstream_status(&self) -> Option<u16> {
        match self {
            Answer::Forwarded(response) | Answer::Passthrough(response, _) => {
                Some(response.status().as_u16())
            }
            _ => None,
        }
    }

    /// The response to send.
    pub fn into_response(self) -> Response<Body> {
        let outcome = HeaderValue::from_static(self.header_outcome());
        let mut response = match self {
            Answer::Forwarded(response) | Answer::Passthrough(response, _) => {
                let mut response = response.map(BodyExt::boxed);
                // The sender's connection has its own protocol version.
                *response.version_mut() = http::Version::HTTP_11;
                response
            }
            Answer::Duplicate(status) => duplicate(status),
            Answer::InFlight(status, retry_after) => with_retry_after(
                plain(
                    status,
                    "in-flight",
                    "another delivery of this event is being processed; retry later",
                ),
                retry_after,
            ),
            Answer::Rejected(rejection) => {
                let (status, detail) = rejection.status_and_detail();
                plain(status, "rejected", &detail)
            }
            Answer::Unavailable(reason, retry_after) => {
                let detail = match reason {
                    Unavailable::Store => "the idempotency store is unavailable; retry later",
                    Unavailable::LeaseTooShort => {
                        "the claim's lease ran short before forwarding; retry later"
                    }
                    Unavailable::Overloaded { .. } => "too many concurrent requests; retry later",
                    Unavailable::ShuttingDown => "the proxy is shutting down; retry later",
                };
                with_retry_after(
                    plain(StatusCode::SERVICE_UNAVAILABLE, "unavailable", detail),
                    retry_after,
                )
            }
            Answer::UpstreamError(error) | Answer::ShadowedUpstreamError { error, .. } => {
                let status = match error {
                    UpstreamError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
                    UpstreamError::Connect(_) | UpstreamError::Failed(_) => StatusCode::BAD_GATEWAY,
                    // Unmatched requests answer it as a rejection; a
                    // webhook's body is whole before it is sent.
                    UpstreamError::SenderBody(_) => StatusCode::BAD_REQUEST,
                };
                let detail = match error {
                    UpstreamError::Timeout(_) => "the upstream did not answer in time",
                    UpstreamError::Connect(_) => "the upstream could not be reached",
                    UpstreamError::Failed(_) => "the upstream connection failed",
                    UpstreamError::SenderBody(_) => "the request body could not be read",
                };
                plain(status, "upstream-error", detail)
            }
        };
        response.headers_mut().insert(OUTCOME_HEADER_NAME, outcome);
        response
    }
}

impl Rejection {
    fn status_and_detail(&self) -> (StatusCode, String) {
        match self {
            Rejection::MissingKey(expected) => (
                StatusCode::BAD_REQUEST,
                format!("no idempotency key found in the request: expected {expected}"),
            ),
            Rejection::BadRequest(detail) => (StatusCode::BAD_REQUEST, detail.clone()),
            Rejection::Signature(detail) => (StatusCode::UNAUTHORIZED, detail.clone()),
            Rejection::Timeout => (
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time".into(),
            ),
            Rejection::NoRoute => (
                StatusCode::NOT_FOUND,
                "no webhook route matches this request".into(),
            ),
            Rejection::TooLarge(limit) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("body exceeds the {limit}-byte limit"),
            ),
            Rejection::PayloadMismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "this event id was delivered before with a different body".into(),
            ),
        }
    }
}

/// A proxy-made answer's body, `{"detail":…,"outcome":…}`.
#[derive(Serialize)]
struct Explanation<'a> {
    detail: &'a str,
    outcome: &'a str,
}

fn explanation(outcome: &str, detail: &str) -> Vec<u8> {
    serde_json::to_vec(&Explanation { detail, outcome }).expect("text serializes")
}

fn plain(status: StatusCode, outcome: &str, detail: &str) -> Response<Body> {
    json_response(status, Bytes::from(explanation(outcome, detail)))
}

/// The answer to a duplicate: the same body every time, so made once (a
/// duplicate's answer is most of what a burst of replays costs the proxy).
fn duplicate(status: StatusCode) -> Response<Body> {
    static BODY: LazyLock<Vec<u8>> =
        LazyLock::new(|| explanation("duplicate", "this event was already processed"));
    json_response(status, Bytes::from_static(BODY.as_slice()))
}

fn json_response(status: StatusCode, body: Bytes) -> Response<Body> {
    // RFC 9110 gives a 204, 205 or 304 no content (a configurable status can
    // be one). hyper leaves out a 204's or 304's body over HTTP/1 only; over
    // HTTP/2 the sender would take the body for a protocol error.
    let without_content = [
        StatusCode::NO_CONTENT,
        StatusCode::RESET_CONTENT,
        StatusCode::NOT_MODIFIED,
    ]
    .contains(&status);
    let body = if without_content { Bytes::new() } else { body };
    let mut response = Response::new(Full::new(body).map_err(|never| match never {}).boxed());
    *response.status_mut() = status;
    if !without_content {
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    }
    response
}

fn with_retry_after(mut response: Response<Body>, retry_after: Duration) -> Response<Body> {
    let seconds = retry_after.as_secs_f64().ceil().max(1.0) as u64;
    response.headers_mut().insert(RETRY_AFTER, seconds.into());
    response
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::metrics::labels;

    /// The answers made without an upstream response; those with one are
    /// `forwarded` or `passthrough`, or in shadow mode one of these.
    fn answers_without_a_response() -> Vec<Answer> {
        let wait = Duration::from_secs(1);
        let mut answers = vec![
            Answer::Duplicate(StatusCode::OK),
            Answer::InFlight(StatusCode::CONFLICT, wait),
            Answer::UpstreamError(UpstreamError::Timeout(wait)),
        ];
        answers.extend(
            [
                Rejection::MissingKey(String::new()),
                Rejection::BadRequest(String::new()),
                Rejection::Signature(String::new()),
                Rejection::NoRoute,
                Rejection::Timeout,
                Rejection::TooLarge(1),
                Rejection::PayloadMismatch,
            ]
            .map(Answer::Rejected),
        );
        answers.extend(
            [
                Unavailable::Store,
                Unavailable::LeaseTooShort,
                Unavailable::Overloaded { body_left: false },
                Unavailable::Overloaded { body_left: true },
                Unavailable::ShuttingDown,
            ]
            .map(|why| Answer::Unavailable(why, wait)),
        );
        answers
    }

    #[test]
    fn every_outcome_is_created_at_start_up() {
        for answer in answers_without_a_response() {
            let outcome = answer.metric_outcome();
            assert!(labels::OUTCOMES.contains(&outcome), "{outcome}");
        }
        for outcome in ["forwarded", "passthrough"] {
            assert!(labels::OUTCOMES.contains(&outcome), "{outcome}");
        }
        for unmatched in [
            Answer::Rejected(Rejection::NoRoute),
            Answer::Unavailable(Unavailable::Overloaded { body_left: false }, Duration::ZERO),
            Answer::UpstreamError(UpstreamError::Connect(String::new())),
        ] {
            let outcome = unmatched.metric_outcome();
            assert!(labels::UNMATCHED_OUTCOMES.contains(&outcome), "{outcome}");
        }
    }

    #[tokio::test]
    async fn proxy_made_answers_explain_themselves_in_json() {
        let cases = [
            (
                Answer::Duplicate(StatusCode::ACCEPTED),
                202,
                r#"{"detail":"this event was already processed","outcome":"duplicate"}"#,
            ),
            (
                Answer::Rejected(Rejection::BadRequest(r#"a "quoted" \ detail"#.into())),
                400,
                r#"{"detail":"a \"quoted\" \\ detail","outcome":"rejected"}"#,
            ),
        ];
        for (answer, status, body) in cases {
            let response = answer.into_response();
            assert_eq!(response.status(), status);
            assert_eq!(response.headers()["content-type"], "application/json");
            let sent = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(std::str::from_utf8(&sent).unwrap(), body);
        }
    }

    /// RFC 9110 gives a 204, 205 or 304 no content; hyper leaves out only a
    /// 204's and a 304's body, and over HTTP/1 only.
    #[tokio::test]
    async fn answers_without_content_have_no_body() {
        let wait = Duration::from_secs(1);
        for answer in [
            Answer::Duplicate(StatusCode::NO_CONTENT),
            Answer::Duplicate(StatusCode::RESET_CONTENT),
            Answer::Duplicate(StatusCode::NOT_MODIFIED),
            Answer::InFlight(StatusCode::NOT_MODIFIED, wait),
        ] {
            let response = answer.into_response();
            assert!(response.headers().get("content-type").is_none());
            let sent = response.into_body().collect().await.unwrap().to_bytes();
            assert!(sent.is_empty());
        }
    }
}
