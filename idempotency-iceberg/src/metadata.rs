//! Table and view metadata kept out of the store, and read back for replays.
//!
//! An answer that carries metadata (`updateTable`, `createTable`, `registerTable`,
//! `createView`, `replaceView`, `registerView`) grows with its table: every snapshot and
//! log entry is in it. It is determined by the metadata file the request wrote, which
//! Iceberg never changes once written. So with a [`MetadataReader`] the profile stores the
//! answer with its `metadata` value replaced by `null`, and beside it the length and
//! digest of the bytes it took out; a replay reads the file named by the answer's
//! `metadata-location` through the reader, checks length and digest, and puts the bytes
//! back where they were. The replay is the first answer byte for byte, or it is not sent.
//!
//! The digest is XXH3-128, not SHA-256: it tells a file that is not the one the answer
//! carried (re-serialized by a reader, replaced at the same path) from the right one, at
//! a tenth of SHA-256's cost on a megabyte of metadata. It is no defence against someone
//! who can write the catalog's storage, and needs none: such a writer changes the table
//! itself, not only a retry's answer.

use std::future::Future;
use std::ops::Range;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use http::header;
use xxhash_rust::xxh3::xxh3_128;

use super::json;
use idempotency_core::{BoxError, StoredResponse};

/// The note on a stored answer whose `metadata` was taken out: `at=OFFSET;length=N;
/// xxh3=HEX`, where the `null` left in its place starts and the length and XXH3-128
/// digest of the bytes taken out. Never sent to a client.
pub(super) const METADATA_TAKEN_OUT: &str = "x-idempotency-iceberg-metadata";

/// How long a retry is asked to wait when its answer's metadata file cannot be read.
const RETRY_AFTER_SECONDS: &str = "1";

/// Reads a catalog's metadata files, so that a keyed answer that carries table or view
/// metadata is stored as a pointer to its file instead of whole: see
/// [`IcebergProfile::with_metadata_reader`](super::IcebergProfile::with_metadata_reader).
///
/// [`read_metadata`](Self::read_metadata) returns the JSON the catalog's answers carry as
/// `metadata` for the file at `location` (the answer's `metadata-location`): the file's
/// bytes, decompressed if the catalog writes compressed files. The catalog reads it with
/// its own storage client (local files, S3, …). If what it returns differs by one byte
/// from what the first answer carried, the retry is not answered with it (it gets a 503
/// instead), so a catalog whose answers re-serialize metadata differently from its files
/// must answer with the file's bytes for replays to work.
///
/// A closure `Fn(String) -> impl Future<Output = Result<impl Into<Bytes>, impl Into<BoxError>>>`
/// is a reader:
///
/// ```
/// use idempotency_iceberg::{IcebergProfile, MetadataReader};
///
/// let profile = IcebergProfile::default().with_metadata_reader(|location: String| async move {
///     let path = location.strip_prefix("file://").unwrap_or(&location).to_owned();
///     tokio::task::spawn_blocking(move || std::fs::read(path)).await?
/// });
/// # drop(profile);
/// ```
#[async_trait]
pub trait MetadataReader: Send + Sync + 'static {
    /// The metadata JSON of the file at `location`, as the catalog's answers carry it.
    async fn read_metadata(&self, location: &str) -> Result<Bytes, BoxError>;
}

#[async_trait]
impl<F, Fut, T, E> MetadataReader for F
where
    F: Fn(String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, E>> + Send,
    T: Into<Bytes>,
    E: Into<BoxError>,
{
    async fn read_metadata(&self, location: &str) -> Result<Bytes, BoxError> {
        match self(location.to_owned()).await {
            Ok(metadata) => Ok(metadata.into()),
            Err(error) => Err(error.into()),
        }
    }
}

/// Takes the `metadata` value out of an answer that names its `metadata-location`,
/// leaving `null` in its place and a note of what was taken out. Answers of any other
/// shape are left alone (`false`).
pub(super) fn take_out(answer: &mut StoredResponse) -> bool {
    let Some(metadata) = metadata_span(&answer.body) else {
        return false;
    };
    let taken = &answer.body[metadata.clone()];
    let note = format!(
        "at={};length={};xxh3={:032x}",
        metadata.start,
        taken.len(),
        xxh3_128(taken)
    );
    let mut kept = BytesMut::with_capacity(answer.body.len() - taken.len() + 4);
    kept.extend_from_slice(&answer.body[..metadata.start]);
    kept.extend_from_slice(b"null");
    kept.extend_from_slice(&answer.body[metadata.end..]);
    answer.body = kept.freeze();
    answer
        .headers
        .push((METADATA_TAKEN_OUT.to_owned(), Bytes::from(note)));
    true
}

/// Where the `metadata` object sits in an answer that also names a `metadata-location`.
fn metadata_span(body: &[u8]) -> Option<Range<usize>> {
    let [location, metadata] = json::member_spans(body, ["metadata-location", "metadata"])?;
    (body[location].starts_with(b"\"") && body[metadata.clone()].starts_with(b"{"))
        .then_some(metadata)
}

/// Whether `stored` had its metadata taken out.
pub(super) fn was_taken_out(stored: &StoredResponse) -> bool {
    note(stored).is_some()
}

fn note(stored: &StoredResponse) -> Option<&Bytes> {
    stored
        .headers
        .iter()
        .find(|(name, _)| name == METADATA_TAKEN_OUT)
        .map(|(_, value)| value)
}

/// The stored answer with its metadata read back through `reader` and put where it was
/// taken out: the first answer's bytes. If the file cannot be read, or does not hold
/// the bytes taken out, the retry gets [`unavailable`] instead, never a guess.
pub(super) async fn put_back(
    reader: Option<&dyn MetadataReader>,
    mut stored: StoredResponse,
) -> StoredResponse {
    let Some(pointer) = Pointer::of(&stored) else {
        tracing::error!(
            outcome = "replay-unavailable",
            "idempotency: a stored Iceberg answer whose metadata was taken out is malformed; answering 503"
        );
        return unavailable(None);
    };
    let Some(reader) = reader else {
        tracing::error!(outcome = "replay-unavailable", location = %pointer.location, "idempotency: a stored Iceberg answer points at its metadata file, but the profile has no metadata reader to read it (install the one it was stored with); answering 503");
        return unavailable(Some(&pointer.location));
    };
    let metadata = match reader.read_metadata(&pointer.location).await {
        Ok(metadata) => metadata,
        Err(error) => {
            tracing::warn!(outcome = "replay-unavailable", location = %pointer.location, %error, "idempotency: the metadata file of a stored Iceberg answer cannot be read (deleted, or storage unavailable); the retry is answered 503, state unknown");
            return unavailable(Some(&pointer.location));
        }
    };
    if metadata.len() != pointer.length || xxh3_128(&metadata) != pointer.digest {
        tracing::error!(outcome = "replay-unavailable", location = %pointer.location, read = metadata.len(), stored = pointer.length, "idempotency: the metadata file of a stored Iceberg answer does not hold the bytes the answer carried (the reader must return what the catalog's answers carry); the retry is answered 503, state unknown");
        return unavailable(Some(&pointer.location));
    }
    let body = &stored.body;
    let (before, after) = (
        &body[..pointer.placeholder.start],
        &body[pointer.placeholder.end..],
    );
    // Put together in the reader's own buffer when nothing else holds it (a copy when
    // something does): one answer-sized buffer per replay instead of two. With two, the
    // allocator hands the pair back to the kernel after each replay and the next one
    // faults it in again (BENCHMARKS, "Tables with thousands of snapshots").
    let mut whole = Vec::from(metadata);
    whole.reserve_exact(before.len() + after.len());
    whole.splice(..0, before.iter().copied());
    whole.extend_from_slice(after);
    stored.body = Bytes::from(whole);
    stored
        .headers
        .retain(|(name, _)| name != METADATA_TAKEN_OUT);
    stored
}

/// What a stored answer says about the metadata taken out of it.
struct Pointer {
    location: String,
    length: usize,
    /// XXH3-128 of the bytes taken out.
    digest: u128,
    /// Where the `null` left in its place sits in the stored body.
    placeholder: Range<usize>,
}

impl Pointer {
    fn of(stored: &StoredResponse) -> Option<Self> {
        let note = std::str::from_utf8(note(stored)?).ok()?;
        let (mut at, mut length, mut digest) = (None, None, None);
        for field in note.split(';') {
            match field.split_once('=')? {
                ("at", value) => at = value.parse::<usize>().ok(),
                ("length", value) => length = value.parse().ok(),
                ("xxh3", value) => digest = u128::from_str_radix(value, 16).ok(),
                _ => {}
            }
        }
        let body = &stored.body;
        let [location] = json::member_spans(body, ["metadata-location"])?;
        let location = serde_json::from_slice(&body[location]).ok()?;
        // The `null` left where the metadata was: put back exactly there.
        let placeholder = at?..at? + 4;
        (body.get(placeholder.clone())? == b"null").then_some(Self {
            location,
            length: length?,
            digest: digest?,
            placeholder,
        })
    }
}

/// The answer a retry gets when its metadata cannot be read back: 503 with
/// `Retry-After`, an Iceberg `ErrorModel` that says the request already ran. The Java
/// client resends a keyed 503 and then reports a commit's state as unknown: neither a
/// success it cannot show nor a failure that did not happen.
pub(super) fn unavailable(location: Option<&str>) -> StoredResponse {
    let file = location.map_or_else(String::new, |location| format!(" ({location})"));
    let message = format!(
        "The request with this Idempotency-Key already ran and succeeded, but its answer \
         cannot be replayed now: the metadata file it wrote{file} cannot be read (deleted, \
         or storage unavailable). Retry later, or load the table or view to see its state."
    );
    let body = serde_json::json!({
        "error": {
            "message": message,
            "type": "CommitStateUnknownException",
            "code": 503,
        }
    });
    StoredResponse {
        status: 503,
        headers: vec![
            (
                header::CONTENT_TYPE.as_str().to_owned(),
                Bytes::from_static(b"application/json"),
            ),
            (
                header::RETRY_AFTER.as_str().to_owned(),
                Bytes::from_static(RETRY_AFTER_SECONDS.as_bytes()),
            ),
        ],
        body: Bytes::from(body.to_string()),
        trailers: Vec::new(),
    }
}
