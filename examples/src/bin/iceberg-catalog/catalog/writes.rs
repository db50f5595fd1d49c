//! [`Writes`]: where a change's transaction comes from and how its answer is recorded in
//! it, the catalog's implementation of `idempotency_store_sql::Transactions`. Domain code
//! takes the transaction ([`CatalogTx`]) and never sees a reservation.

use std::sync::Arc;

use axum::http::Response;
use bytes::Bytes;
use http_body::Body;
use idempotency_core::{BoxError, ReservationHandle, StoreError};
use idempotency_store_sql::{
    FinalizeError, LazyTx, OneCommitStore, RecordsElsewhere, Transactions, WriteTransaction,
};

use super::database::CatalogDatabase;

/// A change's transaction, still to begin: the extractor every mutating route takes.
pub(crate) type CatalogTx<DB> = LazyTx<Writes<DB>>;

/// Where the idempotency records are, as the catalog's changes write them.
pub(crate) enum Writes<DB: CatalogDatabase> {
    /// In the catalog's database: the record, the change and the answer commit once (or,
    /// with `--two-commit`, the reservation is committed first, with a lease).
    Here(Arc<OneCommitStore<DB>>),
    /// Elsewhere (Redis), or nowhere (`--no-idempotency`): the layer records the answer.
    Elsewhere(RecordsElsewhere<DB>),
}

impl<DB: CatalogDatabase> Clone for Writes<DB> {
    fn clone(&self) -> Self {
        match self {
            Self::Here(store) => Self::Here(store.clone()),
            Self::Elsewhere(elsewhere) => Self::Elsewhere(elsewhere.clone()),
        }
    }
}

impl<DB: CatalogDatabase> Transactions for Writes<DB> {
    type Database = DB;
    type Transaction = WriteTransaction<DB>;

    fn records_in_transaction(&self) -> bool {
        matches!(self, Self::Here(_))
    }

    async fn begin(
        &self,
        reservation: Option<&ReservationHandle>,
    ) -> Result<WriteTransaction<DB>, StoreError> {
        match self {
            Self::Here(store) => store.begin(reservation).await,
            Self::Elsewhere(elsewhere) => elsewhere.begin(reservation).await,
        }
    }

    async fn finalize_in<B>(
        &self,
        transaction: &mut WriteTransaction<DB>,
        reservation: Option<&ReservationHandle>,
        answer: Response<B>,
    ) -> Result<Response<B>, FinalizeError>
    where
        B: Body<Data = Bytes> + From<Bytes> + Send,
        B::Error: Into<BoxError>,
    {
        match self {
            Self::Here(store) => store.finalize_in(transaction, reservation, answer).await,
            Self::Elsewhere(elsewhere) => {
                elsewhere
                    .finalize_in(transaction, reservation, answer)
                    .await
            }
        }
    }
}
