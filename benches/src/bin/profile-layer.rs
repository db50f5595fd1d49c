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

use std::time::Duration;

use benches::grpc::{BenchOrders, OrdersServer};
use idempotency_core::{
    Binding, FencingToken, IdempotencyLayer, IdempotencyRecord, IdempotencyStore, Ownership,
    RecordId, Reservation, StoreError, StoredResponse, Waited,
};
use idempotency_store_memory::MemoryStore;
use tower::Layer;

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "fresh".to_owned());
    let requests: u64 = args
        .next()
        .map_or(20_000, |n| n.parse().expect("a request count"));
    let metrics = args.next().as_deref() != Some("metrics-off");
    // Keys `profile-0` … : a fresh key per request in `fresh` modes.
    let requests = 0..requests;
    let layer = IdempotencyLayer::new(MemoryStore::new().with_max_entries(100_000_000))
        .with_metrics(metrics);
    match mode.as_str() {
        "bare" => benches::drive::http(benches::app::bare(), &mode, requests),
        "identity" => benches::drive::http(
            benches::app::bare().layer(tower::layer::util::Identity::new()),
            &mode,
            requests,
        ),
        "per-route" => benches::drive::http(benches::app::layered(layer), &mode, requests),
        "none" | "fresh" | "replay" => {
            benches::drive::http(layer.layer(benches::app::bare()), &mode, requests)
        }
        "fresh-awaited" | "replay-awaited" => benches::drive::http(
            IdempotencyLayer::new(Awaited(MemoryStore::new().with_max_entries(100_000_000)))
                .with_metrics(metrics)
                .layer(benches::app::bare()),
            mode.trim_end_matches("-awaited"),
            requests,
        ),
        "grpc-bare" => benches::drive::grpc(OrdersServer::new(BenchOrders), &mode, requests),
        "grpc-none" | "grpc-fresh" | "grpc-replay" => benches::drive::grpc(
            benches::grpc::memory_layer(100_000_000)
                .with_metrics(metrics)
                .layer(OrdersServer::new(BenchOrders)),
            &mode,
            requests,
        ),
        other => panic!("unknown mode {other}"),
    }
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
