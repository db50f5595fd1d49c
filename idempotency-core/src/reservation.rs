//! [`ReservationHandle`]: the reservation a keyed request runs under, as its handler sees
//! it, and the marks a handler puts on its answer: finalized in its own transaction, or
//! [`OutcomeUnknown`]. What a handler does with them is in `in_transaction`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, Uri, Version};

use crate::settings::Settings;
use crate::store::{FencingToken, RecordId};

/// The reservation a keyed request runs under, added to the request's extensions for
/// the inner service (requests without a key carry none).
///
/// A service that keeps its state in the store's database uses it to finalize the
/// record inside its own transaction, with the answer it is about to send: the SQL
/// stores take it (see the `idempotency-store-sql` crate), and a store of your own
/// builds on [`prepare_answer`](Self::prepare_answer).
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
    shared: Arc<Shared>,
}

/// The reservation, and what the layer knows about the keyed request that the handler's
/// finalize needs. One allocation per keyed request, shared by the owner and the handler.
struct Shared {
    id: RecordId,
    token: FencingToken,
    settings: Arc<Settings>,
    /// The keyed request's method and URI, for what decides what of its answer is kept.
    request_line: (Method, Uri),
    /// Set once the handler finalized in its transaction (commit pending or done): the
    /// layer then stops renewing the lease, and a renewal that finds the record no
    /// longer in flight is no surprise.
    finalized: AtomicBool,
}

impl ReservationHandle {
    pub(crate) fn new(
        settings: Arc<Settings>,
        request_line: (Method, Uri),
        id: RecordId,
        token: FencingToken,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                id,
                token,
                settings,
                request_line,
                finalized: AtomicBool::new(false),
            }),
        }
    }

    /// The record reserved.
    pub fn id(&self) -> &RecordId {
        &self.shared.id
    }

    /// The token that owns it.
    pub fn token(&self) -> FencingToken {
        self.shared.token
    }

    /// The layer the request runs in.
    pub(crate) fn settings(&self) -> &Arc<Settings> {
        &self.shared.settings
    }

    /// The keyed request's method and URI.
    pub(crate) fn request_line(&self) -> (&Method, &Uri) {
        (&self.shared.request_line.0, &self.shared.request_line.1)
    }

    /// Whether the handler finalized this reservation in its own transaction.
    pub(crate) fn finalized_in_transaction(&self) -> bool {
        self.shared.finalized.load(Ordering::Acquire)
    }

    /// Notes that the handler finalized this reservation in its own transaction.
    pub(crate) fn mark_finalized_in_transaction(&self) {
        self.shared.finalized.store(true, Ordering::Release);
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
            .field("key", &self.shared.settings.log_key(self.id()).to_string())
            .field("token", &self.shared.token)
            .finish_non_exhaustive()
    }
}

/// The mark on a response whose record the handler finalized in its own transaction,
/// with the answer exactly as it was prepared: what the layer sends.
#[derive(Clone)]
pub(crate) struct FinalizedInTransaction {
    pub(crate) reservation: ReservationHandle,
    pub(crate) status: StatusCode,
    pub(crate) version: Version,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

/// The mark on an answer whose change may or may not have taken effect: its transaction's
/// `COMMIT` was sent, and the answer to it was lost, and asking the database afterwards
/// did not tell (the SQL stores' `WriteTransaction::commit` says when this is so).
///
/// A keyed request whose answer carries it **keeps its key reserved until the key
/// expires**: the answer is sent to this caller but neither stored nor replayed (it says
/// nothing about what happened), and the key is not released, as a 5xx otherwise does,
/// because a retry would then run the change a second time. Retries meanwhile are told
/// the request is still in flight (409 by default, or the profile's in-flight answer);
/// 503 with `Retry-After`); an operator who has checked the state can evict the key. A
/// request without a key is answered as it is.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
/// use axum::{Router, body::Body, response::IntoResponse, routing::post};
/// use http::{Request, StatusCode};
/// use idempotency_core::{IdempotencyLayer, OutcomeUnknown};
/// use idempotency_store_memory::MemoryStore;
/// use tower::ServiceExt;
///
/// let runs = Arc::new(AtomicU32::new(0));
/// let counted = runs.clone();
/// let handler = move || async move {
///     counted.fetch_add(1, Ordering::SeqCst);
///     // ... the COMMIT's answer was lost, and the database could not be asked.
///     let mut answer = (StatusCode::INTERNAL_SERVER_ERROR, "commit state unknown").into_response();
///     answer.extensions_mut().insert(OutcomeUnknown);
///     answer
/// };
/// let app = Router::new()
///     .route("/orders", post(handler))
///     .layer(
///         IdempotencyLayer::new(MemoryStore::new())
///             .with_lease(Duration::from_millis(100)) // an owner's lease between renewals
///             .with_in_flight_wait(Duration::from_millis(50)),
///     );
///
/// let order = || Request::post("/orders").header("idempotency-key", "k1").body(Body::empty()).unwrap();
/// let first = app.clone().oneshot(order()).await.unwrap();
/// assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
/// tokio::time::sleep(Duration::from_millis(300)).await; // past the lease: still held
/// let retry = app.oneshot(order()).await.unwrap();
/// assert_eq!(retry.status(), StatusCode::CONFLICT); // still reserved: in flight
/// assert_eq!(runs.load(Ordering::SeqCst), 1); // not run again
/// # }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutcomeUnknown;
