//! The life of a keyed request, as a state machine read top to bottom. Each stage is a
//! file of its own, with the number and the name the crate docs give it, and takes and
//! returns plain values:
//!
//! 1. [`parse`]: does the request take part, with which key, and whose key is it
//!    (called by the service, before anything is awaited).
//! 2. [`bind`]: read the body whole and bind the record to the request.
//! 3. [`reserve`]: own the key, or wait for its owner, take a dead owner's place, find
//!    its answer, or find it bound to another request (or the store failing).
//! 4. [`execute`]: the owner runs the inner service under a renewed lease.
//! 5. [`classify`]: what happens to what the inner service did.
//! 6. [`settle`]: the verdict written to the store (finalize or release; nothing when the
//!    handler finalized in its own transaction), and the caller's answer.
//! 7. [`replay`]: a retry of a finished request gets the stored answer.
//!
//! [`respond`] runs stages 2, 3 and 7 in the caller's task, and stages 4 to 6 as the
//! key's owner ([`own`]), which finishes them even if the caller goes away. Every store
//! call goes through [`store`], the seam that adds the layer's lease and lifetime and
//! times each call.

pub(crate) mod bind;
pub(crate) mod classify;
pub(crate) mod execute;
pub(crate) mod parse;
pub(crate) mod replay;
pub(crate) mod reserve;
pub(crate) mod settle;
pub(crate) mod store;

use std::sync::Arc;

use bytes::Bytes;
use http::Request;

use crate::body_types::{Answer, Bodies, InnerService};
use crate::budget::Held;
use crate::future::FinishOnDrop;
use crate::outcome::Outcome;
use crate::payload_key::FoundKey;
use crate::reservation::ReservationHandle;
use crate::settings::Settings;
use crate::store::{FencingToken, RecordId};

use self::parse::KeyedBy;
use self::reserve::Next;
use self::settle::recorded;

/// Stages 2 to 7 of a request with a key: what its caller gets.
pub(crate) async fn respond<S, B>(
    settings: Arc<Settings>,
    inner: S,
    request: Request<B::RequestIn>,
    keyed_by: KeyedBy,
) -> Answer<B, S::Error>
where
    S: InnerService<B::RequestOut, B::ResponseIn>,
    B: Bodies,
{
    // 2. Bind. The request's bytes stay taken from the memory budget until it is answered.
    let (parts, body) = request.into_parts();
    let mut held = Held::default();
    let body = match bind::read_body(&settings, &parts.headers, body, &mut held).await {
        Ok(body) => body,
        Err(rejection) => {
            tracing::info!(
                outcome = rejection.kind.as_str(),
                "idempotency: refused the request body: {}",
                rejection.message
            );
            return Ok(recorded(&settings, rejection.into_response::<B>(&settings)));
        }
    };
    let request = Request::from_parts(parts, body);
    // A key in the body is known now (1. Parse, finished).
    let (id, fingerprint) = match keyed_by {
        KeyedBy::Header(id) => (id, None),
        KeyedBy::Payload { scope } => match parse::key_in_body(&settings, &request) {
            Ok(Some(FoundKey { key, fingerprint })) => {
                let id = RecordId::new(scope, key);
                tracing::Span::current()
                    .record("key", tracing::field::display(settings.log_key(&id)));
                (id, fingerprint)
            }
            // No key in the body, and none required: it runs unprotected, as a request
            // without a key header does.
            Ok(None) => {
                let mut inner = inner;
                let request = request.map(B::keyed_request);
                return Ok(inner.call(request).await?.map(B::ResponseOut::from));
            }
            Err(rejection) => {
                tracing::info!(
                    outcome = rejection.kind.as_str(),
                    "idempotency: refused the key in the body: {}",
                    rejection.message
                );
                return Ok(recorded(&settings, rejection.into_response::<B>(&settings)));
            }
        },
    };
    let binding = bind::binding(&request, fingerprint.as_deref());
    // 3. Reserve.
    match reserve::reserve(&settings, &id, &binding).await {
        // 4 to 6.
        Next::Run { token, outcome } => {
            own::<S, B>(settings, inner, request, id, token, outcome, held).await
        }
        // 7. Replay.
        Next::Replay(stored) => {
            let replayed = replay::replay::<S, B>(&settings, inner, &request, stored).await;
            Ok(recorded(&settings, replayed))
        }
        Next::Refuse(rejection) => Ok(recorded(&settings, rejection.into_response::<B>(&settings))),
        Next::StoreFailed(error) => {
            let answer = Box::pin(reserve::store_failed::<S, B>(
                settings.clone(),
                inner,
                request,
                &id,
                &error,
            ))
            .await?;
            Ok(recorded(&settings, answer))
        }
    }
}

/// Stages 4 to 6, as the key's owner. They run in the caller's task, but finish (and
/// record their answer) even when the caller drops the response future: the rest of the
/// work then moves to a task of its own.
///
/// Not an `async fn`: the reservation is made here, at once, and only the owner's work
/// is kept (boxed, in [`FinishOnDrop`]), not a second copy of the request inside the
/// caller's future.
fn own<S, B>(
    settings: Arc<Settings>,
    inner: S,
    request: Request<Bytes>,
    id: RecordId,
    token: FencingToken,
    first_run: Outcome,
    mut held: Held,
) -> FinishOnDrop<Answer<B, S::Error>>
where
    S: InnerService<B::RequestOut, B::ResponseIn>,
    B: Bodies,
{
    let request_line = (request.method().clone(), request.uri().clone());
    let reservation = ReservationHandle::new(settings.clone(), request_line, id, token);
    let tracker = settings.in_flight.clone();
    // The request's bytes (and then its answer's) stay taken from the budget while it
    // runs, even after its caller went away.
    FinishOnDrop::new(&tracker, async move {
        // 4. Execute.
        let ran =
            execute::execute::<S, B>(&settings, inner, &reservation, request, &mut held).await;
        // 5. Classify.
        let decided = classify::classify(&settings, &reservation, ran);
        // 6. Settle.
        settle::settle::<B, S::Error>(&settings, &reservation, decided, first_run, &mut held).await
    })
}
