//! A database outage under load: while keyed requests stream through the layer over
//! PostgreSQL, every connection of the layer's pool is killed with
//! `pg_terminate_backend`, again and again. Requests that meet the outage get 503 with
//! `Retry-After` (fail-closed); no mutation runs twice; no finalized record is lost; the
//! service recovers by itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::IdempotencyLayer;
use idempotency_store_sql::sqlx::{self, PgPool};
use idempotency_store_sql::{PoolSettings, PostgresStore};
use tower::ServiceExt;

fn database_url() -> String {
    std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

#[derive(Clone, Default)]
struct Executions(Arc<Mutex<HashMap<String, u32>>>);

async fn mutate(
    State(executions): State<Executions>,
    Path(name): Path<String>,
) -> (StatusCode, String) {
    *executions
        .0
        .lock()
        .unwrap()
        .entry(name.clone())
        .or_default() += 1;
    (StatusCode::CREATED, format!("created {name}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_database_connections_fail_closed_and_recover() {
    let admin = match PgPool::connect(&database_url()).await {
        Ok(pool) => pool,
        Err(error) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!(
                "PostgreSQL at {} is unreachable under CI: {error}",
                database_url()
            )
        }
        Err(error) => {
            eprintln!("skipping: PostgreSQL is unreachable: {error}");
            return;
        }
    };
    let application = format!("outage_{}", uuid::Uuid::new_v4().simple());
    let table = format!("{application}_records");
    let separator = if database_url().contains('?') {
        '&'
    } else {
        '?'
    };
    let url = format!(
        "{}{separator}application_name={application}",
        database_url()
    );
    let store = PostgresStore::connect(
        &url,
        &PoolSettings::default().acquire_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap()
    .with_table_name(&table)
    .unwrap()
    .migrate()
    .await
    .unwrap();
    let executions = Executions::default();
    let app = Router::new()
        .route("/mutations/{name}", post(mutate))
        .with_state(executions.clone())
        // A reserve whose answer the outage swallowed leaves a reservation nobody owns;
        // a short lease lets the next request take it over quickly.
        .layer(
            IdempotencyLayer::new(store)
                .with_lease(Duration::from_secs(1))
                .with_finalize_retry_for(Duration::from_secs(5)),
        );

    // The outage: kill every connection of the layer's pool, ten times, 100 ms apart.
    let killer = tokio::spawn({
        let admin = admin.clone();
        let application = application.clone();
        async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1")
                    .bind(&application)
                    .execute(&admin)
                    .await
                    .unwrap();
            }
        }
    });

    let send = |name: String| {
        let app = app.clone();
        async move {
            let request = Request::post(format!("/mutations/{name}"))
                .header("idempotency-key", format!("key-{name}"))
                .body(Body::empty())
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let retry_after = response.headers().contains_key("retry-after");
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, replayed, retry_after, body)
        }
    };

    let mut answers: HashMap<String, Vec<(StatusCode, bool, bool)>> = HashMap::new();
    let mut round = 0;
    while !killer.is_finished() || round < 3 {
        round += 1;
        let batch: Vec<String> = (0..40)
            .map(|i| format!("m{}", (round * 40 + i) % 120))
            .collect();
        let results = futures_util::future::join_all(batch.iter().cloned().map(send)).await;
        for (name, (status, replayed, retry_after, _)) in batch.into_iter().zip(results) {
            answers
                .entry(name)
                .or_default()
                .push((status, replayed, retry_after));
        }
        assert!(round < 200, "the outage never ended");
    }
    killer.await.unwrap();

    let mut unavailable = 0;
    for (name, seen) in &answers {
        for (status, _, retry_after) in seen {
            match *status {
                StatusCode::CREATED => {}
                StatusCode::SERVICE_UNAVAILABLE => {
                    unavailable += 1;
                    assert!(retry_after, "503 without Retry-After for {name}");
                }
                other => panic!("{name}: unexpected status {other}"),
            }
        }
    }
    eprintln!("{unavailable} requests met the outage and got 503");

    // Recovered: every mutation now answers, and none ran twice.
    for name in answers.keys() {
        let (status, _, _, body) = send(name.clone()).await;
        assert_eq!(status, StatusCode::CREATED, "{name} did not recover");
        assert_eq!(body, format!("created {name}"));
    }
    let executions = executions.0.lock().unwrap().clone();
    for (name, count) in &executions {
        assert_eq!(*count, 1, "{name} ran {count} times");
    }
    // No finalized record was lost: every mutation that answered 201 before is replayed now.
    for (name, seen) in &answers {
        if seen
            .iter()
            .any(|(status, _, _)| *status == StatusCode::CREATED)
        {
            let (_, replayed, _, _) = send(name.clone()).await;
            assert!(replayed, "{name} answered 201 once but its record is gone");
        }
    }
    let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {table}"))
        .execute(&admin)
        .await;
}
