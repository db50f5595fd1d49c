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
//!   handler's transaction (the SQL stores' `finalize_in` does all of this), and hands
//!   back [`PreparedAnswer::into_finalized`]: the response, marked.
//! - The layer sees the mark, does not finalize again, and sends the marked answer as
//!   it was prepared, whatever happened to the response on its way out.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, Version, header, response};
use http_body::Body;

use crate::bodies::Bodies;
use crate::body::{Answered, Buffered, buffer};
use crate::keyed::classify::{Verdict, classify, to_store};
use crate::outcome::Outcome;
use crate::settings::Settings;
use crate::store::{BoxError, FencingToken, RecordId, StoredResponse};

/// The reservation a keyed request runs under, added to the request's extensions for
/// the inner service (requests without a key carry none).
///
/// A service that keeps its state in the store's database uses it to finalize the
/// record inside its own transaction, with the answer it is about to send: the SQL
/// stores' `finalize_in` takes it (see the `idempotency-store-sql` crate), and a store
/// of your own builds on [`prepare_answer`](Self::prepare_answer).
///
/// ```
/// use axum::Extension;
/// use idempotency_core::ReservationHandle;
///
/// // In an axum handler: `None` for a request without a key.
/// async fn handler(reservation: Option<Extension<ReservationHandle>>) -> &'static str {
///     if let Some(Extension(reservation)) = reservation {
///         let _ = (reservation.id(), reservation.token());
///     }
///     "ok"
/// }
/// # let _ = handler;
/// ```
#[derive(Clone)]
pub struct ReservationHandle {
    reserved: Arc<Reserved>,
}

/// The reservation, and what the layer knows about the keyed request that the handler's
/// finalize needs. One allocation per keyed request, shared by the owner and the handler.
struct Reserved {
    id: RecordId,
    token: FencingToken,
    /// Whether the ownership has a lease the layer renews while the request runs (an
    /// uncommitted reservation has none).
    leased: bool,
    settings: Arc<Settings>,
    /// The keyed request as the layer read it, for the profile's `to_store`; `None` when
    /// the profile's `to_store` does not read it
    /// ([`Profile::to_store_reads_request`](crate::Profile::to_store_reads_request)).
    request: Option<Request<Bytes>>,
    /// Set once the handler finalized in its transaction (commit pending or done): the
    /// layer then stops renewing the lease, and a renewal that finds the record no
    /// longer in flight is no surprise.
    finalized: AtomicBool,
}

impl ReservationHandle {
    pub(crate) fn new(
        settings: Arc<Settings>,
        request: Option<Request<Bytes>>,
        id: RecordId,
        token: FencingToken,
        leased: bool,
    ) -> Self {
        Self {
            reserved: Arc::new(Reserved {
                id,
                token,
                leased,
                settings,
                request,
                finalized: AtomicBool::new(false),
            }),
        }
    }

    /// The record reserved.
    pub fn id(&self) -> &RecordId {
        &self.reserved.id
    }

    /// The token that owns it.
    pub fn token(&self) -> FencingToken {
        self.reserved.token
    }

    /// Whether the ownership has a lease to renew while the request runs.
    pub(crate) fn is_leased(&self) -> bool {
        self.reserved.leased
    }

    /// The keyed request as the layer read it, if the profile's `to_store` reads it.
    pub(crate) fn request(&self) -> Option<&Request<Bytes>> {
        self.reserved.request.as_ref()
    }

    /// Whether the handler finalized this reservation in its own transaction.
    pub(crate) fn finalized_in_transaction(&self) -> bool {
        self.reserved.finalized.load(Ordering::Acquire)
    }

    /// Reads `response` whole and applies the layer's rules to it, as the layer would
    /// after the handler returned: what is stored of it (the status, the
    /// [replayed headers](crate::IdempotencyLayer::with_replayed_headers) and the body,
    /// after the profile's [`to_store`](crate::Profile::to_store), so that an Iceberg
    /// answer's vended credentials are cut out here too), or nothing when the answer is
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
        let settings = &self.reserved.settings;
        let (parts, body) = response.into_parts();
        // Read whole (the handler holds its answer whole anyway); what the layer would
        // not keep is classified as the layer classifies an answer over its limit.
        let (bytes, trailers, read) = match buffer(body, settings.max_response_body).await {
            Buffered::Whole(bytes, trailers) => {
                let read = Answered::<http_body_util::Empty<Bytes>>::Whole(
                    bytes.clone(),
                    trailers.clone(),
                );
                (bytes, trailers, read)
            }
            Buffered::TooLarge(bytes, trailers) => {
                let read = Answered::Over(bytes.clone(), Box::pin(http_body_util::Empty::new()));
                (bytes, trailers, read)
            }
            Buffered::Failed(error) => return Err(error),
        };
        let stored = match classify(settings, &parts, read) {
            Verdict::Store(kept, kept_trailers) => Some(to_store(
                settings,
                self.request(),
                &parts,
                &kept,
                kept_trailers.as_ref(),
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

impl PartialEq for ReservationHandle {
    fn eq(&self, other: &Self) -> bool {
        self.id() == other.id() && self.token() == other.token()
    }
}

impl Eq for ReservationHandle {}

impl std::fmt::Debug for ReservationHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key collects the response: show its short hash, as the logs do.
        f.debug_struct("ReservationHandle")
            .field(
                "key",
                &self.reserved.settings.log_key(self.id()).to_string(),
            )
            .field("token", &self.reserved.token)
            .finish_non_exhaustive()
    }
}

/// A handler's answer with the layer's rules applied, ready to be finalized inside the
/// handler's transaction: see [`ReservationHandle::prepare_answer`].
#[derive(Debug)]
pub struct PreparedAnswer {
    reservation: ReservationHandle,
    response: Response<Bytes>,
    /// The trailers the body ended with (gRPC's status), if any.
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
    /// `to_store` keeps out of the store).
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
        self.reservation
            .reserved
            .finalized
            .store(true, Ordering::Release);
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

/// The mark on a response whose record the handler finalized in its own transaction,
/// with the answer exactly as it was prepared.
#[derive(Clone)]
struct FinalizedInTransaction {
    reservation: ReservationHandle,
    status: StatusCode,
    version: Version,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

/// Stage 6, done by the handler: if it finalized the record in its transaction, the
/// answer to send (the one it finalized) instead of classifying and finalizing again. A
/// mark for another reservation (a response passed between requests) is ignored.
pub(crate) fn finalized_answer<B: Bodies>(
    settings: &Settings,
    reservation: &ReservationHandle,
    parts: &mut response::Parts,
    body: &Answered<B::Inner>,
    outcome: Outcome,
) -> Option<Response<B::Answer>> {
    let id = reservation.id();
    let mark = parts.extensions.remove::<FinalizedInTransaction>()?;
    if mark.reservation != *reservation {
        tracing::warn!(outcome = "lost-ownership", key = %settings.log_key(id), "idempotency: the response is marked as finalized for another reservation; handling it as an ordinary answer");
        return None;
    }
    let unchanged = mark.status == parts.status
        && same_apart_from_framing(&mark.headers, &parts.headers)
        && matches!(body, Answered::Whole(bytes, _) if *bytes == mark.body);
    if unchanged {
        tracing::debug!(outcome = "finalized", key = %settings.log_key(id), status = mark.status.as_u16(), "idempotency: the handler stored the response in its own transaction");
    } else {
        tracing::warn!(outcome = "finalized", key = %settings.log_key(id), "idempotency: the response changed after the handler finalized it in its transaction; sending the finalized answer, which is what retries get");
    }
    let mut parts = std::mem::replace(parts, Response::new(()).into_parts().0);
    parts.status = mark.status;
    parts.version = mark.version;
    parts.headers = mark.headers;
    parts.extensions.insert(outcome);
    Some(Response::from_parts(
        parts,
        B::made(mark.body, mark.trailers),
    ))
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
