//! The keyed path, in request order: read the key, bind the record to the request,
//! reserve it (or wait for its owner, or take a crashed owner's place), and replay a
//! finished answer. Running the inner service as the key's owner is [`crate::owner`].

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::body::{Buffered, buffer};
use crate::layer::Settings;
use crate::outcome::Outcome;
use crate::owner;
use crate::policy::is_mutation;
use crate::profile::RequestHead;
use crate::rejection::Rejection;
use crate::service::{Answer, Bodies, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, Inner};
use crate::store::{
    Binding, IdempotencyRecord, RecordId, RecordState, Reservation, StoreError, StoredResponse,
};

/// Reservation attempts before a duplicate gives up: a key that keeps being released and
/// re-reserved by others under our feet is answered as in flight.
const MAX_ATTEMPTS: usize = 4;

/// Stage 1, the key: `Ok(None)` for a request that does not take part or carries no key
/// (it passes through), `Err` for a bad key header.
pub(crate) fn read_key<B>(
    settings: &Settings,
    request: &Request<B>,
) -> Result<Option<String>, Rejection> {
    let method = request.method();
    if !is_mutation(method) {
        return Ok(None);
    }
    let mut values = request.headers().get_all(&IDEMPOTENCY_KEY).iter();
    let value = values.next().map(|v| v.as_bytes().trim_ascii());
    let repeated = values.next().is_some();
    let has_key = value.is_some_and(|v| !v.is_empty());
    if !has_key && !repeated && !settings.require_key {
        return Ok(None);
    }
    if !settings.takes_part(&RequestHead::of(request)) {
        return Ok(None);
    }
    let path = request.uri().path();
    if repeated {
        return Err(Rejection::duplicate_key_header());
    }
    match value {
        Some(value) if has_key => settings
            .key_format()
            .parse(value)
            .map(Some)
            .map_err(|error| Rejection::invalid_key(&error)),
        _ => Err(Rejection::missing_key(method, path)),
    }
}

/// Stages 2 and 3 for a request with a key: bind, then reserve, wait or take over, and
/// replay or run as the owner.
pub(crate) async fn handle<S, B>(
    settings: Arc<Settings>,
    inner: S,
    request: Request<B::In>,
    key: String,
) -> Answer<B, S::Error>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    let (parts, body) = request.into_parts();
    let id = RecordId::new(settings.scope.scope(&parts), key);
    let body = match read_body(&settings, body).await {
        Ok(body) => body,
        Err(rejection) => {
            tracing::info!(outcome = rejection.kind.as_str(), key = %settings.log_key(&id), "idempotency: refused the request body: {}", rejection.message);
            return Ok(rejection.into_response::<B>(&settings));
        }
    };
    let request = Request::from_parts(parts, body);
    let binding = bind(&request);

    let wait_until = Instant::now() + settings.in_flight_wait;
    for _ in 0..MAX_ATTEMPTS {
        let reservation = settings
            .store
            .reserve(&id, &binding, settings.lease(), settings.kept_for())
            .await;
        let record = match reservation {
            Ok(Reservation::Reserved(token)) => {
                tracing::debug!(outcome = "reserved", key = %settings.log_key(&id), "idempotency: reserved the key");
                return owner::run::<S, B>(settings, inner, request, id, token, Outcome::Executed)
                    .await;
            }
            Ok(Reservation::Exists(record)) => record,
            Err(error) => return store_failed::<S, B>(settings, inner, request, &id, &error).await,
        };
        if record.binding != binding {
            tracing::info!(outcome = "key-reused", key = %settings.log_key(&id), "idempotency: key reused for another request");
            return Ok(Rejection::key_reused(&settings).into_response::<B>(&settings));
        }
        let settled = match record.state {
            RecordState::InFlight {
                lease_lapsed: false,
                ..
            } => {
                let remaining = wait_until.saturating_duration_since(Instant::now());
                tracing::debug!(outcome = "waiting", key = %settings.log_key(&id), "idempotency: waiting for the in-flight owner");
                match settings.store.wait(&id, remaining).await {
                    Ok(Some(IdempotencyRecord { state, .. })) => state,
                    // Released or expired while we waited: reserve again.
                    Ok(None) => continue,
                    Err(error) => {
                        return store_failed::<S, B>(settings, inner, request, &id, &error).await;
                    }
                }
            }
            state => state,
        };
        match settled {
            RecordState::Completed(stored) => {
                tracing::debug!(outcome = "replayed", key = %settings.log_key(&id), status = stored.status, "idempotency: replayed the stored response");
                return Ok(replay::<S, B>(&settings, inner, &request, stored).await);
            }
            RecordState::InFlight {
                token,
                lease_lapsed: true,
            } => match settings.store.take_over(&id, token, settings.lease()).await {
                Ok(Some(token)) => {
                    tracing::warn!(outcome = "took-over", key = %settings.log_key(&id), "idempotency: took over a reservation whose owner stopped renewing its lease");
                    return owner::run::<S, B>(
                        settings,
                        inner,
                        request,
                        id,
                        token,
                        Outcome::TookOver,
                    )
                    .await;
                }
                // Someone else took it over, or the owner finished: look again.
                Ok(None) => continue,
                Err(error) => {
                    return store_failed::<S, B>(settings, inner, request, &id, &error).await;
                }
            },
            RecordState::InFlight { .. } => break,
        }
    }
    tracing::info!(outcome = "conflict", key = %settings.log_key(&id), "idempotency: the owner is still running; answered in flight");
    Ok(Rejection::in_flight(&settings).into_response::<B>(&settings))
}

/// Reads the request body whole (it is fingerprinted and may be sent to the inner
/// service again), refusing one over the limit.
async fn read_body<B>(settings: &Settings, body: B) -> Result<Bytes, Rejection>
where
    B: http_body::Body<Data: Send, Error: Into<crate::BoxError>>,
{
    match Limited::new(body, settings.max_request_body)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(Rejection::body_too_large(settings)),
        Err(error) => Err(Rejection::unreadable_body(&error)),
    }
}

/// Stage 2, the binding: what the key is used for. A retry with another binding is
/// refused instead of replayed.
fn bind(request: &Request<Bytes>) -> Binding {
    let uri = request.uri();
    Binding {
        method: request.method().as_str().to_owned(),
        path: uri
            .path_and_query()
            .map_or_else(|| uri.path(), |path| path.as_str())
            .to_owned(),
        body_sha256: Sha256::digest(request.body()).into(),
    }
}

/// The store failed before anything ran: fail closed, or run unprotected if configured.
async fn store_failed<S, B>(
    settings: Arc<Settings>,
    mut inner: S,
    request: Request<Bytes>,
    id: &RecordId,
    error: &StoreError,
) -> Answer<B, S::Error>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    if let StoreError::Full { .. } = error {
        tracing::warn!(outcome = "store-full", key = %settings.log_key(id), "idempotency: {error}");
        return Ok(Rejection::store_full(&settings).into_response::<B>(&settings));
    }
    if settings.fail_open {
        tracing::warn!(outcome = "ran-unprotected", key = %settings.log_key(id), %error, "idempotency: store failed; running the request without protection (fail-open)");
        let mut response = inner
            .call(request.map(B::request))
            .await?
            .map(B::Answer::from);
        response.extensions_mut().insert(Outcome::RanUnprotected);
        return Ok(response);
    }
    tracing::error!(outcome = "store-unavailable", key = %settings.log_key(id), %error, "idempotency: store failed before the request ran");
    Ok(Rejection::store_unavailable(&settings).into_response::<B>(&settings))
}

/// Stage 7, the replay: the stored answer, with what the profile adds back. When the
/// profile asks for a refresh, the inner service answers it first, with the retry's own
/// headers and extensions (so with the retry's own authorization).
async fn replay<S, B>(
    settings: &Settings,
    mut inner: S,
    retry: &Request<Bytes>,
    stored: StoredResponse,
) -> Response<B::Answer>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    let refreshed = match settings.profile.refresh(retry, &stored) {
        Some(refresh) => match inner.call(refresh.map(B::request)).await {
            Ok(answer) if answer.status().is_success() => {
                let (parts, body) = answer.into_parts();
                match buffer(body, settings.max_response_body).await {
                    Buffered::Whole(bytes, _) => Some(Response::from_parts(parts, bytes)),
                    _ => None,
                }
            }
            _ => None,
        },
        None => None,
    };
    replay_response::<B>(settings.profile.replay(stored, refreshed))
}

/// A stored answer as a response: same status, same stored headers, same body, same
/// trailers, plus `idempotent-replayed: true`.
fn replay_response<B: Bodies>(stored: StoredResponse) -> Response<B::Answer> {
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
pub(crate) fn header_map(fields: Vec<(String, Bytes)>) -> HeaderMap {
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
