//! The layer end to end: an axum router wrapped by `IdempotencyLayer` over the memory
//! store, driven with `tower::ServiceExt::oneshot` on a real multi-threaded runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use idempotency_core::{
    Binding, FencingToken, IdempotencyLayer, IdempotencyRecord, IdempotencyStore, Outcome,
    Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, RecordState, Reservation,
    ReservationHandle, StoreError, StoredResponse,
};
use idempotency_store_memory::MemoryStore;
use tower::ServiceExt;

#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

impl Calls {
    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A router whose `POST /things/{status}` counts its calls, sleeps for the `x-sleep-ms`
/// request header, and answers `status` with a JSON body, an ETag and a header that is
/// not on the replay allow-list.
fn app(calls: Calls) -> Router {
    async fn handler(
        State(calls): State<Calls>,
        Path(status): Path<u16>,
        headers: HeaderMap,
        body: String,
    ) -> Response {
        let n = calls.0.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(ms) = headers.get("x-sleep-ms") {
            let ms: u64 = ms.to_str().unwrap().parse().unwrap();
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if headers.contains_key("x-panic") {
            panic!("handler panicked on purpose");
        }
        let status = StatusCode::from_u16(status).unwrap();
        (
            status,
            [
                ("content-type", "application/json"),
                ("etag", "\"v1\""),
                ("x-call", &n.to_string()),
            ],
            format!(r#"{{"call":{n},"echo":{body:?}}}"#),
        )
            .into_response()
    }
    async fn big(State(calls): State<Calls>) -> Vec<u8> {
        calls.0.fetch_add(1, Ordering::SeqCst);
        vec![7u8; 3000]
    }
    async fn reservation(req: Request<Body>) -> String {
        format!(
            "{:?}",
            req.extensions().get::<ReservationHandle>().is_some()
        )
    }
    Router::new()
        .route(
            "/things/{status}",
            post(handler).get(handler).delete(handler),
        )
        .route("/other/{status}", post(handler))
        .route("/big", post(big))
        .route("/reservation", post(reservation))
        .with_state(calls)
}

fn keyed(method: &str, uri: &str, key: &str, body: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

/// Sends one request; the outcome is `None` when the layer passed the request through.
async fn send(
    app: &Router,
    request: Request<Body>,
) -> (StatusCode, HeaderMap, Vec<u8>, Option<Outcome>) {
    let response = app.clone().oneshot(request).await.unwrap();
    let outcome = response.extensions().get::<Outcome>().copied();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes().to_vec();
    (parts.status, parts.headers, body, outcome)
}

/// A keyed `POST /things/201` whose handler sleeps for `ms` milliseconds.
fn slow_keyed(key: &str, ms: u64) -> Request<Body> {
    let mut request = keyed("POST", "/things/201", key, "{}");
    request
        .headers_mut()
        .insert("x-sleep-ms", ms.to_string().parse().unwrap());
    request
}

/// Sends `request` on a task of its own, as a concurrent client would.
fn spawn_send(
    app: &Router,
    request: Request<Body>,
) -> tokio::task::JoinHandle<(StatusCode, HeaderMap, Vec<u8>, Option<Outcome>)> {
    let app = app.clone();
    tokio::spawn(async move { send(&app, request).await })
}

fn layered(layer: IdempotencyLayer, calls: &Calls) -> Router {
    app(calls.clone()).layer(layer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_requests_with_one_key_run_the_handler_once() {
    let calls = Calls::default();
    let app = layered(IdempotencyLayer::new(MemoryStore::new()), &calls);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let app = app.clone();
        tasks.spawn(async move {
            let mut request = keyed("POST", "/things/201", "race-key", "{}");
            request
                .headers_mut()
                .insert("x-sleep-ms", "200".parse().unwrap());
            send(&app, request).await
        });
    }
    let mut executed = 0;
    let mut replayed = 0;
    let mut first_body = None;
    while let Some(result) = tasks.join_next().await {
        let (status, headers, body, outcome) = result.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        match outcome.expect("no outcome") {
            Outcome::Executed => executed += 1,
            Outcome::Replayed => {
                replayed += 1;
                assert_eq!(headers["idempotent-replayed"], "true");
            }
            other => panic!("unexpected outcome {other:?}"),
        }
        let body = String::from_utf8(body).unwrap();
        assert_eq!(first_body.get_or_insert(body.clone()), &body);
    }
    assert_eq!(calls.count(), 1, "the handler must run exactly once");
    assert_eq!((executed, replayed), (1, 63));
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_is_byte_identical_and_never_calls_the_handler() {
    let calls = Calls::default();
    let app = layered(IdempotencyLayer::new(MemoryStore::new()), &calls);
    let first = send(&app, keyed("POST", "/things/201", "k1", r#"{"a":1}"#)).await;
    assert_eq!(first.3, Some(Outcome::Executed));
    assert!(first.1.get("idempotent-replayed").is_none());
    for _ in 0..3 {
        let again = send(&app, keyed("POST", "/things/201", "k1", r#"{"a":1}"#)).await;
        assert_eq!(again.3, Some(Outcome::Replayed));
        assert_eq!(again.0, first.0, "status");
        assert_eq!(again.2, first.2, "body bytes");
        assert_eq!(again.1["content-type"], first.1["content-type"]);
        assert_eq!(again.1["etag"], first.1["etag"]);
        assert_eq!(again.1["idempotent-replayed"], "true");
        assert!(
            again.1.get("x-call").is_none(),
            "headers off the allow-list must not be replayed"
        );
    }
    assert_eq!(calls.count(), 1);
}

#[tokio::test]
async fn server_errors_and_transient_client_errors_release_the_key() {
    for status in [500u16, 503, 401, 403, 408, 419, 429] {
        let calls = Calls::default();
        let app = layered(IdempotencyLayer::new(MemoryStore::new()), &calls);
        let uri = format!("/things/{status}");
        let first = send(&app, keyed("POST", &uri, "k", "{}")).await;
        assert_eq!(first.0.as_u16(), status);
        assert_eq!(first.3, Some(Outcome::Released), "status {status}");
        let second = send(&app, keyed("POST", &uri, "k", "{}")).await;
        assert_eq!(
            second.3,
            Some(Outcome::Released),
            "status {status} was replayed"
        );
        assert_eq!(
            calls.count(),
            2,
            "status {status}: the retry must run again"
        );
    }
}

#[tokio::test]
async fn deterministic_client_errors_are_replayed() {
    for status in [400u16, 404, 409, 422] {
        let calls = Calls::default();
        let app = layered(IdempotencyLayer::new(MemoryStore::new()), &calls);
        let uri = format!("/things/{status}");
        let first = send(&app, keyed("POST", &uri, "k", "{}")).await;
        let second = send(&app, keyed("POST", &uri, "k", "{}")).await;
        assert_eq!(second.3, Some(Outcome::Replayed), "status {status}");
        assert_eq!((second.0, second.2), (first.0, first.2));
        assert_eq!(calls.count(), 1);
    }
}

#[tokio::test]
async fn a_key_reused_for_another_body_path_or_method_is_refused() {
    let calls = Calls::default();
    let app = layered(IdempotencyLayer::new(MemoryStore::new()), &calls);
    send(&app, keyed("POST", "/things/201", "k", r#"{"name":"a"}"#)).await;
    for (method, uri, body) in [
        ("POST", "/things/201", r#"{"name":"b"}"#),
        ("POST", "/other/201", r#"{"name":"a"}"#),
        ("DELETE", "/things/201", r#"{"name":"a"}"#),
        ("POST", "/things/201?force=true", r#"{"name":"a"}"#),
    ] {
        let (status, headers, body_bytes, outcome) =
            send(&app, keyed(method, uri, "k", body)).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{method} {uri}");
        assert_eq!(
            outcome,
            Some(Outcome::Rejected(
                idempotency_core::RejectionKind::KeyReused
            ))
        );
        assert_eq!(headers["content-type"], "application/problem+json");
        let problem: serde_json::Value = serde_json::from_slice(&body_bytes).unwrap();
        assert_eq!(problem["status"], 422);
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains("send a new key"),
            "{problem}"
        );
    }
    assert_eq!(calls.count(), 1, "a reused key must never run the handler");
}

#[tokio::test]
async fn another_scope_never_sees_the_replay() {
    let calls = Calls::default();
    let layer =
        IdempotencyLayer::new(MemoryStore::new()).with_scope(|request: &http::request::Parts| {
            Some(request.headers["x-tenant"].to_str().unwrap().to_owned())
        });
    let app = layered(layer, &calls);
    let as_tenant = |tenant: &str| {
        let mut request = keyed("POST", "/things/201", "shared-key", "{}");
        request
            .headers_mut()
            .insert("x-tenant", tenant.parse().unwrap());
        request
    };
    let a = send(&app, as_tenant("a")).await;
    let b = send(&app, as_tenant("b")).await;
    assert_eq!(
        (a.3, b.3),
        (Some(Outcome::Executed), Some(Outcome::Executed))
    );
    assert_ne!(a.2, b.2, "tenant b must get its own response");
    assert_eq!(send(&app, as_tenant("a")).await.2, a.2);
    assert_eq!(calls.count(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_response_future_still_finalizes() {
    dropped_response_future_finalizes().await;
}

/// The owner runs in the caller's task until the caller drops it; then it must move to a
/// task of its own on whatever runtime is running, a single-threaded one included.
#[tokio::test(flavor = "current_thread")]
async fn a_dropped_response_future_still_finalizes_on_a_current_thread_runtime() {
    dropped_response_future_finalizes().await;
}

async fn dropped_response_future_finalizes() {
    let calls = Calls::default();
    let store = MemoryStore::new();
    let app = layered(IdempotencyLayer::new(store.clone()), &calls);
    let mut request = keyed("POST", "/things/201", "dropped", "{}");
    request
        .headers_mut()
        .insert("x-sleep-ms", "300".parse().unwrap());
    // The client gives up after 50 ms; the handler is still running.
    let timed_out =
        tokio::time::timeout(Duration::from_millis(50), app.clone().oneshot(request)).await;
    assert!(timed_out.is_err());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let record = store
        .load(&RecordId::new("", "dropped"))
        .await
        .unwrap()
        .expect("record lost");
    assert!(matches!(record.state, RecordState::Completed(ref r) if r.status == 201));
    let retry = send(&app, keyed("POST", "/things/201", "dropped", "{}")).await;
    assert_eq!(retry.3, Some(Outcome::Replayed));
    assert_eq!(calls.count(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_handler_releases_the_key() {
    let calls = Calls::default();
    let store = MemoryStore::new();
    let app = layered(IdempotencyLayer::new(store.clone()), &calls);
    let mut request = keyed("POST", "/things/201", "boom", "{}");
    request
        .headers_mut()
        .insert("x-panic", "1".parse().unwrap());
    let app2 = app.clone();
    let panicked = tokio::spawn(async move { app2.oneshot(request).await }).await;
    assert!(
        panicked.unwrap_err().is_panic(),
        "the panic must reach the caller"
    );
    assert!(
        store
            .load(&RecordId::new("", "boom"))
            .await
            .unwrap()
            .is_none()
    );
    let retry = send(&app, keyed("POST", "/things/201", "boom", "{}")).await;
    assert_eq!(retry.3, Some(Outcome::Executed));
    assert_eq!(calls.count(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lapsed_lease_is_taken_over_and_the_old_owner_is_fenced() {
    let calls = Calls::default();
    let store = MemoryStore::new();
    let binding_of = |body: &str| {
        use sha2::Digest;
        Binding {
            method: "POST".into(),
            path: "/things/201".into(),
            body_sha256: sha2::Sha256::digest(body.as_bytes()).into(),
        }
    };
    // A "crashed" owner: reserved with a short lease, then never renewed.
    let id = RecordId::new("", "crashed");
    let Reservation::Reserved(old) = store
        .reserve(
            &id,
            &binding_of("{}"),
            Duration::from_millis(100),
            Duration::from_secs(60),
        )
        .await
        .unwrap()
    else {
        panic!("fresh key not reserved")
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let app = layered(IdempotencyLayer::new(store.clone()), &calls);
    let retry = send(&app, keyed("POST", "/things/201", "crashed", "{}")).await;
    assert_eq!(retry.3, Some(Outcome::TookOver));
    assert_eq!(retry.0, StatusCode::CREATED);
    let stale = StoredResponse {
        status: 500,
        headers: vec![],
        body: "stale".into(),
        trailers: vec![],
    };
    assert_eq!(
        store.finalize(&id, old, &stale).await.unwrap(),
        Ownership::Lost
    );
    let again = send(&app, keyed("POST", "/things/201", "crashed", "{}")).await;
    assert_eq!((again.3, again.2), (Some(Outcome::Replayed), retry.2));
    assert_eq!(calls.count(), 1);
}

#[tokio::test]
async fn bad_key_headers_get_400_and_never_reach_the_handler() {
    let calls = Calls::default();
    let app = layered(
        IdempotencyLayer::new(MemoryStore::new())
            .with_key_format(idempotency_core::UuidKey::any_version()),
        &calls,
    );
    let long = "a".repeat(10_000);
    let bad: Vec<Request<Body>> = vec![
        keyed("POST", "/things/201", "not-a-uuid", "{}"),
        keyed("POST", "/things/201", &long, "{}"),
        {
            let mut request = keyed(
                "POST",
                "/things/201",
                "01890a5d-ac96-774b-bcce-b302099a8057",
                "{}",
            );
            request.headers_mut().append(
                "idempotency-key",
                "01890a5d-ac96-774b-bcce-b302099a8058".parse().unwrap(),
            );
            request
        },
        {
            let mut request = keyed("POST", "/things/201", "x", "{}");
            request.headers_mut().insert(
                "idempotency-key",
                http::HeaderValue::from_bytes(b"\xff\xfe-not-utf8").unwrap(),
            );
            request
        },
    ];
    for request in bad {
        let (status, _, body, outcome) = send(&app, request).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(matches!(outcome, Some(Outcome::Rejected(_))));
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(!problem["detail"].as_str().unwrap().is_empty());
    }
    assert_eq!(calls.count(), 0);
    // Upper-case and lower-case spellings of one UUID are one key.
    let upper = send(
        &app,
        keyed(
            "POST",
            "/things/201",
            "01890A5D-AC96-774B-BCCE-B302099A8057",
            "{}",
        ),
    )
    .await;
    let lower = send(
        &app,
        keyed(
            "POST",
            "/things/201",
            "01890a5d-ac96-774b-bcce-b302099a8057",
            "{}",
        ),
    )
    .await;
    assert_eq!(
        (upper.3, lower.3),
        (Some(Outcome::Executed), Some(Outcome::Replayed))
    );
}

#[tokio::test]
async fn requests_without_a_key_and_reads_pass_through() {
    let calls = Calls::default();
    let app = layered(IdempotencyLayer::new(MemoryStore::new()), &calls);
    for request in [
        Request::post("/things/201").body(Body::from("{}")).unwrap(),
        keyed("GET", "/things/200", "read-key", ""),
        keyed("GET", "/things/200", "read-key", ""),
    ] {
        assert_eq!(send(&app, request).await.3, None);
    }
    assert_eq!(calls.count(), 3);
    let (_, _, body, _) = send(
        &app,
        Request::post("/reservation").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(
        body, b"false",
        "an unkeyed request runs without a reservation"
    );
    let (_, _, body, _) = send(&app, keyed("POST", "/reservation", "r", "")).await;
    assert_eq!(body, b"true", "a keyed request carries its reservation");
}

#[tokio::test]
async fn require_key_refuses_unkeyed_mutations_only() {
    let calls = Calls::default();
    let app = layered(
        IdempotencyLayer::new(MemoryStore::new()).with_require_key(true),
        &calls,
    );
    let (status, _, body, _) = send(
        &app,
        Request::post("/things/201").body(Body::from("{}")).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        String::from_utf8(body)
            .unwrap()
            .contains("requires an Idempotency-Key")
    );
    let read = send(
        &app,
        Request::get("/things/200").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(read.0, StatusCode::OK);
    assert_eq!(calls.count(), 1);
}

#[tokio::test]
async fn an_oversized_request_body_gets_413_and_reserves_nothing() {
    let calls = Calls::default();
    let store = MemoryStore::new();
    let app = layered(
        IdempotencyLayer::new(store.clone()).with_max_request_body(1024),
        &calls,
    );
    let (status, _, _, outcome) =
        send(&app, keyed("POST", "/things/201", "big", &"x".repeat(1025))).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        outcome,
        Some(Outcome::Rejected(
            idempotency_core::RejectionKind::BodyTooLarge
        ))
    );
    assert!(store.is_empty());
    assert_eq!(calls.count(), 0);
}

#[tokio::test]
async fn an_oversized_response_is_delivered_whole_and_never_replayed_as_itself() {
    let calls = Calls::default();
    let app = layered(
        IdempotencyLayer::new(MemoryStore::new()).with_max_response_body(1000),
        &calls,
    );
    let first = send(&app, keyed("POST", "/big", "huge", "")).await;
    assert_eq!(first.3, Some(Outcome::ExecutedNotStored));
    assert_eq!(
        first.2,
        vec![7u8; 3000],
        "the first caller gets the whole body"
    );
    let retry = send(&app, keyed("POST", "/big", "huge", "")).await;
    assert_eq!(retry.3, Some(Outcome::Replayed));
    assert_eq!(retry.0, StatusCode::CONFLICT);
    let problem: serde_json::Value = serde_json::from_slice(&retry.2).unwrap();
    assert_eq!(problem["kind"], "response-not-stored");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("already ran (status 200)")
    );
    assert_eq!(calls.count(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_waits_for_the_owner_then_replays() {
    let calls = Calls::default();
    let app = layered(IdempotencyLayer::new(MemoryStore::new()), &calls);
    let owner = spawn_send(&app, slow_keyed("wait", 300));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let duplicate = send(&app, keyed("POST", "/things/201", "wait", "{}")).await;
    let owner = owner.await.unwrap();
    assert_eq!(
        (owner.3, duplicate.3),
        (Some(Outcome::Executed), Some(Outcome::Replayed))
    );
    assert_eq!(owner.2, duplicate.2);
    assert_eq!(calls.count(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_gets_409_with_retry_after_when_the_wait_ends() {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_in_flight_wait(Duration::from_millis(100))
        .with_retry_after(Duration::from_secs(2));
    let app = layered(layer, &calls);
    let owner = spawn_send(&app, slow_keyed("busy", 600));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, headers, _, outcome) =
        send(&app, keyed("POST", "/things/201", "busy", "{}")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(headers["retry-after"], "2");
    assert_eq!(
        outcome,
        Some(Outcome::Rejected(idempotency_core::RejectionKind::InFlight))
    );
    owner.await.unwrap();
    assert_eq!(calls.count(), 1);

    // The Iceberg-style variant answers 503 instead.
    let calls = Calls::default();
    let app = layered(
        IdempotencyLayer::new(MemoryStore::new())
            .with_in_flight_wait(Duration::ZERO)
            .with_in_flight_status(StatusCode::SERVICE_UNAVAILABLE),
        &calls,
    );
    let owner = spawn_send(&app, slow_keyed("busy", 300));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, headers, _, _) = send(&app, keyed("POST", "/things/201", "busy", "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
    owner.await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_lease_is_renewed_while_a_slow_handler_runs() {
    let calls = Calls::default();
    let store = MemoryStore::new();
    let app = layered(
        IdempotencyLayer::new(store.clone()).with_lease(Duration::from_millis(90)),
        &calls,
    );
    let owner = spawn_send(&app, slow_keyed("slow", 500));
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Some(record) = store.load(&RecordId::new("", "slow")).await.unwrap() {
            assert!(
                !matches!(
                    record.state,
                    RecordState::InFlight {
                        lease_lapsed: true,
                        ..
                    }
                ),
                "the lease lapsed while its owner was running"
            );
        }
    }
    assert_eq!(owner.await.unwrap().3, Some(Outcome::Executed));
    assert_eq!(calls.count(), 1);
}

/// A handler that runs longer than the key's lifetime is never run a second time beside
/// itself: its record stays in flight under its renewed lease, a duplicate waits for it
/// and gets the replay.
#[tokio::test(flavor = "multi_thread")]
async fn a_handler_that_outlives_the_lifetime_is_not_run_again_by_a_duplicate() {
    let calls = Calls::default();
    let app = layered(
        IdempotencyLayer::new(MemoryStore::new())
            .with_lifetime(Duration::from_millis(200))
            .with_in_flight_wait(Duration::from_secs(5)),
        &calls,
    );
    let owner = spawn_send(&app, slow_keyed("overrun", 900));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let duplicate = send(&app, slow_keyed("overrun", 900)).await;
    let owner = owner.await.unwrap();
    assert_eq!(owner.3, Some(Outcome::Executed));
    assert_eq!(
        calls.count(),
        1,
        "a duplicate past the lifetime ran the handler again while the first still ran"
    );
    assert_eq!(duplicate.3, Some(Outcome::Replayed));
    assert_eq!(duplicate.2, owner.2);
}

/// An owner stuck past the maximum run time stops renewing: once its lease lapses a
/// retry takes over, and the stuck owner's late answer is fenced out.
#[tokio::test(flavor = "multi_thread")]
async fn an_owner_past_the_maximum_run_time_can_be_taken_over() {
    let calls = Calls::default();
    let app = layered(
        IdempotencyLayer::new(MemoryStore::new())
            .with_lease(Duration::from_millis(90))
            .with_max_run_time(Duration::from_millis(150))
            .with_in_flight_wait(Duration::ZERO),
        &calls,
    );
    let stuck = spawn_send(&app, slow_keyed("stuck", 1_000));
    tokio::time::sleep(Duration::from_millis(450)).await;
    let retry = send(&app, keyed("POST", "/things/201", "stuck", "{}")).await;
    assert_eq!(retry.3, Some(Outcome::TookOver));
    assert_eq!(calls.count(), 2);
    assert_eq!(stuck.await.unwrap().0, StatusCode::CREATED);
    let again = send(&app, keyed("POST", "/things/201", "stuck", "{}")).await;
    assert_eq!(
        (again.3, again.2),
        (Some(Outcome::Replayed), retry.2),
        "the stuck owner's answer was fenced out"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shutdown_waits_no_longer_than_its_deadline() {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let in_flight = layer.in_flight();
    let app = layered(layer, &calls);
    let slow = spawn_send(&app, slow_keyed("slow-shutdown", 2_000));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    assert_eq!(in_flight.wait_at_most(Duration::from_millis(200)).await, 1);
    assert!(started.elapsed() < Duration::from_secs(1));
    slow.abort();
}

#[tokio::test(flavor = "multi_thread")]
async fn in_flight_requests_can_be_drained_for_shutdown() {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let in_flight = layer.in_flight();
    let app = layered(layer, &calls);
    let slow = slow_keyed("drain", 300);
    // The client disconnects at once; the mutation must still be waited for.
    drop(tokio::time::timeout(Duration::from_millis(20), app.clone().oneshot(slow)).await);
    assert_eq!(in_flight.count(), 1);
    in_flight.wait().await;
    assert_eq!(in_flight.count(), 0);
    assert_eq!(calls.count(), 1);
}

/// A store whose every operation fails while `broken` is set, wrapping a real one: the
/// way to make a store fail on purpose without a database outage.
#[derive(Clone, Default)]
struct FailingStore {
    inner: MemoryStore,
    broken: Arc<std::sync::atomic::AtomicBool>,
}

impl FailingStore {
    fn check(&self) -> Result<(), StoreError> {
        if self.broken.load(Ordering::SeqCst) {
            Err(StoreError::backend(std::io::Error::other(
                "connection refused",
            )))
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl IdempotencyStore for FailingStore {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        self.check()?;
        self.inner.reserve(id, binding, lease, lifetime).await
    }
    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.check()?;
        self.inner.load(id).await
    }
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.check()?;
        self.inner.renew(id, token, lease).await
    }
    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        self.check()?;
        self.inner.finalize(id, token, response).await
    }
    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        self.check()?;
        self.inner.release(id, token).await
    }
    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        self.check()?;
        self.inner.take_over(id, lapsed, lease).await
    }
}

#[async_trait]
impl RecordAdmin for FailingStore {}

#[async_trait]
impl PurgeExpired for FailingStore {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        self.check()?;
        self.inner.purge_expired(batch_size).await
    }
}

#[tokio::test]
async fn a_failing_store_fails_closed_by_default_and_open_when_asked() {
    let store = FailingStore::default();
    store.broken.store(true, Ordering::SeqCst);
    let calls = Calls::default();
    let closed = layered(IdempotencyLayer::new(store.clone()), &calls);
    let (status, headers, body, outcome) =
        send(&closed, keyed("POST", "/things/201", "k", "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(
        outcome,
        Some(Outcome::Rejected(
            idempotency_core::RejectionKind::StoreUnavailable
        ))
    );
    assert!(String::from_utf8(body).unwrap().contains("retry later"));
    assert_eq!(calls.count(), 0, "fail-closed must not run the handler");

    let open = layered(
        IdempotencyLayer::new(store.clone()).with_fail_open(true),
        &calls,
    );
    let (status, _, _, outcome) = send(&open, keyed("POST", "/things/201", "k", "{}")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::RanUnprotected))
    );
    assert_eq!(calls.count(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_finalize_that_fails_briefly_is_retried() {
    let store = FailingStore::default();
    let calls = Calls::default();
    let app = layered(IdempotencyLayer::new(store.clone()), &calls);
    let owner = spawn_send(&app, slow_keyed("flaky", 200));
    // Break the store while the handler runs, mend it shortly after it returns.
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.broken.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(250)).await;
    store.broken.store(false, Ordering::SeqCst);
    let (status, _, _, outcome) = owner.await.unwrap();
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    let retry = send(&app, keyed("POST", "/things/201", "flaky", "{}")).await;
    assert_eq!(
        retry.3,
        Some(Outcome::Replayed),
        "the retried finalize must have stored the answer"
    );
    assert_eq!(calls.count(), 1);
}

#[tokio::test]
async fn a_full_memory_store_answers_503_and_keeps_its_records() {
    let calls = Calls::default();
    let app = layered(
        IdempotencyLayer::new(MemoryStore::new().with_max_entries(2)),
        &calls,
    );
    for key in ["a", "b"] {
        send(&app, keyed("POST", "/things/201", key, "{}")).await;
    }
    let (status, headers, _, outcome) = send(&app, keyed("POST", "/things/201", "c", "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.contains_key("retry-after"));
    assert_eq!(
        outcome,
        Some(Outcome::Rejected(
            idempotency_core::RejectionKind::StoreFull
        ))
    );
    assert_eq!(
        send(&app, keyed("POST", "/things/201", "a", "{}")).await.3,
        Some(Outcome::Replayed)
    );
    assert_eq!(calls.count(), 2);
}

#[tokio::test]
async fn works_around_a_plain_tower_service() {
    use tower::Layer;
    let service = tower::service_fn(|request: Request<Body>| async move {
        let body = request.into_body().collect().await.unwrap().to_bytes();
        Ok::<_, std::convert::Infallible>(Response::new(Body::from(body)))
    });
    let service = IdempotencyLayer::new(MemoryStore::new()).layer(service);
    let response = service
        .clone()
        .oneshot(keyed("PUT", "/x", "k", "echo"))
        .await
        .unwrap();
    assert_eq!(
        response.into_body().collect().await.unwrap().to_bytes(),
        "echo"
    );
    let replay = service
        .oneshot(keyed("PUT", "/x", "k", "echo"))
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

#[tokio::test]
async fn get_routes_are_untouched_by_a_key() {
    let calls = Calls::default();
    let app = app(calls.clone())
        .route("/ping", get(|| async { "pong" }))
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let (status, _, body, outcome) = send(&app, keyed("GET", "/ping", "k", "")).await;
    assert_eq!(
        (status, body.as_slice(), outcome),
        (StatusCode::OK, &b"pong"[..], None)
    );
}

#[tokio::test]
async fn records_live_for_the_lifetime_plus_the_grace_period() {
    let calls = Calls::default();
    let store = MemoryStore::new();
    let app = layered(
        IdempotencyLayer::new(store.clone())
            .with_lifetime(Duration::from_millis(100))
            .with_grace_period(Duration::from_millis(200)),
        &calls,
    );
    send(&app, keyed("POST", "/things/201", "graced", "{}")).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let within_grace = send(&app, keyed("POST", "/things/201", "graced", "{}")).await;
    assert_eq!(
        within_grace.3,
        Some(Outcome::Replayed),
        "kept through the grace period"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = send(&app, keyed("POST", "/things/201", "graced", "{}")).await;
    assert_eq!(
        after.3,
        Some(Outcome::Executed),
        "expired after lifetime + grace"
    );
    assert_eq!(calls.count(), 2);
}

/// A service whose answer has the status of its `x-status` header and a body that fails
/// half way, behind the layer, with its call count.
fn failing_body_app(store: MemoryStore) -> (Router, Calls) {
    use tower::Layer;
    let calls = Calls::default();
    let counted = calls.clone();
    let service = tower::service_fn(move |request: Request<Body>| {
        counted.0.fetch_add(1, Ordering::SeqCst);
        let status: u16 = request.headers()["x-status"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        async move {
            let chunks: Vec<Result<&'static str, std::io::Error>> = vec![
                Ok("{\"partial\":"),
                Err(std::io::Error::other("disk went away")),
            ];
            let mut response = Response::new(Body::from_stream(futures_util::stream::iter(chunks)));
            *response.status_mut() = StatusCode::from_u16(status).unwrap();
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let app = Router::new().fallback_service(IdempotencyLayer::new(store).layer(service));
    (app, calls)
}

fn with_status(mut request: Request<Body>, status: &'static str) -> Request<Body> {
    request
        .headers_mut()
        .insert("x-status", status.parse().unwrap());
    request
}

#[tokio::test]
async fn a_response_body_that_fails_after_a_success_keeps_the_key_as_already_ran() {
    let (app, calls) = failing_body_app(MemoryStore::new());
    let request = || with_status(keyed("POST", "/x", "k", "{}"), "201");
    let (status, _, body, outcome) = send(&app, request()).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(outcome, Some(Outcome::ExecutedNotStored));
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["kind"], "response-failed");
    assert!(problem["detail"].as_str().unwrap().contains("already ran"));
    let (status, _, body, outcome) = send(&app, request()).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CONFLICT, Some(Outcome::Replayed))
    );
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["kind"], "response-not-stored");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("already ran (status 201)")
    );
    assert_eq!(calls.count(), 1, "the mutation must not run again");
}

#[tokio::test]
async fn a_response_body_that_fails_after_a_server_error_releases_the_key() {
    let store = MemoryStore::new();
    let (app, calls) = failing_body_app(store.clone());
    let request = || with_status(keyed("POST", "/x", "k", "{}"), "503");
    let (status, _, body, outcome) = send(&app, request()).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::BAD_GATEWAY, Some(Outcome::Released))
    );
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("runs the request again")
    );
    assert!(store.load(&RecordId::new("", "k")).await.unwrap().is_none());
    assert_eq!(send(&app, request()).await.3, Some(Outcome::Released));
    assert_eq!(calls.count(), 2, "a released key runs again");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_owner_keeps_its_lease_while_its_caller_does_not_poll_it() {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_lease(Duration::from_millis(150))
        .with_in_flight_wait(Duration::from_millis(200));
    let app = layered(layer, &calls);
    let mut first = Box::pin(app.clone().oneshot(slow_keyed("unpolled", 300)));
    // Poll until the handler has started, then hold the future for three leases unpolled.
    while calls.count() == 0 {
        let _ = futures_util::poll!(first.as_mut());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(450)).await;
    let retry = send(&app, slow_keyed("unpolled", 10)).await;
    assert_eq!(
        retry.3,
        Some(Outcome::Rejected(idempotency_core::RejectionKind::InFlight)),
        "the retry must not take over a lease its owner still renews"
    );
    let first = first.await.unwrap();
    assert_eq!(
        first.extensions().get::<Outcome>(),
        Some(&Outcome::Executed)
    );
    assert_eq!(
        send(&app, slow_keyed("unpolled", 10)).await.3,
        Some(Outcome::Replayed)
    );
    assert_eq!(calls.count(), 1);
}
