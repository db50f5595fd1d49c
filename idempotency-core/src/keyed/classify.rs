//! Stage 5, **classify**: what happens to what the inner service did, decided from the
//! facts, without I/O. An error or a panic releases the key. An answer the handler
//! already finalized in its own transaction is sent as it was finalized; one it marked
//! [`OutcomeUnknown`] keeps the key reserved, neither stored nor released. Otherwise 5xx
//! and the release statuses release the key; the profile decides the rest; an answer
//! that cannot be kept (too large, or encoded although the layer asked for none) is
//! remembered as "already ran"; an answer whose body failed is released or remembered by
//! its status.

use std::pin::Pin;

use bytes::Bytes;
use http::{HeaderMap, StatusCode, response};

use crate::decisions::Disposition;
use crate::encoding::is_encoded;
use crate::keyed::execute::{Panic, Ran};
use crate::read::BodyRead;
use crate::reservation::{FinalizedInTransaction, OutcomeUnknown, ReservationHandle};
use crate::settings::Settings;

/// What classifying an answer looks at.
pub(crate) struct Facts<'a> {
    /// Its status, headers and extensions.
    pub(crate) parts: &'a response::Parts,
    /// The trailers its body ended with, once read whole.
    pub(crate) trailers: Option<&'a HeaderMap>,
    /// How far its body was read (it did not fail).
    pub(crate) read: ReadState,
}

/// How far an answer's body was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadState {
    /// Whole, within the limit and the memory budget.
    Whole,
    /// Past the limit or the budget.
    TooLarge,
}

/// Why an answer that ran is not kept for replay: its retries are told it already ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotKept {
    /// Larger than the limit, or than the memory budget allows.
    TooLarge,
    /// Encoded (`Content-Encoding`) although the layer asked for none: it could not be
    /// inspected, nor replayed to a retry that may not accept the encoding.
    Encoded,
}

/// What the rules decide about an answer, from its [`Facts`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Store the answer and replay it to every retry.
    Store,
    /// Release the key, so that a retry runs again; the reason, for the log.
    Release(&'static str),
    /// Remember that the request ran, without its answer.
    NotKept(NotKept),
}

/// What becomes of the key of an answer that is not stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Then {
    /// Keep the key reserved: the change may or may not have taken effect, so its answer
    /// cannot be replayed, and releasing the key would let a retry run it a second time.
    KeepReserved,
    /// Release the key, so that a retry runs again; the reason, for the log.
    Release(&'static str),
    /// Remember that the request ran, without its answer.
    NotKept(NotKept),
}

/// What happens to what the inner service did, with what settling it takes: each case
/// carries exactly the parts of the answer its settling uses.
pub(crate) enum Decided<I, E> {
    /// The inner service returned an error: the key is released, then the error returned.
    Error(E),
    /// The inner service panicked: the key is released, then the panic resumed.
    Panic(Panic),
    /// The handler stored its answer in its own transaction: that answer is sent, and
    /// nothing more is written.
    /// (Boxed: a rare case, whose mark should not make every decision larger.)
    FinalizedByHandler {
        parts: response::Parts,
        read: BodyRead,
        mark: Box<FinalizedInTransaction>,
    },
    /// Store the whole answer, and replay it to every retry; the caller gets it too.
    Store {
        parts: response::Parts,
        bytes: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// An answer that is not stored: it goes on to its caller as read (the rest of its
    /// body still unread, when it went past the limit), and its key is kept, released or
    /// remembered as "already ran".
    PassOn {
        parts: response::Parts,
        then: Then,
        unsent: Unsent,
        body: Pin<Box<I>>,
    },
    /// The answer's body failed while it was read.
    BodyFailed {
        status: StatusCode,
        release: bool,
        read: BodyRead,
    },
}

/// An answer's body as read, not yet sent to its caller.
pub(crate) enum Unsent {
    /// All of it, and the trailers it ended with.
    Whole(Bytes, Option<HeaderMap>),
    /// The bytes read before it went past the limit or the budget, and how many of them
    /// were taken from the budget; the rest is still unread.
    Over { read: Bytes, taken: usize },
}

/// The decision on what the owner's inner service did.
pub(crate) fn classify<I, E>(
    settings: &Settings,
    reservation: &ReservationHandle,
    ran: Ran<I, E>,
) -> Decided<I, E> {
    let (mut parts, read, body) = match ran {
        Ran::Error(error) => return Decided::Error(error),
        Ran::Panic(panic) => return Decided::Panic(panic),
        Ran::Response { parts, read, body } => (parts, read, body),
    };
    if let Some(mark) = parts.extensions.remove::<FinalizedInTransaction>() {
        if mark.reservation == *reservation {
            return Decided::FinalizedByHandler {
                parts,
                read,
                mark: Box::new(mark),
            };
        }
        tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(reservation.id()), "idempotency: the response is marked as finalized for another reservation; handling it as an ordinary answer");
    }
    let status = parts.status;
    let (unsent, read_state) = match read {
        BodyRead::Whole(bytes, trailers) => (Unsent::Whole(bytes, trailers), ReadState::Whole),
        BodyRead::Over { read, taken, .. } => (Unsent::Over { read, taken }, ReadState::TooLarge),
        failed @ (BodyRead::Failed(_) | BodyRead::TimedOut) => {
            // A body that failed cannot be delivered: an answer of unknown outcome is
            // remembered as "already ran" instead, which runs nothing again either.
            let release =
                parts.extensions.get::<OutcomeUnknown>().is_none() && releases(settings, status);
            return Decided::BodyFailed {
                status,
                release,
                read: failed,
            };
        }
    };
    if parts.extensions.get::<OutcomeUnknown>().is_some() {
        return Decided::PassOn {
            parts,
            then: Then::KeepReserved,
            unsent,
            body,
        };
    }
    let trailers = match &unsent {
        Unsent::Whole(_, trailers) => trailers.as_ref(),
        Unsent::Over { .. } => None,
    };
    let facts = Facts {
        parts: &parts,
        trailers,
        read: read_state,
    };
    let (then, unsent) = match (verdict_on(settings, &facts), unsent) {
        (Verdict::Store, Unsent::Whole(bytes, trailers)) => {
            return Decided::Store {
                parts,
                bytes,
                trailers,
            };
        }
        // The rules never store an answer read past the limit (its facts say so); were
        // one ever to, it is remembered as too large, never stored in part.
        (Verdict::Store, unsent @ Unsent::Over { .. }) => {
            (Then::NotKept(NotKept::TooLarge), unsent)
        }
        (Verdict::Release(why), unsent) => (Then::Release(why), unsent),
        (Verdict::NotKept(why), unsent) => (Then::NotKept(why), unsent),
    };
    Decided::PassOn {
        parts,
        then,
        unsent,
        body,
    }
}

/// The verdict on an answer read without failing: the generic rules first, then the
/// profile's.
pub(crate) fn verdict_on(settings: &Settings, facts: &Facts<'_>) -> Verdict {
    if releases(settings, facts.parts.status) {
        return Verdict::Release("the response releases the key");
    }
    // An answer over the limit has its trailers still to come.
    if settings.classifier.classify(facts.parts, facts.trailers) == Disposition::Release {
        return Verdict::Release("the profile releases the key for this response");
    }
    if facts.read == ReadState::TooLarge {
        return Verdict::NotKept(NotKept::TooLarge);
    }
    if is_encoded(&facts.parts.headers) {
        return Verdict::NotKept(NotKept::Encoded);
    }
    Verdict::Store
}

/// Whether `status` releases the key by the generic rules: 5xx, and the layer's release
/// statuses (401, 403, 408, 419, 429 by default).
fn releases(settings: &Settings, status: StatusCode) -> bool {
    status.is_server_error() || settings.release_statuses.contains(&status)
}
