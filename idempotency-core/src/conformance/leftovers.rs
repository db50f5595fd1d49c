//! Nothing a request holds outlives it: whatever a keyed request comes to, once it is
//! settled the store holds no transaction, lock, claim or connection for it, and a key
//! held for an unknown outcome frees when its record expires. Checked through the layer,
//! with what the store holds seen from outside by a [`Leftovers`] probe its test supplies.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use tower_layer::Layer;
use tower_service::Service;

use crate::body::IdempotencyBody;
use crate::layer::IdempotencyLayer;
use crate::reservation::OutcomeUnknown;
use crate::store::IdempotencyStore;

/// What a store holds for requests right now, seen from outside: the test of a store
/// that holds anything per request (a transaction, a lock, a pooled connection, a claim
/// in the process) supplies one, e.g. counting the open transactions of the store's
/// connections in PostgreSQL's `pg_stat_activity` or MariaDB's `SHOW ENGINE INNODB
/// STATUS` (not `information_schema.innodb_trx`: InnoDB refreshes that table only after
/// 0.1 s without a read, and these checks poll faster), and the pool's connections not
/// idle. Given to the
/// suite with [`Suite::with_leftovers`](super::Suite::with_leftovers).
#[async_trait::async_trait]
pub trait Leftovers: Send + Sync + 'static {
    /// What is held now, one line each (`"2 connections in a transaction"`); empty when
    /// nothing is.
    async fn held(&self) -> Vec<String>;
}

type RequestBody = UnsyncBoxBody<Bytes, Infallible>;

/// The handler every request of these checks reaches, told by headers what to do:
/// `x-sleep-ms` (run that long), `x-answer` (answer that status), `x-unknown` (answer 500
/// marked [`OutcomeUnknown`]), `x-panic`, `x-error` (the service fails). It counts its
/// runs.
#[derive(Clone, Default)]
struct Scripted {
    runs: Arc<AtomicUsize>,
}

/// The service's own failure (`x-error`).
#[derive(Debug)]
struct Failed;

impl Service<Request<IdempotencyBody<RequestBody>>> for Scripted {
    type Response = Response<Full<Bytes>>;
    type Error = Failed;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Failed>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Failed>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<IdempotencyBody<RequestBody>>) -> Self::Future {
        let runs = self.runs.clone();
        let headers = request.headers().clone();
        Box::pin(async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let header = |name: &str| {
                headers
                    .get(name)
                    .and_then(|value| value.to_str().ok())
                    .map(str::to_owned)
            };
            if let Some(ms) = header("x-sleep-ms").and_then(|ms| ms.parse().ok()) {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            if header("x-panic").is_some() {
                panic!("the handler panicked (on purpose: a conformance check)");
            }
            if header("x-error").is_some() {
                return Err(Failed);
            }
            let status = header("x-answer")
                .and_then(|status| StatusCode::from_bytes(status.as_bytes()).ok())
                .unwrap_or(StatusCode::CREATED);
            let mut response = Response::new(Full::new(Bytes::from(format!("run {run}"))));
            *response.status_mut() = status;
            if header("x-unknown").is_some() {
                *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                response.extensions_mut().insert(OutcomeUnknown);
            }
            Ok(response)
        })
    }
}

/// What a client got: the status and whether it was a replay, or that the call failed
/// (the handler's error or panic).
#[derive(Debug, PartialEq, Eq)]
enum Got {
    Answer(StatusCode, bool),
    Failed,
}

type Layered = <IdempotencyLayer<crate::WrappedBodies> as Layer<Scripted>>::Service;

fn layered<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
    lifetime: Duration,
) -> (Layered, Scripted) {
    let handler = Scripted::default();
    let store: Arc<dyn IdempotencyStore> = Arc::new(store.clone());
    let service = IdempotencyLayer::from_shared_store(store)
        .with_lifetime(lifetime)
        .with_grace_period(Duration::ZERO)
        .with_lease(Duration::from_millis(150))
        .with_in_flight_wait(Duration::from_millis(100))
        .wrap_bodies()
        .layer(handler.clone());
    (service, handler)
}

fn request(
    key: &str,
    body: &'static str,
    headers: &[(&'static str, &'static str)],
) -> Request<RequestBody> {
    let mut request = Request::post("/conformance")
        .header("idempotency-key", key)
        .body(
            Full::new(Bytes::from_static(body.as_bytes()))
                .map_err(|never| match never {})
                .boxed_unsync(),
        )
        .expect("a valid request");
    for (name, value) in headers {
        request
            .headers_mut()
            .insert(*name, http::HeaderValue::from_static(value));
    }
    request
}

/// Sends `request` on a task of its own (so that a panicking handler fails only it).
async fn send(service: &Layered, request: Request<RequestBody>) -> Got {
    let mut service = service.clone();
    let sent = tokio::spawn(async move {
        let response = service.call(request).await?;
        let (parts, body) = response.into_parts();
        let _ = body.collect().await;
        Ok::<_, Failed>(Got::Answer(
            parts.status,
            parts.headers.contains_key("idempotent-replayed"),
        ))
    });
    match sent.await {
        Ok(Ok(got)) => got,
        Ok(Err(Failed)) => Got::Failed,
        Err(join) if join.is_panic() => Got::Failed,
        Err(join) => panic!("the request's task ended without an answer: {join}"),
    }
}

fn key() -> String {
    format!("conformance-leftovers-{}", uuid::Uuid::new_v4())
}

/// Waits (up to 5 s) until `leftovers` sees nothing held, else fails naming `after`.
async fn settled(leftovers: Option<&dyn Leftovers>, after: &str) {
    let Some(leftovers) = leftovers else {
        return;
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let held = leftovers.held().await;
        if held.is_empty() {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "5 s after a request that {after} was settled, the store still holds: {}",
                held.join("; ")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whatever a keyed request comes to — executed, replayed, refused as a reused key,
/// answered in flight, released by a 5xx, held for an unknown outcome, a handler that
/// panicked or failed, a client gone mid-request, an owner past its lease — once it is
/// settled, `leftovers` (if given) sees nothing held, and the key is where the rules say:
/// a released key runs again, a held one answers in flight, a finished one replays.
pub async fn nothing_outlives_its_request<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
    leftovers: Option<&dyn Leftovers>,
) {
    let (service, handler) = layered(store, Duration::from_secs(30));
    let runs = || handler.runs.load(Ordering::SeqCst);
    let created = Got::Answer(StatusCode::CREATED, false);
    let replayed = Got::Answer(StatusCode::CREATED, true);

    let finished = key();
    assert_eq!(send(&service, request(&finished, "a", &[])).await, created);
    settled(leftovers, "executed").await;
    assert_eq!(send(&service, request(&finished, "a", &[])).await, replayed);
    settled(leftovers, "was replayed").await;
    assert_eq!(
        send(&service, request(&finished, "b", &[])).await,
        Got::Answer(StatusCode::UNPROCESSABLE_ENTITY, false),
        "a key reused for another body must be refused"
    );
    settled(leftovers, "was refused as a reused key").await;

    let released = key();
    let unavailable = Got::Answer(StatusCode::SERVICE_UNAVAILABLE, false);
    assert_eq!(
        send(&service, request(&released, "a", &[("x-answer", "503")])).await,
        unavailable
    );
    settled(leftovers, "answered 503 (released)").await;
    assert_eq!(
        send(&service, request(&released, "a", &[])).await,
        created,
        "a released key must run again"
    );
    settled(leftovers, "ran again after a release").await;

    for (what, header) in [("panicked", "x-panic"), ("failed", "x-error")] {
        let released = key();
        assert_eq!(
            send(&service, request(&released, "a", &[(header, "1")])).await,
            Got::Failed
        );
        settled(leftovers, &format!("whose handler {what}")).await;
        assert_eq!(
            send(&service, request(&released, "a", &[])).await,
            created,
            "the key of a handler that {what} must be released"
        );
        settled(leftovers, &format!("ran again after its handler {what}")).await;
    }

    let unknown = key();
    let before = runs();
    assert_eq!(
        send(&service, request(&unknown, "a", &[("x-unknown", "1")])).await,
        Got::Answer(StatusCode::INTERNAL_SERVER_ERROR, false)
    );
    settled(leftovers, "answered with an unknown outcome").await;
    assert_eq!(
        send(&service, request(&unknown, "a", &[])).await,
        Got::Answer(StatusCode::CONFLICT, false),
        "a key held for an unknown outcome must answer in flight"
    );
    assert_eq!(runs(), before + 1, "a held key must not run again");
    settled(leftovers, "was answered in flight (a held key)").await;

    // The client goes away while the handler runs; the owner finishes on its own.
    let abandoned = key();
    let mut caller = service.clone();
    let call = caller.call(request(&abandoned, "a", &[("x-sleep-ms", "300")]));
    let _ = tokio::time::timeout(Duration::from_millis(50), call).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    settled(leftovers, "lost its client mid-request").await;
    assert_eq!(
        send(&service, request(&abandoned, "a", &[])).await,
        replayed,
        "a request whose client went away must still be finalized"
    );

    // Past its lease (renewed meanwhile), with a duplicate answered in flight.
    let slow = key();
    let before = runs();
    let owner = tokio::spawn({
        let (service, slow) = (service.clone(), slow.clone());
        async move { send(&service, request(&slow, "a", &[("x-sleep-ms", "600")])).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A store whose reservation blocks a duplicate until the owner commits (a row lock)
    // answers it with the owner's answer instead; either way it must not run again.
    let duplicate = send(&service, request(&slow, "a", &[])).await;
    assert!(
        duplicate == Got::Answer(StatusCode::CONFLICT, false) || duplicate == replayed,
        "a duplicate of a request that runs past its lease must be answered in flight \
         or with the owner's answer, got {duplicate:?}"
    );
    assert_eq!(owner.await.expect("the owner's task"), created);
    assert_eq!(
        runs(),
        before + 1,
        "a duplicate of a running request must not run"
    );
    settled(leftovers, "ran past its lease").await;
}

/// A key held for an unknown outcome frees once its record expires: a retry before then
/// is answered in flight (past the owner's lease too), one after it runs the request.
pub async fn an_unknown_outcome_frees_its_key_once_it_expires<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
) {
    let lifetime = Duration::from_millis(800);
    let (service, handler) = layered(store, lifetime);
    let unknown = key();
    let sent_at = tokio::time::Instant::now();
    assert_eq!(
        send(&service, request(&unknown, "a", &[("x-unknown", "1")])).await,
        Got::Answer(StatusCode::INTERNAL_SERVER_ERROR, false)
    );
    tokio::time::sleep(Duration::from_millis(400)).await; // past the 150 ms lease
    assert_eq!(
        send(&service, request(&unknown, "a", &[])).await,
        Got::Answer(StatusCode::CONFLICT, false),
        "a key held for an unknown outcome must not run again before it expires"
    );
    tokio::time::sleep_until(sent_at + lifetime + Duration::from_millis(1_000)).await;
    assert_eq!(
        send(&service, request(&unknown, "a", &[])).await,
        Got::Answer(StatusCode::CREATED, false),
        "a key held for an unknown outcome must run again once its record expired"
    );
    assert_eq!(handler.runs.load(Ordering::SeqCst), 2);
}
