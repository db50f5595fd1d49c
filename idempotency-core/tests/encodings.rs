//! Wrapped services that compress: tower-http's `CompressionLayer` inside the wrapped
//! router (it honors the `Accept-Encoding: identity` the layer asks for), and a service
//! that compresses whatever it is asked (it does not). For the plain HTTP profile and the
//! Iceberg profile: nothing encoded is stored, no replay goes out in an encoding its retry
//! did not accept, vended credentials never reach the store, and `/v1/config` advertises
//! the layer's lifetime. Compression outside the layer (where it belongs) still
//! compresses first answers and replays alike.

use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use idempotency_core::{
    IdempotencyLayer, IdempotencyStore, Outcome, RecordId, RecordState, SingleScope,
};
use idempotency_store_memory::MemoryStore;
use serde_json::{Value, json};
use tower::{Layer, ServiceExt};
use tower_http::compression::CompressionLayer;

const KEY: &str = "01890a5d-ac96-774b-bcce-b302099a8057";

/// How the wrapped router compresses.
#[derive(Clone, Copy, Debug)]
enum Compressing {
    /// `CompressionLayer` as it is: compresses only what the request accepts.
    AsAsked,
    /// Compresses with gzip whatever the request accepts.
    Always,
}

/// `router` with compression inside it, as an existing service has it.
fn compressed(router: Router, how: Compressing) -> Router {
    let router = router.layer(CompressionLayer::new());
    match how {
        Compressing::AsAsked => router,
        Compressing::Always => router.layer(axum::middleware::map_request(
            |mut request: Request| async move {
                request
                    .headers_mut()
                    .insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
                request
            },
        )),
    }
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    /// The body as it came, encoded or not.
    raw: Bytes,
    outcome: Option<Outcome>,
}

impl Answer {
    fn encoding(&self) -> Option<&str> {
        self.headers
            .get(header::CONTENT_ENCODING)
            .map(|v| v.to_str().unwrap())
    }

    /// The body, gunzipped if it says it is gzip.
    fn plain(&self) -> String {
        match self.encoding() {
            None => String::from_utf8(self.raw.to_vec()).unwrap(),
            Some("gzip") => gunzip(&self.raw),
            Some(other) => panic!("unexpected encoding {other}"),
        }
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.plain()).unwrap()
    }
}

fn gunzip(bytes: &[u8]) -> String {
    let mut plain = String::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_string(&mut plain)
        .expect("a gzip body");
    plain
}

async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.unwrap();
    let outcome = response.extensions().get::<Outcome>().copied();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        raw: body.collect().await.unwrap().to_bytes(),
        outcome,
    }
}

fn request(
    method: &str,
    uri: &str,
    key: Option<&str>,
    accept: Option<&str>,
    body: Value,
) -> Request<Body> {
    let mut builder = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .header("authorization", "Bearer alice");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    if let Some(accept) = accept {
        builder = builder.header("accept-encoding", accept);
    }
    let body = if body.is_null() {
        Body::empty()
    } else {
        Body::from(body.to_string())
    };
    builder.body(body).unwrap()
}

/// The body a finished record holds.
async fn stored_body(store: &MemoryStore, key: &str) -> Bytes {
    let record = store
        .load(&RecordId::new("", key))
        .await
        .unwrap()
        .expect("a record");
    let RecordState::Completed(stored) = record.state else {
        panic!("the record is not completed")
    };
    assert!(
        !stored
            .headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-encoding")),
        "an encoding was stored: {:?}",
        stored.headers
    );
    stored.body
}

fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0x1f, 0x8b])
}

// ------------------------------------------------------------------------------------------
// The plain HTTP profile
// ------------------------------------------------------------------------------------------

/// `POST /orders`: counts its calls and answers with a long, compressible text that names
/// the Accept-Encoding it was asked with.
fn orders(calls: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/orders",
        post(move |headers: HeaderMap| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let accepted = headers
                    .get("accept-encoding")
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default();
                (
                    StatusCode::CREATED,
                    [("content-type", "text/plain")],
                    format!(
                        "order {n}, accepted {accepted:?}; {}",
                        "line item; ".repeat(50)
                    ),
                )
            }
        }),
    )
}

#[tokio::test]
async fn plain_http_compression_inside_is_asked_for_identity_and_replays_suit_every_retry() {
    let calls = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::new();
    let app = Router::new().fallback_service(
        IdempotencyLayer::new(store.clone())
            .with_scope(SingleScope)
            .layer(compressed(orders(calls.clone()), Compressing::AsAsked)),
    );

    // Unkeyed requests are the service's own business: it compresses them.
    let unkeyed = send(
        &app,
        request("POST", "/orders", None, Some("gzip"), Value::Null),
    )
    .await;
    assert_eq!(unkeyed.encoding(), Some("gzip"));

    let first = send(
        &app,
        request("POST", "/orders", Some("k-1"), Some("gzip"), Value::Null),
    )
    .await;
    assert_eq!(
        (first.status, first.outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    assert_eq!(first.encoding(), None, "the service was asked for identity");
    assert!(
        first.plain().contains(r#"accepted "identity""#),
        "{}",
        first.plain()
    );
    assert!(!is_gzip(&stored_body(&store, "k-1").await));

    for accept in [None, Some("gzip"), Some("br;q=1, gzip;q=0.5")] {
        let retry = send(
            &app,
            request("POST", "/orders", Some("k-1"), accept, Value::Null),
        )
        .await;
        assert_eq!(retry.outcome, Some(Outcome::Replayed), "{accept:?}");
        assert_eq!(retry.encoding(), None, "{accept:?}");
        assert_eq!(retry.raw, first.raw, "{accept:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn plain_http_compression_outside_the_layer_compresses_answers_and_replays() {
    let calls = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::new();
    // The recommended arrangement: compression outside, so the layer stores plain bytes
    // and each answer is compressed for the request it goes to.
    let app = Router::new()
        .fallback_service(
            IdempotencyLayer::new(store.clone())
                .with_scope(SingleScope)
                .layer(orders(calls.clone())),
        )
        .layer(CompressionLayer::new());

    let first = send(
        &app,
        request("POST", "/orders", Some("k-2"), Some("gzip"), Value::Null),
    )
    .await;
    assert_eq!(first.encoding(), Some("gzip"));
    let plain_first = first.plain();
    assert!(plain_first.contains("order 1"), "{plain_first}");
    assert!(!is_gzip(&stored_body(&store, "k-2").await));

    let gzip_retry = send(
        &app,
        request("POST", "/orders", Some("k-2"), Some("gzip"), Value::Null),
    )
    .await;
    assert_eq!(gzip_retry.outcome, Some(Outcome::Replayed));
    assert_eq!(gzip_retry.encoding(), Some("gzip"));
    assert_eq!(gzip_retry.plain(), plain_first);

    let plain_retry = send(
        &app,
        request("POST", "/orders", Some("k-2"), None, Value::Null),
    )
    .await;
    assert_eq!(plain_retry.outcome, Some(Outcome::Replayed));
    assert_eq!(plain_retry.encoding(), None);
    assert_eq!(plain_retry.plain(), plain_first);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn plain_http_a_service_that_compresses_unasked_is_not_stored_and_never_replayed_encoded() {
    let calls = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::new();
    let app = Router::new().fallback_service(
        IdempotencyLayer::new(store.clone())
            .with_scope(SingleScope)
            .layer(compressed(orders(calls.clone()), Compressing::Always)),
    );

    let first = send(
        &app,
        request("POST", "/orders", Some("k-3"), Some("gzip"), Value::Null),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.outcome, Some(Outcome::ExecutedNotStored));
    assert_eq!(
        first.encoding(),
        Some("gzip"),
        "its caller gets the answer as it came"
    );
    let stored = stored_body(&store, "k-3").await;
    assert!(!is_gzip(&stored), "an encoded body was stored");
    assert!(!String::from_utf8_lossy(&stored).contains("line item"));

    let retry = send(
        &app,
        request("POST", "/orders", Some("k-3"), None, Value::Null),
    )
    .await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.encoding(), None);
    assert!(retry.plain().contains("already ran"), "{}", retry.plain());
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the retry did not run it again"
    );
}

// ------------------------------------------------------------------------------------------
// The Iceberg profile
// ------------------------------------------------------------------------------------------

/// A catalog that vends a fresh secret on every table creation and load, and advertises a
/// key lifetime of its own (as catalogs with their own key handling do).
fn catalog(loads: Arc<AtomicUsize>) -> Router {
    fn load_result(name: &str, secret: String) -> Value {
        json!({
            "metadata-location": format!("file:///warehouse/db/{name}/metadata/00000.json"),
            "metadata": {"format-version": 2, "table-uuid": "9c12d441-03fe-4693-9a96-a0705ddf69c1",
                         "properties": {"padding": "x".repeat(300)}},
            "config": {"s3.region": "eu-west-1"},
            "storage-credentials": [{"prefix": "file:///warehouse/db",
                                     "config": {"s3.access-key-id": "AKIATEST", "s3.secret-access-key": secret}}]
        })
    }
    async fn create(
        State(loads): State<Arc<AtomicUsize>>,
        Json(request): Json<Value>,
    ) -> Json<Value> {
        let n = loads.fetch_add(1, Ordering::SeqCst) + 1;
        Json(load_result(
            request["name"].as_str().unwrap(),
            format!("secret-{n}"),
        ))
    }
    async fn load(
        State(loads): State<Arc<AtomicUsize>>,
        Path((_ns, table)): Path<(String, String)>,
    ) -> Json<Value> {
        let n = loads.fetch_add(1, Ordering::SeqCst) + 1;
        Json(load_result(&table, format!("secret-{n}")))
    }
    async fn config() -> Json<Value> {
        Json(
            json!({"defaults": {"padding": "x".repeat(300)}, "overrides": {}, "idempotency-key-lifetime": "PT24H"}),
        )
    }
    Router::new()
        .route("/v1/config", get(config))
        .route("/v1/namespaces/{ns}/tables", post(create))
        .route("/v1/namespaces/{ns}/tables/{table}", get(load))
        .with_state(loads)
}

fn create_table(accept: Option<&str>) -> Request<Body> {
    request(
        "POST",
        "/v1/namespaces/db/tables",
        Some(KEY),
        accept,
        json!({"name": "events"}),
    )
}

fn secret(answer: &Answer) -> String {
    answer.json()["storage-credentials"][0]["config"]["s3.secret-access-key"]
        .as_str()
        .unwrap_or_else(|| panic!("no secret in {}", answer.plain()))
        .to_owned()
}

#[tokio::test]
async fn iceberg_compression_inside_keeps_secrets_out_and_the_advertisement_right() {
    for outside in [false, true] {
        let loads = Arc::new(AtomicUsize::new(0));
        let store = MemoryStore::new();
        let wrapped = idempotency_iceberg::layer(store.clone())
            .with_scope(SingleScope)
            .layer(compressed(catalog(loads.clone()), Compressing::AsAsked));
        let mut app = Router::new().fallback_service(wrapped);
        if outside {
            app = app.layer(CompressionLayer::new());
        }
        let gzip_if_outside = outside.then_some("gzip");

        let config = send(
            &app,
            request("GET", "/v1/config", None, Some("gzip"), Value::Null),
        )
        .await;
        assert_eq!(config.encoding(), gzip_if_outside, "outside: {outside}");
        assert_eq!(
            config.json()["idempotency-key-lifetime"],
            "PT30M",
            "outside: {outside}"
        );

        let first = send(&app, create_table(Some("gzip"))).await;
        assert_eq!(first.outcome, Some(Outcome::Executed));
        assert_eq!(first.encoding(), gzip_if_outside, "outside: {outside}");
        assert_eq!(secret(&first), "secret-1");
        let stored =
            String::from_utf8(stored_body(&store, KEY).await.to_vec()).expect("plain JSON");
        assert!(
            !stored.contains("secret-1") && !stored.contains("AKIATEST"),
            "{stored}"
        );

        for (n, accept) in [(2, None), (3, Some("gzip"))] {
            let retry = send(&app, create_table(accept)).await;
            assert_eq!(retry.outcome, Some(Outcome::Replayed), "outside: {outside}");
            let expected_encoding = accept.and(gzip_if_outside);
            assert_eq!(
                retry.encoding(),
                expected_encoding,
                "outside: {outside}, {accept:?}"
            );
            assert_eq!(secret(&retry), format!("secret-{n}"), "fresh credentials");
            assert_eq!(retry.json()["metadata"], first.json()["metadata"]);
        }
    }
}

#[tokio::test]
async fn iceberg_a_catalog_that_compresses_unasked_stores_no_secret_and_is_still_advertised() {
    let loads = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::new();
    let app = Router::new().fallback_service(
        idempotency_iceberg::layer(store.clone())
            .with_scope(SingleScope)
            .layer(compressed(catalog(loads.clone()), Compressing::Always)),
    );

    // The layer decodes the config answer it amends, and sends it unencoded.
    for accept in [None, Some("gzip")] {
        let config = send(
            &app,
            request("GET", "/v1/config", None, accept, Value::Null),
        )
        .await;
        assert_eq!(config.status, StatusCode::OK);
        assert_eq!(config.encoding(), None, "{accept:?}");
        let body = config.json();
        assert_eq!(
            body["idempotency-key-lifetime"], "PT30M",
            "{accept:?}: {body}"
        );
        assert_eq!(body["defaults"]["padding"], "x".repeat(300));
    }
    // Unaffected: a read the layer does not amend goes out as the catalog sent it.
    let read = send(
        &app,
        request("GET", "/v1/namespaces/db/tables/t", None, None, Value::Null),
    )
    .await;
    assert_eq!(read.encoding(), Some("gzip"));

    let first = send(&app, create_table(Some("gzip"))).await;
    assert_eq!(first.outcome, Some(Outcome::ExecutedNotStored));
    assert_eq!(first.encoding(), Some("gzip"));
    assert!(secret(&first).starts_with("secret-"));
    let stored = stored_body(&store, KEY).await;
    assert!(!is_gzip(&stored));
    let stored = String::from_utf8(stored.to_vec()).unwrap();
    assert!(
        !stored.contains("secret-") && !stored.contains("AKIATEST"),
        "{stored}"
    );

    let retry = send(&app, create_table(None)).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.encoding(), None);
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(retry.json()["error"]["type"], "CommitStateUnknownException");
}
