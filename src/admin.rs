//! The admin listener: `/metrics`, `/healthz` (the process serves) and
//! `/readyz` (the schema is in place and the store answers).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::metrics::Metrics;
use crate::store::{Store, StoreError};

/// What the admin endpoints report on.
pub struct Admin {
    /// The metrics registry.
    pub metrics: Metrics,
    /// The store, pinged by `/readyz`.
    pub store: Store,
    /// The start-up migration's progress.
    pub schema: Arc<Schema>,
    /// Set when shutdown begins: the webhook listener is closed, so a load
    /// balancer should stop sending here, while `/metrics` still shows the
    /// drain.
    pub shutting_down: AtomicBool,
}

impl Admin {
    /// Answers one admin request.
    pub async fn handle(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        if request.method() != Method::GET && request.method() != Method::HEAD {
            let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
            response
                .headers_mut()
                .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
            return response;
        }
        match request.uri().path() {
            "/metrics" => {
                let mut response = text(StatusCode::OK, self.metrics.render());
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                response
            }
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" => self.readiness().await,
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }

    async fn readiness(&self) -> Response<Full<Bytes>> {
        if self.shutting_down.load(Ordering::Acquire) {
            return text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n");
        }
        let reached = self.store.ready().await;
        if !self.schema.is_ready() {
            // The start-up migration has not finished: most often because the
            // store cannot be reached, which is then the reason to give, or
            // else because the migration itself failed (no right to create).
            let reason = match (reached, self.schema.failure()) {
                (Err(error), _) if !matches!(error, StoreError::MissingTable(_)) => {
                    format!("store unavailable: {error}\n")
                }
                (_, Some(failure)) => format!(
                    "store schema not ready: the start-up migration failed, and is retried: {failure}\n"
                ),
                _ => "store schema not ready: the start-up migration has not finished\n".into(),
            };
            return text(StatusCode::SERVICE_UNAVAILABLE, reason);
        }
        match reached {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(error) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("store unavailable: {error}\n"),
            ),
        }
    }
}

/// The start-up migration's progress, as `/readyz` tells it.
pub struct Schema {
    ready: AtomicBool,
    failure: Mutex<Option<String>>,
}

impl Schema {
    /// `ready` when there is no migration to wait for.
    pub fn new(ready: bool) -> Self {
        Self {
            ready: AtomicBool::new(ready),
            failure: Mutex::new(None),
        }
    }

    /// Whether the migration has run (or there was none to run).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// The migration has run.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    /// The migration's last attempt failed this way.
    pub fn set_failure(&self, error: String) {
        *self.failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(error);
    }

    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
