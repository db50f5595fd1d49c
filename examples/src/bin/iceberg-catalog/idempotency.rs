//! The Idempotency-Key layer in front of the catalog, and the store it keeps its records
//! in.
//!
//! The layer is `idempotency_iceberg`'s profile: UUID keys, the spec's mutation
//! routes (with and without `{prefix}`), `ErrorModel` errors, 503 with `Retry-After` while
//! a duplicate is in flight, and the top-level `idempotency-key-lifetime` added to this
//! catalog's `GET /v1/config` answers.
//!
//! It is set up the way a catalog configured from properties would be: the command line
//! becomes `idempotency-*` properties (`--idempotency-property KEY=VALUE` adds the
//! store's own), read by [`IdempotencyConfig`], and the store that
//! `idempotency-store-type` names is opened by its crate, which reads and checks its own
//! keys. By default (`idempotency-store-type=sql`) the records live in the catalog's own
//! database, in a table of their own (`idempotency_records`): SQLite for one process,
//! PostgreSQL or MySQL for replicas, which then replay each other's answers. A
//! background task purges expired records.
//!
//! With `--idempotency-store redis://…` (or `redis+cluster://…`;
//! `idempotency-store-type=redis`) the records live in Redis or Valkey instead, one
//! server or a cluster, where they expire by themselves; the catalog's own state stays in
//! its database.
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

use idempotency_core::config::{
    ConfigError, IdempotencyConfig, PURGE_INTERVAL as PURGE_INTERVAL_KEY, STORE_TYPE,
};
use idempotency_core::iso8601::format_duration;
use idempotency_core::{IdempotencyLayer, RecordAdmin, SingleScope};
use idempotency_iceberg::{IcebergProfile, MetadataReader};
use idempotency_store_redis::properties as redis;
use idempotency_store_sql::properties as sql;
use idempotency_store_sql::{OneCommitStore, Reservations, TableName};
use sqlx::Pool;

use crate::catalog::{CatalogDatabase, Writes};

/// How often expired records are purged, unless `idempotency-purge-interval` is given.
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
    properties: &[(String, String)],
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
    let config = configuration(records, lifetime, properties)?;
    let (layer, records, finalizer) = records_layer(&config, commits, pool).await?;
    Ok((layer.with_profile(profile), records, finalizer))
}

/// The configuration the command line says: the records where `records` says, kept for
/// `lifetime`, and the `--idempotency-property` pairs, `properties`.
fn configuration(
    records: Records<'_>,
    lifetime: Duration,
    properties: &[(String, String)],
) -> Result<IdempotencyConfig, String> {
    let mut all = vec![
        ("idempotency-enabled".to_owned(), "true".to_owned()),
        (
            "idempotency-key-lifetime".to_owned(),
            format_duration(lifetime),
        ),
    ];
    match records {
        Records::Database(url) => {
            all.push((STORE_TYPE.to_owned(), sql::STORE_TYPE.to_owned()));
            all.push((sql::DATABASE_URL.to_owned(), url.to_owned()));
            if !properties.iter().any(|(key, _)| key == PURGE_INTERVAL_KEY) {
                all.push((
                    PURGE_INTERVAL_KEY.to_owned(),
                    format_duration(PURGE_INTERVAL),
                ));
            }
        }
        Records::Redis(url) => {
            all.push((STORE_TYPE.to_owned(), redis::STORE_TYPE.to_owned()));
            all.push((redis::REDIS_URL.to_owned(), url.to_owned()));
        }
    }
    all.extend(properties.iter().cloned());
    IdempotencyConfig::from_properties(all)
        .map_err(|error| format!("--idempotency-property: {error}"))
}

/// [`layer`] with the records in the store `config` names, before its profile is set.
async fn records_layer<DB: CatalogDatabase>(
    config: &IdempotencyConfig,
    commits: Commits,
    pool: &Pool<DB>,
) -> Result<
    (IdempotencyLayer, Arc<dyn RecordAdmin>, Option<Writes<DB>>),
    Box<dyn std::error::Error + Send + Sync>,
> {
    match config.store_type.as_str() {
        sql::STORE_TYPE => {
            // Reads and checks the SQL store's keys (a key it does not take is refused,
            // named), connects and migrates.
            let typed = idempotency_store_sql::open(config)
                .await
                .map_err(|error| format!("the idempotency records in --database: {error}"))?;
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
                idempotency_iceberg::layer(store.clone())
                    .with_lifetime(config.key_lifetime)
                    .with_scope(SingleScope),
                store.clone(),
                Some(Writes::with_records(store)),
            ))
        }
        redis::STORE_TYPE => {
            let store = idempotency_store_redis::open(config)
                .await
                .map_err(redis_error)?;
            // Records expire in Redis by themselves: no purge task. A clone shares the
            // connections.
            Ok((
                idempotency_iceberg::layer(store.clone())
                    .with_lifetime(config.key_lifetime)
                    .with_scope(SingleScope),
                Arc::new(store),
                None,
            ))
        }
        other => Err(format!(
            "{STORE_TYPE}={other}: this catalog keeps its records in its database ({}) or in \
             Redis ({})",
            sql::STORE_TYPE,
            redis::STORE_TYPE
        )
        .into()),
    }
}

/// What the Redis store's `error` says, naming the flag that gave what it refused.
fn redis_error(error: ConfigError) -> String {
    match error {
        // The URL, from `--idempotency-store`, cannot be used.
        ConfigError::InvalidValue {
            key: redis::REDIS_URL,
            ..
        } => format!(
            "--idempotency-store: {error}; or leave it out to keep the records in --database"
        ),
        _ => format!("the idempotency records in --idempotency-store: {error}"),
    }
}
