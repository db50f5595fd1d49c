//! Checks that cargo-mutants found missing (see TESTING.md, "Mutation testing"), against
//! the real servers: what PostgreSQL's waiters do with their own key's notice and with
//! other keys'; and on the one-commit store, what a stale token settles of a newer
//! uncommitted reservation of its key, the bytes its uncommitted reservations count
//! against a scope's quota, what a full scope answers its own key, and what releasing
//! answers once another request's record holds the key; on MySQL/MariaDB, a full scope's replays and refusals.
#![cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Extension, Router};
use idempotency_core::{
    FullStore, IdempotencyLayer, IdempotencyStore, Ownership, RecordId, RecordState, Reservation,
    ReservationHandle, ScopeQuota, StoreError, Waited,
};
use idempotency_store_sql::{
    MySqlStore, OneCommitStore, PoolSettings, PostgresStore, RecordDatabase, SqliteStore,
    TableName, Tx, Writes,
};
use tower::ServiceExt as _;

use common::{drop_postgres_table, postgres_node, postgres_url};

/// Every record of a table is announced on one channel: a waiter looks at its record
/// again for its own key's announcement, not for every other key's. 10 waiters on one key
/// while 100 other keys are finalized send a few queries each (a load at the start, one a
/// second, one when woken), not one per announcement (1 000). The waiters' pool counts
/// every query they send.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_do_not_look_again_for_other_keys_notices() {
    let Some(owner) = postgres_node(&common::unique_table()).await else {
        return;
    };
    let owner = owner.migrate().await.expect("migrate");
    let (waiters_node, queries) = common::counting_postgres_node(&owner).await;

    let waited = common::id();
    let token = common::reserved(&owner, &waited).await;
    // Start the listener first, so that the count is the waiters' alone.
    let _ = waiters_node
        .wait(&common::id(), Duration::ZERO)
        .await
        .unwrap();
    let waiters: Vec<_> = (0..10)
        .map(|_| {
            let store = waiters_node.clone();
            let id = waited.clone();
            tokio::spawn(async move { store.wait(&id, Duration::from_secs(20)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = queries.load(Ordering::Relaxed);
    let started = tokio::time::Instant::now();
    for _ in 0..100 {
        let other = common::id();
        let token = common::reserved(&owner, &other).await;
        assert_eq!(
            owner
                .finalize(&other, token, &common::response(b"other"))
                .await
                .unwrap(),
            Ownership::Held
        );
    }
    assert_eq!(
        owner
            .finalize(&waited, token, &common::response(b"done"))
            .await
            .unwrap(),
        Ownership::Held
    );
    for waiter in waiters {
        assert!(matches!(waiter.await.unwrap().unwrap(), Waited::Settled(_)));
    }
    let spent = queries.load(Ordering::Relaxed) - before;
    // One when woken, and one for each second the 100 finalizes took.
    let seconds = started.elapsed().as_secs() as usize;
    assert!(
        spent <= 10 * (seconds + 3),
        "10 waiters sent {spent} queries in {seconds} s while 100 other keys settled"
    );
    drop_postgres_table(&owner).await;
}

/// A PostgreSQL waiter looks at its record once a second, and at once when its own
/// key's announcement comes: a finalize between two looks (1.3 s after the waiter began,
/// 0.7 s before its next look) wakes it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_its_own_notice_between_two_looks() {
    let Some(owner) = postgres_node(&common::unique_table()).await else {
        return;
    };
    let owner = owner.migrate().await.expect("migrate");
    let waiters_node = postgres_node(owner.table_name().as_str()).await.unwrap();
    let id = common::id();
    let token = common::reserved(&owner, &id).await;
    // Start the listener first.
    let _ = waiters_node
        .wait(&common::id(), Duration::ZERO)
        .await
        .unwrap();
    let waiter = {
        let id = id.clone();
        tokio::spawn(async move { waiters_node.wait(&id, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let finalized_at = tokio::time::Instant::now();
    assert_eq!(
        owner
            .finalize(&id, token, &common::response(b"done"))
            .await
            .unwrap(),
        Ownership::Held
    );
    assert!(matches!(waiter.await.unwrap().unwrap(), Waited::Settled(_)));
    let woken_after = finalized_at.elapsed();
    assert!(
        woken_after < Duration::from_millis(400),
        "a waiter woke {woken_after:?} after its record was finalized"
    );
    drop_postgres_table(&owner).await;
}

/// The one-commit store on a fresh table of `url`'s database, its handlers' pool of the
/// driver `DB`, with the typed store `typed` (on that table) keeping what is committed.
async fn one_commit<DB: RecordDatabase>(
    url: &str,
    table: &str,
    typed: Arc<dyn FullStore>,
) -> OneCommitStore<DB> {
    let handlers = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(8)
        .connect(url)
        .await
        .expect("the handlers' pool");
    OneCommitStore::new(typed, handlers, &TableName::new(table).unwrap())
        .await
        .expect("the one-commit store")
}

/// A reservation released, then the key reserved again: the first reservation's token
/// is stale, and releasing or finalizing under it touches nothing of the second, which
/// is not committed yet (it is the handlers' open transaction, or on SQLite this
/// process's claim) and finalizes as usual. (Not on MariaDB: there the typed store's
/// statements under the stale token wait for the newer reservation's row lock, until
/// `innodb_lock_wait_timeout`.)
async fn a_stale_token_settles_nothing_of_a_newer_reservation<DB: RecordDatabase>(
    store: &OneCommitStore<DB>,
) {
    let id = common::id();
    let binding = common::binding();
    let uncommitted = |reservation| match reservation {
        Reservation::Reserved(token) => token,
        other => panic!("a free key answered {other:?}"),
    };
    let stale = uncommitted(
        store
            .reserve(&id, &binding, common::LONG, common::LONG)
            .await
            .unwrap(),
    );
    assert_eq!(store.release(&id, stale).await.unwrap(), Ownership::Held);
    let token = uncommitted(
        store
            .reserve(&id, &binding, common::LONG, common::LONG)
            .await
            .unwrap(),
    );
    assert_eq!(
        store.release(&id, stale).await.unwrap(),
        Ownership::Lost,
        "a stale token released the newer reservation"
    );
    assert_eq!(
        store
            .finalize(&id, stale, &common::response(b"stale"))
            .await
            .unwrap(),
        Ownership::Lost,
        "a stale token finalized the newer reservation"
    );
    assert_eq!(
        store
            .finalize(&id, token, &common::response(b"done"))
            .await
            .unwrap(),
        Ownership::Held
    );
    let record = store
        .load(&id)
        .await
        .unwrap()
        .expect("the finalized record");
    assert_eq!(
        record.state,
        RecordState::Completed(common::response(b"done"))
    );
}

/// A byte quota counts the bytes of this process's reservations not committed yet: with
/// room for two reservations' bytes, two uncommitted ones in the scope leave none for a
/// third (and a scope's count is its own: another scope's reservations count nothing).
async fn uncommitted_reservations_count_their_bytes<DB: RecordDatabase>(store: OneCommitStore<DB>) {
    let scope = format!("bytes-{}", uuid::Uuid::new_v4());
    let binding = common::binding();
    let ids: Vec<_> = ["key-1", "key-2", "key-3"]
        .iter()
        .map(|key| RecordId::new(scope.clone(), *key))
        .collect();
    let each = ids[0].reserved_bytes(&binding);
    let store = store.with_scope_quota(ScopeQuota::default().with_max_bytes(2 * each));
    let mut held = Vec::new();
    for id in &ids[..2] {
        match store
            .reserve(id, &binding, common::LONG, common::LONG)
            .await
            .unwrap()
        {
            Reservation::Reserved(token) => held.push((id, token)),
            other => panic!("a scope with room answered {other:?}"),
        }
    }
    match store
        .reserve(&ids[2], &binding, common::LONG, common::LONG)
        .await
    {
        Err(StoreError::QuotaExceeded { bound, .. }) => {
            assert_eq!(bound, format!("{} bytes", 2 * each));
        }
        other => panic!("a third reservation past the byte quota answered {other:?}"),
    }
    // Another scope is not affected.
    let elsewhere = RecordId::new(format!("other-{}", uuid::Uuid::new_v4()), "key-1");
    match store
        .reserve(&elsewhere, &binding, common::LONG, common::LONG)
        .await
        .unwrap()
    {
        Reservation::Reserved(token) => held.push((&elsewhere, token)),
        other => panic!("another scope answered {other:?}"),
    }
    for (id, token) in held {
        assert_eq!(store.release(id, token).await.unwrap(), Ownership::Held);
    }
}

/// A scope with room for one record, full, never refuses its own key: a duplicate of
/// an uncommitted reservation is told the key is busy, and a retry of a committed record
/// gets that record; only another key is refused.
async fn a_full_scope_answers_its_own_key<DB: RecordDatabase>(store: OneCommitStore<DB>) {
    let store = store.with_scope_quota(ScopeQuota::default().with_max_records(1));
    let id = common::id();
    let binding = common::binding();
    let reserve = |id: RecordId| {
        let (store, binding) = (&store, binding.clone());
        async move {
            store
                .reserve(&id, &binding, common::LONG, common::LONG)
                .await
        }
    };
    let Ok(Reservation::Reserved(token)) = reserve(id.clone()).await else {
        panic!("an empty scope did not reserve");
    };
    match reserve(id.clone()).await {
        Ok(Reservation::Busy) => {}
        other => {
            panic!("a duplicate of an uncommitted reservation in a full scope answered {other:?}")
        }
    }
    assert_eq!(
        store
            .finalize(&id, token, &common::response(b"done"))
            .await
            .unwrap(),
        Ownership::Held
    );
    match reserve(id.clone()).await {
        Ok(Reservation::Exists(record)) => assert_eq!(
            record.state,
            RecordState::Completed(common::response(b"done"))
        ),
        other => panic!("a retry of the committed record of a full scope answered {other:?}"),
    }
    match reserve(RecordId::new(id.scope.clone(), "another")).await {
        Err(StoreError::QuotaExceeded { .. }) => {}
        other => panic!("another key in a full scope answered {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_postgres_a_full_scope_answers_its_own_key() {
    let Some((store, typed)) = postgres_one_commit().await else {
        return;
    };
    a_full_scope_answers_its_own_key(store).await;
    drop_postgres_table(&typed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_sqlite_a_full_scope_answers_its_own_key() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_one_commit(dir.path()).await;
    a_full_scope_answers_its_own_key(store).await;
}

/// A one-commit store on PostgreSQL, on a migrated table of its own, and the typed store
/// that keeps its records; `None` (after `common::unreachable`) without a server.
async fn postgres_one_commit() -> Option<(OneCommitStore<sqlx::Postgres>, PostgresStore)> {
    let table = common::unique_table();
    let typed = postgres_node(&table)
        .await?
        .migrate()
        .await
        .expect("migrate");
    let store = one_commit(&postgres_url(), &table, Arc::new(typed.clone())).await;
    Some((store, typed))
}

/// A one-commit store on a SQLite file in `dir`.
async fn sqlite_one_commit(dir: &std::path::Path) -> OneCommitStore<sqlx::Sqlite> {
    let url = format!("sqlite://{}/one.db?mode=rwc", dir.display());
    let table = common::unique_table();
    let typed = SqliteStore::connect(&url, &PoolSettings::default())
        .await
        .expect("open the SQLite file")
        .with_table_name(&table)
        .unwrap()
        .migrate()
        .await
        .expect("migrate");
    one_commit(&url, &table, Arc::new(typed)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_postgres_counts_uncommitted_bytes() {
    let Some((store, typed)) = postgres_one_commit().await else {
        return;
    };
    uncommitted_reservations_count_their_bytes(store).await;
    drop_postgres_table(&typed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_sqlite_counts_uncommitted_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_one_commit(dir.path()).await;
    uncommitted_reservations_count_their_bytes(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_postgres_a_stale_token_settles_nothing() {
    let Some((store, typed)) = postgres_one_commit().await else {
        return;
    };
    a_stale_token_settles_nothing_of_a_newer_reservation(&store).await;
    drop_postgres_table(&typed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_sqlite_a_stale_token_settles_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_one_commit(dir.path()).await;
    a_stale_token_settles_nothing_of_a_newer_reservation(&store).await;
}

/// What the handler below saw: the typed replica's reservation, and what releasing the
/// one-commit reservation answered.
type Seen = Arc<Mutex<Option<(Reservation, Ownership)>>>;

/// Takes the reservation's transaction and rolls it back; another replica (a typed store
/// on the table) then reserves the key, and the one-commit reservation is released.
async fn rolled_back_then_taken_elsewhere(
    State((store, typed, seen)): State<(Arc<OneCommitStore<sqlx::Postgres>>, PostgresStore, Seen)>,
    Extension(reservation): Extension<ReservationHandle>,
) -> StatusCode {
    let tx = Tx::begin(&Writes::with_records(store.clone()), Some(&reservation))
        .await
        .unwrap();
    tx.rollback();
    let (id, token) = (reservation.id().clone(), reservation.token());
    // The rollback of a dropped transaction reaches the server a moment later: until
    // then its lock holds the key, and the replica finds it busy.
    let mut other = Reservation::Busy;
    for _ in 0..100 {
        other = typed
            .reserve(&id, &common::binding(), common::LONG, common::LONG)
            .await
            .unwrap();
        if other != Reservation::Busy {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let released = store.release(&id, token).await.unwrap();
    *seen.lock().unwrap() = Some((other, released));
    StatusCode::SERVICE_UNAVAILABLE
}

/// A handler took its reservation's transaction and rolled it back, and another
/// replica's request reserved the key meanwhile: releasing the first reservation then
/// finds nothing of its own, and another request's record holding the key, and answers
/// `Lost` (releasing left the key held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_on_postgres_a_release_after_the_key_was_taken_elsewhere_is_lost() {
    let Some((store, typed)) = postgres_one_commit().await else {
        return;
    };
    let store = Arc::new(store);
    let seen: Seen = Arc::default();
    let app = Router::new()
        .route("/effects", post(rolled_back_then_taken_elsewhere))
        .with_state((store.clone(), typed.clone(), seen.clone()))
        .layer(IdempotencyLayer::from_shared_store(store.clone()));
    let response = app
        .oneshot(
            Request::post("/effects")
                .header("idempotency-key", "taken-elsewhere")
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let (other, released) = seen.lock().unwrap().take().expect("the handler ran");
    assert!(
        matches!(other, Reservation::Reserved(_)),
        "the other replica could not reserve the key once the transaction rolled back: \
         {other:?}"
    );
    assert_eq!(
        released,
        Ownership::Lost,
        "releasing answered Held with another request's record holding the key"
    );
    drop(store);
    drop_postgres_table(&typed).await;
}

fn mysql_url() -> String {
    std::env::var("IDEMPOTENCY_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A MariaDB store on a fresh migrated table, on a pool that counts the connections
/// handed back to it.
async fn counted_mysql_store() -> Option<(MySqlStore, Arc<AtomicUsize>)> {
    let released = Arc::new(AtomicUsize::new(0));
    let counted = released.clone();
    let pool = match sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .after_release(move |_, _| {
            counted.fetch_add(1, Ordering::Relaxed);
            Box::pin(async { Ok(true) })
        })
        .connect(&mysql_url())
        .await
    {
        Ok(pool) => pool,
        Err(error) => {
            return common::unreachable(
                "MariaDB",
                &mysql_url(),
                "IDEMPOTENCY_TEST_MYSQL_URL",
                error,
            );
        }
    };
    let store = MySqlStore::new(pool)
        .with_table_name(&common::unique_table())
        .unwrap()
        .migrate()
        .await
        .expect("migrate");
    Some((store, released))
}

/// The count once it has stopped moving for 50 ms.
async fn settled(count: &AtomicUsize) -> usize {
    let mut last = count.load(Ordering::Relaxed);
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = count.load(Ordering::Relaxed);
        if now == last {
            return now;
        }
        last = now;
    }
}

/// A scope with room for one record, full: a replay of its record is answered from it
/// (never refused), a new key is refused at once (a refusal is not a deadlock, and is
/// not tried again: one connection, not one per attempt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_full_scope_replays_and_refuses_at_once() {
    let Some((store, released)) = counted_mysql_store().await else {
        return;
    };
    let store = store.with_scope_quota(ScopeQuota::default().with_max_records(1));
    let scope = format!("full-{}", uuid::Uuid::new_v4());
    let first = RecordId::new(scope.clone(), "first");
    let token = common::reserved(&store, &first).await;
    assert_eq!(
        store
            .finalize(&first, token, &common::response(b"done"))
            .await
            .unwrap(),
        Ownership::Held
    );
    match store
        .reserve(&first, &common::binding(), common::LONG, common::LONG)
        .await
    {
        Ok(Reservation::Exists(record)) => {
            assert_eq!(
                record.state,
                RecordState::Completed(common::response(b"done"))
            );
        }
        other => panic!("a replay in a full scope answered {other:?}"),
    }
    // sqlx hands a dropped connection back to the pool in a task of its own: let the
    // earlier calls' returns land before counting.
    let before = settled(&released).await;
    match store
        .reserve(
            &RecordId::new(scope, "second"),
            &common::binding(),
            common::LONG,
            common::LONG,
        )
        .await
    {
        Err(StoreError::QuotaExceeded { .. }) => {}
        other => panic!("a new key in a full scope answered {other:?}"),
    }
    let used = settled(&released).await - before;
    assert!(
        used <= 2,
        "a refused reservation used {used} pooled connections"
    );
    sqlx::query(&format!("DROP TABLE IF EXISTS `{}`", store.table_name()))
        .execute(store.pool())
        .await
        .expect("drop table");
}
