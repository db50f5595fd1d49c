//! The SQL side of the catalog: which database it runs on, its transactions, and the
//! statements every resource shares.
//!
//! Statements are written once with `?` placeholders and translated for PostgreSQL, so
//! that one text serves SQLite, PostgreSQL and MySQL through sqlx `Any`.

use iceberg::TableIdent;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyConnection, AnyPool, Row};

use crate::error::ApiResult;

/// The `catalog_name` of every row this server writes.
pub(super) const CATALOG_NAME: &str = "default";
/// Tables share `iceberg_tables` with views; rows of SQL catalogs that predate views have
/// no type.
pub(super) const TABLE_TYPE_FILTER: &str = "(iceberg_type = 'TABLE' OR iceberg_type IS NULL)";
pub(super) const VIEW_TYPE_FILTER: &str = "iceberg_type = 'VIEW'";

/// Which SQL database the catalog runs on, told by its URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Backend {
    /// `sqlite:...`: a single file, one process (or several on one machine).
    Sqlite,
    /// `postgres://...`
    Postgres,
    /// `mysql://...` (MySQL 8 or MariaDB)
    MySql,
}

impl Backend {
    /// The backend a database URL names.
    pub(super) fn from_url(url: &str) -> Result<Self, String> {
        let scheme = url.split(':').next().unwrap_or_default();
        match scheme {
            "sqlite" => Ok(Self::Sqlite),
            "postgres" | "postgresql" => Ok(Self::Postgres),
            "mysql" | "mariadb" => Ok(Self::MySql),
            _ => Err(format!(
                "unsupported database URL {url:?}: expected sqlite:, postgres:// or mysql://"
            )),
        }
    }
}

/// The connection pool, and the backend whose dialect its statements must speak.
pub(super) struct Database {
    pool: AnyPool,
    backend: Backend,
}

impl Database {
    /// Connects to the database a URL names.
    pub(super) async fn connect(
        database_url: &str,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let backend = Backend::from_url(database_url)?;
        sqlx::any::install_default_drivers();
        // Room for the write transactions of many concurrent requests, each of which may
        // hold one connection from its reservation to its commit, and read with another.
        let pool = AnyPoolOptions::new()
            .max_connections(match backend {
                Backend::Sqlite => 8,
                Backend::Postgres | Backend::MySql => 32,
            })
            .connect(database_url)
            .await?;
        if backend == Backend::Sqlite {
            // Several pools (the catalog's, ours, the idempotency store's) write to one
            // file; with write-ahead logging readers never block the writer. The mode is
            // stored in the file, so setting it once is enough.
            sqlx::query("PRAGMA journal_mode = WAL")
                .execute(&pool)
                .await?;
        }
        Ok(Self { pool, backend })
    }

    /// The pool.
    pub(super) fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Which database this is.
    pub(super) fn backend(&self) -> Backend {
        self.backend
    }

    /// A statement in this backend's placeholder style: `?` becomes `$1`, `$2`, ... on
    /// PostgreSQL. (The statements here contain no other question marks.)
    pub(super) fn with_placeholders(&self, statement: &str) -> String {
        if self.backend != Backend::Postgres {
            return statement.to_owned();
        }
        let mut out = String::with_capacity(statement.len() + 8);
        let mut n = 0;
        for c in statement.chars() {
            if c == '?' {
                n += 1;
                out.push('$');
                out.push_str(&n.to_string());
            } else {
                out.push(c);
            }
        }
        out
    }

    /// Runs a read outside any transaction.
    pub(super) async fn fetch_all(&self, statement: &str, args: &[&str]) -> ApiResult<Vec<AnyRow>> {
        let statement = self.with_placeholders(statement);
        let mut query = sqlx::query(&statement);
        for arg in args {
            query = query.bind(*arg);
        }
        Ok(query.fetch_all(&self.pool).await?)
    }

    /// Runs a write inside a change's transaction; the number of rows it touched.
    pub(super) async fn execute_in(
        &self,
        tx: &mut AnyConnection,
        statement: &str,
        args: &[&str],
    ) -> Result<u64, sqlx::Error> {
        let statement = self.with_placeholders(statement);
        let mut query = sqlx::query(&statement);
        for arg in args {
            query = query.bind(*arg);
        }
        Ok(query.execute(tx).await?.rows_affected())
    }

    /// Whether any table or view has this name.
    pub(super) async fn name_taken(&self, ident: &TableIdent) -> ApiResult<bool> {
        let rows = self
            .fetch_all(
                "SELECT 1 FROM iceberg_tables \
                 WHERE catalog_name = ? AND table_namespace = ? AND table_name = ?",
                &[CATALOG_NAME, &ident.namespace().join("."), ident.name()],
            )
            .await?;
        Ok(!rows.is_empty())
    }

    /// The current metadata file of the table or view (`filter` says which) with this
    /// name; `None` if there is none.
    pub(super) async fn metadata_location(
        &self,
        ident: &TableIdent,
        filter: &str,
    ) -> ApiResult<Option<String>> {
        let rows = self
            .fetch_all(
                &format!(
                    "SELECT metadata_location FROM iceberg_tables \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? AND {filter}"
                ),
                &[CATALOG_NAME, &ident.namespace().join("."), ident.name()],
            )
            .await?;
        match rows.first() {
            Some(row) => Ok(row.try_get::<Option<String>, _>(0)?),
            None => Ok(None),
        }
    }
}
