//! `iceberg-catalog`: an Apache Iceberg REST catalog server, protected by the
//! Idempotency-Key layer.
//!
//! ```text
//! cargo run -p examples --bin iceberg-catalog
//! ```
//!
//! starts a catalog on `http://127.0.0.1:8181` that keeps its state in a SQLite file in the
//! current directory (`iceberg-catalog.db`) and its table metadata under `./warehouse`.
//! Point PyIceberg, Spark or any other Iceberg REST client at it.
//!
//! # The story of a request
//!
//! A client creates a table: `POST /v1/namespaces/db/tables` with an `Idempotency-Key`
//! header. The access log (outermost) notes the time; the idempotency layer reserves the
//! key in its store, fingerprints the body, and lets the request through to the catalog.
//! The catalog ([`catalog`]) builds the table's first metadata with iceberg-rust's
//! `TableMetadataBuilder`, writes it to
//! `<warehouse>/db/<table>/metadata/00000-<uuid>.metadata.json`, and inserts the table's
//! row into the SQL database, in a transaction that it does not commit yet. The route
//! builds the answer, a `LoadTableResult`, and commits it with the table: the answer goes
//! into the key's record in the same transaction, so a crash at any instant leaves both
//! or neither. The answer goes back through the layer, which sees it recorded already,
//! and out through the access log, which prints method, path, status and what the layer
//! did (`executed`).
//!
//! The answer is lost on the way; the client sends the same request again with the same
//! key. This time the layer finds the key finished and answers with the stored response,
//! byte for byte, plus `idempotent-replayed: true`; the catalog is not called, the table
//! is not created twice, and the log says `replayed`. The same key with a different body
//! gets 422. A retry that arrives while the first is still running waits for it, and gets
//! 503 with `Retry-After` if it is still running after the wait (never a 409, which a Java
//! client would take as a failed commit).
//!
//! # Replicas
//!
//! Two processes started with one `--database postgres://...` (or `mysql://...`) and one
//! `--warehouse` are two replicas of one catalog: the catalog state and the idempotency
//! records both live in that database, commits are compare-and-swap on the metadata
//! location, and a retry that lands on the other replica is replayed from the shared
//! record.
//!
//! # Idempotency records in Redis
//!
//! `--idempotency-store redis://host:port` (or `redis+cluster://host:port,host:port`)
//! keeps the idempotency records in Redis or Valkey, for a deployment whose shared state
//! lives there; the catalog's own state stays in `--database`. Replicas then share the
//! Redis server as well as the database. The URL's query sets the store's options:
//! `redis://host:port?replica-acks=1&replica-ack-timeout=250ms` makes every write wait
//! until a replica has it, so that a failover to that replica loses no record.
//!
//! # Modules
//!
//! The HTTP side and the state side are split the same way, one file per resource
//! (namespaces, tables, transactions, views; the routes also serve config):
//!
//! - [`routes`]: the REST routes, with and without `{prefix}`, and their handlers, which
//!   turn path, query and body into a catalog call.
//! - [`catalog`]: namespaces, tables and views over the SQL database and the warehouse,
//!   with the plumbing they share (connection, SQL, uncommitted changes, locations).
//! - [`rest`]: the request and response bodies.
//! - [`error`]: Iceberg `ErrorModel` errors.
//! - [`idempotency`]: the layer and its store.
//! - [`telemetry`]: `--metrics-listen`, the layer's metrics as Prometheus text (shared
//!   with `grpc-orders`, in the examples' library).
//! - [`admin`]: `--admin-token`, endpoints that inspect and evict idempotency records.
//! - `test_hooks`: what the crash and fault tests switch on, only in a build with the
//!   `test-hooks` feature.

mod admin;
mod catalog;
mod error;
mod idempotency;
mod rest;
mod routes;
#[cfg(feature = "test-hooks")]
mod test_hooks;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use clap::Parser;
use examples::telemetry;
use idempotency_core::{IdempotencyLayer, Outcome};
use tower_layer::Layer as _;

use crate::catalog::{Backend, Catalog, CatalogDatabase};
use crate::routes::AppState;

/// An Apache Iceberg REST catalog server with Idempotency-Key support.
#[derive(Debug, Parser)]
#[command(name = "iceberg-catalog", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8181")]
    listen: SocketAddr,

    /// Database for the catalog state and the idempotency records: `sqlite://FILE?mode=rwc`,
    /// `postgres://...` or `mysql://...`. Processes sharing one PostgreSQL or MySQL
    /// database (and one warehouse) are replicas of one catalog.
    #[arg(long, default_value = "sqlite://iceberg-catalog.db?mode=rwc")]
    database: String,

    /// Directory for table and view metadata (and, written by clients, data files).
    #[arg(long, default_value = "./warehouse")]
    warehouse: PathBuf,

    /// How long a finished request's answer is kept for retries with its key, as an
    /// ISO-8601 duration (advertised to clients in `GET /v1/config`).
    #[arg(long, default_value = "PT30M", value_parser = idempotency_core::iso8601::parse_duration)]
    idempotency_lifetime: Duration,

    /// Keep the idempotency records in Redis or Valkey instead of `--database`:
    /// `redis://host:port[/db]` for one server, `redis+cluster://host:port,host:port` for a
    /// Redis Cluster. The catalog's own state stays in `--database`. The server must run
    /// with `maxmemory-policy noeviction` (and `appendonly yes` for records that survive
    /// its restart). The URL's query sets the store's other options, e.g.
    /// `?replica-acks=1&replica-ack-timeout=250ms` (each write waits until a replica has
    /// it, so a failover loses no record), `key-prefix`, `connect-timeout`,
    /// `operation-timeout`, `replica-ack-connections`, `accept-evicting-policy`, `cluster`.
    #[arg(long, value_name = "URL")]
    idempotency_store: Option<String>,

    /// An `idempotency-*` property for the idempotency store, `KEY=VALUE`, as a catalog
    /// configured from properties takes it; repeatable. The store's own keys, e.g.
    /// `idempotency-database-pool-size=4` for the records in `--database`, or
    /// `idempotency-redis-replica-acks=1` with `--idempotency-store`, and
    /// `idempotency-purge-interval` or `idempotency-scope-max-records`. The store refuses
    /// a key it does not take, naming the keys it does.
    #[arg(
        long = "idempotency-property",
        value_name = "KEY=VALUE",
        value_parser = key_value,
        conflicts_with = "no_idempotency"
    )]
    idempotency_properties: Vec<(String, String)>,

    /// Serve without the idempotency layer: keys are ignored and not advertised.
    #[arg(long, conflicts_with = "idempotency_store")]
    no_idempotency: bool,

    /// Reserve a keyed request's record in a commit of its own before the change runs
    /// (and write its answer in the change's transaction), instead of in the change's own
    /// transaction: two commits per change instead of one. For comparison (benches and
    /// tests), only in a build with the `test-hooks` feature.
    #[cfg(feature = "test-hooks")]
    #[arg(long, conflicts_with_all = ["idempotency_store", "no_idempotency"])]
    two_commit: bool,

    /// Store keyed answers that carry table or view metadata whole, as a catalog without
    /// a metadata reader does, instead of as a pointer to their metadata file, which
    /// replays read back. For comparison (benches).
    #[arg(long, conflicts_with = "no_idempotency")]
    store_whole_metadata: bool,

    /// How long a shutdown waits for keyed requests still running (ISO-8601). Those still
    /// running then are abandoned: their keys are taken over by a retry once their
    /// leases lapse.
    #[arg(long, default_value = "PT30S", value_parser = idempotency_core::iso8601::parse_duration)]
    shutdown_deadline: Duration,

    /// Serve the idempotency layer's metrics as Prometheus text on
    /// `http://ADDR/metrics`, e.g. `127.0.0.1:9090` (a listener of its own).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,

    /// Turn on the admin endpoints that inspect and evict idempotency records
    /// (`/admin/idempotency/…`), for requests that send `Authorization: Bearer TOKEN`;
    /// at least 16 characters. Off without it.
    #[arg(
        long,
        env = "ICEBERG_CATALOG_ADMIN_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    admin_token: Option<String>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let args = Args::parse();

    std::fs::create_dir_all(&args.warehouse)?;
    let warehouse_dir = std::fs::canonicalize(&args.warehouse)?;
    let warehouse = format!(
        "file://{}",
        warehouse_dir.display().to_string().trim_end_matches('/')
    );
    // Before the layer is made, so that its metrics have a recorder from the first request.
    let metrics_address = match args.metrics_listen {
        Some(listen) => Some(telemetry::serve(listen).await?),
        None => None,
    };
    // The catalog is generic over its database: the URL picks which.
    match Backend::from_url(&args.database)? {
        Backend::Sqlite => serve::<sqlx::Sqlite>(args, warehouse, metrics_address).await,
        Backend::Postgres => serve::<sqlx::Postgres>(args, warehouse, metrics_address).await,
        Backend::MySql => serve::<sqlx::MySql>(args, warehouse, metrics_address).await,
    }
}

/// Opens the catalog on database `DB` with its idempotency layer, and serves it until
/// Ctrl-C or SIGTERM.
async fn serve<DB: CatalogDatabase>(
    args: Args,
    warehouse: String,
    metrics_address: Option<SocketAddr>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let catalog = Catalog::<DB>::open(&args.database, warehouse.clone()).await?;
    let (layer, records, catalog) = if args.no_idempotency {
        (None, None, catalog)
    } else {
        let records = match &args.idempotency_store {
            Some(url) => idempotency::Records::Redis(url),
            None => idempotency::Records::Database(&args.database),
        };
        #[cfg(feature = "test-hooks")]
        let commits = if args.two_commit {
            idempotency::Commits::Two
        } else {
            idempotency::Commits::One
        };
        #[cfg(not(feature = "test-hooks"))]
        let commits = idempotency::Commits::One;
        let metadata = (!args.store_whole_metadata).then(|| catalog.metadata_reader());
        let (layer, records, writes) = idempotency::layer(
            records,
            args.idempotency_lifetime,
            &args.idempotency_properties,
            commits,
            catalog.pool(),
            metadata,
        )
        .await?;
        let catalog = match writes {
            Some(writes) => catalog.with_records_in_database(writes),
            None => catalog,
        };
        (Some(layer), Some(records), catalog)
    };
    let in_flight = layer.as_ref().map(IdempotencyLayer::in_flight);
    let admin = admin::router(args.admin_token.as_deref(), records)?;
    let catalog_routes = routes::router(AppState {
        catalog: Arc::new(catalog),
    });
    #[cfg(feature = "test-hooks")]
    let catalog_routes = test_hooks::install(catalog_routes);
    // The layer wraps the whole router (not each route, as `Router::layer` would), so a
    // replay can reach the catalog's other routes. The admin routes sit in front of it:
    // an eviction is not itself a keyed mutation.
    let app = match layer {
        Some(layer) => admin.fallback_service(layer.layer(catalog_routes)),
        None => admin.fallback_service(catalog_routes),
    }
    .layer(middleware::from_fn(access_log));

    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(
        "Iceberg REST catalog on http://{} (database {}, warehouse {}, idempotency {})",
        listener.local_addr()?,
        redact(&args.database),
        warehouse,
        if in_flight.is_some() {
            format!(
                "on, keys kept {} in {}",
                idempotency_core::iso8601::format_duration(args.idempotency_lifetime),
                match &args.idempotency_store {
                    Some(url) => redact(url),
                    None => "the database".to_owned(),
                }
            )
        } else {
            "off".to_owned()
        },
    );
    if let Some(address) = metrics_address {
        tracing::info!("metrics on http://{address}/metrics");
    }
    if args.admin_token.is_some() {
        tracing::info!("admin endpoints on /admin/idempotency/… (bearer token required)");
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    if let Some(in_flight) = in_flight {
        // Keyed mutations whose clients went away still finish and are recorded, so
        // their retries (on another replica, or after a restart) get the answer.
        tracing::info!(
            running = in_flight.count(),
            "waiting for in-flight keyed requests"
        );
        let abandoned = in_flight.wait_at_most(args.shutdown_deadline).await;
        if abandoned > 0 {
            tracing::warn!(
                abandoned,
                "keyed requests still running at the shutdown deadline were abandoned; retries take them over once their leases lapse"
            );
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// `KEY=VALUE`, as `--idempotency-property` takes it.
fn key_value(pair: &str) -> Result<(String, String), String> {
    match pair.split_once('=') {
        Some((key, value)) if !key.trim().is_empty() => {
            Ok((key.trim().to_owned(), value.to_owned()))
        }
        _ => Err(format!(
            "expected KEY=VALUE, such as idempotency-database-pool-size=4, not {pair:?}"
        )),
    }
}

/// One line per request: method, path, status, what the idempotency layer did, time.
/// An admin request shows its route, not its path: the path holds a key, which collects
/// a response and is never logged.
async fn access_log(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = match request.extensions().get::<MatchedPath>() {
        Some(route) if route.as_str().starts_with("/admin/") => route.as_str().to_owned(),
        _ => request.uri().path().to_owned(),
    };
    let started = Instant::now();
    let response = next.run(request).await;
    let outcome = response
        .extensions()
        .get::<Outcome>()
        .map_or_else(|| "passed-through".to_owned(), Outcome::to_string);
    tracing::info!(
        target: "iceberg_catalog::access",
        "{method} {path} {} idempotency={outcome} {}ms",
        response.status().as_u16(),
        started.elapsed().as_millis()
    );
    response
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: no new connections");
}

/// A database URL without its password, for the log.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let credentials = &url[scheme_end + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}
