//! Checks that mutation testing found missing: the owner's retries of a failing store
//! (their bound and backoff), a reservation whose outcome the store did not take, a wait that ends on another request's record, the maximum run time, the
//! default polling wait's backoff, the scope quota's byte accounting, and the `Arc`
//! forwarding of the store traits.
//!
//! Every timed check runs on tokio's paused clock: the store calls are logged with the
//! virtual instant they were made at, so backoffs are compared exactly.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::{
    Binding, Bytes, EvictInFlight, Eviction, FencingToken, IdempotencyLayer, IdempotencyRecord,
    IdempotencyStore, InspectedRecord, InspectedState, MAX_KEPT_PATH, Outcome, Ownership,
    PurgeExpired, Purged, RecordAdmin, RecordId, RecordState, ReplayAnswer, Reservation,
    ScopeQuota, StoreError, StoredResponse, Waited,
};
use idempotency_store_memory::MemoryStore;
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::ServiceExt;

/// The memory store with switches for what a real backend may do that it never does:
/// hide an in-flight record behind `Busy`, fail to finalize. Every call to the fenced methods is logged with its (virtual) instant.
#[derive(Clone, Default)]
struct Switched {
    inner: MemoryStore,
    busy: bool,
    finalize_fails: bool,
    calls: Arc<Mutex<Vec<(&'static str, Instant)>>>,
}

impl Switched {
    fn log(&self, call: &'static str) {
        self.calls.lock().unwrap().push((call, Instant::now()));
        // On a paused clock a caller that retries or polls without pausing never lets
        // time pass: fail it instead of spinning for ever.
        assert!(
            self.count(call) <= MAX_CALLS,
            "{call} was called again and again without a pause"
        );
    }

    /// How many times `call` was made.
    fn count(&self, call: &str) -> usize {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(name, _)| *name == call)
            .count()
    }

    /// When each `call` was made, in milliseconds after the first reservation.
    fn offsets_ms(&self, call: &str) -> Vec<u128> {
        let calls = self.calls.lock().unwrap();
        let start = calls
            .iter()
            .find(|(name, _)| *name == "reserve")
            .expect("a reservation")
            .1;
        calls
            .iter()
            .filter(|(name, _)| *name == call)
            .map(|(_, at)| at.duration_since(start).as_millis())
            .collect()
    }
}

/// Far more calls of one method than any check here makes.
const MAX_CALLS: usize = 1000;

fn backend_down() -> StoreError {
    StoreError::backend(std::io::Error::other("connection refused"))
}

/// The trait's defaults: what a store that does not implement them offers operators.
#[async_trait]
impl RecordAdmin for Switched {}

#[async_trait]
impl IdempotencyStore for Switched {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        self.log("reserve");
        match self.inner.reserve(id, binding, lease, lifetime).await? {
            Reservation::Exists(IdempotencyRecord {
                state: RecordState::InFlight { .. },
                ..
            }) if self.busy => Ok(Reservation::Busy),
            other => Ok(other),
        }
    }
    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.log("load");
        self.inner.load(id).await
    }
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.log("renew");
        self.inner.renew(id, token, lease).await
    }
    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        self.log("finalize");
        if self.finalize_fails {
            return Err(backend_down());
        }
        self.inner.finalize(id, token, response).await
    }
    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        self.log("release");
        self.inner.release(id, token).await
    }
    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        self.log("take_over");
        self.inner.take_over(id, lapsed, lease).await
    }
}

/// `POST /orders`: answers 201 with the body it got; with `x-gate`, only once the test
/// opens `gate` (after telling it the handler started); after `x-sleep-ms` if set.
fn app(layer: IdempotencyLayer, runs: Arc<AtomicUsize>, gate: Arc<Gate>) -> Router {
    let handler = move |headers: HeaderMap, body: String| {
        let (runs, gate) = (runs.clone(), gate.clone());
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            if headers.contains_key("x-gate") {
                gate.started.notify_one();
                gate.open.notified().await;
            }
            if let Some(ms) = headers.get("x-sleep-ms") {
                let ms: u64 = ms.to_str().unwrap().parse().unwrap();
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            (StatusCode::CREATED, format!("created from {body}"))
        }
    };
    Router::new().route("/orders", post(handler)).layer(layer)
}

/// Holds a request inside its handler, so that the test knows its key is in flight.
#[derive(Default)]
struct Gate {
    started: Notify,
    open: Notify,
}

fn order(key: &str, body: &str) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn with_header(mut request: Request<Body>, name: &'static str, value: &str) -> Request<Body> {
    request.headers_mut().insert(name, value.parse().unwrap());
    request
}

/// Sends one request, bounded by a virtual minute so that a mutant that retries for ever
/// fails instead of hanging.
async fn send(app: &Router, request: Request<Body>) -> (StatusCode, String, Option<Outcome>) {
    let answering = app.clone().oneshot(request);
    let response = tokio::time::timeout(Duration::from_secs(60), answering)
        .await
        .expect("answered within a minute")
        .unwrap();
    let outcome = response.extensions().get::<Outcome>().copied();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        String::from_utf8_lossy(&body).into_owned(),
        outcome,
    )
}

/// An owner whose store keeps failing retries its finalize with pauses that double from
/// 25 ms up to a second, and stops once the next pause would end past the retry time.
#[tokio::test(start_paused = true)]
async fn a_finalize_that_keeps_failing_is_retried_with_doubling_pauses_then_given_up() {
    let store = Switched {
        finalize_fails: true,
        ..Switched::default()
    };
    // The last try is at 4575 ms; its pause of a second would end exactly at the retry
    // time, which is too late for one more.
    let layer =
        IdempotencyLayer::new(store.clone()).with_finalize_retry_for(Duration::from_millis(5575));
    let app = app(layer, Arc::default(), Arc::default());
    let (status, body, outcome) = send(&app, order("k", "a")).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "the caller gets the real answer"
    );
    assert_eq!(body, "created from a");
    assert_eq!(outcome, Some(Outcome::Unsettled));
    assert_eq!(
        store.offsets_ms("finalize"),
        [0, 25, 75, 175, 375, 775, 1575, 2575, 3575, 4575]
    );
    assert_eq!(
        store.count("release"),
        1,
        "then released, so that nothing it holds outlives the request"
    );
}

/// A reservation may have no lease that would lapse (one held unseen, in a transaction):
/// when its finalize fails for good, it is released, and a retry runs the request again.
#[tokio::test(start_paused = true)]
async fn a_reservation_whose_finalize_failed_is_released() {
    let store = Switched {
        finalize_fails: true,
        ..Switched::default()
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(store.clone()).with_finalize_retry_for(Duration::ZERO);
    let app = app(layer, runs.clone(), Arc::default());
    let (status, _, outcome) = send(&app, order("k", "a")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Unsettled))
    );
    assert_eq!(store.count("finalize"), 1);
    assert_eq!(store.count("release"), 1);
    let (_, _, retried) = send(&app, order("k", "a")).await;
    assert_eq!(retried, Some(Outcome::Unsettled));
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the released key ran again");
}

/// A reservation whose answer was stored is not released after it.
#[tokio::test(start_paused = true)]
async fn a_reservation_whose_answer_was_stored_is_kept() {
    let store = Switched::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(
        IdempotencyLayer::new(store.clone()),
        runs.clone(),
        Arc::default(),
    );
    let (status, _, outcome) = send(&app, order("k", "a")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    assert_eq!(store.count("release"), 0);
    let (_, body, retried) = send(&app, order("k", "a")).await;
    assert_eq!(
        (body.as_str(), retried),
        ("created from a", Some(Outcome::Replayed))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A store that cannot show the owner's record answers `Busy`; when the wait then ends
/// on a record bound to another request, the duplicate is told the key was reused
/// (422), and one bound to the same request is told it is still in flight (409).
#[tokio::test(start_paused = true)]
async fn a_wait_that_ends_on_another_requests_record_is_a_reused_key() {
    let store = Switched {
        busy: true,
        ..Switched::default()
    };
    let gate = Arc::new(Gate::default());
    let layer =
        IdempotencyLayer::new(store.clone()).with_in_flight_wait(Duration::from_millis(100));
    let app = app(layer, Arc::default(), gate.clone());
    let owner = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, with_header(order("k", "X"), "x-gate", "1")).await })
    };
    gate.started.notified().await;

    let (status, _, outcome) = send(&app, order("k", "Y")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(matches!(outcome, Some(Outcome::Rejected(_))), "{outcome:?}");
    let (status, _, _) = send(&app, order("k", "X")).await;
    assert_eq!(status, StatusCode::CONFLICT);

    gate.open.notify_one();
    assert_eq!(owner.await.unwrap().0, StatusCode::CREATED);
}

/// The lease is renewed every third of its length until the maximum run time, and
/// never after it.
#[tokio::test(start_paused = true)]
async fn renewals_stop_at_the_maximum_run_time() {
    let store = Switched::default();
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(300))
        .with_max_run_time(Duration::from_millis(1000));
    let app = app(layer, Arc::default(), Arc::default());
    let (status, _, _) = send(&app, with_header(order("k", "a"), "x-sleep-ms", "2950")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        store.offsets_ms("renew"),
        [100, 200, 300, 400, 500, 600, 700, 800, 900]
    );
}

/// Without a maximum run time, the lease is renewed for as long as the request runs.
#[tokio::test(start_paused = true)]
async fn without_a_maximum_run_time_renewals_go_on() {
    let store = Switched::default();
    let layer = IdempotencyLayer::new(store.clone()).with_lease(Duration::from_millis(300));
    let app = app(layer, Arc::default(), Arc::default());
    let (status, _, _) = send(&app, with_header(order("k", "a"), "x-sleep-ms", "2950")).await;
    assert_eq!(status, StatusCode::CREATED);
    let expected: Vec<u128> = (1..=29).map(|n| n * 100).collect();
    assert_eq!(store.offsets_ms("renew"), expected);
}

/// The default wait polls at once, then after pauses that double from 5 ms up to 200 ms
/// (at most five loads a second), and once more at the deadline.
#[tokio::test(start_paused = true)]
async fn the_polling_wait_backs_off_to_five_loads_a_second() {
    let store = Switched::default();
    let id = RecordId::new("tenant", "k");
    let binding = Binding {
        method: "POST".into(),
        path: "/orders".into(),
        body_sha256: [0; 32],
    };
    let hour = Duration::from_secs(3600);
    let reserved = store.reserve(&id, &binding, hour, hour).await.unwrap();
    assert!(matches!(reserved, Reservation::Reserved(_)));

    let waited = idempotency_core::wait_by_polling(&store, &id, Duration::from_millis(1000))
        .await
        .unwrap();
    assert!(
        matches!(waited, Waited::Running(Some(ref record)) if record.binding == binding),
        "{waited:?}"
    );
    assert_eq!(
        store.offsets_ms("load"),
        [0, 5, 15, 35, 75, 155, 315, 515, 715, 915, 1000]
    );
}

/// A quota refuses at its bound, by records or by bytes, and says which bound it was.
#[test]
fn a_scope_quota_refuses_at_each_bound_and_names_it() {
    let quota = ScopeQuota::default()
        .with_max_records(2)
        .with_max_bytes(100);
    assert_eq!(quota.refuses(1, 99), None);
    assert_eq!(quota.refuses(2, 0), Some("2 records".to_owned()));
    assert_eq!(quota.refuses(0, 100), Some("100 bytes".to_owned()));
    assert_eq!(ScopeQuota::default().refuses(u64::MAX, u64::MAX), None);
}

/// A reserved record counts its scope, key, method and path, and the body's hash; a
/// stored answer adds its status, each header and trailer with its separator, and its body.
#[test]
fn a_scope_quota_counts_the_bytes_a_record_holds() {
    let id = RecordId::new("tenant", "key-1");
    let binding = Binding {
        method: "POST".into(),
        path: "/orders".into(),
        body_sha256: [0; 32],
    };
    assert_eq!(id.reserved_bytes(&binding), 6 + 5 + 4 + 7 + 32);
    let answer = StoredResponse {
        status: 201,
        headers: vec![
            ("etag".into(), Bytes::from_static(b"\"v1\"")),
            ("content-type".into(), Bytes::from_static(b"text/plain")),
        ],
        body: Bytes::from_static(b"hello"),
        trailers: vec![("grpc-status".into(), Bytes::from_static(b"0"))],
    };
    assert_eq!(
        answer.stored_bytes(),
        2 + (4 + 4 + 2) + (12 + 10 + 2) + 5 + (11 + 1 + 2)
    );
}

/// A store with a byte quota refuses a scope's reservation once its records hold that
/// many bytes, and still serves other scopes.
#[tokio::test]
async fn a_byte_quota_refuses_a_scope_once_its_records_fill_it() {
    let binding = Binding {
        method: "POST".into(),
        path: "/orders".into(),
        body_sha256: [0; 32],
    };
    let per_record = RecordId::new("tenant", "key-1").reserved_bytes(&binding);
    let store =
        MemoryStore::new().with_scope_quota(ScopeQuota::default().with_max_bytes(2 * per_record));
    let minute = Duration::from_secs(60);
    for key in ["key-1", "key-2"] {
        let id = RecordId::new("tenant", key);
        let reserved = store.reserve(&id, &binding, minute, minute).await;
        assert!(matches!(reserved, Ok(Reservation::Reserved(_))), "{key}");
    }
    let refused = store
        .reserve(&RecordId::new("tenant", "key-3"), &binding, minute, minute)
        .await;
    match refused {
        Err(StoreError::QuotaExceeded { bound, .. }) => {
            assert_eq!(bound, format!("{} bytes", 2 * per_record));
        }
        other => panic!("expected the byte quota to refuse, got {other:?}"),
    }
    let elsewhere = store
        .reserve(&RecordId::new("other", "key-3"), &binding, minute, minute)
        .await;
    assert!(matches!(elsewhere, Ok(Reservation::Reserved(_))));
}

fn binding() -> Binding {
    Binding {
        method: "POST".into(),
        path: "/orders".into(),
        body_sha256: [0; 32],
    }
}

fn answer(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: Vec::new(),
        body: Bytes::from_static(body),
        trailers: Vec::new(),
    }
}

/// A store held in an `Arc` answers exactly as the store itself, through every method of
/// the request path: none falls back to the trait's default.
#[tokio::test(start_paused = true)]
async fn a_store_in_an_arc_forwards_the_request_path() {
    let store = Arc::new(MemoryStore::new());
    let (id, binding) = (RecordId::new("tenant", "k"), binding());
    let (lease, lifetime) = (Duration::from_millis(100), Duration::from_secs(60));

    let Some(Ok(Reservation::Reserved(first))) = store.reserve_now(&id, &binding, lease, lifetime)
    else {
        panic!("the memory store reserves at once, through an Arc too");
    };
    let loaded = store.load(&id).await.unwrap().expect("the reserved record");
    assert_eq!(loaded.binding, binding);
    assert!(matches!(
        store.reserve(&id, &binding, lease, lifetime).await.unwrap(),
        Reservation::Exists(_)
    ));
    assert_eq!(
        store.renew(&id, first, lease).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store
            .renew(&id, FencingToken(first.0 + 1000), lease)
            .await
            .unwrap(),
        Ownership::Lost
    );

    tokio::time::sleep(lease * 2).await;
    let second = store
        .take_over(&id, first, lease)
        .await
        .unwrap()
        .expect("the lapsed lease is taken over");
    assert_ne!(second, first);
    assert_eq!(
        store.hold(&id, second, lifetime).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(store.release(&id, second).await.unwrap(), Ownership::Held);
    assert_eq!(store.load(&id).await.unwrap(), None);
    assert!(matches!(
        store.wait(&id, Duration::from_secs(1)).await.unwrap(),
        Waited::Gone
    ));

    let Reservation::Reserved(third) = store.reserve(&id, &binding, lease, lifetime).await.unwrap()
    else {
        panic!("the released key is free again");
    };
    assert!(matches!(
        store.finalize_now(&id, third, &answer(b"done")),
        Some(Ok(Ownership::Held))
    ));
    let settled = store.wait(&id, Duration::from_secs(1)).await.unwrap();
    assert!(
        matches!(settled, Waited::Settled(ref record) if record.state == RecordState::Completed(answer(b"done"))),
        "{settled:?}"
    );
    let other = RecordId::new("tenant", "other");
    let Reservation::Reserved(fourth) = store
        .reserve(&other, &binding, lease, lifetime)
        .await
        .unwrap()
    else {
        panic!("another key is free");
    };
    assert_eq!(
        store
            .finalize(&other, fourth, &answer(b"async"))
            .await
            .unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.load(&other).await.unwrap().unwrap().state,
        RecordState::Completed(answer(b"async"))
    );
}

/// The operator's and maintenance's methods through an `Arc` are the store's own too:
/// its `inspect` has times, which the trait's default cannot give.
#[tokio::test(start_paused = true)]
async fn a_store_in_an_arc_forwards_inspect_evict_and_purge() {
    let store = Arc::new(MemoryStore::new());
    let (id, binding) = (RecordId::new("tenant", "k"), binding());
    let minute = Duration::from_secs(60);
    let Reservation::Reserved(token) = store.reserve(&id, &binding, minute, minute).await.unwrap()
    else {
        panic!("a free key");
    };

    let inspected = RecordAdmin::inspect(&store, &id)
        .await
        .unwrap()
        .expect("the reserved record");
    assert!(inspected.is_in_flight());
    assert_eq!(inspected.binding, binding);
    assert!(inspected.created_at.is_some() && inspected.inspected_at.is_some());
    assert!(matches!(
        inspected.state,
        InspectedState::InFlight {
            lease_expires_at: Some(_),
            ..
        }
    ));
    assert!(matches!(
        RecordAdmin::evict(&store, &id, EvictInFlight::Refuse)
            .await
            .unwrap(),
        Eviction::InFlight(_)
    ));

    store.finalize(&id, token, &answer(b"done")).await.unwrap();
    let inspected = RecordAdmin::inspect(&store, &id).await.unwrap().unwrap();
    assert!(!inspected.is_in_flight());
    assert_eq!(inspected.state, InspectedState::Completed { status: 201 });
    let evicted = RecordAdmin::evict(&store, &id, EvictInFlight::Refuse)
        .await
        .unwrap();
    assert!(matches!(evicted, Eviction::Evicted(_)), "{evicted:?}");
    assert_eq!(store.load(&id).await.unwrap(), None);

    store.reserve(&id, &binding, minute, minute).await.unwrap();
    tokio::time::sleep(minute * 2).await;
    let purged = PurgeExpired::purge_expired(&store, 100).await.unwrap();
    assert_eq!(purged, Purged::Deleted(1));
}

/// A store that keeps the trait's default `inspect` shows the record as `load` returns
/// it, without times; its default `evict` says it is not implemented.
#[tokio::test]
async fn the_default_inspect_reads_the_record_and_the_default_evict_refuses() {
    let store = Switched::default();
    let (id, binding) = (RecordId::new("tenant", "k"), binding());
    let minute = Duration::from_secs(60);
    assert_eq!(store.inspect(&id).await.unwrap(), None);
    store.reserve(&id, &binding, minute, minute).await.unwrap();
    let inspected = store.inspect(&id).await.unwrap();
    assert_eq!(
        inspected,
        Some(InspectedRecord {
            binding,
            state: InspectedState::InFlight {
                lease_lapsed: false,
                lease_expires_at: None,
            },
            created_at: None,
            expires_at: None,
            inspected_at: None,
        })
    );
    assert!(matches!(
        store.evict(&id, EvictInFlight::Force).await,
        Err(StoreError::Unsupported {
            method: "evict",
            ..
        })
    ));
}

/// A record's id as shown to people: the key alone without a scope, else `scope/key`.
#[test]
fn a_record_id_shows_its_scope_and_key() {
    assert_eq!(RecordId::new("", "k-1").to_string(), "k-1");
    assert_eq!(RecordId::new("tenant", "k-1").to_string(), "tenant/k-1");
}

/// A request path is bound as it is up to `MAX_KEPT_PATH` bytes, and as its hash past
/// that.
#[tokio::test]
async fn a_path_is_kept_up_to_its_limit_and_hashed_past_it() {
    let store = MemoryStore::new();
    let app = Router::new()
        .fallback(|| async { StatusCode::CREATED })
        .layer(IdempotencyLayer::new(store.clone()));
    for length in [MAX_KEPT_PATH, MAX_KEPT_PATH + 1] {
        let path = format!("/{}", "a".repeat(length - 1));
        let key = length.to_string();
        let request = Request::post(&path)
            .header("idempotency-key", &key)
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&app, request).await.0, StatusCode::CREATED);
        let record = store.load(&RecordId::new("", key)).await.unwrap().unwrap();
        if length == MAX_KEPT_PATH {
            assert_eq!(record.binding.path, path);
        } else {
            assert!(
                record.binding.path.starts_with("sha256:") && record.binding.path.len() < 100,
                "{}",
                record.binding.path
            );
        }
    }
}

/// A request body that declares exactly the limit is read; one that declares a byte
/// more is refused before it is read.
#[tokio::test]
async fn a_body_that_declares_the_limit_is_read_and_one_byte_more_is_refused() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_max_request_body(1024);
    let app = app(layer, runs.clone(), Arc::default());
    for (length, expected) in [
        (1024, StatusCode::CREATED),
        (1025, StatusCode::PAYLOAD_TOO_LARGE),
    ] {
        let request = with_header(
            order(&format!("k-{length}"), &"x".repeat(length)),
            "content-length",
            &length.to_string(),
        );
        assert_eq!(send(&app, request).await.0, expected, "{length} bytes");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Refreshes every replay from `GET /fresh`, whose answer then replaces the stored body.
struct FreshOnReplay;

impl ReplayAnswer for FreshOnReplay {
    fn refresh(&self, _retry: &Request<Bytes>, _stored: &StoredResponse) -> Option<Request<Bytes>> {
        Some(Request::get("/fresh").body(Bytes::new()).unwrap())
    }

    fn replay(
        &self,
        mut stored: StoredResponse,
        refreshed: Option<Response<Bytes>>,
    ) -> StoredResponse {
        if let Some(fresh) = refreshed {
            stored.body = fresh.into_body();
        }
        stored
    }
}

/// A replay takes the refreshing load's answer only when the load succeeded and its
/// answer fits the response limit; otherwise the stored answer is replayed as it is.
#[tokio::test]
async fn a_replay_is_refreshed_only_by_a_successful_load_within_the_limit() {
    let fresh = Arc::new(Mutex::new((StatusCode::OK, 0)));
    let answers = fresh.clone();
    let load = move || {
        let (status, length) = *answers.lock().unwrap();
        async move { (status, "f".repeat(length)) }
    };
    let routes = Router::new()
        .route(
            "/orders",
            post(|| async { (StatusCode::CREATED, "stored") }),
        )
        .route("/fresh", axum::routing::get(load));
    // Around the whole router (`Router::layer` wraps each route on its own), so that the
    // refreshing load reaches `/fresh`.
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_answer_replayer(FreshOnReplay)
        .with_max_response_body(64);
    let app = Router::new().fallback_service(tower::Layer::layer(&layer, routes));
    for (status, length, refreshed) in [
        (StatusCode::OK, 64, true),
        (StatusCode::OK, 65, false),
        (StatusCode::NOT_FOUND, 8, false),
    ] {
        *fresh.lock().unwrap() = (status, length);
        let key = format!("{status}-{length}");
        let (first, body, _) = send(&app, order(&key, "a")).await;
        assert_eq!((first, body.as_str()), (StatusCode::CREATED, "stored"));
        let (again, body, outcome) = send(&app, order(&key, "a")).await;
        assert_eq!(
            (again, outcome),
            (StatusCode::CREATED, Some(Outcome::Replayed))
        );
        let expected = if refreshed {
            "f".repeat(length)
        } else {
            "stored".to_owned()
        };
        assert_eq!(
            body, expected,
            "a load that answered {status} with {length} bytes"
        );
    }
}

/// A memory store record expires at its deadline, not after it (the rule: `now >=
/// deadline` has expired).
#[tokio::test(start_paused = true)]
async fn a_memory_store_record_expires_at_its_deadline() {
    let store = MemoryStore::new();
    let id = RecordId::new("tenant", "k");
    let deadline = Duration::from_millis(100);
    store
        .reserve(&id, &binding(), deadline, deadline)
        .await
        .unwrap();
    tokio::time::sleep(deadline - Duration::from_millis(1)).await;
    assert!(store.load(&id).await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(store.load(&id).await.unwrap(), None);
}

/// A renewal that pushes a record's expiry later is purged at its new expiry: the purge
/// that comes at the old one finds it live and must not lose track of it.
#[tokio::test(start_paused = true)]
async fn a_memory_store_record_renewed_past_its_lifetime_is_purged_when_it_expires() {
    let store = MemoryStore::new();
    let id = RecordId::new("tenant", "k");
    let (lease, lifetime) = (Duration::from_millis(50), Duration::from_millis(100));
    let Reservation::Reserved(token) = store
        .reserve(&id, &binding(), lease, lifetime)
        .await
        .unwrap()
    else {
        panic!("a free key");
    };
    let longer = Duration::from_millis(500);
    assert_eq!(
        store.renew(&id, token, longer).await.unwrap(),
        Ownership::Held
    );

    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(store.purge_expired(100).await.unwrap(), Purged::Deleted(0));
    assert_eq!(store.len(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(store.purge_expired(100).await.unwrap(), Purged::Deleted(1));
    assert_eq!(store.len(), 0);
}

/// A memory store takes records up to exactly its byte bound, and refuses past it.
#[tokio::test]
async fn a_memory_store_fills_to_exactly_its_byte_bound() {
    let store = MemoryStore::new().with_max_bytes(1024);
    let minute = Duration::from_secs(60);
    let binding = binding();
    let unkeyed = RecordId::new("", "").reserved_bytes(&binding);
    let filling = RecordId::new("", "k".repeat((1024 - unkeyed) as usize));
    assert_eq!(filling.reserved_bytes(&binding), 1024);
    let reserved = store.reserve(&filling, &binding, minute, minute).await;
    assert!(
        matches!(reserved, Ok(Reservation::Reserved(_))),
        "{reserved:?}"
    );
    let refused = store
        .reserve(&RecordId::new("", "one-more"), &binding, minute, minute)
        .await;
    assert!(
        matches!(refused, Err(StoreError::Full { .. })),
        "{refused:?}"
    );
}

/// A scope's record quota counts what the scope still holds after one of its records is
/// released: room for one more, not a fresh start.
#[tokio::test]
async fn a_released_record_gives_its_scope_room_for_one_record() {
    let store = MemoryStore::new().with_scope_quota(ScopeQuota::default().with_max_records(2));
    let minute = Duration::from_secs(60);
    let binding = binding();
    let mut tokens = Vec::new();
    for key in ["a", "b"] {
        let id = RecordId::new("tenant", key);
        let Reservation::Reserved(token) =
            store.reserve(&id, &binding, minute, minute).await.unwrap()
        else {
            panic!("room for {key}");
        };
        tokens.push((id, token));
    }
    let (id, token) = &tokens[0];
    assert_eq!(store.release(id, *token).await.unwrap(), Ownership::Held);
    let third = store
        .reserve(&RecordId::new("tenant", "c"), &binding, minute, minute)
        .await;
    assert!(matches!(third, Ok(Reservation::Reserved(_))), "{third:?}");
    let fourth = store
        .reserve(&RecordId::new("tenant", "d"), &binding, minute, minute)
        .await;
    assert!(
        matches!(fourth, Err(StoreError::QuotaExceeded { ref bound, .. }) if bound == "2 records"),
        "{fourth:?}"
    );
}

/// A memory store waiter whose record expires while it waits is told the key is gone,
/// never handed the expired record.
#[tokio::test(start_paused = true)]
async fn a_memory_store_waiter_finds_an_expired_record_gone() {
    let store = MemoryStore::new();
    let id = RecordId::new("tenant", "k");
    let lifetime = Duration::from_millis(100);
    store
        .reserve(&id, &binding(), lifetime, lifetime)
        .await
        .unwrap();
    let waited = store.wait(&id, Duration::from_secs(1)).await.unwrap();
    assert!(matches!(waited, Waited::Gone), "{waited:?}");
}
