//! Hostile and careless clients: bodies that are too large, too slow or too many; keys and
//! queries that must not leak into answers or logs; spellings of one path; encodings.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::{IdempotencyLayer, Outcome, RejectionKind};
use idempotency_store_memory::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower::ServiceExt;

/// A handler that counts its calls and answers with the request's Accept-Encoding.
fn app(calls: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/orders/{*rest}",
        post(move |headers: HeaderMap, body: String| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let accepted = headers
                    .get("accept-encoding")
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default();
                let mut answer = (
                    StatusCode::CREATED,
                    [
                        ("cache-control", "private, no-store"),
                        ("vary", "authorization"),
                    ],
                    format!("call {n}, accepted {accepted:?}, body {body}"),
                )
                    .into_response();
                if headers.contains_key("x-encode") {
                    answer
                        .headers_mut()
                        .insert("content-encoding", "gzip".parse().unwrap());
                }
                answer
            }
        }),
    )
}

async fn send(
    app: &Router,
    request: Request<Body>,
) -> (StatusCode, HeaderMap, String, Option<Outcome>) {
    let response = app.clone().oneshot(request).await.unwrap();
    let outcome = response.extensions().get::<Outcome>().copied();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
        outcome,
    )
}

fn keyed(uri: &str, key: &str, body: &str) -> Request<Body> {
    Request::post(uri)
        .header("idempotency-key", key)
        .header("accept-encoding", "gzip, br")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    address
}

/// Reads what the server sent until it closes or `wait` passes.
async fn read_some(stream: &mut TcpStream, wait: Duration) -> String {
    let mut buffer = vec![0u8; 64 * 1024];
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Ok(read)) = tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
        if read == 0 {
            break;
        }
        text.push_str(&String::from_utf8_lossy(&buffer[..read]));
        if text.contains("\r\n\r\n") && !text.starts_with("HTTP/1.1 100") {
            break;
        }
    }
    text
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_refused_before_any_body_is_read() {
    let calls = Arc::new(AtomicUsize::new(0));
    let address = serve(app(calls.clone()).layer(IdempotencyLayer::new(MemoryStore::new()))).await;
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream
        .write_all(
            b"POST /orders/1 HTTP/1.1\r\nhost: x\r\nidempotency-key: big-1\r\n\
              content-length: 1073741824\r\nexpect: 100-continue\r\n\r\n",
        )
        .await
        .unwrap();
    let answer = read_some(&mut stream, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        !answer.contains("100 Continue"),
        "the client was invited to send 1 GiB: {answer}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_gets_408_and_frees_its_budget() {
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_request_body_timeout(Duration::from_millis(300))
        .with_memory_budget(100_000);
    let address = serve(app(calls.clone()).layer(layer)).await;

    // Holds 60 kB of the budget and never sends the rest.
    let mut slow = TcpStream::connect(address).await.unwrap();
    slow.write_all(
        b"POST /orders/1 HTTP/1.1\r\nhost: x\r\nidempotency-key: slow-1\r\ncontent-length: 60000\r\n\r\nfirst bytes",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    // Meanwhile another 60 kB request does not fit.
    let mut other = TcpStream::connect(address).await.unwrap();
    let body = "x".repeat(60_000);
    other
        .write_all(
            format!(
                "POST /orders/2 HTTP/1.1\r\nhost: x\r\nidempotency-key: other-1\r\ncontent-length: 60000\r\n\r\n{body}"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let answer = read_some(&mut other, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after"),
        "{answer}"
    );
    assert!(answer.contains("over-budget"), "{answer}");

    let answer = read_some(&mut slow, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body-timeout"), "{answer}");

    // The slow request's bytes were let go: the same 60 kB request now runs.
    let mut again = TcpStream::connect(address).await.unwrap();
    again
        .write_all(
            format!(
                "POST /orders/2 HTTP/1.1\r\nhost: x\r\nidempotency-key: other-1\r\ncontent-length: 60000\r\n\r\n{body}"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let answer = read_some(&mut again, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// This process's resident memory (Linux).
#[cfg(target_os = "linux")]
fn resident_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<usize>()
                .ok()
        })
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

/// Slow clients that each send all but the last byte of an 8 MB keyed body hold the
/// server's memory at the budget, not at clients × 8 MB: the process (one per test under
/// nextest; the clients share one buffer) grows by less than the budget plus a margin
/// for what a server needs anyway, and the clients past the budget get 503 before their
/// body is read. Without the budget the layer would hold 48 × 8 MB.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_hold_no_more_memory_than_the_budget() {
    const BODY: usize = 8 << 20;
    const CLIENTS: usize = 48;
    const BUDGET: usize = 16 << 20;
    const MARGIN: usize = 48 << 20;
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_memory_budget(BUDGET)
        .with_request_body_timeout(Duration::from_secs(30));
    let address = serve(app(Arc::default()).layer(layer)).await;
    let all_but_the_last_byte: Arc<[u8]> = vec![b'x'; BODY - 1].into();
    let before = resident_bytes();

    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let body = all_but_the_last_byte.clone();
            tokio::spawn(async move {
                let mut stream = TcpStream::connect(address).await.unwrap();
                let head = format!(
                    "POST /orders/{i} HTTP/1.1\r\nhost: x\r\nidempotency-key: slow-{i}\r\n\
                     content-length: {BODY}\r\n\r\n"
                );
                stream.write_all(head.as_bytes()).await.unwrap();
                // A refused request's body is not read: its write stalls or fails.
                let _ = tokio::time::timeout(Duration::from_secs(3), stream.write_all(&body)).await;
                let answer = read_some(&mut stream, Duration::from_secs(2)).await;
                (stream, answer)
            })
        })
        .collect();
    let mut held = Vec::new();
    for client in clients {
        held.push(client.await.unwrap());
    }
    let grown = resident_bytes().saturating_sub(before);
    assert!(
        grown < BUDGET + MARGIN,
        "{CLIENTS} slow clients grew the process by {} MiB (budget {} MiB)",
        grown >> 20,
        BUDGET >> 20
    );
    let refused = held
        .iter()
        .filter(|(_, answer)| answer.starts_with("HTTP/1.1 503"))
        .count();
    assert!(
        refused >= CLIENTS - BUDGET / BODY,
        "only {refused} of {CLIENTS} slow clients were refused: {:?}",
        held.iter()
            .map(|(_, answer)| answer.lines().next())
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn answers_never_echo_another_requests_path_query_or_body() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(calls.clone()).layer(IdempotencyLayer::new(MemoryStore::new()));
    send(
        &app,
        keyed(
            "/orders/1?access_token=SECRET-OF-CALLER-A",
            "shared-key",
            "body of A",
        ),
    )
    .await;
    let (status, _, body, _) = send(&app, keyed("/orders/2?x=1", "shared-key", "body of B")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    for leak in [
        "SECRET-OF-CALLER-A",
        "access_token",
        "/orders/1",
        "body of A",
    ] {
        assert!(!body.contains(leak), "the 422 carries {leak:?}: {body}");
    }
}

/// Collects the formatted log lines of the current thread.
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

#[tokio::test]
async fn logs_never_show_a_key_and_a_key_cannot_forge_log_fields() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(calls).layer(IdempotencyLayer::new(MemoryStore::new()));
    let forging = r#"KEY-42 outcome="replayed" key=other"#;
    send(&app, keyed("/orders/1", forging, "a")).await; // executed
    send(&app, keyed("/orders/1", forging, "a")).await; // replayed
    send(&app, keyed("/orders/1", forging, "b")).await; // key reused
    send(&app, keyed("/orders/1", &"k".repeat(300), "a")).await; // refused: too long

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(text.contains("idempotency"), "nothing was logged: {text}");
    for secret in ["KEY-42", "kkkkkkkk", r#"outcome="replayed" key=other"#] {
        assert!(
            !text.contains(secret),
            "a log line shows {secret:?}:\n{text}"
        );
    }
}

#[tokio::test]
async fn replays_keep_cache_control_and_vary_and_no_encoding_is_stored() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(calls.clone()).layer(IdempotencyLayer::new(MemoryStore::new()));

    let (_, _, first, _) = send(&app, keyed("/orders/1", "cache-1", "a")).await;
    assert!(
        first.contains(r#"accepted "identity""#),
        "the inner service must be asked for an unencoded answer: {first}"
    );
    let (status, headers, replay, outcome) = send(&app, keyed("/orders/1", "cache-1", "a")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Replayed))
    );
    assert_eq!(replay, first);
    assert_eq!(headers["cache-control"], "private, no-store");
    assert_eq!(headers["vary"], "authorization");

    // An inner service that encodes anyway: its caller gets the answer, retries are told
    // it ran; nothing encoded is ever replayed to a retry that may not accept it.
    let mut encoded = keyed("/orders/2", "gzip-1", "a");
    encoded
        .headers_mut()
        .insert("x-encode", "1".parse().unwrap());
    let (status, headers, _, outcome) = send(&app, encoded).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::ExecutedNotStored))
    );
    assert_eq!(headers["content-encoding"], "gzip");
    let mut retry = keyed("/orders/2", "gzip-1", "a");
    retry.headers_mut().insert("x-encode", "1".parse().unwrap());
    let (status, headers, body, outcome) = send(&app, retry).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CONFLICT, Some(Outcome::Replayed))
    );
    assert!(headers.get("content-encoding").is_none());
    assert!(body.contains("already ran"), "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn spellings_of_one_path_bind_as_one_and_a_different_query_does_not() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(calls.clone()).layer(IdempotencyLayer::new(MemoryStore::new()));
    let (status, _, _, _) = send(&app, keyed("/orders/a/b", "path-1", "x")).await;
    assert_eq!(status, StatusCode::CREATED);
    for spelling in ["/orders//a/b", "/orders/a/b/", "/orders/%61/b"] {
        let (status, _, _, outcome) = send(&app, keyed(spelling, "path-1", "x")).await;
        assert_eq!(
            (status, outcome),
            (StatusCode::CREATED, Some(Outcome::Replayed)),
            "{spelling}"
        );
    }
    let (status, _, _, outcome) = send(&app, keyed("/orders/a/b?page=2", "path-1", "x")).await;
    assert_eq!(
        (status, outcome),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some(Outcome::Rejected(RejectionKind::KeyReused))
        )
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

fn with_credential(mut request: Request<Body>, credential: &str) -> Request<Body> {
    request
        .headers_mut()
        .insert("authorization", credential.parse().unwrap());
    request
}

#[tokio::test]
async fn a_layer_without_a_scope_refuses_requests_that_carry_credentials_and_logs_it_once() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let misconfigured = "misconfigured";

    let calls = Arc::new(AtomicUsize::new(0));
    let unscoped = app(calls.clone()).layer(IdempotencyLayer::new(MemoryStore::new()));
    for n in 0..3 {
        let request = with_credential(keyed("/orders/1", &format!("w-{n}"), "a"), "Bearer a");
        let (status, _, body, outcome) = send(&unscoped, request).await;
        assert_eq!(
            (status, outcome),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                Some(Outcome::Rejected(RejectionKind::NoScope))
            ),
            "{body}"
        );
        assert!(body.contains("with_scope"), "{body}");
        assert!(!body.contains("Bearer"), "{body}");
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "a refused request never runs"
    );
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert_eq!(text.matches(misconfigured).count(), 1, "{text}");
    assert!(text.contains("ERROR"), "{text}");
    assert!(!text.contains("Bearer") && !text.contains("w-0"), "{text}");

    // Without credentials there is nobody to tell apart: one shared scope.
    let (status, _, _, outcome) = send(&unscoped, keyed("/orders/1", "anonymous", "a")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );

    // A single-tenant service says so, and then runs requests that carry credentials.
    logs.0.lock().unwrap().clear();
    let single = app(Arc::default())
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_scope(idempotency_core::SingleScope));
    let (status, _, _, outcome) = send(
        &single,
        with_credential(keyed("/orders/1", "w-9", "a"), "Bearer a"),
    )
    .await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(!text.contains(misconfigured), "{text}");
}

#[tokio::test]
async fn empty_and_blank_keys_are_refused_on_every_profile() {
    for blank in ["", " ", "\t  "] {
        let calls = Arc::new(AtomicUsize::new(0));
        let plain = app(calls.clone()).layer(IdempotencyLayer::new(MemoryStore::new()));
        let (status, _, body, outcome) = send(&plain, keyed("/orders/1", blank, "a")).await;
        assert_eq!(
            (status, outcome),
            (
                StatusCode::BAD_REQUEST,
                Some(Outcome::Rejected(RejectionKind::InvalidKey))
            ),
            "{blank:?}: {body}"
        );
        assert!(body.contains("empty"), "{body}");
        let iceberg = app(calls.clone()).layer(idempotency_iceberg::layer(MemoryStore::new()));
        let mut request = keyed("/v1/namespaces", blank, "{}");
        *request.uri_mut() = "/v1/namespaces".parse().unwrap();
        let (status, _, body, _) = send(&iceberg, request).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{blank:?}: {body}");
        assert!(body.contains("BadRequestException"), "{body}");
        assert_eq!(calls.load(Ordering::SeqCst), 0, "a blank key never runs");
    }
}

#[tokio::test]
async fn with_the_credential_scope_a_stolen_key_collects_nothing() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(calls.clone()).layer(
        IdempotencyLayer::new(MemoryStore::new())
            .with_scope(idempotency_core::CredentialScope::default()),
    );
    let alice = || {
        with_credential(
            keyed("/orders/1", "alices-key", "alice's order"),
            "Bearer alice",
        )
    };
    let (_, _, first, _) = send(&app, alice()).await;
    let (_, _, replay, outcome) = send(&app, alice()).await;
    assert_eq!(
        (replay.as_str(), outcome),
        (first.as_str(), Some(Outcome::Replayed))
    );

    let mallory = with_credential(
        keyed("/orders/1", "alices-key", "alice's order"),
        "Bearer mallory",
    );
    let (_, _, body, outcome) = send(&app, mallory).await;
    assert_eq!(
        outcome,
        Some(Outcome::Executed),
        "another credential is another scope"
    );
    assert_ne!(body, first, "mallory collected alice's answer");
}

#[tokio::test]
async fn the_inner_service_does_not_see_the_key_unless_it_is_forwarded() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorder = |seen: Arc<Mutex<Vec<Option<String>>>>| {
        Router::new().route(
            "/orders",
            post(move |headers: HeaderMap| {
                let seen = seen.clone();
                async move {
                    let key = headers
                        .get("idempotency-key")
                        .map(|v| v.to_str().unwrap().to_owned());
                    seen.lock().unwrap().push(key);
                    StatusCode::CREATED
                }
            }),
        )
    };
    let hidden = recorder(seen.clone()).layer(IdempotencyLayer::new(MemoryStore::new()));
    send(&hidden, keyed("/orders", "k-1", "")).await;
    let forwarding = recorder(seen.clone())
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_forwarded_key(true));
    send(&forwarding, keyed("/orders", "k-2", "")).await;
    assert_eq!(*seen.lock().unwrap(), [None, Some("k-2".to_owned())]);
}

#[tokio::test]
async fn a_caller_at_its_quota_gets_429_and_others_carry_on() {
    let calls = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::new()
        .with_scope_quota(idempotency_core::ScopeQuota::default().with_max_records(2));
    let app = app(calls.clone()).layer(
        IdempotencyLayer::new(store).with_scope(idempotency_core::CredentialScope::default()),
    );
    for n in 0..2 {
        let request = with_credential(keyed("/orders/1", &format!("a-{n}"), "x"), "Bearer a");
        assert_eq!(send(&app, request).await.0, StatusCode::CREATED);
    }
    let over = with_credential(keyed("/orders/1", "a-2", "x"), "Bearer a");
    let (status, headers, body, outcome) = send(&app, over).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(headers.contains_key("retry-after"));
    assert!(body.contains("quota"), "{body}");
    assert_eq!(
        outcome,
        Some(Outcome::Rejected(RejectionKind::QuotaExceeded))
    );
    let other = with_credential(keyed("/orders/1", "b-0", "x"), "Bearer b");
    assert_eq!(send(&app, other).await.0, StatusCode::CREATED);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// An answer of `chunks` chunks of 64 KiB, streamed.
fn streamed_answer(chunks: usize) -> Body {
    let chunk = bytes::Bytes::from(vec![b'z'; 64 * 1024]);
    Body::from_stream(futures_util::stream::iter(
        (0..chunks).map(move |_| Ok::<_, std::io::Error>(chunk.clone())),
    ))
}

#[tokio::test]
async fn an_answer_over_the_limit_streams_on_to_its_caller_with_wrapped_bodies() {
    use http_body_util::Full;
    use idempotency_core::IdempotencyBody;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let inner = tower::service_fn(
        move |_request: Request<IdempotencyBody<Full<bytes::Bytes>>>| {
            counted.fetch_add(1, Ordering::SeqCst);
            // 32 MiB, with a limit of 1 MiB and a budget of 4 MiB.
            async {
                Ok::<_, std::convert::Infallible>(axum::http::Response::new(streamed_answer(512)))
            }
        },
    );
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_max_response_body(1 << 20)
        .with_memory_budget(4 << 20)
        .wrap_bodies();
    let service = tower::Layer::layer(&layer, inner);
    let request = || {
        Request::post("/export")
            .header("idempotency-key", "export-1")
            .body(Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap()
    };
    let response = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(
        response.extensions().get::<Outcome>(),
        Some(&Outcome::ExecutedNotStored)
    );
    let received = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        received.len(),
        32 << 20,
        "the caller must get the whole answer"
    );
    assert!(received.iter().all(|byte| *byte == b'z'));
    let retry = service.oneshot(request()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CONFLICT);
    assert_eq!(
        retry.extensions().get::<Outcome>(),
        Some(&Outcome::Replayed)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_over_the_budget_that_cannot_stream_gets_502_and_is_not_run_again() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app = Router::new()
        .route(
            "/export",
            post(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { streamed_answer(160) } // 10 MiB
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .with_max_response_body(1 << 20)
                .with_memory_budget(4 << 20),
        );
    let (status, _, body, outcome) = send(&app, keyed("/export", "export-2", "{}")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert!(body.contains("larger than this server can hold"), "{body}");
    assert_eq!(outcome, Some(Outcome::ExecutedNotStored));
    let (status, _, body, _) = send(&app, keyed("/export", "export-2", "{}")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(body.contains("already ran"), "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_over_the_limit_within_the_budget_is_delivered_whole_with_inner_bodies() {
    let app = Router::new()
        .route("/export", post(|| async { streamed_answer(320) })) // 20 MiB
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_max_response_body(1 << 20));
    let (status, _, body, outcome) = send(&app, keyed("/export", "export-3", "{}")).await;
    assert_eq!(status, StatusCode::OK, "{}", &body[..body.len().min(300)]);
    assert_eq!(body.len(), 20 << 20);
    assert_eq!(outcome, Some(Outcome::ExecutedNotStored));
}
