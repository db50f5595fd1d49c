//! [`AtMostOnce`]: idempotent functions on the layer's request path.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tower_layer::Layer;
use tower_service::Service;

use crate::headers::IDEMPOTENCY_KEY;
use crate::layer::IdempotencyLayer;
use crate::outcome::Outcome;
use crate::profile::HttpProfile;
use crate::rejection::RejectionKind;
use crate::reservation::{OutcomeUnknown, ReservationHandle};
use crate::service::Idempotency;

/// Idempotent functions: any async work run at most once per (scope, key), with the
/// same stores, rules and guarantees as a keyed HTTP request — because it *is* one, on
/// the layer's own request path.
///
/// [`AtMostOnce::run`] hands the work to an [`IdempotencyLayer`] as the inner service of
/// one keyed request: the key is the request's key, the fingerprint (any
/// [`Serialize`] value, as JSON) is its body, and the scope is the call's. So a
/// duplicate while the work runs waits and gets the first run's result; the same key
/// with another fingerprint is refused ([`RunError::KeyReused`]); the lease is renewed
/// while the work runs, and a crashed owner's key is taken over once its lease lapsed; a
/// result is replayed to every retry until the key's lifetime ends.
///
/// The work answers `Ok(value)` (stored, as JSON, and replayed), or says how it failed
/// ([`WorkError`]): [`Retryable`](WorkError::Retryable) releases the key, so that a
/// retry runs the work again; [`OutcomeUnknown`](WorkError::OutcomeUnknown) holds the
/// key until it expires, so that no retry runs a change that may have happened. A
/// failure that retries must not fix is a value: make `T` a `Result`, and its `Err` is
/// stored and replayed like any result.
///
/// ```
/// # #[tokio::main]
/// # async fn main() {
/// use idempotency_core::{AtMostOnce, IdempotencyLayer, RunError, WorkError};
/// use idempotency_store_memory::MemoryStore;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize)]
/// struct Charge { account: u64, cents: u64 }
///
/// #[derive(Serialize, Deserialize, Debug, PartialEq)]
/// struct Receipt { id: u64 }
///
/// let once = AtMostOnce::new(IdempotencyLayer::new(MemoryStore::new()));
/// let charge = Charge { account: 7, cents: 1250 };
/// let run = || async { Ok::<_, WorkError<String>>(Receipt { id: 1 }) };
///
/// let first = once.run("tenant-1", "charge-42", &charge, run).await;
/// assert_eq!(first.unwrap(), Receipt { id: 1 });
/// // A retry gets the stored result; its work does not run.
/// let again = once
///     .run("tenant-1", "charge-42", &charge, || async {
///         Ok::<Receipt, WorkError<String>>(unreachable!("a retry runs nothing"))
///     })
///     .await;
/// assert_eq!(again.unwrap(), Receipt { id: 1 });
/// // The same key for another charge is refused.
/// let other = Charge { account: 7, cents: 99 };
/// let reused = once.run("tenant-1", "charge-42", &other, run).await;
/// assert!(matches!(reused, Err(RunError::KeyReused)));
/// # }
/// ```
///
/// Results are stored as JSON (`serde_json`): the store keeps bytes, and JSON is what a
/// result's type most often already round-trips (it is the HTTP layer's body format
/// too), readable when an operator inspects a record, and tolerant of fields added to
/// `T` between a run and its replay.
///
/// Built from an [`IdempotencyLayer`], whose store, lifetime, lease, in-flight wait and
/// limits it uses. Its scope is each call's own (the layer's
/// [scope extractor](IdempotencyLayer::with_scope) is not used), and the layer's
/// protocol decisions are put back to the [plain HTTP profile](HttpProfile)'s: every call
/// takes part, keys are opaque, results are stored whole. Cheap to clone: clones share
/// the store.
#[derive(Clone)]
pub struct AtMostOnce {
    service: Idempotency<RunWork>,
}

impl std::fmt::Debug for AtMostOnce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AtMostOnce").finish_non_exhaustive()
    }
}

/// How the work failed, as the work says.
#[derive(Debug)]
pub enum WorkError<E> {
    /// Nothing took effect, or trying again is safe: the key is released, and a retry
    /// (or a duplicate waiting meanwhile) runs the work again.
    Retryable(E),
    /// Whether the work took effect is unknown (the answer to a `COMMIT` was lost, a
    /// remote call timed out): the key stays reserved until it expires, and no retry
    /// runs the work before then.
    OutcomeUnknown(E),
}

/// Why [`AtMostOnce::run`] has no result.
#[derive(Debug, thiserror::Error)]
pub enum RunError<E> {
    /// This call ran the work, which failed with [`WorkError::Retryable`]: the key was
    /// released.
    #[error("the work failed; its key was released, and a retry runs it again")]
    Failed(E),
    /// This call ran the work, which failed with [`WorkError::OutcomeUnknown`]: the key
    /// stays reserved until it expires.
    #[error(
        "the work's outcome is unknown; its key stays reserved until it expires, and no retry \
         runs it before then"
    )]
    OutcomeUnknown(E),
    /// The key was first used with another fingerprint (or in flight for one): nothing
    /// ran. Use a new key for a new piece of work.
    #[error("the key was first used with another fingerprint; use a new key for new work")]
    KeyReused,
    /// Another run of this key was still running when the layer's in-flight wait ended
    /// (or its key is held after an unknown outcome): nothing ran. Try again later.
    #[error("another run of this key is still in flight; try again later")]
    InFlight,
    /// The work ran and took effect, but its result could not be written as JSON: the
    /// key stays reserved until it expires (nothing could be stored to replay).
    #[error("the work ran, but its result could not be serialized as JSON: {0}")]
    Unserializable(#[source] serde_json::Error),
    /// The stored result could not be read back as the caller's type (the type changed
    /// since the first run, say): nothing ran.
    #[error("the key's stored result is not a valid value of the result type: {0}")]
    StoredResult(#[source] serde_json::Error),
    /// The layer refused or could not protect the call (an invalid key, the store
    /// unavailable or full, a result too large to store, …): what it said, and its
    /// [`Outcome`].
    #[error("{status}: {message}")]
    Refused {
        /// The layer's outcome for the call, if it had one.
        outcome: Option<Outcome>,
        /// The HTTP status the layer answered.
        status: StatusCode,
        /// The layer's message.
        message: String,
    },
}

impl AtMostOnce {
    /// Runs work through `layer`'s request path.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_core::{AtMostOnce, IdempotencyLayer};
    /// use idempotency_store_memory::MemoryStore;
    ///
    /// let once = AtMostOnce::new(
    ///     IdempotencyLayer::new(MemoryStore::new()).with_lifetime(Duration::from_secs(3600)),
    /// );
    /// ```
    pub fn new(layer: IdempotencyLayer) -> Self {
        let layer = layer
            .with_profile(HttpProfile)
            .with_scope(|request: &http::request::Parts| {
                request
                    .extensions
                    .get::<CallScope>()
                    .map(|scope| scope.0.clone())
            });
        Self {
            service: layer.layer(RunWork),
        }
    }

    /// Runs `work` unless a run of (`scope`, `key`) already has a result, which is
    /// returned instead; waits for a run still in flight. `fingerprint` is what the key
    /// is bound to: the same key with another fingerprint is refused.
    ///
    /// The work runs to its end even if this future is dropped (as a request's handler
    /// does when its client hangs up), so that its result is stored; it must be
    /// `Send + 'static`. Work that panics releases the key, and the panic reaches the
    /// caller.
    pub async fn run<T, E, F, Fut>(
        &self,
        scope: &str,
        key: &str,
        fingerprint: &impl Serialize,
        work: F,
    ) -> Result<T, RunError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, WorkError<E>>> + Send + 'static,
    {
        self.run_with_reservation(scope, key, fingerprint, |_| work())
            .await
    }

    /// [`run`](Self::run), for work that records its result itself, in the same commit
    /// as its own write: the work is given the call's [`WorkReservation`], whose
    /// [`handle`](WorkReservation::handle) a store's transaction API takes (the SQL
    /// store's `Tx::begin`) and whose [`answer`](WorkReservation::answer) is the record
    /// to commit with the write. The layer then finalizes nothing more, and a retry of
    /// the key replays what the work committed.
    ///
    /// ```
    /// # #[tokio::main]
    /// # async fn main() {
    /// use idempotency_core::{AtMostOnce, IdempotencyLayer, WorkError};
    /// use idempotency_store_memory::MemoryStore;
    ///
    /// let once = AtMostOnce::new(IdempotencyLayer::new(MemoryStore::new()));
    /// let shipped = once
    ///     .run_with_reservation("tenant-1", "ship-7", &7, |reservation| async move {
    ///         // With a store that commits records in the work's transaction:
    ///         // let mut tx = Tx::begin(&writes, reservation.handle()).await?;
    ///         // ... the write, through &mut *tx ...
    ///         // tx.commit(reservation.answer(&"shipped")?).await?;
    ///         let _record = reservation.answer(&"shipped").expect("a string is JSON");
    ///         Ok::<_, WorkError<String>>("shipped".to_owned())
    ///     })
    ///     .await;
    /// assert_eq!(shipped.unwrap(), "shipped");
    /// # }
    /// ```
    pub async fn run_with_reservation<T, E, F, Fut>(
        &self,
        scope: &str,
        key: &str,
        fingerprint: &impl Serialize,
        work: F,
    ) -> Result<T, RunError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(WorkReservation) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, WorkError<E>>> + Send + 'static,
    {
        let fingerprint = serde_json::to_vec(fingerprint).map_err(|error| RunError::Refused {
            outcome: None,
            status: StatusCode::BAD_REQUEST,
            message: format!("the fingerprint could not be serialized as JSON: {error}"),
        })?;
        let failure: Slot<Failure<E>> = Arc::new(Mutex::new(None));
        let work = boxed(work, failure.clone());
        let request = Request::post("/")
            .header(IDEMPOTENCY_KEY, key)
            .extension(CallScope(scope.to_owned()))
            .extension(PendingWork(Arc::new(Mutex::new(Some(work)))))
            .body(Full::new(Bytes::from(fingerprint)));
        let request = match request {
            Ok(request) => request,
            Err(error) => {
                return Err(RunError::Refused {
                    outcome: Some(Outcome::Rejected(RejectionKind::InvalidKey)),
                    status: StatusCode::BAD_REQUEST,
                    message: format!("the key is not a valid header value: {error}"),
                });
            }
        };
        let mut service = self.service.clone();
        let response = match std::future::poll_fn(|cx| service.poll_ready(cx)).await {
            Ok(()) => service.call(request).await,
            Err(never) => match never {},
        };
        let Ok(response) = response;
        let (parts, body) = response.into_parts();
        let outcome = parts.extensions.get::<Outcome>().copied();
        let bytes = match body.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(never) => match never {},
        };
        // This call's own run failed: the work said how.
        if let Some(failure) = take(&failure) {
            return Err(match failure {
                Failure::Work(WorkError::Retryable(error)) => RunError::Failed(error),
                Failure::Work(WorkError::OutcomeUnknown(error)) => RunError::OutcomeUnknown(error),
                Failure::Unserializable(error) => RunError::Unserializable(error),
            });
        }
        match (parts.status, outcome) {
            // A result: this call's (stored or not) or a replay of the first run's; only
            // the work answers 200.
            (StatusCode::OK, _) => serde_json::from_slice(&bytes).map_err(RunError::StoredResult),
            (_, Some(Outcome::Rejected(RejectionKind::KeyReused))) => Err(RunError::KeyReused),
            (_, Some(Outcome::Rejected(RejectionKind::InFlight))) => Err(RunError::InFlight),
            (status, outcome) => Err(RunError::Refused {
                outcome,
                status,
                message: String::from_utf8_lossy(&bytes).into_owned(),
            }),
        }
    }
}

/// The reservation a call's work runs under, for work that commits its result with its
/// own write ([`AtMostOnce::run_with_reservation`]).
#[derive(Clone, Debug)]
pub struct WorkReservation {
    handle: Option<ReservationHandle>,
}

impl WorkReservation {
    /// The call's reservation, as a keyed request's handler has it: what a store's
    /// transaction API takes to commit the record with the work's write. `None` when the
    /// layer runs the work unprotected (its store unavailable under
    /// [fail-open](crate::IdempotencyLayer::with_fail_open)): the write then commits alone.
    pub fn handle(&self) -> Option<&ReservationHandle> {
        self.handle.as_ref()
    }

    /// The answer that records `result` (as [`AtMostOnce`] stores every result: a `200`
    /// with its JSON), to commit with the work's write. Return the same `result` from the
    /// work: the first call gets it, and every retry the committed one.
    pub fn answer<T: Serialize>(
        &self,
        result: &T,
    ) -> Result<Response<Full<Bytes>>, serde_json::Error> {
        Ok(answer(
            StatusCode::OK,
            Bytes::from(serde_json::to_vec(result)?),
            false,
        ))
    }
}

/// The scope of the call a request carries (the layer reads it as the request's scope).
#[derive(Clone)]
struct CallScope(String);

/// The work of the call a request carries, taken by [`RunWork`] when it runs.
#[derive(Clone)]
struct PendingWork(Arc<Mutex<Option<BoxedWork>>>);

type BoxedWork = Box<
    dyn FnOnce(WorkReservation) -> Pin<Box<dyn Future<Output = Response<Full<Bytes>>> + Send>>
        + Send,
>;

type Slot<T> = Arc<Mutex<Option<T>>>;

/// How a call's own run failed, kept for the caller beside the answer the layer sees.
enum Failure<E> {
    Work(WorkError<E>),
    Unserializable(serde_json::Error),
}

fn take<T>(slot: &Slot<T>) -> Option<T> {
    slot.lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .take()
}

fn put<T>(slot: &Slot<T>, value: T) {
    *slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(value);
}

/// The work as the inner service's answer: its result as a 200 with the JSON body (kept
/// and replayed), a retryable failure as a 503 (released), an unknown outcome or a
/// result that cannot be written as a 500 marked [`OutcomeUnknown`] (held until the key
/// expires). The failure itself goes to the caller through `failure`.
fn boxed<T, E, F, Fut>(work: F, failure: Slot<Failure<E>>) -> BoxedWork
where
    T: Serialize + Send + 'static,
    E: Send + 'static,
    F: FnOnce(WorkReservation) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, WorkError<E>>> + Send + 'static,
{
    Box::new(move |reservation| {
        Box::pin(async move {
            let (status, unknown) = match work(reservation).await {
                Ok(value) => match serde_json::to_vec(&value) {
                    Ok(json) => return answer(StatusCode::OK, Bytes::from(json), false),
                    Err(error) => {
                        put(&failure, Failure::Unserializable(error));
                        (StatusCode::INTERNAL_SERVER_ERROR, true)
                    }
                },
                Err(error) => {
                    let status = match &error {
                        WorkError::Retryable(_) => (StatusCode::SERVICE_UNAVAILABLE, false),
                        WorkError::OutcomeUnknown(_) => (StatusCode::INTERNAL_SERVER_ERROR, true),
                    };
                    put(&failure, Failure::Work(error));
                    status
                }
            };
            answer(status, Bytes::new(), unknown)
        })
    })
}

fn answer(status: StatusCode, body: Bytes, unknown: bool) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    if unknown {
        response.extensions_mut().insert(OutcomeUnknown);
    }
    response
}

/// The inner service of [`AtMostOnce`]: runs the work its request carries.
#[derive(Clone, Copy, Debug)]
struct RunWork;

impl Service<Request<Full<Bytes>>> for RunWork {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let work = request
            .extensions()
            .get::<PendingWork>()
            .and_then(|pending| take(&pending.0));
        let handle = request.extensions().get::<ReservationHandle>().cloned();
        Box::pin(async move {
            Ok(match work {
                Some(work) => work(WorkReservation { handle }).await,
                // Only `AtMostOnce::run` builds the requests, each with its work, which
                // runs once: the layer calls the inner service once per request.
                None => answer(StatusCode::INTERNAL_SERVER_ERROR, Bytes::new(), false),
            })
        })
    }
}
