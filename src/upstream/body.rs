//! Bodies on their way through: a sender's streamed to the upstream, which
//! must arrive whole by `limits.body_read_timeout`, and the upstream's
//! response passed back, which must keep coming within `upstream.timeout`.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http_body_util::combinators::BoxBody;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::Instant;

/// Why a sender's body streamed to the upstream ended before it was whole.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SenderBodyError {
    /// Not whole within `limits.body_read_timeout` of the end of the head.
    #[error("the request body did not arrive within {0:?}")]
    Timeout(Duration),
    /// Cut off, or badly framed (a chunk size that is not one, say).
    #[error("the request body could not be read: {0}")]
    Unreadable(String),
}

/// A request body: buffered, or streamed through from the sender.
pub type RequestBody = BoxBody<Bytes, SenderBodyError>;

/// A sender's body streamed through to the upstream, which must arrive
/// whole by a deadline: a sender that stalls would otherwise hold an
/// upstream connection, and the application's attention, until
/// `upstream.timeout`.
pub struct StreamedBody {
    body: Incoming,
    deadline: Instant,
    timeout: Duration,
    // Made on the first wait only: a body that arrived with its head (nearly
    // every one) costs no timer.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    // None for a body that was over before it began.
    end: Option<Arc<BodyEnd>>,
}

impl StreamedBody {
    /// `body`, due whole `timeout` after `started`.
    pub fn new(body: Incoming, started: std::time::Instant, timeout: Duration) -> Self {
        let deadline = Instant::from_std(started) + timeout;
        let end = (!body.is_end_stream()).then(|| {
            Arc::new(BodyEnd {
                at: OnceLock::new(),
                watcher: AtomicWaker::new(),
                due: deadline,
            })
        });
        Self {
            body,
            deadline,
            timeout,
            timer: None,
            end,
        }
    }

    /// When the body is over, for a body that has yet to be sent.
    pub(super) fn end(&self) -> Option<Arc<BodyEnd>> {
        self.end.clone()
    }
}

/// When a streamed body was over: the upstream is given `upstream.timeout`
/// to answer from then, not from when forwarding began, so that the time a
/// sender takes to upload (bounded by `limits.body_read_timeout`) is not
/// taken from the application's.
#[derive(Debug)]
pub struct BodyEnd {
    at: OnceLock<Instant>,
    /// The request waiting for the body to be over, if it waits.
    watcher: AtomicWaker,
    /// When the body must be over.
    due: Instant,
}

impl BodyEnd {
    fn mark(&self) {
        if self.at.set(Instant::now()).is_ok() {
            self.watcher.wake();
        }
    }

    /// When the body was over, once it is.
    pub(super) fn over(&self) -> impl Future<Output = Instant> + '_ {
        std::future::poll_fn(|cx| {
            self.watcher.register(cx.waker());
            match self.at.get() {
                Some(&over) => Poll::Ready(over),
                None => Poll::Pending,
            }
        })
    }

    /// Asked at `now`, when an answer was due and has not come: when it is
    /// due instead, if later, and whether to wait for [`Self::over`] as
    /// well. That is `timeout` after the body was over; for a body not yet
    /// over, when it must be, or `timeout` after it is over, if sooner; and
    /// for a body not over by then, `timeout` after that. The body's own
    /// deadline ends a sender's stall, but only while the upstream
    /// connection takes the body: an upstream that reads nothing must not
    /// hold the request for ever.
    pub(super) fn answer_due(&self, now: Instant, timeout: Duration) -> Option<(Instant, bool)> {
        let (due, watch) = match self.at.get() {
            Some(&over) => (over + timeout, false),
            None if now < self.due => (self.due, true),
            None => (self.due + timeout, false),
        };
        (due > now).then_some((due, watch))
    }
}

// The body is over when hyper drops it: it does once the body has ended,
// and without asking for more once it has sent it whole (after trailers, or
// once a known length is written, though an HTTP/2 sender's stream may end in
// a frame of its own). A body dropped cut short fails its request anyway.
impl Drop for StreamedBody {
    fn drop(&mut self) {
        if let Some(end) = &self.end {
            end.mark();
        }
    }
}

impl Body for StreamedBody {
    type Data = Bytes;
    type Error = SenderBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, SenderBodyError>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|frame| {
                let mut frame = frame
                    .map_err(|error| SenderBodyError::Unreadable(crate::error_chain(&error)))?;
                // An application that merges trailers into the head would
                // otherwise take forged ones for the proxy's.
                if let Some(trailers) = frame.trailers_mut() {
                    super::strip_trailers(trailers);
                }
                Ok(frame)
            }));
        }
        let deadline = this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(SenderBodyError::Timeout(this.timeout)))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// An upstream's response body, passed on as it arrives. The upstream must
/// keep it coming: a wait of `upstream.timeout` for its next piece ends it
/// with an error, so that an application that sends its headers and then
/// stalls cannot hold the sender, and an upstream connection, for good.
#[derive(Debug)]
pub struct ResponseBody {
    body: Incoming,
    timeout: Duration,
    /// The delivery the response answers; none for an unmatched request.
    origin: Option<Box<super::Origin>>,
    // Made on the second wait in a row only: a body that arrives with its
    // head, or right behind it (nearly every one), costs no timer.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    // A piece arrived since the timer was last set: the next wait starts a
    // new one.
    rearm: bool,
    // The body has been waited for once and the task woken to look again.
    looked_again: bool,
}

/// Why an upstream's response body ended before it was whole.
#[derive(Debug, thiserror::Error)]
pub enum ResponseBodyError {
    /// The connection failed, or the body was badly framed.
    #[error("the upstream's response body failed: {0}")]
    Upstream(#[from] hyper::Error),
    /// Nothing more came for `upstream.timeout`.
    #[error("the upstream's response body stalled for {0:?}")]
    Stalled(Duration),
    /// The sender took nothing more of it for `upstream.timeout`.
    #[error("the sender took no more of the response for {0:?}")]
    SenderStalled(Duration),
}

impl ResponseBody {
    pub(super) fn new(
        body: Incoming,
        timeout: Duration,
        origin: Option<Box<super::Origin>>,
    ) -> Self {
        Self {
            body,
            timeout,
            origin,
            timer: None,
            rearm: false,
            looked_again: false,
        }
    }
}

impl ResponseBody {
    fn warn_cut_off(&self, error: &ResponseBodyError) {
        const CUT_OFF: &str = "the upstream's response was cut off on its way to the sender";
        let Some(origin) = &self.origin else {
            tracing::warn!(route = "unmatched", %error, "{CUT_OFF}");
            return;
        };
        // As the webhook's own line has it, not as `X-Dedupe-Key` carries it.
        let key = origin
            .key
            .as_ref()
            .map(|key| percent_encoding::percent_decode(key.as_bytes()).decode_utf8_lossy());
        tracing::warn!(
            route = &*origin.route,
            key = key.as_deref(),
            attempt = origin.attempt,
            %error,
            "{CUT_OFF}"
        );
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = ResponseBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ResponseBodyError>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            this.rearm = true;
            let frame = frame.map(|frame| {
                let mut frame = frame.map_err(ResponseBodyError::from)?;
                // HTTP/2 refuses connection fields in trailers as in a head,
                // and resets the sender's stream; `X-Dedupe-Outcome` is the
                // proxy's to say.
                if let Some(trailers) = frame.trailers_mut() {
                    super::strip_trailers(trailers);
                }
                Ok(frame)
            });
            if let Some(Err(error)) = &frame {
                this.warn_cut_off(error);
            }
            return Poll::Ready(frame);
        }
        // The piece is most often on its way already, with the connection's
        // task that has yet to run on this thread: rather than make a timer
        // (a lock on the runtime's timer wheel, and again to cancel it), the
        // task is woken to look once more, behind that one.
        if this.timer.is_none() && !std::mem::replace(&mut this.looked_again, true) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let timeout = this.timeout;
        let timer = match &mut this.timer {
            Some(timer) => {
                if std::mem::take(&mut this.rearm) {
                    timer.as_mut().reset(Instant::now() + timeout);
                }
                timer
            }
            None => {
                // Set from now: a piece that came before counts in this one.
                this.rearm = false;
                this.timer.insert(Box::pin(tokio::time::sleep(timeout)))
            }
        };
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                let error = ResponseBodyError::Stalled(timeout);
                this.warn_cut_off(&error);
                Poll::Ready(Some(Err(error)))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(30);

    /// A response whose head and first piece came, then nothing: the body
    /// is cut off `timeout` after that piece, not twice that (the piece
    /// made before the timer once pushed the first deadline back by a whole
    /// timeout).
    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_after_a_piece_is_cut_off_one_timeout_later() {
        let (near, mut far) = tokio::io::duplex(4096);
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(near))
            .await
            .unwrap();
        tokio::spawn(connection);
        let upstream = tokio::spawn(async move {
            let mut request = [0; 1024];
            let _ = far.read(&mut request).await.unwrap();
            far.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
                .await
                .unwrap();
            // Held open, silent.
            std::future::pending::<()>().await;
            drop(far);
        });
        let request = http::Request::get("/")
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        let mut body = ResponseBody::new(response.into_body(), TIMEOUT, None);
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "first");
        let piece_came = Instant::now();
        let cut_off = body.frame().await.unwrap().unwrap_err();
        assert!(
            matches!(cut_off, ResponseBodyError::Stalled(_)),
            "{cut_off:?}"
        );
        assert_eq!(piece_came.elapsed(), TIMEOUT);
        upstream.abort();
    }

    fn body_due_in(seconds: u64) -> (BodyEnd, Instant) {
        let start = Instant::now();
        let end = BodyEnd {
            at: OnceLock::new(),
            watcher: AtomicWaker::new(),
            due: start + Duration::from_secs(seconds),
        };
        (end, start)
    }

    /// The answer is due `timeout` after the body was over, however long
    /// the upload took, and not before.
    #[test]
    fn an_answer_is_due_a_timeout_after_the_body_was_over() {
        let (end, start) = body_due_in(60);
        let over = start + Duration::from_secs(40);
        end.at.set(over).unwrap();
        let asked = start + TIMEOUT;
        assert_eq!(
            end.answer_due(asked, TIMEOUT),
            Some((over + TIMEOUT, false))
        );
        assert_eq!(end.answer_due(over + TIMEOUT, TIMEOUT), None);
    }

    /// A body still coming is waited for, and looked at again when it must
    /// be over; one that never is (an upstream that stopped taking it) gives
    /// the upstream `timeout` from then.
    #[test]
    fn a_body_not_yet_over_puts_the_answer_off_to_its_own_deadline_then_a_timeout() {
        let (end, start) = body_due_in(60);
        let due = start + Duration::from_secs(60);
        assert_eq!(end.answer_due(start + TIMEOUT, TIMEOUT), Some((due, true)));
        assert_eq!(end.answer_due(due, TIMEOUT), Some((due + TIMEOUT, false)));
        assert_eq!(end.answer_due(due + TIMEOUT, TIMEOUT), None);
    }
}
