//! A webhook's body, read whole under `limits.max_body_bytes`,
//! `limits.body_read_timeout` and the shared `limits.max_buffered_body_bytes`
//! budget: a route's signature and key need all of it before anything is
//! claimed or forwarded.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::sync::OwnedSemaphorePermit;

use super::{Answer, Proxy, Rejection, Unavailable};

impl Proxy {
    /// Reads the whole body, refusing it past the limit, and takes its bytes
    /// from the buffered-body budget into `budget` as they arrive.
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
