//! The layer's overhead in process: `tower::ServiceExt::oneshot` on the trivial app, with
//! and without the layer, no HTTP and no sockets.

use std::cell::Cell;
use std::hint::black_box;
use std::time::{Duration, Instant};

use std::convert::Infallible;

use axum::body::Body;
use http::{HeaderValue, Request, Response, StatusCode, header};
use idempotency_core::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyLayer};
use idempotency_store_memory::MemoryStore;
use tokio::runtime::Runtime;
use tower::{Layer, Service, ServiceExt};

use crate::app;
use crate::harness::{Paired, paired};
use crate::report::{Estimate, Row, Verdict, paired_row};

/// How long the in-process benchmarks run.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// Interleaved rounds per comparison.
    pub rounds: usize,
    /// Requests per round.
    pub iters: u64,
}

impl Settings {
    /// A few seconds in all.
    pub fn quick() -> Self {
        Self {
            rounds: 15,
            iters: 2_000,
        }
    }

    /// A second or two: every figure once, for `compare --smoke`, not for reading.
    pub fn smoke() -> Self {
        Self {
            rounds: 3,
            iters: 100,
        }
    }

    /// About a minute in all.
    pub fn full() -> Self {
        Self {
            rounds: 41,
            iters: 5_000,
        }
    }
}

/// Which `Idempotency-Key` a request carries.
#[derive(Clone, Copy, Debug)]
enum Key {
    /// None: the layer passes the request through.
    None,
    /// A new key on every request: the first execution of each.
    Fresh,
    /// The same key on every request: every request after the first is a replay.
    Fixed,
}

struct Bench<'a> {
    runtime: &'a Runtime,
    counter: Cell<u64>,
}

impl Bench<'_> {
    fn request(&self, key: Key) -> Request<Body> {
        let mut builder = Request::post(app::PATH).header(header::CONTENT_TYPE, "application/json");
        let n = self.counter.get();
        self.counter.set(n + 1);
        // Both sides of a comparison pay for the same key formatting.
        let value = match key {
            Key::None => None,
            Key::Fresh => Some(format!("inproc-fresh-{n}")),
            Key::Fixed => Some(format!("inproc-fixed-{}", black_box(0u64))),
        };
        if let Some(value) = value {
            builder = builder.header(
                IDEMPOTENCY_KEY,
                HeaderValue::try_from(value).expect("printable key"),
            );
        }
        builder
            .body(Body::from(app::REQUEST_BODY))
            .expect("valid request")
    }

    async fn call<S: App>(&self, app: &S, key: Key) -> Response<Body> {
        let response = app
            .clone()
            .oneshot(self.request(key))
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::CREATED);
        response
    }

    fn batch<S: App>(&self, app: &S, key: Key, iters: u64) -> Duration {
        self.runtime.block_on(async {
            let start = Instant::now();
            for _ in 0..iters {
                let response = self.call(app, key).await;
                let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                    .await
                    .expect("body");
                black_box(body);
            }
            start.elapsed()
        })
    }

    fn compare<A: App, B: App>(
        &self,
        settings: Settings,
        (baseline, baseline_key): (&A, Key),
        (subject, subject_key): (&B, Key),
    ) -> Paired {
        paired(
            settings.rounds,
            settings.iters,
            |n| self.batch(baseline, baseline_key, n),
            |n| self.batch(subject, subject_key, n),
        )
    }
}

/// What the benchmark can drive: the bare router, or the router behind a layer.
trait App:
    Service<Request<Body>, Response = Response<Body>, Error = Infallible, Future: Send> + Clone + Send
{
}

impl<S> App for S where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible, Future: Send>
        + Clone
        + Send
{
}

fn layer() -> IdempotencyLayer {
    // The default bound (10,000 live records) would fill up during the fresh-key benchmark
    // and answer 503; the benchmark measures the steady state, not the bound.
    IdempotencyLayer::new(
        MemoryStore::new()
            .with_max_entries(100_000_000)
            .with_max_bytes(u64::MAX),
    )
}

/// A row read by the fastest rounds: in process, noise only ever adds time.
fn row(name: &str, result: Paired, baseline: &str, target: &str, verdict: Verdict) -> Row {
    paired_row(
        name,
        result,
        Estimate::FastestRounds,
        baseline,
        target,
        verdict,
    )
}

/// Runs the in-process comparisons and returns their rows.
pub fn run(settings: Settings) -> Vec<Row> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let bench = Bench {
        runtime: &runtime,
        counter: Cell::new(0),
    };
    let bare = app::bare();
    // The layer around the whole app, as the README recommends: what it costs on its own.
    let wrapped = || layer().layer(app::bare());

    // Sanity: the layered app executes once and replays after.
    let check = wrapped();
    runtime.block_on(async {
        let first = bench.call(&check, Key::Fixed).await;
        assert!(first.headers().get(IDEMPOTENT_REPLAYED).is_none());
        let second = bench.call(&check, Key::Fixed).await;
        assert_eq!(
            second.headers().get(IDEMPOTENT_REPLAYED),
            Some(&HeaderValue::from_static("true")),
            "the layered app does not replay"
        );
    });

    let mut rows = Vec::new();

    let no_key = wrapped();
    let result = bench.compare(settings, (&bare, Key::None), (&no_key, Key::None));
    rows.push(row(
        "in-process oneshot, no key (layer around the app + memory store)",
        result,
        "bare",
        "costs < 1% (≥ 0.99×)",
        Verdict::from_bool(result.throughput_ratio >= 0.99),
    ));
    // With `Router::layer` axum boxes every layered route and its response future, a
    // cost any layer pays. Against a no-op layer added the same way, what is left is ours.
    let identity = app::bare().layer(tower::layer::util::Identity::new());
    let per_route = app::layered(layer());
    let result = bench.compare(settings, (&identity, Key::None), (&per_route, Key::None));
    rows.push(row(
        "in-process oneshot, no key, `Router::layer` (ours vs a no-op layer added the same way)",
        result,
        "no-op `Identity` layer",
        "costs < 1% (≥ 0.99×)",
        Verdict::from_bool(result.throughput_ratio >= 0.99),
    ));
    let result = bench.compare(settings, (&bare, Key::None), (&identity, Key::None));
    rows.push(row(
        "in-process oneshot, no key: a no-op layer with `Router::layer` (axum's own cost)",
        result,
        "bare",
        "",
        Verdict::Info,
    ));

    let fresh = wrapped();
    let result = bench.compare(settings, (&bare, Key::Fresh), (&fresh, Key::Fresh));
    rows.push(row(
        "in-process oneshot, first execution (fresh key, memory store)",
        result,
        "bare",
        "≥ 0.90×",
        Verdict::from_bool(result.throughput_ratio >= 0.90),
    ));

    let replay = wrapped();
    let result = bench.compare(settings, (&bare, Key::Fixed), (&replay, Key::Fixed));
    rows.push(row(
        "in-process oneshot, replay (memory store) vs the bare trivial handler",
        result,
        "bare",
        "replay faster than the handler (> 1×)",
        Verdict::from_bool(result.throughput_ratio > 1.0),
    ));

    let result = bench.compare(settings, (&fresh, Key::Fresh), (&replay, Key::Fixed));
    rows.push(row(
        "in-process oneshot, replay vs first execution (memory store)",
        result,
        "first execution",
        "",
        Verdict::Info,
    ));

    // The function API: work run through `AtMostOnce` (a keyed request on the layer's own
    // path) against the same work called directly. The work is the handler's: it makes
    // the answer's JSON. Fresh keys: first executions; one key: replays.
    let once = idempotency_core::AtMostOnce::new(layer().with_scope(idempotency_core::SingleScope));
    let work = || async {
        let value: serde_json::Value =
            serde_json::from_str(app::RESPONSE_BODY).expect("the handler's JSON");
        Ok::<_, idempotency_core::WorkError<()>>(value)
    };
    let runtime = &runtime;
    let direct = |n: u64| {
        runtime.block_on(async {
            let start = Instant::now();
            for _ in 0..n {
                black_box(work().await.ok());
            }
            start.elapsed()
        })
    };
    let through_once = |fixed: bool| {
        let (once, counter) = (&once, &bench.counter);
        move |n: u64| {
            runtime.block_on(async {
                let start = Instant::now();
                for _ in 0..n {
                    let i = counter.get();
                    counter.set(i + 1);
                    let key = if fixed {
                        "once-fixed".to_owned()
                    } else {
                        format!("once-{i}")
                    };
                    let result = once.run("bench", &key, &app::REQUEST_BODY, work).await;
                    black_box(result.expect("the work's result"));
                }
                start.elapsed()
            })
        }
    };
    for (name, fixed) in [("first execution", false), ("replay", true)] {
        let result = paired(settings.rounds, settings.iters, direct, through_once(fixed));
        rows.push(row(
            &format!(
                "in-process `AtMostOnce::run`, {name} (memory store) vs the work called directly"
            ),
            result,
            "direct call",
            "",
            Verdict::Info,
        ));
    }

    // Metrics: the layer records every outcome, store call and wait through the `metrics`
    // facade. No recorder is installed here, the case whose target is "no cost beyond a
    // branch": against the same layer built `with_metrics(false)` (no metrics call, no
    // clock read for them) the difference is what recording costs without a recorder.
    let unmetered = || layer().with_metrics(false).layer(app::bare());
    for (name, key) in [
        ("no key", Key::None),
        ("first execution", Key::Fresh),
        ("replay", Key::Fixed),
    ] {
        let (off, on) = (unmetered(), wrapped());
        let result = bench.compare(settings, (&off, key), (&on, key));
        rows.push(row(
            &format!(
                "in-process oneshot, {name}: metrics on, no recorder installed, vs `with_metrics(false)`"
            ),
            result,
            "metrics off",
            "no cost beyond the noise (≈ 1.00×)",
            Verdict::Info,
        ));
    }
    rows
}
