//! Leased reservations (`Reservations::Leased`): a handler writes its mutation and its
//! answer through its `Tx`, on PostgreSQL, MariaDB and SQLite. The mutation and the
//! record commit together or not at all; a reservation taken over is refused; and a
//! takeover on another node while the transaction is open waits for it, then finds the
//! record finalized (commit) or still in flight (rollback): the mutation never runs twice.
//!
//! The test steers the handler's transaction between its answer's write and its `COMMIT`
//! through a `Transactions` of its own around the store's, as any user could write one.
#![cfg(all(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "any"
))]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http_body_util::BodyExt;
use idempotency_core::{
    Binding, FencingToken, FullStore, IdempotencyLayer, IdempotencyRecord, IdempotencyStore,
    Outcome, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, RecordState, Reservation,
    ReservationHandle, StoreError, StoredResponse,
};
use idempotency_store_sql::{
    CommitError, FinalizeError, MySqlStore, OneCommitStore, OpenTransaction, PoolSettings,
    PostgresStore, Reservations, SqliteStore, TableName, Transactions, Tx, Writes,
};
use sqlx::{Any, AnyConnection};
use tokio::sync::oneshot;
use tower::ServiceExt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Postgres,
    MariaDb,
    Sqlite,
}

/// One node's store, typed: each backend has its own connection type.
#[derive(Clone)]
enum Store {
    Postgres(PostgresStore),
    MariaDb(MySqlStore),
    Sqlite(SqliteStore),
}

/// A database for one test: fresh tables, and (SQLite) the directory of its file.
struct Database {
    backend: Backend,
    url: String,
    table: String,
    _dir: tempfile::TempDir,
}

impl Database {
    fn new(backend: Backend) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = match backend {
            Backend::Postgres => std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
            Backend::MariaDb => std::env::var("IDEMPOTENCY_TEST_MYSQL_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned()),
            Backend::Sqlite => format!("sqlite:{}", dir.path().join("records.db").display()),
        };
        Self {
            backend,
            url,
            table: common::unique_table(),
            _dir: dir,
        }
    }

    fn env(&self) -> &'static str {
        match self.backend {
            Backend::Postgres => "IDEMPOTENCY_TEST_POSTGRES_URL",
            Backend::MariaDb => "IDEMPOTENCY_TEST_MYSQL_URL",
            Backend::Sqlite => "(a temporary file)",
        }
    }

    /// A node: a store with a pool of its own, migrated, with the orders table.
    async fn node(&self) -> Option<Store> {
        let settings = PoolSettings::default().max_connections(4);
        let opened = match self.backend {
            Backend::Postgres => match PostgresStore::connect(&self.url, &settings).await {
                Ok(store) => store
                    .with_table_name(&self.table)
                    .unwrap()
                    .migrate()
                    .await
                    .map(Store::Postgres),
                Err(error) => Err(error),
            },
            Backend::MariaDb => match MySqlStore::connect(&self.url, &settings).await {
                Ok(store) => store
                    .with_table_name(&self.table)
                    .unwrap()
                    .migrate()
                    .await
                    .map(Store::MariaDb),
                Err(error) => Err(error),
            },
            Backend::Sqlite => match SqliteStore::connect(&self.url, &settings).await {
                Ok(store) => store
                    .with_table_name(&self.table)
                    .unwrap()
                    .migrate()
                    .await
                    .map(Store::Sqlite),
                Err(error) => Err(error),
            },
        };
        let store = match opened {
            Ok(store) => store,
            Err(error) => {
                return common::unreachable(
                    &format!("{:?}", self.backend),
                    &self.url,
                    self.env(),
                    error,
                );
            }
        };
        store
            .execute(&format!(
                "CREATE TABLE IF NOT EXISTS {} (item TEXT NOT NULL)",
                self.orders()
            ))
            .await;
        Some(store)
    }

    fn orders(&self) -> String {
        format!("{}_orders", self.table)
    }

    async fn any_pool(&self) -> sqlx::AnyPool {
        sqlx::any::install_default_drivers();
        sqlx::any::AnyPoolOptions::new()
            .max_connections(4)
            .connect(&self.url)
            .await
            .unwrap()
    }

    async fn drop_tables(&self, store: &Store) {
        if self.backend != Backend::Sqlite {
            store.execute(&format!("DROP TABLE {}", self.table)).await;
            store
                .execute(&format!("DROP TABLE {}", self.orders()))
                .await;
        }
    }
}

impl Store {
    fn shared(&self) -> Arc<dyn FullStore> {
        match self {
            Self::Postgres(store) => Arc::new(store.clone()),
            Self::MariaDb(store) => Arc::new(store.clone()),
            Self::Sqlite(store) => Arc::new(store.clone()),
        }
    }

    async fn execute(&self, statement: &str) {
        match self {
            Self::Postgres(store) => {
                sqlx::query(statement).execute(store.pool()).await.unwrap();
            }
            Self::MariaDb(store) => {
                sqlx::query(statement).execute(store.pool()).await.unwrap();
            }
            Self::Sqlite(store) => {
                sqlx::query(statement).execute(store.pool()).await.unwrap();
            }
        }
    }

    async fn count(&self, table: &str) -> i64 {
        let statement = format!("SELECT count(*) FROM {table}");
        match self {
            Self::Postgres(store) => sqlx::query_scalar(&statement).fetch_one(store.pool()).await,
            Self::MariaDb(store) => sqlx::query_scalar(&statement).fetch_one(store.pool()).await,
            Self::Sqlite(store) => sqlx::query_scalar(&statement).fetch_one(store.pool()).await,
        }
        .unwrap()
    }
}

/// The store, counting the finalizes the layer itself sends.
struct Counting {
    inner: Arc<dyn FullStore>,
    finalizes: AtomicUsize,
}

#[async_trait]
impl IdempotencyStore for Counting {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        self.inner.reserve(id, binding, lease, lifetime).await
    }
    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.inner.load(id).await
    }
    async fn wait(
        &self,
        id: &RecordId,
        timeout: Duration,
    ) -> Result<idempotency_core::Waited, StoreError> {
        self.inner.wait(id, timeout).await
    }
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.inner.renew(id, token, lease).await
    }
    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        self.finalizes.fetch_add(1, Ordering::SeqCst);
        self.inner.finalize(id, token, response).await
    }
    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        self.inner.release(id, token).await
    }
    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        self.inner.take_over(id, lapsed, lease).await
    }
}

#[async_trait]
impl RecordAdmin for Counting {}

#[async_trait]
impl PurgeExpired for Counting {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        self.inner.purge_expired(batch_size).await
    }
}

/// How the test steers the handler's transaction: pauses before it and after the
/// answer's write, and whether it then commits.
#[derive(Default)]
struct Script {
    /// Told when the handler runs, then awaited before its transaction begins.
    before_transaction: Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>,
    /// Told the answer's write's outcome, then awaited for commit (`true`) or rollback.
    after_finalize: Option<(oneshot::Sender<FinalizeOutcome>, oneshot::Receiver<bool>)>,
    /// Awaited after a rollback, before the handler answers.
    after_rollback: Option<oneshot::Receiver<()>>,
}

/// What writing the answer in the transaction gave: `Ok`, or the error's message.
type FinalizeOutcome = Result<(), String>;

type Leased = Writes<Any>;

/// The store's transactions, paused as the script says between the answer's write and
/// the `COMMIT`.
#[derive(Clone)]
struct Scripted {
    store: Leased,
    script: Arc<Mutex<Script>>,
}

/// The store's transaction, and the decision the script awaits before its `COMMIT`.
struct Paused {
    transaction: <Leased as Transactions>::Transaction,
    decision: Option<oneshot::Receiver<bool>>,
}

impl OpenTransaction for Paused {
    type Connection = AnyConnection;

    fn connection(&mut self) -> &mut AnyConnection {
        self.transaction.connection()
    }

    fn connection_ref(&self) -> &AnyConnection {
        self.transaction.connection_ref()
    }

    async fn commit(self) -> Result<(), CommitError> {
        let commit = match self.decision {
            Some(decision) => decision.await.unwrap(),
            None => true,
        };
        if commit {
            OpenTransaction::commit(self.transaction).await
        } else {
            self.transaction.rollback().await.unwrap();
            Err(CommitError::NotCommitted(sqlx::Error::Protocol(
                "rolled back by the test".into(),
            )))
        }
    }
}

impl Transactions for Scripted {
    type Database = Any;
    type Transaction = Paused;

    fn records_in_transaction(&self) -> bool {
        true
    }

    async fn begin(&self, reservation: Option<&ReservationHandle>) -> Result<Paused, StoreError> {
        Ok(Paused {
            transaction: self.store.begin(reservation).await?,
            decision: None,
        })
    }

    async fn finalize_in<B>(
        &self,
        transaction: &mut Paused,
        reservation: Option<&ReservationHandle>,
        answer: Response<B>,
    ) -> Result<Response<B>, FinalizeError>
    where
        B: http_body::Body<Data = bytes::Bytes> + From<bytes::Bytes> + Send,
        B::Error: Into<idempotency_core::BoxError>,
    {
        let finalized = self
            .store
            .finalize_in(&mut transaction.transaction, reservation, answer)
            .await;
        let after_finalize = self.script.lock().unwrap().after_finalize.take();
        if let Some((told, decision)) = after_finalize {
            // (A response body is not `Sync`: no reference to it lives across an await.)
            let outcome = finalized.as_ref().map(drop).map_err(ToString::to_string);
            told.send(outcome).unwrap();
            transaction.decision = Some(decision);
        }
        finalized
    }
}

#[derive(Clone)]
struct App {
    transactions: Scripted,
    orders: String,
}

/// `POST /orders`: inserts an order and commits it with its answer in the request's `Tx`,
/// as the script says.
async fn place_order(
    State(app): State<App>,
    reservation: Option<Extension<ReservationHandle>>,
) -> Response {
    let before_transaction = app
        .transactions
        .script
        .lock()
        .unwrap()
        .before_transaction
        .take();
    if let Some((running, go_on)) = before_transaction {
        running.send(()).unwrap();
        go_on.await.unwrap();
    }
    let answer = (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        format!(r#"{{"order":"{}"}}"#, uuid::Uuid::new_v4()),
    )
        .into_response();
    let mut tx = Tx::begin(&app.transactions, reservation.as_deref())
        .await
        .unwrap();
    let insert = format!("INSERT INTO {} (item) VALUES ('book')", app.orders);
    sqlx::query(&insert).execute(&mut *tx).await.unwrap();
    match tx.commit(answer).await {
        Ok(answer) => answer,
        Err(error) => {
            let after_rollback = app
                .transactions
                .script
                .lock()
                .unwrap()
                .after_rollback
                .take();
            if let Some(answer_now) = after_rollback {
                answer_now.await.unwrap();
            }
            (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response()
        }
    }
}

/// A node's app: the handler, behind a layer with a short lease, over the store with
/// leased reservations built on `store` (the typed store of the node); the store as the
/// layer sees it, counting its finalizes.
async fn app(database: &Database, store: &Store) -> (Router, Arc<Mutex<Script>>, Arc<Counting>) {
    let table = TableName::new(&database.table).unwrap();
    let leased = OneCommitStore::new(store.shared(), database.any_pool().await, &table)
        .await
        .unwrap()
        .with_reservations(Reservations::Leased);
    let leased = Arc::new(leased);
    let counting = Arc::new(Counting {
        inner: leased.clone(),
        finalizes: AtomicUsize::new(0),
    });
    let script = Arc::new(Mutex::new(Script::default()));
    let state = App {
        transactions: Scripted {
            store: Writes::with_records(leased),
            script: script.clone(),
        },
        orders: database.orders(),
    };
    let router = Router::new()
        .route("/orders", post(place_order))
        .with_state(state)
        .layer(
            IdempotencyLayer::from_shared_store(counting.clone())
                .with_lease(LEASE)
                // Renewals stop early, so a test can let the lease lapse while the
                // handler waits; the answer's write in the transaction stops them too.
                .with_max_run_time(Duration::from_millis(50)),
        );
    (router, script, counting)
}

const LEASE: Duration = Duration::from_millis(300);

fn order(key: &str) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .body(Body::empty())
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

async fn record(store: &Store, key: &str) -> Option<RecordState> {
    store
        .shared()
        .load(&RecordId::new("", key))
        .await
        .unwrap()
        .map(|record| record.state)
}

/// Waits until the record's lease has lapsed, and returns its token.
async fn lapsed_token(store: &Store, key: &str) -> FencingToken {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match record(store, key).await {
            Some(RecordState::InFlight {
                token,
                lease_lapsed: true,
            }) => return token,
            Some(RecordState::InFlight { .. }) => {}
            other => panic!("expected an in-flight record, found {other:?}"),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never lapsed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn a_commit_stores_the_answer_with_the_mutation(backend: Backend) {
    let database = Database::new(backend);
    let Some(store) = database.node().await else {
        return;
    };
    let (app, _, counting) = app(&database, &store).await;
    let key = uuid::Uuid::new_v4().to_string();

    let (status, body, outcome) = send(&app, order(&key)).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed)),
        "{body}"
    );
    assert_eq!(store.count(&database.orders()).await, 1);
    match record(&store, &key).await {
        Some(RecordState::Completed(stored)) => {
            assert_eq!(stored.status, 201);
            assert_eq!(
                stored.body,
                body.as_bytes(),
                "what is stored is what was sent"
            );
        }
        other => panic!("the record must be finalized with the order: {other:?}"),
    }
    assert_eq!(
        counting.finalizes.load(Ordering::SeqCst),
        0,
        "the layer does not finalize a second time"
    );

    let (status, replayed, outcome) = send(&app, order(&key)).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Replayed))
    );
    assert_eq!(replayed, body);
    assert_eq!(store.count(&database.orders()).await, 1);
    database.drop_tables(&store).await;
}

/// The handler finalized, then rolled back and answered 503: nothing of the request is
/// left (the layer released the key), and the retry runs once.
async fn a_rollback_takes_the_record_with_it(backend: Backend) {
    let database = Database::new(backend);
    let Some(store) = database.node().await else {
        return;
    };
    let (app, script, _) = app(&database, &store).await;
    let key = uuid::Uuid::new_v4().to_string();
    let (told, outcome_of_finalize) = oneshot::channel();
    let (decide, decision) = oneshot::channel();
    script.lock().unwrap().after_finalize = Some((told, decision));

    let request = tokio::spawn({
        let app = app.clone();
        let key = key.clone();
        async move { send(&app, order(&key)).await }
    });
    assert_eq!(outcome_of_finalize.await.unwrap(), Ok(()));
    decide.send(false).unwrap();
    let (status, _, outcome) = request.await.unwrap();
    assert_eq!(
        (status, outcome),
        (StatusCode::SERVICE_UNAVAILABLE, Some(Outcome::Released))
    );
    assert_eq!(store.count(&database.orders()).await, 0);
    assert_eq!(record(&store, &key).await, None, "the 503 released the key");

    let (status, _, outcome) = send(&app, order(&key)).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    assert_eq!(store.count(&database.orders()).await, 1);
    database.drop_tables(&store).await;
}

/// The handler's lease lapsed and another node took the key over before the handler
/// finalized: its finalize is refused, it rolls back, and the mutation is left to the
/// new owner.
async fn a_reservation_taken_over_is_refused(backend: Backend) {
    let database = Database::new(backend);
    let Some(store) = database.node().await else {
        return;
    };
    let Some(other_node) = database.node().await else {
        return;
    };
    let (app, script, _) = app(&database, &store).await;
    let key = uuid::Uuid::new_v4().to_string();
    let (running, handler_running) = oneshot::channel();
    let (go_on, begin_now) = oneshot::channel();
    let (told, outcome_of_finalize) = oneshot::channel();
    let (decide, decision) = oneshot::channel();
    *script.lock().unwrap() = Script {
        before_transaction: Some((running, begin_now)),
        after_finalize: Some((told, decision)),
        after_rollback: None,
    };

    let request = tokio::spawn({
        let app = app.clone();
        let key = key.clone();
        async move { send(&app, order(&key)).await }
    });
    handler_running.await.unwrap();
    let lapsed = lapsed_token(&other_node, &key).await;
    let taken = other_node
        .shared()
        .take_over(
            &RecordId::new("", key.clone()),
            lapsed,
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert!(taken.is_some(), "the lapsed lease is taken over");
    go_on.send(()).unwrap();
    let refused = outcome_of_finalize.await.unwrap().unwrap_err();
    assert!(
        refused.contains("taken over") && refused.contains("roll back"),
        "{refused}"
    );
    // A refused answer rolls the `Tx` back without a decision: it may be gone already.
    let _ = decide.send(false);
    let (status, body, _) = request.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(store.count(&database.orders()).await, 0, "rolled back");
    assert!(
        matches!(record(&store, &key).await, Some(RecordState::InFlight { token, .. }) if token != lapsed),
        "the record belongs to the new owner"
    );
    database.drop_tables(&store).await;
}

/// While the handler's transaction is open with the record finalized in it, another
/// node finds the lease lapsed and tries to take the record over: the takeover waits for
/// the transaction (the row lock, or SQLite's write lock), and then finds the record
/// finalized (`commit`: it does not run) or still in flight (rollback: it takes over).
async fn a_concurrent_takeover_waits_for_the_transaction(backend: Backend, commit: bool) {
    let database = Database::new(backend);
    let Some(store) = database.node().await else {
        return;
    };
    let Some(other_node) = database.node().await else {
        return;
    };
    let (app, script, _) = app(&database, &store).await;
    let key = uuid::Uuid::new_v4().to_string();
    let (told, outcome_of_finalize) = oneshot::channel();
    let (decide, decision) = oneshot::channel();
    // After a rollback, the handler answers (a 503, and the layer releases the key) only
    // once the takeover is through, so that the takeover finds the record as the
    // rollback left it.
    let (answer_now, answer_after_rollback) = oneshot::channel();
    {
        let mut script = script.lock().unwrap();
        script.after_finalize = Some((told, decision));
        script.after_rollback = Some(answer_after_rollback);
    }

    let request = tokio::spawn({
        let app = app.clone();
        let key = key.clone();
        async move { send(&app, order(&key)).await }
    });
    assert_eq!(outcome_of_finalize.await.unwrap(), Ok(()));
    // The layer stopped renewing once the handler finalized; the lease lapses. Others
    // still read the record as it was before the transaction: in flight.
    let lapsed = lapsed_token(&other_node, &key).await;
    let mut take_over = tokio::spawn({
        let other_node = other_node.shared();
        let id = RecordId::new("", key.clone());
        async move {
            other_node
                .take_over(&id, lapsed, Duration::from_secs(60))
                .await
        }
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut take_over)
            .await
            .is_err(),
        "the takeover must wait while the transaction is open"
    );
    decide.send(commit).unwrap();
    let taken = tokio::time::timeout(Duration::from_secs(10), take_over)
        .await
        .expect("the takeover goes on once the transaction ends")
        .unwrap()
        .unwrap();
    let _ = answer_now.send(());
    let (status, body, _) = request.await.unwrap();
    if commit {
        assert_eq!(
            taken, None,
            "the record was finalized: no takeover, no second run"
        );
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(store.count(&database.orders()).await, 1);
        match record(&other_node, &key).await {
            Some(RecordState::Completed(stored)) => assert_eq!(stored.body, body.as_bytes()),
            other => panic!("expected the finalized record, found {other:?}"),
        }
    } else {
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(store.count(&database.orders()).await, 0, "rolled back");
        // The record was still in flight after the rollback: the takeover got it.
        match (taken, record(&other_node, &key).await) {
            (Some(token), Some(RecordState::InFlight { token: owner, .. })) => {
                assert_eq!(token, owner)
            }
            other => panic!("after the rollback: {other:?}"),
        }
    }
    database.drop_tables(&store).await;
}

/// A request without a key has no reservation: its answer comes back untouched and
/// nothing is written.
async fn a_request_without_a_key_is_left_alone(backend: Backend) {
    let database = Database::new(backend);
    let Some(store) = database.node().await else {
        return;
    };
    let (app, _, _) = app(&database, &store).await;
    let (status, _, outcome) =
        send(&app, Request::post("/orders").body(Body::empty()).unwrap()).await;
    assert_eq!((status, outcome), (StatusCode::CREATED, None));
    assert_eq!(store.count(&database.orders()).await, 1);
    assert_eq!(store.count(&database.table).await, 0);
    database.drop_tables(&store).await;
}

macro_rules! backend_tests {
    ($module:ident, $backend:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_commit_stores_the_answer_with_the_mutation() {
                super::a_commit_stores_the_answer_with_the_mutation($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_rollback_takes_the_record_with_it() {
                super::a_rollback_takes_the_record_with_it($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_reservation_taken_over_is_refused() {
                super::a_reservation_taken_over_is_refused($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_concurrent_takeover_waits_and_then_finds_the_record_finalized() {
                super::a_concurrent_takeover_waits_for_the_transaction($backend, true).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_concurrent_takeover_waits_and_takes_over_after_a_rollback() {
                super::a_concurrent_takeover_waits_for_the_transaction($backend, false).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_request_without_a_key_is_left_alone() {
                super::a_request_without_a_key_is_left_alone($backend).await;
            }
        }
    };
}

backend_tests!(postgres, Backend::Postgres);
backend_tests!(mariadb, Backend::MariaDb);
backend_tests!(sqlite, Backend::Sqlite);
