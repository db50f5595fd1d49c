//! Reading a body: the one reader every body the layer reads goes through — a keyed
//! request's (to bind it), the inner service's answer (to store it), a handler's answer
//! (to finalize it in the handler's transaction), and the answers a profile amends or
//! refreshes a replay with — and [`BodyRead`], what it read.

use std::pin::Pin;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures_util::FutureExt as _;
use http::HeaderMap;
use http_body::Body;
use http_body_util::BodyExt as _;
use tokio::time::Instant;

use crate::budget::{Held, MemoryBudget};
use crate::store::BoxError;

/// A body as read so far.
#[derive(Debug)]
pub(crate) enum BodyRead {
    /// All of it, and the trailers it ended with.
    Whole(Bytes, Option<HeaderMap>),
    /// It went past the size limit or the memory budget: the bytes read so far (the
    /// frame that went past included), and how many of them were taken from the budget.
    /// The rest of the body is still unread.
    Over {
        read: Bytes,
        past: Past,
        taken: usize,
    },
    /// It made the reader wait longer than the time limit.
    TimedOut,
    /// It failed.
    Failed(BoxError),
}

/// Which bound a body went past.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Past {
    /// The size limit.
    Limit,
    /// The memory budget.
    Budget,
}

/// How much of a body is read, and within what: [`read`](Self::read) reads it.
pub(crate) struct Reader<'a> {
    limit: usize,
    budget: Option<(&'a MemoryBudget, &'a mut Held)>,
    /// Bytes already taken from the budget for this body.
    taken: usize,
    timeout: Option<Duration>,
}

impl<'a> Reader<'a> {
    /// A reader of at most `limit` bytes.
    pub(crate) fn up_to(limit: usize) -> Self {
        Self {
            limit,
            budget: None,
            taken: 0,
            timeout: None,
        }
    }

    /// A reader that reads a body whole, however long (one the caller holds whole
    /// anyway, or whose length it checks itself).
    pub(crate) fn whole() -> Self {
        Self::up_to(usize::MAX)
    }

    /// Takes every byte read from `budget` into `held`, of which `taken` bytes were taken
    /// for this body already (what its `Content-Length` declared).
    pub(crate) fn within(
        mut self,
        budget: &'a MemoryBudget,
        held: &'a mut Held,
        taken: usize,
    ) -> Self {
        self.budget = Some((budget, held));
        self.taken = taken;
        self
    }

    /// Gives up on a body that makes the reader wait longer than `timeout` in all,
    /// counted from the first time it waits (a body that is there already costs no
    /// timer, and no reading of the clock).
    pub(crate) fn in_time(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Reads `body` after the bytes `so_far` (empty, or what an earlier read of the same
    /// body got).
    pub(crate) async fn read<B>(mut self, mut body: Pin<&mut B>, so_far: Bytes) -> BodyRead
    where
        B: Body<Data: Buf, Error: Into<BoxError>> + ?Sized,
    {
        let mut bytes = Joined::default();
        bytes.push(so_far);
        let mut trailers: Option<HeaderMap> = None;
        let mut deadline = None;
        loop {
            // A frame that is already there is taken without arming a timer. (`if let`, not
            // `match`: the scrutinee must not live across the await below.)
            let frame = if let Some(frame) = body.as_mut().frame().now_or_never() {
                frame
            } else if let Some(timeout) = self.timeout {
                let deadline = *deadline.get_or_insert_with(|| Instant::now() + timeout);
                match tokio::time::timeout_at(deadline, body.as_mut().frame()).await {
                    Ok(frame) => frame,
                    Err(_elapsed) => return BodyRead::TimedOut,
                }
            } else {
                body.as_mut().frame().await
            };
            let frame = match frame {
                None => return BodyRead::Whole(bytes.freeze(), trailers),
                Some(Err(error)) => return BodyRead::Failed(error.into()),
                Some(Ok(frame)) => frame,
            };
            let mut data = match frame.into_data() {
                Ok(data) => data,
                Err(frame) => {
                    if let Ok(more) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(more);
                    }
                    continue;
                }
            };
            let length = bytes.len() + data.remaining();
            let past = if length > self.limit {
                Some(Past::Limit)
            } else if !self.take(length) {
                Some(Past::Budget)
            } else {
                None
            };
            // A frame of `Bytes` (what hyper and axum send) is taken without a copy.
            bytes.push_expecting(data.copy_to_bytes(data.remaining()), self.taken);
            if let Some(past) = past {
                return BodyRead::Over {
                    read: bytes.freeze(),
                    past,
                    taken: self.taken,
                };
            }
        }
    }

    /// Takes from the budget what a body of `length` bytes needs beyond what was taken.
    fn take(&mut self, length: usize) -> bool {
        let Some((budget, held)) = &mut self.budget else {
            return true;
        };
        if length <= self.taken {
            return true;
        }
        let more = length - self.taken;
        if !budget.grow(held, more) {
            return false;
        }
        self.taken = length;
        true
    }
}

/// Reads `body` whole, without a bound: for a body its caller holds whole anyway.
pub(crate) async fn read_whole<B>(body: B) -> Result<(Bytes, Option<HeaderMap>), BoxError>
where
    B: Body<Data = Bytes, Error: Into<BoxError>>,
{
    let body = std::pin::pin!(body);
    match Reader::whole().read(body, Bytes::new()).await {
        BodyRead::Whole(bytes, trailers) => Ok((bytes, trailers)),
        BodyRead::Failed(error) => Err(error),
        // A whole reader has neither a limit, a budget nor a time limit to go past.
        BodyRead::Over { .. } | BodyRead::TimedOut => {
            Err("the body went past a bound of a reader that has none".into())
        }
    }
}

/// A body's data frames joined into one byte string. Most bodies the layer reads arrive
/// as one frame: that frame is kept as it came, with neither a copy nor an allocation;
/// only a second frame starts a buffer that the frames are copied into.
#[derive(Default)]
struct Joined {
    first: Bytes,
    more: Option<BytesMut>,
}

impl Joined {
    fn len(&self) -> usize {
        self.more.as_ref().map_or(self.first.len(), BytesMut::len)
    }

    fn push(&mut self, data: Bytes) {
        self.push_expecting(data, 0);
    }

    /// [`push`](Self::push) for a body expected to be `expected` bytes long: if a
    /// buffer has to be started, it is sized for them at once.
    fn push_expecting(&mut self, data: Bytes, expected: usize) {
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

    fn freeze(self) -> Bytes {
        self.more.map_or(self.first, BytesMut::freeze)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};

    type Frames = StreamBody<
        futures_util::stream::Iter<
            std::vec::IntoIter<Result<http_body::Frame<Bytes>, std::convert::Infallible>>,
        >,
    >;

    fn frames(parts: &'static [&'static [u8]]) -> Frames {
        let frames: Vec<_> = parts
            .iter()
            .map(|part| Ok(http_body::Frame::data(Bytes::from_static(part))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
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
    async fn a_body_past_the_limit_is_read_up_to_the_frame_that_went_past() {
        let mut body = std::pin::pin!(frames(&[b"ab", b"cd", b"ef"]));
        let read = Reader::up_to(3).read(body.as_mut(), Bytes::new()).await;
        assert!(
            matches!(&read, BodyRead::Over { read, past: Past::Limit, .. } if read == "abcd"),
            "{read:?}"
        );
        // The rest is still there, and a second read picks up where the first stopped.
        let rest = Reader::whole()
            .read(body, Bytes::from_static(b"abcd"))
            .await;
        assert!(
            matches!(&rest, BodyRead::Whole(bytes, None) if bytes == "abcdef"),
            "{rest:?}"
        );
    }

    #[tokio::test]
    async fn a_body_past_the_budget_stops_and_holds_what_it_took() {
        let budget = MemoryBudget::new(5);
        let mut held = Held::default();
        let body = std::pin::pin!(frames(&[b"abc", b"def"]));
        let read = Reader::whole()
            .within(&budget, &mut held, 0)
            .read(body, Bytes::new())
            .await;
        assert!(
            matches!(&read, BodyRead::Over { read, past: Past::Budget, taken: 3 } if read == "abcdef"),
            "{read:?}"
        );
        assert_eq!(held.bytes(), 3);
    }

    #[tokio::test]
    async fn what_was_taken_up_front_is_not_taken_twice() {
        let budget = MemoryBudget::new(4);
        let mut held = Held::default();
        assert!(budget.grow(&mut held, 4));
        let body = std::pin::pin!(Full::new(Bytes::from_static(b"abcd")));
        let read = Reader::up_to(4)
            .within(&budget, &mut held, 4)
            .read(body, Bytes::new())
            .await;
        assert!(matches!(read, BodyRead::Whole(..)), "{read:?}");
        assert_eq!(held.bytes(), 4);
    }

    #[tokio::test]
    async fn a_body_that_does_not_arrive_in_time_times_out() {
        let stalled = StreamBody::new(futures_util::stream::pending::<
            Result<http_body::Frame<Bytes>, std::convert::Infallible>,
        >());
        let body = std::pin::pin!(stalled);
        let read = Reader::whole()
            .in_time(Duration::from_millis(10))
            .read(body, Bytes::new())
            .await;
        assert!(matches!(read, BodyRead::TimedOut), "{read:?}");
    }
}
