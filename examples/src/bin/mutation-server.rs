//! A small server for crash and outage tests: `POST /mutations/{name}` inserts one row
//! into a `side_effects` table of the database that holds the idempotency records, in a
//! `Tx` that records the request's answer **in the same transaction**, so that the row
//! and the record commit together or not at all. A test counts the rows to see how often
//! a mutation really ran, across processes and crashes. One handler, written once, runs
//! on every database and both ways of committing: it is what a service's handler looks
//! like on the one transactional path.
//!
//! ```text
//! cargo run -p examples --bin mutation-server -- \
//!     --database postgres://postgres@127.0.0.1:5432/test --listen 127.0.0.1:8300 --lease-ms 1000
//! ```
//!
//! `--database` takes `postgres://…`, `mysql://…` (MySQL 8 or MariaDB) or `sqlite:FILE`.
//! `--commits one` reserves each key in the transaction the side effect is written in
//! (`OneCommitStore` on the typed store's own pool: `PgPool`, `MySqlPool` or
//! `SqlitePool`): the record, the side effect and the answer commit once; the default,
//! `--commits two`, reserves it in a commit of its own first (`Reservations::Leased`).
//!
//! Request headers steer the handler, so that a test can kill the process at a chosen
//! instant:
//!
//! - `x-sleep-before-ms`: wait before the transaction begins (a kill lands before the
//!   side effect);
//! - `x-sleep-in-transaction-ms`: wait after the row is written, before the commit that
//!   writes the record with it (a kill rolls both back);
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

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idempotency_core::{IdempotencyLayer, Outcome, ReservationHandle};
use idempotency_store_sql::sqlx::{self, Database as _, Executor, IntoArguments};
use idempotency_store_sql::{
    LazyTx, MySqlStore, OneCommitStore, PoolSettings, PostgresStore, RecordDatabase, Reservations,
    SqliteStore, TableName, Transactions, Writes,
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

/// The typed store the records are in, by database.
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

/// What the handler needs: where its transactions come from, and the side effects table.
struct App<T> {
    transactions: T,
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
    let table = TableName::new(&flags.table)?;
    // The store on the typed store's own pool, the typed store keeping what is committed:
    // one commit per keyed write, or (without `--one-commit`) a committed leased
    // reservation first.
    let reservations = if flags.one_commit {
        Reservations::Uncommitted
    } else {
        Reservations::Leased
    };
    macro_rules! store {
        ($store:expr) => {{
            let pool = $store.pool().clone();
            Arc::new(
                OneCommitStore::new(Arc::new($store), pool, &table)
                    .await?
                    .with_reservations(reservations),
            )
        }};
    }
    match database {
        Database::Postgres(store) => serve(store!(store), &flags, side_effects).await,
        Database::MySql(store) => serve(store!(store), &flags, side_effects).await,
        Database::Sqlite(store) => serve(store!(store), &flags, side_effects).await,
    }
}

/// Serves `POST /mutations/{name}` behind the layer on `store`, its handler writing
/// through `Tx`, until Ctrl-C, and waits for the requests in flight.
async fn serve<DB>(
    store: Arc<OneCommitStore<DB>>,
    flags: &Flags,
    side_effects: String,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB: RecordDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i32: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let layer = IdempotencyLayer::from_shared_store(store.clone()).with_lease(flags.lease);
    let in_flight = layer.in_flight();
    let app = Router::new()
        .route("/mutations/{name}", post(mutate::<Writes<DB>>))
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::new(App {
            transactions: Writes::with_records(store),
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

/// A mutation failed: a 5xx (the layer releases the key and a retry runs again), or,
/// when whether it committed is unknown, the answer `TxError::into_response` makes of it.
fn failed(error: impl std::fmt::Display) -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response()
}

async fn mutate<T>(
    State(app): State<Arc<App<T>>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    reservation: Option<axum::Extension<ReservationHandle>>,
) -> Response
where
    T: Transactions,
    for<'c> &'c mut <T::Database as sqlx::Database>::Connection:
        Executor<'c, Database = T::Database>,
    for<'q> <T::Database as sqlx::Database>::Arguments<'q>: IntoArguments<'q, T::Database>,
    for<'q> String: sqlx::Encode<'q, T::Database> + sqlx::Type<T::Database>,
    for<'q> i32: sqlx::Encode<'q, T::Database> + sqlx::Type<T::Database>,
{
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
    // A handler whose side effect lives elsewhere leaves the record to the layer: its
    // transaction is a request's without a key.
    let reservation = match headers.get("x-finalize-by-layer") {
        Some(value) if value == "true" => None,
        _ => reservation.map(|axum::Extension(reservation)| reservation),
    };
    let mut tx = match LazyTx::new(app.transactions.clone(), reservation)
        .begin()
        .await
    {
        Ok(tx) => tx,
        Err(error) => return failed(error),
    };
    let placeholders = match T::Database::NAME {
        "PostgreSQL" => "($1, $2)",
        _ => "(?, ?)",
    };
    let insert = format!(
        "INSERT INTO {} (name, pid) VALUES {placeholders}",
        app.side_effects
    );
    if let Err(error) = sqlx::query(&insert)
        .bind(name)
        .bind(pid)
        .execute(&mut *tx)
        .await
    {
        return failed(error);
    }
    pause("x-sleep-in-transaction-ms").await;
    // The side effect, the record and the answer, committed together (a dropped `Tx`
    // rolls back). A lost COMMIT answer needs no more than the 5xx `TxError` makes of
    // it: the record is in the same database, and the layer's release leaves a
    // committed one alone.
    let answer = match tx.commit(answer).await {
        Ok(answer) => answer,
        Err(error) => return error.into_response(),
    };
    pause("x-sleep-after-ms").await;
    answer
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
