//! The protocol's decisions, one trait each. A [`Profile`](crate::Profile) installs a
//! set of them for one protocol at once.
//!
//! The layer's request path is the same for every protocol: parse the key, bind the
//! record to the request, reserve it, run the inner service, classify the answer, store
//! or release it, replay it to retries. What in that path depends on the protocol is a
//! decision of its own, asked of one trait, installed with one builder method:
//!
//! | decision | trait | builder | plain HTTP (the default) |
//! |---|---|---|---|
//! | which requests take part | [`RouteFilter`] | [`with_routes`](crate::IdempotencyLayer::with_routes) | every mutation ([`AllMutations`](crate::AllMutations)) |
//! | what a key looks like | [`KeyFormat`](crate::KeyFormat) | [`with_key_format`](crate::IdempotencyLayer::with_key_format) | [`OpaqueKey`](crate::OpaqueKey) |
//! | store an answer, or release the key | [`ClassifyAnswer`] | [`with_classifier`](crate::IdempotencyLayer::with_classifier) | store ([`StoreAnswers`]) |
//! | what of an answer is kept in the store | [`KeepAnswer`] | [`with_answer_keeper`](crate::IdempotencyLayer::with_answer_keeper) | all of it ([`KeepWhole`]) |
//! | what a replay adds to the stored answer | [`ReplayAnswer`] | [`with_answer_replayer`](crate::IdempotencyLayer::with_answer_replayer) | nothing ([`ReplayAsStored`]) |
//! | how the layer's own answers look | [`ErrorRenderer`](crate::ErrorRenderer) | [`with_error_renderer`](crate::IdempotencyLayer::with_error_renderer) | [`ProblemJson`](crate::ProblemJson) |
//! | answers amended although they do not take part | [`Advertise`] | [`with_advertiser`](crate::IdempotencyLayer::with_advertiser) | none |
//! | a key carried in the body | [`PayloadKey`](crate::PayloadKey) | [`with_payload_key`](crate::IdempotencyLayer::with_payload_key) | none: the header's |
//!
//! Each slot holds one decision: the last builder call that sets it wins, and nothing
//! else changes it. A [`Profile`](crate::Profile) (a protocol's, [`HttpProfile`](crate::HttpProfile), your own) is a
//! set of these installed at once with
//! [`with_profile`](crate::IdempotencyLayer::with_profile); a call after it replaces one
//! of its decisions, and says so by being there.
//!
//! What stays generic, and so the same under every profile: GET, HEAD and OPTIONS never
//! take part; 5xx answers and the layer's
//! [release statuses](crate::IdempotencyLayer::with_release_statuses) always release the
//! key (a classifier can release more, never store those); only the
//! [replayed headers](crate::IdempotencyLayer::with_replayed_headers) are stored; and a
//! replay always carries `idempotent-replayed: true`.

use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::{Extensions, HeaderMap, Method, Request, Response, Uri, response};

use crate::store::StoredResponse;

/// Which requests take part, among mutations (POST, PUT, PATCH, DELETE) that carry a key.
/// GET, HEAD and OPTIONS never take part, whatever the filter says. Any
/// `Fn(&RequestHead) -> bool` is a filter. Asked of every keyed mutation before its body
/// is read, so keep it cheap.
///
/// ```
/// use idempotency_core::{IdempotencyLayer, RequestHead};
/// use idempotency_store_memory::MemoryStore;
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .with_routes(|request: &RequestHead<'_>| request.uri.path().starts_with("/v1/"));
/// # drop(layer);
/// ```
pub trait RouteFilter: Send + Sync + 'static {
    /// Whether `request` takes part.
    fn takes_part(&self, request: &RequestHead<'_>) -> bool;
}

impl<F> RouteFilter for F
where
    F: Fn(&RequestHead<'_>) -> bool + Send + Sync + 'static,
{
    fn takes_part(&self, request: &RequestHead<'_>) -> bool {
        self(request)
    }
}

/// The default [`RouteFilter`]: every mutation takes part.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllMutations;

impl RouteFilter for AllMutations {
    fn takes_part(&self, _request: &RequestHead<'_>) -> bool {
        true
    }
}

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

/// Whether an answer is stored or releases the key. Asked only about answers the generic
/// rules keep (not 5xx, not a release status), with the trailers the body ended with, if
/// any (an RPC protocol may send its status there).
///
/// ```
/// use http::StatusCode;
/// use idempotency_core::{Disposition, IdempotencyLayer};
/// use idempotency_store_memory::MemoryStore;
///
/// // A 409 (the order was placed by other means) releases the key instead of being replayed.
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_classifier(
///     |answer: &http::response::Parts, _trailers: Option<&http::HeaderMap>| {
///         if answer.status == StatusCode::CONFLICT { Disposition::Release } else { Disposition::Store }
///     },
/// );
/// # drop(layer);
/// ```
pub trait ClassifyAnswer: Send + Sync + 'static {
    /// Store `answer`, or release the key.
    fn classify(&self, answer: &response::Parts, trailers: Option<&HeaderMap>) -> Disposition;
}

impl<F> ClassifyAnswer for F
where
    F: Fn(&response::Parts, Option<&HeaderMap>) -> Disposition + Send + Sync + 'static,
{
    fn classify(&self, answer: &response::Parts, trailers: Option<&HeaderMap>) -> Disposition {
        self(answer, trailers)
    }
}

/// The default [`ClassifyAnswer`]: every answer the generic rules keep is stored.
#[derive(Clone, Copy, Debug, Default)]
pub struct StoreAnswers;

impl ClassifyAnswer for StoreAnswers {
    fn classify(&self, _answer: &response::Parts, _trailers: Option<&HeaderMap>) -> Disposition {
        Disposition::Store
    }
}

/// What of an answer is kept in the store: what [`keep`](Self::keep) leaves out or keeps
/// by reference, [`restore`](Self::restore) puts back before a replay. A catalog profile
/// may cut vended credentials out, and keep table metadata as a pointer to its immutable
/// file.
///
/// The first caller always gets the whole answer, whatever is kept.
pub trait KeepAnswer: Send + Sync + 'static {
    /// What is stored of `answer`, given to a request with this `method` and `uri`: its
    /// status, replayed headers and body come in, and what comes out is written to the
    /// store. The default keeps it as it is.
    fn keep(&self, method: &Method, uri: &Uri, answer: StoredResponse) -> StoredResponse {
        let _ = (method, uri);
        answer
    }

    /// Rebuilds what [`keep`](Self::keep) kept out of the store by reference (e.g.
    /// table metadata, read back from its immutable file), before a stored answer is
    /// replayed. `None` (the default) when `stored` is complete as it is. The future
    /// resolves to the answer to go on with: the rebuilt one, or, when what it refers to
    /// cannot be read, the answer the retry gets instead (never a guess at the first one).
    fn restore(&self, stored: &StoredResponse) -> Option<Restoring<'_>> {
        let _ = stored;
        None
    }
}

/// The default [`KeepAnswer`]: the answer is stored whole.
#[derive(Clone, Copy, Debug, Default)]
pub struct KeepWhole;

impl KeepAnswer for KeepWhole {}

/// What a replay adds to the stored answer, from a request the layer sends the inner
/// service first: a catalog profile may load the table again for fresh vended
/// credentials, which it never stores. The two halves belong together:
/// [`refresh`](Self::refresh)'s answer is what [`replay`](Self::replay) adds.
pub trait ReplayAnswer: Send + Sync + 'static {
    /// A request for the inner service, sent before a stored answer is replayed to
    /// `retry`. Its answer is given to [`replay`](Self::replay). `None` (the default) sends
    /// nothing. The layer ensures `retry` has the same method, path and body as the
    /// request whose answer is stored.
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
}

/// The default [`ReplayAnswer`]: a replay is the stored answer, and nothing is sent first.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReplayAsStored;

impl ReplayAnswer for ReplayAsStored {}

/// The rebuilding of a stored answer that [`KeepAnswer::restore`] starts.
pub type Restoring<'a> = Pin<Box<dyn Future<Output = StoredResponse> + Send + 'a>>;

/// Answers the layer amends although their requests do not take part, to tell clients
/// about the layer (e.g. the key lifetime in a catalog's config answer).
pub trait Advertise: Send + Sync + 'static {
    /// Whether the answer to this request is amended. Asked of every request, so keep it
    /// cheap.
    fn advertises(&self, method: &Method, path: &str) -> bool;

    /// The amended answer to a request [`advertises`](Self::advertises) picked, read whole
    /// (up to 1 MiB; a larger one goes out untouched). `lifetime` is how long the layer
    /// keeps a key.
    fn advertise(&self, answer: Response<Bytes>, lifetime: Duration) -> Response<Bytes>;
}

/// A request as a [`RouteFilter`] sees it: everything but the body, which has not been
/// read yet.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI (path and query).
    pub uri: &'a Uri,
    /// The headers (for an RPC protocol on HTTP/2, the request metadata).
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
