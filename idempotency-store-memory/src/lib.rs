//! A single-process [`IdempotencyStore`] for development, tests and single-node services.
//!
//! Records live in a hash map behind a mutex. The store is bounded by `max_entries`
//! (default 10,000): when it is full of live records, a new reservation fails with
//! [`StoreError::Full`] (the layer answers 503 with `Retry-After`) instead of evicting a
//! record that a retry may still need. Expired records are dropped to make room first.
//! Duplicates waiting for an in-flight owner are woken by a notification, not by polling.
//!
//! Records do not survive a restart and are not shared between processes: run several
//! replicas on a SQL store instead.
//!
//! ```
//! use idempotency_core::IdempotencyLayer;
//! use idempotency_store_memory::MemoryStore;
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new().with_max_entries(50_000));
//! # drop(layer);
//! ```
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{
    Binding, FencingToken, IdempotencyRecord, IdempotencyStore, Ownership, RecordId, RecordState,
    Reservation, StoreError, StoredResponse,
};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The default bound on live records.
pub const DEFAULT_MAX_ENTRIES: usize = 10_000;

/// An in-process idempotency store. Cheap to clone: clones share the same records.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    records: Mutex<HashMap<RecordId, Entry>>,
    max_entries: usize,
    next_token: AtomicI64,
}

#[derive(Debug)]
struct Entry {
    binding: Binding,
    state: EntryState,
    expires_at: Instant,
    /// Created when the first duplicate waits; woken whenever the record settles.
    waiters: Option<Arc<Notify>>,
}

#[derive(Debug)]
enum EntryState {
    InFlight {
        token: FencingToken,
        lease_until: Instant,
    },
    Completed(StoredResponse),
}

impl Entry {
    fn to_record(&self, now: Instant) -> IdempotencyRecord {
        let state = match &self.state {
            EntryState::InFlight { token, lease_until } => RecordState::InFlight {
                token: *token,
                lease_lapsed: *lease_until <= now,
            },
            EntryState::Completed(response) => RecordState::Completed(response.clone()),
        };
        IdempotencyRecord {
            binding: self.binding.clone(),
            state,
        }
    }

    fn owned_by(&self, token: FencingToken, now: Instant) -> bool {
        self.expires_at > now
            && matches!(self.state, EntryState::InFlight { token: owner, .. } if owner == token)
    }

    fn wake_waiters(&self) {
        if let Some(waiters) = &self.waiters {
            waiters.notify_waiters();
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store bounded by [`DEFAULT_MAX_ENTRIES`].
    pub fn new() -> Self {
        Self::with_capacity_bound(DEFAULT_MAX_ENTRIES)
    }

    fn with_capacity_bound(max_entries: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                // Sized up front for the usual bounds, so that the table never rehashes
                // (every record moved while the lock is held) under load.
                records: Mutex::new(HashMap::with_capacity(max_entries.min(1 << 16))),
                max_entries,
                next_token: AtomicI64::new(1),
            }),
        }
    }

    /// Bounds the store to `max_entries` live records (at least 1).
    ///
    /// ```
    /// use idempotency_store_memory::MemoryStore;
    ///
    /// let store = MemoryStore::new().with_max_entries(100);
    /// assert_eq!(store.max_entries(), 100);
    /// ```
    pub fn with_max_entries(self, max_entries: usize) -> Self {
        Self::with_capacity_bound(max_entries.max(1))
    }

    /// The bound on live records.
    pub fn max_entries(&self) -> usize {
        self.shared.max_entries
    }

    /// How many records the store holds, expired ones not yet purged included.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<RecordId, Entry>> {
        // A panic while holding the lock cannot leave a record half-written (every
        // mutation is a single assignment), so a poisoned map is still consistent.
        self.shared
            .records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn new_token(&self) -> FencingToken {
        FencingToken(self.shared.next_token.fetch_add(1, Ordering::Relaxed))
    }
}

#[async_trait]
impl IdempotencyStore for MemoryStore {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        let waiters = match records.get_mut(id) {
            Some(entry) if entry.expires_at > now => {
                return Ok(Reservation::Exists(entry.to_record(now)));
            }
            // An expired record counts as absent; whoever waits on it is woken.
            Some(expired) => {
                expired.wake_waiters();
                expired.waiters.take()
            }
            None => {
                if records.len() >= self.shared.max_entries {
                    records.retain(|_, entry| entry.expires_at > now);
                    if records.len() >= self.shared.max_entries {
                        return Err(StoreError::Full {
                            max_entries: self.shared.max_entries,
                        });
                    }
                }
                None
            }
        };
        let token = self.new_token();
        records.insert(
            id.clone(),
            Entry {
                binding: binding.clone(),
                state: EntryState::InFlight {
                    token,
                    lease_until: now + lease,
                },
                expires_at: now + lifetime,
                waiters,
            },
        );
        Ok(Reservation::Reserved(token))
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        let now = Instant::now();
        Ok(self
            .lock()
            .get(id)
            .filter(|entry| entry.expires_at > now)
            .map(|entry| entry.to_record(now)))
    }

    async fn wait(
        &self,
        id: &RecordId,
        timeout: Duration,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let deadline = Instant::now() + timeout;
        loop {
            let now = Instant::now();
            let waiters;
            let wake_at;
            {
                let mut records = self.lock();
                let entry = match records.get_mut(id) {
                    Some(entry) if entry.expires_at > now => entry,
                    _ => return Ok(None),
                };
                let lease_until = match entry.state {
                    EntryState::InFlight { lease_until, .. } if lease_until > now => lease_until,
                    _ => return Ok(Some(entry.to_record(now))),
                };
                if now >= deadline {
                    return Ok(Some(entry.to_record(now)));
                }
                wake_at = deadline.min(lease_until).min(entry.expires_at);
                waiters = entry
                    .waiters
                    .get_or_insert_with(|| Arc::new(Notify::new()))
                    .clone();
            }
            // Register for the wake-up, then look again: a change between the check
            // above and this registration would otherwise go unnoticed.
            let notified = waiters.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.settled_since(id) {
                continue;
            }
            let _ = tokio::time::timeout_at(wake_at, notified).await;
        }
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        match records.get_mut(id) {
            Some(entry) if entry.owned_by(token, now) => {
                entry.state = EntryState::InFlight {
                    token,
                    lease_until: now + lease,
                };
                Ok(Ownership::Held)
            }
            _ => Ok(Ownership::Lost),
        }
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        match records.get_mut(id) {
            Some(entry) if entry.owned_by(token, now) => {
                entry.state = EntryState::Completed(response.clone());
                entry.wake_waiters();
                Ok(Ownership::Held)
            }
            _ => Ok(Ownership::Lost),
        }
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        match records.get(id) {
            Some(entry) if entry.owned_by(token, now) => {
                entry.wake_waiters();
                records.remove(id);
                Ok(Ownership::Held)
            }
            _ => Ok(Ownership::Lost),
        }
    }

    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        let Some(entry) = records.get_mut(id) else {
            return Ok(None);
        };
        let lapsed_here = matches!(
            entry.state,
            EntryState::InFlight { token, lease_until } if token == lapsed && lease_until <= now
        );
        if !lapsed_here || entry.expires_at <= now {
            return Ok(None);
        }
        let token = self.new_token();
        entry.state = EntryState::InFlight {
            token,
            lease_until: now + lease,
        };
        entry.wake_waiters();
        Ok(Some(token))
    }

    async fn purge_expired(&self, batch_size: usize) -> Result<u64, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        let expired: Vec<RecordId> = records
            .iter()
            .filter(|(_, entry)| entry.expires_at <= now)
            .map(|(id, _)| id.clone())
            .take(batch_size)
            .collect();
        for id in &expired {
            if let Some(entry) = records.remove(id) {
                entry.wake_waiters();
            }
        }
        Ok(expired.len() as u64)
    }
}

impl MemoryStore {
    /// Whether the record left the "in flight under a live lease" state, checked after a
    /// waiter registered for notifications.
    fn settled_since(&self, id: &RecordId) -> bool {
        let now = Instant::now();
        match self.lock().get(id) {
            Some(entry) if entry.expires_at > now => !matches!(
                entry.state,
                EntryState::InFlight { lease_until, .. } if lease_until > now
            ),
            _ => true,
        }
    }
}
