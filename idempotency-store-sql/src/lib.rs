//! SQL stores for `idempotency-core`: PostgreSQL, MySQL 8 / MariaDB 10.6+, and SQLite, each
//! written for its database (one struct per backend, each behind a cargo feature:
//! `postgres`, `mysql`, `sqlite`; `sqlite` is on by default). Each implements the request
//! path ([`IdempotencyStore`]), the operators'
//! [`RecordAdmin`](idempotency_core::RecordAdmin) and maintenance's
//! [`PurgeExpired`](idempotency_core::PurgeExpired), so it is a
//! [`FullStore`](idempotency_core::FullStore).
//!
//! # Which store
//!
//! | you run | store | why |
//! | --- | --- | --- |
//! | one process, tests, development | `MemoryStore` (`idempotency-store-memory`) | no I/O; waiters are notified; records die with the process |
//! | one host, records must survive restarts | `SqliteStore` (feature `sqlite`) | a single file, no server; several processes on the host may share it |
//! | several replicas | `PostgresStore` (feature `postgres`) or `MySqlStore` (feature `mysql`) | every replica sees every key; one clock (the database's) decides leases and expiry |
//!
//! A retry that lands on another replica, or a replica that crashed mid-request, is the
//! reason the SQL stores exist: with them every replica sees the same record, leases
//! lapse by the database clock (node clock skew cannot cause a double execution), and
//! a lapsed reservation is taken over with a new fencing token so the crashed owner's
//! late finalize is refused.
//!
//! Every store accepts an existing sqlx pool (`new`, so a catalog shares its own)
//! or a URL plus [`PoolSettings`] (`connect`). `migrate()`
//! creates the schema idempotently and is safe to call from several nodes at once.
//! The table name is configurable (`with_table_name`)
//! and validated as an identifier ([`TableName`]).
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idempotency_core::spawn_purge_task;
//! use idempotency_store_sql::PostgresStore;
//!
//! let pool = sqlx::PgPool::connect("postgres://catalog@db/catalog").await?;
//! let store = Arc::new(PostgresStore::new(pool).migrate().await?);
//! let purge = spawn_purge_task(store.clone(), Duration::from_secs(300), 100);
//! # drop(purge); Ok(()) }
//! ```
//!
//! A service configured from a properties map
//! ([`IdempotencyConfig`](idempotency_core::config::IdempotencyConfig),
//! `idempotency-store-type=sql`) opens its store with [`open`]; the SQL store's keys
//! (`idempotency-database-url`, `-user`, `-password`, `-pool-size`,
//! `-synchronous-replication`) are listed in [`properties`] and read by [`SqlConfig`].
//!
//! # Commit your write with its record: `Tx`
//!
//! A handler whose state lives in the records' database writes it through a [`Tx`], the
//! transaction its request's write belongs in, and hands its answer to [`Tx::commit`],
//! which records the answer with the write and commits once. The store behind it is a
//! [`OneCommitStore`] on the pool the service already has (`PgPool`, `MySqlPool`,
//! `SqlitePool`, or an `AnyPool` with the `any` feature), and the `Tx` is begun from
//! [`Writes::with_records`] of it: with the `axum` feature `Tx<Writes<DB>>` is an
//! extractor, and [`Tx::begin`] is the same for hyper and tonic handlers. The handler
//! never sees a reservation.
//!
//! What a reservation is, is the store's setting ([`Reservations`]): by default the
//! handler's own open transaction holds the key, and a keyed first execution commits
//! once, as the same request without a key does; with [`Reservations::Leased`] a
//! committed record with a lease holds it (two commits), for handlers that run for
//! minutes. Either way the write and its record commit together or not at all: a crash at
//! any instant leaves either nothing (the retry runs the request once) or both (the retry
//! is replayed); a handler whose leased reservation was taken over before it committed
//! gets [`TxError::NotRecorded`] and nothing of it commits.
//!
//! For a database that does not hold the records (they are in Redis, say),
//! [`Writes::records_elsewhere`] gives the same `Tx`; there a `COMMIT` whose answer is lost is asked
//! about (PostgreSQL's `txid_status`), and where the database cannot tell, `Tx::commit`
//! answers [`TxError::Unknown`], for the handler to mark its answer
//! [`OutcomeUnknown`](idempotency_core::OutcomeUnknown).
//!
//! sqlx is 0.8 on purpose: iceberg-rust's SQL catalog pins sqlx 0.8, and two sqlx
//! versions cannot both link SQLite (`links = "sqlite3"`) into one binary.
//!
//! # Schema
//!
//! One table (default `idempotency_records`), one row per (scope, key). Timestamps are
//! BIGINT epoch milliseconds by the database clock; the response columns are NULL while
//! the request is in flight. Headers are stored in one binary column, encoded by
//! `StoredResponse::encode_headers`.
//!
//! PostgreSQL (12+):
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS "idempotency_records" (
//!     scope               TEXT    NOT NULL,
//!     idempotency_key     TEXT    NOT NULL,
//!     method              TEXT    NOT NULL,
//!     path                TEXT    NOT NULL,
//!     body_sha256         BYTEA   NOT NULL,
//!     fencing_token       BIGINT  NOT NULL,
//!     created_at_ms       BIGINT  NOT NULL,
//!     expires_at_ms       BIGINT  NOT NULL,
//!     lease_expires_at_ms BIGINT  NOT NULL,
//!     response_status     INTEGER NULL,
//!     response_headers    BYTEA   NULL,
//!     response_body       BYTEA   NULL,
//!     response_trailers   BYTEA   NULL,      -- encoded like the headers; NULL: none
//!     PRIMARY KEY (scope, idempotency_key)
//! );
//! CREATE INDEX IF NOT EXISTS "idempotency_records_expires_idx"
//!     ON "idempotency_records" (expires_at_ms);
//! ALTER TABLE "idempotency_records" ADD COLUMN IF NOT EXISTS response_trailers BYTEA NULL;
//! -- run in one transaction after SELECT pg_advisory_xact_lock(<hash of the table name>),
//! -- because concurrent CREATE TABLE IF NOT EXISTS can fail on pg_type's unique index.
//! ```
//!
//! Tables of 0.1.0 have no `response_trailers`: `migrate()` adds it in place (see the
//! CHANGELOG).
//!
//! MySQL 8 / MariaDB 10.6+ (the index is declared inside `CREATE TABLE`, since MySQL has
//! no `CREATE INDEX IF NOT EXISTS`; scope and key of at most 255 characters, 2,040 bytes
//! of primary key in utf8mb4, well within InnoDB's 3,072):
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS `idempotency_records` (
//!     scope               VARCHAR(255) NOT NULL,
//!     idempotency_key     VARCHAR(255) NOT NULL,
//!     method              VARCHAR(255) NOT NULL,
//!     path                TEXT         NOT NULL,
//!     body_sha256         BINARY(32)   NOT NULL,
//!     fencing_token       BIGINT       NOT NULL,
//!     created_at_ms       BIGINT       NOT NULL,
//!     expires_at_ms       BIGINT       NOT NULL,
//!     lease_expires_at_ms BIGINT       NOT NULL,
//!     response_status     INT          NULL,
//!     response_headers    MEDIUMBLOB   NULL,
//!     response_body       LONGBLOB     NULL,
//!     response_trailers   MEDIUMBLOB   NULL,
//!     PRIMARY KEY (scope, idempotency_key),
//!     KEY `idempotency_records_expires_idx` (expires_at_ms)
//! ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
//! ```
//!
//! `utf8mb4_bin` compares scopes and keys byte for byte, except that, being a PAD SPACE
//! collation, it ignores trailing spaces (keys never have them: the layer trims them).
//! `DELETE … LIMIT` is flagged unsafe for statement-based binary logging; use
//! `binlog_format=ROW` (MySQL 8's default) on a replicated server.
//! A response body must fit in the server's `max_allowed_packet` (MariaDB's default is
//! 16 MiB, MySQL 8's 64 MiB); a larger one fails to finalize and is released by lease.
//!
//! SQLite (3.35+, for `RETURNING`; the bundled one is newer):
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS "idempotency_records" (
//!     scope TEXT NOT NULL, idempotency_key TEXT NOT NULL,
//!     method TEXT NOT NULL, path TEXT NOT NULL, body_sha256 BLOB NOT NULL,
//!     fencing_token BIGINT NOT NULL, created_at_ms BIGINT NOT NULL,
//!     expires_at_ms BIGINT NOT NULL, lease_expires_at_ms BIGINT NOT NULL,
//!     response_status INTEGER NULL, response_headers BLOB NULL, response_body BLOB NULL,
//!     response_trailers BLOB NULL,
//!     PRIMARY KEY (scope, idempotency_key)
//! );
//! CREATE INDEX IF NOT EXISTS "idempotency_records_expires_idx"
//!     ON "idempotency_records" (expires_at_ms);
//! ```
//!
//! # The statements
//!
//! Every operation is one conditional statement (two in rare races), with "now" taken from
//! the database's clock and fencing tokens made by the client; `sql(Operation::…)` shows the
//! statement a store runs. Each statement, and why it is written so, is in the repository's
//! `DESIGN.md`.
//!
//! # Round trips
//!
//! The typed stores (`PostgresStore`, `MySqlStore`, `SqliteStore`) never hold a
//! transaction open while the handler runs; every operation is autocommit (the answer a
//! `Tx` records is one statement in the handler's own transaction), except SQLite's writes under concurrency: a write that finds another of the
//! store's writes running queues, and the store's writer task commits every queued write
//! in one `BEGIN IMMEDIATE … COMMIT` (group commit: one disk flush for all of them; each
//! caller is answered after that commit).
//!
//! | operation | PostgreSQL | MySQL / MariaDB | SQLite (no network) |
//! | --- | --- | --- | --- |
//! | reserve, key free | 1 | 1 | 2 (select, upsert) |
//! | reserve, key expired but not purged | 2 | 1 | 3 |
//! | reserve, key live (replay, in flight, conflict) | 1 | MariaDB 1; MySQL 8: 2 (upsert, then select) | 1 (select) |
//! | load / one poll of `wait` | 1 | 1 | 1 |
//! | finalize, renew, release, take over | 1 | 1 | 1 |
//! | purge, per batch | 1 | 1 | 1 |
//! | migrate | 4 (begin + lock, DDL, commit) | 1 | 3 |
//!
//! Rare races add a bounded number of round trips: on PostgreSQL a reserve whose
//! snapshot missed a concurrently inserted row reads it with one more query; wherever a
//! reserve takes two statements (an expired row on PostgreSQL and SQLite, a live row on
//! MySQL 8), a row changed by another request between the two sends it around again.
//! `wait` polls `load` with a bounded backoff (5 ms doubling to 200 ms), since a SQL
//! database cannot notify waiters on other nodes. A `MySqlStore` also sends one
//! `SELECT VERSION()` in its life (at `connect`, `migrate` or its first reserve).
//!
//! # Feature flags
//!
//! Each backend is a cargo feature; enable the ones you run (any combination works, and
//! with none only `open` and `pool_settings` remain).
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `sqlite` | **on** | `SqliteStore` and sqlx's SQLite driver (bundles SQLite) |
//! | `postgres` | off | `PostgresStore` and sqlx's PostgreSQL driver |
//! | `mysql` | off | `MySqlStore` (MySQL 8, MariaDB 10.6+) and sqlx's MySQL driver |
//! | `any` | off | sqlx's `Any` driver: `Tx`, [`OneCommitStore`] and [`Writes`] on an `AnyPool` (on any of the backends compiled in) |
//! | `axum` | off | `Tx<T>` and `LazyTx<T>` as axum extractors |
//!
//! `Tx`, `Transactions` and [`OneCommitStore`] come with every backend feature, on that
//! backend's typed pool.
//!
//! `idempotency-store-sql = { version = "0.1", default-features = false, features = ["postgres"] }`
//! builds the PostgreSQL store alone.
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// Built without any backend, only the configuration remains.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code, unused_variables, unreachable_code, unused_mut)
)]

mod commit_outcome;
mod common;
mod config;
mod in_transaction;
#[cfg(feature = "mysql")]
mod mysql;
// Each backend's path is there only with its feature; the rest is unused without it.
#[cfg_attr(
    not(all(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
mod one_commit;
mod pool_settings;
#[cfg(feature = "postgres")]
mod postgres;
pub mod properties;
mod record_database;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "postgres")]
mod synchronous;
mod table;
mod transactions;

pub use commit_outcome::{CommitError, OUTCOME_CHECK_FOR};
pub use common::Operation;
// For the benchmarks, which bind the stores' statements through the stores' own
// `reserve_query` and `finalize_query`; not part of the API.
#[doc(hidden)]
pub use common::EncodedAnswer;
pub use config::{SqlBackend, SqlConfig, open};
pub use in_transaction::FinalizeError;
#[cfg(feature = "mysql")]
pub use mysql::MySqlStore;
pub use one_commit::{OneCommitStore, Reservations, WriteTransaction};
pub use pool_settings::{PoolSettings, SynchronousReplication, UnknownSynchronousReplication};
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
pub use record_database::RecordDatabase;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;
#[cfg(feature = "postgres")]
pub use synchronous::{InvalidSynchronousReplication, NotSynchronous};
pub use table::{DEFAULT_TABLE_NAME, InvalidTableName, MAX_TABLE_NAME_LEN, TableName};
pub use transactions::{LazyTx, OpenTransaction, Transactions, Tx, TxError, Writes};

/// The sqlx version this crate is built on, re-exported so that a caller can build a
/// pool of the exact same version for `new`.
pub use sqlx;

#[cfg(doc)]
use idempotency_core::IdempotencyStore;
