//! Idempotency-Key middleware for Tower and axum services.
//!
//! A client that sends a mutation and loses the answer (a timeout, a dropped connection,
//! a load balancer that gave up) cannot tell whether the mutation happened. If it sends
//! the request again, a table may be created twice, a commit applied twice. The
//! `Idempotency-Key` header fixes this: the client sends the same unique key with every
//! retry of one operation, and the server runs the operation at most once per key and
//! answers every retry with the first answer. Protocols (catalog APIs among them) define
//! exactly this header for their mutation endpoints.
//!
//! This crate is the server side, as a `tower::Layer`:
//!
//! ```
//! use axum::{Router, routing::post};
//! use idempotency_core::IdempotencyLayer;
//! use idempotency_store_memory::MemoryStore;
//!
//! let app: Router = Router::new()
//!     .route("/v1/namespaces", post(|| async { "created" }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()));
//! ```
//!
//! # The life of a keyed request
//!
//! Seven stages, each a file of its own in the crate's `keyed` module, with these
//! numbers and names:
//!
//! 1. **Parse.** Only POST, PUT, PATCH and DELETE requests on the layer's routes
//!    ([`RouteFilter`]) that carry an `Idempotency-Key` header take part.
//!    Everything else goes to the inner service untouched and unbuffered. A malformed,
//!    empty, oversized or repeated header gets 400 before anything is read
//!    ([`KeyFormat`]: [`OpaqueKey`] by default, [`UuidKey`] for UUID keys). The
//!    [`ScopeExtractor`] says whose key it is; a request whose caller it cannot see is
//!    refused.
//! 2. **Bind.** The body is read whole (413 over the limit, 408 if it does not arrive in
//!    time) and the record is bound to the method, path and query, and the SHA-256 of the
//!    body. The record is found by (scope, key).
//! 3. **Reserve** in the [`IdempotencyStore`]. One request wins and owns the key. A
//!    duplicate that finds the key in flight waits for its owner (then replays, or gets
//!    409 with `Retry-After` if the wait runs out); one that finds the owner's lease
//!    lapsed (its process died) takes the record over with a new fencing token, and the
//!    old owner can no longer write to it; one whose binding differs gets 422, also when
//!    the key changed hands while it waited. If the store fails here, the layer answers
//!    503 (fail closed).
//! 4. **Execute** the inner service, renewing the lease while it runs. A client that
//!    disconnects does not cancel it: the rest of the work moves to a task of its own.
//!    The response body is read up to the limit; a response over it is still delivered
//!    whole, but not stored.
//! 5. **Classify** what the inner service did: an answer the handler already finalized in
//!    its own transaction (next section) is sent as finalized; 2xx and deterministic 4xx
//!    are kept; 5xx, 401, 403, 408, 419, 429, an error and a panic release the key; an
//!    answer too large to store or encoded is remembered as "already ran"; a response
//!    body that fails half way is released or remembered by its status.
//! 6. **Settle.** The verdict is written to the store — status, allow-listed headers and
//!    the whole body stored (finalize), or the key freed so a retry runs again (release)
//!    — and the caller gets the answer; a body that failed half way gets a 502.
//! 7. **Replay.** A retry with the same binding gets the stored answer byte for byte,
//!    with `idempotent-replayed: true`; the inner service is not called.
//!
//! One window is left open by the layer alone: a mutation that committed and then lost
//! its finalize (the process died between the two) runs again once its lease lapses.
//! A handler whose state lives in the store's database closes it by recording its answer
//! inside its own transaction (next section).
//!
//! # Exactly once: the answer recorded in the handler's transaction
//!
//! Every keyed request carries a [`ReservationHandle`] extension. A handler that writes
//! its mutation to the store's database hands its answer to its transaction (the SQL
//! store's `Tx::commit`), which writes the answer into the record in that transaction,
//! fenced by the handle's token. The mutation and its record then
//! commit together or not at all, so a crash at any instant leaves either nothing (the
//! retry runs once) or both (the retry is replayed). The layer sees that the answer was
//! finalized and does not finalize again, and the caller gets exactly the answer that
//! was stored (less what the profile keeps out of the store). A store of your own
//! builds the same on [`ReservationHandle::prepare_answer`].
//!
//! Work that does not arrive as an HTTP request (a job, a message's effect) runs at most
//! once per key through [`AtMostOnce`]: one keyed request on this same path, the work as
//! its inner service.
//!
//! Every response the layer took part in carries an [`Outcome`] extension, and every
//! outcome is a `tracing` event with an `outcome` field. Logs never show a key: they
//! show a short hash of it.
//!
//! # Profiles
//!
//! What depends on the protocol is a decision of its own, one small trait each, with one
//! builder method: which requests take part ([`RouteFilter`]), what a key looks like
//! ([`KeyFormat`]), which answers are stored ([`ClassifyAnswer`]), what of an answer is
//! stored ([`KeepAnswer`]), what a replay adds back ([`ReplayAnswer`]), how errors look
//! ([`ErrorRenderer`]), what is advertised ([`Advertise`]). A [`Profile`] installs a
//! protocol's set at once: [`HttpProfile`] by default, a profile crate's, or your own
//! through [`IdempotencyLayer::with_profile`]. The request path above is the same for all.
//!
//! # Bodies
//!
//! By default the service keeps the inner service's body types (axum's `Body`), so it
//! costs nothing on requests it passes through and a wrapped axum `Router` is served as
//! it is; those types must implement `From<Bytes>`. For services with other body types
//! (hyper's `Incoming`, an RPC framework's) or answers with trailers,
//! [`IdempotencyLayer::wrap_bodies`] wraps them in [`IdempotencyBody`] instead. See
//! [`Idempotency`].
//!
//! # Security: scopes
//!
//! Records are found by (scope, key): the scope says whose key it is. **A multi-tenant
//! service must set a scope** ([`IdempotencyLayer::with_scope`]), read from what its
//! authentication established, and the layer must run *after* that authentication, so
//! that a replay never reaches someone who could not have made the original request.
//! When the scope extractor finds no caller, the layer refuses the keyed request (500,
//! [`RejectionKind::NoScope`], one `error` log line) rather than share one scope among
//! callers. A layer given no scope refuses keyed requests that carry credentials; a
//! service with one tenant says so with [`SingleScope`].
//!
//! Where the layer goes, per framework:
//!
//! - **axum**: the layer added *last* runs *first*. Add the idempotency layer **before**
//!   the authentication layer, so that authentication wraps it:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use axum::{Extension, Router, extract::Request, middleware::{self, Next}, response::Response, routing::post};
//! use idempotency_core::{ExtensionScope, IdempotencyLayer};
//! use idempotency_store_memory::MemoryStore;
//!
//! #[derive(Clone)]
//! struct Tenant(String);
//!
//! async fn auth(mut request: Request, next: Next) -> Result<Response, axum::http::StatusCode> {
//!     let tenant = request
//!         .headers()
//!         .get("authorization")
//!         .and_then(|value| value.to_str().ok()?.strip_prefix("Bearer ").map(str::to_owned))
//!         .ok_or(axum::http::StatusCode::UNAUTHORIZED)?;
//!     request.extensions_mut().insert(Tenant(tenant));
//!     Ok(next.run(request).await)
//! }
//!
//! let app: Router = Router::new()
//!     .route("/payments", post(|Extension(t): Extension<Tenant>| async move { format!("paid by {}", t.0) }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new())
//!         .with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone())))
//!     .layer(middleware::from_fn(auth)); // added last: runs first
//! # use http_body_util::BodyExt;
//! # use tower::ServiceExt;
//! # let pay = |tenant: Option<&str>| {
//! #     let mut request = axum::http::Request::post("/payments").header("idempotency-key", "k1");
//! #     if let Some(tenant) = tenant { request = request.header("authorization", format!("Bearer {tenant}")); }
//! #     let app = app.clone();
//! #     async move {
//! #         let response = app.oneshot(request.body(axum::body::Body::empty()).unwrap()).await.unwrap();
//! #         let replayed = response.headers().contains_key("idempotent-replayed");
//! #         let status = response.status().as_u16();
//! #         let body = response.into_body().collect().await.unwrap().to_bytes();
//! #         (status, replayed, String::from_utf8_lossy(&body).into_owned())
//! #     }
//! # };
//! # assert_eq!(pay(Some("a")).await, (200, false, "paid by a".into()));
//! # assert_eq!(pay(Some("a")).await, (200, true, "paid by a".into()));
//! # assert_eq!(pay(Some("b")).await, (200, false, "paid by b".into()), "tenant b runs its own");
//! # assert_eq!(pay(None).await.0, 401);
//! # }
//! ```
//!
//! - **a server builder**: authentication must be a tower layer on the builder *outside*
//!   the idempotency layer: `builder.layer(auth).layer(idempotency)` (there the first
//!   `.layer` is the outermost, the opposite of axum's `Router::layer`). A per-service
//!   interceptor runs inside the server's layers, after the idempotency layer has
//!   looked for the caller: too late.
//! - **plain hyper / tower**: `ServiceBuilder::new().layer(auth).layer(idempotency)`:
//!   in a `ServiceBuilder` the first layer is the outermost.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use idempotency_core::{ExtensionScope, IdempotencyLayer, http};
//! use idempotency_store_memory::MemoryStore;
//! use tower::{ServiceBuilder, service_fn, util::MapRequestLayer};
//!
//! #[derive(Clone)]
//! struct Tenant(String);
//!
//! // Your authentication, as a layer: here a bearer token that names the tenant.
//! let auth = MapRequestLayer::new(|mut request: http::Request<Full<Bytes>>| {
//!     let tenant = request.headers().get("authorization")
//!         .and_then(|value| value.to_str().ok()?.strip_prefix("Bearer ").map(str::to_owned));
//!     if let Some(tenant) = tenant {
//!         request.extensions_mut().insert(Tenant(tenant));
//!     }
//!     request
//! });
//! let service = ServiceBuilder::new()
//!     .layer(auth) // first: the outermost, runs before the idempotency layer
//!     .layer(IdempotencyLayer::new(MemoryStore::new())
//!         .with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone())))
//!     .service(service_fn(|request: http::Request<Full<Bytes>>| async move {
//!         let tenant = request.extensions().get::<Tenant>().map_or("nobody", |t| t.0.as_str()).to_owned();
//!         Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from(format!("paid by {tenant}")))))
//!     }));
//! # use http_body_util::BodyExt;
//! # use tower::ServiceExt;
//! # let pay = |tenant: Option<&str>| {
//! #     let mut request = http::Request::post("/payments").header("idempotency-key", "k1");
//! #     if let Some(tenant) = tenant { request = request.header("authorization", format!("Bearer {tenant}")); }
//! #     let service = service.clone();
//! #     async move {
//! #         let response = service.oneshot(request.body(Full::new(Bytes::new())).unwrap()).await.unwrap();
//! #         let replayed = response.headers().contains_key("idempotent-replayed");
//! #         let status = response.status().as_u16();
//! #         let body = response.into_body().collect().await.unwrap().to_bytes();
//! #         (status, replayed, String::from_utf8_lossy(&body).into_owned())
//! #     }
//! # };
//! # assert_eq!(pay(Some("a")).await, (200, false, "paid by a".into()));
//! # assert_eq!(pay(Some("a")).await, (200, true, "paid by a".into()));
//! # assert_eq!(pay(Some("b")).await, (200, false, "paid by b".into()), "tenant b runs its own");
//! # // No credential reaches the layer without a tenant: refused, never someone's replay.
//! # assert_eq!(pay(None).await.0, 500);
//! # }
//! ```
//!
//! The crate re-exports [`http`], so an extractor written as a closure
//! (`|request: &idempotency_core::http::request::Parts| …`) needs no other dependency.
//!
//! # Stores
//!
//! `idempotency-store-memory` keeps records in process (development, tests, one node).
//! `idempotency-store-sql` keeps them in PostgreSQL, MySQL/MariaDB or SQLite, shared by
//! replicas and durable across crashes. `idempotency-store-redis` keeps them in Redis or
//! Valkey. A store of your own implements three traits, one for each caller:
//!
//! - [`IdempotencyStore`], the request path: what the layer calls (reserve, load, wait,
//!   renew, finalize, release, take over). Its docs list the rules a store keeps. It is
//!   all the layer holds (`Arc<dyn IdempotencyStore>`).
//! - [`RecordAdmin`], for operators: [inspect](RecordAdmin::inspect) a record and
//!   [evict](RecordAdmin::evict) one, from an admin endpoint or a tool.
//! - [`PurgeExpired`], for maintenance: delete expired records, which
//!   [`spawn_purge_task`] and [`purge_all_expired`] call in paced batches.
//!
//! A type with all three is a [`FullStore`]: what code that needs more than the request
//! path holds (`Arc<dyn FullStore>`, which goes wherever one of the three is asked for).
//! The `conformance` suite (feature `conformance`) checks a store against all three, and
//! this crate re-exports what a store needs ([`async_trait`](macro@async_trait),
//! [`Bytes`]).
//!
//! # Defaults
//!
//! | setting | default | why |
//! |---|---|---|
//! | lifetime | 30 min | the catalog default for `idempotency-key-lifetime` |
//! | lease | 20 s | renewed every ~7 s; a crashed owner's key is free again within 20 s |
//! | in-flight wait | 10 s | most mutations finish well within it, so duplicates get the real answer |
//! | request / response body | 8 MiB | fits real table metadata and MySQL's default packet size |
//! | store failure | fail closed (503) | running unprotected can execute a mutation twice |
//!
//! # Feature flags
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `conformance` | off | the [`conformance`] suite: the checks any [`IdempotencyStore`] implementation can run against itself (pulls in `uuid`) |
//!
//! Protocol profiles are crates of their own, built on this crate's public API alone
//! ([`Profile`] and the builder), as a profile of your own would be: `idempotency-iceberg`
//! (the Iceberg REST catalog) and `idempotency-grpc` (gRPC, tonic).
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// The docs point store authors at the `conformance` suite, which only exists with its
// feature; a build of the docs without it (`cargo doc`) leaves those links unresolved.
// The build with all features (docs.rs, `.ci/run`) checks every link.
#![cfg_attr(not(feature = "conformance"), allow(rustdoc::broken_intra_doc_links))]

// The modules, in groups from the bottom up: a module uses only modules of its own group
// or of the groups above it, and nothing imports upward (`modcycles.py` finds no cycle).
//
// Vocabulary: what a key, a record, an answer and a refusal are, and the store contract.
mod budget;
mod decisions;
mod encoding;
mod headers;
pub mod iso8601;
mod key;
mod outcome;
mod payload_key;
mod policy;
mod rejection;
mod store;
// What a layer was configured with, what it measures, and the purge (maintenance, above
// the contract, measured).
pub mod metrics;
mod purge;
mod settings;
// Bodies: the caller's, the inner service's, and the layer's own; refusals as a
// configured layer answers them.
mod body;
mod body_types;
mod future;
mod read;
mod refusals;
// The request path: a keyed request's stages (`keyed`, in order), the handle its handler
// gets (`in_transaction`: it applies stage 5's rules and is handed out at stage 4), and
// the profile's advertisement.
mod advertise;
mod in_transaction;
mod keyed;
mod reservation;
// The service and the layer, at the top, and the profiles that configure a layer.
mod layer;
mod once;
mod profile;
mod service;
// Built on the public API only: the profiles and their layers, properties, and the
// conformance suite.
pub mod config;
#[cfg(feature = "conformance")]
pub mod conformance;

pub use body::IdempotencyBody;
pub use decisions::{
    Advertise, AllMutations, ClassifyAnswer, Disposition, KeepAnswer, KeepWhole, ReplayAnswer,
    ReplayAsStored, RequestHead, Restoring, RouteFilter, StoreAnswers,
};
pub use future::ResponseFuture;
pub use headers::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
pub use in_transaction::PreparedAnswer;
pub use key::{KeyError, KeyFormat, MAX_OPAQUE_KEY_LEN, OpaqueKey, UuidKey};
pub use keyed::bind::MAX_KEPT_PATH;
pub use layer::{IdempotencyLayer, InFlightRequests};
pub use once::{AtMostOnce, RunError, WorkError, WorkReservation};
pub use outcome::Outcome;
pub use payload_key::{FoundKey, JsonPointerKey, PayloadKey};
pub use policy::{CredentialScope, ExtensionScope, ScopeExtractor, SingleScope};
pub use profile::{HttpProfile, Profile};
pub use purge::{PURGE_BATCH_TIME, PURGE_REST_FACTOR, purge_all_expired, spawn_purge_task};
pub use rejection::{ErrorRenderer, ProblemJson, Rejection, RejectionKind};
pub use reservation::{OutcomeUnknown, ReservationHandle};
pub use service::{Idempotency, InnerBodies, WrappedBodies};
pub use settings::{
    DEFAULT_IN_FLIGHT_WAIT, DEFAULT_LEASE, DEFAULT_LIFETIME, DEFAULT_MAX_REQUEST_BODY,
    DEFAULT_MAX_RESPONSE_BODY, DEFAULT_MEMORY_BUDGET, DEFAULT_REQUEST_BODY_TIMEOUT,
};
pub use store::{
    Binding, BoxError, EvictInFlight, Eviction, FencingToken, FullStore, IdempotencyRecord,
    IdempotencyStore, InspectedRecord, InspectedState, MAX_POLLS_PER_SECOND, Ownership,
    PurgeExpired, Purged, RecordAdmin, RecordId, RecordState, Reservation, ScopeQuota, StoreError,
    StoredResponse, Waited, wait_by_polling,
};

// What a store implementation needs, so that it can depend on this crate alone.
pub use async_trait::async_trait;
pub use bytes::Bytes;
// The types a scope extractor, a profile or a renderer names (`http::request::Parts`,
// `http::Method`), without a dependency of the user's own on the same version.
pub use http;

/// The README's usage snippets, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

/// The snippets of the guides in `docs/`, compiled as doctests: one item per page that
/// has Rust code (a profile's guide is compiled by the profile's crate).
#[cfg(doctest)]
#[doc = include_str!("../../docs/operating.md")]
struct OperatingGuideDoctests;

#[cfg(doctest)]
#[doc = include_str!("../../docs/profiles.md")]
struct ProfilesGuideDoctests;

#[cfg(doctest)]
#[doc = include_str!("../../docs/writing-a-store.md")]
struct StoreGuideDoctests;
