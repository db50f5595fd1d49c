//! Stage 6, **settle**: the verdict of stage 5 written to the store — the answer stored
//! for every retry, the key held reserved when the change's outcome is unknown, the key released so that a retry runs again, or "it already ran"
//! remembered for an answer that cannot be kept; nothing, when the handler finalized in
//! its own transaction — and the caller's answer. This is the one place that writes an
//! owner's outcome to the store, and [`stored_answer`] says what of an answer is stored.

use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Response, StatusCode, header, response};
use tokio::time::Instant;

use crate::body_types::{Answer, Bodies};
use crate::budget::Held;
use crate::keyed::classify::{Decided, NotKept, Then, Unsent};
use crate::keyed::store::RequestPathStore;
use crate::metrics;
use crate::outcome::Outcome;
use crate::read::{BodyRead, Reader};
use crate::rejection::Rejection;
use crate::reservation::{FinalizedInTransaction, ReservationHandle};
use crate::settings::Settings;
use crate::store::{FencingToken, Ownership, RecordId, StoredResponse};

/// Writes the decision to the store and gives the caller its answer, which carries its
/// [`Outcome`]; `first_run` is the outcome of a request that ran and was stored
/// ([`Outcome::Executed`], or [`Outcome::TookOver`]). The inner service's error is
/// returned, and its panic resumed, once the key is released.
pub(crate) async fn settle<B: Bodies, E>(
    settings: &Settings,
    reservation: &ReservationHandle,
    decided: Decided<B::ResponseIn, E>,
    first_run: Outcome,
    held: &mut Held,
) -> Answer<B, E> {
    let (id, token) = (reservation.id(), reservation.token());
    let (parts, then, unsent, body) = match decided {
        Decided::Error(error) => {
            let outcome = release(settings, id, token, "the inner service returned an error").await;
            metrics::outcome(
                settings,
                end_unsettled(settings, reservation, outcome).await,
            );
            return Err(error);
        }
        Decided::Panic(panic) => {
            let outcome = release(settings, id, token, "the inner service panicked").await;
            metrics::outcome(
                settings,
                end_unsettled(settings, reservation, outcome).await,
            );
            std::panic::resume_unwind(panic);
        }
        Decided::FinalizedByHandler { parts, read, mark } => {
            return Ok(finalized_by_handler::<B>(
                settings, parts, &read, *mark, first_run,
            ));
        }
        Decided::BodyFailed {
            status,
            release,
            read,
        } => {
            let mut response =
                Box::pin(body_failed::<B>(settings, id, token, status, release, read)).await;
            if let Some(outcome) = response.extensions().get::<Outcome>().copied() {
                let outcome = end_unsettled(settings, reservation, outcome).await;
                response.extensions_mut().insert(outcome);
            }
            return Ok(response);
        }
        Decided::Store {
            parts,
            bytes,
            trailers,
        } => {
            let stored = stored_answer(settings, reservation, &parts, &bytes, trailers.as_ref());
            let outcome = finalize(settings, id, token, &stored)
                .await
                .unless_unsettled(first_run);
            let outcome = end_unsettled(settings, reservation, outcome).await;
            let mut response = Response::from_parts(parts, B::made(bytes, trailers));
            response.extensions_mut().insert(outcome);
            return Ok(recorded(settings, response));
        }
        Decided::PassOn {
            parts,
            then,
            unsent,
            body,
        } => (parts, then, unsent, body),
    };
    let status = parts.status;
    let outcome = match then {
        Then::KeepReserved => keep_reserved(settings, id, token, status).await,
        Then::Release(why) => release(settings, id, token, why).await,
        Then::NotKept(why) => remember_not_kept(settings, id, token, status, why)
            .await
            .unless_unsettled(Outcome::ExecutedNotStored),
    };
    let outcome = end_unsettled(settings, reservation, outcome).await;
    let mut response = match deliver::<B>(settings, unsent, body, held).await {
        Some(answer) => Response::from_parts(parts, answer),
        None => {
            tracing::warn!(outcome = "response-failed", key = %settings.log_key(id), "idempotency: a response too large for the memory budget could not be delivered: its service's body type cannot be streamed on (wrap bodies to stream it)");
            Rejection::response_too_large_to_hold(status).into_response::<B>(settings)
        }
    };
    response.extensions_mut().insert(outcome);
    Ok(recorded(settings, response))
}

/// The caller's answer, its [`Outcome`] recorded (in the request's span and as a
/// metric).
pub(crate) fn recorded<B>(settings: &Settings, response: Response<B>) -> Response<B> {
    if let Some(outcome) = response.extensions().get::<Outcome>() {
        metrics::outcome(settings, *outcome);
    }
    response
}

/// The caller's body: the whole answer, or what was read and the rest streamed on
/// unread; for a body type built from bytes alone, the rest read too while the budget
/// allows (`None` past it).
async fn deliver<B: Bodies>(
    settings: &Settings,
    unsent: Unsent,
    body: Pin<Box<B::ResponseIn>>,
    held: &mut Held,
) -> Option<B::ResponseOut> {
    let (read, taken) = match unsent {
        Unsent::Whole(bytes, trailers) => return Some(B::made(bytes, trailers)),
        Unsent::Over { read, taken } => (read, taken),
    };
    let (read, mut body) = match B::continued(read, body) {
        Ok(streamed) => return Some(streamed),
        Err(parts) => parts,
    };
    // Boxed: a rare path, whose future should not make every owner's larger.
    let rest = Reader::whole()
        .within(&settings.memory, held, taken)
        .read(body.as_mut(), read);
    match Box::pin(rest).await {
        BodyRead::Whole(bytes, trailers) => Some(B::made(bytes, trailers)),
        _ => None,
    }
}

/// The answer a handler finalized in its own transaction, exactly as it was prepared
/// (the record holds it), whatever happened to the response on its way out.
fn finalized_by_handler<B: Bodies>(
    settings: &Settings,
    mut parts: response::Parts,
    read: &BodyRead,
    mark: FinalizedInTransaction,
    outcome: Outcome,
) -> Response<B::ResponseOut> {
    let id = mark.reservation.id();
    let unchanged = mark.status == parts.status
        && same_apart_from_framing(&mark.headers, &parts.headers)
        && matches!(read, BodyRead::Whole(bytes, _) if *bytes == mark.body);
    if unchanged {
        tracing::debug!(outcome = "finalized", key = %settings.log_key(id), status = mark.status.as_u16(), "idempotency: the handler stored the response in its own transaction");
    } else {
        tracing::warn!(outcome = "finalized", key = %settings.log_key(id), "idempotency: the response changed after the handler finalized it in its transaction; sending the finalized answer, which is what retries get");
    }
    parts.status = mark.status;
    parts.version = mark.version;
    parts.headers = mark.headers;
    parts.extensions.insert(outcome);
    recorded(
        settings,
        Response::from_parts(parts, B::made(mark.body, mark.trailers)),
    )
}

/// Whether two header maps hold the same fields, `Content-Length` aside: a router on the
/// way out adds it from the body's size (axum does), which changes nothing of the answer.
fn same_apart_from_framing(a: &HeaderMap, b: &HeaderMap) -> bool {
    let fields = |map: &HeaderMap| {
        map.keys()
            .filter(|name| **name != header::CONTENT_LENGTH)
            .count()
    };
    fields(a) == fields(b)
        && a.keys()
            .filter(|name| **name != header::CONTENT_LENGTH)
            .all(|name| a.get_all(name).iter().eq(b.get_all(name).iter()))
}

/// What is stored of a kept answer: status, the replayed headers, the body and every
/// trailer, then what the layer's [`KeepAnswer`](crate::KeepAnswer) keeps of that.
pub(crate) fn stored_answer(
    settings: &Settings,
    reservation: &ReservationHandle,
    parts: &response::Parts,
    body: &Bytes,
    trailers: Option<&HeaderMap>,
) -> StoredResponse {
    let answer = StoredResponse {
        status: parts.status.as_u16(),
        headers: kept_headers(&parts.headers, |name| {
            settings.replayed_headers.contains(name)
        }),
        body: body.clone(),
        trailers: trailers.map_or_else(Vec::new, |trailers| kept_headers(trailers, |_| true)),
    };
    let (method, uri) = reservation.request_line();
    settings.keeper.keep(method, uri, answer)
}

/// The header fields `keep` keeps, as a store holds them.
fn kept_headers(headers: &HeaderMap, keep: impl Fn(&HeaderName) -> bool) -> Vec<(String, Bytes)> {
    headers
        .iter()
        .filter(|(name, _)| keep(name))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}

/// A response body that failed half way: the key released if its status releases it,
/// else "already ran" remembered; the caller told the body failed.
async fn body_failed<B: Bodies>(
    settings: &Settings,
    id: &RecordId,
    token: FencingToken,
    status: StatusCode,
    released: bool,
    read: BodyRead,
) -> Response<B::ResponseOut> {
    if let BodyRead::Failed(error) = &read {
        tracing::warn!(outcome = "response-failed", key = %settings.log_key(id), %error, "idempotency: the response body failed while it was read");
    }
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
    recorded(settings, response)
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
enum Settled {
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
async fn release(settings: &Settings, id: &RecordId, token: FencingToken, why: &str) -> Outcome {
    let store = RequestPathStore::of(settings);
    match retried(settings, id, "releasing the key", || {
        store.release(id, token)
    })
    .await
    {
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

/// Holds the key reserved for as long as a record is kept, its answer neither stored
/// nor released: [`Outcome::Unknown`] if the store took it, [`Outcome::Unsettled`] if not.
async fn keep_reserved(
    settings: &Settings,
    id: &RecordId,
    token: FencingToken,
    status: StatusCode,
) -> Outcome {
    let store = RequestPathStore::of(settings);
    match retried(settings, id, "keeping the key reserved", || {
        store.hold(id, token)
    })
    .await
    {
        Ok(Ownership::Held) => {
            tracing::warn!(outcome = "unknown", key = %settings.log_key(id), status = status.as_u16(), "idempotency: the handler does not know whether its change took effect; the key stays reserved until it expires, so that no retry runs the change again");
            Outcome::Unknown
        }
        Ok(Ownership::Lost) => {
            tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(id), "idempotency: could not keep a key it no longer owns reserved (its change's outcome is unknown)");
            Outcome::Unsettled
        }
        Err(error) => {
            tracing::error!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: keeping the key reserved failed (its change's outcome is unknown); it stays reserved until its lease lapses");
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
    let store = RequestPathStore::of(settings);
    match retried(settings, id, "storing the response", || {
        store.finalize(id, token, stored)
    })
    .await
    {
        Ok(Ownership::Held) => {
            tracing::debug!(outcome = "finalized", key = %settings.log_key(id), status = stored.status, "idempotency: stored the response");
            Settled::Yes
        }
        Ok(Ownership::Lost) => {
            tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(id), "idempotency: the response was not stored: another request took over this key (this request's lease lapsed)");
            Settled::No
        }
        Err(error) => {
            tracing::error!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: storing the response failed; giving up, the record will be taken over when its lease lapses");
            Settled::No
        }
    }
}

/// Calls the store until it answers, retrying its errors with backoff for a bounded time
/// (`finalize_retry_for`): an owner's last word on its key is worth a few tries.
async fn retried<F, Fut>(
    settings: &Settings,
    id: &RecordId,
    what: &str,
    mut call: F,
) -> Result<Ownership, crate::store::StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Ownership, crate::store::StoreError>>,
{
    let give_up_at = Instant::now() + settings.finalize_retry_for;
    let mut pause = Duration::from_millis(25);
    loop {
        match call().await {
            Err(error) if Instant::now() + pause < give_up_at => {
                tracing::warn!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: {what} failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            answer => return answer,
        }
    }
}

/// A reservation whose outcome the store did not take is released, so that nothing it
/// holds outlives the request: a reservation held unseen (a transaction, a lock, a pooled
/// connection) has no lease that would lapse, and the layer cannot tell one kind from the
/// other. That is the lesser harm, the one a lapsing lease would have allowed anyway,
/// only later: a retry may run the request again.
async fn end_unsettled(
    settings: &Settings,
    reservation: &ReservationHandle,
    outcome: Outcome,
) -> Outcome {
    if outcome != Outcome::Unsettled {
        return outcome;
    }
    let (id, token) = (reservation.id(), reservation.token());
    release(
        settings,
        id,
        token,
        "a reservation whose outcome the store did not take",
    )
    .await;
    outcome
}
