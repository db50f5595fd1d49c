//! The storage contract: the [`IdempotencyStore`] trait, the records it keeps, and the
//! purge helpers.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

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

/// A response as stored for replay: status, allow-listed headers and the whole body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Header names (lower-case) and values, in the order they were sent.
    pub headers: Vec<(String, Bytes)>,
    /// The body, byte for byte.
    pub body: Bytes,
}

impl StoredResponse {
    /// Encodes the headers as one byte string (`name:value\n` per header), for stores
    /// that keep them in a single column. Header values cannot contain `\n`.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_bytes());
            out.push(b':');
            out.extend_from_slice(value);
            out.push(b'\n');
        }
        out
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

/// The one error type every store returns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store holds as many live records as it may; nothing was evicted to make room.
    #[error(
        "the idempotency store is full ({max_entries} live records); retry later, or raise max_entries"
    )]
    Full {
        /// The configured bound.
        max_entries: usize,
    },
    /// The backend failed (connection lost, query error, timeout); the source is kept.
    #[error("the idempotency store backend failed: {0}")]
    Backend(#[source] BoxError),
    /// The store returned data the layer cannot use.
    #[error("the idempotency store holds a malformed record: {0}")]
    Corrupt(String),
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
///   body of several megabytes.
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
    /// The default polls [`load`](Self::load) with a bounded backoff; stores that can
    /// notify waiters should override it.
    async fn wait(
        &self,
        id: &RecordId,
        timeout: Duration,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_millis(5);
        loop {
            let record = self.load(id).await?;
            let settled = !matches!(
                &record,
                Some(IdempotencyRecord {
                    state: RecordState::InFlight {
                        lease_lapsed: false,
                        ..
                    },
                    ..
                })
            );
            let now = tokio::time::Instant::now();
            if settled || now >= deadline {
                return Ok(record);
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        }
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
}

/// How long [`purge_all_expired`] rests after each full batch, as a multiple of the time
/// that batch took: the purge then keeps the database busy at most a quarter of the time,
/// and foreground statements queued behind a batch (its WAL flush, its CPU, its I/O) get
/// through before the next one starts.
///
/// Chosen by measurement (BENCHMARKS.md, purge of 1,000,000 expired PostgreSQL rows in
/// batches of 100): reservation p99 during the purge was 2.7× the p99 without a purge
/// when the batches ran back to back, 2.1× resting 3× as long as each batch, and no better
/// resting 1×; the purge then takes about 4 times as long (50 s instead of 18 s here).
/// Most of what is left comes from the size of each batch, so keep batches small.
pub const PURGE_REST_FACTOR: u32 = 3;

/// Runs [`IdempotencyStore::purge_expired`] until a batch comes back short, and says how
/// many records it deleted in all (or [`Purged::ByBackend`] for a store that expires
/// records by itself).
///
/// Each batch is its own short statement, and after each full batch the purge rests for
/// [`PURGE_REST_FACTOR`] times as long as the batch took, so a large backlog is worked off
/// in the gaps of the foreground traffic instead of competing with it for the database.
/// The rest scales with the batch, so it backs off further when the database is busy and
/// batches slow down. A rest under a millisecond (the memory store's batches) only yields:
/// tokio's timer would round it up to a whole millisecond and slow such a purge twentyfold.
/// Needs tokio's timer, like [`spawn_purge_task`].
pub async fn purge_all_expired(
    store: &dyn IdempotencyStore,
    batch_size: usize,
) -> Result<Purged, StoreError> {
    let batch_size = batch_size.max(1);
    let mut total = 0;
    loop {
        let started = tokio::time::Instant::now();
        let deleted = match store.purge_expired(batch_size).await? {
            Purged::Deleted(deleted) => deleted,
            Purged::ByBackend => return Ok(Purged::ByBackend),
        };
        total += deleted;
        if deleted < batch_size as u64 {
            return Ok(Purged::Deleted(total));
        }
        let rest = started.elapsed() * PURGE_REST_FACTOR;
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
        };
        let encoded = response.encode_headers();
        assert_eq!(
            StoredResponse::decode_headers(&encoded).unwrap(),
            response.headers
        );
    }

    #[test]
    fn corrupt_header_encoding_is_reported() {
        let error = StoredResponse::decode_headers(b"no-colon-here\n").unwrap_err();
        assert!(matches!(error, StoreError::Corrupt(_)));
    }
}
