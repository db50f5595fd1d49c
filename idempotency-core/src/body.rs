//! [`IdempotencyBody`], the body of a service whose bodies the layer wraps.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The body of a service whose bodies the layer wraps
    /// ([`IdempotencyLayer::wrap_bodies`](crate::IdempotencyLayer::wrap_bodies)): either
    /// another body, untouched, or a body the layer
    /// holds in memory, with the trailers it ends with.
    ///
    /// Requests and answers the layer does not take part in travel as [`new`](Self::new)
    /// wrappers around the original body: nothing is read, copied or boxed. Keyed requests
    /// reach the inner service as the bytes the layer read, and the layer's own answers
    /// (replays, first answers it read whole to store, rejections) are bytes plus
    /// trailers, sent as one data frame and one trailers frame.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::HeaderMap;
    /// use http_body_util::{BodyExt, Empty};
    /// use idempotency_core::IdempotencyBody;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let mut trailers = HeaderMap::new();
    /// trailers.insert("x-status", "0".parse().unwrap());
    /// let body = IdempotencyBody::<Empty<Bytes>>::buffered(Bytes::from_static(b"hi"), Some(trailers.clone()));
    /// let collected = body.collect().await.unwrap();
    /// assert_eq!(collected.trailers(), Some(&trailers));
    /// assert_eq!(collected.to_bytes(), "hi");
    /// # }
    /// ```
    #[derive(Debug)]
    pub struct IdempotencyBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Buffered { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Continued { read: Option<Bytes>, rest: Pin<Box<B>> },
    }
}

impl<B> IdempotencyBody<B> {
    /// Wraps `body`, untouched.
    pub fn new(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    /// A body of `data`, then `trailers` if any.
    pub fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: Kind::Buffered {
                data: Some(data).filter(|data| !data.is_empty()),
                trailers,
            },
        }
    }

    /// The bytes the layer read of `rest`, then `rest` itself, streamed on: an answer
    /// too large for the layer to hold.
    pub(crate) fn continued(read: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: Kind::Continued {
                read: Some(read).filter(|read| !read.is_empty()),
                rest,
            },
        }
    }

    /// The wrapped body, if this is one (`None` for a body the layer holds).
    pub fn into_inner(self) -> Option<B> {
        match self.kind {
            Kind::Inner { body } => Some(body),
            Kind::Buffered { .. } | Kind::Continued { .. } => None,
        }
    }
}

/// Wraps a body, untouched: the same as [`IdempotencyBody::new`].
impl<B> From<B> for IdempotencyBody<B> {
    fn from(body: B) -> Self {
        Self::new(body)
    }
}

impl<B> Default for IdempotencyBody<B> {
    fn default() -> Self {
        Self::buffered(Bytes::new(), None)
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Buffered { data, trailers } => Poll::Ready(match data.take() {
                Some(data) => Some(Ok(Frame::data(data))),
                None => trailers
                    .take()
                    .map(|trailers| Ok(Frame::trailers(trailers))),
            }),
            KindProj::Continued { read, rest } => match read.take() {
                Some(read) => Poll::Ready(Some(Ok(Frame::data(read)))),
                None => rest.as_mut().poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Continued { read, rest } => read.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Buffered { data, trailers } => {
                let length = data.as_ref().map_or(0, |data| data.len() as u64);
                if trailers.is_none() {
                    SizeHint::with_exact(length)
                } else {
                    // Not exact: an HTTP/1.1 server then sends the body chunked, which is
                    // how trailers can follow it (a Content-Length body has no room for
                    // them).
                    let mut hint = SizeHint::new();
                    hint.set_lower(length);
                    hint
                }
            }
            Kind::Continued { read, rest } => {
                let read = read.as_ref().map_or(0, |read| read.len() as u64);
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + read);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + read);
                }
                hint
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn an_empty_buffered_body_without_trailers_ends_at_once() {
        let body = IdempotencyBody::<Full<Bytes>>::buffered(Bytes::new(), None);
        assert!(body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(0));
    }

    #[tokio::test]
    async fn a_body_with_trailers_does_not_claim_an_exact_length() {
        let body = IdempotencyBody::<Full<Bytes>>::buffered(
            Bytes::from_static(b"abc"),
            Some(HeaderMap::new()),
        );
        assert_eq!(body.size_hint().exact(), None);
        assert_eq!(body.size_hint().lower(), 3);
    }

    #[tokio::test]
    async fn a_wrapped_body_is_passed_through() {
        let body = IdempotencyBody::new(Full::new(Bytes::from_static(b"abc")));
        assert_eq!(body.size_hint().exact(), Some(3));
        let collected = body.collect().await.unwrap();
        assert!(collected.trailers().is_none());
        assert_eq!(collected.to_bytes(), "abc");
    }
}
