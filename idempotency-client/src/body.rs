//! Buffering a request body once, and building each attempt's body from the buffer.

use bytes::{Bytes, BytesMut};
use http_body::Body;
use http_body_util::{BodyExt, Full};

use crate::error::{BoxError, Error};

/// A request body type the layer can rebuild from the bytes it buffered, so that every
/// attempt sends the same bytes.
///
/// Implemented for `http_body_util::Full<Bytes>` (hyper-util's client), the boxed bodies
/// of `http-body-util`, and, with the `tonic` feature, `tonic::body::Body` (a tonic
/// `Channel`). For a body type of your own, build it from the bytes:
///
/// ```
/// use bytes::{Bytes, BytesMut};
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
/// size is known) and one with trailers (a rebuilt body could not send them again).
pub(crate) async fn buffer<B>(body: B, limit: usize) -> Result<Bytes, Error>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(Error::BodyTooLarge { limit });
    }
    let mut body = std::pin::pin!(body);
    // Most bodies arrive in one frame: that one is kept as it is, without a copy.
    let mut first = Bytes::new();
    let mut more = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| Error::Body(error.into()))?;
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(_trailers) => {
                return Err(Error::Body(
                    "the request body has trailers, which the idempotency layer cannot resend: \
                     send it outside the layer"
                        .into(),
                ));
            }
        };
        if first.len() + more.len() + data.len() > limit {
            return Err(Error::BodyTooLarge { limit });
        }
        if first.is_empty() && more.is_empty() {
            first = data;
        } else {
            if !first.is_empty() {
                more.extend_from_slice(&std::mem::take(&mut first));
            }
            more.extend_from_slice(&data);
        }
    }
    Ok(if more.is_empty() {
        first
    } else {
        more.freeze()
    })
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http::HeaderMap;
    use http_body::Frame;

    use super::*;

    /// A body of the given frames, its size unknown.
    struct Frames(std::collections::VecDeque<Frame<Bytes>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            std::task::Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    fn frames(frames: Vec<Frame<Bytes>>) -> Frames {
        Frames(frames.into())
    }

    fn data(text: &'static str) -> Frame<Bytes> {
        Frame::data(Bytes::from_static(text.as_bytes()))
    }

    #[tokio::test]
    async fn frames_are_joined_and_bounded_and_trailers_refused() {
        let one = buffer(Full::new(Bytes::from_static(b"book")), 4)
            .await
            .unwrap();
        assert_eq!(one, "book");
        let joined = buffer(frames(vec![data(""), data("bo"), data(""), data("ok")]), 4)
            .await
            .unwrap();
        assert_eq!(joined, "book");
        assert!(matches!(
            buffer(frames(vec![data("bo"), data("oks")]), 4).await,
            Err(Error::BodyTooLarge { limit: 4 })
        ));
        assert!(matches!(
            buffer(Full::new(Bytes::from_static(b"books")), 4).await,
            Err(Error::BodyTooLarge { limit: 4 })
        ));
        let trailers = buffer(
            frames(vec![data("a"), Frame::trailers(HeaderMap::new())]),
            4,
        )
        .await;
        assert!(
            matches!(&trailers, Err(Error::Body(e)) if e.to_string().contains("trailers")),
            "{trailers:?}"
        );
    }
}
