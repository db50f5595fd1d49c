//! A small server for crash and outage tests: `POST /mutations/{name}` inserts one row
//! into a `side_effects` table of the database that holds the idempotency records, and
//! finalizes the request's key **in the same transaction** (`finalize_in`), so that the
//! row and the record commit together or not at all. A test counts the rows to see how
//! often a mutation really ran, across processes and crashes.
//!
//! ```text
//! cargo run -p examples --bin mutation-server -- \
//!     --database postgres://postgres@127.0.0.1:5432/test --listen 127.0.0.1:8300 --lease-ms 1000
//! ```
//!
//! `--database` takes `postgres://…`, `mysql://…` (MySQL 8 or MariaDB) or `sqlite:FILE`.
//! `--commits one` reserves each key in the transaction the side effect is written in
//! (`OneCommitStore`): the record, the side effect and the answer commit once; the
//! default, `--commits two`, reserves it in a commit of its own first (a typed store).
//!
//! Request headers steer the handler, so that a test can kill the process at a chosen
//! instant:
//!
//! - `x-sleep-before-ms`: wait before the transaction begins (a kill lands before the
//!   side effect);
//! - `x-sleep-in-transaction-ms`: wait after the row and the record are written, before
//!   the commit (a kill rolls both back);
//! - `x-sleep-after-ms`: wait after the commit, before answering (a kill lands between
//!   the side effect and the answer; the record is already final);
//! - `x-finalize-by-layer: true`: do not finalize in the transaction, and leave it to
//!   the layer after the answer, as a handler whose side effect lives elsewhere must (a
//!   kill during `x-sleep-after-ms` then lands between the side effect and the
//!   finalize).
//!
//! Every response carries `x-idempotency-outcome` with what the layer did.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use idempotency_core::{FullStore, IdempotencyLayer, Outcome, ReservationHandle};
use idempotency_store_sql::sqlx;
use idempotency_store_sql::{
    FinalizeError, MySqlStore, OneCommitStore, PoolSettings, PostgresStore, SqliteStore, TableName,
};

struct Flags {
    database: String,
    listen: String,
    lease: Duration,
    table: String,
    one_commit: bool,
}

fn parse_flags() -> Result<Flags, String> {
    let mut flags = Flags {
        database: "postgres://postgres@127.0.0.1:5432/test".to_owned(),
        listen: "127.0.0.1:8300".to_owned(),
        lease: Duration::from_secs(20),
        table: "idempotency_records".to_owned(),
        one_commit: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--database" => flags.database = value,
            "--listen" => flags.listen = value,
            "--table" => flags.table = value,
            "--commits" => {
                flags.one_commit = match value.as_str() {
                    "one" => true,
                    "two" => false,
                    _ => return Err(format!("--commits takes one or two, not {value:?}")),
                };
            }
            "--lease-ms" => {
                flags.lease = Duration::from_millis(
                    value
                        .parse()
                        .map_err(|_| format!("--lease-ms takes milliseconds, not {value:?}"))?,
                );
            }
            other => {
                return Err(format!(
                    "unknown flag {other}; use --database URL, --listen ADDR, --table NAME, --lease-ms N, --commits one|two"
                ));
            }
        }
    }
    Ok(flags)
}

/// The store, typed by database: each has its own connection type for `finalize_in`.
#[derive(Clone)]
enum Database {
    Postgres(PostgresStore),
    MySql(MySqlStore),
    Sqlite(SqliteStore),
}

impl Database {
    async fn open(url: &str, table: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let settings = PoolSettings::default();
        Ok(if url.starts_with("postgres") {
            let store = PostgresStore::connect(url, &settings).await?;
            Self::Postgres(store.with_table_name(table)?.migrate().await?)
        } else if url.starts_with("mysql") || url.starts_with("mariadb") {
            let store = MySqlStore::connect(url, &settings).await?;
            Self::MySql(store.with_table_name(table)?.migrate().await?)
        } else if url.starts_with("sqlite") {
            let store = SqliteStore::connect(url, &settings).await?;
            Self::Sqlite(store.with_table_name(table)?.migrate().await?)
        } else {
            return Err(format!(
                "unsupported --database {url:?}: use postgres://…, mysql://… or sqlite:FILE"
            )
            .into());
        })
    }

    /// A one-commit store over this typed store, reserving on a pool of its own.
    async fn one_commit(
        &self,
        url: &str,
        table: &str,
    ) -> Result<OneCommitStore, Box<dyn std::error::Error>> {
        sqlx::any::install_default_drivers();
        let pool = sqlx::AnyPool::connect(url).await?;
        let records: Arc<dyn FullStore> = match self {
            Self::Postgres(store) => Arc::new(store.clone()),
            Self::MySql(store) => Arc::new(store.clone()),
            Self::Sqlite(store) => Arc::new(store.clone()),
        };
        Ok(OneCommitStore::new(records, pool, &TableName::new(table)?).await?)
    }

    fn layer(&self) -> IdempotencyLayer {
        match self {
            Self::Postgres(store) => IdempotencyLayer::new(store.clone()),
            Self::MySql(store) => IdempotencyLayer::new(store.clone()),
            Self::Sqlite(store) => IdempotencyLayer::new(store.clone()),
        }
    }

    /// The side effects table, created if missing (several processes may start at once:
    /// a concurrent creator may win the race on PostgreSQL's catalog, and the retry then
    /// finds the table).
    async fn create_side_effects(&self, table: &str) -> Result<(), sqlx::Error> {
        let statement = format!(
            "CREATE TABLE IF NOT EXISTS {table} (name TEXT NOT NULL, pid INTEGER NOT NULL)"
        );
        if self.execute(&statement).await.is_err() {
            self.execute(&statement).await?;
        }
        Ok(())
    }

    async fn execute(&self, statement: &str) -> Result<(), sqlx::Error> {
        match self {
            Self::Postgres(store) => sqlx::query(statement).execute(store.pool()).await.map(drop),
            Self::MySql(store) => sqlx::query(statement).execute(store.pool()).await.map(drop),
            Self::Sqlite(store) => sqlx::query(statement).execute(store.pool()).await.map(drop),
        }
    }
}

#[derive(Clone)]
struct App {
    database: Database,
    /// With `--commits one`: the store whose reservations the side effect is written in.
    one_commit: Option<Arc<OneCommitStore>>,
    side_effects: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let flags = parse_flags()?;
    let database = Database::open(&flags.database, &flags.table).await?;
    let side_effects = format!("{}_side_effects", flags.table);
    database.create_side_effects(&side_effects).await?;
    let one_commit = match flags.one_commit {
        true => Some(Arc::new(
            database.one_commit(&flags.database, &flags.table).await?,
        )),
        false => None,
    };
    let layer = match &one_commit {
        Some(store) => IdempotencyLayer::from_shared_store(store.clone()),
        None => database.layer(),
    }
    .with_lease(flags.lease);
    let in_flight = layer.in_flight();
    let app = Router::new()
        .route("/mutations/{name}", post(mutate))
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::new(App {
            database,
            one_commit,
            side_effects,
        }))
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

/// Why a mutation failed: a 5xx, so the layer releases the key and a retry runs again.
struct Failed(String);

impl From<sqlx::Error> for Failed {
    fn from(error: sqlx::Error) -> Self {
        Self(format!("database error: {error}"))
    }
}

impl From<FinalizeError> for Failed {
    fn from(error: FinalizeError) -> Self {
        Self(error.to_string())
    }
}

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        (StatusCode::SERVICE_UNAVAILABLE, self.0).into_response()
    }
}

async fn mutate(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    reservation: Option<Extension<ReservationHandle>>,
) -> Result<Response, Failed> {
    let pause = |header: &str| {
        let pause = headers
            .get(header)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map_or(Duration::ZERO, Duration::from_millis);
        tokio::time::sleep(pause)
    };
    pause("x-sleep-before-ms").await;
    let pid = std::process::id() as i32;
    let answer = (
        StatusCode::CREATED,
        format!(r#"{{"mutation":"{name}","pid":{pid}}}"#),
    )
        .into_response();
    let reservation = match headers.get("x-finalize-by-layer") {
        Some(value) if value == "true" => None,
        _ => reservation.as_deref(),
    };
    let table = &app.side_effects;
    // The side effect and the record, in one transaction. (Dropping a transaction
    // without committing rolls it back.)
    if let Some(store) = &app.one_commit {
        // The transaction the key was reserved in: one commit for all three.
        let mut tx = store
            .begin(reservation)
            .await
            .map_err(|e| Failed(e.to_string()))?;
        let placeholders = match &app.database {
            Database::Postgres(_) => "($1, $2)",
            Database::MySql(_) | Database::Sqlite(_) => "(?, ?)",
        };
        sqlx::query(&format!(
            "INSERT INTO {table} (name, pid) VALUES {placeholders}"
        ))
        .bind(&name)
        .bind(pid)
        .execute(&mut **tx)
        .await?;
        let answer = store.finalize_in(&mut tx, reservation, answer).await?;
        pause("x-sleep-in-transaction-ms").await;
        // A lost COMMIT answer needs no more than a 5xx here: the record is in the same
        // database, and the layer's release leaves it alone if it committed.
        tx.commit().await.map_err(|e| Failed(e.to_string()))?;
        pause("x-sleep-after-ms").await;
        return Ok(answer);
    }
    let answer = match &app.database {
        Database::Postgres(store) => {
            let mut tx = store.pool().begin().await?;
            sqlx::query(&format!("INSERT INTO {table} (name, pid) VALUES ($1, $2)"))
                .bind(&name)
                .bind(pid)
                .execute(&mut *tx)
                .await?;
            let answer = store.finalize_in(&mut tx, reservation, answer).await?;
            pause("x-sleep-in-transaction-ms").await;
            tx.commit().await?;
            answer
        }
        Database::MySql(store) => {
            let mut tx = store.pool().begin().await?;
            sqlx::query(&format!("INSERT INTO {table} (name, pid) VALUES (?, ?)"))
                .bind(&name)
                .bind(pid)
                .execute(&mut *tx)
                .await?;
            let answer = store.finalize_in(&mut tx, reservation, answer).await?;
            pause("x-sleep-in-transaction-ms").await;
            tx.commit().await?;
            answer
        }
        Database::Sqlite(store) => {
            let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await?;
            sqlx::query(&format!("INSERT INTO {table} (name, pid) VALUES (?, ?)"))
                .bind(&name)
                .bind(pid)
                .execute(&mut *tx)
                .await?;
            let answer = store.finalize_in(&mut tx, reservation, answer).await?;
            pause("x-sleep-in-transaction-ms").await;
            tx.commit().await?;
            answer
        }
    };
    pause("x-sleep-after-ms").await;
    Ok(answer)
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
