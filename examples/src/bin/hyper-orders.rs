//! `hyper-orders`: a plain hyper 1 service (hyper-util's server, no axum, no tonic) behind
//! the Idempotency-Key layer.
//!
//! ```text
//! cargo run -p examples --bin hyper-orders -- 127.0.0.1:3001
//! ```
//!
//! `POST /orders` creates an order (a counter) and answers its number in the body and in a
//! trailer, `x-order`. The handler takes hyper's own request body, which the layer cannot
//! build from bytes, so the layer wraps bodies (`wrap_bodies`): the handler gets
//! `Request<IdempotencyBody<Incoming>>`, and answers keep their trailers, first answers
//! and replays alike. Trailers reach an HTTP/2 client, or an HTTP/1.1 client that sends
//! `TE: trailers`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use idempotency_core::{IdempotencyBody, IdempotencyLayer};
use idempotency_store_memory::MemoryStore;
use tower_layer::Layer;

type AnswerBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// `POST /orders`: the next order number, in the body and in the `x-order` trailer.
async fn orders(
    counter: Arc<AtomicU64>,
    request: Request<IdempotencyBody<Incoming>>,
) -> Result<Response<AnswerBody>, Infallible> {
    if request.method() != Method::POST || request.uri().path() != "/orders" {
        let mut response = Response::new(Full::new(Bytes::from_static(b"not found")).boxed());
        *response.status_mut() = StatusCode::NOT_FOUND;
        return Ok(response);
    }
    // Read the body as any handler would (the layer hands over the bytes it read).
    let item = match request.into_body().collect().await {
        Ok(body) => String::from_utf8_lossy(&body.to_bytes()).into_owned(),
        Err(_) => String::new(),
    };
    let number = counter.fetch_add(1, Ordering::SeqCst) + 1;
    let mut trailers = HeaderMap::new();
    trailers.insert("x-order", HeaderValue::from(number));
    let frames = [
        Ok::<_, Infallible>(Frame::data(Bytes::from(format!(
            "{{\"order\":{number},\"item\":{item:?}}}"
        )))),
        Ok(Frame::trailers(trailers)),
    ];
    let body = StreamBody::new(futures_util::stream::iter(frames)).boxed();
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::CREATED;
    Ok(response)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listen = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3001".to_owned());
    let counter = Arc::new(AtomicU64::new(0));
    let service = IdempotencyLayer::new(MemoryStore::new())
        .wrap_bodies()
        .layer(tower::service_fn(move |request| {
            orders(counter.clone(), request)
        }));
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    // The test waits for this line.
    println!("hyper-orders listening on {}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
