//! [`RecordDatabase`]: the sqlx databases whose transactions a request's record is written
//! in — sqlx's typed `Postgres`, `MySql` and `Sqlite` and its `Any` — and the few bound
//! statements the one-commit path runs on them, written once for all four.
//!
//! The statements' text is each backend's (`postgres.rs`, `mysql.rs`, `sqlite.rs`); what
//! is here is how they are bound and run on a connection of any of the four drivers, so
//! that [`OneCommitStore`](crate::OneCommitStore), [`WriteTransaction`](crate::WriteTransaction)
//! and [`AnyFinalizer`](crate::AnyFinalizer) are written once instead of once per driver.

use std::future::Future;
use std::time::Duration;

use idempotency_core::{Binding, FencingToken, RecordId, StoredResponse};
use sqlx::Pool;
#[allow(unused_imports)] // with no backend compiled in
use sqlx::Row;

/// A record to insert: what the insert statements bind before the answer (scope, key,
/// method, path, body_sha256, token, lifetime, lease).
#[allow(unreachable_pub)] // sealed: only this crate's databases take it
#[derive(Clone, Copy, Debug)]
pub struct NewRecord<'a> {
    pub(crate) id: &'a RecordId,
    pub(crate) binding: &'a Binding,
    pub(crate) token: FencingToken,
    /// From now until it expires, in milliseconds.
    pub(crate) expires_in_ms: i64,
    /// From now until its lease lapses, in milliseconds.
    pub(crate) lease_ms: i64,
}

impl<'a> NewRecord<'a> {
    /// A record of `id` bound to `binding`, owned by `token` under a lease of `lease`,
    /// expiring `lifetime` from now, or when its lease lapses if that is later (a record in
    /// flight under a live lease never expires).
    pub(crate) fn new(
        id: &'a RecordId,
        binding: &'a Binding,
        token: FencingToken,
        lease: Duration,
        lifetime: Duration,
    ) -> Self {
        Self {
            id,
            binding,
            token,
            expires_in_ms: crate::common::millis(lifetime.max(lease)),
            lease_ms: crate::common::millis(lease),
        }
    }
}

/// The database a connection is on, as the statements tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    Postgres,
    MySql,
    Sqlite,
}

impl Dialect {
    /// The dialect of a database sqlx names `name` (`Database::NAME`, or an `Any`
    /// connection's backend name).
    pub(crate) fn of(name: &str) -> Option<Self> {
        match name {
            "PostgreSQL" => Some(Self::Postgres),
            "MySQL" => Some(Self::MySql),
            "SQLite" => Some(Self::Sqlite),
            _ => None,
        }
    }
}

mod sealed {
    /// Only this crate's databases are [`RecordDatabase`](super::RecordDatabase)s: their
    /// methods are the crate's statements.
    #[allow(unreachable_pub)]
    pub trait Sealed {}
}

/// A sqlx database whose transactions a request's record can be written in, so that the
/// record and the handler's write commit once: `sqlx::Postgres`, `sqlx::MySql`,
/// `sqlx::Sqlite` (each with this crate's feature for it) and `sqlx::Any`. A service on a
/// typed pool (`PgPool`, …) and one on an `AnyPool` use the same
/// [`OneCommitStore`](crate::OneCommitStore) and [`Tx`](crate::Tx).
///
/// Sealed; its methods are the crate's own.
pub trait RecordDatabase: sqlx::Database + sealed::Sealed {
    #[doc(hidden)]
    /// The backend's name (`Database::NAME`, or what an `Any` connection is on).
    fn backend_name(connection: &Self::Connection) -> &str;

    #[doc(hidden)]
    /// Whether `pool` is on SQLite, whose write transactions take the write lock at once.
    fn is_sqlite(pool: &Pool<Self>) -> bool;

    #[doc(hidden)]
    /// Runs a statement without parameters; the rows it changed.
    fn run(
        connection: &mut Self::Connection,
        sql: &str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    #[doc(hidden)]
    /// Runs a statement with one `BIGINT` parameter (a lock key); the rows it changed.
    fn run_with(
        connection: &mut Self::Connection,
        sql: &str,
        value: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    #[doc(hidden)]
    /// The one text value a query without parameters answers (`SELECT VERSION()`).
    fn text(
        connection: &mut Self::Connection,
        sql: &str,
    ) -> impl Future<Output = Result<String, sqlx::Error>> + Send;

    #[doc(hidden)]
    /// The one nullable `BIGINT` a query without parameters answers.
    fn optional_number(
        connection: &mut Self::Connection,
        sql: &str,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send;

    #[doc(hidden)]
    /// The one nullable text value a query with one `BIGINT` parameter answers.
    fn optional_text_of(
        connection: &mut Self::Connection,
        sql: &str,
        value: i64,
    ) -> impl Future<Output = Result<Option<String>, sqlx::Error>> + Send;

    #[doc(hidden)]
    /// How many rows a query with two text parameters (a record's scope and key)
    /// answers.
    fn rows_of_key(
        connection: &mut Self::Connection,
        sql: &str,
        id: &RecordId,
    ) -> impl Future<Output = Result<usize, sqlx::Error>> + Send;

    #[doc(hidden)]
    /// Inserts the in-flight record for `id` with the backend's `insert_in_flight`
    /// statement: `(committed, inserted)`. PostgreSQL's statement takes the key's
    /// advisory lock (`lock_key`) and answers a row saying whether a record holds the
    /// key and whether this one went in; the others' answer the rows inserted.
    fn insert_in_flight(
        connection: &mut Self::Connection,
        sql: &str,
        record: &NewRecord<'_>,
        lock_key: Option<i64>,
    ) -> impl Future<Output = Result<(i64, i64), sqlx::Error>> + Send;

    #[doc(hidden)]
    /// PostgreSQL: whether a record holds `id`, and whether the transaction holds the
    /// key's advisory lock (`lock_key`), with the backend's look statement (`sql`):
    /// `(committed, locked)`.
    fn look_under_lock(
        connection: &mut Self::Connection,
        sql: &str,
        id: &RecordId,
        lock_key: i64,
    ) -> impl Future<Output = Result<(bool, bool), sqlx::Error>> + Send;

    #[doc(hidden)]
    /// PostgreSQL and SQLite: inserts the finished record for `id` whole (replacing an
    /// expired one); the rows inserted.
    fn insert_completed(
        connection: &mut Self::Connection,
        sql: &str,
        record: &NewRecord<'_>,
        answer: &StoredResponse,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    #[doc(hidden)]
    /// What `id`'s scope holds, with the backend's scope usage statement (`sql`):
    /// `(key_live, records, bytes, next_expiry_in_ms)`.
    fn scope_usage(
        connection: &mut Self::Connection,
        sql: &str,
        id: &RecordId,
    ) -> impl Future<Output = Result<(bool, i64, i64, Option<i64>), sqlx::Error>> + Send;

    #[doc(hidden)]
    /// Writes `answer` into the record `token` holds, with the backend's finalize
    /// statement (`sql`, of the connection's backend); the rows it finalized.
    fn write_answer(
        connection: &mut Self::Connection,
        sql: &str,
        id: &RecordId,
        token: FencingToken,
        answer: &StoredResponse,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// PostgreSQL: waits up to `timeout` for the key's advisory lock (`lock_key`), held by a
/// one-commit owner while its record is not written yet, in a transaction of its own that
/// takes the lock and lets it go: `true` once it was free (the owner ended), `false` if it
/// was still held when the time was up.
pub(crate) async fn wait_for_key_lock<DB: RecordDatabase>(
    pool: &Pool<DB>,
    lock_key: i64,
    timeout: Duration,
) -> Result<bool, sqlx::Error> {
    // The whole wait is bounded by `timeout`, the wait for a pooled connection included:
    // a pool whose connections the handlers hold would otherwise keep a duplicate waiting
    // past the layer's in-flight wait (found by the simulation: leased reservations on
    // PostgreSQL, seed 100, a 150 ms wait answered after 610 ms).
    let deadline = tokio::time::Instant::now() + timeout;
    let Ok(connection) = tokio::time::timeout_at(deadline, pool.acquire()).await else {
        return Ok(false);
    };
    let mut connection = connection?;
    let mut transaction = sqlx::Connection::begin(&mut *connection).await?;
    // Rounded up to whole milliseconds, so that the wait never ends before `timeout`
    // (truncated, a 400 ms wait ended after 399.9 ms); `lock_timeout` 0 would mean
    // "forever".
    let timeout = deadline.saturating_duration_since(tokio::time::Instant::now());
    let ms = timeout
        .as_micros()
        .div_ceil(1000)
        .clamp(1, i32::MAX as u128);
    DB::run(&mut transaction, &format!("SET LOCAL lock_timeout = {ms}")).await?;
    let waited = DB::run_with(
        &mut transaction,
        "SELECT pg_advisory_xact_lock($1)",
        lock_key,
    )
    .await;
    let _ = transaction.rollback().await;
    match waited {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(error)) => match error.code().as_deref() {
            // lock_not_available: the owner still runs.
            Some("55P03") => Ok(false),
            // deadlock_detected: the wait ended without the lock; look again.
            Some("40P01") => Ok(true),
            _ => Err(sqlx::Error::Database(error)),
        },
        Err(error) => Err(error),
    }
}

/// Binds what every insert of a record starts with, in the statements' order.
#[allow(dead_code)] // with no backend compiled in
fn bind_new_record<'q, DB>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>,
    record: &NewRecord<'q>,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>
where
    DB: sqlx::Database,
    for<'e> &'e str: sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    Vec<u8>: for<'e> sqlx::Encode<'e, DB> + sqlx::Type<DB>,
    i64: for<'e> sqlx::Encode<'e, DB> + sqlx::Type<DB>,
{
    query
        .bind(record.id.scope.as_str())
        .bind(record.id.key.as_str())
        .bind(record.binding.method.as_str())
        .bind(record.binding.path.as_str())
        .bind(record.binding.body_sha256.to_vec())
        .bind(record.token.0)
        .bind(record.expires_in_ms)
        .bind(record.lease_ms)
}

/// Implements [`RecordDatabase`] for one sqlx database: the bodies are the same for all
/// four (each compiles against its driver's own types), but how a connection names its
/// backend differs between the typed drivers and `Any`.
#[allow(unused_macros)] // with no backend compiled in
macro_rules! record_database {
    ($database:ty, backend: |$connection:ident| $name:expr, sqlite: |$pool:ident| $sqlite:expr) => {
        impl sealed::Sealed for $database {}

        impl RecordDatabase for $database {
            fn backend_name($connection: &Self::Connection) -> &str {
                $name
            }

            fn is_sqlite($pool: &Pool<Self>) -> bool {
                $sqlite
            }

            async fn run(connection: &mut Self::Connection, sql: &str) -> Result<u64, sqlx::Error> {
                Ok(sqlx::query(sql).execute(connection).await?.rows_affected())
            }

            async fn run_with(
                connection: &mut Self::Connection,
                sql: &str,
                value: i64,
            ) -> Result<u64, sqlx::Error> {
                let done = sqlx::query(sql).bind(value).execute(connection).await?;
                Ok(done.rows_affected())
            }

            async fn text(
                connection: &mut Self::Connection,
                sql: &str,
            ) -> Result<String, sqlx::Error> {
                sqlx::query_scalar(sql).fetch_one(connection).await
            }

            async fn optional_number(
                connection: &mut Self::Connection,
                sql: &str,
            ) -> Result<Option<i64>, sqlx::Error> {
                sqlx::query(sql).fetch_one(connection).await?.try_get(0)
            }

            async fn optional_text_of(
                connection: &mut Self::Connection,
                sql: &str,
                value: i64,
            ) -> Result<Option<String>, sqlx::Error> {
                sqlx::query(sql)
                    .bind(value)
                    .fetch_one(connection)
                    .await?
                    .try_get(0)
            }

            async fn rows_of_key(
                connection: &mut Self::Connection,
                sql: &str,
                id: &RecordId,
            ) -> Result<usize, sqlx::Error> {
                let rows = sqlx::query(sql)
                    .bind(id.scope.as_str())
                    .bind(id.key.as_str())
                    .fetch_all(connection)
                    .await?;
                Ok(rows.len())
            }

            async fn insert_in_flight(
                connection: &mut Self::Connection,
                sql: &str,
                record: &NewRecord<'_>,
                lock_key: Option<i64>,
            ) -> Result<(i64, i64), sqlx::Error> {
                let query = bind_new_record(sqlx::query(sql), record);
                match lock_key {
                    Some(lock_key) => {
                        let row = query.bind(lock_key).fetch_one(connection).await?;
                        Ok((row.try_get("committed")?, row.try_get("inserted")?))
                    }
                    None => {
                        let done = query.execute(connection).await?;
                        Ok((0, done.rows_affected() as i64))
                    }
                }
            }

            async fn look_under_lock(
                connection: &mut Self::Connection,
                sql: &str,
                id: &RecordId,
                lock_key: i64,
            ) -> Result<(bool, bool), sqlx::Error> {
                let row = sqlx::query(sql)
                    .bind(id.scope.as_str())
                    .bind(id.key.as_str())
                    .bind(lock_key)
                    .fetch_one(connection)
                    .await?;
                Ok((row.try_get("committed")?, row.try_get("locked")?))
            }

            async fn insert_completed(
                connection: &mut Self::Connection,
                sql: &str,
                record: &NewRecord<'_>,
                answer: &StoredResponse,
            ) -> Result<u64, sqlx::Error> {
                let done = bind_new_record(sqlx::query(sql), record)
                    .bind(i32::from(answer.status))
                    .bind(answer.encode_headers())
                    .bind(&answer.body[..])
                    .bind(crate::common::trailers_column(answer))
                    .execute(connection)
                    .await?;
                Ok(done.rows_affected())
            }

            async fn scope_usage(
                connection: &mut Self::Connection,
                sql: &str,
                id: &RecordId,
            ) -> Result<(bool, i64, i64, Option<i64>), sqlx::Error> {
                let query = sqlx::query(sql)
                    .bind(id.scope.as_str())
                    .bind(id.key.as_str());
                // MySQL's statement names the scope twice, without numbered parameters.
                let query = match Dialect::of(Self::backend_name(connection)) {
                    Some(Dialect::MySql) => query.bind(id.scope.as_str()),
                    _ => query,
                };
                let row = query.fetch_one(connection).await?;
                // A truth value, or (MySQL) a count.
                let key_live = row
                    .try_get::<bool, _>("key_live")
                    .or_else(|_| row.try_get::<i64, _>("key_live").map(|n| n > 0))?;
                Ok((
                    key_live,
                    row.try_get("records")?,
                    row.try_get("bytes")?,
                    row.try_get("next_expiry_in_ms")?,
                ))
            }

            async fn write_answer(
                connection: &mut Self::Connection,
                sql: &str,
                id: &RecordId,
                token: FencingToken,
                answer: &StoredResponse,
            ) -> Result<u64, sqlx::Error> {
                let (status, headers, body) = (
                    i32::from(answer.status),
                    answer.encode_headers(),
                    &answer.body[..],
                );
                let trailers = crate::common::trailers_column(answer);
                let query = sqlx::query(sql);
                // Each backend's finalize statement takes its values in its own order.
                match Dialect::of(Self::backend_name(connection)) {
                    #[cfg(feature = "postgres")]
                    Some(Dialect::Postgres) => {
                        let row = query
                            .bind(id.scope.as_str())
                            .bind(id.key.as_str())
                            .bind(token.0)
                            .bind(status)
                            .bind(headers)
                            .bind(body)
                            .bind(crate::common::notice_for(id))
                            .bind(trailers)
                            .fetch_optional(connection)
                            .await?;
                        Ok(u64::from(row.is_some()))
                    }
                    Some(Dialect::MySql) => {
                        let done = query
                            .bind(status)
                            .bind(headers)
                            .bind(body)
                            .bind(trailers)
                            .bind(id.scope.as_str())
                            .bind(id.key.as_str())
                            .bind(token.0)
                            .execute(connection)
                            .await?;
                        Ok(done.rows_affected())
                    }
                    _ => {
                        let done = query
                            .bind(id.scope.as_str())
                            .bind(id.key.as_str())
                            .bind(token.0)
                            .bind(status)
                            .bind(headers)
                            .bind(body)
                            .bind(trailers)
                            .execute(connection)
                            .await?;
                        Ok(done.rows_affected())
                    }
                }
            }
        }
    };
}

#[cfg(feature = "any")]
record_database!(sqlx::Any,
    backend: |connection| connection.backend_name(),
    sqlite: |pool| pool.connect_options().database_url.scheme() == "sqlite");
#[cfg(feature = "postgres")]
record_database!(sqlx::Postgres,
    backend: |_connection| <sqlx::Postgres as sqlx::Database>::NAME,
    sqlite: |_pool| false);
#[cfg(feature = "mysql")]
record_database!(sqlx::MySql,
    backend: |_connection| <sqlx::MySql as sqlx::Database>::NAME,
    sqlite: |_pool| false);
#[cfg(feature = "sqlite")]
record_database!(sqlx::Sqlite,
    backend: |_connection| <sqlx::Sqlite as sqlx::Database>::NAME,
    sqlite: |_pool| true);
