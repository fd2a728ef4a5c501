//! What an HTTP/2 connection needs beyond hyper's server: it is closed once
//! no request has been open on it for a while, as an idle HTTP/1 connection
//! is, and a response its sender stops taking is cut off.

use std::convert::Infallible;
use std::future::poll_fn;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::Service;
use hyper::{Request, Response};
use hyper_util::server::graceful::GracefulConnection;
use tokio_util::sync::CancellationToken;

use crate::proxy::Body;

/// Serves an HTTP/2 connection to its end. It is asked to finish gracefully
/// (GOAWAY) once shutdown begins, or once no request has been open on it for
/// `idle`, as an HTTP/1 connection is closed once it has waited that long
/// for a request's head: without that, a sender could keep any number of
/// connections (and their file descriptors) open by sending nothing after
/// the preface. A sender that does not then close the connection (it never
/// answers the GOAWAY's ping) has it dropped `idle` later, or, at shutdown,
/// once no request has been open on it for a second.
pub(super) async fn serve_http2<C: GracefulConnection>(
    connection: C,
    shutdown: &CancellationToken,
    requests: &OpenRequests,
    idle: Duration,
) -> C::Output {
    let mut connection = pin!(connection);
    let mut cancelled = pin!(shutdown.cancelled());
    let mut timer = pin!(tokio::time::sleep(idle));
    let mut told = None;
    let goaway_answer_wait = idle.min(GOAWAY_ANSWER_WAIT);
    poll_fn(|cx| {
        if !matches!(told, Some(Told::Shutdown)) && cancelled.as_mut().poll(cx).is_ready() {
            // One told already that it was idle has had its GOAWAY; it too
            // now gets only the shutdown's short wait, not the rest of
            // `idle`.
            if told.is_none() {
                connection.as_mut().graceful_shutdown();
            }
            told = Some(Told::Shutdown);
            timer
                .as_mut()
                .reset(tokio::time::Instant::now() + goaway_answer_wait);
        }
        while timer.as_mut().poll(cx).is_ready() {
            let now = tokio::time::Instant::now();
            match told {
                Some(Told::Idle) => return Poll::Ready(Ok(())),
                // Shutting down: once no request has been open for a while,
                // a sender that has not closed the connection (it never
                // answered the GOAWAY's ping, a half-open connection) would
                // hold the whole shutdown for its grace period.
                Some(Told::Shutdown) => match requests.idle_until(now, goaway_answer_wait) {
                    None => return Poll::Ready(Ok(())),
                    Some(deadline) => timer.as_mut().reset(deadline),
                },
                None => match requests.idle_until(now, idle) {
                    None => {
                        told = Some(Told::Idle);
                        connection.as_mut().graceful_shutdown();
                        timer.as_mut().reset(now + idle);
                    }
                    Some(deadline) => timer.as_mut().reset(deadline),
                },
            }
        }
        connection.as_mut().poll(cx)
    })
    .await
}

/// How long a connection with no open request has, once shutdown began, to
/// answer the GOAWAY's ping and close: a round trip, with room to spare.
const GOAWAY_ANSWER_WAIT: Duration = Duration::from_secs(1);

/// Why an HTTP/2 connection was asked to finish.
#[derive(Clone, Copy)]
enum Told {
    Shutdown,
    Idle,
}

/// How many requests are open on an HTTP/2 connection, and since when that
/// number has been what it is.
pub(super) struct OpenRequests(std::sync::Mutex<(usize, tokio::time::Instant)>);

impl Default for OpenRequests {
    fn default() -> Self {
        Self(std::sync::Mutex::new((0, tokio::time::Instant::now())))
    }
}

impl OpenRequests {
    /// When the connection will have had no open request for `idle`, or
    /// `None` if it has by `now`.
    fn idle_until(
        &self,
        now: tokio::time::Instant,
        idle: Duration,
    ) -> Option<tokio::time::Instant> {
        let (open, since) = *self.0.lock().expect("not poisoned");
        let deadline = if open > 0 { now + idle } else { since + idle };
        (deadline > now).then_some(deadline)
    }

    fn change(&self, count: impl FnOnce(usize) -> usize) {
        let mut state = self.0.lock().expect("not poisoned");
        *state = (count(state.0), tokio::time::Instant::now());
    }
}

/// One request open on an HTTP/2 connection, until its answer has been
/// passed on.
struct OpenRequest(Arc<OpenRequests>);

impl OpenRequest {
    fn begin(requests: &Arc<OpenRequests>) -> Self {
        requests.change(|open| open + 1);
        Self(Arc::clone(requests))
    }
}

impl Drop for OpenRequest {
    fn drop(&mut self) {
        self.0.change(|open| open - 1);
    }
}

/// A service that counts its open requests on an HTTP/2 connection, and
/// cuts off a response its sender stops taking.
pub(super) struct Counted<S> {
    pub(super) service: S,
    pub(super) requests: Arc<OpenRequests>,
    pub(super) send_stall: Duration,
}

impl<S> Service<Request<Incoming>> for Counted<S>
where
    S: Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let open = OpenRequest::begin(&self.requests);
        let answer = self.service.call(request);
        let send_stall = self.send_stall;
        Box::pin(async move {
            let answer = answer.await;
            answer.map(|response| {
                response.map(|body| super::sender_stall::watched(body, send_stall, open))
            })
        })
    }
}
