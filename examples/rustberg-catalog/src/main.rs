//! `rustberg-catalog`: an existing Iceberg REST catalog, [rustberg] 0.3.0, with the
//! Idempotency-Key layer added from outside, the way the README recommends for a catalog
//! that is published as a library and builds its own router.
//!
//! ```text
//! cargo run -p rustberg-catalog -- --data ./rustberg-data --vend-test-credentials
//! ```
//!
//! serves rustberg's redb file catalog (`DATA/catalog/catalog.redb`) over a file warehouse
//! (`DATA/warehouse`) on `http://127.0.0.1:8181`, with the layer's records in SQLite
//! (`DATA/idempotency.db`).
//!
//! # How it is wired, from the outside in
//!
//! 1. **Access log**: one line per request with what the layer did.
//! 2. **Compression** (tower-http): outside the layer, so the layer stores plain bytes and
//!    every answer, first or replayed, is compressed for the request it goes to.
//! 3. **The layer** (`idempotency_iceberg::layer`) around rustberg's whole router (so a
//!    replay can reach `loadTable` for fresh credentials):
//!    - keyed requests and `GET /v1/config` reach rustberg with `Accept-Encoding:
//!      identity`, which rustberg's own compression honors;
//!    - rustberg never sees the `Idempotency-Key` header, so its own key cache (24 hours,
//!      no check of the body, not switchable) never answers in the layer's place;
//!    - the scope is a hash of the credential the caller presented
//!      ([`CredentialScope`] over `Authorization` and `X-API-Key`), the best the layer can
//!      see from outside, because rustberg authenticates inside its router;
//!    - rustberg's security headers are stored and replayed with the answer;
//!    - answers that carry table or view metadata are stored as a pointer to their
//!      metadata file, read back with rustberg's own FileIO for a replay
//!      ([`metadata_reader`]), so a record does not grow with its table.
//! 4. **rustberg's router** as `App::into_router` builds it: its own auth, rate limits,
//!    Cedar authorization, audit, compression and error envelope.
//!
//! A replay is answered by the layer without calling rustberg: it skips rustberg's
//! authentication, authorization, rate limits and audit (a revoked credential still gets
//! the replay of an answer it was given, until the record expires), and carries no
//! `x-request-id`.
//!
//! `--vend-test-credentials` installs [`credentials::TestCredentials`], which vends a
//! fresh fake S3 credential on every table creation and load that asks for one
//! (`X-Iceberg-Access-Delegation: vended-credentials`), so credential handling can be
//! observed without a cloud.
//!
//! [rustberg]: https://crates.io/crates/rustberg

mod credentials;

use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::{HeaderName, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use clap::Parser;
use idempotency_core::{
    BoxError, CredentialScope, IdempotencyLayer, IdempotencyStore, Outcome, spawn_purge_task,
};
use idempotency_iceberg::{IcebergProfile, MetadataReader};
use idempotency_store_sql::{PoolSettings, SqliteStore};
use tower_http::compression::CompressionLayer;
use tower_layer::Layer as _;

/// How often expired idempotency records are purged.
const PURGE_INTERVAL: Duration = Duration::from_secs(60);

/// The headers rustberg's router sets on every answer, replayed with a stored answer
/// besides the layer's defaults (`x-request-id` is not: it names the first request).
const RUSTBERG_RESPONSE_HEADERS: [&str; 4] = [
    "x-content-type-options",
    "x-frame-options",
    "content-security-policy",
    "x-xss-protection",
];

/// rustberg 0.3.0 (an Apache Iceberg REST catalog) with Idempotency-Key support.
#[derive(Debug, Parser)]
#[command(name = "rustberg-catalog", version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8181")]
    listen: SocketAddr,

    /// Directory for everything the catalog keeps: `catalog/` (rustberg's redb file),
    /// `warehouse/` (table metadata and data files) and `idempotency.db` (the layer's
    /// records, SQLite). Created if missing.
    #[arg(long, default_value = "./rustberg-data", value_name = "DIR")]
    data: PathBuf,

    /// How long a finished request's answer is kept for retries with its key, as an
    /// ISO-8601 duration (advertised to clients in `GET /v1/config`).
    #[arg(long, default_value = "PT30M", value_parser = idempotency_core::iso8601::parse_duration)]
    idempotency_lifetime: Duration,

    /// Vend a fresh fake S3 credential on every table creation and load that asks for
    /// one, so credential handling can be observed without a cloud. Never for real data.
    #[arg(long)]
    vend_test_credentials: bool,

    /// Let rustberg see the `Idempotency-Key` header too. Only to show why the default
    /// is off: rustberg's own key cache then answers a reused key with its first answer
    /// whatever the body, for 24 hours.
    #[arg(long)]
    forward_idempotency_key: bool,
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

    let data = prepare_data_dir(&args.data)?;
    let warehouse = format!("file://{}", data.join("warehouse").display());
    let catalog = format!("file://{}", data.join("catalog").display());

    let mut builder = rustberg::App::builder()
        .with_catalog_url(catalog)
        .with_warehouse_location(warehouse.clone());
    if args.vend_test_credentials {
        builder = builder
            .with_credential_provider(Arc::new(credentials::TestCredentials::new(&warehouse)));
    }
    let rustberg = builder.build().await.map_err(|error| {
        format!(
            "rustberg could not be set up on {}: {error}",
            data.display()
        )
    })?;

    let database = data.join("idempotency.db");
    let store = SqliteStore::connect(
        &format!("sqlite:{}", database.display()),
        &PoolSettings::default(),
    )
    .await
    .map_err(|error| {
        format!(
            "could not open the idempotency database {}: {error}",
            database.display()
        )
    })?
    .migrate()
    .await?;
    let store = Arc::new(store);
    spawn_purge_task(store.clone(), PURGE_INTERVAL, 500);

    let metadata = metadata_reader().map_err(|error| format!("rustberg's FileIO: {error}"))?;
    let layer = idempotency_layer(store, metadata, &args);
    let in_flight = layer.in_flight();
    let app = axum::Router::new()
        .fallback_service(layer.layer(rustberg.into_router()))
        .layer(CompressionLayer::new())
        .layer(middleware::from_fn(access_log));

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|error| format!("cannot listen on {}: {error}", args.listen))?;
    tracing::info!(
        "rustberg Iceberg REST catalog on http://{} (data {}, warehouse {warehouse}, idempotency keys kept {}{}{})",
        listener.local_addr()?,
        data.display(),
        idempotency_core::iso8601::format_duration(args.idempotency_lifetime),
        if args.vend_test_credentials {
            ", vending TEST credentials"
        } else {
            ""
        },
        if args.forward_idempotency_key {
            ", keys FORWARDED to rustberg"
        } else {
            ""
        },
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown_signal())
    .await?;
    let abandoned = in_flight.wait_at_most(Duration::from_secs(30)).await;
    if abandoned > 0 {
        tracing::warn!(
            abandoned,
            "keyed requests still running at shutdown were abandoned; retries take them over once their leases lapse"
        );
    }
    Ok(())
}

/// Reads table and view metadata files with rustberg's own FileIO (every storage scheme
/// rustberg was built with), so that keyed answers that carry metadata are stored as a
/// pointer to their file and replayed from it. rustberg answers creates and commits with
/// the metadata it just wrote, so the file holds exactly the bytes the answer carried.
fn metadata_reader() -> Result<impl MetadataReader, BoxError> {
    let file_io = rustberg::catalog::file_io::build_file_io()?;
    Ok(move |location: String| {
        let file_io = file_io.clone();
        async move {
            let bytes = file_io.new_input(&location)?.read().await?;
            Ok::<_, BoxError>(gunzipped(bytes)?)
        }
    })
}

/// A metadata file's JSON: decompressed if the table writes gzip metadata
/// (`write.metadata.compression-codec`).
fn gunzipped(bytes: Bytes) -> std::io::Result<Bytes> {
    if !bytes.starts_with(&[0x1f, 0x8b]) {
        return Ok(bytes);
    }
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&bytes[..]).read_to_end(&mut json)?;
    Ok(Bytes::from(json))
}

/// The layer as the README recommends it for a catalog that authenticates inside its own
/// router and keeps a key cache of its own.
fn idempotency_layer(
    store: Arc<dyn IdempotencyStore>,
    metadata: impl MetadataReader,
    args: &Args,
) -> IdempotencyLayer {
    let replayed = [
        header::CONTENT_TYPE,
        header::CONTENT_LANGUAGE,
        header::CONTENT_LOCATION,
        header::LOCATION,
        header::ETAG,
        header::LAST_MODIFIED,
        header::CACHE_CONTROL,
        header::VARY,
    ]
    .into_iter()
    .chain(RUSTBERG_RESPONSE_HEADERS.map(HeaderName::from_static));
    idempotency_iceberg::layer(store)
        .with_profile(IcebergProfile::default().with_metadata_reader(metadata))
        .with_lifetime(args.idempotency_lifetime)
        // rustberg's credentials: a bearer token (OIDC/JWT, API key) or `X-API-Key`.
        .with_scope(CredentialScope::from_headers([
            header::AUTHORIZATION,
            HeaderName::from_static("x-api-key"),
        ]))
        .with_replayed_headers(replayed)
        .with_forwarded_key(args.forward_idempotency_key)
}

/// Creates `dir` and its `catalog` and `warehouse` folders, and returns its absolute path.
fn prepare_data_dir(dir: &Path) -> Result<PathBuf, String> {
    for sub in ["catalog", "warehouse"] {
        let path = dir.join(sub);
        std::fs::create_dir_all(&path)
            .map_err(|error| format!("cannot create {}: {error}", path.display()))?;
    }
    std::fs::canonicalize(dir).map_err(|error| format!("cannot resolve {}: {error}", dir.display()))
}

/// One line per request: method, path, status, what the layer did, time.
async fn access_log(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let started = Instant::now();
    let response = next.run(request).await;
    let outcome = response
        .extensions()
        .get::<Outcome>()
        .map_or_else(|| "passed-through".to_owned(), Outcome::to_string);
    tracing::info!(
        target: "rustberg_catalog::access",
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
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: no new connections");
}
