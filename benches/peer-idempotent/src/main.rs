//! The benchmark app (`POST /orders` answering `201 created`) behind the `idempotent`
//! crate's `IdempotencyLayer` and its in-memory store, or its Valkey/Redis store with
//! `--valkey URL`, so that `compare` can drive it with the same load as our own layer in
//! the same run (on the same Redis).
//!
//! Usage: `peer-idempotent --listen 127.0.0.1:8090 [--threads 1] [--valkey redis://…]`

use std::net::SocketAddr;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Router, ServiceExt};
use idempotent::memory::MemoryStore;
use idempotent::middleware::IdempotencyLayer;
use idempotent::valkey::ValkeyStore;
use tower_layer::Layer;

/// The handler every benchmark server runs: the same bytes as `benches::app::create_order`.
async fn create_order() -> (StatusCode, [(&'static str, &'static str); 1], &'static str) {
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        r#"{"id":"ord_1","status":"created"}"#,
    )
}

fn main() {
    let mut listen: SocketAddr = "127.0.0.1:8090".parse().expect("default address");
    let mut threads = 1usize;
    let mut valkey: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--listen" => listen = value.parse().expect("--listen takes ip:port"),
            "--threads" => threads = value.parse().expect("--threads takes a number"),
            "--valkey" => valkey = Some(value),
            other => panic!("unknown argument {other}"),
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let router = Router::new().route("/orders", post(create_order));
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .expect("bind the listen address");
        let address = listener.local_addr().expect("local address");
        // Defaults otherwise: 60 s processing lease, 24 h completed lease, 1 MiB body cap.
        // Around the whole app, as `bench-server` wraps ours.
        match valkey {
            None => {
                let store = MemoryStore::builder()
                    .try_build()
                    .expect("idempotent memory store");
                let app = IdempotencyLayer::new(store).layer(router);
                println!("listening on {address}");
                axum::serve(listener, ServiceExt::<Request>::into_make_service(app))
                    .await
                    .expect("serve");
            }
            Some(url) => {
                // A prefix of its own, beside ours (`bench-idempotency:`) on the same server.
                let store = ValkeyStore::with_url(url)
                    .prefix("bench-peer")
                    .try_build()
                    .await
                    .expect("idempotent Valkey store");
                let app = IdempotencyLayer::new(store).layer(router);
                println!("listening on {address}");
                axum::serve(listener, ServiceExt::<Request>::into_make_service(app))
                    .await
                    .expect("serve");
            }
        }
    });
}
