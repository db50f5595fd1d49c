//! A service on PostgreSQL that shares one connection pool between its own queries and
//! the idempotency records, and purges expired records in the background. Run two of
//! them against one database and they are two replicas: a retry that lands on the other
//! one is replayed.
//!
//! ```text
//! cargo run -p idempotency-store-sql --features postgres --example postgres -- postgres://postgres@127.0.0.1/test
//! curl -si -X POST localhost:3001/orders -H 'Idempotency-Key: order-1' -d 'two apples'
//! curl -si -X POST localhost:3001/orders -H 'Idempotency-Key: order-1' -d 'two apples'   # replayed
//! ```

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use idempotency_core::{IdempotencyLayer, spawn_purge_task};
use idempotency_store_sql::PostgresStore;
use idempotency_store_sql::sqlx::PgPool;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = PgPool::connect(&url).await?;
    create_orders_table(&pool).await?;

    // The store runs on the service's own pool; `migrate` is safe on every replica.
    let store = Arc::new(PostgresStore::new(pool.clone()).migrate().await?);
    // Every replica may purge: batches are small and skip rows another one is deleting.
    spawn_purge_task(store.clone(), Duration::from_secs(60), 100);

    let app = Router::new()
        .route("/orders", post(create_order))
        .with_state(pool)
        .layer(IdempotencyLayer::from_shared_store(store));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
    println!("listening on http://127.0.0.1:3001; POST /orders with an Idempotency-Key header");
    axum::serve(listener, app).await?;
    Ok(())
}

async fn create_orders_table(pool: &PgPool) -> Result<(), idempotency_store_sql::sqlx::Error> {
    idempotency_store_sql::sqlx::query(
        "CREATE TABLE IF NOT EXISTS example_orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL)",
    )
    .execute(pool)
    .await
    .map(drop)
}

/// Creates an order: a side effect that must not happen twice for one key.
async fn create_order(State(pool): State<PgPool>, item: String) -> (StatusCode, String) {
    let inserted: Result<i64, _> = idempotency_store_sql::sqlx::query_scalar(
        "INSERT INTO example_orders (item) VALUES ($1) RETURNING id",
    )
    .bind(&item)
    .fetch_one(&pool)
    .await;
    match inserted {
        Ok(id) => (StatusCode::CREATED, format!("{{\"order\":{id}}}\n")),
        // A 5xx releases the key, so the client's retry runs again.
        Err(error) => (StatusCode::SERVICE_UNAVAILABLE, format!("{error}\n")),
    }
}
