//! Which requests take part, and whose key a request's key is.

use http::Method;
use http::request::Parts;

/// Picks the requests that take part, among mutations (POST, PUT, PATCH, DELETE).
///
/// GET, HEAD and OPTIONS never take part, whatever the filter says. Any
/// `Fn(&Method, &str) -> bool` (method, path) is a filter.
pub trait RouteFilter: Send + Sync + 'static {
    /// Whether a mutation of `path` with `method` takes part.
    fn takes_part(&self, method: &Method, path: &str) -> bool;
}

impl<F> RouteFilter for F
where
    F: Fn(&Method, &str) -> bool + Send + Sync + 'static,
{
    fn takes_part(&self, method: &Method, path: &str) -> bool {
        self(method, path)
    }
}

/// The default filter: every mutation takes part.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllMutations;

impl RouteFilter for AllMutations {
    fn takes_part(&self, _method: &Method, _path: &str) -> bool {
        true
    }
}

pub(crate) fn is_mutation(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

/// Tells callers apart: records are found by (scope, key), so one caller can never
/// collect another's response by sending its key.
///
/// **A multi-tenant service must set one.** Without it, every caller shares one scope.
/// Place the layer after authentication and read the principal or tenant from a request
/// extension that the auth layer set. Any `Fn(&http::request::Parts) -> String` is an
/// extractor.
///
/// ```
/// use idempotency_core::IdempotencyLayer;
/// # use idempotency_store_memory::MemoryStore;
///
/// #[derive(Clone)]
/// struct Principal(String);
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(
///     |request: &http::request::Parts| {
///         request
///             .extensions
///             .get::<Principal>()
///             .map(|principal| principal.0.clone())
///             .unwrap_or_default()
///     },
/// );
/// # drop(layer);
/// ```
pub trait ScopeExtractor: Send + Sync + 'static {
    /// The scope of this request; requests in different scopes never share records.
    fn scope(&self, request: &Parts) -> String;
}

impl<F> ScopeExtractor for F
where
    F: Fn(&Parts) -> String + Send + Sync + 'static,
{
    fn scope(&self, request: &Parts) -> String {
        self(request)
    }
}

/// The default extractor: one scope (the empty string) for everybody.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleScope;

impl ScopeExtractor for SingleScope {
    fn scope(&self, _request: &Parts) -> String {
        String::new()
    }
}
