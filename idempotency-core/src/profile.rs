//! [`Profile`]: the protocol-specific part of the layer, and the plain HTTP default.

use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::{Extensions, HeaderMap, Method, Request, Response, Uri};

use crate::key::{KeyFormat, OpaqueKey};
use crate::rejection::{ErrorRenderer, ProblemJson, Rejection};
use crate::store::StoredResponse;

/// What the layer does with an answer it classified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// Keep the answer and replay it to every retry with the key.
    Store,
    /// Free the key, so that a retry runs the request again: the answer says nothing
    /// about the operation itself (it was refused, or failed on the way).
    Release,
}

/// Everything about idempotency that depends on the protocol; install one with
/// [`IdempotencyLayer::with_profile`](crate::IdempotencyLayer::with_profile).
///
/// The layer's request path is the same for every protocol: parse the key, bind the
/// record to the request, reserve it, run the inner service, classify the answer, store
/// or release it, replay it to retries. Whatever in that path depends on the protocol is
/// asked of a [`Profile`]:
///
/// | stage | the profile says | default ([`HttpProfile`]) |
/// |---|---|---|
/// | take part | [`takes_part`](Self::takes_part) (method and path) or [`takes_part_request`](Self::takes_part_request) (the whole head): which mutations take part | all of them |
/// | parse | [`key_format`](Self::key_format): what a key looks like | [`OpaqueKey`] |
/// | classify | [`classify`](Self::classify): store the answer or release the key | store |
/// | store | [`to_store`](Self::to_store): what of the answer is kept | all of it |
/// | replay | [`restore`](Self::restore), [`refresh`](Self::refresh) and [`replay`](Self::replay): what a replay rebuilds and adds back | nothing |
/// | reject | [`render`](Self::render): how the layer's own answers look | [`ProblemJson`] |
/// | advertise | [`advertises`](Self::advertises) and [`advertise`](Self::advertise): answers the profile amends although they do not take part | none |
///
/// Every method has a default, so a profile states only what differs from plain HTTP.
/// The Iceberg profile ([`IcebergProfile`](crate::iceberg::IcebergProfile)) is built on
/// this trait alone, with nothing a third party could not write; read it as an example.
///
/// What stays generic, and so the same under every profile: GET, HEAD and OPTIONS never
/// take part; 5xx answers and the layer's
/// [release statuses](crate::IdempotencyLayer::with_release_statuses) always release the
/// key (a profile can release more, never store those); only the
/// [replayed headers](crate::IdempotencyLayer::with_replayed_headers) are stored; and a
/// replay always carries `idempotent-replayed: true`.
///
/// ```
/// use bytes::Bytes;
/// use http::{Method, StatusCode};
/// use idempotency_core::{Disposition, IdempotencyLayer, Profile};
/// use idempotency_store_memory::MemoryStore;
///
/// /// Orders: only `/orders` takes part, and a 409 (the order was already placed
/// /// by other means) releases the key instead of being replayed.
/// struct Orders;
///
/// impl Profile for Orders {
///     fn takes_part(&self, _method: &Method, path: &str) -> bool {
///         path.starts_with("/orders")
///     }
///
///     fn classify(&self, answer: &http::response::Parts, _trailers: Option<&http::HeaderMap>) -> Disposition {
///         if answer.status == StatusCode::CONFLICT { Disposition::Release } else { Disposition::Store }
///     }
/// }
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_profile(Orders);
/// # drop(layer);
/// ```
///
/// The request given to [`to_store`](Self::to_store) and [`refresh`](Self::refresh) is
/// the keyed request with its body read whole; the layer ensures a retry that reaches
/// [`refresh`](Self::refresh) has the same method, path and body as the request whose
/// answer is stored.
pub trait Profile: Send + Sync + 'static {
    /// Whether a mutation (POST, PUT, PATCH or DELETE) of `path` takes part. Requests that
    /// do not pass through untouched, key or no key.
    fn takes_part(&self, method: &Method, path: &str) -> bool {
        let _ = (method, path);
        true
    }

    /// Whether a mutation takes part, seen with its whole head (headers, extensions)
    /// before its body is read: for a profile that decides on more than the method and
    /// path, e.g. gRPC, which takes part only in `application/grpc` calls of unary
    /// methods and lets the others (streaming calls included) pass through untouched and
    /// unbuffered. The default asks [`takes_part`](Self::takes_part). Asked of every
    /// mutation that carries a key, so keep it cheap.
    fn takes_part_request(&self, request: &RequestHead<'_>) -> bool {
        self.takes_part(request.method, request.uri.path())
    }

    /// How the `Idempotency-Key` header's value becomes a key.
    fn key_format(&self) -> &dyn KeyFormat {
        &OpaqueKey
    }

    /// Whether an answer the layer would store is stored, or releases the key. It is asked
    /// only about answers that the generic rules keep (not 5xx, not a release status),
    /// with the trailers the body ended with, if any.
    fn classify(
        &self,
        answer: &http::response::Parts,
        trailers: Option<&HeaderMap>,
    ) -> Disposition {
        let _ = (answer, trailers);
        Disposition::Store
    }

    /// What is kept of an answer that is stored: its status, replayed headers and body
    /// come in, and what comes out is written to the store. The first caller always gets
    /// the whole answer, whatever is kept.
    fn to_store(&self, request: &Request<Bytes>, answer: StoredResponse) -> StoredResponse {
        let _ = request;
        answer
    }

    /// Whether [`to_store`](Self::to_store) reads the request it is given. While the
    /// default, `true`, holds, the layer keeps a copy of every keyed request (its head
    /// and body) for `to_store` while the inner service runs. A profile whose `to_store`
    /// does not look at the request (the default `to_store` does not) answers `false`
    /// and spares every keyed request that copy; its `to_store` is then given an empty
    /// request (`GET /`, no headers, no body).
    fn to_store_reads_request(&self) -> bool {
        true
    }

    /// Rebuilds what [`to_store`](Self::to_store) kept out of the store by reference
    /// (Iceberg: table metadata, read back from its immutable file), before a stored
    /// answer goes to [`refresh`](Self::refresh) and [`replay`](Self::replay). `None`
    /// (the default) when `stored` is complete as it is. The future resolves to the
    /// answer to go on with: the rebuilt one, or, when what it refers to cannot be read,
    /// the answer the retry gets instead (never a guess at the first one).
    fn restore(&self, stored: &StoredResponse) -> Option<Restoring<'_>> {
        let _ = stored;
        None
    }

    /// A request for the inner service, sent before a stored answer is replayed to
    /// `retry`, to fetch what [`to_store`](Self::to_store) kept out of the store. Its
    /// answer is given to [`replay`](Self::replay). `None` (the default) sends nothing.
    fn refresh(&self, retry: &Request<Bytes>, stored: &StoredResponse) -> Option<Request<Bytes>> {
        let _ = (retry, stored);
        None
    }

    /// The answer a retry gets, from the stored one and the answer to
    /// [`refresh`](Self::refresh)'s request (`None` when none was sent, or it failed or
    /// was not a 2xx). The default replays the stored answer untouched.
    fn replay(&self, stored: StoredResponse, refreshed: Option<Response<Bytes>>) -> StoredResponse {
        let _ = refreshed;
        stored
    }

    /// The layer's own answer for `rejection`. The layer adds `Retry-After`.
    fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        ProblemJson.render(rejection)
    }

    /// Whether the profile amends the answer to this request, which does not take part
    /// (Iceberg: `GET /v1/config`). Asked of every request, so keep it cheap.
    fn advertises(&self, method: &Method, path: &str) -> bool {
        let _ = (method, path);
        false
    }

    /// The amended answer to a request [`advertises`](Self::advertises) picked, read
    /// whole (up to 1 MiB; a larger one goes out untouched). `lifetime` is how long the
    /// layer keeps a key.
    fn advertise(&self, answer: Response<Bytes>, lifetime: Duration) -> Response<Bytes> {
        let _ = lifetime;
        answer
    }
}

/// The rebuilding of a stored answer that [`Profile::restore`] starts.
pub type Restoring<'a> = Pin<Box<dyn Future<Output = StoredResponse> + Send + 'a>>;

/// A request as [`Profile::takes_part_request`] sees it: everything but the body, which
/// has not been read yet.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI (path and query).
    pub uri: &'a Uri,
    /// The headers (gRPC: the request metadata).
    pub headers: &'a HeaderMap,
    /// The extensions other layers set (e.g. the authenticated principal).
    pub extensions: &'a Extensions,
}

impl<'a> RequestHead<'a> {
    /// The head of `request`.
    ///
    /// ```
    /// use idempotency_core::RequestHead;
    /// let request = http::Request::post("/orders").body(()).unwrap();
    /// assert_eq!(RequestHead::of(&request).uri.path(), "/orders");
    /// ```
    pub fn of<B>(request: &'a Request<B>) -> Self {
        Self {
            method: request.method(),
            uri: request.uri(),
            headers: request.headers(),
            extensions: request.extensions(),
        }
    }
}

/// The default profile, for plain HTTP services: every mutation takes part, keys are
/// opaque, answers are stored as they are, errors are problem+json documents.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpProfile;

impl Profile for HttpProfile {
    fn to_store_reads_request(&self) -> bool {
        false // it keeps the default `to_store`
    }
}
