//! [`AnyFinalizer`]: `finalize_in` for a transaction on sqlx's `Any` driver, on whichever
//! backend it runs. It sits above the backends, whose finalize statements it uses.

use bytes::Bytes;
use http::Response;
use http_body::Body;
use idempotency_core::{BoxError, ReservationHandle};

use crate::in_transaction::{FinalizeError, finalize_with};
use crate::record_database::Dialect;

/// `finalize_in` for a transaction on sqlx's `Any` driver (feature `any`), whichever
/// database it is on: PostgreSQL, MySQL/MariaDB or SQLite. For services that keep their
/// own state through `Any` (an Iceberg catalog on `iceberg-catalog-sql`'s tables, say):
/// the typed stores' `finalize_in` take a typed connection, and an `Any` connection
/// cannot be turned into one.
///
/// It needs only the table the store keeps its records in: build it with
/// [`AnyFinalizer::new`] and the store's [`table_name`](crate::PostgresStore::table_name),
/// or [`AnyFinalizer::default`] for the default table (what
/// [`open`](crate::open) uses). The records' backend must be compiled in (features
/// `postgres`, `mysql`, `sqlite`).
///
/// ```no_run
/// # async fn demo(store: idempotency_store_sql::PostgresStore, reservation: Option<&idempotency_core::ReservationHandle>) -> Result<(), Box<dyn std::error::Error>> {
/// use axum::response::IntoResponse;
/// use idempotency_store_sql::AnyFinalizer;
/// use sqlx::AnyPool;
///
/// let finalizer = AnyFinalizer::new(store.table_name());
/// let pool = AnyPool::connect("postgres://app@db/catalog").await?;
///
/// // In the handler:
/// let mut tx = pool.begin().await?;
/// sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = $1")
///     .bind(7_i64)
///     .execute(&mut *tx)
///     .await?;
/// let answer = (http::StatusCode::OK, "paid").into_response();
/// let answer = finalizer.finalize_in(&mut tx, reservation, answer).await?; // on error: roll back
/// tx.commit().await?;
/// # drop(answer); Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct AnyFinalizer {
    table: crate::TableName,
    #[cfg(feature = "postgres")]
    postgres: String,
    #[cfg(feature = "mysql")]
    mysql: String,
    #[cfg(feature = "sqlite")]
    sqlite: String,
}

impl Default for AnyFinalizer {
    /// For records in the [default table](crate::DEFAULT_TABLE_NAME).
    fn default() -> Self {
        Self::new(&crate::TableName::default())
    }
}

impl AnyFinalizer {
    /// For records in `table` (the table the store was given with `with_table_name`, or
    /// the default).
    pub fn new(table: &crate::TableName) -> Self {
        Self {
            table: table.clone(),
            #[cfg(feature = "postgres")]
            postgres: crate::postgres::finalize_statement(table),
            #[cfg(feature = "mysql")]
            mysql: crate::mysql::finalize_statement(table),
            #[cfg(feature = "sqlite")]
            sqlite: crate::sqlite::finalize_statement(table),
        }
    }

    /// The table the records are in.
    pub fn table_name(&self) -> &crate::TableName {
        &self.table
    }

    /// Finalizes the request's reservation inside `transaction`, with `response`, and
    /// returns the response to send once the transaction commits, exactly as the typed
    /// stores' `finalize_in` do (see [`PostgresStore::finalize_in`](crate::PostgresStore::finalize_in)
    /// for the whole story). A request without a reservation (no key) gets its response
    /// back untouched.
    ///
    /// On an error, roll the transaction back.
    pub async fn finalize_in<B>(
        &self,
        transaction: &mut sqlx::AnyConnection,
        reservation: Option<&ReservationHandle>,
        response: Response<B>,
    ) -> Result<Response<B>, FinalizeError>
    where
        B: Body<Data = Bytes> + From<Bytes>,
        B::Error: Into<BoxError>,
    {
        if reservation.is_none() {
            return Ok(response);
        }
        let statement = self.statement_for(transaction)?;
        finalize_with::<sqlx::Any, B>(transaction, statement, reservation, response).await
    }

    /// The fenced finalize statement of the backend `transaction` is on.
    fn statement_for(&self, transaction: &sqlx::AnyConnection) -> Result<&str, FinalizeError> {
        let backend = transaction.backend_name().to_owned();
        let statement = match Dialect::of(&backend) {
            #[cfg(feature = "postgres")]
            Some(Dialect::Postgres) => &self.postgres,
            #[cfg(feature = "mysql")]
            Some(Dialect::MySql) => &self.mysql,
            #[cfg(feature = "sqlite")]
            Some(Dialect::Sqlite) => &self.sqlite,
            #[allow(unreachable_patterns)]
            Some(dialect) => {
                return Err(FinalizeError::NotBuiltFor {
                    database: backend,
                    feature: dialect.feature(),
                });
            }
            None => {
                return Err(FinalizeError::WrongDatabase {
                    expected: "PostgreSQL, MySQL/MariaDB or SQLite",
                    found: backend,
                });
            }
        };
        Ok(statement)
    }
}
