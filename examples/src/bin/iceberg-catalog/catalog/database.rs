//! The SQL side of the catalog: which database it runs on, its pool, and the statements
//! every resource shares.
//!
//! The catalog's state is on a typed pool (`PgPool`, `MySqlPool`, `SqlitePool`): the
//! whole catalog is generic over [`CatalogDatabase`], and `main` picks the database the
//! URL names. Statements are written once with `?` placeholders and numbered for
//! PostgreSQL, so that one text serves all three.

use std::future::Future;

use iceberg::TableIdent;
use idempotency_store_sql::RecordDatabase;
use sqlx::pool::PoolOptions;
use sqlx::{Pool, Row};

use crate::error::ApiResult;

/// The `catalog_name` of every row this server writes.
pub(super) const CATALOG_NAME: &str = "default";
/// Tables share `iceberg_tables` with views; rows of SQL catalogs that predate views have
/// no type.
pub(super) const TABLE_TYPE_FILTER: &str = "(iceberg_type = 'TABLE' OR iceberg_type IS NULL)";
pub(super) const VIEW_TYPE_FILTER: &str = "iceberg_type = 'VIEW'";

/// Which SQL database the catalog runs on, told by its URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    /// `sqlite:...`: a single file, one process (or several on one machine).
    Sqlite,
    /// `postgres://...`
    Postgres,
    /// `mysql://...` (MySQL 8 or MariaDB)
    MySql,
}

impl Backend {
    /// The backend a database URL names.
    pub(crate) fn from_url(url: &str) -> Result<Self, String> {
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

/// A database the catalog keeps its state in: `sqlx::Postgres`, `sqlx::MySql` or
/// `sqlx::Sqlite`, each of which the idempotency records can be written in too
/// ([`RecordDatabase`]). Its two operations take text parameters, which is all the
/// catalog's statements bind; written once for the three drivers by the macro below.
pub(crate) trait CatalogDatabase: RecordDatabase {
    /// Which database this is.
    const BACKEND: Backend;

    /// Runs a write; the number of rows it touched.
    fn execute(
        connection: &mut Self::Connection,
        statement: &str,
        args: &[&str],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Runs a read; the first column of each row it answers, as text.
    fn first_column(
        connection: &mut Self::Connection,
        statement: &str,
        args: &[&str],
    ) -> impl Future<Output = Result<Vec<Option<String>>, sqlx::Error>> + Send;
}

macro_rules! catalog_database {
    ($database:ty, $backend:expr) => {
        impl CatalogDatabase for $database {
            const BACKEND: Backend = $backend;

            async fn execute(
                connection: &mut Self::Connection,
                statement: &str,
                args: &[&str],
            ) -> Result<u64, sqlx::Error> {
                let query = args
                    .iter()
                    .fold(sqlx::query(statement), |q, arg| q.bind(*arg));
                Ok(query.execute(connection).await?.rows_affected())
            }

            async fn first_column(
                connection: &mut Self::Connection,
                statement: &str,
                args: &[&str],
            ) -> Result<Vec<Option<String>>, sqlx::Error> {
                let query = args
                    .iter()
                    .fold(sqlx::query(statement), |q, arg| q.bind(*arg));
                query
                    .fetch_all(connection)
                    .await?
                    .iter()
                    .map(|row| row.try_get::<Option<String>, _>(0))
                    .collect()
            }
        }
    };
}

catalog_database!(sqlx::Postgres, Backend::Postgres);
catalog_database!(sqlx::MySql, Backend::MySql);
catalog_database!(sqlx::Sqlite, Backend::Sqlite);

/// The connection pool of the catalog's database.
pub(super) struct Database<DB: CatalogDatabase> {
    pool: Pool<DB>,
}

impl<DB: CatalogDatabase> Database<DB> {
    /// Connects to the database a URL names.
    pub(super) async fn connect(
        database_url: &str,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        // Room for the write transactions of many concurrent requests, each of which may
        // hold one connection from its reservation to its commit, and read with another.
        let pool = PoolOptions::<DB>::new()
            .max_connections(match DB::BACKEND {
                Backend::Sqlite => 8,
                Backend::Postgres | Backend::MySql => 32,
            })
            .connect(database_url)
            .await?;
        if DB::BACKEND == Backend::Sqlite {
            // Several pools (the catalog's, ours, the idempotency store's) write to one
            // file; with write-ahead logging readers never block the writer. The mode is
            // stored in the file, so setting it once is enough.
            DB::execute(
                &mut *pool.acquire().await?,
                "PRAGMA journal_mode = WAL",
                &[],
            )
            .await?;
        }
        Ok(Self { pool })
    }

    /// The pool.
    pub(super) fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// A statement in this backend's placeholder style: `?` becomes `$1`, `$2`, ... on
    /// PostgreSQL. (The statements here contain no other question marks.)
    pub(super) fn with_placeholders(statement: &str) -> String {
        if DB::BACKEND != Backend::Postgres {
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

    /// Runs a read outside any transaction: the first column of each row, as text.
    pub(super) async fn fetch_texts(
        &self,
        statement: &str,
        args: &[&str],
    ) -> ApiResult<Vec<String>> {
        let mut connection = self.pool.acquire().await?;
        Ok(self.texts_in(&mut connection, statement, args).await?)
    }

    /// Runs a read in a change's transaction: the first column of each row, as text (a
    /// `NULL` is left out).
    pub(super) async fn texts_in(
        &self,
        connection: &mut DB::Connection,
        statement: &str,
        args: &[&str],
    ) -> Result<Vec<String>, sqlx::Error> {
        let statement = Self::with_placeholders(statement);
        let column = DB::first_column(connection, &statement, args).await?;
        Ok(column.into_iter().flatten().collect())
    }

    /// Runs a write inside a change's transaction; the number of rows it touched.
    pub(super) async fn execute_in(
        &self,
        tx: &mut DB::Connection,
        statement: &str,
        args: &[&str],
    ) -> Result<u64, sqlx::Error> {
        let statement = Self::with_placeholders(statement);
        DB::execute(tx, &statement, args).await
    }

    /// Whether any table or view has this name.
    pub(super) async fn name_taken(&self, ident: &TableIdent) -> ApiResult<bool> {
        let names = self
            .fetch_texts(
                "SELECT table_name FROM iceberg_tables \
                 WHERE catalog_name = ? AND table_namespace = ? AND table_name = ?",
                &[CATALOG_NAME, &ident.namespace().join("."), ident.name()],
            )
            .await?;
        Ok(!names.is_empty())
    }

    /// The current metadata file of the table or view (`filter` says which) with this
    /// name; `None` if there is none.
    pub(super) async fn metadata_location(
        &self,
        ident: &TableIdent,
        filter: &str,
    ) -> ApiResult<Option<String>> {
        let locations = self
            .fetch_texts(
                &format!(
                    "SELECT metadata_location FROM iceberg_tables \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? AND {filter}"
                ),
                &[CATALOG_NAME, &ident.namespace().join("."), ident.name()],
            )
            .await?;
        Ok(locations.into_iter().next())
    }
}
