//! A duplicate that waits for its key's owner never gets another request's answer, and
//! never takes over another request's record.
//!
//! The scenario, on one key K:
//!
//! 1. A (`POST /swap`, body `X`) runs; its handler answers 500 after a while, which
//!    releases the key.
//! 2. B, the same request as A, arrives while A runs: it waits for A.
//! 3. C, key K with another body `Y`, reserves the key the moment A released it, and its
//!    handler answers 201 at once.
//!
//! B must get the key-reused answer (422: the key now belongs to C) or run its own
//! request; never C's 201 and never C's record. Run on a store that keeps the trait's
//! default `wait` (polling `load`, as every third-party store gets) and on the memory
//! store's notified `wait`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::{
    Binding, FencingToken, IdempotencyLayer, IdempotencyRecord, IdempotencyStore, Ownership,
    RecordId, Reservation, StoreError, StoredResponse, Waited,
};
use idempotency_store_memory::MemoryStore;
use tokio::sync::Notify;
use tower::ServiceExt;

/// How a [`SwapStore`] waits.
#[derive(Clone, Copy, Debug)]
enum Waiting {
    /// The trait's default: polling `load`.
    Polling,
    /// The memory store's own, woken by the owner.
    Notified,
}

/// The memory store, with a hook: the moment a release takes effect, C's request body
/// is let through, so that C reserves the key before the waiting duplicate looks again.
#[derive(Clone)]
struct SwapStore {
    inner: MemoryStore,
    waiting: Waiting,
    released: Arc<Notify>,
}

#[async_trait]
impl IdempotencyStore for SwapStore {
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
        match self.waiting {
            Waiting::Polling => idempotency_core::wait_by_polling(self, id, timeout).await,
            Waiting::Notified => self.inner.wait(id, timeout).await,
        }
    }
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.inner.renew(id, token, lease).await
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
        // C's body first: its task is woken before the waiter the release wakes.
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
}

/// `POST /swap`: answers 500 after `x-fail-after-ms` when that header is set, else 201
/// with the body it got, after `x-slow-ms` if set.
fn app(layer: IdempotencyLayer, calls: Arc<AtomicUsize>, a_started: Arc<Notify>) -> Router {
    let handler = move |headers: HeaderMap, body: String| {
        let (calls, a_started) = (calls.clone(), a_started.clone());
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            if let Some(ms) = headers.get("x-fail-after-ms") {
                a_started.notify_one();
                let ms: u64 = ms.to_str().unwrap().parse().unwrap();
                tokio::time::sleep(Duration::from_millis(ms)).await;
                return (StatusCode::INTERNAL_SERVER_ERROR, "A failed").into_response();
            }
            if let Some(ms) = headers.get("x-slow-ms") {
                let ms: u64 = ms.to_str().unwrap().parse().unwrap();
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            (StatusCode::CREATED, format!("created from {body}")).into_response()
        }
    };
    Router::new().route("/swap", post(handler)).layer(layer)
}

/// How a round's requests reach the layer.
#[derive(Clone)]
enum Transport {
    /// Called in process (`tower::ServiceExt::oneshot`).
    InProcess(Router),
    /// Over HTTP/1.1, to the router served on a loopback port.
    Http(std::net::SocketAddr),
}

/// One `POST /swap` as a client sends it.
struct Swap {
    key: String,
    body: &'static str,
    headers: Vec<(&'static str, String)>,
    /// The body is sent only once this is notified.
    gate: Option<Arc<Notify>>,
}

/// What a client got: status, headers, body.
type Answer = (StatusCode, HeaderMap, String);

async fn send(transport: Transport, swap: Swap) -> Answer {
    match transport {
        Transport::InProcess(app) => {
            let body = match swap.gate {
                None => Body::from(swap.body),
                Some(gate) => Body::from_stream(futures_util::stream::once(async move {
                    gate.notified().await;
                    Ok::<_, std::io::Error>(Bytes::from_static(swap.body.as_bytes()))
                })),
            };
            let mut request = Request::post("/swap")
                .header("idempotency-key", &swap.key)
                .body(body)
                .unwrap();
            for (name, value) in swap.headers {
                request.headers_mut().insert(name, value.parse().unwrap());
            }
            let response: Response = app.oneshot(request).await.unwrap();
            let (parts, body) = response.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            (
                parts.status,
                parts.headers,
                String::from_utf8_lossy(&body).into_owned(),
            )
        }
        Transport::Http(address) => send_over_http(address, swap).await,
    }
}

/// The request written by hand on a fresh connection (`Connection: close`), the answer
/// read to its end.
async fn send_over_http(address: std::net::SocketAddr, swap: Swap) -> Answer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut connection = tokio::net::TcpStream::connect(address).await.unwrap();
    let mut head = format!(
        "POST /swap HTTP/1.1\r\nhost: {address}\r\nconnection: close\r\nidempotency-key: {}\r\ncontent-length: {}\r\n",
        swap.key,
        swap.body.len()
    );
    for (name, value) in &swap.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    connection.write_all(head.as_bytes()).await.unwrap();
    if let Some(gate) = swap.gate {
        gate.notified().await;
    }
    connection.write_all(swap.body.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    connection.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap();
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line.split_once(':').unwrap();
        headers.insert(
            axum::http::HeaderName::from_bytes(name.trim().as_bytes()).unwrap(),
            value.trim().parse().unwrap(),
        );
    }
    (
        StatusCode::from_u16(status.parse().unwrap()).unwrap(),
        headers,
        body.to_owned(),
    )
}

fn swap(key: &str, body: &'static str) -> Swap {
    Swap {
        key: key.to_owned(),
        body,
        headers: Vec::new(),
        gate: None,
    }
}

/// The timing of one round.
#[derive(Clone, Copy, Debug)]
struct Timing {
    /// How long A runs before it answers 500.
    a_fails_after_ms: u64,
    /// How long C's handler takes.
    c_takes_ms: u64,
}

/// C answers at once.
const QUICK_C: Timing = Timing {
    a_fails_after_ms: 300,
    c_takes_ms: 0,
};

/// One round of the scenario, in process: B never gets C's answer, C never gets B's, and
/// the retries of each get their own request's answer (or 422).
async fn round(waiting: Waiting, timing: Timing, layer: impl Fn(SwapStore) -> IdempotencyLayer) {
    round_over(waiting, timing, layer, false).await;
}

/// [`round`], over HTTP when `over_http`.
async fn round_over(
    waiting: Waiting,
    timing: Timing,
    layer: impl Fn(SwapStore) -> IdempotencyLayer,
    over_http: bool,
) {
    let store = SwapStore {
        inner: MemoryStore::new(),
        waiting,
        released: Arc::new(Notify::new()),
    };
    let released = store.released.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let a_started = Arc::new(Notify::new());
    let app = app(layer(store), calls.clone(), a_started.clone());
    let (transport, server) = if over_http {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        (Transport::Http(address), Some(server))
    } else {
        (Transport::InProcess(app), None)
    };
    let key = uuid::Uuid::new_v4().to_string();

    let mut a = swap(&key, "X");
    a.headers
        .push(("x-fail-after-ms", timing.a_fails_after_ms.to_string()));
    let a = tokio::spawn(send(transport.clone(), a));
    a_started.notified().await;
    // B waits for A.
    let b = tokio::spawn(send(transport.clone(), swap(&key, "X")));
    // C's body arrives the moment A's release takes effect.
    let mut c = swap(&key, "Y");
    c.headers.push(("x-slow-ms", timing.c_takes_ms.to_string()));
    c.gate = Some(released);
    let c = tokio::spawn(send(transport.clone(), c));

    let (a, b, c) = (a.await.unwrap(), b.await.unwrap(), c.await.unwrap());
    let what = format!("{waiting:?}, {timing:?}: A got {a:?}, B got {b:?}, C got {c:?}");
    assert_eq!(a.0, StatusCode::INTERNAL_SERVER_ERROR, "{what}");
    assert!(!b.2.contains("from Y"), "B (body X) got C's answer: {what}");
    assert!(!c.2.contains("from X"), "C (body Y) got B's answer: {what}");
    // Whoever ran owns the key; a retry of each request gets its own answer or 422.
    let b_retry = send(transport.clone(), swap(&key, "X")).await;
    let c_retry = send(transport.clone(), swap(&key, "Y")).await;
    let what = format!("{what}; B's retry got {b_retry:?}, C's retry got {c_retry:?}");
    match (b.0, c.0) {
        // The key was C's by the time B looked.
        (StatusCode::UNPROCESSABLE_ENTITY, StatusCode::CREATED) => {
            assert!(c.2.contains("from Y"), "{what}");
            assert_eq!(b_retry.0, StatusCode::UNPROCESSABLE_ENTITY, "{what}");
            assert_eq!(c_retry.0, StatusCode::CREATED, "{what}");
            assert_eq!(c_retry.2, c.2, "{what}");
        }
        // B found the key free and ran its own request; C came too late.
        (StatusCode::CREATED, StatusCode::UNPROCESSABLE_ENTITY) => {
            assert!(b.2.contains("from X"), "{what}");
            assert!(!b.1.contains_key("idempotent-replayed"), "{what}");
            assert_eq!(b_retry.0, StatusCode::CREATED, "{what}");
            assert_eq!(b_retry.2, b.2, "{what}");
            assert_eq!(c_retry.0, StatusCode::UNPROCESSABLE_ENTITY, "{what}");
        }
        _ => panic!("unexpected answers: {what}"),
    }
    if let Some(server) = server {
        server.abort();
    }
}

const ROUNDS: usize = 10;

#[tokio::test(flavor = "current_thread")]
async fn a_polling_waiter_never_gets_another_requests_answer() {
    for _ in 0..ROUNDS {
        round(Waiting::Polling, QUICK_C, IdempotencyLayer::new).await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_notified_waiter_never_gets_another_requests_answer() {
    for _ in 0..ROUNDS {
        round(Waiting::Notified, QUICK_C, IdempotencyLayer::new).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_never_get_another_requests_answer_on_several_threads() {
    for _ in 0..ROUNDS {
        round(Waiting::Polling, QUICK_C, IdempotencyLayer::new).await;
        round(Waiting::Notified, QUICK_C, IdempotencyLayer::new).await;
    }
}

/// C holds the key and is slow, and stops renewing its lease (it ran past the maximum
/// run time): a waiting B sees C's lease lapse, and must not take C's record over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_never_takes_over_another_requests_record() {
    let timing = Timing {
        a_fails_after_ms: 40,
        c_takes_ms: 400,
    };
    let layer = |store| {
        IdempotencyLayer::new(store)
            .with_lease(Duration::from_millis(60))
            .with_max_run_time(Duration::from_millis(100))
            .with_in_flight_wait(Duration::from_secs(3))
    };
    for _ in 0..ROUNDS {
        round(Waiting::Polling, timing, layer).await;
        round(Waiting::Notified, timing, layer).await;
    }
}

/// The scenario over HTTP, on a polling store, while every core of the machine is busy:
/// many rounds, none gives B C's answer or C's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_under_cpu_load_no_waiter_gets_another_requests_answer() {
    let busy = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let burners: Vec<_> = (0..std::thread::available_parallelism().map_or(2, |n| n.get()))
        .map(|_| {
            let busy = busy.clone();
            std::thread::spawn(move || {
                let mut x = 0_u64;
                while busy.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            })
        })
        .collect();
    let lapsing = Timing {
        a_fails_after_ms: 40,
        c_takes_ms: 400,
    };
    for _ in 0..ROUNDS {
        round_over(Waiting::Polling, QUICK_C, IdempotencyLayer::new, true).await;
        round_over(
            Waiting::Polling,
            lapsing,
            |store| {
                IdempotencyLayer::new(store)
                    .with_lease(Duration::from_millis(60))
                    .with_max_run_time(Duration::from_millis(100))
                    .with_in_flight_wait(Duration::from_secs(3))
            },
            true,
        )
        .await;
    }
    busy.store(false, Ordering::Relaxed);
    for burner in burners {
        burner.join().unwrap();
    }
}
