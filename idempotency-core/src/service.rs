//! [`Idempotency`]: the service the layer wraps around an inner one, and where each
//! request's path begins.
//!
//! A request takes one of four ways, decided here without reading its body:
//!
//! 1. The layer's [advertiser](crate::Advertise) amends its answer (e.g. a
//!    catalog's config answer): the inner service answers and the advertiser amends the answer
//!    ([`advertise`](crate::advertise)).
//! 2. It does not take part (not a mutation, not one of the layer's routes, no key): the
//!    inner service gets it untouched, and its future is returned as it is.
//! 3. Its key header is bad: the layer answers 400 at once.
//! 4. It carries a key: the [keyed path](crate::keyed) takes it through its stages
//!    (bind, reserve, execute, classify, finalize or release, replay).

use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::advertise;
use crate::body::IdempotencyBody;
use crate::body_types::{Bodies, InnerService, Same, Wrap};
use crate::encoding::ask_for_identity;
use crate::future::ResponseFuture;
use crate::keyed::{self, parse, parse::Parsed};
use crate::settings::Settings;
use crate::store::BoxError;

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) wraps around an inner one.
///
/// How its bodies are typed is its second parameter, chosen by the layer:
///
/// - [`InnerBodies`] (the default, [`IdempotencyLayer::new`](crate::IdempotencyLayer::new)
///   and most profiles' layers): requests and responses keep the
///   inner service's own body types, so wrapping costs nothing on requests it passes
///   through, and an axum `Router` wrapped whole can still be served with `axum::serve`.
///   The bodies the layer makes itself (keyed requests for the inner service, replays,
///   first answers it read whole, rejections) are built with the body types'
///   `From<Bytes>`: axum's `Body` and `http_body_util::Full<Bytes>` have it. Such a body
///   cannot carry trailers: an answer that ends with trailers loses them (they are still
///   stored, and a warning is logged). Use [`WrappedBodies`] for such services.
/// - [`WrappedBodies`] ([`IdempotencyLayer::wrap_bodies`](crate::IdempotencyLayer::wrap_bodies),
///   and an RPC profile's layer): any body types (an RPC framework's, hyper's `Incoming`).
///   The inner service gets `Request<IdempotencyBody<ReqBody>>` and the caller
///   `Response<IdempotencyBody<ResBody>>`: the original bodies, wrapped untouched, or the
///   layer's own, with trailers.
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
pub struct Idempotency<S, M = InnerBodies> {
    inner: S,
    settings: Arc<Settings>,
    _bodies: PhantomData<fn() -> M>,
}

/// The default body mode of [`Idempotency`]: the inner service's own body types, which
/// must implement `From<Bytes>`.
#[derive(Clone, Copy, Debug, Default)]
pub struct InnerBodies;

/// The body mode of [`Idempotency`] that wraps bodies in [`IdempotencyBody`]: any body
/// types, and answers that keep their trailers.
#[derive(Clone, Copy, Debug, Default)]
pub struct WrappedBodies;

impl<S: Clone, M> Clone for Idempotency<S, M> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            settings: self.settings.clone(),
            _bodies: PhantomData,
        }
    }
}

impl<S: std::fmt::Debug, M> std::fmt::Debug for Idempotency<S, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, M> Idempotency<S, M> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>) -> Self {
        Self {
            inner,
            settings,
            _bodies: PhantomData,
        }
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

    /// Where each request's path begins, for either body mode.
    fn dispatch<B>(
        &mut self,
        mut request: Request<B::RequestIn>,
    ) -> ResponseFuture<S::Future, B::ResponseOut, S::Error>
    where
        B: Bodies,
        S: InnerService<B::RequestOut, B::ResponseIn> + Clone,
    {
        let settings = &self.settings;
        if let Some(advertiser) = &settings.advertiser
            && advertiser.advertises(request.method(), request.uri().path())
        {
            // The advertiser reads the answer: ask for it unencoded.
            ask_for_identity(request.headers_mut());
            let answer = self.inner.call(request.map(B::pass));
            return ResponseFuture::boxed(Box::pin(advertise::amend::<B, _, _>(
                settings.clone(),
                advertiser.clone(),
                answer,
            )));
        }
        match parse::parse(settings, request) {
            Parsed::PassThrough(request) => {
                ResponseFuture::passthrough(self.inner.call(request.map(B::pass)))
            }
            Parsed::Refused(rejection) => {
                ResponseFuture::ready(rejection.into_response::<B>(settings))
            }
            Parsed::Keyed(request, keyed_by, span) => {
                let settings = settings.clone();
                let inner = self.take_ready_inner();
                ResponseFuture::in_span(
                    Box::pin(keyed::respond::<S, B>(settings, inner, request, keyed_by)),
                    span,
                )
            }
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, InnerBodies>
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

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        self.dispatch::<Same<ReqBody, ResBody>>(request)
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, WrappedBodies>
where
    S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, IdempotencyBody<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        self.dispatch::<Wrap<ReqBody, ResBody>>(request)
    }
}
