//! The Idempotency-Key layer in front of the catalog, and the store it keeps its records
//! in.
//!
//! The layer is `idempotency_core`'s Iceberg profile: UUID keys, the spec's mutation
//! routes (with and without `{prefix}`), `ErrorModel` errors, 503 with `Retry-After` while
//! a duplicate is in flight, and the top-level `idempotency-key-lifetime` added to this
//! catalog's `GET /v1/config` answers.
//!
//! By default it is set up the way a catalog configured from properties would be: the
//! command line becomes `idempotency-*` properties, read by [`IdempotencyConfig`]. The
//! records live in the catalog's own database, in a table of their own
//! (`idempotency_records`): SQLite for one process, PostgreSQL or MySQL for replicas,
//! which then replay each other's answers. A background task purges expired records.
//!
//! With `--idempotency-store redis://…` (or `redis+cluster://…`) the records live in
//! Redis or Valkey instead, one server or a cluster, where they expire by themselves; the
//! catalog's own state stays in its database (`grpc-orders` connects the same way:
//! [`examples::records`]).
//!
//! An answer that carries table or view metadata (a commit's, a created or registered
//! table's or view's) is stored as a pointer to the metadata file it names, which the
//! layer reads back through the catalog's FileIO to replay it byte for byte: a record
//! then costs a few hundred bytes whatever the table's size. `--store-whole-metadata`
//! stores such answers whole instead, as a catalog without a reader would (for
//! comparison).
//!
//! Being in the same database, a keyed change commits **once**, with its record and its
//! answer: the record is reserved in a transaction on the catalog's own pool
//! ([`OneCommitStore`]), the change is written in that transaction, then its answer, and
//! the transaction commits: see [`crate::catalog`]. Records in Redis cannot join that
//! transaction: the layer then finalizes them after the answer, as for any service.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::config::IdempotencyConfig;
use idempotency_core::iceberg::{IcebergProfile, MetadataReader};
use idempotency_core::iso8601::format_duration;
use idempotency_core::{IdempotencyLayer, RecordAdmin, SingleScope};
use idempotency_store_sql::{OneCommitStore, Reservations, TableName};
use sqlx::Pool;

use crate::catalog::{CatalogDatabase, Writes};

/// How often expired records are purged.
const PURGE_INTERVAL: Duration = Duration::from_secs(60);

/// Where the idempotency records are kept.
pub(crate) enum Records<'a> {
    /// In the catalog's database (`--database`).
    Database(&'a str),
    /// In Redis or Valkey (`--idempotency-store`).
    Redis(&'a str),
}

/// How a keyed change commits when the records are in the catalog's database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Commits {
    /// Once: the record is reserved in the change's own transaction.
    One,
    /// Twice: the record is reserved in a commit of its own first (`--two-commit`, a
    /// comparison in builds with the `test-hooks` feature).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    Two,
}

/// The layer for the catalog, keeping answers for `lifetime` where `records` says, and
/// answers that carry table or view metadata as a pointer to their file, read back
/// through `metadata` for replays (whole without it); its
/// store as the admin endpoints use it (inspect, evict: the layer holds only the request
/// path); and, when the records are in the catalog's database, how the catalog's changes
/// write their answers: in the one-commit store's reservations, opened on the catalog's
/// `pool`, or (`Commits::Two`) in transactions of their own.
///
/// The catalog authenticates nobody (every caller may do everything), so there are no
/// callers to tell apart: it says so with [`SingleScope`], and clients configured with a
/// token (which the layer would otherwise refuse, unable to tell them apart) work too. A
/// catalog with authentication reads the principal instead (README, Usage).
pub(crate) async fn layer<DB: CatalogDatabase>(
    records: Records<'_>,
    lifetime: Duration,
    commits: Commits,
    pool: &Pool<DB>,
    metadata: Option<impl MetadataReader>,
) -> Result<
    (IdempotencyLayer, Arc<dyn RecordAdmin>, Option<Writes<DB>>),
    Box<dyn std::error::Error + Send + Sync>,
> {
    let profile = match metadata {
        Some(reader) => IcebergProfile::default().with_metadata_reader(reader),
        None => IcebergProfile::default(),
    };
    let (layer, records, finalizer) = records_layer(records, lifetime, commits, pool).await?;
    Ok((layer.with_profile(profile), records, finalizer))
}

/// [`layer`] with the records where `records` says, before its profile is set.
async fn records_layer<DB: CatalogDatabase>(
    records: Records<'_>,
    lifetime: Duration,
    commits: Commits,
    pool: &Pool<DB>,
) -> Result<
    (IdempotencyLayer, Arc<dyn RecordAdmin>, Option<Writes<DB>>),
    Box<dyn std::error::Error + Send + Sync>,
> {
    match records {
        Records::Database(database_url) => {
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
            let typed = idempotency_store_sql::open(&config).await?;
            config.spawn_purge_task(typed.clone());
            // `open` keeps the records in the default table. `--two-commit`: each
            // reservation committed on its own first, with a lease.
            let reservations = match commits {
                Commits::One => Reservations::Uncommitted,
                Commits::Two => Reservations::Leased,
            };
            let store = OneCommitStore::new(typed, pool.clone(), &TableName::default())
                .await?
                .with_reservations(reservations);
            let store = Arc::new(store);
            Ok((
                config.iceberg_layer(store.clone()).with_scope(SingleScope),
                store.clone(),
                Some(Writes::with_records(store)),
            ))
        }
        Records::Redis(url) => {
            let store = examples::records::connect_redis(url).await?;
            // Records expire in Redis by themselves: no purge task. A clone shares the
            // connections.
            Ok((
                IdempotencyLayer::iceberg(store.clone())
                    .with_lifetime(lifetime)
                    .with_scope(SingleScope),
                Arc::new(store),
                None,
            ))
        }
    }
}
