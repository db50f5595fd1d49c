//! Vended credentials in a SQL database (secrets are never stored): a createTable
//! answer that carries secrets goes through the Iceberg profile over SQLite and
//! PostgreSQL; the raw rows of the records table never contain a secret, and the replay
//! still hands the client working credentials, loaded afresh.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{Request, StatusCode};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use idempotency_core::FullStore;
use serde_json::{Value, json};
use tower::{Layer, ServiceExt};

const KEY: &str = "0190f5a4-1c9e-7d2b-8a3f-5b6c7d8e9f01";
const SECRETS: [&str; 3] = ["secret-from-create", "fresh-secret-", "session-token-value"];

/// A catalog whose createTable and loadTable vend credentials, a new secret each load.
fn catalog(loads: Arc<AtomicUsize>) -> Router {
    fn answer(secret: String) -> Value {
        json!({
            "metadata-location": "file:///warehouse/db/events/metadata/00000.json",
            "metadata": {"format-version": 2},
            "config": {"s3.secret-access-key": secret, "s3.region": "eu-west-1"},
            "storage-credentials": [{"prefix": "s3://b/db", "config": {"s3.session-token": "session-token-value"}}]
        })
    }
    Router::new()
        .route(
            "/v1/namespaces/{ns}/tables",
            post(|| async { Json(answer("secret-from-create".into())) }),
        )
        .route(
            "/v1/namespaces/{ns}/tables/{table}",
            get(|State(loads): State<Arc<AtomicUsize>>, Path((_ns, _t)): Path<(String, String)>| async move {
                let n = loads.fetch_add(1, Ordering::SeqCst) + 1;
                Json(answer(format!("fresh-secret-{n}")))
            }),
        )
        .with_state(loads)
}

async fn create(app: &Router) -> (StatusCode, bool, Value) {
    let request = Request::post("/v1/namespaces/db/tables")
        .header("idempotency-key", KEY)
        .header("content-type", "application/json")
        .body(Body::from(json!({"name": "events"}).to_string()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, serde_json::from_slice(&body).unwrap())
}

/// Drives a create and its retry through the profile over `store`; returns the replay.
async fn create_and_retry(store: Arc<dyn FullStore>) -> Value {
    let loads = Arc::new(AtomicUsize::new(0));
    let layer = idempotency_iceberg::layer(store);
    let app = Router::new().fallback_service(layer.layer(catalog(loads)));
    let (status, replayed, first) = create(&app).await;
    assert_eq!((status, replayed), (StatusCode::OK, false));
    assert_eq!(
        first["config"]["s3.secret-access-key"],
        "secret-from-create"
    );
    let (status, replayed, replay) = create(&app).await;
    assert_eq!((status, replayed), (StatusCode::OK, true));
    replay
}

fn assert_fresh_credentials(replay: &Value) {
    assert_eq!(replay["config"]["s3.secret-access-key"], "fresh-secret-1");
    assert_eq!(
        replay["storage-credentials"][0]["config"]["s3.session-token"],
        "session-token-value"
    );
    assert_eq!(replay["config"]["s3.region"], "eu-west-1");
}

fn assert_no_secret(raw: &[u8]) {
    let raw = String::from_utf8_lossy(raw);
    for secret in SECRETS {
        assert!(
            !raw.contains(secret),
            "the database holds {secret:?}: {raw}"
        );
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_rows_never_hold_vended_credentials() {
    use idempotency_store_sql::{PoolSettings, SqliteStore};
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("records.db").display()
    );
    let store = SqliteStore::connect(&url, &PoolSettings::default())
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let pool = store.pool().clone();
    let replay = create_and_retry(Arc::new(store)).await;
    assert_fresh_credentials(&replay);
    let rows: Vec<(Vec<u8>, Vec<u8>)> =
        sqlx::query_as("SELECT response_body, response_headers FROM idempotency_records")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 1);
    for (body, headers) in rows {
        assert_no_secret(&body);
        assert_no_secret(&headers);
        assert!(String::from_utf8_lossy(&body).contains("metadata-location"));
    }
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_rows_never_hold_vended_credentials() {
    use idempotency_store_sql::{PoolSettings, PostgresStore};
    let url = std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let store = match PostgresStore::connect(&url, &PoolSettings::default()).await {
        Ok(store) => store,
        Err(error) => {
            common::unreachable::<()>("PostgreSQL", &url, "IDEMPOTENCY_TEST_POSTGRES_URL", error);
            return;
        }
    };
    let table = common::unique_table();
    let store = store
        .with_table_name(&table)
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let pool = store.pool().clone();
    let replay = create_and_retry(Arc::new(store)).await;
    assert_fresh_credentials(&replay);
    let rows: Vec<(Vec<u8>, Vec<u8>)> = sqlx::query_as(&format!(
        "SELECT response_body, response_headers FROM \"{table}\""
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 1);
    for (body, headers) in rows {
        assert_no_secret(&body);
        assert_no_secret(&headers);
    }
    sqlx::query(&format!("DROP TABLE \"{table}\""))
        .execute(&pool)
        .await
        .unwrap();
}
