//! HTTP/2 responses the sender must keep taking. A sender that stops taking
//! a response (an HTTP/2 flow-control window left at zero) would otherwise
//! hold the body's upstream connection for as long as it keeps its own
//! connection open, one upstream connection per stream, outside
//! `limits.max_concurrent_requests`, which is released once the answer is
//! made. hyper polls a response body only once the sender's window has room,
//! so the body cannot notice that itself: a task per response watches it and
//! drops what it is passing on, freeing the upstream connection, once the
//! sender has taken nothing for `upstream.timeout`.

use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body as _, Frame, SizeHint};
use tokio::time::Instant;

use crate::proxy::Body;
use crate::upstream::ResponseBodyError;

/// `body`, cut off once its sender has taken nothing of it for `stall`.
/// `guard` is kept for as long as the body is being passed on.
pub(super) fn watched<G: Send + Sync + 'static>(body: Body, stall: Duration, guard: G) -> Body {
    if body.is_end_stream() {
        return body;
    }
    let slot = Arc::new(Mutex::new(Slot {
        body: Some(body),
        handed_at: Some(Instant::now()),
        cut_off: None,
    }));
    tokio::spawn(watch(Arc::downgrade(&slot), stall));
    Body::new(Watched {
        slot,
        _guard: guard,
    })
}

struct Slot {
    /// `None` once the body has ended or was dropped for the stall.
    body: Option<Body>,
    /// Since when the sender has been waited on for the next poll: set when
    /// a piece (or the head) was handed over, cleared while the body itself
    /// is waited on.
    handed_at: Option<Instant>,
    /// Set when the body was dropped for the stall, until it is reported.
    cut_off: Option<Duration>,
}

struct Watched<G> {
    slot: Arc<Mutex<Slot>>,
    _guard: G,
}

impl<G> hyper::body::Body for Watched<G> {
    type Data = Bytes;
    type Error = ResponseBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ResponseBodyError>>> {
        let mut slot = self.slot.lock().expect("not poisoned");
        let Some(body) = slot.body.as_mut() else {
            return Poll::Ready(
                slot.cut_off
                    .take()
                    .map(|stall| Err(ResponseBodyError::SenderStalled(stall))),
            );
        };
        let polled = Pin::new(body).poll_frame(cx);
        slot.handed_at = match &polled {
            Poll::Ready(Some(Ok(_))) => Some(Instant::now()),
            Poll::Ready(_) => {
                slot.body = None;
                None
            }
            Poll::Pending => None,
        };
        polled
    }

    fn is_end_stream(&self) -> bool {
        let slot = self.slot.lock().expect("not poisoned");
        match &slot.body {
            Some(body) => body.is_end_stream(),
            None => slot.cut_off.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        let slot = self.slot.lock().expect("not poisoned");
        slot.body
            .as_ref()
            .map_or_else(SizeHint::default, |body| body.size_hint())
    }
}

/// Drops the body once its sender has taken nothing for `stall`; ends when
/// the body ends or is dropped.
async fn watch(slot: Weak<Mutex<Slot>>, stall: Duration) {
    let mut deadline = Instant::now() + stall;
    loop {
        tokio::time::sleep_until(deadline).await;
        let Some(slot) = slot.upgrade() else { return };
        let mut slot = slot.lock().expect("not poisoned");
        if slot.body.is_none() {
            return;
        }
        match slot.handed_at.map(|handed_at| handed_at + stall) {
            Some(due) if due <= Instant::now() => {
                slot.body = None;
                slot.cut_off = Some(stall);
                tracing::warn!(
                    error = %ResponseBodyError::SenderStalled(stall),
                    "the upstream's response was cut off on its way to the sender"
                );
                return;
            }
            Some(due) => deadline = due,
            None => deadline = Instant::now() + stall,
        }
    }
}
