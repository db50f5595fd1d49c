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

/// The PostgreSQL server the tests use, or `None` outside CI without one.
async fn postgres_pool() -> Option<sqlx::PgPool> {
    pool(
        "IDEMPOTENCY_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
    .await
}

/// The MySQL/MariaDB server the tests use, or `None` outside CI without one.
async fn mysql_pool() -> Option<MySqlPool> {
    pool(
        "IDEMPOTENCY_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    )
    .await
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
    let Some(pool) = postgres_pool().await else {
        return;
    };
    let table = table();
    let records = PostgresStore::new(pool.clone())
        .with_table_name(&table)
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let store = one_commit(records, &pool, &table).await;
    nothing_of_an_unseen_reservation_lapses(&store).await;
    a_renewal_after_the_handlers_transaction_answers_from_the_table(&store).await;
    holds_answers_and_replays_a_key(store).await;
    drop_table(&pool, &format!("DROP TABLE IF EXISTS \"{table}\"")).await;
}

async fn on_mysql(mysql_8: bool) {
    let Some(pool) = mysql_pool().await else {
        return;
    };
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
    a_renewal_after_the_handlers_transaction_answers_from_the_table(&store).await;
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

/// Renewing a reservation held in its transaction holds it under its own token, and
/// nothing under another. (PostgreSQL: on MariaDB another token's renewal waits for the
/// reservation's row lock.)
async fn nothing_of_an_unseen_reservation_lapses<DB: RecordDatabase>(store: &OneCommitStore<DB>) {
    let id = RecordId::new("renew", uuid::Uuid::new_v4().to_string());
    let lease = Duration::from_secs(30);
    let Reservation::Reserved(token) = store.reserve(&id, &binding(), lease, lease).await.unwrap()
    else {
        panic!("a free key is reserved");
    };
    assert_eq!(
        store.renew(&id, token, lease).await.unwrap(),
        Ownership::Held
    );
    let stale = FencingToken(token.0 ^ 1);
    assert_eq!(
        store.renew(&id, stale, lease).await.unwrap(),
        Ownership::Lost
    );
    assert_eq!(store.release(&id, token).await.unwrap(), Ownership::Held);
}

/// Once the handler's transaction ended without the answer, a renewal answers from the
/// table: it extends the lease of the record the `COMMIT` left in flight, and says
/// `Lost` after a rollback, which left the key free.
async fn a_renewal_after_the_handlers_transaction_answers_from_the_table<DB: RecordDatabase>(
    store: &OneCommitStore<DB>,
) {
    let lease = Duration::from_secs(1);
    let lifetime = Duration::from_secs(30);
    for commits in [true, false] {
        let id = RecordId::new("renew", uuid::Uuid::new_v4().to_string());
        let Reservation::Reserved(token) = store
            .reserve(&id, &binding(), lease, lifetime)
            .await
            .unwrap()
        else {
            panic!("a free key is reserved");
        };
        let transaction = store
            .reserved_transaction(&id, token)
            .await
            .unwrap()
            .expect("the reservation's transaction is handed over");
        if commits {
            transaction.commit().await.unwrap();
            tokio::time::sleep(Duration::from_millis(600)).await;
            assert_eq!(
                store.renew(&id, token, lease).await.unwrap(),
                Ownership::Held
            );
            // 1.2 s after the commit: the first lease has lapsed, the renewed one has not.
            tokio::time::sleep(Duration::from_millis(600)).await;
            let record = store.load(&id).await.unwrap().expect("the record is live");
            assert!(
                matches!(
                    record.state,
                    idempotency_core::RecordState::InFlight {
                        lease_lapsed: false,
                        ..
                    }
                ),
                "the renewal extended the committed record's lease: {record:?}"
            );
        } else {
            transaction.rollback().await.unwrap();
            assert_eq!(
                store.renew(&id, token, lease).await.unwrap(),
                Ownership::Lost,
                "after a rollback nothing holds the key"
            );
        }
        assert_eq!(store.release(&id, token).await.unwrap(), Ownership::Held);
        assert_eq!(store.load(&id).await.unwrap(), None);
    }
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

    let Reservation::Reserved(token) = store.reserve(&id, &binding, lease, lifetime).await.unwrap()
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

    let Reservation::Reserved(token) = store.reserve(&id, &binding, lease, lifetime).await.unwrap()
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

/// Two transactions of `pool` that each lock their first statement's resource, then
/// wait for the other's (the second statement): the server ends one of them as a deadlock
/// victim. Both second statements' results come back; the transactions roll back.
async fn deadlocked<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
    [first_a, first_b]: [String; 2],
    [second_a, second_b]: [String; 2],
) -> [Result<(), sqlx::Error>; 2]
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let mut a = pool.begin().await.unwrap();
    sqlx::Executor::execute(&mut *a, first_a.as_str())
        .await
        .unwrap();
    let mut b = pool.begin().await.unwrap();
    sqlx::Executor::execute(&mut *b, first_b.as_str())
        .await
        .unwrap();
    let a_waits = tokio::spawn(async move {
        sqlx::Executor::execute(&mut *a, second_a.as_str())
            .await
            .map(drop)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let b_result = sqlx::Executor::execute(&mut *b, second_b.as_str())
        .await
        .map(drop);
    drop(b);
    [a_waits.await.unwrap(), b_result]
}

/// The errors a reservation tells apart, raised for real: on PostgreSQL a lock not
/// available in time (busy) and a deadlock (tried again); on MariaDB a lock wait timeout
/// and a deadlock; on SQLite a write lock another connection keeps (busy); anything else
/// is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_are_told_apart() {
    use super::reserve::{Conflict, conflict};

    #[cfg(feature = "sqlite")]
    {
        use sqlx::ConnectOptions;
        use sqlx::sqlite::SqliteConnectOptions;

        let dir = tempfile::tempdir().unwrap();
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("busy.db"))
            .create_if_missing(true)
            .busy_timeout(Duration::ZERO);
        let (mut writer, mut other) = (
            options.connect().await.unwrap(),
            options.connect().await.unwrap(),
        );
        sqlx::Executor::execute(&mut writer, "BEGIN IMMEDIATE")
            .await
            .unwrap();
        let busy = sqlx::Executor::execute(&mut other, "BEGIN IMMEDIATE")
            .await
            .unwrap_err();
        assert_eq!(conflict(&busy), Conflict::Busy, "{busy}");
        let other_error = sqlx::Executor::execute(&mut writer, "SELECT * FROM no_such_table")
            .await
            .unwrap_err();
        assert_eq!(conflict(&other_error), Conflict::Other, "{other_error}");
    }

    if let Some(pool) = postgres_pool().await {
        let lock = rand_lock();
        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(lock)
            .execute(&mut *holder)
            .await
            .unwrap();
        let mut waiter = pool.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '50ms'")
            .execute(&mut *waiter)
            .await
            .unwrap();
        let timed_out = sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(lock)
            .execute(&mut *waiter)
            .await
            .unwrap_err();
        assert_eq!(conflict(&timed_out), Conflict::Busy, "{timed_out}");
        drop((holder, waiter));

        let (one, two) = (rand_lock(), rand_lock());
        let lock = |key: i64| format!("SELECT pg_advisory_xact_lock({key})");
        let results = deadlocked(&pool, [lock(one), lock(two)], [lock(two), lock(one)]).await;
        let victims: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        assert_eq!(victims.len(), 1, "{results:?}");
        assert_eq!(conflict(victims[0]), Conflict::Deadlock, "{}", victims[0]);

        let other = sqlx::query("SELECT 1/0").execute(&pool).await.unwrap_err();
        assert_eq!(conflict(&other), Conflict::Other, "{other}");
    }

    let Some(pool) = mysql_pool().await else {
        return;
    };
    let table = table();
    for statement in [
        format!("CREATE TABLE `{table}` (id INT PRIMARY KEY) ENGINE = InnoDB"),
        format!("INSERT INTO `{table}` VALUES (1), (2)"),
    ] {
        sqlx::query(&statement).execute(&pool).await.unwrap();
    }
    let row = |id: i32| format!("SELECT id FROM `{table}` WHERE id = {id} FOR UPDATE");
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(&row(1)).execute(&mut *holder).await.unwrap();
    let mut waiter = pool.begin().await.unwrap();
    sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
        .execute(&mut *waiter)
        .await
        .unwrap();
    let timed_out = sqlx::query(&row(1))
        .execute(&mut *waiter)
        .await
        .unwrap_err();
    assert_eq!(conflict(&timed_out), Conflict::Busy, "{timed_out}");
    sqlx::query("SET SESSION innodb_lock_wait_timeout = DEFAULT")
        .execute(&mut *waiter)
        .await
        .unwrap();
    drop((holder, waiter));

    let results = deadlocked(&pool, [row(1), row(2)], [row(2), row(1)]).await;
    let victims: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(victims.len(), 1, "{results:?}");
    assert_eq!(conflict(victims[0]), Conflict::Deadlock, "{}", victims[0]);

    let other = sqlx::query("SELECT * FROM `no_such_table_here`")
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(conflict(&other), Conflict::Other, "{other}");
    drop_table(&pool, &format!("DROP TABLE IF EXISTS `{table}`")).await;
}

/// An advisory lock number no other test takes.
fn rand_lock() -> i64 {
    uuid::Uuid::new_v4().as_u64_pair().0 as i64
}

/// A transaction a handler drops rolls back before the next write begins: on SQLite, whose
/// one writer it held, the next `BEGIN IMMEDIATE` never meets the writer still held
/// ("database is locked"), even on a pool that never waits for a busy database (busy
/// timeout zero), and on another connection than the dropped one's.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_transaction_lets_the_writer_go_before_its_room() {
    use std::str::FromStr;

    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/dropped.db?mode=rwc", dir.path().display());
    let options = SqliteConnectOptions::from_str(&url)
        .unwrap()
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::ZERO);
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    let table = table();
    let records = crate::SqliteStore::new(pool.clone())
        .with_table_name(&table)
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let store = one_commit(records, &pool, &table).await;
    sqlx::query("CREATE TABLE writes (n INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    // Every connection open and idle, so that the next write begins on another one than
    // the dropped transaction's.
    let warm: Vec<_> = futures_util::future::join_all((0..4).map(|_| pool.acquire())).await;
    drop(warm);
    for n in 0..100 {
        let mut transaction = store
            .begin(None)
            .await
            .unwrap_or_else(|error| panic!("write {n} after a dropped one: {error}"));
        sqlx::query("INSERT INTO writes (n) VALUES (?)")
            .bind(n)
            .execute(&mut **transaction)
            .await
            .unwrap();
        drop(transaction);
    }
    let written: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM writes")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(written, 0, "every dropped transaction rolled back");
}
