//! One transactional path for handlers: the same axum handler, taking a `Tx<T>`
//! extractor, writes an order and commits it with its answer on every kind of
//! `Transactions` — the typed PostgreSQL, MariaDB and SQLite stores (two commits), the
//! one-commit store on typed pools (`PgPool`, `MySqlPool`, `SqlitePool`) and over sqlx
//! `Any` (SQLite and PostgreSQL), and a pool whose database does not hold the records.
//! Each time: a keyed write commits with its answer and its retry is replayed, a write
//! without a key commits on its own, and a handler that does not commit leaves nothing;
//! the handler looks from another connection for a committed in-flight record, which a
//! one-commit store never has (the reservation rides in the handler's transaction).
//! With authentication in front of the layer, two tenants that send one key each get
//! their own write and answer.
#![cfg(all(
    feature = "axum",
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite"
))]

mod common;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::{FullStore, IdempotencyLayer, Outcome};
use idempotency_store_sql::{
    MySqlStore, OneCommitStore, PoolSettings, PostgresStore, RecordDatabase, Reservations,
    SqliteStore, TableName, Transactions, Tx, TxError, Writes,
};
use sqlx::{AnyPool, Database, Executor, IntoArguments, Pool};
use tower::ServiceExt;

fn postgres_url() -> String {
    std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn mysql_url() -> String {
    std::env::var("IDEMPOTENCY_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A pool of the test's own on `url`, and a fresh `orders` table in it; `None` (skip)
/// when the server is unreachable outside CI.
async fn observer(url: &str, env: &str) -> Option<(AnyPool, String)> {
    sqlx::any::install_default_drivers();
    let pool = match AnyPool::connect(url).await {
        Ok(pool) => pool,
        Err(error) => return common::unreachable(url, url, env, error),
    };
    let orders = format!("{}_orders", common::unique_table());
    sqlx::query(&format!(
        "CREATE TABLE {orders} (item VARCHAR(64) NOT NULL)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    Some((pool, orders))
}

/// Where the handler looks for committed in-flight records before it commits: the test's
/// own pool and the records table.
#[derive(Clone)]
struct Records(AnyPool, String);

/// `POST /orders` writes an order and commits it with its answer, saying in
/// `x-in-flight-committed` how many in-flight records another connection saw before its
/// commit (with `records`); `POST /abandoned` writes one and answers 503 without
/// committing.
fn app<T>(
    transactions: T,
    layer: IdempotencyLayer,
    orders: &str,
    records: Option<Records>,
) -> Router
where
    T: Transactions,
    for<'c> &'c mut <T::Database as Database>::Connection: Executor<'c, Database = T::Database>,
    for<'q> <T::Database as Database>::Arguments<'q>: IntoArguments<'q, T::Database>,
{
    let insert = format!("INSERT INTO {orders} (item) VALUES ('book')");
    let abandoned = insert.clone();
    Router::new()
        .route(
            "/orders",
            post(move |mut tx: Tx<T>| {
                let (insert, records) = (insert.clone(), records.clone());
                async move {
                    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
                    let mut answer = (StatusCode::CREATED, "order placed").into_response();
                    if let Some(Records(observer, table)) = &records {
                        let seen: i64 = sqlx::query_scalar(&format!(
                            "SELECT COUNT(*) FROM {table} WHERE response_status IS NULL"
                        ))
                        .fetch_one(observer)
                        .await
                        .unwrap();
                        answer
                            .headers_mut()
                            .insert("x-in-flight-committed", seen.into());
                    }
                    let mut sent = tx
                        .commit(answer)
                        .await
                        .unwrap_or_else(TxError::into_response);
                    // Too late for the record: an answer recorded in the transaction is sent
                    // as it was recorded.
                    sent.headers_mut()
                        .insert("x-after-commit", "1".parse().unwrap());
                    sent
                }
            }),
        )
        .route(
            "/abandoned",
            post(move |mut tx: Tx<T>| async move {
                sqlx::query(&abandoned).execute(&mut *tx).await.unwrap();
                drop(tx);
                StatusCode::SERVICE_UNAVAILABLE.into_response()
            }),
        )
        .with_state(transactions)
        .layer(layer)
}

/// How many commits a keyed first execution takes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Commits {
    /// The reservation's, then the handler's with the answer.
    Two,
    /// The handler's, holding the reservation, the write and the answer.
    One,
    /// The records are in another database: not observed.
    Elsewhere,
}

async fn send(
    app: &Router,
    path: &str,
    key: Option<&str>,
) -> (StatusCode, bool, Option<Outcome>, String, bool, Option<i64>) {
    let mut request = Request::post(path);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let outcome = response.extensions().get::<Outcome>().copied();
    let after_commit = response.headers().contains_key("x-after-commit");
    let in_flight_committed = response
        .headers()
        .get("x-in-flight-committed")
        .map(|seen| seen.to_str().unwrap().parse().unwrap());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    (
        status,
        replayed,
        outcome,
        body,
        after_commit,
        in_flight_committed,
    )
}

async fn orders(observer: &AnyPool, orders: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {orders}"))
        .fetch_one(observer)
        .await
        .unwrap()
}

/// The checks every kind of `Transactions` passes; with the records elsewhere, the
/// answer is recorded by the layer after the handler (else in the handler's transaction).
async fn one_path(app: Router, observer: &AnyPool, table: &str, commits: Commits) {
    let key = uuid::Uuid::new_v4().to_string();
    let first = send(&app, "/orders", Some(&key)).await;
    assert_eq!(first.0, StatusCode::CREATED, "{}", first.3);
    assert_eq!(first.2, Some(Outcome::Executed));
    assert_eq!(
        first.4,
        commits == Commits::Elsewhere,
        "an answer recorded in the transaction is sent as recorded"
    );
    let expected_in_flight = match commits {
        Commits::Two => Some(1),
        Commits::One => Some(0),
        Commits::Elsewhere => None,
    };
    assert_eq!(
        first.5, expected_in_flight,
        "committed in-flight records seen before the handler's commit ({commits:?} commits)"
    );
    assert_eq!(orders(observer, table).await, 1);

    let retry = send(&app, "/orders", Some(&key)).await;
    assert_eq!(
        (retry.0, retry.1),
        (StatusCode::CREATED, true),
        "{}",
        retry.3
    );
    assert_eq!(retry.3, "order placed");
    assert_eq!(orders(observer, table).await, 1, "the retry ran nothing");

    let unkeyed = send(&app, "/orders", None).await;
    assert_eq!(unkeyed.0, StatusCode::CREATED);
    assert_eq!(orders(observer, table).await, 2);

    let abandoned_key = uuid::Uuid::new_v4().to_string();
    for _ in 0..2 {
        let abandoned = send(&app, "/abandoned", Some(&abandoned_key)).await;
        assert_eq!(abandoned.0, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!abandoned.1, "a 5xx releases the key: the retry runs again");
    }
    assert_eq!(orders(observer, table).await, 2, "nothing of it committed");
    let _ = sqlx::query(&format!("DROP TABLE {table}"))
        .execute(observer)
        .await;
}

async fn postgres_store(table: &str) -> PostgresStore {
    PostgresStore::connect(&postgres_url(), &PoolSettings::default())
        .await
        .unwrap()
        .with_table_name(table)
        .unwrap()
        .migrate()
        .await
        .unwrap()
}

async fn mariadb_store(table: &str) -> MySqlStore {
    MySqlStore::connect(&mysql_url(), &PoolSettings::default())
        .await
        .unwrap()
        .with_table_name(table)
        .unwrap()
        .migrate()
        .await
        .unwrap()
}

async fn sqlite_store(url: &str, table: &str) -> SqliteStore {
    SqliteStore::connect(url, &PoolSettings::default())
        .await
        .unwrap()
        .with_table_name(table)
        .unwrap()
        .migrate()
        .await
        .unwrap()
}

/// `one_path` on `store`'s transactions behind the layer on `store`, the handler looking
/// for committed in-flight records in `records`.
async fn checked<DB: RecordDatabase>(
    store: Arc<OneCommitStore<DB>>,
    observer: &AnyPool,
    table: &str,
    records: String,
    commits: Commits,
) where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let layer = IdempotencyLayer::from_shared_store(store.clone());
    let peek = Records(observer.clone(), records);
    let app = app(Writes::with_records(store), layer, table, Some(peek));
    one_path(app, observer, table, commits).await;
}

/// A one-commit store on `pool`, its committed records kept by `typed` in `records`.
async fn one_commit_store<DB: RecordDatabase>(
    typed: Arc<dyn FullStore>,
    pool: Pool<DB>,
    records: &str,
) -> Arc<OneCommitStore<DB>> {
    let table = TableName::new(records).unwrap();
    Arc::new(OneCommitStore::new(typed, pool, &table).await.unwrap())
}

/// The store with leased reservations (`Reservations::Leased`): the reservation commits
/// on its own, the handler's `Tx` commits the write with the answer (two commits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_reservations_on_a_pg_pool() {
    let Some((observer, table)) = observer(&postgres_url(), "IDEMPOTENCY_TEST_POSTGRES_URL").await
    else {
        return;
    };
    let records = common::unique_table();
    let typed = postgres_store(&records).await;
    let pool: sqlx::PgPool = typed.pool().clone();
    let store = leased(one_commit_store(Arc::new(typed), pool, &records).await);
    checked(store, &observer, &table, records, Commits::Two).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_reservations_on_a_mysql_pool() {
    let Some((observer, table)) = observer(&mysql_url(), "IDEMPOTENCY_TEST_MYSQL_URL").await else {
        return;
    };
    let records = common::unique_table();
    let typed = mariadb_store(&records).await;
    let pool: sqlx::MySqlPool = typed.pool().clone();
    let store = leased(one_commit_store(Arc::new(typed), pool, &records).await);
    checked(store, &observer, &table, records, Commits::Two).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_reservations_on_a_sqlite_pool() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/orders.db?mode=rwc", dir.path().display());
    let (observer, table) = observer(&url, "-").await.unwrap();
    let records = common::unique_table();
    let typed = sqlite_store(&url, &records).await;
    let pool: sqlx::SqlitePool = typed.pool().clone();
    let store = leased(one_commit_store(Arc::new(typed), pool, &records).await);
    checked(store, &observer, &table, records, Commits::Two).await;
}

fn leased<DB: RecordDatabase>(store: Arc<OneCommitStore<DB>>) -> Arc<OneCommitStore<DB>> {
    let store = Arc::into_inner(store).expect("not shared yet");
    Arc::new(store.with_reservations(Reservations::Leased))
}

/// The one-commit store on a typed pool: the typed store's own (`PgPool`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_a_pg_pool() {
    let Some((observer, table)) = observer(&postgres_url(), "IDEMPOTENCY_TEST_POSTGRES_URL").await
    else {
        return;
    };
    let records = common::unique_table();
    let typed = postgres_store(&records).await;
    let pool: sqlx::PgPool = typed.pool().clone();
    let store = one_commit_store(Arc::new(typed), pool, &records).await;
    checked(store, &observer, &table, records, Commits::One).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_a_mysql_pool() {
    let Some((observer, table)) = observer(&mysql_url(), "IDEMPOTENCY_TEST_MYSQL_URL").await else {
        return;
    };
    let records = common::unique_table();
    let typed = mariadb_store(&records).await;
    let pool: sqlx::MySqlPool = typed.pool().clone();
    let store = one_commit_store(Arc::new(typed), pool, &records).await;
    checked(store, &observer, &table, records, Commits::One).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_a_sqlite_pool() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/orders.db?mode=rwc", dir.path().display());
    let (observer, table) = observer(&url, "-").await.unwrap();
    let records = common::unique_table();
    let typed = sqlite_store(&url, &records).await;
    let pool: sqlx::SqlitePool = typed.pool().clone();
    let store = one_commit_store(Arc::new(typed), pool, &records).await;
    checked(store, &observer, &table, records, Commits::One).await;
}

/// The one-commit store over sqlx `Any`, on `url`.
async fn one_commit_on_any(url: &str, env: &str) {
    let Some((observer, table)) = observer(url, env).await else {
        return;
    };
    let records = common::unique_table();
    let typed: Arc<dyn FullStore> = match url.split(':').next() {
        Some("postgres") => Arc::new(postgres_store(&records).await),
        _ => Arc::new(sqlite_store(url, &records).await),
    };
    let pool = sqlx::any::AnyPoolOptions::new()
        .max_connections(8)
        .connect(url)
        .await
        .unwrap();
    let store = one_commit_store(typed, pool, &records).await;
    checked(store, &observer, &table, records, Commits::One).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_an_any_pool_on_postgres() {
    one_commit_on_any(&postgres_url(), "IDEMPOTENCY_TEST_POSTGRES_URL").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_an_any_pool_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    one_commit_on_any(
        &format!("sqlite://{}/orders.db?mode=rwc", dir.path().display()),
        "-",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_database_does_not_hold_the_records() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/orders.db?mode=rwc", dir.path().display());
    let (observer, table) = observer(&url, "-").await.unwrap();
    let records_url = format!("sqlite://{}/records.db?mode=rwc", dir.path().display());
    let records = SqliteStore::connect(&records_url, &PoolSettings::default())
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let elsewhere = Writes::records_elsewhere(observer.clone());
    let app = app(elsewhere, IdempotencyLayer::new(records), &table, None);
    one_path(app, &observer, &table, Commits::Elsewhere).await;
}

/// Who is calling, as the authentication in front of the layer found out.
#[derive(Clone)]
struct Tenant(String);

/// The README's order of layers with authentication in front: two tenants who send the
/// same key each get their own write and answer, and each retry is replayed its own —
/// with leased reservations (two commits) and uncommitted ones (one), on a `SqlitePool`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_with_one_key_each_get_their_own_answer() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/orders.db?mode=rwc", dir.path().display());
    let records = common::unique_table();
    let typed = sqlite_store(&url, &records).await;
    let pool: sqlx::SqlitePool = typed.pool().clone();
    let store = leased(one_commit_store(Arc::new(typed), pool, &records).await);
    two_tenants(
        Writes::with_records(store.clone()),
        IdempotencyLayer::from_shared_store(store),
        &url,
    )
    .await;

    let records = common::unique_table();
    let typed = sqlite_store(&url, &records).await;
    let pool: sqlx::SqlitePool = typed.pool().clone();
    let store = one_commit_store(Arc::new(typed), pool, &records).await;
    two_tenants(
        Writes::with_records(store.clone()),
        IdempotencyLayer::from_shared_store(store),
        &url,
    )
    .await;
}

async fn two_tenants<T>(transactions: T, layer: IdempotencyLayer, url: &str)
where
    T: Transactions,
    for<'c> &'c mut <T::Database as Database>::Connection: Executor<'c, Database = T::Database>,
    for<'q> <T::Database as Database>::Arguments<'q>: IntoArguments<'q, T::Database>,
{
    use axum::extract::{Extension, Request};
    use axum::middleware::{self, Next};
    use idempotency_core::ExtensionScope;

    let (observer, table) = observer(url, "-").await.unwrap();
    let insert = format!("INSERT INTO {table} (item) VALUES ('book')");
    let authenticate = |mut request: Request, next: Next| async move {
        let tenant = request
            .headers()
            .get("authorization")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        match tenant {
            Some(tenant) => {
                request.extensions_mut().insert(Tenant(tenant));
                next.run(request).await
            }
            None => StatusCode::UNAUTHORIZED.into_response(),
        }
    };
    let app = Router::new()
        .route(
            "/orders",
            post(move |Extension(tenant): Extension<Tenant>, mut tx: Tx<T>| {
                let insert = insert.clone();
                async move {
                    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
                    let answer =
                        (StatusCode::CREATED, format!("order of {}", tenant.0)).into_response();
                    tx.commit(answer)
                        .await
                        .unwrap_or_else(TxError::into_response)
                }
            }),
        )
        .with_state(transactions)
        .layer(layer.with_scope(ExtensionScope::new(|tenant: &Tenant| tenant.0.clone())))
        .layer(middleware::from_fn(authenticate));
    let send = |tenant: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/orders")
                .header("authorization", tenant)
                .header("idempotency-key", "shared-key")
                .body(Body::empty())
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (String::from_utf8_lossy(&body).into_owned(), replayed)
        }
    };
    assert_eq!(send("alice").await, ("order of alice".to_owned(), false));
    assert_eq!(send("bob").await, ("order of bob".to_owned(), false));
    assert_eq!(
        orders(&observer, &table).await,
        2,
        "each tenant's write ran"
    );
    assert_eq!(send("alice").await, ("order of alice".to_owned(), true));
    assert_eq!(send("bob").await, ("order of bob".to_owned(), true));
    assert_eq!(orders(&observer, &table).await, 2);
}
