//! Keys that travel in the request's body: [`PayloadKey`], the decision, and
//! [`JsonPointerKey`], the one for JSON bodies (an AWS-style `clientToken`, a
//! `requestId` field).

use std::sync::Arc;

use serde_json::Value;

use crate::decisions::{AllMutations, RequestHead, RouteFilter};

/// Where a route's key is when the API carries it in the request's body rather than in
/// the `Idempotency-Key` header, and what of the body the key is bound to.
///
/// On a request it [applies](Self::applies) to, the layer reads the body whole first,
/// then [finds](Self::find) the key in it; the header is not read. **The payload wins**
/// because on such a route the body's field is the API's own contract, which the
/// application sets, while a header may be added by a generic client or proxy that
/// mints a key per attempt (and would make every retry look new). A key found in the
/// body is checked by the layer's [`KeyFormat`](crate::KeyFormat) as a header's would
/// be, and refused with the same 400.
///
/// A profile's crate implements it for its protocol's messages (`idempotency-grpc`'s
/// `RequestIdField` reads a protobuf field); [`JsonPointerKey`] is the one for JSON.
pub trait PayloadKey: Send + Sync + 'static {
    /// Whether `request`'s key is in its body.
    fn applies(&self, request: &RequestHead<'_>) -> bool;

    /// The key in `body`, and what the request is bound to: `Ok(None)` when the body
    /// carries no key (the request then runs unprotected, or is refused if the layer
    /// requires a key), `Err` with what is wrong when the body cannot carry one (it is
    /// not the format the API speaks, the key's field has the wrong type). The message
    /// is sent to the client.
    fn find(&self, body: &[u8]) -> Result<Option<FoundKey>, String>;
}

/// A key found in a request's body, and what its request is bound to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundKey {
    /// The key, as a client sent it.
    pub key: String,
    /// The bytes whose SHA-256 binds the record (a retry must send the same), or `None`
    /// for the whole body. A fingerprint of some fields leaves out what changes from
    /// one attempt to the next (a timestamp, a trace id).
    pub fingerprint: Option<Vec<u8>>,
}

/// The key of a JSON body, found by a JSON Pointer (RFC 6901), optionally with the
/// fields that make up the fingerprint.
///
/// The key's field must be a string; a body without it (or with `null` there) carries
/// no key. A body that is not JSON, or whose key field is another type, is refused with
/// a 400 that says so.
///
/// ```
/// use idempotency_core::{IdempotencyLayer, JsonPointerKey, RequestHead};
/// # use idempotency_store_memory::MemoryStore;
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_payload_key(
///     JsonPointerKey::new("/clientToken")
///         // bound to the order's fields, not to `/sentAt`
///         .with_fingerprint(["/account", "/amount"])
///         .on_routes(|request: &RequestHead<'_>| request.uri.path() == "/orders"),
/// );
/// ```
#[derive(Clone)]
pub struct JsonPointerKey {
    key: String,
    fingerprint: Option<Vec<String>>,
    routes: Arc<dyn RouteFilter>,
}

impl std::fmt::Debug for JsonPointerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonPointerKey")
            .field("key", &self.key)
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl JsonPointerKey {
    /// The key at `pointer` (`/clientToken`, `/request/id`), on every route the layer
    /// takes part in, bound to the whole body.
    ///
    /// # Panics
    ///
    /// If `pointer` is not a JSON Pointer: a pointer is empty (the whole document, which
    /// is no key) or starts with `/`, and `~` is only followed by `0` or `1`.
    pub fn new(pointer: impl Into<String>) -> Self {
        let key = pointer.into();
        assert_pointer(&key);
        Self {
            key,
            fingerprint: None,
            routes: Arc::new(AllMutations),
        }
    }

    /// Binds the record to the values at `pointers` (in this order; an absent one counts
    /// as `null`) instead of the whole body.
    ///
    /// # Panics
    ///
    /// If one of `pointers` is not a JSON Pointer (see [`new`](Self::new)).
    pub fn with_fingerprint<P: Into<String>>(
        mut self,
        pointers: impl IntoIterator<Item = P>,
    ) -> Self {
        let pointers: Vec<String> = pointers.into_iter().map(Into::into).collect();
        pointers.iter().for_each(|pointer| assert_pointer(pointer));
        self.fingerprint = Some(pointers);
        self
    }

    /// Reads the key from the body only on the requests `routes` picks (default: every
    /// request the layer takes part in); others keep the header's key.
    pub fn on_routes(mut self, routes: impl RouteFilter) -> Self {
        self.routes = Arc::new(routes);
        self
    }
}

impl PayloadKey for JsonPointerKey {
    fn applies(&self, request: &RequestHead<'_>) -> bool {
        self.routes.takes_part(request)
    }

    fn find(&self, body: &[u8]) -> Result<Option<FoundKey>, String> {
        let document: Value = serde_json::from_slice(body).map_err(|error| {
            format!(
                "the request body is not JSON ({error}); this route reads its idempotency key \
                 from the body's {}",
                self.key
            )
        })?;
        let key = match document.pointer(&self.key) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(key)) => key.clone(),
            Some(_) => {
                return Err(format!(
                    "the request body's {} must be a string: it is this request's idempotency \
                     key (a new UUID per operation, the same one on every retry)",
                    self.key
                ));
            }
        };
        let fingerprint = self.fingerprint.as_ref().map(|pointers| {
            let values: Vec<&Value> = pointers
                .iter()
                .map(|pointer| document.pointer(pointer).unwrap_or(&Value::Null))
                .collect();
            serde_json::to_vec(&values).unwrap_or_default()
        });
        Ok(Some(FoundKey { key, fingerprint }))
    }
}

fn assert_pointer(pointer: &str) {
    let escapes_ok = pointer
        .split('~')
        .skip(1)
        .all(|after| after.starts_with('0') || after.starts_with('1'));
    assert!(
        pointer.starts_with('/') && escapes_ok,
        "{pointer:?} is not a JSON Pointer to a field (RFC 6901): it starts with `/`, and `~` \
         is written `~0`, `/` in a name `~1` (e.g. \"/clientToken\", \"/request/id\")"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find(key: &JsonPointerKey, body: &str) -> Result<Option<FoundKey>, String> {
        key.find(body.as_bytes())
    }

    #[test]
    fn the_key_is_the_string_at_the_pointer() {
        let key = JsonPointerKey::new("/request/id");
        let found = find(&key, r#"{"request":{"id":"k-1"},"n":2}"#)
            .unwrap()
            .unwrap();
        assert_eq!(found.key, "k-1");
        assert_eq!(found.fingerprint, None, "bound to the whole body");
        assert_eq!(find(&key, r#"{"request":{}}"#).unwrap(), None);
        assert_eq!(find(&key, r#"{"request":{"id":null}}"#).unwrap(), None);
    }

    #[test]
    fn a_key_of_another_type_or_a_body_that_is_not_json_is_refused() {
        let key = JsonPointerKey::new("/id");
        let number = find(&key, r#"{"id":7}"#).unwrap_err();
        assert!(number.contains("/id must be a string"), "{number}");
        let text = find(&key, "id=7").unwrap_err();
        assert!(text.contains("not JSON"), "{text}");
    }

    #[test]
    fn the_fingerprint_is_the_values_at_its_pointers_in_order() {
        let key = JsonPointerKey::new("/id").with_fingerprint(["/a", "/b"]);
        let at = |body: &str| find(&key, body).unwrap().unwrap().fingerprint.unwrap();
        let first = at(r#"{"id":"k","a":1,"b":"x","sentAt":"10:00"}"#);
        assert_eq!(first, br#"[1,"x"]"#);
        assert_eq!(at(r#"{"sentAt":"10:05","b":"x","a":1,"id":"k"}"#), first);
        assert_ne!(at(r#"{"id":"k","a":2,"b":"x"}"#), first);
        assert_eq!(at(r#"{"id":"k"}"#), b"[null,null]");
    }

    #[test]
    #[should_panic(expected = "is not a JSON Pointer")]
    fn a_pointer_without_its_slash_is_refused_at_once() {
        JsonPointerKey::new("clientToken");
    }

    #[test]
    #[should_panic(expected = "is not a JSON Pointer")]
    fn a_bad_escape_is_refused_at_once() {
        JsonPointerKey::new("/a").with_fingerprint(["/b~2"]);
    }
}
