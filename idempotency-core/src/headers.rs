//! The header names the layer reads and writes.

use http::HeaderName;

/// The request header that carries the key (and, being lower-case, an HTTP/2 metadata key).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// The response header set on every replay.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
