//! Requests sent through a service in process, one at a time on a current-thread runtime,
//! for what counts per request: `profile-layer` (instructions, under callgrind) and
//! `mem-scale` (allocations). Each mode is one kind of request:
//!
//! - HTTP, on the benchmark app: `bare`, `none` (no key), `fresh` (the key `profile-N` for
//!   each `N` of the range), `replay` (one key for every request);
//! - gRPC, on the benchmark's tonic service (a complete framed call, read to its
//!   trailers): `grpc-bare`, `grpc-none`, `grpc-fresh`, `grpc-replay`.

use std::convert::Infallible;
use std::ops::Range;

use axum::body::Body;
use bytes::{BufMut as _, Bytes, BytesMut};
use http::{HeaderValue, Request, Response, header};
use http_body_util::{BodyExt as _, Full};
use idempotency_core::IDEMPOTENCY_KEY;
use tower::Service;
use tower::ServiceExt as _;

/// Sends one HTTP request of `mode` per number in `requests` through `app`.
pub fn http<S>(app: S, mode: &str, requests: Range<u64>)
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone,
{
    runtime().block_on(async {
        for n in requests.clone() {
            let builder =
                Request::post(crate::app::PATH).header(header::CONTENT_TYPE, "application/json");
            let request = with_key(builder, mode, n)
                .body(Body::from(crate::app::REQUEST_BODY))
                .expect("a valid request");
            let response = app.clone().oneshot(request).await.expect("infallible");
            let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .expect("the body");
            std::hint::black_box(body);
        }
    });
}

/// Sends one gRPC call of `mode` per number in `requests` through `service`.
pub fn grpc<S, B>(service: S, mode: &str, requests: Range<u64>)
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible> + Clone,
    B: axum::body::HttpBody<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let message = prost::Message::encode_to_vec(&crate::grpc::request_message());
    let mut framed = BytesMut::with_capacity(5 + message.len());
    framed.put_u8(0);
    framed.put_u32(u32::try_from(message.len()).expect("a small message"));
    framed.put_slice(&message);
    let framed = framed.freeze();
    let mode = mode.strip_prefix("grpc-").unwrap_or(mode);
    runtime().block_on(async {
        for n in requests.clone() {
            let builder = Request::post(crate::grpc::METHOD)
                .header(header::CONTENT_TYPE, "application/grpc")
                .header(header::TE, "trailers");
            let request = with_key(builder, mode, n)
                .body(Full::new(framed.clone()))
                .expect("a valid request");
            let response = service.clone().oneshot(request).await.expect("infallible");
            let body = response.into_body().collect().await.expect("the body");
            assert!(
                body.trailers()
                    .and_then(|t| t.get("grpc-status"))
                    .is_some_and(|s| s == "0"),
                "the call did not succeed"
            );
            std::hint::black_box(body.to_bytes());
        }
    });
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `builder` with the key that request `n` of `mode` carries: `fresh` a key of its own,
/// `replay` the same key every time, any other mode none.
fn with_key(builder: http::request::Builder, mode: &str, n: u64) -> http::request::Builder {
    match mode {
        "fresh" => {
            let key = HeaderValue::try_from(format!("profile-{n}")).expect("a key");
            builder.header(IDEMPOTENCY_KEY, key)
        }
        "replay" => builder.header(IDEMPOTENCY_KEY, "profile-fixed"),
        _ => builder,
    }
}
