//! SQLite: the conformance suite and multi-pool checks on a temporary database file.
#![cfg(feature = "sqlite")]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{FullStore, IdempotencyStore};
use idempotency_store_sql::{PoolSettings, SqliteStore};

/// A "node": a store with a pool of its own on the database file at `path`.
async fn node(path: &Path, table: &str) -> SqliteStore {
    let url = format!("sqlite:{}", path.display());
    SqliteStore::connect(&url, &PoolSettings::default().max_connections(4))
        .await
        .expect("open the SQLite file")
        .with_table_name(table)
        .expect("valid table name")
}

/// A node on the table `records` of the file at `path`, migrated.
async fn migrated(path: &Path) -> SqliteStore {
    node(path, "records")
        .await
        .migrate()
        .await
        .expect("migrate")
}

fn temp_db() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("idempotency.db");
    (dir, path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_conformance_suite_with_two_pools() {
    let (_dir, path) = temp_db();
    let store = node(&path, "idempotency_records")
        .await
        .migrate()
        .await
        .expect("migrate");
    let second_pool = node(&path, "idempotency_records").await;
    common::passes_every_check(common::shared(store), common::shared(second_pool)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_pools_migrate_at_once_and_again() {
    let (_dir, path) = temp_db();
    let table = common::unique_table();
    let mut nodes = Vec::new();
    for _ in 0..8 {
        nodes.push(node(&path, &table).await);
    }
    let results =
        futures_util::future::join_all(nodes.iter().cloned().map(SqliteStore::migrate)).await;
    for result in results {
        result.expect("a concurrent migrate failed");
    }
    let store = nodes[0].clone().migrate().await.expect("second migrate");
    let index: String = sqlx::query_scalar(
        "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ?1 AND sql IS NOT NULL",
    )
    .bind(&table)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert!(index.contains("(expires_at_ms)"), "{index}");
}

/// The table as release 0.1.0 created it (before `response_trailers`): eight pools
/// migrate it at once (each checks the catalog, then adds the column), then again; its
/// rows still replay and new ones keep trailers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_pools_upgrade_a_table_of_the_previous_release() {
    let (_dir, path) = temp_db();
    let table = common::unique_table();
    let first = node(&path, &table).await;
    let old_ddl = format!(
        "CREATE TABLE \"{table}\" (
            scope               TEXT    NOT NULL,
            idempotency_key     TEXT    NOT NULL,
            method              TEXT    NOT NULL,
            path                TEXT    NOT NULL,
            body_sha256         BLOB    NOT NULL,
            fencing_token       BIGINT  NOT NULL,
            created_at_ms       BIGINT  NOT NULL,
            expires_at_ms       BIGINT  NOT NULL,
            lease_expires_at_ms BIGINT  NOT NULL,
            response_status     INTEGER NULL,
            response_headers    BLOB    NULL,
            response_body       BLOB    NULL,
            PRIMARY KEY (scope, idempotency_key)
        );
        CREATE INDEX \"{table}_expires_idx\" ON \"{table}\" (expires_at_ms);
        INSERT INTO \"{table}\" {}",
        common::OLD_ROW
    );
    sqlx::raw_sql(&old_ddl)
        .execute(first.pool())
        .await
        .expect("create the old table");
    let mut nodes = vec![first];
    for _ in 1..8 {
        nodes.push(node(&path, &table).await);
    }
    let results =
        futures_util::future::join_all(nodes.iter().cloned().map(SqliteStore::migrate)).await;
    for result in results {
        result.expect("a concurrent migrate of the old table failed");
    }
    let store = nodes[0].clone().migrate().await.expect("second migrate");
    common::check_upgraded_table(common::shared(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_pools_purge_at_once() {
    let (_dir, path) = temp_db();
    let first = migrated(&path).await;
    let mut nodes: Vec<Arc<dyn FullStore>> = vec![Arc::new(first)];
    for _ in 0..2 {
        nodes.push(Arc::new(node(&path, "records").await));
    }
    idempotency_core::conformance::concurrent_purges(&nodes[0], &nodes[1]).await;
    idempotency_core::conformance::concurrent_purges(&nodes[2], &nodes[0]).await;
}

#[tokio::test]
async fn records_survive_reopening_the_file() {
    let (_dir, path) = temp_db();
    let id = common::id();
    {
        let store = migrated(&path).await;
        let token = common::reserved(&store, &id).await;
        store
            .finalize(&id, token, &common::response(b"kept"))
            .await
            .unwrap();
        store.pool().close().await;
    }
    let reopened = migrated(&path).await;
    assert_eq!(
        reopened.load(&id).await.unwrap().unwrap().state,
        idempotency_core::RecordState::Completed(common::response(b"kept"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_database_keeps_its_records() {
    let store = SqliteStore::connect("sqlite::memory:", &PoolSettings::default())
        .await
        .expect("open in-memory SQLite")
        .migrate()
        .await
        .expect("migrate");
    idempotency_core::conformance::tokens_are_never_reused(&common::shared(store.clone())).await;
    idempotency_core::conformance::lapsed_owner_may_finish_until_taken_over(&common::shared(
        store.clone(),
    ))
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    idempotency_core::conformance::finalize_then_replay(&common::shared(store)).await;
}

#[tokio::test]
async fn quoted_mixed_case_table_name_works() {
    let (_dir, path) = temp_db();
    let store = node(&path, "Order").await.migrate().await.expect("migrate");
    idempotency_core::conformance::tokens_are_never_reused(&common::shared(store.clone())).await;
}

#[tokio::test]
async fn bad_table_names_are_rejected() {
    let (_dir, path) = temp_db();
    let store = node(&path, "records").await;
    for name in [
        "",
        "1x",
        "a-b",
        "x\"; DROP TABLE y; --",
        "naïve",
        &"t".repeat(64),
    ] {
        let error = store.clone().with_table_name(name).unwrap_err();
        assert!(
            error.to_string().contains("invalid idempotency table name"),
            "{error}"
        );
    }
    assert_eq!(
        SqliteStore::new(store.pool().clone()).table_name().as_str(),
        "idempotency_records"
    );
}

#[tokio::test]
async fn shows_the_sql_it_runs_on_its_own_table() {
    use idempotency_store_sql::Operation;
    let (_dir, path) = temp_db();
    let store = node(&path, "audited_records").await;
    for operation in [
        Operation::Reserve,
        Operation::Load,
        Operation::Renew,
        Operation::Finalize,
        Operation::Release,
        Operation::TakeOver,
        Operation::Purge,
    ] {
        assert!(
            store.sql(operation).contains("\"audited_records\""),
            "{operation:?}: {}",
            store.sql(operation)
        );
    }
    assert!(store.sql(Operation::Finalize).contains("fencing_token"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enforces_a_scope_quota_across_two_pools() {
    use idempotency_core::ScopeQuota;
    let (_dir, path) = temp_db();
    let quota = ScopeQuota::default().with_max_records(5);
    let a = migrated(&path).await;
    let one: Arc<dyn FullStore> = Arc::new(a.clone().with_scope_quota(quota));
    idempotency_core::conformance::scope_quota_holds_under_concurrency(&one, 5).await;
    let racing = Arc::new(a.with_scope_quota(quota));
    let other = Arc::new(node(&path, "records").await.with_scope_quota(quota));
    let scope = format!("racing-{}", uuid::Uuid::new_v4());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..40 {
        let store = if i % 2 == 0 {
            racing.clone()
        } else {
            other.clone()
        };
        let id = idempotency_core::RecordId::new(scope.clone(), format!("k{i}"));
        tasks.spawn(async move {
            store
                .reserve(&id, &common::binding(), common::LONG, common::LONG)
                .await
        });
    }
    let mut won = 0;
    while let Some(result) = tasks.join_next().await {
        match result.unwrap() {
            Ok(idempotency_core::Reservation::Reserved(_)) => won += 1,
            Err(idempotency_core::StoreError::QuotaExceeded { retry_after, .. }) => {
                assert!(retry_after.is_some_and(|after| after <= common::LONG));
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(won, 5);
}

/// The store commits the writes that wait together (group commit); each is answered only
/// once it is committed, so another pool on the file sees it the moment its caller does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writes_are_answered_once_committed() {
    use idempotency_core::RecordState;
    let (_dir, path) = temp_db();
    let store = migrated(&path).await;
    let observer = node(&path, "records").await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let (store, observer) = (store.clone(), observer.clone());
        tasks.spawn(async move {
            let id = idempotency_core::RecordId::new("group", format!("k{i}"));
            let token = common::reserved(&store, &id).await;
            let seen = observer.load(&id).await.expect("load").expect("committed");
            assert!(matches!(seen.state, RecordState::InFlight { token: t, .. } if t == token));
            let ownership = store
                .finalize(&id, token, &common::response(b"done"))
                .await
                .expect("finalize");
            assert_eq!(ownership, idempotency_core::Ownership::Held);
            let seen = observer.load(&id).await.expect("load").expect("committed");
            assert_eq!(
                seen.state,
                RecordState::Completed(common::response(b"done"))
            );
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a writer task failed");
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM records")
        .fetch_one(observer.pool())
        .await
        .unwrap();
    assert_eq!(rows, 64);
}

/// A write that fails inside a group commit fails alone: the others of its batch are run
/// again without it and committed. A second connection holds the write lock while the
/// writes queue, so that they do form one batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_that_fails_in_a_batch_fails_alone() {
    use idempotency_core::{Reservation, StoreError};
    let (_dir, path) = temp_db();
    let store = migrated(&path).await;
    let other = node(&path, "records").await;
    sqlx::query(
        "CREATE TRIGGER poison BEFORE INSERT ON records WHEN NEW.idempotency_key = 'poison'
         BEGIN SELECT RAISE(ABORT, 'this key is poisoned'); END",
    )
    .execute(other.pool())
    .await
    .unwrap();
    let mut blocker = other.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    // The first write takes the turn and waits for the lock; every later one queues,
    // the poisoned one last.
    for i in 0..32 {
        let store = store.clone();
        let key = if i == 31 {
            "poison".to_owned()
        } else {
            format!("k{i}")
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        tasks.spawn(async move {
            let id = idempotency_core::RecordId::new("batch", key.clone());
            let reserved = store
                .reserve(&id, &common::binding(), common::LONG, common::LONG)
                .await;
            (key, reserved)
        });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("SELECT 1")
        .execute(&mut *blocker)
        .await
        .unwrap();
    blocker.commit().await.unwrap();
    while let Some(done) = tasks.join_next().await {
        match done.expect("task") {
            (key, Err(StoreError::Backend(error))) if key == "poison" => {
                assert!(error.to_string().contains("poisoned"), "{error}");
            }
            (key, Ok(Reservation::Reserved(_))) if key != "poison" => {}
            (key, other) => panic!("{key}: {other:?}"),
        }
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM records")
        .fetch_one(other.pool())
        .await
        .unwrap();
    assert_eq!(rows, 31);
}

/// A replay is a plain read: it is answered while another connection holds SQLite's one
/// write lock, where a reserve that wrote would wait for it (up to the busy timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_does_not_wait_for_the_write_lock() {
    use idempotency_core::{RecordState, Reservation};
    let (_dir, path) = temp_db();
    let store = migrated(&path).await;
    let id = common::id();
    let token = common::reserved(&store, &id).await;
    store
        .finalize(&id, token, &common::response(b"kept"))
        .await
        .unwrap();
    let other = node(&path, "records").await;
    let writer = other.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let replay = tokio::time::timeout(
        Duration::from_secs(1),
        store.reserve(&id, &common::binding(), common::LONG, common::LONG),
    )
    .await
    .expect("the replay waited for the write lock");
    let Ok(Reservation::Exists(record)) = replay else {
        panic!("{replay:?}")
    };
    assert_eq!(
        record.state,
        RecordState::Completed(common::response(b"kept"))
    );
    writer.rollback().await.unwrap();
}
