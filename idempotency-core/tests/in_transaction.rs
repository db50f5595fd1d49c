//! The layer's side of finalizing inside the handler's own transaction: a handler
//! prepares its answer with the `ReservationHandle` (the layer's rules, the profile's
//! `KeepAnswer` included), writes it with its store, and returns the marked answer; the
//! layer then does not finalize again and sends exactly that answer. The memory store
//! stands in for the handler's database (the SQL stores' `finalize_in` is tested in
//! `idempotency-store-sql/tests/in_transaction.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http_body_util::BodyExt;
use idempotency_core::{
    Binding, FencingToken, IdempotencyLayer, IdempotencyRecord, IdempotencyStore, Outcome,
    Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, RecordState, Reservation,
    ReservationHandle, StoreError, StoredResponse,
};
use idempotency_store_memory::MemoryStore;
use serde_json::{Value, json};
use tower::ServiceExt;

/// The memory store, counting the finalizes the layer sends.
#[derive(Default)]
struct CountingStore {
    inner: MemoryStore,
    finalizes: AtomicUsize,
}

#[async_trait]
impl IdempotencyStore for CountingStore {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        self.inner.reserve(id, binding, lease, lifetime).await
    }
    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.inner.load(id).await
    }
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.inner.renew(id, token, lease).await
    }
    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        self.finalizes.fetch_add(1, Ordering::SeqCst);
        self.inner.finalize(id, token, response).await
    }
    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        self.inner.release(id, token).await
    }
    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        self.inner.take_over(id, lapsed, lease).await
    }
}

#[async_trait]
impl RecordAdmin for CountingStore {}

#[async_trait]
impl PurgeExpired for CountingStore {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        self.inner.purge_expired(batch_size).await
    }
}

/// The handler's "transaction": it writes the prepared answer straight into the records
/// (what a SQL store's `finalize_in` does in the handler's transaction), bypassing the
/// layer's count.
async fn finalize_in_handler(
    records: &CountingStore,
    reservation: &ReservationHandle,
    answer: Response,
) -> Response {
    let prepared = reservation.prepare_answer(answer).await.unwrap();
    let Some(stored) = prepared.stored() else {
        return prepared.into_response();
    };
    let held = records
        .inner
        .finalize(reservation.id(), reservation.token(), stored)
        .await
        .unwrap();
    assert_eq!(held, Ownership::Held);
    prepared.into_finalized()
}

fn keyed(uri: &str, key: &str) -> Request<Body> {
    Request::post(uri)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"name":"t"}"#))
        .unwrap()
}

async fn send(
    app: &Router,
    request: Request<Body>,
) -> (StatusCode, Vec<(String, String)>, Vec<u8>, Option<Outcome>) {
    let response = app.clone().oneshot(request).await.unwrap();
    let outcome = response.extensions().get::<Outcome>().copied();
    let (parts, body) = response.into_parts();
    let headers = parts
        .headers
        .iter()
        .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
        .collect();
    (
        parts.status,
        headers,
        body.collect().await.unwrap().to_bytes().to_vec(),
        outcome,
    )
}

async fn stored(store: &CountingStore, key: &str) -> StoredResponse {
    match store.load(&RecordId::new("", key)).await.unwrap() {
        Some(IdempotencyRecord {
            state: RecordState::Completed(stored),
            ..
        }) => stored,
        other => panic!("not completed: {other:?}"),
    }
}

#[tokio::test]
async fn an_answer_finalized_by_the_handler_is_not_finalized_again_and_is_what_retries_get() {
    let store = Arc::new(CountingStore::default());
    let records = store.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(
                move |Extension(reservation): Extension<ReservationHandle>| {
                    let records = records.clone();
                    async move {
                        let answer = (
                            StatusCode::CREATED,
                            [("content-type", "application/json"), ("etag", "\"o1\"")],
                            r#"{"order":1}"#,
                        )
                            .into_response();
                        finalize_in_handler(&records, &reservation, answer).await
                    }
                },
            ),
        )
        .layer(IdempotencyLayer::from_shared_store(store.clone()));

    let (status, headers, body, outcome) = send(&app, keyed("/orders", "k1")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body, br#"{"order":1}"#);
    assert_eq!(outcome, Some(Outcome::Executed));
    assert!(headers.contains(&("etag".to_owned(), "\"o1\"".to_owned())));
    assert_eq!(
        store.finalizes.load(Ordering::SeqCst),
        0,
        "the layer saw the answer finalized and did not finalize again"
    );
    let record = stored(&store, "k1").await;
    assert_eq!(
        (record.status, &record.body[..]),
        (201, &br#"{"order":1}"#[..])
    );

    let (status, headers, replayed, outcome) = send(&app, keyed("/orders", "k1")).await;
    assert_eq!(outcome, Some(Outcome::Replayed));
    assert_eq!((status, replayed), (StatusCode::CREATED, body));
    assert!(headers.contains(&("idempotent-replayed".to_owned(), "true".to_owned())));
}

/// Something between the handler and the layer changes the answer after it was
/// finalized: the caller still gets the finalized answer, the one retries get.
#[tokio::test]
async fn the_caller_gets_the_finalized_answer_even_if_it_changes_on_its_way_out() {
    let store = Arc::new(CountingStore::default());
    let records = store.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(
                move |Extension(reservation): Extension<ReservationHandle>| {
                    let records = records.clone();
                    async move {
                        let answer = (StatusCode::CREATED, "finalized").into_response();
                        finalize_in_handler(&records, &reservation, answer).await
                    }
                },
            ),
        )
        .layer(axum::middleware::map_response(
            |response: Response| async move {
                let (mut parts, _) = response.into_parts();
                parts.status = StatusCode::ACCEPTED;
                Response::from_parts(parts, Body::from("rewritten"))
            },
        ))
        .layer(IdempotencyLayer::from_shared_store(store.clone()));

    let (status, _, body, _) = send(&app, keyed("/orders", "k2")).await;
    assert_eq!(
        (status, &body[..]),
        (StatusCode::CREATED, &b"finalized"[..])
    );
    let record = stored(&store, "k2").await;
    assert_eq!((record.status, &record.body[..]), (201, &b"finalized"[..]));
    assert_eq!(store.finalizes.load(Ordering::SeqCst), 0);
}

/// A handler that finalized, then rolled back and answered an error instead: the
/// error carries no mark, so the layer's usual path applies (a 5xx releases the key).
/// (The memory store cannot roll back; the "transaction" here never wrote.)
#[tokio::test]
async fn an_answer_without_the_mark_takes_the_layers_usual_path() {
    let store = Arc::new(CountingStore::default());
    let app = Router::new()
        .route(
            "/orders",
            post(
                |Extension(reservation): Extension<ReservationHandle>| async move {
                    let prepared = reservation
                        .prepare_answer((StatusCode::CREATED, "made").into_response())
                        .await
                        .unwrap();
                    assert!(prepared.stored().is_some());
                    // The write failed or the transaction rolled back: answer the error.
                    StatusCode::SERVICE_UNAVAILABLE.into_response()
                },
            ),
        )
        .layer(IdempotencyLayer::from_shared_store(store.clone()));

    let (status, _, _, outcome) = send(&app, keyed("/orders", "k3")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(outcome, Some(Outcome::Released));
    assert!(
        store
            .load(&RecordId::new("", "k3"))
            .await
            .unwrap()
            .is_none()
    );
}

/// What the layer would not store is not prepared for storing either: 5xx and the
/// release statuses release the key; a body over the limit is not kept.
#[tokio::test]
async fn answers_the_layer_does_not_keep_have_nothing_to_store() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    let app = Router::new()
        .route(
            "/answer/{status}",
            post(
                move |Extension(reservation): Extension<ReservationHandle>,
                      axum::extract::Path(status): axum::extract::Path<u16>| {
                    let record = record.clone();
                    async move {
                        let body = if status == 200 {
                            vec![b'x'; 64]
                        } else {
                            vec![b'y'; 4]
                        };
                        let answer = (StatusCode::from_u16(status).unwrap(), body).into_response();
                        let prepared = reservation.prepare_answer(answer).await.unwrap();
                        record
                            .lock()
                            .unwrap()
                            .push((status, prepared.stored().is_some()));
                        prepared.into_response::<Body>()
                    }
                },
            ),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_max_response_body(32));
    for (n, status) in [201, 404, 500, 429, 200].into_iter().enumerate() {
        let (answered, _, _, _) =
            send(&app, keyed(&format!("/answer/{status}"), &format!("k{n}"))).await;
        assert_eq!(answered.as_u16(), status);
    }
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (201, true),
            (404, true),
            (500, false),
            (429, false),
            (200, false)
        ],
        "stored: 2xx and deterministic 4xx; not: 5xx, release statuses, over the limit"
    );
}

/// The Iceberg profile cuts vended credentials out of what is stored: through the
/// handler's finalize exactly as through the layer's. The caller gets them.
#[tokio::test]
async fn the_profiles_to_store_applies_to_an_answer_finalized_in_the_transaction() {
    let store = Arc::new(CountingStore::default());
    let records = store.clone();
    let app = Router::new()
        .route(
            "/v1/namespaces/{namespace}/tables",
            post(move |Extension(reservation): Extension<ReservationHandle>| {
                let records = records.clone();
                async move {
                    let answer = json!({
                        "metadata-location": "file:///w/db/t/metadata/00000-a.metadata.json",
                        "metadata": {"format-version": 2},
                        "config": {"s3.access-key-id": "AKIA", "s3.secret-access-key": "very-secret"}
                    });
                    let answer =
                        ([("content-type", "application/json")], answer.to_string()).into_response();
                    finalize_in_handler(&records, &reservation, answer).await
                }
            }),
        );
    let app = Router::new().fallback_service(tower_layer::Layer::layer(
        &idempotency_iceberg::layer(store.clone()),
        app,
    ));
    let key = uuid::Uuid::new_v4().to_string();

    let (status, _, body, _) = send(&app, keyed("/v1/namespaces/db/tables", &key)).await;
    assert_eq!(status, StatusCode::OK);
    let first: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(first["config"]["s3.secret-access-key"], "very-secret");
    let record = stored(&store, &key).await;
    let kept = String::from_utf8_lossy(&record.body);
    assert!(
        !kept.contains("very-secret") && kept.contains("metadata-location"),
        "credentials are cut out of the stored answer: {kept}"
    );
    assert_eq!(store.finalizes.load(Ordering::SeqCst), 0);
}

/// A body that ends with trailers (gRPC's status, a hyper service's `x-order`): the
/// trailers are stored with the answer written in the handler's transaction, and the
/// layer sends them with the finalized answer, first time and on replays.
#[tokio::test]
async fn trailers_are_stored_and_sent_with_an_answer_finalized_in_the_transaction() {
    use http_body::Frame;
    use http_body_util::{Full, StreamBody};
    use idempotency_core::IdempotencyBody;
    use tower_layer::Layer as _;

    let store = Arc::new(CountingStore::default());
    let records = store.clone();
    let handler = tower::service_fn(
        move |request: Request<IdempotencyBody<Full<bytes::Bytes>>>| {
            let records = records.clone();
            async move {
                let reservation = request
                    .extensions()
                    .get::<ReservationHandle>()
                    .unwrap()
                    .clone();
                let mut trailers = http::HeaderMap::new();
                trailers.insert("x-order", http::HeaderValue::from_static("7"));
                let frames = [
                    Ok::<_, std::convert::Infallible>(Frame::data(bytes::Bytes::from_static(
                        b"order 7",
                    ))),
                    Ok(Frame::trailers(trailers)),
                ];
                let answer = Response::new(StreamBody::new(futures_util::stream::iter(frames)));
                let prepared = reservation.prepare_answer(answer).await.unwrap();
                let stored = prepared.stored().unwrap();
                assert_eq!(stored.trailers.len(), 1, "{stored:?}");
                records
                    .inner
                    .finalize(reservation.id(), reservation.token(), stored)
                    .await
                    .unwrap();
                Ok::<_, std::convert::Infallible>(prepared.into_finalized::<Full<bytes::Bytes>>())
            }
        },
    );
    let service = IdempotencyLayer::from_shared_store(store.clone())
        .wrap_bodies()
        .layer(handler);

    for (n, replayed) in [(1, false), (2, true)] {
        let request = Request::post("/orders")
            .header("idempotency-key", "with-trailers")
            .body(Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        let response = service.clone().oneshot(request).await.unwrap();
        assert_eq!(
            response.headers().contains_key("idempotent-replayed"),
            replayed,
            "answer {n}"
        );
        let collected = response.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned().expect("trailers");
        assert_eq!(trailers["x-order"], "7", "answer {n}");
        assert_eq!(collected.to_bytes(), "order 7");
    }
    assert_eq!(store.finalizes.load(Ordering::SeqCst), 0);
}
