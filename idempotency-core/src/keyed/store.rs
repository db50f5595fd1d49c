//! The seam between the request path and the store: the store as the stages call it,
//! with the layer's lease and lifetime added to each call, and each call timed.

use std::time::{Duration, Instant};

use crate::metrics::{self, StoreCall, store_call, store_call_now};
use crate::settings::Settings;
use crate::store::{
    Binding, FencingToken, Ownership, RecordId, Reservation, StoreError, StoredResponse, Waited,
};

/// The layer's store as the stages call it: each call with the layer's lease and
/// lifetime, timed as [`STORE_DURATION`](crate::metrics::STORE_DURATION) (a duplicate's wait as [`WAIT_DURATION`](crate::metrics::WAIT_DURATION)) when
/// the layer records metrics.
pub(crate) struct RequestPathStore<'a> {
    settings: &'a Settings,
}

impl<'a> RequestPathStore<'a> {
    pub(crate) fn of(settings: &'a Settings) -> Self {
        Self { settings }
    }

    /// Reserves the key, with the layer's lease and lifetime: answered at once by a store
    /// that can ([`IdempotencyStore::reserve_now`](crate::IdempotencyStore::reserve_now)).
    pub(crate) async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
    ) -> Result<Reservation, StoreError> {
        let settings = self.settings;
        let (lease, lifetime) = (settings.lease(), settings.kept_for());
        let at_once = store_call_now(settings, StoreCall::Reserve, || {
            settings.store.reserve_now(id, binding, lease, lifetime)
        });
        match at_once {
            Some(answer) => answer,
            None => {
                let reserving = settings.store.reserve(id, binding, lease, lifetime);
                store_call(settings, StoreCall::Reserve, reserving).await
            }
        }
    }

    /// Waits for the owner of an in-flight record, at most `timeout`.
    pub(crate) async fn wait(
        &self,
        id: &RecordId,
        timeout: Duration,
    ) -> Result<Waited, StoreError> {
        let waiting_since = self.settings.metrics.then(Instant::now);
        let waited = self.settings.store.wait(id, timeout).await;
        if let Some(since) = waiting_since {
            metrics::wait_duration(self.settings, since.elapsed());
        }
        waited
    }

    /// Takes over a record whose owner's lease lapsed, with a new lease.
    pub(crate) async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
    ) -> Result<Option<FencingToken>, StoreError> {
        let settings = self.settings;
        let taking = settings.store.take_over(id, lapsed, settings.lease());
        store_call(settings, StoreCall::TakeOver, taking).await
    }

    /// Renews the owner's lease.
    pub(crate) async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
    ) -> Result<Ownership, StoreError> {
        let settings = self.settings;
        let renewing = settings.store.renew(id, token, settings.lease());
        store_call(settings, StoreCall::Renew, renewing).await
    }

    /// Holds the key for as long as a record is kept (the lifetime and its grace period),
    /// for an owner that can neither finalize nor release: see
    /// [`IdempotencyStore::hold`](crate::IdempotencyStore::hold).
    pub(crate) async fn hold(
        &self,
        id: &RecordId,
        token: FencingToken,
    ) -> Result<Ownership, StoreError> {
        let settings = self.settings;
        let holding = settings.store.hold(id, token, settings.kept_for());
        store_call(settings, StoreCall::Hold, holding).await
    }

    /// Stores the answer: at once where the store can
    /// ([`IdempotencyStore::finalize_now`](crate::IdempotencyStore::finalize_now)).
    pub(crate) async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        stored: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let settings = self.settings;
        let at_once = store_call_now(settings, StoreCall::Finalize, || {
            settings.store.finalize_now(id, token, stored)
        });
        match at_once {
            Some(answer) => answer,
            None => {
                let finalizing = settings.store.finalize(id, token, stored);
                store_call(settings, StoreCall::Finalize, finalizing).await
            }
        }
    }

    /// Releases the key.
    pub(crate) async fn release(
        &self,
        id: &RecordId,
        token: FencingToken,
    ) -> Result<Ownership, StoreError> {
        let releasing = self.settings.store.release(id, token);
        store_call(self.settings, StoreCall::Release, releasing).await
    }
}
