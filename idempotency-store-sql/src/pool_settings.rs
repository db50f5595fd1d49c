//! The settings a `connect` constructor opens its pool with ([`PoolSettings`]), among
//! them the synchronous-replication check a PostgreSQL store makes
//! ([`SynchronousReplication`]).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Whether a SQL store checks, when it connects, that the database replicates its
/// commits synchronously ([`PoolSettings::synchronous_replication`], the URL parameter
/// `synchronous-replication`, the property
/// `idempotency-database-synchronous-replication`; PostgreSQL).
///
/// With asynchronous streaming replication, a failover to a standby loses the commits the
/// standby had not received yet: a lost reservation lets a duplicate run beside its
/// owner, a lost answer runs the mutation again on the next retry. An operator who relies
/// on a synchronous standby says so here, and the store checks the server it connected
/// to: `synchronous_standby_names` must name a standby and `synchronous_commit` must wait
/// for it (`on`, `remote_apply` or `remote_write`).
///
/// ```
/// use idempotency_store_sql::SynchronousReplication;
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

/// Pool settings for the `connect` constructors. Stores built with `new` use the
/// caller's pool as it is.
///
/// ```
/// use std::time::Duration;
/// use idempotency_store_sql::PoolSettings;
///
/// let settings = PoolSettings::default()
///     .max_connections(20)
///     .acquire_timeout(Duration::from_secs(3));
/// assert_eq!(settings.max_connections, 20);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolSettings {
    /// The most connections the pool opens (default 10).
    pub max_connections: u32,
    /// Connections kept open when idle (default 0).
    pub min_connections: u32,
    /// How long an operation waits for a free connection before failing (default 5 s);
    /// the layer turns the failure into 503 + `Retry-After`.
    pub acquire_timeout: Duration,
    /// Idle connections are closed after this long (default 10 minutes).
    pub idle_timeout: Option<Duration>,
    /// Whether a PostgreSQL store checks at connect that the server replicates its
    /// commits synchronously, and refuses or warns when it does not (default: no check).
    /// The URL parameter `synchronous-replication=require|warn|off` sets it too.
    pub synchronous_replication: SynchronousReplication,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            max_connections: 10,
            min_connections: 0,
            acquire_timeout: Duration::from_secs(5),
            idle_timeout: Some(Duration::from_secs(600)),
            synchronous_replication: SynchronousReplication::Off,
        }
    }
}

impl PoolSettings {
    /// Sets [`max_connections`](Self::max_connections) (at least 1).
    pub fn max_connections(mut self, max_connections: u32) -> Self {
        self.max_connections = max_connections.max(1);
        self
    }

    /// Sets [`min_connections`](Self::min_connections).
    pub fn min_connections(mut self, min_connections: u32) -> Self {
        self.min_connections = min_connections;
        self
    }

    /// Sets [`acquire_timeout`](Self::acquire_timeout).
    pub fn acquire_timeout(mut self, acquire_timeout: Duration) -> Self {
        self.acquire_timeout = acquire_timeout;
        self
    }

    /// Sets [`idle_timeout`](Self::idle_timeout).
    pub fn idle_timeout(mut self, idle_timeout: Option<Duration>) -> Self {
        self.idle_timeout = idle_timeout;
        self
    }

    /// Sets [`synchronous_replication`](Self::synchronous_replication): what a
    /// PostgreSQL store does at connect when `synchronous_standby_names` is empty or
    /// `synchronous_commit` does not wait for a standby (`off`, `local`) on the server it
    /// connected to. Ignored by the other backends.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use idempotency_store_sql::{PoolSettings, PostgresStore, SynchronousReplication};
    ///
    /// let settings = PoolSettings::default().synchronous_replication(SynchronousReplication::Require);
    /// // Fails, naming both settings and their values, if the server cannot give it.
    /// let store = PostgresStore::connect("postgres://app@db/catalog", &settings).await?;
    /// // The same, from the URL:
    /// let same = PostgresStore::connect(
    ///     "postgres://app@db/catalog?synchronous-replication=require",
    ///     &PoolSettings::default(),
    /// )
    /// .await?;
    /// # drop((store, same)); Ok(()) }
    /// ```
    pub fn synchronous_replication(mut self, expect: SynchronousReplication) -> Self {
        self.synchronous_replication = expect;
        self
    }

    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    pub(crate) fn pool_options<DB: sqlx::Database>(&self) -> sqlx::pool::PoolOptions<DB> {
        sqlx::pool::PoolOptions::new()
            .max_connections(self.max_connections.max(1))
            .min_connections(self.min_connections.min(self.max_connections.max(1)))
            .acquire_timeout(self.acquire_timeout)
            .idle_timeout(self.idle_timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each builder method sets its own setting and keeps the others.
    #[test]
    fn pool_settings_are_built_one_at_a_time() {
        let settings = PoolSettings::default()
            .max_connections(3)
            .min_connections(2)
            .acquire_timeout(Duration::from_millis(1500))
            .idle_timeout(None)
            .synchronous_replication(SynchronousReplication::Warn);
        assert_eq!(settings.max_connections, 3);
        assert_eq!(settings.min_connections, 2);
        assert_eq!(settings.acquire_timeout, Duration::from_millis(1500));
        assert_eq!(settings.idle_timeout, None);
        assert_eq!(
            settings.synchronous_replication,
            SynchronousReplication::Warn
        );
        assert_eq!(
            PoolSettings::default().max_connections(0).max_connections,
            1
        );
    }
}
