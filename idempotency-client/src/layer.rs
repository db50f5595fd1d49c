//! The layer and its settings.

use std::sync::Arc;
use std::time::Duration;

use http::request;
use tower_layer::Layer;

use crate::policy::{Policy, Protocol};
use crate::service::IdempotentRetry;

/// Wraps an HTTP or gRPC client so that each mutation it sends carries one
/// `Idempotency-Key`, and is resent with the same key and the same bytes when resending is
/// safe and useful. See the [crate docs](crate) for what is retried and when it stops.
///
/// ```
/// use idempotency_client::IdempotentRetryLayer;
///
/// let layer = IdempotentRetryLayer::new(); // plain HTTP: POST, PUT, PATCH, DELETE
/// let grpc = IdempotentRetryLayer::grpc(); // every call, answers read as gRPC statuses
/// ```
#[derive(Clone)]
pub struct IdempotentRetryLayer {
    policy: Arc<Policy>,
}

impl IdempotentRetryLayer {
    /// For an HTTP client: POST, PUT, PATCH and DELETE requests are keyed and retried.
    pub fn new() -> Self {
        Self::with_policy(Policy::new(Protocol::Http))
    }

    /// For a gRPC client (a tonic `Channel`): every call is keyed (in its `idempotency-key`
    /// metadata) and retried on `UNAVAILABLE` only. Calls that stream their requests should
    /// be left out with [`with_mutations`](Self::with_mutations): the layer buffers a
    /// keyed request whole before it sends it.
    pub fn grpc() -> Self {
        Self::with_policy(Policy::new(Protocol::Grpc))
    }

    fn with_policy(policy: Policy) -> Self {
        IdempotentRetryLayer {
            policy: Arc::new(policy),
        }
    }

    #[cfg(feature = "reqwest")]
    pub(crate) fn policy(&self) -> &Policy {
        &self.policy
    }

    fn edit(mut self, change: impl FnOnce(&mut Policy)) -> Self {
        change(Arc::make_mut(&mut self.policy));
        self
    }

    /// Which requests are mutations, keyed and retried; the others pass through untouched.
    ///
    /// ```
    /// use idempotency_client::IdempotentRetryLayer;
    ///
    /// // Only order creation, not the streaming calls.
    /// let layer = IdempotentRetryLayer::grpc()
    ///     .with_mutations(|request: &http::request::Parts| request.uri.path() == "/orders.v1.Orders/CreateOrder");
    /// ```
    pub fn with_mutations(
        self,
        is_mutation: impl Fn(&request::Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.edit(|policy| policy.is_mutation = Arc::new(is_mutation))
    }

    /// The most times a request is sent, the first time included (default 5).
    ///
    /// ```
    /// use idempotency_client::IdempotentRetryLayer;
    ///
    /// let layer = IdempotentRetryLayer::new().with_max_attempts(3);
    /// ```
    pub fn with_max_attempts(self, attempts: u32) -> Self {
        self.edit(|policy| policy.max_attempts = attempts.max(1))
    }

    /// The wait before the second attempt (default 100 ms), doubled for each later one up to
    /// `max` (default 10 s), each with random jitter between half and all of it. A server's
    /// `Retry-After` (or gRPC `grpc-retry-pushback-ms`) is waited when it is longer.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_client::IdempotentRetryLayer;
    ///
    /// let layer = IdempotentRetryLayer::new()
    ///     .with_backoff(Duration::from_millis(50), Duration::from_secs(2));
    /// ```
    pub fn with_backoff(self, first: Duration, max: Duration) -> Self {
        self.edit(|policy| {
            policy.first_backoff = first;
            policy.max_backoff = max.max(first);
        })
    }

    /// The server's key lifetime (an Iceberg catalog advertises it:
    /// [`iceberg::fetch_key_lifetime`](crate::iceberg::fetch_key_lifetime)).
    /// After it the server forgets the key, and a resent request would run again, so retries
    /// stop at nine tenths of it, counted from the first attempt. Without it they stop after
    /// 60 seconds.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_client::IdempotentRetryLayer;
    ///
    /// let layer = IdempotentRetryLayer::new().with_key_lifetime(Duration::from_secs(30 * 60));
    /// ```
    pub fn with_key_lifetime(self, lifetime: Duration) -> Self {
        self.edit(|policy| policy.horizon = lifetime.mul_f64(0.9))
    }

    /// Whether a `5xx` other than 503 is retried (default `true`). A server that releases
    /// the key on a `5xx`, as this project's does, runs the request again on the retry;
    /// turn it off for a server that does not.
    ///
    /// ```
    /// use idempotency_client::IdempotentRetryLayer;
    ///
    /// let layer = IdempotentRetryLayer::new().with_retry_on_server_errors(false);
    /// ```
    pub fn with_retry_on_server_errors(self, retry: bool) -> Self {
        self.edit(|policy| policy.retry_server_errors = retry)
    }

    /// The largest request body the layer buffers for resending (default 8 MiB, the
    /// server's default limit). A larger one is refused with
    /// [`Error::BodyTooLarge`](crate::Error::BodyTooLarge) before anything is sent.
    ///
    /// ```
    /// use idempotency_client::IdempotentRetryLayer;
    ///
    /// let layer = IdempotentRetryLayer::new().with_max_body_bytes(64 * 1024);
    /// ```
    pub fn with_max_body_bytes(self, limit: usize) -> Self {
        self.edit(|policy| policy.max_body_bytes = limit)
    }
}

impl Default for IdempotentRetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for IdempotentRetryLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let policy = &self.policy;
        f.debug_struct("IdempotentRetryLayer")
            .field("protocol", &policy.protocol)
            .field("max_attempts", &policy.max_attempts)
            .field("first_backoff", &policy.first_backoff)
            .field("max_backoff", &policy.max_backoff)
            .field("horizon", &policy.horizon)
            .field("retry_server_errors", &policy.retry_server_errors)
            .field("max_body_bytes", &policy.max_body_bytes)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for IdempotentRetryLayer {
    type Service = IdempotentRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentRetry::new(inner, Arc::clone(&self.policy))
    }
}
