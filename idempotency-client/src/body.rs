//! Buffering a request body once, and building each attempt's body from the buffer.

use bytes::Bytes;
use http_body::Body;
use http_body_util::{BodyExt, Full, Limited};

use crate::error::{BoxError, Error};

/// A request body type the layer can rebuild from the bytes it buffered, so that every
/// attempt sends the same bytes.
///
/// Implemented for `http_body_util::Full<Bytes>` (hyper-util's client), the boxed bodies
/// of `http-body-util`, and, with the `tonic` feature, `tonic::body::Body` (a tonic
/// `Channel`). For a body type of your own, build it from the bytes:
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use idempotency_client::ResendBody;
///
/// struct MyBody(Full<Bytes>);
/// # impl http_body::Body for MyBody {
/// #     type Data = Bytes;
/// #     type Error = std::convert::Infallible;
/// #     fn poll_frame(
/// #         self: std::pin::Pin<&mut Self>,
/// #         cx: &mut std::task::Context<'_>,
/// #     ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
/// #         std::pin::Pin::new(&mut self.get_mut().0).poll_frame(cx)
/// #     }
/// # }
///
/// impl ResendBody for MyBody {
///     fn from_bytes(bytes: Bytes) -> Self {
///         MyBody(Full::new(bytes))
///     }
/// }
/// ```
pub trait ResendBody: Body<Data = Bytes> + Sized {
    /// A body that sends exactly `bytes`.
    fn from_bytes(bytes: Bytes) -> Self;
}

impl ResendBody for Full<Bytes> {
    fn from_bytes(bytes: Bytes) -> Self {
        Full::new(bytes)
    }
}

impl<E> ResendBody for http_body_util::combinators::BoxBody<Bytes, E>
where
    E: 'static,
{
    fn from_bytes(bytes: Bytes) -> Self {
        Full::new(bytes).map_err(|never| match never {}).boxed()
    }
}

impl<E> ResendBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E>
where
    E: 'static,
{
    fn from_bytes(bytes: Bytes) -> Self {
        Full::new(bytes)
            .map_err(|never| match never {})
            .boxed_unsync()
    }
}

#[cfg(feature = "tonic")]
impl ResendBody for tonic::body::Body {
    fn from_bytes(bytes: Bytes) -> Self {
        tonic::body::Body::new(Full::new(bytes))
    }
}

/// Reads the whole body, refusing one over `limit` bytes (before reading it, when its
/// size is known).
pub(crate) async fn buffer<B>(body: B, limit: usize) -> Result<Bytes, Error>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(Error::BodyTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            Err(Error::BodyTooLarge { limit })
        }
        Err(error) => Err(Error::Body(error)),
    }
}
