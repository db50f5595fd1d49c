//! Stage 1, **parse**: does the request take part, and with which key; and whose key is
//! it (the scope). Runs before anything is awaited or allocated for the request: a
//! request without a key costs a method check and a header look-up, and a bad key or an
//! unseen caller is answered at once.

use http::Request;

use crate::decisions::RequestHead;
use crate::headers::IDEMPOTENCY_KEY;
use crate::outcome::Outcome;
use crate::policy::is_mutation;
use crate::rejection::Rejection;
use crate::settings::Settings;
use crate::store::RecordId;

/// Where parsing leaves a request.
pub(crate) enum Parsed<B> {
    /// It does not take part, or carries no key: it passes through untouched.
    PassThrough(Request<B>),
    /// Its key header is bad, or its caller cannot be seen: the layer answers at once.
    Refused(Rejection),
    /// It takes part: its record's id (scope and key), and its span.
    Keyed(Request<B>, RecordId, tracing::Span),
}

/// Parses a request: whether it takes part, its key, its scope.
pub(crate) fn parse<B>(settings: &Settings, request: Request<B>) -> Parsed<B> {
    let key = match read_key(settings, &request) {
        Ok(Some(key)) => key,
        Ok(None) => return Parsed::PassThrough(request),
        Err(rejection) => {
            tracing::info!(
                outcome = rejection.kind.as_str(),
                method = %request.method(),
                "idempotency: refused the key header: {}",
                rejection.message
            );
            crate::metrics::count(settings, Outcome::Rejected(rejection.kind));
            return Parsed::Refused(rejection);
        }
    };
    match scope_and_span(settings, request, key) {
        Ok((request, id, span)) => Parsed::Keyed(request, id, span),
        Err(rejection) => {
            crate::metrics::count(settings, Outcome::Rejected(rejection.kind));
            Parsed::Refused(rejection)
        }
    }
}

/// The key: `Ok(None)` for a request that does not take part or carries no key
/// (it passes through), `Err` for a bad key header.
fn read_key<B>(settings: &Settings, request: &Request<B>) -> Result<Option<String>, Rejection> {
    let method = request.method();
    if !is_mutation(method) {
        return Ok(None);
    }
    let mut values = request.headers().get_all(&IDEMPOTENCY_KEY).iter();
    let value = values.next().map(|v| v.as_bytes().trim_ascii());
    let repeated = values.next().is_some();
    if value.is_none() && !settings.require_key {
        return Ok(None);
    }
    if !settings.routes.takes_part(&RequestHead::of(request)) {
        return Ok(None);
    }
    if repeated {
        return Err(Rejection::duplicate_key_header());
    }
    match value {
        // A header that is there but empty is a client's mistake, not the absence of a
        // key: running the mutation unprotected would hide it.
        Some([]) => Err(Rejection::empty_key()),
        Some(value) => settings
            .key_format
            .parse(value)
            .map(Some)
            .map_err(|error| Rejection::invalid_key(&error)),
        None => Err(Rejection::missing_key(method, request.uri().path())),
    }
}

/// The start of a keyed request, before anything is awaited: whose key it is (the
/// scope), and the request's span. A request whose caller the layer cannot see is
/// refused here, before its body is read.
///
/// The span (`idempotency`) carries the key as logs show it (a short hash of scope and
/// key, never the key: a key is what collects a response) and, once decided, the
/// `outcome` ([`Outcome`](crate::Outcome)'s `Display`, e.g. `replayed`, `rejected:key-reused`). The
/// [`ResponseFuture`](crate::ResponseFuture) enters it on every poll of [`respond`](super::respond)'s
/// future, which saves wrapping (and moving) that large future once more.
fn scope_and_span<Body>(
    settings: &Settings,
    request: Request<Body>,
    key: String,
) -> Result<(Request<Body>, RecordId, tracing::Span), Rejection> {
    let (parts, body) = request.into_parts();
    let Some(scope) = settings.scope.scope(&parts) else {
        let rejection = Rejection::no_scope(settings.scope_chosen);
        settings.no_scope_logged.call_once(|| {
            tracing::error!(
                "idempotency: misconfigured, keyed requests are refused: {}",
                rejection.message
            );
        });
        return Err(rejection);
    };
    let id = RecordId::new(scope, key);
    // Without a `tracing` subscriber that wants INFO, no span at all: a disabled span
    // still feeds the `log` crate fallback (on in every axum application) at each poll.
    let span = if tracing::level_enabled!(tracing::Level::INFO) {
        tracing::info_span!(
            "idempotency",
            key = %settings.log_key(&id),
            outcome = tracing::field::Empty,
        )
    } else {
        tracing::Span::none()
    };
    Ok((Request::from_parts(parts, body), id, span))
}
