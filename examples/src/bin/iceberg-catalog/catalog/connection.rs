//! The [`Catalog`] handle every operation works through, and how it opens: the
//! database, `SqlCatalog` over the same tables, and the warehouse's file system.

use std::collections::HashMap;
use std::sync::Arc;

use iceberg::CatalogBuilder as _;
use iceberg::io::{FileIO, LocalFsStorageFactory};
use iceberg_catalog_sql::{SqlBindStyle, SqlCatalog, SqlCatalogBuilder};

use super::database::{Backend, CATALOG_NAME, CatalogDatabase, Database};
use super::log::LOG_TARGET;
use super::writes::Writes;

/// Where the state lives and the files go, on database `DB`.
pub(crate) struct Catalog<DB: CatalogDatabase> {
    /// Serves the reads it does well (namespaces, list / load / exists table); every
    /// write goes through [`Self::db`], in transactions `SqlCatalog` cannot join.
    pub(super) sql_catalog: SqlCatalog,
    pub(super) db: Database<DB>,
    pub(super) file_io: FileIO,
    /// The warehouse root as a `file://` URI, without a trailing slash.
    pub(super) warehouse: String,
    /// Where a change's transaction comes from and how its answer is recorded in it.
    pub(crate) writes: Writes<DB>,
}

impl<DB: CatalogDatabase> Catalog<DB> {
    /// Connects to the database, creates the catalog tables if they are missing, and
    /// keeps metadata files under `warehouse` (a `file://` URI of an existing directory).
    pub(crate) async fn open(
        database_url: &str,
        warehouse: String,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let db = Database::connect(database_url).await?;
        // `SqlCatalog` creates its tables with `CREATE TABLE IF NOT EXISTS`, which
        // PostgreSQL can still fail when two replicas start on a fresh database at once;
        // the loser's retry finds the tables there.
        let mut attempt = 0;
        let sql_catalog = loop {
            let loaded = SqlCatalogBuilder::default()
                .uri(database_url)
                .warehouse_location(warehouse.clone())
                .sql_bind_style(match DB::BACKEND {
                    Backend::Postgres => SqlBindStyle::DollarNumeric,
                    Backend::Sqlite | Backend::MySql => SqlBindStyle::QMark,
                })
                .with_storage_factory(Arc::new(LocalFsStorageFactory))
                .load(CATALOG_NAME, HashMap::new())
                .await;
            match loaded {
                Ok(sql_catalog) => break sql_catalog,
                Err(e) if attempt < 3 => {
                    attempt += 1;
                    tracing::warn!(target: LOG_TARGET, error = %e, attempt, "opening the SQL catalog failed; retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(250 * attempt)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let writes = Writes::records_elsewhere(db.pool().clone());
        Ok(Self {
            sql_catalog,
            db,
            file_io: FileIO::new_with_fs(),
            warehouse,
            writes,
        })
    }

    /// Keeps the idempotency records in the catalog's database: every change writes its
    /// answer into its record as `writes` says.
    pub(crate) fn with_records_in_database(mut self, writes: Writes<DB>) -> Self {
        self.writes = writes;
        self
    }

    /// The pool the catalog writes with.
    pub(crate) fn pool(&self) -> &sqlx::Pool<DB> {
        self.db.pool()
    }
}
