//! The client layer's cost: keyed `POST`s over loopback HTTP/1.1 to a benchmark server, a
//! fixed number in flight, sent by hyper-util's client alone (the caller sets a fresh
//! UUIDv7 key on each: the same bytes on the wire) and by the same client under
//! `IdempotentRetryLayer` (which mints the key, buffers the body, and reads each answer's
//! status). No faults: what the layer costs when it has nothing to absorb. Rounds
//! alternate and the ratio is the median of the rounds' (as the HTTP and gRPC sections
//! read theirs: over sockets a round's latency swings with the scheduler), and the bare
//! client against itself is the noise floor.
//!
//! The target is measured against a server that takes keys (the benchmark app behind the
//! layer and the memory store: every call a first execution), the server a keyed client
//! talks to; the same layer against the bare app, which ignores the key and answers in a
//! few microseconds, is the harshest case and has no target.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idempotency_client::IdempotentRetryLayer;
use tower::{Layer, ServiceExt};

use crate::app;
use crate::harness::paired;
use crate::inprocess::Settings;
use crate::report::{Estimate, Row, Verdict, paired_row};

/// The target: keyed calls through the layer at ≥ 0.95× the bare client's throughput.
pub const TARGET: f64 = 0.95;

type Bare = Client<HttpConnector, Full<Bytes>>;

/// Which server the calls go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    /// The benchmark app behind the layer and the memory store: the target's server.
    Keyed,
    /// The bare benchmark app (ignores keys): the harshest case, no target.
    Bare,
}

/// Measures the layer against the bare client, `in_flight` requests at a time, against the
/// server at `address`, and returns the rows (with the keyed server, the noise floor first).
/// A round sends `settings.iters` calls per call in flight, so that a round lasts about as
/// long at every level.
pub fn run(settings: Settings, server: Server, address: SocketAddr, in_flight: u64) -> Vec<Row> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let bare: Bare = Client::builder(TokioExecutor::new()).build_http();
    let layered = IdempotentRetryLayer::new().layer(bare.clone());
    let uri: http::Uri = format!("http://{address}{}", app::PATH).parse().unwrap();
    let runtime = &runtime;
    let batch = |service: Sender, keyed_by_caller: bool| {
        let uri = uri.clone();
        move |requests: u64| {
            runtime.block_on(send_all(
                service.clone(),
                &uri,
                requests,
                in_flight,
                keyed_by_caller,
            ))
        }
    };
    let iters = settings.iters * in_flight;
    let layer = paired(
        settings.rounds,
        iters,
        batch(Sender::Bare(bare.clone()), true),
        batch(Sender::Layered(layered), false),
    );
    if server == Server::Bare {
        return vec![paired_row(
            &format!(
                "client, keyed POST through the layer to the bare app (ignores keys), {in_flight} in flight"
            ),
            layer,
            Estimate::MedianRound,
            "bare client",
            "",
            Verdict::Info,
        )];
    }
    // The same client twice: the noise floor.
    let floor = paired(
        settings.rounds,
        iters,
        batch(Sender::Bare(bare.clone()), true),
        batch(Sender::Bare(bare), true),
    );
    vec![
        paired_row(
            &format!(
                "client, bare hyper client against itself (noise floor), {in_flight} in flight"
            ),
            floor,
            Estimate::MedianRound,
            "bare client",
            "",
            Verdict::Info,
        ),
        paired_row(
            &format!(
                "client, keyed POST through the layer to a keyed server, no faults, {in_flight} in flight"
            ),
            layer,
            Estimate::MedianRound,
            "bare client",
            "≥ 0.95× the bare client",
            Verdict::from_bool(Estimate::MedianRound.of(&layer) >= TARGET),
        ),
    ]
}

/// Either client, behind one type so that one batch function drives both.
#[derive(Clone)]
enum Sender {
    Bare(Bare),
    Layered(idempotency_client::IdempotentRetry<Bare>),
}

async fn send_all(
    service: Sender,
    uri: &http::Uri,
    requests: u64,
    in_flight: u64,
    keyed_by_caller: bool,
) -> Duration {
    let started = Instant::now();
    let per_task = requests.div_ceil(in_flight);
    let tasks: Vec<_> = (0..in_flight)
        .map(|_| {
            let service = service.clone();
            let uri = uri.clone();
            tokio::spawn(async move {
                for _ in 0..per_task {
                    let mut request = Request::post(uri.clone())
                        .header(http::header::CONTENT_TYPE, "application/json")
                        .body(Full::new(Bytes::from_static(app::REQUEST_BODY.as_bytes())))
                        .unwrap();
                    if keyed_by_caller {
                        let key = uuid::Uuid::now_v7().hyphenated().to_string();
                        request
                            .headers_mut()
                            .insert("idempotency-key", key.parse().unwrap());
                    }
                    let response: Response<Incoming> = match service.clone() {
                        Sender::Bare(client) => client.oneshot(request).await.expect("request"),
                        Sender::Layered(client) => client.oneshot(request).await.expect("request"),
                    };
                    assert_eq!(response.status(), StatusCode::CREATED);
                    response.into_body().collect().await.expect("body");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a client task");
    }
    started.elapsed()
}
