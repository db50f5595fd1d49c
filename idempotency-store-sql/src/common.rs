//! Helpers every backend shares: the row shape all three return, durations as
//! milliseconds, fencing tokens, error mapping and scope usage.

use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, InspectedRecord,
    InspectedState, RecordState, StoreError, StoredResponse,
};

/// Durations are clamped to this many milliseconds (about 100 years) so that
/// `now + duration` never overflows a BIGINT.
const MAX_DURATION_MS: u128 = 100 * 366 * 24 * 60 * 60 * 1000;

/// The one-commit path's upsert of a finished record over an expired one
/// (PostgreSQL's and SQLite's `ON CONFLICT … DO UPDATE SET`): every column from the row
/// that was to be inserted.
#[allow(dead_code)] // without PostgreSQL and SQLite
pub(crate) const REPLACE_WITH_EXCLUDED: &str = "method = excluded.method, path = excluded.path,
             body_sha256 = excluded.body_sha256, fencing_token = excluded.fencing_token,
             created_at_ms = excluded.created_at_ms, expires_at_ms = excluded.expires_at_ms,
             lease_expires_at_ms = excluded.lease_expires_at_ms,
             response_status = excluded.response_status,
             response_headers = excluded.response_headers,
             response_body = excluded.response_body,
             response_trailers = excluded.response_trailers";

/// How many times an operation that lost a race with another statement (PostgreSQL's
/// snapshot hiding a concurrent insert, a MySQL deadlock, a row deleted between two
/// statements) is tried before giving up with an error. Each retry needs another node to
/// change the same key in the few milliseconds between two statements.
pub(crate) const MAX_ATTEMPTS: usize = 8;

/// A duration as whole milliseconds, rounded up (a 1 µs lease is 1 ms, not 0) and
/// clamped to [`MAX_DURATION_MS`].
pub(crate) fn millis(duration: Duration) -> i64 {
    let nanos = duration.as_nanos();
    let ms = nanos.div_ceil(1_000_000).min(MAX_DURATION_MS);
    ms as i64
}

/// A statement that reserves (the reserve, or the replacement of an expired record) with
/// its first eight parameters, in the order PostgreSQL's and SQLite's statements take
/// them: scope, key, method, path, body hash, token, lease, lifetime.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn reservation_query<'q, DB>(
    sql: &'q str,
    id: &'q idempotency_core::RecordId,
    binding: &'q Binding,
    token: FencingToken,
    lease: Duration,
    lifetime: Duration,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>
where
    DB: sqlx::Database,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    sqlx::query(sql)
        .bind(id.scope.as_str())
        .bind(id.key.as_str())
        .bind(binding.method.as_str())
        .bind(binding.path.as_str())
        .bind(&binding.body_sha256[..])
        .bind(token.0)
        .bind(millis(lease))
        // In flight under a live lease, a record never expires.
        .bind(millis(lifetime.max(lease)))
}

/// A fresh fencing token: 64 random bits, so that a token is never reused across
/// release / re-reserve cycles, on any node.
pub(crate) fn new_token() -> FencingToken {
    // A v4 UUID's 6 fixed bits (version: bits 12-15 of `high`; variant: bits 62-63 of
    // `low`) must each meet a random bit: turned by 32, the variant lands on bits 30-31.
    // (Turned by 17 it landed on bits 15-16, and bit 15, fixed at 0 in both, was clear
    // in every token: 63 random bits.)
    let (high, low) = uuid::Uuid::new_v4().as_u64_pair();
    FencingToken((high ^ low.rotate_left(32)) as i64)
}

/// Another random token, guaranteed to differ from `old`.
pub(crate) fn new_token_other_than(old: FencingToken) -> FencingToken {
    loop {
        let token = new_token();
        if token != old {
            return token;
        }
    }
}

/// Wraps a driver error, keeping it as the source.
pub(crate) fn backend(error: sqlx::Error) -> StoreError {
    StoreError::backend(error)
}

/// A fenced statement held the record iff it changed exactly one row.
pub(crate) fn ownership(rows_affected: u64) -> idempotency_core::Ownership {
    if rows_affected == 1 {
        idempotency_core::Ownership::Held
    } else {
        idempotency_core::Ownership::Lost
    }
}

/// The error returned when an operation kept losing races (see [`MAX_ATTEMPTS`]).
pub(crate) fn too_many_races(operation: &str) -> StoreError {
    StoreError::backend(format!(
        "{operation} lost {MAX_ATTEMPTS} races in a row with concurrent changes to the same key; giving up"
    ))
}

/// A live record as every backend selects it: the stored columns plus the database's
/// "now", so that `lease_lapsed` is decided by the database clock.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct RawRecord {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) body_sha256: Vec<u8>,
    pub(crate) fencing_token: i64,
    pub(crate) lease_expires_at_ms: i64,
    pub(crate) now_ms: i64,
    pub(crate) response_status: Option<i32>,
    pub(crate) response_headers: Option<Vec<u8>>,
    pub(crate) response_body: Option<Vec<u8>>,
    /// NULL for an answer without trailers, and in rows written before the column
    /// existed.
    pub(crate) response_trailers: Option<Vec<u8>>,
}

fn body_sha256(stored: &[u8]) -> Result<[u8; 32], StoreError> {
    stored.try_into().map_err(|_| {
        StoreError::Corrupt(format!(
            "body_sha256 holds {} bytes, expected 32",
            stored.len()
        ))
    })
}

fn http_status(stored: i32) -> Result<u16, StoreError> {
    u16::try_from(stored)
        .ok()
        .filter(|status| (100..=999).contains(status))
        .ok_or_else(|| {
            StoreError::Corrupt(format!("response_status {stored} is not an HTTP status"))
        })
}

impl RawRecord {
    pub(crate) fn into_record(self) -> Result<IdempotencyRecord, StoreError> {
        let body_sha256 = body_sha256(&self.body_sha256)?;
        let state = match self.response_status {
            None => RecordState::InFlight {
                token: FencingToken(self.fencing_token),
                lease_lapsed: self.lease_expires_at_ms <= self.now_ms,
            },
            Some(status) => {
                let status = http_status(status)?;
                let headers = StoredResponse::decode_headers(
                    self.response_headers.as_deref().unwrap_or_default(),
                )?;
                let body = self.response_body.ok_or_else(|| {
                    StoreError::Corrupt("a completed record has no response_body".to_owned())
                })?;
                let trailers = StoredResponse::decode_trailers(
                    self.response_trailers.as_deref().unwrap_or_default(),
                )?;
                RecordState::Completed(StoredResponse {
                    status,
                    headers,
                    body: Bytes::from(body),
                    trailers,
                })
            }
        };
        Ok(IdempotencyRecord {
            binding: Binding {
                method: self.method,
                path: self.path,
                body_sha256,
            },
            state,
        })
    }
}

/// A live record as every backend's `inspect` selects it: the row without the stored
/// response's headers and body, and the database's "now".
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct RawInspection {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) body_sha256: Vec<u8>,
    pub(crate) fencing_token: i64,
    pub(crate) created_at_ms: i64,
    pub(crate) expires_at_ms: i64,
    pub(crate) lease_expires_at_ms: i64,
    pub(crate) now_ms: i64,
    pub(crate) response_status: Option<i32>,
}

impl RawInspection {
    pub(crate) fn in_flight(&self) -> bool {
        self.response_status.is_none()
    }

    pub(crate) fn to_inspected(&self) -> Result<InspectedRecord, StoreError> {
        let state = match self.response_status {
            None => InspectedState::InFlight {
                lease_lapsed: self.lease_expires_at_ms <= self.now_ms,
                lease_expires_at: Some(wall_clock(self.lease_expires_at_ms)),
            },
            Some(status) => InspectedState::Completed {
                status: http_status(status)?,
            },
        };
        Ok(InspectedRecord {
            binding: Binding {
                method: self.method.clone(),
                path: self.path.clone(),
                body_sha256: body_sha256(&self.body_sha256)?,
            },
            state,
            created_at: Some(wall_clock(self.created_at_ms)),
            expires_at: Some(wall_clock(self.expires_at_ms)),
            inspected_at: Some(wall_clock(self.now_ms)),
        })
    }
}

/// The operators' `evict`, the same on every backend: read the record with `inspect`,
/// keep it if it is in flight and `in_flight` refuses that, else delete it as read with
/// `delete` (given the token and in-flight-ness it read; it deletes only a row still so,
/// and says whether it did), and read again if the delete found nothing, because the
/// record was finalized, released or reserved anew in between.
pub(crate) async fn evict_as_read<Inspect, Delete>(
    inspect: impl Fn() -> Inspect,
    delete: impl Fn(FencingToken, bool) -> Delete,
    in_flight: EvictInFlight,
) -> Result<Eviction, StoreError>
where
    Inspect: Future<Output = Result<Option<RawInspection>, StoreError>>,
    Delete: Future<Output = Result<bool, StoreError>>,
{
    for _ in 0..MAX_ATTEMPTS {
        let Some(raw) = inspect().await? else {
            return Ok(Eviction::NotFound);
        };
        let inspected = raw.to_inspected()?;
        if raw.in_flight() && in_flight == EvictInFlight::Refuse {
            return Ok(Eviction::InFlight(inspected));
        }
        if delete(FencingToken(raw.fencing_token), raw.in_flight()).await? {
            return Ok(Eviction::Evicted(inspected));
        }
    }
    Err(too_many_races("evict"))
}

/// An epoch-millisecond column as a wall-clock time.
fn wall_clock(epoch_ms: i64) -> SystemTime {
    let since_epoch = Duration::from_millis(epoch_ms.unsigned_abs());
    if epoch_ms >= 0 {
        UNIX_EPOCH + since_epoch
    } else {
        UNIX_EPOCH - since_epoch
    }
}

/// The trailers of a response as a column value: NULL when it has none, so that a
/// response without trailers is stored as the previous release stored it.
pub(crate) fn trailers_column(response: &StoredResponse) -> Option<Vec<u8>> {
    (!response.trailers.is_empty()).then(|| response.encode_trailers())
}

/// A stored response as the finalize statements bind it: status, encoded headers, body,
/// and the trailers column. Encoded once, so that a statement run again (a retry, or the
/// SQLite writer's turn) does not encode it again.
///
/// Not part of the API: it exists for the benchmarks, which bind the stores' finalize
/// statements through the stores' own `finalize_query`.
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct EncodedAnswer {
    pub(crate) status: i32,
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<Vec<u8>>,
}

impl EncodedAnswer {
    /// `response` as the finalize statements bind it.
    pub fn new(response: &StoredResponse) -> Self {
        Self {
            status: i32::from(response.status),
            headers: response.encode_headers(),
            body: response.body.clone(),
            trailers: trailers_column(response),
        }
    }
}

/// A store operation whose SQL a store shows with `sql()`: for auditing what runs
/// against your database, and for benchmarks that issue the very same statement raw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Operation {
    /// Insert if absent, or report the existing row.
    Reserve,
    /// Read a live record.
    Load,
    /// Extend a lease (fenced).
    Renew,
    /// Store the response (fenced).
    Finalize,
    /// Delete an in-flight record (fenced).
    Release,
    /// Take over a lapsed lease (fenced).
    TakeOver,
    /// Delete one batch of expired records.
    Purge,
    /// Read a live record without its response, with its times (operators).
    Inspect,
    /// Delete a live record as `Inspect` read it: same token, same state (operators).
    Evict,
}

/// What a scope holds, as the quota check reads it, and when its next record expires.
pub(crate) struct ScopeUsage {
    /// The reserving key already has a live record: a replay or a duplicate, which the
    /// quota never refuses.
    pub(crate) key_live: bool,
    pub(crate) records: i64,
    pub(crate) bytes: i64,
    pub(crate) next_expiry_in_ms: Option<i64>,
}

impl ScopeUsage {
    /// The quota's refusal of a new record in this scope, if any.
    pub(crate) fn refusal(&self, quota: &idempotency_core::ScopeQuota) -> Option<StoreError> {
        if self.key_live {
            return None;
        }
        let bound = quota.refuses(self.records.max(0) as u64, self.bytes.max(0) as u64)?;
        Some(StoreError::QuotaExceeded {
            bound,
            retry_after: self
                .next_expiry_in_ms
                .map(|ms| Duration::from_millis(ms.max(0) as u64)),
        })
    }
}

/// The SQL expression for the bytes the row `row` (a table alias) holds, as
/// `ScopeQuota` counts them; `length` is the byte-length function (`octet_length` on
/// PostgreSQL and MySQL, `length` on SQLite, whose text and blobs it measures in bytes
/// once cast to blobs).
pub(crate) fn row_bytes(length: &str, row: &str) -> String {
    format!(
        "{length}({row}.scope) + {length}({row}.idempotency_key) + {length}({row}.method) \
         + {length}({row}.path) + 32 + COALESCE({length}({row}.response_headers), 0) \
         + COALESCE({length}({row}.response_body), 0) \
         + CASE WHEN {row}.response_status IS NULL THEN 0 ELSE 2 END"
    )
}

/// What finalize and release announce for a record: a hash of its id, which says nothing
/// of the key to whoever else listens on the database.
#[cfg(feature = "postgres")]
pub(crate) fn notice_for(id: &idempotency_core::RecordId) -> String {
    use sha2::Digest as _;
    let mut hasher = sha2::Sha256::new();
    hasher.update((id.scope.len() as u64).to_be_bytes());
    hasher.update(id.scope.as_bytes());
    hasher.update(id.key.as_bytes());
    hex(&hasher.finalize()[..16])
}

/// `bytes` as lower-case hex digits.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        hex.push(char::from(DIGITS[usize::from(byte >> 4)]));
        hex.push(char::from(DIGITS[usize::from(byte & 0xf)]));
    }
    hex
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_round_up_and_clamp() {
        assert_eq!(millis(Duration::ZERO), 0);
        assert_eq!(millis(Duration::from_nanos(1)), 1);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), MAX_DURATION_MS as i64);
    }

    /// The clamp is about a century: a lifetime of 99 years is kept as it is, and the
    /// longest one still leaves room to add it to any instant of this millennium.
    #[test]
    fn the_clamp_is_a_century() {
        const YEAR_MS: i64 = 366 * 24 * 60 * 60 * 1000;
        assert_eq!(MAX_DURATION_MS, 3_162_240_000_000);
        let years_99 = Duration::from_millis(99 * YEAR_MS as u64);
        assert_eq!(millis(years_99), 99 * YEAR_MS);
        let year_2999_ms = 1000 * YEAR_MS;
        assert!(year_2999_ms.checked_add(millis(Duration::MAX)).is_some());
    }

    /// Epoch milliseconds before 1970 (no record has them, but a column may) are read
    /// as times before 1970.
    #[test]
    fn wall_clock_reads_both_sides_of_the_epoch() {
        assert_eq!(wall_clock(1500), UNIX_EPOCH + Duration::from_millis(1500));
        assert_eq!(wall_clock(-1500), UNIX_EPOCH - Duration::from_millis(1500));
        assert_eq!(wall_clock(0), UNIX_EPOCH);
    }

    #[test]
    fn tokens_differ() {
        let a = new_token();
        assert_ne!(a, new_token_other_than(a));
    }

    /// Each of a token's 64 bits is set in about half of the tokens drawn: the UUID's
    /// fixed version and variant bits are mixed away (2 000 draws: 1 000 ± 22 expected,
    /// so the bounds are 9 standard deviations out).
    #[test]
    fn token_bits_are_each_set_about_half_the_time() {
        let mut ones = [0_u32; 64];
        for _ in 0..2000 {
            let token = new_token().0 as u64;
            for (bit, count) in ones.iter_mut().enumerate() {
                *count += u32::from(token >> bit & 1 == 1);
            }
        }
        for (bit, count) in ones.iter().enumerate() {
            assert!(
                (800..=1200).contains(count),
                "bit {bit} was set in {count} of 2000 tokens"
            );
        }
    }
}
