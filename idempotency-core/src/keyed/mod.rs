//! The life of a keyed request, in order. Each stage is a file of its own, named for what
//! it does, with the number the crate docs give it:
//!
//! 1. [`parse`]: does the request take part, with which key, and whose key is it.
//! 2. [`bind`]: read the body whole and bind the record to the request.
//! 3. [`reserve`]: own the key, or wait for its owner, take a dead owner's place, find its
//!    answer, or find it bound to another request. (The store failing here is
//!    [`store_down`].)
//! 4. [`execute`]: the owner runs the inner service under a renewed lease.
//! 5. [`classify`]: what happens to the answer.
//! 6. [`settle`]: finalize or release — the verdict written to the store (unless the
//!    handler already finalized in its own transaction), and the caller's answer.
//! 7. [`replay`]: a retry of a finished request gets the stored answer.
//!
//! Stage 1 runs in `Idempotency::call`, before anything is awaited. [`handle`] runs
//! stages 2, 3 and 7 in the caller's task; [`run`] runs 4 to 6 as the key's owner, and
//! finishes them even if the caller goes away.

pub(crate) mod bind;
pub(crate) mod classify;
pub(crate) mod execute;
pub(crate) mod parse;
pub(crate) mod replay;
pub(crate) mod reserve;
pub(crate) mod settle;
pub(crate) mod store_down;

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};

use crate::bodies::{Answer, Bodies, Inner};
use crate::budget::Held;
use crate::future::FinishOnDrop;
use crate::in_transaction::{self, ReservationHandle};
use crate::metrics;
use crate::outcome::Outcome;
use crate::settings::Settings;
use crate::store::{FencingToken, RecordId};

use self::reserve::Reserved;

/// Stages 2, 3 and 7 of a request with a key, and the owner's stages 4 to 6.
pub(crate) async fn handle<S, B>(
    settings: Arc<Settings>,
    inner: S,
    request: Request<B::In>,
    id: RecordId,
) -> Answer<B, S::Error>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    // 2. Bind. The request's bytes stay taken from the memory budget until it is answered.
    let (parts, body) = request.into_parts();
    let mut held = Held::default();
    let body = match bind::read_body(&settings, &parts.headers, body, &mut held).await {
        Ok(body) => body,
        Err(rejection) => {
            tracing::info!(outcome = rejection.kind.as_str(), key = %settings.log_key(&id), "idempotency: refused the request body: {}", rejection.message);
            return Ok(answered(&settings, rejection.into_response::<B>(&settings)));
        }
    };
    let request = Request::from_parts(parts, body);
    let binding = bind::bind(&request);

    // 3. Reserve, then 4–6 as the owner, or 7.
    match reserve::reserve(&settings, &id, &binding).await {
        Reserved::Owner {
            token,
            leased,
            outcome,
        } => run::<S, B>(settings, inner, request, id, (token, leased), outcome, held).await,
        Reserved::Replay(stored) => {
            let replayed = replay::replay::<S, B>(&settings, inner, &request, stored).await;
            Ok(answered(&settings, replayed))
        }
        Reserved::Refused(rejection) => {
            Ok(answered(&settings, rejection.into_response::<B>(&settings)))
        }
        Reserved::StoreFailed(error) => {
            let answer = Box::pin(store_down::store_failed::<S, B>(
                settings.clone(),
                inner,
                request,
                &id,
                &error,
            ))
            .await?;
            Ok(answered(&settings, answer))
        }
    }
}

/// Runs stages 4 to 6 as the key's owner. It runs in the caller's task, but finishes
/// (and records its answer) even when the caller drops the response future: the rest of
/// the work then moves to a task of its own.
///
/// Not an `async fn`: the reservation is made here, at once, and only the owner's work
/// is kept (boxed, in [`FinishOnDrop`]), not a second copy of the request inside the
/// caller's future.
fn run<S, B>(
    settings: Arc<Settings>,
    inner: S,
    request: Request<Bytes>,
    id: RecordId,
    (token, leased): (FencingToken, bool),
    outcome: Outcome,
    held: Held,
) -> FinishOnDrop<Answer<B, S::Error>>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    // The reservation handed to the inner service keeps a copy of the request for the
    // profile's `to_store`, when that reads it; the owner reads the record's id from it
    // rather than keeping a copy.
    let kept = settings
        .profile
        .to_store_reads_request()
        .then(|| request.clone());
    let reservation = ReservationHandle::new(settings.clone(), kept, id, token, leased);
    let tracker = settings.in_flight.clone();
    // The request's bytes (and then its answer's) stay taken from the budget while it
    // runs, even after its caller went away.
    FinishOnDrop::new(
        &tracker,
        own::<S, B>(settings, inner, reservation, request, outcome, held),
    )
}

/// Stages 4, 5 and 6, in order.
async fn own<S, B>(
    settings: Arc<Settings>,
    inner: S,
    reservation: ReservationHandle,
    request: Request<Bytes>,
    executed: Outcome,
    mut held: Held,
) -> Answer<B, S::Error>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    // 4. Execute.
    let ran = execute::execute::<S, B>(&settings, inner, &reservation, request, &mut held).await;
    let (mut parts, body) = match ran {
        Ok(Ok(answer)) => answer,
        Ok(Err(error)) => {
            let why = "the inner service returned an error";
            let outcome = settle::release(&settings, reservation.id(), reservation.token(), why);
            metrics::outcome(&settings, outcome.await);
            return Err(error);
        }
        Err(panic) => {
            let why = "the inner service panicked";
            let outcome = settle::release(&settings, reservation.id(), reservation.token(), why);
            metrics::outcome(&settings, outcome.await);
            std::panic::resume_unwind(panic);
        }
    };
    // 6, done by the handler: it finalized the record in its own transaction.
    if let Some(finalized) =
        in_transaction::finalized_answer::<B>(&settings, &reservation, &mut parts, &body, executed)
    {
        return Ok(answered(&settings, finalized));
    }
    // 5. Classify.
    let verdict = classify::classify(&settings, &parts, body);
    // 6. Finalize or release.
    let answer =
        settle::settle::<B>(&settings, &reservation, parts, verdict, executed, &mut held).await;
    Ok(answered(&settings, answer))
}

/// The caller's answer, its [`Outcome`] recorded (in the request's span and as a metric).
fn answered<B>(settings: &Settings, response: Response<B>) -> Response<B> {
    if let Some(outcome) = response.extensions().get::<Outcome>() {
        metrics::outcome(settings, *outcome);
    }
    response
}
