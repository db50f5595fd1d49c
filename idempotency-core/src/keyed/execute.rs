//! Stage 4, **execute**: the key's owner runs the inner service on the buffered request,
//! with its [`ReservationHandle`] in the request's extensions, and reads the answer up to
//! the limit and within the memory budget, while the lease is renewed on a task of its
//! own. A panic is caught, so that the key can be released.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, Request, response};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use crate::body_types::{Bodies, InnerService};
use crate::budget::Held;
use crate::encoding::ask_for_identity;
use crate::headers::IDEMPOTENCY_KEY;
use crate::keyed::store::RequestPathStore;
use crate::read::{BodyRead, Reader};
use crate::reservation::ReservationHandle;
use crate::settings::Settings;
use crate::store::Ownership;

/// A panic of the inner service, caught to release the key and then resumed.
pub(crate) type Panic = Box<dyn std::any::Any + Send>;

/// What running the inner service came to.
// The large variant is the common one: boxing it would cost every request an allocation.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Ran<I, E> {
    /// It answered: the head, the body as read, and the body itself, whose rest is still
    /// unread when the read stopped at the limit or the budget.
    Response {
        parts: response::Parts,
        read: BodyRead,
        body: Pin<Box<I>>,
    },
    /// It returned an error.
    Error(E),
    /// It panicked.
    Panic(Panic),
}

/// Runs the inner service on `request` and reads its answer, while the lease is renewed.
pub(crate) async fn execute<S, B>(
    settings: &Arc<Settings>,
    mut inner: S,
    reservation: &ReservationHandle,
    request: Request<Bytes>,
    held: &mut Held,
) -> Ran<B::ResponseIn, S::Error>
where
    S: InnerService<B::RequestOut, B::ResponseIn>,
    B: Bodies,
{
    // Built and pinned in place, and the request handed over inside it: the work is kept
    // once, in this future, not moved into another one (a copy of every byte of it).
    let work = std::pin::pin!(
        AssertUnwindSafe(async move {
            let mut request = request.map(B::keyed_request);
            prepare_for_inner(settings, request.headers_mut());
            request.extensions_mut().insert(reservation.clone());
            let (parts, body) = match inner.call(request).await {
                Ok(response) => response.into_parts(),
                Err(error) => return Ran::Error(error),
            };
            let mut body = Box::pin(body);
            let read = Reader::up_to(settings.max_response_body)
                .within(&settings.memory, held, 0)
                .read(body.as_mut(), Bytes::new())
                .await;
            Ran::Response { parts, read, body }
        })
        .catch_unwind()
    );
    hold_lease(settings, reservation.clone(), work)
        .await
        .unwrap_or_else(Ran::Panic)
}

/// The headers a keyed request reaches the inner service with: asking for an unencoded
/// answer, and without the key unless the layer forwards it.
pub(crate) fn prepare_for_inner(settings: &Settings, headers: &mut HeaderMap) {
    ask_for_identity(headers);
    if !settings.forward_key {
        headers.remove(IDEMPOTENCY_KEY);
    }
}

/// Drives `work` while its lease is renewed every third of the lease's length.
///
/// The renewal runs on a task of its own, so the lease is kept even while nobody polls
/// `work` (a caller may hold the response future for a while without polling it). It
/// starts only if `work` does not finish on its first poll, and stops when `work` ends or
/// is dropped (a reservation held unseen by the store answers each renewal from what
/// holds it). Losing the lease does not stop the work: the request is already running, and the store's
/// fencing keeps the stale owner from overwriting the new one.
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
    let store = RequestPathStore::of(&settings);
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
        match store.renew(id, token).await {
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
