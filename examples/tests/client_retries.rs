//! The client layer (`idempotency-client`) against the project's own servers, the Iceberg
//! catalog and `grpc-orders`, behind a fault proxy that loses answers after the server
//! committed, or answers 503 / `UNAVAILABLE` before the server sees the request.
//!
//! Each logical create through the layer has exactly one effect and one success; the same
//! faults with a fresh key per attempt (the mistake the layer exists to prevent, as a
//! control) give a failure (Iceberg: the retry finds its own namespace, 409) or a
//! duplicate (gRPC: a second order). The waits are measured: `Retry-After` is honoured,
//! and retries end before the horizon set from the server's key lifetime.

#[path = "../../test-support/fault_proxy.rs"]
mod fault_proxy;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fault_proxy::{Fault, FaultProxy};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_client::{BoxError, Error, IdempotentRetryLayer, KeyedOutcome, iceberg};
use tonic::transport::Channel;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

mod pb {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("orders.v1");
}

use pb::orders_client::OrdersClient;
use pb::{CreateOrderRequest, ListOrdersRequest, PlaceOrderRequest};

/// A server process, killed when dropped.
struct Process {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Iceberg catalog with its defaults (SQLite, keys on, lifetime PT30M); its base URL.
fn start_catalog() -> (Process, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let child = Command::new(env!("CARGO_BIN_EXE_iceberg-catalog"))
        .current_dir(dir.path())
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .expect("start iceberg-catalog");
    let process = Process { child, _dir: dir };
    let address = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_err() {
        assert!(Instant::now() < deadline, "iceberg-catalog did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    (process, format!("http://{address}"))
}

/// `grpc-orders` on a SQLite file of its own; its URL.
fn start_orders() -> (Process, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let database = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("orders.db").display()
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_grpc-orders"))
        .args(["--listen", "127.0.0.1:0", "--database", &database])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start grpc-orders");
    let stdout = child.stdout.take().unwrap();
    let process = Process { child, _dir: dir };
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(address) = line.strip_prefix("grpc-orders listening on ") {
                let _ = sender.send(address.to_owned());
            }
        }
    });
    let address = receiver
        .recv_timeout(Duration::from_secs(60))
        .expect("grpc-orders did not start");
    (process, format!("http://{address}"))
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn create_namespace(base: &str, name: &str) -> Request<Full<Bytes>> {
    Request::post(format!("{base}/v1/namespaces"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(format!(
            r#"{{"namespace":["{name}"]}}"#
        ))))
        .unwrap()
}

async fn namespaces(base: &str) -> Vec<String> {
    let request = Request::get(format!("{base}/v1/namespaces"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = http_client()
        .request(request)
        .await
        .expect("list namespaces");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let listed: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let mut names: Vec<String> = listed["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|namespace| namespace[0].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

fn outcome<B>(response: &Response<B>) -> KeyedOutcome {
    response
        .extensions()
        .get::<KeyedOutcome>()
        .cloned()
        .expect("a keyed answer says what happened")
}

#[tokio::test]
async fn iceberg_creates_through_lost_answers_and_503s_run_once_each() -> Result<(), BoxError> {
    let (_catalog, base) = start_catalog();
    let proxy = FaultProxy::start(&base, false).await;
    let catalog = proxy.url();
    // The layer set as the README says: the horizon from the catalog's advertised lifetime.
    // README: client hyper
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let config = format!("{catalog}/v1/config").parse()?;
    let lifetime = iceberg::fetch_key_lifetime(&mut http.clone(), config).await?;
    let mut client = ServiceBuilder::new()
        .layer(IdempotentRetryLayer::new().with_key_lifetime(lifetime.ok_or("keys ignored")?))
        .service(http);
    // README: end
    assert_eq!(lifetime, Some(Duration::from_secs(30 * 60)));

    const CREATES: usize = 6;
    let mut names = Vec::new();
    for n in 0..CREATES {
        // Odd creates: the first answer is lost after the commit. Even ones: 503 first.
        let first = if n % 2 == 1 {
            Fault::LoseAnswer
        } else {
            Fault::Unavailable(Duration::ZERO)
        };
        proxy.plan([first]);
        let name = format!("layer_{n}");
        let response = client
            .ready()
            .await
            .unwrap()
            .call(create_namespace(&proxy.url(), &name))
            .await
            .expect("the layer absorbs the fault");
        assert_eq!(response.status(), StatusCode::OK, "{name}");
        let outcome = outcome(&response);
        assert_eq!(outcome.attempts, 2, "{name}");
        assert_eq!(
            outcome.replayed,
            first == Fault::LoseAnswer,
            "{name}: a lost answer comes back as the replay; after a 503 the request ran fresh"
        );
        names.push(name);
    }
    let seen = proxy.seen();
    assert_eq!(
        seen.len(),
        1 + 2 * CREATES,
        "the config, then two attempts per create: {seen:?}"
    );
    assert_eq!(
        namespaces(&base).await,
        names,
        "one namespace per logical create"
    );

    // The control: the same faults, with a fresh key on each attempt.
    let mut failures = 0;
    for n in 0..CREATES {
        proxy.plan([Fault::LoseAnswer]);
        let name = format!("control_{n}");
        for _attempt in 0..2 {
            let mut request = create_namespace(&proxy.url(), &name);
            request.headers_mut().insert(
                "idempotency-key",
                uuid::Uuid::new_v4().to_string().parse().unwrap(),
            );
            match http_client().request(request).await {
                Ok(response) if response.status() == StatusCode::OK => break,
                Ok(response) => {
                    assert_eq!(response.status(), StatusCode::CONFLICT, "{name}");
                    failures += 1;
                    break;
                }
                Err(_lost) => continue,
            }
        }
    }
    assert_eq!(
        failures, CREATES,
        "with a fresh key per attempt, each retry after a lost answer fails: the namespace it created exists"
    );
    Ok(())
}

#[tokio::test]
async fn reqwest_creates_through_lost_answers_run_once_each() {
    let (_catalog, base) = start_catalog();
    let proxy = FaultProxy::start(&base, false).await;
    // README: client reqwest
    let client = reqwest_middleware::ClientBuilder::new(reqwest_middleware::reqwest::Client::new())
        .with(IdempotentRetryLayer::new())
        .build();
    // README: end
    const CREATES: usize = 4;
    let mut names = Vec::new();
    for n in 0..CREATES {
        proxy.plan([Fault::LoseAnswer, Fault::Unavailable(Duration::ZERO)]);
        let name = format!("reqwest_{n}");
        let response = client
            .post(format!("{}/v1/namespaces", proxy.url()))
            .header("content-type", "application/json")
            .body(format!(r#"{{"namespace":["{name}"]}}"#))
            .send()
            .await
            .expect("the middleware absorbs the faults");
        assert_eq!(response.status(), 200, "{name}");
        let outcome = response
            .extensions()
            .get::<KeyedOutcome>()
            .cloned()
            .unwrap();
        assert_eq!((outcome.attempts, outcome.replayed), (3, true), "{name}");
        names.push(name);
    }
    assert_eq!(
        namespaces(&base).await,
        names,
        "one namespace per logical create"
    );

    // A 422 is the layer's typed error, inside reqwest-middleware's.
    let key = uuid::Uuid::now_v7().to_string();
    let send = |name: &str| {
        client
            .post(format!("{}/v1/namespaces", proxy.url()))
            .header("idempotency-key", &key)
            .body(format!(r#"{{"namespace":["{name}"]}}"#))
            .send()
    };
    assert_eq!(send("reuse_a").await.unwrap().status(), 200);
    proxy.clear_seen();
    let error = send("reuse_b").await.unwrap_err();
    let reqwest_middleware::Error::Middleware(error) = error else {
        panic!("expected the layer's error, got {error:?}");
    };
    assert!(
        matches!(error.downcast_ref::<Error>(), Some(Error::KeyReused { .. })),
        "{error:?}"
    );
    assert_eq!(proxy.seen().len(), 1, "a 422 is not resent");
}

#[tokio::test]
async fn iceberg_key_reuse_retry_after_horizon_and_body_bound() {
    let (_catalog, base) = start_catalog();
    let proxy = FaultProxy::start(&base, false).await;
    let layer = IdempotentRetryLayer::new().with_max_attempts(10);
    let mut client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(http_client());

    // A key the caller reuses for another request: 422, a typed error, never resent.
    let own_key = uuid::Uuid::now_v7().to_string();
    let mut first = create_namespace(&proxy.url(), "reuse_a");
    first
        .headers_mut()
        .insert("idempotency-key", own_key.parse().unwrap());
    let answer = client.ready().await.unwrap().call(first).await.unwrap();
    assert_eq!(outcome(&answer).key, own_key, "the caller's key is kept");
    let mut second = create_namespace(&proxy.url(), "reuse_b");
    second
        .headers_mut()
        .insert("idempotency-key", own_key.parse().unwrap());
    proxy.clear_seen();
    match client.ready().await.unwrap().call(second).await {
        Err(Error::KeyReused { key }) => assert_eq!(key, own_key),
        other => panic!("expected KeyReused, got {other:?}"),
    }
    assert_eq!(proxy.seen().len(), 1, "a 422 is not resent");

    // A 503 with Retry-After: 1 is waited.
    proxy.clear_seen();
    proxy.plan([Fault::Unavailable(Duration::from_secs(1))]);
    let started = Instant::now();
    let answer = client
        .ready()
        .await
        .unwrap()
        .call(create_namespace(&proxy.url(), "waited"))
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(
        (answer.status(), outcome(&answer).attempts),
        (StatusCode::OK, 2)
    );
    assert!(
        waited >= Duration::from_secs(1),
        "Retry-After: 1, sent again after {waited:?}"
    );

    // Retries end before the horizon: a 3 s lifetime is a 2.7 s horizon, and a server
    // that keeps asking for 1 s gets three attempts, at 0, 1 and 2 s.
    let mut short = ServiceBuilder::new()
        .layer(layer.clone().with_key_lifetime(Duration::from_secs(3)))
        .service(http_client());
    proxy.clear_seen();
    // A fourth attempt would pass, and fail the test.
    proxy.plan([Fault::Unavailable(Duration::from_secs(1)); 3]);
    let started = Instant::now();
    let answer = short
        .ready()
        .await
        .unwrap()
        .call(create_namespace(&proxy.url(), "horizon"))
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(outcome(&answer).attempts, 3);
    assert_eq!(proxy.seen().len(), 3);
    assert!(took < Duration::from_millis(2700), "retried until {took:?}");

    // A body over the bound is refused before anything is sent.
    let mut bounded = ServiceBuilder::new()
        .layer(layer.with_max_body_bytes(1024))
        .service(http_client());
    proxy.clear_seen();
    let large = Request::post(format!("{}/v1/namespaces", proxy.url()))
        .body(Full::new(Bytes::from(vec![b' '; 2048])))
        .unwrap();
    match bounded.ready().await.unwrap().call(large).await {
        Err(Error::BodyTooLarge { limit: 1024 }) => {}
        other => panic!("expected BodyTooLarge, got {other:?}"),
    }
    assert!(proxy.seen().is_empty(), "nothing was sent");
}

#[tokio::test]
async fn grpc_creates_through_lost_answers_and_unavailable_run_once_each() -> Result<(), BoxError> {
    let (_orders, url) = start_orders();
    let proxy = FaultProxy::start(&url, true).await;
    let address = proxy.url();
    // README: client tonic
    let channel = Channel::from_shared(address)?.connect().await?;
    let channel = IdempotentRetryLayer::grpc().layer(channel);
    let mut orders = OrdersClient::new(channel);
    // README: end

    const CREATES: usize = 6;
    for n in 0..CREATES {
        let first = if n % 2 == 1 {
            Fault::LoseAnswer
        } else {
            Fault::Unavailable(Duration::from_millis(50))
        };
        proxy.plan([first]);
        let response = orders
            .create_order(CreateOrderRequest {
                item: format!("layer-{n}"),
            })
            .await
            .expect("the layer absorbs the fault");
        let outcome = response
            .extensions()
            .get::<KeyedOutcome>()
            .cloned()
            .expect("the outcome rides to tonic's response");
        assert_eq!(outcome.attempts, 2, "order {n}");
        assert_eq!(outcome.replayed, first == Fault::LoseAnswer, "order {n}");
    }
    let direct = OrdersClient::connect(url.clone()).await.unwrap();
    let count = |item_prefix: &'static str| {
        let mut direct = direct.clone();
        async move {
            let mut stream = direct
                .list_orders(ListOrdersRequest {})
                .await
                .unwrap()
                .into_inner();
            let mut count = 0;
            while let Some(order) = stream.message().await.unwrap() {
                count += usize::from(order.item.starts_with(item_prefix));
            }
            count
        }
    };
    assert_eq!(
        count("layer-").await,
        CREATES,
        "one order per logical create"
    );

    // A method whose key is its message's `request_id` (AIP-155): the layer resends the
    // message as it is, so the retry carries the same request_id and is replayed.
    proxy.plan([Fault::LoseAnswer]);
    let request_id = uuid::Uuid::now_v7().to_string();
    let placed = orders
        .place_order(PlaceOrderRequest {
            item: "placed-1".into(),
            request_id,
        })
        .await?;
    let outcome = placed.extensions().get::<KeyedOutcome>().cloned().unwrap();
    assert_eq!((outcome.attempts, outcome.replayed), (2, true));
    assert_eq!(count("placed-").await, 1, "placed once");

    // FAILED_PRECONDITION (the key reused for another message) is not resent.
    let mut request = tonic::Request::new(CreateOrderRequest { item: "a".into() });
    request
        .metadata_mut()
        .insert("idempotency-key", "reused-key".parse().unwrap());
    orders.create_order(request).await.unwrap();
    let mut request = tonic::Request::new(CreateOrderRequest { item: "b".into() });
    request
        .metadata_mut()
        .insert("idempotency-key", "reused-key".parse().unwrap());
    proxy.clear_seen();
    let status = orders.create_order(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert_eq!(proxy.seen().len(), 1, "FAILED_PRECONDITION is not resent");

    // The control: a lost answer, and a retry with a fresh key, is a second order.
    let channel = Channel::from_shared(proxy.url())?.connect().await?;
    let mut naive = OrdersClient::new(channel);
    for n in 0..CREATES {
        proxy.plan([Fault::LoseAnswer]);
        for _attempt in 0..2 {
            let mut request = tonic::Request::new(CreateOrderRequest {
                item: format!("control-{n}"),
            });
            let key = uuid::Uuid::new_v4().to_string();
            request
                .metadata_mut()
                .insert("idempotency-key", key.parse().unwrap());
            if naive.create_order(request).await.is_ok() {
                break;
            }
        }
    }
    assert_eq!(
        count("control-").await,
        2 * CREATES,
        "with a fresh key per attempt, every lost answer is a duplicate order"
    );
    Ok(())
}

/// The README's client snippets are the lines these tests run.
#[test]
fn the_readme_shows_the_client_layer_as_these_tests_set_it_up() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let tests = std::fs::read_to_string(root.join("tests/client_retries.rs")).unwrap();
    let readme = std::fs::read_to_string(root.join("../README.md")).unwrap();
    let readme: Vec<&str> = readme.lines().map(str::trim).collect();
    for client in ["hyper", "tonic", "reqwest"] {
        let snippet: Vec<&str> = tests
            .lines()
            .skip_while(|line| line.trim() != format!("// README: client {client}"))
            .skip(1)
            .take_while(|line| !line.contains("// README: end"))
            .map(str::trim)
            .collect();
        assert!(
            (3..=10).contains(&snippet.len()),
            "{client}: the markers are missing, or the setup is over 10 lines"
        );
        assert!(
            readme
                .windows(snippet.len())
                .any(|window| window == snippet),
            "README.md must show these lines of examples/tests/client_retries.rs:\n{}",
            snippet.join("\n")
        );
    }
}
