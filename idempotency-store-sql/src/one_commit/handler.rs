//! The handler's side of [`OneCommitStore`]: the transaction a `Tx` writes in, and the
//! answer recorded in it.

use bytes::Bytes;
use http::Response;
use http_body::Body;
use idempotency_core::{
    BoxError, FencingToken, Ownership, RecordId, ReservationHandle, StoreError,
};

use crate::common::backend;
use crate::in_transaction::{FinalizeError, finalize_with, finish, prepare};
use crate::record_database::{Dialect, NewRecord, RecordDatabase};

use super::OneCommitStore;
use super::claims::{ClaimGuard, InFlightUnlessFinalized, Pending, PendingState, Terms};
use super::transaction::WriteTransaction;

impl<DB: RecordDatabase> OneCommitStore<DB> {
    /// The transaction for a handler to write its mutation in: the one its request's
    /// record was reserved in (keyed requests), or a new one (requests without a key, or
    /// keyed ones that a typed store reserved: a record that had expired, say). Write,
    /// then [`finalize_in`](Self::finalize_in), then commit: for a keyed request, that one
    /// commit holds the record, the mutation and the answer.
    ///
    /// Dropping a reservation's transaction rolls the reservation back with it: the layer
    /// then keeps the handler's answer as a typed store would (two commits).
    ///
    /// Write transactions, keyed or not, take at most half the pool's connections at once
    /// (SQLite: one, the database's single writer), so that a handler that holds one always
    /// finds a connection to read with; past the pool's acquire timeout, this fails.
    pub(crate) async fn begin(
        &self,
        reservation: Option<&ReservationHandle>,
    ) -> Result<WriteTransaction<DB>, StoreError> {
        if let Some(reservation) = reservation
            && let Some(transaction) = self
                .reserved_transaction(reservation.id(), reservation.token())
                .await?
        {
            return Ok(transaction);
        }
        let room = self.room().await?;
        let transaction = self.begin_raw().await.map_err(backend)?;
        Ok(WriteTransaction::new(transaction, room))
    }

    /// The transaction that holds the reservation `token` made of `id`, taken by its
    /// handler: `None` if the reservation is not this store's to hand over (a typed
    /// store's, or taken already).
    pub(super) async fn reserved_transaction(
        &self,
        id: &RecordId,
        token: FencingToken,
    ) -> Result<Option<WriteTransaction<DB>>, StoreError> {
        let claim = |in_flight| ClaimGuard {
            claims: self.claims.clone(),
            id: id.clone(),
            token,
            in_flight,
            held_by_transaction: self.dialect != Dialect::Sqlite,
        };
        Ok(Some(match self.take(id, token) {
            // PostgreSQL: the record is written whole by `finalize_in`, in this
            // transaction; if the handler commits without it, the record is inserted in
            // flight at its `COMMIT`, so that the key stays held.
            Some(Taken::Open(transaction)) if self.dialect == Dialect::Postgres => {
                let in_flight = InFlightUnlessFinalized {
                    statement: self.sql.insert_in_flight.clone(),
                    lock_key: self.table.record_lock_key(id),
                };
                transaction.holding(claim(Some(in_flight)))
            }
            // MySQL/MariaDB: the record is in flight in this transaction already.
            Some(Taken::Open(transaction)) => transaction.holding(claim(None)),
            // SQLite: the record is written whole by `finalize_in`, in this transaction,
            // and the claim is let go when it ends.
            Some(Taken::Claimed) => {
                let room = self.room().await?;
                let transaction = self.begin_raw().await.map_err(backend)?;
                WriteTransaction::new(transaction, room).holding(claim(None))
            }
            None => return Ok(None),
        }))
    }

    /// Marks the reservation `token` holds on `id` as taken by its handler, and hands over
    /// what the handler writes in: the open transaction, or (SQLite) word that the
    /// handler's own transaction will hold the record. `None` once taken.
    pub(super) fn take(&self, id: &RecordId, token: FencingToken) -> Option<Taken<DB>> {
        let mut pending = self.claims.lock();
        let entry = pending.get_mut(id).filter(|entry| entry.token == token)?;
        if !matches!(entry.state, PendingState::Open(_) | PendingState::Claimed) {
            return None;
        }
        match std::mem::replace(&mut entry.state, PendingState::Taken) {
            PendingState::Open(transaction) => Some(Taken::Open(transaction)),
            _ => Some(Taken::Claimed),
        }
    }

    /// Writes `response` into the request's record inside `transaction` and returns the
    /// answer to send once it commits, as [`AnyFinalizer::finalize_in`](crate::AnyFinalizer::finalize_in) does; a request
    /// without a key gets its response back untouched. On an error, roll the transaction
    /// back.
    pub(crate) async fn finalize_in<B>(
        &self,
        transaction: &mut DB::Connection,
        reservation: Option<&ReservationHandle>,
        response: Response<B>,
    ) -> Result<Response<B>, FinalizeError>
    where
        B: Body<Data = Bytes> + From<Bytes>,
        B::Error: Into<BoxError>,
    {
        // PostgreSQL and SQLite: the record is inserted here, finished, for a reservation
        // whose transaction (SQLite: claim) the handler holds.
        if let Some(reservation) = reservation
            && let Some(terms) = self.held_terms(reservation)
        {
            let prepared = match prepare(Some(reservation), response).await? {
                Ok(prepared) => prepared,
                Err(unchanged) => return Ok(unchanged),
            };
            let stored = prepared
                .stored()
                .expect("prepare() keeps only answers to store");
            let (id, token) = (reservation.id(), reservation.token());
            let ownership = self
                .write_completed(transaction, id, token, &terms, stored)
                .await
                .map_err(FinalizeError::Database)?;
            if ownership == Ownership::Held {
                // The reservation goes when the transaction ends (`ClaimGuard`): a
                // duplicate waiting for it then reads the committed record.
                self.claims.finalized(id, token);
            }
            return finish(prepared, ownership);
        }
        let answer =
            finalize_with::<DB, B>(transaction, &self.sql.finalize, reservation, response).await?;
        // Finalized (or nothing to keep): the layer will not call finalize or release for it.
        if let Some(reservation) = reservation {
            self.forget(reservation.id(), reservation.token());
        }
        Ok(answer)
    }

    /// PostgreSQL, SQLite: writes a reservation's record, finished with `response`, in
    /// `connection`'s transaction; `Lost` if a live record holds the key (another process
    /// committed it while this request ran).
    pub(super) async fn write_completed(
        &self,
        connection: &mut DB::Connection,
        id: &RecordId,
        token: FencingToken,
        terms: &Terms,
        response: &idempotency_core::StoredResponse,
    ) -> Result<Ownership, sqlx::Error> {
        let statement = self.sql.insert_completed.as_deref().expect(
            "only PostgreSQL and SQLite write a finished record, and both have the statement",
        );
        let written = DB::insert_completed(
            connection,
            statement,
            &NewRecord::new(id, &terms.binding, token, terms.lease, terms.lifetime),
            response,
        )
        .await?;
        Ok(crate::common::ownership(written))
    }

    /// Writes `answer` into the record `token` holds, in `connection`'s transaction.
    pub(super) async fn write_answer(
        &self,
        connection: &mut DB::Connection,
        id: &RecordId,
        token: FencingToken,
        answer: &idempotency_core::StoredResponse,
    ) -> Result<Ownership, sqlx::Error> {
        let written = DB::write_answer(connection, &self.sql.finalize, id, token, answer).await?;
        Ok(crate::common::ownership(written))
    }

    /// SQLite: the finished record, in a transaction of its own, for a handler that wrote
    /// none in its transaction.
    pub(super) async fn record_alone(
        &self,
        id: &RecordId,
        token: FencingToken,
        terms: &Terms,
        response: &idempotency_core::StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let room = self.room().await?;
        let mut transaction = self.begin_raw().await.map_err(backend)?;
        let held = self
            .write_completed(&mut transaction, id, token, terms, response)
            .await
            .map_err(backend)?;
        if held == Ownership::Held {
            transaction.commit().await.map_err(backend)?;
        } else {
            transaction.rollback().await.map_err(backend)?;
        }
        drop(room);
        Ok(held)
    }
}

/// What a handler takes of its reservation.
pub(super) enum Taken<DB: RecordDatabase> {
    Open(WriteTransaction<DB>),
    Claimed,
}

impl<DB: RecordDatabase> OneCommitStore<DB> {
    /// Removes the reservation `token` holds on `id` from the pending ones.
    pub(super) fn forget(
        &self,
        id: &RecordId,
        token: FencingToken,
    ) -> Option<Pending<WriteTransaction<DB>>> {
        self.claims.forget(id, token)
    }

    /// The terms of a reservation whose record `finalize_in` writes whole: one whose
    /// handler took its transaction (PostgreSQL) or claim (SQLite; claimed, not taken, when
    /// the handler began a transaction of its own). `None` for any other, and on
    /// MySQL/MariaDB, whose record is in flight already.
    pub(super) fn held_terms(&self, reservation: &ReservationHandle) -> Option<Terms> {
        if self.dialect == Dialect::MySql {
            return None;
        }
        self.claims
            .lock()
            .get(reservation.id())
            .filter(|entry| {
                entry.token == reservation.token()
                    && matches!(entry.state, PendingState::Taken | PendingState::Claimed)
            })
            .map(|entry| entry.terms.clone())
    }
}
