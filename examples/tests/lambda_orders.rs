//! The `lambda-orders` function run for real under `lambda_runtime`, two instances at
//! once, against the Lambda Runtime API served here on loopback (what AWS serves to a
//! function's process: `GET …/invocation/next` hands out an event, `POST
//! …/invocation/{id}/response` or `/error` takes its answer), as `lambda_runtime`'s own
//! tests do. A client's retry of an order, with a later `sent_at`, delivered to both
//! instances at once gets the first result from both; another order under the same id
//! is refused; an event without the key says so. Not tested: AWS itself.
//!
//! PostgreSQL is taken from `IDEMPOTENCY_TEST_POSTGRES_URL`; under `CI=true` an
//! unreachable database fails the test.

use std::collections::{HashMap, VecDeque};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use idempotency_store_sql::sqlx::{self, PgPool};
use serde_json::{Value, json};
use tokio::sync::Notify;

fn postgres_url() -> String {
    std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The Runtime API's side: events waiting for an instance, and the answers received.
#[derive(Default)]
struct RuntimeApi {
    events: Mutex<VecDeque<(String, Value)>>,
    answers: Mutex<HashMap<String, (&'static str, Value)>>,
    event_queued: Notify,
    answered: Notify,
}

impl RuntimeApi {
    fn invoke(&self, request_id: &str, event: Value) {
        self.events
            .lock()
            .unwrap()
            .push_back((request_id.to_owned(), event));
        self.event_queued.notify_waiters();
    }

    /// The answer to `request_id`: ("response" or "error", its body).
    async fn answer(&self, request_id: &str) -> (&'static str, Value) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let answered = self.answered.notified();
            if let Some(answer) = self.answers.lock().unwrap().get(request_id) {
                return answer.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no answer to {request_id}");
            let _ = tokio::time::timeout(left, answered).await;
        }
    }
}

/// `GET /2018-06-01/runtime/invocation/next`: the next event, when there is one (an
/// instance waits for it, as on AWS).
async fn next(State(api): State<Arc<RuntimeApi>>) -> (HeaderMap, String) {
    loop {
        let queued = api.event_queued.notified();
        if let Some((request_id, event)) = api.events.lock().unwrap().pop_front() {
            let mut headers = HeaderMap::new();
            headers.insert("lambda-runtime-aws-request-id", request_id.parse().unwrap());
            headers.insert(
                "lambda-runtime-deadline-ms",
                "4102444800000".parse().unwrap(),
            );
            headers.insert(
                "lambda-runtime-invoked-function-arn",
                "arn:aws:lambda:eu-west-1:000000000000:function:orders"
                    .parse()
                    .unwrap(),
            );
            return (headers, event.to_string());
        }
        queued.await;
    }
}

async fn respond(
    kind: &'static str,
    api: Arc<RuntimeApi>,
    request_id: String,
    body: String,
) -> StatusCode {
    let body = serde_json::from_str(&body).unwrap_or(Value::String(body));
    api.answers.lock().unwrap().insert(request_id, (kind, body));
    api.answered.notify_waiters();
    StatusCode::ACCEPTED
}

/// A `lambda-orders` instance pointed at the Runtime API on `address`.
fn instance(address: std::net::SocketAddr, prefix: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_lambda-orders"))
        .env("AWS_LAMBDA_RUNTIME_API", address.to_string())
        .env("AWS_LAMBDA_FUNCTION_NAME", "orders")
        .env("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128")
        .env("AWS_LAMBDA_FUNCTION_VERSION", "1")
        .env("DATABASE_URL", postgres_url())
        .env("TABLE_PREFIX", prefix)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start lambda-orders")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_retried_on_two_instances_is_placed_once() {
    let postgres = match PgPool::connect(&postgres_url()).await {
        Ok(pool) => pool,
        Err(error) => {
            let ci = std::env::var("CI").is_ok_and(|value| value == "true");
            assert!(!ci, "PostgreSQL is unreachable under CI=true: {error}");
            eprintln!("skipped: PostgreSQL is unreachable ({error}); scripts/services starts it");
            return;
        }
    };
    let api = Arc::new(RuntimeApi::default());
    let app = Router::new()
        .route("/2018-06-01/runtime/invocation/next", get(next))
        .route(
            "/2018-06-01/runtime/invocation/{id}/response",
            post(|State(api), Path(id), body| respond("response", api, id, body)),
        )
        .route(
            "/2018-06-01/runtime/invocation/{id}/error",
            post(|State(api), Path(id), body| respond("error", api, id, body)),
        )
        .with_state(api.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let prefix = format!(
        "lambda_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let mut instances = [instance(address, &prefix), instance(address, &prefix)];

    // The first try and the client's retry, one to each instance, at once.
    api.invoke(
        "first",
        json!({"order_id": "o-1", "item": "book", "sent_at": 1}),
    );
    api.invoke(
        "retry",
        json!({"order_id": "o-1", "item": "book", "sent_at": 2}),
    );
    let (first, retry) = (api.answer("first").await, api.answer("retry").await);
    assert_eq!(first.0, "response", "{first:?}");
    assert_eq!(retry, first, "the retry gets the first result");
    // Another order under the same id is refused; another id is placed.
    api.invoke(
        "reused",
        json!({"order_id": "o-1", "item": "pen", "sent_at": 3}),
    );
    let reused = api.answer("reused").await;
    assert_eq!(reused.0, "error", "{reused:?}");
    assert!(reused.1.to_string().contains("already used"), "{reused:?}");
    api.invoke("second", json!({"order_id": "o-2", "item": "pen"}));
    let second = api.answer("second").await;
    assert_eq!(second.0, "response", "{second:?}");
    assert_ne!(second.1["row"], first.1["row"]);
    // An event without the key is not placed, and says why.
    api.invoke("keyless", json!({"item": "pen"}));
    let keyless = api.answer("keyless").await;
    assert_eq!(keyless.0, "error", "{keyless:?}");
    assert!(keyless.1.to_string().contains("/order_id"), "{keyless:?}");

    for instance in &mut instances {
        let _ = instance.kill();
        let _ = instance.wait();
    }
    let rows: Vec<(String,)> = sqlx::query_as(&format!(
        "SELECT order_id FROM {prefix}_orders ORDER BY order_id"
    ))
    .fetch_all(&postgres)
    .await
    .unwrap();
    for table in ["orders", "records"] {
        sqlx::query(&format!("DROP TABLE IF EXISTS {prefix}_{table}"))
            .execute(&postgres)
            .await
            .unwrap();
    }
    assert_eq!(
        rows,
        [("o-1".to_owned(),), ("o-2".to_owned(),)],
        "each order placed once"
    );
}
