//! The layer's `tracing` spans, in a test binary of its own: `tracing` caches per call site
//! whether anyone listens, and a test beside it that ran with no subscriber could leave the
//! cache saying no.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use idempotency_client::IdempotentRetryLayer;
use tower::{BoxError, Layer, ServiceExt, service_fn};

/// One `idempotent_request` span per logical request, one `attempt` span per attempt
/// inside it.
#[tokio::test(start_paused = true)]
async fn each_request_is_one_span_with_its_attempts_inside() {
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::registry::LookupSpan;

    /// A span's name and its parent's.
    type Named = (String, Option<String>);
    #[derive(Clone, Default)]
    struct Spans(Arc<Mutex<Vec<Named>>>);
    impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Spans {
        fn on_new_span(
            &self,
            _: &tracing::span::Attributes<'_>,
            id: &tracing::span::Id,
            context: Context<'_, S>,
        ) {
            let span = context.span(id).unwrap();
            let parent = span.parent().map(|parent| parent.name().to_owned());
            self.0
                .lock()
                .unwrap()
                .push((span.name().to_owned(), parent));
        }
    }

    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry()
        .with(spans.clone())
        .with(tracing_subscriber::filter::LevelFilter::DEBUG);
    let _guard = tracing::subscriber::set_default(subscriber);
    let calls = Arc::new(Mutex::new(0));
    let service = service_fn(move |_: Request<Full<Bytes>>| {
        let calls = Arc::clone(&calls);
        async move {
            let mut calls = calls.lock().unwrap();
            *calls += 1;
            if *calls == 1 {
                return Err::<Response<Full<Bytes>>, BoxError>("connection reset".into());
            }
            let mut created = Response::new(Full::new(Bytes::new()));
            *created.status_mut() = StatusCode::CREATED;
            Ok(created)
        }
    });
    let layer = IdempotentRetryLayer::new()
        .with_backoff(Duration::from_millis(100), Duration::from_secs(1));
    let request = Request::post("http://orders.test/orders")
        .body(Full::new(Bytes::from_static(b"book")))
        .unwrap();
    layer.layer(service).oneshot(request).await.unwrap();
    let spans = spans.0.lock().unwrap().clone();
    let request = ("idempotent_request".to_owned(), None);
    let attempt = ("attempt".to_owned(), Some("idempotent_request".to_owned()));
    assert_eq!(spans, vec![request, attempt.clone(), attempt]);
}
