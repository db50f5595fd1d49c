//! A single-process [`IdempotencyStore`] for development, tests and single-node services.
//!
//! Records live in hash tables behind mutexes, sharded by key so that requests on
//! different keys rarely wait for each other and a growing table pauses only its own
//! shard. The store is bounded by `max_entries`
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
//!
//! # Feature flags
//!
//! This crate has no cargo features.
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hashbrown::HashTable;
use hashbrown::hash_table::Entry as TableEntry;
use idempotency_core::{
    Binding, FencingToken, IdempotencyRecord, IdempotencyStore, Ownership, Purged, RecordId,
    RecordState, Reservation, StoreError, StoredResponse, async_trait,
};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The default bound on live records.
pub const DEFAULT_MAX_ENTRIES: usize = 10_000;

/// Independent tables, each behind its own mutex.
const SHARDS: usize = 16;

/// An in-process idempotency store. Cheap to clone: clones share the same records.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    shards: Box<[Mutex<Shard>]>,
    /// SipHash with random keys: the keys are chosen by clients, who must not be able to
    /// aim many of them at one bucket.
    hasher: RandomState,
    /// Records held in all shards, expired ones not yet dropped included.
    len: AtomicUsize,
    max_entries: usize,
    next_token: AtomicI64,
}

type Shard = HashTable<Slot>;

/// A record's place in a table. The hash is kept so that a growing table never hashes a
/// key again, and the record sits behind a pointer so that growing moves 16 bytes per
/// record, not the whole record, while the shard's lock is held.
#[derive(Debug)]
struct Slot {
    hash: u64,
    record: Box<Record>,
}

#[derive(Debug)]
struct Record {
    id: RecordId,
    binding: Binding,
    state: State,
    expires_at: Instant,
    /// Created when the first duplicate waits; woken whenever the record settles.
    waiters: Option<Arc<Notify>>,
}

#[derive(Debug)]
enum State {
    InFlight {
        token: FencingToken,
        lease_until: Instant,
    },
    Completed(StoredResponse),
}

impl Record {
    fn to_record(&self, now: Instant) -> IdempotencyRecord {
        let state = match &self.state {
            State::InFlight { token, lease_until } => RecordState::InFlight {
                token: *token,
                lease_lapsed: *lease_until <= now,
            },
            State::Completed(response) => RecordState::Completed(response.clone()),
        };
        IdempotencyRecord {
            binding: self.binding.clone(),
            state,
        }
    }

    fn is_live(&self, now: Instant) -> bool {
        self.expires_at > now
    }

    fn owned_by(&self, token: FencingToken, now: Instant) -> bool {
        self.is_live(now)
            && matches!(self.state, State::InFlight { token: owner, .. } if owner == token)
    }

    /// Puts the record in flight under `token` until `lease_until`, and keeps it from
    /// expiring before then.
    fn lease(&mut self, token: FencingToken, lease_until: Instant) {
        self.state = State::InFlight { token, lease_until };
        self.expires_at = self.expires_at.max(lease_until);
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
        // Sized up front for the usual bounds, so that the tables do not grow under load.
        let per_shard = max_entries.min(1 << 16).div_ceil(SHARDS);
        Self {
            shared: Arc::new(Shared {
                shards: (0..SHARDS)
                    .map(|_| Mutex::new(HashTable::with_capacity(per_shard)))
                    .collect(),
                hasher: RandomState::new(),
                len: AtomicUsize::new(0),
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

    /// The store a properties configuration names: bounded by
    /// `idempotency-max-entries` when set.
    ///
    /// ```
    /// use idempotency_core::config::IdempotencyConfig;
    /// use idempotency_store_memory::MemoryStore;
    ///
    /// let config = IdempotencyConfig::from_properties([("idempotency-max-entries", "500")])?;
    /// assert_eq!(MemoryStore::from_config(&config).max_entries(), 500);
    /// # Ok::<(), idempotency_core::config::ConfigError>(())
    /// ```
    pub fn from_config(config: &idempotency_core::config::IdempotencyConfig) -> Self {
        match config.max_entries {
            Some(max_entries) => Self::new().with_max_entries(max_entries),
            None => Self::new(),
        }
    }

    /// The bound on live records.
    pub fn max_entries(&self) -> usize {
        self.shared.max_entries
    }

    /// How many records the store holds, expired ones not yet purged included.
    pub fn len(&self) -> usize {
        self.shared.len.load(Ordering::Acquire)
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The key's hash and its locked shard.
    fn shard_of(&self, id: &RecordId) -> (u64, MutexGuard<'_, Shard>) {
        let hash = self.shared.hasher.hash_one(id);
        // The table indexes buckets with the low bits and tags them with the top seven;
        // the shard comes from bits neither uses for tables under 2^32 buckets.
        let shard = (hash >> 32) as usize % SHARDS;
        (hash, lock(&self.shared.shards[shard]))
    }

    fn new_token(&self) -> FencingToken {
        FencingToken(self.shared.next_token.fetch_add(1, Ordering::Relaxed))
    }

    /// Takes one unit of the bound for a new record, if any is left.
    fn claim_room(&self) -> bool {
        self.shared
            .len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |len| {
                (len < self.shared.max_entries).then_some(len + 1)
            })
            .is_ok()
    }

    /// Drops every expired record, waking whoever waits on one. Takes the shards' locks
    /// one at a time, so it must be called without holding any.
    fn drop_expired(&self, now: Instant, limit: usize) -> usize {
        let mut dropped = 0;
        for shard in self.shared.shards.iter() {
            if dropped == limit {
                break;
            }
            let mut table = lock(shard);
            for slot in table
                .extract_if(|slot| !slot.record.is_live(now))
                .take(limit - dropped)
            {
                slot.record.wake_waiters();
                dropped += 1;
            }
        }
        self.shared.len.fetch_sub(dropped, Ordering::AcqRel);
        dropped
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock cannot leave a record half-written (every mutation
    // is a single assignment), so a poisoned shard is still consistent.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn find<'a>(table: &'a mut Shard, hash: u64, id: &RecordId) -> Option<&'a mut Record> {
    table
        .find_mut(hash, |slot| slot.record.id == *id)
        .map(|slot| &mut *slot.record)
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
        let fresh = |token, waiters| Record {
            id: id.clone(),
            binding: binding.clone(),
            state: State::InFlight {
                token,
                lease_until: now + lease,
            },
            // In flight under a live lease, a record never expires.
            expires_at: now + lifetime.max(lease),
            waiters,
        };
        // A second pass only after making room by dropping expired records, which must
        // happen with no shard locked.
        for made_room in [false, true] {
            let (hash, mut table) = self.shard_of(id);
            match table.entry(hash, |slot| slot.record.id == *id, |slot: &Slot| slot.hash) {
                TableEntry::Occupied(mut occupied) => {
                    let record = &mut occupied.get_mut().record;
                    if record.is_live(now) {
                        return Ok(Reservation::Exists(record.to_record(now)));
                    }
                    // An expired record counts as absent; whoever waits on it is woken.
                    record.wake_waiters();
                    let token = self.new_token();
                    **record = fresh(token, record.waiters.take());
                    return Ok(Reservation::Reserved(token));
                }
                TableEntry::Vacant(vacant) => {
                    if self.claim_room() {
                        let token = self.new_token();
                        let record = Box::new(fresh(token, None));
                        vacant.insert(Slot { hash, record });
                        return Ok(Reservation::Reserved(token));
                    }
                    if made_room {
                        break;
                    }
                }
            }
            drop(table);
            self.drop_expired(now, usize::MAX);
        }
        Err(StoreError::Full {
            max_entries: self.shared.max_entries,
        })
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        let now = Instant::now();
        let (hash, mut table) = self.shard_of(id);
        Ok(find(&mut table, hash, id)
            .filter(|record| record.is_live(now))
            .map(|record| record.to_record(now)))
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
                let (hash, mut table) = self.shard_of(id);
                let record = match find(&mut table, hash, id) {
                    Some(record) if record.is_live(now) => record,
                    _ => return Ok(None),
                };
                let lease_until = match record.state {
                    State::InFlight { lease_until, .. } if lease_until > now => lease_until,
                    _ => return Ok(Some(record.to_record(now))),
                };
                if now >= deadline {
                    return Ok(Some(record.to_record(now)));
                }
                wake_at = deadline.min(lease_until).min(record.expires_at);
                waiters = record
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
        let (hash, mut table) = self.shard_of(id);
        match find(&mut table, hash, id) {
            Some(record) if record.owned_by(token, now) => {
                record.lease(token, now + lease);
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
        let (hash, mut table) = self.shard_of(id);
        match find(&mut table, hash, id) {
            Some(record) if record.owned_by(token, now) => {
                record.state = State::Completed(response.clone());
                record.wake_waiters();
                Ok(Ownership::Held)
            }
            _ => Ok(Ownership::Lost),
        }
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        let now = Instant::now();
        let (hash, mut table) = self.shard_of(id);
        match table.find_entry(hash, |slot| slot.record.id == *id) {
            Ok(occupied) if occupied.get().record.owned_by(token, now) => {
                let (slot, _) = occupied.remove();
                slot.record.wake_waiters();
                self.shared.len.fetch_sub(1, Ordering::AcqRel);
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
        let (hash, mut table) = self.shard_of(id);
        let Some(record) = find(&mut table, hash, id) else {
            return Ok(None);
        };
        let lapsed_here = matches!(
            record.state,
            State::InFlight { token, lease_until } if token == lapsed && lease_until <= now
        );
        if !lapsed_here || !record.is_live(now) {
            return Ok(None);
        }
        let token = self.new_token();
        record.lease(token, now + lease);
        record.wake_waiters();
        Ok(Some(token))
    }

    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        Ok(Purged::Deleted(
            self.drop_expired(Instant::now(), batch_size) as u64,
        ))
    }
}

impl MemoryStore {
    /// Whether the record left the "in flight under a live lease" state, checked after a
    /// waiter registered for notifications.
    fn settled_since(&self, id: &RecordId) -> bool {
        let now = Instant::now();
        let (hash, mut table) = self.shard_of(id);
        match find(&mut table, hash, id) {
            Some(record) if record.is_live(now) => !matches!(
                record.state,
                State::InFlight { lease_until, .. } if lease_until > now
            ),
            _ => true,
        }
    }
}
