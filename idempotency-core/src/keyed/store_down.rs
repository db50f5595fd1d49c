//! The store failed before the request ran (stage 3): the layer fails closed (503 with
//! `Retry-After`, the inner service does not run) unless it was told to fail open, and
//! tells a full store or a scope over its quota apart.

use std::sync::Arc;

use bytes::Bytes;
use http::Request;

use crate::bodies::{Answer, Bodies, Inner};
use crate::keyed::execute::prepare_for_inner;
use crate::outcome::Outcome;
use crate::rejection::Rejection;
use crate::settings::Settings;
use crate::store::{RecordId, StoreError};

/// The store failed before anything ran: fail closed, or run unprotected if configured.
/// Its caller boxes its future (it may call the inner service): a rare path, which should
/// not make every keyed request's future larger.
pub(crate) async fn store_failed<S, B>(
    settings: Arc<Settings>,
    mut inner: S,
    request: Request<Bytes>,
    id: &RecordId,
    error: &StoreError,
) -> Answer<B, S::Error>
where
    S: Inner<B::Request, B::Inner>,
    B: Bodies,
{
    match error {
        StoreError::Full { retry_after, .. } => {
            tracing::warn!(outcome = "store-full", key = %settings.log_key(id), "idempotency: {error}");
            return Ok(Rejection::store_full(&settings, *retry_after).into_response::<B>(&settings));
        }
        StoreError::QuotaExceeded { retry_after, .. } => {
            tracing::info!(outcome = "quota-exceeded", key = %settings.log_key(id), "idempotency: {error}");
            return Ok(
                Rejection::quota_exceeded(&settings, *retry_after).into_response::<B>(&settings)
            );
        }
        _ => {}
    }
    if settings.fail_open {
        tracing::warn!(outcome = "ran-unprotected", key = %settings.log_key(id), %error, "idempotency: store failed; running the request without protection (fail-open)");
        let mut request = request.map(B::request);
        prepare_for_inner(&settings, request.headers_mut());
        let mut response = inner.call(request).await?.map(B::Answer::from);
        response.extensions_mut().insert(Outcome::RanUnprotected);
        return Ok(response);
    }
    tracing::error!(outcome = "store-unavailable", key = %settings.log_key(id), %error, "idempotency: store failed before the request ran");
    Ok(Rejection::store_unavailable(&settings).into_response::<B>(&settings))
}
