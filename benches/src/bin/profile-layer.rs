//! Runs one in-process scenario many times, for a profiler (`valgrind --tool=callgrind`).

use axum::body::Body;
use http::{HeaderValue, Request, header};
use idempotency_core::{IDEMPOTENCY_KEY, IdempotencyLayer};
use idempotency_store_memory::MemoryStore;
use tower::ServiceExt;

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "fresh".to_owned());
    let n: u64 = args.next().map_or(20_000, |n| n.parse().expect("count"));
    let layer = IdempotencyLayer::new(MemoryStore::new().with_max_entries(100_000_000));
    let router = match mode.as_str() {
        "bare" => benches::app::bare(),
        "identity" => benches::app::bare().layer(tower::layer::util::Identity::new()),
        "outer" => {
            axum::Router::new().fallback_service(tower::Layer::layer(&layer, benches::app::bare()))
        }
        _ => benches::app::layered(layer),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        for i in 0..n {
            let mut builder =
                Request::post(benches::app::PATH).header(header::CONTENT_TYPE, "application/json");
            match mode.as_str() {
                "fresh" => {
                    builder = builder.header(
                        IDEMPOTENCY_KEY,
                        HeaderValue::try_from(format!("k-{i}")).expect("key"),
                    )
                }
                "replay" => builder = builder.header(IDEMPOTENCY_KEY, "k-fixed"),
                _ => {}
            }
            let request = builder
                .body(Body::from(benches::app::REQUEST_BODY))
                .expect("request");
            let response = router.clone().oneshot(request).await.expect("infallible");
            let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .expect("body");
            std::hint::black_box(body);
        }
    });
}
