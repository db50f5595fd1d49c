//! What the layer tells the caller about a request it handled.

use http::HeaderValue;

/// Put on every response the layer returns for a keyed request (in the response's
/// extensions): the key it sent, how many times it sent the request, and whether the
/// server said the answer was a replay of an earlier attempt's.
///
/// ```
/// use idempotency_client::KeyedOutcome;
///
/// fn log(response: &http::Response<()>) {
///     if let Some(outcome) = response.extensions().get::<KeyedOutcome>() {
///         println!("key {:?}, {} attempts, replayed: {}", outcome.key, outcome.attempts, outcome.replayed);
///     }
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyedOutcome {
    /// The `Idempotency-Key` every attempt carried: the caller's, or the one the layer minted.
    pub key: HeaderValue,
    /// How many times the request was sent, this answer's attempt included (at least 1).
    pub attempts: u32,
    /// The server marked the answer `idempotent-replayed: true`: an earlier attempt ran the
    /// request, and this is its stored answer.
    pub replayed: bool,
}
