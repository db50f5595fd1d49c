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
    idempotency_core::conformance::run_all(&shared).await;
    drop_table(&store).await;
}
