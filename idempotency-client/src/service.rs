//! The service: one logical request, one key, as many attempts as the policy allows.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;
use tracing::Instrument;

use crate::attempts::{Attempts, Step, key_of};
use crate::body::{ResendBody, buffer};
use crate::error::{BoxError, Error};
use crate::policy::Policy;

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
        let key = key_of(&mut parts.headers);
        let span = tracing::info_span!(
            "idempotent_request",
            method = %parts.method,
            path = parts.uri.path(),
            key = ?key,
        );
        let attempts = async move {
            let bytes = buffer(body, policy.max_body_bytes).await?;
            let mut attempts = Attempts::new(&policy, key);
            loop {
                let number = attempts.send();
                let attempt =
                    Request::from_parts(parts.clone(), ReqBody::from_bytes(bytes.clone()));
                let answer = async {
                    poll_fn(|cx| inner.poll_ready(cx)).await?;
                    inner.call(attempt).await
                }
                .instrument(tracing::debug_span!("attempt", number))
                .await
                .map_err(Into::into);
                match attempts.settle(answer) {
                    Step::Return(result) => return result,
                    Step::Wait(wait) => tokio::time::sleep(wait).await,
                }
            }
        };
        ResponseFuture {
            inner: Box::pin(attempts.instrument(span)),
        }
    }
}
