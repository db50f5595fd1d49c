//! The key's owner, in request order: execute the inner service under a renewed lease,
//! [`classify`] the answer (a pure function), then [`settle`]: store or release the key,
//! in the one place that writes the outcome to the store, and answer the caller.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, HeaderValue, Request, Response, header, response};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use crate::body::{Answered, read_answer, read_rest};
use crate::budget::Held;
use crate::future::FinishOnDrop;
use crate::in_transaction::{self, ReservationHandle};
use crate::layer::Settings;
use crate::metrics::{self, StoreCall};
use crate::outcome::Outcome;
use crate::profile::Disposition;
use crate::rejection::Rejection;
use crate::service::{Answer, Bodies, IDEMPOTENCY_KEY, Inner};
use crate::store::{FencingToken, Ownership, RecordId, StoredResponse};

/// Runs the inner service as the key's owner. It runs in the caller's task, but finishes
/// (and records its answer) even when the caller drops the response future: the rest of
/// the work then moves to a task of its own.
///
/// Not an `async fn`: the reservation is made here, at once, and only the owner's work
/// is kept (boxed, in [`FinishOnDrop`]), not a second copy of the request inside the
/// caller's future.
pub(crate) fn run<S, B>(
    settings: Arc<Settings>,
    inner: S,
    request: Request<Bytes>,
    id: RecordId,
    token: FencingToken,
    outcome: Outcome,
    held: Held,
) -> FinishOnDrop<Answer<B, S::Error>>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    // The reservation handed to the inner service keeps the request for the profile's
    // `to_store` if it reads it (then the inner service gets a copy; otherwise the
    // request itself), and the record's id: the owner reads both from it rather than
    // keeping copies.
    let (kept, request) = if settings.profile.to_store_reads_request() {
        (Some(request), None)
    } else {
        (None, Some(request))
    };
    let reservation = ReservationHandle::new(settings.clone(), kept, id, token);
    let tracker = settings.in_flight.clone();
    // The request's bytes (and then its answer's) stay taken from the budget while it
    // runs, even after its caller went away.
    FinishOnDrop::new(
        &tracker,
        own::<S, B>(settings, inner, reservation, request, outcome, held),
    )
}

async fn own<S, B>(
    settings: Arc<Settings>,
    inner: S,
    reservation: ReservationHandle,
    request: Option<Request<Bytes>>,
    outcome: Outcome,
    mut held: Held,
) -> Answer<B, S::Error>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    let (id, token) = (reservation.id(), reservation.token());
    let executed = execute::<S, B>(&settings, inner, &reservation, request, &mut held).await;
    let (mut parts, body) = match executed {
        Ok(Ok(ran)) => ran,
        Ok(Err(error)) => {
            release(&settings, id, token, "the inner service returned an error").await;
            metrics::outcome(&settings, Outcome::Released);
            return Err(error);
        }
        Err(panic) => {
            release(&settings, id, token, "the inner service panicked").await;
            metrics::outcome(&settings, Outcome::Released);
            std::panic::resume_unwind(panic);
        }
    };
    if let Some(answer) =
        in_transaction::finalized_answer::<B>(&settings, id, token, &mut parts, &body, outcome)
    {
        return Ok(answer);
    }
    let verdict = classify(&settings, &parts, &body);
    Ok(settle::<B>(
        &settings,
        reservation.request(),
        id,
        token,
        verdict,
        parts,
        body,
        outcome,
        &mut held,
    )
    .await)
}

type Panic = Box<dyn std::any::Any + Send>;

/// Stage 4: runs the inner service on the request (with the reservation in its
/// extensions) and reads its answer, up to the limit and within the memory budget,
/// while the lease is renewed.
async fn execute<S, B>(
    settings: &Arc<Settings>,
    mut inner: S,
    reservation: &ReservationHandle,
    request: Option<Request<Bytes>>,
    held: &mut Held,
) -> Result<Result<(response::Parts, Answered<B::Inner>), S::Error>, Panic>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    // Built and pinned in place, and the request made inside it: the work is kept once in
    // this future, not moved into another one (a copy of every byte of it) or kept
    // beside a request that was already handed to the inner service.
    let work = std::pin::pin!(
        AssertUnwindSafe(async move {
            let request = match (request, reservation.request()) {
                (Some(request), _) => request,
                (None, Some(kept)) => Request::clone(kept),
                (None, None) => unreachable!("the request is either kept or handed over"),
            };
            let mut request = request.map(B::request);
            prepare_for_inner(settings, request.headers_mut());
            request.extensions_mut().insert(reservation.clone());
            let (parts, body) = inner.call(request).await?.into_parts();
            let budget = &settings.memory;
            Ok((
                parts,
                read_answer(body, settings.max_response_body, budget, held).await,
            ))
        })
        .catch_unwind()
    );
    hold_lease(settings, reservation.clone(), work).await
}

/// What happens to an answer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Store it and replay it to every retry.
    Store,
    /// Release the key, so that a retry runs again; the caller gets the answer.
    Release,
    /// The answer is too large to keep: retries are told the request already ran; the
    /// caller gets the answer.
    TooLargeToStore,
    /// The answer is encoded (`Content-Encoding`) although the layer asked for none: it
    /// cannot be inspected, nor replayed to a retry that may not accept the encoding, so
    /// retries are told the request already ran; the caller gets the answer.
    Encoded,
    /// The answer's body failed and its status releases the key: release it; the caller
    /// is told the body failed.
    FailedReleased,
    /// The answer's body failed after a status that keeps the key: the mutation most
    /// likely happened, so retries are told it already ran; so is the caller.
    FailedKept,
}

/// Stage 5: what happens to an answer, by the generic rules (5xx and the release
/// statuses release) and then the profile's.
pub(crate) fn classify<I>(
    settings: &Settings,
    parts: &response::Parts,
    body: &Answered<I>,
) -> Verdict {
    let status = parts.status;
    let releases = status.is_server_error() || settings.release_statuses.contains(&status);
    let trailers = match body {
        Answered::Failed(_) if releases => return Verdict::FailedReleased,
        Answered::Failed(_) => return Verdict::FailedKept,
        _ if releases => return Verdict::Release,
        Answered::Whole(_, trailers) => trailers.as_ref(),
        // Its trailers are still to come.
        Answered::Over(..) => None,
    };
    match (settings.profile.classify(parts, trailers), body) {
        (Disposition::Release, _) => Verdict::Release,
        (_, Answered::Over(..)) => Verdict::TooLargeToStore,
        _ if is_encoded(&parts.headers) => Verdict::Encoded,
        _ => Verdict::Store,
    }
}

/// Stage 6: writes the verdict to the store and builds the caller's answer.
#[allow(clippy::too_many_arguments)]
async fn settle<B: Bodies>(
    settings: &Settings,
    request: Option<&Request<Bytes>>,
    id: &RecordId,
    token: FencingToken,
    verdict: Verdict,
    parts: response::Parts,
    body: Answered<B::Inner>,
    executed: Outcome,
    held: &mut Held,
) -> Response<B::Answer> {
    let status = parts.status;
    let (body, trailers, rest) = match body {
        Answered::Whole(bytes, trailers) => (bytes, trailers, None),
        Answered::Over(read, rest) => (read, None, Some(rest)),
        Answered::Failed(error) => {
            tracing::warn!(outcome = "response-failed", key = %settings.log_key(id), %error, "idempotency: the response body failed while it was read");
            let released = verdict == Verdict::FailedReleased;
            let outcome = if released {
                release(settings, id, token, "the response body failed").await;
                Outcome::Released
            } else {
                let why = "its response failed before it could be stored";
                finalize_rejection(
                    settings,
                    id,
                    token,
                    Rejection::not_stored(settings, status, why),
                )
                .await;
                Outcome::ExecutedNotStored
            };
            let mut response =
                Rejection::response_failed(status, released).into_response::<B>(settings);
            metrics::outcome(settings, outcome);
            response.extensions_mut().insert(outcome);
            return response;
        }
    };
    let outcome = match verdict {
        Verdict::Store => {
            let stored = to_store(
                settings,
                request,
                stored_response(settings, &parts, &body, trailers.as_ref()),
            );
            finalize(settings, id, token, &stored).await;
            executed
        }
        Verdict::Release => {
            release(settings, id, token, "the response releases the key").await;
            Outcome::Released
        }
        Verdict::TooLargeToStore => {
            tracing::warn!(outcome = "not-stored", key = %settings.log_key(id), limit = settings.max_response_body, "idempotency: response too large to store (over the limit, or the memory budget); it streams on to its caller, and retries will be told it already ran");
            let why = format!(
                "its response was larger than the {} bytes kept for replay",
                settings.max_response_body
            );
            finalize_rejection(
                settings,
                id,
                token,
                Rejection::not_stored(settings, status, &why),
            )
            .await;
            Outcome::ExecutedNotStored
        }
        Verdict::Encoded => {
            tracing::warn!(outcome = "not-stored", key = %settings.log_key(id), "idempotency: the response is encoded although the layer asked for none; retries will be told it already ran (put compression outside the layer)");
            let why = "its response was encoded (Content-Encoding), and encoded responses are not kept for replay";
            finalize_rejection(
                settings,
                id,
                token,
                Rejection::not_stored(settings, status, why),
            )
            .await;
            Outcome::ExecutedNotStored
        }
        Verdict::FailedReleased | Verdict::FailedKept => {
            unreachable!("a failed body was answered above")
        }
    };
    let answer = match rest {
        None => B::made(body, trailers),
        // Too large to hold: what was read, then the rest, streamed on unread; or, for a
        // body type built from bytes alone, the rest read too, while the budget allows.
        Some(rest) => match B::continued(body, rest) {
            Ok(streamed) => streamed,
            // Boxed for the same reason as `finalize_rejection`: a rare path.
            Err((read, rest)) => {
                match Box::pin(read_rest(read, rest, &settings.memory, held)).await {
                    Ok(Some((bytes, trailers))) => B::made(bytes, trailers),
                    Ok(None) | Err(_) => {
                        tracing::warn!(outcome = "response-failed", key = %settings.log_key(id), "idempotency: a response too large for the memory budget could not be delivered: its service's body type cannot be streamed on (wrap bodies to stream it)");
                        let mut response = Rejection::response_too_large_to_hold(status)
                            .into_response::<B>(settings);
                        metrics::outcome(settings, outcome);
                        response.extensions_mut().insert(outcome);
                        return response;
                    }
                }
            }
        },
    };
    let mut response = Response::from_parts(parts, answer);
    metrics::outcome(settings, outcome);
    response.extensions_mut().insert(outcome);
    response
}

/// The headers a keyed request reaches the inner service with: asking for an unencoded
/// answer, and without the key unless the layer forwards it.
pub(crate) fn prepare_for_inner(settings: &Settings, headers: &mut HeaderMap) {
    ask_for_identity(headers);
    if !settings.forward_key {
        headers.remove(IDEMPOTENCY_KEY);
    }
}

/// Asks the inner service for an answer the layer can store, inspect and replay to any
/// retry: one without a content encoding.
pub(crate) fn ask_for_identity(headers: &mut HeaderMap) {
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
}

/// Whether an answer carries a content encoding other than `identity`.
fn is_encoded(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|value| {
            !value
                .as_bytes()
                .trim_ascii()
                .eq_ignore_ascii_case(b"identity")
        })
}

/// What the profile keeps of an answer, given the keyed request if it was kept for it
/// (and an empty one otherwise, as [`Profile::to_store_reads_request`] says).
///
/// [`Profile::to_store_reads_request`]: crate::Profile::to_store_reads_request
pub(crate) fn to_store(
    settings: &Settings,
    request: Option<&Request<Bytes>>,
    answer: StoredResponse,
) -> StoredResponse {
    match request {
        Some(request) => settings.profile.to_store(request, answer),
        None => settings
            .profile
            .to_store(&Request::new(Bytes::new()), answer),
    }
}

/// The answer as the generic rules keep it: status, the replayed headers, the body, and
/// every trailer.
pub(crate) fn stored_response(
    settings: &Settings,
    parts: &response::Parts,
    body: &Bytes,
    trailers: Option<&HeaderMap>,
) -> StoredResponse {
    StoredResponse {
        status: parts.status.as_u16(),
        headers: kept_headers(&parts.headers, |name| {
            settings.replayed_headers.contains(name)
        }),
        body: body.clone(),
        trailers: trailers.map_or_else(Vec::new, |trailers| kept_headers(trailers, |_| true)),
    }
}

fn kept_headers(
    headers: &HeaderMap,
    keep: impl Fn(&http::HeaderName) -> bool,
) -> Vec<(String, Bytes)> {
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

/// Stores a rendered rejection as the key's answer, for every retry to get.
///
/// Boxed: answers that are not stored are rare, and the owner's future (boxed and moved
/// on every first execution) should not carry room for this one.
fn finalize_rejection<'a>(
    settings: &'a Settings,
    id: &'a RecordId,
    token: FencingToken,
    rejection: Rejection,
) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
    Box::pin(async move {
        let rendered = settings.render(&rejection);
        let stored = StoredResponse {
            status: rendered.status().as_u16(),
            headers: kept_headers(rendered.headers(), |_| true),
            body: rendered.into_body(),
            trailers: Vec::new(),
        };
        finalize(settings, id, token, &stored).await;
    })
}

/// Drives `work` while its lease is renewed every third of the lease's length.
///
/// The renewal runs on a task of its own, so the lease is kept even while nobody polls
/// `work` (a caller may hold the response future for a while without polling it). It
/// starts only if `work` does not finish on its first poll, and stops when `work` ends or
/// is dropped. Losing the lease does not stop the work: the request is already running,
/// and the store's fencing keeps the stale owner from overwriting the new one.
async fn hold_lease<F: Future>(
    settings: &Arc<Settings>,
    reservation: ReservationHandle,
    mut work: Pin<&mut F>,
) -> F::Output {
    let first_poll = std::future::poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx))).await;
    if let Poll::Ready(output) = first_poll {
        return output;
    }
    let _renewing =
        AbortOnDropHandle::new(tokio::spawn(renew_lease(settings.clone(), reservation)));
    work.await
}

async fn renew_lease(settings: Arc<Settings>, reservation: ReservationHandle) {
    let (id, token) = (reservation.id(), reservation.token());
    let lease = settings.lease();
    let give_up_at = settings.max_run_time.map(|max| Instant::now() + max);
    loop {
        tokio::time::sleep(lease / 3).await;
        // The handler wrote the answer in its transaction: the record settles when it
        // commits, and a renewal would only wait for the transaction's row lock.
        if reservation.finalized_in_transaction() {
            return;
        }
        if give_up_at.is_some_and(|at| Instant::now() >= at) {
            tracing::warn!(outcome = "over-max-run-time", key = %settings.log_key(id), "idempotency: the request ran longer than the maximum run time; its lease is no longer renewed, so a retry may take the key over once it lapses");
            return;
        }
        match metrics::store_call(
            &settings,
            StoreCall::Renew,
            settings.store.renew(id, token, lease),
        )
        .await
        {
            Ok(Ownership::Held) => {}
            // A renewal that waited for the handler's transaction finds the record
            // finalized by it.
            Ok(Ownership::Lost) if reservation.finalized_in_transaction() => return,
            Ok(Ownership::Lost) => {
                tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(id), "idempotency: lost the reservation while the request ran (lease lapsed and taken over, or expired)");
                return;
            }
            Err(error) => {
                tracing::warn!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: renewing the lease failed; will retry")
            }
        }
    }
}

async fn release(settings: &Settings, id: &RecordId, token: FencingToken, why: &str) {
    match metrics::store_call(
        settings,
        StoreCall::Release,
        settings.store.release(id, token),
    )
    .await
    {
        Ok(Ownership::Held) => {
            tracing::info!(outcome = "released", key = %settings.log_key(id), "idempotency: released the key: {why}")
        }
        Ok(Ownership::Lost) => {
            tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(id), "idempotency: could not release a key it no longer owns ({why})")
        }
        Err(error) => {
            tracing::error!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: releasing the key failed; it stays reserved until its lease lapses ({why})")
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
) {
    let give_up_at = Instant::now() + settings.finalize_retry_for;
    let mut pause = Duration::from_millis(25);
    loop {
        let finalized = metrics::store_call(
            settings,
            StoreCall::Finalize,
            settings.store.finalize(id, token, stored),
        )
        .await;
        match finalized {
            Ok(Ownership::Held) => {
                tracing::debug!(outcome = "finalized", key = %settings.log_key(id), status = stored.status, "idempotency: stored the response");
                return;
            }
            Ok(Ownership::Lost) => {
                tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(id), "idempotency: the response was not stored: another request took over this key (this request's lease lapsed)");
                return;
            }
            Err(error) if Instant::now() + pause < give_up_at => {
                tracing::warn!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: storing the response failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(error) => {
                tracing::error!(outcome = "store-error", key = %settings.log_key(id), %error, "idempotency: storing the response failed; giving up, the record will be taken over when its lease lapses");
                return;
            }
        }
    }
}
