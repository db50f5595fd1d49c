//! The checker catches what it is for: stores with a bug planted on purpose, each of
//! which the memory sweep's seeds expose. (Bugs of the layer itself are planted on a
//! scratch branch instead; `TESTING.md` lists them with the seeds that caught them.)

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Binding, FencingToken, IdempotencyRecord, IdempotencyStore, Ownership, RecordId, RecordState,
    Reservation, StoreError, StoredResponse, Waited, async_trait,
};
use idempotency_store_memory::MemoryStore;
use simulation::{Settings, Target, simulate};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// `release` answers `Held` and deletes nothing.
    ReleaseKeepsTheRecord,
    /// `finalize` with a token that was taken over writes over the new owner's record.
    FinalizeIgnoresTheFence,
}

struct Planted {
    inner: MemoryStore,
    bug: Bug,
}

#[async_trait]
impl IdempotencyStore for Planted {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        self.inner.reserve(id, binding, lease, lifetime).await
    }
    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.inner.load(id).await
    }
    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        self.inner.wait(id, timeout).await
    }
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.inner.renew(id, token, lease).await
    }
    async fn hold(
        &self,
        id: &RecordId,
        token: FencingToken,
        kept_for: Duration,
    ) -> Result<Ownership, StoreError> {
        self.inner.hold(id, token, kept_for).await
    }
    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let answer = self.inner.finalize(id, token, response).await?;
        if self.bug == Bug::FinalizeIgnoresTheFence
            && answer == Ownership::Lost
            && let Some(IdempotencyRecord {
                state: RecordState::InFlight { token: owner, .. },
                ..
            }) = self.inner.load(id).await?
        {
            return self.inner.finalize(id, owner, response).await;
        }
        Ok(answer)
    }
    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        if self.bug == Bug::ReleaseKeepsTheRecord {
            return Ok(Ownership::Held);
        }
        self.inner.release(id, token).await
    }
    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        self.inner.take_over(id, lapsed, lease).await
    }
}

/// The first of seeds 1..=100 whose run breaks `rule` on a store with `bug`.
fn first_seed_that_catches(bug: Bug, rule: &str) -> Option<u64> {
    let settings = Settings::quick();
    (1..=100).find(|&seed| {
        let run = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a runtime")
            .block_on(async {
                let target = Target {
                    store: Arc::new(Planted {
                        inner: MemoryStore::new(),
                        bug,
                    }),
                    purge: None,
                    leftovers: None,
                    namespace: String::new(),
                    effects: None,
                    own_faults: None,
                    reservations_unseen: false,
                };
                simulate(&target, &settings, seed).await
            });
        run.violations
            .iter()
            .any(|violation| violation.rule == rule)
    })
}

#[test]
fn a_release_that_deletes_nothing_is_caught() {
    let seed = first_seed_that_catches(Bug::ReleaseKeepsTheRecord, "a released record is gone");
    eprintln!("caught by seed {seed:?}");
    assert!(
        seed.is_some_and(|seed| seed <= 5),
        "caught by seed {seed:?}"
    );
}

#[test]
fn a_finalize_that_ignores_the_fence_is_caught() {
    let seed = first_seed_that_catches(
        Bug::FinalizeIgnoresTheFence,
        "a fenced owner changes nothing",
    );
    eprintln!("caught by seed {seed:?}");
    assert!(
        seed.is_some_and(|seed| seed <= 20),
        "caught by seed {seed:?}"
    );
}
