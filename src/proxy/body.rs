//! A webhook's body, read whole under `limits.max_body_bytes`,
//! `limits.body_read_timeout` and the shared `limits.max_buffered_body_bytes`
//! budget: a route's signature and key need all of it before anything is
//! claimed or forwarded.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Version, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::OwnedSemaphorePermit;

use super::{Answer, Proxy, Rejection, Unavailable};

impl Proxy {
    /// Reads the whole body, refusing it past the limit, and takes what
    /// holding it costs from the buffered-body budget into `budget` as it
    /// arrives.
    pub(super) async fn read(
        &self,
        request: Request<Incoming>,
        budget: &mut Option<OwnedSemaphorePermit>,
    ) -> Result<(Parts, Bytes), Answer> {
        let limit = self.settings.max_body_bytes;
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
        let (parts, mut body) = request.into_parts();
        if declared.is_some_and(|length| length > limit as u64) {
            self.discard_rest(&parts, body);
            return Err(Answer::Rejected(Rejection::TooLarge(limit)));
        }
        let declared = declared.and_then(|length| usize::try_from(length).ok());
        let collect = self.collect(&mut body, limit, declared, budget);
        match tokio::time::timeout(self.settings.body_read_timeout, collect).await {
            Ok(Ok(collected)) => Ok((parts, collected)),
            Ok(Err(Refused::Budget)) => {
                let body_left = self.discard_rest(&parts, body);
                Err(Answer::Unavailable(
                    Unavailable::Overloaded { body_left },
                    self.settings.retry_after,
                ))
            }
            Ok(Err(Refused::TooLarge)) => {
                self.discard_rest(&parts, body);
                Err(Answer::Rejected(Rejection::TooLarge(limit)))
            }
            Ok(Err(Refused::Body(error))) => Err(Answer::Rejected(Rejection::BadRequest(format!(
                "the request body could not be read: {}",
                crate::error_chain(&*error)
            )))),
            Err(_) => Err(Answer::Rejected(Rejection::Timeout)),
        }
    }

    /// Reads and drops the rest of a body refused (too large, or over the
    /// buffered-body or concurrency limits), for at most
    /// `limits.body_read_timeout`, before its HTTP/1 connection is closed.
    /// Most clients write the whole body before they read the answer; closed
    /// under them, the socket refuses their writes and they report a broken
    /// connection, never the answer. (HTTP/2 ends the stream alone.) Whether
    /// any of the body was left, so that the connection must close.
    pub(super) fn discard_rest(&self, parts: &Parts, mut body: Incoming) -> bool {
        if parts.version >= Version::HTTP_2 || hyper::body::Body::is_end_stream(&body) {
            return false;
        }
        // A sender waiting for `100 Continue` is refused before it sends the
        // body; reading it would ask for it.
        if expects_continue(parts) {
            return true;
        }
        let timeout = self.settings.body_read_timeout;
        tokio::spawn(tokio::time::timeout(timeout, async move {
            while let Some(Ok(_)) = body.frame().await {}
        }));
        true
    }

    /// Reads the body whole, up to `limit` bytes; the body is left where it
    /// stopped. What is held is charged to the buffered-body budget: a body
    /// of one piece as it came, one of several copied into a single buffer
    /// whose whole capacity is charged. Pieces kept as they came would cost
    /// far more than their bytes when small (a chunk of one byte, say), and
    /// the budget would not bound the memory held. The buffer is the
    /// declared `Content-Length` from the start; without one it doubles as
    /// it fills, and is cut to size at the end, its surplus given back.
    async fn collect(
        &self,
        body: &mut Incoming,
        limit: usize,
        declared: Option<usize>,
        budget: &mut Option<OwnedSemaphorePermit>,
    ) -> Result<Bytes, Refused> {
        let mut first = None;
        let mut joined = Vec::new();
        let mut read = 0;
        let mut charged = 0;
        while let Some(frame) = body.frame().await {
            let Ok(chunk) = frame
                .map_err(|error| Refused::Body(error.into()))?
                .into_data()
            else {
                continue;
            };
            // HTTP/2 often ends a body with an empty frame.
            if chunk.is_empty() {
                continue;
            }
            read += chunk.len();
            if read > limit {
                return Err(Refused::TooLarge);
            }
            let holding = match first.take() {
                None if joined.is_empty() => {
                    let holding = chunk.len();
                    first = Some(chunk);
                    holding
                }
                earlier => {
                    if joined.capacity() - joined.len() < chunk.len() {
                        let wanted = declared
                            .unwrap_or(joined.capacity() * 2)
                            .max(read)
                            .min(limit);
                        joined.reserve_exact(wanted - joined.len());
                    }
                    joined.extend_from_slice(&earlier.unwrap_or_default());
                    joined.extend_from_slice(&chunk);
                    joined.capacity()
                }
            };
            if holding > charged {
                self.charge(holding - charged, budget)?;
                charged = holding;
            }
        }
        if let Some(only) = first {
            return Ok(only);
        }
        if joined.capacity() > joined.len() {
            joined.shrink_to_fit();
            if let Some(held) = budget.as_mut() {
                let surplus = charged.saturating_sub(joined.capacity());
                drop(held.split(surplus));
            }
        }
        Ok(Bytes::from(joined))
    }

    /// Takes `bytes` more from the buffered-body budget into `budget`.
    fn charge(
        &self,
        bytes: usize,
        budget: &mut Option<OwnedSemaphorePermit>,
    ) -> Result<(), Refused> {
        let bytes = u32::try_from(bytes).map_err(|_| Refused::Budget)?;
        let taken = Arc::clone(&self.body_budget)
            .try_acquire_many_owned(bytes)
            .map_err(|_| Refused::Budget)?;
        match budget {
            Some(held) => held.merge(taken),
            None => *budget = Some(taken),
        }
        Ok(())
    }
}

/// Why a body was not read whole.
enum Refused {
    /// The body, or what it was sent with, was refused.
    Body(Box<dyn std::error::Error + Send + Sync>),
    /// `limits.max_buffered_body_bytes` is taken.
    Budget,
    /// Longer than `limits.max_body_bytes`.
    TooLarge,
}

/// Whether the sender waits for `100 Continue` before it sends the body.
fn expects_continue(parts: &Parts) -> bool {
    parts
        .headers
        .get(header::EXPECT)
        .is_some_and(|expect| expect.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}
