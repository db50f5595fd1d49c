//! The layer's own answers as a configured layer gives them: the [`Rejection`]s whose
//! status, limit or `Retry-After` come from the [`Settings`], and a rejection turned into
//! the response the caller gets. (The rejections themselves, and how they are rendered,
//! are `rejection.rs`: vocabulary that knows nothing of a layer.)

use std::time::Duration;

use http::{HeaderValue, Response, StatusCode, header};

use crate::body_types::Bodies;
use crate::outcome::Outcome;
use crate::rejection::{Rejection, RejectionKind};
use crate::settings::Settings;

impl Rejection {
    pub(crate) fn body_too_large(settings: &Settings) -> Self {
        Self::new(
            RejectionKind::BodyTooLarge,
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is larger than the {} bytes this server accepts for requests \
                 with an Idempotency-Key; send a smaller body",
                settings.max_request_body
            ),
        )
    }

    pub(crate) fn body_timeout(settings: &Settings) -> Self {
        Self::new(
            RejectionKind::BodyTimeout,
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s; send it again, whole and without \
                 pauses",
                settings.request_body_timeout.as_secs_f64()
            ),
        )
    }

    /// The layer holds as much request and response data as its memory budget allows.
    pub(crate) fn over_budget(settings: &Settings) -> Self {
        Self::new(
            RejectionKind::OverBudget,
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is holding as many requests with an Idempotency-Key as it can right \
             now; retry later with the same key",
        )
        .retry_after(settings.retry_after)
    }

    /// The key is bound to another request. The message says so without naming that
    /// request: its path, query and body belong to whoever sent it first.
    pub(crate) fn key_reused(settings: &Settings) -> Self {
        Self::new(
            RejectionKind::KeyReused,
            settings.key_reused_status,
            "this Idempotency-Key was already used for a different request (another method, \
             path or body); a key identifies one operation, so send a new key for a different \
             request",
        )
    }

    pub(crate) fn in_flight(settings: &Settings) -> Self {
        Self::new(
            RejectionKind::InFlight,
            settings.in_flight_status,
            "a request with this Idempotency-Key is still being processed; retry later with \
             the same key to get its result",
        )
        .retry_after(settings.retry_after)
    }

    /// The store is full; `retry_after` is when it expects room, if it knows.
    pub(crate) fn store_full(settings: &Settings, retry_after: Option<Duration>) -> Self {
        Self::new(
            RejectionKind::StoreFull,
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is holding too many idempotency records to accept a new key right \
             now; retry later with the same key",
        )
        .retry_after(retry_after.unwrap_or(settings.retry_after))
    }

    /// The caller's scope is at its quota; `retry_after` is when the store expects room
    /// in it, if it knows.
    pub(crate) fn quota_exceeded(settings: &Settings, retry_after: Option<Duration>) -> Self {
        Self::new(
            RejectionKind::QuotaExceeded,
            StatusCode::TOO_MANY_REQUESTS,
            "you hold as many idempotency records as your quota allows; retry later with the \
             same key, or send fewer distinct keys",
        )
        .retry_after(retry_after.unwrap_or(settings.retry_after))
    }

    pub(crate) fn store_unavailable(settings: &Settings) -> Self {
        Self::new(
            RejectionKind::StoreUnavailable,
            StatusCode::SERVICE_UNAVAILABLE,
            "the idempotency store is unavailable, so the request was not run; retry later \
             with the same Idempotency-Key",
        )
        .retry_after(settings.retry_after)
    }

    /// What a retry is told when the first answer (with `status`) ran but could not be
    /// kept, and `why`.
    pub(crate) fn not_stored(settings: &Settings, status: StatusCode, why: &str) -> Self {
        Self::new(
            RejectionKind::ResponseNotStored,
            settings.not_stored_status,
            format!(
                "the request with this Idempotency-Key already ran (status {}), but {why}; read \
                 the resource's current state instead of retrying",
                status.as_u16()
            ),
        )
    }

    /// The rejection as a response: rendered by the profile (or the layer's renderer),
    /// with `Retry-After` when it has one, and its [`Outcome`].
    pub(crate) fn into_response<B: Bodies>(self, settings: &Settings) -> Response<B::ResponseOut> {
        let mut response = settings.render(&self).map(|body| B::made(body, None));
        if let Some(retry_after) = self.retry_after {
            let seconds = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        }
        response
            .extensions_mut()
            .insert(Outcome::Rejected(self.kind));
        response
    }
}
