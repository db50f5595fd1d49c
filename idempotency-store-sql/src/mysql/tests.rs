//! Tests of the MySQL 8 reserve, against a MySQL 8 or MariaDB server.

use super::*;

/// A store on a table of its own, or `None` (skip) when no server answers outside CI.
async fn store() -> Option<MySqlStore> {
    let url = std::env::var("IDEMPOTENCY_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let pool = match MySqlPool::connect(&url).await {
        Ok(pool) => pool,
        Err(error) if std::env::var("CI").is_ok_and(|ci| ci == "true") => {
            panic!("MySQL at {url} is unreachable: {error}")
        }
        Err(error) => {
            eprintln!("SKIPPED: MySQL at {url} is unreachable ({error})");
            return None;
        }
    };
    let table = format!(
        "idem_unit_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    );
    Some(MySqlStore::new(pool).with_table_name(&table).unwrap())
}

async fn drop_table(store: &MySqlStore) {
    sqlx::query(&format!("DROP TABLE IF EXISTS `{}`", store.table_name()))
        .execute(store.pool())
        .await
        .unwrap();
}

#[tokio::test]
async fn migrate_learns_the_server_and_sql_shows_its_reserve() {
    let Some(store) = store().await else { return };
    assert!(!store.sql(Operation::Reserve).contains("RETURNING"));
    let store = store.migrate().await.unwrap();
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(
        store.sql(Operation::Reserve).contains("RETURNING"),
        version.contains("MariaDB"),
        "{version}: {}",
        store.sql(Operation::Reserve)
    );
    drop_table(&store).await;
}

/// The MySQL 8 path (upsert, then a SELECT) is plain SQL that MariaDB runs too, so
/// it stays covered on a MariaDB-only machine by telling the store it is on MySQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_mysql_8_reserve_passes_the_conformance_suite() {
    let Some(store) = store().await else { return };
    store.flavor.set(Flavor::MySql).unwrap();
    let store = store.migrate().await.unwrap();
    assert!(!store.sql(Operation::Reserve).contains("RETURNING"));
    let shared: Arc<dyn idempotency_core::FullStore> = Arc::new(store.clone());
    idempotency_core::conformance::Suite::full(shared)
        .run()
        .await;
    drop_table(&store).await;
}

/// Real InnoDB deadlocks on demand, on a table of their own: each [`Deadlocks::victim`]
/// runs a transaction that InnoDB picks as a deadlock's victim (error 1213).
struct Deadlocks {
    pool: MySqlPool,
    table: String,
}

impl Deadlocks {
    async fn new(store: &MySqlStore) -> Self {
        let table = format!("{}_deadlocks", store.table_name());
        sqlx::raw_sql(&format!(
            "CREATE TABLE `{table}` (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB;
             INSERT INTO `{table}` VALUES (1, 0), (2, 0), (3, 0), (4, 0)"
        ))
        .execute(store.pool())
        .await
        .unwrap();
        Self {
            pool: store.pool().clone(),
            table,
        }
    }

    /// A transaction that locks row 1 and then waits for row 2, which another one
    /// (heavier: three rows written) holds while it asks for row 1. InnoDB rolls back the
    /// lighter one: this one, whose error comes back.
    async fn victim(&self) -> Result<(), sqlx::Error> {
        let table = &self.table;
        let mut heavier = self.pool.begin().await?;
        // One row at a time, by its key: on a table this small `id IN (…)` is a scan,
        // which locks every row.
        for id in [2, 3, 4] {
            sqlx::query(&format!("UPDATE `{table}` SET v = v + 1 WHERE id = {id}"))
                .execute(&mut *heavier)
                .await?;
        }
        let mut victim = self.pool.begin().await?;
        sqlx::query(&format!("UPDATE `{table}` SET v = v + 1 WHERE id = 1"))
            .execute(&mut *victim)
            .await?;
        let waiting = async {
            sqlx::query(&format!("UPDATE `{table}` SET v = v + 1 WHERE id = 2"))
                .execute(&mut *victim)
                .await
        };
        let closing = async {
            // Once the victim waits for row 2, ask for its row 1: the cycle.
            tokio::time::sleep(Duration::from_millis(50)).await;
            sqlx::query(&format!("UPDATE `{table}` SET v = v + 1 WHERE id = 1"))
                .execute(&mut *heavier)
                .await
        };
        let (waited, closed) = tokio::join!(waiting, closing);
        closed.expect("the heavier transaction is not the victim");
        heavier.rollback().await?;
        let _ = victim.rollback().await;
        waited.map(|_| ())
    }

    async fn drop_table(&self) {
        sqlx::query(&format!("DROP TABLE IF EXISTS `{}`", self.table))
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

/// How many times `retry_deadlocks` ran its statement, and what it answered, for a
/// statement that deadlocks its first `times` runs and then answers `Ok(7)`.
async fn retried(deadlocks: &Deadlocks, times: usize) -> (usize, Result<i32, sqlx::Error>) {
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let answer = tokio::time::timeout(
        Duration::from_secs(60),
        retry_deadlocks(|| async {
            let run = runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            if run <= times {
                deadlocks.victim().await?;
                panic!("run {run}: the victim's transaction was not rolled back");
            }
            Ok(7)
        }),
    )
    .await
    .expect("the retries are bounded");
    (runs.into_inner(), answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_that_always_deadlocks_is_run_max_attempts_times() {
    let Some(store) = store().await else { return };
    let deadlocks = Deadlocks::new(&store).await;
    let (runs, answer) = retried(&deadlocks, usize::MAX).await;
    assert_eq!(runs, MAX_ATTEMPTS);
    let error = answer.unwrap_err();
    assert!(error.is_deadlock(), "{error}");
    // As the store passes it on, it is still a deadlock (the reservation's retry).
    assert!(backend(error).is_deadlock());
    deadlocks.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_that_deadlocks_twice_answers_at_its_third_run() {
    let Some(store) = store().await else { return };
    let deadlocks = Deadlocks::new(&store).await;
    let (runs, answer) = retried(&deadlocks, 2).await;
    assert_eq!((runs, answer.unwrap()), (3, 7));
    deadlocks.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_errors_are_not_run_again() {
    let Some(store) = store().await else { return };
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let answer: Result<u64, sqlx::Error> = tokio::time::timeout(
        Duration::from_secs(30),
        retry_deadlocks(|| async {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            sqlx::query("SELECT * FROM a_table_that_is_not_there")
                .execute(store.pool())
                .await
                .map(|done| done.rows_affected())
        }),
    )
    .await
    .expect("an error that is no deadlock ends the retries");
    assert!(!answer.unwrap_err().is_deadlock());
    assert_eq!(runs.into_inner(), 1);
    // A store error that is no deadlock is not one either.
    assert!(!StoreError::backend("refused").is_deadlock());
}
