//! The storage contract, split by who calls it:
//!
//! - [`IdempotencyStore`] (`request`): the request path, what the layer calls for every
//!   keyed request (reserve, load, wait, renew, finalize, release, take over);
//! - [`RecordAdmin`] (`admin`): what operators call (inspect a record, evict one);
//! - [`PurgeExpired`] (`expiry`): what maintenance calls (delete expired records);
//! - [`FullStore`]: a store that does all three, for whoever needs more than the request
//!   path (a configuration that opens a store for the layer, the purge task and an admin
//!   endpoint; the conformance suite).
//!
//! The records they speak of (`record`) come first. Nothing here imports the layer; the
//! purge helpers that pace [`PurgeExpired`] and record metrics sit above it
//! (`crate::purge`).

mod admin;
mod expiry;
mod record;
mod request;

pub use admin::{EvictInFlight, Eviction, InspectedRecord, InspectedState, RecordAdmin};
pub use expiry::{PurgeExpired, Purged};
pub(crate) use record::LogHash;
pub use record::{
    Binding, BoxError, FencingToken, IdempotencyRecord, Ownership, RecordId, RecordState,
    Reservation, ScopeQuota, StoreError, StoredResponse, Waited,
};
pub use request::{IdempotencyStore, MAX_POLLS_PER_SECOND, wait_by_polling};

/// A store with every capability: the request path ([`IdempotencyStore`]), the
/// operators' ([`RecordAdmin`]) and maintenance ([`PurgeExpired`]). It has no methods of
/// its own, and every type that implements the three is one: implement those, never this.
///
/// It is what code that needs more than the request path holds, type-erased, as
/// `Arc<dyn FullStore>`: what `idempotency-store-sql`'s `open` returns, what the
/// [conformance suite](crate::conformance) runs against. Such an `Arc` goes wherever one
/// capability is asked for, by Rust's trait upcasting: to
/// [`IdempotencyLayer::from_shared_store`](crate::IdempotencyLayer::from_shared_store) as
/// an `Arc<dyn IdempotencyStore>`, to [`spawn_purge_task`](crate::spawn_purge_task) as an
/// `Arc<dyn PurgeExpired>`, to an admin endpoint as an `Arc<dyn RecordAdmin>`.
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{FullStore, IdempotencyLayer, RecordAdmin};
/// use idempotency_store_memory::MemoryStore;
///
/// let store: Arc<dyn FullStore> = Arc::new(MemoryStore::new());
/// let admin: Arc<dyn RecordAdmin> = store.clone();
/// let layer = IdempotencyLayer::from_shared_store(store);
/// # let _ = (admin, layer);
/// ```
pub trait FullStore: RecordAdmin + PurgeExpired {}

impl<T: RecordAdmin + PurgeExpired + ?Sized> FullStore for T {}
