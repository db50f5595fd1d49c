//! Configuration from a properties map, mirroring the `idempotency-*` keys of catalog
//! configurations (Gravitino's design, catalog properties).
//!
//! [`IdempotencyConfig::from_properties`] reads the keys every store shares (the table
//! below) and keeps every other `idempotency-*` key, unread, in
//! [`StoreProperties`] (`config.store_properties`), for the store that
//! `idempotency-store-type` names. Each store crate documents its own keys, and reads and
//! checks them when it opens its store from the configuration (the memory store:
//! `MemoryStore::from_config(&config)?`): a key it does not know is refused there, with
//! an error that names the key, the store type and the keys that store takes. A store of
//! your own reads its keys the same way ([`IdempotencyConfig::store_properties_for`];
//! this crate's `examples/custom_store.rs` shows one).
//! [`IdempotencyConfig::layer`] builds the layer.
//!
//! ```
//! # async fn demo() -> Result<(), idempotency_core::config::ConfigError> {
//! use std::collections::HashMap;
//! use std::sync::Arc;
//! use idempotency_core::FullStore;
//! use idempotency_core::config::{ConfigError, IdempotencyConfig};
//! use idempotency_store_memory::MemoryStore;
//!
//! let properties = HashMap::from([
//!     ("idempotency-enabled", "true"),
//!     ("idempotency-key-lifetime", "PT1H"),
//!     ("idempotency-max-entries", "50000"), // the memory store's key
//! ]);
//! let config = IdempotencyConfig::from_properties(properties)?;
//! if config.enabled {
//!     // Open the store the configuration names with the crate that provides it.
//!     let store: Arc<dyn FullStore> = match config.store_type.as_str() {
//!         "memory" => Arc::new(MemoryStore::from_config(&config)?),
//!         other => return Err(ConfigError::invalid_value(
//!             idempotency_core::config::STORE_TYPE,
//!             other,
//!             "a store this service is built with: `memory`",
//!         )),
//!     };
//!     config.spawn_purge_task(store.clone());
//!     let layer = config.layer(store);
//!     assert_eq!(layer.lifetime(), std::time::Duration::from_secs(3600));
//! }
//! # Ok(()) }
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
//! ```
//!
//! | key | default | value |
//! | --- | --- | --- |
//! | `idempotency-enabled` | `false` | `true` or `false` |
//! | `idempotency-key-lifetime` | `PT30M` | ISO-8601 duration (`java.time.Duration` syntax), > 0 |
//! | `idempotency-store-type` | `memory` | the name of the store, lowercase: `memory` (idempotency-store-memory) or the name another store crate documents |
//! | `idempotency-purge-interval` | no purging | ISO-8601 duration, > 0 |
//! | `idempotency-scope-max-records` | no quota | positive integer: the live records one scope may hold |
//! | `idempotency-scope-max-bytes` | no quota | positive integer: the bytes one scope's records may hold |
//! | any other `idempotency-*` key | — | the store's own: see its crate |
//!
//! Keys that do not start with `idempotency-` are ignored, so a service can pass its
//! whole configuration map. A bad value of a key above, or any `idempotency-*` key given
//! twice, is an error that names the key. Only the lifetime is ever shown to clients
//! (see [`IdempotencyConfig::key_lifetime_iso8601`]); the store's values are never
//! printed, not even by `Debug` (they may hold passwords).

use std::collections::BTreeMap;
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
/// `idempotency-purge-interval`
pub const PURGE_INTERVAL: &str = "idempotency-purge-interval";
/// `idempotency-scope-max-records`
pub const SCOPE_MAX_RECORDS: &str = "idempotency-scope-max-records";
/// `idempotency-scope-max-bytes`
pub const SCOPE_MAX_BYTES: &str = "idempotency-scope-max-bytes";

/// The keys [`IdempotencyConfig::from_properties`] reads itself, whatever the store; every
/// other `idempotency-*` key goes to the store, in [`StoreProperties`].
pub const KEYS: [&str; 6] = [
    ENABLED,
    KEY_LIFETIME,
    STORE_TYPE,
    PURGE_INTERVAL,
    SCOPE_MAX_RECORDS,
    SCOPE_MAX_BYTES,
];

/// The store type when `idempotency-store-type` is not given: `memory`.
pub const DEFAULT_STORE_TYPE: &str = "memory";

/// The default record lifetime: 30 minutes.
pub const DEFAULT_KEY_LIFETIME: Duration = Duration::from_secs(30 * 60);

/// How many expired records the purge task deletes per statement, at most. Each batch
/// holds up the reservations that arrive while it runs, so batches are kept small (the
/// workspace's BENCHMARKS.md, "Purge under load", compares sizes).
pub const PURGE_BATCH_SIZE: usize = 100;

/// The idempotency settings of a service, read from its properties.
///
/// ```
/// use std::collections::HashMap;
/// use std::time::Duration;
/// use idempotency_core::config::IdempotencyConfig;
///
/// let properties = HashMap::from([
///     ("idempotency-enabled".to_owned(), "true".to_owned()),
///     ("idempotency-key-lifetime".to_owned(), "PT1H".to_owned()),
///     ("idempotency-store-type".to_owned(), "Custom".to_owned()),
///     ("idempotency-custom-path".to_owned(), " /var/lib/records ".to_owned()),
///     ("catalog-name".to_owned(), "ignored: not an idempotency-* key".to_owned()),
/// ]);
/// let config = IdempotencyConfig::from_properties(&properties)?;
/// assert!(config.enabled);
/// assert_eq!(config.key_lifetime, Duration::from_secs(3600));
/// assert_eq!(config.store_type, "custom");
/// assert_eq!(config.key_lifetime_iso8601(), "PT1H");
/// // The store's own key, trimmed, for the store to read and check.
/// assert_eq!(config.store_properties.get("idempotency-custom-path"), Some("/var/lib/records"));
/// # Ok::<(), idempotency_core::config::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotencyConfig {
    /// `idempotency-enabled`: whether the layer takes part at all (default `false`).
    pub enabled: bool,
    /// `idempotency-key-lifetime`: how long a record lives (default 30 minutes).
    pub key_lifetime: Duration,
    /// `idempotency-store-type`, lowercase: the name of the store that keeps the records
    /// (default [`DEFAULT_STORE_TYPE`], `memory`). The store crate that has this name
    /// opens it.
    pub store_type: String,
    /// Every `idempotency-*` key but [`KEYS`]: the store's own, which the store reads and
    /// checks when it is opened.
    pub store_properties: StoreProperties,
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
            store_type: DEFAULT_STORE_TYPE.to_owned(),
            store_properties: StoreProperties::default(),
            purge_interval: None,
            scope_quota: None,
        }
    }
}

/// The `idempotency-*` properties that are the store's own (every key but [`KEYS`]),
/// trimmed and otherwise as given: [`IdempotencyConfig::store_properties`].
///
/// A store reads them when it is opened: it checks its store type and that each key is
/// one it knows ([`IdempotencyConfig::store_properties_for`]), then
/// reads each value with [`get`](Self::get) or a parsing helper, which names the key in
/// its error.
///
/// `Debug` shows the keys, never the values: they may hold passwords, or URLs with
/// passwords.
///
/// ```
/// use idempotency_core::config::IdempotencyConfig;
///
/// let config = IdempotencyConfig::from_properties([
///     ("idempotency-store-type", "custom"),
///     ("idempotency-custom-password", "s3cret"),
/// ])?;
/// let properties = &config.store_properties;
/// assert_eq!(properties.get("idempotency-custom-password"), Some("s3cret"));
/// assert_eq!(properties.get("idempotency-custom-user"), None);
/// assert!(!format!("{config:?}").contains("s3cret"));
/// # Ok::<(), idempotency_core::config::ConfigError>(())
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StoreProperties {
    values: BTreeMap<String, String>,
}

impl fmt::Debug for StoreProperties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreProperties")
            .field("keys", &self.values.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl StoreProperties {
    /// The value of `key`, trimmed, if it was given.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    /// The keys given, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.values.keys().map(String::as_str)
    }

    /// Checks that every key is one the store `store_type` takes (`accepted`), so that a
    /// misspelt key, or another store's, is refused rather than ignored. The error names
    /// the first key that is not, the store type and the keys the store takes.
    ///
    /// ```
    /// use idempotency_core::config::{ConfigError, IdempotencyConfig};
    ///
    /// let config = IdempotencyConfig::from_properties([
    ///     ("idempotency-store-type", "custom"),
    ///     ("idempotency-custom-pth", "/var/lib/records"),
    /// ])?;
    /// let error = config
    ///     .store_properties_for("custom", &["idempotency-custom-path"])
    ///     .unwrap_err();
    /// assert!(matches!(error, ConfigError::UnknownKey { .. }));
    /// let message = error.to_string();
    /// assert!(message.contains("`idempotency-custom-pth`"), "{message}");
    /// assert!(message.contains("idempotency-store-type=custom"), "{message}");
    /// assert!(message.contains("idempotency-custom-path"), "{message}");
    /// # Ok::<(), ConfigError>(())
    /// ```
    pub(crate) fn check_keys(
        &self,
        store_type: &str,
        accepted: &[&str],
    ) -> Result<(), ConfigError> {
        match self.keys().find(|key| !accepted.contains(key)) {
            Some(key) => Err(ConfigError::UnknownKey {
                key: key.to_owned(),
                store_type: store_type.to_owned(),
                accepted: accepted.iter().map(|key| (*key).to_owned()).collect(),
            }),
            None => Ok(()),
        }
    }

    /// The value of `key` as a positive integer (1 or more), if it was given.
    ///
    /// ```
    /// use idempotency_core::config::IdempotencyConfig;
    ///
    /// let config = IdempotencyConfig::from_properties([
    ///     ("idempotency-custom-connections", "8"),
    ///     ("idempotency-custom-shards", "0"),
    /// ])?;
    /// let properties = &config.store_properties;
    /// assert_eq!(properties.positive_integer::<u32>("idempotency-custom-connections")?, Some(8));
    /// assert_eq!(properties.positive_integer::<u32>("idempotency-custom-retries")?, None);
    /// let error = properties.positive_integer::<u32>("idempotency-custom-shards").unwrap_err();
    /// assert_eq!(
    ///     error.to_string(),
    ///     "invalid value \"0\" for `idempotency-custom-shards`: expected a positive integer"
    /// );
    /// # Ok::<(), idempotency_core::config::ConfigError>(())
    /// ```
    pub fn positive_integer<T>(&self, key: &'static str) -> Result<Option<T>, ConfigError>
    where
        T: FromStr + PartialOrd + From<u8>,
    {
        self.get(key)
            .map(|value| positive_integer(key, value))
            .transpose()
    }

    /// The value of `key` as a positive ISO-8601 duration (`PT30M`, `PT0.5S`, `P1D`), if
    /// it was given.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_core::config::IdempotencyConfig;
    ///
    /// let config = IdempotencyConfig::from_properties([
    ///     ("idempotency-custom-timeout", "PT2S"),
    ///     ("idempotency-custom-backoff", "2s"),
    /// ])?;
    /// let properties = &config.store_properties;
    /// assert_eq!(properties.duration("idempotency-custom-timeout")?, Some(Duration::from_secs(2)));
    /// let error = properties.duration("idempotency-custom-backoff").unwrap_err().to_string();
    /// assert!(error.contains("`idempotency-custom-backoff`") && error.contains("PT30M"), "{error}");
    /// # Ok::<(), idempotency_core::config::ConfigError>(())
    /// ```
    pub fn duration(&self, key: &'static str) -> Result<Option<Duration>, ConfigError> {
        self.get(key)
            .map(|value| positive_duration(key, value))
            .transpose()
    }

    /// The value of `key` as `true` or `false` (in any case), if it was given.
    ///
    /// ```
    /// use idempotency_core::config::IdempotencyConfig;
    ///
    /// let config = IdempotencyConfig::from_properties([
    ///     ("idempotency-custom-compress", "TRUE"),
    ///     ("idempotency-custom-verify", "yes"),
    /// ])?;
    /// let properties = &config.store_properties;
    /// assert_eq!(properties.boolean("idempotency-custom-compress")?, Some(true));
    /// assert!(properties.boolean("idempotency-custom-verify").is_err());
    /// # Ok::<(), idempotency_core::config::ConfigError>(())
    /// ```
    pub fn boolean(&self, key: &'static str) -> Result<Option<bool>, ConfigError> {
        self.get(key).map(|value| boolean(key, value)).transpose()
    }
}

/// What is wrong with a configuration, naming the key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An `idempotency-*` key that the chosen store does not take: misspelt, or another
    /// store's.
    #[error(
        "unknown property `{key}` for idempotency-store-type={store_type}: the {store_type} \
         store takes {}, and every store takes {}; correct or remove the key, or set \
         idempotency-store-type to the store it belongs to",
        list_or_none(.accepted),
        KEYS.join(", ")
    )]
    UnknownKey {
        /// The key as given.
        key: String,
        /// The store type (`idempotency-store-type`).
        store_type: String,
        /// The keys that store takes, besides [`KEYS`].
        accepted: Vec<String>,
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
    /// A key the store knows that does not apply to the rest of its configuration (it
    /// would be silently ignored).
    #[error("`{key}` does not apply to {applies_not_to}; remove it")]
    NotApplicable {
        /// The key.
        key: &'static str,
        /// What it does not apply to.
        applies_not_to: &'static str,
    },
    /// Opening, migrating or checking the store failed.
    #[error("could not open the idempotency store: {0}")]
    Store(#[source] StoreError),
}

fn list_or_none(keys: &[String]) -> String {
    if keys.is_empty() {
        "no keys of its own".to_owned()
    } else {
        keys.join(", ")
    }
}

impl ConfigError {
    /// `key` has a `value` that cannot be used, and what is `expected` instead. For store
    /// crates that read their own keys' values (`value` must not hold a secret: mask a
    /// URL's password first).
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

impl IdempotencyConfig {
    /// Reads the `idempotency-*` keys from `properties` (a `&HashMap<String, String>` or
    /// any iterator of key/value pairs), ignoring every other key. Values are trimmed.
    /// The keys in [`KEYS`] are read and checked here; every other `idempotency-*` key is
    /// kept in [`store_properties`](Self::store_properties), for the store to read and
    /// check when it is opened.
    pub fn from_properties<I, K, V>(properties: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut store_properties = StoreProperties::default();
        for (key, value) in properties {
            let key = key.as_ref();
            if !key.starts_with("idempotency-") {
                continue;
            }
            let value = value.as_ref().trim().to_owned();
            if store_properties
                .values
                .insert(key.to_owned(), value)
                .is_some()
            {
                return Err(ConfigError::DuplicateKey {
                    key: key.to_owned(),
                });
            }
        }
        let general = StoreProperties {
            values: KEYS
                .iter()
                .filter_map(|key| store_properties.values.remove_entry(*key))
                .collect(),
        };

        let mut config = Self {
            store_properties,
            ..Self::default()
        };
        if let Some(enabled) = general.boolean(ENABLED)? {
            config.enabled = enabled;
        }
        if let Some(lifetime) = general.duration(KEY_LIFETIME)? {
            config.key_lifetime = lifetime;
        }
        if let Some(value) = general.get(STORE_TYPE) {
            if value.is_empty() {
                return Err(invalid(
                    STORE_TYPE,
                    value,
                    "the name of a store, such as `memory`",
                ));
            }
            config.store_type = value.to_ascii_lowercase();
        }
        config.purge_interval = general.duration(PURGE_INTERVAL)?;
        if let Some(records) = general.positive_integer(SCOPE_MAX_RECORDS)? {
            let quota = config.scope_quota.unwrap_or_default();
            config.scope_quota = Some(quota.with_max_records(records));
        }
        if let Some(bytes) = general.positive_integer(SCOPE_MAX_BYTES)? {
            let quota = config.scope_quota.unwrap_or_default();
            config.scope_quota = Some(quota.with_max_bytes(bytes));
        }
        Ok(config)
    }

    /// The store properties, for the store named `store_type` that takes the keys
    /// `accepted`, once checked: the configuration must name that store
    /// (`idempotency-store-type`), and every store property must be one of `accepted`.
    /// A store crate calls this first when it opens
    /// its store from a configuration.
    ///
    /// ```
    /// use idempotency_core::config::IdempotencyConfig;
    ///
    /// const KEYS: [&str; 1] = ["idempotency-custom-path"];
    /// let config = IdempotencyConfig::from_properties([
    ///     ("idempotency-store-type", "custom"),
    ///     ("idempotency-custom-path", "/var/lib/records"),
    /// ])?;
    /// let properties = config.store_properties_for("custom", &KEYS)?;
    /// assert_eq!(properties.get("idempotency-custom-path"), Some("/var/lib/records"));
    ///
    /// // Another store's opener refuses it, naming the key.
    /// let error = config.store_properties_for("memory", &[]).unwrap_err().to_string();
    /// assert!(error.contains("`idempotency-store-type`"), "{error}");
    /// # Ok::<(), idempotency_core::config::ConfigError>(())
    /// ```
    pub fn store_properties_for(
        &self,
        store_type: &str,
        accepted: &[&str],
    ) -> Result<&StoreProperties, ConfigError> {
        if self.store_type != store_type {
            return Err(invalid(
                STORE_TYPE,
                &self.store_type,
                format!(
                    "`{store_type}`: this opens the {store_type} store; open a `{}` store \
                     with the crate that provides it, or set {STORE_TYPE}={store_type}",
                    self.store_type
                ),
            ));
        }
        self.store_properties.check_keys(store_type, accepted)?;
        Ok(&self.store_properties)
    }

    /// The lifetime as the ISO-8601 duration to advertise to clients (`PT30M` by
    /// default), e.g. in a catalog's config response: the only setting ever shown to them.
    pub fn key_lifetime_iso8601(&self) -> String {
        format_duration(self.key_lifetime)
    }

    /// A layer over `store` with the configured lifetime and the layer's other defaults
    /// (plain HTTP). Further options are the layer's builder methods; a profile crate's
    /// own layer takes the lifetime the same way: `.with_lifetime(config.key_lifetime)`.
    pub fn layer(&self, store: Arc<dyn IdempotencyStore>) -> IdempotencyLayer {
        IdempotencyLayer::from_shared_store(store).with_lifetime(self.key_lifetime)
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

fn invalid(key: &'static str, value: &str, expected: impl Into<String>) -> ConfigError {
    ConfigError::invalid_value(key, value, expected)
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

fn positive_integer<T: FromStr + PartialOrd + From<u8>>(
    key: &'static str,
    value: &str,
) -> Result<T, ConfigError> {
    match value.parse::<T>() {
        Ok(number) if number >= T::from(1) => Ok(number),
        _ => Err(invalid(key, value, "a positive integer")),
    }
}

fn boolean(key: &'static str, value: &str) -> Result<bool, ConfigError> {
    match value.to_ascii_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(invalid(key, value, "`true` or `false`")),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn parse(pairs: &[(&str, &str)]) -> Result<IdempotencyConfig, ConfigError> {
        IdempotencyConfig::from_properties(pairs.iter().copied())
    }

    fn error(pairs: &[(&str, &str)]) -> String {
        parse(pairs)
            .expect_err("configuration should be refused")
            .to_string()
    }

    #[test]
    fn empty_properties_give_the_defaults() {
        let config = IdempotencyConfig::from_properties(HashMap::<String, String>::new()).unwrap();
        assert!(!config.enabled);
        assert_eq!(config.key_lifetime, Duration::from_secs(1800));
        assert_eq!(config.key_lifetime_iso8601(), "PT30M");
        assert_eq!(config.store_type, "memory");
        assert_eq!(config.store_properties.keys().count(), 0);
        assert_eq!(config.purge_interval, None);
        assert_eq!(config.scope_quota, None);
        assert_eq!(config, IdempotencyConfig::default());
    }

    #[test]
    fn every_general_key_is_read_and_the_rest_kept_for_the_store() {
        let config = parse(&[
            ("idempotency-enabled", " TRUE "),
            ("idempotency-key-lifetime", "PT1H"),
            ("idempotency-store-type", " Some-Store "),
            ("idempotency-purge-interval", "PT5M"),
            ("idempotency-scope-max-records", "1000"),
            ("idempotency-scope-max-bytes", "1048576"),
            ("idempotency-some-store-url", " scheme://user:s3cret@host "),
            ("idempotency-some-store-size", "7"),
            ("catalog-name", "not ours, ignored"),
        ])
        .unwrap();
        assert!(config.enabled);
        assert_eq!(config.key_lifetime, Duration::from_secs(3600));
        assert_eq!(config.store_type, "some-store");
        assert_eq!(config.purge_interval, Some(Duration::from_secs(300)));
        assert_eq!(
            config.scope_quota,
            Some(
                ScopeQuota::default()
                    .with_max_records(1000)
                    .with_max_bytes(1_048_576)
            )
        );
        let properties = &config.store_properties;
        assert_eq!(
            properties.keys().collect::<Vec<_>>(),
            ["idempotency-some-store-size", "idempotency-some-store-url"]
        );
        assert_eq!(
            properties.get("idempotency-some-store-url"),
            Some("scheme://user:s3cret@host")
        );
        assert_eq!(properties.get("catalog-name"), None);
        assert_eq!(properties.get("idempotency-enabled"), None);
        assert_eq!(
            properties
                .positive_integer::<usize>("idempotency-some-store-size")
                .unwrap(),
            Some(7)
        );
        let debug = format!("{config:?}");
        assert!(!debug.contains("s3cret"), "Debug shows a value: {debug}");
        assert!(debug.contains("idempotency-some-store-url"), "{debug}");
    }

    #[test]
    fn each_bad_value_names_its_key_value_and_what_is_expected() {
        type Properties<'a> = &'a [(&'a str, &'a str)];
        let cases: &[(Properties, &[&str])] = &[
            (
                &[("idempotency-enabled", "yes")],
                &["idempotency-enabled", "\"yes\"", "`true` or `false`"],
            ),
            (
                &[("idempotency-key-lifetime", "30m")],
                &["idempotency-key-lifetime", "\"30m\"", "ISO-8601", "PT30M"],
            ),
            (
                &[("idempotency-key-lifetime", "P1W")],
                &["idempotency-key-lifetime", "\"P1W\"", "weeks"],
            ),
            (
                &[("idempotency-key-lifetime", "PT0S")],
                &["idempotency-key-lifetime", "\"PT0S\"", "positive"],
            ),
            (
                &[("idempotency-key-lifetime", "-PT5M")],
                &["idempotency-key-lifetime", "negative"],
            ),
            (
                &[("idempotency-key-lifetime", "")],
                &["idempotency-key-lifetime", "\"\""],
            ),
            (
                &[("idempotency-store-type", " ")],
                &["idempotency-store-type", "\"\"", "`memory`"],
            ),
            (
                &[("idempotency-scope-max-bytes", "lots")],
                &[
                    "idempotency-scope-max-bytes",
                    "\"lots\"",
                    "positive integer",
                ],
            ),
            (
                &[("idempotency-scope-max-records", "0")],
                &["idempotency-scope-max-records", "\"0\"", "positive integer"],
            ),
            (
                &[("idempotency-scope-max-records", "-5")],
                &["idempotency-scope-max-records", "positive integer"],
            ),
            (
                &[("idempotency-purge-interval", "5 minutes")],
                &["idempotency-purge-interval", "\"5 minutes\"", "ISO-8601"],
            ),
            (
                &[("idempotency-purge-interval", "PT0S")],
                &["idempotency-purge-interval", "positive"],
            ),
        ];
        for (pairs, needles) in cases {
            let message = error(pairs);
            for needle in *needles {
                assert!(
                    message.contains(needle),
                    "{pairs:?}: {message:?} lacks {needle:?}"
                );
            }
        }
    }

    #[test]
    fn a_key_given_twice_is_refused_whoever_reads_it() {
        for key in ["idempotency-enabled", "idempotency-some-store-url"] {
            let message = error(&[(key, "true"), (key, "false")]);
            assert_eq!(message, format!("property `{key}` is given more than once"));
        }
    }

    #[test]
    fn the_store_checks_its_type_and_its_keys() {
        let config = parse(&[
            ("idempotency-store-type", "mine"),
            ("idempotency-key-lifetime-minutes", "30"),
        ])
        .unwrap();
        // Keys the core does not read are the store's to refuse.
        let error = config
            .store_properties_for("mine", &["idempotency-mine-path", "idempotency-mine-size"])
            .unwrap_err();
        assert!(
            matches!(&error, ConfigError::UnknownKey { key, store_type, accepted }
                if key == "idempotency-key-lifetime-minutes"
                    && store_type == "mine"
                    && accepted == &["idempotency-mine-path", "idempotency-mine-size"]),
            "{error:?}"
        );
        let message = error.to_string();
        for needle in [
            "unknown property `idempotency-key-lifetime-minutes`",
            "idempotency-store-type=mine",
            "the mine store takes idempotency-mine-path, idempotency-mine-size",
            // A typo of a general key is easy to spot: they are listed too.
            "idempotency-key-lifetime,",
            "set idempotency-store-type to the store it belongs to",
        ] {
            assert!(message.contains(needle), "{needle}: {message}");
        }
        let message = config
            .store_properties_for("mine", &[])
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("the mine store takes no keys of its own"),
            "{message}"
        );

        // Another store's opener names the store type.
        let message = config
            .store_properties_for("other", &["idempotency-key-lifetime-minutes"])
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with(
                "invalid value \"mine\" for `idempotency-store-type`: expected `other`"
            ),
            "{message}"
        );

        let config = parse(&[("idempotency-store-type", "mine")]).unwrap();
        assert!(config.store_properties_for("mine", &[]).is_ok());
        // The default store type is `memory`.
        assert!(
            IdempotencyConfig::default()
                .store_properties_for("memory", &[])
                .is_ok()
        );
    }

    #[test]
    fn parse_helpers_name_the_key() {
        let config = parse(&[
            ("idempotency-x-count", "12"),
            ("idempotency-x-zero", "0"),
            ("idempotency-x-wait", "PT0.5S"),
            ("idempotency-x-never", "PT0S"),
            ("idempotency-x-on", "False"),
            ("idempotency-x-maybe", "maybe"),
        ])
        .unwrap();
        let properties = &config.store_properties;
        assert_eq!(
            properties
                .positive_integer::<u64>("idempotency-x-count")
                .unwrap(),
            Some(12)
        );
        assert_eq!(
            properties
                .positive_integer::<u64>("idempotency-x-none")
                .unwrap(),
            None
        );
        assert!(
            properties
                .positive_integer::<u64>("idempotency-x-zero")
                .unwrap_err()
                .to_string()
                .contains("`idempotency-x-zero`")
        );
        assert_eq!(
            properties.duration("idempotency-x-wait").unwrap(),
            Some(Duration::from_millis(500))
        );
        assert!(
            properties
                .duration("idempotency-x-never")
                .unwrap_err()
                .to_string()
                .contains("positive")
        );
        assert_eq!(properties.boolean("idempotency-x-on").unwrap(), Some(false));
        assert!(
            properties
                .boolean("idempotency-x-maybe")
                .unwrap_err()
                .to_string()
                .contains("`idempotency-x-maybe`")
        );
    }
}
