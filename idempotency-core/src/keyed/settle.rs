//! Stage 6, **finalize or release**: the verdict of stage 5 written to the store — the
//! answer stored for every retry, the key released so that a retry runs again, or "it
//! already ran" remembered for an answer that cannot be kept — and the caller's answer.
//! This is the one place that writes an owner's outcome to the store (a handler that
//! finalized in its own transaction already did: see `in_transaction.rs`).

use std::pin::Pin;
use std::time::Duration;

use http::{Response, StatusCode, response};
use tokio::time::Instant;

use crate::bodies::Bodies;
use crate::body::read_rest;
use crate::budget::Held;
use crate::in_transaction::ReservationHandle;
use crate::keyed::classify::{NotKept, Readable, Verdict, kept_headers, to_store};
use crate::metrics::MeasuredStore;
use crate::outcome::Outcome;
use crate::rejection::Rejection;
use crate::settings::Settings;
use crate::store::{BoxError, FencingToken, Ownership, RecordId, StoredResponse};

/// Writes the verdict to the store and builds the caller's answer, which carries its
/// [`Outcome`].
pub(crate) async fn settle<B: Bodies>(
    settings: &Settings,
    reservation: &ReservationHandle,
    parts: response::Parts,
    verdict: Verdict<B::Inner>,
    executed: Outcome,
    held: &mut Held,
) -> Response<B::Answer> {
    let (id, token) = (reservation.id(), reservation.token());
    let status = parts.status;
    let (outcome, body) = match verdict {
        Verdict::Store(bytes, trailers) => {
            let stored = to_store(
                settings,
                reservation.request(),
                &parts,
                &bytes,
                trailers.as_ref(),
            );
            let settled = finalize(settings, id, token, &stored).await;
            (
                settled.unless_unsettled(executed),
                Readable::Whole(bytes, trailers),
            )
        }
        Verdict::Release(body) => {
            let why = "the response releases the key";
            (release(settings, id, token, why).await, body)
        }
        Verdict::NotKept(why, body) => {
            let settled = remember_not_kept(settings, id, token, status, why).await;
            (settled.unless_unsettled(Outcome::ExecutedNotStored), body)
        }
        Verdict::Failed { release, error } => {
            return Box::pin(body_failed::<B>(
                settings, id, token, status, release, error,
            ))
            .await;
        }
    };
    let mut response = match deliver::<B>(settings, body, held).await {
        Some(answer) => Response::from_parts(parts, answer),
        None => {
            tracing::warn!(outcome = "response-failed", key = %settings.log_key(id), "idempotency: a response too large for the memory budget could not be delivered: its service's body type cannot be streamed on (wrap bodies to stream it)");
            Rejection::response_too_large_to_hold(status).into_response::<B>(settings)
        }
    };
    response.extensions_mut().insert(outcome);
    response
}

/// The caller's body: the whole answer, or what was read and the rest streamed on
/// unread; for a body type built from bytes alone, the rest read too while the budget
/// allows (`None` past it).
async fn deliver<B: Bodies>(
    settings: &Settings,
    body: Readable<B::Inner>,
    held: &mut Held,
) -> Option<B::Answer> {
    match body {
        Readable::Whole(bytes, trailers) => Some(B::made(bytes, trailers)),
        Readable::Over(read, rest) => match B::continued(read, rest) {
            Ok(streamed) => Some(streamed),
            // Boxed: a rare path, whose future should not make every owner's larger.
            Err((read, rest)) => {
                match Box::pin(read_rest(read, rest, &settings.memory, held)).await {
                    Ok(Some((bytes, trailers))) => Some(B::made(bytes, trailers)),
                    Ok(None) | Err(_) => None,
                }
            }
        },
    }
}

/// A response body that failed half way: the key released if its status releases it,
/// else "already ran" remembered; the caller told the body failed.
async fn body_failed<B: Bodies>(
    settings: &Settings,
    id: &RecordId,
    token: FencingToken,
    status: StatusCode,
    released: bool,
    error: BoxError,
) -> Response<B::Answer> {
    tracing::warn!(outcome = "response-failed", key = %settings.log_key(id), %error, "idempotency: the response body failed while it was read");
    let outcome = if released {
        release(settings, id, token, "the response body failed").await
    } else {
        let why = "its response failed before it could be stored";
        finalize_rejection(
            settings,
            id,
            token,
            Rejection::not_stored(settings, status, why),
        )
        .await
        .unless_unsettled(Outcome::ExecutedNotStored)
    };
    let mut response = Rejection::response_failed(status, released).into_response::<B>(settings);
    response.extensions_mut().insert(outcome);
    response
}

/// Records that the request ran, with the answer retries get instead of one that could
/// not be kept.
async fn remember_not_kept(
    settings: &Settings,
    id: &RecordId,
    token: FencingToken,
    status: StatusCode,
    why: NotKept,
) -> Settled {
    let why = match why {
        NotKept::TooLarge => {
            tracing::warn!(outcome = "not-stored", key = %settings.log_key(id), limit = settings.max_response_body, "idempotency: response too large to store (over the limit, or the memory budget); it streams on to its caller, and retries will be told it already ran");
            format!(
                "its response was larger than the {} bytes kept for replay",
                settings.max_response_body
            )
        }
        NotKept::Encoded => {
            tracing::warn!(outcome = "not-stored", key = %settings.log_key(id), "idempotency: the response is encoded although the layer asked for none; retries will be told it already ran (put compression outside the layer)");
            "its response was encoded (Content-Encoding), and encoded responses are not kept for replay".to_owned()
        }
    };
    finalize_rejection(
        settings,
        id,
        token,
        Rejection::not_stored(settings, status, &why),
    )
    .await
}

/// Stores a rendered rejection as the key's answer, for every retry to get.
///
/// Boxed: answers that are not stored are rare, and the owner's future (boxed and moved
/// on every first execution) should not carry room for this one.
fn finalize_rejection<'a>(
    settings: &'a Settings,
    id: &'a RecordId,
    token: FencingToken,
    rejection: Rejection,
) -> Pin<Box<dyn Future<Output = Settled> + Send + 'a>> {
    Box::pin(async move {
        let rendered = settings.render(&rejection);
        let stored = StoredResponse {
            status: rendered.status().as_u16(),
            headers: kept_headers(rendered.headers(), |_| true),
            body: rendered.into_body(),
            trailers: Vec::new(),
        };
        finalize(settings, id, token, &stored).await
    })
}

/// Whether the store took the owner's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settled {
    Yes,
    /// The store failed, or the key was no longer this request's.
    No,
}

impl Settled {
    /// `outcome` if the store took it, else [`Outcome::Unsettled`].
    fn unless_unsettled(self, outcome: Outcome) -> Outcome {
        match self {
            Self::Yes => outcome,
            Self::No => Outcome::Unsettled,
        }
    }
}

/// Releases the key `token` owns, saying `why` in the log: [`Outcome::Released`] if it
/// was released, [`Outcome::Unsettled`] if not.
pub(crate) async fn release(
    settings: &Settings,
    id: &RecordId,
    token: FencingToken,
    why: &str,
) -> Outcome {
    match MeasuredStore::of(settings).release(id, token).await {
        Ok(Ownership::Held) => {
            tracing::info!(outcome = "released", key = %settings.log_key(id), "idempotency: released the key: {why}");
            Outcome::Released
        }
        Ok(Ownership::Lost) => {
            tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(id), "idempotency: could not release a key it no longer owns ({why})");
            Outcome::Unsettled
        }
        Err(error) => {
            tracing::error!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: releasing the key failed; it stays reserved until its lease lapses ({why})");
            Outcome::Unsettled
        }
    }
}

/// Stores the answer, retrying a failing store with backoff for a bounded time. The
/// caller gets the real answer either way.
async fn finalize(
    settings: &Settings,
    id: &RecordId,
    token: FencingToken,
    stored: &StoredResponse,
) -> Settled {
    let store = MeasuredStore::of(settings);
    let give_up_at = Instant::now() + settings.finalize_retry_for;
    let mut pause = Duration::from_millis(25);
    loop {
        match store.finalize(id, token, stored).await {
            Ok(Ownership::Held) => {
                tracing::debug!(outcome = "finalized", key = %settings.log_key(id), status = stored.status, "idempotency: stored the response");
                return Settled::Yes;
            }
            Ok(Ownership::Lost) => {
                tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(id), "idempotency: the response was not stored: another request took over this key (this request's lease lapsed)");
                return Settled::No;
            }
            Err(error) if Instant::now() + pause < give_up_at => {
                tracing::warn!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: storing the response failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(error) => {
                tracing::error!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: storing the response failed; giving up, the record will be taken over when its lease lapses");
                return Settled::No;
            }
        }
    }
}
