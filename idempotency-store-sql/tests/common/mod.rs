//! Helpers shared by the backend test binaries: unique tables, the skip-or-fail rule for
//! unreachable servers, and a few records to work with. The store checks themselves,
//! multi-node ones included, are the public conformance suite's.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Binding, FencingToken, FullStore, IdempotencyStore, RecordId, Reservation, StoredResponse,
};

pub const LONG: Duration = Duration::from_secs(60);

/// A table name no other test (or test process) uses.
pub fn unique_table() -> String {
    format!(
        "idem_test_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    )
}

/// Under `CI=true` an unreachable database fails the test; elsewhere it is skipped with a
/// notice. Returns `None` when the caller should return (skip).
pub fn unreachable<T>(
    backend: &str,
    url: &str,
    env: &str,
    error: impl std::fmt::Display,
) -> Option<T> {
    let message =
        format!("{backend} at {url} is unreachable ({error}); start it or point {env} at one");
    if std::env::var("CI").is_ok_and(|ci| ci == "true") {
        panic!("{message} (CI=true: a database that cannot be reached fails the run)");
    }
    eprintln!("SKIPPED: {message}");
    None
}

pub fn id() -> RecordId {
    RecordId::new(
        format!("scope-{}", uuid::Uuid::new_v4()),
        uuid::Uuid::new_v4().to_string(),
    )
}

pub fn binding() -> Binding {
    Binding {
        method: "POST".to_owned(),
        path: "/v1/namespaces/db/tables?x=1".to_owned(),
        body_sha256: [7; 32],
    }
}

pub fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".to_owned(),
            bytes::Bytes::from_static(b"application/json"),
        )],
        body: bytes::Bytes::from_static(body),
        trailers: vec![],
    }
}

/// Reserves `id`, a key nobody holds, with [`binding`] and a [`LONG`] lease and lifetime;
/// panics if the store does not reserve it.
pub async fn reserved(store: &impl IdempotencyStore, id: &RecordId) -> FencingToken {
    match store.reserve(id, &binding(), LONG, LONG).await {
        Ok(Reservation::Reserved(token)) => token,
        other => panic!("a fresh key was not reserved: {other:?}"),
    }
}

/// A store as the conformance suite takes it.
pub fn shared(store: impl FullStore) -> Arc<dyn FullStore> {
    Arc::new(store)
}

/// The whole conformance suite, with `second_node` (another pool on the same table) as a
/// second replica: a store whose reservations have a lease skips nothing.
pub async fn passes_every_check(store: Arc<dyn FullStore>, second_node: Arc<dyn FullStore>) {
    let report = idempotency_core::conformance::Suite::full(store)
        .with_second_node(second_node)
        .run()
        .await;
    assert!(report.skipped.is_empty(), "{report}");
}

/// The row a release before `response_trailers` existed wrote for a completed request
/// (as `OLD_ROW_VALUES` inserts it), as the store must read it after `migrate()`.
pub const OLD_ROW_SCOPE: &str = "upgrade-scope";
pub const OLD_ROW_KEY: &str = "upgrade-key";

/// The columns and values of that row, for an `INSERT INTO t {OLD_ROW}`; it expires in
/// the year 2255 by any clock.
pub const OLD_ROW: &str = "(scope, idempotency_key, method, path, body_sha256, fencing_token,
     created_at_ms, expires_at_ms, lease_expires_at_ms, response_status, response_headers,
     response_body)
   VALUES ('upgrade-scope', 'upgrade-key', 'POST', '/orders', X'0707070707070707070707070707070707070707070707070707070707070707',
     42, 0, 9000000000000, 9000000000000, 201, X'636F6E74656E742D747970653A6170706C69636174696F6E2F6A736F6E0A', X'7B7D')";

/// After `migrate()` on a table of the previous release: its row still replays (with no
/// trailers), and new records keep their trailers.
pub async fn check_upgraded_table(store: Arc<dyn FullStore>) {
    let old = store
        .load(&RecordId::new(OLD_ROW_SCOPE, OLD_ROW_KEY))
        .await
        .expect("load the old row")
        .expect("the old row is gone");
    assert_eq!(old.binding.body_sha256, [7; 32]);
    assert_eq!(
        old.state,
        idempotency_core::RecordState::Completed(StoredResponse {
            status: 201,
            headers: vec![(
                "content-type".to_owned(),
                bytes::Bytes::from_static(b"application/json"),
            )],
            body: bytes::Bytes::from_static(b"{}"),
            trailers: vec![],
        }),
        "a row written before the trailers column existed must replay as it was"
    );
    idempotency_core::conformance::trailers_round_trip(&store).await;
}

/// The URL of the PostgreSQL server the tests use, and the variable that names another.
#[cfg(feature = "postgres")]
pub const POSTGRES_ENV: &str = "IDEMPOTENCY_TEST_POSTGRES_URL";

#[cfg(feature = "postgres")]
pub fn postgres_url() -> String {
    std::env::var(POSTGRES_ENV)
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A PostgreSQL node: a store with a pool of its own, on `table` (not migrated); `None`
/// (after [`unreachable`]) when the server does not answer.
#[cfg(feature = "postgres")]
pub async fn postgres_node(table: &str) -> Option<idempotency_store_sql::PostgresStore> {
    let settings = idempotency_store_sql::PoolSettings::default()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10));
    match idempotency_store_sql::PostgresStore::connect(&postgres_url(), &settings).await {
        Ok(store) => Some(store.with_table_name(table).expect("valid table name")),
        Err(error) => unreachable("PostgreSQL", &postgres_url(), POSTGRES_ENV, error),
    }
}

#[cfg(feature = "postgres")]
pub async fn drop_postgres_table(store: &idempotency_store_sql::PostgresStore) {
    sqlx::query(&format!("DROP TABLE IF EXISTS \"{}\"", store.table_name()))
        .execute(store.pool())
        .await
        .expect("drop table");
}

/// A second PostgreSQL node on `owner`'s table, with a pool of its own that counts the
/// connections handed back to it: one per query its store sends.
#[cfg(feature = "postgres")]
pub async fn counting_postgres_node(
    owner: &idempotency_store_sql::PostgresStore,
) -> (
    idempotency_store_sql::PostgresStore,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    let queries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = queries.clone();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .after_release(move |_, _| {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::pin(async { Ok(true) })
        })
        .connect(&postgres_url())
        .await
        .expect("second pool");
    let node = idempotency_store_sql::PostgresStore::new(pool)
        .with_table_name(owner.table_name().as_str())
        .unwrap();
    (node, queries)
}

/// The variable that names the MySQL/MariaDB server the tests use.
#[cfg(feature = "mysql")]
pub const MYSQL_ENV: &str = "IDEMPOTENCY_TEST_MYSQL_URL";

#[cfg(feature = "mysql")]
pub fn mysql_url() -> String {
    std::env::var(MYSQL_ENV).unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A MySQL/MariaDB node: a store with a pool of its own, on `table` (not migrated);
/// `None` (after [`unreachable`]) when the server does not answer.
#[cfg(feature = "mysql")]
pub async fn mysql_node(table: &str) -> Option<idempotency_store_sql::MySqlStore> {
    let settings = idempotency_store_sql::PoolSettings::default()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10));
    match idempotency_store_sql::MySqlStore::connect(&mysql_url(), &settings).await {
        Ok(store) => Some(store.with_table_name(table).expect("valid table name")),
        Err(error) => unreachable("MySQL", &mysql_url(), MYSQL_ENV, error),
    }
}
