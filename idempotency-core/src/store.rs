//! The storage contract: the [`IdempotencyStore`] trait, the records it keeps, and the
//! purge helpers.

use std::error::Error as StdError;
use std::fmt;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

/// A boxed error from a store backend, kept as the source of [`StoreError::Backend`].
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Identifies one record: the caller's scope and the idempotency key it sent.
///
/// The scope separates callers (tenants, warehouses, principals); two scopes never see
/// each other's records even when they send the same key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordId {
    /// Who the key belongs to; empty when the layer runs without a scope extractor.
    pub scope: String,
    /// The normalized idempotency key.
    pub key: String,
}

impl RecordId {
    /// A record id from a scope and a key.
    pub fn new(scope: impl Into<String>, key: impl Into<String>) -> Self {
        Self {
            scope: scope.into(),
            key: key.into(),
        }
    }
}

impl RecordId {
    /// The record as the layer's logs name it: a short hash of scope and key (12 hex
    /// digits), never the key itself, since a key is what collects a response. A tool
    /// that logs what it did to a record (an admin endpoint that evicts one) uses it too,
    /// so that its lines match the layer's.
    ///
    /// ```
    /// use idempotency_core::RecordId;
    ///
    /// let hash = RecordId::new("tenant-a", "6f1c…").log_hash().to_string();
    /// assert_eq!(hash.len(), 12);
    /// assert!(!hash.contains("6f1c"));
    /// ```
    pub fn log_hash(&self) -> impl fmt::Display + '_ {
        crate::settings::LogKey(self)
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.scope.is_empty() {
            write!(f, "{}", self.key)
        } else {
            write!(f, "{}/{}", self.scope, self.key)
        }
    }
}

/// What a key was first used for. A later request with the same key and another binding
/// is refused instead of replayed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The HTTP method, e.g. `POST`.
    pub method: String,
    /// The path in a normal form, with a fingerprint of the query when there is one,
    /// e.g. `/v1/ns/tables?sha256:6b86b273ff34fce19d6b804eff5a3f57`; never the raw query.
    pub path: String,
    /// SHA-256 of the request body.
    pub body_sha256: [u8; 32],
}

/// Proof of ownership of an in-flight record. A new token is issued on every reservation
/// and takeover, so an owner that lost its record cannot write into the new owner's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FencingToken(pub i64);

/// A response as stored for replay: status, allow-listed headers, the whole body and the
/// trailers it ended with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Header names (lower-case) and values, in the order they were sent.
    pub headers: Vec<(String, Bytes)>,
    /// The body, byte for byte.
    pub body: Bytes,
    /// The trailers the body ended with (names lower-case, in the order they were sent):
    /// empty when it had none. gRPC sends its status here (`grpc-status`,
    /// `grpc-message`, `grpc-status-details-bin`); a replay sends them as a trailers frame.
    pub trailers: Vec<(String, Bytes)>,
}

impl StoredResponse {
    /// Encodes the headers as one byte string (`name:value\n` per header), for stores
    /// that keep them in a single column. Header values cannot contain `\n`.
    pub fn encode_headers(&self) -> Vec<u8> {
        encode_fields(&self.headers)
    }

    /// Encodes the trailers the way [`encode_headers`](Self::encode_headers) encodes the
    /// headers; no trailers encode as an empty string.
    pub fn encode_trailers(&self) -> Vec<u8> {
        encode_fields(&self.trailers)
    }

    /// Decodes what [`encode_trailers`](Self::encode_trailers) wrote (the encoding is the
    /// headers' one).
    pub fn decode_trailers(encoded: &[u8]) -> Result<Vec<(String, Bytes)>, StoreError> {
        Self::decode_headers(encoded)
    }

    /// Decodes what [`encode_headers`](Self::encode_headers) wrote.
    pub fn decode_headers(encoded: &[u8]) -> Result<Vec<(String, Bytes)>, StoreError> {
        encoded
            .split(|b| *b == b'\n')
            .filter(|line| !line.is_empty())
            .map(|line| {
                let colon = line.iter().position(|b| *b == b':').ok_or_else(|| {
                    StoreError::Corrupt("stored header line has no ':'".to_owned())
                })?;
                let name = std::str::from_utf8(&line[..colon])
                    .map_err(|_| StoreError::Corrupt("stored header name is not UTF-8".into()))?;
                Ok((name.to_owned(), Bytes::copy_from_slice(&line[colon + 1..])))
            })
            .collect()
    }
}

fn encode_fields(fields: &[(String, Bytes)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.extend_from_slice(name.as_bytes());
        out.push(b':');
        out.extend_from_slice(value);
        out.push(b'\n');
    }
    out
}

/// Where a record stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordState {
    /// An owner is running the request.
    InFlight {
        /// The owner's token.
        token: FencingToken,
        /// Whether the owner's lease had lapsed by the store's clock when the record was
        /// read; a lapsed lease may be taken over.
        lease_lapsed: bool,
    },
    /// The request finished; its response is replayed to every retry.
    Completed(StoredResponse),
}

/// A live (not expired) record as read from a store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyRecord {
    /// What the key was first used for.
    pub binding: Binding,
    /// Where the record stands.
    pub state: RecordState,
}

/// The answer to [`IdempotencyStore::reserve`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// The caller now owns the key and must finalize or release it.
    Reserved(FencingToken),
    /// A live record already holds the key.
    Exists(IdempotencyRecord),
}

/// The answer to the fenced operations (renew, finalize, release).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ownership {
    /// The token still owned the record and the operation took effect.
    Held,
    /// The record is gone or belongs to another token; nothing was changed.
    Lost,
}

/// A record as an operator sees it, from [`IdempotencyStore::inspect`]: what the key is
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
    /// The inspection of a record as [`IdempotencyStore::load`] returns it, with no
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

/// Whether [`IdempotencyStore::evict`] may delete a record that is still in flight.
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

/// What [`IdempotencyStore::evict`] did.
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

/// The one error type every store returns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store holds as many live records, or bytes, as it may; nothing was evicted to
    /// make room.
    #[error("the idempotency store is full ({bound}); retry later, or raise the bound")]
    Full {
        /// Which bound was reached, e.g. `10000 live records`.
        bound: String,
        /// When room is expected (the next record's expiry), if the store knows.
        retry_after: Option<Duration>,
    },
    /// The caller's scope holds as many live records, or bytes, as its
    /// [`ScopeQuota`] allows; other scopes are not affected.
    #[error("this scope holds as much as its quota allows ({bound}); retry later")]
    QuotaExceeded {
        /// Which part of the quota was reached, e.g. `100 records`.
        bound: String,
        /// When room is expected in this scope, if the store knows.
        retry_after: Option<Duration>,
    },
    /// The backend failed (connection lost, query error, timeout); the source is kept.
    #[error("the idempotency store backend failed: {0}")]
    Backend(#[source] BoxError),
    /// The store returned data the layer cannot use.
    #[error("the idempotency store holds a malformed record: {0}")]
    Corrupt(String),
    /// The store does not implement an optional operation (one the layer itself never
    /// calls, such as [`IdempotencyStore::evict`]).
    #[error(
        "this idempotency store cannot {operation}; its author has to implement IdempotencyStore::{method} (the conformance suite checks it)"
    )]
    Unsupported {
        /// What the caller asked for, e.g. "evict a record".
        operation: &'static str,
        /// The trait method the store has to implement, e.g. "evict".
        method: &'static str,
    },
}

impl StoreError {
    /// Wraps any backend error.
    pub fn backend(error: impl Into<BoxError>) -> Self {
        Self::Backend(error.into())
    }
}

/// Storage for idempotency records: what a backend must do so that the layer can
/// guarantee "at most once per key".
///
/// Each method is atomic on its own: exactly one of many concurrent `reserve` calls for
/// one [`RecordId`] gets [`Reservation::Reserved`], and the fenced methods change a
/// record only while the given token owns it. A record moves through a small life:
///
/// ```text
///   (absent) --reserve--> in flight (token T, lease) --finalize(T)--> completed --(lifetime)--> expired
///                          |   ^  |                                                             |
///                          |   |  +--release(T)--> (absent)                     purge_expired --+
///                          |   +--renew(T)--+
///                          +--lease lapses--> take_over(T) --> in flight (token T')
/// ```
///
/// # The rules every store keeps
///
/// The [conformance suite](crate::conformance) checks each of them.
///
/// - **One clock.** "Now" is the store's own clock (the database's, for a store shared by
///   several processes), which is why the trait passes durations, never instants: the
///   store adds them to its clock, so clock skew between nodes cannot cause a double
///   execution.
/// - **Deadlines.** A lease or a lifetime that ends at `t` has lapsed (or expired) at
///   `t`: `now >= deadline` is lapsed.
/// - **Expiry.** A record expires `lifetime` after it was first reserved, or at the end
///   of the last lease it was granted if that is later. An expired record counts as
///   absent everywhere (load, reserve, the fenced operations), even before
///   [`purge_expired`](IdempotencyStore::purge_expired) removes it. So **a record in
///   flight under a live lease never expires**, however old: reserve, renew and take_over
///   each extend the expiry to at least the end of the lease they grant, and a slow owner
///   that keeps renewing can never be run a second time beside itself. (The layer keeps
///   its lease no longer than the lifetime, so a quick request's record lives exactly
///   its lifetime.)
/// - **Identity.** A record is found by its whole [`RecordId`]: scope and key are
///   separate values, and no two different pairs may share a record, whatever bytes they
///   hold (scope `a:b` with key `c` is not scope `a` with key `b:c`).
/// - **Fencing.** Every reservation and every takeover issues a new [`FencingToken`],
///   never one the key had before. Renew, finalize and release take effect only while
///   the record exists, has not expired, is in flight and holds the given token; so an
///   owner whose lease lapsed may still renew, finalize or release until someone takes
///   over, and never after.
/// - **Takeover** keeps the record's binding, creation time and expiry (extended to the
///   end of the new lease if it would end sooner) and replaces only the token and lease.
/// - **Round trips.** A finalized [`StoredResponse`] comes back exactly as stored: any
///   status, no headers or many, header values that are not UTF-8, an empty body or a
///   body of several megabytes, no trailers or several.
/// - **Inspection** ([`inspect`](IdempotencyStore::inspect), for operators) reads a live
///   record like `load` does, without its stored headers and body, and with its times by
///   the store's clock: created (kept by a takeover), expires, the lease's end, and the
///   store's "now". An expired record is absent. It changes nothing.
/// - **Eviction** ([`evict`](IdempotencyStore::evict), for operators) deletes a live
///   record whatever its token, so that the next request with its key runs again. It
///   deletes an in-flight record only when forced, and decides on the record as it
///   stands when it deletes it: a record that is finalized, released or reserved anew
///   between the store's read and its delete is looked at again, never deleted on a stale
///   verdict. Whoever [waits](IdempotencyStore::wait) on an evicted record is woken (it
///   then finds it absent), and the fenced operations of its former owner find nothing.
///   An expired record is absent: evicting it answers [`Eviction::NotFound`].
///
/// # Writing a store
///
/// A store depends on this crate alone: it re-exports [`async_trait`](crate::async_trait)
/// and [`Bytes`](crate::Bytes). Implement [`IdempotencyStore`] and run the public
/// [`conformance`](crate::conformance) suite against it (feature `conformance`); the
/// `custom_store` example in this crate is a skeleton that does both.
///
/// [`purge_expired`]: IdempotencyStore::purge_expired
#[async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Inserts an in-flight record if no live one exists (an expired one is replaced).
    ///
    /// The lease lapses `lease` after now and the record expires `lifetime` after now (or
    /// when the lease lapses, if that is later), both by the store's clock. The new token
    /// must differ from every token the key had before. On conflict, returns the existing
    /// record.
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError>;

    /// Reads the live record, if any.
    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError>;

    /// Waits until the record is no longer in flight under a live lease — it completed,
    /// was released, expired, or its lease lapsed — or until `timeout` passes, and returns
    /// it as it then stands.
    ///
    /// The default is [`wait_by_polling`]: at most [`MAX_POLLS_PER_SECOND`] loads per
    /// second per waiter. Stores that can notify waiters should override it.
    async fn wait(
        &self,
        id: &RecordId,
        timeout: Duration,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        wait_by_polling(self, id, timeout).await
    }

    /// Extends the lease of the record `token` owns to `lease` from now, and its expiry to
    /// the end of that lease if it would end sooner.
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError>;

    /// Completes the record `token` owns with `response`.
    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError>;

    /// Deletes the in-flight record `token` owns, so that a retry runs again.
    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError>;

    /// Takes over an in-flight record whose lease has lapsed while `lapsed` still owns it:
    /// issues a new token (one the key never had) and a new lease of `lease` from now,
    /// extending the expiry to the end of that lease if it would end sooner; the binding,
    /// creation time and expiry are otherwise kept. Returns `None` when the lease is live,
    /// the token changed, or the record is gone, expired or completed.
    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError>;

    /// Deletes at most `batch_size` expired records and says how many it deleted; call
    /// it again while it returns a full batch. A backend that deletes expired records by
    /// itself (key expiry in Redis, a TTL index) returns [`Purged::ByBackend`] instead.
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError>;

    /// Reads the live record, if any, as an operator sees it: binding, state, the stored
    /// status, and the times by the store's clock, but not the stored headers or body
    /// (see [`InspectedRecord`]). The layer never calls it.
    ///
    /// The default derives it from [`load`](Self::load), which knows no times: they are
    /// `None`. Every store in this workspace overrides it, and the conformance suite's
    /// [`inspect_shows_state_and_times_without_the_body`](crate::conformance::inspect_shows_state_and_times_without_the_body)
    /// check requires the times, so a store that passes the suite reports them.
    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        Ok(self
            .load(id)
            .await?
            .as_ref()
            .map(InspectedRecord::from_record))
    }

    /// [`reserve`](Self::reserve), answered at once by a store that never has to wait to
    /// answer it (one that keeps its records in memory), or `None` (the default): the
    /// layer then awaits [`reserve`](Self::reserve).
    ///
    /// It is an optimization, not a second operation: called through
    /// `Arc<dyn IdempotencyStore>`, every `async` method costs a boxed future (an
    /// allocation), which is a large share of what an in-memory reservation costs. A
    /// store that answers here must answer exactly as `reserve` would, with the same
    /// effects; the layer calls one or the other for a given reservation, never both.
    fn reserve_now(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Option<Result<Reservation, StoreError>> {
        let _ = (id, binding, lease, lifetime);
        None
    }

    /// [`finalize`](Self::finalize), answered at once, or `None` (the default): as
    /// [`reserve_now`](Self::reserve_now) is to [`reserve`](Self::reserve).
    fn finalize_now(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Option<Result<Ownership, StoreError>> {
        let _ = (id, token, response);
        None
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
    /// [`StoreError::Unsupported`]; every store in this workspace overrides it, and the
    /// conformance suite checks it.
    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        let _ = (id, in_flight);
        Err(StoreError::Unsupported {
            operation: "evict a record",
            method: "evict",
        })
    }
}

/// How much one scope (one tenant, one caller) may hold in a store at once, so that no
/// scope can fill a shared store and lock the others out. A reservation that would go
/// over gets [`StoreError::QuotaExceeded`] (the layer answers 429 with `Retry-After`).
///
/// Bytes are what a record holds: its scope, key and binding, and once finalized its
/// stored answer. A record is counted from its reservation until it expires or is
/// released; a finalize never fails for the quota (the request already ran), so a scope
/// can go over its byte quota by one answer, and then reserves nothing more until it is
/// back under.
///
/// ```
/// use idempotency_core::ScopeQuota;
/// let quota = ScopeQuota::default().with_max_records(1_000).with_max_bytes(64 << 20);
/// assert_eq!(quota.max_records, Some(1_000));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScopeQuota {
    /// The most live records a scope may hold.
    pub max_records: Option<u64>,
    /// The most bytes a scope's live records may hold.
    pub max_bytes: Option<u64>,
}

impl ScopeQuota {
    /// Limits the live records of a scope.
    pub fn with_max_records(mut self, records: u64) -> Self {
        self.max_records = Some(records);
        self
    }

    /// Limits the bytes of a scope's live records.
    pub fn with_max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = Some(bytes);
        self
    }

    /// Whether a scope holding `records` records and `bytes` bytes may reserve one more,
    /// and if not, which bound it reached.
    pub fn refuses(&self, records: u64, bytes: u64) -> Option<String> {
        if self.max_records.is_some_and(|max| records >= max) {
            return Some(format!("{} records", self.max_records.unwrap_or_default()));
        }
        if self.max_bytes.is_some_and(|max| bytes >= max) {
            return Some(format!("{} bytes", self.max_bytes.unwrap_or_default()));
        }
        None
    }
}

impl RecordId {
    /// The bytes a record of this id with `binding` holds before it is finalized, as
    /// [`ScopeQuota`] counts them.
    pub fn reserved_bytes(&self, binding: &Binding) -> u64 {
        (self.scope.len() + self.key.len() + binding.method.len() + binding.path.len() + 32) as u64
    }
}

impl StoredResponse {
    /// The bytes this answer adds to its record once finalized, as [`ScopeQuota`]
    /// counts them.
    pub fn stored_bytes(&self) -> u64 {
        let headers: usize = self
            .headers
            .iter()
            .map(|(name, value)| name.len() + value.len() + 2)
            .sum();
        (2 + headers + self.body.len()) as u64
    }
}

/// The most loads per second [`wait_by_polling`] sends for one waiter, once its backoff
/// has grown (it starts at 5 ms and doubles).
pub const MAX_POLLS_PER_SECOND: u32 = 5;

/// [`IdempotencyStore::wait`] by polling [`load`](IdempotencyStore::load) with a backoff
/// that starts at 5 ms and doubles up to 200 ms: a quick owner is noticed at once, and a
/// waiter costs at most [`MAX_POLLS_PER_SECOND`] loads per second after that.
pub async fn wait_by_polling<S: IdempotencyStore + ?Sized>(
    store: &S,
    id: &RecordId,
    timeout: Duration,
) -> Result<Option<IdempotencyRecord>, StoreError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pause = Duration::from_millis(5);
    loop {
        let record = store.load(id).await?;
        let now = tokio::time::Instant::now();
        if is_settled(&record) || now >= deadline {
            return Ok(record);
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(Duration::from_secs(1) / MAX_POLLS_PER_SECOND);
    }
}

/// Whether a record, as loaded, is no longer in flight under a live lease: what a waiter
/// waits for.
pub fn is_settled(record: &Option<IdempotencyRecord>) -> bool {
    !matches!(
        record,
        Some(IdempotencyRecord {
            state: RecordState::InFlight {
                lease_lapsed: false,
                ..
            },
            ..
        })
    )
}

/// What [`IdempotencyStore::purge_expired`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Purged {
    /// It deleted this many expired records (never more than the batch size).
    Deleted(u64),
    /// The backend deletes expired records on its own; there was nothing to do.
    ByBackend,
}

#[async_trait]
impl<T: IdempotencyStore + ?Sized> IdempotencyStore for std::sync::Arc<T> {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        (**self).reserve(id, binding, lease, lifetime).await
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        (**self).load(id).await
    }

    async fn wait(
        &self,
        id: &RecordId,
        timeout: Duration,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        (**self).wait(id, timeout).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        (**self).renew(id, token, lease).await
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        (**self).finalize(id, token, response).await
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        (**self).release(id, token).await
    }

    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        (**self).take_over(id, lapsed, lease).await
    }

    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        (**self).purge_expired(batch_size).await
    }

    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        (**self).inspect(id).await
    }

    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        (**self).evict(id, in_flight).await
    }

    fn reserve_now(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Option<Result<Reservation, StoreError>> {
        (**self).reserve_now(id, binding, lease, lifetime)
    }

    fn finalize_now(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Option<Result<Ownership, StoreError>> {
        (**self).finalize_now(id, token, response)
    }
}

/// How long [`purge_all_expired`] rests after each full batch, as a multiple of the time
/// that batch took: the purge then keeps the database busy at most a quarter of the time,
/// and foreground statements queued behind a batch (its WAL flush, its CPU, its I/O) get
/// through before the next one starts.
///
/// Chosen by measurement (BENCHMARKS.md, purge of 1,000,000 expired PostgreSQL rows in
/// batches of 100): reservation p99 during the purge was 2.7× the p99 without a purge
/// when the batches ran back to back, 2.1× resting 3× as long as each batch, and no better
/// resting 1× or 9×: once more than 1% of reservations meet a batch at all, the p99 is
/// set by how long a batch lasts, not by how often one runs (see [`PURGE_BATCH_TIME`]).
/// Resting makes the purge take about 4 times as long as back to back.
pub const PURGE_REST_FACTOR: u32 = 3;

/// How long one batch of [`purge_all_expired`] should take at most: the batch size
/// halves while batches take longer (down to 10 rows, or the size asked for if smaller),
/// and doubles back (up to the size asked for) while they take less than half of it. A
/// reservation that queues behind a batch then waits about this long at worst, unless the
/// database is so slow that even 10 rows take longer.
///
/// Chosen by measurement (BENCHMARKS.md, "Issue 15"): with a bound of 1 ms the
/// reservation p99 during a purge of 1,000,000 PostgreSQL rows was a steady 768–782 µs,
/// while the p99 without a purge it is compared with moved between 337 and 422 µs, so the
/// ratio landed on either side of 2× (1.83–2.28× in five quick runs). A batch must stay
/// well under twice the quiet p99 for a reservation that meets one to stay under 2× it;
/// 0.5 ms leaves that margin: on a quiet machine the p99 during the purge was 637–753 µs
/// and the ratio 1.47–1.80× in five quick runs in a row (1.70× in a full run). The price
/// is speed: 1,000,000 rows took 270–302 s, against 41–63 s at 1 ms.
///
/// The floor of 10 rows is for a loaded machine, where one statement with its commit
/// takes longer than the bound whatever its size: halving further then only multiplies the
/// statements and commits the purge needs without making any of them shorter. Without the
/// floor (and with a bound of 1 ms) the batches came down to 1 or 2 rows: 23,046 batches,
/// 205 rows a second, at a load average of 4–6; with it (and 0.5 ms), 750 rows a second
/// at a load average of 3–4. Ten rows cost little more than one: deleting 100 took
/// 0.66 ms of execution there, a few µs a row, against a round trip and a commit of
/// hundreds.
pub const PURGE_BATCH_TIME: Duration = Duration::from_micros(500);

/// The size a batch of [`purge_all_expired`] does not shrink below (see
/// [`PURGE_BATCH_TIME`]).
const PURGE_MIN_BATCH: usize = 10;

/// Runs [`IdempotencyStore::purge_expired`] until a batch comes back short, and says how
/// many records it deleted in all (or [`Purged::ByBackend`] for a store that expires
/// records by itself).
///
/// Each batch is its own short statement of at most `batch_size` records, sized to take
/// about [`PURGE_BATCH_TIME`], and after each full batch the purge rests for
/// [`PURGE_REST_FACTOR`] times as long as the batch took, so a large backlog is worked off
/// in the gaps of the foreground traffic instead of competing with it for the database.
/// Batches shrink and rests grow when the database is busy and batches slow down. A rest
/// under a millisecond (the memory store's batches) only yields: tokio's timer would round
/// it up to a whole millisecond and slow such a purge twentyfold.
/// Needs tokio's timer, like [`spawn_purge_task`].
pub async fn purge_all_expired(
    store: &dyn IdempotencyStore,
    batch_size: usize,
) -> Result<Purged, StoreError> {
    let max_batch = batch_size.max(1);
    let min_batch = PURGE_MIN_BATCH.min(max_batch);
    let mut batch_size = max_batch;
    let mut total = 0;
    loop {
        let started = tokio::time::Instant::now();
        let purged = store.purge_expired(batch_size).await;
        crate::metrics::store_duration(
            crate::metrics::StoreCall::Purge,
            purged.is_ok(),
            started.elapsed(),
        );
        let deleted = match purged? {
            Purged::Deleted(deleted) => deleted,
            Purged::ByBackend => return Ok(Purged::ByBackend),
        };
        crate::metrics::records_purged(deleted);
        total += deleted;
        if deleted < batch_size as u64 {
            return Ok(Purged::Deleted(total));
        }
        let took = started.elapsed();
        if took > PURGE_BATCH_TIME {
            batch_size = (batch_size / 2).max(min_batch);
        } else if took < PURGE_BATCH_TIME / 2 {
            batch_size = (batch_size * 2).min(max_batch);
        }
        let rest = took * PURGE_REST_FACTOR;
        if rest < Duration::from_millis(1) {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(rest).await;
        }
    }
}

/// Starts a tokio task that purges expired records every `interval`, in batches of
/// `batch_size`, paced as [`purge_all_expired`] paces them. Errors are logged and the task
/// carries on; abort the returned handle to stop it. For a store that expires records by
/// itself the task ends after its first round.
pub fn spawn_purge_task(
    store: std::sync::Arc<dyn IdempotencyStore>,
    interval: Duration,
    batch_size: usize,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            match purge_all_expired(store.as_ref(), batch_size).await {
                Ok(Purged::Deleted(0)) => {}
                Ok(Purged::Deleted(deleted)) => {
                    tracing::debug!(deleted, "purged expired idempotency records")
                }
                Ok(Purged::ByBackend) => {
                    tracing::debug!(
                        "the idempotency store expires records by itself; no purge task needed"
                    );
                    return;
                }
                Err(error) => tracing::warn!(%error, "purging expired idempotency records failed"),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_through_their_encoding() {
        let response = StoredResponse {
            status: 201,
            headers: vec![
                (
                    "content-type".into(),
                    Bytes::from_static(b"application/json"),
                ),
                ("etag".into(), Bytes::from_static(b"\"a:b\"")),
            ],
            body: Bytes::new(),
            trailers: vec![
                ("grpc-status".into(), Bytes::from_static(b"0")),
                ("grpc-message".into(), Bytes::from_static(b"a%3Ab")),
            ],
        };
        let encoded = response.encode_headers();
        assert_eq!(
            StoredResponse::decode_headers(&encoded).unwrap(),
            response.headers
        );
        let encoded = response.encode_trailers();
        assert_eq!(
            StoredResponse::decode_trailers(&encoded).unwrap(),
            response.trailers
        );
        assert!(StoredResponse::decode_trailers(b"").unwrap().is_empty());
    }

    #[test]
    fn corrupt_header_encoding_is_reported() {
        let error = StoredResponse::decode_headers(b"no-colon-here\n").unwrap_err();
        assert!(matches!(error, StoreError::Corrupt(_)));
    }
}
