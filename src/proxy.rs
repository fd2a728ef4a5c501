//! The request flow: route, read, key, claim, forward, settle, answer. Owns
//! the order of those steps and the guarantees between them (settle before
//! answering, enough lease left before forwarding); the steps themselves
//! live in their modules.

mod answer;
mod body;
mod forward;
mod malformed;
mod open_claims;
mod record;
mod settle;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response, Version, header};
use hyper::body::Incoming;
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::task::TaskTracker;

pub use answer::{Answer, Body, OUTCOME_HEADER, PassReason, Rejection, Unavailable};
use forward::unclaimed_dedupe_headers;
use malformed::malformation;
pub use open_claims::{OpenClaim, OpenClaims};
use record::{InFlight, class_of, log_request};

use crate::config::{Config, Mode, OnMissingKey, OnUnavailable, UNMATCHED_ROUTE, Unmatched};
use crate::key::KeyError;
use crate::metrics::{Metrics, UpstreamSeries};
use crate::route::{NearMiss, Route, Routes};
use crate::store::{Claim, ClaimRequest, Fence, Store};
use crate::upstream::{Outgoing, Peer, StreamedBody, Upstream, UpstreamError};
use crate::verify::{self, Verified};

/// Everything a request needs, shared by all connections.
pub struct Proxy {
    routes: Routes,
    store: Store,
    upstream: Upstream,
    metrics: Metrics,
    /// Counted on every unmatched request, so looked up once.
    unmatched_upstream: UpstreamSeries,
    open_claims: Arc<OpenClaims>,
    concurrency: Arc<Semaphore>,
    /// One permit per byte of request body held (`limits.max_buffered_body_bytes`).
    body_budget: Arc<Semaphore>,
    /// The webhooks being processed: shutdown waits for them, as some have
    /// no connection left that would (an HTTP/2 sender that reset its
    /// stream, or its connection, while the upstream had the request).
    webhooks: TaskTracker,
    settings: Settings,
}

struct Settings {
    max_body_bytes: usize,
    max_key_bytes: usize,
    body_read_timeout: Duration,
    lease: Duration,
    upstream_timeout: Duration,
    on_unavailable: OnUnavailable,
    retry_after: Duration,
    unmatched: Unmatched,
}

/// What the flow decided before anything was forwarded.
enum Decision {
    /// Forward a won claim, then settle it.
    Claimed(Won),
    /// Forward without deduplication.
    Pass(PassReason),
    /// Answer without forwarding (in shadow mode: forward, recording this).
    Answer(Answer),
}

impl Decision {
    /// The answer to a delivery whose claim did not win: done, or in flight
    /// (also while this replica's own outcome for the key is unwritten), or
    /// its body rejected as a mismatch.
    fn lost(route: &Route, claim: &Claim) -> Self {
        Decision::Answer(match claim {
            _ if route.rejects(claim) => Answer::Rejected(Rejection::PayloadMismatch),
            Claim::Done { .. } => Answer::Duplicate(route.duplicate_status),
            Claim::InFlight { .. } | Claim::Won { .. } => {
                Answer::InFlight(route.in_flight_status, route.in_flight_retry_after)
            }
        })
    }
}

/// A request whose route's signature policy has been applied: the only form
/// in which a matched request can be forwarded.
struct Checked {
    parts: Parts,
    body: Bytes,
    peer: Peer,
    _verified: Verified,
}

/// A webhook's place under `limits.max_concurrent_requests` and in
/// `dedupe_in_flight_requests`, and its body's under
/// `limits.max_buffered_body_bytes`, held until its processing ends.
struct Held {
    _permit: OwnedSemaphorePermit,
    _in_flight: InFlight,
    body: Option<OwnedSemaphorePermit>,
}

/// Counts and logs an HTTP/2 request whose sender reset its stream while
/// the proxy waited: hyper drops the request's future then, and nothing
/// else would. A webhook so reset once its body was read is not claimed; an
/// unmatched request so reset before the upstream's answer is abandoned, its
/// upstream connection closed, as a reverse proxy does when its sender
/// leaves (its body may have ended early: hyper reads a stream reset with
/// NO_ERROR as the body's end).
struct RecordIfDropped<'a> {
    proxy: &'a Proxy,
    route: &'a str,
    webhook: bool,
    started: Instant,
    reason: &'static str,
}

impl Drop for RecordIfDropped<'_> {
    fn drop(&mut self) {
        let answer = Answer::Rejected(Rejection::BadRequest(self.reason.into()));
        let trace = Trace::default();
        self.proxy
            .record(self.webhook, self.route, &trace, &answer, self.started);
    }
}

/// A claim this request won, with enough of its lease left to forward.
struct Won {
    request: ClaimRequest,
    fence: Fence,
    /// The store holds another body for the key's first delivery.
    payload_mismatch: bool,
}

/// What the per-webhook log line reports besides the outcome.
#[derive(Default)]
struct Trace {
    key: Option<String>,
    attempt: Option<i32>,
    store_time: Duration,
    upstream_time: Option<Duration>,
}

impl Proxy {
    /// Builds the proxy from validated configuration, with upstream
    /// connections kept apart for each of `lanes` serving threads.
    pub fn new(
        config: &Config,
        store: Store,
        metrics: Metrics,
        lanes: usize,
    ) -> Result<Self, String> {
        Ok(Self {
            routes: Routes::compile(config)?,
            store,
            upstream: Upstream::new(&config.upstream, lanes)
                .map_err(|error| format!("upstream: {error}"))?,
            unmatched_upstream: metrics.upstream_series(UNMATCHED_ROUTE),
            metrics,
            open_claims: Arc::default(),
            concurrency: Arc::new(Semaphore::new(config.limits.max_concurrent_requests)),
            body_budget: Arc::new(Semaphore::new(config.limits.max_buffered_body_bytes)),
            webhooks: TaskTracker::new(),
            settings: Settings {
                max_body_bytes: config.limits.max_body_bytes,
                max_key_bytes: config.limits.max_key_bytes,
                body_read_timeout: config.limits.body_read_timeout,
                lease: config.store.lease,
                upstream_timeout: config.upstream.timeout,
                on_unavailable: config.store.on_unavailable,
                retry_after: config.store.retry_after,
                unmatched: config.unmatched,
            },
        })
    }

    /// The claims won and not yet settled.
    pub fn open_claims(&self) -> &OpenClaims {
        &self.open_claims
    }

    /// The store, for shutdown's final settles.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Waits until every webhook being processed has ended, or `deadline`;
    /// called once the connections have drained. Whether they all ended.
    pub async fn finish_webhooks(&self, deadline: Instant) -> bool {
        self.webhooks.close();
        if self.webhooks.is_empty() {
            return true;
        }
        // Called with time left, once every connection has ended: what is
        // still being processed has lost its sender.
        tracing::info!(
            webhooks = self.webhooks.len(),
            "shutdown waits for webhooks whose senders have gone"
        );
        let deadline = tokio::time::Instant::from_std(deadline);
        tokio::time::timeout_at(deadline, self.webhooks.wait())
            .await
            .is_ok()
    }

    /// Counts a request that hyper answered itself before it reached
    /// [`Proxy::handle`]: one it could not parse, or over the header limits
    /// (400, 431). It was never routed, so it counts as unmatched.
    pub fn count_unparsable_request(&self) {
        self.metrics
            .requests
            .with_label_values(&[UNMATCHED_ROUTE, answer::REJECTED_BAD_REQUEST])
            .inc();
    }

    /// Handles one request on the webhook listener.
    pub async fn handle(
        self: &Arc<Self>,
        request: Request<Incoming>,
        peer: Peer,
    ) -> Response<Body> {
        let started = Instant::now();
        let in_flight = InFlight::count(&self.metrics.in_flight);
        let route = self.routes.find(request.method(), request.uri().path());
        let near_miss = self
            .routes
            .near_miss(request.method(), request.uri().path(), route);
        let route_name = near_miss
            .map(NearMiss::route)
            .or(route)
            .map_or(UNMATCHED_ROUTE, |route| &*route.name);
        let malformed = malformation(&request);
        let version = request.version();
        let (answer, upstream_time) = match Arc::clone(&self.concurrency).try_acquire_owned() {
            _ if let Some(problem) = malformed => (
                Answer::Rejected(Rejection::BadRequest(problem.into())),
                None,
            ),
            _ if let Some(near_miss) = near_miss => (
                Answer::Rejected(Rejection::BadRequest(near_miss.refusal(request.method()))),
                None,
            ),
            Err(_) => {
                // Refused before a byte of the body is read: drained like a
                // 413's, so the sender is not cut off writing it and gets
                // the 503 and its Retry-After.
                let (parts, body) = request.into_parts();
                let body_left = self.discard_rest(&parts, body);
                (
                    Answer::Unavailable(
                        Unavailable::Overloaded { body_left },
                        self.settings.retry_after,
                    ),
                    None,
                )
            }
            // Boxed: hyper keeps one slot per connection for this future from
            // the connection's first request to its close, so what it holds
            // inline is memory every idle keep-alive connection pays for.
            Ok(permit) => match route {
                // Counted and logged where it is decided, which is not
                // cancelled when the sender hangs up.
                Some(route) => {
                    let held = Held {
                        _permit: permit,
                        _in_flight: in_flight,
                        body: None,
                    };
                    let answer = Box::pin(self.webhook(route, request, peer, started, held)).await;
                    return respond(answer, false, version);
                }
                None if version == Version::HTTP_2 => {
                    let reset = RecordIfDropped {
                        proxy: self,
                        route: UNMATCHED_ROUTE,
                        webhook: false,
                        started,
                        reason: "the sender reset the stream before the upstream answered; the exchange was abandoned",
                    };
                    let answer = Box::pin(self.unmatched(request, peer, started)).await;
                    std::mem::forget(reset);
                    answer
                }
                None => Box::pin(self.unmatched(request, peer, started)).await,
            },
        };
        let trace = Trace {
            upstream_time,
            ..Trace::default()
        };
        self.record(
            route.is_some() || near_miss.is_some(),
            route_name,
            &trace,
            &answer,
            started,
        );
        respond(answer, malformed.is_some(), version)
    }

    /// Counts a request's outcome and writes its log line.
    fn record(&self, webhook: bool, route: &str, trace: &Trace, answer: &Answer, started: Instant) {
        self.metrics
            .requests
            .with_label_values(&[route, answer.metric_outcome()])
            .inc();
        log_request(webhook, route, trace, answer, started);
    }

    /// The answer, and how long the upstream took when it was asked.
    async fn unmatched(
        &self,
        request: Request<Incoming>,
        peer: Peer,
        started: Instant,
    ) -> (Answer, Option<Duration>) {
        if self.settings.unmatched == Unmatched::Reject {
            return (Answer::Rejected(Rejection::NoRoute), None);
        }
        let (parts, body) = request.into_parts();
        let body = StreamedBody::new(body, started, self.settings.body_read_timeout);
        let sent_at = Instant::now();
        let result = self
            .upstream
            .send(parts, Outgoing::Streamed(body), peer, None, None)
            .await;
        let upstream_time = sent_at.elapsed();
        let result = match result {
            Err(UpstreamError::SenderBody(fault)) => {
                return (Answer::Rejected(fault.into()), Some(upstream_time));
            }
            result => result,
        };
        self.unmatched_upstream
            .observe(class_of(&result), upstream_time);
        let answer = match result {
            Ok(response) => Answer::Passthrough(response, PassReason::NotDeduplicated),
            Err(error) => Answer::UpstreamError(error),
        };
        (answer, Some(upstream_time))
    }

    /// Reads a webhook, then runs the rest detached: once the store has been
    /// asked to claim its key, a sender that hangs up must not cancel the
    /// claim's forwarding and settling, or the key would stay `processing`
    /// until its lease expired (and an effect might go unrecorded). The
    /// detached part holds the request's place under
    /// `limits.max_concurrent_requests` and its body's bytes: a sender that
    /// cancels its HTTP/2 streams as soon as they are read would otherwise
    /// start any number.
    async fn webhook(
        self: &Arc<Self>,
        route: &Arc<Route>,
        request: Request<Incoming>,
        peer: Peer,
        started: Instant,
        mut held: Held,
    ) -> Answer {
        let (parts, body) = match self.read(request, &mut held.body).await {
            Ok(read) => read,
            Err(answer) => {
                self.record(true, &route.name, &Trace::default(), &answer, started);
                return answer;
            }
        };
        if parts.version == Version::HTTP_2 {
            // hyper ends an HTTP/2 body cut off by RST_STREAM(NO_ERROR) as
            // if it were whole: read that way, a truncated event would be
            // claimed and forwarded, and its real delivery answered as a
            // duplicate. hyper checks for a reset whenever this future
            // waits, and drops it on one, so waiting once here, before the
            // webhook is handed to a task that outlives the sender, lets a
            // reset stream go unclaimed. Counted and logged all the same.
            let reset = RecordIfDropped {
                proxy: self,
                route: &route.name,
                webhook: true,
                started,
                reason: "the sender reset the stream before the webhook was claimed",
            };
            tokio::task::yield_now().await;
            std::mem::forget(reset);
        }
        let processing = Arc::clone(self).process(Arc::clone(route), parts, body, peer, started);
        // Boxed, so that the task moves a pointer rather than the whole
        // future: spawned inline, beside `held`, it cost about 4 KiB more of
        // resident memory per idle keep-alive connection that had delivered
        // a webhook, and more CPU per request (bench/HISTORY.md).
        let processing = Box::pin(processing);
        let task = self.webhooks.spawn(async move {
            let _held = held;
            processing.await
        });
        task.await.unwrap_or_else(|error| {
            let failure = UpstreamError::Failed(format!("webhook task failed: {error}"));
            let answer = Answer::UpstreamError(failure);
            self.record(true, &route.name, &Trace::default(), &answer, started);
            answer
        })
    }

    async fn process(
        self: Arc<Self>,
        route: Arc<Route>,
        parts: Parts,
        body: Bytes,
        peer: Peer,
        started: Instant,
    ) -> Answer {
        let mut trace = Trace::default();
        let answer = self
            .verified_webhook(&route, parts, body, peer, &mut trace)
            .await;
        self.record(true, &route.name, &trace, &answer, started);
        answer
    }

    async fn verified_webhook(
        &self,
        route: &Arc<Route>,
        parts: Parts,
        body: Bytes,
        peer: Peer,
        trace: &mut Trace,
    ) -> Answer {
        // Nothing in the request is trusted before this, in any mode.
        let now = SystemTime::now();
        let verified =
            match verify::verify_route(route.verifier.as_ref(), &parts.headers, &body, now) {
                Ok(verified) => verified,
                Err(error) => return Answer::Rejected(Rejection::Signature(error.to_string())),
            };
        let decision = self.decide(route, &parts, &body, trace).await;
        let request = Checked {
            parts,
            body,
            peer,
            _verified: verified,
        };
        let shadow = route.mode == Mode::Shadow;
        match decision {
            Decision::Claimed(claim) => {
                match self.forward_claimed(route, claim, request, trace).await {
                    Answer::Forwarded(response) if shadow => {
                        Answer::Passthrough(response, PassReason::Shadow("forwarded"))
                    }
                    answer => answer,
                }
            }
            // A key found but not claimed (store down, or shadow) still goes
            // to the application, which may deduplicate on it itself.
            Decision::Pass(reason) => {
                let dedupe = unclaimed_dedupe_headers(route, trace);
                self.pass(route, request, reason, dedupe, trace).await
            }
            // Shadow mode records what enforcing would answer, and forwards.
            Decision::Answer(answer) if shadow => {
                let reason = PassReason::Shadow(answer.metric_outcome());
                let dedupe = unclaimed_dedupe_headers(route, trace);
                self.pass(route, request, reason, dedupe, trace).await
            }
            Decision::Answer(answer) => answer,
        }
    }

    /// Everything before forwarding: key, claim, and what the claim means.
    async fn decide(
        &self,
        route: &Route,
        parts: &Parts,
        body: &Bytes,
        trace: &mut Trace,
    ) -> Decision {
        if route.is_handshake(body) {
            return Decision::Pass(PassReason::NotDeduplicated);
        }
        let key = match self.key_of(route, parts, body) {
            ControlFlow::Continue(key) => key,
            ControlFlow::Break(decision) => return decision,
        };
        trace.key = Some(key.clone());
        let payload_sha256: [u8; 32] = Sha256::digest(body).into();
        // Our own claim on the key has an outcome the store has not taken yet
        // (it was down): past the claim's lease the store would hand the key
        // to this retry, and the event would be forwarded again.
        if let Some(unwritten) = self.open_claims.unwritten_outcome(&route.name, &key) {
            let in_flight = Claim::InFlight {
                payload_mismatch: unwritten.payload_mismatch(&payload_sha256),
            };
            self.count_claim(route, &key, &in_flight);
            return Decision::lost(route, &in_flight);
        }
        let request = ClaimRequest {
            source: Arc::clone(&route.name),
            key,
            payload_sha256,
            lease: self.settings.lease,
            reject_mismatch: route.rejects_mismatched_bodies(),
        };
        let claimed_at = Instant::now();
        let claim = self.claim(route, &request).await;
        trace.store_time = claimed_at.elapsed();
        let claim = match claim {
            ControlFlow::Continue(claim) => claim,
            ControlFlow::Break(decision) => return decision,
        };
        self.count_claim(route, &request.key, &claim);
        // A won claim never carries a body the route rejects: the store
        // takes no key over for one (`ClaimRequest::reject_mismatch`).
        match claim {
            Claim::Won {
                fence,
                payload_mismatch,
                ..
            } => {
                let won = Won {
                    request,
                    fence,
                    payload_mismatch,
                };
                self.forward_if_lease_allows(won, claimed_at, trace).await
            }
            lost => Decision::lost(route, &lost),
        }
    }

    /// The route's key in the request, or what to do without one.
    fn key_of(&self, route: &Route, parts: &Parts, body: &Bytes) -> ControlFlow<Decision, String> {
        match route
            .key
            .extract(&parts.headers, body, self.settings.max_key_bytes)
        {
            Ok(Some(key)) => ControlFlow::Continue(key),
            Ok(None) | Err(KeyError::NotJson(_)) if route.takes_as_keyless_form(&parts.headers) => {
                ControlFlow::Break(Decision::Pass(PassReason::NotDeduplicated))
            }
            Ok(None) if route.on_missing_key == OnMissingKey::Forward => {
                ControlFlow::Break(Decision::Pass(PassReason::NotDeduplicated))
            }
            Ok(None) => ControlFlow::Break(Decision::Answer(Answer::Rejected(
                Rejection::MissingKey(route.key.describe()),
            ))),
            Err(error) => ControlFlow::Break(Decision::Answer(Answer::Rejected(
                Rejection::BadRequest(error.to_string()),
            ))),
        }
    }

    /// Asks the store for the key; a store that fails is handled per
    /// `store.on_unavailable`.
    async fn claim(&self, route: &Route, request: &ClaimRequest) -> ControlFlow<Decision, Claim> {
        let claim = self
            .metrics
            .time_store("claim", self.store.claim(request))
            .await;
        let error = match claim {
            Ok(claim) => return ControlFlow::Continue(claim),
            Err(error) => error,
        };
        // A failed connection may have lost a committed claim's answer.
        let hint = error.outcome_unknown().then_some(
            "had the claim reached the database before the connection failed, the key stays processing until its lease expires (dedupe-proxy keys release frees it)",
        );
        tracing::warn!(route = &*route.name, key = request.key.as_str(), %error, hint, "claim failed: store unavailable");
        ControlFlow::Break(match self.settings.on_unavailable {
            OnUnavailable::Reject => Decision::Answer(Answer::Unavailable(
                Unavailable::Store,
                self.settings.retry_after,
            )),
            OnUnavailable::Forward => Decision::Pass(PassReason::StoreUnavailable),
        })
    }
}

/// The answer as a response, saying `Connection: close` when the connection
/// cannot carry another request (hyper then closes it once the response is
/// written): the request's framing is in doubt, so is whatever follows it,
/// or the answer came before its body was read to its end. To an HTTP/1.0
/// request such a response is marked HTTP/1.0 as well: hyper would otherwise
/// add `keep-alive` beside the `close` for a sender that asked to keep the
/// connection.
fn respond(answer: Answer, framing_in_doubt: bool, request: Version) -> Response<Body> {
    let close = framing_in_doubt || answer.leaves_body_unread();
    let mut response = answer.into_response();
    if close {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        if request == Version::HTTP_10 {
            *response.version_mut() = Version::HTTP_10;
        }
    }
    response
}
