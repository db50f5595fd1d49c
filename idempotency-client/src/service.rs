//! The service: one logical request, one key, as many attempts as the policy allows.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use http::{HeaderName, HeaderValue, Request, Response};
use tower_service::Service;
use tracing::Instrument;

use crate::body::{ResendBody, buffer};
use crate::error::{BoxError, Error};
use crate::outcome::KeyedOutcome;
use crate::policy::{Policy, Verdict, is_replay};

/// The request header that carries the key (gRPC: the request metadata of that name).
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// A client wrapped by [`IdempotentRetryLayer`](crate::IdempotentRetryLayer).
#[derive(Clone)]
pub struct IdempotentRetry<S> {
    inner: S,
    policy: Arc<Policy>,
}

impl<S> IdempotentRetry<S> {
    pub(crate) fn new(inner: S, policy: Arc<Policy>) -> Self {
        IdempotentRetry { inner, policy }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for IdempotentRetry<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentRetry")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// The future of an [`IdempotentRetry`] call: every attempt and the waits between them.
pub struct ResponseFuture<T> {
    inner: Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>,
}

impl<T> Future for ResponseFuture<T> {
    type Output = Result<T, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<T> std::fmt::Debug for ResponseFuture<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotentRetry<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ReqBody: ResendBody + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = Error;
    type Future = ResponseFuture<Response<ResBody>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|error| Error::Client(error.into()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready service goes with this request; a clone stays for the next one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let policy = Arc::clone(&self.policy);
        let (mut parts, body) = request.into_parts();
        if !(policy.is_mutation)(&parts) {
            let request = Request::from_parts(parts, body);
            let call = inner.call(request);
            return ResponseFuture {
                inner: Box::pin(async move { call.await.map_err(|e| Error::Client(e.into())) }),
            };
        }
        let key = match parts.headers.get(&IDEMPOTENCY_KEY) {
            Some(key) => key.clone(),
            None => {
                let key = mint_key();
                parts.headers.insert(IDEMPOTENCY_KEY, key.clone());
                key
            }
        };
        let span = tracing::info_span!(
            "idempotent_request",
            method = %parts.method,
            path = parts.uri.path(),
            key = ?key,
        );
        let attempts = async move {
            let bytes = buffer(body, policy.max_body_bytes).await?;
            let started = Instant::now();
            let mut sent = 0;
            loop {
                sent += 1;
                let attempt =
                    Request::from_parts(parts.clone(), ReqBody::from_bytes(bytes.clone()));
                let answer: Result<Response<ResBody>, BoxError> = async {
                    poll_fn(|cx| inner.poll_ready(cx)).await?;
                    inner.call(attempt).await
                }
                .instrument(tracing::debug_span!("attempt", number = sent))
                .await
                .map_err(Into::into);
                let wait = match answer {
                    Ok(mut response) => {
                        let wait = match policy.judge(response.status(), response.headers()) {
                            Verdict::Final => None,
                            Verdict::KeyReused => return Err(Error::KeyReused { key }),
                            Verdict::Retry { hint } => policy.next_wait(started, sent, hint),
                        };
                        let Some(wait) = wait else {
                            let replayed = is_replay(response.headers());
                            tracing::debug!(status = %response.status(), attempts = sent, replayed, "answered");
                            response.extensions_mut().insert(KeyedOutcome {
                                key,
                                attempts: sent,
                                replayed,
                            });
                            return Ok(response);
                        };
                        tracing::debug!(status = %response.status(), ?wait, "retrying");
                        wait
                    }
                    Err(source) => {
                        let Some(wait) = policy.next_wait(started, sent, None) else {
                            return Err(Error::Transport {
                                key,
                                attempts: sent,
                                source,
                            });
                        };
                        tracing::debug!(error = %source, ?wait, "retrying");
                        wait
                    }
                };
                tokio::time::sleep(wait).await;
            }
        };
        ResponseFuture {
            inner: Box::pin(attempts.instrument(span)),
        }
    }
}

/// A new key: a UUIDv7, time-ordered, so that a server's index of keys stays compact.
fn mint_key() -> HeaderValue {
    let mut text = uuid::Uuid::encode_buffer();
    let text = uuid::Uuid::now_v7().hyphenated().encode_lower(&mut text);
    HeaderValue::from_str(text).expect("a UUID is a valid header value")
}
