//! What the example servers share: the operational flags that `iceberg-catalog` and
//! `grpc-orders` both take, written once.
//!
//! - [`telemetry`]: `--metrics-listen ADDR`, the idempotency layer's metrics as
//!   Prometheus text on `http://ADDR/metrics`.
//! - [`records`]: `--idempotency-store redis://…`, the idempotency records in Redis or
//!   Valkey while the service's own state stays in its SQL database.
//!
//! Nothing here is an API to depend on: the crate is not published, and these modules
//! change with the examples.

pub mod records;
pub mod telemetry;
