//! [`IdempotencyLayer`]: the configuration, and the `tower::Layer` that wraps a service.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, StatusCode, header};
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use crate::budget::MemoryBudget;
use crate::decisions::{
    Advertise, AllMutations, ClassifyAnswer, KeepAnswer, KeepWhole, ReplayAnswer, ReplayAsStored,
    RouteFilter, StoreAnswers,
};
use crate::key::{KeyFormat, OpaqueKey};
use crate::policy::{NoScopeSet, ScopeExtractor};
use crate::rejection::{ErrorRenderer, ProblemJson};
use crate::service::{Idempotency, InnerBodies, WrappedBodies};
use crate::settings::{
    DEFAULT_IN_FLIGHT_WAIT, DEFAULT_LEASE, DEFAULT_LIFETIME, DEFAULT_MAX_REQUEST_BODY,
    DEFAULT_MAX_RESPONSE_BODY, DEFAULT_MEMORY_BUDGET, DEFAULT_REQUEST_BODY_TIMEOUT, MIN_LEASE,
    Settings,
};
use crate::store::IdempotencyStore;

/// A `tower::Layer` that makes mutations carrying an `Idempotency-Key` header run at most
/// once per key, and replays the first answer to every retry.
///
/// ```
/// use axum::{Router, routing::post};
/// use idempotency_core::IdempotencyLayer;
/// use idempotency_store_memory::MemoryStore;
///
/// let app: Router = Router::new()
///     .route("/orders", post(|| async { "created" }))
///     .layer(IdempotencyLayer::new(MemoryStore::new()));
/// ```
///
/// Place it after authentication, and give it a [scope](Self::with_scope) in a
/// multi-tenant service. See the [crate docs](crate) for the whole story.
///
/// Its parameter is how the services it makes type their bodies: [`InnerBodies`] (the
/// default) keeps the inner service's own body types, [`WrappedBodies`] (after
/// [`wrap_bodies`](Self::wrap_bodies)) wraps them in
/// [`IdempotencyBody`](crate::IdempotencyBody). See [`Idempotency`].
pub struct IdempotencyLayer<M = InnerBodies> {
    settings: Arc<Settings>,
    _bodies: PhantomData<fn() -> M>,
}

impl<M> Clone for IdempotencyLayer<M> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
            _bodies: PhantomData,
        }
    }
}

impl<M> std::fmt::Debug for IdempotencyLayer<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("lifetime", &self.settings.lifetime)
            .field("lease", &self.settings.lease)
            .field("in_flight_wait", &self.settings.in_flight_wait)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store` for plain HTTP ([`HttpProfile`](crate::HttpProfile)) with the defaults: opaque
    /// keys, no scope (see [`with_scope`](Self::with_scope)), every mutation, a 30-minute lifetime, 409 while in flight, 422 on
    /// key reuse, fail-closed. A store shared with other code (a purge task) can be
    /// passed as an `Arc`.
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self::from_shared_store(Arc::new(store))
    }

    /// A layer over a store that is already shared, e.g. with a purge task.
    pub fn from_shared_store(store: Arc<dyn IdempotencyStore>) -> Self {
        crate::metrics::describe();
        Self {
            _bodies: PhantomData,
            settings: Arc::new(Settings {
                store,
                routes: Arc::new(AllMutations),
                key_format: Arc::new(OpaqueKey),
                classifier: Arc::new(StoreAnswers),
                keeper: Arc::new(KeepWhole),
                replayer: Arc::new(ReplayAsStored),
                renderer: Arc::new(ProblemJson),
                advertiser: None,
                payload_key: None,
                scope: Arc::new(NoScopeSet),
                scope_chosen: false,
                no_scope_logged: Arc::new(std::sync::Once::new()),
                lifetime: DEFAULT_LIFETIME,
                grace_period: Duration::ZERO,
                lease: DEFAULT_LEASE,
                in_flight_wait: DEFAULT_IN_FLIGHT_WAIT,
                in_flight_status: StatusCode::CONFLICT,
                key_reused_status: StatusCode::UNPROCESSABLE_ENTITY,
                not_stored_status: StatusCode::CONFLICT,
                retry_after: Duration::from_secs(1),
                max_request_body: DEFAULT_MAX_REQUEST_BODY,
                request_body_timeout: DEFAULT_REQUEST_BODY_TIMEOUT,
                memory: Arc::new(MemoryBudget::new(DEFAULT_MEMORY_BUDGET)),
                max_response_body: DEFAULT_MAX_RESPONSE_BODY,
                release_statuses: [401, 403, 408, 419, 429]
                    .into_iter()
                    .filter_map(|code| StatusCode::from_u16(code).ok())
                    .collect(),
                replayed_headers: vec![
                    header::CONTENT_TYPE,
                    header::CONTENT_LANGUAGE,
                    header::CONTENT_LOCATION,
                    header::LOCATION,
                    header::ETAG,
                    header::LAST_MODIFIED,
                    header::CACHE_CONTROL,
                    header::VARY,
                ],
                require_key: false,
                forward_key: false,
                fail_open: false,
                finalize_retry_for: Duration::from_secs(5),
                max_run_time: None,
                in_flight: TaskTracker::new(),
                metrics: true,
            }),
        }
    }
}

impl<M> IdempotencyLayer<M> {
    /// The same layer, making services that wrap their bodies in
    /// [`IdempotencyBody`](crate::IdempotencyBody) ([`WrappedBodies`]): they serve inner
    /// services of any body types (hyper's `Incoming`, an RPC framework's, your own) with no
    /// adapter, and answers keep their trailers, first answers and replays alike. The
    /// inner service gets `Request<IdempotencyBody<ReqBody>>` and the caller
    /// `Response<IdempotencyBody<ResBody>>`; requests the layer does not take part in are
    /// only wrapped, never read or boxed.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use idempotency_core::{IdempotencyBody, IdempotencyLayer};
    /// use idempotency_store_memory::MemoryStore;
    /// use tower_layer::Layer;
    ///
    /// // A handler for the bodies the layer hands it: the server's own, wrapped.
    /// async fn handle<B>(_request: Request<IdempotencyBody<B>>) -> Result<Response<Full<Bytes>>, Infallible> {
    ///     Ok(Response::new(Full::new(Bytes::from_static(b"created"))))
    /// }
    ///
    /// let service = IdempotencyLayer::new(MemoryStore::new())
    ///     .wrap_bodies()
    ///     .layer(tower::service_fn(handle::<Full<Bytes>>));
    /// # drop(service);
    /// ```
    pub fn wrap_bodies(self) -> IdempotencyLayer<WrappedBodies> {
        IdempotencyLayer {
            settings: self.settings,
            _bodies: PhantomData,
        }
    }

    fn edit(mut self, change: impl FnOnce(&mut Settings)) -> Self {
        change(Arc::make_mut(&mut self.settings));
        self
    }

    /// How long a record is kept from its first submission (default 30 minutes). Retries
    /// after that run again.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use std::time::Duration;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_lifetime(Duration::from_secs(3600));
    /// assert_eq!(layer.lifetime(), Duration::from_secs(3600));
    /// ```
    pub fn with_lifetime(self, lifetime: Duration) -> Self {
        self.edit(|s| s.lifetime = lifetime)
    }

    /// The record lifetime.
    pub fn lifetime(&self) -> Duration {
        self.settings.lifetime
    }

    /// Keeps records this much longer than the lifetime (default none), for clients whose
    /// clocks or queues run late. Only the lifetime is advertised to clients.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use std::time::Duration;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_grace_period(Duration::from_secs(300));
    /// ```
    pub fn with_grace_period(self, grace_period: Duration) -> Self {
        self.edit(|s| s.grace_period = grace_period)
    }

    /// How long an owner's lease lasts (default 20 s, and never longer than the lifetime).
    /// The owner renews it every third of that while the inner service runs; a crashed
    /// owner's record is taken over after it.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// # use std::time::Duration;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_lease(Duration::from_secs(5));
    /// ```
    pub fn with_lease(self, lease: Duration) -> Self {
        self.edit(|s| s.lease = lease.max(MIN_LEASE))
    }

    /// How long a duplicate waits for an in-flight owner before it is answered with the
    /// in-flight status (default 10 s).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// # use std::time::Duration;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_in_flight_wait(Duration::ZERO);
    /// ```
    pub fn with_in_flight_wait(self, wait: Duration) -> Self {
        self.edit(|s| s.in_flight_wait = wait)
    }

    /// The status a duplicate gets when the owner is still running after the wait
    /// (default 409 Conflict; a profile's layer may use 503). `Retry-After` is always added.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_in_flight_status(http::StatusCode::SERVICE_UNAVAILABLE);
    /// ```
    pub fn with_in_flight_status(self, status: StatusCode) -> Self {
        self.edit(|s| s.in_flight_status = status)
    }

    /// The status for a key reused with another method, path or body (default 422).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_key_reused_status(http::StatusCode::BAD_REQUEST);
    /// ```
    pub fn with_key_reused_status(self, status: StatusCode) -> Self {
        self.edit(|s| s.key_reused_status = status)
    }

    /// The status replayed for a request that ran but whose response was larger than
    /// [`max_response_body`](Self::with_max_response_body) and so was not stored
    /// (default 409 Conflict). The first caller always gets the whole real response.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_not_stored_status(http::StatusCode::INTERNAL_SERVER_ERROR);
    /// ```
    pub fn with_not_stored_status(self, status: StatusCode) -> Self {
        self.edit(|s| s.not_stored_status = status)
    }

    /// The `Retry-After` the layer sends with in-flight and store-failure answers
    /// (default 1 s).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// # use std::time::Duration;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_retry_after(Duration::from_secs(2));
    /// ```
    pub fn with_retry_after(self, retry_after: Duration) -> Self {
        self.edit(|s| s.retry_after = retry_after)
    }

    /// The largest request body buffered and fingerprinted (default 8 MiB); larger keyed
    /// requests get 413 and nothing is reserved.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_max_request_body(1 << 20);
    /// ```
    pub fn with_max_request_body(self, bytes: usize) -> Self {
        self.edit(|s| s.max_request_body = bytes)
    }

    /// How long the body of a keyed request may take to arrive, whole (default 30 s).
    /// A slower one gets 408 and its bytes are let go; nothing was reserved.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// # use std::time::Duration;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_request_body_timeout(Duration::from_secs(5));
    /// ```
    pub fn with_request_body_timeout(self, timeout: Duration) -> Self {
        self.edit(|s| s.request_body_timeout = timeout)
    }

    /// The most bytes of bodies the layer holds at once, over all requests (default 256
    /// MiB): the bodies of keyed requests (held while they run, and while a duplicate
    /// waits) and the answers being read to be stored. A keyed request that would go
    /// over it gets 503 with `Retry-After` before its body is read; requests without a key
    /// are not held and never refused.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_memory_budget(64 << 20);
    /// ```
    pub fn with_memory_budget(self, bytes: usize) -> Self {
        self.edit(|s| s.memory = Arc::new(MemoryBudget::new(bytes)))
    }

    /// The largest response body stored for replay (default 8 MiB, which fits the
    /// default `max_allowed_packet` of MySQL and MariaDB). The layer reads a keyed answer
    /// up to this size (and within the [memory budget](Self::with_memory_budget)); a
    /// larger one is never truncated and never stored, and retries get the
    /// [not-stored status](Self::with_not_stored_status) saying the request already ran.
    /// Its caller gets it whole: with [wrapped bodies](Self::wrap_bodies) the rest streams
    /// on unread, so it costs no more memory than the limit; with the inner service's own
    /// body types (which the layer can only build from bytes) the rest is read too while
    /// the memory budget allows, and past the budget the caller gets 502 saying the
    /// request ran. Keep routes that stream large answers out of the layer with
    /// [`with_routes`](Self::with_routes).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_max_response_body(32 << 20);
    /// ```
    pub fn with_max_response_body(self, bytes: usize) -> Self {
        self.edit(|s| s.max_response_body = bytes)
    }

    /// The 4xx statuses that release the key instead of being stored (default 401, 403,
    /// 408, 419, 429): they say nothing about the operation, so a retry should run it.
    /// 5xx statuses always release.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use http::StatusCode;
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_release_statuses([StatusCode::UNAUTHORIZED, StatusCode::TOO_MANY_REQUESTS]);
    /// ```
    pub fn with_release_statuses(self, statuses: impl IntoIterator<Item = StatusCode>) -> Self {
        let statuses = statuses.into_iter().collect();
        self.edit(|s| s.release_statuses = statuses)
    }

    /// The response headers stored and replayed (default: content-type,
    /// content-language, content-location, location, etag, last-modified, cache-control,
    /// vary). Others are dropped from replays, never from the first answer.
    /// `Content-Encoding` is not among them: the layer asks the inner service for an
    /// unencoded answer and stores only such answers, so a replay never arrives in an
    /// encoding the retry did not accept. Compression belongs outside the layer.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use http::header;
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_replayed_headers([header::CONTENT_TYPE, header::LOCATION]);
    /// ```
    pub fn with_replayed_headers(self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        let headers = headers.into_iter().collect();
        self.edit(|s| s.replayed_headers = headers)
    }

    /// Answers 400 to a taking-part mutation that carries no key (default: such requests
    /// pass through unprotected).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_require_key(true);
    /// ```
    pub fn with_require_key(self, require: bool) -> Self {
        self.edit(|s| s.require_key = require)
    }

    /// Whether the inner service sees the `Idempotency-Key` header (default: no).
    ///
    /// The layer alone decides what a key means. A wrapped service with key handling of
    /// its own (an existing catalog may cache answers by key, with another lifetime and
    /// no check of the body) would otherwise answer in the layer's place, and a key the
    /// layer let run again could get the inner cache's stale answer. A handler that needs
    /// the reservation reads it from the [`ReservationHandle`](crate::ReservationHandle)
    /// request extension; set this only for a service that must pass the key on (e.g.
    /// to a payment provider) and does nothing else with it.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_forwarded_key(true);
    /// ```
    pub fn with_forwarded_key(self, forward: bool) -> Self {
        self.edit(|s| s.forward_key = forward)
    }

    /// When the store fails before the inner service ran: fail closed (the default: 503
    /// with `Retry-After`, nothing runs) or, with `true`, fail open (run the request
    /// unprotected and log a warning).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_fail_open(true);
    /// ```
    pub fn with_fail_open(self, fail_open: bool) -> Self {
        self.edit(|s| s.fail_open = fail_open)
    }

    /// How long a failing finalize is retried, with backoff, before the layer gives up
    /// and leaves the record for its lease to lapse (default 5 s).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// # use std::time::Duration;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_finalize_retry_for(Duration::from_secs(2));
    /// ```
    pub fn with_finalize_retry_for(self, duration: Duration) -> Self {
        self.edit(|s| s.finalize_retry_for = duration)
    }

    /// How long an owner may hold its key while the inner service runs (default: as long
    /// as it runs). After that the owner stops renewing its lease: once the lease lapses,
    /// a retry takes the key over and runs the request again, and the stuck owner's late
    /// answer is fenced out. For handlers that can hang; a request that is merely slow
    /// would then run twice, so set it well above the slowest real request.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// # use std::time::Duration;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_max_run_time(Duration::from_secs(600));
    /// ```
    pub fn with_max_run_time(self, max_run_time: Duration) -> Self {
        self.edit(|s| s.max_run_time = Some(max_run_time))
    }

    /// Whether the layer records its [metrics](crate::metrics) (default on): every keyed
    /// request's outcome, each store call's duration, each wait for an in-flight owner.
    /// They go to the recorder the application installs through the `metrics` facade,
    /// and cost next to nothing without one. Off, the layer makes no metrics call and
    /// reads no clock for them; the `tracing` span and events stay.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_metrics(false);
    /// ```
    pub fn with_metrics(self, metrics: bool) -> Self {
        self.edit(|s| s.metrics = metrics)
    }

    /// Which requests take part, among mutations that carry a key (default: every
    /// mutation, [`AllMutations`](crate::AllMutations); a profile's routes or calls). To narrow a profile's routes, ask them first in your
    /// own filter.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use idempotency_core::RequestHead;
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_routes(|request: &RequestHead<'_>| request.uri.path().starts_with("/v1/"));
    /// ```
    pub fn with_routes(self, routes: impl RouteFilter) -> Self {
        self.edit(|s| s.routes = Arc::new(routes))
    }

    /// How keys are parsed (default [`OpaqueKey`](crate::OpaqueKey); or
    /// [`UuidKey`](crate::UuidKey)).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use idempotency_core::UuidKey;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_key_format(UuidKey::v7_only());
    /// ```
    pub fn with_key_format(self, format: impl KeyFormat) -> Self {
        self.edit(|s| s.key_format = Arc::new(format))
    }

    /// Whether an answer is stored or releases the key, beyond the generic rules (5xx and
    /// the [release statuses](Self::with_release_statuses) always release). Default:
    /// stored ([`StoreAnswers`](crate::StoreAnswers)); an RPC profile may read the
    /// RPC status. See [`ClassifyAnswer`].
    pub fn with_classifier(self, classifier: impl ClassifyAnswer) -> Self {
        self.edit(|s| s.classifier = Arc::new(classifier))
    }

    /// What of an answer is kept in the store (default: all of it,
    /// [`KeepWhole`](crate::KeepWhole); a catalog profile may keep vended credentials
    /// out, and table metadata by reference). See [`KeepAnswer`].
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use idempotency_core::KeepWhole;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_answer_keeper(KeepWhole);
    /// ```
    pub fn with_answer_keeper(self, keeper: impl KeepAnswer) -> Self {
        self.edit(|s| s.keeper = Arc::new(keeper))
    }

    /// What a replay adds to the stored answer, from a request sent to the inner service
    /// first (default: nothing, [`ReplayAsStored`](crate::ReplayAsStored); a catalog
    /// profile may load the table again for fresh vended credentials). See
    /// [`ReplayAnswer`].
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use idempotency_core::ReplayAsStored;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_answer_replayer(ReplayAsStored);
    /// ```
    pub fn with_answer_replayer(self, replayer: impl ReplayAnswer) -> Self {
        self.edit(|s| s.replayer = Arc::new(replayer))
    }

    /// How the layer's own answers are rendered (default
    /// [`ProblemJson`](crate::ProblemJson); a profile renders its protocol's errors).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use idempotency_core::Rejection;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_error_renderer(|r: &Rejection| {
    ///     let mut response = http::Response::new(bytes::Bytes::from(r.message.clone()));
    ///     *response.status_mut() = r.status;
    ///     response
    /// });
    /// ```
    pub fn with_error_renderer(self, renderer: impl ErrorRenderer) -> Self {
        self.edit(|s| s.renderer = Arc::new(renderer))
    }

    /// Answers the layer amends although their requests do not take part (default: none;
    /// a catalog profile may add the key lifetime to its config answer). See
    /// [`Advertise`].
    pub fn with_advertiser(self, advertiser: impl Advertise) -> Self {
        self.edit(|s| s.advertiser = Some(Arc::new(advertiser)))
    }

    /// Amends no answer (the default).
    pub fn without_advertiser(self) -> Self {
        self.edit(|s| s.advertiser = None)
    }

    /// Reads the key from the request's body on the routes `payload_key` applies to
    /// (see [`PayloadKey`](crate::PayloadKey): there the body's key wins over the header).
    ///
    /// ```
    /// # use idempotency_core::{IdempotencyLayer, JsonPointerKey};
    /// # use idempotency_store_memory::MemoryStore;
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_payload_key(JsonPointerKey::new("/clientToken"));
    /// ```
    pub fn with_payload_key(self, payload_key: impl crate::PayloadKey) -> Self {
        self.edit(|s| s.payload_key = Some(Arc::new(payload_key)))
    }

    /// Reads keys from the `Idempotency-Key` header only (the default).
    pub fn without_payload_key(self) -> Self {
        self.edit(|s| s.payload_key = None)
    }

    /// How callers are told apart. See [`ScopeExtractor`]: read the scope from what your
    /// authentication layer established, never from a header the client sets, and run
    /// the layer *after* that authentication. An extractor that finds no caller (`None`)
    /// makes the layer refuse the request rather than share answers between callers.
    ///
    /// Without a scope, a layer puts requests that carry no credential in one shared
    /// scope and refuses keyed requests that carry one (`Authorization`, `Cookie`): it
    /// cannot tell those callers apart. A service with one tenant says so with
    /// [`SingleScope`](crate::SingleScope).
    ///
    /// **Order matters.** In axum the layer added last runs first, so add this layer
    /// *before* the authentication layer: `.layer(idempotency).layer(auth)`. In a server builder whose
    /// first layer is the outermost, authentication must be a layer outside this one (a
    /// per-service interceptor runs too late). See the [crate docs](crate#security-scopes).
    ///
    /// ```
    /// use idempotency_core::{ExtensionScope, IdempotencyLayer};
    /// # use idempotency_store_memory::MemoryStore;
    /// #[derive(Clone)]
    /// struct Tenant(String); // set by the authentication layer
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone()));
    /// ```
    pub fn with_scope(self, scope: impl ScopeExtractor) -> Self {
        self.edit(|s| {
            s.scope = Arc::new(scope);
            s.scope_chosen = true;
        })
    }

    /// The store this layer uses.
    pub fn store(&self) -> &Arc<dyn IdempotencyStore> {
        &self.settings.store
    }

    /// A handle on the keyed requests this layer is running, for graceful shutdown.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// # async fn example() {
    /// let layer = IdempotencyLayer::new(MemoryStore::new());
    /// let in_flight = layer.in_flight();
    /// // ... serve with the layer, and on shutdown:
    /// in_flight.wait().await;
    /// # }
    /// ```
    pub fn in_flight(&self) -> InFlightRequests {
        InFlightRequests {
            tracker: self.settings.in_flight.clone(),
        }
    }
}

impl<S, M> Layer<S> for IdempotencyLayer<M> {
    type Service = Idempotency<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.settings.clone())
    }
}

/// The keyed requests a layer is running. A request whose client goes away is moved to a
/// task of its own and still finishes; wait for them before exiting.
#[derive(Clone, Debug)]
pub struct InFlightRequests {
    tracker: TaskTracker,
}

impl InFlightRequests {
    /// How many keyed requests are running now.
    pub fn count(&self) -> usize {
        self.tracker.len()
    }

    /// Waits until no keyed request is running.
    pub async fn wait(&self) {
        self.tracker.close();
        self.tracker.wait().await;
        // New requests may still arrive while a server drains; keep tracking them.
        self.tracker.reopen();
    }

    /// Waits until no keyed request is running, or `deadline` passes; returns how many
    /// were still running then.
    ///
    /// What happens to those when the process then exits: each one's key stays reserved
    /// until its lease lapses (20 s by default), during which retries are told it is in
    /// flight; after that the next retry, on any replica, takes the key over and runs the
    /// request again. Its caller gets no answer. A request whose mutation had committed
    /// runs a second time unless its handler finalized inside its own transaction.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// # async fn example() {
    /// # let layer = IdempotencyLayer::new(MemoryStore::new());
    /// let abandoned = layer.in_flight().wait_at_most(std::time::Duration::from_secs(30)).await;
    /// assert_eq!(abandoned, 0);
    /// # }
    /// ```
    pub async fn wait_at_most(&self, deadline: Duration) -> usize {
        let _ = tokio::time::timeout(deadline, self.wait()).await;
        self.count()
    }
}
