//! Opening the SQL store that a properties configuration
//! ([`IdempotencyConfig`](idempotency_core::config::IdempotencyConfig)) names.

use std::sync::Arc;

use idempotency_core::FullStore;
#[cfg(feature = "postgres")]
use idempotency_core::config::DATABASE_SYNCHRONOUS_REPLICATION;
use idempotency_core::config::{
    ConfigError, DATABASE_URL, IdempotencyConfig, SqlBackend, StoreType,
};

use crate::common::PoolSettings;

/// Opens the SQL store `config` names (`idempotency-store-type=sql`): connects with the
/// configured URL, user, password and pool size, checks PostgreSQL's synchronous
/// replication if `idempotency-database-synchronous-replication` (or the URL's
/// `synchronous-replication` parameter) asks for it, and migrates the schema. The purge
/// task is the caller's: `config.spawn_purge_task(store.clone())`.
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotency_core::config::ConfigError> {
/// use idempotency_core::config::IdempotencyConfig;
///
/// let config = IdempotencyConfig::from_properties([
///     ("idempotency-enabled", "true"),
///     ("idempotency-store-type", "sql"),
///     ("idempotency-database-url", "postgres://app@db/catalog"),
/// ])?;
/// let store = idempotency_store_sql::open(&config).await?;
/// config.spawn_purge_task(store.clone());
/// let layer = config.iceberg_layer(store);
/// # drop(layer); Ok(()) }
/// ```
pub async fn open(config: &IdempotencyConfig) -> Result<Arc<dyn FullStore>, ConfigError> {
    // What every backend's arm does with its connect options and its store, written once
    // (the drivers' options and the stores share no trait for it).
    #[allow(unused_macros)] // with no networked backend compiled in
    macro_rules! with_credentials {
        ($options:expr, $config:expr) => {{
            let mut options = $options;
            if let Some(user) = &$config.database_user {
                options = options.username(user);
            }
            if let Some(password) = &$config.database_password {
                options = options.password(password);
            }
            options
        }};
    }
    #[allow(unused_macros)] // with no backend compiled in
    macro_rules! ready {
        ($connect:expr, $config:expr) => {{
            let store = $connect
                .await
                .map_err(ConfigError::Store)?
                .migrate()
                .await
                .map_err(ConfigError::Store)?;
            Ok(Arc::new(match $config.scope_quota {
                Some(quota) => store.with_scope_quota(quota),
                None => store,
            }))
        }};
    }
    if config.store_type != StoreType::Sql {
        return Err(ConfigError::NotApplicable {
            key: idempotency_core::config::STORE_TYPE,
            applies_not_to: "idempotency_store_sql::open (it opens SQL stores; set idempotency-store-type=sql)",
        });
    }
    let url = config.database_url.as_deref().ok_or(ConfigError::Missing {
        key: DATABASE_URL,
        when: "idempotency-store-type=sql",
    })?;
    let backend = SqlBackend::from_url(url).ok_or_else(|| {
        ConfigError::invalid_database_url(
            url,
            "a URL starting with postgres://, postgresql://, mysql://, mariadb:// or sqlite:",
        )
    })?;
    match backend {
        SqlBackend::Postgres => {
            #[cfg(feature = "postgres")]
            {
                let (url, from_url) = crate::synchronous::split_url(url).map_err(|e| {
                    ConfigError::invalid_database_url(url, format!("a valid PostgreSQL URL ({e})"))
                })?;
                let mut settings = pool_settings(config);
                if let Some(mode) = from_url {
                    if config.database_synchronous_replication.is_some() {
                        return Err(ConfigError::DuplicateKey {
                            key: format!(
                                "{DATABASE_SYNCHRONOUS_REPLICATION} (also given as the parameter \
                                 `synchronous-replication` of {DATABASE_URL})"
                            ),
                        });
                    }
                    settings = settings.synchronous_replication(mode);
                }
                let options: sqlx::postgres::PgConnectOptions = url.parse().map_err(|e| {
                    ConfigError::invalid_database_url(&url, format!("a valid PostgreSQL URL ({e})"))
                })?;
                let options = with_credentials!(options, config);
                ready!(
                    crate::PostgresStore::connect_with(options, &settings),
                    config
                )
            }
            #[cfg(not(feature = "postgres"))]
            Err(not_compiled(url, backend))
        }
        SqlBackend::MySql => {
            #[cfg(feature = "mysql")]
            {
                let options: sqlx::mysql::MySqlConnectOptions =
                    crate::mysql::mysql_url(url).parse().map_err(|e| {
                        ConfigError::invalid_database_url(url, format!("a valid MySQL URL ({e})"))
                    })?;
                let options = with_credentials!(options, config);
                ready!(
                    crate::MySqlStore::connect_with(options, &pool_settings(config)),
                    config
                )
            }
            #[cfg(not(feature = "mysql"))]
            Err(not_compiled(url, backend))
        }
        SqlBackend::Sqlite => {
            #[cfg(feature = "sqlite")]
            {
                ready!(
                    crate::SqliteStore::connect(url, &pool_settings(config)),
                    config
                )
            }
            #[cfg(not(feature = "sqlite"))]
            Err(not_compiled(url, backend))
        }
    }
}

/// The pool settings `config` asks for (`idempotency-database-pool-size`,
/// `idempotency-database-synchronous-replication`).
pub fn pool_settings(config: &IdempotencyConfig) -> PoolSettings {
    let mut settings = PoolSettings::default();
    if let Some(size) = config.database_pool_size {
        settings = settings.max_connections(size);
    }
    if let Some(expect) = config.database_synchronous_replication {
        settings = settings.synchronous_replication(expect);
    }
    settings
}

/// The cargo feature of this crate that compiles `backend` in.
fn feature(backend: SqlBackend) -> &'static str {
    match backend {
        SqlBackend::Postgres => "postgres",
        SqlBackend::MySql => "mysql",
        SqlBackend::Sqlite => "sqlite",
    }
}

#[allow(dead_code)] // unused when every backend is compiled in
fn not_compiled(url: &str, backend: SqlBackend) -> ConfigError {
    ConfigError::invalid_database_url(
        url,
        format!(
            "a database whose backend is compiled into this build; enable the `{}` feature of idempotency-store-sql for this one",
            feature(backend)
        ),
    )
}
