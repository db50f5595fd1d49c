//! The gRPC benchmark: one unary method (`bench.v1.Orders/CreateOrder`, in
//! `benches/proto/bench.proto`) served by tonic bare or behind
//! [`idempotency_grpc::layer`], and a tonic client load generator that drives it over
//! loopback (`grpc-server` and `grpc-load`; `compare --only grpc` runs both).

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::time::{Duration, Instant};

use idempotency_core::IdempotencyLayer;
use idempotency_grpc::GrpcProfile;
use idempotency_store_memory::MemoryStore;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::harness::quantile;
use crate::http_load::LoadResult;

/// The code generated from `benches/proto/bench.proto`.
pub mod pb {
    #![allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
    tonic::include_proto!("bench.v1");
}

pub use pb::orders_client::OrdersClient;
pub use pb::orders_server::{Orders, OrdersServer};
pub use pb::{CreateOrderRequest, Order};

/// The serialized file descriptor set of `bench.proto`, given to the layer as a real
/// service would (it has no streaming method, so every call takes part).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/bench_descriptor.bin"));

/// The full path of the benchmark's one method.
pub const METHOD: &str = "/bench.v1.Orders/CreateOrder";

/// The request every benchmark call sends (the HTTP benchmark's body, as a message).
pub fn request_message() -> CreateOrderRequest {
    CreateOrderRequest {
        item: "book".to_owned(),
        quantity: 1,
    }
}

/// The handler: answers every call with the same small `Order` and does nothing else.
#[derive(Clone, Copy, Debug, Default)]
pub struct BenchOrders;

#[tonic::async_trait]
impl Orders for BenchOrders {
    async fn create_order(
        &self,
        _request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        Ok(Response::new(Order {
            id: "ord_1".to_owned(),
            status: "created".to_owned(),
        }))
    }
}

/// The layer of the `memory` mode: the gRPC profile over a memory store bounded high
/// enough that a fresh-key load never fills it (as in the HTTP benchmark).
pub fn memory_layer(max_entries: usize) -> IdempotencyLayer<idempotency_core::WrappedBodies> {
    idempotency_grpc::layer(
        MemoryStore::new()
            .with_max_entries(max_entries)
            .with_max_bytes(u64::MAX),
    )
    .with_profile(
        GrpcProfile::new()
            .with_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .expect("bench.proto's descriptor set"),
    )
}

/// Which `idempotency-key` the calls of a load carry (the names of the HTTP benchmark).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyMode {
    /// `nokey`: none; the layer passes the call through.
    None,
    /// `fresh`: a new key on every call (first executions).
    Fresh,
    /// `fixed`: one key for the whole run, executed beforehand (replays).
    Fixed,
}

impl KeyMode {
    /// Parses `nokey`, `fresh` or `fixed`.
    pub fn parse(mode: &str) -> Option<Self> {
        match mode {
            "nokey" => Some(Self::None),
            "fresh" => Some(Self::Fresh),
            "fixed" => Some(Self::Fixed),
            _ => None,
        }
    }
}

/// One load run's settings.
#[derive(Clone, Debug)]
pub struct LoadSettings {
    /// Calls in flight at any time (each a task that calls, waits for the answer, calls
    /// again).
    pub concurrency: usize,
    /// HTTP/2 connections the calls are spread over (task `i` uses connection
    /// `i % connections`).
    pub connections: usize,
    /// How long the calls are started for.
    pub duration: Duration,
    /// Which key the calls carry.
    pub mode: KeyMode,
    /// Makes this run's request ids (and fresh keys) unique across runs.
    pub nonce: String,
    /// The key of [`KeyMode::Fixed`].
    pub fixed_key: String,
}

/// Opens one HTTP/2 connection to `addr` (tonic's default settings).
pub async fn connect(addr: SocketAddr) -> Result<OrdersClient<Channel>, String> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    Ok(OrdersClient::new(channel))
}

/// Builds one call: every call carries a unique `x-request-id` whatever the mode, so that
/// the client does the same work for every server (as the `wrk` script does).
fn call(settings: &LoadSettings, id: &str) -> Request<CreateOrderRequest> {
    let mut request = Request::new(request_message());
    let metadata = request.metadata_mut();
    metadata.insert(
        "x-request-id",
        MetadataValue::try_from(id).expect("printable id"),
    );
    let key = match settings.mode {
        KeyMode::None => None,
        KeyMode::Fresh => Some(MetadataValue::try_from(format!("k-{id}")).expect("printable key")),
        KeyMode::Fixed => {
            Some(MetadataValue::try_from(settings.fixed_key.as_str()).expect("printable key"))
        }
    };
    if let Some(key) = key {
        metadata.insert("idempotency-key", key);
    }
    request
}

/// Drives `addr` with `settings` and measures calls per second and latency. Connections
/// are opened, and one call made on each, before the clock starts. Must run on a tokio
/// runtime with local task support (the load generator's own current-thread runtime).
pub async fn drive(addr: SocketAddr, settings: LoadSettings) -> Result<LoadResult, String> {
    let mut clients = Vec::with_capacity(settings.connections.max(1));
    for _ in 0..settings.connections.max(1) {
        let mut client = connect(addr).await?;
        client
            .create_order(Request::new(request_message()))
            .await
            .map_err(|status| format!("the warm-up call failed: {status}"))?;
        clients.push(client);
    }
    let settings = Rc::new(settings);
    let started = Instant::now();
    let deadline = started + settings.duration;
    let local = tokio::task::LocalSet::new();
    let mut tasks = Vec::with_capacity(settings.concurrency);
    for task in 0..settings.concurrency.max(1) {
        let mut client = clients[task % clients.len()].clone();
        let settings = Rc::clone(&settings);
        tasks.push(local.spawn_local(async move {
            let mut latencies = Vec::with_capacity(1 << 14);
            let mut errors = 0u64;
            let mut n = 0u64;
            while Instant::now() < deadline {
                n += 1;
                let id = format!("{}-{task}-{n}", settings.nonce);
                let request = call(&settings, &id);
                let sent = Instant::now();
                match client.create_order(request).await {
                    Ok(response) => {
                        std::hint::black_box(response);
                    }
                    Err(_) => errors += 1,
                }
                latencies.push(sent.elapsed().as_secs_f64() * 1e6);
            }
            (latencies, errors)
        }));
    }
    let (latencies, errors) = local
        .run_until(async move {
            let mut all = Vec::new();
            let mut errors = 0;
            for task in tasks {
                let (latencies, e) = task.await.map_err(|e| e.to_string())?;
                all.extend(latencies);
                errors += e;
            }
            Ok::<_, String>((all, errors))
        })
        .await?;
    let elapsed = started.elapsed().as_secs_f64();
    let mut latencies = latencies;
    latencies.sort_by(f64::total_cmp);
    if latencies.is_empty() {
        return Err("no call completed".to_owned());
    }
    Ok(LoadResult {
        requests: latencies.len() as u64,
        rps: latencies.len() as f64 / elapsed,
        p50_us: quantile(&latencies, 0.50),
        p99_us: quantile(&latencies, 0.99),
        non_2xx: errors,
        socket_errors: 0,
    })
}

/// The line `grpc-load` prints and [`run_load`] parses.
pub fn result_line(result: &LoadResult) -> String {
    format!(
        "RESULT requests={} rps={:.1} p50_us={:.0} p99_us={:.0} errors={}",
        result.requests, result.rps, result.p50_us, result.p99_us, result.non_2xx
    )
}

/// Runs the `grpc-load` binary (`program`) against `addr` once and parses its result.
pub fn run_load(
    program: &Path,
    addr: SocketAddr,
    settings: &LoadSettings,
) -> Result<LoadResult, String> {
    let mode = match settings.mode {
        KeyMode::None => "nokey",
        KeyMode::Fresh => "fresh",
        KeyMode::Fixed => "fixed",
    };
    let output = Command::new(program)
        .args(["--addr", &addr.to_string(), "--mode", mode])
        .args(["--concurrency", &settings.concurrency.to_string()])
        .args(["--connections", &settings.connections.to_string()])
        .args(["--seconds", &settings.duration.as_secs_f64().to_string()])
        .args([
            "--nonce",
            &settings.nonce,
            "--fixed-key",
            &settings.fixed_key,
        ])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    let result = crate::http_load::ResultLine::of("grpc-load", &output)?;
    let field = |name: &str| result.field(name);
    Ok(LoadResult {
        requests: field("requests") as u64,
        rps: field("rps"),
        p50_us: field("p50_us"),
        p99_us: field("p99_us"),
        non_2xx: field("errors") as u64,
        socket_errors: 0,
    })
}

/// Checks that the server at `addr` executes `key` and then replays it (`layered`), or
/// that it never says it replayed (bare).
pub fn check_replays(addr: SocketAddr, key: &str, layered: bool) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let mut client = connect(addr).await?;
        let settings = LoadSettings {
            concurrency: 1,
            connections: 1,
            duration: Duration::ZERO,
            mode: KeyMode::Fixed,
            nonce: "check".to_owned(),
            fixed_key: key.to_owned(),
        };
        for attempt in 0..2 {
            let response = client
                .create_order(call(&settings, &format!("check-{attempt}")))
                .await
                .map_err(|status| format!("call {attempt} failed: {status}"))?;
            let replayed = response
                .metadata()
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true");
            let order = response.into_inner();
            if order.id != "ord_1" {
                return Err(format!("call {attempt} answered {order:?}"));
            }
            if replayed != (layered && attempt == 1) {
                return Err(format!(
                    "call {attempt}: idempotent-replayed is {replayed}, expected {}",
                    layered && attempt == 1
                ));
            }
        }
        Ok(())
    })
}

/// CPU time the process `pid` has used so far, all its threads together, in
/// nanoseconds (from `/proc/PID/task/*/schedstat`; `None` where there is no `/proc`).
pub fn cpu_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}
