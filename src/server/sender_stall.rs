//! HTTP/2 responses the sender must keep taking. A sender that stops taking
//! a response (an HTTP/2 flow-control window left at zero) would otherwise
//! hold the body's upstream connection for as long as it keeps its own
//! connection open, one upstream connection per stream, outside
//! `limits.max_concurrent_requests`, which is released once the answer is
//! made. hyper polls a response body only once the sender's window has room,
//! so the body cannot notice that itself: a task per response watches it and
//! drops what it is passing on, freeing the upstream connection, once the
//! sender has taken nothing for `upstream.timeout`. The request then no
//! longer counts as open on its connection, so a connection left with only
//! such streams is closed as idle: hyper would keep waiting for the window
//! to open, and could not reset the stream.

use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body as _, Frame, SizeHint};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::proxy::Body;
use crate::upstream::ResponseBodyError;

/// `body`, cut off once its sender has taken nothing of it for `stall`.
/// `guard` is kept for as long as the body is being passed on, and dropped
/// when it is cut off.
pub(super) fn watched<G: Send + Sync + 'static>(body: Body, stall: Duration, guard: G) -> Body {
    if body.is_end_stream() {
        return body;
    }
    let slot = Arc::new(Mutex::new(Slot {
        body: Some(body),
        handed_at: Some(Instant::now()),
        cut_off: None,
        guard: Some(guard),
    }));
    let dropped = CancellationToken::new();
    tokio::spawn(watch(Arc::downgrade(&slot), stall, dropped.clone()));
    Body::new(Watched {
        slot,
        _dropped: dropped.drop_guard(),
    })
}

struct Slot<G> {
    /// `None` once the body has ended or was dropped for the stall.
    body: Option<Body>,
    /// Since when the sender has been waited on for the next poll: set when
    /// a piece (or the head) was handed over, cleared while the body itself
    /// is waited on.
    handed_at: Option<Instant>,
    /// Set when the body was dropped for the stall, until it is reported.
    cut_off: Option<Duration>,
    guard: Option<G>,
}

struct Watched<G> {
    slot: Arc<Mutex<Slot<G>>>,
    /// Ends the watch, and takes its timer out of the runtime's, as soon as
    /// the body is done with rather than at its next deadline: a watch that
    /// outlived its response by `stall` would hold a task and a timer for
    /// every response of the last `stall`.
    _dropped: DropGuard,
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
/// the body has ended or is dropped.
async fn watch<G>(slot: Weak<Mutex<Slot<G>>>, stall: Duration, dropped: CancellationToken) {
    let mut deadline = Instant::now() + stall;
    loop {
        if dropped
            .run_until_cancelled(tokio::time::sleep_until(deadline))
            .await
            .is_none()
        {
            return;
        }
        let Some(slot) = slot.upgrade() else { return };
        let mut slot = slot.lock().expect("not poisoned");
        if slot.body.is_none() {
            return;
        }
        match slot.handed_at.map(|handed_at| handed_at + stall) {
            Some(due) if due <= Instant::now() => {
                slot.body = None;
                slot.cut_off = Some(stall);
                slot.guard = None;
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

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    fn body(text: &'static str) -> Body {
        Full::new(Bytes::from_static(text.as_bytes()))
            .map_err(|never| match never {})
            .boxed()
    }

    async fn alive_tasks_settle_at(expected: usize) {
        for _ in 0..100 {
            if tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks()
                == expected
            {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!(
            "{} tasks alive, expected {expected}",
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks()
        );
    }

    #[tokio::test]
    async fn a_body_passed_on_whole_ends_its_watch_at_once() {
        let before = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        let watched = watched(body("answer"), Duration::from_secs(3600), ());
        assert_eq!(
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks(),
            before + 1
        );
        let collected = watched.collect().await.unwrap().to_bytes();
        assert_eq!(&collected[..], b"answer");
        alive_tasks_settle_at(before).await;
    }

    /// The body is dropped, and so is the guard (which counts the request
    /// open on its connection), although hyper never polls the body again:
    /// it waits for the sender's window to open.
    #[tokio::test(start_paused = true)]
    async fn a_body_its_sender_takes_nothing_of_is_dropped_after_the_stall() {
        let stall = Duration::from_secs(30);
        let (guard, guard_dropped) = tokio::sync::oneshot::channel::<()>();
        let started = Instant::now();
        let mut watched = watched(body("never taken"), stall, guard);
        tokio::time::timeout(stall * 2, guard_dropped)
            .await
            .expect("the guard is dropped at the cut")
            .expect_err("dropped, never sent on");
        assert_eq!(Instant::now().duration_since(started), stall);
        tokio::time::sleep(stall * 2).await;
        let frame = watched.frame().await.expect("the cut is reported");
        assert!(
            matches!(frame, Err(ResponseBodyError::SenderStalled(d)) if d == stall),
            "{frame:?}"
        );
        assert!(watched.frame().await.is_none());
    }
}
