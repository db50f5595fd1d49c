//! A layer placed where it cannot see the caller refuses; it never shares one caller's
//! answer with another. Each stack is built the way a user of axum or tonic writes it:
//!
//! - axum, misordered: `.layer(auth).layer(idempotency)` reads "after auth", but the
//!   layer added last runs first, so the layer sees no tenant;
//! - axum, as documented: `.layer(idempotency).layer(auth)`;
//! - tonic, misordered: `Server::builder().layer(idempotency)` with the authentication in
//!   a per-service interceptor (`OrdersServer::with_interceptor`), which runs inside;
//! - tonic, as documented: `Server::builder().layer(InterceptorLayer::new(auth))
//!   .layer(idempotency)`.
//!
//! The misordered stacks must answer tenant A, tenant B and an unauthenticated caller
//! with the refusal (and run nothing); the documented ones must replay A's answer to A
//! only, and run B's request with the same key separately. The tonic stacks are driven
//! by the generated tonic client over real HTTP/2.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, Request};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::{ExtensionScope, IdempotencyLayer};
use idempotency_grpc::GrpcProfile;
use idempotency_store_memory::MemoryStore;
use tonic::service::interceptor::InterceptorLayer;
use tonic::transport::Server;
use tower::ServiceExt;

mod pb {
    #![allow(missing_docs, unreachable_pub, clippy::all)]
    tonic::include_proto!("orders.v1");
}

use pb::orders_client::OrdersClient;
use pb::orders_server::{Orders, OrdersServer};
use pb::{CreateOrderRequest, ListOrdersRequest, Order, PlaceOrderRequest};

const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/orders_descriptor.bin"));

/// Who the authentication found.
#[derive(Clone)]
struct Tenant(String);

fn bearer(value: Option<&str>) -> Option<String> {
    value?.strip_prefix("Bearer ").map(str::to_owned)
}

// --- axum ----------------------------------------------------------------------------------

async fn auth(mut request: Request, next: Next) -> Result<Response, StatusCode> {
    let tenant = bearer(
        request
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok()),
    )
    .ok_or(StatusCode::UNAUTHORIZED)?;
    request.extensions_mut().insert(Tenant(tenant));
    Ok(next.run(request).await)
}

fn payments(calls: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/payments",
        post(move |Extension(tenant): Extension<Tenant>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move { (StatusCode::CREATED, format!("payment {n} of {}", tenant.0)) }
        }),
    )
}

fn idempotency() -> IdempotencyLayer {
    IdempotencyLayer::new(MemoryStore::new())
        .with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone()))
}

async fn pay(app: &Router, tenant: Option<&str>) -> (StatusCode, bool, String) {
    let mut request = axum::http::Request::post("/payments").header("idempotency-key", "pay-1");
    if let Some(tenant) = tenant {
        request = request.header("authorization", format!("Bearer {tenant}"));
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from("100 EUR")).unwrap())
        .await
        .unwrap();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        replayed,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

#[tokio::test]
async fn axum_with_the_layer_outside_auth_refuses_every_caller_and_runs_nothing() {
    let calls = Arc::new(AtomicUsize::new(0));
    // "After auth" in reading order; in axum the last `.layer` runs first.
    let app = payments(calls.clone())
        .layer(middleware::from_fn(auth))
        .layer(idempotency());
    for caller in [Some("tenant-a"), Some("tenant-b"), None, Some("tenant-a")] {
        let (status, replayed, body) = pay(&app, caller).await;
        assert_eq!(
            status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{caller:?}: {body}"
        );
        assert!(!replayed, "{caller:?} got a replay: {body}");
        assert!(
            body.contains("before authentication") && body.contains("no-scope"),
            "the refusal names the misconfiguration: {body}"
        );
        assert!(
            !body.contains("tenant-a") && !body.contains("payment"),
            "{body}"
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "nothing may run unprotected"
    );

    // A layer given no scope at all sees the credential and refuses too.
    let unscoped = payments(calls.clone())
        .layer(middleware::from_fn(auth))
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let (status, _, body) = pay(&unscoped, Some("tenant-a")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    assert!(body.contains("with_scope"), "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn axum_with_the_layer_inside_auth_keeps_tenants_apart() {
    let calls = Arc::new(AtomicUsize::new(0));
    // As the README says: the idempotency layer first, the authentication last (outside).
    let app = payments(calls.clone())
        .layer(idempotency())
        .layer(middleware::from_fn(auth));
    let first = pay(&app, Some("tenant-a")).await;
    assert_eq!(
        first,
        (StatusCode::CREATED, false, "payment 1 of tenant-a".into())
    );
    let again = pay(&app, Some("tenant-a")).await;
    assert_eq!(
        again,
        (StatusCode::CREATED, true, "payment 1 of tenant-a".into())
    );
    let other = pay(&app, Some("tenant-b")).await;
    assert_eq!(
        other,
        (StatusCode::CREATED, false, "payment 2 of tenant-b".into()),
        "tenant b's request with the same key runs on its own"
    );
    let anonymous = pay(&app, None).await;
    assert_eq!(anonymous.0, StatusCode::UNAUTHORIZED);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

// --- tonic ---------------------------------------------------------------------------------

fn authenticate(mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
    let tenant = bearer(
        request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok()),
    )
    .ok_or_else(|| tonic::Status::unauthenticated("send authorization: Bearer <tenant>"))?;
    request.extensions_mut().insert(Tenant(tenant));
    Ok(request)
}

#[derive(Clone, Default)]
struct Bank {
    calls: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl Orders for Bank {
    async fn create_order(
        &self,
        request: tonic::Request<CreateOrderRequest>,
    ) -> Result<tonic::Response<Order>, tonic::Status> {
        let tenant = request
            .extensions()
            .get::<Tenant>()
            .map(|t| t.0.clone())
            .ok_or_else(|| tonic::Status::unauthenticated("no tenant"))?;
        let id = self.calls.fetch_add(1, Ordering::SeqCst) as i64 + 1;
        Ok(tonic::Response::new(Order {
            id,
            item: format!("{} for {tenant}", request.into_inner().item),
        }))
    }

    async fn place_order(
        &self,
        _request: tonic::Request<PlaceOrderRequest>,
    ) -> Result<tonic::Response<Order>, tonic::Status> {
        Err(tonic::Status::unimplemented("not called by these tests"))
    }

    type ListOrdersStream = futures_util::stream::Empty<Result<Order, tonic::Status>>;

    async fn list_orders(
        &self,
        _request: tonic::Request<ListOrdersRequest>,
    ) -> Result<tonic::Response<Self::ListOrdersStream>, tonic::Status> {
        Ok(tonic::Response::new(futures_util::stream::empty()))
    }
}

fn grpc_idempotency() -> IdempotencyLayer<idempotency_core::WrappedBodies> {
    idempotency_grpc::layer(MemoryStore::new())
        .with_profile(
            GrpcProfile::new()
                .with_file_descriptor_set(FILE_DESCRIPTOR_SET)
                .unwrap(),
        )
        .with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone()))
}

async fn listener() -> (tokio::net::TcpListener, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    (listener, address)
}

async fn order(
    address: SocketAddr,
    tenant: Option<&str>,
    key: &str,
) -> Result<(Order, bool), tonic::Status> {
    let mut client = OrdersClient::connect(format!("http://{address}"))
        .await
        .unwrap();
    let mut request = tonic::Request::new(CreateOrderRequest {
        item: "book".into(),
    });
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    if let Some(tenant) = tenant {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {tenant}").parse().unwrap());
    }
    let response = client.create_order(request).await?;
    let replayed = response.metadata().contains_key("idempotent-replayed");
    Ok((response.into_inner(), replayed))
}

#[tokio::test]
async fn tonic_with_a_per_service_interceptor_refuses_every_caller_and_runs_nothing() {
    let bank = Bank::default();
    let (listener, address) = listener().await;
    let server = Server::builder()
        .layer(grpc_idempotency())
        .add_service(OrdersServer::with_interceptor(bank.clone(), authenticate));
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    for caller in [Some("tenant-a"), Some("tenant-b"), None] {
        let status = order(address, caller, "order-1")
            .await
            .expect_err("a layer that cannot see the caller must refuse");
        assert_eq!(
            status.code(),
            tonic::Code::Internal,
            "{caller:?}: {status:?}"
        );
        assert!(
            status.message().contains("before authentication"),
            "{status:?}"
        );
    }
    assert_eq!(bank.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn tonic_with_auth_as_an_outer_layer_keeps_tenants_apart() {
    let bank = Bank::default();
    let (listener, address) = listener().await;
    // The first `.layer` of a tonic server is the outermost.
    let server = Server::builder()
        .layer(InterceptorLayer::new(authenticate))
        .layer(grpc_idempotency())
        .add_service(OrdersServer::new(bank.clone()));
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    let (first, replayed) = order(address, Some("tenant-a"), "order-1").await.unwrap();
    assert_eq!(
        (first.id, first.item.as_str(), replayed),
        (1, "book for tenant-a", false)
    );
    let (again, replayed) = order(address, Some("tenant-a"), "order-1").await.unwrap();
    assert_eq!((again, replayed), (first, true));
    let (other, replayed) = order(address, Some("tenant-b"), "order-1").await.unwrap();
    assert_eq!(
        (other.id, other.item.as_str(), replayed),
        (2, "book for tenant-b", false),
        "tenant b's call with the same key runs on its own"
    );
    let anonymous = order(address, None, "order-1").await.unwrap_err();
    assert_eq!(anonymous.code(), tonic::Code::Unauthenticated);
    assert_eq!(bank.calls.load(Ordering::SeqCst), 2);

    // An empty or blank key is the client's mistake, not an unprotected call.
    for blank in ["", "   "] {
        let status = order(address, Some("tenant-a"), blank).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{blank:?}");
        assert!(status.message().contains("empty"), "{status:?}");
    }
    assert_eq!(bank.calls.load(Ordering::SeqCst), 2);
}
