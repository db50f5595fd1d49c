//! Two replicas, each with its own `IdempotencyLayer` and its own pool, over one
//! PostgreSQL database and again over one MariaDB database: one key
//! hammered on both runs once, a retry on the other replica is replayed, and a replica
//! that crashes mid-request is taken over once its lease lapses, its late finalize
//! refused.
#![cfg(any(feature = "postgres", feature = "mysql"))]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::{
    FullStore, IdempotencyLayer, IdempotencyStore, Outcome, Ownership, RecordId, RecordState,
    RejectionKind, StoredResponse,
};
use idempotency_store_sql::PoolSettings;
use tower::ServiceExt;

#[derive(Clone, Copy, Debug)]
enum Backend {
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "mysql")]
    MySql,
}

impl Backend {
    fn url(self) -> (String, &'static str) {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres => (
                std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
                "IDEMPOTENCY_TEST_POSTGRES_URL",
            ),
            #[cfg(feature = "mysql")]
            Self::MySql => (
                std::env::var("IDEMPOTENCY_TEST_MYSQL_URL")
                    .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned()),
                "IDEMPOTENCY_TEST_MYSQL_URL",
            ),
        }
    }

    /// One replica's store: a pool of its own on the shared table, migrated.
    async fn replica(self, table: &str) -> Option<Arc<dyn FullStore>> {
        let (url, env) = self.url();
        let settings = PoolSettings::default().max_connections(8);
        let opened: Result<Arc<dyn FullStore>, _> = match self {
            #[cfg(feature = "postgres")]
            Self::Postgres => {
                match idempotency_store_sql::PostgresStore::connect(&url, &settings).await {
                    Ok(store) => store
                        .with_table_name(table)
                        .unwrap()
                        .migrate()
                        .await
                        .map(|s| Arc::new(s) as _),
                    Err(error) => Err(error),
                }
            }
            #[cfg(feature = "mysql")]
            Self::MySql => {
                match idempotency_store_sql::MySqlStore::connect(&url, &settings).await {
                    Ok(store) => store
                        .with_table_name(table)
                        .unwrap()
                        .migrate()
                        .await
                        .map(|s| Arc::new(s) as _),
                    Err(error) => Err(error),
                }
            }
        };
        match opened {
            Ok(store) => Some(store),
            Err(error) => common::unreachable(&format!("{self:?}"), &url, env, error),
        }
    }

    async fn drop_table(self, table: &str) {
        let (url, _) = self.url();
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres => {
                let pool = sqlx::PgPool::connect(&url).await.unwrap();
                sqlx::query(&format!("DROP TABLE IF EXISTS \"{table}\""))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
            #[cfg(feature = "mysql")]
            Self::MySql => {
                let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
                sqlx::query(&format!("DROP TABLE IF EXISTS `{table}`"))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
    }
}

/// The service's side effect, shared by both replicas (as a catalog's database would be).
#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

/// `POST /tables` counts its calls, sleeps for `x-sleep-ms`, answers 201 with the call
/// number in the body.
fn app(calls: Calls, layer: IdempotencyLayer) -> Router {
    async fn create(State(calls): State<Calls>, headers: HeaderMap) -> Response {
        let n = calls.0.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(ms) = headers.get("x-sleep-ms") {
            let ms: u64 = ms.to_str().unwrap().parse().unwrap();
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        (
            StatusCode::CREATED,
            [("content-type", "application/json")],
            format!(r#"{{"call":{n}}}"#),
        )
            .into_response()
    }
    Router::new()
        .route("/tables", post(create))
        .with_state(calls)
        .layer(layer)
}

fn request(key: &str, sleep_ms: u64) -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri("/tables")
        .header("idempotency-key", key)
        .header("x-sleep-ms", sleep_ms.to_string())
        .body(Body::from(r#"{"name":"t1"}"#))
        .unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, Vec<u8>, Option<Outcome>) {
    let response = app.clone().oneshot(request).await.unwrap();
    let outcome = response.extensions().get::<Outcome>().copied();
    let (parts, body) = response.into_parts();
    (
        parts.status,
        body.collect().await.unwrap().to_bytes().to_vec(),
        outcome,
    )
}

/// Which path the replicas reserve on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Commits {
    /// A typed store: the record committed on its own, before the handler runs.
    Two,
    /// `OneCommitStore` on the backend's typed pool: the record reserved in a transaction
    /// the layer commits with the answer (the handler here writes nothing of its own).
    #[cfg(feature = "any")]
    One,
}

impl Backend {
    /// One replica's store on the path `commits` names.
    async fn replica_on(self, table: &str, commits: Commits) -> Option<Arc<dyn FullStore>> {
        let typed = self.replica(table).await?;
        match commits {
            Commits::Two => Some(typed),
            #[cfg(feature = "any")]
            Commits::One => {
                // On the backend's typed pool (`PgPool`, `MySqlPool`).
                let url = self.url().0;
                Some(match self {
                    #[cfg(feature = "postgres")]
                    Self::Postgres => one_commit::<sqlx::Postgres>(typed, &url, table).await,
                    #[cfg(feature = "mysql")]
                    Self::MySql => one_commit::<sqlx::MySql>(typed, &url, table).await,
                })
            }
        }
    }
}

/// A one-commit store on a pool of `DB` to `url`, over `typed`.
#[cfg(feature = "any")]
async fn one_commit<DB: idempotency_store_sql::RecordDatabase>(
    typed: Arc<dyn FullStore>,
    url: &str,
    table: &str,
) -> Arc<dyn FullStore> {
    let pool = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(8)
        .connect(url)
        .await
        .unwrap();
    let table = idempotency_store_sql::TableName::new(table).unwrap();
    let store = idempotency_store_sql::OneCommitStore::new(typed, pool, &table)
        .await
        .unwrap();
    Arc::new(store)
}

async fn one_key_over_two_replicas_runs_once(backend: Backend, commits: Commits) {
    let table = common::unique_table();
    let Some(a) = backend.replica_on(&table, commits).await else {
        return;
    };
    let Some(b) = backend.replica_on(&table, commits).await else {
        return;
    };
    let calls = Calls::default();
    let replicas = [
        app(calls.clone(), IdempotencyLayer::from_shared_store(a)),
        app(calls.clone(), IdempotencyLayer::from_shared_store(b)),
    ];
    let key = uuid::Uuid::new_v4().to_string();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let app = replicas[i % 2].clone();
        let key = key.clone();
        tasks.spawn(async move { send(&app, request(&key, 300)).await });
    }
    let (mut executed, mut replayed, mut in_flight) = (0, 0, 0);
    let mut bodies = std::collections::HashSet::new();
    while let Some(result) = tasks.join_next().await {
        let (status, body, outcome) = result.unwrap();
        match outcome {
            Some(Outcome::Executed) => executed += 1,
            Some(Outcome::Replayed) => replayed += 1,
            Some(Outcome::Rejected(RejectionKind::InFlight)) => {
                in_flight += 1;
                continue;
            }
            other => panic!("unexpected outcome {other:?} ({status})"),
        }
        assert_eq!(status, StatusCode::CREATED);
        bodies.insert(body);
    }
    assert_eq!(
        calls.0.load(Ordering::SeqCst),
        1,
        "the handler must run exactly once"
    );
    assert_eq!(executed, 1);
    assert_eq!(executed + replayed + in_flight, 64);
    assert_eq!(bodies.len(), 1, "every replay must be the first answer");

    // A later retry on either replica is the replay.
    for app in &replicas {
        let (status, body, outcome) = send(app, request(&key, 0)).await;
        assert_eq!(
            (status, outcome),
            (StatusCode::CREATED, Some(Outcome::Replayed))
        );
        assert!(bodies.contains(&body));
    }
    assert_eq!(calls.0.load(Ordering::SeqCst), 1);
    backend.drop_table(&table).await;
}

async fn a_request_finalized_on_a_is_replayed_on_b(backend: Backend) {
    let table = common::unique_table();
    let Some(a) = backend.replica(&table).await else {
        return;
    };
    let Some(b) = backend.replica(&table).await else {
        return;
    };
    let calls = Calls::default();
    let on_a = app(calls.clone(), IdempotencyLayer::from_shared_store(a));
    let on_b = app(calls.clone(), IdempotencyLayer::from_shared_store(b));
    let key = uuid::Uuid::new_v4().to_string();
    let first = send(&on_a, request(&key, 0)).await;
    assert_eq!(first.2, Some(Outcome::Executed));
    let retry = send(&on_b, request(&key, 0)).await;
    assert_eq!(retry.2, Some(Outcome::Replayed));
    assert_eq!((retry.0, &retry.1), (first.0, &first.1));
    assert_eq!(calls.0.load(Ordering::SeqCst), 1);
    backend.drop_table(&table).await;
}

async fn a_crashed_replica_is_taken_over_and_fenced(backend: Backend) {
    let table = common::unique_table();
    let Some(b) = backend.replica(&table).await else {
        return;
    };
    let calls = Calls::default();
    let key = uuid::Uuid::new_v4().to_string();
    let lease = Duration::from_millis(400);

    // Replica A lives on a runtime of its own; it starts the request (a slow handler),
    // then the whole runtime is torn down: its tasks, lease renewals and connections die
    // with it, as in a process crash.
    let crashed = std::thread::spawn({
        let (calls, key, table) = (calls.clone(), key.clone(), table.clone());
        move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let started = runtime.block_on(async {
                let a = backend.replica(&table).await?;
                let on_a = app(
                    calls.clone(),
                    IdempotencyLayer::from_shared_store(a).with_lease(lease),
                );
                tokio::spawn(async move { send(&on_a, request(&key, 60_000)).await });
                while calls.0.load(Ordering::SeqCst) == 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Some(())
            });
            runtime.shutdown_background();
            started
        }
    });
    if crashed.join().unwrap().is_none() {
        return;
    }
    let id = RecordId::new("", key.clone());
    let Some(RecordState::InFlight { token: old, .. }) =
        b.load(&id).await.unwrap().map(|r| r.state)
    else {
        panic!("the crashed replica left no in-flight record")
    };

    // The retry on B waits for the owner; the lease lapses; B takes over and runs.
    let on_b = app(
        calls.clone(),
        IdempotencyLayer::from_shared_store(b.clone()).with_in_flight_wait(Duration::from_secs(5)),
    );
    let (status, body, outcome) = send(&on_b, request(&key, 0)).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::TookOver))
    );
    assert_eq!(
        calls.0.load(Ordering::SeqCst),
        2,
        "A started, B ran after the takeover"
    );

    // A's late finalize (say A was only partitioned away, not dead) is refused.
    let Some(late_a) = backend.replica(&table).await else {
        return;
    };
    let stale = StoredResponse {
        status: 201,
        headers: vec![],
        body: "stale".into(),
        trailers: vec![],
    };
    assert_eq!(
        late_a.finalize(&id, old, &stale).await.unwrap(),
        Ownership::Lost
    );
    assert_eq!(
        late_a.renew(&id, old, lease).await.unwrap(),
        Ownership::Lost
    );
    assert_eq!(late_a.release(&id, old).await.unwrap(), Ownership::Lost);

    // Every later retry, on any replica, replays B's answer.
    let on_new_a = app(calls.clone(), IdempotencyLayer::from_shared_store(late_a));
    let (status, replay, outcome) = send(&on_new_a, request(&key, 0)).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Replayed))
    );
    assert_eq!(replay, body);
    assert_eq!(calls.0.load(Ordering::SeqCst), 2);
    backend.drop_table(&table).await;
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_key_over_two_replicas_runs_once() {
        super::one_key_over_two_replicas_runs_once(Backend::Postgres, Commits::Two).await;
    }

    #[cfg(feature = "any")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_key_over_two_replicas_runs_once_in_one_commit() {
        super::one_key_over_two_replicas_runs_once(Backend::Postgres, Commits::One).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_finalized_on_a_is_replayed_on_b() {
        super::a_request_finalized_on_a_is_replayed_on_b(Backend::Postgres).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crashed_replica_is_taken_over_and_fenced() {
        super::a_crashed_replica_is_taken_over_and_fenced(Backend::Postgres).await;
    }
}

#[cfg(feature = "mysql")]
mod mariadb {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_key_over_two_replicas_runs_once() {
        super::one_key_over_two_replicas_runs_once(Backend::MySql, Commits::Two).await;
    }

    #[cfg(feature = "any")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_key_over_two_replicas_runs_once_in_one_commit() {
        super::one_key_over_two_replicas_runs_once(Backend::MySql, Commits::One).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_finalized_on_a_is_replayed_on_b() {
        super::a_request_finalized_on_a_is_replayed_on_b(Backend::MySql).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crashed_replica_is_taken_over_and_fenced() {
        super::a_crashed_replica_is_taken_over_and_fenced(Backend::MySql).await;
    }
}
