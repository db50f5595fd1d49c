//! Opening the SQL store that a properties configuration
//! ([`IdempotencyConfig`](idempotency_core::config::IdempotencyConfig)) names: its keys
//! ([`crate::properties`]) read and checked, and the types their values are.

use std::fmt;
use std::sync::Arc;

use idempotency_core::FullStore;
use idempotency_core::config::{ConfigError, IdempotencyConfig};

use crate::pool_settings::{PoolSettings, SynchronousReplication};
use crate::properties::{
    DATABASE_PASSWORD, DATABASE_POOL_SIZE, DATABASE_SYNCHRONOUS_REPLICATION, DATABASE_URL,
    DATABASE_USER, KEYS, STORE_TYPE,
};

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
    ///
    /// ```
    /// use idempotency_store_sql::SqlBackend;
    ///
    /// assert_eq!(SqlBackend::from_url("mariadb://db/x"), Some(SqlBackend::MySql));
    /// assert_eq!(SqlBackend::from_url("oracle://db/x"), None);
    /// ```
    pub fn from_url(url: &str) -> Option<Self> {
        let scheme = url.split_once(':')?.0.to_ascii_lowercase();
        match scheme.as_str() {
            "postgres" | "postgresql" => Some(Self::Postgres),
            "mysql" | "mariadb" => Some(Self::MySql),
            "sqlite" => Some(Self::Sqlite),
            _ => None,
        }
    }

    /// The cargo feature of this crate that compiles the backend in.
    fn feature(self) -> &'static str {
        match self {
            SqlBackend::Postgres => "postgres",
            SqlBackend::MySql => "mysql",
            SqlBackend::Sqlite => "sqlite",
        }
    }
}

/// The SQL store's properties ([`crate::properties`]), read and checked: what [`open`]
/// connects with. `Debug` masks the URL's password and the password.
///
/// ```
/// use idempotency_core::config::IdempotencyConfig;
/// use idempotency_store_sql::{SqlBackend, SqlConfig};
///
/// let config = IdempotencyConfig::from_properties([
///     ("idempotency-store-type", "sql"),
///     ("idempotency-database-url", "postgres://db.internal/catalog"),
///     ("idempotency-database-user", "catalog"),
///     ("idempotency-database-pool-size", "20"),
/// ])?;
/// let sql = SqlConfig::from_config(&config)?;
/// assert_eq!(sql.backend, SqlBackend::Postgres);
/// assert_eq!(sql.user.as_deref(), Some("catalog"));
/// assert_eq!(sql.pool_settings().max_connections, 20);
///
/// // A key of another store, or a misspelt one, is refused.
/// let config = IdempotencyConfig::from_properties([
///     ("idempotency-store-type", "sql"),
///     ("idempotency-database-url", "sqlite:/tmp/records.db"),
///     ("idempotency-max-entries", "500"),
/// ])?;
/// let error = SqlConfig::from_config(&config).unwrap_err().to_string();
/// assert!(error.contains("`idempotency-max-entries`"), "{error}");
/// assert!(error.contains("idempotency-database-url"), "{error}");
/// # Ok::<(), idempotency_core::config::ConfigError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqlConfig {
    /// The backend the URL's scheme names.
    pub backend: SqlBackend,
    /// `idempotency-database-url`.
    pub url: String,
    /// `idempotency-database-user`: in place of the URL's user.
    pub user: Option<String>,
    /// `idempotency-database-password`: in place of the URL's password. Never printed.
    pub password: Option<String>,
    /// `idempotency-database-pool-size` (default 10).
    pub pool_size: Option<u32>,
    /// `idempotency-database-synchronous-replication` (default: no check).
    pub synchronous_replication: Option<SynchronousReplication>,
}

impl fmt::Debug for SqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlConfig")
            .field("backend", &self.backend)
            .field("url", &redact_url(&self.url))
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("pool_size", &self.pool_size)
            .field("synchronous_replication", &self.synchronous_replication)
            .finish()
    }
}

impl SqlConfig {
    /// Reads and checks the SQL store's keys in `config`, which must name the SQL store
    /// (`idempotency-store-type=sql`): every store property must be one of
    /// [`properties::KEYS`](crate::properties::KEYS), the URL is required and must name a
    /// backend, a SQLite database takes no user or password, and synchronous replication
    /// is PostgreSQL's. Connects to nothing; errors name the key.
    pub fn from_config(config: &IdempotencyConfig) -> Result<Self, ConfigError> {
        let properties = config.store_properties_for(STORE_TYPE, &KEYS)?;
        let url = properties.get(DATABASE_URL).ok_or(ConfigError::Missing {
            key: DATABASE_URL,
            when: "idempotency-store-type=sql",
        })?;
        let backend = SqlBackend::from_url(url).ok_or_else(|| {
            invalid_database_url(
                url,
                "a URL starting with postgres://, postgresql://, mysql://, mariadb:// or sqlite:",
            )
        })?;
        let user = properties.get(DATABASE_USER);
        if user == Some("") {
            return Err(ConfigError::invalid_value(
                DATABASE_USER,
                "",
                "a non-empty user name",
            ));
        }
        let password = properties.get(DATABASE_PASSWORD);
        let pool_size = properties.positive_integer(DATABASE_POOL_SIZE)?;
        let synchronous_replication = properties
            .get(DATABASE_SYNCHRONOUS_REPLICATION)
            .map(|value| {
                value.parse().map_err(|_| {
                    ConfigError::invalid_value(
                        DATABASE_SYNCHRONOUS_REPLICATION,
                        value,
                        SynchronousReplication::EXPECTED,
                    )
                })
            })
            .transpose()?;

        if backend == SqlBackend::Sqlite {
            for (key, given) in [
                (DATABASE_USER, user.is_some()),
                (DATABASE_PASSWORD, password.is_some()),
            ] {
                if given {
                    return Err(ConfigError::NotApplicable {
                        key,
                        applies_not_to: "a sqlite: database",
                    });
                }
            }
        }
        if backend != SqlBackend::Postgres && synchronous_replication.is_some() {
            return Err(ConfigError::NotApplicable {
                key: DATABASE_SYNCHRONOUS_REPLICATION,
                applies_not_to: match backend {
                    SqlBackend::Sqlite => "a sqlite: database",
                    _ => "a mysql:// or mariadb:// database",
                },
            });
        }
        Ok(Self {
            backend,
            url: url.to_owned(),
            user: user.map(str::to_owned),
            password: password.map(str::to_owned),
            pool_size,
            synchronous_replication,
        })
    }

    /// The pool settings these properties ask for (`idempotency-database-pool-size`,
    /// `idempotency-database-synchronous-replication`), the defaults otherwise.
    pub fn pool_settings(&self) -> PoolSettings {
        let mut settings = PoolSettings::default();
        if let Some(size) = self.pool_size {
            settings = settings.max_connections(size);
        }
        if let Some(expect) = self.synchronous_replication {
            settings = settings.synchronous_replication(expect);
        }
        settings
    }
}

/// Opens the SQL store `config` names (`idempotency-store-type=sql`): reads and checks
/// its keys ([`SqlConfig::from_config`]), connects with the configured URL, user,
/// password and pool size, checks PostgreSQL's synchronous replication if
/// `idempotency-database-synchronous-replication` (or the URL's
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
/// let layer = config.layer(store);
/// # drop(layer); Ok(()) }
/// ```
pub async fn open(config: &IdempotencyConfig) -> Result<Arc<dyn FullStore>, ConfigError> {
    // What every backend's arm does with its connect options and its store, written once
    // (the drivers' options and the stores share no trait for it).
    #[allow(unused_macros)] // with no networked backend compiled in
    macro_rules! with_credentials {
        ($options:expr, $sql:expr) => {{
            let mut options = $options;
            if let Some(user) = &$sql.user {
                options = options.username(user);
            }
            if let Some(password) = &$sql.password {
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
    let sql = SqlConfig::from_config(config)?;
    let url = sql.url.as_str();
    match sql.backend {
        SqlBackend::Postgres => {
            #[cfg(feature = "postgres")]
            {
                let (url, from_url) = crate::synchronous::split_url(url).map_err(|e| {
                    invalid_database_url(url, format!("a valid PostgreSQL URL ({e})"))
                })?;
                let mut settings = sql.pool_settings();
                if let Some(mode) = from_url {
                    if sql.synchronous_replication.is_some() {
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
                    invalid_database_url(&url, format!("a valid PostgreSQL URL ({e})"))
                })?;
                let options = with_credentials!(options, sql);
                ready!(
                    crate::PostgresStore::connect_with(options, &settings),
                    config
                )
            }
            #[cfg(not(feature = "postgres"))]
            Err(not_compiled(url, sql.backend))
        }
        SqlBackend::MySql => {
            #[cfg(feature = "mysql")]
            {
                let options: sqlx::mysql::MySqlConnectOptions = crate::mysql::mysql_url(url)
                    .parse()
                    .map_err(|e| invalid_database_url(url, format!("a valid MySQL URL ({e})")))?;
                let options = with_credentials!(options, sql);
                ready!(
                    crate::MySqlStore::connect_with(options, &sql.pool_settings()),
                    config
                )
            }
            #[cfg(not(feature = "mysql"))]
            Err(not_compiled(url, sql.backend))
        }
        SqlBackend::Sqlite => {
            #[cfg(feature = "sqlite")]
            {
                ready!(
                    crate::SqliteStore::connect(url, &sql.pool_settings()),
                    config
                )
            }
            #[cfg(not(feature = "sqlite"))]
            Err(not_compiled(url, sql.backend))
        }
    }
}

/// `idempotency-database-url` cannot be used, and what is `expected` instead; the URL is
/// shown with its password masked.
fn invalid_database_url(url: &str, expected: impl Into<String>) -> ConfigError {
    ConfigError::invalid_value(DATABASE_URL, redact_url(url), expected)
}

#[allow(dead_code)] // unused when every backend is compiled in
fn not_compiled(url: &str, backend: SqlBackend) -> ConfigError {
    invalid_database_url(
        url,
        format!(
            "a database whose backend is compiled into this build; enable the `{}` feature of idempotency-store-sql for this one",
            backend.feature()
        ),
    )
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
