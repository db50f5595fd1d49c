//! A small server for crash and outage tests: `POST /mutations/{name}` inserts one row
//! into a `side_effects` table of the same database that holds the idempotency records,
//! so a test can count how often a mutation really ran, across processes and crashes.
//!
//! ```text
//! cargo run -p examples --bin mutation-server -- \
//!     --database postgres://postgres@127.0.0.1:5432/test --listen 127.0.0.1:8300 --lease-ms 1000
//! ```
//!
//! Request headers steer the handler: `x-sleep-before-ms` waits before the row is
//! written (a kill then lands before the side effect), `x-sleep-after-ms` waits after it
//! is committed (a kill then lands between the side effect and the finalize). Every
//! response carries `x-idempotency-outcome` with what the layer did.

use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use idempotency_core::{IdempotencyLayer, Outcome};
use idempotency_store_sql::sqlx::{self, PgPool};
use idempotency_store_sql::{PoolSettings, PostgresStore};

struct Flags {
    database: String,
    listen: String,
    lease: Duration,
    table: String,
}

fn parse_flags() -> Result<Flags, String> {
    let mut flags = Flags {
        database: "postgres://postgres@127.0.0.1:5432/test".to_owned(),
        listen: "127.0.0.1:8300".to_owned(),
        lease: Duration::from_secs(20),
        table: "idempotency_records".to_owned(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--database" => flags.database = value,
            "--listen" => flags.listen = value,
            "--table" => flags.table = value,
            "--lease-ms" => {
                flags.lease = Duration::from_millis(
                    value
                        .parse()
                        .map_err(|_| format!("--lease-ms takes milliseconds, not {value:?}"))?,
                );
            }
            other => {
                return Err(format!(
                    "unknown flag {other}; use --database URL, --listen ADDR, --table NAME, --lease-ms N"
                ));
            }
        }
    }
    Ok(flags)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let flags = parse_flags()?;
    let store = PostgresStore::connect(&flags.database, &PoolSettings::default())
        .await?
        .with_table_name(&flags.table)?
        .migrate()
        .await?;
    let pool = store.pool().clone();
    sqlx_create_side_effects(&pool, &flags.table).await?;
    let layer = IdempotencyLayer::new(store).with_lease(flags.lease);
    let in_flight = layer.in_flight();
    let app = Router::new()
        .route("/mutations/{name}", post(mutate))
        .route("/health", get(|| async { "ok" }))
        .with_state((pool, format!("{}_side_effects", flags.table)))
        .layer(layer)
        .layer(axum::middleware::map_response(label_outcome));
    let listener = tokio::net::TcpListener::bind(&flags.listen).await?;
    tracing::info!("mutation-server listening on {}", flags.listen);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    in_flight.wait().await;
    Ok(())
}

async fn sqlx_create_side_effects(pool: &PgPool, table: &str) -> Result<(), sqlx::Error> {
    // Same advisory-lock-free idiom as the store: retry once if a concurrent creator won.
    let statement = format!(
        "CREATE TABLE IF NOT EXISTS {table}_side_effects (name TEXT NOT NULL, pid INTEGER NOT NULL)"
    );
    if sqlx::query(&statement).execute(pool).await.is_err() {
        sqlx::query(&statement).execute(pool).await?;
    }
    Ok(())
}

async fn mutate(
    State((pool, side_effects)): State<(PgPool, String)>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<(StatusCode, String), (StatusCode, String)> {
    let pause = |header: &str| {
        headers
            .get(header)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map(Duration::from_millis)
    };
    if let Some(pause) = pause("x-sleep-before-ms") {
        tokio::time::sleep(pause).await;
    }
    sqlx::query(&format!(
        "INSERT INTO {side_effects} (name, pid) VALUES ($1, $2)"
    ))
    .bind(&name)
    .bind(std::process::id() as i32)
    .execute(&pool)
    .await
    .map_err(|error| (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    if let Some(pause) = pause("x-sleep-after-ms") {
        tokio::time::sleep(pause).await;
    }
    Ok((
        StatusCode::CREATED,
        format!(r#"{{"mutation":"{name}","pid":{}}}"#, std::process::id()),
    ))
}

async fn label_outcome(mut response: Response) -> Response {
    let label = response
        .extensions()
        .get::<Outcome>()
        .map_or_else(|| "passed-through".to_owned(), Outcome::to_string);
    if let Ok(value) = HeaderValue::from_str(&label) {
        response
            .headers_mut()
            .insert("x-idempotency-outcome", value);
    }
    response
}
