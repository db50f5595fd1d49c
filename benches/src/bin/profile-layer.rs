//! Sends one kind of request through the app in process, many times, for a profiler that
//! counts instructions (callgrind counts the same whatever else the machine is doing):
//!
//! ```sh
//! valgrind --tool=callgrind target/release/profile-layer fresh 40000
//! ```
//!
//! Modes: `bare` (no layer, no key), `none` (the layer around the app, no key), `fresh`
//! (a new key per request), `replay` (one key, replayed after the first request),
//! `identity` (a no-op layer with `Router::layer`, no key), `per-route` (our layer with
//! `Router::layer`, no key). Compare two modes' totals, divided by the request count.
//!
//! A third argument `metrics-off` builds the layer `with_metrics(false)`: the same
//! requests without a single metrics call, to count what recording metrics costs when
//! no recorder is installed (none ever is here).

use std::convert::Infallible;

use axum::body::Body;
use http::{HeaderValue, Request, Response, header};
use idempotency_core::{IDEMPOTENCY_KEY, IdempotencyLayer};
use idempotency_store_memory::MemoryStore;
use tower::{Layer, Service, ServiceExt};

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "fresh".to_owned());
    let requests: u64 = args
        .next()
        .map_or(20_000, |n| n.parse().expect("a request count"));
    let metrics = args.next().as_deref() != Some("metrics-off");
    let layer = IdempotencyLayer::new(MemoryStore::new().with_max_entries(100_000_000))
        .with_metrics(metrics);
    match mode.as_str() {
        "bare" => drive(benches::app::bare(), &mode, requests),
        "identity" => drive(
            benches::app::bare().layer(tower::layer::util::Identity::new()),
            &mode,
            requests,
        ),
        "per-route" => drive(benches::app::layered(layer), &mode, requests),
        "none" | "fresh" | "replay" => drive(layer.layer(benches::app::bare()), &mode, requests),
        other => panic!("unknown mode {other}"),
    }
}

fn drive<S>(app: S, mode: &str, requests: u64)
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        for n in 0..requests {
            let mut builder =
                Request::post(benches::app::PATH).header(header::CONTENT_TYPE, "application/json");
            match mode {
                "fresh" => {
                    let key = HeaderValue::try_from(format!("profile-{n}")).expect("a key");
                    builder = builder.header(IDEMPOTENCY_KEY, key);
                }
                "replay" => builder = builder.header(IDEMPOTENCY_KEY, "profile-fixed"),
                _ => {}
            }
            let request = builder
                .body(Body::from(benches::app::REQUEST_BODY))
                .expect("a valid request");
            let response = app.clone().oneshot(request).await.expect("infallible");
            let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .expect("the body");
            std::hint::black_box(body);
        }
    });
}
