//! The keyed path, in request order: read the key, bind the record to the request,
//! reserve it (or wait for its owner, or take a crashed owner's place), and replay a
//! finished answer. Running the inner service as the key's owner is [`crate::owner`].

use std::sync::Arc;

use bytes::{Buf, Bytes};
use futures_util::FutureExt as _;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::binding;
use crate::body::{Buffered, Joined, buffer};
use crate::budget::Held;
use crate::layer::Settings;
use crate::metrics::{self, StoreCall};
use crate::outcome::Outcome;
use crate::owner;
use crate::policy::is_mutation;
use crate::profile::RequestHead;
use crate::rejection::Rejection;
use crate::service::{Answer, Bodies, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, Inner};
use crate::store::{
    IdempotencyRecord, RecordId, RecordState, Reservation, StoreError, StoredResponse,
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
    if value.is_none() && !settings.require_key {
        return Ok(None);
    }
    if !settings.takes_part(&RequestHead::of(request)) {
        return Ok(None);
    }
    if repeated {
        return Err(Rejection::duplicate_key_header());
    }
    match value {
        // A header that is there but empty is a client's mistake, not the absence of a
        // key: running the mutation unprotected would hide it.
        Some([]) => Err(Rejection::empty_key()),
        Some(value) => settings
            .key_format()
            .parse(value)
            .map(Some)
            .map_err(|error| Rejection::invalid_key(&error)),
        None => Err(Rejection::missing_key(method, request.uri().path())),
    }
}

/// The start of a keyed request, before anything is awaited: whose key it is (the
/// scope), and the request's span. A request whose caller the layer cannot see is
/// refused here, before its body is read.
///
/// The span (`idempotency`) carries the key as logs show it (a short hash of scope and
/// key, never the key: a key is what collects a response) and, once decided, the
/// `outcome` ([`Outcome`]'s `Display`, e.g. `replayed`, `rejected:key-reused`). The
/// [`ResponseFuture`](crate::ResponseFuture) enters it on every poll of [`handle`]'s
/// future, which saves wrapping (and moving) that large future once more.
pub(crate) fn begin<Body>(
    settings: &Settings,
    request: Request<Body>,
    key: String,
) -> Result<(Request<Body>, RecordId, tracing::Span), Rejection> {
    let (parts, body) = request.into_parts();
    let Some(scope) = settings.scope.scope(&parts) else {
        let rejection = Rejection::no_scope(settings.scope_chosen);
        settings.no_scope_logged.call_once(|| {
            tracing::error!(
                "idempotency: misconfigured, keyed requests are refused: {}",
                rejection.message
            );
        });
        return Err(rejection);
    };
    let id = RecordId::new(scope, key);
    // Without a `tracing` subscriber that wants INFO, no span at all: a disabled span
    // still feeds the `log` crate fallback (on in every axum application) at each poll.
    let span = if tracing::level_enabled!(tracing::Level::INFO) {
        tracing::info_span!(
            "idempotency",
            key = %settings.log_key(&id),
            outcome = tracing::field::Empty,
        )
    } else {
        tracing::Span::none()
    };
    Ok((Request::from_parts(parts, body), id, span))
}

/// Stages 2 and 3 for a request with a key: bind, then reserve, wait or take over, and
/// replay or run as the owner.
pub(crate) async fn handle<S, B>(
    settings: Arc<Settings>,
    inner: S,
    request: Request<B::In>,
    id: RecordId,
) -> Answer<B, S::Error>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    let (parts, body) = request.into_parts();
    // The request's bytes stay taken from the memory budget until it is answered.
    let mut held = Held::default();
    let body = match read_body(&settings, &parts.headers, body, &mut held).await {
        Ok(body) => body,
        Err(rejection) => {
            tracing::info!(outcome = rejection.kind.as_str(), key = %settings.log_key(&id), "idempotency: refused the request body: {}", rejection.message);
            return Ok(refuse::<B>(&settings, rejection));
        }
    };
    let request = Request::from_parts(parts, body);
    let binding = binding::bind(&request);

    // The wait for an in-flight owner is bounded from the first time this request waits:
    // most requests never do, and reading the clock for them is a cost of its own.
    let mut wait_until = None;
    for _ in 0..MAX_ATTEMPTS {
        let (lease, lifetime) = (settings.lease(), settings.kept_for());
        let reservation = metrics::store_call(
            &settings,
            StoreCall::Reserve,
            settings.store.reserve(&id, &binding, lease, lifetime),
        )
        .await;
        let record = match reservation {
            Ok(Reservation::Reserved(token)) => {
                tracing::debug!(outcome = "reserved", key = %settings.log_key(&id), "idempotency: reserved the key");
                return owner::run::<S, B>(
                    settings,
                    inner,
                    request,
                    id,
                    token,
                    Outcome::Executed,
                    held,
                )
                .await;
            }
            Ok(Reservation::Exists(record)) => record,
            Err(error) => {
                return Box::pin(store_failed::<S, B>(settings, inner, request, &id, &error)).await;
            }
        };
        if record.binding != binding {
            tracing::info!(outcome = "key-reused", key = %settings.log_key(&id), "idempotency: key reused for another request");
            return Ok(refuse::<B>(&settings, Rejection::key_reused(&settings)));
        }
        let settled = match record.state {
            RecordState::InFlight {
                lease_lapsed: false,
                ..
            } => {
                let now = Instant::now();
                let wait_until = *wait_until.get_or_insert(now + settings.in_flight_wait);
                let remaining = wait_until.saturating_duration_since(now);
                tracing::debug!(outcome = "waiting", key = %settings.log_key(&id), "idempotency: waiting for the in-flight owner");
                let waiting_since = settings.metrics.then(std::time::Instant::now);
                let waited = settings.store.wait(&id, remaining).await;
                if let Some(since) = waiting_since {
                    metrics::wait_duration(&settings, since.elapsed());
                }
                match waited {
                    Ok(Some(IdempotencyRecord { state, .. })) => state,
                    // Released or expired while we waited: reserve again.
                    Ok(None) => continue,
                    Err(error) => {
                        return Box::pin(store_failed::<S, B>(
                            settings, inner, request, &id, &error,
                        ))
                        .await;
                    }
                }
            }
            state => state,
        };
        match settled {
            RecordState::Completed(stored) => {
                tracing::debug!(outcome = "replayed", key = %settings.log_key(&id), status = stored.status, "idempotency: replayed the stored response");
                metrics::outcome(&settings, Outcome::Replayed);
                return Ok(replay::<S, B>(&settings, inner, &request, stored).await);
            }
            RecordState::InFlight {
                token,
                lease_lapsed: true,
            } => match metrics::store_call(
                &settings,
                StoreCall::TakeOver,
                settings.store.take_over(&id, token, settings.lease()),
            )
            .await
            {
                Ok(Some(token)) => {
                    tracing::warn!(outcome = "took-over", key = %settings.log_key(&id), "idempotency: took over a reservation whose owner stopped renewing its lease");
                    return owner::run::<S, B>(
                        settings,
                        inner,
                        request,
                        id,
                        token,
                        Outcome::TookOver,
                        held,
                    )
                    .await;
                }
                // Someone else took it over, or the owner finished: look again.
                Ok(None) => continue,
                Err(error) => {
                    return Box::pin(store_failed::<S, B>(settings, inner, request, &id, &error))
                        .await;
                }
            },
            RecordState::InFlight { .. } => break,
        }
    }
    tracing::info!(outcome = "conflict", key = %settings.log_key(&id), "idempotency: the owner is still running; answered in flight");
    Ok(refuse::<B>(&settings, Rejection::in_flight(&settings)))
}

/// The layer's own answer to a keyed request, with its outcome recorded.
fn refuse<B: Bodies>(settings: &Settings, rejection: Rejection) -> Response<B::Answer> {
    metrics::outcome(settings, Outcome::Rejected(rejection.kind));
    rejection.into_response::<B>(settings)
}

/// Reads the request body whole (it is fingerprinted and may be sent to the inner
/// service again), within the memory budget, the size limit and the time limit. A
/// declared `Content-Length` over the limit is refused before anything is read (so no
/// `100 Continue` is sent). The bytes stay taken from the budget while `held` lives.
async fn read_body<B>(
    settings: &Settings,
    headers: &HeaderMap,
    body: B,
    held: &mut Held,
) -> Result<Bytes, Rejection>
where
    B: http_body::Body<Data: Send, Error: Into<crate::BoxError>>,
{
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > settings.max_request_body as u64) {
        return Err(Rejection::body_too_large(settings));
    }
    // Take what the body declares up front, so an over-budget request is refused before
    // a byte of it is read; a body of unknown length is taken as it arrives.
    let upfront = declared.map_or(0, |length| length as usize);
    if !settings.memory.grow(held, upfront) {
        return Err(Rejection::over_budget(settings));
    }
    // The time limit starts when the body first makes us wait: frames that are already
    // there are read without a timer (and without reading the clock).
    let mut deadline = None;
    let mut body = std::pin::pin!(body);
    let mut bytes = Joined::default();
    loop {
        // A frame that is already there is taken without arming a timer; only a body
        // that makes us wait is raced against the deadline.
        let frame = if let Some(frame) = body.as_mut().frame().now_or_never() {
            frame
        } else {
            let deadline =
                *deadline.get_or_insert_with(|| Instant::now() + settings.request_body_timeout);
            match tokio::time::timeout_at(deadline, body.as_mut().frame()).await {
                Err(_elapsed) => return Err(Rejection::body_timeout(settings)),
                Ok(frame) => frame,
            }
        };
        let frame = match frame {
            None => return Ok(bytes.freeze()),
            Some(Err(error)) => return Err(Rejection::unreadable_body(&error.into())),
            Some(Ok(frame)) => frame,
        };
        let Ok(mut data) = frame.into_data() else {
            continue; // trailers of a request body are not part of the binding
        };
        let length = bytes.len() + data.remaining();
        if length > settings.max_request_body {
            return Err(Rejection::body_too_large(settings));
        }
        if length > held.bytes() && !settings.memory.grow(held, length - held.bytes()) {
            return Err(Rejection::over_budget(settings));
        }
        // A frame of `Bytes` (what hyper and axum send) is taken without a copy. What
        // is held from the budget is the declared length, if any, else what was read.
        let data = data.copy_to_bytes(data.remaining());
        bytes.push_expecting(data, held.bytes());
    }
}

/// The store failed before anything ran: fail closed, or run unprotected if configured.
/// Its callers box its future (it may call the inner service): a rare path, which should
/// not make every keyed request's future larger.
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
    match error {
        StoreError::Full { retry_after, .. } => {
            tracing::warn!(outcome = "store-full", key = %settings.log_key(id), "idempotency: {error}");
            return Ok(refuse::<B>(
                &settings,
                Rejection::store_full(&settings, *retry_after),
            ));
        }
        StoreError::QuotaExceeded { retry_after, .. } => {
            tracing::info!(outcome = "quota-exceeded", key = %settings.log_key(id), "idempotency: {error}");
            return Ok(refuse::<B>(
                &settings,
                Rejection::quota_exceeded(&settings, *retry_after),
            ));
        }
        _ => {}
    }
    if settings.fail_open {
        tracing::warn!(outcome = "ran-unprotected", key = %settings.log_key(id), %error, "idempotency: store failed; running the request without protection (fail-open)");
        metrics::outcome(&settings, Outcome::RanUnprotected);
        let mut request = request.map(B::request);
        owner::prepare_for_inner(&settings, request.headers_mut());
        let mut response = inner.call(request).await?.map(B::Answer::from);
        response.extensions_mut().insert(Outcome::RanUnprotected);
        return Ok(response);
    }
    tracing::error!(outcome = "store-unavailable", key = %settings.log_key(id), %error, "idempotency: store failed before the request ran");
    Ok(refuse::<B>(
        &settings,
        Rejection::store_unavailable(&settings),
    ))
}

/// Stage 7, the replay: the stored answer, with what the profile adds back. When the
/// profile asks for a refresh, the inner service answers it first, with the retry's own
/// headers and extensions (so with the retry's own authorization).
async fn replay<S, B>(
    settings: &Settings,
    inner: S,
    retry: &Request<Bytes>,
    stored: StoredResponse,
) -> Response<B::Answer>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    // The refresh calls the inner service: its future is boxed, so that the keyed
    // future of every other request (most replays refresh nothing) does not carry room
    // for it.
    let refreshed = match settings.profile.refresh(retry, &stored) {
        Some(refresh) => Box::pin(refresh_for_replay::<S, B>(settings, inner, refresh)).await,
        None => None,
    };
    replay_response::<B>(settings.profile.replay(stored, refreshed))
}

/// The inner service's answer to the profile's refresh request, read whole; `None` if it
/// failed, was not a 2xx or could not be read.
async fn refresh_for_replay<S, B>(
    settings: &Settings,
    mut inner: S,
    mut refresh: Request<Bytes>,
) -> Option<Response<Bytes>>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    owner::ask_for_identity(refresh.headers_mut());
    match inner.call(refresh.map(B::request)).await {
        Ok(answer) if answer.status().is_success() => {
            let (mut parts, body) = answer.into_parts();
            match buffer(body, settings.max_response_body).await {
                // Asked for identity; decoded if the service compressed anyway.
                Buffered::Whole(bytes, _) => {
                    crate::encoding::decode(&mut parts.headers, &bytes, settings.max_response_body)
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
