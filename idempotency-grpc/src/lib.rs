//! The gRPC profile for the [`idempotency-core`](idempotency_core) Idempotency-Key
//! middleware, for tonic servers (and any gRPC server built on `http`).
//!
//! [`layer`] wraps a tonic server or router as it is, *inside* the
//! server's authentication:
//!
//! ```text
//! tonic::transport::Server::builder()
//!     .layer(InterceptorLayer::new(authenticate)) // first: the outermost, sets the Tenant
//!     .layer(idempotency_grpc::layer(store)
//!         .with_profile(GrpcProfile::new().with_file_descriptor_set(FILE_DESCRIPTOR_SET)?)
//!         .with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone())))
//!     .add_service(OrdersServer::new(orders))
//!     .serve(address)
//!     .await?;
//! ```
//!
//! (compiled in the workspace's `grpc-orders` example, whose test keeps the README's copy
//! in step with it).
//!
//! **Authentication must run before the layer**, as a tower layer on `Server::builder()`
//! added before this one (there the first `.layer` is the outermost, the opposite of
//! axum's `Router::layer`): tonic's `InterceptorLayer`, or an async auth layer, that puts
//! the caller into the request extensions for the [scope](idempotency_core::IdempotencyLayer::with_scope)
//! to read. A per-service interceptor (`OrdersServer::with_interceptor(svc, auth)`) runs
//! *inside* the server's layers, after this layer looked for the caller: the scope then
//! finds no caller and the layer refuses every keyed call (`INTERNAL`, with a message that
//! names the misconfiguration) rather than put all callers in one scope.
//!
//! **The file descriptor set** tells the layer which methods stream. A build script
//! writes it, with `protox` needing no `protoc` (build-dependencies `protox`, `prost`,
//! `tonic-prost-build`):
//!
//! ```text
//! // build.rs
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let descriptors = protox::compile(["proto/orders.proto"], ["proto"])?;
//!     let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
//!     let set = prost::Message::encode_to_vec(&descriptors);
//!     std::fs::write(out.join("orders_descriptor.bin"), set)?;
//!     tonic_prost_build::configure().compile_fds(descriptors)?;
//!     Ok(())
//! }
//! // in the crate:
//! pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/orders_descriptor.bin"));
//! ```
//!
//! What it does:
//!
//! - **Key**: the `idempotency-key` request metadata, any printable ASCII string of 1–255
//!   bytes ([`OpaqueKey`]), e.g. a UUID.
//! - **Which calls**: `application/grpc` calls of unary methods. Streaming methods pass
//!   through untouched and unbuffered, key or no key — but the layer cannot tell a
//!   streaming method from a unary one by its request, so **tell it which methods
//!   stream**: give it your file descriptor set
//!   ([`GrpcProfile::with_file_descriptor_set`], the bytes `protox`, `tonic-prost-build`
//!   or `protoc --descriptor_set_out` write), or their paths
//!   ([`GrpcProfile::with_streaming_methods`]). A method it was not told about is taken as
//!   unary.
//! - **Binding**: the method path and the request message bytes (as sent, with their
//!   5-byte gRPC prefix). The same key with another method or message gets
//!   `FAILED_PRECONDITION`.
//! - **Classification** by the gRPC status, from the trailers or from the headers of a
//!   trailers-only answer, never by the HTTP status (always 200): `OK` and the
//!   deterministic codes (`INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`,
//!   `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNIMPLEMENTED`) are stored and replayed; the
//!   others release the key, so a retry runs again ([`GrpcProfile::with_release_codes`]).
//!   An answer without a status releases too.
//! - **Stored**: of the initial metadata only [`REPLAYED_METADATA`] (`content-type`,
//!   `grpc-encoding` and, for a trailers-only answer, the status entries); the message
//!   bytes; the trailers (`grpc-status`, `grpc-message`, `grpc-status-details-bin` and
//!   any other trailing metadata). A replay is the same message and the same status,
//!   sent as a trailers frame, with `idempotent-replayed: true` in its metadata. Custom
//!   initial metadata a handler sets is **not** replayed unless allow-listed:
//!   `.with_replayed_headers(idempotency_grpc::REPLAYED_METADATA.into_iter().chain([HeaderName::from_static("x-order-region")]))`.
//! - **The layer's own answers** are trailers-only gRPC statuses any client decodes (HTTP
//!   200, `content-type: application/grpc`, `grpc-status`, percent-encoded
//!   `grpc-message`), each with a message that says what to do: a malformed, empty,
//!   repeated or missing key → `INVALID_ARGUMENT`; a layer that cannot see the caller →
//!   `INTERNAL`; a key reused with another method or message →
//!   `FAILED_PRECONDITION`; still in flight after the wait, or the store unavailable or
//!   full, or the layer's memory budget used up → `UNAVAILABLE` (the code gRPC retry
//!   policies retry) with `grpc-retry-pushback-ms`; a request message over the limit →
//!   `RESOURCE_EXHAUSTED`, as is a caller over its scope's quota; a request message that
//!   does not arrive in time →
//!   `DEADLINE_EXCEEDED`.
//!
//! The layer's services wrap bodies ([`WrappedBodies`]): they take
//! tonic's body and answer with [`IdempotencyBody`](idempotency_core::IdempotencyBody), which tonic's
//! server accepts, so trailers reach the client on first answers and replays alike.
//!
//!
//! # Feature flags
//!
//! None: the crate is the profile, [`layer`] and the helpers it uses.
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod descriptor;
mod request_id;
mod wire;

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, header};

use idempotency_core::{
    ClassifyAnswer, Disposition, ErrorRenderer, IdempotencyLayer, IdempotencyStore, KeepWhole,
    OpaqueKey, Profile, Rejection, RejectionKind, ReplayAsStored, RequestHead, RouteFilter,
    WrappedBodies,
};

pub use descriptor::DescriptorError;
pub use request_id::RequestIdField;

/// A layer for a gRPC server (tonic's `Server::builder().layer(…)`, or around a
/// `tonic::service::Routes`): [`GrpcProfile`], bodies wrapped so that trailers are
/// kept, and the gRPC headers stored ([`REPLAYED_METADATA`]). See the
/// [crate docs](crate). The one way to set the profile up: further options are the
/// layer's builder methods.
///
/// ```
/// # use idempotency_store_memory::MemoryStore;
/// use idempotency_grpc::GrpcProfile;
///
/// let layer = idempotency_grpc::layer(MemoryStore::new())
///     .with_profile(GrpcProfile::new().with_streaming_methods(["/orders.v1.Orders/ListOrders"]));
/// ```
pub fn layer(store: impl IdempotencyStore) -> IdempotencyLayer<WrappedBodies> {
    IdempotencyLayer::new(store)
        .with_profile(GrpcProfile::new())
        .with_replayed_headers(REPLAYED_METADATA)
        .wrap_bodies()
}

/// The header (and trailer) that carries a gRPC status code.
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// The header (and trailer) that carries a gRPC status message, percent-encoded.
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// The header (and trailer) that carries a serialized `google.rpc.Status`.
pub const GRPC_STATUS_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");
const GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");
const GRPC_RETRY_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The initial metadata a gRPC replay carries (besides `idempotent-replayed`): what
/// [`layer`] stores. Extend it to replay metadata of your own:
///
/// ```
/// # use idempotency_core::IdempotencyLayer;
/// # use idempotency_store_memory::MemoryStore;
/// use idempotency_core::http::HeaderName;
///
/// let layer = idempotency_grpc::layer(MemoryStore::new()).with_replayed_headers(
///     idempotency_grpc::REPLAYED_METADATA.into_iter().chain([HeaderName::from_static("x-order-region")]),
/// );
/// ```
pub const REPLAYED_METADATA: [HeaderName; 5] = [
    header::CONTENT_TYPE,
    GRPC_ENCODING,
    GRPC_STATUS,
    GRPC_MESSAGE,
    GRPC_STATUS_DETAILS,
];

/// A gRPC status code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
#[allow(missing_docs)] // the names are gRPC's
pub enum Code {
    Ok = 0,
    Cancelled = 1,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    AlreadyExists = 6,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    OutOfRange = 11,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    DataLoss = 15,
    Unauthenticated = 16,
}

impl Code {
    const ALL: [Code; 17] = [
        Code::Ok,
        Code::Cancelled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// The code a `grpc-status` value names, if any.
    ///
    /// ```
    /// use idempotency_grpc::Code;
    /// assert_eq!(Code::from_header(b"14"), Some(Code::Unavailable));
    /// assert_eq!(Code::from_header(b"17"), None);
    /// ```
    pub fn from_header(value: &[u8]) -> Option<Code> {
        let number: usize = std::str::from_utf8(value).ok()?.trim().parse().ok()?;
        Self::ALL.get(number).copied()
    }

    /// The code's number, as `grpc-status` carries it.
    pub fn number(self) -> u8 {
        self as u8
    }

    fn header_value(self) -> HeaderValue {
        HeaderValue::from(u16::from(self.number()))
    }

    /// The codes that release the key by default: they say nothing final about the
    /// operation, so a retry should run it.
    pub const DEFAULT_RELEASE: [Code; 10] = [
        Code::Unavailable,
        Code::DeadlineExceeded,
        Code::Aborted,
        Code::ResourceExhausted,
        Code::Internal,
        Code::Unknown,
        Code::Cancelled,
        Code::DataLoss,
        Code::Unauthenticated,
        Code::PermissionDenied,
    ];
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Code::Ok => "OK",
            Code::Cancelled => "CANCELLED",
            Code::Unknown => "UNKNOWN",
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::PermissionDenied => "PERMISSION_DENIED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::Aborted => "ABORTED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Internal => "INTERNAL",
            Code::Unavailable => "UNAVAILABLE",
            Code::DataLoss => "DATA_LOSS",
            Code::Unauthenticated => "UNAUTHENTICATED",
        };
        f.write_str(name)
    }
}

/// The gRPC profile: unary `application/grpc` calls take part, answers are classified by
/// their gRPC status, the layer's own answers are gRPC statuses. See the
/// [crate docs](crate).
#[derive(Clone, Debug)]
pub struct GrpcProfile {
    streaming: HashSet<String>,
    /// Bit `n` set: code `n` releases the key.
    release: u32,
}

impl Default for GrpcProfile {
    fn default() -> Self {
        Self::new()
    }
}

impl GrpcProfile {
    /// The profile with the default release codes ([`Code::DEFAULT_RELEASE`]), knowing
    /// no streaming method yet.
    pub fn new() -> Self {
        Self {
            streaming: HashSet::new(),
            release: codes_mask(Code::DEFAULT_RELEASE),
        }
    }

    /// Learns which methods stream from a serialized `google.protobuf.FileDescriptorSet`
    /// of your services (what `protox::compile(…)?.encode_to_vec()`, prost-build's
    /// `file_descriptor_set_path` or `protoc --descriptor_set_out` produce, and
    /// tonic-reflection serves). Its streaming methods (client, server or both) pass
    /// through; its unary methods take part.
    ///
    /// ```
    /// use idempotency_grpc::GrpcProfile;
    /// // An empty set is a valid one; garbage is not.
    /// assert!(GrpcProfile::new().with_file_descriptor_set(&[]).is_ok());
    /// assert!(GrpcProfile::new().with_file_descriptor_set(&[0x0a, 0x05]).is_err());
    /// ```
    pub fn with_file_descriptor_set(mut self, set: &[u8]) -> Result<Self, DescriptorError> {
        for method in descriptor::methods(set)? {
            if method.streaming {
                self.streaming.insert(method.path);
            }
        }
        Ok(self)
    }

    /// Methods that stream, by path (`/package.Service/Method`): they pass through,
    /// untouched and unbuffered.
    ///
    /// ```
    /// use idempotency_grpc::GrpcProfile;
    /// let profile = GrpcProfile::new().with_streaming_methods(["/orders.v1.Orders/ListOrders"]);
    /// ```
    pub fn with_streaming_methods<I>(mut self, paths: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.streaming.extend(paths.into_iter().map(Into::into));
        self
    }

    /// The codes that release the key instead of being stored (default
    /// [`Code::DEFAULT_RELEASE`]). An answer without a valid `grpc-status` always
    /// releases it.
    ///
    /// ```
    /// use idempotency_grpc::{Code, GrpcProfile};
    /// // ABORTED is final for this service: replay it.
    /// let release = Code::DEFAULT_RELEASE.into_iter().filter(|code| *code != Code::Aborted);
    /// let profile = GrpcProfile::new().with_release_codes(release);
    /// ```
    pub fn with_release_codes(mut self, codes: impl IntoIterator<Item = Code>) -> Self {
        self.release = codes_mask(codes);
        self
    }

    /// Whether a call to `path` takes part: it is not a known streaming method.
    fn is_unary(&self, path: &str) -> bool {
        !self.streaming.contains(path)
    }
}

fn codes_mask(codes: impl IntoIterator<Item = Code>) -> u32 {
    codes
        .into_iter()
        .fold(0, |mask, code| mask | 1 << code.number())
}

/// Whether a request's content type is gRPC's (`application/grpc`, `application/grpc+proto`,
/// …), gRPC-Web excluded.
fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.as_bytes().strip_prefix(b"application/grpc"))
        .is_some_and(|rest| rest.is_empty() || rest[0] == b'+' || rest[0] == b';')
}

/// The gRPC status of an answer: from its trailers, or from its headers when it is
/// trailers-only.
///
/// ```
/// use idempotency_grpc::{Code, status};
/// let mut trailers = http::HeaderMap::new();
/// trailers.insert("grpc-status", "5".parse().unwrap());
/// assert_eq!(status(&http::HeaderMap::new(), Some(&trailers)), Some(Code::NotFound));
/// assert_eq!(status(&http::HeaderMap::new(), None), None);
/// ```
pub fn status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<Code> {
    trailers
        .and_then(|trailers| trailers.get(GRPC_STATUS))
        .or_else(|| headers.get(GRPC_STATUS))
        .and_then(|value| Code::from_header(value.as_bytes()))
}

impl Profile for GrpcProfile {
    fn apply<M>(self, layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
        layer
            .with_routes(self.clone())
            .with_key_format(OpaqueKey)
            .with_classifier(self)
            .with_answer_keeper(KeepWhole)
            .with_answer_replayer(ReplayAsStored)
            .with_error_renderer(GrpcStatuses)
            .without_advertiser()
    }
}

/// Unary `application/grpc` calls take part; streaming calls pass through.
impl RouteFilter for GrpcProfile {
    fn takes_part(&self, request: &RequestHead<'_>) -> bool {
        is_grpc(request.headers)
            && *request.method == Method::POST
            && self.is_unary(request.uri.path())
    }
}

/// An answer is classified by its gRPC status, never by its HTTP status.
impl ClassifyAnswer for GrpcProfile {
    fn classify(
        &self,
        answer: &http::response::Parts,
        trailers: Option<&HeaderMap>,
    ) -> Disposition {
        match status(&answer.headers, trailers) {
            Some(code) if self.release & (1 << code.number()) == 0 => Disposition::Store,
            _ => Disposition::Release,
        }
    }
}

/// The layer's own answers as gRPC statuses, in trailers-only answers that any gRPC client
/// decodes.
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcStatuses;

impl ErrorRenderer for GrpcStatuses {
    fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        let code = match rejection.kind {
            RejectionKind::MissingKey
            | RejectionKind::InvalidKey
            | RejectionKind::DuplicateKeyHeader => Code::InvalidArgument,
            RejectionKind::KeyReused => Code::FailedPrecondition,
            RejectionKind::BodyTooLarge | RejectionKind::QuotaExceeded => Code::ResourceExhausted,
            RejectionKind::BodyTimeout => Code::DeadlineExceeded,
            RejectionKind::UnreadableBody
            | RejectionKind::OverBudget
            | RejectionKind::InFlight
            | RejectionKind::StoreUnavailable
            | RejectionKind::StoreFull => Code::Unavailable,
            // It ran, and its answer is gone: retrying with the key cannot help.
            RejectionKind::ResponseNotStored => Code::FailedPrecondition,
            RejectionKind::ResponseFailed | RejectionKind::NoScope => Code::Internal,
            // A kind a later idempotency-core adds (`RejectionKind` is non-exhaustive):
            // gRPC's code for an error it has no better code for.
            _ => Code::Unknown,
        };
        trailers_only(
            code,
            &grpc_message(&rejection.message),
            rejection.retry_after,
        )
    }
}

/// The message of a rejection in gRPC's words: the layer's messages speak of the
/// `Idempotency-Key` header, which gRPC calls metadata.
fn grpc_message(message: &str) -> String {
    message
        .replace("Idempotency-Key header", "idempotency-key metadata entry")
        .replace("Idempotency-Key", "idempotency-key metadata")
        .replace("request body", "request message")
}

/// A trailers-only gRPC answer: HTTP 200, the status in the headers, no body.
fn trailers_only(code: Code, message: &str, retry_after: Option<Duration>) -> Response<Bytes> {
    let mut response = Response::new(Bytes::new());
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert(GRPC_STATUS, code.header_value());
    if let Ok(message) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert(GRPC_MESSAGE, message);
    }
    if let Some(retry_after) = retry_after {
        let millis = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
        headers.insert(GRPC_RETRY_PUSHBACK, HeaderValue::from(millis));
    }
    response
}

/// Percent-encodes a `grpc-message`: every byte outside printable ASCII, and `%`.
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..0x7f).contains(&byte) && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&'static str, &'static str)]) -> http::response::Parts {
        let mut response = Response::new(());
        for (name, value) in headers {
            response
                .headers_mut()
                .insert(*name, HeaderValue::from_static(value));
        }
        response.into_parts().0
    }

    fn trailers(code: &'static str) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert(GRPC_STATUS, HeaderValue::from_static(code));
        map
    }

    #[test]
    fn answers_are_classified_by_their_grpc_status() {
        let profile = GrpcProfile::new();
        let stored = [0, 3, 5, 6, 9, 11, 12];
        for code in 0..=16u8 {
            let value = trailers(Box::leak(code.to_string().into_boxed_str()));
            let expected = if stored.contains(&code) {
                Disposition::Store
            } else {
                Disposition::Release
            };
            assert_eq!(
                profile.classify(&parts(&[]), Some(&value)),
                expected,
                "code {code} in trailers"
            );
            let head = parts(&[("grpc-status", Box::leak(code.to_string().into_boxed_str()))]);
            assert_eq!(
                profile.classify(&head, None),
                expected,
                "code {code} in a trailers-only answer"
            );
        }
        assert_eq!(
            profile.classify(&parts(&[]), None),
            Disposition::Release,
            "no status"
        );
        assert_eq!(
            profile.classify(&parts(&[]), Some(&trailers("x"))),
            Disposition::Release,
            "a status that is not a number"
        );
        let lenient = GrpcProfile::new().with_release_codes([Code::Unavailable]);
        assert_eq!(
            lenient.classify(&parts(&[]), Some(&trailers("13"))),
            Disposition::Store
        );
    }

    #[test]
    fn only_unary_grpc_calls_take_part() {
        let profile = GrpcProfile::new().with_streaming_methods(["/p.S/Stream"]);
        let call = |path: &str, content_type: &'static str| {
            let request = http::Request::post(path)
                .header("content-type", content_type)
                .body(())
                .unwrap();
            profile.takes_part(&RequestHead::of(&request))
        };
        assert!(call("/p.S/Unary", "application/grpc"));
        assert!(call("/p.S/Unary", "application/grpc+proto"));
        assert!(!call("/p.S/Stream", "application/grpc"));
        assert!(!call("/p.S/Unary", "application/grpc-web"));
        assert!(!call("/p.S/Unary", "application/json"));
    }

    #[test]
    fn rejections_are_trailers_only_statuses() {
        let rejection = Rejection {
            kind: RejectionKind::InFlight,
            status: http::StatusCode::CONFLICT,
            message: "a request with this Idempotency-Key is still being processed; 100% sure"
                .to_owned(),
            retry_after: Some(Duration::from_millis(1500)),
        };
        let response = GrpcStatuses.render(&rejection);
        assert_eq!(response.status(), 200);
        assert!(response.body().is_empty());
        let headers = response.headers();
        assert_eq!(headers["content-type"], "application/grpc");
        assert_eq!(headers["grpc-status"], "14");
        assert_eq!(headers["grpc-retry-pushback-ms"], "1500");
        assert_eq!(
            headers["grpc-message"],
            "a request with this idempotency-key metadata is still being processed; 100%25 sure"
        );
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a b%c\né"), "a b%25c%0A%C3%A9");
    }
}

/// The README's snippets, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
