//! The Idempotency-Key layer in front of the catalog, and the store it keeps its records
//! in.
//!
//! The layer is `idempotency_core`'s Iceberg profile: UUID keys, the spec's mutation
//! routes (with and without `{prefix}`), `ErrorModel` errors, 503 with `Retry-After` while
//! a duplicate is in flight, and the top-level `idempotency-key-lifetime` added to this
//! catalog's `GET /v1/config` answers.
//!
//! It is set up the way a catalog configured from properties would be: the command
//! line becomes `idempotency-*` properties, read by
//! [`IdempotencyConfig`]. The records live
//! in the catalog's own database, in a table of their own (`idempotency_records`):
//! SQLite for one process, PostgreSQL or MySQL for replicas, which then replay each
//! other's answers. A background task purges expired records.
//!
//! Being in the same database, a change's answer is written into its record in the
//! change's own transaction ([`AnyFinalizer`], on the catalog's `Any` connections), so
//! that the two commit together: see [`crate::catalog`].

use std::time::Duration;

use idempotency_core::IdempotencyLayer;
use idempotency_core::config::{ConfigError, IdempotencyConfig};
use idempotency_core::iso8601::format_duration;
use idempotency_store_sql::AnyFinalizer;

/// How often expired records are purged.
const PURGE_INTERVAL: Duration = Duration::from_secs(60);

/// The layer for the catalog on `database_url`, keeping answers for `lifetime`, and
/// the finalizer that writes an answer into its record in the catalog's transactions.
pub(crate) async fn layer(
    database_url: &str,
    lifetime: Duration,
) -> Result<(IdempotencyLayer, AnyFinalizer), ConfigError> {
    let config = IdempotencyConfig::from_properties([
        ("idempotency-enabled", "true".to_owned()),
        ("idempotency-key-lifetime", format_duration(lifetime)),
        ("idempotency-store-type", "sql".to_owned()),
        ("idempotency-database-url", database_url.to_owned()),
        (
            "idempotency-purge-interval",
            format_duration(PURGE_INTERVAL),
        ),
    ])?;
    let store = idempotency_store_sql::open(&config).await?;
    config.spawn_purge_task(store.clone());
    // `open` keeps the records in the default table.
    Ok((config.iceberg_layer(store), AnyFinalizer::default()))
}
