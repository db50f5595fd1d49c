//! How one [`Idempotency`](crate::Idempotency) service types its bodies, under one name
//! for the stages of a keyed request. [`Bodies`] names the four bodies a request meets —
//! the caller's request (`RequestIn`), the inner service's request (`RequestOut`), the
//! inner service's response (`ResponseIn`), the caller's response (`ResponseOut`) — and
//! how the layer converts between them. [`Same`] is the default mode
//! ([`InnerBodies`](crate::InnerBodies)), [`Wrap`] the wrapping one
//! ([`WrappedBodies`](crate::WrappedBodies)).

use std::marker::PhantomData;
use std::pin::Pin;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::body::IdempotencyBody;
use crate::store::BoxError;

/// The inner service a layer wraps, under one name for the functions of the keyed path.
/// Every service the public `Service` impls accept is one.
pub(crate) trait InnerService<ReqBody, ResBody>:
    Service<
        Request<ReqBody>,
        Response = Response<ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
}

impl<S, ReqBody, ResBody> InnerService<ReqBody, ResBody> for S where
    S: Service<
            Request<ReqBody>,
            Response = Response<ResBody>,
            Future: Send + 'static,
            Error: Send + 'static,
        > + Send
        + 'static
{
}

/// The four body types of one [`Idempotency`](crate::Idempotency) service, and how the
/// layer converts between them.
pub(crate) trait Bodies: 'static {
    /// The caller's request body, read whole when the request is keyed.
    type RequestIn: Body<Data: Send, Error: Into<BoxError>> + Send + 'static;
    /// The inner service's request body.
    type RequestOut: Send + 'static;
    /// The inner service's response body, read whole when the request is keyed.
    type ResponseIn: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static;
    /// The caller's response body.
    type ResponseOut: From<Self::ResponseIn> + Send + 'static;

    /// A request body passed through, untouched.
    fn pass(body: Self::RequestIn) -> Self::RequestOut;
    /// A keyed request's body, read whole, for the inner service.
    fn keyed_request(bytes: Bytes) -> Self::RequestOut;
    /// A response the layer makes: the bytes, then the trailers.
    fn made(bytes: Bytes, trailers: Option<HeaderMap>) -> Self::ResponseOut;
    /// A response whose first bytes the layer read and whose rest streams on unread; the
    /// parts back when this mode cannot stream (a body type built from bytes alone).
    #[allow(clippy::type_complexity)]
    fn continued(
        read: Bytes,
        rest: Pin<Box<Self::ResponseIn>>,
    ) -> Result<Self::ResponseOut, (Bytes, Pin<Box<Self::ResponseIn>>)>;
}

/// [`InnerBodies`](crate::InnerBodies): the inner service's own types, built with
/// `From<Bytes>`.
pub(crate) struct Same<ReqBody, ResBody>(PhantomData<fn() -> (ReqBody, ResBody)>);

impl<ReqBody, ResBody> Bodies for Same<ReqBody, ResBody>
where
    ReqBody: Body<Data: Send, Error: Into<BoxError>> + From<Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + From<Bytes> + Send + 'static,
{
    type RequestIn = ReqBody;
    type RequestOut = ReqBody;
    type ResponseIn = ResBody;
    type ResponseOut = ResBody;

    fn pass(body: ReqBody) -> ReqBody {
        body
    }

    fn keyed_request(bytes: Bytes) -> ReqBody {
        ReqBody::from(bytes)
    }

    fn made(bytes: Bytes, trailers: Option<HeaderMap>) -> ResBody {
        if trailers
            .as_ref()
            .is_some_and(|trailers| !trailers.is_empty())
        {
            tracing::warn!(
                "idempotency: an answer with trailers went out without them: the service's body \
                 type is built from bytes alone. Wrap bodies (IdempotencyLayer::wrap_bodies) to \
                 keep trailers"
            );
        }
        ResBody::from(bytes)
    }

    fn continued(
        read: Bytes,
        rest: Pin<Box<ResBody>>,
    ) -> Result<ResBody, (Bytes, Pin<Box<ResBody>>)> {
        Err((read, rest))
    }
}

/// [`WrappedBodies`](crate::WrappedBodies): every body wrapped in [`IdempotencyBody`].
pub(crate) struct Wrap<ReqBody, ResBody>(PhantomData<fn() -> (ReqBody, ResBody)>);

impl<ReqBody, ResBody> Bodies for Wrap<ReqBody, ResBody>
where
    ReqBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    type RequestIn = ReqBody;
    type RequestOut = IdempotencyBody<ReqBody>;
    type ResponseIn = ResBody;
    type ResponseOut = IdempotencyBody<ResBody>;

    fn pass(body: ReqBody) -> IdempotencyBody<ReqBody> {
        IdempotencyBody::new(body)
    }

    fn keyed_request(bytes: Bytes) -> IdempotencyBody<ReqBody> {
        IdempotencyBody::buffered(bytes, None)
    }

    fn made(bytes: Bytes, trailers: Option<HeaderMap>) -> IdempotencyBody<ResBody> {
        IdempotencyBody::buffered(bytes, trailers)
    }

    fn continued(
        read: Bytes,
        rest: Pin<Box<ResBody>>,
    ) -> Result<IdempotencyBody<ResBody>, (Bytes, Pin<Box<ResBody>>)> {
        Ok(IdempotencyBody::continued(read, rest))
    }
}

/// What the keyed path's functions return: the caller's response, or the inner
/// service's error.
pub(crate) type Answer<B, E> = Result<Response<<B as Bodies>::ResponseOut>, E>;
