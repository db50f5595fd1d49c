//! The response body the layer hands out: the inner service's own body when the layer
//! stays out of the way, or bytes it buffered, stored or rendered.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::store::BoxError;

pin_project! {
    /// The body of every response the [`Idempotency`](crate::Idempotency) service returns.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        // The inner service's body, untouched (requests without a key).
        Inner { #[pin] body: B },
        // A buffered, replayed or rendered body.
        Full { data: Option<Bytes> },
        // A response too large to buffer: what was read, then the rest of the stream.
        Prefixed { prefix: Option<Bytes>, rest: Pin<Box<B>> },
        // The inner body failed while it was being buffered: what was read, then the error.
        Failed { prefix: Option<Bytes>, error: Option<BoxError> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    pub(crate) fn prefixed(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: Kind::Prefixed {
                prefix: Some(prefix),
                rest,
            },
        }
    }

    pub(crate) fn failed(prefix: Bytes, error: BoxError) -> Self {
        Self {
            kind: Kind::Failed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                error: Some(error),
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Prefixed { prefix, rest } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => rest.as_mut().poll_frame(cx).map_err(Into::into),
            },
            KindProj::Failed { prefix, error } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => Poll::Ready(error.take().map(Err)),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
            Kind::Prefixed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
            Kind::Failed { prefix, error } => prefix.is_none() && error.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Prefixed { prefix, rest } => {
                let already = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + already);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + already);
                }
                hint
            }
            Kind::Failed { .. } => SizeHint::new(),
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Full { .. } => "full",
            Kind::Prefixed { .. } => "prefixed",
            Kind::Failed { .. } => "failed",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}
