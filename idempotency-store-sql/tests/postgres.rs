//! PostgreSQL: the conformance suite and multi-node checks against a real server
//! (`IDEMPOTENCY_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`).
#![cfg(feature = "postgres")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{FullStore, IdempotencyStore};
use idempotency_store_sql::PostgresStore;

use common::{drop_postgres_table, postgres_node, postgres_url};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_conformance_suite_with_two_nodes() {
    let table = common::unique_table();
    let Some(store) = postgres_node(&table).await else {
        return;
    };
    let Some(second_node) = postgres_node(&table).await else {
        return;
    };
    let store = store.migrate().await.expect("migrate");
    common::passes_every_check(common::shared(store.clone()), common::shared(second_node)).await;
    drop_postgres_table(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_nodes_migrate_at_once_and_again() {
    let table = common::unique_table();
    let mut nodes = Vec::new();
    for _ in 0..8 {
        let Some(store) = postgres_node(&table).await else {
            return;
        };
        nodes.push(store);
    }
    let results =
        futures_util::future::join_all(nodes.iter().cloned().map(PostgresStore::migrate)).await;
    for result in results {
        result.expect("a concurrent migrate failed");
    }
    let store = nodes[0].clone().migrate().await.expect("second migrate");
    let indexes: Vec<String> =
        sqlx::query_scalar("SELECT indexdef FROM pg_indexes WHERE tablename = $1")
            .bind(&table)
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert!(
        indexes.iter().any(|def| def.contains("(expires_at_ms)")),
        "{indexes:?}"
    );
    assert!(
        indexes
            .iter()
            .any(|def| def.contains("UNIQUE") && def.contains("(scope, idempotency_key)")),
        "{indexes:?}"
    );
    let body_type: String = sqlx::query_scalar(
        "SELECT data_type FROM information_schema.columns WHERE table_name = $1 AND column_name = 'response_body'",
    )
    .bind(&table)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(body_type, "bytea");
    drop_postgres_table(&store).await;
}

/// The table as release 0.1.0 created it (before `response_trailers`): eight nodes
/// migrate it at once, then again; its rows still replay and new ones keep trailers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_nodes_upgrade_a_table_of_the_previous_release() {
    let table = common::unique_table();
    let Some(first) = postgres_node(&table).await else {
        return;
    };
    let old_ddl = format!(
        "CREATE TABLE \"{table}\" (
            scope               TEXT    NOT NULL,
            idempotency_key     TEXT    NOT NULL,
            method              TEXT    NOT NULL,
            path                TEXT    NOT NULL,
            body_sha256         BYTEA   NOT NULL,
            fencing_token       BIGINT  NOT NULL,
            created_at_ms       BIGINT  NOT NULL,
            expires_at_ms       BIGINT  NOT NULL,
            lease_expires_at_ms BIGINT  NOT NULL,
            response_status     INTEGER NULL,
            response_headers    BYTEA   NULL,
            response_body       BYTEA   NULL,
            PRIMARY KEY (scope, idempotency_key)
        );
        CREATE INDEX \"{table}_expires_idx\" ON \"{table}\" (expires_at_ms);
        INSERT INTO \"{table}\" {}",
        common::OLD_ROW.replace("X'", "'\\x")
    );
    sqlx::raw_sql(&old_ddl)
        .execute(first.pool())
        .await
        .expect("create the old table");
    let mut nodes = vec![first];
    for _ in 1..8 {
        nodes.push(postgres_node(&table).await.expect("second node"));
    }
    let results =
        futures_util::future::join_all(nodes.iter().cloned().map(PostgresStore::migrate)).await;
    for result in results {
        result.expect("a concurrent migrate of the old table failed");
    }
    let store = nodes[0].clone().migrate().await.expect("second migrate");
    common::check_upgraded_table(common::shared(store.clone())).await;
    drop_postgres_table(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_purge_at_once() {
    let table = common::unique_table();
    let mut nodes: Vec<Arc<dyn FullStore>> = Vec::new();
    let Some(first) = postgres_node(&table).await else {
        return;
    };
    let first = first.migrate().await.expect("migrate");
    nodes.push(Arc::new(first.clone()));
    for _ in 0..2 {
        let Some(store) = postgres_node(&table).await else {
            return;
        };
        nodes.push(Arc::new(store));
    }
    idempotency_core::conformance::concurrent_purges(&nodes[0], &nodes[1]).await;
    idempotency_core::conformance::concurrent_purges(&nodes[2], &nodes[0]).await;
    drop_postgres_table(&first).await;
}

#[tokio::test]
async fn quoted_mixed_case_table_name_works() {
    let table = format!("Idem{}", &common::unique_table()[4..]);
    let Some(store) = postgres_node(&table).await else {
        return;
    };
    let store = store.migrate().await.expect("migrate");
    idempotency_core::conformance::tokens_are_never_reused(&common::shared(store.clone())).await;
    drop_postgres_table(&store).await;
}

#[tokio::test]
async fn bad_table_names_are_rejected() {
    // connect_lazy opens nothing, so this needs no server.
    let pool = sqlx::PgPool::connect_lazy(&postgres_url()).expect("url parses");
    for name in ["", "1x", "a-b", "x\"; DROP TABLE y; --", &"t".repeat(64)] {
        let error = PostgresStore::new(pool.clone())
            .with_table_name(name)
            .unwrap_err();
        assert!(
            error.to_string().contains("invalid idempotency table name"),
            "{error}"
        );
    }
    assert_eq!(
        PostgresStore::new(pool).table_name().as_str(),
        "idempotency_records"
    );
}

/// A reserve that conflicts with a row inserted by a transaction committing *after* the
/// reserve statement began cannot see that row in its snapshot; it must still answer
/// with the row, not fail and not win.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_sees_a_row_committed_after_its_snapshot() {
    use idempotency_core::{RecordState, Reservation};

    let Some(store) = postgres_node(&common::unique_table()).await else {
        return;
    };
    let store = store.migrate().await.expect("migrate");
    let id = common::id();
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO \"{}\" (scope, idempotency_key, method, path, body_sha256, fencing_token,
             created_at_ms, expires_at_ms, lease_expires_at_ms)
         SELECT $1, $2, 'POST', '/v1/namespaces/db/tables?x=1', $3, 4242, n, n + 60000, n + 60000
         FROM (SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS n) AS c",
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
    drop_postgres_table(&store).await;
}

/// Duplicates waiting for an owner are woken by its announcement (LISTEN/NOTIFY), on any
/// node, and cost about one query a second each while they wait, not a poll every
/// 200 ms. The store's pool counts every query a waiter sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_woken_by_notices_and_cost_about_a_query_a_second() {
    use std::sync::atomic::Ordering;

    use idempotency_core::RecordState;

    let Some(owner) = postgres_node(&common::unique_table()).await else {
        return;
    };
    let owner = owner.migrate().await.expect("migrate");
    // The waiters' node: its own pool, counting the queries it sends.
    let (waiters_node, queries) = common::counting_postgres_node(&owner).await;

    let id = common::id();
    let token = common::reserved(&owner, &id).await;
    // Start the listener first, so that the count is the waiters' alone.
    let _ = waiters_node
        .wait(&common::id(), Duration::ZERO)
        .await
        .unwrap();
    let before = queries.load(Ordering::Relaxed);
    let waiters: Vec<_> = (0..100)
        .map(|_| {
            let store = waiters_node.clone();
            let id = id.clone();
            tokio::spawn(async move { store.wait(&id, Duration::from_secs(20)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let finalized_at = tokio::time::Instant::now();
    owner
        .finalize(&id, token, &common::response(b"done"))
        .await
        .unwrap();
    for waiter in waiters {
        let idempotency_core::Waited::Settled(record) = waiter.await.unwrap().unwrap() else {
            panic!("a waiter on a finalized record did not see it settled")
        };
        assert_eq!(
            record.state,
            RecordState::Completed(common::response(b"done"))
        );
    }
    let woken_after = finalized_at.elapsed();
    let spent = queries.load(Ordering::Relaxed) - before;
    assert!(
        woken_after < Duration::from_millis(800),
        "waiters woke {woken_after:?} after the finalize"
    );
    // Polling every 200 ms would be about 15 loads per waiter over 3 s; listening is
    // one at the start, one a second, one when woken.
    assert!(
        spent <= 100 * 6,
        "100 waiters sent {spent} queries in 3 s of waiting"
    );
    drop_postgres_table(&owner).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enforces_a_scope_quota_across_two_nodes() {
    use idempotency_core::ScopeQuota;
    let table = common::unique_table();
    let Some(a) = postgres_node(&table).await else {
        return;
    };
    let Some(b) = postgres_node(&table).await else {
        return;
    };
    let a = a.migrate().await.expect("migrate");
    let quota = ScopeQuota::default().with_max_records(5);
    let one: Arc<dyn FullStore> = Arc::new(a.clone().with_scope_quota(quota));
    idempotency_core::conformance::scope_quota_holds_under_concurrency(&one, 5).await;
    // Two nodes racing for one scope's last places: the quota still holds exactly.
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
    drop_postgres_table(&a).await;
}
