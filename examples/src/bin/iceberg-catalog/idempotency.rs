//! The Idempotency-Key layer in front of the catalog, and the store it keeps its records
//! in.
//!
//! The layer is `idempotency_core`'s Iceberg profile: UUID keys, the spec's mutation
//! routes (with and without `{prefix}`), `ErrorModel` errors, 503 with `Retry-After` while
//! a duplicate is in flight, and the top-level `idempotency-key-lifetime` added to this
//! catalog's `GET /v1/config` answers.
//!
//! By default the records live in the catalog's own database, in a table of their own
//! (`idempotency_records`): SQLite for one process, PostgreSQL or MySQL for replicas,
//! which then replay each other's answers, and a background task purges expired
//! records. With `--idempotency-store redis://…` they live in Redis or Valkey (one server
//! or a cluster) instead, where they expire by themselves.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{IdempotencyLayer, IdempotencyStore};
use idempotency_store_redis::{RedisOptions, RedisStore};
use idempotency_store_sql::{
    MySqlStore, PoolSettings, PostgresStore, SqliteStore, spawn_purge_task,
};

use crate::catalog::Backend;

/// How often expired records are purged, and how many at a time.
const PURGE_INTERVAL: Duration = Duration::from_secs(60);
// Small batches keep reservation p99 within 2x while a backlog is purged (BENCHMARKS.md).
const PURGE_BATCH: usize = 100;

/// Where the idempotency records are kept.
pub(crate) enum Records<'a> {
    /// In the catalog's database (`--database`).
    Database(&'a str),
    /// In Redis or Valkey (`--idempotency-store`).
    Redis(&'a str),
}

/// The layer for the catalog, keeping answers for `lifetime` where `records` says.
pub(crate) async fn layer(
    records: Records<'_>,
    lifetime: Duration,
) -> Result<IdempotencyLayer, Box<dyn std::error::Error + Send + Sync>> {
    let database_url = match records {
        Records::Database(url) => url,
        Records::Redis(url) => {
            let options = RedisOptions::from_url(url).map_err(|error| {
                format!("--idempotency-store: {error}; or leave it out to keep the records in --database")
            })?;
            let store = RedisStore::connect_with(options)
                .await
                .map_err(|error| format!("--idempotency-store: {error}"))?;
            // Records expire in Redis by themselves: no purge task.
            return Ok(IdempotencyLayer::new(store)
                .into_iceberg()
                .with_lifetime(lifetime));
        }
    };
    let settings = PoolSettings::default();
    let store: Arc<dyn IdempotencyStore> = match Backend::from_url(database_url)? {
        Backend::Sqlite => Arc::new(
            SqliteStore::connect(database_url, &settings)
                .await?
                .migrate()
                .await?,
        ),
        Backend::Postgres => Arc::new(
            PostgresStore::connect(database_url, &settings)
                .await?
                .migrate()
                .await?,
        ),
        Backend::MySql => Arc::new(
            MySqlStore::connect(database_url, &settings)
                .await?
                .migrate()
                .await?,
        ),
    };
    spawn_purge_task(store.clone(), PURGE_INTERVAL, PURGE_BATCH);
    Ok(IdempotencyLayer::from_shared_store(store)
        .into_iceberg()
        .with_lifetime(lifetime))
}
