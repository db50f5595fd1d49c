//! `grpc-orders`: a tonic gRPC server protected by the Idempotency-Key layer's gRPC profile.
//!
//! ```text
//! cargo run -p examples --bin grpc-orders
//! ```
//!
//! serves `orders.v1.Orders` (`examples/proto/orders.proto`) on `127.0.0.1:50051`, with its
//! orders and the idempotency records in a SQLite file in the current directory
//! (`grpc-orders.db`). Two processes started with one `--database postgres://…` (or
//! `mysql://…`) are two replicas of one service: a retry that lands on the other replica
//! is replayed from the shared record.
//!
//! - `CreateOrder` appends an order with the next id and returns it. Item `unavailable`
//!   answers `UNAVAILABLE` and creates nothing (the key is released: a retry runs again);
//!   item `invalid` answers `INVALID_ARGUMENT` "item is invalid" and creates nothing (the
//!   answer is stored and replayed); item `slow` waits 2 s, then creates.
//! - `ListOrders` streams every order in id order; it is a streaming method, so it passes
//!   through the layer untouched, key or no key.
//!
//! Operating it:
//!
//! - `--idempotency-store redis://host:port` (or `redis+cluster://host:port,host:port`)
//!   keeps the idempotency records in Redis or Valkey, where they expire by themselves;
//!   the orders stay in `--database`. Replicas then share the Redis server as well as the
//!   database. In SQL, expired records are deleted by a purge task once a minute.
//! - `--metrics-listen 127.0.0.1:9090` serves the layer's metrics (keyed calls by outcome,
//!   store call durations) as Prometheus text on `http://127.0.0.1:9090/metrics`, a
//!   listener of its own.
//!
//! Callers are told apart by tenant: `authorization: Bearer <tenant>` metadata names the
//! caller's tenant (a real service verifies a token there), and a call without it is the
//! tenant `anonymous`, so that clients without credentials (the grpcio test, grpcurl)
//! still work. The authentication is a tower layer on the server, *outside* the
//! idempotency layer, so the layer sees the tenant; a per-service interceptor
//! (`OrdersServer::with_interceptor`) would run inside it, too late, and the layer would
//! refuse every keyed call.
//!
//! A call with `idempotency-key` metadata runs at most once per key and tenant; every
//! retry gets the first answer back with `idempotent-replayed: true` in its metadata. The
//! layer is set up in a few lines (the README shows the same ones):
//!
//! ```text
//! idempotency_grpc::layer(store)
//!     .with_profile(GrpcProfile::new().with_file_descriptor_set(orders::FILE_DESCRIPTOR_SET)?)
//! ```

mod orders;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use idempotency_core::{ExtensionScope, FullStore};
use idempotency_grpc::{GrpcProfile, RequestIdField};
use idempotency_store_sql::{MySqlStore, PoolSettings, PostgresStore, SqliteStore};
use tonic::service::interceptor::InterceptorLayer;
use tonic::transport::Server;

use crate::orders::{Database, OrdersServer, OrdersService, Tenant, authenticate};

/// A gRPC orders service with Idempotency-Key support.
#[derive(Debug, Parser)]
#[command(name = "grpc-orders", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,

    /// Database for the orders and (without `--idempotency-store`) the idempotency
    /// records: `sqlite://FILE?mode=rwc`, `postgres://...` or `mysql://...`. Processes
    /// sharing one PostgreSQL or MySQL database are replicas of one service.
    #[arg(long, default_value = "sqlite://grpc-orders.db?mode=rwc")]
    database: String,

    /// Prefix of the two tables (`PREFIX_orders`, `PREFIX_idempotency`), so that several
    /// services (or test runs) can share one database.
    #[arg(long, default_value = "grpc")]
    tables: String,

    /// How long a duplicate waits for the call that holds its key before it is told
    /// `UNAVAILABLE`, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    in_flight_wait_ms: u64,

    /// Keep the idempotency records in Redis or Valkey instead of `--database`:
    /// `redis://host:port[/db]` for one server, `redis+cluster://host:port,host:port` for a
    /// Redis Cluster. The orders stay in `--database`. The server must run with
    /// `maxmemory-policy noeviction` (and `appendonly yes` for records that survive its
    /// restart).
    #[arg(long, value_name = "URL")]
    idempotency_store: Option<String>,

    /// Serve the idempotency layer's metrics as Prometheus text on
    /// `http://ADDR/metrics`, e.g. `127.0.0.1:9090` (a listener of its own).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    // Before the layer is made, so that its metrics have a recorder from the first call.
    if let Some(listen) = args.metrics_listen {
        let address = examples::telemetry::serve(listen).await?;
        // Printed before the listening line, which the tests wait for.
        println!("grpc-orders metrics on http://{address}/metrics");
    }
    let database = Database::open(&args.database, &format!("{}_orders", args.tables)).await?;
    let store: Arc<dyn FullStore> = match &args.idempotency_store {
        Some(url) => Arc::new(examples::records::connect_redis(url).await?),
        None => store(&args.database, &format!("{}_idempotency", args.tables)).await?,
    };
    // SQL tables keep expired records until they are deleted; Redis expires its own (the
    // task then ends after its first round).
    let _purge = idempotency_core::spawn_purge_task(
        store.clone(),
        Duration::from_secs(60),
        idempotency_core::config::PURGE_BATCH_SIZE,
    );
    let orders = OrdersService::new(database);

    // README: tonic
    let layer = idempotency_grpc::layer(store)
        .with_profile(GrpcProfile::new().with_file_descriptor_set(orders::FILE_DESCRIPTOR_SET)?)
        .with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone()))
        // AIP-155: PlaceOrder's key is its message's `string request_id = 2`.
        .with_payload_key(RequestIdField::new(2).on_methods(["/orders.v1.Orders/PlaceOrder"]))
        .with_in_flight_wait(Duration::from_millis(args.in_flight_wait_ms));
    let in_flight = layer.in_flight();
    let server = Server::builder()
        .layer(InterceptorLayer::new(authenticate)) // first: the outermost, runs before the layer
        .layer(layer)
        .add_service(OrdersServer::new(orders));
    // README: end

    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let address = listener.local_addr()?;
    // The tests wait for this line.
    println!("grpc-orders listening on {address}");
    server
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener),
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        )
        .await?;
    in_flight.wait().await;
    Ok(())
}

/// The idempotency store in `url`'s database, in table `table`, migrated.
async fn store(
    url: &str,
    table: &str,
) -> Result<Arc<dyn FullStore>, Box<dyn std::error::Error + Send + Sync>> {
    let settings = PoolSettings::default();
    Ok(if url.starts_with("postgres") {
        Arc::new(
            PostgresStore::connect(url, &settings)
                .await?
                .with_table_name(table)?
                .migrate()
                .await?,
        )
    } else if url.starts_with("mysql") || url.starts_with("mariadb") {
        Arc::new(
            MySqlStore::connect(url, &settings)
                .await?
                .with_table_name(table)?
                .migrate()
                .await?,
        )
    } else {
        Arc::new(
            SqliteStore::connect(url, &settings)
                .await?
                .with_table_name(table)?
                .migrate()
                .await?,
        )
    })
}
