//! Checks that run an [`IdempotencyLayer`] over the store, for what the store alone
//! cannot show: what a retry that waited for its key's owner is answered, and what
//! callers of [`AtMostOnce`](crate::AtMostOnce) get.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use tokio::sync::Notify;
use tower_layer::Layer;
use tower_service::Service;

use crate::body::IdempotencyBody;
use crate::layer::IdempotencyLayer;
use crate::store::{
    Binding, FencingToken, IdempotencyRecord, IdempotencyStore, Ownership, RecordId, Reservation,
    StoreError, StoredResponse, Waited,
};

/// A retry that waits for its key's owner never gets another request's answer.
///
/// Three requests on one key, through the layer: A (body `X`) runs and answers 500 after
/// a while, which releases the key; B, the same request as A, arrives meanwhile and
/// waits; C (body `Y`) reserves the key the moment A releases it and answers 201 at once.
/// B must then be refused as a key reused for another request (the key is C's), or run
/// its own request if it found the key free first — never be answered C's 201, and
/// never take C's record over. The retries of B and C then get their own request's answer
/// (or the refusal). Three rounds.
pub async fn a_waiting_retry_never_gets_another_requests_answer<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
) {
    for _ in 0..3 {
        swap_round(store.clone()).await;
    }
}

/// The store under test, with one hook: the moment a release is asked for, C's request
/// body is let through (before the store wakes anyone who waits on the key).
struct ReleaseHook<S: ?Sized> {
    inner: Arc<S>,
    released: Arc<Notify>,
}

#[async_trait::async_trait]
#[deny(clippy::missing_trait_methods)]
impl<S: IdempotencyStore + ?Sized> IdempotencyStore for ReleaseHook<S> {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        self.inner.reserve(id, binding, lease, lifetime).await
    }
    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.inner.load(id).await
    }
    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        self.inner.wait(id, timeout).await
    }
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.inner.renew(id, token, lease).await
    }
    async fn hold(
        &self,
        id: &RecordId,
        token: FencingToken,
        kept_for: Duration,
    ) -> Result<Ownership, StoreError> {
        self.inner.hold(id, token, kept_for).await
    }
    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        self.inner.finalize(id, token, response).await
    }
    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        self.released.notify_one();
        self.inner.release(id, token).await
    }
    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        self.inner.take_over(id, lapsed, lease).await
    }
    fn reserve_now(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Option<Result<Reservation, StoreError>> {
        self.inner.reserve_now(id, binding, lease, lifetime)
    }
    fn finalize_now(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Option<Result<Ownership, StoreError>> {
        self.inner.finalize_now(id, token, response)
    }
}

type RequestBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// `POST /swap`: answers 500 after `x-fail-after-ms` when that header is set (and says
/// it started), else 201 with the body it got.
#[derive(Clone)]
struct Swap {
    calls: Arc<AtomicUsize>,
    a_started: Arc<Notify>,
}

impl Service<Request<IdempotencyBody<RequestBody>>> for Swap {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<IdempotencyBody<RequestBody>>) -> Self::Future {
        let (calls, a_started) = (self.calls.clone(), self.a_started.clone());
        Box::pin(async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let fail_after = request
                .headers()
                .get("x-fail-after-ms")
                .and_then(|ms| ms.to_str().ok()?.parse().ok());
            let body = match request.into_body().collect().await {
                Ok(body) => body.to_bytes(),
                Err(_) => Bytes::new(),
            };
            let (status, answer) = match fail_after {
                Some(ms) => {
                    a_started.notify_one();
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    (StatusCode::INTERNAL_SERVER_ERROR, "A failed".to_owned())
                }
                None => (
                    StatusCode::CREATED,
                    format!("created from {}", String::from_utf8_lossy(&body)),
                ),
            };
            let mut response = Response::new(Full::new(Bytes::from(answer)));
            *response.status_mut() = status;
            Ok(response)
        })
    }
}

/// An answer as a client sees it: status, whether it is a replay, body.
type Answer = (StatusCode, bool, String);

async fn send<T>(mut service: T, request: Request<RequestBody>) -> Answer
where
    T: Service<Request<RequestBody>, Response = Response<IdempotencyBody<Full<Bytes>>>>,
    T::Error: std::fmt::Debug,
{
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .expect("the layer is always ready");
    let response = service.call(request).await.expect("the layer answers");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("a whole body").to_bytes();
    (
        parts.status,
        parts.headers.contains_key("idempotent-replayed"),
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn swap(key: &str, body: RequestBody) -> Request<RequestBody> {
    Request::post("/swap")
        .header("idempotency-key", key)
        .body(body)
        .expect("a valid request")
}

fn whole(body: &'static str) -> RequestBody {
    Full::new(Bytes::from_static(body.as_bytes()))
        .map_err(|never| match never {})
        .boxed_unsync()
}

async fn swap_round<S: IdempotencyStore + ?Sized>(store: Arc<S>) {
    let released = Arc::new(Notify::new());
    let hooked = ReleaseHook {
        inner: store,
        released: released.clone(),
    };
    let a_started = Arc::new(Notify::new());
    let service = IdempotencyLayer::from_shared_store(Arc::new(hooked))
        .with_in_flight_wait(Duration::from_secs(10))
        .wrap_bodies()
        .layer(Swap {
            calls: Arc::new(AtomicUsize::new(0)),
            a_started: a_started.clone(),
        });
    let key = format!("conformance-swap-{}", uuid::Uuid::new_v4());

    let mut a = swap(&key, whole("X"));
    a.headers_mut()
        .insert("x-fail-after-ms", http::HeaderValue::from_static("300"));
    let a = tokio::spawn(send(service.clone(), a));
    a_started.notified().await;
    let b = tokio::spawn(send(service.clone(), swap(&key, whole("X"))));
    let c_body = futures_util::stream::once(async move {
        released.notified().await;
        Ok::<_, std::io::Error>(http_body::Frame::data(Bytes::from_static(b"Y")))
    });
    let c = tokio::spawn(send(
        service.clone(),
        swap(&key, StreamBody::new(c_body).boxed_unsync()),
    ));
    let (a, b, c) = (
        a.await.expect("A"),
        b.await.expect("B"),
        c.await.expect("C"),
    );
    let b_retry = send(service.clone(), swap(&key, whole("X"))).await;
    let c_retry = send(service.clone(), swap(&key, whole("Y"))).await;
    let what = format!(
        "A got {a:?}, B (the same request as A) got {b:?}, C (another body) got {c:?}; \
         B's retry got {b_retry:?}, C's retry got {c_retry:?}"
    );
    assert_eq!(a.0, StatusCode::INTERNAL_SERVER_ERROR, "{what}");
    assert!(!b.2.contains("from Y"), "B got C's answer: {what}");
    assert!(!c.2.contains("from X"), "C got B's answer: {what}");
    let refused = StatusCode::UNPROCESSABLE_ENTITY;
    match (b.0, c.0) {
        // The key was C's by the time B looked again.
        (status, StatusCode::CREATED) if status == refused => {
            assert_eq!(c.2, "created from Y", "{what}");
            assert_eq!(b_retry.0, refused, "{what}");
            assert_eq!(
                c_retry,
                (StatusCode::CREATED, true, c.2.clone()),
                "C's retry must replay C's answer: {what}"
            );
        }
        // B found the key free and ran its own request; C came too late.
        (StatusCode::CREATED, status) if status == refused => {
            assert_eq!(
                b,
                (StatusCode::CREATED, false, "created from X".into()),
                "{what}"
            );
            assert_eq!(
                b_retry,
                (StatusCode::CREATED, true, b.2.clone()),
                "B's retry must replay B's answer: {what}"
            );
            assert_eq!(c_retry.0, refused, "{what}");
        }
        _ => panic!("B and C must get one 201 and one 422 between them: {what}"),
    }
}

/// Work run through [`AtMostOnce`](crate::AtMostOnce) over the store runs once for many
/// concurrent callers of one key, each getting its result; a retryable failure lets the
/// next call run; the same key with another fingerprint is refused; work run with its
/// reservation is given the call's own, and its retry the first result.
pub async fn work_runs_at_most_once<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
    use crate::{AtMostOnce, RunError, WorkError};

    let once = AtMostOnce::new(
        IdempotencyLayer::from_shared_store(Arc::new(store.clone()))
            .with_in_flight_wait(Duration::from_secs(10)),
    );
    let scope = format!("scope-{}", uuid::Uuid::new_v4());
    let runs = Arc::new(AtomicUsize::new(0));
    let callers: Vec<_> = (0..8)
        .map(|_| {
            let (once, scope, runs) = (once.clone(), scope.clone(), runs.clone());
            tokio::spawn(async move {
                once.run(&scope, "once", &"fingerprint", move || async move {
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Ok::<usize, WorkError<()>>(run)
                })
                .await
            })
        })
        .collect();
    for caller in callers {
        let result = caller.await.expect("a caller panicked");
        assert_eq!(
            result.expect("a caller got no result"),
            1,
            "every caller of one key gets the one run's result"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "8 callers of one key ran the work more than once"
    );

    let reused = once
        .run(&scope, "once", &"another fingerprint", || async {
            Ok::<usize, WorkError<()>>(0)
        })
        .await;
    assert!(
        matches!(reused, Err(RunError::KeyReused)),
        "the key with another fingerprint must be refused as reused: {reused:?}"
    );

    let failed = once
        .run(&scope, "retryable", &"fingerprint", || async {
            Err::<usize, _>(WorkError::Retryable(()))
        })
        .await;
    assert!(matches!(failed, Err(RunError::Failed(()))), "{failed:?}");
    let again = once
        .run(&scope, "retryable", &"fingerprint", || async {
            Ok::<usize, WorkError<()>>(2)
        })
        .await;
    assert_eq!(
        again.expect("after a retryable failure the key must run again"),
        2
    );

    // Work that records its result itself is given the call's reservation.
    let expected = crate::RecordId::new(scope.clone(), "with-reservation");
    for attempt in 0..2_usize {
        let expected = expected.clone();
        let result = once
            .run_with_reservation(
                &scope,
                "with-reservation",
                &"fingerprint",
                move |work| async move {
                    let handle = work
                        .handle()
                        .expect("a keyed call runs under a reservation");
                    assert_eq!(
                        handle.id(),
                        &expected,
                        "the work was given another call's reservation"
                    );
                    Ok::<usize, WorkError<()>>(attempt)
                },
            )
            .await;
        assert_eq!(
            result.expect("work with its reservation got no result"),
            0,
            "the retry of work run with its reservation gets the first result"
        );
    }
}
