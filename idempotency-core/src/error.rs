//! The answers the layer gives on its own, and how they are rendered.
//!
//! Every answer the layer produces instead of the inner service's says what was wrong and
//! what to do. The body format is pluggable through [`ErrorRenderer`]: the default,
//! [`ProblemJson`], writes a small `application/problem+json` document; the Iceberg
//! profile writes Iceberg's `ErrorModel`. Any `Fn(&Rejection) -> http::Response<Bytes>`
//! is a renderer.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// Why the layer answered instead of the inner service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectionKind {
    /// A key is required on this route and none was sent.
    MissingKey,
    /// The header value is not a valid key.
    InvalidKey,
    /// The request carried more than one `Idempotency-Key` header.
    DuplicateKeyHeader,
    /// The key was first used for another method, path or body.
    KeyReused,
    /// The request body is larger than the layer buffers.
    BodyTooLarge,
    /// The request body could not be read.
    UnreadableBody,
    /// Another request with this key is still running.
    InFlight,
    /// The store could not be reached or failed.
    StoreUnavailable,
    /// The store is full of live records.
    StoreFull,
    /// The request ran, but its response was too large to store, so it cannot be replayed.
    ResponseNotStored,
    /// The request ran, but its response body failed while the layer was reading it; the
    /// key was released.
    ResponseFailed,
}

impl RejectionKind {
    /// A short, stable, kebab-case name for logs and machine-readable bodies.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MissingKey => "missing-key",
            Self::InvalidKey => "invalid-key",
            Self::DuplicateKeyHeader => "duplicate-key-header",
            Self::KeyReused => "key-reused",
            Self::BodyTooLarge => "body-too-large",
            Self::UnreadableBody => "unreadable-body",
            Self::InFlight => "in-flight",
            Self::StoreUnavailable => "store-unavailable",
            Self::StoreFull => "store-full",
            Self::ResponseNotStored => "response-not-stored",
            Self::ResponseFailed => "response-failed",
        }
    }
}

/// An answer the layer gives on its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// Why.
    pub kind: RejectionKind,
    /// The HTTP status to answer with.
    pub status: StatusCode,
    /// What was wrong and what to do, for the client.
    pub message: String,
    /// When set, the layer adds a `Retry-After` header (whole seconds, rounded up).
    pub retry_after: Option<Duration>,
}

/// Renders a [`Rejection`] as a response. The layer adds `Retry-After` afterwards.
pub trait ErrorRenderer: Send + Sync + 'static {
    /// The response for this rejection.
    fn render(&self, rejection: &Rejection) -> Response<Bytes>;
}

impl<F> ErrorRenderer for F
where
    F: Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
{
    fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        self(rejection)
    }
}

/// The default renderer: an RFC 9457 problem document,
/// `{"type":"about:blank","title":…,"status":…,"detail":…,"kind":…}`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProblemJson;

impl ErrorRenderer for ProblemJson {
    fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        let body = serde_json::json!({
            "type": "about:blank",
            "title": rejection.status.canonical_reason().unwrap_or("Error"),
            "status": rejection.status.as_u16(),
            "detail": rejection.message,
            "kind": rejection.kind.as_str(),
        });
        json_response(rejection.status, "application/problem+json", &body)
    }
}

/// A response with a JSON body and the given content type.
pub fn json_response(
    status: StatusCode,
    content_type: &'static str,
    body: &serde_json::Value,
) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(body.to_string()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
