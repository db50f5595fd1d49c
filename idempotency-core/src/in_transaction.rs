//! Finishing a keyed request inside the handler's own database transaction.
//!
//! The layer alone leaves one window open: a mutation that committed, and then lost its
//! finalize (the process died between the two), runs again on the retry, because the
//! record still says "in flight" and its lease lapses. A handler whose state lives in the
//! store's database closes the window by writing the answer into the record **in the
//! same transaction as the mutation**: then both commit, or neither does, and a crash at
//! any instant leaves either nothing (the retry runs once) or both (the retry replays).
//!
//! The pieces:
//!
//! - The layer puts a [`ReservationHandle`] on every keyed request it runs. Besides the
//!   record and its fencing token, it carries the layer's rules for answers (which are
//!   kept, which release the key, what the profile cuts out before storing).
//! - [`ReservationHandle::prepare_answer`] reads the handler's response and applies
//!   those rules: the result, a [`PreparedAnswer`], holds what the layer would store
//!   ([`PreparedAnswer::stored`]) and the response the caller gets.
//! - A store writes [`stored`](PreparedAnswer::stored) with a fenced statement in the
//!   handler's transaction (the SQL store's `Tx::commit` does all of this), and hands
//!   back [`PreparedAnswer::into_finalized`]: the response, marked.
//! - The layer sees the mark, does not finalize again, and sends the marked answer as
//!   it was prepared, whatever happened to the response on its way out.
//!
//! One more case closes the window from the other side: a `COMMIT` whose answer was lost
//! (the connection dropped after it was sent). The change may or may not be there, and an
//! error answer would release the key, so that the retry runs the change a second time.
//! A handler that cannot find out what happened marks its answer
//! [`OutcomeUnknown`](crate::OutcomeUnknown): the layer keeps the key reserved until it
//! expires, neither storing that answer nor releasing the key.

use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body::Body;

use crate::keyed::classify::{Facts, ReadState, Verdict, verdict_on};
use crate::keyed::settle::stored_answer;
use crate::read::read_whole;
use crate::reservation::{FinalizedInTransaction, ReservationHandle};
use crate::store::{BoxError, StoredResponse};

impl ReservationHandle {
    /// Reads `response` whole and applies the layer's rules to it, as the layer would
    /// after the handler returned: what is stored of it (the status, the
    /// [replayed headers](crate::IdempotencyLayer::with_replayed_headers) and the body,
    /// after the layer's [`KeepAnswer::keep`](crate::KeepAnswer::keep), so that what a profile
    /// keeps out of the store is cut out here too), or nothing when the answer is
    /// not stored: a 5xx or a [release status](crate::IdempotencyLayer::with_release_statuses)
    /// (the layer releases the key), a body over the
    /// [limit](crate::IdempotencyLayer::with_max_response_body), or an encoded body (the
    /// layer records "already ran", as it always does).
    ///
    /// Fails only if the response body fails while it is read.
    ///
    /// This is the building block of an in-transaction finalize for a store of your own:
    /// write [`stored`](PreparedAnswer::stored) with the fenced finalize statement in
    /// the handler's transaction, and if it held, answer with
    /// [`into_finalized`](PreparedAnswer::into_finalized):
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::sync::Arc;
    /// use axum::{Extension, Router, body::Body, response::{IntoResponse, Response}, routing::post};
    /// use http::{Request, StatusCode};
    /// use idempotency_core::{IdempotencyLayer, IdempotencyStore, Ownership, ReservationHandle};
    /// use idempotency_store_memory::MemoryStore;
    /// use tower::ServiceExt;
    ///
    /// let store = Arc::new(MemoryStore::new());
    /// let records = store.clone();
    /// let handler = move |Extension(reservation): Extension<ReservationHandle>| {
    ///     let records = records.clone();
    ///     async move {
    ///     let answer = (StatusCode::CREATED, "order 42").into_response();
    ///     let prepared = reservation.prepare_answer(answer).await.unwrap();
    ///     let Some(stored) = prepared.stored() else {
    ///         return prepared.into_response::<Body>(); // not kept: the layer goes on as usual
    ///     };
    ///     // Your store's fenced finalize, inside the transaction of your mutation.
    ///     match records.finalize(reservation.id(), reservation.token(), stored).await.unwrap() {
    ///         Ownership::Held => prepared.into_finalized(), // commit, then send this
    ///         Ownership::Lost => StatusCode::SERVICE_UNAVAILABLE.into_response(), // roll back
    ///     }
    ///     }
    /// };
    /// let app = Router::new()
    ///     .route("/orders", post(handler))
    ///     .layer(IdempotencyLayer::from_shared_store(store));
    ///
    /// let order = || Request::post("/orders").header("idempotency-key", "k1").body(Body::empty()).unwrap();
    /// let first = app.clone().oneshot(order()).await.unwrap();
    /// assert_eq!(first.status(), StatusCode::CREATED);
    /// let retry = app.oneshot(order()).await.unwrap();
    /// assert_eq!(retry.headers()["idempotent-replayed"], "true");
    /// # }
    /// ```
    pub async fn prepare_answer<B>(&self, response: Response<B>) -> Result<PreparedAnswer, BoxError>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        let settings = self.settings();
        let (parts, body) = response.into_parts();
        // Read whole: the handler holds its answer whole anyway.
        let (bytes, trailers) = read_whole(body).await?;
        let read = if bytes.len() > settings.max_response_body {
            ReadState::TooLarge
        } else {
            ReadState::Whole
        };
        let facts = Facts {
            parts: &parts,
            trailers: trailers.as_ref(),
            read,
        };
        let stored = match verdict_on(settings, &facts) {
            Verdict::Store => Some(stored_answer(
                settings,
                self,
                &parts,
                &bytes,
                trailers.as_ref(),
            )),
            _ => None,
        };
        Ok(PreparedAnswer {
            reservation: self.clone(),
            response: Response::from_parts(parts, bytes),
            trailers,
            stored,
        })
    }
}

/// A handler's answer with the layer's rules applied, ready to be finalized inside the
/// handler's transaction: see [`ReservationHandle::prepare_answer`].
#[derive(Debug)]
pub struct PreparedAnswer {
    reservation: ReservationHandle,
    response: Response<Bytes>,
    /// The trailers the body ended with, if any.
    trailers: Option<HeaderMap>,
    stored: Option<StoredResponse>,
}

impl PreparedAnswer {
    /// The reservation to finalize.
    pub fn reservation(&self) -> &ReservationHandle {
        &self.reservation
    }

    /// What to write into the record, or `None` when the layer does not keep this
    /// answer (nothing is to be written: return [`into_response`](Self::into_response)).
    pub fn stored(&self) -> Option<&StoredResponse> {
        self.stored.as_ref()
    }

    /// The response to send once [`stored`](Self::stored) was written, by a fenced
    /// statement that held, in the transaction of the mutation. It is marked, so that
    /// the layer does not finalize the record again; the layer sends exactly this
    /// answer (status, headers, body), even if something changes the response on its
    /// way out, because this is what retries are replayed (less what the profile's
    /// `KeepAnswer` keeps out of the store).
    ///
    /// Send it only if the transaction commits. If it rolls back, send another answer
    /// (e.g. a 5xx, which releases the key): a marked answer whose record was rolled
    /// back leaves the record in flight until its lease lapses, and then a retry runs
    /// the request again. An answer with nothing to store comes back unmarked. (The body
    /// is rebuilt from its bytes, so trailers it ended with are not in this response;
    /// the layer sends them with the answer it takes from the mark.)
    ///
    /// From here on the layer no longer renews the request's lease: the record settles
    /// when the transaction ends. A handler that rolls back and tries again should do so
    /// promptly, or its second finalize may find the key taken over (and be refused).
    pub fn into_finalized<B: From<Bytes>>(self) -> Response<B> {
        if self.stored.is_none() {
            return self.into_response();
        }
        self.reservation.mark_finalized_in_transaction();
        let (mut parts, body) = self.response.into_parts();
        let mark = FinalizedInTransaction {
            reservation: self.reservation,
            status: parts.status,
            version: parts.version,
            headers: parts.headers.clone(),
            body: body.clone(),
            trailers: self.trailers,
        };
        parts.extensions.insert(mark);
        Response::from_parts(parts, B::from(body))
    }

    /// The response, unmarked: for an answer with nothing to store, or one whose
    /// finalize did not happen. The layer then handles it as any other answer.
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        self.response.map(B::from)
    }
}
