//! The layer's metrics and its span, as an application with a recorder and a `tracing`
//! subscriber sees them: keyed requests through an axum router wrapped by the layer,
//! counted by outcome; store calls and waits timed; purges counted; one span per keyed
//! request carrying the outcome and the key's hash, never the key.
//!
//! Each test installs a recorder of its own for the current thread only
//! (`metrics::set_default_local_recorder`), on a current-thread runtime, so that tests
//! running side by side never see each other's numbers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idempotency_core::metrics::{
    OPERATION, OUTCOME, RECORDS_PURGED, REJECTION, REQUESTS, STORE_DURATION, STORE_RESULT,
    WAIT_DURATION,
};
use idempotency_core::{
    IdempotencyLayer, IdempotencyStore, PurgeExpired, RecordAdmin, purge_all_expired,
};
use idempotency_store_memory::MemoryStore;
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use tower::ServiceExt;

/// A recorder that keeps every counter and histogram by name and labels.
#[derive(Default)]
struct Recorded {
    counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
    histograms: Mutex<BTreeMap<String, Arc<Samples>>>,
}

#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

/// `name{label=value,…}`, labels in the order the key has them.
fn series(key: &Key) -> String {
    let labels: Vec<String> = key
        .labels()
        .map(|label| format!("{}={}", label.key(), label.value()))
        .collect();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl Recorder for Recorded {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut counters = self.counters.lock().unwrap();
        Counter::from_arc(counters.entry(series(key)).or_default().clone())
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let mut histograms = self.histograms.lock().unwrap();
        Histogram::from_arc(histograms.entry(series(key)).or_default().clone())
    }
}

impl Recorded {
    fn counters(&self) -> BTreeMap<String, u64> {
        self.counters
            .lock()
            .unwrap()
            .iter()
            .map(|(name, value)| (name.clone(), value.load(Ordering::SeqCst)))
            .collect()
    }

    fn samples(&self, series: &str) -> Vec<f64> {
        self.histograms
            .lock()
            .unwrap()
            .get(series)
            .map(|samples| samples.0.lock().unwrap().clone())
            .unwrap_or_default()
    }
}

fn requests(outcome: &str) -> String {
    format!("{REQUESTS}{{{OUTCOME}={outcome}}}")
}

fn rejected(kind: &str) -> String {
    format!("{REQUESTS}{{{OUTCOME}=rejected,{REJECTION}={kind}}}")
}

fn store_call(operation: &str, result: &str) -> String {
    format!("{STORE_DURATION}{{{OPERATION}={operation},{STORE_RESULT}={result}}}")
}

/// `POST /things/{status}` answers `status`, after sleeping for the `x-sleep-ms` header.
fn app() -> Router {
    async fn handler(Path(status): Path<u16>, headers: axum::http::HeaderMap) -> StatusCode {
        if let Some(ms) = headers.get("x-sleep-ms") {
            let ms: u64 = ms.to_str().unwrap().parse().unwrap();
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        StatusCode::from_u16(status).unwrap()
    }
    Router::new().route("/things/{status}", post(handler))
}

async fn send(app: &Router, path: &str, keys: &[&str], body: &str) -> StatusCode {
    let mut request = Request::post(path);
    for key in keys {
        request = request.header("idempotency-key", *key);
    }
    app.clone()
        .oneshot(request.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap()
        .status()
}

#[tokio::test]
async fn every_outcome_is_counted_once_by_its_name_and_store_calls_are_timed() {
    let recorder = Recorded::default();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let app = app().layer(IdempotencyLayer::new(MemoryStore::new()));

    assert_eq!(send(&app, "/things/201", &["k1"], "a").await, 201);
    assert_eq!(send(&app, "/things/201", &["k1"], "a").await, 201); // replay
    assert_eq!(send(&app, "/things/201", &["k1"], "b").await, 422); // other body
    assert_eq!(send(&app, "/things/201", &["k2", "k3"], "a").await, 400); // two headers
    assert_eq!(send(&app, "/things/503", &["k4"], "a").await, 503); // released
    assert_eq!(send(&app, "/things/201", &[], "a").await, 201); // no key: not counted

    let expected: BTreeMap<String, u64> = [
        (requests("executed"), 1),
        (requests("replayed"), 1),
        (requests("released"), 1),
        (rejected("key-reused"), 1),
        (rejected("duplicate-key-header"), 1),
    ]
    .into_iter()
    .collect();
    assert_eq!(recorder.counters(), expected);

    // Reserve for each keyed request that got past its header (k1 three times, k4),
    // finalize for the stored answer, release for the 503.
    assert_eq!(recorder.samples(&store_call("reserve", "ok")).len(), 4);
    assert_eq!(recorder.samples(&store_call("finalize", "ok")).len(), 1);
    assert_eq!(recorder.samples(&store_call("release", "ok")).len(), 1);
    for sample in recorder.samples(&store_call("reserve", "ok")) {
        assert!(
            (0.0..5.0).contains(&sample),
            "a memory-store reserve took {sample} s?"
        );
    }
}

#[tokio::test]
async fn a_duplicate_that_outwaits_its_owner_is_a_conflict_and_its_wait_is_timed() {
    let recorder = Recorded::default();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let layer =
        IdempotencyLayer::new(MemoryStore::new()).with_in_flight_wait(Duration::from_millis(100));
    let app = app().layer(layer);

    let slow = {
        let app = app.clone();
        async move {
            let request = Request::post("/things/201")
                .header("idempotency-key", "slow")
                .header("x-sleep-ms", "600")
                .body(Body::from("a"))
                .unwrap();
            app.oneshot(request).await.unwrap().status()
        }
    };
    let duplicate = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        send(&app, "/things/201", &["slow"], "a").await
    };
    let (first, second) = tokio::join!(slow, duplicate);
    assert_eq!((first, second), (StatusCode::CREATED, StatusCode::CONFLICT));

    let counters = recorder.counters();
    assert_eq!(
        counters.get(&rejected("in-flight")),
        Some(&1),
        "{counters:?}"
    );
    assert_eq!(
        counters.get(&requests("executed")),
        Some(&1),
        "{counters:?}"
    );
    let waits = recorder.samples(&format!("{WAIT_DURATION}{{}}"));
    assert_eq!(waits.len(), 1, "one wait: {waits:?}");
    assert!(
        (0.09..5.0).contains(&waits[0]),
        "the duplicate waited its in-flight wait (100 ms), not {} s",
        waits[0]
    );
}

#[tokio::test]
async fn a_failing_store_is_timed_as_an_error_and_fail_open_is_counted() {
    let recorder = Recorded::default();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let app = app()
        .layer(IdempotencyLayer::from_shared_store(Arc::new(Unreachable)).with_fail_open(true));
    assert_eq!(send(&app, "/things/201", &["k"], "a").await, 201);
    let closed = app
        .clone()
        .layer(IdempotencyLayer::from_shared_store(Arc::new(Unreachable)).with_fail_open(false));
    assert_eq!(send(&closed, "/things/201", &["k"], "a").await, 503);

    let counters = recorder.counters();
    assert_eq!(counters.get(&requests("ran-unprotected")), Some(&1));
    assert_eq!(counters.get(&rejected("store-unavailable")), Some(&1));
    assert_eq!(recorder.samples(&store_call("reserve", "error")).len(), 2);
}

#[tokio::test]
async fn a_layer_without_metrics_records_nothing() {
    let recorder = Recorded::default();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let app = app().layer(IdempotencyLayer::new(MemoryStore::new()).with_metrics(false));
    assert_eq!(send(&app, "/things/201", &["k"], "a").await, 201);
    assert_eq!(send(&app, "/things/201", &["k"], "a").await, 201);
    assert_eq!(send(&app, "/things/201", &["k", "k"], "a").await, 400);
    assert!(recorder.counters().is_empty(), "{:?}", recorder.counters());
    assert!(recorder.histograms.lock().unwrap().is_empty());
}

#[tokio::test]
async fn purges_are_counted_and_timed() {
    let recorder = Recorded::default();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let store = MemoryStore::new();
    let binding = idempotency_core::Binding {
        method: "POST".into(),
        path: "/".into(),
        body_sha256: [0; 32],
    };
    for i in 0..5 {
        let id = idempotency_core::RecordId::new("", format!("k{i}"));
        let short = Duration::from_millis(10);
        store.reserve(&id, &binding, short, short).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    purge_all_expired(&store, 2).await.unwrap();
    assert_eq!(
        recorder.counters().get(&format!("{RECORDS_PURGED}{{}}")),
        Some(&5)
    );
    // Batches of 2, 2, 1.
    assert_eq!(recorder.samples(&store_call("purge", "ok")).len(), 3);
}

/// A store that cannot be reached.
struct Unreachable;

#[idempotency_core::async_trait]
impl IdempotencyStore for Unreachable {
    async fn reserve(
        &self,
        _: &idempotency_core::RecordId,
        _: &idempotency_core::Binding,
        _: Duration,
        _: Duration,
    ) -> Result<idempotency_core::Reservation, idempotency_core::StoreError> {
        Err(down())
    }
    async fn load(
        &self,
        _: &idempotency_core::RecordId,
    ) -> Result<Option<idempotency_core::IdempotencyRecord>, idempotency_core::StoreError> {
        Err(down())
    }
    async fn renew(
        &self,
        _: &idempotency_core::RecordId,
        _: idempotency_core::FencingToken,
        _: Duration,
    ) -> Result<idempotency_core::Ownership, idempotency_core::StoreError> {
        Err(down())
    }
    async fn finalize(
        &self,
        _: &idempotency_core::RecordId,
        _: idempotency_core::FencingToken,
        _: &idempotency_core::StoredResponse,
    ) -> Result<idempotency_core::Ownership, idempotency_core::StoreError> {
        Err(down())
    }
    async fn release(
        &self,
        _: &idempotency_core::RecordId,
        _: idempotency_core::FencingToken,
    ) -> Result<idempotency_core::Ownership, idempotency_core::StoreError> {
        Err(down())
    }
    async fn take_over(
        &self,
        _: &idempotency_core::RecordId,
        _: idempotency_core::FencingToken,
        _: Duration,
    ) -> Result<Option<idempotency_core::FencingToken>, idempotency_core::StoreError> {
        Err(down())
    }
}

#[idempotency_core::async_trait]
impl RecordAdmin for Unreachable {}

#[idempotency_core::async_trait]
impl PurgeExpired for Unreachable {
    async fn purge_expired(
        &self,
        _: usize,
    ) -> Result<idempotency_core::Purged, idempotency_core::StoreError> {
        Err(down())
    }
}

fn down() -> idempotency_core::StoreError {
    idempotency_core::StoreError::backend(std::io::Error::other("connection refused"))
}

/// The trait's defaults: a store that implements neither inspects through `load` (no
/// times) and refuses to evict, saying what its author must implement.
#[tokio::test]
async fn a_store_without_inspect_or_evict_gets_the_defaults() {
    let id = idempotency_core::RecordId::new("", "k");
    let error = Unreachable
        .evict(&id, idempotency_core::EvictInFlight::Refuse)
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(error, idempotency_core::StoreError::Unsupported { .. })
            && message.contains("RecordAdmin::evict"),
        "{message}"
    );
    // inspect falls back to load, whose error it passes on.
    assert!(Unreachable.inspect(&id).await.is_err());
}

/// One span per keyed request, named `idempotency`, with the key's short hash and the
/// outcome; the key itself appears nowhere in the logs.
#[test]
fn each_keyed_request_has_a_span_with_its_outcome_and_never_its_key() {
    #[derive(Clone, Default)]
    struct Logs(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Logs {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let key = "a-secret-key-0123456789";
    tracing::subscriber::with_default(subscriber, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let app = app().layer(IdempotencyLayer::new(MemoryStore::new()));
            assert_eq!(send(&app, "/things/201", &[key], "a").await, 201);
            assert_eq!(send(&app, "/things/201", &[key], "a").await, 201);
            assert_eq!(send(&app, "/things/201", &[key], "b").await, 422);
        });
    });
    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(!logs.contains(key), "the key must never be logged:\n{logs}");
    let closed: Vec<&str> = logs
        .lines()
        .filter(|line| line.contains("idempotency{") && line.contains("close"))
        .collect();
    assert_eq!(closed.len(), 3, "one span per keyed request:\n{logs}");
    for (line, outcome) in closed
        .iter()
        .zip(["executed", "replayed", "rejected:key-reused"])
    {
        assert!(
            line.contains(&format!("outcome={outcome}")),
            "span without outcome {outcome}: {line}"
        );
        let hash = line
            .split("key=")
            .nth(1)
            .and_then(|rest| rest.split([' ', '}']).next())
            .unwrap_or_default();
        assert!(
            hash.len() == 12 && hash.chars().all(|c| c.is_ascii_hexdigit()),
            "the span carries the key's short hash, not {hash:?}: {line}"
        );
    }
}

/// A handler that finalized in its own transaction: the request is counted once, as
/// executed, and the layer makes no finalize call of its own.
#[tokio::test]
async fn an_answer_finalized_in_the_handlers_transaction_is_counted_once() {
    use axum::Extension;
    use axum::response::IntoResponse;
    use idempotency_core::ReservationHandle;

    let recorder = Recorded::default();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let store = Arc::new(MemoryStore::new());
    let records = store.clone();
    let handler = move |Extension(reservation): Extension<ReservationHandle>| {
        let records = records.clone();
        async move {
            let answer = (StatusCode::CREATED, "made").into_response();
            let prepared = reservation.prepare_answer(answer).await.unwrap();
            let stored = prepared.stored().unwrap();
            // The handler's own write, standing in for its transaction's.
            records
                .finalize(reservation.id(), reservation.token(), stored)
                .await
                .unwrap();
            prepared.into_finalized::<Body>()
        }
    };
    let app = Router::new()
        .route("/orders", post(handler))
        .layer(IdempotencyLayer::from_shared_store(store));

    assert_eq!(send(&app, "/orders", &["k1"], "a").await, 201);
    let expected: BTreeMap<String, u64> = [(requests("executed"), 1)].into_iter().collect();
    assert_eq!(recorder.counters(), expected);
    assert!(recorder.samples(&store_call("finalize", "ok")).is_empty());
    assert_eq!(recorder.samples(&store_call("reserve", "ok")).len(), 1);
}
