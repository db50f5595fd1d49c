//! Sends one kind of request through the app in process, many times, for a profiler that
//! counts instructions (callgrind counts the same whatever else the machine is doing):
//!
//! ```sh
//! valgrind --tool=callgrind target/release/profile-layer fresh 40000
//! ```
//!
//! Modes: `bare` (no layer, no key), `none` (the layer around the app, no key), `fresh`
//! (a new key per request), `replay` (one key, replayed after the first request),
//! `identity` (a no-op layer with `Router::layer`, no key), `per-route` (our layer with
//! `Router::layer`, no key). Compare two modes' totals, divided by the request count.
//!
//! gRPC modes, on the tonic service of the gRPC benchmark (`benches/proto/bench.proto`,
//! `idempotency_grpc::layer` over a memory store, as `grpc-server --mode memory`):
//! `grpc-bare` (tonic's generated server alone), `grpc-none`, `grpc-fresh`, `grpc-replay`
//! (the layer around it: no key, a new key per call, one key). Each call is a complete
//! gRPC request (framed message, `content-type: application/grpc`); the answer is read to
//! its trailers. No HTTP/2: this counts the layer against the generated service only.
//!
//! A third argument `metrics-off` builds the layer `with_metrics(false)`: the same
//! requests without a single metrics call, to count what recording metrics costs when
//! no recorder is installed (none ever is here).
//!
//! `fresh-awaited` and `replay-awaited` are `fresh` and `replay` over a memory store
//! that answers only the trait's async methods (the layer then awaits `reserve` and
//! `finalize` instead of taking `reserve_now` and `finalize_now`): what the store's fast
//! paths save.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use benches::grpc::{BenchOrders, OrdersServer};
use bytes::{BufMut as _, Bytes, BytesMut};
use http::{HeaderValue, Request, Response, header};
use http_body_util::{BodyExt as _, Full};
use idempotency_core::{
    Binding, FencingToken, IDEMPOTENCY_KEY, IdempotencyLayer, IdempotencyRecord, IdempotencyStore,
    Ownership, RecordId, Reservation, StoreError, StoredResponse, Waited,
};
use idempotency_store_memory::MemoryStore;
use tower::{Layer, Service, ServiceExt};

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "fresh".to_owned());
    let requests: u64 = args
        .next()
        .map_or(20_000, |n| n.parse().expect("a request count"));
    let metrics = args.next().as_deref() != Some("metrics-off");
    let layer = IdempotencyLayer::new(MemoryStore::new().with_max_entries(100_000_000))
        .with_metrics(metrics);
    match mode.as_str() {
        "bare" => drive(benches::app::bare(), &mode, requests),
        "identity" => drive(
            benches::app::bare().layer(tower::layer::util::Identity::new()),
            &mode,
            requests,
        ),
        "per-route" => drive(benches::app::layered(layer), &mode, requests),
        "none" | "fresh" | "replay" => drive(layer.layer(benches::app::bare()), &mode, requests),
        "fresh-awaited" | "replay-awaited" => drive(
            IdempotencyLayer::new(Awaited(MemoryStore::new().with_max_entries(100_000_000)))
                .with_metrics(metrics)
                .layer(benches::app::bare()),
            mode.trim_end_matches("-awaited"),
            requests,
        ),
        "grpc-bare" => drive_grpc(OrdersServer::new(BenchOrders), &mode, requests),
        "grpc-none" | "grpc-fresh" | "grpc-replay" => drive_grpc(
            benches::grpc::memory_layer(100_000_000)
                .with_metrics(metrics)
                .layer(OrdersServer::new(BenchOrders)),
            &mode,
            requests,
        ),
        other => panic!("unknown mode {other}"),
    }
}

fn drive<S>(app: S, mode: &str, requests: u64)
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        for n in 0..requests {
            let mut builder =
                Request::post(benches::app::PATH).header(header::CONTENT_TYPE, "application/json");
            match mode {
                "fresh" => {
                    let key = HeaderValue::try_from(format!("profile-{n}")).expect("a key");
                    builder = builder.header(IDEMPOTENCY_KEY, key);
                }
                "replay" => builder = builder.header(IDEMPOTENCY_KEY, "profile-fixed"),
                _ => {}
            }
            let request = builder
                .body(Body::from(benches::app::REQUEST_BODY))
                .expect("a valid request");
            let response = app.clone().oneshot(request).await.expect("infallible");
            let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .expect("the body");
            std::hint::black_box(body);
        }
    });
}

fn drive_grpc<S, B>(service: S, mode: &str, requests: u64)
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible> + Clone,
    B: axum::body::HttpBody<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let message = prost::Message::encode_to_vec(&benches::grpc::request_message());
    let mut framed = BytesMut::with_capacity(5 + message.len());
    framed.put_u8(0);
    framed.put_u32(u32::try_from(message.len()).expect("a small message"));
    framed.put_slice(&message);
    let framed = framed.freeze();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        for n in 0..requests {
            let mut builder = Request::post(benches::grpc::METHOD)
                .header(header::CONTENT_TYPE, "application/grpc")
                .header(header::TE, "trailers");
            match mode {
                "grpc-fresh" => {
                    let key = HeaderValue::try_from(format!("profile-{n}")).expect("a key");
                    builder = builder.header(IDEMPOTENCY_KEY, key);
                }
                "grpc-replay" => builder = builder.header(IDEMPOTENCY_KEY, "profile-fixed"),
                _ => {}
            }
            let request = builder
                .body(Full::new(framed.clone()))
                .expect("a valid request");
            let response = service.clone().oneshot(request).await.expect("infallible");
            let body = response.into_body().collect().await.expect("the body");
            assert!(
                body.trailers()
                    .and_then(|t| t.get("grpc-status"))
                    .is_some_and(|s| s == "0"),
                "the call did not succeed"
            );
            std::hint::black_box(body.to_bytes());
        }
    });
}

/// The memory store without its fast paths: every call is the trait's async one.
struct Awaited(MemoryStore);

#[idempotency_core::async_trait]
impl IdempotencyStore for Awaited {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        self.0.reserve(id, binding, lease, lifetime).await
    }
    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.0.load(id).await
    }
    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        self.0.wait(id, timeout).await
    }
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.0.renew(id, token, lease).await
    }
    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        self.0.finalize(id, token, response).await
    }
    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        self.0.release(id, token).await
    }
    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        self.0.take_over(id, lapsed, lease).await
    }
}
