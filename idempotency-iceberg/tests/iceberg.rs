//! The Iceberg profile through the layer: routes, UUID keys, ErrorModel errors, 503 while
//! in flight, the advertised lifetime, and vended credentials kept out of the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use idempotency_core::{IdempotencyStore, RecordId, RecordState, SingleScope};
use idempotency_store_memory::MemoryStore;
use serde_json::{Value, json};
use tower::{Layer, ServiceExt};

const KEY: &str = "01890A5D-AC96-774B-BCCE-B302099A8057";

#[derive(Clone, Default)]
struct Catalog {
    creates: Arc<AtomicUsize>,
    loads: Arc<AtomicUsize>,
}

/// A catalog that vends a different secret on every table load, so a test can tell a
/// stored secret from a fresh one.
fn catalog(state: Catalog) -> Router {
    fn load_result(name: &str, secret: String) -> Value {
        json!({
            "metadata-location": format!("file:///warehouse/db/{name}/metadata/00000.json"),
            "metadata": {"format-version": 2, "table-uuid": "9c12d441-03fe-4693-9a96-a0705ddf69c1"},
            "config": {"s3.access-key-id": "AKIAEXAMPLE", "s3.secret-access-key": secret, "s3.region": "eu-west-1"},
            "storage-credentials": [{"prefix": "s3://bucket/db", "config": {"s3.session-token": "session-for-load"}}]
        })
    }
    async fn create(
        State(state): State<Catalog>,
        Json(request): Json<Value>,
    ) -> (StatusCode, Json<Value>) {
        state.creates.fetch_add(1, Ordering::SeqCst);
        let name = request["name"].as_str().unwrap().to_owned();
        (
            StatusCode::OK,
            Json(load_result(&name, "secret-from-create".into())),
        )
    }
    async fn load(
        State(state): State<Catalog>,
        Path((_prefix, _ns, table)): Path<(String, String, String)>,
        headers: HeaderMap,
    ) -> Result<Json<Value>, StatusCode> {
        if headers.get("authorization").map(|v| v.as_bytes()) != Some(b"Bearer alice") {
            return Err(StatusCode::FORBIDDEN);
        }
        let n = state.loads.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Json(load_result(&table, format!("fresh-secret-{n}"))))
    }
    async fn commit(State(state): State<Catalog>, headers: HeaderMap) -> Json<Value> {
        if let Some(ms) = headers.get("x-sleep-ms") {
            tokio::time::sleep(Duration::from_millis(ms.to_str().unwrap().parse().unwrap())).await;
        }
        state.creates.fetch_add(1, Ordering::SeqCst);
        Json(json!({"metadata-location": "file:///m/2.json", "metadata": {}}))
    }
    async fn config() -> Json<Value> {
        Json(json!({"defaults": {"clients": "4"}, "overrides": {}}))
    }
    Router::new()
        .route("/v1/config", get(config))
        .route("/v1/{prefix}/namespaces/{ns}/tables", post(create))
        .route(
            "/v1/{prefix}/namespaces/{ns}/tables/{table}",
            get(load).post(commit),
        )
        .route(
            "/v1/{prefix}/namespaces/{ns}/tables/{table}/metrics",
            post(commit),
        )
        .with_state(state)
}

fn request(method: &str, uri: &str, key: Option<&str>, body: Value) -> Request<Body> {
    let mut builder = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .header("authorization", "Bearer alice");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_string())).unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, Value) {
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (parts.status, parts.headers, json)
}

#[tokio::test]
async fn config_responses_advertise_the_lifetime_at_the_top_level() {
    let app = catalog(Catalog::default()).layer(
        idempotency_iceberg::layer(MemoryStore::new())
            .with_scope(SingleScope)
            .with_lifetime(Duration::from_secs(3600)),
    );
    let (status, _, config) = send(&app, request("GET", "/v1/config", None, Value::Null)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(config["idempotency-key-lifetime"], "PT1H");
    assert_eq!(
        config["defaults"],
        json!({"clients": "4"}),
        "defaults untouched"
    );
    assert!(config["defaults"].get("idempotency-key-lifetime").is_none());

    let without = catalog(Catalog::default());
    let (_, _, config) = send(&without, request("GET", "/v1/config", None, Value::Null)).await;
    assert!(
        config.get("idempotency-key-lifetime").is_none(),
        "absent when disabled"
    );
}

#[tokio::test]
async fn keys_must_be_uuids_and_errors_are_error_models() {
    let state = Catalog::default();
    let app = catalog(state.clone())
        .layer(idempotency_iceberg::layer(MemoryStore::new()).with_scope(SingleScope));
    let (status, _, error) = send(
        &app,
        request(
            "POST",
            "/v1/p/namespaces/db/tables",
            Some("not-a-uuid"),
            json!({"name": "t"}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error["error"]["type"], "BadRequestException");
    assert_eq!(error["error"]["code"], 400);
    assert!(error["error"]["message"].as_str().unwrap().contains("UUID"));

    send(
        &app,
        request(
            "POST",
            "/v1/p/namespaces/db/tables",
            Some(KEY),
            json!({"name": "t"}),
        ),
    )
    .await;
    let (status, _, error) = send(
        &app,
        request(
            "POST",
            "/v1/p/namespaces/db/tables",
            Some(KEY),
            json!({"name": "other"}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(error["error"]["type"], "IdempotencyKeyReusedException");
    assert_eq!(state.creates.load(Ordering::SeqCst), 1);

    // Routes outside the spec's list are left alone, key or not.
    let (status, headers, _) = send(
        &app,
        request(
            "POST",
            "/v1/p/namespaces/db/tables/t/metrics",
            Some("not-a-uuid"),
            json!({}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("idempotent-replayed").is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_commit_still_running_gets_503_with_retry_after() {
    let state = Catalog::default();
    let app = catalog(state.clone()).layer(
        idempotency_iceberg::layer(MemoryStore::new())
            .with_scope(SingleScope)
            .with_in_flight_wait(Duration::from_millis(50)),
    );
    let mut slow = request(
        "POST",
        "/v1/p/namespaces/db/tables/t",
        Some(KEY),
        json!({"updates": []}),
    );
    slow.headers_mut()
        .insert("x-sleep-ms", "400".parse().unwrap());
    let owner = tokio::spawn({
        let app = app.clone();
        async move { send(&app, slow).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, headers, error) = send(
        &app,
        request(
            "POST",
            "/v1/p/namespaces/db/tables/t",
            Some(KEY),
            json!({"updates": []}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.contains_key("retry-after"));
    assert_eq!(error["error"]["code"], 503);
    assert_eq!(owner.await.unwrap().0, StatusCode::OK);
    let (status, headers, _) = send(
        &app,
        request(
            "POST",
            "/v1/p/namespaces/db/tables/t",
            Some(KEY),
            json!({"updates": []}),
        ),
    )
    .await;
    assert_eq!(
        (status, &headers["idempotent-replayed"]),
        (StatusCode::OK, &"true".parse().unwrap())
    );
    assert_eq!(state.creates.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn vended_credentials_are_never_stored_and_replays_get_fresh_ones() {
    let state = Catalog::default();
    let store = MemoryStore::new();
    // The layer wraps the whole router, so that a replay can reach loadTable.
    let wrapped = idempotency_iceberg::layer(store.clone())
        .with_scope(SingleScope)
        .layer(catalog(state.clone()));
    let app = Router::new().fallback_service(wrapped);
    let create = || {
        request(
            "POST",
            "/v1/p/namespaces/db/tables",
            Some(KEY),
            json!({"name": "events"}),
        )
    };

    let (status, _, first) = send(&app, create()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        first["config"]["s3.secret-access-key"],
        "secret-from-create"
    );

    // What the store holds: no secret, no storage credentials.
    let record = store
        .load(&RecordId::new("", KEY.to_ascii_lowercase()))
        .await
        .unwrap()
        .unwrap();
    let RecordState::Completed(stored) = record.state else {
        panic!("not completed")
    };
    let raw = String::from_utf8_lossy(&stored.body);
    for secret in [
        "secret-from-create",
        "AKIAEXAMPLE",
        "session-for-load",
        "storage-credentials",
    ] {
        assert!(!raw.contains(secret), "the store holds {secret}: {raw}");
    }
    assert!(raw.contains("eu-west-1"), "non-secret config is kept");

    // The replay carries fresh credentials, loaded with the retry's own authorization.
    let (status, headers, replay) = send(&app, create()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replay["config"]["s3.secret-access-key"], "fresh-secret-1");
    assert_eq!(
        replay["storage-credentials"][0]["config"]["s3.session-token"],
        "session-for-load"
    );
    assert_eq!(replay["metadata-location"], first["metadata-location"]);
    assert_eq!(
        state.creates.load(Ordering::SeqCst),
        1,
        "the create ran once"
    );

    // A retry whose caller may not load the table gets the replay without secrets.
    let mut stranger = create();
    stranger
        .headers_mut()
        .insert("authorization", "Bearer mallory".parse().unwrap());
    let (status, _, replay) = send(&app, stranger).await;
    assert_eq!(status, StatusCode::OK);
    assert!(replay["config"].get("s3.secret-access-key").is_none());
    assert!(replay.get("storage-credentials").is_none());
}

#[tokio::test]
async fn with_per_route_layering_a_replay_goes_out_without_credentials() {
    // `Router::layer` wraps each route on its own: the createTable route cannot reach
    // loadTable, so the replay carries no credentials (and never the stored ones).
    let app = catalog(Catalog::default())
        .layer(idempotency_iceberg::layer(MemoryStore::new()).with_scope(SingleScope));
    let create = || {
        request(
            "POST",
            "/v1/p/namespaces/db/tables",
            Some(KEY),
            json!({"name": "events"}),
        )
    };
    let (_, _, first) = send(&app, create()).await;
    assert_eq!(
        first["config"]["s3.secret-access-key"],
        "secret-from-create"
    );
    let (status, headers, replay) = send(&app, create()).await;
    assert_eq!(
        (status, &headers["idempotent-replayed"]),
        (StatusCode::OK, &"true".parse().unwrap())
    );
    assert!(replay["config"].get("s3.secret-access-key").is_none());
    assert_eq!(replay["metadata-location"], first["metadata-location"]);
}

/// A catalog that writes its table-loading answers by hand, with its own spacing and key
/// order (no JSON library would reproduce them), secrets last. Answers for `plain` carry
/// no credentials. Every load vends a new secret.
fn handwritten_catalog(loads: Arc<AtomicUsize>) -> Router {
    fn answer(table: &str, n: usize) -> String {
        if table == "plain" {
            return r#"{"metadata-location": "file:///w/db/plain/m.json",  "metadata":{"z":1,"a":2}, "config":{"s3.region":"eu-west-1"}}"#.to_owned();
        }
        format!(
            r#"{{"metadata-location": "file:///w/db/{table}/m.json",  "metadata":{{"z":1,"a":2}}, "config":{{"s3.region":"eu-west-1","s3.secret-access-key":"SECRET-{n}"}},"storage-credentials":[{{"prefix":"s3://b","config":{{"s3.session-token":"TOKEN-{n}"}}}}]}}"#
        )
    }
    async fn create(body: String) -> ([(&'static str, &'static str); 1], String) {
        let request: Value = serde_json::from_str(&body).unwrap();
        let table = request["name"].as_str().unwrap().to_owned();
        ([("content-type", "application/json")], answer(&table, 0))
    }
    async fn load(
        State(loads): State<Arc<AtomicUsize>>,
        Path((_prefix, _ns, table)): Path<(String, String, String)>,
    ) -> ([(&'static str, &'static str); 1], String) {
        let n = loads.fetch_add(1, Ordering::SeqCst) + 1;
        ([("content-type", "application/json")], answer(&table, n))
    }
    Router::new()
        .route("/v1/{prefix}/namespaces/{ns}/tables", post(create))
        .route("/v1/{prefix}/namespaces/{ns}/tables/{table}", get(load))
        .with_state(loads)
}

async fn raw(app: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, String) {
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

/// A replay is the first answer byte for byte: untouched (and nothing reloaded) when it
/// vended no credentials; with fresh credentials in place of the first ones otherwise.
#[tokio::test]
async fn replays_are_the_first_answer_byte_for_byte_but_for_fresh_credentials() {
    let loads = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::new();
    let wrapped = idempotency_iceberg::layer(store.clone())
        .with_scope(SingleScope)
        .layer(handwritten_catalog(loads.clone()));
    let app = Router::new().fallback_service(wrapped);
    let create = |table: &str, key: &str| {
        request(
            "POST",
            "/v1/p/namespaces/db/tables",
            Some(key),
            json!({"name": table}),
        )
    };

    let plain_key = "4d3b2a10-0c5e-4a8f-9b1e-1f2e3d4c5b6a";
    let (_, _, first) = raw(&app, create("plain", plain_key)).await;
    let (status, headers, replay) = raw(&app, create("plain", plain_key)).await;
    assert_eq!(
        (status, &headers["idempotent-replayed"]),
        (StatusCode::OK, &"true".parse().unwrap())
    );
    assert_eq!(
        replay, first,
        "an answer without credentials is replayed as its bytes"
    );
    assert_eq!(
        loads.load(Ordering::SeqCst),
        0,
        "and nothing is reloaded for it"
    );

    let (_, _, first) = raw(&app, create("events", KEY)).await;
    let record = store
        .load(&RecordId::new("", KEY.to_ascii_lowercase()))
        .await
        .unwrap()
        .unwrap();
    let RecordState::Completed(stored) = record.state else {
        panic!("not completed")
    };
    assert_eq!(
        String::from_utf8_lossy(&stored.body),
        r#"{"metadata-location": "file:///w/db/events/m.json",  "metadata":{"z":1,"a":2}, "config":{"s3.region":"eu-west-1"}}"#,
        "the store holds the first answer with the credentials cut out, every other byte kept"
    );
    let (status, headers, replay) = raw(&app, create("events", KEY)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert!(
        headers
            .keys()
            .all(|name| !name.as_str().starts_with("x-idempotency")),
        "the profile's own note is never sent: {headers:?}"
    );
    assert_eq!(
        replay,
        first
            .replace("SECRET-0", "SECRET-1")
            .replace("TOKEN-0", "TOKEN-1"),
        "the replay is the first answer with fresh credentials in place"
    );
    assert_eq!(loads.load(Ordering::SeqCst), 1);
}
