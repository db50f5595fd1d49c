//! One run: the real layer over the store under test (through the fault wrapper), the
//! seed's clients against it, a quiet phase, and the checker's verdict.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use idempotency_core::conformance::Leftovers;
use idempotency_core::{
    IdempotencyBody, IdempotencyLayer, IdempotencyStore, JsonPointerKey, OutcomeUnknown,
    PurgeExpired, ReservationHandle, WrappedBodies,
};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tower::{Layer, Service, ServiceExt};

use crate::check::{Violation, check};
use crate::faults::FaultyStore;
use crate::history::{Answer, Change, Ending, Event, History, KeyOf};
use crate::plan::{Behaviour, Settings, Step, plan};

/// The store a run drives, and what the run may ask of it besides the request path.
#[derive(Clone)]
pub struct Target {
    /// The store under test.
    pub store: Arc<dyn IdempotencyStore>,
    /// Its purge, run now and then during the run (records expire mid-run).
    pub purge: Option<Arc<dyn PurgeExpired>>,
    /// What it holds per request (transactions, connections), checked once quiet.
    pub leftovers: Option<Arc<dyn Leftovers>>,
    /// Put before every scope (with the seed), so that runs on a shared server never
    /// meet.
    pub namespace: String,
    /// Where the handler writes its changes, if it writes through a transaction: its
    /// answers that are stored (201, 400) then commit with their change.
    pub effects: Option<Arc<dyn Effects>>,
    /// Faults of the target's own (a proxy in front of its database): turned on with the
    /// run's seed as it begins, off when the quiet phase does.
    pub own_faults: Option<Arc<dyn OwnFaults>>,
    /// Whether the store holds its reservations unseen, in a transaction of its own (the
    /// one-commit store with `Reservations::Uncommitted`): the store's answers cannot say
    /// so, and the checker then knows that such a reservation has no lease that could
    /// lapse (unless it is taken over, which proves it a record under a lease).
    pub reservations_unseen: bool,
}

/// Faults a target injects itself, beside the store wrapper's: a proxy in front of its
/// database that loses `COMMIT` answers, cuts connections and restarts the server.
pub trait OwnFaults: Send + Sync + 'static {
    /// Turns the faults on for a run with `seed`. `dropped` is called each time the
    /// server drops client connections (a restart, a connection cut): the transactions
    /// open on them end there, uncommitted reservations with them.
    fn start(&self, seed: u64, dropped: Arc<dyn Fn() + Send + Sync>);
    /// Turns them off: the run goes quiet.
    fn stop(&self);
}

/// A handler's change written to a database, for targets whose handler writes through
/// the store's transactional path (`Tx`): the change and the answer commit together, or
/// neither does. The test of such a target implements it.
#[async_trait::async_trait]
pub trait Effects: Send + Sync + 'static {
    /// Writes execution `exec`'s change for `key` in the transaction of the request
    /// `reservation` belongs to, with `answer`, and commits: the answer to send (`answer`
    /// once committed, else an error answer, a 5xx marked `OutcomeUnknown` where the store
    /// says so) and what became of the change.
    async fn write(
        &self,
        reservation: Option<ReservationHandle>,
        exec: u64,
        key: &KeyOf,
        answer: Response<Full<Bytes>>,
    ) -> (Response<Full<Bytes>>, Change);

    /// The executions whose change the database holds, among those of `namespace`.
    async fn in_database(&self, namespace: &str) -> Vec<u64>;

    /// Whether the idempotency records are in the same database and commit with the
    /// change (the one-commit store), or are kept elsewhere (Redis) and recorded by the
    /// layer after the handler committed.
    fn records_commit_with_changes(&self) -> bool;
}

/// What a run did and what the checker found.
pub struct Run {
    /// The run's seed.
    pub seed: u64,
    /// Its history.
    pub history: Arc<History>,
    /// The broken rules (empty: the run passed).
    pub violations: Vec<Violation>,
}

impl Run {
    /// Panics with the seed, the broken rules and the history of the keys involved when
    /// the run broke a rule.
    pub fn assert_passed(&self, store: &str) {
        if self.violations.is_empty() {
            return;
        }
        let mut keys: Vec<KeyOf> = self
            .violations
            .iter()
            .flat_map(|violation| violation.keys.iter().cloned())
            .collect();
        keys.sort();
        keys.dedup();
        let rules: Vec<String> = self
            .violations
            .iter()
            .map(|violation| format!("- {}: {}", violation.rule, violation.what))
            .collect();
        panic!(
            "the simulation on {store} broke {} rule(s) with seed {} (replay it with \
             SIM_SEED={}):\n{}\n\nhistory of the keys involved:\n{}",
            self.violations.len(),
            self.seed,
            self.seed,
            rules.join("\n"),
            self.history.render(Some(&keys))
        );
    }
}

type RequestBody = UnsyncBoxBody<Bytes, Infallible>;
type Layered = <IdempotencyLayer<WrappedBodies> as Layer<Handler>>::Service;

const EXEC_HEADER: HeaderName = HeaderName::from_static("x-exec");

/// The service's own failure (`Behaviour::Fails`).
#[derive(Debug)]
struct Failed;

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the handler failed (on purpose: a simulated failure)")
    }
}

impl std::error::Error for Failed {}

/// The handler: does what the request's `x-behaviour` says, after `x-sleep-ms`, and
/// records each execution (its number, request, key and reservation token) in the
/// history. Its answers name the execution in `x-exec` (a kept header) and the body.
#[derive(Clone)]
struct Handler {
    history: Arc<History>,
    next_exec: Arc<AtomicU64>,
    effects: Option<Arc<dyn Effects>>,
}

impl Service<Request<IdempotencyBody<RequestBody>>> for Handler {
    type Response = Response<Full<Bytes>>;
    type Error = Failed;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Failed>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Failed>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<IdempotencyBody<RequestBody>>) -> Self::Future {
        let history = self.history.clone();
        let exec = self.next_exec.fetch_add(1, Ordering::SeqCst) + 1;
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let behaviour = Behaviour::from_name(&header("x-behaviour")).unwrap_or(Behaviour::Created);
        let sleep = Duration::from_millis(header("x-sleep-ms").parse().unwrap_or(0));
        let number = header("x-request").parse().unwrap_or(0);
        let body = if header("x-body") == "b" { "b" } else { "a" };
        // The key as the layer reserved it (the layer does not forward the header).
        let reservation = request.extensions().get::<ReservationHandle>();
        let key = KeyOf {
            scope: reservation.map_or_else(String::new, |r| r.id().scope.clone()),
            key: reservation.map_or_else(String::new, |r| r.id().key.clone()),
        };
        let token = reservation.map_or(0, |reservation| reservation.token().0);
        let reservation = reservation.cloned();
        let effects = self.effects.clone();
        Box::pin(async move {
            history.push(Event::ExecStarted {
                exec,
                request: number,
                key: key.clone(),
                body,
                token,
            });
            tokio::time::sleep(sleep).await;
            let (status, unknown) = match behaviour {
                Behaviour::Created | Behaviour::Slow => (StatusCode::CREATED, false),
                Behaviour::BadRequest => (StatusCode::BAD_REQUEST, false),
                Behaviour::ServerError => (StatusCode::INTERNAL_SERVER_ERROR, false),
                Behaviour::Unauthorized => (StatusCode::UNAUTHORIZED, false),
                Behaviour::Unknown => (StatusCode::INTERNAL_SERVER_ERROR, true),
                Behaviour::Panics | Behaviour::Fails => {
                    history.push(Event::ExecEnded {
                        exec,
                        answer: None,
                        unknown: false,
                        change: Change::None,
                        recorded: None,
                    });
                    if behaviour == Behaviour::Fails {
                        return Err(Failed);
                    }
                    panic!("a simulated handler panic (exec {exec})");
                }
            };
            let text = Bytes::from(format!("exec {exec} for request {number}"));
            let named = |mut response: Response<Full<Bytes>>| {
                let headers = response.headers_mut();
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
                headers.insert(EXEC_HEADER, HeaderValue::from(exec));
                response
            };
            let mut response = named(Response::new(Full::new(text.clone())));
            *response.status_mut() = status;
            if unknown {
                response.extensions_mut().insert(OutcomeUnknown);
            }
            let intended = (status.as_u16(), text.clone());
            let (response, change) = match effects {
                Some(effects) if behaviour.is_stored() => {
                    let (answer, change) = effects.write(reservation, exec, &key, response).await;
                    (named(answer), change)
                }
                _ => (response, Change::None),
            };
            let (parts, full) = response.into_parts();
            let text = full
                .collect()
                .await
                .map_or_else(|never| match never {}, |body| body.to_bytes());
            let answer = (parts.status.as_u16(), text.clone());
            history.push(Event::ExecEnded {
                exec,
                recorded: (change != Change::None && answer != intended).then_some(intended),
                answer: Some(answer),
                unknown: parts.extensions.get::<OutcomeUnknown>().is_some(),
                change,
            });
            Ok(Response::from_parts(parts, Full::new(text)))
        })
    }
}

/// Runs one seed against `target` and judges it.
pub async fn simulate(target: &Target, settings: &Settings, seed: u64) -> Run {
    quiet_simulated_panics();
    let history = Arc::new(History::new());
    let store = Arc::new(FaultyStore::new(
        target.store.clone(),
        settings.faults,
        StdRng::seed_from_u64(seed ^ 0x5eed_fa17),
        history.clone(),
        target.reservations_unseen,
    ));
    let handler = Handler {
        history: history.clone(),
        next_exec: Arc::new(AtomicU64::new(0)),
        effects: target.effects.clone(),
    };
    let service = IdempotencyLayer::from_shared_store(store.clone())
        .with_scope(|parts: &http::request::Parts| {
            parts
                .headers
                .get("x-scope")
                .and_then(|scope| scope.to_str().ok())
                .map(str::to_owned)
        })
        .with_lifetime(settings.lifetime)
        .with_grace_period(Duration::ZERO)
        .with_lease(settings.lease)
        .with_in_flight_wait(settings.in_flight_wait)
        .with_replayed_headers([CONTENT_TYPE, EXEC_HEADER]);
    let service = if settings.keys_in_body {
        service.with_payload_key(JsonPointerKey::new("/key").with_fingerprint(["/body"]))
    } else {
        service
    };
    let service = service.wrap_bodies().layer(handler);

    if let Some(own_faults) = &target.own_faults {
        let history = history.clone();
        own_faults.start(
            seed,
            Arc::new(move || history.push(Event::ConnectionsDropped)),
        );
    }
    let purging = target.purge.clone().map(|purge| {
        let every = settings.lifetime / 3;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let _ = purge.purge_expired(100).await;
            }
        })
    });

    let keys_in_body = settings.keys_in_body;
    // Each seed's keys are its own: a run never meets the records of the run before.
    let scope = |index: usize| format!("{}{seed}-s{index}", target.namespace);
    let next_request = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = plan(seed, settings)
        .into_iter()
        .map(|steps| {
            let (service, history, next_request) =
                (service.clone(), history.clone(), next_request.clone());
            let scopes: Vec<String> = (0..settings.scopes).map(scope).collect();
            tokio::spawn(async move {
                for step in steps {
                    tokio::time::sleep(step.think).await;
                    let key = KeyOf {
                        scope: scopes[step.scope].clone(),
                        key: format!("k{}", step.key),
                    };
                    let number = next_request.fetch_add(1, Ordering::SeqCst) + 1;
                    send(&service, &history, number, key, &step, keys_in_body).await;
                }
            })
        })
        .collect();
    for client in clients {
        client.await.expect("a client's task");
    }

    // Quiet: no more faults; every owner finishes and every record expires.
    history.push(Event::Quiet);
    store.disable_faults();
    if let Some(own_faults) = &target.own_faults {
        own_faults.stop();
    }
    tokio::time::sleep(
        settings.lifetime
            + settings.lease * 4
            + settings.faults.max_latency * 4
            + settings.clock_tolerance * 2,
    )
    .await;
    let mut violations = Vec::new();
    if let Some(leftovers) = &target.leftovers {
        let held = settled(leftovers.as_ref()).await;
        if !held.is_empty() {
            violations.push(Violation {
                rule: "nothing outlives its request",
                what: format!("once quiet, the store still holds: {}", held.join("; ")),
                keys: Vec::new(),
            });
        }
    }
    let mut final_requests = Vec::new();
    for scope_index in 0..settings.scopes {
        for key in 0..settings.keys {
            let number = next_request.fetch_add(1, Ordering::SeqCst) + 1;
            let step = Step {
                think: Duration::ZERO,
                scope: scope_index,
                key,
                body: "a",
                behaviour: Behaviour::Created,
                handler_time: Duration::ZERO,
                gives_up_after: None,
            };
            let key = KeyOf {
                scope: scope(scope_index),
                key: format!("k{key}"),
            };
            send(&service, &history, number, key, &step, keys_in_body).await;
            final_requests.push(number);
        }
    }
    if let Some(purging) = purging {
        purging.abort();
    }
    let in_database = match &target.effects {
        Some(effects) => Some((
            effects
                .in_database(&format!("{}{seed}-", target.namespace))
                .await,
            effects.records_commit_with_changes(),
        )),
        None => None,
    };
    violations.extend(check(
        &history.events(),
        settings,
        &final_requests,
        in_database
            .as_ref()
            .map(|(found, with_records)| (&found[..], *with_records)),
    ));
    Run {
        seed,
        history,
        violations,
    }
}

/// Sends one request on a task of its own (a panicking handler fails only it), records
/// it and how it ended.
async fn send(
    service: &Layered,
    history: &Arc<History>,
    number: u64,
    key: KeyOf,
    step: &Step,
    key_in_body: bool,
) {
    history.push(Event::Sent {
        request: number,
        key: key.clone(),
        body: step.body,
        behaviour: step.behaviour.name().to_owned(),
    });
    let (mut request, body) = if key_in_body {
        let body = serde_json::json!({"key": key.key, "body": step.body}).to_string();
        (Request::post("/simulated"), Bytes::from(body))
    } else {
        let request = Request::post("/simulated").header("idempotency-key", &key.key);
        (request, Bytes::from_static(step.body.as_bytes()))
    };
    request = request
        .header("x-scope", &key.scope)
        .header("x-request", number)
        .header("x-behaviour", step.behaviour.name())
        .header("x-sleep-ms", step.handler_time.as_millis() as u64)
        .header("x-body", step.body);
    let request = request
        .body(
            Full::new(body)
                .map_err(|never| match never {})
                .boxed_unsync(),
        )
        .expect("a valid request");
    let service = service.clone();
    let gives_up_after = step.gives_up_after;
    let task = tokio::spawn(async move {
        let answer = async move {
            let response = service.oneshot(request).await.map_err(|_| ())?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|_| ())?.to_bytes();
            Ok::<_, ()>(Answer {
                status: parts.status.as_u16(),
                replayed: parts.headers.contains_key("idempotent-replayed"),
                exec_header: parts
                    .headers
                    .get(EXEC_HEADER)
                    .and_then(|exec| exec.to_str().ok())
                    .map(str::to_owned),
                body,
            })
        };
        match gives_up_after {
            Some(after) => match tokio::time::timeout(after, answer).await {
                Ok(answer) => answer.map_or(Ending::Failed, Ending::Answered),
                Err(_) => Ending::GaveUp,
            },
            None => answer.await.map_or(Ending::Failed, Ending::Answered),
        }
    });
    let ending = match task.await {
        Ok(ending) => ending,
        Err(join) if join.is_panic() => Ending::Failed,
        Err(join) => panic!("a request's task ended without an answer: {join}"),
    };
    history.push(Event::Ended {
        request: number,
        ending,
    });
}

/// What `leftovers` still holds after up to 5 s of waiting for it to let go.
async fn settled(leftovers: &dyn Leftovers) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let held = leftovers.held().await;
        if held.is_empty() || tokio::time::Instant::now() >= deadline {
            return held;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The handler's panics are part of the workload: keep them out of the test output.
fn quiet_simulated_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let simulated = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|message| message.starts_with("a simulated handler panic"));
            if !simulated {
                previous(info);
            }
        }));
    });
}
