//! What operators call: [`RecordAdmin`] (inspect a record, evict one), and what it
//! answers.

use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;

use super::record::{Binding, IdempotencyRecord, RecordId, RecordState, StoreError};
use super::request::IdempotencyStore;

/// A record as an operator sees it, from [`RecordAdmin::inspect`]: what the key is
/// bound to, where it stands and when, but never the stored response's headers or body.
///
/// The stored answer stays out on purpose: it belongs to whoever sent the request, and may
/// hold something only they should see (a token, a location, another tenant's data),
/// while an inspection is typically read by an operator, pasted into a ticket or shown
/// on an admin page.
///
/// The times are the store's clock (the database's, for a shared store), which is the
/// clock that decides leases and expiry; compare them with [`inspected_at`](Self::inspected_at),
/// not with the reader's own clock. A store that cannot tell them leaves them `None`
/// (the trait's default `inspect` does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InspectedRecord {
    /// What the key was first used for.
    pub binding: Binding,
    /// Where the record stands.
    pub state: InspectedState,
    /// When the record was reserved (a takeover keeps it).
    pub created_at: Option<SystemTime>,
    /// When the record expires and counts as absent; a lease may push it later.
    pub expires_at: Option<SystemTime>,
    /// The store's "now" when the record was read.
    pub inspected_at: Option<SystemTime>,
}

/// Where an [inspected](InspectedRecord) record stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InspectedState {
    /// An owner is running the request (or crashed while running it).
    InFlight {
        /// Whether the lease had lapsed when the record was read: the owner stopped
        /// renewing it, and the next retry will take the record over.
        lease_lapsed: bool,
        /// When the current lease lapses unless the owner renews it.
        lease_expires_at: Option<SystemTime>,
    },
    /// The request finished; every retry gets its stored answer, which had this status.
    Completed {
        /// The stored answer's HTTP status.
        status: u16,
    },
}

impl InspectedRecord {
    /// The inspection of a record as [`IdempotencyStore::load`](super::IdempotencyStore::load) returns it, with no
    /// times: what the trait's default `inspect` reports.
    pub fn from_record(record: &IdempotencyRecord) -> Self {
        let state = match &record.state {
            RecordState::InFlight { lease_lapsed, .. } => InspectedState::InFlight {
                lease_lapsed: *lease_lapsed,
                lease_expires_at: None,
            },
            RecordState::Completed(response) => InspectedState::Completed {
                status: response.status,
            },
        };
        Self {
            binding: record.binding.clone(),
            state,
            created_at: None,
            expires_at: None,
            inspected_at: None,
        }
    }

    /// Whether an owner is (or was, if its lease lapsed) running the request.
    pub fn is_in_flight(&self) -> bool {
        matches!(self.state, InspectedState::InFlight { .. })
    }
}

/// Whether [`RecordAdmin::evict`] may delete a record that is still in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictInFlight {
    /// Leave an in-flight record alone and answer [`Eviction::InFlight`]: its owner may
    /// still be running the request, and a retry after the eviction would run it again
    /// beside it.
    Refuse,
    /// Delete it anyway, for an owner that is stuck for good. The owner's finalize then
    /// finds nothing to write to (and logs that it lost the key), and the next retry runs
    /// the request again, possibly while the stuck owner is still running it.
    Force,
}

/// What [`RecordAdmin::evict`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Eviction {
    /// The record was deleted; this is how it stood just before. The next request with
    /// its key runs as a first execution.
    Evicted(InspectedRecord),
    /// The record is in flight and [`EvictInFlight::Refuse`] was asked; nothing changed.
    InFlight(InspectedRecord),
    /// No live record holds the key (never reserved, released, evicted, or expired).
    NotFound,
}

/// What operators call: read a record as an operator sees it ([`inspect`](Self::inspect))
/// and delete one on an operator's order ([`evict`](Self::evict)), from an admin endpoint
/// or a tool. The layer never calls either.
///
/// It extends [`IdempotencyStore`] (an operator's tool reads and deletes the records the
/// request path writes); a store implements it beside that trait and [`PurgeExpired`],
/// and holds it as `Arc<dyn RecordAdmin>` or [`Arc<dyn FullStore>`](super::FullStore) where
/// operators need it.
///
/// # The rules
///
/// They extend [the rules every store keeps](IdempotencyStore#the-rules-every-store-keeps),
/// and the [conformance suite](crate::conformance) checks them too.
///
/// - **Inspection** ([`inspect`](Self::inspect)) reads a live record like `load` does, without its stored headers and body, and with its times by
///   the store's clock: created (kept by a takeover), expires, the lease's end, and the
///   store's "now". An expired record is absent. It changes nothing.
/// - **Eviction** ([`evict`](Self::evict)) deletes a live record whatever its token, so that the next request with its key runs again. It
///   deletes an in-flight record only when forced, and decides on the record as it
///   stands when it deletes it: a record that is finalized, released or reserved anew
///   between the store's read and its delete is looked at again, never deleted on a stale
///   verdict. Whoever [waits](super::IdempotencyStore::wait) on an evicted record is woken (it
///   then finds it absent), and the fenced operations of its former owner find nothing.
///   An expired record is absent: evicting it answers [`Eviction::NotFound`].
///
/// [`PurgeExpired`]: super::PurgeExpired
/// [`FullStore`]: super::FullStore
#[async_trait]
pub trait RecordAdmin: IdempotencyStore {
    /// Reads the live record, if any, as an operator sees it: binding, state, the stored
    /// status, and the times by the store's clock, but not the stored headers or body
    /// (see [`InspectedRecord`]). The layer never calls it.
    ///
    /// The default derives it from [`load`](IdempotencyStore::load), which knows no times: they are
    /// `None`. Every store in this workspace overrides it. The [conformance
    /// suite](crate::conformance::Suite) finds out whether a store's `inspect` tells the
    /// times, and runs its check of them (`inspect_shows_state_and_times_without_the_body`)
    /// only then, reporting it skipped otherwise.
    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        Ok(self
            .load(id)
            .await?
            .as_ref()
            .map(InspectedRecord::from_record))
    }

    /// Deletes the live record on an operator's order, whatever token it holds, so that
    /// the next request with its key runs as a first execution: the way out when a wrong
    /// answer was stored for the whole lifetime, or an owner is stuck. An in-flight record
    /// is deleted only with [`EvictInFlight::Force`]; otherwise the answer is
    /// [`Eviction::InFlight`] and nothing changes. The layer never calls it.
    ///
    /// The trait's rules say what must hold (eviction decides on the record as it stands
    /// when it deletes it, and wakes waiters). There is no default way to delete a
    /// completed record through the other operations, so the default answers
    /// [`StoreError::Unsupported`]; every store in this workspace overrides it. The
    /// conformance suite checks eviction where a store has it, and reports those checks
    /// skipped where it answers `Unsupported`.
    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        let _ = (id, in_flight);
        Err(StoreError::Unsupported {
            operation: "evict a record",
            method: "evict",
        })
    }
}

/// Forwards every method, provided ones included (see the forwarding
/// [`IdempotencyStore`] impl for `Arc`).
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl<T: RecordAdmin + ?Sized> RecordAdmin for Arc<T> {
    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        (**self).inspect(id).await
    }

    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        (**self).evict(id, in_flight).await
    }
}
