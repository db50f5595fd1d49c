//! Stage 1, **parse**: does the request take part, and with which key; and whose key is
//! it (the scope). Runs before anything is awaited or allocated for the request: a
//! request without a key costs a method check and a header look-up, and a bad key or an
//! unseen caller is answered at once.

use http::Request;

use crate::decisions::RequestHead;
use crate::headers::IDEMPOTENCY_KEY;
use crate::outcome::Outcome;
use crate::payload_key::FoundKey;
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
    /// It takes part: where its key is, and its span.
    Keyed(Request<B>, KeyedBy, tracing::Span),
}

/// Where a keyed request's key is.
pub(crate) enum KeyedBy {
    /// In its header: the record's id (scope and key).
    Header(RecordId),
    /// In its body (a [`PayloadKey`](crate::PayloadKey) route), found once the body is
    /// read ([`key_in_body`]); the scope is known already.
    Payload { scope: String },
}

/// Where a request's key is, as far as its head tells.
enum KeyIn {
    Header(String),
    Body,
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
        Ok((request, keyed, span)) => Parsed::Keyed(request, keyed, span),
        Err(rejection) => {
            crate::metrics::count(settings, Outcome::Rejected(rejection.kind));
            Parsed::Refused(rejection)
        }
    }
}

/// The key: `Ok(None)` for a request that does not take part or carries no key
/// (it passes through), `Err` for a bad key header. On a route whose key is in the body,
/// the header is not read: the body's key wins (see [`PayloadKey`](crate::PayloadKey)).
fn read_key<B>(settings: &Settings, request: &Request<B>) -> Result<Option<KeyIn>, Rejection> {
    let method = request.method();
    if !is_mutation(method) {
        return Ok(None);
    }
    if let Some(payload_key) = &settings.payload_key {
        let head = RequestHead::of(request);
        if settings.routes.takes_part(&head) && payload_key.applies(&head) {
            return Ok(Some(KeyIn::Body));
        }
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
            .map(|key| Some(KeyIn::Header(key)))
            .map_err(|error| Rejection::invalid_key(&error)),
        None => Err(Rejection::missing_key(method, request.uri().path())),
    }
}

/// The key of a request whose route reads it from the body, once the body is read
/// whole (checked by the key format), and what the request is bound to. `Ok(None)`: the
/// body carries no key (refused if the layer requires one).
pub(crate) fn key_in_body(
    settings: &Settings,
    request: &Request<bytes::Bytes>,
) -> Result<Option<FoundKey>, Rejection> {
    let Some(payload_key) = &settings.payload_key else {
        return Ok(None);
    };
    match payload_key.find(request.body()) {
        Ok(Some(found)) => {
            let key = settings
                .key_format
                .parse(found.key.as_bytes())
                .map_err(|error| Rejection::invalid_key(&error))?;
            Ok(Some(FoundKey { key, ..found }))
        }
        Ok(None) if settings.require_key => Err(Rejection::missing_payload_key(
            request.method(),
            request.uri().path(),
        )),
        Ok(None) => Ok(None),
        Err(message) => Err(Rejection::payload_key(message)),
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
    key: KeyIn,
) -> Result<(Request<Body>, KeyedBy, tracing::Span), Rejection> {
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
    let keyed = match key {
        KeyIn::Header(key) => KeyedBy::Header(RecordId::new(scope, key)),
        KeyIn::Body => KeyedBy::Payload { scope },
    };
    // Without a `tracing` subscriber that wants INFO, no span at all: a disabled span
    // still feeds the `log` crate fallback (on in every axum application) at each poll.
    // A key in the body is recorded in the span once it is read.
    let span = if !tracing::level_enabled!(tracing::Level::INFO) {
        tracing::Span::none()
    } else if let KeyedBy::Header(id) = &keyed {
        tracing::info_span!(
            "idempotency",
            key = %settings.log_key(id),
            outcome = tracing::field::Empty,
        )
    } else {
        tracing::info_span!(
            "idempotency",
            key = tracing::field::Empty,
            outcome = tracing::field::Empty,
        )
    };
    Ok((Request::from_parts(parts, body), keyed, span))
}
