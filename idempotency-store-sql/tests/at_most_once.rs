//! `AtMostOnce` (idempotent functions) on the SQL stores: two replicas of a service, each
//! with its own pool on one table, run a piece of work once however many of their
//! callers ask for it at once; a retryable failure lets the key run again; an unknown
//! outcome holds it until it expires. PostgreSQL, MariaDB and SQLite. And work that
//! commits its write with its record (`run_with_reservation`, `Tx`), on PostgreSQL and
//! MariaDB: it runs once, and on PostgreSQL one transaction wrote both.
#![cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency_core::{AtMostOnce, FullStore, IdempotencyLayer, RunError, WorkError};
use idempotency_store_sql::{PoolSettings, SqliteStore};

const LIFETIME: Duration = Duration::from_secs(2);

/// A replica's `AtMostOnce`, whose duplicates wait `in_flight_wait` for a running owner.
fn replica(store: &Arc<dyn FullStore>, in_flight_wait: Duration) -> AtMostOnce {
    AtMostOnce::new(
        IdempotencyLayer::from_shared_store(store.clone())
            .with_lifetime(LIFETIME)
            .with_in_flight_wait(in_flight_wait),
    )
}

/// The checks, on two replicas' stores over one table.
async fn runs_once_across_replicas(a: Arc<dyn FullStore>, b: Arc<dyn FullStore>) {
    let replicas = [
        replica(&a, Duration::from_secs(10)),
        replica(&b, Duration::from_secs(10)),
    ];
    let runs = Arc::new(AtomicUsize::new(0));
    let order = serde_json::json!({"sku": "ø-1", "count": 2});

    // 16 callers, 8 on each replica, one key: one run, every caller its result.
    let key = uuid::Uuid::new_v4().to_string();
    let calls: Vec<_> = (0..16)
        .map(|n| {
            let (once, runs, key, order) = (
                replicas[n % 2].clone(),
                runs.clone(),
                key.clone(),
                order.clone(),
            );
            tokio::spawn(async move {
                once.run("tenant", &key, &order, move || async move {
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok::<usize, WorkError<()>>(run)
                })
                .await
            })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), 1);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one run for 16 callers");

    // The same key with another fingerprint, on the other replica.
    let reused = replicas[1]
        .run(
            "tenant",
            &key,
            &serde_json::json!({"sku": "other"}),
            || async { Ok::<usize, WorkError<()>>(0) },
        )
        .await;
    assert!(matches!(reused, Err(RunError::KeyReused)), "{reused:?}");

    // A retryable failure on one replica; the retry on the other runs.
    let key = uuid::Uuid::new_v4().to_string();
    let failed = replicas[0]
        .run("tenant", &key, &order, || async {
            Err::<usize, _>(WorkError::Retryable("try again"))
        })
        .await;
    assert!(
        matches!(failed, Err(RunError::Failed("try again"))),
        "{failed:?}"
    );
    let again = replicas[1]
        .run("tenant", &key, &order, || async {
            Ok::<usize, WorkError<()>>(7)
        })
        .await;
    assert_eq!(again.unwrap(), 7);

    // An unknown outcome holds the key on every replica until it expires.
    let key = uuid::Uuid::new_v4().to_string();
    let unknown = replicas[0]
        .run("tenant", &key, &order, || async {
            Err::<usize, _>(WorkError::OutcomeUnknown(()))
        })
        .await;
    assert!(
        matches!(unknown, Err(RunError::OutcomeUnknown(()))),
        "{unknown:?}"
    );
    let impatient = replica(&b, Duration::ZERO);
    let held = impatient
        .run("tenant", &key, &order, || async {
            Ok::<usize, WorkError<()>>(8)
        })
        .await;
    assert!(matches!(held, Err(RunError::InFlight)), "{held:?}");
    tokio::time::sleep(LIFETIME + Duration::from_millis(500)).await;
    let after = impatient
        .run("tenant", &key, &order, || async {
            Ok::<usize, WorkError<()>>(8)
        })
        .await;
    assert_eq!(after.unwrap(), 8, "the key runs again once it expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres() {
    let table = common::unique_table();
    let (Some(a), Some(b)) = (
        common::postgres_node(&table).await,
        common::postgres_node(&table).await,
    ) else {
        return;
    };
    let a = a.migrate().await.unwrap();
    let b = b.migrate().await.unwrap();
    runs_once_across_replicas(Arc::new(a.clone()), Arc::new(b)).await;
    common::drop_postgres_table(&a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb() {
    let table = common::unique_table();
    let (Some(a), Some(b)) = (
        common::mysql_node(&table).await,
        common::mysql_node(&table).await,
    ) else {
        return;
    };
    let a = a.migrate().await.unwrap();
    let b = b.migrate().await.unwrap();
    runs_once_across_replicas(Arc::new(a.clone()), Arc::new(b)).await;
    sqlx::query(&format!("DROP TABLE IF EXISTS `{table}`"))
        .execute(a.pool())
        .await
        .unwrap();
}

/// Two processes on one SQLite file.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/once.db?mode=rwc", dir.path().display());
    let settings = PoolSettings::default().max_connections(4);
    let a = SqliteStore::connect(&url, &settings)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let b = SqliteStore::connect(&url, &settings)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    runs_once_across_replicas(Arc::new(a), Arc::new(b)).await;
}

/// Work that commits its write with its record (`run_with_reservation` and `Tx`, on the
/// one-commit store): it runs once, its retries get its result, and its write and its
/// record are one transaction's.
macro_rules! work_commits_with_its_record {
    ($name:ident, $node:path, $database:ty, $same_transaction:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            use idempotency_store_sql::{OneCommitStore, TableName, Tx, Writes};
            let table = common::unique_table();
            let Some(records) = $node(&table).await else {
                return;
            };
            let records = records.migrate().await.unwrap();
            let pool = records.pool().clone();
            let store = OneCommitStore::new(
                Arc::new(records),
                pool.clone(),
                &TableName::new(table.clone()).unwrap(),
            )
            .await
            .unwrap();
            let store = Arc::new(store);
            let writes: Writes<$database> = Writes::with_records(store.clone());
            let once =
                AtMostOnce::new(IdempotencyLayer::from_shared_store(store).with_lifetime(LIFETIME));
            let effects = format!("{table}_effects");
            sqlx::query(&format!("CREATE TABLE {effects} (k VARCHAR(64))"))
                .execute(&pool)
                .await
                .unwrap();
            let key = uuid::Uuid::new_v4().simple().to_string();
            for attempt in 0..3_u32 {
                let (writes, effects, key_in_row) = (writes.clone(), effects.clone(), key.clone());
                let result = once
                    .run_with_reservation(
                        "tenant",
                        &key,
                        &"the order",
                        move |reservation| async move {
                            let failed =
                                |e: &dyn std::fmt::Display| WorkError::Retryable(e.to_string());
                            let mut tx = Tx::begin(&writes, reservation.handle())
                                .await
                                .map_err(|e| failed(&e))?;
                            sqlx::query(&format!(
                                "INSERT INTO {effects} (k) VALUES ('{key_in_row}')"
                            ))
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| failed(&e))?;
                            let answer = reservation.answer(&attempt).map_err(|e| failed(&e))?;
                            tx.commit(answer).await.map_err(|e| failed(&e))?;
                            Ok::<u32, WorkError<String>>(attempt)
                        },
                    )
                    .await;
                assert_eq!(
                    result.unwrap(),
                    0,
                    "attempt {attempt} gets the first run's result"
                );
            }
            let (rows,): (i64,) = sqlx::query_as(&format!("SELECT COUNT(*) FROM {effects}"))
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(rows, 1, "the work wrote once");
            let (records,): (i64,) = sqlx::query_as(&format!("SELECT COUNT(*) FROM {table}"))
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(records, 1, "one record");
            if let Some(same_transaction) = $same_transaction {
                let query = format!("SELECT {same_transaction} FROM {effects} e, {table} r");
                let (same,): (bool,) = sqlx::query_as(&query).fetch_one(&pool).await.unwrap();
                assert!(
                    same,
                    "the write and its record were committed by one transaction"
                );
            }
            for dropped in [effects, table] {
                sqlx::query(&format!("DROP TABLE {dropped}"))
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
    };
}

work_commits_with_its_record!(
    postgres_work_commits_with_its_record,
    common::postgres_node,
    sqlx::Postgres,
    Some("e.xmin::text = r.xmin::text")
);
work_commits_with_its_record!(
    mariadb_work_commits_with_its_record,
    common::mysql_node,
    sqlx::MySql,
    None::<&str> // MariaDB does not tell which transaction wrote a row
);
