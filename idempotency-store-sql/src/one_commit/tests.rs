//! Each dialect's reservation, on a key and binding that text spliced into SQL would
//! break (MariaDB's, which rides in `BEGIN`, carries them as literals), and MySQL 8's
//! (`BEGIN`, the session's lock wait set around the insert), which is plain SQL that
//! MariaDB runs too: it stays covered on a MariaDB-only machine by telling the store it
//! is not on MariaDB.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idempotency_core::{
    Binding, FencingToken, IdempotencyStore, Ownership, RecordId, RecordState, Reservation,
    StoredResponse,
};
use sqlx::MySqlPool;

use crate::record_database::NewRecord;
use crate::{MySqlStore, OneCommitStore, PostgresStore, RecordDatabase, TableName};

/// A pool on the server `env` names (or `url`), or `None` (skip) when none answers
/// outside CI.
async fn pool<DB: sqlx::Database>(env: &str, url: &str) -> Option<sqlx::Pool<DB>> {
    let url = std::env::var(env).unwrap_or_else(|_| url.to_owned());
    match sqlx::Pool::<DB>::connect(&url).await {
        Ok(pool) => Some(pool),
        Err(error) if std::env::var("CI").is_ok_and(|ci| ci == "true") => {
            panic!("{url} is unreachable: {error}")
        }
        Err(error) => {
            eprintln!("SKIPPED: {url} is unreachable ({error})");
            None
        }
    }
}

/// The one-commit store on `pool`, its committed records kept by `records` in `table`.
async fn one_commit<DB: RecordDatabase>(
    records: impl idempotency_core::FullStore,
    pool: &sqlx::Pool<DB>,
    table: &str,
) -> OneCommitStore<DB> {
    OneCommitStore::new(
        Arc::new(records),
        pool.clone(),
        &TableName::new(table).unwrap(),
    )
    .await
    .unwrap()
}

fn table() -> String {
    format!(
        "idem_unit_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    let Some(pool) = pool::<sqlx::Postgres>(
        "IDEMPOTENCY_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
    .await
    else {
        return;
    };
    let table = table();
    let records = PostgresStore::new(pool.clone())
        .with_table_name(&table)
        .unwrap()
        .migrate()
        .await
        .unwrap();
    holds_answers_and_replays_a_key(one_commit(records, &pool, &table).await).await;
    drop_table(&pool, &format!("DROP TABLE IF EXISTS \"{table}\"")).await;
}

async fn on_mysql(mysql_8: bool) {
    let Some(pool) = pool::<sqlx::MySql>(
        "IDEMPOTENCY_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    )
    .await
    else {
        return;
    };
    let pool: MySqlPool = pool;
    let table = table();
    let records = MySqlStore::new(pool.clone())
        .with_table_name(&table)
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let mut store = one_commit(records, &pool, &table).await;
    if mysql_8 {
        store.mariadb = false;
    }
    // MariaDB sends the reservation as the transaction's `BEGIN`, one round trip fewer;
    // MySQL 8 begins, then inserts.
    let (id, binding) = (RecordId::new("scope", "key"), binding());
    let record = NewRecord::new(
        &id,
        &binding,
        FencingToken(1),
        Duration::from_secs(1),
        Duration::from_secs(1),
    );
    let in_begin = store.reserve_begin_statement(&record);
    assert_eq!(
        in_begin
            .as_deref()
            .map(|statement| statement.starts_with("BEGIN NOT ATOMIC")),
        (!mysql_8).then_some(true),
        "the reservation in BEGIN: {in_begin:?}"
    );
    holds_answers_and_replays_a_key(store).await;
    drop_table(&pool, &format!("DROP TABLE IF EXISTS `{table}`")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    on_mysql(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_8_on_any_mysql_server() {
    on_mysql(true).await;
}

async fn drop_table<DB: sqlx::Database>(pool: &sqlx::Pool<DB>, statement: &str)
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    sqlx::Executor::execute(pool, statement).await.unwrap();
}

/// A binding whose path text spliced into SQL would break.
fn binding() -> Binding {
    Binding {
        method: "POST".to_owned(),
        path: "/v1/namespaces/'ø'$$".to_owned(),
        body_sha256: [9; 32],
    }
}

/// Reserves a free key, finds a duplicate busy (bounded), releases, reserves again,
/// finalizes, and replays.
async fn holds_answers_and_replays_a_key<DB: RecordDatabase>(store: OneCommitStore<DB>) {
    let store = Arc::new(store);
    let id = RecordId::new(
        "scope-'\\$reserve$",
        format!("clé-\"'); {}", uuid::Uuid::new_v4()),
    );
    let binding = binding();
    let (lease, lifetime) = (Duration::from_secs(30), Duration::from_secs(600));

    let Reservation::ReservedUncommitted(token) =
        store.reserve(&id, &binding, lease, lifetime).await.unwrap()
    else {
        panic!("a free key is reserved");
    };
    // A duplicate finds the key held and waits at most the bounded lock wait.
    let duplicate = tokio::time::timeout(
        Duration::from_secs(5),
        store.reserve(&id, &binding, lease, lifetime),
    )
    .await
    .expect("the duplicate's lock wait is bounded");
    assert!(matches!(duplicate, Ok(Reservation::Busy)), "{duplicate:?}");
    assert_eq!(store.release(&id, token).await.unwrap(), Ownership::Held);

    let Reservation::ReservedUncommitted(token) =
        store.reserve(&id, &binding, lease, lifetime).await.unwrap()
    else {
        panic!("a released key is reserved again");
    };
    let answer = StoredResponse {
        status: 201,
        headers: vec![("content-type".to_owned(), Bytes::from_static(b"text/plain"))],
        body: Bytes::from_static(b"made"),
        trailers: Vec::new(),
    };
    assert_eq!(
        store.finalize(&id, token, &answer).await.unwrap(),
        Ownership::Held
    );
    match store.reserve(&id, &binding, lease, lifetime).await.unwrap() {
        Reservation::Exists(record) => {
            assert_eq!(record.binding, binding);
            assert_eq!(record.state, RecordState::Completed(answer));
        }
        other => panic!("a finished key replays, got {other:?}"),
    }
}
