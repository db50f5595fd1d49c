//! Stage 5, **classify**: what happens to what the inner service did, decided from the
//! facts, without I/O. An error or a panic releases the key. An answer the handler
//! already finalized in its own transaction is sent as it was finalized; one it marked
//! [`OutcomeUnknown`] keeps the key reserved, neither stored nor released. Otherwise 5xx
//! and the release statuses release the key; the profile decides the rest; an answer
//! that cannot be kept (too large, or encoded although the layer asked for none) is
//! remembered as "already ran"; an answer whose body failed is released or remembered by
//! its status.

use http::{HeaderMap, StatusCode, response};

use crate::decisions::Disposition;
use crate::encoding::is_encoded;
use crate::keyed::execute::Ran;
use crate::read::BodyRead;
use crate::reservation::{FinalizedInTransaction, OutcomeUnknown, ReservationHandle};
use crate::settings::Settings;

/// What classifying an answer looks at.
pub(crate) struct Facts<'a> {
    /// Its status, headers and extensions.
    pub(crate) parts: &'a response::Parts,
    /// The trailers its body ended with, once read whole.
    pub(crate) trailers: Option<&'a HeaderMap>,
    /// How far its body was read.
    pub(crate) read: ReadState,
}

/// How far an answer's body was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadState {
    /// Whole, within the limit and the memory budget.
    Whole,
    /// Past the limit or the budget.
    TooLarge,
    /// It failed.
    Failed,
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

/// What happens to what the inner service did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The handler stored its answer in its own transaction: that answer is sent, and
    /// nothing more is written.
    FinalizedByHandler,
    /// Store the answer and replay it to every retry.
    Store,
    /// Keep the key reserved: the change may or may not have taken effect, so its answer
    /// cannot be replayed, and releasing the key would let a retry run it a second time.
    KeepReserved,
    /// Release the key, so that a retry runs again; the reason, for the log.
    Release(&'static str),
    /// Remember that the request ran, without its answer.
    NotKept(NotKept),
    /// The answer's body failed while it was read: the key is released if the status
    /// releases it, else remembered as "already ran" (the mutation most likely happened).
    BodyFailed { release: bool },
}

/// The verdict on what the owner's inner service did.
pub(crate) fn classify<I, E>(
    settings: &Settings,
    reservation: &ReservationHandle,
    ran: &Ran<I, E>,
) -> Verdict {
    let (parts, read) = match ran {
        Ran::Error(_) => return Verdict::Release("the inner service returned an error"),
        Ran::Panic(_) => return Verdict::Release("the inner service panicked"),
        Ran::Response { parts, read, .. } => (parts, read),
    };
    if let Some(mark) = parts.extensions.get::<FinalizedInTransaction>() {
        if mark.reservation == *reservation {
            return Verdict::FinalizedByHandler;
        }
        tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(reservation.id()), "idempotency: the response is marked as finalized for another reservation; handling it as an ordinary answer");
    }
    let (trailers, read) = match read {
        BodyRead::Whole(_, trailers) => (trailers.as_ref(), ReadState::Whole),
        BodyRead::Over { .. } => (None, ReadState::TooLarge),
        BodyRead::Failed(_) | BodyRead::TimedOut => (None, ReadState::Failed),
    };
    if parts.extensions.get::<OutcomeUnknown>().is_some() {
        // A body that failed cannot be delivered: remembered as "already ran" instead,
        // which runs nothing again either.
        return match read {
            ReadState::Failed => Verdict::BodyFailed { release: false },
            ReadState::Whole | ReadState::TooLarge => Verdict::KeepReserved,
        };
    }
    verdict_on(
        settings,
        &Facts {
            parts,
            trailers,
            read,
        },
    )
}

/// The verdict on an answer: the generic rules first, then the profile's.
pub(crate) fn verdict_on(settings: &Settings, facts: &Facts<'_>) -> Verdict {
    let status = facts.parts.status;
    let release = releases(settings, status);
    if facts.read == ReadState::Failed {
        return Verdict::BodyFailed { release };
    }
    if release {
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
