//! `mem-scale [--records 1000000] [--requests 10000]`: fills a memory store with live
//! completed records the way the layer does (reserve, then finalize with a freshly buffered
//! response) and prints the memory they take, counted two ways: live heap bytes (a counting
//! global allocator) and resident set growth; then the heap an in-flight record takes
//! (reserved, not finalized); then, for each kind of request `benches::drive` sends (HTTP and
//! gRPC; no layer, no key, a fresh key, a replay), the allocations per request through the
//! layer over a memory store, the bytes they ask for, and the heap still live per request
//! afterwards (a fresh key's stored record).
// A global allocator cannot be written without `unsafe`; it only forwards to `System`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use benches::grpc::{BenchOrders, OrdersServer};
use bytes::Bytes;
use idempotency_core::{
    Binding, IdempotencyLayer, IdempotencyStore, RecordId, Reservation, StoredResponse,
};
use idempotency_store_memory::MemoryStore;
use tower::Layer as _;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

fn counted(size: usize) {
    LIVE.fetch_add(size, Ordering::Relaxed);
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    ALLOCATED.fetch_add(size, Ordering::Relaxed);
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged and only
// adds bookkeeping on an atomic counter.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            counted(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc_zeroed`'s contract.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            counted(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is; the caller upholds `dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `realloc`'s contract.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            counted(new_size);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        new
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() {
    let mut records: u64 = 1_000_000;
    let mut requests: u64 = 10_000;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--records", Some(n)) => records = n.parse().expect("--records takes a number"),
            ("--requests", Some(n)) => requests = n.parse().expect("--requests takes a number"),
            (other, _) => panic!("unknown argument {other}"),
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let store = MemoryStore::new()
        .with_max_entries(usize::try_from(records).expect("fits") + 1)
        .with_max_bytes(u64::MAX);
    let binding = Binding {
        method: "POST".to_owned(),
        path: benches::app::PATH.to_owned(),
        body_sha256: [7; 32],
    };
    let lease = Duration::from_secs(20);
    let lifetime = Duration::from_secs(30 * 60);
    let body = benches::app::RESPONSE_BODY.as_bytes();

    let heap_before = LIVE.load(Ordering::Relaxed);
    let rss_before = benches::scale::rss_bytes().unwrap_or(0);
    let start = Instant::now();
    runtime.block_on(async {
        for n in 0..records {
            // A 36-character key shaped like a UUID, as clients send.
            let key = format!("{:08x}-0000-4000-8000-{:012x}", n >> 16, n);
            let id = RecordId::new("", key);
            let Reservation::Reserved(token) = store
                .reserve(&id, &binding, lease, lifetime)
                .await
                .expect("reserve")
            else {
                panic!("key {n} already taken");
            };
            // What the layer builds in `own_the_key`: a buffered body and copied headers.
            let stored = StoredResponse {
                status: 201,
                headers: vec![(
                    "content-type".to_owned(),
                    Bytes::copy_from_slice(b"application/json"),
                )],
                body: Bytes::copy_from_slice(body),
                trailers: vec![],
            };
            store.finalize(&id, token, &stored).await.expect("finalize");
        }
    });
    let seconds = start.elapsed().as_secs_f64();
    let heap = LIVE.load(Ordering::Relaxed).saturating_sub(heap_before) as f64;
    let rss = benches::scale::rss_bytes()
        .unwrap_or(0)
        .saturating_sub(rss_before) as f64;
    assert_eq!(store.len() as u64, records);
    let payload = 36 + "POST".len() + benches::app::PATH.len() + 32 + 2 // key, binding, status
        + "content-type".len() + "application/json".len() + body.len();
    let n = records as f64;
    println!(
        "RESULT records={records} heap_bytes_per_record={:.1} rss_bytes_per_record={:.1} \
         payload_bytes_per_record={payload} seconds={seconds:.2}",
        heap / n,
        rss / n
    );
    drop(store);

    // In flight: reserved, not finalized (what a slow request holds while it runs).
    let in_flight = (records / 10).max(1);
    let store = MemoryStore::new()
        .with_max_entries(usize::try_from(in_flight).expect("fits") + 1)
        .with_max_bytes(u64::MAX);
    let heap_before = LIVE.load(Ordering::Relaxed);
    runtime.block_on(async {
        for n in 0..in_flight {
            let id = RecordId::new("", format!("{:08x}-0000-4000-8000-{:012x}", n >> 16, n));
            let reserved = store.reserve(&id, &binding, lease, lifetime).await;
            assert!(matches!(reserved, Ok(Reservation::Reserved(_))), "key {n}");
        }
    });
    let heap = LIVE.load(Ordering::Relaxed).saturating_sub(heap_before) as f64;
    println!(
        "IN_FLIGHT records={in_flight} heap_bytes_per_record={:.1}",
        heap / in_flight as f64
    );
    drop(store);
    drop(runtime);

    for mode in [
        "bare",
        "none",
        "fresh",
        "replay",
        "grpc-bare",
        "grpc-none",
        "grpc-fresh",
        "grpc-replay",
    ] {
        let store = MemoryStore::new().with_max_entries(1 << 24);
        let (allocations, allocated, live) = match mode {
            "bare" => {
                let app = benches::app::bare();
                counted_requests(requests, |keys| {
                    benches::drive::http(app.clone(), mode, keys)
                })
            }
            "none" | "fresh" | "replay" => {
                let app = IdempotencyLayer::new(store).layer(benches::app::bare());
                counted_requests(requests, |keys| {
                    benches::drive::http(app.clone(), mode, keys)
                })
            }
            "grpc-bare" => {
                let service = OrdersServer::new(BenchOrders);
                counted_requests(requests, |keys| {
                    benches::drive::grpc(service.clone(), mode, keys)
                })
            }
            _ => {
                let service =
                    benches::grpc::memory_layer(1 << 24).layer(OrdersServer::new(BenchOrders));
                counted_requests(requests, |keys| {
                    benches::drive::grpc(service.clone(), mode, keys)
                })
            }
        };
        let n = requests as f64;
        println!(
            "ALLOCATIONS mode={mode} requests={requests} per_request={:.2} bytes_per_request={:.1} live_bytes_per_request={:.1}",
            allocations as f64 / n,
            allocated as f64 / n,
            live as f64 / n
        );
    }
}

/// Sends 100 requests to warm up (a replay's key runs once there), then `requests` more,
/// and returns what those asked of the allocator: allocations, bytes, and heap still live
/// once they are done (the records a fresh key leaves in the store).
fn counted_requests(requests: u64, drive: impl Fn(std::ops::Range<u64>)) -> (usize, usize, usize) {
    drive(0..100);
    let before = (
        ALLOCATIONS.load(Ordering::Relaxed),
        ALLOCATED.load(Ordering::Relaxed),
        LIVE.load(Ordering::Relaxed),
    );
    drive(100..100 + requests);
    (
        ALLOCATIONS.load(Ordering::Relaxed) - before.0,
        ALLOCATED.load(Ordering::Relaxed) - before.1,
        LIVE.load(Ordering::Relaxed).saturating_sub(before.2),
    )
}
