//! The record vocabulary every store trait speaks: what identifies a record, what it is
//! bound to, where it stands, what the fenced operations answer, and the one error type.
//! It imports nothing of the layer.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

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
        LogHash(self)
    }
}

/// What [`RecordId::log_hash`] shows: the first 6 bytes (12 hex digits) of the SHA-256 of
/// the scope's length (8 bytes, big-endian), the scope and the key. The length prefix keeps
/// scope `a:b` with key `c` apart from scope `a` with key `b:c`.
pub(crate) struct LogHash<'a>(pub(crate) &'a RecordId);

impl fmt::Display for LogHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        hasher.update((self.0.scope.len() as u64).to_be_bytes());
        hasher.update(self.0.scope.as_bytes());
        hasher.update(self.0.key.as_bytes());
        let digest = hasher.finalize();
        for byte in &digest[..6] {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
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
    /// The body, byte for byte. It may be a slice of a larger buffer the inner service
    /// encoded into (some frameworks encode into buffers of several KiB): a store that keeps
    /// it in memory copies it into an allocation of its own, or each record holds the whole
    /// buffer.
    pub body: Bytes,
    /// The trailers the body ended with (names lower-case, in the order they were sent):
    /// empty when it had none. An RPC protocol may send its status here; a replay sends
    /// them as a trailers frame.
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

/// The answer to [`IdempotencyStore::reserve`](crate::IdempotencyStore::reserve): what
/// the store knows about the key, and what the caller must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// The caller owns the key. While the request runs it [renews](crate::IdempotencyStore::renew)
    /// the reservation (a store whose reservation is a record under a lease extends the
    /// lease, which may otherwise lapse and be taken over by a duplicate; one whose
    /// reservation is held where nobody else can see it, by a transaction of its own,
    /// answers whether it still holds the key), and then it finalizes, releases or holds
    /// the key.
    Reserved(FencingToken),
    /// A live record holds the key: the caller checks its binding, then replays, waits
    /// for or takes over that record as its state says.
    Exists(IdempotencyRecord),
    /// Another owner holds the key where the store cannot show its record: in a
    /// transaction not committed yet (a reservation nobody else can see, with no lease
    /// that could lapse). The caller [waits](crate::IdempotencyStore::wait), then reserves
    /// again: only then is there a record whose binding it can check.
    Busy,
}

/// The answer to [`IdempotencyStore::wait`](crate::IdempotencyStore::wait): how the wait
/// for an owner ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Waited {
    /// The record is no longer in flight under a live lease: it completed, or its
    /// owner's lease lapsed. It may be another request's record by now (the key was
    /// released and reserved again while the caller waited): the caller checks its
    /// binding as on a first look.
    Settled(IdempotencyRecord),
    /// No live record holds the key any more (released, rolled back, expired or
    /// evicted): the caller reserves again.
    Gone,
    /// An owner still holds the key when the timeout passed: its record, when the store
    /// can show it (`None` for an owner whose reservation is not committed yet).
    Running(Option<IdempotencyRecord>),
}

impl Waited {
    /// How a wait that has just loaded `record` ends: `Some` once the owner is done
    /// ([`Gone`](Self::Gone), [`Settled`](Self::Settled)), or, when it `timed_out`, with
    /// the owner still [`Running`](Self::Running); `None` while the owner still runs
    /// under a live lease and the wait goes on.
    pub fn after_load(record: Option<IdempotencyRecord>, timed_out: bool) -> Option<Self> {
        match record {
            None => Some(Self::Gone),
            Some(
                running @ IdempotencyRecord {
                    state:
                        RecordState::InFlight {
                            lease_lapsed: false,
                            ..
                        },
                    ..
                },
            ) => timed_out.then_some(Self::Running(Some(running))),
            Some(settled) => Some(Self::Settled(settled)),
        }
    }
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
    /// calls, such as [`RecordAdmin::evict`](crate::RecordAdmin::evict)).
    #[error(
        "this idempotency store cannot {operation}; its author has to implement RecordAdmin::{method} (the conformance suite checks it)"
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
    /// Headers and trailers count alike.
    pub fn stored_bytes(&self) -> u64 {
        let fields: usize = self
            .headers
            .iter()
            .chain(&self.trailers)
            .map(|(name, value)| name.len() + value.len() + 2)
            .sum();
        (2 + fields + self.body.len()) as u64
    }
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
                ("x-status".into(), Bytes::from_static(b"0")),
                ("x-message".into(), Bytes::from_static(b"a%3Ab")),
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

    /// The hash the layer's logs have always shown (SHA-256 over the scope's length as 8
    /// big-endian bytes, the scope and the key; the first 6 bytes in hex), pinned so that
    /// moving it cannot change a log line: the values were computed outside Rust.
    #[test]
    fn log_hash_is_the_layers_log_key() {
        for (scope, key, hash) in [
            ("tenant-a", "k-1", "1f833c551835"),
            ("", "k-1", "2ec7010d70b2"),
            ("a:b", "c", "59582b2d751a"),
            ("a", "b:c", "27f10c870d17"),
        ] {
            assert_eq!(RecordId::new(scope, key).log_hash().to_string(), hash);
        }
    }

    #[test]
    fn corrupt_header_encoding_is_reported() {
        let error = StoredResponse::decode_headers(b"no-colon-here\n").unwrap_err();
        assert!(matches!(error, StoreError::Corrupt(_)));
    }
}
