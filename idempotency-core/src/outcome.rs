//! [`Outcome`]: what the layer did with a request, for logs, metrics and tests.

use std::fmt;

use crate::rejection::RejectionKind;

/// What the layer did with a keyed request. Every response to a request the layer took
/// part in carries one as an extension, so an access log can say whether the request
/// ran, was replayed or was refused. Requests passed through untouched carry none.
///
/// ```
/// use idempotency_core::{Outcome, RejectionKind};
///
/// assert_eq!(Outcome::Replayed.as_str(), "replayed");
/// assert_eq!(Outcome::Rejected(RejectionKind::KeyReused).as_str(), "rejected");
/// assert_eq!(Outcome::Rejected(RejectionKind::KeyReused).to_string(), "rejected:key-reused");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The request reserved its key and ran; its answer was stored.
    Executed,
    /// The request took over a crashed owner's lapsed reservation and ran.
    TookOver,
    /// The request ran, and its answer released the key (5xx, 401, 429, …).
    Released,
    /// The request ran but its answer could not be stored (too large, or its body failed);
    /// retries are told it already ran.
    ExecutedNotStored,
    /// The request ran, but the store did not take its outcome: finalizing or releasing
    /// the key failed (the store was down past the finalize retries), or another request
    /// had taken the key over meanwhile. The record stays as it was: in flight until its
    /// lease lapses, or another owner's.
    Unsettled,
    /// The request ran, and whether its change took effect is unknown: its handler marked
    /// the answer [`OutcomeUnknown`](crate::OutcomeUnknown) (the answer to its `COMMIT`
    /// was lost, say). The key stays reserved until it expires, so that no retry runs the
    /// change again.
    Unknown,
    /// The stored answer of an earlier request was replayed; nothing ran.
    Replayed,
    /// The store failed and the layer is configured to fail open: it ran unprotected.
    RanUnprotected,
    /// The layer refused the request; nothing ran.
    Rejected(RejectionKind),
}

impl Outcome {
    /// A short, stable, kebab-case name, the same for every [`RejectionKind`]
    /// (`rejected`): a label for metrics. [`Display`](fmt::Display) adds the kind
    /// (`rejected:key-reused`), for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::TookOver => "took-over",
            Self::Released => "released",
            Self::ExecutedNotStored => "executed-not-stored",
            Self::Unsettled => "unsettled",
            Self::Unknown => "unknown",
            Self::Replayed => "replayed",
            Self::RanUnprotected => "ran-unprotected",
            Self::Rejected(_) => "rejected",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rejected(kind) => write!(f, "rejected:{}", kind.as_str()),
            other => f.write_str(other.as_str()),
        }
    }
}
