//! The smallest useful program: an axum service whose `POST /orders` is protected by the
//! Idempotency-Key layer over the in-memory store.
//!
//! ```text
//! cargo run -p idempotency-store-memory --example hello
//! curl -si -X POST localhost:3000/orders -H 'Idempotency-Key: order-1' -d '{"sku":"a"}'
//! curl -si -X POST localhost:3000/orders -H 'Idempotency-Key: order-1' -d '{"sku":"a"}'   # replayed
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use idempotency_core::IdempotencyLayer;
use idempotency_store_memory::MemoryStore;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let in_flight = layer.in_flight();
    let orders = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/orders", post(create_order))
        .with_state(orders)
        .layer(layer);

    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on http://{listen}; POST /orders with an Idempotency-Key header");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Mutations still running for clients that went away finish and are recorded.
    in_flight.wait().await;
    Ok(())
}

/// Creates an order: a side effect that must not happen twice for one key.
async fn create_order(State(orders): State<Arc<AtomicU64>>, body: String) -> (StatusCode, String) {
    let id = orders.fetch_add(1, Ordering::SeqCst) + 1;
    println!("created order {id}");
    (
        StatusCode::CREATED,
        format!("{{\"order\":{id},\"request\":{body:?}}}\n"),
    )
}
