//! One transactional path for handlers, whatever the pool: [`Tx`], the transaction a
//! request's write belongs in, and [`Transactions`], where it comes from. The crate docs
//! ("Commit your write with its record") tell the story.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body::Body;
use idempotency_core::{BoxError, OutcomeUnknown, ReservationHandle, StoreError};

use crate::commit_outcome::CommitError;
use crate::in_transaction::FinalizeError;
use crate::record_database::{Dialect, RecordDatabase};

/// Where a handler's [`Tx`] comes from, and how the request's answer is recorded in it.
///
/// [`Writes`] is this crate's, for a `PgPool`, `MySqlPool`, `SqlitePool` or `AnyPool`,
/// with the records in that database or elsewhere. A store of your own implements it the
/// same way; so does a wrapper (a test's, say, that pauses before a `COMMIT`).
pub trait Transactions: Clone + Send + Sync + 'static {
    /// The database the transaction is on.
    type Database: sqlx::Database;
    /// An open transaction.
    type Transaction: OpenTransaction<Connection = <Self::Database as sqlx::Database>::Connection>;

    /// Whether the records are in the transaction's database: a `COMMIT` whose answer is
    /// lost is then decided by the record itself (it committed with the write or not at
    /// all, and the layer's release is fenced on a record still in flight). When they are
    /// not, a lost `COMMIT` the database cannot tell about must not release the key.
    fn records_in_transaction(&self) -> bool;

    /// The transaction for a request's write: `reservation` is the request's, `None`
    /// without a key.
    fn begin(
        &self,
        reservation: Option<&ReservationHandle>,
    ) -> impl Future<Output = Result<Self::Transaction, StoreError>> + Send;

    /// Writes `answer` into the request's record inside `transaction` and returns the
    /// answer to send once it commits, marked so that the layer does not record it again;
    /// an answer the layer does not keep (5xx, 401, …) comes back unmarked.
    fn finalize_in<B>(
        &self,
        transaction: &mut Self::Transaction,
        reservation: Option<&ReservationHandle>,
        answer: Response<B>,
    ) -> impl Future<Output = Result<Response<B>, FinalizeError>> + Send
    where
        B: Body<Data = Bytes> + From<Bytes> + Send,
        B::Error: Into<BoxError>;
}

/// A transaction a handler writes through and commits: sqlx's own, and
/// [`WriteTransaction`](crate::WriteTransaction).
pub trait OpenTransaction: Send + 'static {
    /// The connection it writes on.
    type Connection;

    /// The connection it writes on.
    fn connection(&mut self) -> &mut Self::Connection;

    /// The same, shared.
    fn connection_ref(&self) -> &Self::Connection;

    /// Commits it, saying on a failure whether anything of it may be in the database.
    fn commit(self) -> impl Future<Output = Result<(), CommitError>> + Send;
}

/// A `COMMIT` the database answered with an error rolled back, and so did one on SQLite;
/// one whose answer was lost may have committed.
impl<DB: sqlx::Database> OpenTransaction for sqlx::Transaction<'static, DB> {
    type Connection = DB::Connection;

    fn connection(&mut self) -> &mut DB::Connection {
        self
    }

    fn connection_ref(&self) -> &DB::Connection {
        self
    }

    async fn commit(self) -> Result<(), CommitError> {
        sqlx::Transaction::commit(self)
            .await
            .map_err(|error| CommitError::after(Dialect::of(DB::NAME), error))
    }
}

/// See [`WriteTransaction::commit`](crate::WriteTransaction::commit).
impl<DB: RecordDatabase> OpenTransaction for crate::WriteTransaction<DB> {
    type Connection = DB::Connection;

    fn connection(&mut self) -> &mut DB::Connection {
        self
    }

    fn connection_ref(&self) -> &DB::Connection {
        self
    }

    async fn commit(self) -> Result<(), CommitError> {
        crate::WriteTransaction::commit(self).await
    }
}

/// The transaction a request's write belongs in. Write through it as through a
/// connection (`&mut *tx`), then [`commit`](Self::commit) it with the answer, which
/// records the answer with the write and commits once. Dropped, it rolls back.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn handler(
/// #     writes: idempotency_store_sql::Writes<sqlx::Sqlite>,
/// #     reservation: Option<axum::Extension<idempotency_core::ReservationHandle>>,
/// # ) -> axum::response::Response {
/// use axum::response::IntoResponse;
/// use idempotency_store_sql::Tx;
///
/// let mut tx = match Tx::begin(&writes, reservation.as_deref()).await {
///     Ok(tx) => tx,
///     Err(error) => return (http::StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
/// };
/// sqlx::query("INSERT INTO orders (item) VALUES ('book')").execute(&mut *tx).await.unwrap();
/// let answer = (http::StatusCode::CREATED, "order placed").into_response();
/// match tx.commit(answer).await {
///     Ok(answer) => answer,                // the write and its record, committed once
///     Err(error) => error.into_response(), // rolled back, or its outcome unknown: a 5xx
/// }
/// # }
/// ```
///
/// With the `axum` feature it is an extractor: `Tx<T>` in a handler's arguments begins the
/// transaction on the `T` in the router's state (`FromRef`), with the request's
/// reservation, so that the handler and the domain code it calls take a transaction and
/// never see a reservation.
pub struct Tx<T: Transactions> {
    store: T,
    /// `Some` until it commits.
    transaction: Option<T::Transaction>,
    reservation: Option<ReservationHandle>,
}

impl<T: Transactions> Tx<T> {
    /// Begins the transaction for the request `reservation` belongs to (`None`: a request
    /// without a key).
    pub async fn begin(
        store: &T,
        reservation: Option<&ReservationHandle>,
    ) -> Result<Self, StoreError> {
        let transaction = store.begin(reservation).await?;
        Ok(Self {
            store: store.clone(),
            transaction: Some(transaction),
            reservation: reservation.cloned(),
        })
    }

    /// Records `answer` with the write and commits, once; the answer to send.
    ///
    /// On an error nothing of the request is committed, or (only when the records are
    /// kept elsewhere) whether it was is unknown: answer with
    /// [`TxError::into_response`], or with your own error answer, marked
    /// [`OutcomeUnknown`] when [`TxError::outcome_unknown`] says so.
    pub async fn commit<B>(mut self, answer: Response<B>) -> Result<Response<B>, TxError>
    where
        B: Body<Data = Bytes> + From<Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        let mut transaction = self.transaction.take().expect("open until it commits");
        let reservation = self.reservation.as_ref();
        // On an error the transaction is dropped, which rolls it back.
        let answer = self
            .store
            .finalize_in(&mut transaction, reservation, answer)
            .await
            .map_err(TxError::NotRecorded)?;
        match transaction.commit().await {
            Ok(()) => Ok(answer),
            Err(error @ CommitError::Unknown(_)) if !self.store.records_in_transaction() => {
                Err(TxError::Unknown(error))
            }
            Err(error) => Err(TxError::NotCommitted(error)),
        }
    }

    /// Rolls the transaction back (as dropping it does).
    pub fn rollback(self) {}
}

impl<T: Transactions> std::ops::Deref for Tx<T> {
    type Target = <T::Database as sqlx::Database>::Connection;

    fn deref(&self) -> &Self::Target {
        self.transaction
            .as_ref()
            .expect("open until it commits")
            .connection_ref()
    }
}

impl<T: Transactions> std::ops::DerefMut for Tx<T> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.transaction
            .as_mut()
            .expect("open until it commits")
            .connection()
    }
}

impl<T: Transactions> std::fmt::Debug for Tx<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("keyed", &self.reservation.is_some())
            .finish_non_exhaustive()
    }
}

/// A [`Tx`] still to begin: the store and the request's reservation, for domain code that
/// begins its transaction only once it is ready to write (after reads, or after writing
/// files, so as not to hold SQLite's write lock meanwhile). With the `axum` feature it is
/// an extractor, as [`Tx`] is.
#[derive(Clone)]
pub struct LazyTx<T: Transactions> {
    store: T,
    reservation: Option<ReservationHandle>,
}

impl<T: Transactions> LazyTx<T> {
    /// The transaction for the request `reservation` belongs to (`None`: a request
    /// without a key), on `store`, to begin later.
    pub fn new(store: T, reservation: Option<ReservationHandle>) -> Self {
        Self { store, reservation }
    }

    /// Begins it.
    pub async fn begin(self) -> Result<Tx<T>, StoreError> {
        Tx::begin(&self.store, self.reservation.as_ref()).await
    }
}

impl<T: Transactions> std::fmt::Debug for LazyTx<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyTx")
            .field("keyed", &self.reservation.is_some())
            .finish_non_exhaustive()
    }
}

/// Why [`Tx::commit`] did not commit the request's write, or cannot tell whether it did.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TxError {
    /// The answer could not be recorded (the key was taken over meanwhile, the database
    /// failed): the transaction rolled back, nothing of the request is committed.
    #[error(transparent)]
    NotRecorded(FinalizeError),
    /// The database did not commit. Or, with the records in the same database, the
    /// answer to `COMMIT` was lost: the record then decides, and a 5xx lets the layer
    /// release a key whose record rolled back and keep one whose record committed.
    #[error(transparent)]
    NotCommitted(CommitError),
    /// The answer to `COMMIT` was lost, the database could not tell what happened, and
    /// the records are kept elsewhere: the answer must be marked [`OutcomeUnknown`], so
    /// that the layer keeps the key reserved rather than let a retry run the write again.
    #[error(transparent)]
    Unknown(CommitError),
}

impl TxError {
    /// Whether the answer must be marked [`OutcomeUnknown`] (see [`TxError::Unknown`]).
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, Self::Unknown(_))
    }

    /// A plain-text error answer: 503 when nothing was committed (a retry runs again),
    /// 500 marked [`OutcomeUnknown`] when whether it was is unknown (the key stays
    /// reserved until it expires).
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        let status = if self.outcome_unknown() {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        let mut response = Response::new(B::from(Bytes::from(self.to_string())));
        *response.status_mut() = status;
        if self.outcome_unknown() {
            response.extensions_mut().insert(OutcomeUnknown);
        }
        response
    }
}

/// The one-commit store, on any of the [`RecordDatabase`]s: the transaction the request's
/// record was reserved in, and the record, the write and the answer committed once.
/// Where a handler's [`Tx`] writes, and where its request's record is kept: what a `Tx`
/// is begun from (in axum, the router's state, or a part of it through `FromRef`).
///
/// - [`with_records`](Self::with_records): the records are in the database the handler
///   writes to, kept by a [`OneCommitStore`](crate::OneCommitStore) (the layer's store).
///   The transaction is the one the key was reserved in (a new one for a request without
///   a key, or with [`Reservations::Leased`](crate::Reservations::Leased)); the record,
///   the write and the answer commit once.
/// - [`records_elsewhere`](Self::records_elsewhere): the records are elsewhere (Redis,
///   say). The transaction is a new one on the pool; the layer records the answer after
///   the handler, and a keyed transaction's `COMMIT` whose answer is lost is asked about
///   (PostgreSQL's `txid_status`) and, where the database cannot tell, answered
///   [`TxError::Unknown`].
///
/// The handler's code is the same either way: `Tx<Writes<DB>>`.
pub struct Writes<DB: RecordDatabase>(Place<DB>);

enum Place<DB: RecordDatabase> {
    WithRecords(Arc<crate::OneCommitStore<DB>>),
    Elsewhere(sqlx::Pool<DB>),
}

impl<DB: RecordDatabase> Writes<DB> {
    /// Writes in the database of `store`, which keeps the records (and is the layer's
    /// store): one commit for the record, the write and the answer.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # fn demo(store: std::sync::Arc<idempotency_store_sql::OneCommitStore<sqlx::Postgres>>) {
    /// use idempotency_store_sql::Writes;
    ///
    /// let writes = Writes::with_records(store.clone());
    /// # drop(writes); }
    /// ```
    pub fn with_records(store: Arc<crate::OneCommitStore<DB>>) -> Self {
        Self(Place::WithRecords(store))
    }

    /// Writes on `pool`, whose database does not hold the records (the layer's store is
    /// another: Redis, say).
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # fn demo(pool: sqlx::PgPool) {
    /// use idempotency_store_sql::Writes;
    ///
    /// let writes = Writes::records_elsewhere(pool);
    /// # drop(writes); }
    /// ```
    pub fn records_elsewhere(pool: sqlx::Pool<DB>) -> Self {
        Self(Place::Elsewhere(pool))
    }
}

impl<DB: RecordDatabase> Clone for Writes<DB> {
    fn clone(&self) -> Self {
        Self(match &self.0 {
            Place::WithRecords(store) => Place::WithRecords(store.clone()),
            Place::Elsewhere(pool) => Place::Elsewhere(pool.clone()),
        })
    }
}

impl<DB: RecordDatabase> std::fmt::Debug for Writes<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Place::WithRecords(store) => {
                f.debug_tuple("Writes::with_records").field(store).finish()
            }
            Place::Elsewhere(_) => f.write_str("Writes::records_elsewhere"),
        }
    }
}

impl<DB: RecordDatabase> Transactions for Writes<DB> {
    type Database = DB;
    type Transaction = crate::WriteTransaction<DB>;

    fn records_in_transaction(&self) -> bool {
        matches!(self.0, Place::WithRecords(_))
    }

    async fn begin(
        &self,
        reservation: Option<&ReservationHandle>,
    ) -> Result<Self::Transaction, StoreError> {
        match &self.0 {
            Place::WithRecords(store) => crate::OneCommitStore::begin(store, reservation).await,
            Place::Elsewhere(pool) => crate::WriteTransaction::begin_on(pool, reservation)
                .await
                .map_err(StoreError::backend),
        }
    }

    async fn finalize_in<B>(
        &self,
        transaction: &mut Self::Transaction,
        reservation: Option<&ReservationHandle>,
        answer: Response<B>,
    ) -> Result<Response<B>, FinalizeError>
    where
        B: Body<Data = Bytes> + From<Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        match &self.0 {
            Place::WithRecords(store) => {
                crate::OneCommitStore::finalize_in(store, transaction, reservation, answer).await
            }
            // The layer records it, after the handler.
            Place::Elsewhere(_) => Ok(answer),
        }
    }
}

#[cfg(feature = "axum")]
mod extractor {
    use axum_core::extract::{FromRef, FromRequestParts};
    use axum_core::response::{IntoResponse, Response};
    use http::request::Parts;
    use idempotency_core::ReservationHandle;

    use super::{LazyTx, Transactions, Tx, TxError};

    /// `Tx<T>` as an axum extractor: the transaction for the request's write, begun on
    /// the `T` in the router's state (`FromRef`), with the request's reservation.
    /// Refused with a 503 when it cannot begin.
    impl<T, S> FromRequestParts<S> for Tx<T>
    where
        T: Transactions + FromRef<S>,
        S: Send + Sync,
    {
        type Rejection = Response;

        async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
            let store = T::from_ref(state);
            let reservation = parts.extensions.get::<ReservationHandle>();
            Tx::begin(&store, reservation).await.map_err(|error| {
                (
                    http::StatusCode::SERVICE_UNAVAILABLE,
                    format!("cannot begin the request's transaction; retry: {error}"),
                )
                    .into_response()
            })
        }
    }

    /// `LazyTx<T>` as an axum extractor: never refused; the transaction begins when the
    /// handler asks.
    impl<T, S> FromRequestParts<S> for LazyTx<T>
    where
        T: Transactions + FromRef<S>,
        S: Send + Sync,
    {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
            let reservation = parts.extensions.get::<ReservationHandle>().cloned();
            Ok(LazyTx::new(T::from_ref(state), reservation))
        }
    }

    impl IntoResponse for TxError {
        fn into_response(self) -> Response {
            TxError::into_response(self)
        }
    }
}
