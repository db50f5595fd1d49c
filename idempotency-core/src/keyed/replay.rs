//! Stage 7, **replay**: a retry of a finished request gets the stored answer, byte for
//! byte, with `idempotent-replayed: true`; the inner service is not called, unless the
//! profile asks for a refresh (e.g. a catalog loads the table again for fresh credentials). A
//! profile that stored part of the answer by reference rebuilds it first (e.g. table
//! metadata read back from its file).

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};

use crate::body_types::{Bodies, InnerService};
use crate::encoding;
use crate::headers::IDEMPOTENT_REPLAYED;
use crate::outcome::Outcome;
use crate::read::read_whole;
use crate::settings::Settings;
use crate::store::StoredResponse;

/// The stored answer, with what the profile adds back. When the
/// profile asks for a refresh, the inner service answers it first, with the retry's own
/// headers and extensions (so with the retry's own authorization).
pub(crate) async fn replay<S, B>(
    settings: &Settings,
    inner: S,
    retry: &Request<Bytes>,
    stored: StoredResponse,
) -> Response<B::ResponseOut>
where
    S: InnerService<B::RequestOut, B::ResponseIn>,
    B: Bodies,
{
    let stored = match settings.keeper.restore(&stored) {
        Some(restoring) => restoring.await,
        None => stored,
    };
    // The refresh calls the inner service: its future is boxed, so that the keyed
    // future of every other request (most replays refresh nothing) does not carry room
    // for it.
    let refreshed = match settings.replayer.refresh(retry, &stored) {
        Some(refresh) => Box::pin(refresh_for_replay::<S, B>(settings, inner, refresh)).await,
        None => None,
    };
    replay_response::<B>(settings.replayer.replay(stored, refreshed))
}

/// The inner service's answer to the profile's refresh request, read whole; `None` if it
/// failed, was not a 2xx or could not be read.
async fn refresh_for_replay<S, B>(
    settings: &Settings,
    mut inner: S,
    mut refresh: Request<Bytes>,
) -> Option<Response<Bytes>>
where
    S: InnerService<B::RequestOut, B::ResponseIn>,
    B: Bodies,
{
    encoding::ask_for_identity(refresh.headers_mut());
    match inner.call(refresh.map(B::keyed_request)).await {
        Ok(answer) if answer.status().is_success() => {
            let (mut parts, body) = answer.into_parts();
            match read_whole(body).await {
                // Asked for identity; decoded if the service compressed anyway.
                Ok((bytes, _)) if bytes.len() <= settings.max_response_body => {
                    encoding::decode(&mut parts.headers, &bytes, settings.max_response_body)
                        .inspect_err(|unreadable| tracing::warn!(outcome = "replayed", "idempotency: the load that refreshes a replay could not be read because {}", unreadable.why))
                        .ok()
                        .map(|plain| Response::from_parts(parts, plain))
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// A stored answer as a response: same status, same stored headers, same body, same
/// trailers, plus `idempotent-replayed: true`.
fn replay_response<B: Bodies>(stored: StoredResponse) -> Response<B::ResponseOut> {
    let trailers = (!stored.trailers.is_empty()).then(|| header_map(stored.trailers));
    let mut response = Response::new(B::made(stored.body, trailers));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            headers.append(name, value);
        }
    }
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response.extensions_mut().insert(Outcome::Replayed);
    response
}

/// Stored header or trailer fields as a map; fields that are no longer valid are skipped.
fn header_map(fields: Vec<(String, Bytes)>) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(fields.len());
    for (name, value) in fields {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            map.append(name, value);
        }
    }
    map
}
