//! Opening the Redis store that a properties configuration
//! ([`IdempotencyConfig`](idempotency_core::config::IdempotencyConfig)) names.

use idempotency_core::StoreError;
use idempotency_core::config::{ConfigError, IdempotencyConfig};

use crate::{RedisOptions, RedisStore};

/// Opens the Redis store `config` names (`idempotency-store-type=redis`): the URL in
/// `idempotency-redis-url` and the other `idempotency-redis-*` keys, read as the URL's
/// parameters of the same name ([`RedisOptions::from_config`], which refuses another
/// store type and any key that is not one of [`properties`](crate::properties)), then
/// connects and runs the checks at connect; a scope quota from
/// `idempotency-scope-max-*` is applied.
/// Records expire by themselves, so no purge task is needed.
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotency_core::config::ConfigError> {
/// use std::sync::Arc;
/// use idempotency_core::config::IdempotencyConfig;
///
/// let config = IdempotencyConfig::from_properties([
///     ("idempotency-enabled", "true"),
///     ("idempotency-store-type", "redis"),
///     ("idempotency-redis-url", "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"),
///     ("idempotency-redis-replica-acks", "1"),
///     ("idempotency-redis-replica-ack-timeout", "250ms"),
/// ])?;
/// let store = idempotency_store_redis::open(&config).await?;
/// let layer = config.layer(Arc::new(store));
/// # drop(layer); Ok(()) }
/// ```
pub async fn open(config: &IdempotencyConfig) -> Result<RedisStore, ConfigError> {
    let options = RedisOptions::from_config(config)?;
    let store = RedisStore::connect_with(options)
        .await
        .map_err(|error| ConfigError::Store(StoreError::backend(error)))?;
    Ok(match config.scope_quota {
        Some(quota) => store.with_scope_quota(quota),
        None => store,
    })
}
