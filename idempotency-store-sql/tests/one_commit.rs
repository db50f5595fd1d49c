//! `OneCommitStore` behind the layer, on PostgreSQL, MariaDB and SQLite, each on its typed
//! pool (`PgPool`, `MySqlPool`, `SqlitePool`: the modules named after the database) and on
//! sqlx `Any` (`…_any`), the handler writing through `Tx`: a handler that
//! writes its side effect in the reservation's transaction commits the record, the side
//! effect and the answer once — nothing of the record is visible while it runs — and
//! every rule of the two-commit path holds: retries replay, a duplicate in flight waits
//! and replays, a reused key gets 422, a 5xx leaves nothing, and a handler that rolls its
//! transaction back still has its answer kept.
#![cfg(all(
    feature = "any",
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite"
))]

mod common;
#[path = "../../test-support/innodb.rs"]
mod innodb;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Extension;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;
use idempotency_core::conformance::Leftovers;
use idempotency_core::{
    Binding, EvictInFlight, Eviction, FullStore, IdempotencyLayer, IdempotencyStore, Outcome,
    OutcomeUnknown, Ownership, RecordAdmin, RecordId, RejectionKind, Reservation,
    ReservationHandle, ScopeQuota, Waited,
};
use idempotency_store_sql::{
    OneCommitStore, PoolSettings, RecordDatabase, Reservations, TableName, Transactions, Tx,
    TxError, Writes,
};
use sqlx::{AnyPool, Executor, IntoArguments};
use tower::ServiceExt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Postgres,
    MariaDb,
    Sqlite,
}

/// One database for a test: the one-commit store on a fresh table, a pool of the test's
/// own, and the side effects table.
struct Database<DB: RecordDatabase> {
    backend: Backend,
    store: Arc<OneCommitStore<DB>>,
    /// The test's own, to look from outside.
    pool: AnyPool,
    table: String,
    /// What the handlers' pool holds, seen from outside.
    leftovers: Arc<HandlerPool<DB>>,
    _dir: tempfile::TempDir,
}

/// The handlers' pool, as a [`Leftovers`] probe: its connections checked out of the pool,
/// and those with a transaction open in the database.
struct HandlerPool<DB: RecordDatabase> {
    pool: sqlx::Pool<DB>,
    observer: AnyPool,
    backend: Backend,
    /// PostgreSQL: the pool's connections' application name.
    marker: String,
    /// MariaDB: the pool's connections' ids.
    connection_ids: Arc<std::sync::Mutex<Vec<i64>>>,
}

#[idempotency_core::async_trait]
impl<DB: RecordDatabase> Leftovers for HandlerPool<DB> {
    async fn held(&self) -> Vec<String> {
        let mut held = Vec::new();
        let in_use = self.pool.size() as usize - self.pool.num_idle();
        if in_use > 0 {
            held.push(format!(
                "{in_use} of the handlers' pooled connections in use"
            ));
        }
        let open = match self.backend {
            Backend::Postgres => sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                     WHERE application_name = $1 AND xact_start IS NOT NULL",
            )
            .bind(&self.marker)
            .fetch_one(&self.observer)
            .await
            .unwrap(),
            Backend::MariaDb => {
                let ids = self.connection_ids.lock().unwrap().clone();
                if ids.is_empty() {
                    0
                } else {
                    let status = sqlx::query(innodb::STATUS)
                        .fetch_one(&self.observer)
                        .await
                        .unwrap();
                    innodb::active_transactions(&sqlx::Row::get::<String, _>(&status, 2), &ids)
                        as i64
                }
            }
            Backend::Sqlite => 0,
        };
        if open > 0 {
            held.push(format!(
                "{open} of the handlers' connections in an open transaction"
            ));
        }
        held
    }
}

impl<DB: RecordDatabase> Database<DB> {
    async fn open(backend: Backend) -> Option<Self> {
        Self::open_with(backend, None, 16).await
    }

    /// With `quota` on the one-commit store, and `connections` in the handlers' pool.
    async fn open_with(
        backend: Backend,
        quota: Option<ScopeQuota>,
        connections: u32,
    ) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let (url, env) = match backend {
            Backend::Postgres => (
                std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
                "IDEMPOTENCY_TEST_POSTGRES_URL",
            ),
            Backend::MariaDb => (
                std::env::var("IDEMPOTENCY_TEST_MYSQL_URL")
                    .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned()),
                "IDEMPOTENCY_TEST_MYSQL_URL",
            ),
            Backend::Sqlite => (
                format!("sqlite://{}/one.db?mode=rwc", dir.path().display()),
                "-",
            ),
        };
        let table = common::unique_table();
        let settings = PoolSettings::default();
        let typed: Result<Arc<dyn FullStore>, _> = match backend {
            Backend::Postgres => {
                match idempotency_store_sql::PostgresStore::connect(&url, &settings).await {
                    Ok(store) => store
                        .with_table_name(&table)
                        .unwrap()
                        .migrate()
                        .await
                        .map(|s| Arc::new(s) as _),
                    Err(error) => Err(error),
                }
            }
            Backend::MariaDb => {
                match idempotency_store_sql::MySqlStore::connect(&url, &settings).await {
                    Ok(store) => store
                        .with_table_name(&table)
                        .unwrap()
                        .migrate()
                        .await
                        .map(|s| Arc::new(s) as _),
                    Err(error) => Err(error),
                }
            }
            Backend::Sqlite => {
                match idempotency_store_sql::SqliteStore::connect(&url, &settings).await {
                    Ok(store) => store
                        .with_table_name(&table)
                        .unwrap()
                        .migrate()
                        .await
                        .map(|s| Arc::new(s) as _),
                    Err(error) => Err(error),
                }
            }
        };
        let typed = match typed {
            Ok(typed) => typed,
            Err(error) => return common::unreachable(&format!("{backend:?}"), &url, env, error),
        };
        sqlx::any::install_default_drivers();
        let pool = sqlx::any::AnyPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .unwrap();
        sqlx::query(&format!(
            "CREATE TABLE {table}_side_effects (name VARCHAR(64) NOT NULL)"
        ))
        .execute(&pool)
        .await
        .unwrap();
        // The handlers' pool, of the driver under test, its connections told apart from
        // every other test's: by their application name (PostgreSQL), by their ids
        // (MariaDB).
        let marker = format!("handlers_{table}");
        let handlers_url = match backend {
            Backend::Postgres => format!("{url}?application_name={marker}"),
            Backend::MariaDb | Backend::Sqlite => url.clone(),
        };
        let connection_ids = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut options = sqlx::pool::PoolOptions::<DB>::new().max_connections(connections);
        if backend == Backend::MariaDb {
            let ids = connection_ids.clone();
            options = options.after_connect(move |connection, _| {
                let ids = ids.clone();
                Box::pin(async move {
                    let id =
                        DB::optional_number(connection, "SELECT CAST(CONNECTION_ID() AS SIGNED)")
                            .await?
                            .expect("a connection id");
                    ids.lock().unwrap().push(id);
                    Ok(())
                })
            });
        }
        let handlers = options.connect(&handlers_url).await.unwrap();
        let leftovers = Arc::new(HandlerPool {
            pool: handlers.clone(),
            observer: pool.clone(),
            backend,
            marker,
            connection_ids,
        });
        let mut store = OneCommitStore::new(typed, handlers, &TableName::new(&table).unwrap())
            .await
            .unwrap();
        if let Some(quota) = quota {
            store = store.with_scope_quota(quota);
        }
        Some(Self {
            backend,
            store: Arc::new(store),
            pool,
            table,
            leftovers,
            _dir: dir,
        })
    }

    async fn count(&self, statement: &str) -> i64 {
        sqlx::query_scalar(statement)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn side_effects(&self) -> i64 {
        self.count(&format!("SELECT COUNT(*) FROM {}_side_effects", self.table))
            .await
    }

    /// Committed records, in any state.
    async fn records(&self) -> i64 {
        let quoted = match self.backend {
            Backend::MariaDb => format!("`{}`", self.table),
            Backend::Postgres | Backend::Sqlite => format!("\"{}\"", self.table),
        };
        self.count(&format!("SELECT COUNT(*) FROM {quoted}")).await
    }

    /// Drops the test's tables, once the store let go of the transactions it still holds
    /// (reservations nobody settled), which roll back.
    async fn drop_tables(self) {
        if self.backend == Backend::Sqlite {
            return;
        }
        drop(self.store);
        for name in [self.table.clone(), format!("{}_side_effects", self.table)] {
            let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {name}"))
                .execute(&self.pool)
                .await;
        }
    }
}

struct App<DB: RecordDatabase> {
    writes: Writes<DB>,
    side_effects: String,
    /// The test's pool, to look from outside while the handler runs.
    observer: AnyPool,
    records: String,
}

impl<DB: RecordDatabase> Clone for App<DB> {
    fn clone(&self) -> Self {
        Self {
            writes: self.writes.clone(),
            side_effects: self.side_effects.clone(),
            observer: self.observer.clone(),
            records: self.records.clone(),
        }
    }
}

/// `POST /effects`: writes one side effect in the reservation's transaction and its
/// answer into the record, then commits. `x-answer: 409` answers 409 instead, having
/// written nothing and rolled the transaction back; `x-answer: 503` the same, with 503;
/// `x-sleep-ms` waits inside the transaction. The answer says how many records another
/// connection could see while the handler ran.
async fn effect<DB: RecordDatabase>(
    State(app): State<App<DB>>,
    headers: HeaderMap,
    reservation: Option<Extension<ReservationHandle>>,
) -> Response
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let mut tx = Tx::begin(&app.writes, reservation.as_deref())
        .await
        .unwrap();
    let visible: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {}", app.records))
        .fetch_one(&app.observer)
        .await
        .unwrap();
    if let Some(status) = headers.get("x-answer") {
        tx.rollback();
        let status = StatusCode::from_bytes(status.as_bytes()).unwrap();
        return (status, "refused").into_response();
    }
    sqlx::query(&format!(
        "INSERT INTO {} (name) VALUES ('effect')",
        app.side_effects
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    if let Some(ms) = headers.get("x-sleep-ms") {
        let ms: u64 = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let answer = (
        StatusCode::CREATED,
        format!(r#"{{"records_visible_while_running":{visible}}}"#),
    )
        .into_response();
    tx.commit(answer)
        .await
        .unwrap_or_else(TxError::into_response)
}

fn app<DB: RecordDatabase>(database: &Database<DB>) -> Router
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let records = match database.backend {
        Backend::MariaDb => format!("`{}`", database.table),
        Backend::Postgres | Backend::Sqlite => format!("\"{}\"", database.table),
    };
    Router::new()
        .route("/effects", post(effect::<DB>))
        .with_state(App {
            writes: Writes::with_records(database.store.clone()),
            side_effects: format!("{}_side_effects", database.table),
            observer: database.pool.clone(),
            records,
        })
        .layer(IdempotencyLayer::from_shared_store(database.store.clone()))
}

fn request(key: &str, body: &'static str) -> Request<Body> {
    Request::post("/effects")
        .header("idempotency-key", key)
        .body(Body::from(body))
        .unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, String, Option<Outcome>) {
    let response = app.clone().oneshot(request).await.unwrap();
    let outcome = response.extensions().get::<Outcome>().copied();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        String::from_utf8(body.to_vec()).unwrap(),
        outcome,
    )
}

/// Sends `key` to `owner` with a handler that takes `owner_ms`, and `after_ms` later the
/// same request to `duplicate_to`: what the duplicate got, and the owner's answer.
async fn duplicate_while_running(
    owner: &Router,
    duplicate_to: &Router,
    key: &str,
    owner_ms: u64,
    after_ms: u64,
) -> ((StatusCode, String, Option<Outcome>), String) {
    let (mut parts, body) = request(key, "a").into_parts();
    parts
        .headers
        .insert("x-sleep-ms", owner_ms.to_string().parse().unwrap());
    let first = tokio::spawn({
        let owner = owner.clone();
        async move { send(&owner, Request::from_parts(parts, body)).await }
    });
    tokio::time::sleep(Duration::from_millis(after_ms)).await;
    let duplicate = send(duplicate_to, request(key, "a")).await;
    let (_, original, _) = first.await.unwrap();
    (duplicate, original)
}

async fn one_commit_then_replays<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    let app = app(&database);
    let key = uuid::Uuid::new_v4().to_string();

    let (status, body, outcome) = send(&app, request(&key, "a")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    assert_eq!(
        body, r#"{"records_visible_while_running":0}"#,
        "the reservation is not committed on its own: nothing of it is visible while the handler runs"
    );
    assert_eq!(database.side_effects().await, 1);
    assert_eq!(database.records().await, 1);

    let (status, replayed, outcome) = send(&app, request(&key, "a")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Replayed))
    );
    assert_eq!(replayed, body);
    let (status, _, outcome) = send(&app, request(&key, "another body")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(outcome, Some(Outcome::Rejected(RejectionKind::KeyReused)));
    assert_eq!(database.side_effects().await, 1);
    database.drop_tables().await;
}

async fn a_duplicate_in_flight_waits_and_replays<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    let app = app(&database);
    let key = uuid::Uuid::new_v4().to_string();
    let ((status, duplicate, outcome), original) =
        duplicate_while_running(&app, &app, &key, 400, 100).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Replayed))
    );
    assert_eq!(duplicate, original);
    assert_eq!(database.side_effects().await, 1);
    database.drop_tables().await;
}

async fn a_5xx_leaves_nothing_and_a_rolled_back_answer_is_still_kept<DB: RecordDatabase>(
    backend: Backend,
) where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    let app = app(&database);

    let key = uuid::Uuid::new_v4().to_string();
    let mut failing = request(&key, "a");
    failing
        .headers_mut()
        .insert("x-answer", "503".parse().unwrap());
    let (status, _, outcome) = send(&app, failing).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::SERVICE_UNAVAILABLE, Some(Outcome::Released))
    );
    assert_eq!(database.records().await, 0, "a 5xx leaves no record");
    let (status, _, outcome) = send(&app, request(&key, "a")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );

    // The handler took the reservation's transaction, rolled it back and answered 409:
    // the layer keeps that answer (in commits of its own), and retries get it.
    let key = uuid::Uuid::new_v4().to_string();
    let mut refused = request(&key, "b");
    refused
        .headers_mut()
        .insert("x-answer", "409".parse().unwrap());
    let (status, _, outcome) = send(&app, refused).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CONFLICT, Some(Outcome::Executed))
    );
    let (status, body, outcome) = send(&app, request(&key, "b")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CONFLICT, Some(Outcome::Replayed))
    );
    assert_eq!(body, "refused");
    assert_eq!(database.side_effects().await, 1);
    database.drop_tables().await;
}

async fn a_request_without_a_key_writes_in_a_transaction_of_its_own<DB: RecordDatabase>(
    backend: Backend,
) where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    let app = app(&database);
    let unkeyed = Request::post("/effects").body(Body::from("a")).unwrap();
    let (status, _, outcome) = send(&app, unkeyed).await;
    assert_eq!((status, outcome), (StatusCode::CREATED, None));
    assert_eq!(database.side_effects().await, 1);
    assert_eq!(database.records().await, 0, "no key, no record");
    database.drop_tables().await;
}

/// The probe behind every "nothing held" check sees a handler's transaction while it is
/// open, polled as often as those checks poll, and stops seeing it once it ends
/// (MariaDB's `information_schema.innodb_trx`, which InnoDB caches, kept showing one
/// rolled back seconds before).
async fn the_probe_sees_a_transaction_while_it_is_open<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    for round in 0..3 {
        let mut transaction = database.leftovers.pool.begin().await.unwrap();
        sqlx::query(&format!(
            "INSERT INTO {}_side_effects (name) VALUES ('probe')",
            database.table
        ))
        .execute(&mut *transaction)
        .await
        .unwrap();
        for _ in 0..10 {
            let held = database.leftovers.held().await;
            let seen = match backend {
                Backend::Sqlite => !held.is_empty(),
                Backend::Postgres | Backend::MariaDb => {
                    held.iter().any(|line| line.contains("open transaction"))
                }
            };
            assert!(
                seen,
                "round {round}: an open transaction not seen: {held:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        transaction.rollback().await.unwrap();
        nothing_held(&database, "a transaction rolled back").await;
    }
    database.drop_tables().await;
}

/// Callers that go away while their transaction begins or commits (clients hang up) must
/// leave no connection in a transaction nobody ends: on SQLite that would hold the
/// database's write lock for good.
async fn abandoned_transactions_leave_nothing_open<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    // SQLite: another connection holds the write lock, so that BEGIN is still waiting
    // for it when its caller goes away.
    let mut holder = database.pool.acquire().await.unwrap();
    if backend == Backend::Sqlite {
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *holder)
            .await
            .unwrap();
    }
    for round in 0..20_u64 {
        let abandoned = async {
            let tx = Transactions::begin(&Writes::with_records(database.store.clone()), None)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        };
        // Cut off at every point: before, during and after BEGIN and COMMIT.
        let _ = tokio::time::timeout(Duration::from_micros(round * 500), abandoned).await;
    }
    if backend == Backend::Sqlite {
        sqlx::query("ROLLBACK").execute(&mut *holder).await.unwrap();
    }
    drop(holder);
    let fresh = tokio::time::timeout(Duration::from_secs(3), async {
        let mut tx = Transactions::begin(&Writes::with_records(database.store.clone()), None)
            .await
            .unwrap();
        sqlx::query(&format!(
            "INSERT INTO {}_side_effects (name) VALUES ('after')",
            database.table
        ))
        .execute(&mut **tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
    })
    .await;
    assert!(fresh.is_ok(), "a write after abandoned ones must not wait");
    assert_eq!(database.side_effects().await, 1);
    database.drop_tables().await;
}

/// A new key, the binding of a request for it, a lease and a lifetime, for calls to the
/// store itself.
fn a_key() -> (RecordId, Binding, Duration, Duration) {
    let lease = Duration::from_secs(30);
    (common::id(), common::binding(), lease, common::LONG)
}

/// Callers that go away while their key is being reserved (a client hangs up at once)
/// leave nothing held: no transaction, no connection, and no claim, so that the next
/// request for the key is reserved at once. (Found by the simulation, seed 800 on
/// `one_commit_sqlite`: a claim taken before the read of the key's record stayed when its
/// caller went away during the read, and the key answered "in flight" for good.)
async fn abandoned_reservations_leave_the_key_free<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    let (id, binding, lease, lifetime) = a_key();
    for round in 0..60_u64 {
        let mut reserve = std::pin::pin!(database.store.reserve(&id, &binding, lease, lifetime));
        // Cut off at every point of the reservation: right after its first poll, and later.
        let outcome = if round % 20 == 0 {
            let mut context = std::task::Context::from_waker(std::task::Waker::noop());
            match reserve.as_mut().poll(&mut context) {
                std::task::Poll::Ready(reserved) => Some(reserved),
                std::task::Poll::Pending => None,
            }
        } else {
            tokio::time::timeout(Duration::from_micros(round % 20 * 300), reserve)
                .await
                .ok()
        };
        match outcome {
            None => {}
            Some(Ok(Reservation::Reserved(token))) => {
                database.store.release(&id, token).await.unwrap();
            }
            // A reservation cut short a moment ago is still letting go of the key.
            Some(Ok(Reservation::Busy)) => {
                let waited = database.store.wait(&id, Duration::from_secs(3)).await;
                assert_eq!(waited.unwrap(), Waited::Gone, "round {round}");
            }
            Some(other) => panic!("round {round}: the key must be free, got {other:?}"),
        }
    }
    nothing_held(&database, "reservations whose callers went away").await;
    let reserved = tokio::time::timeout(
        Duration::from_secs(3),
        database.store.reserve(&id, &binding, lease, lifetime),
    )
    .await
    .expect("the reservation must not wait");
    let Ok(Reservation::Reserved(token)) = reserved else {
        panic!("after callers that went away, the key must be free: {reserved:?}");
    };
    database.store.release(&id, token).await.unwrap();
    nothing_held(&database, "the last reservation was released").await;
    database.drop_tables().await;
}

/// A duplicate's wait for a running owner ends at its timeout, not at the database's
/// next whole second (InnoDB bounds a lock wait in seconds), and says the owner runs.
async fn a_wait_for_a_running_owner_ends_at_its_timeout<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    let (id, binding, lease, lifetime) = a_key();
    let reserved = database.store.reserve(&id, &binding, lease, lifetime).await;
    let Ok(Reservation::Reserved(token)) = reserved else {
        panic!("the key is free: {reserved:?}");
    };
    for timeout in [Duration::from_millis(150), Duration::from_millis(400)] {
        let started = tokio::time::Instant::now();
        let waited = database.store.wait(&id, timeout).await.unwrap();
        let took = started.elapsed();
        assert_eq!(waited, Waited::Running(None), "the owner still runs");
        assert!(
            took >= timeout && took < timeout + Duration::from_millis(250),
            "a wait of {timeout:?} took {took:?}"
        );
    }
    assert_eq!(
        database.store.release(&id, token).await.unwrap(),
        Ownership::Held
    );
    database.drop_tables().await;
}

/// `POST /unknown`: answers 500 marked [`OutcomeUnknown`], with its transaction as
/// `x-tx` says: `untouched` (never taken), `dropped` (begun, then dropped: rolled back),
/// `committed` (begun, a side effect written and committed without the answer). `x-tx:
/// write` writes a side effect and commits it with a 201 instead.
async fn unknown<DB: RecordDatabase>(
    State(app): State<App<DB>>,
    headers: HeaderMap,
    reservation: Option<Extension<ReservationHandle>>,
) -> Response
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let mode = headers.get("x-tx").unwrap().to_str().unwrap().to_owned();
    let unknown = || {
        let mut answer =
            (StatusCode::INTERNAL_SERVER_ERROR, "commit state unknown").into_response();
        answer.extensions_mut().insert(OutcomeUnknown);
        answer
    };
    if mode == "untouched" {
        return unknown();
    }
    let mut tx = Tx::begin(&app.writes, reservation.as_deref())
        .await
        .unwrap();
    if mode == "dropped" {
        drop(tx);
        return unknown();
    }
    sqlx::query(&format!(
        "INSERT INTO {} (name) VALUES ('effect')",
        app.side_effects
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    if mode == "committed" {
        // A 500 is not kept: this commits the write alone.
        let not_kept = (StatusCode::INTERNAL_SERVER_ERROR, "").into_response();
        tx.commit(not_kept).await.unwrap();
        return unknown();
    }
    tx.commit((StatusCode::CREATED, "written").into_response())
        .await
        .unwrap_or_else(TxError::into_response)
}

/// Waits (up to 5 s) until the handlers' pool holds nothing.
async fn nothing_held<DB: RecordDatabase>(database: &Database<DB>, after: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let held = database.leftovers.held().await;
        if held.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "5 s after {after}, the handlers' pool still holds: {}",
            held.join("; ")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A handler that cannot tell whether its change took effect marks its answer
/// [`OutcomeUnknown`]: on a pool of 4 connections (room for 2 open write transactions),
/// three such requests for each way the handler leaves its transaction (never taken,
/// dropped, committed without the answer) leave no transaction open and no connection
/// checked out, later keyed writes still run, each held key answers in flight until it
/// expires, and runs again after.
async fn an_unknown_outcome_holds_its_key_until_it_expires_and_holds_nothing_else<
    DB: RecordDatabase,
>(
    backend: Backend,
) where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open_with(backend, None, 4).await else {
        return;
    };
    let lifetime = Duration::from_secs(2);
    let records = match database.backend {
        Backend::MariaDb => format!("`{}`", database.table),
        Backend::Postgres | Backend::Sqlite => format!("\"{}\"", database.table),
    };
    let app = Router::new()
        .route("/effects", post(effect::<DB>))
        .route("/unknown", post(unknown::<DB>))
        .with_state(App {
            writes: Writes::with_records(database.store.clone()),
            side_effects: format!("{}_side_effects", database.table),
            observer: database.pool.clone(),
            records,
        })
        .layer(
            IdempotencyLayer::from_shared_store(database.store.clone())
                .with_lifetime(lifetime)
                .with_grace_period(Duration::ZERO)
                .with_lease(Duration::from_millis(200))
                .with_in_flight_wait(Duration::from_millis(100)),
        );
    let unknown_request = |key: &str, mode: &'static str| {
        Request::post("/unknown")
            .header("idempotency-key", key)
            .header("x-tx", mode)
            .body(Body::from("u"))
            .unwrap()
    };
    let started = tokio::time::Instant::now();
    let mut held = Vec::new();
    for mode in ["untouched", "dropped", "committed"] {
        for round in 0..3 {
            let key = format!("unknown-{mode}-{round}-{}", uuid::Uuid::new_v4());
            let (status, _, outcome) = send(&app, unknown_request(&key, mode)).await;
            assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(
                outcome,
                Some(Outcome::Unknown),
                "{mode}: the key must be held"
            );
            nothing_held(&database, &format!("an unknown outcome ({mode})")).await;
            held.push(key);
        }
        let fresh = format!("after-{mode}-{}", uuid::Uuid::new_v4());
        let (status, body, _) = send(&app, request(&fresh, "a")).await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "a keyed write after unknown outcomes ({mode}): {body}"
        );
        nothing_held(&database, "a keyed write").await;
    }
    for key in &held {
        let (status, _, _) = send(&app, unknown_request(key, "write")).await;
        assert_eq!(
            status,
            StatusCode::CONFLICT,
            "a held key must answer in flight until it expires"
        );
    }
    assert!(
        started.elapsed() < lifetime,
        "the test took longer than the keys' lifetime ({:?}); it proves nothing",
        started.elapsed()
    );
    nothing_held(&database, "retries of held keys").await;
    tokio::time::sleep_until(started + lifetime + Duration::from_secs(3)).await;
    for key in &held {
        let (status, body, outcome) = send(&app, unknown_request(key, "write")).await;
        assert_eq!(
            (status, outcome),
            (StatusCode::CREATED, Some(Outcome::Executed)),
            "a held key must run again once it expired: {body}"
        );
    }
    nothing_held(&database, "the expired keys ran again").await;
    database.drop_tables().await;
}

/// Every check of the store contract that applies to this path, found by the suite
/// itself: its reservations are held unseen (nobody else sees them before they commit;
/// they have no lease to lapse or take over), and it has every capability.
async fn the_conformance_checks_that_apply<DB: RecordDatabase>(backend: Backend) {
    use idempotency_core::conformance::Suite;
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    let store: Arc<dyn FullStore> = database.store.clone();
    let report = Suite::full(store)
        .with_leftovers(database.leftovers.clone())
        .run()
        .await;
    assert!(
        report
            .ran
            .contains(&"a_held_key_shows_its_owners_binding_or_busy")
            && report
                .ran
                .contains(&"a_wait_sees_the_key_released_and_finished_by_another_request")
            && report
                .ran
                .contains(&"through_layer::a_waiting_retry_never_gets_another_requests_answer"),
        "{report}"
    );
    // The multi-node checks run with two replicas in this file's own tests.
    for (check, why) in &report.skipped {
        assert!(
            why.contains("held unseen") || why.contains("second handle"),
            "{check} was skipped for another reason than the reservations' kind: {why}"
        );
    }
    database.drop_tables().await;
}

/// With leased reservations (`Reservations::Leased`) the store is the typed store it is
/// built on, plus the handler's transaction: every check of the contract applies, the
/// lease-bound ones included, and nothing outlives its request.
async fn every_check_with_leased_reservations<DB: RecordDatabase>(backend: Backend) {
    use idempotency_core::conformance::Suite;
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    // Two stores on one table, as two replicas build them.
    let node = || async {
        let store = OneCommitStore::new(
            database.store.records().clone(),
            database.leftovers.pool.clone(),
            &TableName::new(&database.table).unwrap(),
        )
        .await
        .unwrap()
        .with_reservations(Reservations::Leased);
        Arc::new(store) as Arc<dyn FullStore>
    };
    let report = Suite::full(node().await)
        .with_second_node(node().await)
        .with_leftovers(database.leftovers.clone())
        .run()
        .await;
    assert!(report.skipped.is_empty(), "{report}");
    assert!(
        report.ran.contains(&"expired_reservation_fences_its_owner")
            && report.ran.contains(&"nothing_outlives_its_request"),
        "{report}"
    );
    database.drop_tables().await;
}

/// `POST /effects` on a replica that keeps its records with the typed store (two
/// commits) on the same table: its handler counts its runs and answers 201.
fn typed_replica<DB: RecordDatabase>(database: &Database<DB>, runs: Arc<AtomicUsize>) -> Router {
    let records: Arc<dyn idempotency_core::IdempotencyStore> = database.store.records().clone();
    Router::new()
        .route(
            "/effects",
            post(move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, "the typed replica ran it")
            }),
        )
        .layer(IdempotencyLayer::from_shared_store(records))
}

/// A one-commit owner holds its key against a replica whose typed store reserves on the
/// same table (PostgreSQL: the owner's record is not written until it commits, so the
/// typed store's reservation and wait go by the key's advisory lock; MariaDB: by the
/// owner's uncommitted row): the replica's duplicate waits, then replays the owner's
/// answer, and never runs.
async fn a_typed_replica_waits_for_a_one_commit_owner<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    let app = app(&database);
    let runs = Arc::new(AtomicUsize::new(0));
    let replica = typed_replica(&database, runs.clone());
    let key = uuid::Uuid::new_v4().to_string();
    let ((status, duplicate, outcome), original) =
        duplicate_while_running(&app, &replica, &key, 600, 150).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Replayed)),
        "{duplicate}"
    );
    assert_eq!(duplicate, original);
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the duplicate never ran");
    assert_eq!(database.side_effects().await, 1);
    database.drop_tables().await;
}

/// A handler that commits the reservation's transaction without handing its answer over
/// (`WriteTransaction::commit`, not `Tx::commit`) leaves its key held, never free: the
/// in-flight record commits with its write (PostgreSQL inserts it before the `COMMIT`;
/// MariaDB's reservation inserted it), and the layer writes the answer afterwards; on
/// SQLite this process's claim holds the key until then. Retries replay that answer.
async fn a_commit_without_the_answer_keeps_the_key_held<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    async fn raw<DB: RecordDatabase>(
        State(app): State<App<DB>>,
        reservation: Option<Extension<ReservationHandle>>,
    ) -> Response
    where
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
        for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    {
        let mut tx = Transactions::begin(&app.writes, reservation.as_deref())
            .await
            .unwrap();
        sqlx::query(&format!(
            "INSERT INTO {} (name) VALUES ('effect')",
            app.side_effects
        ))
        .execute(&mut **tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let held: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {}", app.records))
            .fetch_one(&app.observer)
            .await
            .unwrap();
        (
            StatusCode::CREATED,
            format!("records after the commit: {held}"),
        )
            .into_response()
    }
    let records = match database.backend {
        Backend::MariaDb => format!("`{}`", database.table),
        Backend::Postgres | Backend::Sqlite => format!("\"{}\"", database.table),
    };
    let app = Router::new()
        .route("/effects", post(raw::<DB>))
        .with_state(App {
            writes: Writes::with_records(database.store.clone()),
            side_effects: format!("{}_side_effects", database.table),
            observer: database.pool.clone(),
            records,
        })
        .layer(IdempotencyLayer::from_shared_store(database.store.clone()));
    let key = uuid::Uuid::new_v4().to_string();
    let (status, body, outcome) = send(&app, request(&key, "a")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    let expected = match backend {
        Backend::Postgres | Backend::MariaDb => "records after the commit: 1",
        Backend::Sqlite => "records after the commit: 0",
    };
    assert_eq!(body, expected);
    let (status, replayed, outcome) = send(&app, request(&key, "a")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Replayed))
    );
    assert_eq!(replayed, body);
    assert_eq!(database.side_effects().await, 1);
    assert_eq!(database.records().await, 1);
    database.drop_tables().await;
}

/// A scope quota on this path: concurrent reservations in one scope win exactly the
/// quota (the uncommitted ones of this process counted), another scope is not affected,
/// a released reservation gives its room back.
async fn scope_quotas_hold<DB: RecordDatabase>(backend: Backend) {
    let quota = ScopeQuota::default().with_max_records(5);
    let Some(database) = Database::<DB>::open_with(backend, Some(quota), 16).await else {
        return;
    };
    idempotency_core::conformance::scope_quota_holds_under_concurrency(&database.store, 5).await;
    database.drop_tables().await;
}

/// A write committed with its record through `Tx` leaves nothing of its reservation
/// behind in the store: with a quota of two records, a second key of the scope still
/// runs (a reservation left pending would count as the second record).
async fn a_committed_write_leaves_its_scope_room<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let quota = ScopeQuota::default().with_max_records(2);
    let Some(database) = Database::<DB>::open_with(backend, Some(quota), 4).await else {
        return;
    };
    let app = app(&database);
    let key = |n: u32| format!("room-{n}-{}", uuid::Uuid::new_v4());
    for n in 1..=2 {
        let (status, body, outcome) = send(&app, request(&key(n), r#"{"n":1}"#)).await;
        assert_eq!(
            (status, outcome),
            (StatusCode::CREATED, Some(Outcome::Executed)),
            "write {n} of a scope with room for two: {body}"
        );
    }
    assert_eq!(database.records().await, 2);
    database.drop_tables().await;
}

/// What `a_stale_owner_writes_nothing` hands between its two handlers.
struct StaleOwner<DB: RecordDatabase> {
    writes: Writes<DB>,
    store: Arc<OneCommitStore<DB>>,
    side_effects: String,
    /// Told once the stale owner's record was evicted (and the owner still runs).
    evicted: Arc<tokio::sync::Notify>,
    /// Told once the stale owner is about to commit.
    committing: Arc<tokio::sync::Notify>,
}

impl<DB: RecordDatabase> Clone for StaleOwner<DB> {
    fn clone(&self) -> Self {
        Self {
            writes: self.writes.clone(),
            store: self.store.clone(),
            side_effects: self.side_effects.clone(),
            evicted: self.evicted.clone(),
            committing: self.committing.clone(),
        }
    }
}

/// `POST /effects` for `a_stale_owner_writes_nothing`: writes one side effect in its `Tx`
/// and commits it with a 201 saying `x-role`. `x-role: stale` has its record evicted
/// (forced) first, and tells `committing` before it commits; `x-role: new` waits until
/// the stale one is committing before it writes, so that its reservation is pending,
/// its transaction taken, while the stale one finalizes.
async fn stale_or_new<DB: RecordDatabase>(
    State(app): State<StaleOwner<DB>>,
    headers: HeaderMap,
    reservation: Option<Extension<ReservationHandle>>,
) -> Response
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let role = headers
        .get("x-role")
        .map_or("plain", |role| role.to_str().unwrap())
        .to_owned();
    if role == "stale" {
        // Before its `Tx`: on SQLite that holds the database's one writer.
        let id = reservation.as_deref().unwrap().id();
        let evicted = app.store.evict(id, EvictInFlight::Force).await.unwrap();
        assert!(
            matches!(evicted, Eviction::Evicted(_)),
            "the stale owner's record: {evicted:?}"
        );
    }
    let mut tx = Tx::begin(&app.writes, reservation.as_deref())
        .await
        .unwrap();
    match role.as_str() {
        "stale" => app.evicted.notify_one(),
        "new" => {
            // SQLite: the new owner's `Tx` waits for the database's one writer, which
            // the stale owner holds, so the stale one commits without this.
            let _ = tokio::time::timeout(Duration::from_secs(2), app.committing.notified()).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        _ => {}
    }
    sqlx::query(&format!(
        "INSERT INTO {} (name) VALUES ('{role}')",
        app.side_effects
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    if role == "stale" {
        // The new owner reserves the key meanwhile; give it time to take its `Tx`.
        tokio::time::sleep(Duration::from_millis(300)).await;
        app.committing.notify_one();
    }
    tx.commit((StatusCode::CREATED, role).into_response())
        .await
        .unwrap_or_else(TxError::into_response)
}

/// An owner whose record was taken from it (evicted while it ran, as an operator does
/// for a stuck owner) and whose key a new owner then reserved in this process writes
/// nothing when it commits: its `Tx` finds its record gone and rolls back (503), and the
/// new owner's answer is the key's. (The stale owner's reservation is a committed one:
/// its key held an expired record. The new owner's is pending in this process, its
/// transaction taken, when the stale one finalizes: the store must not write the new
/// owner's record for the stale one.) PostgreSQL and MariaDB: SQLite reserves a key
/// whose record expired as its free keys, with a claim of this process that nothing
/// evicts.
async fn a_stale_owner_writes_nothing<DB: RecordDatabase>(backend: Backend)
where
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
{
    let Some(database) = Database::<DB>::open(backend).await else {
        return;
    };
    let lifetime = Duration::from_secs(1);
    let state = StaleOwner {
        writes: Writes::with_records(database.store.clone()),
        store: database.store.clone(),
        side_effects: format!("{}_side_effects", database.table),
        evicted: Arc::new(tokio::sync::Notify::new()),
        committing: Arc::new(tokio::sync::Notify::new()),
    };
    let app = Router::new()
        .route("/effects", post(stale_or_new::<DB>))
        .with_state(state.clone())
        .layer(IdempotencyLayer::from_shared_store(database.store.clone()).with_lifetime(lifetime));
    let key = uuid::Uuid::new_v4().to_string();
    let as_role = |role: &'static str| {
        let mut request = request(&key, "a");
        request
            .headers_mut()
            .insert("x-role", role.parse().unwrap());
        request
    };
    let (status, _, _) = send(&app, as_role("plain")).await;
    assert_eq!(status, StatusCode::CREATED);
    tokio::time::sleep(lifetime + Duration::from_millis(500)).await;

    let stale = tokio::spawn({
        let (app, request) = (app.clone(), as_role("stale"));
        async move { send(&app, request).await }
    });
    tokio::time::timeout(Duration::from_secs(5), state.evicted.notified())
        .await
        .expect("the stale owner's record was evicted");
    let new = tokio::spawn({
        let (app, request) = (app.clone(), as_role("new"));
        async move { send(&app, request).await }
    });
    let (stale, new) = (stale.await.unwrap(), new.await.unwrap());
    assert_eq!(
        (stale.0, stale.2),
        (StatusCode::SERVICE_UNAVAILABLE, Some(Outcome::Unsettled)),
        "the stale owner's record is gone: it must not commit ({})",
        stale.1
    );
    assert_eq!(
        (new.0, new.1.as_str(), new.2),
        (StatusCode::CREATED, "new", Some(Outcome::Executed))
    );
    let (status, body, outcome) = send(&app, as_role("plain")).await;
    assert_eq!(
        (status, body.as_str(), outcome),
        (StatusCode::CREATED, "new", Some(Outcome::Replayed)),
        "the key's answer is the new owner's"
    );
    assert_eq!(
        database.side_effects().await,
        2,
        "the first write and the new owner's"
    );
    database.drop_tables().await;
}

/// The tests above on `$backend`, the handlers on a pool of `$database` (the backend's
/// typed driver, or `sqlx::Any`).
macro_rules! on {
    ($module:ident, $backend:expr, $database:ty) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_conformance_checks_that_apply() {
                super::the_conformance_checks_that_apply::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_check_with_leased_reservations() {
                super::every_check_with_leased_reservations::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_unknown_outcome_holds_its_key_until_it_expires_and_holds_nothing_else() {
                super::an_unknown_outcome_holds_its_key_until_it_expires_and_holds_nothing_else::<
                    $database,
                >($backend)
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_wait_for_a_running_owner_ends_at_its_timeout() {
                super::a_wait_for_a_running_owner_ends_at_its_timeout::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn abandoned_reservations_leave_the_key_free() {
                super::abandoned_reservations_leave_the_key_free::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn abandoned_transactions_leave_nothing_open() {
                super::abandoned_transactions_leave_nothing_open::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_probe_sees_a_transaction_while_it_is_open() {
                super::the_probe_sees_a_transaction_while_it_is_open::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_request_without_a_key_writes_in_a_transaction_of_its_own() {
                super::a_request_without_a_key_writes_in_a_transaction_of_its_own::<$database>(
                    $backend,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn scope_quotas_hold() {
                super::scope_quotas_hold::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_commit_then_replays() {
                super::one_commit_then_replays::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_commit_without_the_answer_keeps_the_key_held() {
                super::a_commit_without_the_answer_keeps_the_key_held::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_committed_write_leaves_its_scope_room() {
                super::a_committed_write_leaves_its_scope_room::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_duplicate_in_flight_waits_and_replays() {
                super::a_duplicate_in_flight_waits_and_replays::<$database>($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_5xx_leaves_nothing_and_a_rolled_back_answer_is_still_kept() {
                super::a_5xx_leaves_nothing_and_a_rolled_back_answer_is_still_kept::<$database>(
                    $backend,
                )
                .await;
            }
        }
    };
}

/// `a_stale_owner_writes_nothing` where a reservation can go stale: one committed in a
/// transaction of its own (SQLite's reservation of a key whose record expired is the
/// process's claim, which nothing evicts).
macro_rules! stale_owner {
    ($module:ident, $backend:expr, $database:ty) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stale_owner_writes_nothing() {
                super::a_stale_owner_writes_nothing::<$database>($backend).await;
            }
        }
    };
}

stale_owner!(postgres_stale_owner, Backend::Postgres, sqlx::Postgres);
stale_owner!(postgres_any_stale_owner, Backend::Postgres, sqlx::Any);
stale_owner!(mariadb_stale_owner, Backend::MariaDb, sqlx::MySql);
stale_owner!(mariadb_any_stale_owner, Backend::MariaDb, sqlx::Any);

/// `a_typed_replica_waits_for_a_one_commit_owner` where a replica's typed store shares
/// the table with one-commit owners (several processes on one SQLite file keep the
/// SQLite rules of `OneCommitStore`'s docs instead).
macro_rules! shared_table {
    ($module:ident, $backend:expr, $database:ty) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_typed_replica_waits_for_a_one_commit_owner() {
                super::a_typed_replica_waits_for_a_one_commit_owner::<$database>($backend).await;
            }
        }
    };
}

shared_table!(postgres_shared_table, Backend::Postgres, sqlx::Postgres);
shared_table!(mariadb_shared_table, Backend::MariaDb, sqlx::MySql);

on!(postgres, Backend::Postgres, sqlx::Postgres);
on!(postgres_any, Backend::Postgres, sqlx::Any);
on!(mariadb, Backend::MariaDb, sqlx::MySql);
on!(mariadb_any, Backend::MariaDb, sqlx::Any);
on!(sqlite, Backend::Sqlite, sqlx::Sqlite);
on!(sqlite_any, Backend::Sqlite, sqlx::Any);
