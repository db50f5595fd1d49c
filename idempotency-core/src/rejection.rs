//! The answers the layer gives on its own: every one is built here, and rendered by the
//! profile (or an [`ErrorRenderer`] set on the layer).
//!
//! Every answer the layer produces instead of the inner service's says what was wrong and
//! what to do, and none repeats anything of another request: a message may name the
//! caller's own method and path, never the path, query or body a key was first used
//! with. The default renderer, [`ProblemJson`], writes a small
//! `application/problem+json` document; a profile writes its
//! protocol's errors. Any `Fn(&Rejection) -> http::Response<Bytes>` is a renderer.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Response, StatusCode, header};

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
    /// The layer cannot tell who the caller is (its scope extractor found none, or the
    /// request carries credentials and the layer has no scope): a misconfiguration,
    /// refused rather than sharing answers between callers.
    NoScope,
    /// The key was first used for another method, path or body.
    KeyReused,
    /// The request body is larger than the layer buffers.
    BodyTooLarge,
    /// The request body could not be read.
    UnreadableBody,
    /// The request body did not arrive in time.
    BodyTimeout,
    /// The layer holds as many bytes as its memory budget allows.
    OverBudget,
    /// Another request with this key is still running.
    InFlight,
    /// The store could not be reached or failed.
    StoreUnavailable,
    /// The store is full of live records.
    StoreFull,
    /// The caller's scope holds as much as its quota allows.
    QuotaExceeded,
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
            Self::NoScope => "no-scope",
            Self::KeyReused => "key-reused",
            Self::BodyTooLarge => "body-too-large",
            Self::UnreadableBody => "unreadable-body",
            Self::BodyTimeout => "body-timeout",
            Self::OverBudget => "over-budget",
            Self::InFlight => "in-flight",
            Self::StoreUnavailable => "store-unavailable",
            Self::StoreFull => "store-full",
            Self::QuotaExceeded => "quota-exceeded",
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
pub(crate) fn json_response(
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

/// The rejections the layer gives, each with its status and a message that says what to
/// do. Those whose status, limit or `Retry-After` the layer's configuration sets are
/// built in `refusals.rs`, from the settings.
impl Rejection {
    pub(crate) fn new(kind: RejectionKind, status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            kind,
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    pub(crate) fn retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = Some(retry_after);
        self
    }

    pub(crate) fn duplicate_key_header() -> Self {
        Self::new(
            RejectionKind::DuplicateKeyHeader,
            StatusCode::BAD_REQUEST,
            "the request carries more than one Idempotency-Key header; send exactly one",
        )
    }

    pub(crate) fn empty_key() -> Self {
        Self::new(
            RejectionKind::InvalidKey,
            StatusCode::BAD_REQUEST,
            "the Idempotency-Key header is empty; send a key (a new UUID per operation, the \
             same one on every retry), or no Idempotency-Key header at all",
        )
    }

    /// The layer cannot see the caller. The message names the misconfiguration and
    /// nothing of the request.
    pub(crate) fn no_scope(scope_chosen: bool) -> Self {
        let message = if scope_chosen {
            "this server cannot tell who sent the request: its idempotency layer's scope \
             extractor found no caller, most likely because the layer runs before \
             authentication (in axum the layer added last runs first: call \
             .layer(idempotency) before .layer(auth); in a server builder put \
             authentication on the builder outside the idempotency layer, not in a \
             per-service interceptor). The request was refused, not run, rather than share answers \
             between callers"
        } else {
            "this server cannot tell callers apart: the request carries credentials but the \
             server's idempotency layer has no scope (IdempotencyLayer::with_scope, or \
             with_scope(SingleScope) for a single-tenant service). The request was refused, \
             not run, rather than share answers between callers"
        };
        Self::new(
            RejectionKind::NoScope,
            StatusCode::INTERNAL_SERVER_ERROR,
            message,
        )
    }

    pub(crate) fn invalid_key(error: &crate::KeyError) -> Self {
        Self::new(
            RejectionKind::InvalidKey,
            StatusCode::BAD_REQUEST,
            error.to_string(),
        )
    }

    /// A body that cannot carry the key its route reads from it; `message` says why.
    pub(crate) fn payload_key(message: String) -> Self {
        Self::new(RejectionKind::InvalidKey, StatusCode::BAD_REQUEST, message)
    }

    /// A body without the key its route requires.
    pub(crate) fn missing_payload_key(method: &Method, path: &str) -> Self {
        Self::new(
            RejectionKind::MissingKey,
            StatusCode::BAD_REQUEST,
            format!(
                "{method} {path} requires an idempotency key in the request body; send one \
                 (a new UUID per operation, the same one on every retry)"
            ),
        )
    }

    pub(crate) fn missing_key(method: &Method, path: &str) -> Self {
        Self::new(
            RejectionKind::MissingKey,
            StatusCode::BAD_REQUEST,
            format!(
                "{method} {path} requires an Idempotency-Key header; send one (a new UUID per \
                 operation, the same one on every retry)"
            ),
        )
    }

    pub(crate) fn unreadable_body(error: &crate::BoxError) -> Self {
        Self::new(
            RejectionKind::UnreadableBody,
            StatusCode::BAD_REQUEST,
            format!("the request body could not be read ({error}); send the request again"),
        )
    }

    /// What the caller is told when the inner service's response body failed mid-way,
    /// and whether the key was `released`.
    pub(crate) fn response_failed(status: StatusCode, released: bool) -> Self {
        let next = if released {
            "the key was released, so a retry with the same key runs the request again"
        } else {
            "the key is kept, so a retry with the same key is told the request already ran; \
             read the resource's current state to see its result"
        };
        Self::new(
            RejectionKind::ResponseFailed,
            StatusCode::BAD_GATEWAY,
            format!(
                "the request ran (status {}), but its response body failed before it was \
                 complete; {next}",
                status.as_u16()
            ),
        )
    }

    /// The inner service answered with more than the memory budget could hold, and its
    /// body type cannot be streamed on: the caller cannot get it.
    pub(crate) fn response_too_large_to_hold(status: StatusCode) -> Self {
        Self::new(
            RejectionKind::ResponseFailed,
            StatusCode::BAD_GATEWAY,
            format!(
                "the request ran (status {}), but its response was larger than this server can \
                 hold for a request with an Idempotency-Key; a retry with the same key is told \
                 it already ran, so read the resource's current state to see its result",
                status.as_u16()
            ),
        )
    }

    /// An answer the layer reads to advertise (e.g. a catalog's config answer) failed mid-way.
    pub(crate) fn advertised_answer_failed(error: &crate::BoxError) -> Self {
        Self::new(
            RejectionKind::ResponseFailed,
            StatusCode::BAD_GATEWAY,
            format!(
                "the service's response failed before it was complete ({error}); send the request again"
            ),
        )
    }
}
