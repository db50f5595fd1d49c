//! [`SqliteStore`]: the SQLite backend, the embedded default.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, Reservation,
    ScopeQuota, StoreError, StoredResponse, async_trait,
};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};

use crate::common::{
    EncodedAnswer, Operation, REPLACE_WITH_EXCLUDED, RawInspection, RawRecord, backend,
    evict_as_read, new_token_other_than, ownership, row_bytes,
};
use crate::pool_settings::PoolSettings;
use crate::table::{InvalidTableName, TableName};

mod writer;

use writer::{Write, Writer, Written};

/// "Now" by the database clock, in epoch milliseconds. `julianday('now')` has millisecond
/// resolution and is the same for every use within one statement; `ROUND` removes the
/// floating-point error of the conversion. (It works on every SQLite with `RETURNING`,
/// unlike `unixepoch('subsec')`, which needs 3.42.)
const NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

/// An [`IdempotencyStore`] in a SQLite database file (SQLite 3.35 or later): the
/// embedded default, with no server to run. Several processes may share the file on one
/// host; replicas on several hosts need PostgreSQL or MySQL. Cheap to clone: clones
/// share the pool and the writer.
///
/// SQLite lets one connection write at a time, and every commit waits for the disk. A
/// write that finds none of this store's writes running runs at once, as its own
/// statement; writes that find one running queue, and the store's writer task commits
/// all that wait in one transaction, answering each after that commit (group commit: one
/// flush for the group, so throughput grows with concurrency instead of staying at one
/// flush per write). A reserve reads first: a live record (a replay, a duplicate) is
/// answered by a `SELECT`, without waiting for the write lock. Durability is SQLite's
/// default, `synchronous = FULL`: no caller hears of a write before it is on disk.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency_store_sql::{PoolSettings, SqliteStore};
///
/// let store = SqliteStore::connect("sqlite:/var/lib/catalog/idempotency.db", &PoolSettings::default())
///     .await?
///     .migrate()
///     .await?;
/// # drop(store); Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
    table: TableName,
    sql: Arc<Statements>,
    quota: Option<ScopeQuota>,
    /// The task that runs this store's writes, shared by clones (see [`writer`]).
    writer: Arc<Writer>,
}

#[derive(Debug)]
struct Statements {
    migrate: String,
    /// What a scope holds, read inside the reserving write transaction when a quota is
    /// set.
    scope_usage: String,
    reserve: String,
    replace_expired: String,
    load: String,
    renew: String,
    finalize: String,
    release: String,
    take_over: String,
    purge: String,
    inspect: String,
    evict: String,
}

impl Statements {
    fn new(table: &TableName) -> Self {
        let t = format!("\"{table}\"");
        let index = table.expiry_index_name();
        let owned = format!(
            "scope = ?1 AND idempotency_key = ?2 AND fencing_token = ?3 \
             AND response_status IS NULL AND expires_at_ms > {NOW_MS}"
        );
        // A record as `RawRecord` decodes it.
        let record_columns = format!(
            "method, path, body_sha256, fencing_token, lease_expires_at_ms,
             {NOW_MS} AS now_ms, response_status, response_headers, response_body,
             response_trailers"
        );
        Self {
            scope_usage: scope_usage_statement(table),
            migrate: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
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
                    response_trailers   BLOB    NULL,
                    PRIMARY KEY (scope, idempotency_key)
                );
                CREATE INDEX IF NOT EXISTS \"{index}\" ON {t} (expires_at_ms);"
            ),
            // DO UPDATE, not DO NOTHING, because only an updated row comes back from
            // RETURNING; the assignment leaves the row byte for byte as it was, and SQLite
            // writes no page for a cell that comes out unchanged, so a replay writes
            // nothing. Every column is left alone on purpose: assigning the indexed
            // expires_at_ms, even to its own value, rewrites its index entry (one page
            // written and synced per replay), so an expired row is replaced by
            // `replace_expired` instead.
            reserve: format!(
                "INSERT INTO {t}
                    (scope, idempotency_key, method, path, body_sha256, fencing_token,
                     created_at_ms, expires_at_ms, lease_expires_at_ms,
                     response_status, response_headers, response_body)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6,
                         {NOW_MS}, {NOW_MS} + ?8, {NOW_MS} + ?7, NULL, NULL, NULL)
                 ON CONFLICT (scope, idempotency_key) DO UPDATE SET
                    fencing_token = fencing_token
                 RETURNING {record_columns}, expires_at_ms"
            ),
            replace_expired: format!(
                "UPDATE {t} SET
                    method = ?3, path = ?4, body_sha256 = ?5, fencing_token = ?6,
                    created_at_ms = {NOW_MS}, expires_at_ms = {NOW_MS} + ?8,
                    lease_expires_at_ms = {NOW_MS} + ?7,
                    response_status = NULL, response_headers = NULL, response_body = NULL,
                    response_trailers = NULL
                 WHERE scope = ?1 AND idempotency_key = ?2 AND expires_at_ms <= {NOW_MS}"
            ),
            load: format!(
                "SELECT {record_columns}
                 FROM {t}
                 WHERE scope = ?1 AND idempotency_key = ?2 AND expires_at_ms > {NOW_MS}"
            ),
            // The expiry moves with the lease, so a record in flight under a live lease
            // never expires. SQLite reads 'now' once per statement.
            renew: format!(
                "UPDATE {t} SET lease_expires_at_ms = {NOW_MS} + ?4,
                     expires_at_ms = MAX(expires_at_ms, {NOW_MS} + ?4)
                 WHERE {owned}"
            ),
            finalize: format!(
                "UPDATE {t}
                 SET response_status = ?4, response_headers = ?5, response_body = ?6,
                     response_trailers = ?7
                 WHERE {owned}"
            ),
            release: format!("DELETE FROM {t} WHERE {owned}"),
            take_over: format!(
                "UPDATE {t}
                 SET fencing_token = ?4, lease_expires_at_ms = {NOW_MS} + ?5,
                     expires_at_ms = MAX(expires_at_ms, {NOW_MS} + ?5)
                 WHERE {owned} AND lease_expires_at_ms <= {NOW_MS}"
            ),
            purge: format!(
                "DELETE FROM {t} WHERE rowid IN
                    (SELECT rowid FROM {t} WHERE expires_at_ms <= {NOW_MS} LIMIT ?1)"
            ),
            inspect: format!(
                "SELECT method, path, body_sha256, fencing_token, created_at_ms, expires_at_ms,
                        lease_expires_at_ms, {NOW_MS} AS now_ms, response_status
                 FROM {t}
                 WHERE scope = ?1 AND idempotency_key = ?2 AND expires_at_ms > {NOW_MS}"
            ),
            evict: format!(
                "DELETE FROM {t}
                 WHERE scope = ?1 AND idempotency_key = ?2 AND fencing_token = ?3
                   AND (response_status IS NULL) = ?4 AND expires_at_ms > {NOW_MS}"
            ),
        }
    }
}

/// The finalize statement for records in `table`, for the answers a `Tx` writes.
pub(crate) fn finalize_statement(table: &TableName) -> String {
    Statements::new(table).finalize
}

/// The one-commit path's record ([`OneCommitStore`](crate::OneCommitStore)), written
/// whole, with its answer, in the handler's transaction: inserted, or put in the place of
/// an expired one; nothing (0 rows) if a live record holds the key. Parameters: scope,
/// key, method, path, body_sha256, token, lifetime, lease, status, headers, body,
/// trailers.
pub(crate) fn insert_completed_statement(table: &TableName) -> String {
    format!(
        "INSERT INTO \"{table}\"
         (scope, idempotency_key, method, path, body_sha256, fencing_token,
          created_at_ms, expires_at_ms, lease_expires_at_ms,
          response_status, response_headers, response_body, response_trailers)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, {NOW_MS}, {NOW_MS} + ?7, {NOW_MS} + ?8,
                 ?9, ?10, ?11, ?12)
         ON CONFLICT (scope, idempotency_key) DO UPDATE SET {REPLACE_WITH_EXCLUDED}
         WHERE expires_at_ms <= {NOW_MS}"
    )
}

/// The one-commit path's in-flight record, written under a reservation's own token when
/// the reservation has to outlive the handler's transaction (an unknown outcome holds the
/// key; an answer is kept after the handler's transaction rolled back): an expired record
/// is replaced, a live one left alone (no row written). Bound as the PostgreSQL and MySQL
/// statements of the same name are: scope, key, method, path, body_sha256, token,
/// lifetime, lease.
pub(crate) fn insert_in_flight_statement(table: &TableName) -> String {
    format!(
        "INSERT INTO \"{table}\"
         (scope, idempotency_key, method, path, body_sha256, fencing_token,
          created_at_ms, expires_at_ms, lease_expires_at_ms,
          response_status, response_headers, response_body, response_trailers)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, {NOW_MS}, {NOW_MS} + ?7, {NOW_MS} + ?8,
                 NULL, NULL, NULL, NULL)
         ON CONFLICT (scope, idempotency_key) DO UPDATE SET {REPLACE_WITH_EXCLUDED}
         WHERE expires_at_ms <= {NOW_MS}"
    )
}

type SqliteQuery<'q> = sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>;

impl SqliteStore {
    /// A store on the caller's pool, using the table
    /// [`idempotency_records`](crate::DEFAULT_TABLE_NAME). The pool should have a busy
    /// timeout (sqlx's default is 5 s) and preferably WAL journaling, as
    /// [`connect`](Self::connect) sets up.
    pub fn new(pool: SqlitePool) -> Self {
        let table = TableName::default();
        Self {
            sql: Arc::new(Statements::new(&table)),
            table,
            quota: None,
            writer: Arc::new(Writer::new(pool.clone())),
            pool,
        }
    }

    /// Opens a pool of its own to `url` (`sqlite:path/to/file.db`, `sqlite::memory:`),
    /// creating the file if it is missing, in WAL mode.
    ///
    /// An in-memory database lives only as long as its connections, so for one the pool
    /// keeps a single connection open for good whatever `settings` say.
    pub async fn connect(url: &str, settings: &PoolSettings) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url).map_err(backend)?;
        if url.contains(":memory:") || url.contains("mode=memory") {
            let pool = settings
                .pool_options()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(options)
                .await
                .map_err(backend)?;
            return Ok(Self::new(pool));
        }
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        Self::connect_with(options, settings).await
    }

    /// Opens a pool of its own with explicit connect options.
    pub async fn connect_with(
        options: SqliteConnectOptions,
        settings: &PoolSettings,
    ) -> Result<Self, StoreError> {
        let pool = settings
            .pool_options()
            // A connection to a file cannot drop the way a socket can; the check before
            // each acquire would be one more round trip to the connection's thread,
            // taken while this store's writers queue behind the one holding the lock.
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(backend)?;
        Ok(Self::new(pool))
    }

    /// Uses the table `name` instead of the default.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, InvalidTableName> {
        self.table = TableName::new(name)?;
        self.sql = Arc::new(Statements::new(&self.table));
        Ok(self)
    }

    /// Bounds what each scope may hold (see [`ScopeQuota`]). Reservations of a new key
    /// then run in a write transaction (`BEGIN IMMEDIATE`) that reads the scope's usage
    /// and claims its room at once: a quota costs a scan of the scope's live records per
    /// new key.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::SqlitePool) {
    /// use idempotency_core::ScopeQuota;
    /// use idempotency_store_sql::SqliteStore;
    ///
    /// let store = SqliteStore::new(pool).with_scope_quota(ScopeQuota::default().with_max_records(10_000));
    /// # drop(store); }
    /// ```
    pub fn with_scope_quota(mut self, quota: ScopeQuota) -> Self {
        self.quota = Some(quota);
        self
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The table the store uses.
    pub fn table_name(&self) -> &TableName {
        &self.table
    }

    /// The SQL this store runs for `operation`, exactly as it sends it.
    pub fn sql(&self, operation: Operation) -> &str {
        let sql = &self.sql;
        match operation {
            Operation::Reserve => &sql.reserve,
            Operation::Load => &sql.load,
            Operation::Renew => &sql.renew,
            Operation::Finalize => &sql.finalize,
            Operation::Release => &sql.release,
            Operation::TakeOver => &sql.take_over,
            Operation::Purge => &sql.purge,
            Operation::Inspect => &sql.inspect,
            Operation::Evict => &sql.evict,
        }
    }

    /// The reserve statement ([`sql`](Self::sql)`(Operation::Reserve)`) with its
    /// parameters, as the store's writer sends it.
    ///
    /// Not part of the API: it exists for the benchmarks, which issue the store's
    /// statements raw and must bind them exactly as the store does.
    #[doc(hidden)]
    pub fn reserve_query<'q>(
        &'q self,
        id: &'q RecordId,
        binding: &'q Binding,
        token: FencingToken,
        lease: Duration,
        lifetime: Duration,
    ) -> SqliteQuery<'q> {
        writer::reserve_query(&self.sql, id, binding, token, lease, lifetime)
    }

    /// The fenced finalize ([`sql`](Self::sql)`(Operation::Finalize)`) with its
    /// parameters, as the store's writer sends it.
    ///
    /// Not part of the API: it exists for the benchmarks, which issue the store's
    /// statements raw and must bind them exactly as the store does.
    #[doc(hidden)]
    pub fn finalize_query<'q>(
        &'q self,
        id: &'q RecordId,
        token: FencingToken,
        answer: &'q EncodedAnswer,
    ) -> SqliteQuery<'q> {
        writer::finalize_query(&self.sql, id, token, answer)
    }

    /// Creates the table and its expiry index if they do not exist, in one transaction,
    /// then adds the columns a table created by an earlier release lacks
    /// (`response_trailers`). Safe to call from several tasks or processes at once:
    /// SQLite serializes writers, and a column another migrator added first is taken as
    /// added.
    pub async fn migrate(self) -> Result<Self, StoreError> {
        let mut tx = self.pool.begin().await.map_err(backend)?;
        sqlx::raw_sql(&self.sql.migrate)
            .execute(&mut *tx)
            .await
            .map_err(backend)?;
        tx.commit().await.map_err(backend)?;
        let has_trailers: bool = sqlx::query_scalar(
            "SELECT COUNT(*) > 0 FROM pragma_table_info(?1) WHERE name = 'response_trailers'",
        )
        .bind(self.table.as_str())
        .fetch_one(&self.pool)
        .await
        .map_err(backend)?;
        if !has_trailers {
            let add = format!(
                "ALTER TABLE \"{}\" ADD COLUMN response_trailers BLOB NULL",
                self.table
            );
            match sqlx::raw_sql(&add).execute(&self.pool).await {
                Ok(_) => {}
                // Another migrator added it between our check and our ALTER.
                Err(sqlx::Error::Database(error))
                    if error.message().contains("duplicate column name") => {}
                Err(error) => return Err(backend(error)),
            }
        }
        Ok(self)
    }

    /// Runs a write on this store's writer, answering once it is committed.
    async fn write(&self, write: Write) -> Result<Written, StoreError> {
        self.writer.write(&self.sql, write).await
    }

    /// Runs a fenced write: the token held the record iff it changed one row.
    async fn fenced(&self, write: Write) -> Result<Ownership, StoreError> {
        Ok(ownership(self.write(write).await?.rows()))
    }
}

#[async_trait]
impl IdempotencyStore for SqliteStore {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        // A live record answers a replay or a duplicate as the reserve would, and reading
        // it needs no turn at the write lock: replays run side by side on the pool's
        // connections. A new key costs one SELECT more, next to its commit's flush.
        if let Some(record) = self.load(id).await? {
            return Ok(Reservation::Exists(record));
        }
        let reserve = Write::Reserve {
            id: id.clone(),
            binding: binding.clone(),
            lease,
            lifetime,
            quota: self.quota,
        };
        Ok(self.write(reserve).await?.reservation())
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        let raw: Option<RawRecord> = sqlx::query_as(&self.sql.load)
            .bind(&id.scope)
            .bind(&id.key)
            .fetch_optional(&self.pool)
            .await
            .map_err(backend)?;
        raw.map(RawRecord::into_record).transpose()
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.fenced(Write::Renew {
            id: id.clone(),
            token,
            lease,
        })
        .await
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        self.fenced(Write::Finalize {
            id: id.clone(),
            token,
            answer: EncodedAnswer::new(response),
        })
        .await
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        self.fenced(Write::Release {
            id: id.clone(),
            token,
        })
        .await
    }

    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        let token = new_token_other_than(lapsed);
        let outcome = self
            .fenced(Write::TakeOver {
                id: id.clone(),
                lapsed,
                token,
                lease,
            })
            .await?;
        Ok((outcome == Ownership::Held).then_some(token))
    }
}

#[async_trait]
impl RecordAdmin for SqliteStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        self.inspect_raw(id)
            .await?
            .map(|raw| raw.to_inspected())
            .transpose()
    }

    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        let inspect = || self.inspect_raw(id);
        let delete = |token: FencingToken, in_flight: bool| async move {
            let evict = Write::Evict {
                id: id.clone(),
                token,
                in_flight,
            };
            Ok(self.fenced(evict).await? == Ownership::Held)
        };
        evict_as_read(inspect, delete, in_flight).await
    }
}

#[async_trait]
impl PurgeExpired for SqliteStore {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        let limit = i64::try_from(batch_size).unwrap_or(i64::MAX);
        let deleted = self.write(Write::Purge { limit }).await?.rows();
        Ok(Purged::Deleted(deleted))
    }
}

impl SqliteStore {
    async fn inspect_raw(&self, id: &RecordId) -> Result<Option<RawInspection>, StoreError> {
        sqlx::query_as(&self.sql.inspect)
            .bind(&id.scope)
            .bind(&id.key)
            .fetch_optional(&self.pool)
            .await
            .map_err(backend)
    }
}

/// What a scope holds, for its quota (`ScopeUsage`): whether the reserving key is live,
/// the scope's live records, their bytes, and when the next of them expires.
pub(crate) fn scope_usage_statement(table: &TableName) -> String {
    let t = format!("\"{table}\"");
    format!(
        "SELECT EXISTS (SELECT 1 FROM {t} AS k
                        WHERE k.scope = ?1 AND k.idempotency_key = ?2
                          AND k.expires_at_ms > {NOW_MS}) AS key_live,
                count(*) AS records,
                COALESCE(sum({bytes}), 0) AS bytes,
                min(r.expires_at_ms) - {NOW_MS} AS next_expiry_in_ms
         FROM {t} AS r
         WHERE r.scope = ?1 AND r.expires_at_ms > {NOW_MS}",
        bytes = row_bytes("octet_length", "r"),
    )
}
