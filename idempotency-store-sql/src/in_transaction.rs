//! Recording a request's answer inside the handler's own transaction (what `Tx::commit`
//! does through the store): its error, its first and last steps, and the fenced write of
//! the answer into a record in flight.

use bytes::Bytes;
use http::Response;
use http_body::Body;
use idempotency_core::{BoxError, Ownership, PreparedAnswer, ReservationHandle};

use crate::record_database::RecordDatabase;

/// Why `finalize_in` did not finalize the reservation. **Roll your transaction back**
/// (drop it, or call `rollback`) and answer with an error, e.g. a 503: nothing of the
/// request may commit. A 5xx leaves the key to whoever owns it now, and the client's
/// retry gets that request's answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FinalizeError {
    /// The request no longer owns its key: its lease lapsed and another request took it
    /// over (and runs the mutation itself), or the record expired, or it was already
    /// finalized (`finalize_in` was called twice).
    #[error(
        "this request's reservation was taken over by another request (its lease lapsed), \
         or has expired or was already finalized; roll back your transaction: the request \
         that holds the key now runs the mutation, and retries get its answer"
    )]
    TakenOver,
    /// The database failed to run the finalize statement.
    #[error(
        "finalizing the idempotency record in your transaction failed; roll back your \
         transaction and answer with a 5xx, so that a retry runs again: {0}"
    )]
    Database(#[source] sqlx::Error),
    /// The response body failed while it was read, so there is no answer to store.
    #[error(
        "the response body failed while it was read, so it cannot be stored; roll back \
         your transaction: {0}"
    )]
    Body(#[source] BoxError),
    /// This build of the crate has no support for the transaction's database.
    #[error(
        "the transaction is on {database}, which this build of idempotency-store-sql cannot \
         write to; enable its `{feature}` feature"
    )]
    NotBuiltFor {
        /// The database the transaction is on.
        database: String,
        /// The cargo feature that adds it.
        feature: &'static str,
    },
    /// The transaction is on another database than the one the records are in.
    #[error(
        "the transaction is on {found}, but the idempotency records are kept in {expected}; \
         finalize in a transaction on the store's own database"
    )]
    WrongDatabase {
        /// The database the records are in.
        expected: &'static str,
        /// The database the transaction is on.
        found: String,
    },
}

/// What a backend's `finalize_in` does first: nothing at all for a request without a
/// reservation (no key), or for an answer the layer does not keep (`Err` then holds the
/// response to send as it is); otherwise the prepared answer, whose
/// [`stored`](PreparedAnswer::stored) the backend writes.
pub(crate) async fn prepare<B>(
    reservation: Option<&ReservationHandle>,
    response: Response<B>,
) -> Result<Result<PreparedAnswer, Response<B>>, FinalizeError>
where
    B: Body<Data = Bytes> + From<Bytes>,
    B::Error: Into<BoxError>,
{
    let Some(reservation) = reservation else {
        return Ok(Err(response));
    };
    let prepared = reservation
        .prepare_answer(response)
        .await
        .map_err(FinalizeError::Body)?;
    if prepared.stored().is_none() {
        return Ok(Err(prepared.into_response()));
    }
    Ok(Ok(prepared))
}

/// What a backend's `finalize_in` does last: the marked response if its fenced write
/// held, [`FinalizeError::TakenOver`] if not.
pub(crate) fn finish<B: From<Bytes>>(
    prepared: PreparedAnswer,
    ownership: Ownership,
) -> Result<Response<B>, FinalizeError> {
    match ownership {
        Ownership::Held => Ok(prepared.into_finalized()),
        Ownership::Lost => Err(FinalizeError::TakenOver),
    }
}

/// `finalize_in`, written once for every store and driver: the layer's rules applied to
/// `response`, the answer written into the request's record in `connection`'s
/// transaction with `statement` (the backend's fenced finalize), and the answer to send
/// once it commits.
pub(crate) async fn finalize_with<DB: RecordDatabase, B>(
    connection: &mut DB::Connection,
    statement: &str,
    reservation: Option<&ReservationHandle>,
    response: Response<B>,
) -> Result<Response<B>, FinalizeError>
where
    B: Body<Data = Bytes> + From<Bytes>,
    B::Error: Into<BoxError>,
{
    let prepared = match prepare(reservation, response).await? {
        Ok(prepared) => prepared,
        Err(unchanged) => return Ok(unchanged),
    };
    let reservation = prepared.reservation();
    let stored = prepared
        .stored()
        .expect("prepare() passes on only answers with something to store");
    let written = DB::write_answer(
        connection,
        statement,
        reservation.id(),
        reservation.token(),
        stored,
    )
    .await
    .map_err(FinalizeError::Database)?;
    finish(prepared, crate::common::ownership(written))
}
