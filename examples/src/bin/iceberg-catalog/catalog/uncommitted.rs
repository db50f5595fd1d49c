//! [`Uncommitted`]: a change written in an open transaction, and the commit that writes
//! the request's answer into its idempotency record in that same transaction.

use axum::response::Response;
use iceberg::table::Table;
use idempotency_store_sql::{CommitError, Tx, TxError};

use super::connection::Catalog;
use super::database::CatalogDatabase;
use super::log::LOG_TARGET;
use super::writes::Writes;
use crate::error::{ApiError, ApiResult};

/// A change written in an open database transaction: nothing of it is visible until
/// [`commit`](Self::commit), and dropped, it rolls back.
#[must_use = "a change that is not committed rolls back"]
pub(crate) struct Uncommitted<'a, DB: CatalogDatabase, T> {
    catalog: &'a Catalog<DB>,
    tx: Tx<Writes<DB>>,
    /// What the change made, for the answer.
    pub(crate) value: T,
    /// Metadata files written for the change: nothing points at them unless it commits.
    pub(super) written: Vec<String>,
    /// A dropped table whose files go once the drop committed (`purgeRequested`).
    pub(super) purge: Option<Table>,
}

impl<'a, DB: CatalogDatabase, T> Uncommitted<'a, DB, T> {
    pub(super) fn new(catalog: &'a Catalog<DB>, tx: Tx<Writes<DB>>, value: T) -> Self {
        Self {
            catalog,
            tx,
            value,
            written: Vec::new(),
            purge: None,
        }
    }

    pub(super) fn map<U>(self, f: impl FnOnce(T) -> U) -> Uncommitted<'a, DB, U> {
        Uncommitted {
            catalog: self.catalog,
            tx: self.tx,
            value: f(self.value),
            written: self.written,
            purge: self.purge,
        }
    }

    /// Writes `answer` into the request's idempotency record (if it carries a key) in the
    /// change's own transaction, commits the two together, and returns the answer to
    /// send, which is exactly what a retry with the key is replayed.
    ///
    /// If the record cannot be written (the request's key was taken over by another
    /// request while it ran, or the database failed), the change rolls back and the
    /// request fails with a 5xx: the key stays with whoever owns it, and nothing of this
    /// request is committed. If the answer to the `COMMIT` is lost, the answer says what
    /// the database says happened; if it cannot tell, a `CommitStateUnknownException`
    /// whose key the layer keeps reserved until it expires.
    pub(crate) async fn commit(self, answer: Response) -> ApiResult<Response> {
        let answer = match self.tx.commit(answer).await {
            Ok(answer) => answer,
            Err(TxError::NotRecorded(error)) => {
                self.catalog.delete_unused(&self.written).await;
                return Err(error.into());
            }
            Err(TxError::NotCommitted(CommitError::NotCommitted(e))) => {
                tracing::error!(target: LOG_TARGET, error = %e, "the database did not commit the change");
                self.catalog.delete_unused(&self.written).await;
                return Err(ApiError::not_committed(format!(
                    "The database did not commit the change, so nothing of it was committed; retry: {e}"
                )));
            }
            // The files stay, since a committed change may point at them. With the record
            // in this database the record tells (the layer's release leaves a committed
            // answer alone and frees the key of one that rolled back); kept elsewhere,
            // nothing tells, and the key stays reserved.
            Err(error) => {
                tracing::error!(target: LOG_TARGET, %error, "commit of catalog transaction failed");
                let unknown = ApiError::commit_state_unknown(format!(
                    "Committing the change failed: {error}"
                ));
                return Err(if error.outcome_unknown() {
                    unknown.marked_outcome_unknown()
                } else {
                    unknown
                });
            }
        };
        #[cfg(feature = "test-hooks")]
        crate::test_hooks::after_commit();
        if let Some(table) = self.purge
            && let Err(e) = iceberg::drop_table_data(&table).await
        {
            tracing::warn!(target: LOG_TARGET, error = %e, "could not delete all files of a purged table");
        }
        Ok(answer)
    }
}
