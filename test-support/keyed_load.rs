//! The keyed load the failover tests of the Redis and the SQL stores share
//! (`idempotency-store-redis/tests/failover.rs`, `idempotency-store-sql/tests/failover.rs`,
//! each including this file with `#[path]`): a service whose handler counts its
//! executions per key outside the store, and clients that send each key until it is
//! answered, as the Iceberg Java client does.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::{IdempotencyLayer, IdempotencyStore};
use tower::ServiceExt;

#[derive(Clone, Default)]
pub(crate) struct Executions(pub(crate) Arc<Mutex<HashMap<String, u32>>>);

pub(crate) async fn mutate(
    State(executions): State<Executions>,
    Path(name): Path<String>,
) -> (StatusCode, String) {
    *executions
        .0
        .lock()
        .unwrap()
        .entry(name.clone())
        .or_default() += 1;
    // Long enough that a kill also meets requests between reserve and finalize.
    tokio::time::sleep(Duration::from_millis(20)).await;
    (StatusCode::CREATED, format!("created {name}"))
}

/// A mutation that takes no time, for measuring what the store adds.
pub(crate) async fn quick(Path(name): Path<String>) -> (StatusCode, String) {
    (StatusCode::CREATED, format!("created {name}"))
}

/// One service instance: the layer over its own store handle.
pub(crate) fn app(store: impl IdempotencyStore, executions: Executions) -> Router {
    Router::new()
        .route("/mutations/{name}", post(mutate))
        .route("/quick/{name}", post(quick))
        .with_state(executions)
        .layer(
            IdempotencyLayer::new(store)
                .with_lease(Duration::from_secs(3))
                .with_in_flight_wait(Duration::from_secs(2))
                .with_finalize_retry_for(Duration::from_secs(10)),
        )
}

pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) replayed: bool,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) body: String,
}

pub(crate) async fn send(app: &Router, name: &str) -> Answer {
    send_to(app, "mutations", name).await
}

pub(crate) async fn send_to(app: &Router, route: &str, name: &str) -> Answer {
    let request = Request::post(format!("/{route}/{name}"))
        .header("idempotency-key", format!("key-{name}"))
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|value| value.to_str().ok()?.parse().ok())
        .map(Duration::from_secs);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        replayed,
        retry_after,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// What the clients saw.
#[derive(Default)]
pub(crate) struct Seen {
    /// Keys that got an answer (2xx), and whether it came back on the first attempt.
    pub(crate) answered: Mutex<Vec<String>>,
    pub(crate) gave_up: AtomicUsize,
    pub(crate) attempts: AtomicUsize,
    pub(crate) refused: AtomicUsize,
    /// When the last attempt that got no answer (503, 409, 429) was answered.
    pub(crate) last_failure: Mutex<Option<Instant>>,
}

pub(crate) const ATTEMPTS: usize = 6;

/// Sends mutation `name` until it is answered, like the Iceberg Java client: the same key
/// on up to six attempts, each retry after `Retry-After` (or an exponential backoff), to
/// the other service instance. The first answer of every fourth key is lost on its way
/// back, and the client retries it.
pub(crate) async fn send_until_answered(apps: &[Router; 2], n: usize, seen: &Seen) {
    let name = format!("m{n}");
    let mut lose_answer = n.is_multiple_of(4);
    let mut backoff = Duration::from_millis(100);
    for attempt in 0..ATTEMPTS {
        seen.attempts.fetch_add(1, Ordering::Relaxed);
        let answer = send(&apps[(n + attempt) % 2], &name).await;
        match answer.status {
            status if status.is_success() => {
                assert_eq!(answer.body, format!("created {name}"), "a wrong answer");
                if lose_answer {
                    lose_answer = false;
                    tokio::time::sleep(backoff).await;
                } else {
                    seen.answered.lock().unwrap().push(name);
                    return;
                }
            }
            StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::CONFLICT
            | StatusCode::TOO_MANY_REQUESTS => {
                seen.refused.fetch_add(1, Ordering::Relaxed);
                *seen.last_failure.lock().unwrap() = Some(Instant::now());
                assert!(
                    answer.retry_after.is_some(),
                    "{} without Retry-After",
                    answer.status
                );
                tokio::time::sleep(answer.retry_after.unwrap_or(backoff)).await;
            }
            other => panic!("{name}: unexpected status {other}: {}", answer.body),
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
    seen.gave_up.fetch_add(1, Ordering::Relaxed);
}
