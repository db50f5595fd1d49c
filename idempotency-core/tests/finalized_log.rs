//! The operator's warning when an answer finalized in the handler's transaction changes
//! on its way out. Alone in its test binary: `tracing` caches whether a log line is
//! wanted, and a test on another thread, without a subscriber, could make it skip the
//! lines this one reads.

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http_body_util::BodyExt;
use idempotency_core::{IdempotencyLayer, IdempotencyStore, Ownership, ReservationHandle};
use idempotency_store_memory::MemoryStore;
use tower::ServiceExt;

/// Collects the formatted log lines.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a middleware between the handler and the layer does to a finalized answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnItsWayOut {
    Untouched,
    HeaderValueChanged,
    HeaderAdded,
    BodyChanged,
    StatusChanged,
}

/// `POST /orders`, whose handler writes its answer (201, an ETag, `finalized`) in its
/// "transaction" (straight into the memory store) and returns it marked; a middleware
/// between it and the layer then does `change` to it.
fn app(change: OnItsWayOut) -> Router {
    let store = Arc::new(MemoryStore::new());
    let records = store.clone();
    let handler = move |Extension(reservation): Extension<ReservationHandle>| {
        let records = records.clone();
        async move {
            let answer = (StatusCode::CREATED, [("etag", "\"o1\"")], "finalized").into_response();
            let prepared = reservation.prepare_answer(answer).await.unwrap();
            let stored = prepared.stored().expect("a 201 is stored");
            let held = records
                .finalize(reservation.id(), reservation.token(), stored)
                .await
                .unwrap();
            assert_eq!(held, Ownership::Held);
            prepared.into_finalized::<Body>()
        }
    };
    let on_its_way_out = move |response: Response| async move {
        let (mut parts, mut body) = response.into_parts();
        match change {
            OnItsWayOut::Untouched => {}
            OnItsWayOut::HeaderValueChanged => {
                parts.headers.insert("etag", "\"o2\"".parse().unwrap());
            }
            OnItsWayOut::HeaderAdded => {
                parts.headers.insert("x-added", "1".parse().unwrap());
            }
            OnItsWayOut::BodyChanged => body = Body::from("rewritten"),
            OnItsWayOut::StatusChanged => parts.status = StatusCode::ACCEPTED,
        }
        Response::from_parts(parts, body)
    };
    Router::new()
        .route("/orders", post(handler))
        .layer(axum::middleware::map_response(on_its_way_out))
        .layer(IdempotencyLayer::from_shared_store(store))
}

/// A finalized answer that changed on its way out is sent as it was finalized, and the
/// operator is warned: the service meant to send something else. One that arrives as it
/// was finalized is no cause for a warning (a router's `Content-Length` is no change).
#[tokio::test]
async fn a_finalized_answer_changed_on_its_way_out_is_warned_about_and_only_then() {
    for change in [
        OnItsWayOut::Untouched,
        OnItsWayOut::HeaderValueChanged,
        OnItsWayOut::HeaderAdded,
        OnItsWayOut::BodyChanged,
        OnItsWayOut::StatusChanged,
    ] {
        let logs = Logs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || writer.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);

        let request = Request::post("/orders")
            .header("idempotency-key", "k")
            .body(Body::from("{}"))
            .unwrap();
        let response = app(change).oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "{change:?}");
        assert_eq!(response.headers()["etag"], "\"o1\"", "{change:?}");
        assert!(!response.headers().contains_key("x-added"), "{change:?}");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "finalized", "{change:?}");

        let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        let warned = text.contains("the response changed after the handler finalized it");
        assert_eq!(
            warned,
            change != OnItsWayOut::Untouched,
            "{change:?}, logged:\n{text}"
        );
        if change == OnItsWayOut::Untouched {
            assert!(
                text.contains("the handler stored the response in its own transaction"),
                "logged:\n{text}"
            );
        }
    }
}
