//! Idempotency-Key middleware for Tower and axum services.
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]

mod body;
pub mod error;
mod future;
pub mod key;
mod layer;
pub mod policy;
mod service;
pub mod store;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use body::ResponseBody;
pub use error::{ErrorRenderer, ProblemJson, Rejection, RejectionKind};
pub use future::ResponseFuture;
pub use key::{KeyError, KeyFormat, OpaqueKey, UuidKey};
pub use layer::{
    DEFAULT_IN_FLIGHT_WAIT, DEFAULT_LEASE, DEFAULT_LIFETIME, DEFAULT_MAX_REQUEST_BODY,
    DEFAULT_MAX_RESPONSE_BODY, IdempotencyLayer, InFlightRequests,
};
pub use policy::{AllMutations, RouteFilter, ScopeExtractor, SingleScope};
pub use service::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, Idempotency, Outcome, ReservationHandle};
pub use store::{
    Binding, BoxError, FencingToken, IdempotencyRecord, IdempotencyStore, Ownership, RecordId,
    RecordState, Reservation, StoreError, StoredResponse,
};
