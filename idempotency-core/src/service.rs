//! [`Idempotency`]: the service the layer wraps around an inner one, and where each
//! request's path begins.
//!
//! A request takes one of four ways, decided here without reading its body:
//!
//! 1. The profile [advertises](crate::Profile::advertises) on it (Iceberg's
//!    `GET /v1/config`): the inner service answers and the profile amends the answer
//!    ([`advertise`](crate::advertise)).
//! 2. It does not take part (not a mutation, not a route of the profile's, no key): the
//!    inner service gets it untouched, and its future is returned as it is.
//! 3. Its key header is bad: the layer answers 400 at once.
//! 4. It carries a key: the [keyed path](crate::keyed) binds, reserves and replays, and
//!    the [owner](crate::owner) runs the inner service.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderName, Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::future::ResponseFuture;
use crate::layer::Settings;
use crate::rejection::Rejection;
use crate::store::BoxError;
use crate::{advertise, keyed};

/// The request header that carries the key (and, being lower-case, the gRPC metadata key).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The response header set on every replay.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) wraps around an inner one.
///
/// Its responses have the inner service's own body type, so wrapping costs nothing on
/// requests it passes through (and an axum `Router` wrapped whole can still be served
/// with `axum::serve`). The answers it makes itself (replays, buffered and rendered
/// bodies) are built with the body type's `From<Bytes>`: axum's `Body` and
/// `http_body_util::Full<Bytes>` have it; map any other body to one of those first.
///
/// ```no_run
/// use axum::{Router, extract::Request, routing::post};
/// use idempotency_core::IdempotencyLayer;
/// use idempotency_store_memory::MemoryStore;
/// use tower_layer::Layer;
///
/// # async fn serve() -> std::io::Result<()> {
/// let router = Router::new().route("/orders", post(|| async { "created" }));
/// let app = IdempotencyLayer::new(MemoryStore::new()).layer(router);
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
/// axum::serve(listener, axum::ServiceExt::<Request>::into_make_service(app)).await
/// # }
/// ```
pub struct Idempotency<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S: Clone> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>) -> Self {
        Self { inner, settings }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The instance that was polled ready serves this request; a clone takes its place
    /// (the usual tower pattern for a service called from a future that outlives `call`).
    fn take_ready_inner(&mut self) -> S
    where
        S: Clone,
    {
        let clone = self.inner.clone();
        std::mem::replace(&mut self.inner, clone)
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let settings = &self.settings;
        let (method, path) = (request.method(), request.uri().path());
        if settings.profile.advertises(method, path) {
            // The profile reads the answer: ask for it unencoded.
            crate::owner::ask_for_identity(request.headers_mut());
            let answer = self.inner.call(request);
            return ResponseFuture::boxed(Box::pin(advertise::amend(settings.clone(), answer)));
        }
        let key = match keyed::read_key(settings, &request) {
            Ok(Some(key)) => key,
            Ok(None) => return ResponseFuture::passthrough(self.inner.call(request)),
            Err(rejection) => {
                return ResponseFuture::ready(reject_key(settings, &request, rejection));
            }
        };
        let (request, id, span) = keyed::begin(settings, request, key);
        let settings = settings.clone();
        let inner = self.take_ready_inner();
        ResponseFuture::in_span(Box::pin(keyed::handle(settings, inner, request, id)), span)
    }
}

fn reject_key<B, ResBody: From<Bytes>>(
    settings: &Settings,
    request: &Request<B>,
    rejection: Rejection,
) -> Response<ResBody> {
    tracing::info!(
        outcome = rejection.kind.as_str(),
        method = %request.method(),
        "idempotency: refused the key header: {}",
        rejection.message
    );
    crate::metrics::count(settings, crate::Outcome::Rejected(rejection.kind));
    rejection.into_response(settings)
}

/// The inner services the layer wraps, under one name for the functions of the keyed
/// path. Every service the public `Service` impl accepts is one.
pub(crate) trait Inner<ReqBody, ResBody>:
    Service<
        Request<ReqBody>,
        Response = Response<ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
}

impl<S, ReqBody, ResBody> Inner<ReqBody, ResBody> for S where
    S: Service<
            Request<ReqBody>,
            Response = Response<ResBody>,
            Future: Send + 'static,
            Error: Send + 'static,
        > + Send
        + 'static
{
}

/// The request bodies the keyed path reads, under one name.
pub(crate) trait RequestBody:
    Body<Data: Send, Error: Into<BoxError>> + From<Bytes> + Send + 'static
{
}

impl<B> RequestBody for B where
    B: Body<Data: Send, Error: Into<BoxError>> + From<Bytes> + Send + 'static
{
}

/// The response bodies the keyed path reads and rebuilds, under one name.
pub(crate) trait AnswerBody:
    Body<Data = Bytes, Error: Into<BoxError>> + From<Bytes> + Send + 'static
{
}

impl<B> AnswerBody for B where
    B: Body<Data = Bytes, Error: Into<BoxError>> + From<Bytes> + Send + 'static
{
}

/// What the keyed path's functions return: the inner service's response or its error.
pub(crate) type Answer<ResBody, E> = Result<Response<ResBody>, E>;
