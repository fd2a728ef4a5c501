//! The request flow: route, read, key, claim, forward, settle, answer. Owns
//! the order of those steps and the guarantees between them (settle before
//! answering, enough lease left before forwarding); the steps themselves
//! live in their modules.

mod answer;
mod open_claims;
mod record;
mod settle;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Method, Request, Response, Version, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use answer::{Answer, Body, OUTCOME_HEADER, PassReason, Rejection, Unavailable};
pub use open_claims::{OpenClaim, OpenClaims};
use record::{InFlight, class_of, log_request};

use crate::config::{Config, Mode, OnMissingKey, OnUnavailable, UNMATCHED_ROUTE, Unmatched};
use crate::key;
use crate::metrics::{Metrics, UpstreamSeries};
use crate::route::{NearMiss, Route, Routes};
use crate::store::{Claim, ClaimRequest, Fence, SettledStatus, Settlement, Store};
use crate::upstream::{DedupeHeaders, Peer, RequestBody, StreamedBody, Upstream, UpstreamError};
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
        let answer = match Arc::clone(&self.concurrency).try_acquire_owned() {
            _ if let Some(problem) = malformed => {
                Answer::Rejected(Rejection::BadRequest(problem.into()))
            }
            _ if let Some(near_miss) = near_miss => {
                Answer::Rejected(Rejection::BadRequest(match near_miss {
                    NearMiss::Variant(meant) => format!(
                        "not route {}'s path ({} {}) but a variant of it (letter case, percent-encoding, dot segments, repeated or trailing slashes, `;` parameters, spaces around a segment, a format suffix such as `.json`): refused rather than forwarded unverified; send the route's path exactly",
                        meant.name,
                        request.method().as_str().to_ascii_uppercase(),
                        meant.path()
                    ),
                    NearMiss::OutOfPrefix(prefix) => format!(
                        "a path under route {}'s path_prefix ({}) whose dot segments lead out of it: refused rather than forwarded to another path with this route's checks",
                        prefix.name,
                        prefix.path()
                    ),
                }))
            }
            Err(_) => Answer::Unavailable(Unavailable::Overloaded, self.settings.retry_after),
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
                    // The rest of a body refused as too large is never read,
                    // so the connection cannot carry another request; saying
                    // so lets the sender open a new one instead of finding
                    // this one closed under its next request.
                    let body_left_unread =
                        matches!(answer, Answer::Rejected(Rejection::TooLarge(_)));
                    let mut response = answer.into_response();
                    if body_left_unread {
                        response
                            .headers_mut()
                            .insert(header::CONNECTION, HeaderValue::from_static("close"));
                    }
                    return response;
                }
                None => Box::pin(self.unmatched(request, peer, started)).await,
            },
        };
        self.record(
            route.is_some() || near_miss.is_some(),
            route_name,
            &Trace::default(),
            &answer,
            started,
        );
        let mut response = answer.into_response();
        // The request's framing is in doubt, so is whatever follows it.
        if malformed.is_some() {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }

    /// Counts a request's outcome and writes its log line.
    fn record(&self, webhook: bool, route: &str, trace: &Trace, answer: &Answer, started: Instant) {
        self.metrics
            .requests
            .with_label_values(&[route, answer.metric_outcome()])
            .inc();
        log_request(webhook, route, trace, answer, started);
    }

    async fn unmatched(&self, request: Request<Incoming>, peer: Peer, started: Instant) -> Answer {
        if self.settings.unmatched == Unmatched::Reject {
            return Answer::Rejected(Rejection::NoRoute);
        }
        let (parts, body) = request.into_parts();
        let body = StreamedBody::new(body, started, self.settings.body_read_timeout);
        let sent_at = Instant::now();
        let result = match self.upstream.send(parts, body.boxed(), peer, None).await {
            Err(UpstreamError::SenderBody(fault)) => return Answer::Rejected(fault.into()),
            result => result,
        };
        self.unmatched_upstream
            .observe(class_of(&result), sent_at.elapsed());
        match result {
            Ok(response) => Answer::Passthrough(response, PassReason::NotDeduplicated),
            Err(error) => Answer::UpstreamError(error),
        }
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
            // reset stream go unclaimed.
            tokio::task::yield_now().await;
        }
        let processing = Arc::clone(self).process(Arc::clone(route), parts, body, peer, started);
        // Boxed, so that the task moves a pointer rather than the whole
        // future: spawned inline, beside `held`, it cost about 4 KiB more of
        // resident memory per idle keep-alive connection that had delivered
        // a webhook, and more CPU per request (bench/HISTORY.md).
        let processing = Box::pin(processing);
        let task = tokio::spawn(async move {
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
        if route.is_keyless(&parts.headers, body) {
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

    /// A won claim is forwarded only while enough of its lease is left;
    /// otherwise it is released.
    async fn forward_if_lease_allows(
        &self,
        won: Won,
        claimed_at: Instant,
        trace: &mut Trace,
    ) -> Decision {
        trace.attempt = Some(won.fence.attempt);
        if !self.lease_left_too_short(claimed_at) {
            return Decision::Claimed(won);
        }
        let (answer, settle_time) = self
            .release_unforwarded(&won.request, won.fence, Unavailable::LeaseTooShort)
            .await;
        trace.store_time += settle_time;
        Decision::Answer(answer)
    }

    /// Releases a won claim that is not to be forwarded; returns the 503
    /// that says why and the time the release took.
    async fn release_unforwarded(
        &self,
        claim: &ClaimRequest,
        fence: Fence,
        why: Unavailable,
    ) -> (Answer, Duration) {
        let settle_started = Instant::now();
        self.settle(claim, fence, Settlement::RELEASED).await;
        let answer = Answer::Unavailable(why, self.settings.retry_after);
        (answer, settle_started.elapsed())
    }

    /// Forwards a won claim and settles it before the response goes back.
    async fn forward_claimed(
        &self,
        route: &Route,
        won: Won,
        request: Checked,
        trace: &mut Trace,
    ) -> Answer {
        let (answer, upstream_time, settle_time) =
            self.forward_and_settle(route, won, request).await;
        trace.upstream_time = upstream_time;
        trace.store_time += settle_time;
        answer
    }

    /// Whether too little of a lease taken at `claimed_at` (before the claim
    /// was sent) is left to wait out the upstream: another replica may own
    /// the key by the time the upstream answers.
    fn lease_left_too_short(&self, claimed_at: Instant) -> bool {
        let lease_deadline = claimed_at + self.settings.lease;
        lease_deadline.saturating_duration_since(Instant::now()) < self.settings.upstream_timeout
    }

    async fn forward_and_settle(
        &self,
        route: &Route,
        won: Won,
        request: Checked,
    ) -> (Answer, Option<Duration>, Duration) {
        let Won {
            request: claim,
            fence,
            payload_mismatch,
        } = won;
        let attempt = fence.attempt;
        let registered = self.open_claims.register(OpenClaim {
            source: Arc::clone(&claim.source),
            key: claim.key.clone(),
            fence,
            // The store keeps the first delivery's hash, which this body's is
            // unless the store said otherwise.
            first_payload_sha256: (!payload_mismatch).then_some(claim.payload_sha256),
            outcome: None,
        });
        let Some(guard) = registered else {
            let (answer, settle_time) = self
                .release_unforwarded(&claim, fence, Unavailable::ShuttingDown)
                .await;
            return (answer, None, settle_time);
        };
        let dedupe = DedupeHeaders {
            key: key::header_value(claim.key.as_bytes()),
            source: route_source(route),
            attempt: Some(attempt),
        };
        let sent_at = Instant::now();
        let result = self
            .upstream
            .send(
                request.parts,
                full(request.body),
                request.peer,
                Some(dedupe),
            )
            .await;
        let upstream_time = sent_at.elapsed();
        self.count_upstream(route, &result, upstream_time);
        if let Err(error) = &result {
            tracing::warn!(
                route = &*route.name,
                key = claim.key.as_str(),
                attempt,
                %error,
                "upstream gave no response"
            );
        }
        let settlement = match &result {
            Ok(response) if route.is_done(response.status()) => Settlement {
                status: SettledStatus::Done,
                response_status: Some(response.status().as_u16()),
            },
            Ok(response) => Settlement {
                status: SettledStatus::Failed,
                response_status: Some(response.status().as_u16()),
            },
            Err(_) => Settlement::RELEASED,
        };
        guard.set_outcome(settlement);
        let settle_started = Instant::now();
        if !self.settle(&claim, fence, settlement).await {
            self.settle_in_background(claim, fence, settlement, route.retention, guard);
        }
        let settle_time = settle_started.elapsed();
        let answer = match result {
            Ok(response) => Answer::Forwarded(response),
            Err(error) => Answer::UpstreamError(error),
        };
        (answer, Some(upstream_time), settle_time)
    }

    async fn pass(
        &self,
        route: &Route,
        request: Checked,
        reason: PassReason,
        dedupe: Option<DedupeHeaders>,
        trace: &mut Trace,
    ) -> Answer {
        let sent_at = Instant::now();
        let result = self
            .upstream
            .send(request.parts, full(request.body), request.peer, dedupe)
            .await;
        let upstream_time = sent_at.elapsed();
        trace.upstream_time = Some(upstream_time);
        self.count_upstream(route, &result, upstream_time);
        match (result, reason) {
            (Ok(response), reason) => Answer::Passthrough(response, reason),
            (Err(error), PassReason::Shadow(enforced)) => {
                Answer::ShadowedUpstreamError { error, enforced }
            }
            (Err(error), _) => Answer::UpstreamError(error),
        }
    }

    /// Reads the whole body, refusing it past the limit, and takes its bytes
    /// from the buffered-body budget into `budget` as they arrive.
    async fn read(
        &self,
        request: Request<Incoming>,
        budget: &mut Option<OwnedSemaphorePermit>,
    ) -> Result<(Parts, Bytes), Answer> {
        let limit = self.settings.max_body_bytes;
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|length| length > limit as u64) {
            return Err(Answer::Rejected(Rejection::TooLarge(limit)));
        }
        let (parts, body) = request.into_parts();
        let collect = self.collect(Limited::new(body, limit), budget);
        match tokio::time::timeout(self.settings.body_read_timeout, collect).await {
            Ok(Ok(body)) => Ok((parts, body)),
            Ok(Err(Refused::Budget)) => Err(Answer::Unavailable(
                Unavailable::Overloaded,
                self.settings.retry_after,
            )),
            Ok(Err(Refused::Body(error))) if error.is::<http_body_util::LengthLimitError>() => {
                Err(Answer::Rejected(Rejection::TooLarge(limit)))
            }
            Ok(Err(Refused::Body(error))) => Err(Answer::Rejected(Rejection::BadRequest(format!(
                "could not read the request body: {error}"
            )))),
            Err(_) => Err(Answer::Rejected(Rejection::Timeout)),
        }
    }

    async fn collect(
        &self,
        mut body: Limited<Incoming>,
        budget: &mut Option<OwnedSemaphorePermit>,
    ) -> Result<Bytes, Refused> {
        let mut chunks = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(chunk) = frame.map_err(Refused::Body)?.into_data() else {
                continue;
            };
            let bytes = u32::try_from(chunk.len()).map_err(|_| Refused::Budget)?;
            let taken = Arc::clone(&self.body_budget)
                .try_acquire_many_owned(bytes)
                .map_err(|_| Refused::Budget)?;
            match budget {
                Some(held) => held.merge(taken),
                None => *budget = Some(taken),
            }
            chunks.push(chunk);
        }
        Ok(match chunks.len() {
            0 => Bytes::new(),
            1 => chunks.pop().expect("one chunk"),
            _ => Bytes::from(chunks.concat()),
        })
    }
}

/// Why a body was not read whole.
enum Refused {
    /// The body, or what it was sent with, was refused.
    Body(Box<dyn std::error::Error + Send + Sync>),
    /// `limits.max_buffered_body_bytes` is taken.
    Budget,
}

/// Why RFC 9112 has a server refuse the request with 400, if it does: its
/// framing could be read two ways, or its `Host` is missing or repeated.
fn malformation(request: &Request<Incoming>) -> Option<&'static str> {
    if is_ambiguously_framed(request.headers()) {
        return Some(
            "ambiguous message framing: Transfer-Encoding must be exactly `chunked`, without Content-Length",
        );
    }
    if request.method() == Method::CONNECT {
        return Some(
            "CONNECT is not served: the proxy forwards requests, it does not open tunnels",
        );
    }
    let mut hosts = request.headers().get_all(header::HOST).iter();
    let host = match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => return Some("more than one Host field"),
        // HTTP/1.0 may leave it out; HTTP/2 carries `:authority` instead.
        (None, _) if request.version() == Version::HTTP_11 => {
            return Some("an HTTP/1.1 request needs a Host field");
        }
        (host, _) => host,
    };
    // RFC 9112 section 3.2: a Host that is not a host and an optional port
    // (`a/b`, `a b`, `user@a`) would be passed on as one to the application,
    // and in X-Forwarded-Host.
    if host.is_some_and(|host| {
        !host
            .as_bytes()
            .iter()
            .all(|&byte| HOST_BYTES[usize::from(byte)])
    }) {
        return Some("the Host field is not a host with an optional port");
    }
    let target = request.uri();
    let http2 = request.version() >= Version::HTTP_2;
    if !http2 && target.scheme().is_none() && target.authority().is_some() {
        return Some("a request target in authority form is for CONNECT only");
    }
    // RFC 9112 section 3.2.2 and RFC 9113 section 8.3.1: the target's
    // authority (HTTP/2's `:authority`), not Host, names the resource;
    // forwarded with the sender's Host, the application would read another.
    if let (Some(authority), Some(host)) = (target.authority(), host)
        && !host
            .as_bytes()
            .eq_ignore_ascii_case(authority.as_str().as_bytes())
    {
        return Some(if http2 {
            "the :authority and Host fields differ"
        } else {
            "the request target's authority and the Host field differ"
        });
    }
    if target.path() == "*" && request.method() != Method::OPTIONS {
        return Some("a request target of `*` is for OPTIONS only");
    }
    None
}

/// The bytes that may appear in a host and port (RFC 3986 section 3.2.2: a
/// name's unreserved characters, escapes and sub-delimiters, an IP
/// literal's brackets and colons, the port's colon), as a table looked up
/// once per byte of every request's Host. Not `http::uri::Authority`, which
/// copies the field to parse it.
const HOST_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = (byte as u8).is_ascii_alphanumeric();
        byte += 1;
    }
    let others = b"-._~%!$&'()*+,;=:[]";
    let mut i = 0;
    while i < others.len() {
        table[others[i] as usize] = true;
        i += 1;
    }
    table
};

/// Whether the request's framing could be read two ways by two servers (the
/// request-smuggling pattern): both `Content-Length` and `Transfer-Encoding`,
/// or a transfer coding other than one `chunked`.
fn is_ambiguously_framed(headers: &http::HeaderMap) -> bool {
    let mut codings = headers.get_all(header::TRANSFER_ENCODING).iter();
    match (codings.next(), codings.next()) {
        (None, _) => false,
        (Some(coding), None) => {
            headers.contains_key(header::CONTENT_LENGTH)
                || !coding.as_bytes().eq_ignore_ascii_case(b"chunked")
        }
        (Some(_), Some(_)) => true,
    }
}

/// For a shadowed delivery that holds no claim: the application still
/// learns the key, so it can see the duplicates enforcing would suppress,
/// but no attempt is named.
fn unclaimed_dedupe_headers(route: &Route, trace: &Trace) -> Option<DedupeHeaders> {
    let key = trace.key.as_deref()?;
    Some(DedupeHeaders {
        key: key::header_value(key.as_bytes()),
        source: route_source(route),
        attempt: None,
    })
}

/// `X-Dedupe-Source`: the route's name.
fn route_source(route: &Route) -> HeaderValue {
    HeaderValue::from_str(&route.name).expect("route names are header-safe")
}

fn full(body: Bytes) -> RequestBody {
    Full::new(body).map_err(|never| match never {}).boxed()
}
