//! The Idempotency-Key layer in front of the catalog, and the store it keeps its records
//! in.
//!
//! The layer is `idempotency_core`'s Iceberg profile: UUID keys, the spec's mutation
//! routes (with and without `{prefix}`), `ErrorModel` errors, 503 with `Retry-After` while
//! a duplicate is in flight, and the top-level `idempotency-key-lifetime` added to this
//! catalog's `GET /v1/config` answers.
//!
//! TODO(sql-store): until `idempotency-store-sql` lands on main, records are kept in
//! memory, so replicas do not share them and a restart forgets them; then the store
//! opens the catalog's own database (SQLite, PostgreSQL or MySQL).

use std::time::Duration;

use idempotency_core::IdempotencyLayer;
use idempotency_store_memory::MemoryStore;

/// The layer for the catalog on `database_url`, keeping answers for `lifetime`.
pub(crate) async fn layer(
    _database_url: &str,
    lifetime: Duration,
) -> Result<IdempotencyLayer, Box<dyn std::error::Error + Send + Sync>> {
    let store = MemoryStore::new();
    Ok(IdempotencyLayer::iceberg(store).with_lifetime(lifetime))
}
