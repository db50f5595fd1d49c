//! [`Idempotency`]: the service that reserves a key, runs the inner service once, records
//! its answer and replays it to retries.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;
use tower_service::Service;

use crate::error::{Rejection, RejectionKind};
use crate::future::{FinishOnDrop, ResponseFuture};
use crate::iceberg;
use crate::layer::Settings;
use crate::policy::is_mutation;
use http::HeaderName;

use crate::store::{
    Binding, BoxError, FencingToken, Ownership, RecordId, RecordState, Reservation, StoreError,
    StoredResponse,
};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The response header set on every replay.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// What the layer did with a keyed request. Every response to a request the layer took
/// part in carries one as an extension, so an access log can say whether the request
/// ran, was replayed or was refused. Requests passed through untouched carry none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The request reserved its key and ran; its answer was stored.
    Executed,
    /// The request took over a crashed owner's lapsed reservation and ran.
    TookOver,
    /// The request ran, and its answer released the key (5xx, 401, 429, …).
    Released,
    /// The request ran but its answer could not be stored (too large, or its body failed);
    /// retries are told it already ran.
    ExecutedNotStored,
    /// The stored answer of an earlier request was replayed; nothing ran.
    Replayed,
    /// The store failed and the layer is configured to fail open: it ran unprotected.
    RanUnprotected,
    /// The layer refused the request; nothing ran.
    Rejected(RejectionKind),
}

/// The reservation a keyed request runs under, added to the request's extensions for
/// the inner service. A service that keeps its state in the store's database can use it
/// to finalize the record inside its own transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservationHandle {
    /// The record reserved.
    pub id: RecordId,
    /// The token that owns it.
    pub token: FencingToken,
}

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) wraps around an inner one.
///
/// Its responses have the inner service's own body type, so wrapping costs nothing on
/// requests it passes through (and an axum `Router` wrapped whole can still be served
/// with `axum::serve`). The answers it makes itself (replays, buffered and rendered
/// bodies) are built with the body type's `From<Bytes>`: axum's `Body` and
/// `http_body_util::Full<Bytes>` have it; map any other body to one of those first.
///
/// ```no_run
/// use axum::{Router, extract::Request, routing::post};
/// use idempotency_core::IdempotencyLayer;
/// use idempotency_store_memory::MemoryStore;
/// use tower_layer::Layer;
///
/// # async fn serve() -> std::io::Result<()> {
/// let router = Router::new().route("/orders", post(|| async { "created" }));
/// let app = IdempotencyLayer::new(MemoryStore::new()).layer(router);
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
/// axum::serve(listener, axum::ServiceExt::<Request>::into_make_service(app)).await
/// # }
/// ```
pub struct Idempotency<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S: Clone> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>) -> Self {
        Self { inner, settings }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

type Answer<ResBody, E> = Result<Response<ResBody>, E>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let settings = &self.settings;
        if settings.iceberg
            && request.method() == Method::GET
            && iceberg::is_config_path(request.uri().path())
        {
            let answer = self.inner.call(request);
            return ResponseFuture::boxed(Box::pin(advertise_lifetime(settings.clone(), answer)));
        }
        if !is_mutation(request.method())
            || !settings
                .routes
                .takes_part(request.method(), request.uri().path())
        {
            return ResponseFuture::passthrough(self.inner.call(request));
        }
        let key = match read_key(settings, &request) {
            Ok(Some(key)) => key,
            Ok(None) => return ResponseFuture::passthrough(self.inner.call(request)),
            Err(rejection) => {
                tracing::info!(
                    outcome = rejection.kind.as_str(),
                    method = %request.method(),
                    path = request.uri().path(),
                    "idempotency: rejected the key header: {}",
                    rejection.message
                );
                return ResponseFuture::ready(render(settings, &rejection));
            }
        };
        // The clone goes back into `self`; the instance that was polled ready serves this
        // request (the usual tower pattern for services called from a spawned future).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::boxed(Box::pin(handle_keyed(
            settings.clone(),
            inner,
            request,
            key,
        )))
    }
}

/// The key of a taking-part request: `Ok(None)` without one, `Err` for a bad header.
fn read_key<B>(settings: &Settings, request: &Request<B>) -> Result<Option<String>, Rejection> {
    let mut values = request.headers().get_all(&IDEMPOTENCY_KEY).iter();
    let value = values.next().map(|v| v.as_bytes().trim_ascii());
    if values.next().is_some() {
        return Err(Rejection {
            kind: RejectionKind::DuplicateKeyHeader,
            status: StatusCode::BAD_REQUEST,
            message: "the request carries more than one Idempotency-Key header; send exactly one"
                .to_owned(),
            retry_after: None,
        });
    }
    match value {
        Some(value) if !value.is_empty() => match settings.key_format.parse(value) {
            Ok(key) => Ok(Some(key)),
            Err(error) => Err(Rejection {
                kind: RejectionKind::InvalidKey,
                status: StatusCode::BAD_REQUEST,
                message: error.to_string(),
                retry_after: None,
            }),
        },
        _ if settings.require_key => Err(Rejection {
            kind: RejectionKind::MissingKey,
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "{} {} requires an Idempotency-Key header; send one (a new UUID per operation, \
                 the same one on every retry)",
                request.method(),
                request.uri().path()
            ),
            retry_after: None,
        }),
        _ => Ok(None),
    }
}

fn render<B: From<Bytes>>(settings: &Settings, rejection: &Rejection) -> Response<B> {
    let mut response = settings.renderer.render(rejection).map(B::from);
    if let Some(retry_after) = rejection.retry_after {
        let seconds = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
    }
    response
        .extensions_mut()
        .insert(Outcome::Rejected(rejection.kind));
    response
}

fn reject<B: From<Bytes>, E>(settings: &Settings, rejection: Rejection) -> Answer<B, E> {
    Ok(render(settings, &rejection))
}

fn replay<B: From<Bytes>>(stored: StoredResponse) -> Response<B> {
    let mut response = Response::new(B::from(stored.body));
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
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response.extensions_mut().insert(Outcome::Replayed);
    response
}

fn store_failure(settings: &Settings, id: &RecordId, error: &StoreError) -> Rejection {
    if let StoreError::Full { .. } = error {
        tracing::warn!(outcome = "store-full", key = %id, "idempotency: {error}");
        return Rejection {
            kind: RejectionKind::StoreFull,
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is holding too many idempotency records to accept a new key \
                      right now; retry later with the same key"
                .to_owned(),
            retry_after: Some(settings.retry_after),
        };
    }
    tracing::error!(outcome = "store-error", key = %id, error = %error, "idempotency: store failed before the request ran");
    Rejection {
        kind: RejectionKind::StoreUnavailable,
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: "the idempotency store is unavailable, so the request was not run; retry \
                  later with the same Idempotency-Key"
            .to_owned(),
        retry_after: Some(settings.retry_after),
    }
}

fn key_reused(settings: &Settings, original: &Binding, retry: &Binding) -> Rejection {
    let what = if original.method != retry.method || original.path != retry.path {
        format!("{} {}", original.method, original.path)
    } else {
        "a request with another body".to_owned()
    };
    Rejection {
        kind: RejectionKind::KeyReused,
        status: settings.key_reused_status,
        message: format!(
            "this Idempotency-Key was already used for {what}; a key identifies one operation, \
             so send a new key for a different request"
        ),
        retry_after: None,
    }
}

fn in_flight(settings: &Settings) -> Rejection {
    Rejection {
        kind: RejectionKind::InFlight,
        status: settings.in_flight_status,
        message: "a request with this Idempotency-Key is still being processed; retry later \
                  with the same key to get its result"
            .to_owned(),
        retry_after: Some(settings.retry_after),
    }
}

/// Reservation attempts before a duplicate gives up: a key that keeps being released and
/// re-reserved by others under our feet is answered as in flight.
const MAX_ATTEMPTS: usize = 4;

async fn handle_keyed<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    inner: S,
    request: Request<ReqBody>,
    key: String,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let id = RecordId::new(settings.scope.scope(&parts), key);
    let body = match Limited::new(body, settings.max_request_body)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            tracing::info!(outcome = "body-too-large", key = %id, "idempotency: request body over the limit");
            return reject(
                &settings,
                Rejection {
                    kind: RejectionKind::BodyTooLarge,
                    status: StatusCode::PAYLOAD_TOO_LARGE,
                    message: format!(
                        "the request body is larger than the {} bytes this server accepts for \
                         requests with an Idempotency-Key; send a smaller body",
                        settings.max_request_body
                    ),
                    retry_after: None,
                },
            );
        }
        Err(error) => {
            tracing::info!(outcome = "unreadable-body", key = %id, %error, "idempotency: request body could not be read");
            return reject(
                &settings,
                Rejection {
                    kind: RejectionKind::UnreadableBody,
                    status: StatusCode::BAD_REQUEST,
                    message: format!(
                        "the request body could not be read ({error}); send the request again"
                    ),
                    retry_after: None,
                },
            );
        }
    };
    let binding = Binding {
        method: parts.method.as_str().to_owned(),
        path: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path(), |path| path.as_str())
            .to_owned(),
        body_sha256: Sha256::digest(&body).into(),
    };
    let request = Request::from_parts(parts, body);

    let kept_for = settings.lifetime + settings.grace_period;
    let wait_until = Instant::now() + settings.in_flight_wait;
    for _ in 0..MAX_ATTEMPTS {
        let reservation = settings
            .store
            .reserve(&id, &binding, settings.lease(), kept_for)
            .await;
        let record = match reservation {
            Ok(Reservation::Reserved(token)) => {
                tracing::debug!(outcome = "reserved", key = %id, "idempotency: reserved the key");
                return run_as_owner(settings, inner, request, id, token, Outcome::Executed).await;
            }
            Ok(Reservation::Exists(record)) => record,
            Err(error) => return store_failed(settings, inner, request, &id, &error).await,
        };
        if record.binding != binding {
            tracing::info!(outcome = "mismatch", key = %id, "idempotency: key reused for another request");
            return reject(&settings, key_reused(&settings, &record.binding, &binding));
        }
        let settled = match record.state {
            RecordState::InFlight {
                lease_lapsed: false,
                ..
            } => {
                let remaining = wait_until.saturating_duration_since(Instant::now());
                tracing::debug!(outcome = "waiting", key = %id, "idempotency: waiting for the in-flight owner");
                match settings.store.wait(&id, remaining).await {
                    Ok(Some(record)) => record.state,
                    // Released or expired while we waited: reserve again.
                    Ok(None) => continue,
                    Err(error) => return store_failed(settings, inner, request, &id, &error).await,
                }
            }
            state => state,
        };
        match settled {
            RecordState::Completed(stored) => {
                tracing::debug!(outcome = "replayed", key = %id, status = stored.status, "idempotency: replayed the stored response");
                if settings.iceberg {
                    return Ok(
                        replay_with_fresh_credentials(&settings, inner, &request, stored).await,
                    );
                }
                return Ok(replay(stored));
            }
            RecordState::InFlight {
                token,
                lease_lapsed: true,
            } => match settings.store.take_over(&id, token, settings.lease()).await {
                Ok(Some(token)) => {
                    tracing::warn!(outcome = "taken-over", key = %id, "idempotency: took over a reservation whose owner stopped renewing its lease");
                    return run_as_owner(settings, inner, request, id, token, Outcome::TookOver)
                        .await;
                }
                // Someone else took it over, or the owner finished: look again.
                Ok(None) => continue,
                Err(error) => return store_failed(settings, inner, request, &id, &error).await,
            },
            RecordState::InFlight { .. } => break,
        }
    }
    tracing::info!(outcome = "conflict", key = %id, "idempotency: the owner is still running; answered in flight");
    reject(&settings, in_flight(&settings))
}

/// The store failed before anything ran: fail closed, or run unprotected if configured.
async fn store_failed<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    mut inner: S,
    request: Request<Bytes>,
    id: &RecordId,
    error: &StoreError,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: From<Bytes>,
    ResBody: From<Bytes>,
{
    if settings.fail_open && !matches!(error, StoreError::Full { .. }) {
        tracing::warn!(outcome = "ran-unprotected", key = %id, %error, "idempotency: store failed; running the request without protection (fail-open)");
        let mut response = inner.call(request.map(ReqBody::from)).await?;
        response.extensions_mut().insert(Outcome::RanUnprotected);
        return Ok(response);
    }
    reject(&settings, store_failure(&settings, id, error))
}

/// Runs the inner service as the key's owner. It runs in the caller's task, but finishes
/// (and records its answer) even when the caller drops the response future: the rest of
/// the work then moves to a task of its own.
async fn run_as_owner<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    inner: S,
    request: Request<Bytes>,
    id: RecordId,
    token: FencingToken,
    outcome: Outcome,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: From<Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let tracker = settings.in_flight.clone();
    FinishOnDrop::new(
        &tracker,
        own_the_key(settings, inner, request, id, token, outcome),
    )
    .await
}

/// How a response body ended up after buffering.
enum Buffered {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// The whole body, over the limit: delivered, but not kept.
    TooLarge(Bytes),
    /// The body failed while it was read.
    Failed(BoxError),
}

async fn own_the_key<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    mut inner: S,
    request: Request<Bytes>,
    id: RecordId,
    token: FencingToken,
    outcome: Outcome,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: From<Bytes>,
    ResBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // Remembered only by the Iceberg profile, which keeps vended credentials out of the store.
    let operation = settings
        .iceberg
        .then(|| (request.method().clone(), request.uri().path().to_owned()));
    let mut request = request.map(ReqBody::from);
    request.extensions_mut().insert(ReservationHandle {
        id: id.clone(),
        token,
    });
    let max_body = settings.max_response_body;
    let run = async move {
        let response = inner.call(request).await?;
        let (parts, body) = response.into_parts();
        Ok((parts, buffer(body, max_body).await))
    };
    let ran = hold_lease(&settings, &id, token, AssertUnwindSafe(run).catch_unwind()).await;

    let (parts, buffered) = match ran {
        Err(panic) => {
            release(&settings, &id, token, "the inner service panicked").await;
            std::panic::resume_unwind(panic);
        }
        Ok(Err(error)) => {
            release(&settings, &id, token, "the inner service returned an error").await;
            return Err(error);
        }
        Ok(Ok(ran)) => ran,
    };

    let status = parts.status;
    let releases = status.is_server_error() || settings.release_statuses.contains(&status);
    let (body, outcome) = match buffered {
        // The answer is lost. A status that releases the key releases it as usual; any
        // other means the mutation most likely happened, so the key is kept, recorded as
        // "already ran", and the caller is told so instead of getting half a body.
        Buffered::Failed(error) if releases => {
            release(&settings, &id, token, "the response body failed").await;
            tracing::warn!(outcome = "response-failed", key = %id, %error, "idempotency: the response body failed; the status releases the key");
            let mut response = render(&settings, &response_failed(status, true));
            response.extensions_mut().insert(Outcome::Released);
            return Ok(response);
        }
        Buffered::Failed(error) => {
            tracing::warn!(outcome = "response-failed", key = %id, %error, "idempotency: the response body failed after the request ran; retries will be told it already ran");
            let why = "its response failed before it could be stored";
            finalize_rendered(&settings, &id, token, &not_stored(&settings, status, why)).await;
            let mut response = render(&settings, &response_failed(status, false));
            response.extensions_mut().insert(Outcome::ExecutedNotStored);
            return Ok(response);
        }
        Buffered::Whole(bytes) | Buffered::TooLarge(bytes) if releases => {
            release(
                &settings,
                &id,
                token,
                "the response status releases the key",
            )
            .await;
            (bytes, Outcome::Released)
        }
        Buffered::Whole(bytes) => {
            let stored = StoredResponse {
                status: status.as_u16(),
                headers: parts
                    .headers
                    .iter()
                    .filter(|(name, _)| settings.replayed_headers.contains(name))
                    .map(|(name, value)| {
                        (
                            name.as_str().to_owned(),
                            Bytes::copy_from_slice(value.as_bytes()),
                        )
                    })
                    .collect(),
                body: operation
                    .and_then(|(method, path)| iceberg::strip_credentials(&method, &path, &bytes))
                    .unwrap_or_else(|| bytes.clone()),
            };
            finalize(&settings, &id, token, &stored).await;
            (bytes, outcome)
        }
        Buffered::TooLarge(bytes) => {
            tracing::warn!(outcome = "not-stored", key = %id, limit = settings.max_response_body, "idempotency: response too large to store; retries will be told it already ran");
            let why = format!(
                "its response was larger than the {} bytes kept for replay",
                settings.max_response_body
            );
            finalize_rendered(&settings, &id, token, &not_stored(&settings, status, &why)).await;
            (bytes, Outcome::ExecutedNotStored)
        }
    };
    let mut response = Response::from_parts(parts, ResBody::from(body));
    response.extensions_mut().insert(outcome);
    Ok(response)
}

/// What a retry is told when the first answer ran but could not be kept, and `why`.
fn not_stored(settings: &Settings, status: StatusCode, why: &str) -> Rejection {
    Rejection {
        kind: RejectionKind::ResponseNotStored,
        status: settings.not_stored_status,
        message: format!(
            "the request with this Idempotency-Key already ran (status {}), but {why}; read \
             the resource's current state instead of retrying",
            status.as_u16()
        ),
        retry_after: None,
    }
}

/// Stores a rendered rejection as the key's answer, for every retry to get.
async fn finalize_rendered(
    settings: &Settings,
    id: &RecordId,
    token: FencingToken,
    rejection: &Rejection,
) {
    let rendered = settings.renderer.render(rejection);
    let stored = StoredResponse {
        status: rendered.status().as_u16(),
        headers: rendered
            .headers()
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    Bytes::copy_from_slice(value.as_bytes()),
                )
            })
            .collect(),
        body: rendered.into_body(),
    };
    finalize(settings, id, token, &stored).await;
}

/// What the caller is told when the inner service's response body failed mid-way, and
/// whether the key was `released`.
fn response_failed(status: StatusCode, released: bool) -> Rejection {
    let next = if released {
        "the key was released, so a retry with the same key runs the request again"
    } else {
        "the key is kept, so a retry with the same key is told the request already ran; \
         read the resource's current state to see its result"
    };
    Rejection {
        kind: RejectionKind::ResponseFailed,
        status: StatusCode::BAD_GATEWAY,
        message: format!(
            "the request ran (status {}), but its response body failed before it was \
             complete; {next}",
            status.as_u16()
        ),
        retry_after: None,
    }
}

/// Replays a stored Iceberg answer. A table-loading answer was stored without its vended
/// credentials; they are loaded afresh through the inner service with the retry's own
/// headers, so only a caller who may load the table gets them.
async fn replay_with_fresh_credentials<S, ReqBody, ResBody>(
    settings: &Settings,
    mut inner: S,
    request: &Request<Bytes>,
    mut stored: StoredResponse,
) -> Response<ResBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: From<Bytes>,
    ResBody: Body<Data = Bytes> + From<Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let reload_path = (stored.status == 200)
        .then(|| {
            iceberg::credentials_reload_path(request.method(), request.uri().path(), request.body())
        })
        .flatten();
    let Some(path) = reload_path else {
        return replay(stored);
    };
    let mut load = Request::new(ReqBody::from(Bytes::new()));
    *load.uri_mut() = match path.parse() {
        Ok(uri) => uri,
        Err(_) => return replay(stored),
    };
    *load.extensions_mut() = request.extensions().clone();
    for (name, value) in request.headers() {
        if name != header::CONTENT_LENGTH && name != header::CONTENT_TYPE && name != IDEMPOTENCY_KEY
        {
            load.headers_mut().append(name, value.clone());
        }
    }
    let fresh = match inner.call(load).await {
        Ok(response) if response.status() == StatusCode::OK => {
            match buffer(response.into_body(), settings.max_response_body).await {
                Buffered::Whole(body) => Some(body),
                _ => None,
            }
        }
        _ => None,
    };
    match fresh.and_then(|fresh| iceberg::merge_fresh_credentials(&stored.body, &fresh)) {
        Some(body) => stored.body = body,
        None => tracing::warn!(
            outcome = "replayed",
            path,
            "idempotency: could not reload the table for fresh credentials; replaying without them"
        ),
    }
    replay(stored)
}

/// Adds `idempotency-key-lifetime` to a successful `GET /v1/config` answer.
async fn advertise_lifetime<F, ResBody, E>(
    settings: Arc<Settings>,
    answer: F,
) -> Result<Response<ResBody>, E>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
    ResBody: Body<Data = Bytes> + From<Bytes>,
    ResBody::Error: Into<BoxError>,
{
    const MAX_CONFIG_BODY: usize = 1024 * 1024;
    let (mut parts, body) = answer.await?.into_parts();
    if parts.status != StatusCode::OK {
        return Ok(Response::from_parts(parts, body));
    }
    let body = match buffer(body, MAX_CONFIG_BODY).await {
        Buffered::Whole(bytes) => match iceberg::add_lifetime_to_body(&bytes, settings.lifetime) {
            Some(advertised) => {
                parts.headers.remove(header::CONTENT_LENGTH);
                advertised
            }
            None => bytes,
        },
        Buffered::TooLarge(bytes) => bytes,
        Buffered::Failed(error) => {
            tracing::warn!(%error, "idempotency: the config response body failed");
            let rejection = Rejection {
                kind: RejectionKind::ResponseFailed,
                status: StatusCode::BAD_GATEWAY,
                message: format!(
                    "the catalog's configuration response failed before it was complete \
                     ({error}); request the configuration again"
                ),
                retry_after: None,
            };
            return Ok(render(&settings, &rejection));
        }
    };
    Ok(Response::from_parts(parts, ResBody::from(body)))
}

/// Drives `work` while its lease is renewed every third of the lease's length.
///
/// The renewal runs on a task of its own, so the lease is kept even while nobody polls
/// `work` (a caller may hold the response future for a while without polling it). It
/// starts only if `work` does not finish on its first poll, and stops when `work` ends or
/// is dropped. Losing the lease does not stop the work: the request is already running,
/// and the store's fencing keeps the stale owner from overwriting the new one.
async fn hold_lease<F: Future>(
    settings: &Arc<Settings>,
    id: &RecordId,
    token: FencingToken,
    work: F,
) -> F::Output {
    let mut work = std::pin::pin!(work);
    let first_poll = std::future::poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx))).await;
    if let Poll::Ready(output) = first_poll {
        return output;
    }
    let _renewing = AbortOnDropHandle::new(tokio::spawn(renew_lease(
        settings.clone(),
        id.clone(),
        token,
    )));
    work.await
}

async fn renew_lease(settings: Arc<Settings>, id: RecordId, token: FencingToken) {
    loop {
        tokio::time::sleep(settings.lease() / 3).await;
        match settings.store.renew(&id, token, settings.lease()).await {
            Ok(Ownership::Held) => {}
            Ok(Ownership::Lost) => {
                tracing::warn!(outcome = "lost-ownership", key = %id, "idempotency: lost the reservation while the request ran (lease lapsed and taken over, or expired)");
                return;
            }
            Err(error) => {
                tracing::warn!(outcome = "store-error", key = %id, %error, "idempotency: renewing the lease failed; will retry")
            }
        }
    }
}

/// Reads a response body whole. Trailers are dropped: replays carry status, headers and
/// body only.
async fn buffer<B>(body: B, limit: usize) -> Buffered
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match body.collect().await {
        Ok(collected) => {
            let bytes = collected.to_bytes();
            if bytes.len() > limit {
                Buffered::TooLarge(bytes)
            } else {
                Buffered::Whole(bytes)
            }
        }
        Err(error) => Buffered::Failed(error.into()),
    }
}

async fn release(settings: &Settings, id: &RecordId, token: FencingToken, why: &str) {
    match settings.store.release(id, token).await {
        Ok(Ownership::Held) => {
            tracing::info!(outcome = "released", key = %id, "idempotency: released the key: {why}")
        }
        Ok(Ownership::Lost) => {
            tracing::warn!(outcome = "lost-ownership", key = %id, "idempotency: could not release a key it no longer owns ({why})")
        }
        Err(error) => {
            tracing::error!(outcome = "store-error", key = %id, %error, "idempotency: releasing the key failed; it stays reserved until its lease lapses ({why})")
        }
    }
}

/// Stores the answer, retrying a failing store with backoff for a bounded time. The
/// caller gets the real answer either way.
async fn finalize(
    settings: &Settings,
    id: &RecordId,
    token: FencingToken,
    stored: &StoredResponse,
) {
    let give_up_at = Instant::now() + settings.finalize_retry_for;
    let mut pause = Duration::from_millis(25);
    loop {
        match settings.store.finalize(id, token, stored).await {
            Ok(Ownership::Held) => {
                tracing::debug!(outcome = "finalized", key = %id, status = stored.status, "idempotency: stored the response");
                return;
            }
            Ok(Ownership::Lost) => {
                tracing::warn!(outcome = "lost-ownership", key = %id, "idempotency: the response was not stored: another request took over this key (this request's lease lapsed)");
                return;
            }
            Err(error) if Instant::now() + pause < give_up_at => {
                tracing::warn!(outcome = "store-error", key = %id, %error, "idempotency: storing the response failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(error) => {
                tracing::error!(outcome = "store-error", key = %id, %error, "idempotency: storing the response failed; giving up, the record will be taken over when its lease lapses");
                return;
            }
        }
    }
}
