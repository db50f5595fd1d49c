//! MySQL / MariaDB: the conformance suite and multi-node checks against a real server
//! (`IDEMPOTENCY_TEST_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`).
#![cfg(feature = "mysql")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{FullStore, IdempotencyStore};
use idempotency_store_sql::{MySqlStore, PoolSettings};

use common::{MYSQL_ENV as ENV, mysql_node as node, mysql_url as url};

async fn drop_table(store: &MySqlStore) {
    sqlx::query(&format!("DROP TABLE IF EXISTS `{}`", store.table_name()))
        .execute(store.pool())
        .await
        .expect("drop table");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_conformance_suite_with_two_nodes() {
    let table = common::unique_table();
    let Some(store) = node(&table).await else {
        return;
    };
    let Some(second_node) = node(&table).await else {
        return;
    };
    let store = store.migrate().await.expect("migrate");
    common::passes_every_check(common::shared(store.clone()), common::shared(second_node)).await;
    drop_table(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_nodes_migrate_at_once_and_again() {
    let table = common::unique_table();
    let mut nodes = Vec::new();
    for _ in 0..8 {
        let Some(store) = node(&table).await else {
            return;
        };
        nodes.push(store);
    }
    let results =
        futures_util::future::join_all(nodes.iter().cloned().map(MySqlStore::migrate)).await;
    for result in results {
        result.expect("a concurrent migrate failed");
    }
    let store = nodes[0].clone().migrate().await.expect("second migrate");
    let (engine, collation): (String, String) = sqlx::query_as(
        "SELECT CAST(engine AS CHAR), CAST(table_collation AS CHAR) FROM information_schema.tables
         WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(&table)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(
        (engine.as_str(), collation.as_str()),
        ("InnoDB", "utf8mb4_bin")
    );
    let indexed: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(column_name AS CHAR) FROM information_schema.statistics
         WHERE table_schema = DATABASE() AND table_name = ? ORDER BY index_name, seq_in_index",
    )
    .bind(&table)
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert!(indexed.contains(&"expires_at_ms".to_owned()), "{indexed:?}");
    let body_type: String = sqlx::query_scalar(
        "SELECT CAST(data_type AS CHAR) FROM information_schema.columns
         WHERE table_schema = DATABASE() AND table_name = ? AND column_name = 'response_body'",
    )
    .bind(&table)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(body_type.to_ascii_lowercase(), "longblob");
    drop_table(&store).await;
}

/// The table as release 0.1.0 created it (before `response_trailers`): eight nodes
/// migrate it at once (each checks the catalog, then adds the column, so most race),
/// then again; its rows still replay and new ones keep trailers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_nodes_upgrade_a_table_of_the_previous_release() {
    let table = common::unique_table();
    let Some(first) = node(&table).await else {
        return;
    };
    let old_ddl = format!(
        "CREATE TABLE `{table}` (
            scope               VARCHAR(255) NOT NULL,
            idempotency_key     VARCHAR(255) NOT NULL,
            method              VARCHAR(255) NOT NULL,
            path                TEXT         NOT NULL,
            body_sha256         BINARY(32)   NOT NULL,
            fencing_token       BIGINT       NOT NULL,
            created_at_ms       BIGINT       NOT NULL,
            expires_at_ms       BIGINT       NOT NULL,
            lease_expires_at_ms BIGINT       NOT NULL,
            response_status     INT          NULL,
            response_headers    MEDIUMBLOB   NULL,
            response_body       LONGBLOB     NULL,
            PRIMARY KEY (scope, idempotency_key),
            KEY `{table}_expires_idx` (expires_at_ms)
        ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
    );
    sqlx::raw_sql(&old_ddl)
        .execute(first.pool())
        .await
        .expect("create the old table");
    sqlx::raw_sql(&format!("INSERT INTO `{table}` {}", common::OLD_ROW))
        .execute(first.pool())
        .await
        .expect("insert the old row");
    let mut nodes = vec![first];
    for _ in 1..8 {
        nodes.push(node(&table).await.expect("second node"));
    }
    let results =
        futures_util::future::join_all(nodes.iter().cloned().map(MySqlStore::migrate)).await;
    for result in results {
        result.expect("a concurrent migrate of the old table failed");
    }
    let store = nodes[0].clone().migrate().await.expect("second migrate");
    common::check_upgraded_table(common::shared(store.clone())).await;
    drop_table(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_purge_at_once() {
    let table = common::unique_table();
    let mut nodes: Vec<Arc<dyn FullStore>> = Vec::new();
    let Some(first) = node(&table).await else {
        return;
    };
    let first = first.migrate().await.expect("migrate");
    nodes.push(Arc::new(first.clone()));
    for _ in 0..2 {
        let Some(store) = node(&table).await else {
            return;
        };
        nodes.push(Arc::new(store));
    }
    idempotency_core::conformance::concurrent_purges(&nodes[0], &nodes[1]).await;
    idempotency_core::conformance::concurrent_purges(&nodes[2], &nodes[0]).await;
    drop_table(&first).await;
}

#[tokio::test]
async fn quoted_mixed_case_table_name_works() {
    let table = format!("Idem{}", &common::unique_table()[4..]);
    let Some(store) = node(&table).await else {
        return;
    };
    let store = store.migrate().await.expect("migrate");
    idempotency_core::conformance::tokens_are_never_reused(&common::shared(store.clone())).await;
    drop_table(&store).await;
}

#[tokio::test]
async fn bad_table_names_are_rejected() {
    // connect_lazy opens nothing, so this needs no server.
    let pool = sqlx::MySqlPool::connect_lazy(&url()).expect("url parses");
    for name in ["", "1x", "a-b", "x\"; DROP TABLE y; --", &"t".repeat(64)] {
        let error = MySqlStore::new(pool.clone())
            .with_table_name(name)
            .unwrap_err();
        assert!(
            error.to_string().contains("invalid idempotency table name"),
            "{error}"
        );
    }
    assert_eq!(
        MySqlStore::new(pool).table_name().as_str(),
        "idempotency_records"
    );
}

/// A reserve that conflicts with a row another transaction inserted and has not yet
/// committed waits for it, then answers with that row: it neither fails nor wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_waits_for_an_uncommitted_insert_of_the_key() {
    use idempotency_core::{RecordState, Reservation};

    let Some(store) = node(&common::unique_table()).await else {
        return;
    };
    let store = store.migrate().await.expect("migrate");
    let id = common::id();
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO `{}` (scope, idempotency_key, method, path, body_sha256, fencing_token,
             created_at_ms, expires_at_ms, lease_expires_at_ms)
         SELECT ?, ?, 'POST', '/v1/namespaces/db/tables?x=1', ?, 4242, n, n + 60000, n + 60000
         FROM (SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS n) AS c",
        store.table_name()
    ))
    .bind(&id.scope)
    .bind(&id.key)
    .bind(&[7u8; 32][..])
    .execute(&mut *tx)
    .await
    .unwrap();
    let racing = {
        let store = store.clone();
        let id = id.clone();
        tokio::spawn(async move {
            store
                .reserve(&id, &common::binding(), common::LONG, common::LONG)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !racing.is_finished(),
        "reserve should wait for the uncommitted insert"
    );
    tx.commit().await.unwrap();
    match racing.await.unwrap().expect("reserve failed") {
        Reservation::Exists(record) => assert_eq!(
            record.state,
            RecordState::InFlight {
                token: idempotency_core::FencingToken(4242),
                lease_lapsed: false
            }
        ),
        other => panic!("reserve of a key another transaction holds answered {other:?}"),
    }
    drop_table(&store).await;
}

/// Values wider than the MySQL schema are refused instead of being truncated (two long
/// scopes must never collide on a common prefix).
#[tokio::test]
async fn overlong_scopes_and_keys_are_refused() {
    let Some(store) = node(&common::unique_table()).await else {
        return;
    };
    let store = store.migrate().await.expect("migrate");
    let long = "s".repeat(256);
    for id in [
        idempotency_core::RecordId::new(long.clone(), "k"),
        idempotency_core::RecordId::new("s", long.clone()),
    ] {
        let error = store
            .reserve(&id, &common::binding(), common::LONG, common::LONG)
            .await
            .unwrap_err();
        assert!(
            error.to_string().contains("at most 255 characters"),
            "{error}"
        );
    }
    // 255 four-byte characters fit (the key columns are utf8mb4).
    let widest = idempotency_core::RecordId::new("😀".repeat(255), "k".repeat(255));
    assert!(matches!(
        store
            .reserve(&widest, &common::binding(), common::LONG, common::LONG)
            .await
            .unwrap(),
        idempotency_core::Reservation::Reserved(_)
    ));
    assert!(store.load(&widest).await.unwrap().is_some());
    drop_table(&store).await;
}

#[tokio::test]
async fn mariadb_scheme_is_accepted() {
    let url = url().replacen("mysql:", "mariadb:", 1);
    match MySqlStore::connect(&url, &PoolSettings::default()).await {
        Ok(_) => {}
        Err(error) => {
            let _: Option<()> = common::unreachable("MySQL", &url, ENV, error);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enforces_a_scope_quota_across_two_nodes() {
    use idempotency_core::ScopeQuota;
    let table = common::unique_table();
    let Some(a) = node(&table).await else { return };
    let Some(b) = node(&table).await else { return };
    let a = a.migrate().await.expect("migrate");
    let quota = ScopeQuota::default().with_max_records(5);
    let one: Arc<dyn FullStore> = Arc::new(a.clone().with_scope_quota(quota));
    idempotency_core::conformance::scope_quota_holds_under_concurrency(&one, 5).await;
    let racing = Arc::new(a.clone().with_scope_quota(quota));
    let other = Arc::new(b.with_scope_quota(quota));
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
    drop_table(&a).await;
}
