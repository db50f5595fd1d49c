//! The layer as `reqwest-middleware` middleware (the `reqwest` feature): the same settings,
//! the same rules, for a `reqwest` client.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use idempotency_client::{IdempotentRetryLayer, KeyedOutcome};
//! use reqwest_middleware::{ClientBuilder, reqwest};
//!
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotentRetryLayer::new())
//!     .build();
//! let response = client.post("http://127.0.0.1:3000/orders").body("book").send().await?;
//! let outcome = response.extensions().get::<KeyedOutcome>();
//! # Ok(()) }
//! ```
//!
//! A request whose body is a stream cannot be resent, and is refused
//! ([`Error::Body`]) when it is a mutation. The layer's errors reach the
//! caller as `reqwest_middleware::Error::Middleware`, from which
//! `downcast_ref::<idempotency_client::Error>()` gets them back.

use reqwest_middleware::reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use tracing::Instrument;

use crate::IdempotentRetryLayer;
use crate::attempts::{Answer, Attempts, Step, key_of};
use crate::error::{BoxError, Error};
use crate::outcome::KeyedOutcome;
use crate::policy::Policy;

impl Answer for Response {
    fn status(&self) -> http::StatusCode {
        self.status()
    }

    fn headers(&self) -> &http::HeaderMap {
        self.headers()
    }

    fn set_outcome(&mut self, outcome: KeyedOutcome) {
        self.extensions_mut().insert(outcome);
    }
}

#[async_trait::async_trait]
impl Middleware for IdempotentRetryLayer {
    async fn handle(
        &self,
        mut request: Request,
        extensions: &mut http::Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let policy = self.policy();
        if !is_mutation(policy, &mut request) {
            return next.run(request, extensions).await;
        }
        let key = key_of(request.headers_mut());
        let span = tracing::info_span!(
            "idempotent_request",
            method = %request.method(),
            path = request.url().path(),
            key = ?key,
        );
        let fail = reqwest_middleware::Error::middleware;
        async move {
            let size = match request.body().map(|body| body.as_bytes()) {
                None => 0,
                Some(Some(bytes)) => bytes.len(),
                Some(None) => {
                    return Err(fail(Error::Body(
                        "the request body is a stream, which the idempotency layer cannot \
                         resend: send the body as bytes"
                            .into(),
                    )));
                }
            };
            if size > policy.max_body_bytes {
                return Err(fail(Error::BodyTooLarge {
                    limit: policy.max_body_bytes,
                }));
            }
            let mut attempts = Attempts::new(policy, key);
            loop {
                let number = attempts.send();
                let attempt = request
                    .try_clone()
                    .expect("a request whose body is bytes can be cloned");
                let answer = next
                    .clone()
                    .run(attempt, extensions)
                    .instrument(tracing::debug_span!("attempt", number))
                    .await
                    .map_err(BoxError::from);
                match attempts.settle(answer) {
                    Step::Return(result) => return result.map_err(fail),
                    Step::Wait(wait) => tokio::time::sleep(wait).await,
                }
            }
        }
        .instrument(span)
        .await
    }
}

/// Asks the mutation predicate about a reqwest request, shown to it as `http` parts: the
/// headers are lent to the parts and given back, not copied, on every request.
fn is_mutation(policy: &Policy, request: &mut Request) -> bool {
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = request.method().clone();
    parts.uri = request.url().as_str().parse().unwrap_or_default();
    parts.version = request.version();
    parts.headers = std::mem::take(request.headers_mut());
    let mutation = (policy.is_mutation)(&parts);
    *request.headers_mut() = parts.headers;
    mutation
}
