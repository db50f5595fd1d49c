//! A single-process store for development, tests and single-node services: [`MemoryStore`]
//! implements the request path ([`IdempotencyStore`]), the operators' [`RecordAdmin`] and
//! maintenance's [`PurgeExpired`], so it is a [`FullStore`](idempotency_core::FullStore).
//!
//! Records live in hash tables behind mutexes, sharded by key so that requests on
//! different keys rarely wait for each other and a growing table pauses only its own
//! shard. Duplicates waiting for an in-flight owner are woken by a notification, not by
//! polling.
//!
//! # Bounds
//!
//! The store never grows without limit, and never evicts a record a retry may still
//! need to make room:
//!
//! - **Records and bytes**: at most `max_entries` live records (default 10,000) holding
//!   at most `max_bytes` (default 256 MiB; a record's bytes are its scope, key, binding
//!   and stored answer). A reservation past either bound fails with
//!   [`StoreError::Full`], and the layer answers 503 with `Retry-After` set to when the
//!   next record expires. Expired records are dropped first to make room. Both the
//!   refusal and the drop cost time in proportion to what is dropped, never to the size
//!   of the store: each shard keeps its records' expiries in order.
//! - **Per scope** (off by default): a [`ScopeQuota`] bounds what one scope (one tenant)
//!   may hold, so that no tenant can fill the store and lock the others out; a scope at
//!   its quota gets [`StoreError::QuotaExceeded`] (the layer answers 429). A
//!   multi-tenant service sets one.
//!
//! Records do not survive a restart and are not shared between processes: run several
//! replicas on a SQL store instead.
//!
//! ```
//! use idempotency_core::{IdempotencyLayer, ScopeQuota};
//! use idempotency_store_memory::MemoryStore;
//!
//! let store = MemoryStore::new()
//!     .with_max_entries(50_000)
//!     .with_max_bytes(512 << 20)
//!     .with_scope_quota(ScopeQuota::default().with_max_records(1_000));
//! let layer = IdempotencyLayer::new(store);
//! # drop(layer);
//! ```
//!
//! # From a properties configuration
//!
//! [`MemoryStore::from_config`] opens the store an [`IdempotencyConfig`] names
//! (`idempotency-store-type=memory`, the default), reading the one key of its own
//! ([`properties`]; the keys every store shares are `idempotency_core::config`'s):
//!
//! | key | default | value |
//! | --- | --- | --- |
//! | `idempotency-max-entries` | 10,000 | positive integer: the most live records ([`MemoryStore::with_max_entries`]) |
//!
//! Any other store property (a misspelt key, or another store's) is refused, with an
//! error that names it and the keys this store takes.
//!
//! # Feature flags
//!
//! This crate has no cargo features.
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

use bytes::Bytes;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use hashbrown::HashTable;
use hashbrown::hash_table::Entry as TableEntry;
use idempotency_core::config::{ConfigError, IdempotencyConfig};
use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, InspectedState, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId,
    RecordState, Reservation, ScopeQuota, StoreError, StoredResponse, Waited, async_trait,
};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The default bound on live records.
pub const DEFAULT_MAX_ENTRIES: usize = 10_000;
/// The default bound on the bytes of live records: 256 MiB.
pub const DEFAULT_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// The memory store's name and keys in a properties configuration
/// ([`MemoryStore::from_config`]).
pub mod properties {
    /// `idempotency-store-type=memory`: the memory store.
    pub const STORE_TYPE: &str = "memory";
    /// `idempotency-max-entries`: the most live records (default
    /// [`DEFAULT_MAX_ENTRIES`](crate::DEFAULT_MAX_ENTRIES)), a positive integer.
    pub const MAX_ENTRIES: &str = "idempotency-max-entries";
    /// Every key the memory store takes, besides the general ones.
    pub const KEYS: [&str; 1] = [MAX_ENTRIES];
}

/// Independent tables, each behind its own mutex.
const SHARDS: usize = 16;

/// An in-process idempotency store. Cheap to clone: clones share the same records.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

#[derive(Clone, Copy, Debug)]
struct Bounds {
    max_entries: usize,
    max_bytes: u64,
    quota: Option<ScopeQuota>,
}

#[derive(Debug)]
struct Shared {
    bounds: Bounds,
    shards: Box<[Mutex<Shard>]>,
    /// SipHash with random keys: the keys are chosen by clients, who must not be able to
    /// aim many of them at one bucket.
    hasher: RandomState,
    /// Records held in all shards, expired ones not yet dropped included.
    len: AtomicUsize,
    /// Their bytes.
    bytes: AtomicU64,
    /// What each scope holds, kept only when a quota is set; sharded by scope.
    scopes: Box<[Mutex<HashMap<String, Usage>>]>,
    next_token: AtomicI64,
    epoch: Epoch,
}

#[derive(Debug, Default)]
struct Shard {
    table: HashTable<Slot>,
    /// The records' expiries, soonest first, by the records' hashes. An entry may be
    /// stale (its record was renewed, replaced or removed): it is checked when it comes
    /// due, and a record whose expiry moves gets a new entry.
    expiries: BinaryHeap<Reverse<(Instant, u64)>>,
}

#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    records: u64,
    bytes: u64,
}

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
    /// Whose record it is and what it is bound to, in one allocation rather than four
    /// strings of their own (scope, key, method, path).
    names: Names,
    body_sha256: [u8; 32],
    state: State,
    /// When the key was reserved (a takeover keeps it); only inspection reads it.
    created_at: Instant,
    expires_at: Instant,
    /// What the record counts against the bounds.
    bytes: u64,
    /// Created when the first duplicate waits; woken whenever the record settles.
    waiters: Option<Arc<Notify>>,
}

/// A record's scope, key, method and path, one after the other in one string.
#[derive(Debug)]
struct Names {
    text: Box<str>,
    /// Where the key, the method and the path start in `text`.
    key_at: usize,
    method_at: usize,
    path_at: usize,
}

impl Names {
    fn new(id: &RecordId, binding: &Binding) -> Self {
        let mut text = String::with_capacity(
            id.scope.len() + id.key.len() + binding.method.len() + binding.path.len(),
        );
        text.push_str(&id.scope);
        let key_at = text.len();
        text.push_str(&id.key);
        let method_at = text.len();
        text.push_str(&binding.method);
        let path_at = text.len();
        text.push_str(&binding.path);
        Self {
            text: text.into_boxed_str(),
            key_at,
            method_at,
            path_at,
        }
    }

    fn scope(&self) -> &str {
        &self.text[..self.key_at]
    }

    fn key(&self) -> &str {
        &self.text[self.key_at..self.method_at]
    }

    fn method(&self) -> &str {
        &self.text[self.method_at..self.path_at]
    }

    fn path(&self) -> &str {
        &self.text[self.path_at..]
    }

    /// Whether these are the names of `id`'s record: scope and key compared each on its
    /// own, so that no two ids share a record whatever bytes they hold.
    fn are_of(&self, id: &RecordId) -> bool {
        self.scope() == id.scope && self.key() == id.key
    }
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
    fn binding(&self) -> Binding {
        Binding {
            method: self.names.method().to_owned(),
            path: self.names.path().to_owned(),
            body_sha256: self.body_sha256,
        }
    }

    fn to_record(&self, now: Instant) -> IdempotencyRecord {
        let state = match &self.state {
            State::InFlight { token, lease_until } => RecordState::InFlight {
                token: *token,
                lease_lapsed: *lease_until <= now,
            },
            State::Completed(response) => RecordState::Completed(response.clone()),
        };
        IdempotencyRecord {
            binding: self.binding(),
            state,
        }
    }

    fn is_live(&self, now: Instant) -> bool {
        self.expires_at > now
    }

    /// The record as an operator sees it, with the store's instants as wall-clock times.
    fn inspect(&self, clock: &WallClock) -> InspectedRecord {
        let state = match &self.state {
            State::InFlight { lease_until, .. } => InspectedState::InFlight {
                lease_lapsed: *lease_until <= clock.now,
                lease_expires_at: Some(clock.at(*lease_until)),
            },
            State::Completed(response) => InspectedState::Completed {
                status: response.status,
            },
        };
        InspectedRecord {
            binding: self.binding(),
            state,
            created_at: Some(clock.at(self.created_at)),
            expires_at: Some(clock.at(self.expires_at)),
            inspected_at: Some(clock.wall),
        }
    }

    fn owned_by(&self, token: FencingToken, now: Instant) -> bool {
        self.is_live(now)
            && matches!(self.state, State::InFlight { token: owner, .. } if owner == token)
    }

    /// Puts the record in flight under `token` until `lease_until`, and keeps it from
    /// expiring before then; says whether its expiry moved.
    fn lease(&mut self, token: FencingToken, lease_until: Instant) -> bool {
        self.state = State::InFlight { token, lease_until };
        let moved = lease_until > self.expires_at;
        self.expires_at = self.expires_at.max(lease_until);
        moved
    }

    fn wake_waiters(&self) {
        if let Some(waiters) = &self.waiters {
            waiters.notify_waiters();
        }
    }
}

/// The store's clock is monotonic ([`Instant`]); an inspection shows its instants as
/// wall-clock times, counted from one pair of readings taken when the store was made, so
/// that one instant always shows as the same time.
#[derive(Clone, Copy, Debug)]
struct Epoch {
    instant: Instant,
    wall: SystemTime,
}

impl Epoch {
    fn new() -> Self {
        Self {
            instant: Instant::now(),
            wall: SystemTime::now(),
        }
    }

    fn clock(self) -> WallClock {
        let now = Instant::now();
        WallClock {
            now,
            wall: self.at(now),
            epoch: self,
        }
    }

    fn at(self, instant: Instant) -> SystemTime {
        if instant >= self.instant {
            self.wall + (instant - self.instant)
        } else {
            self.wall - (self.instant - instant)
        }
    }
}

/// "Now" for one inspection, in both clocks.
struct WallClock {
    now: Instant,
    wall: SystemTime,
    epoch: Epoch,
}

impl WallClock {
    fn at(&self, instant: Instant) -> SystemTime {
        self.epoch.at(instant)
    }
}

/// Why a reservation found no room.
enum NoRoom {
    Full(String),
    Quota(String),
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store bounded by [`DEFAULT_MAX_ENTRIES`] and [`DEFAULT_MAX_BYTES`], with
    /// no per-scope quota.
    pub fn new() -> Self {
        Self::with_bounds(Bounds {
            max_entries: DEFAULT_MAX_ENTRIES,
            max_bytes: DEFAULT_MAX_BYTES,
            quota: None,
        })
    }

    fn with_bounds(bounds: Bounds) -> Self {
        // Sized up front for the usual bounds, so that the tables do not grow under load.
        let per_shard = bounds.max_entries.min(1 << 16).div_ceil(SHARDS);
        Self {
            shared: Arc::new(Shared {
                bounds,
                shards: (0..SHARDS)
                    .map(|_| {
                        Mutex::new(Shard {
                            table: HashTable::with_capacity(per_shard),
                            expiries: BinaryHeap::with_capacity(per_shard),
                        })
                    })
                    .collect(),
                hasher: RandomState::new(),
                len: AtomicUsize::new(0),
                bytes: AtomicU64::new(0),
                scopes: (0..SHARDS).map(|_| Mutex::default()).collect(),
                next_token: AtomicI64::new(1),
                epoch: Epoch::new(),
            }),
        }
    }

    /// Bounds the store to `max_entries` live records (at least 1). Call it on a new
    /// store: the bounds are set before any record is kept.
    ///
    /// ```
    /// use idempotency_store_memory::MemoryStore;
    ///
    /// let store = MemoryStore::new().with_max_entries(100);
    /// assert_eq!(store.max_entries(), 100);
    /// ```
    pub fn with_max_entries(self, max_entries: usize) -> Self {
        let bounds = self.shared.bounds;
        Self::with_bounds(Bounds {
            max_entries: max_entries.max(1),
            ..bounds
        })
    }

    /// Bounds the bytes the store's live records hold (at least 1 KiB). Call it on a new
    /// store.
    ///
    /// ```
    /// use idempotency_store_memory::MemoryStore;
    ///
    /// let store = MemoryStore::new().with_max_bytes(64 << 20);
    /// assert_eq!(store.max_bytes(), 64 << 20);
    /// ```
    pub fn with_max_bytes(self, max_bytes: u64) -> Self {
        let bounds = self.shared.bounds;
        Self::with_bounds(Bounds {
            max_bytes: max_bytes.max(1024),
            ..bounds
        })
    }

    /// Bounds what each scope may hold. Call it on a new store.
    ///
    /// ```
    /// use idempotency_core::ScopeQuota;
    /// use idempotency_store_memory::MemoryStore;
    ///
    /// let store = MemoryStore::new().with_scope_quota(ScopeQuota::default().with_max_records(100));
    /// # drop(store);
    /// ```
    pub fn with_scope_quota(self, quota: ScopeQuota) -> Self {
        let bounds = self.shared.bounds;
        Self::with_bounds(Bounds {
            quota: Some(quota),
            ..bounds
        })
    }

    /// The store a properties configuration names (`idempotency-store-type=memory`, the
    /// default): bounded by `idempotency-max-entries` and by the scope quota when set.
    /// Refuses another store type, and any store property but the ones in
    /// [`properties`], naming the key.
    ///
    /// ```
    /// use idempotency_core::config::IdempotencyConfig;
    /// use idempotency_store_memory::MemoryStore;
    ///
    /// let config = IdempotencyConfig::from_properties([("idempotency-max-entries", "500")])?;
    /// assert_eq!(MemoryStore::from_config(&config)?.max_entries(), 500);
    ///
    /// // A misspelt key, or another store's, is refused.
    /// let config = IdempotencyConfig::from_properties([("idempotency-max-entrys", "500")])?;
    /// let error = MemoryStore::from_config(&config).err().expect("refused").to_string();
    /// assert!(error.contains("`idempotency-max-entrys`"), "{error}");
    /// assert!(error.contains("idempotency-max-entries"), "{error}");
    /// # Ok::<(), idempotency_core::config::ConfigError>(())
    /// ```
    pub fn from_config(config: &IdempotencyConfig) -> Result<Self, ConfigError> {
        let given = config.store_properties_for(properties::STORE_TYPE, &properties::KEYS)?;
        let mut store = Self::new();
        if let Some(max_entries) = given.positive_integer(properties::MAX_ENTRIES)? {
            store = store.with_max_entries(max_entries);
        }
        if let Some(quota) = config.scope_quota {
            store = store.with_scope_quota(quota);
        }
        Ok(store)
    }

    /// The bound on live records.
    pub fn max_entries(&self) -> usize {
        self.shared.bounds.max_entries
    }

    /// The bound on the bytes of live records.
    pub fn max_bytes(&self) -> u64 {
        self.shared.bounds.max_bytes
    }

    /// How many records the store holds, expired ones not yet purged included.
    pub fn len(&self) -> usize {
        self.shared.len.load(Ordering::Acquire)
    }

    /// How many bytes its records hold, expired ones not yet purged included.
    pub fn bytes(&self) -> u64 {
        self.shared.bytes.load(Ordering::Acquire)
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

    fn scope_usage(&self, scope: &str) -> MutexGuard<'_, HashMap<String, Usage>> {
        let shard = self.shared.hasher.hash_one(scope) as usize % SHARDS;
        lock(&self.shared.scopes[shard])
    }

    fn new_token(&self) -> FencingToken {
        FencingToken(self.shared.next_token.fetch_add(1, Ordering::Relaxed))
    }

    /// Takes room for a new record of `bytes` bytes in `scope`: its scope's quota first,
    /// then the store's bounds; gives back what it took when a later step refuses.
    fn claim_room(&self, scope: &str, bytes: u64) -> Result<(), NoRoom> {
        let bounds = &self.shared.bounds;
        if let Some(quota) = bounds.quota {
            let mut scopes = self.scope_usage(scope);
            let usage = scopes.entry(scope.to_owned()).or_default();
            if let Some(bound) = quota.refuses(usage.records, usage.bytes) {
                if usage.records == 0 {
                    scopes.remove(scope);
                }
                return Err(NoRoom::Quota(bound));
            }
            usage.records += 1;
            usage.bytes += bytes;
        }
        let records = self
            .shared
            .len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |len| {
                (len < bounds.max_entries).then_some(len + 1)
            });
        let refused = if records.is_err() {
            Some(format!("{} live records", bounds.max_entries))
        } else if self.shared.bytes.fetch_add(bytes, Ordering::AcqRel) + bytes > bounds.max_bytes {
            self.shared.bytes.fetch_sub(bytes, Ordering::AcqRel);
            self.shared.len.fetch_sub(1, Ordering::AcqRel);
            Some(format!("{} bytes", bounds.max_bytes))
        } else {
            None
        };
        match refused {
            None => Ok(()),
            Some(bound) => {
                self.forget_in_scope(scope, 1, bytes);
                Err(NoRoom::Full(bound))
            }
        }
    }

    /// Counts `bytes` more for a record of `scope` (its answer was stored).
    fn grow(&self, scope: &str, bytes: u64) {
        self.shared.bytes.fetch_add(bytes, Ordering::AcqRel);
        if self.shared.bounds.quota.is_some()
            && let Some(usage) = self.scope_usage(scope).get_mut(scope)
        {
            usage.bytes += bytes;
        }
    }

    /// Counts `bytes` fewer for a record of `scope`.
    fn shrink(&self, scope: &str, bytes: u64) {
        self.shared.bytes.fetch_sub(bytes, Ordering::AcqRel);
        self.forget_in_scope(scope, 0, bytes);
    }

    /// Gives back the room of a record that is gone.
    fn forget(&self, record: &Record) {
        self.shared.len.fetch_sub(1, Ordering::AcqRel);
        self.shared.bytes.fetch_sub(record.bytes, Ordering::AcqRel);
        self.forget_in_scope(record.names.scope(), 1, record.bytes);
    }

    fn forget_in_scope(&self, scope: &str, records: u64, bytes: u64) {
        if self.shared.bounds.quota.is_none() {
            return;
        }
        let mut scopes = self.scope_usage(scope);
        if let Some(usage) = scopes.get_mut(scope) {
            usage.records = usage.records.saturating_sub(records);
            usage.bytes = usage.bytes.saturating_sub(bytes);
            if usage.records == 0 {
                scopes.remove(scope);
            }
        }
    }

    /// Drops up to `limit` expired records, soonest expired first, waking whoever waits
    /// on them. Takes the shards' locks one at a time, so it must be called without
    /// holding any. Its cost follows what it drops, not the size of the store.
    fn drop_expired(&self, now: Instant, limit: usize) -> usize {
        let mut dropped = 0;
        for shard in self.shared.shards.iter() {
            let mut shard = lock(shard);
            while dropped < limit {
                let Some(&Reverse((due, hash))) = shard.expiries.peek() else {
                    break;
                };
                if due > now {
                    break;
                }
                shard.expiries.pop();
                // The entry may be stale; only records that are expired now go.
                while let Ok(expired) = shard
                    .table
                    .find_entry(hash, |slot| !slot.record.is_live(now))
                {
                    let (slot, _) = expired.remove();
                    slot.record.wake_waiters();
                    self.forget(&slot.record);
                    dropped += 1;
                }
            }
            if dropped == limit {
                break;
            }
        }
        dropped
    }

    /// How long until the next record is due to expire, as far as the shards' expiries
    /// tell: when room is expected.
    fn next_expiry(&self, now: Instant) -> Option<Duration> {
        self.shared
            .shards
            .iter()
            .filter_map(|shard| lock(shard).expiries.peek().map(|Reverse((due, _))| *due))
            .min()
            .map(|due| due.saturating_duration_since(now))
    }

    /// Whether the record left the "in flight under a live lease" state, checked after a
    /// waiter registered for notifications.
    fn settled_since(&self, id: &RecordId) -> bool {
        let now = Instant::now();
        let (hash, mut shard) = self.shard_of(id);
        match find(&mut shard, hash, id) {
            Some(record) if record.is_live(now) => !matches!(
                record.state,
                State::InFlight { lease_until, .. } if lease_until > now
            ),
            _ => true,
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave a record half-written (every mutation
    // is a single assignment), so a poisoned shard is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn find<'a>(shard: &'a mut Shard, hash: u64, id: &RecordId) -> Option<&'a mut Record> {
    shard
        .table
        .find_mut(hash, |slot| slot.record.names.are_of(id))
        .map(|slot| &mut *slot.record)
}

/// The operations the layer calls on every keyed request, done under a shard's lock
/// without awaiting anything: the trait's `async` methods and its `*_now` twins (which
/// spare the layer a boxed future per call) both run them.
impl MemoryStore {
    fn reserve_record(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let now = Instant::now();
        let bytes = id.reserved_bytes(binding);
        let fresh = |token, waiters| Record {
            names: Names::new(id, binding),
            body_sha256: binding.body_sha256,
            state: State::InFlight {
                token,
                lease_until: now + lease,
            },
            created_at: now,
            // In flight under a live lease, a record never expires.
            expires_at: now + lifetime.max(lease),
            bytes,
            waiters,
        };
        // A second pass only after making room by dropping expired records, which must
        // happen with no shard locked.
        let mut no_room = None;
        for made_room in [false, true] {
            let (hash, mut shard) = self.shard_of(id);
            let Shard { table, expiries } = &mut *shard;
            match table.entry(
                hash,
                |slot| slot.record.names.are_of(id),
                |slot: &Slot| slot.hash,
            ) {
                TableEntry::Occupied(mut occupied) => {
                    let record = &mut occupied.get_mut().record;
                    if record.is_live(now) {
                        return Ok(Reservation::Exists(record.to_record(now)));
                    }
                    // An expired record counts as absent; whoever waits on it is woken.
                    // It is replaced in place, in its scope: only its size changes.
                    record.wake_waiters();
                    let token = self.new_token();
                    let replacement = fresh(token, record.waiters.take());
                    self.grow(&id.scope, bytes);
                    self.shrink(&id.scope, record.bytes);
                    expiries.push(Reverse((replacement.expires_at, hash)));
                    **record = replacement;
                    return Ok(Reservation::Reserved(token));
                }
                TableEntry::Vacant(vacant) => match self.claim_room(&id.scope, bytes) {
                    Ok(()) => {
                        let token = self.new_token();
                        let record = Box::new(fresh(token, None));
                        expiries.push(Reverse((record.expires_at, hash)));
                        vacant.insert(Slot { hash, record });
                        return Ok(Reservation::Reserved(token));
                    }
                    Err(refusal) => no_room = Some(refusal),
                },
            }
            drop(shard);
            if !made_room {
                self.drop_expired(now, usize::MAX);
            }
        }
        let retry_after = self.next_expiry(now);
        Err(match no_room {
            Some(NoRoom::Quota(bound)) => StoreError::QuotaExceeded { bound, retry_after },
            Some(NoRoom::Full(bound)) => StoreError::Full { bound, retry_after },
            None => unreachable!("a reservation that found no room says why"),
        })
    }

    fn finalize_record(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let now = Instant::now();
        let (hash, mut shard) = self.shard_of(id);
        match find(&mut shard, hash, id) {
            Some(record) if record.owned_by(token, now) => {
                let added = response.stored_bytes();
                record.state = State::Completed(StoredResponse {
                    // Its own allocation, sized to the body: the layer's may be a slice of
                    // a larger buffer, which the record would otherwise hold whole.
                    body: Bytes::copy_from_slice(&response.body),
                    ..response.clone()
                });
                record.bytes += added;
                record.wake_waiters();
                self.grow(&id.scope, added);
                Ok(Ownership::Held)
            }
            _ => Ok(Ownership::Lost),
        }
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
        self.reserve_record(id, binding, lease, lifetime)
    }

    fn reserve_now(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Option<Result<Reservation, StoreError>> {
        Some(self.reserve_record(id, binding, lease, lifetime))
    }

    fn finalize_now(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Option<Result<Ownership, StoreError>> {
        Some(self.finalize_record(id, token, response))
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        let now = Instant::now();
        let (hash, mut shard) = self.shard_of(id);
        Ok(find(&mut shard, hash, id)
            .filter(|record| record.is_live(now))
            .map(|record| record.to_record(now)))
    }

    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        let deadline = Instant::now() + timeout;
        loop {
            let now = Instant::now();
            let waiters;
            let wake_at;
            {
                let (hash, mut shard) = self.shard_of(id);
                let record = match find(&mut shard, hash, id) {
                    Some(record) if record.is_live(now) => record,
                    _ => return Ok(Waited::Gone),
                };
                let lease_until = match record.state {
                    State::InFlight { lease_until, .. } if lease_until > now => lease_until,
                    _ => return Ok(Waited::Settled(record.to_record(now))),
                };
                if now >= deadline {
                    return Ok(Waited::Running(Some(record.to_record(now))));
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
        let (hash, mut shard) = self.shard_of(id);
        let Some(record) = find(&mut shard, hash, id).filter(|r| r.owned_by(token, now)) else {
            return Ok(Ownership::Lost);
        };
        if record.lease(token, now + lease) {
            let due = record.expires_at;
            shard.expiries.push(Reverse((due, hash)));
        }
        Ok(Ownership::Held)
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        self.finalize_record(id, token, response)
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        let now = Instant::now();
        let (hash, mut shard) = self.shard_of(id);
        match shard
            .table
            .find_entry(hash, |slot| slot.record.names.are_of(id))
        {
            Ok(occupied) if occupied.get().record.owned_by(token, now) => {
                let (slot, _) = occupied.remove();
                slot.record.wake_waiters();
                self.forget(&slot.record);
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
        let (hash, mut shard) = self.shard_of(id);
        let Some(record) = find(&mut shard, hash, id) else {
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
        let moved = record.lease(token, now + lease);
        record.wake_waiters();
        if moved {
            let due = record.expires_at;
            shard.expiries.push(Reverse((due, hash)));
        }
        Ok(Some(token))
    }
}

#[async_trait]
impl RecordAdmin for MemoryStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        let clock = self.shared.epoch.clock();
        let (hash, mut shard) = self.shard_of(id);
        Ok(find(&mut shard, hash, id)
            .filter(|record| record.is_live(clock.now))
            .map(|record| record.inspect(&clock)))
    }

    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        let clock = self.shared.epoch.clock();
        // One lock for the look and the delete: the verdict is on the record as it stands.
        let (hash, mut shard) = self.shard_of(id);
        let occupied = match shard
            .table
            .find_entry(hash, |slot| slot.record.names.are_of(id))
        {
            Ok(occupied) if occupied.get().record.is_live(clock.now) => occupied,
            _ => return Ok(Eviction::NotFound),
        };
        let inspected = occupied.get().record.inspect(&clock);
        if inspected.is_in_flight() && in_flight == EvictInFlight::Refuse {
            return Ok(Eviction::InFlight(inspected));
        }
        // As release does: the record's expiry entry goes stale and is skipped when due.
        let (slot, _) = occupied.remove();
        slot.record.wake_waiters();
        self.forget(&slot.record);
        Ok(Eviction::Evicted(inspected))
    }
}

#[async_trait]
impl PurgeExpired for MemoryStore {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        Ok(Purged::Deleted(
            self.drop_expired(Instant::now(), batch_size) as u64,
        ))
    }
}
