//! Bodies: reading a response whole, as the layer must to store or amend it, and
//! [`IdempotencyBody`], the body of a service whose bodies the layer wraps.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

use crate::budget::{Held, MemoryBudget};
use crate::store::BoxError;

/// How a response body ended up after reading it.
pub(crate) enum Buffered {
    /// The whole body, within the limit, and the trailers it ended with.
    Whole(Bytes, Option<HeaderMap>),
    /// The whole body, over the limit: delivered, but not kept.
    TooLarge(Bytes, Option<HeaderMap>),
    /// The body failed while it was read.
    Failed(BoxError),
}

/// A keyed request's answer as its owner read it.
pub(crate) enum Answered<I> {
    /// The whole body, within the limit and the memory budget, and its trailers.
    Whole(Bytes, Option<HeaderMap>),
    /// Longer than the limit, or than the memory budget allows: the bytes read so far
    /// (never kept), and the rest, unread, to stream on to the caller.
    Over(Bytes, Pin<Box<I>>),
    /// The body failed while it was read.
    Failed(BoxError),
}

/// Reads a keyed answer up to `limit` bytes, each taken from the memory budget into
/// `held`; past either, stops and hands back what it read and the rest of the body.
pub(crate) async fn read_answer<I>(
    body: I,
    limit: usize,
    budget: &MemoryBudget,
    held: &mut Held,
) -> Answered<I>
where
    I: Body<Data = Bytes>,
    I::Error: Into<BoxError>,
{
    let mut body = Box::pin(body);
    let mut bytes = Joined::default();
    let mut trailers = None;
    loop {
        match body.frame().await {
            None => return Answered::Whole(bytes.freeze(), trailers),
            Some(Err(error)) => return Answered::Failed(error.into()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    let over = bytes.len() + data.len() > limit || !budget.grow(held, data.len());
                    bytes.push(data);
                    if over {
                        return Answered::Over(bytes.freeze(), body);
                    }
                }
                Err(frame) => {
                    if let Ok(more) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(more);
                    }
                }
            },
        }
    }
}

/// A body's data frames joined into one byte string. Most bodies the layer reads arrive
/// as one frame: that frame is kept as it came, with neither a copy nor an allocation;
/// only a second frame starts a buffer that the frames are copied into.
#[derive(Default)]
pub(crate) struct Joined {
    first: Bytes,
    more: Option<BytesMut>,
}

impl Joined {
    pub(crate) fn len(&self) -> usize {
        self.more.as_ref().map_or(self.first.len(), BytesMut::len)
    }

    pub(crate) fn push(&mut self, data: Bytes) {
        self.push_expecting(data, 0);
    }

    /// [`push`](Self::push) for a body that declared `expected` bytes: if a buffer has
    /// to be started, it is sized for them at once.
    pub(crate) fn push_expecting(&mut self, data: Bytes, expected: usize) {
        if data.is_empty() {
            return;
        }
        match &mut self.more {
            Some(more) => more.extend_from_slice(&data),
            None if self.first.is_empty() => self.first = data,
            None => {
                let mut more = BytesMut::with_capacity(expected.max(self.first.len() + data.len()));
                more.extend_from_slice(&self.first);
                more.extend_from_slice(&data);
                self.more = Some(more);
            }
        }
    }

    pub(crate) fn freeze(self) -> Bytes {
        self.more.map_or(self.first, BytesMut::freeze)
    }
}

/// Reads the rest of an answer after `prefix`, within the memory budget: the whole
/// answer, or `None` when the budget runs out first (the rest is then dropped).
pub(crate) async fn read_rest<I>(
    prefix: Bytes,
    mut rest: Pin<Box<I>>,
    budget: &MemoryBudget,
    held: &mut Held,
) -> Result<Option<(Bytes, Option<HeaderMap>)>, BoxError>
where
    I: Body<Data = Bytes>,
    I::Error: Into<BoxError>,
{
    let mut bytes = BytesMut::from(&prefix[..]);
    let mut trailers = None;
    while let Some(frame) = rest.frame().await {
        match frame.map_err(Into::into)?.into_data() {
            Ok(data) => {
                if !budget.grow(held, data.len()) {
                    return Ok(None);
                }
                bytes.extend_from_slice(&data);
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
                }
            }
        }
    }
    Ok(Some((bytes.freeze(), trailers)))
}

/// Reads `body` whole; over `limit` bytes it is still read (its caller gets it whole),
/// but reported as too large to keep.
pub(crate) async fn buffer<B>(body: B, limit: usize) -> Buffered
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match body.collect().await {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            let bytes = collected.to_bytes();
            if bytes.len() > limit {
                Buffered::TooLarge(bytes, trailers)
            } else {
                Buffered::Whole(bytes, trailers)
            }
        }
        Err(error) => Buffered::Failed(error.into()),
    }
}

pin_project! {
    /// The body of a service whose bodies the layer wraps
    /// ([`IdempotencyLayer::wrap_bodies`](crate::IdempotencyLayer::wrap_bodies), and every
    /// [gRPC](crate::grpc) layer): either another body, untouched, or a body the layer
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
    /// trailers.insert("grpc-status", "0".parse().unwrap());
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
    use http_body_util::Full;

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

    #[test]
    fn frames_are_joined_and_a_single_frame_is_kept_as_it_came() {
        let frame = Bytes::from_static(b"abc");
        let mut one = Joined::default();
        one.push(Bytes::new());
        one.push(frame.clone());
        one.push(Bytes::new());
        assert_eq!(one.len(), 3);
        let kept = one.freeze();
        assert_eq!(kept, "abc");
        assert_eq!(kept.as_ptr(), frame.as_ptr(), "one frame is not copied");

        let mut many = Joined::default();
        for part in [&b"abc"[..], b"", b"de", b"fghi"] {
            many.push_expecting(Bytes::copy_from_slice(part), 9);
        }
        assert_eq!(many.len(), 9);
        assert_eq!(many.freeze(), "abcdefghi");
        assert_eq!(Joined::default().freeze(), "");
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
