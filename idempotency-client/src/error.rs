//! The layer's one error type.

use http::HeaderValue;

/// The boxed error of the wrapped client (a transport error) or of a request body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a keyed request got no answer to return.
///
/// Every other answer, a final `4xx` or `5xx` included, is returned as the response it is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server answered 422: this key was already used for a different request (another
    /// method, path or body). Nothing ran. The caller reused a key it must not reuse; send
    /// the new request with a key of its own (or none, and let the layer mint one).
    #[error(
        "the server refused idempotency key {key:?} (422): it was used before for a different \
         request; send this request with a new key"
    )]
    KeyReused {
        /// The key the server refused.
        key: HeaderValue,
    },
    /// The request body is larger than the layer buffers for resending. Nothing was sent.
    #[error(
        "the request body is larger than the {limit} bytes the idempotency layer buffers for \
         a retry, and was not sent: raise the limit (with_max_body_bytes) or send it outside \
         the layer"
    )]
    BodyTooLarge {
        /// The limit in bytes (`with_max_body_bytes`).
        limit: usize,
    },
    /// Reading the request body failed. Nothing was sent.
    #[error("reading the request body failed, nothing was sent: {0}")]
    Body(#[source] BoxError),
    /// The wrapped client failed on the last attempt the layer made (a transport error).
    /// The request may or may not have reached the
    /// server: resending it with the same key is safe until the server's key lifetime ends.
    #[error("request with idempotency key {key:?} failed after {attempts} attempt(s): {source}")]
    Transport {
        /// The key every attempt carried.
        key: HeaderValue,
        /// How many attempts were sent.
        attempts: u32,
        /// The wrapped client's error from the last attempt.
        #[source]
        source: BoxError,
    },
    /// The wrapped client failed on a request the layer does not key (not a mutation), or
    /// while it was getting ready for a request.
    #[error("request failed: {0}")]
    Client(#[source] BoxError),
}
