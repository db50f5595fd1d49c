//! What maintenance calls: [`PurgeExpired`], which deletes expired records.

use std::sync::Arc;

use async_trait::async_trait;

use super::record::StoreError;
use super::request::IdempotencyStore;

/// What [`PurgeExpired::purge_expired`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Purged {
    /// It deleted this many expired records (never more than the batch size).
    Deleted(u64),
    /// The backend deletes expired records on its own; there was nothing to do.
    ByBackend,
}

/// What maintenance calls: delete the records that have expired. An expired record
/// already counts as absent everywhere ([the rules](IdempotencyStore#the-rules-every-store-keeps));
/// purging only frees the space it holds. The layer never calls it;
/// [`purge_all_expired`](crate::purge_all_expired) and
/// [`spawn_purge_task`](crate::spawn_purge_task) do, paced so that a backlog does not
/// compete with the foreground traffic.
///
/// It extends [`IdempotencyStore`], as tower-sessions' `ExpiredDeletion` extends its
/// `SessionStore`; a store implements it beside that trait and
/// [`RecordAdmin`](super::RecordAdmin).
#[async_trait]
pub trait PurgeExpired: IdempotencyStore {
    /// Deletes at most `batch_size` expired records and says how many it deleted; call
    /// it again while it returns a full batch. A backend that deletes expired records by
    /// itself (key expiry in Redis, a TTL index) returns [`Purged::ByBackend`] instead.
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError>;
}

/// Forwards every method (see the forwarding [`IdempotencyStore`] impl for `Arc`).
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl<T: PurgeExpired + ?Sized> PurgeExpired for Arc<T> {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        (**self).purge_expired(batch_size).await
    }
}
