//! Idempotency-Key middleware for Tower and axum services.
//!
//! A client that sends a mutation and loses the answer (a timeout, a dropped connection,
//! a load balancer that gave up) cannot tell whether the mutation happened. If it sends
//! the request again, a table may be created twice, a commit applied twice. The
//! `Idempotency-Key` header fixes this: the client sends the same unique key with every
//! retry of one operation, and the server runs the operation at most once per key and
//! answers every retry with the first answer. The Apache Iceberg REST catalog spec
//! defines exactly this header for its mutation endpoints.
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
//! 1. **Take part?** Only POST, PUT, PATCH and DELETE requests on the profile's routes
//!    (narrowed by a [`RouteFilter`]) that carry an `Idempotency-Key` header. Everything
//!    else goes to the inner service untouched and unbuffered. A malformed, oversized or
//!    repeated header gets 400 before anything is read ([`KeyFormat`]: [`OpaqueKey`] by
//!    default, [`UuidKey`] for Iceberg).
//! 2. **Bind.** The body is buffered (413 over the limit) and the record is bound to the
//!    method, path and query, and the SHA-256 of the body. The record is found by
//!    (scope, key); the [`ScopeExtractor`] says whose key it is.
//! 3. **Reserve** atomically in the [`IdempotencyStore`]. One request wins; it owns the
//!    key under a lease and a fencing token.
//! 4. **Execute** the inner service, renewing the lease while it runs. A client that
//!    disconnects does not cancel it: the rest of the work moves to a task of its own.
//!    The response body is read whole (it has to be stored); a response over the limit
//!    is still delivered whole, but not stored.
//! 5. **Classify.** 2xx and deterministic 4xx are **finalized**: status, allow-listed
//!    headers and the whole body are stored. 5xx and 401, 403, 408, 419, 429 are
//!    **released**: the key is freed so a retry runs again. A panic releases too. A
//!    response body that fails half way gets the caller a 502; the key is released if the
//!    status releases it, and otherwise kept as "already ran", like a response too large
//!    to store.
//! 6. **Replay.** A retry with the same binding gets the stored answer byte for byte,
//!    with `idempotent-replayed: true`; the inner service is not called. A retry with
//!    another binding gets 422. A retry that arrives while the first is running waits
//!    for it, then replays; if the wait runs out it gets 409 with `Retry-After`.
//! 7. **Crashes.** If an owner stops renewing (its process died), the next retry takes
//!    the record over with a new token; the old owner can no longer write to it.
//!
//! One window is left open by the layer alone: a mutation that committed and then lost
//! its finalize (the process died between the two) runs again once its lease lapses.
//! A handler whose state lives in the store's database closes it by finalizing inside
//! its own transaction (next section).
//!
//! # Exactly once: finalize in your own transaction
//!
//! Every keyed request carries a [`ReservationHandle`] extension. A handler that writes
//! its mutation to the store's database hands its answer and its open transaction to
//! the store (the SQL stores' `finalize_in`), which writes the answer into the record in
//! that transaction, fenced by the handle's token. The mutation and its record then
//! commit together or not at all, so a crash at any instant leaves either nothing (the
//! retry runs once) or both (the retry is replayed). The layer sees that the answer was
//! finalized and does not finalize again, and the caller gets exactly the answer that
//! was stored (less what the profile keeps out of the store). A store of your own
//! builds the same on [`ReservationHandle::prepare_answer`].
//!
//! Every response the layer took part in carries an [`Outcome`] extension, and every
//! outcome is a `tracing` event with an `outcome` field. Logs never show a key: they
//! show a short hash of it.
//!
//! # Profiles
//!
//! What depends on the protocol (which routes, what a key looks like, which answers are
//! stored, what a replay adds back, how errors look, what is advertised) comes from a
//! [`Profile`]: [`HttpProfile`] by default, [`iceberg::IcebergProfile`] through
//! [`IdempotencyLayer::iceberg`], [`grpc::GrpcProfile`] through
//! [`IdempotencyLayer::grpc`] (tonic), or your own through
//! [`IdempotencyLayer::with_profile`]. The request path above is the same for all.
//!
//! # Bodies
//!
//! By default the service keeps the inner service's body types (axum's `Body`), so it
//! costs nothing on requests it passes through and a wrapped axum `Router` is served as
//! it is; those types must implement `From<Bytes>`. For services with other body types
//! (tonic, hyper's `Incoming`) or answers with trailers, [`IdempotencyLayer::wrap_bodies`]
//! (which the gRPC layer uses) wraps them in [`IdempotencyBody`] instead. See
//! [`Idempotency`].
//!
//! # Security: scopes
//!
//! Without a scope extractor every caller shares one key space, and anyone who learns a
//! key can collect its response. **A multi-tenant service must set a scope**, and the
//! layer belongs *after* authentication and authorization, so that a replay never
//! reaches someone who could not have made the original request:
//!
//! ```
//! # use idempotency_core::IdempotencyLayer;
//! # use idempotency_store_memory::MemoryStore;
//! #[derive(Clone)]
//! struct Tenant(String);
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(|request: &http::request::Parts| {
//!     request.extensions.get::<Tenant>().map(|t| t.0.clone()).unwrap_or_default()
//! });
//! # drop(layer);
//! ```
//!
//! # Stores
//!
//! `idempotency-store-memory` keeps records in process (development, tests, one node).
//! `idempotency-store-sql` keeps them in PostgreSQL, MySQL/MariaDB or SQLite, shared by
//! replicas and durable across crashes. Any type implementing [`IdempotencyStore`] works
//! (its docs list the rules a store keeps); the `conformance` suite (feature
//! `conformance`) checks it, and this crate re-exports what a store needs
//! ([`async_trait`](macro@async_trait), [`Bytes`]).
//!
//! # Defaults
//!
//! | setting | default | why |
//! |---|---|---|
//! | lifetime | 30 min | the Iceberg default for `idempotency-key-lifetime` |
//! | lease | 20 s | renewed every ~7 s; a crashed owner's key is free again within 20 s |
//! | in-flight wait | 10 s | most mutations finish well within it, so duplicates get the real answer |
//! | request / response body | 8 MiB | fits real Iceberg metadata and MySQL's default packet size |
//! | store failure | fail closed (503) | running unprotected can execute a mutation twice |
//!
//! # Feature flags
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `conformance` | off | the [`conformance`] suite: the checks any [`IdempotencyStore`] implementation can run against itself (pulls in `uuid`) |
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// The docs point store authors at the `conformance` suite, which only exists with its
// feature; a build of the docs without it (`cargo doc`) leaves those links unresolved.
// The build with all features (docs.rs, `.ci/run`) checks every link.
#![cfg_attr(not(feature = "conformance"), allow(rustdoc::broken_intra_doc_links))]

mod advertise;
mod binding;
mod body;
mod budget;
pub mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
mod encoding;
mod future;
pub mod grpc;
pub mod iceberg;
mod in_transaction;
pub mod iso8601;
mod key;
mod keyed;
mod layer;
pub mod metrics;
mod outcome;
mod owner;
mod policy;
mod profile;
mod rejection;
mod service;
mod store;

pub use binding::MAX_KEPT_PATH;
pub use body::IdempotencyBody;
pub use future::ResponseFuture;
pub use in_transaction::{PreparedAnswer, ReservationHandle};
pub use key::{KeyError, KeyFormat, MAX_OPAQUE_KEY_LEN, OpaqueKey, UuidKey};
pub use layer::{
    DEFAULT_IN_FLIGHT_WAIT, DEFAULT_LEASE, DEFAULT_LIFETIME, DEFAULT_MAX_REQUEST_BODY,
    DEFAULT_MAX_RESPONSE_BODY, DEFAULT_MEMORY_BUDGET, DEFAULT_REQUEST_BODY_TIMEOUT,
    IdempotencyLayer, InFlightRequests,
};
pub use outcome::Outcome;
pub use policy::{AllMutations, CredentialScope, RouteFilter, ScopeExtractor, SingleScope};
pub use profile::{Disposition, HttpProfile, Profile, RequestHead};
pub use rejection::{ErrorRenderer, ProblemJson, Rejection, RejectionKind};
pub use service::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, Idempotency, InnerBodies, WrappedBodies};
pub use store::{
    Binding, BoxError, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, InspectedState, MAX_POLLS_PER_SECOND, Ownership, PURGE_BATCH_TIME,
    PURGE_REST_FACTOR, Purged, RecordId, RecordState, Reservation, ScopeQuota, StoreError,
    StoredResponse, is_settled, purge_all_expired, spawn_purge_task, wait_by_polling,
};

// What a store implementation needs, so that it can depend on this crate alone.
pub use async_trait::async_trait;
pub use bytes::Bytes;

/// The README's usage snippets, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
