//! The catalog's state: which namespaces, tables and views exist, and where each table's
//! current metadata file is.
//!
//! The state lives in two SQL tables, `iceberg_namespace_properties` and
//! `iceberg_tables`, the schema that iceberg-rust's `SqlCatalog` (and the Java and Python
//! SQL catalogs) use, in the same database as the idempotency records. `SqlCatalog`
//! creates the tables and serves some reads (load / exists namespace, list / load / exists
//! table); everything else is written here over the same tables with sqlx `Any`, and
//! **every change in a transaction of its own**, because `SqlCatalog` commits each of its
//! writes by itself and cannot join an outside transaction:
//!
//! | operation | how |
//! |---|---|
//! | create / drop namespace, update its properties | insert / delete property rows (a marker row `exists` keeps a namespace without properties) |
//! | create, register, drop, rename a table | insert / delete / update its row (`iceberg_type = 'TABLE'`) |
//! | commit a table, commit a transaction | a compare-and-swap on each table's metadata location |
//! | staged create (`stage-create`) | nothing is written; its create transaction is a commit |
//! | views | rows with `iceberg_type = 'VIEW'`, like the Java JDBC catalog |
//! | list namespaces under a parent | here: `SqlCatalog` lists descendants, not children |
//!
//! # Exactly once: the answer commits with the change
//!
//! A change is written in an open transaction and handed back as [`Uncommitted`]; the
//! route builds the answer from it, and [`Uncommitted::commit`] writes that answer into
//! the request's idempotency record **in the same transaction** (`AnyFinalizer`, fenced
//! by the request's token) before it commits. The change and its answer then commit
//! together or not at all: a replica killed right after the commit is replayed on the
//! retry (a second `updateTable` would fail its requirements with
//! `CommitFailedException`, and the Java client would then delete files the committed
//! snapshot needs); one killed before it leaves nothing, and the retry runs once.
//!
//! Metadata files are written before their transaction (they are not in the database):
//! if it rolls back, or the process dies before it commits, the file it wrote is left
//! with nothing pointing at it. That orphan is harmless, and the catalog deletes it when
//! it can (a refused or failed change); a purge (`purgeRequested`) deletes the table's
//! files only after the drop committed.
//!
//! For crash tests, `ICEBERG_CATALOG_CRASH_AFTER_COMMIT=1` makes the process abort right
//! after it commits a change, before it answers.
//!
//! # Files
//!
//! A table's location is `<warehouse>/<namespace levels>/<table>` unless the request or
//! the namespace's `location` property says otherwise; its metadata files are
//! `<location>/metadata/<version>-<uuid>.metadata.json`, written through iceberg-rust's
//! local-filesystem `FileIO`. Every location must lie inside the warehouse: the server
//! writes and reads files on its clients' behalf and refuses to be pointed elsewhere.
//!
//! # Replicas
//!
//! Two processes pointed at one PostgreSQL or MySQL database are two replicas of one
//! catalog. Nothing is cached in process; every commit is a compare-and-swap on the
//! metadata location (`UPDATE ... SET metadata_location = new WHERE metadata_location =
//! base`), so two replicas never both commit on one base: the second gets
//! `CommitFailedException` and its client retries on the new base. Creates rely on the
//! primary key: the second insert of a name fails and is answered `AlreadyExistsException`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;

use axum::response::Response;
use iceberg::io::{FileIO, LocalFsStorageFactory};
use iceberg::spec::{
    FormatVersion, SortOrder, TableMetadata, TableMetadataBuilder, UnboundPartitionSpec,
    ViewFormatVersion, ViewMetadata, ViewMetadataBuilder,
};
use iceberg::table::Table;
use iceberg::{
    Catalog as _, CatalogBuilder as _, ErrorKind, MetadataLocation, NamespaceIdent, TableCreation,
    TableIdent, TableRequirement, TableUpdate, ViewUpdate,
};
use iceberg_catalog_sql::{SqlBindStyle, SqlCatalog, SqlCatalogBuilder};
use idempotency_core::ReservationHandle;
use idempotency_store_sql::AnyFinalizer;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{Any, AnyPool, Row, Transaction};

use crate::error::{ApiError, ApiResult};
use crate::rest::{
    CommitTableRequest, CreateTableRequest, CreateViewRequest, LoadTableResult, LoadViewResult,
    UpdateNamespacePropertiesResponse, ViewRequirement,
};

/// The `catalog_name` of every row this server writes.
const CATALOG_NAME: &str = "default";
/// The property `SqlCatalog` stores on every namespace so that it exists without others.
const EXISTS_PROPERTY: &str = "exists";
/// A namespace property that places the tables created in it.
const LOCATION_PROPERTY: &str = "location";
const TABLE_TYPE_FILTER: &str = "(iceberg_type = 'TABLE' OR iceberg_type IS NULL)";
const VIEW_TYPE_FILTER: &str = "iceberg_type = 'VIEW'";
/// Set to `1`, the process aborts right after it commits a change, before it answers.
pub(crate) const CRASH_AFTER_COMMIT: &str = "ICEBERG_CATALOG_CRASH_AFTER_COMMIT";

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

/// Where the state lives and the files go.
pub(crate) struct Catalog {
    sql: SqlCatalog,
    pool: AnyPool,
    backend: Backend,
    file_io: FileIO,
    /// The warehouse root as a `file://` URI, without a trailing slash.
    warehouse: String,
    /// Writes a request's answer into its idempotency record in the change's transaction;
    /// `None` when the catalog runs without idempotency.
    finalizer: Option<AnyFinalizer>,
    /// [`CRASH_AFTER_COMMIT`] is set.
    crash_after_commit: bool,
}

/// A change written in an open database transaction: nothing of it is visible until
/// [`commit`](Self::commit), and dropped, it rolls back.
#[must_use = "a change that is not committed rolls back"]
pub(crate) struct Uncommitted<'a, T> {
    catalog: &'a Catalog,
    tx: Transaction<'static, Any>,
    /// What the change made, for the answer.
    pub(crate) value: T,
    /// Metadata files written for the change: nothing points at them unless it commits.
    written: Vec<String>,
    /// A dropped table whose files go once the drop committed (`purgeRequested`).
    purge: Option<Table>,
}

impl<'a, T> Uncommitted<'a, T> {
    fn new(catalog: &'a Catalog, tx: Transaction<'static, Any>, value: T) -> Self {
        Self {
            catalog,
            tx,
            value,
            written: Vec::new(),
            purge: None,
        }
    }

    fn map<U>(self, f: impl FnOnce(T) -> U) -> Uncommitted<'a, U> {
        Uncommitted {
            catalog: self.catalog,
            tx: self.tx,
            value: f(self.value),
            written: self.written,
            purge: self.purge,
        }
    }

    /// Writes `answer` into the request's idempotency record (if it carries a key) in the
    /// change's own transaction, commits the two together, and returns the answer to
    /// send, which is exactly what a retry with the key is replayed.
    ///
    /// If the record cannot be written (the request's key was taken over by another
    /// request while it ran, or the database failed), the change rolls back and the
    /// request fails with a 5xx: the key stays with whoever owns it, and nothing of this
    /// request is committed.
    pub(crate) async fn commit(
        mut self,
        reservation: Option<&ReservationHandle>,
        answer: Response,
    ) -> ApiResult<Response> {
        let answer = match &self.catalog.finalizer {
            Some(finalizer) => {
                match finalizer
                    .finalize_in(&mut self.tx, reservation, answer)
                    .await
                {
                    Ok(answer) => answer,
                    Err(error) => {
                        let _ = self.tx.rollback().await;
                        self.catalog.delete_unused(&self.written).await;
                        return Err(error.into());
                    }
                }
            }
            None => answer,
        };
        if let Err(e) = self.tx.commit().await {
            // The database may or may not have applied it; the files stay, since a
            // committed change may point at them.
            tracing::error!(error = %e, "commit of catalog transaction failed");
            return Err(ApiError::commit_state_unknown(format!(
                "Database commit failed, the state of the change is unknown: {e}"
            )));
        }
        if self.catalog.crash_after_commit {
            tracing::error!("{CRASH_AFTER_COMMIT}=1: aborting after the commit, before answering");
            std::process::abort();
        }
        if let Some(table) = self.purge
            && let Err(e) = iceberg::drop_table_data(&table).await
        {
            tracing::warn!(error = %e, "could not delete all files of a purged table");
        }
        Ok(answer)
    }
}

/// A commit whose new metadata file is written but not yet swapped in.
struct PreparedCommit {
    ident: TableIdent,
    /// The metadata location the commit was computed on; `None` for a create transaction.
    base: Option<String>,
    location: String,
    metadata: TableMetadata,
}

impl Catalog {
    /// Connects to the database, creates the catalog tables if they are missing, and
    /// keeps metadata files under `warehouse` (a `file://` URI of an existing directory).
    ///
    /// With a `finalizer`, every change commits together with its request's idempotency
    /// record, which must live in the same database.
    pub(crate) async fn open(
        database_url: &str,
        warehouse: String,
        finalizer: Option<AnyFinalizer>,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let backend = Backend::from_url(database_url)?;
        sqlx::any::install_default_drivers();
        let pool = AnyPoolOptions::new()
            .max_connections(8)
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
        // `SqlCatalog` creates its tables with `CREATE TABLE IF NOT EXISTS`, which
        // PostgreSQL can still fail when two replicas start on a fresh database at once;
        // the loser's retry finds the tables there.
        let mut attempt = 0;
        let sql = loop {
            let loaded = SqlCatalogBuilder::default()
                .uri(database_url)
                .warehouse_location(warehouse.clone())
                .sql_bind_style(match backend {
                    Backend::Postgres => SqlBindStyle::DollarNumeric,
                    Backend::Sqlite | Backend::MySql => SqlBindStyle::QMark,
                })
                .with_storage_factory(Arc::new(LocalFsStorageFactory))
                .load(CATALOG_NAME, HashMap::new())
                .await;
            match loaded {
                Ok(sql) => break sql,
                Err(e) if attempt < 3 => {
                    attempt += 1;
                    tracing::warn!(error = %e, attempt, "opening the SQL catalog failed; retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(250 * attempt)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let crash_after_commit = std::env::var(CRASH_AFTER_COMMIT).is_ok_and(|v| v == "1");
        if crash_after_commit {
            tracing::warn!(
                "{CRASH_AFTER_COMMIT}=1: the process aborts after its first committed change"
            );
        }
        Ok(Self {
            sql,
            pool,
            backend,
            file_io: FileIO::new_with_fs(),
            warehouse,
            finalizer,
            crash_after_commit,
        })
    }

    /// A transaction for a change. On SQLite it takes the write lock at once (`BEGIN
    /// IMMEDIATE`): a deferred transaction that read first could not start writing once
    /// another connection wrote meanwhile, and the idempotency store writes to the same
    /// file on every keyed request.
    async fn begin(&self) -> Result<Transaction<'static, Any>, sqlx::Error> {
        match self.backend {
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await,
            Backend::Postgres | Backend::MySql => self.pool.begin().await,
        }
    }

    /// Deletes metadata files that nothing points at (their change did not commit).
    async fn delete_unused(&self, locations: &[String]) {
        for location in locations {
            if let Err(e) = self.file_io.delete(location).await {
                tracing::warn!(%location, error = %e, "could not delete an unused metadata file");
            }
        }
    }

    /// A statement in this backend's placeholder style: `?` becomes `$1`, `$2`, ... on
    /// PostgreSQL. (The statements here contain no other question marks.)
    fn sql(&self, statement: &str) -> String {
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

    async fn fetch_all(&self, statement: &str, args: &[&str]) -> ApiResult<Vec<AnyRow>> {
        let statement = self.sql(statement);
        let mut query = sqlx::query(&statement);
        for arg in args {
            query = query.bind(*arg);
        }
        Ok(query.fetch_all(&self.pool).await?)
    }

    async fn execute_in(
        &self,
        tx: &mut Transaction<'static, Any>,
        statement: &str,
        args: &[&str],
    ) -> Result<u64, sqlx::Error> {
        let statement = self.sql(statement);
        let mut query = sqlx::query(&statement);
        for arg in args {
            query = query.bind(*arg);
        }
        Ok(query.execute(&mut **tx).await?.rows_affected())
    }

    // ----------------------------------------------------------------------------------
    // Namespaces
    // ----------------------------------------------------------------------------------

    /// Creates a namespace with its properties; 409 if it exists.
    pub(crate) async fn create_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
    ) -> ApiResult<Uncommitted<'_, HashMap<String, String>>> {
        check_namespace(namespace)?;
        check_property_keys(properties.keys())?;
        if self.namespace_exists(namespace).await? {
            return Err(namespace_exists_error(namespace));
        }
        let joined = namespace.join(".");
        let mut tx = self.begin().await?;
        // The marker row makes the namespace exist whatever its properties.
        let rows = properties
            .iter()
            .map(|(key, value)| (key.as_str(), value.as_str()))
            .chain([(EXISTS_PROPERTY, "true")]);
        for (key, value) in rows {
            let inserted = self
                .execute_in(
                    &mut tx,
                    "INSERT INTO iceberg_namespace_properties \
                     (catalog_name, namespace, property_key, property_value) VALUES (?, ?, ?, ?)",
                    &[CATALOG_NAME, &joined, key, value],
                )
                .await;
            if let Err(e) = inserted {
                drop(tx);
                // Two replicas both saw it missing; the primary key let one in.
                return Err(if self.namespace_exists(namespace).await? {
                    namespace_exists_error(namespace)
                } else {
                    e.into()
                });
            }
        }
        Ok(Uncommitted::new(self, tx, properties))
    }

    /// Whether a namespace exists.
    pub(crate) async fn namespace_exists(&self, namespace: &NamespaceIdent) -> ApiResult<bool> {
        Ok(self.sql.namespace_exists(namespace).await?)
    }

    async fn require_namespace(&self, namespace: &NamespaceIdent) -> ApiResult<()> {
        if self.namespace_exists(namespace).await? {
            Ok(())
        } else {
            Err(ApiError::no_such_namespace(display_namespace(namespace)))
        }
    }

    /// The properties of a namespace.
    pub(crate) async fn load_namespace(
        &self,
        namespace: &NamespaceIdent,
    ) -> ApiResult<HashMap<String, String>> {
        match self.sql.get_namespace(namespace).await {
            Ok(found) => Ok(visible(found.properties().clone())),
            Err(e) if e.kind() == ErrorKind::NamespaceNotFound => {
                Err(ApiError::no_such_namespace(display_namespace(namespace)))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The namespaces one level below `parent`, or the top-level ones.
    pub(crate) async fn list_namespaces(
        &self,
        parent: Option<&NamespaceIdent>,
    ) -> ApiResult<Vec<Vec<String>>> {
        if let Some(parent) = parent {
            self.require_namespace(parent).await?;
        }
        let rows = self
            .fetch_all(
                "SELECT namespace FROM iceberg_namespace_properties WHERE catalog_name = ? \
                 UNION SELECT table_namespace FROM iceberg_tables WHERE catalog_name = ?",
                &[CATALOG_NAME, CATALOG_NAME],
            )
            .await?;
        let parent: &[String] = parent.map_or(&[], |p| p.as_ref());
        let mut children = BTreeSet::new();
        for row in rows {
            let joined: String = row.try_get(0)?;
            let levels: Vec<String> = joined.split('.').map(str::to_owned).collect();
            if levels.len() > parent.len() && levels[..parent.len()] == *parent {
                children.insert(levels[..=parent.len()].to_vec());
            }
        }
        Ok(children.into_iter().collect())
    }

    /// Sets and removes namespace properties in one transaction.
    pub(crate) async fn update_namespace_properties(
        &self,
        namespace: &NamespaceIdent,
        removals: Vec<String>,
        updates: HashMap<String, String>,
    ) -> ApiResult<Uncommitted<'_, UpdateNamespacePropertiesResponse>> {
        if let Some(both) = removals.iter().find(|k| updates.contains_key(*k)) {
            return Err(ApiError::new(
                axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                "UnprocessableEntityException",
                format!("Property {both:?} is both removed and updated"),
            ));
        }
        check_property_keys(removals.iter().chain(updates.keys()))?;
        self.require_namespace(namespace).await?;
        let joined = namespace.join(".");
        let mut tx = self.begin().await?;
        let select = self.sql(
            "SELECT property_key FROM iceberg_namespace_properties \
             WHERE catalog_name = ? AND namespace = ?",
        );
        let existing: HashSet<String> = sqlx::query(&select)
            .bind(CATALOG_NAME)
            .bind(&joined)
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|row| row.try_get::<String, _>(0))
            .collect::<Result<_, _>>()?;
        if existing.is_empty() {
            // The namespace exists only through its tables (created by another client
            // of these tables); give it the marker row so it keeps existing.
            self.execute_in(
                &mut tx,
                "INSERT INTO iceberg_namespace_properties \
                 (catalog_name, namespace, property_key, property_value) VALUES (?, ?, ?, ?)",
                &[CATALOG_NAME, &joined, EXISTS_PROPERTY, "true"],
            )
            .await?;
        }
        let mut response = UpdateNamespacePropertiesResponse {
            updated: Vec::new(),
            removed: Vec::new(),
            missing: Vec::new(),
        };
        for key in removals {
            let deleted = self
                .execute_in(
                    &mut tx,
                    "DELETE FROM iceberg_namespace_properties \
                     WHERE catalog_name = ? AND namespace = ? AND property_key = ?",
                    &[CATALOG_NAME, &joined, &key],
                )
                .await?;
            if deleted > 0 {
                response.removed.push(key);
            } else {
                response.missing.push(key);
            }
        }
        for (key, value) in updates {
            let statement = if existing.contains(&key) {
                "UPDATE iceberg_namespace_properties SET property_value = ? \
                 WHERE catalog_name = ? AND namespace = ? AND property_key = ?"
            } else {
                "INSERT INTO iceberg_namespace_properties \
                 (property_value, catalog_name, namespace, property_key) VALUES (?, ?, ?, ?)"
            };
            self.execute_in(&mut tx, statement, &[&value, CATALOG_NAME, &joined, &key])
                .await?;
            response.updated.push(key);
        }
        response.updated.sort();
        response.removed.sort();
        response.missing.sort();
        Ok(Uncommitted::new(self, tx, response))
    }

    /// Drops an empty namespace: 404 if missing, 409 if it still has tables, views or
    /// namespaces below it.
    pub(crate) async fn drop_namespace(
        &self,
        namespace: &NamespaceIdent,
    ) -> ApiResult<Uncommitted<'_, ()>> {
        self.require_namespace(namespace).await?;
        let joined = namespace.join(".");
        let objects = self
            .fetch_all(
                "SELECT table_name FROM iceberg_tables \
                 WHERE catalog_name = ? AND table_namespace = ?",
                &[CATALOG_NAME, &joined],
            )
            .await?;
        if !objects.is_empty() {
            return Err(ApiError::namespace_not_empty(format!(
                "Namespace {} is not empty: it contains {} tables or views",
                display_namespace(namespace),
                objects.len()
            )));
        }
        if !self.list_namespaces(Some(namespace)).await?.is_empty() {
            return Err(ApiError::namespace_not_empty(format!(
                "Namespace {} is not empty: it contains namespaces",
                display_namespace(namespace)
            )));
        }
        let mut tx = self.begin().await?;
        self.execute_in(
            &mut tx,
            "DELETE FROM iceberg_namespace_properties WHERE catalog_name = ? AND namespace = ?",
            &[CATALOG_NAME, &joined],
        )
        .await?;
        Ok(Uncommitted::new(self, tx, ()))
    }

    /// Table and view locations (and registered metadata files) must lie inside the
    /// warehouse: the server writes and reads files there on clients' behalf, and must not
    /// be steered anywhere else on the machine.
    fn check_location(&self, location: &str) -> ApiResult<()> {
        let inside = location
            .strip_prefix(&self.warehouse)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
        let climbs = location.split('/').any(|segment| segment == "..");
        if inside && !climbs {
            Ok(())
        } else {
            Err(ApiError::bad_request(format!(
                "Location {location} is outside the warehouse {}: this catalog keeps every \
                 table and view inside it",
                self.warehouse
            )))
        }
    }

    /// Where a new table or view in `namespace` goes when the request names no location:
    /// the namespace's `location` property, or `<warehouse>/<ns levels>`, then the name.
    async fn default_location(&self, namespace: &NamespaceIdent, name: &str) -> ApiResult<String> {
        let properties = self.load_namespace(namespace).await?;
        let base = match properties.get(LOCATION_PROPERTY) {
            Some(location) => location.trim_end_matches('/').to_owned(),
            None => format!("{}/{}", self.warehouse, namespace.join("/")),
        };
        Ok(format!("{base}/{name}"))
    }

    // ----------------------------------------------------------------------------------
    // Tables
    // ----------------------------------------------------------------------------------

    /// The tables in a namespace, sorted.
    pub(crate) async fn list_tables(
        &self,
        namespace: &NamespaceIdent,
    ) -> ApiResult<Vec<TableIdent>> {
        match self.sql.list_tables(namespace).await {
            Ok(mut tables) => {
                tables.sort_by(|a, b| a.name().cmp(b.name()));
                Ok(tables)
            }
            Err(e) if e.kind() == ErrorKind::NamespaceNotFound => {
                Err(ApiError::no_such_namespace(display_namespace(namespace)))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Whether a table exists.
    pub(crate) async fn table_exists(&self, table: &TableIdent) -> ApiResult<bool> {
        Ok(self.sql.table_exists(table).await?)
    }

    /// Whether any table or view has this name.
    async fn name_taken(&self, ident: &TableIdent) -> ApiResult<bool> {
        let rows = self
            .fetch_all(
                "SELECT 1 FROM iceberg_tables \
                 WHERE catalog_name = ? AND table_namespace = ? AND table_name = ?",
                &[CATALOG_NAME, &ident.namespace().join("."), ident.name()],
            )
            .await?;
        Ok(!rows.is_empty())
    }

    async fn metadata_location(
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

    /// Creates a table: writes its first metadata file and inserts its row.
    pub(crate) async fn create_table(
        &self,
        namespace: &NamespaceIdent,
        request: CreateTableRequest,
    ) -> ApiResult<Uncommitted<'_, LoadTableResult>> {
        let (ident, creation) = self.table_creation(namespace, request).await?;
        let location = creation.location.clone().unwrap_or_default();
        let metadata = TableMetadataBuilder::from_table_creation(creation)?
            .build()?
            .metadata;
        let metadata_location = MetadataLocation::new_with_metadata(location, &metadata);
        metadata.write_to(&self.file_io, &metadata_location).await?;
        let metadata_location = metadata_location.to_string();
        let written = vec![metadata_location.clone()];
        let mut tx = match self.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                self.delete_unused(&written).await;
                return Err(e.into());
            }
        };
        let inserted = self
            .execute_in(
                &mut tx,
                "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, \
                 metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'TABLE')",
                &[
                    CATALOG_NAME,
                    &namespace.join("."),
                    ident.name(),
                    &metadata_location,
                ],
            )
            .await;
        if let Err(e) = inserted {
            drop(tx);
            self.delete_unused(&written).await;
            // Lost a race with another replica: the primary key let only one in.
            return Err(if self.name_taken(&ident).await? {
                table_exists_error(&ident)
            } else {
                e.into()
            });
        }
        let mut created = Uncommitted::new(
            self,
            tx,
            LoadTableResult {
                metadata_location: Some(metadata_location),
                metadata,
                config: HashMap::new(),
            },
        );
        created.written = written;
        Ok(created)
    }

    /// `stage-create`: computes a table's first metadata and writes nothing; the
    /// client's create transaction (a commit with `assert-create`) creates it.
    pub(crate) async fn stage_create_table(
        &self,
        namespace: &NamespaceIdent,
        request: CreateTableRequest,
    ) -> ApiResult<LoadTableResult> {
        let (_, creation) = self.table_creation(namespace, request).await?;
        let metadata = TableMetadataBuilder::from_table_creation(creation)?
            .build()?
            .metadata;
        Ok(LoadTableResult {
            metadata_location: None,
            metadata,
            config: HashMap::new(),
        })
    }

    /// Checks a create request (name, namespace, location inside the warehouse) and
    /// turns it into a `TableCreation` with its location set.
    async fn table_creation(
        &self,
        namespace: &NamespaceIdent,
        request: CreateTableRequest,
    ) -> ApiResult<(TableIdent, TableCreation)> {
        check_name(&request.name)?;
        self.require_namespace(namespace).await?;
        let ident = TableIdent::new(namespace.clone(), request.name.clone());
        if self.name_taken(&ident).await? {
            return Err(table_exists_error(&ident));
        }
        let location = match request.location {
            Some(location) => location.trim_end_matches('/').to_owned(),
            None => self.default_location(namespace, &request.name).await?,
        };
        self.check_location(&location)?;
        let creation = TableCreation::builder()
            .name(request.name)
            .location(location)
            .schema(request.schema)
            .partition_spec_opt(request.partition_spec)
            .sort_order_opt(request.write_order)
            .properties(request.properties)
            .build();
        Ok((ident, creation))
    }

    /// A table's current metadata and its location.
    pub(crate) async fn load_table(&self, ident: &TableIdent) -> ApiResult<LoadTableResult> {
        let Some(location) = self.metadata_location(ident, TABLE_TYPE_FILTER).await? else {
            return Err(ApiError::no_such_table(ident));
        };
        let metadata = TableMetadata::read_from(&self.file_io, &location).await?;
        Ok(LoadTableResult {
            metadata_location: Some(location),
            metadata,
            config: HashMap::new(),
        })
    }

    /// Drops a table from the catalog; with `purge` its files are deleted once the drop
    /// committed.
    pub(crate) async fn drop_table(
        &self,
        ident: &TableIdent,
        purge: bool,
    ) -> ApiResult<Uncommitted<'_, ()>> {
        let table = if purge {
            match self.sql.load_table(ident).await {
                Ok(table) => Some(table),
                Err(e) if e.kind() == ErrorKind::TableNotFound => {
                    return Err(ApiError::no_such_table(ident));
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            None
        };
        let mut tx = self.begin().await?;
        let deleted = self
            .execute_in(
                &mut tx,
                &format!(
                    "DELETE FROM iceberg_tables WHERE catalog_name = ? AND table_namespace = ? \
                     AND table_name = ? AND {TABLE_TYPE_FILTER}"
                ),
                &[CATALOG_NAME, &ident.namespace().join("."), ident.name()],
            )
            .await?;
        if deleted == 0 {
            return Err(ApiError::no_such_table(ident));
        }
        let mut dropped = Uncommitted::new(self, tx, ());
        dropped.purge = table;
        Ok(dropped)
    }

    /// Renames a table, possibly into another namespace. Its files stay where they are.
    pub(crate) async fn rename_table(
        &self,
        from: &TableIdent,
        to: &TableIdent,
    ) -> ApiResult<Uncommitted<'_, ()>> {
        check_name(to.name())?;
        if !self.table_exists(from).await? {
            return Err(ApiError::no_such_table(from));
        }
        if from == to {
            // Nothing changes; the answer is still recorded with the key.
            return Ok(Uncommitted::new(self, self.begin().await?, ()));
        }
        self.require_namespace(to.namespace()).await?;
        if self.name_taken(to).await? {
            return Err(table_exists_error(to));
        }
        let mut tx = self.begin().await?;
        let renamed = self
            .execute_in(
                &mut tx,
                &format!(
                    "UPDATE iceberg_tables SET table_namespace = ?, table_name = ? \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                     AND {TABLE_TYPE_FILTER}"
                ),
                &[
                    &to.namespace().join("."),
                    to.name(),
                    CATALOG_NAME,
                    &from.namespace().join("."),
                    from.name(),
                ],
            )
            .await;
        match renamed {
            Ok(1) => Ok(Uncommitted::new(self, tx, ())),
            Ok(_) => Err(ApiError::no_such_table(from)),
            Err(e) => {
                drop(tx);
                // Lost a race with another replica: the primary key let only one in.
                if self.name_taken(to).await? {
                    Err(table_exists_error(to))
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// Registers an existing metadata file as a table; with `overwrite` replaces the
    /// metadata location of a table that exists.
    pub(crate) async fn register_table(
        &self,
        ident: &TableIdent,
        metadata_location: String,
        overwrite: bool,
    ) -> ApiResult<Uncommitted<'_, LoadTableResult>> {
        check_name(ident.name())?;
        self.require_namespace(ident.namespace()).await?;
        self.check_location(&metadata_location)?;
        let metadata = TableMetadata::read_from(&self.file_io, &metadata_location)
            .await
            .map_err(|e| {
                ApiError::bad_request(format!(
                    "Cannot read table metadata at {metadata_location}: {e}"
                ))
            })?;
        let current = self.metadata_location(ident, TABLE_TYPE_FILTER).await?;
        let mut tx = self.begin().await?;
        let written = match current {
            Some(current) if overwrite => {
                self.execute_in(
                    &mut tx,
                    "UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                     AND metadata_location = ?",
                    &[
                        &metadata_location,
                        &current,
                        CATALOG_NAME,
                        &ident.namespace().join("."),
                        ident.name(),
                        &current,
                    ],
                )
                .await
            }
            Some(_) => return Err(table_exists_error(ident)),
            None => {
                self.execute_in(
                    &mut tx,
                    "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, \
                     metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'TABLE')",
                    &[
                        CATALOG_NAME,
                        &ident.namespace().join("."),
                        ident.name(),
                        &metadata_location,
                    ],
                )
                .await
            }
        };
        match written {
            Ok(1) => {}
            Ok(_) => {
                return Err(ApiError::commit_failed(format!(
                    "Table {ident} changed concurrently"
                )));
            }
            Err(e) => {
                drop(tx);
                if self.name_taken(ident).await? {
                    tracing::debug!(error = %e, "register lost a race");
                    return Err(table_exists_error(ident));
                }
                return Err(e.into());
            }
        }
        Ok(Uncommitted::new(
            self,
            tx,
            LoadTableResult {
                metadata_location: Some(metadata_location),
                metadata,
                config: HashMap::new(),
            },
        ))
    }

    /// Commits requirements and updates to one table (updateTable): its new metadata
    /// location and metadata.
    pub(crate) async fn commit_table(
        &self,
        ident: &TableIdent,
        request: CommitTableRequest,
    ) -> ApiResult<Uncommitted<'_, (String, TableMetadata)>> {
        let prepared = self
            .prepare_commit(ident.clone(), request.requirements, request.updates)
            .await?;
        let swapped = self.swap_in(vec![prepared]).await?;
        Ok(swapped.map(|mut commits| {
            let commit = commits.pop().expect("one commit");
            (commit.location, commit.metadata)
        }))
    }

    /// Commits changes to several tables atomically (commitTransaction): all or none.
    pub(crate) async fn commit_transaction(
        &self,
        changes: Vec<(TableIdent, CommitTableRequest)>,
    ) -> ApiResult<Uncommitted<'_, ()>> {
        let mut seen = HashSet::new();
        let mut prepared = Vec::with_capacity(changes.len());
        for (ident, change) in changes {
            if !seen.insert(ident.clone()) {
                self.discard(&prepared).await;
                return Err(ApiError::bad_request(format!(
                    "Table {ident} appears more than once in the transaction"
                )));
            }
            match self
                .prepare_commit(ident, change.requirements, change.updates)
                .await
            {
                Ok(commit) => prepared.push(commit),
                Err(e) => {
                    self.discard(&prepared).await;
                    return Err(e);
                }
            }
        }
        Ok(self.swap_in(prepared).await?.map(drop))
    }

    /// Checks the requirements against the current metadata, applies the updates and
    /// writes the new metadata file. Nothing is visible to readers yet.
    async fn prepare_commit(
        &self,
        ident: TableIdent,
        requirements: Vec<TableRequirement>,
        updates: Vec<TableUpdate>,
    ) -> ApiResult<PreparedCommit> {
        let base = self.metadata_location(&ident, TABLE_TYPE_FILTER).await?;
        let (metadata, location) = match &base {
            Some(base) => {
                let current = TableMetadata::read_from(&self.file_io, base).await?;
                for requirement in &requirements {
                    requirement
                        .check(Some(&current))
                        .map_err(|e| ApiError::commit_failed(requirement_message(&e)))?;
                }
                let mut builder = current.into_builder(Some(base.clone()));
                for update in updates {
                    builder = update.apply(builder).map_err(|e| invalid_update(&e))?;
                }
                let metadata = builder.build().map_err(|e| invalid_update(&e))?.metadata;
                let location = match MetadataLocation::from_str(base) {
                    Ok(base) => base.with_next_version().with_new_metadata(&metadata),
                    // A registered table whose file is not named `<version>-<uuid>...`.
                    Err(_) => MetadataLocation::new_with_metadata(metadata.location(), &metadata),
                };
                (metadata, location)
            }
            None => {
                if !requirements.contains(&TableRequirement::NotExist) {
                    return Err(ApiError::no_such_table(&ident));
                }
                self.require_namespace(ident.namespace()).await?;
                if self.name_taken(&ident).await? {
                    return Err(ApiError::commit_failed(format!(
                        "Requirement failed: {ident} already exists as a view"
                    )));
                }
                let default_location = self
                    .default_location(ident.namespace(), ident.name())
                    .await?;
                let metadata = metadata_from_create_transaction(updates, default_location)?;
                let location = MetadataLocation::new_with_metadata(metadata.location(), &metadata);
                (metadata, location)
            }
        };
        self.check_location(metadata.location())?;
        metadata.write_to(&self.file_io, &location).await?;
        Ok(PreparedCommit {
            ident,
            base,
            location: location.to_string(),
            metadata,
        })
    }

    /// Swaps the prepared metadata locations in, in one database transaction, each only
    /// if its table is still at the base it was computed on.
    async fn swap_in(
        &self,
        commits: Vec<PreparedCommit>,
    ) -> ApiResult<Uncommitted<'_, Vec<PreparedCommit>>> {
        let mut tx = match self.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                self.discard(&commits).await;
                return Err(e.into());
            }
        };
        for commit in &commits {
            let namespace = commit.ident.namespace().join(".");
            let swapped = match &commit.base {
                Some(base) => {
                    self.execute_in(
                        &mut tx,
                        "UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? \
                         WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                         AND metadata_location = ?",
                        &[&commit.location, base, CATALOG_NAME, &namespace, commit.ident.name(), base],
                    )
                    .await
                }
                None => {
                    self.execute_in(
                        &mut tx,
                        "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, \
                         metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'TABLE')",
                        &[CATALOG_NAME, &namespace, commit.ident.name(), &commit.location],
                    )
                    .await
                }
            };
            let failure = match swapped {
                Ok(1) => continue,
                Ok(_) => ApiError::commit_failed(format!(
                    "Commit failed: table {} was changed by another commit; retry on its new metadata",
                    commit.ident
                )),
                Err(e) if commit.base.is_none() => {
                    tracing::debug!(error = %e, "create transaction lost a race");
                    ApiError::commit_failed(format!(
                        "Requirement failed: table {} was created concurrently",
                        commit.ident
                    ))
                }
                Err(e) => e.into(),
            };
            drop(tx);
            self.discard(&commits).await;
            return Err(failure);
        }
        let written = commits.iter().map(|c| c.location.clone()).collect();
        let mut swapped = Uncommitted::new(self, tx, commits);
        swapped.written = written;
        Ok(swapped)
    }

    /// Deletes the metadata files of commits that were not swapped in.
    async fn discard(&self, commits: &[PreparedCommit]) {
        for commit in commits {
            if let Err(e) = self.file_io.delete(&commit.location).await {
                tracing::warn!(location = %commit.location, error = %e, "could not delete an unused metadata file");
            }
        }
    }

    // ----------------------------------------------------------------------------------
    // Views
    // ----------------------------------------------------------------------------------

    /// The views in a namespace, sorted.
    pub(crate) async fn list_views(
        &self,
        namespace: &NamespaceIdent,
    ) -> ApiResult<Vec<TableIdent>> {
        self.require_namespace(namespace).await?;
        let rows = self
            .fetch_all(
                &format!(
                    "SELECT table_name FROM iceberg_tables \
                     WHERE catalog_name = ? AND table_namespace = ? AND {VIEW_TYPE_FILTER}"
                ),
                &[CATALOG_NAME, &namespace.join(".")],
            )
            .await?;
        let mut views = rows
            .iter()
            .map(|row| {
                Ok(TableIdent::new(
                    namespace.clone(),
                    row.try_get::<String, _>(0)?,
                ))
            })
            .collect::<ApiResult<Vec<_>>>()?;
        views.sort_by(|a, b| a.name().cmp(b.name()));
        Ok(views)
    }

    /// Whether a view exists.
    pub(crate) async fn view_exists(&self, ident: &TableIdent) -> ApiResult<bool> {
        Ok(self
            .metadata_location(ident, VIEW_TYPE_FILTER)
            .await?
            .is_some())
    }

    /// Creates a view.
    pub(crate) async fn create_view(
        &self,
        namespace: &NamespaceIdent,
        request: CreateViewRequest,
    ) -> ApiResult<Uncommitted<'_, LoadViewResult>> {
        check_name(&request.name)?;
        self.require_namespace(namespace).await?;
        let ident = TableIdent::new(namespace.clone(), request.name.clone());
        if self.name_taken(&ident).await? {
            return Err(view_exists_error(&ident));
        }
        let location = match request.location {
            Some(location) => location.trim_end_matches('/').to_owned(),
            None => self.default_location(namespace, &request.name).await?,
        };
        self.check_location(&location)?;
        let metadata = ViewMetadataBuilder::new(
            location,
            request.schema,
            request.view_version,
            ViewFormatVersion::V1,
            request.properties,
        )
        .and_then(ViewMetadataBuilder::build)
        .map_err(|e| invalid_update(&e))?
        .metadata;
        let metadata_location = view_metadata_location(&metadata, 0);
        self.write_view_metadata(&metadata_location, &metadata)
            .await?;
        let written = vec![metadata_location.clone()];
        let mut tx = match self.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                self.delete_unused(&written).await;
                return Err(e.into());
            }
        };
        let inserted = self
            .execute_in(
                &mut tx,
                "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, \
                 metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'VIEW')",
                &[
                    CATALOG_NAME,
                    &namespace.join("."),
                    ident.name(),
                    &metadata_location,
                ],
            )
            .await;
        if let Err(e) = inserted {
            drop(tx);
            self.delete_unused(&written).await;
            return Err(if self.name_taken(&ident).await? {
                view_exists_error(&ident)
            } else {
                e.into()
            });
        }
        let mut created = Uncommitted::new(
            self,
            tx,
            LoadViewResult {
                metadata_location,
                metadata,
                config: HashMap::new(),
            },
        );
        created.written = written;
        Ok(created)
    }

    async fn write_view_metadata(&self, location: &str, metadata: &ViewMetadata) -> ApiResult<()> {
        let json = serde_json::to_vec(metadata)
            .map_err(|e| ApiError::internal(format!("cannot serialize view metadata: {e}")))?;
        self.file_io
            .new_output(location)?
            .write(json.into())
            .await?;
        Ok(())
    }

    /// A view's current metadata and its location.
    pub(crate) async fn load_view(&self, ident: &TableIdent) -> ApiResult<LoadViewResult> {
        let Some(location) = self.metadata_location(ident, VIEW_TYPE_FILTER).await? else {
            return Err(ApiError::no_such_view(ident));
        };
        let bytes = self.file_io.new_input(&location)?.read().await?;
        let metadata: ViewMetadata = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::internal(format!("cannot read view metadata at {location}: {e}"))
        })?;
        Ok(LoadViewResult {
            metadata_location: location,
            metadata,
            config: HashMap::new(),
        })
    }

    /// Applies updates to a view (replaceView), compare-and-swap on its metadata location.
    pub(crate) async fn replace_view(
        &self,
        ident: &TableIdent,
        requirements: Vec<ViewRequirement>,
        updates: Vec<ViewUpdate>,
    ) -> ApiResult<Uncommitted<'_, LoadViewResult>> {
        let current = self.load_view(ident).await?;
        for requirement in requirements {
            match requirement {
                ViewRequirement::AssertViewUuid { uuid } if uuid != current.metadata.uuid() => {
                    return Err(ApiError::commit_failed(format!(
                        "Requirement failed: view UUID does not match: expected {uuid}, found {}",
                        current.metadata.uuid()
                    )));
                }
                ViewRequirement::AssertViewUuid { .. } => {}
            }
        }
        let mut builder = current.metadata.into_builder();
        for update in updates {
            builder = apply_view_update(builder, update).map_err(|e| invalid_update(&e))?;
        }
        let metadata = builder.build().map_err(|e| invalid_update(&e))?.metadata;
        self.check_location(metadata.location())?;
        let version = view_metadata_version(&current.metadata_location).map_or(0, |v| v + 1);
        let location = view_metadata_location(&metadata, version);
        self.write_view_metadata(&location, &metadata).await?;
        let written = vec![location.clone()];
        let mut tx = match self.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                self.delete_unused(&written).await;
                return Err(e.into());
            }
        };
        let swapped = self
            .execute_in(
                &mut tx,
                &format!(
                    "UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                     AND metadata_location = ? AND {VIEW_TYPE_FILTER}"
                ),
                &[
                    &location,
                    &current.metadata_location,
                    CATALOG_NAME,
                    &ident.namespace().join("."),
                    ident.name(),
                    &current.metadata_location,
                ],
            )
            .await;
        if swapped.as_ref().is_ok_and(|swapped| *swapped == 1) {
            let mut replaced = Uncommitted::new(
                self,
                tx,
                LoadViewResult {
                    metadata_location: location,
                    metadata,
                    config: HashMap::new(),
                },
            );
            replaced.written = written;
            return Ok(replaced);
        }
        drop(tx);
        self.delete_unused(&written).await;
        swapped?;
        Err(ApiError::commit_failed(format!(
            "Commit failed: view {ident} was changed by another commit"
        )))
    }

    /// Drops a view from the catalog.
    pub(crate) async fn drop_view(&self, ident: &TableIdent) -> ApiResult<Uncommitted<'_, ()>> {
        let mut tx = self.begin().await?;
        let deleted = self
            .execute_in(
                &mut tx,
                &format!(
                    "DELETE FROM iceberg_tables WHERE catalog_name = ? AND table_namespace = ? \
                     AND table_name = ? AND {VIEW_TYPE_FILTER}"
                ),
                &[CATALOG_NAME, &ident.namespace().join("."), ident.name()],
            )
            .await?;
        if deleted == 0 {
            return Err(ApiError::no_such_view(ident));
        }
        Ok(Uncommitted::new(self, tx, ()))
    }

    /// Renames a view, possibly into another namespace.
    pub(crate) async fn rename_view(
        &self,
        from: &TableIdent,
        to: &TableIdent,
    ) -> ApiResult<Uncommitted<'_, ()>> {
        check_name(to.name())?;
        if !self.view_exists(from).await? {
            return Err(ApiError::no_such_view(from));
        }
        if from == to {
            // Nothing changes; the answer is still recorded with the key.
            return Ok(Uncommitted::new(self, self.begin().await?, ()));
        }
        self.require_namespace(to.namespace()).await?;
        if self.name_taken(to).await? {
            return Err(view_exists_error(to));
        }
        let mut tx = self.begin().await?;
        let renamed = self
            .execute_in(
                &mut tx,
                &format!(
                    "UPDATE iceberg_tables SET table_namespace = ?, table_name = ? \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                     AND {VIEW_TYPE_FILTER}"
                ),
                &[
                    &to.namespace().join("."),
                    to.name(),
                    CATALOG_NAME,
                    &from.namespace().join("."),
                    from.name(),
                ],
            )
            .await;
        match renamed {
            Ok(1) => Ok(Uncommitted::new(self, tx, ())),
            Ok(_) => Err(ApiError::no_such_view(from)),
            Err(e) => {
                drop(tx);
                if self.name_taken(to).await? {
                    Err(view_exists_error(to))
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// Registers an existing view metadata file as a view.
    pub(crate) async fn register_view(
        &self,
        ident: &TableIdent,
        metadata_location: String,
    ) -> ApiResult<Uncommitted<'_, LoadViewResult>> {
        check_name(ident.name())?;
        self.require_namespace(ident.namespace()).await?;
        self.check_location(&metadata_location)?;
        let bytes = self
            .file_io
            .new_input(&metadata_location)?
            .read()
            .await
            .map_err(|e| ApiError::bad_request(format!("Cannot read {metadata_location}: {e}")))?;
        let metadata: ViewMetadata = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::bad_request(format!("{metadata_location} is not view metadata: {e}"))
        })?;
        if self.name_taken(ident).await? {
            return Err(view_exists_error(ident));
        }
        let mut tx = self.begin().await?;
        let inserted = self
            .execute_in(
                &mut tx,
                "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, \
                 metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'VIEW')",
                &[
                    CATALOG_NAME,
                    &ident.namespace().join("."),
                    ident.name(),
                    &metadata_location,
                ],
            )
            .await;
        if let Err(e) = inserted {
            drop(tx);
            return Err(if self.name_taken(ident).await? {
                view_exists_error(ident)
            } else {
                e.into()
            });
        }
        Ok(Uncommitted::new(
            self,
            tx,
            LoadViewResult {
                metadata_location,
                metadata,
                config: HashMap::new(),
            },
        ))
    }
}

/// Builds the first metadata of a table from the updates of a create transaction (a
/// commit with `assert-create` after `stage-create`): the initial schema, spec, sort
/// order, location, properties, format version and UUID start the metadata, and the
/// updates after them (a first snapshot, more properties) are applied on top.
fn metadata_from_create_transaction(
    updates: Vec<TableUpdate>,
    default_location: String,
) -> ApiResult<TableMetadata> {
    let mut schema = None;
    let mut spec = None;
    let mut sort_order = None;
    let mut location = None;
    let mut format_version = FormatVersion::V2;
    let mut uuid = None;
    let mut properties = HashMap::new();
    let mut rest = Vec::new();
    for update in updates {
        match update {
            TableUpdate::AddSchema { schema: s } if schema.is_none() => schema = Some(s),
            TableUpdate::AddSpec { spec: s } if spec.is_none() => spec = Some(s),
            TableUpdate::AddSortOrder { sort_order: s } if sort_order.is_none() => {
                sort_order = Some(s)
            }
            TableUpdate::SetLocation { location: l } if location.is_none() => location = Some(l),
            TableUpdate::UpgradeFormatVersion { format_version: v } => format_version = v,
            TableUpdate::AssignUuid { uuid: u } => uuid = Some(u),
            TableUpdate::SetProperties { updates } if rest.is_empty() => properties.extend(updates),
            // Selecting what was just added is what `new` does already.
            TableUpdate::SetCurrentSchema { schema_id: -1 }
            | TableUpdate::SetDefaultSpec { spec_id: -1 }
            | TableUpdate::SetDefaultSortOrder { sort_order_id: -1 }
                if rest.is_empty() => {}
            other => rest.push(other),
        }
    }
    let schema = schema.ok_or_else(|| {
        ApiError::bad_request("A create transaction must add a schema (add-schema)")
    })?;
    let mut builder = TableMetadataBuilder::new(
        schema,
        spec.unwrap_or_else(|| UnboundPartitionSpec::builder().build()),
        sort_order.unwrap_or_else(SortOrder::unsorted_order),
        location.unwrap_or(default_location),
        format_version,
        properties,
    )
    .map_err(|e| invalid_update(&e))?;
    if let Some(uuid) = uuid {
        builder = builder.assign_uuid(uuid);
    }
    for update in rest {
        builder = update.apply(builder).map_err(|e| invalid_update(&e))?;
    }
    Ok(builder.build().map_err(|e| invalid_update(&e))?.metadata)
}

fn apply_view_update(
    builder: ViewMetadataBuilder,
    update: ViewUpdate,
) -> iceberg::Result<ViewMetadataBuilder> {
    match update {
        ViewUpdate::AssignUuid { uuid } => Ok(builder.assign_uuid(uuid)),
        ViewUpdate::UpgradeFormatVersion { format_version } => {
            builder.upgrade_format_version(format_version)
        }
        ViewUpdate::AddSchema { schema, .. } => Ok(builder.add_schema(schema)),
        ViewUpdate::SetLocation { location } => Ok(builder.set_location(location)),
        ViewUpdate::SetProperties { updates } => builder.set_properties(updates),
        ViewUpdate::RemoveProperties { removals } => Ok(builder.remove_properties(&removals)),
        ViewUpdate::AddViewVersion { view_version } => builder.add_version(view_version),
        ViewUpdate::SetCurrentViewVersion { view_version_id } => {
            builder.set_current_version_id(view_version_id)
        }
    }
}

/// `<location>/metadata/<version>-<uuid>.metadata.json`, like tables.
fn view_metadata_location(metadata: &ViewMetadata, version: u32) -> String {
    format!(
        "{}/metadata/{version:05}-{}.metadata.json",
        metadata.location().trim_end_matches('/'),
        uuid::Uuid::new_v4()
    )
}

/// The version number in a `<version>-<uuid>.metadata.json` file name.
fn view_metadata_version(location: &str) -> Option<u32> {
    let file = location.rsplit('/').next()?;
    file.split('-').next()?.parse().ok()
}

/// Namespace levels are stored joined with `.` (the SQL catalogs' convention), so a level
/// must not contain one; nor may it be empty.
fn check_namespace(namespace: &NamespaceIdent) -> ApiResult<()> {
    for level in namespace.iter() {
        if level.is_empty() || level.contains(['.', '/', '\u{1f}']) {
            return Err(ApiError::bad_request(format!(
                "Invalid namespace level {level:?}: must be non-empty and contain no '.' or '/'"
            )));
        }
    }
    Ok(())
}

fn check_name(name: &str) -> ApiResult<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(ApiError::bad_request(format!(
            "Invalid name {name:?}: must be non-empty, not . or .., and contain no '/'"
        )));
    }
    Ok(())
}

/// The marker property is the catalog's own; clients neither see nor touch it.
fn check_property_keys<'a>(keys: impl IntoIterator<Item = &'a String>) -> ApiResult<()> {
    for key in keys {
        if key == EXISTS_PROPERTY {
            return Err(ApiError::bad_request(format!(
                "Namespace property {EXISTS_PROPERTY:?} is reserved by the catalog"
            )));
        }
    }
    Ok(())
}

fn visible(mut properties: HashMap<String, String>) -> HashMap<String, String> {
    properties.remove(EXISTS_PROPERTY);
    properties
}

/// `a.b` for messages.
pub(crate) fn display_namespace(namespace: &NamespaceIdent) -> String {
    namespace.join(".")
}

fn namespace_exists_error(namespace: &NamespaceIdent) -> ApiError {
    ApiError::already_exists(format!(
        "Namespace already exists: {}",
        display_namespace(namespace)
    ))
}

fn table_exists_error(ident: &TableIdent) -> ApiError {
    ApiError::already_exists(format!("Table or view already exists: {ident}"))
}

fn view_exists_error(ident: &TableIdent) -> ApiError {
    ApiError::already_exists(format!("View or table already exists: {ident}"))
}

fn requirement_message(error: &iceberg::Error) -> String {
    error.to_string().replace('\n', " ")
}

/// An update the metadata builder refused: the request is wrong, not the server.
fn invalid_update(error: &iceberg::Error) -> ApiError {
    match error.kind() {
        ErrorKind::CatalogCommitConflicts => ApiError::commit_failed(requirement_message(error)),
        _ => ApiError::bad_request(requirement_message(error)),
    }
}
