//! Idempotency-Key middleware for Tower and axum services.
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]

pub mod store;

pub use store::{
    Binding, BoxError, FencingToken, IdempotencyRecord, IdempotencyStore, Ownership, RecordId,
    RecordState, Reservation, StoreError, StoredResponse,
};

#[cfg(feature = "conformance")]
pub mod conformance;
