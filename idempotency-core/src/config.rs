//! Configuration from a properties map, mirroring the `idempotency-*` keys of catalog
//! configurations (Gravitino's design, Iceberg catalog properties).
//!
//! This module reads and checks the properties; the store crates open what they name:
//! `MemoryStore::from_config` (idempotency-store-memory), `open` (idempotency-store-sql)
//! and `open` (idempotency-store-redis, which also reads the `idempotency-redis-*`
//! values: they are the store URL's parameters, read by one parser there).
//! [`IdempotencyConfig::layer`] builds the layer.
//!
//! ```
//! # async fn demo() -> Result<(), idempotency_core::config::ConfigError> {
//! use std::collections::HashMap;
//! use std::sync::Arc;
//! use idempotency_core::FullStore;
//! use idempotency_core::config::{IdempotencyConfig, StoreType};
//! use idempotency_store_memory::MemoryStore;
//!
//! let properties = HashMap::from([("idempotency-enabled", "true"), ("idempotency-key-lifetime", "PT1H")]);
//! let config = IdempotencyConfig::from_properties(properties)?;
//! if config.enabled {
//!     let store: Arc<dyn FullStore> = match config.store_type {
//!         StoreType::Memory => Arc::new(MemoryStore::from_config(&config)),
//!         // StoreType::Sql => idempotency_store_sql::open(&config).await?,
//!         // StoreType::Redis => Arc::new(idempotency_store_redis::open(&config).await?),
//!         _ => unimplemented!("open the other stores with their crates"),
//!     };
//!     config.spawn_purge_task(store.clone());
//!     let layer = config.layer(store);
//!     assert_eq!(layer.lifetime(), std::time::Duration::from_secs(3600));
//! }
//! # Ok(()) }
//! ```
//!
//! | key | default | value |
//! | --- | --- | --- |
//! | `idempotency-enabled` | `false` | `true` or `false` |
//! | `idempotency-key-lifetime` | `PT30M` | ISO-8601 duration (`java.time.Duration` syntax), > 0 |
//! | `idempotency-store-type` | `memory` | `memory`, `sql` or `redis` |
//! | `idempotency-max-entries` | 10,000 | memory store only: positive integer |
//! | `idempotency-database-url` | — | sql only, required: `postgres://…`, `mysql://…` / `mariadb://…`, `sqlite:…` |
//! | `idempotency-database-user` | from the URL | sql (PostgreSQL, MySQL) only |
//! | `idempotency-database-password` | from the URL | sql (PostgreSQL, MySQL) only; never printed |
//! | `idempotency-database-pool-size` | 10 | sql only: positive integer |
//! | `idempotency-database-synchronous-replication` | `off` | sql (PostgreSQL) only: `require`, `warn` or `off`; see [`SynchronousReplication`] |
//! | `idempotency-redis-url` | — | redis only, required: `redis://…`, `rediss://…`, `redis+cluster://…`, with the store's URL parameters if you like |
//! | `idempotency-redis-key-prefix` | `idempotency:` | redis only |
//! | `idempotency-redis-connect-timeout` | 2 s | redis only: a duration (`500ms`, `2s`, `PT2S`) |
//! | `idempotency-redis-operation-timeout` | 2 s | redis only: a duration |
//! | `idempotency-redis-replica-acks` | 0 (off) | redis only: replicas that must acknowledge each write |
//! | `idempotency-redis-replica-ack-timeout` | 250 ms | redis only: how long a write waits for them |
//! | `idempotency-redis-replica-ack-connections` | 2; 16 on a cluster | redis only: connections that carry the writes waiting for replicas |
//! | `idempotency-redis-accept-evicting-policy` | `false` | redis only: `true` or `false` |
//! | `idempotency-redis-cluster` | from the URL's scheme | redis only: `true` or `false` |
//! | `idempotency-purge-interval` | no purging | ISO-8601 duration, > 0 |
//! | `idempotency-scope-max-records` | no quota | positive integer: the live records one scope may hold |
//! | `idempotency-scope-max-bytes` | no quota | positive integer: the bytes one scope's records may hold |
//!
//! Each `idempotency-redis-*` key but the URL is the store URL's parameter of the same
//! name (`idempotency-redis-replica-acks=1` is `redis://…?replica-acks=1`); the Redis
//! store reads and checks their values, and refuses a setting given both ways.
//!
//! Keys that do not start with `idempotency-` are ignored, so a service can pass its
//! whole configuration map. An unknown `idempotency-*` key, a bad value, a missing URL or
//! a key that does not apply to the chosen store is an error that names the key. Only
//! the lifetime is ever shown to clients (see
//! [`IdempotencyConfig::key_lifetime_iso8601`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::iso8601::{format_duration, parse_duration};
use crate::{IdempotencyLayer, IdempotencyStore, PurgeExpired, ScopeQuota, StoreError};

/// `idempotency-enabled`
pub const ENABLED: &str = "idempotency-enabled";
/// `idempotency-key-lifetime`
pub const KEY_LIFETIME: &str = "idempotency-key-lifetime";
/// `idempotency-store-type`
pub const STORE_TYPE: &str = "idempotency-store-type";
/// `idempotency-max-entries`
pub const MAX_ENTRIES: &str = "idempotency-max-entries";
/// `idempotency-database-url`
pub const DATABASE_URL: &str = "idempotency-database-url";
/// `idempotency-database-user`
pub const DATABASE_USER: &str = "idempotency-database-user";
/// `idempotency-database-password`
pub const DATABASE_PASSWORD: &str = "idempotency-database-password";
/// `idempotency-database-pool-size`
pub const DATABASE_POOL_SIZE: &str = "idempotency-database-pool-size";
/// `idempotency-database-synchronous-replication`
pub const DATABASE_SYNCHRONOUS_REPLICATION: &str = "idempotency-database-synchronous-replication";
/// `idempotency-redis-url`
pub const REDIS_URL: &str = "idempotency-redis-url";
/// `idempotency-redis-key-prefix`
pub const REDIS_KEY_PREFIX: &str = "idempotency-redis-key-prefix";
/// `idempotency-redis-connect-timeout`
pub const REDIS_CONNECT_TIMEOUT: &str = "idempotency-redis-connect-timeout";
/// `idempotency-redis-operation-timeout`
pub const REDIS_OPERATION_TIMEOUT: &str = "idempotency-redis-operation-timeout";
/// `idempotency-redis-replica-acks`
pub const REDIS_REPLICA_ACKS: &str = "idempotency-redis-replica-acks";
/// `idempotency-redis-replica-ack-timeout`
pub const REDIS_REPLICA_ACK_TIMEOUT: &str = "idempotency-redis-replica-ack-timeout";
/// `idempotency-redis-replica-ack-connections`
pub const REDIS_REPLICA_ACK_CONNECTIONS: &str = "idempotency-redis-replica-ack-connections";
/// `idempotency-redis-accept-evicting-policy`
pub const REDIS_ACCEPT_EVICTING_POLICY: &str = "idempotency-redis-accept-evicting-policy";
/// `idempotency-redis-cluster`
pub const REDIS_CLUSTER: &str = "idempotency-redis-cluster";

/// The `idempotency-redis-*` keys other than the URL, kept as given in
/// [`IdempotencyConfig::redis_settings`]: each is the Redis store URL's parameter named
/// by the rest of the key, and the Redis store reads its value.
pub const REDIS_SETTINGS: [&str; 8] = [
    REDIS_KEY_PREFIX,
    REDIS_CONNECT_TIMEOUT,
    REDIS_OPERATION_TIMEOUT,
    REDIS_REPLICA_ACKS,
    REDIS_REPLICA_ACK_TIMEOUT,
    REDIS_REPLICA_ACK_CONNECTIONS,
    REDIS_ACCEPT_EVICTING_POLICY,
    REDIS_CLUSTER,
];

/// `idempotency-purge-interval`
pub const PURGE_INTERVAL: &str = "idempotency-purge-interval";
/// `idempotency-scope-max-records`
pub const SCOPE_MAX_RECORDS: &str = "idempotency-scope-max-records";
/// `idempotency-scope-max-bytes`
pub const SCOPE_MAX_BYTES: &str = "idempotency-scope-max-bytes";

const KNOWN_KEYS: [&str; 21] = [
    ENABLED,
    KEY_LIFETIME,
    STORE_TYPE,
    MAX_ENTRIES,
    DATABASE_URL,
    DATABASE_USER,
    DATABASE_PASSWORD,
    DATABASE_POOL_SIZE,
    DATABASE_SYNCHRONOUS_REPLICATION,
    REDIS_URL,
    REDIS_KEY_PREFIX,
    REDIS_CONNECT_TIMEOUT,
    REDIS_OPERATION_TIMEOUT,
    REDIS_REPLICA_ACKS,
    REDIS_REPLICA_ACK_TIMEOUT,
    REDIS_REPLICA_ACK_CONNECTIONS,
    REDIS_ACCEPT_EVICTING_POLICY,
    REDIS_CLUSTER,
    PURGE_INTERVAL,
    SCOPE_MAX_RECORDS,
    SCOPE_MAX_BYTES,
];

/// The default record lifetime: 30 minutes.
pub const DEFAULT_KEY_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// How many expired records the purge task deletes per statement, at most. Each batch
/// holds up the reservations that arrive while it runs, so batches are kept small (the
/// workspace's BENCHMARKS.md, "Purge under load", compares sizes).
pub const PURGE_BATCH_SIZE: usize = 100;

/// Which store the configuration builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreType {
    /// The memory store: one process only.
    Memory,
    /// A SQL store, the backend picked by the scheme of `idempotency-database-url`.
    Sql,
    /// The Redis store, at `idempotency-redis-url`.
    Redis,
}

/// Whether a SQL store checks, when it connects, that the database replicates its
/// commits synchronously (`idempotency-database-synchronous-replication`; PostgreSQL).
///
/// With asynchronous streaming replication, a failover to a standby loses the commits the
/// standby had not received yet: a lost reservation lets a duplicate run beside its
/// owner, a lost answer runs the mutation again on the next retry. An operator who relies
/// on a synchronous standby says so here, and the store checks the server it connected
/// to: `synchronous_standby_names` must name a standby and `synchronous_commit` must wait
/// for it (`on`, `remote_apply` or `remote_write`).
///
/// ```
/// use idempotency_core::config::SynchronousReplication;
///
/// assert_eq!("require".parse(), Ok(SynchronousReplication::Require));
/// assert!("yes".parse::<SynchronousReplication>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SynchronousReplication {
    /// No check (the default).
    #[default]
    Off,
    /// Connects anyway, and logs one warning that names the settings and their values.
    Warn,
    /// Refuses to connect, with an error that names the settings, their values and what
    /// to set.
    Require,
}

impl SynchronousReplication {
    /// What a value may be, for error messages.
    pub const EXPECTED: &'static str = "`require`, `warn` or `off`";
}

impl FromStr for SynchronousReplication {
    type Err = UnknownSynchronousReplication;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value.trim().to_ascii_lowercase().as_str() {
            "off" => Ok(Self::Off),
            "warn" => Ok(Self::Warn),
            "require" => Ok(Self::Require),
            _ => Err(UnknownSynchronousReplication),
        }
    }
}

impl fmt::Display for SynchronousReplication {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Warn => "warn",
            Self::Require => "require",
        })
    }
}

/// A value that is not one of [`SynchronousReplication::EXPECTED`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("expected `require`, `warn` or `off`")]
pub struct UnknownSynchronousReplication;

/// The SQL backends, as picked from a database URL's scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SqlBackend {
    /// `postgres://` or `postgresql://`
    Postgres,
    /// `mysql://` or `mariadb://`
    MySql,
    /// `sqlite:`
    Sqlite,
}

impl SqlBackend {
    /// The backend a URL names, by its scheme.
    pub fn from_url(url: &str) -> Option<Self> {
        let scheme = url.split_once(':')?.0.to_ascii_lowercase();
        match scheme.as_str() {
            "postgres" | "postgresql" => Some(Self::Postgres),
            "mysql" | "mariadb" => Some(Self::MySql),
            "sqlite" => Some(Self::Sqlite),
            _ => None,
        }
    }
}

/// The idempotency settings of a service, read from its properties.
///
/// ```
/// use std::collections::HashMap;
/// use std::time::Duration;
/// use idempotency_core::config::{IdempotencyConfig, StoreType};
///
/// let properties = HashMap::from([
///     ("idempotency-enabled".to_owned(), "true".to_owned()),
///     ("idempotency-key-lifetime".to_owned(), "PT1H".to_owned()),
///     ("idempotency-store-type".to_owned(), "sql".to_owned()),
///     ("idempotency-database-url".to_owned(), "sqlite:/tmp/idempotency.db".to_owned()),
///     ("catalog-name".to_owned(), "ignored: not an idempotency-* key".to_owned()),
/// ]);
/// let config = IdempotencyConfig::from_properties(&properties)?;
/// assert!(config.enabled);
/// assert_eq!(config.key_lifetime, Duration::from_secs(3600));
/// assert_eq!(config.store_type, StoreType::Sql);
/// assert_eq!(config.key_lifetime_iso8601(), "PT1H");
/// # Ok::<(), idempotency_core::config::ConfigError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotencyConfig {
    /// `idempotency-enabled`: whether the layer takes part at all (default `false`).
    pub enabled: bool,
    /// `idempotency-key-lifetime`: how long a record lives (default 30 minutes).
    pub key_lifetime: Duration,
    /// `idempotency-store-type` (default memory).
    pub store_type: StoreType,
    /// `idempotency-max-entries`: the memory store's bound (default 10,000).
    pub max_entries: Option<usize>,
    /// `idempotency-database-url`.
    pub database_url: Option<String>,
    /// `idempotency-database-user`: overrides the URL's user.
    pub database_user: Option<String>,
    /// `idempotency-database-password`: overrides the URL's password. Never printed.
    pub database_password: Option<String>,
    /// `idempotency-database-pool-size` (default 10).
    pub database_pool_size: Option<u32>,
    /// `idempotency-database-synchronous-replication` (default: no check).
    pub database_synchronous_replication: Option<SynchronousReplication>,
    /// `idempotency-redis-url`.
    pub redis_url: Option<String>,
    /// The other `idempotency-redis-*` keys ([`REDIS_SETTINGS`]) and their values, trimmed
    /// but otherwise as given: the Redis store reads them.
    pub redis_settings: BTreeMap<&'static str, String>,
    /// `idempotency-purge-interval`: how often expired records are purged (default:
    /// never; expired records still count as absent).
    pub purge_interval: Option<Duration>,
    /// `idempotency-scope-max-records` and `idempotency-scope-max-bytes`: what one scope
    /// may hold (default: no quota).
    pub scope_quota: Option<ScopeQuota>,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            key_lifetime: DEFAULT_KEY_LIFETIME,
            store_type: StoreType::Memory,
            max_entries: None,
            database_url: None,
            database_user: None,
            database_password: None,
            database_pool_size: None,
            database_synchronous_replication: None,
            redis_url: None,
            redis_settings: BTreeMap::new(),
            purge_interval: None,
            scope_quota: None,
        }
    }
}

impl fmt::Debug for IdempotencyConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyConfig")
            .field("enabled", &self.enabled)
            .field("key_lifetime", &self.key_lifetime)
            .field("store_type", &self.store_type)
            .field("max_entries", &self.max_entries)
            .field(
                "database_url",
                &self.database_url.as_deref().map(redact_url),
            )
            .field("database_user", &self.database_user)
            .field(
                "database_password",
                &self.database_password.as_ref().map(|_| "***"),
            )
            .field("database_pool_size", &self.database_pool_size)
            .field(
                "database_synchronous_replication",
                &self.database_synchronous_replication,
            )
            .field("redis_url", &self.redis_url.as_deref().map(redact_url))
            .field("redis_settings", &self.redis_settings)
            .field("purge_interval", &self.purge_interval)
            .field("scope_quota", &self.scope_quota)
            .finish()
    }
}

/// What is wrong with a configuration, naming the key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An `idempotency-*` key this crate does not know (often a typo).
    #[error(
        "unknown property `{key}`; the idempotency properties are: idempotency-enabled, idempotency-key-lifetime, idempotency-store-type, idempotency-max-entries, idempotency-database-url, idempotency-database-user, idempotency-database-password, idempotency-database-pool-size, idempotency-database-synchronous-replication, idempotency-redis-url, idempotency-redis-key-prefix, idempotency-redis-connect-timeout, idempotency-redis-operation-timeout, idempotency-redis-replica-acks, idempotency-redis-replica-ack-timeout, idempotency-redis-replica-ack-connections, idempotency-redis-accept-evicting-policy, idempotency-redis-cluster, idempotency-purge-interval, idempotency-scope-max-records, idempotency-scope-max-bytes"
    )]
    UnknownKey {
        /// The key as given.
        key: String,
    },
    /// The same key was given twice.
    #[error("property `{key}` is given more than once")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// A value that cannot be used.
    #[error("invalid value {value:?} for `{key}`: expected {expected}")]
    InvalidValue {
        /// The key.
        key: &'static str,
        /// The value as given (a URL with its password masked).
        value: String,
        /// What the key accepts.
        expected: String,
    },
    /// A key that the chosen store needs is missing.
    #[error("`{key}` is required when {when}")]
    Missing {
        /// The key.
        key: &'static str,
        /// Which setting needs it.
        when: &'static str,
    },
    /// A key that does not apply to the chosen store (it would be silently ignored).
    #[error("`{key}` does not apply to {applies_not_to}; remove it or change {STORE_TYPE}")]
    NotApplicable {
        /// The key.
        key: &'static str,
        /// The store it does not apply to.
        applies_not_to: &'static str,
    },
    /// Opening, migrating or checking the store failed.
    #[error("could not open the idempotency store: {0}")]
    Store(#[source] StoreError),
}

impl ConfigError {
    /// `idempotency-database-url` cannot be used, and what is `expected` instead; the URL
    /// is shown with its password masked. For store crates that open the database.
    pub fn invalid_database_url(url: &str, expected: impl Into<String>) -> Self {
        invalid(DATABASE_URL, &redact_url(url), expected)
    }

    /// `key` has a `value` that cannot be used, and what is `expected` instead. For store
    /// crates that read their own keys' values (`value` must not hold a secret).
    pub fn invalid_value(
        key: &'static str,
        value: impl Into<String>,
        expected: impl Into<String>,
    ) -> Self {
        ConfigError::InvalidValue {
            key,
            value: value.into(),
            expected: expected.into(),
        }
    }
}

fn invalid(key: &'static str, value: &str, expected: impl Into<String>) -> ConfigError {
    ConfigError::InvalidValue {
        key,
        value: value.to_owned(),
        expected: expected.into(),
    }
}

impl IdempotencyConfig {
    /// Reads the `idempotency-*` keys from `properties` (a `&HashMap<String, String>` or
    /// any iterator of key/value pairs), ignoring every other key. Values are trimmed.
    pub fn from_properties<I, K, V>(properties: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut seen: HashMap<&'static str, String> = HashMap::new();
        for (key, value) in properties {
            let key = key.as_ref();
            if !key.starts_with("idempotency-") {
                continue;
            }
            let known = KNOWN_KEYS
                .iter()
                .find(|known| **known == key)
                .ok_or_else(|| ConfigError::UnknownKey {
                    key: key.to_owned(),
                })?;
            if seen
                .insert(known, value.as_ref().trim().to_owned())
                .is_some()
            {
                return Err(ConfigError::DuplicateKey {
                    key: key.to_owned(),
                });
            }
        }

        let mut config = Self::default();
        if let Some(value) = seen.get(ENABLED) {
            config.enabled = match value.to_ascii_lowercase().as_str() {
                "true" => true,
                "false" => false,
                _ => return Err(invalid(ENABLED, value, "`true` or `false`")),
            };
        }
        if let Some(value) = seen.get(KEY_LIFETIME) {
            config.key_lifetime = positive_duration(KEY_LIFETIME, value)?;
        }
        if let Some(value) = seen.get(STORE_TYPE) {
            config.store_type = match value.to_ascii_lowercase().as_str() {
                "memory" => StoreType::Memory,
                "sql" => StoreType::Sql,
                "redis" => StoreType::Redis,
                _ => return Err(invalid(STORE_TYPE, value, "`memory`, `sql` or `redis`")),
            };
        }
        if let Some(value) = seen.get(MAX_ENTRIES) {
            config.max_entries = Some(positive_integer(MAX_ENTRIES, value)?);
        }
        if let Some(value) = seen.get(DATABASE_URL) {
            if SqlBackend::from_url(value).is_none() {
                return Err(ConfigError::invalid_database_url(
                    value,
                    "a URL starting with postgres://, postgresql://, mysql://, mariadb:// or sqlite:",
                ));
            }
            config.database_url = Some(value.clone());
        }
        if let Some(value) = seen.get(DATABASE_USER) {
            if value.is_empty() {
                return Err(invalid(DATABASE_USER, value, "a non-empty user name"));
            }
            config.database_user = Some(value.clone());
        }
        if let Some(value) = seen.get(DATABASE_PASSWORD) {
            config.database_password = Some(value.clone());
        }
        if let Some(value) = seen.get(DATABASE_POOL_SIZE) {
            config.database_pool_size = Some(positive_integer(DATABASE_POOL_SIZE, value)?);
        }
        if let Some(value) = seen.get(DATABASE_SYNCHRONOUS_REPLICATION) {
            config.database_synchronous_replication = Some(value.parse().map_err(|_| {
                invalid(
                    DATABASE_SYNCHRONOUS_REPLICATION,
                    value,
                    SynchronousReplication::EXPECTED,
                )
            })?);
        }
        if let Some(value) = seen.get(REDIS_URL) {
            if value.is_empty() {
                return Err(invalid(REDIS_URL, value, "a redis:// URL"));
            }
            config.redis_url = Some(value.clone());
        }
        for key in REDIS_SETTINGS {
            if let Some(value) = seen.get(key) {
                config.redis_settings.insert(key, value.clone());
            }
        }
        if let Some(value) = seen.get(PURGE_INTERVAL) {
            config.purge_interval = Some(positive_duration(PURGE_INTERVAL, value)?);
        }
        if let Some(value) = seen.get(SCOPE_MAX_RECORDS) {
            let quota = config.scope_quota.unwrap_or_default();
            config.scope_quota =
                Some(quota.with_max_records(positive_integer(SCOPE_MAX_RECORDS, value)?));
        }
        if let Some(value) = seen.get(SCOPE_MAX_BYTES) {
            let quota = config.scope_quota.unwrap_or_default();
            config.scope_quota =
                Some(quota.with_max_bytes(positive_integer(SCOPE_MAX_BYTES, value)?));
        }
        config.check_combination()?;
        Ok(config)
    }

    fn check_combination(&self) -> Result<(), ConfigError> {
        let (store_type, needs) = match self.store_type {
            StoreType::Memory => ("idempotency-store-type=memory", None),
            StoreType::Sql => ("idempotency-store-type=sql", Some(DATABASE_URL)),
            StoreType::Redis => ("idempotency-store-type=redis", Some(REDIS_URL)),
        };
        let memory_keys = [(MAX_ENTRIES, self.max_entries.is_some())];
        let sql_keys = [
            (DATABASE_URL, self.database_url.is_some()),
            (DATABASE_USER, self.database_user.is_some()),
            (DATABASE_PASSWORD, self.database_password.is_some()),
            (DATABASE_POOL_SIZE, self.database_pool_size.is_some()),
            (
                DATABASE_SYNCHRONOUS_REPLICATION,
                self.database_synchronous_replication.is_some(),
            ),
        ];
        let redis_keys = std::iter::once((REDIS_URL, self.redis_url.is_some())).chain(
            REDIS_SETTINGS
                .into_iter()
                .map(|key| (key, self.redis_settings.contains_key(key))),
        );
        let foreign: Vec<(&'static str, bool)> = match self.store_type {
            StoreType::Memory => sql_keys.into_iter().chain(redis_keys).collect(),
            StoreType::Sql => memory_keys.into_iter().chain(redis_keys).collect(),
            StoreType::Redis => memory_keys.into_iter().chain(sql_keys).collect(),
        };
        if let Some((key, _)) = foreign.into_iter().find(|(_, set)| *set) {
            return Err(ConfigError::NotApplicable {
                key,
                applies_not_to: store_type,
            });
        }
        if let Some(key) = needs {
            let given = match self.store_type {
                StoreType::Redis => self.redis_url.is_some(),
                _ => self.database_url.is_some(),
            };
            if !given {
                return Err(ConfigError::Missing {
                    key,
                    when: store_type,
                });
            }
        }
        if self.store_type == StoreType::Sql {
            let backend = self.sql_backend();
            let not_for = |backend| match backend {
                Some(SqlBackend::Sqlite) => "a sqlite: database",
                _ => "a mysql:// or mariadb:// database",
            };
            if backend == Some(SqlBackend::Sqlite) {
                for (key, set) in [
                    (DATABASE_USER, self.database_user.is_some()),
                    (DATABASE_PASSWORD, self.database_password.is_some()),
                ] {
                    if set {
                        return Err(ConfigError::NotApplicable {
                            key,
                            applies_not_to: not_for(backend),
                        });
                    }
                }
            }
            if backend != Some(SqlBackend::Postgres)
                && self.database_synchronous_replication.is_some()
            {
                return Err(ConfigError::NotApplicable {
                    key: DATABASE_SYNCHRONOUS_REPLICATION,
                    applies_not_to: not_for(backend),
                });
            }
        }
        Ok(())
    }

    /// The lifetime as the ISO-8601 duration to advertise in the Iceberg `/v1/config`
    /// response (`PT30M` by default): the only setting ever shown to clients.
    pub fn key_lifetime_iso8601(&self) -> String {
        format_duration(self.key_lifetime)
    }

    /// The SQL backend the database URL names, if the store type is `sql`.
    pub fn sql_backend(&self) -> Option<SqlBackend> {
        match self.store_type {
            StoreType::Sql => self.database_url.as_deref().and_then(SqlBackend::from_url),
            StoreType::Memory | StoreType::Redis => None,
        }
    }

    /// A layer over `store` with the configured lifetime and the layer's other defaults
    /// (plain HTTP). Further options are the layer's builder methods; for an Iceberg
    /// catalog use [`iceberg_layer`](Self::iceberg_layer).
    pub fn layer(&self, store: Arc<dyn IdempotencyStore>) -> IdempotencyLayer {
        IdempotencyLayer::from_shared_store(store).with_lifetime(self.key_lifetime)
    }

    /// [`IdempotencyLayer::iceberg`] over `store`, with the configured lifetime (which it
    /// advertises in `GET /v1/config`). Feature `iceberg`.
    #[cfg(feature = "iceberg")]
    pub fn iceberg_layer(&self, store: Arc<dyn IdempotencyStore>) -> IdempotencyLayer {
        IdempotencyLayer::iceberg(store).with_lifetime(self.key_lifetime)
    }

    /// Starts the purge task on `store` when `idempotency-purge-interval` is set (it must
    /// run inside a tokio runtime), in batches of [`PURGE_BATCH_SIZE`].
    pub fn spawn_purge_task(
        &self,
        store: Arc<dyn PurgeExpired>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        self.purge_interval
            .map(|interval| crate::spawn_purge_task(store, interval, PURGE_BATCH_SIZE))
    }
}

fn positive_duration(key: &'static str, value: &str) -> Result<Duration, ConfigError> {
    let expected = "a positive ISO-8601 duration such as PT30M, PT1H, PT90S or P1D";
    match parse_duration(value) {
        Ok(duration) if duration > Duration::ZERO => Ok(duration),
        Ok(_) => Err(invalid(key, value, expected)),
        Err(error) => Err(invalid(
            key,
            value,
            format!("{expected} ({})", error.reason()),
        )),
    }
}

fn positive_integer<T: std::str::FromStr + PartialOrd + From<u8>>(
    key: &'static str,
    value: &str,
) -> Result<T, ConfigError> {
    match value.parse::<T>() {
        Ok(number) if number >= T::from(1) => Ok(number),
        _ => Err(invalid(key, value, "a positive integer")),
    }
}

/// The URL with any password masked, for messages and `Debug`.
fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = url.find("://") {
        let authority_start = scheme_end + 3;
        let rest = &url[authority_start..];
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let authority = &rest[..authority_end];
        if let Some(at) = authority.rfind('@')
            && let Some(colon) = authority[..at].find(':')
        {
            out = format!(
                "{}{}:***{}",
                &url[..authority_start],
                &authority[..colon],
                &url[authority_start + at..]
            );
        }
    }
    // A password given as a query parameter (`?password=…`).
    if let Some(start) = out.find("password=") {
        let value_start = start + "password=".len();
        let value_end = out[value_start..]
            .find('&')
            .map_or(out.len(), |end| value_start + end);
        out.replace_range(value_start..value_end, "***");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/x?sslmode=disable"),
            "postgres://app:***@db:5432/x?sslmode=disable"
        );
        assert_eq!(redact_url("mysql://root@db/x"), "mysql://root@db/x");
        assert_eq!(
            redact_url("postgres://db/x?user=a&password=b&x=1"),
            "postgres://db/x?user=a&password=***&x=1"
        );
        assert_eq!(redact_url("sqlite:/tmp/a.db"), "sqlite:/tmp/a.db");
    }
}
