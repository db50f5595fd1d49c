//! [`WriteTransaction`]: the transaction a [`Tx`](crate::Tx) holds on a
//! [`OneCommitStore`](super::OneCommitStore) or [`Writes::records_elsewhere`](crate::Writes::records_elsewhere).

use idempotency_core::ReservationHandle;
use sqlx::{Pool, Transaction};
use tokio::sync::{OwnedSemaphorePermit, oneshot};

use crate::commit_outcome::{CommitError, OutcomeCheck};
use crate::record_database::{Dialect, NewRecord, RecordDatabase};

use super::claims::ClaimGuard;

/// The transaction inside a [`Tx`](crate::Tx) on a [`OneCommitStore`](crate::OneCommitStore) or
/// [`Writes::records_elsewhere`](crate::Writes::records_elsewhere): the one its request's record was
/// reserved in, or a new one. It holds the store's room for one open write transaction
/// until it ends; dropped, it rolls back.
///
/// A `COMMIT` whose answer is lost never lets a retry run the change twice:
/// [`commit`](Self::commit) tells a change that did not commit from one whose outcome is
/// unknown (see [`CommitError`]), and for a keyed transaction on PostgreSQL asks the
/// database what happened.
pub struct WriteTransaction<DB: RecordDatabase> {
    /// `Some` until it commits or rolls back.
    pub(super) transaction: Option<Transaction<'static, DB>>,
    pub(super) room: Option<OwnedSemaphorePermit>,
    /// SQLite: the reservation's claim, let go once the transaction ended.
    pub(super) claim: Option<ClaimGuard<Self>>,
    /// A keyed request whose record is kept elsewhere: the pool to ask, after a `COMMIT`
    /// whose answer was lost, whether it committed.
    pub(super) asks_after_lost_commit: Option<Pool<DB>>,
}

/// A transaction on `pool`; on SQLite, one that takes the write lock at once.
///
/// Begun on a task of its own and handed over: a caller that goes away while `BEGIN` runs
/// (its client hung up) would otherwise leave the connection in a transaction that nobody
/// ends — on SQLite, holding the database's write lock for good.
pub(super) async fn begin_on<DB: RecordDatabase>(
    pool: &Pool<DB>,
) -> Result<Transaction<'static, DB>, sqlx::Error> {
    let pool = pool.clone();
    let immediate = DB::is_sqlite(&pool);
    let (handover, begun) = oneshot::channel();
    tokio::spawn(async move {
        let transaction = if immediate {
            pool.begin_with("BEGIN IMMEDIATE").await
        } else {
            pool.begin().await
        };
        if let Err(Ok(abandoned)) = handover.send(transaction) {
            let _ = abandoned.rollback().await;
        }
    });
    begun.await.unwrap_or(Err(sqlx::Error::PoolClosed))
}

impl<DB: RecordDatabase> WriteTransaction<DB> {
    /// A transaction on `pool` without a one-commit store (idempotency off, or records
    /// elsewhere), with the same care: on SQLite it takes the write lock at once, and a
    /// caller that goes away while it begins, commits or rolls back leaves no
    /// connection inside a transaction.
    ///
    /// Give it the request's `reservation` when the records are kept in another store
    /// than this database (Redis, say): if the answer to its `COMMIT` is lost, the
    /// commit then asks the database what happened before it answers (PostgreSQL; see
    /// [`CommitError`]), which costs one more statement before `COMMIT`. A request without
    /// a key, or whose record is in this database, needs no question: pass `None`.
    pub(crate) async fn begin_on(
        pool: &Pool<DB>,
        reservation: Option<&ReservationHandle>,
    ) -> Result<Self, sqlx::Error> {
        let mut transaction = Self::open(begin_on(pool).await?, None);
        transaction.asks_after_lost_commit = reservation.map(|_| pool.clone());
        Ok(transaction)
    }

    pub(super) fn new(transaction: Transaction<'static, DB>, room: OwnedSemaphorePermit) -> Self {
        Self::open(transaction, Some(room))
    }

    pub(super) fn open(
        transaction: Transaction<'static, DB>,
        room: Option<OwnedSemaphorePermit>,
    ) -> Self {
        Self {
            transaction: Some(transaction),
            room,
            claim: None,
            asks_after_lost_commit: None,
        }
    }

    pub(super) fn holding(mut self, claim: ClaimGuard<Self>) -> Self {
        self.claim = Some(claim);
        self
    }

    /// Commits the transaction: for a keyed request, the record, the mutation and the
    /// answer, once.
    ///
    /// A failed commit says whether anything of it may be in the database
    /// ([`CommitError::Unknown`]) or not ([`CommitError::NotCommitted`]). When the answer
    /// to `COMMIT` was lost and the transaction belongs to a keyed request whose records are
    /// elsewhere ([`Writes::records_elsewhere`](crate::Writes::records_elsewhere)), it asks the database first, for up to
    /// [`OUTCOME_CHECK_FOR`](crate::OUTCOME_CHECK_FOR), and is `Ok` if it committed after
    /// all.
    pub async fn commit(mut self) -> Result<(), CommitError> {
        let backend = Dialect::of(DB::backend_name(&self));
        if let Err(error) = self.record_in_flight_unless_finalized().await {
            let _ = self.rollback().await;
            return Err(CommitError::NotCommitted(error));
        }
        let check = match self.asks_after_lost_commit.take() {
            Some(pool) => Some(OutcomeCheck::prepare(pool, &mut self).await?),
            None => None,
        };
        let Err(error) = self.end(Transaction::commit).await else {
            return Ok(());
        };
        match check {
            Some(check) => check.outcome(backend, error).await,
            None => Err(CommitError::after(backend, error)),
        }
    }

    /// PostgreSQL: a reservation's transaction about to commit without its answer inserts
    /// the record in flight, which keeps the key held once the `COMMIT` lets the key's
    /// lock go (the layer then writes the answer into it).
    pub(super) async fn record_in_flight_unless_finalized(&mut self) -> Result<(), sqlx::Error> {
        let Some(claim) = &self.claim else {
            return Ok(());
        };
        let Some((in_flight, terms)) = claim.unrecorded() else {
            return Ok(());
        };
        let (statement, lock_key) = (in_flight.statement.clone(), in_flight.lock_key);
        let (id, token) = (claim.id.clone(), claim.token);
        let (_, inserted) = DB::insert_in_flight(
            &mut **self,
            &statement,
            &NewRecord::new(&id, &terms.binding, token, terms.lease, terms.lifetime),
            Some(lock_key),
        )
        .await?;
        if inserted == 1 {
            Ok(())
        } else {
            Err(sqlx::Error::Protocol(
                "another request committed a record under this idempotency key while this \
                 one ran; nothing of this one was committed"
                    .into(),
            ))
        }
    }

    /// Rolls the transaction back, a reservation with it.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.end(Transaction::rollback).await
    }

    /// Commits or rolls back on a task of its own, which finishes even if the caller goes
    /// away meanwhile (a connection must not go back to the pool half way through), and
    /// gives the room and the claim back once it is done.
    pub(super) async fn end<F>(
        mut self,
        how: fn(Transaction<'static, DB>) -> F,
    ) -> Result<(), sqlx::Error>
    where
        F: Future<Output = Result<(), sqlx::Error>> + Send + 'static,
    {
        let transaction = self.transaction.take().expect("open until it ends");
        let held = (self.room.take(), self.claim.take());
        let ended = tokio::spawn(async move {
            let ended = how(transaction).await;
            drop(held);
            ended
        });
        ended.await.unwrap_or(Err(sqlx::Error::PoolClosed))
    }
}

impl<DB: RecordDatabase> Drop for WriteTransaction<DB> {
    /// Rolls back a transaction dropped while open, and gives its room (and its pooled
    /// connection) back only once that is done: sqlx alone would return the connection
    /// with the rollback still queued, and the next `BEGIN` on it would fail.
    fn drop(&mut self) {
        let Some(transaction) = self.transaction.take() else {
            return;
        };
        let (room, claim) = (self.room.take(), self.claim.take());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = transaction.rollback().await;
                drop((room, claim));
            });
        }
    }
}

impl<DB: RecordDatabase> std::ops::Deref for WriteTransaction<DB> {
    type Target = Transaction<'static, DB>;

    fn deref(&self) -> &Self::Target {
        self.transaction.as_ref().expect("open until it ends")
    }
}

impl<DB: RecordDatabase> std::ops::DerefMut for WriteTransaction<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.transaction.as_mut().expect("open until it ends")
    }
}

impl<DB: RecordDatabase> std::fmt::Debug for WriteTransaction<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteTransaction").finish_non_exhaustive()
    }
}
