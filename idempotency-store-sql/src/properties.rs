//! The SQL store's name and keys in a properties configuration
//! ([`IdempotencyConfig`](idempotency_core::config::IdempotencyConfig)), read by
//! [`SqlConfig::from_config`](crate::SqlConfig::from_config) and [`open`](crate::open).
//!
//! `idempotency-store-type=sql` names the SQL stores; the database URL's scheme picks the
//! backend, whose cargo feature must be compiled in. Besides the keys every store shares
//! (`idempotency-enabled`, `idempotency-key-lifetime`, `idempotency-store-type`,
//! `idempotency-purge-interval`, `idempotency-scope-max-*`: see
//! `idempotency_core::config`), the SQL store takes:
//!
//! | key | default | value |
//! | --- | --- | --- |
//! | `idempotency-database-url` | — (required) | `postgres://…` / `postgresql://…` (feature `postgres`), `mysql://…` / `mariadb://…` (feature `mysql`), `sqlite:…` (feature `sqlite`) |
//! | `idempotency-database-user` | from the URL | PostgreSQL and MySQL only: a non-empty user name, in place of the URL's |
//! | `idempotency-database-password` | from the URL | PostgreSQL and MySQL only: in place of the URL's; never printed |
//! | `idempotency-database-pool-size` | 10 | positive integer: the most connections ([`PoolSettings::max_connections`](crate::PoolSettings::max_connections)) |
//! | `idempotency-database-synchronous-replication` | `off` | PostgreSQL only: `require`, `warn` or `off` ([`SynchronousReplication`](crate::SynchronousReplication)); or the URL's parameter `synchronous-replication`, not both |
//!
//! Any other store property (a misspelt key, or another store's) is refused, with an
//! error that names it and these keys; a bad value is refused with an error that names
//! the key, the value (a URL with its password masked) and what is expected.
//!
//! ```text
//! idempotency-enabled=true
//! idempotency-store-type=sql
//! idempotency-database-url=postgres://catalog@db.internal:5432/catalog
//! idempotency-database-password=…
//! idempotency-database-pool-size=20
//! idempotency-purge-interval=PT5M
//! ```

/// `idempotency-store-type=sql`: the SQL stores.
pub const STORE_TYPE: &str = "sql";
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

/// Every key the SQL store takes, besides the general ones.
pub const KEYS: [&str; 5] = [
    DATABASE_URL,
    DATABASE_USER,
    DATABASE_PASSWORD,
    DATABASE_POOL_SIZE,
    DATABASE_SYNCHRONOUS_REPLICATION,
];
