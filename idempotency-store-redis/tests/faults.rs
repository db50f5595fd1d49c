//! Redis failing under load. Keyed requests stream through the layer while the server is
//! killed and restarted (its append-only file flushed on every write), or while every
//! client connection is killed with `CLIENT KILL`, again and again; on a single server and
//! on a three-primary cluster. Requests that meet the outage get 503 with `Retry-After`;
//! no mutation runs twice; no finalized record is lost; the application recovers by
//! itself, without a restart.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use common::{RedisCluster, RedisServer, bounded, redis_available, redis_cli};
use http_body_util::BodyExt;
use idempotency_core::IdempotencyLayer;
use idempotency_store_redis::{RedisOptions, RedisStore};
use tokio::task::JoinHandle;
use tower::ServiceExt;

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
    // Long enough that outages also hit requests between execution and finalize.
    tokio::time::sleep(Duration::from_millis(20)).await;
    (StatusCode::CREATED, format!("created {name}"))
}

/// The application: the layer over `store`, with a lease longer than any outage here (a
/// lease that lapses while the owner cannot reach the server to renew it, or to store
/// its answer, lets a retry take over: the one window the layer documents), and
/// finalize retried for longer than an outage.
fn app(store: RedisStore, executions: Executions) -> Router {
    Router::new()
        .route("/mutations/{name}", post(mutate))
        .with_state(executions)
        .layer(
            IdempotencyLayer::new(store)
                .with_lease(Duration::from_secs(3))
                .with_finalize_retry_for(Duration::from_secs(15)),
        )
}

/// Operations fail within a second while the server is down.
fn options(options: RedisOptions) -> RedisOptions {
    options
        .operation_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_millis(500))
}

struct Answer {
    status: StatusCode,
    replayed: bool,
    retry_after: bool,
    body: String,
}

async fn send(app: &Router, name: &str) -> Answer {
    let request = Request::post(format!("/mutations/{name}"))
        .header("idempotency-key", format!("key-{name}"))
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let retry_after = response.headers().contains_key("retry-after");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        replayed,
        retry_after,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Sends batches of 40 keyed requests over 120 names until `disruption` has finished
/// (and at least three batches), then checks the outcome; returns what `disruption`
/// returned and how many requests got 503.
async fn under_load<T>(
    app: Router,
    executions: Executions,
    disruption: JoinHandle<T>,
) -> (T, usize) {
    // The layer's warnings (store errors and what it did about them) show when a test fails.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("warn")
        .try_init();
    let mut answers: HashMap<String, Vec<(StatusCode, bool)>> = HashMap::new();
    let mut round = 0;
    while !disruption.is_finished() || round < 3 {
        round += 1;
        let batch: Vec<String> = (0..40)
            .map(|i| format!("m{}", (round * 40 + i) % 120))
            .collect();
        let results =
            futures_util::future::join_all(batch.iter().map(|name| send(&app, name))).await;
        for (name, answer) in batch.into_iter().zip(results) {
            answers
                .entry(name)
                .or_default()
                .push((answer.status, answer.retry_after));
        }
        assert!(round < 500, "the disruption never ended");
    }
    let kept = disruption.await.expect("the disruption panicked");

    let mut unavailable = 0;
    for (name, seen) in &answers {
        for (status, retry_after) in seen {
            match *status {
                StatusCode::CREATED => {}
                StatusCode::SERVICE_UNAVAILABLE => {
                    unavailable += 1;
                    assert!(retry_after, "503 without Retry-After for {name}");
                }
                // A retry that met its own orphaned reservation (the outage swallowed
                // the answer to the reserve) and outwaited the wait.
                StatusCode::CONFLICT => assert!(retry_after, "409 without Retry-After"),
                other => panic!("{name}: unexpected status {other}"),
            }
        }
    }
    eprintln!("{unavailable} requests met the outage and got 503");

    // Recovered, without restarting anything: every mutation answers (retried after a
    // 503 as a client would, within a few seconds), none ran twice.
    for name in answers.keys() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let answer = loop {
            let answer = send(&app, name).await;
            if answer.status != StatusCode::SERVICE_UNAVAILABLE
                || tokio::time::Instant::now() > deadline
            {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(answer.status, StatusCode::CREATED, "{name} did not recover");
        assert_eq!(answer.body, format!("created {name}"));
    }
    for (name, count) in executions.0.lock().unwrap().iter() {
        assert_eq!(*count, 1, "{name} ran {count} times");
    }
    // No finalized record was lost: every mutation that answered 201 is replayed now.
    for (name, seen) in &answers {
        if seen
            .iter()
            .any(|(status, _)| *status == StatusCode::CREATED)
        {
            let answer = send(&app, name).await;
            assert!(
                answer.replayed,
                "{name} answered 201 once but its record is gone"
            );
        }
    }
    (kept, unavailable)
}

/// Kills the connections of every client of each server, the ones that command and the
/// ones subscribed to settled records alike, ten times, 100 ms apart; returns how many
/// connections it killed.
fn kill_clients(ports: Vec<u16>) -> JoinHandle<u64> {
    tokio::task::spawn_blocking(move || {
        let mut killed = 0;
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(100));
            for port in &ports {
                for kind in ["normal", "pubsub"] {
                    let answer = redis_cli(*port, &["CLIENT", "KILL", "TYPE", kind]);
                    killed += answer.trim().parse::<u64>().unwrap_or(0);
                }
            }
        }
        killed
    })
}

fn assert_met_the_outage(unavailable: usize) {
    assert!(
        unavailable > 0,
        "no request met the outage: the test did not test anything"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_server_fails_closed_keeps_its_records_and_is_reconnected() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(180, async move {
        let store = RedisStore::connect_with(options(RedisOptions::server(server.url())))
            .await
            .unwrap();
        let executions = Executions::default();
        let app = app(store, executions.clone());
        // Twice: SIGKILL, 700 ms down, start again on the same port and files.
        let disruption = tokio::task::spawn_blocking(move || {
            let mut server = server;
            for _ in 0..2 {
                std::thread::sleep(Duration::from_millis(400));
                server.kill();
                std::thread::sleep(Duration::from_millis(700));
                server.restart();
            }
            server
        });
        let (_server, unavailable) = under_load(app, executions, disruption).await;
        assert_met_the_outage(unavailable);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_connections_fail_closed_and_recover() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(180, async {
        let store = RedisStore::connect_with(options(RedisOptions::server(server.url())))
            .await
            .unwrap();
        let executions = Executions::default();
        let (killed, unavailable) = under_load(
            app(store, executions.clone()),
            executions,
            kill_clients(vec![server.port]),
        )
        .await;
        assert!(killed >= 3, "CLIENT KILL killed only {killed} connections");
        // A single server's connection manager reports a killed connection to the
        // operation that was on it, so some requests meet it as an outage.
        assert_met_the_outage(unavailable);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_connections_on_a_cluster_fail_closed_and_recover() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    bounded(180, async {
        let store = RedisStore::connect_with(options(RedisOptions::cluster(cluster.urls())))
            .await
            .unwrap();
        let executions = Executions::default();
        let (killed, _) = under_load(
            app(store, executions.clone()),
            executions,
            kill_clients(cluster.nodes.iter().map(|node| node.port).collect()),
        )
        .await;
        // The cluster client re-sends a command whose connection was killed (the
        // scripts recognise a re-sent reservation or takeover as their own), so requests
        // may never see this outage at all; what must hold is the rest.
        assert!(killed >= 3, "CLIENT KILL killed only {killed} connections");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_cluster_primary_fails_closed_keeps_its_records_and_is_reconnected() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    bounded(180, async move {
        let store = RedisStore::connect_with(options(RedisOptions::cluster(cluster.urls())))
            .await
            .unwrap();
        let executions = Executions::default();
        let app = app(store, executions.clone());
        // One primary (a third of the slots) goes down and comes back, twice; well
        // within the cluster's node timeout, so no failover is attempted.
        let disruption = tokio::task::spawn_blocking(move || {
            let mut cluster = cluster;
            for _ in 0..2 {
                std::thread::sleep(Duration::from_millis(400));
                cluster.nodes[1].kill();
                std::thread::sleep(Duration::from_millis(700));
                cluster.nodes[1].restart();
                cluster.wait_until_ok();
            }
            cluster
        });
        let (_cluster, unavailable) = under_load(app, executions, disruption).await;
        assert_met_the_outage(unavailable);
    })
    .await;
}
