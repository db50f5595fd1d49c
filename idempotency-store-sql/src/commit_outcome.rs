//! What a `COMMIT` that failed did: [`CommitError`], and how a keyed transaction finds out
//! when the answer to its `COMMIT` was lost.
//!
//! A `COMMIT` the database answered with an error did not commit. One whose answer never
//! came (the connection dropped after it was sent) may have: the database may have
//! committed and then lost the connection. Answering that request with a plain 5xx would
//! release its key, and the client's retry would run the change a second time (a
//! namespace created twice answers "already exists", a table commit "snapshot already
//! exists"). So before it answers, a keyed transaction asks:
//!
//! - **PostgreSQL**: the transaction's id, read just before `COMMIT`
//!   (`txid_current_if_assigned()`), then, on another connection, `txid_status` of it:
//!   committed, aborted, or still in progress (asked again until it ends). An id the
//!   server does not know yet ("in the future": it answers for a server that never saw the
//!   transaction, e.g. a standby promoted without it) did not commit there.
//! - **MySQL/MariaDB** have no such function: the outcome is unknown.
//! - **SQLite** is a local file: a commit that failed did not commit.
//!
//! Where the records live in the same database as the change, the record itself tells:
//! the layer's release is fenced on the record still being in flight, so a committed
//! answer stays and is replayed. The question matters when they live elsewhere (Redis,
//! say): a keyed `Tx` on [`Writes::records_elsewhere`](crate::Writes::records_elsewhere).

use std::time::Duration;

use sqlx::{Pool, Transaction};

use crate::record_database::{Dialect, RecordDatabase};

/// How long a transaction whose `COMMIT` answer was lost keeps asking the database what
/// happened before it calls the outcome unknown: long enough for a connection or a
/// failover to come back, short enough for the client that waits.
pub const OUTCOME_CHECK_FOR: Duration = Duration::from_secs(10);

/// Why [`WriteTransaction::commit`](crate::WriteTransaction::commit) did not commit, or
/// could not tell whether it did.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// Nothing of the transaction is in the database. Answer with an error that lets a
    /// retry run again (a 5xx releases the key).
    #[error("the database did not commit the transaction; a retry may run it again: {0}")]
    NotCommitted(#[source] sqlx::Error),
    /// The database may or may not have committed the transaction: the answer to its
    /// `COMMIT` was lost, and asking afterwards did not tell. Answer with an error marked
    /// [`OutcomeUnknown`](idempotency_core::OutcomeUnknown), so that the layer keeps the
    /// key reserved until it expires instead of releasing it (a retry would run the
    /// change a second time).
    #[error(
        "the answer to COMMIT was lost, and whether the database committed is unknown; \
         check the state before trying again: {0}"
    )]
    Unknown(#[source] sqlx::Error),
}

impl CommitError {
    /// What a failed `COMMIT` on `backend` did, without asking: a `COMMIT` the database
    /// answered with an error rolled back, and so did one on SQLite (a local file); one
    /// whose answer was lost may have committed.
    pub(crate) fn after(backend: Option<Dialect>, error: sqlx::Error) -> Self {
        if matches!(error, sqlx::Error::Database(_)) || backend == Some(Dialect::Sqlite) {
            Self::NotCommitted(error)
        } else {
            Self::Unknown(error)
        }
    }
}

/// What a transaction needs to find out, after its `COMMIT` answer was lost, what
/// happened: the pool to ask on, and (PostgreSQL) its id.
pub(crate) struct OutcomeCheck<DB: RecordDatabase> {
    pool: Pool<DB>,
    /// PostgreSQL: the transaction's id, `None` if it wrote nothing.
    transaction_id: Option<i64>,
}

impl<DB: RecordDatabase> OutcomeCheck<DB> {
    /// Readies the check for `transaction`, right before its `COMMIT` (PostgreSQL: reads
    /// its id). An error here means the `COMMIT` was never sent: nothing committed.
    pub(crate) async fn prepare(
        pool: Pool<DB>,
        transaction: &mut Transaction<'static, DB>,
    ) -> Result<Self, CommitError> {
        let transaction_id =
            if Dialect::of(DB::backend_name(transaction)) == Some(Dialect::Postgres) {
                DB::optional_number(transaction, "SELECT txid_current_if_assigned()")
                    .await
                    .map_err(CommitError::NotCommitted)?
            } else {
                None
            };
        Ok(Self {
            pool,
            transaction_id,
        })
    }

    /// What the failed `COMMIT` did, as the database tells: `Ok` if it committed after all.
    pub(crate) async fn outcome(
        self,
        backend: Option<Dialect>,
        error: sqlx::Error,
    ) -> Result<(), CommitError> {
        if backend != Some(Dialect::Postgres) || matches!(error, sqlx::Error::Database(_)) {
            return Err(CommitError::after(backend, error));
        }
        let Some(id) = self.transaction_id else {
            // It wrote nothing, so there is nothing it could have committed.
            return Err(CommitError::NotCommitted(error));
        };
        let give_up_at = tokio::time::Instant::now() + OUTCOME_CHECK_FOR;
        loop {
            let status = match self.pool.acquire().await {
                Ok(mut connection) => {
                    DB::optional_text_of(&mut connection, "SELECT txid_status($1)", id).await
                }
                Err(error) => Err(error),
            };
            match status {
                Ok(Some(status)) if status == "committed" => {
                    tracing::warn!(%error, "the answer to COMMIT was lost; the database says it committed");
                    return Ok(());
                }
                Ok(Some(status)) if status == "aborted" => {
                    return Err(CommitError::NotCommitted(error));
                }
                // Ended soon: the server commits or aborts it once it sees the connection gone.
                Ok(Some(status)) if status == "in progress" => {}
                // Too old to be known any more.
                Ok(_) => return Err(CommitError::Unknown(error)),
                // "transaction ID ... is in the future": this server never saw it.
                Err(sqlx::Error::Database(database))
                    if database.code().as_deref() == Some("22023") =>
                {
                    return Err(CommitError::NotCommitted(error));
                }
                // The database cannot be asked yet.
                Err(_) => {}
            }
            if tokio::time::Instant::now() >= give_up_at {
                return Err(CommitError::Unknown(error));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
