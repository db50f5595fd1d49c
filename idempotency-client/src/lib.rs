//! The client half of Idempotency-Key: a Tower layer that gives each mutation a client
//! sends one key, and resends it, byte for byte with the same key, when that is safe.
//!
//! A key protects a mutation only if the client mints it once, before its retries, and
//! stops retrying before the server forgets it. [`IdempotentRetryLayer`] does both, for
//! any `tower::Service<http::Request<B>>`: hyper-util's client, a tonic `Channel`, or any
//! Tower HTTP client; with the `reqwest` feature it is also `reqwest-middleware`
//! middleware (its `reqwest` module).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use idempotency_client::{IdempotentRetryLayer, KeyedOutcome};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! let mut client = ServiceBuilder::new()
//!     .layer(IdempotentRetryLayer::new())
//!     .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
//! let request = http::Request::post("http://127.0.0.1:3000/orders")
//!     .body(Full::new(Bytes::from_static(b"book")))?;
//! let response = client.ready().await?.call(request).await?;
//! let outcome = response.extensions().get::<KeyedOutcome>().expect("a POST is keyed");
//! println!("{} after {} attempt(s), replayed: {}", response.status(), outcome.attempts, outcome.replayed);
//! # Ok(()) }
//! ```
//!
//! What it does with a request its policy calls a mutation (POST, PUT, PATCH and DELETE by
//! default, [`with_mutations`](IdempotentRetryLayer::with_mutations) to change it):
//!
//! - **Key**: sets `idempotency-key` to a new UUIDv7, unless the caller set one (then
//!   that one is kept, and sent on every attempt).
//! - **Body**: reads it whole once, up to a bound (8 MiB by default); a larger body is
//!   refused with [`Error::BodyTooLarge`] before anything is sent, and so is one with
//!   trailers (a rebuilt body could not send them again). Every attempt sends exactly
//!   these bytes.
//! - **Resends** after a transport error (the request may have reached the server: the
//!   key makes resending safe), a `503`, `429`, a `409` with `Retry-After` (the server's
//!   "the first attempt is still running"), and any other `5xx` unless
//!   [turned off](IdempotentRetryLayer::with_retry_on_server_errors). A server's
//!   `Retry-After` is waited when it is longer than the backoff.
//! - **Never resends** a `422` (returned as [`Error::KeyReused`]: the key was used before
//!   for another request), any other `4xx`, or an answer marked `idempotent-replayed`
//!   (the first attempt's stored answer is final).
//! - **Stops** after 5 attempts or before the horizon, whichever comes first: nine tenths
//!   of the server's [key lifetime](IdempotentRetryLayer::with_key_lifetime) (read it from
//!   an Iceberg catalog with [`iceberg::fetch_key_lifetime`]), 60 seconds when not given.
//!   Backoff doubles from 100 ms with jitter. The last answer (or error) is returned.
//! - **Says what happened**: every keyed response carries a [`KeyedOutcome`] in its
//!   extensions (the key, the attempts, whether it was a replay), and each logical request
//!   is one `tracing` span, `idempotent_request`, with a span per attempt inside it.
//!
//! Other requests pass through untouched, unbuffered and unretried.
//!
//! **gRPC** ([`IdempotentRetryLayer::grpc`]): the key goes in the `idempotency-key`
//! metadata, and only `UNAVAILABLE` is retried (after `grpc-retry-pushback-ms`), never
//! `FAILED_PRECONDITION` (the key's reuse for another call) or `INVALID_ARGUMENT`. Under
//! a tonic client (the `tonic` feature):
//!
//! ```text
//! let channel = Channel::from_static("http://127.0.0.1:50051").connect().await?;
//! let channel = IdempotentRetryLayer::grpc().layer(channel); // tower::Layer
//! let mut orders = OrdersClient::new(channel);
//! ```
//!
//! (the workspace's `examples/tests/client_retries.rs` runs these lines against its gRPC
//! example behind a proxy that loses answers).
//!
//! # Feature flags
//!
//! - `tonic`: [`ResendBody`] for `tonic::body::Body`, so the layer wraps a tonic
//!   `Channel`.
//! - `reqwest`: the layer is also `reqwest-middleware` middleware, for a `reqwest` client
//!   (the `reqwest` module).

#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod attempts;
mod body;
mod error;
pub mod iceberg;
mod layer;
mod outcome;
mod policy;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub mod reqwest;
mod service;
mod wait_hint;

pub use body::ResendBody;
pub use error::{BoxError, Error};
pub use layer::IdempotentRetryLayer;
pub use outcome::KeyedOutcome;
pub use service::{IdempotentRetry, ResponseFuture};

/// The README's snippet, compiled as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
