//! Store checks run on a single server and on a cluster alike: the public conformance
//! suite and reference model, its multi-node checks with two store handles, native
//! expiry, and 64 racers through the layer over two handles.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::conformance::{self, model};
use idempotency_core::{
    FullStore, IdempotencyLayer, IdempotencyStore, Outcome, RecordId, RejectionKind, Reservation,
    Waited,
};
use idempotency_store_redis::RedisStore;
use redis::AsyncCommands as _;
use tower::ServiceExt as _;

use super::{binding, id, response};

/// The public conformance suite, with `second_node` (another handle on the same server
/// or cluster) as a second replica: every check runs (the store's reservations have a
/// lease, and it has every capability, so nothing is skipped).
pub async fn conformance_suite(store: Arc<dyn FullStore>, second_node: Arc<dyn FullStore>) {
    let report = conformance::Suite::full(store)
        .with_second_node(second_node)
        .run()
        .await;
    assert!(report.skipped.is_empty(), "{report}");
}

/// The reference model on `runs` more random sequences, from `first_seed`.
pub async fn reference_model(store: Arc<dyn FullStore>, first_seed: u64, runs: u64) {
    model::check_random_sequences(&store, first_seed, runs, 60).await;
}

async fn reserve_new(
    store: &dyn IdempotencyStore,
    id: &RecordId,
    lease: Duration,
    lifetime: Duration,
) -> idempotency_core::FencingToken {
    match store
        .reserve(id, &binding(), lease, lifetime)
        .await
        .unwrap()
    {
        Reservation::Reserved(token) => token,
        other => panic!("a fresh key answered {other:?}"),
    }
}

/// Redis-specific: records carry a native TTL that matches their expiry, renew and
/// take-over move it out, and an expired record's key is gone from the server.
pub async fn expiry_is_native(store: &RedisStore) {
    let mut connection = store.connection();
    let id = id();
    let key = store.record_key(&id);
    let token = reserve_new(store, &id, Duration::from_secs(5), Duration::from_secs(30)).await;
    let ttl: i64 = connection.pttl(&key).await.unwrap();
    assert!(
        (29_000..=30_000).contains(&ttl),
        "PTTL {ttl} after a 30 s reserve"
    );
    store
        .renew(&id, token, Duration::from_secs(90))
        .await
        .unwrap();
    let ttl: i64 = connection.pttl(&key).await.unwrap();
    assert!(
        (89_000..=90_000).contains(&ttl),
        "PTTL {ttl} after a 90 s renewal"
    );
    store.finalize(&id, token, &response(b"x")).await.unwrap();
    let kept: i64 = connection.pttl(&key).await.unwrap();
    assert!(
        kept <= ttl && kept > 88_000,
        "finalize changed the TTL to {kept}"
    );
    // The key goes as the record expires: Redis keeps a key through the millisecond its
    // expiry is set to, and a record has expired at its `expires_at_ms`. A replay reads
    // no clock, so the key's own expiry is what ends it.
    let expires_at: i64 = connection.hget(&key, "expires_at_ms").await.unwrap();
    let key_expires_at: i64 = redis::cmd("PEXPIRETIME")
        .arg(&key)
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(
        key_expires_at,
        expires_at - 1,
        "the key must expire as the record does"
    );

    let short = super::id();
    let short_key = store.record_key(&short);
    reserve_new(store, &short, Duration::ZERO, Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let exists: bool = connection.exists(&short_key).await.unwrap();
    assert!(!exists, "an expired record's key must be gone");
    // The record is a hash whose fields an operator can read with HGETALL.
    let fields: Vec<String> = connection.hkeys(&key).await.unwrap();
    for field in [
        "method",
        "path",
        "body_sha256",
        "fencing_token",
        "created_at_ms",
        "expires_at_ms",
        "lease_expires_at_ms",
        "response_status",
        "response_headers",
        "response_body",
    ] {
        assert!(
            fields.iter().any(|f| f == field),
            "no {field} in {fields:?}"
        );
    }
}

/// The service's side effect, shared by both replicas.
#[derive(Clone, Default)]
pub struct Calls(pub Arc<AtomicUsize>);

/// `POST /tables`: counts its calls, takes 300 ms, answers 201 with the call number.
pub fn app(calls: Calls, layer: IdempotencyLayer) -> Router {
    async fn create(State(calls): State<Calls>) -> (StatusCode, String) {
        let n = calls.0.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
        (StatusCode::CREATED, format!(r#"{{"call":{n}}}"#))
    }
    Router::new()
        .route("/tables", post(create))
        .with_state(calls)
        .layer(layer)
}

pub async fn send(app: &Router, key: &str) -> (StatusCode, Vec<u8>, Option<Outcome>) {
    let request = Request::post("/tables")
        .header("idempotency-key", key)
        .body(Body::from(r#"{"name":"t1"}"#))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let outcome = response.extensions().get::<Outcome>().copied();
    let (parts, body) = response.into_parts();
    (
        parts.status,
        body.collect().await.unwrap().to_bytes().to_vec(),
        outcome,
    )
}

/// 64 requests with one key over two replicas (two layers, two store handles): the
/// handler runs once; every other request gets the replay or the in-flight answer.
pub async fn sixty_four_racers_over_two_handles_run_once(a: RedisStore, b: RedisStore) {
    let calls = Calls::default();
    let replicas = [
        app(calls.clone(), IdempotencyLayer::new(a)),
        app(calls.clone(), IdempotencyLayer::new(b)),
    ];
    let key = uuid::Uuid::new_v4().to_string();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let app = replicas[i % 2].clone();
        let key = key.clone();
        tasks.spawn(async move { send(&app, &key).await });
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
    for app in &replicas {
        let (status, body, outcome) = send(app, &key).await;
        assert_eq!(
            (status, outcome),
            (StatusCode::CREATED, Some(Outcome::Replayed))
        );
        assert!(bodies.contains(&body));
    }
    assert_eq!(calls.0.load(Ordering::SeqCst), 1);
}

/// 50 duplicates wait on one replica while the owner, on another, takes 3 s: they are
/// woken at once by the finalize's notice (without one they would look again only after
/// a second), and cost about one load a second each (polling would cost five); a
/// release wakes its waiters too. `scripts_run` counts the scripts the server(s) ran.
pub async fn waiters_wake_at_once_and_load_about_once_a_second(
    owner: RedisStore,
    waiters_node: RedisStore,
    scripts_run: impl Fn() -> u64,
    kill_subscriptions: impl Fn() -> u64,
) {
    use idempotency_core::{Ownership, RecordState};
    use tokio::time::Instant;

    let id = id();
    let token = reserve_new(&owner, &id, super::LONG, super::LONG).await;
    // Subscribe (and load the scripts) first, so that the count below is the waiters'.
    waiters_node.wait(&id, Duration::ZERO).await.unwrap();
    let before = scripts_run();
    let waiters: Vec<_> = (0..50)
        .map(|_| {
            let store = waiters_node.clone();
            let id = id.clone();
            tokio::spawn(async move { store.wait(&id, Duration::from_secs(20)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let finalized_at = Instant::now();
    assert_eq!(
        owner
            .finalize(&id, token, &response(b"done"))
            .await
            .unwrap(),
        Ownership::Held
    );
    for waiter in waiters {
        let Waited::Settled(record) = waiter.await.unwrap().unwrap() else {
            panic!("a waiter on a finalized record did not see it settled")
        };
        assert_eq!(record.state, RecordState::Completed(response(b"done")));
    }
    let woken_after = finalized_at.elapsed();
    let spent = scripts_run() - before;
    assert!(
        woken_after < Duration::from_millis(300),
        "waiters woke {woken_after:?} after the finalize"
    );
    // Polling (5 ms doubling to 200 ms) would be about 17 loads per waiter in 3 s;
    // listening is one at the start, one a second, one when woken.
    assert!(
        spent <= 50 * 6 + 1,
        "50 waiters ran {spent} scripts in 3 s of waiting"
    );

    let released = super::id();
    let token = reserve_new(&owner, &released, super::LONG, super::LONG).await;
    let waiter = {
        let store = waiters_node.clone();
        let id = released.clone();
        tokio::spawn(async move { store.wait(&id, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let released_at = Instant::now();
    assert_eq!(
        owner.release(&released, token).await.unwrap(),
        Ownership::Held
    );
    assert!(
        waiter.await.unwrap().unwrap() == Waited::Gone,
        "a released record came back"
    );
    let woken_after = released_at.elapsed();
    assert!(
        woken_after < Duration::from_millis(300),
        "a waiter woke {woken_after:?} after the release"
    );

    // The subscription is killed: a waiter meanwhile still finishes (it looks once a
    // second), and the store subscribes again by itself, so waiters are woken at once
    // again afterwards.
    assert!(kill_subscriptions() > 0, "no subscribed connection to kill");
    let one_waiter = |id: RecordId| {
        let store = waiters_node.clone();
        tokio::spawn(async move { store.wait(&id, Duration::from_secs(20)).await })
    };
    let during = super::id();
    let token = reserve_new(&owner, &during, super::LONG, super::LONG).await;
    let waiter = one_waiter(during.clone());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let finalized_at = Instant::now();
    owner
        .finalize(&during, token, &response(b"during"))
        .await
        .unwrap();
    assert!(matches!(waiter.await.unwrap().unwrap(), Waited::Settled(_)));
    assert!(finalized_at.elapsed() < Duration::from_millis(1_500));
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let after = super::id();
    let token = reserve_new(&owner, &after, super::LONG, super::LONG).await;
    let waiter = one_waiter(after.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let finalized_at = Instant::now();
    owner
        .finalize(&after, token, &response(b"after"))
        .await
        .unwrap();
    assert!(matches!(waiter.await.unwrap().unwrap(), Waited::Settled(_)));
    let woken_after = finalized_at.elapsed();
    assert!(
        woken_after < Duration::from_millis(300),
        "after its subscription was killed, a waiter woke {woken_after:?} after the finalize"
    );
}
