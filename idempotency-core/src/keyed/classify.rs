//! Stage 5, **classify**: what happens to the inner service's answer, decided without
//! I/O. 5xx and the release statuses release the key; the profile decides the rest; an
//! answer that cannot be kept (too large, or encoded although the layer asked for none)
//! is remembered as "already ran"; an answer whose body failed is released or kept by its
//! status. Also what is stored of a kept answer.

use std::pin::Pin;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, StatusCode, response};

use crate::body::Answered;
use crate::encoding::is_encoded;
use crate::profile::Disposition;
use crate::settings::Settings;
use crate::store::{BoxError, StoredResponse};

/// An answer its caller can still get: read whole, or read in part with the rest to
/// stream on.
pub(crate) enum Readable<I> {
    /// The whole body and the trailers it ended with.
    Whole(Bytes, Option<HeaderMap>),
    /// The bytes read so far, and the rest, unread.
    Over(Bytes, Pin<Box<I>>),
}

/// Why an answer that ran is not kept for replay: its retries are told it already ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotKept {
    /// Larger than the limit, or than the memory budget allows.
    TooLarge,
    /// Encoded (`Content-Encoding`) although the layer asked for none: it could not be
    /// inspected, nor replayed to a retry that may not accept the encoding.
    Encoded,
}

/// What happens to an answer, with the answer.
pub(crate) enum Verdict<I> {
    /// Store it and replay it to every retry; the caller gets it.
    Store(Bytes, Option<HeaderMap>),
    /// Release the key, so that a retry runs again; the caller gets the answer.
    Release(Readable<I>),
    /// Remember that the request ran, without its answer; the caller gets the answer.
    NotKept(NotKept, Readable<I>),
    /// The body failed while it was read: released if the status releases the key, else
    /// remembered as "already ran" (the mutation most likely happened). The caller is
    /// told the body failed.
    Failed { release: bool, error: BoxError },
}

/// Whether `status` releases the key by the generic rules: 5xx, and the layer's release
/// statuses (401, 403, 408, 419, 429 by default).
fn releases(settings: &Settings, status: StatusCode) -> bool {
    status.is_server_error() || settings.release_statuses.contains(&status)
}

/// The verdict on an answer: the generic rules first, then the profile's.
pub(crate) fn classify<I>(
    settings: &Settings,
    parts: &response::Parts,
    body: Answered<I>,
) -> Verdict<I> {
    let release = releases(settings, parts.status);
    let readable = match body {
        Answered::Failed(error) => return Verdict::Failed { release, error },
        Answered::Whole(bytes, trailers) => Readable::Whole(bytes, trailers),
        Answered::Over(read, rest) => Readable::Over(read, rest),
    };
    if release {
        return Verdict::Release(readable);
    }
    // An answer over the limit has its trailers still to come.
    let trailers = match &readable {
        Readable::Whole(_, trailers) => trailers.as_ref(),
        Readable::Over(..) => None,
    };
    match (settings.profile.classify(parts, trailers), readable) {
        (Disposition::Release, readable) => Verdict::Release(readable),
        (_, over @ Readable::Over(..)) => Verdict::NotKept(NotKept::TooLarge, over),
        (_, whole) if is_encoded(&parts.headers) => Verdict::NotKept(NotKept::Encoded, whole),
        (_, Readable::Whole(bytes, trailers)) => Verdict::Store(bytes, trailers),
    }
}

/// What is stored of a kept answer: the generic rules' part ([`stored_response`]), then
/// the profile's `to_store`, given the keyed request if it was kept for it (and an empty
/// one otherwise, as [`Profile::to_store_reads_request`] says).
///
/// [`Profile::to_store_reads_request`]: crate::Profile::to_store_reads_request
pub(crate) fn to_store(
    settings: &Settings,
    request: Option<&Request<Bytes>>,
    parts: &response::Parts,
    body: &Bytes,
    trailers: Option<&HeaderMap>,
) -> StoredResponse {
    let answer = stored_response(settings, parts, body, trailers);
    match request {
        Some(request) => settings.profile.to_store(request, answer),
        None => settings
            .profile
            .to_store(&Request::new(Bytes::new()), answer),
    }
}

/// The answer as the generic rules keep it: status, the replayed headers, the body, and
/// every trailer.
fn stored_response(
    settings: &Settings,
    parts: &response::Parts,
    body: &Bytes,
    trailers: Option<&HeaderMap>,
) -> StoredResponse {
    StoredResponse {
        status: parts.status.as_u16(),
        headers: kept_headers(&parts.headers, |name| {
            settings.replayed_headers.contains(name)
        }),
        body: body.clone(),
        trailers: trailers.map_or_else(Vec::new, |trailers| kept_headers(trailers, |_| true)),
    }
}

/// The header fields `keep` keeps, as a store holds them.
pub(crate) fn kept_headers(
    headers: &HeaderMap,
    keep: impl Fn(&HeaderName) -> bool,
) -> Vec<(String, Bytes)> {
    headers
        .iter()
        .filter(|(name, _)| keep(name))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}
