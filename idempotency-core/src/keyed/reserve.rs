//! Stage 3, **reserve**: make this request the key's owner, or find what the key already
//! holds. A key in flight under a live lease is waited for (bounded by the in-flight
//! wait), one whose owner stopped renewing is taken over, a finished one is replayed, and
//! one bound to another request is refused. A store that fails here fails the request
//! closed (503), or lets it run unprotected if the layer was told to fail open
//! ([`store_failed`]).
//!
//! What to do with a record found under the key is decided by [`next_step`], a pure
//! function; [`reserve`] does the store calls around it. Every record goes through it,
//! whichever call returned it: the key may have been released and taken by another
//! request while this one waited, and then that request's record is not this one's to
//! replay or take over.

use std::sync::Arc;

use bytes::Bytes;
use http::Request;
use tokio::time::Instant;

use crate::body_types::{Answer, Bodies, InnerService};
use crate::keyed::execute::prepare_for_inner;
use crate::keyed::store::RequestPathStore;
use crate::outcome::Outcome;
use crate::rejection::Rejection;
use crate::settings::Settings;
use crate::store::{
    Binding, FencingToken, IdempotencyRecord, RecordId, RecordState, Reservation, StoreError,
    StoredResponse, Waited,
};

/// Reservation attempts before a duplicate gives up: a key that keeps being released and
/// re-reserved by others under our feet is answered as in flight.
const MAX_ATTEMPTS: usize = 4;

/// What comes after the reservation.
pub(crate) enum Next {
    /// The request owns the key and runs (stages 4 to 6): a first execution, or a
    /// takeover of a key whose owner stopped renewing its lease; `outcome` is what a
    /// stored answer's outcome will be.
    Run {
        token: FencingToken,
        outcome: Outcome,
    },
    /// The key holds a finished answer for this very request: replay it (stage 7).
    Replay(StoredResponse),
    /// The layer answers instead: the key is bound to another request, or its owner is
    /// still running after the wait.
    Refuse(Rejection),
    /// The store failed before anything ran: [`store_failed`].
    StoreFailed(StoreError),
}

/// What a record found under the key asks of this request.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// The key was first used for another request.
    KeyReused,
    /// Its answer is stored: replay it.
    Replay(StoredResponse),
    /// Its owner holds a live lease: wait for it.
    Wait,
    /// Its owner's lease lapsed (the owner died, or hangs): take it over.
    TakeOver(FencingToken),
}

/// The decision, without I/O: a record bound to another request is refused whatever
/// state it is in; otherwise its state says what comes next.
fn next_step(record: IdempotencyRecord, binding: &Binding) -> Step {
    if record.binding != *binding {
        return Step::KeyReused;
    }
    match record.state {
        RecordState::Completed(stored) => Step::Replay(stored),
        RecordState::InFlight {
            token,
            lease_lapsed: true,
        } => Step::TakeOver(token),
        RecordState::InFlight { .. } => Step::Wait,
    }
}

/// Reserves the key, waiting for its owner or taking over a dead one as [`next_step`]
/// says, for at most [`MAX_ATTEMPTS`] rounds.
pub(crate) async fn reserve(settings: &Settings, id: &RecordId, binding: &Binding) -> Next {
    let store = RequestPathStore::of(settings);
    // The wait for an in-flight owner is bounded from the first time this request waits:
    // most requests never do, and reading the clock for them is a cost of its own.
    let mut wait_until = None;
    for _ in 0..MAX_ATTEMPTS {
        let mut step = match store.reserve(id, binding).await {
            Ok(Reservation::Reserved(token)) => return owner(settings, id, token),
            Ok(Reservation::Exists(record)) => next_step(record, binding),
            Ok(Reservation::Busy) => Step::Wait,
            Err(error) => return Next::StoreFailed(error),
        };
        if step == Step::Wait {
            let now = Instant::now();
            let until = *wait_until.get_or_insert(now + settings.in_flight_wait);
            tracing::debug!(outcome = "waiting", key = %settings.log_key(id), "idempotency: waiting for the in-flight owner");
            step = match store.wait(id, until.saturating_duration_since(now)).await {
                Ok(Waited::Settled(record)) => next_step(record, binding),
                // Released, rolled back or expired while we waited: reserve again.
                Ok(Waited::Gone) => continue,
                Ok(Waited::Running(Some(record))) if record.binding != *binding => Step::KeyReused,
                Ok(Waited::Running(_)) => Step::Wait,
                Err(error) => return Next::StoreFailed(error),
            };
        }
        match step {
            Step::KeyReused => {
                tracing::info!(outcome = "key-reused", key = %settings.log_key(id), "idempotency: key reused for another request");
                return Next::Refuse(Rejection::key_reused(settings));
            }
            Step::Replay(stored) => {
                tracing::debug!(outcome = "replayed", key = %settings.log_key(id), status = stored.status, "idempotency: replayed the stored response");
                return Next::Replay(stored);
            }
            Step::TakeOver(lapsed) => match store.take_over(id, lapsed).await {
                Ok(Some(token)) => {
                    tracing::warn!(outcome = "took-over", key = %settings.log_key(id), "idempotency: took over a reservation whose owner stopped renewing its lease");
                    return Next::Run {
                        token,
                        outcome: Outcome::TookOver,
                    };
                }
                // Someone else took it over, or the owner finished: look again.
                Ok(None) => continue,
                Err(error) => return Next::StoreFailed(error),
            },
            // Still running when the wait ended.
            Step::Wait => break,
        }
    }
    tracing::info!(outcome = "conflict", key = %settings.log_key(id), "idempotency: the owner is still running; answered in flight");
    Next::Refuse(Rejection::in_flight(settings))
}

/// A first execution: the key is this request's.
fn owner(settings: &Settings, id: &RecordId, token: FencingToken) -> Next {
    tracing::debug!(outcome = "reserved", key = %settings.log_key(id), "idempotency: reserved the key");
    Next::Run {
        token,
        outcome: Outcome::Executed,
    }
}

/// The store failed before anything ran: fail closed, or run unprotected if configured.
/// Its caller boxes its future (it may call the inner service): a rare path, which should
/// not make every keyed request's future larger.
pub(crate) async fn store_failed<S, B>(
    settings: Arc<Settings>,
    mut inner: S,
    request: Request<Bytes>,
    id: &RecordId,
    error: &StoreError,
) -> Answer<B, S::Error>
where
    S: InnerService<B::RequestOut, B::ResponseIn>,
    B: Bodies,
{
    match error {
        StoreError::Full { retry_after, .. } => {
            tracing::warn!(outcome = "store-full", key = %settings.log_key(id), "idempotency: {error}");
            return Ok(Rejection::store_full(&settings, *retry_after).into_response::<B>(&settings));
        }
        StoreError::QuotaExceeded { retry_after, .. } => {
            tracing::info!(outcome = "quota-exceeded", key = %settings.log_key(id), "idempotency: {error}");
            return Ok(
                Rejection::quota_exceeded(&settings, *retry_after).into_response::<B>(&settings)
            );
        }
        _ => {}
    }
    if settings.fail_open {
        tracing::warn!(outcome = "ran-unprotected", key = %settings.log_key(id), %error, "idempotency: store failed; running the request without protection (fail-open)");
        let mut request = request.map(B::keyed_request);
        prepare_for_inner(&settings, request.headers_mut());
        let mut response = inner.call(request).await?.map(B::ResponseOut::from);
        response.extensions_mut().insert(Outcome::RanUnprotected);
        return Ok(response);
    }
    tracing::error!(outcome = "store-unavailable", key = %settings.log_key(id), %error, "idempotency: store failed before the request ran");
    Ok(Rejection::store_unavailable(&settings).into_response::<B>(&settings))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Binding;

    fn record(binding: &str, state: RecordState) -> IdempotencyRecord {
        IdempotencyRecord {
            binding: Binding {
                method: "POST".into(),
                path: binding.into(),
                body_sha256: [0; 32],
            },
            state,
        }
    }

    #[test]
    fn a_record_bound_elsewhere_is_refused_whatever_its_state() {
        let mine = record(
            "/a",
            RecordState::InFlight {
                token: FencingToken(1),
                lease_lapsed: true,
            },
        )
        .binding;
        let other = record(
            "/b",
            RecordState::InFlight {
                token: FencingToken(1),
                lease_lapsed: true,
            },
        );
        assert_eq!(next_step(other, &mine), Step::KeyReused);
    }

    #[test]
    fn the_state_says_what_comes_next() {
        let binding = record(
            "/a",
            RecordState::InFlight {
                token: FencingToken(1),
                lease_lapsed: false,
            },
        )
        .binding;
        let live = record(
            "/a",
            RecordState::InFlight {
                token: FencingToken(1),
                lease_lapsed: false,
            },
        );
        assert_eq!(next_step(live, &binding), Step::Wait);
        let lapsed = record(
            "/a",
            RecordState::InFlight {
                token: FencingToken(7),
                lease_lapsed: true,
            },
        );
        assert_eq!(next_step(lapsed, &binding), Step::TakeOver(FencingToken(7)));
    }
}
