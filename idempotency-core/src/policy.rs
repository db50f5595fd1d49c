//! Whose key a request's key is (the scope), and which methods are mutations.

use std::fmt::Write as _;
use std::marker::PhantomData;

use http::request::Parts;
use http::{HeaderName, Method, header};
use sha2::{Digest, Sha256};

pub(crate) fn is_mutation(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

/// Tells callers apart: records are found by (scope, key), so one caller can never
/// collect another's response by sending its key.
///
/// **A multi-tenant service must set one**, and the layer must run *after* the
/// authentication that tells who the caller is: read the principal or tenant from a
/// request extension that the auth layer set (never from a header the client sets, which
/// anyone can spoof). [`ExtensionScope`] does exactly that.
///
/// An extractor answers `None` for "no caller here": the layer then **refuses** the keyed
/// request (500, and one `error` log line naming the misconfiguration) instead of putting
/// every such caller in one shared scope. That is what happens when the layer runs before
/// authentication, the commonest way to misplace it: in axum the layer added *last* runs
/// *first*, so `.layer(idempotency)` must come before `.layer(auth)`; in a server
/// builder a per-service interceptor runs inside the server's layers, too late. A service that
/// really has one tenant says so with [`SingleScope`]. When the authentication happens
/// inside the wrapped service, where the layer cannot see its result,
/// [`CredentialScope`] is the best the layer can do from outside.
///
/// Any `Fn(&http::request::Parts) -> Option<String>` is an extractor (the crate
/// re-exports [`http`](crate::http)):
///
/// ```
/// use idempotency_core::{IdempotencyLayer, http::request::Parts};
/// # use idempotency_store_memory::MemoryStore;
///
/// #[derive(Clone)]
/// struct Principal { tenant: String } // set by the authentication layer
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(|request: &Parts| {
///     // No principal: the layer runs before authentication. `None` refuses.
///     request.extensions.get::<Principal>().map(|principal| principal.tenant.clone())
/// });
/// # drop(layer);
/// ```
pub trait ScopeExtractor: Send + Sync + 'static {
    /// The scope of this request (requests in different scopes never share records), or
    /// `None` when the request carries no caller the extractor can see.
    fn scope(&self, request: &Parts) -> Option<String>;
}

impl<F> ScopeExtractor for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn scope(&self, request: &Parts) -> Option<String> {
        self(request)
    }
}

/// One scope (the empty string) for every caller: for a service that really has one
/// tenant, said explicitly (`with_scope(SingleScope)`).
///
/// ```
/// use idempotency_core::{IdempotencyLayer, SingleScope};
/// # use idempotency_store_memory::MemoryStore;
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(SingleScope);
/// # drop(layer);
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleScope;

impl ScopeExtractor for SingleScope {
    fn scope(&self, _request: &Parts) -> Option<String> {
        Some(String::new())
    }
}

/// The scope of a layer that was given none: one shared scope for requests that carry
/// no credential, and no scope at all (a refusal) for those that do, since the layer
/// cannot tell such callers apart.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NoScopeSet;

impl ScopeExtractor for NoScopeSet {
    fn scope(&self, request: &Parts) -> Option<String> {
        (!looks_authenticated(request)).then(String::new)
    }
}

/// A scope read from a request extension that your authentication layer sets (a
/// principal, a tenant): `None`, a refusal, when the extension is missing, which is what
/// a layer placed before authentication sees.
///
/// ```
/// use idempotency_core::{ExtensionScope, IdempotencyLayer};
/// # use idempotency_store_memory::MemoryStore;
///
/// #[derive(Clone)]
/// struct Tenant(String); // set by the authentication layer
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone()));
/// # drop(layer);
/// ```
pub struct ExtensionScope<T, F> {
    scope_of: F,
    _extension: PhantomData<fn(&T)>,
}

impl<T, F> ExtensionScope<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> String + Send + Sync + 'static,
{
    /// The scope is `scope_of` the request's extension of type `T`.
    pub fn new(scope_of: F) -> Self {
        Self {
            scope_of,
            _extension: PhantomData,
        }
    }
}

impl<T, F> ScopeExtractor for ExtensionScope<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> String + Send + Sync + 'static,
{
    fn scope(&self, request: &Parts) -> Option<String> {
        request.extensions.get::<T>().map(&self.scope_of)
    }
}

impl<T, F> std::fmt::Debug for ExtensionScope<T, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtensionScope")
            .field("extension", &std::any::type_name::<T>())
            .finish_non_exhaustive()
    }
}

/// A scope derived from the credential the caller presented: a hash of its
/// `Authorization` header (or of the headers given to [`from_headers`](Self::from_headers)),
/// for a wrapped service that authenticates inside itself, where the layer cannot see
/// who the caller is. A caller that sends no credential gets the empty scope.
///
/// What it gives: a key is found only with the very credential that first used it, so a
/// caller who learns another's key cannot collect that caller's answer without also
/// holding its credential. The credential itself is never stored, only its SHA-256.
///
/// Its caveats, which a scope from the authenticated principal does not have:
///
/// - **A refreshed credential is a new scope.** A client whose token is renewed between
///   two retries of one operation gets it run again. Short-lived tokens make this
///   likely; keep the layer's lifetime well under the tokens' or use the principal.
/// - **Two credentials of one principal are two scopes** (two API keys of one tenant do
///   not share keys), which is usually what a client expects.
/// - **A replay skips the wrapped service's own checks.** The layer answers a retry from
///   its store without calling the service, so a credential revoked after the first
///   answer still gets that answer replayed (until the record expires), and the
///   service's audit log does not see the retry.
///
/// ```
/// use idempotency_core::{CredentialScope, IdempotencyLayer};
/// # use idempotency_store_memory::MemoryStore;
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(CredentialScope::default());
/// # drop(layer);
/// ```
#[derive(Clone, Debug)]
pub struct CredentialScope {
    headers: Vec<HeaderName>,
}

impl Default for CredentialScope {
    fn default() -> Self {
        Self::from_headers([header::AUTHORIZATION])
    }
}

impl CredentialScope {
    /// A scope from these request headers (e.g. `Authorization` and a session cookie).
    pub fn from_headers(headers: impl IntoIterator<Item = HeaderName>) -> Self {
        Self {
            headers: headers.into_iter().collect(),
        }
    }
}

impl ScopeExtractor for CredentialScope {
    fn scope(&self, request: &Parts) -> Option<String> {
        let mut hasher = Sha256::new();
        let mut presented = false;
        for name in &self.headers {
            for value in request.headers.get_all(name) {
                presented = true;
                // Length-prefixed, so that no two header lists hash alike.
                hasher.update((name.as_str().len() as u64).to_be_bytes());
                hasher.update(name.as_str());
                hasher.update((value.len() as u64).to_be_bytes());
                hasher.update(value.as_bytes());
            }
        }
        if !presented {
            return Some(String::new());
        }
        let mut scope = String::from("credential:");
        for byte in &hasher.finalize()[..16] {
            let _ = write!(scope, "{byte:02x}");
        }
        Some(scope)
    }
}

/// Whether a request looks like it comes from one of several callers: it carries a
/// credential. A layer without a scope refuses such a request.
pub(crate) fn looks_authenticated(request: &Parts) -> bool {
    request.headers.contains_key(header::AUTHORIZATION)
        || request.headers.contains_key(header::COOKIE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut request = http::Request::new(());
        for (name, value) in headers {
            request.headers_mut().append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        request.into_parts().0
    }

    #[test]
    fn credential_scopes_separate_credentials_and_never_show_them() {
        let scope = CredentialScope::default();
        let alice = scope.scope(&parts(&[("authorization", "Bearer alice-token")]));
        let bob = scope.scope(&parts(&[("authorization", "Bearer bob-token")]));
        assert_ne!(alice, bob);
        let alice = alice.unwrap();
        assert!(
            alice.starts_with("credential:") && !alice.contains("alice"),
            "{alice}"
        );
        assert_eq!(
            Some(alice),
            scope.scope(&parts(&[("authorization", "Bearer alice-token")]))
        );
        assert_eq!(scope.scope(&parts(&[])).as_deref(), Some(""));
        let two = CredentialScope::from_headers([header::AUTHORIZATION, header::COOKIE]);
        assert_ne!(
            two.scope(&parts(&[("authorization", "a"), ("cookie", "b")])),
            two.scope(&parts(&[("authorization", "ab")]))
        );
    }

    #[test]
    fn a_layer_without_a_scope_refuses_callers_it_cannot_tell_apart() {
        assert_eq!(NoScopeSet.scope(&parts(&[])).as_deref(), Some(""));
        assert_eq!(
            NoScopeSet.scope(&parts(&[("authorization", "Bearer a")])),
            None
        );
        assert_eq!(NoScopeSet.scope(&parts(&[("cookie", "session=a")])), None);
    }

    #[test]
    fn an_extension_scope_finds_no_caller_without_its_extension() {
        #[derive(Clone)]
        struct Tenant(&'static str);
        let scope = ExtensionScope::new(|tenant: &Tenant| tenant.0.to_owned());
        assert_eq!(scope.scope(&parts(&[])), None);
        let mut request = parts(&[]);
        request.extensions.insert(Tenant("acme"));
        assert_eq!(scope.scope(&request).as_deref(), Some("acme"));
    }
}
