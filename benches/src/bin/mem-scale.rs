//! `mem-scale [--records 1000000]`: fills a memory store with live completed records the
//! way the layer does (reserve, then finalize with a freshly buffered response) and prints
//! the memory they take, counted two ways: live heap bytes (a counting global allocator)
//! and resident set growth.
// A global allocator cannot be written without `unsafe`; it only forwards to `System`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotency_core::{Binding, IdempotencyStore, RecordId, Reservation, StoredResponse};
use idempotency_store_memory::MemoryStore;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged and only
// adds bookkeeping on an atomic counter.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc_zeroed`'s contract.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
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
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        new
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() {
    let mut records: u64 = 1_000_000;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--records", Some(n)) => records = n.parse().expect("--records takes a number"),
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
}
