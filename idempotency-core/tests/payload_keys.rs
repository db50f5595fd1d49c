//! Keys carried in the request's JSON body (`JsonPointerKey`), as a client meets them
//! through an axum router: the body's key wins over the header on its routes, the
//! fingerprint leaves out the fields it does not name, and a body that cannot carry a
//! key gets a 400 that says why.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::{
    AtMostOnce, IdempotencyLayer, JsonPointerKey, Outcome, RejectionKind, RequestHead, SingleScope,
    WorkError,
};
use idempotency_store_memory::MemoryStore;
use tower::ServiceExt;

/// `POST /orders` reads its key from `/clientToken`, bound to `/account` and `/amount`;
/// `POST /other` keeps the header. Both count their runs and answer with the run's number.
fn app(layer: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    async fn run(State(runs): State<Arc<AtomicUsize>>) -> (StatusCode, String) {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        (StatusCode::CREATED, format!("run {n}"))
    }
    let keys = JsonPointerKey::new("/clientToken")
        .with_fingerprint(["/account", "/amount"])
        .on_routes(|request: &RequestHead<'_>| request.uri.path() == "/orders");
    let base = IdempotencyLayer::new(MemoryStore::new())
        .with_scope(SingleScope)
        .with_payload_key(keys);
    let router = Router::new()
        .route("/orders", post(run))
        .route("/other", post(run))
        .with_state(runs.clone())
        .layer(layer(base));
    (router, runs)
}

async fn send(
    app: &Router,
    path: &str,
    header_key: Option<&str>,
    body: &str,
) -> (StatusCode, String, Option<Outcome>) {
    let mut request = Request::post(path).header("content-type", "application/json");
    if let Some(key) = header_key {
        request = request.header("idempotency-key", key);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let outcome = response.extensions().get::<Outcome>().copied();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap(), outcome)
}

#[tokio::test]
async fn the_bodys_key_replays_and_the_header_does_not_count() {
    let (app, runs) = app(|layer| layer);
    let order = r#"{"clientToken":"c-1","account":7,"amount":100,"sentAt":"10:00"}"#;
    let first = send(&app, "/orders", None, order).await;
    assert_eq!(
        first,
        (StatusCode::CREATED, "run 1".into(), Some(Outcome::Executed))
    );
    // A retry whose client minted a new header key, sent a minute later.
    let retry = r#"{"sentAt":"10:01","amount":100,"account":7,"clientToken":"c-1"}"#;
    let again = send(&app, "/orders", Some("a-new-header-key"), retry).await;
    assert_eq!(
        again,
        (StatusCode::CREATED, "run 1".into(), Some(Outcome::Replayed))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn another_order_under_the_same_key_is_refused() {
    let (app, runs) = app(|layer| layer);
    send(
        &app,
        "/orders",
        None,
        r#"{"clientToken":"c","account":7,"amount":100}"#,
    )
    .await;
    let (status, _, outcome) = send(
        &app,
        "/orders",
        None,
        r#"{"clientToken":"c","account":7,"amount":999}"#,
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(outcome, Some(Outcome::Rejected(RejectionKind::KeyReused)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_that_cannot_carry_its_key_gets_a_400_that_says_why() {
    let (app, runs) = app(|layer| layer);
    for (body, says) in [
        ("clientToken=c", "not JSON"),
        (r#"{"clientToken":42}"#, "/clientToken must be a string"),
        (r#"{"clientToken":""}"#, "empty"),
    ] {
        let (status, message, outcome) = send(&app, "/orders", None, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {message}");
        assert_eq!(outcome, Some(Outcome::Rejected(RejectionKind::InvalidKey)));
        assert!(message.contains(says), "{body}: {message}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_body_without_a_key_runs_unprotected_unless_one_is_required() {
    let (lenient, runs) = app(|layer| layer);
    for _ in 0..2 {
        let (status, _, outcome) = send(&lenient, "/orders", None, r#"{"amount":1}"#).await;
        assert_eq!((status, outcome), (StatusCode::CREATED, None));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    let (strict, runs) = app(|layer| layer.with_require_key(true));
    let (status, message, outcome) = send(&strict, "/orders", None, r#"{"amount":1}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(outcome, Some(Outcome::Rejected(RejectionKind::MissingKey)));
    assert!(
        message.contains("idempotency key in the request body"),
        "{message}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn other_routes_keep_the_header() {
    let (app, runs) = app(|layer| layer);
    let body = r#"{"clientToken":"ignored here"}"#;
    send(&app, "/other", Some("h-1"), body).await;
    let again = send(&app, "/other", Some("h-1"), body).await;
    assert_eq!(
        again,
        (StatusCode::CREATED, "run 1".into(), Some(Outcome::Replayed))
    );
    let other = send(&app, "/other", Some("h-2"), body).await;
    assert_eq!(
        other,
        (StatusCode::CREATED, "run 2".into(), Some(Outcome::Executed))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// `AtMostOnce` puts the layer's decisions back to plain HTTP: a payload key configured
/// on the layer does not read its fingerprint as a body.
#[tokio::test]
async fn at_most_once_reads_no_payload_key() {
    let once = AtMostOnce::new(
        IdempotencyLayer::new(MemoryStore::new())
            .with_payload_key(JsonPointerKey::new("/clientToken")),
    );
    let fingerprint = serde_json::json!({"clientToken": "not the key"});
    for _ in 0..2 {
        let result = once
            .run("tenant", "the-key", &fingerprint, || async {
                Ok::<u8, WorkError<()>>(1)
            })
            .await;
        assert_eq!(result.unwrap(), 1);
    }
}

/// As a client meets it over the network: `curl` posts an order twice to a server on
/// loopback, the retry a minute later by its `sentAt` and with a header key its client
/// minted afresh; the retry gets the first answer, marked replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_gets_the_first_answer_for_the_same_client_token() {
    let (app, runs) = app(|layer| layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let post = |header_key: &'static str, body: &'static str| {
        tokio::task::spawn_blocking(move || {
            let output = std::process::Command::new("curl")
                .args(["--silent", "--include", "--request", "POST"])
                .args(["--header", "content-type: application/json"])
                .args(["--header", &format!("idempotency-key: {header_key}")])
                .args(["--data", body])
                .arg(format!("http://{address}/orders"))
                .output()
                .expect("curl runs (Debian package `curl`)");
            assert!(output.status.success(), "curl failed: {output:?}");
            String::from_utf8(output.stdout)
                .unwrap()
                .to_ascii_lowercase()
        })
    };
    let first = post(
        "minted-1",
        r#"{"clientToken":"c-9","account":7,"amount":100,"sentAt":"10:00"}"#,
    )
    .await
    .unwrap();
    let retry = post(
        "minted-2",
        r#"{"clientToken":"c-9","account":7,"amount":100,"sentAt":"10:01"}"#,
    )
    .await
    .unwrap();
    assert!(
        first.starts_with("http/1.1 201") && first.ends_with("run 1"),
        "{first}"
    );
    assert!(!first.contains("idempotent-replayed"), "{first}");
    assert!(
        retry.starts_with("http/1.1 201") && retry.ends_with("run 1"),
        "{retry}"
    );
    assert!(retry.contains("idempotent-replayed: true"), "{retry}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Two tenants, behind real authentication in front of the layer (axum: the layer added
/// before the auth layer runs after it), send the same `clientToken`: each gets its own
/// run, never the other's answer.
#[tokio::test]
async fn a_second_tenant_never_gets_the_first_ones_answer() {
    use axum::extract::Request as AxumRequest;
    use axum::middleware::{self, Next};
    use idempotency_core::ExtensionScope;

    #[derive(Clone)]
    struct Tenant(String);

    async fn authenticate(mut request: AxumRequest, next: Next) -> axum::response::Response {
        let tenant = request.headers().get("authorization").and_then(|value| {
            value
                .to_str()
                .ok()?
                .strip_prefix("Bearer ")
                .map(str::to_owned)
        });
        match tenant {
            Some(tenant) => {
                request.extensions_mut().insert(Tenant(tenant));
                next.run(request).await
            }
            None => StatusCode::UNAUTHORIZED.into_response(),
        }
    }
    use axum::response::IntoResponse;

    let runs = Arc::new(AtomicUsize::new(0));
    async fn run(
        State(runs): State<Arc<AtomicUsize>>,
        axum::Extension(tenant): axum::Extension<Tenant>,
    ) -> (StatusCode, String) {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        (StatusCode::CREATED, format!("run {n} for {}", tenant.0))
    }
    let app = Router::new()
        .route("/orders", post(run))
        .with_state(runs.clone())
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone()))
                .with_payload_key(JsonPointerKey::new("/clientToken")),
        )
        .layer(middleware::from_fn(authenticate));
    let send_as = |tenant: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/orders")
                .header("authorization", format!("Bearer {tenant}"))
                .header("content-type", "application/json")
                .body(Body::from(r#"{"clientToken":"shared-token","amount":1}"#))
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            String::from_utf8(bytes.to_vec()).unwrap()
        }
    };
    assert_eq!(send_as("alice").await, "run 1 for alice");
    assert_eq!(send_as("bob").await, "run 2 for bob");
    assert_eq!(
        send_as("alice").await,
        "run 1 for alice",
        "alice's retry: her own answer"
    );
    assert_eq!(
        send_as("bob").await,
        "run 2 for bob",
        "bob's retry: his own answer"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
