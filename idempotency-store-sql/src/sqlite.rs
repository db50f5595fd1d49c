//! [`SqliteStore`]: the SQLite backend, the embedded default.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body::Body;
use idempotency_core::{
    Binding, BoxError, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, Ownership, Purged, RecordId, Reservation, ReservationHandle, ScopeQuota,
    StoreError, StoredResponse, async_trait,
};
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool};
use sqlx::{FromRow, Row};
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::common::{
    MAX_ATTEMPTS, Operation, PoolSettings, RawInspection, RawRecord, ScopeUsage, backend,
    evict_verdict, millis, new_token, new_token_other_than, ownership, row_bytes, too_many_races,
    trailers_column,
};
use crate::in_transaction::{self, FinalizeError};
use crate::table::{InvalidTableName, TableName};

/// "Now" by the database clock, in epoch milliseconds. `julianday('now')` has millisecond
/// resolution and is the same for every use within one statement; `ROUND` removes the
/// floating-point error of the conversion. (It works on every SQLite with `RETURNING`,
/// unlike `unixepoch('subsec')`, which needs 3.42.)
const NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

/// An [`IdempotencyStore`] in a SQLite database file (SQLite 3.35 or later): the
/// embedded default, with no server to run. Several processes may share the file on one
/// host; replicas on several hosts need PostgreSQL or MySQL. Cheap to clone: clones
/// share the pool.
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
    /// The turn to write, shared by clones: one writing statement (or transaction) of
    /// this store at a time, in the order they asked.
    writes: Arc<Semaphore>,
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
            scope_usage: format!(
                "SELECT EXISTS (SELECT 1 FROM {t} AS k
                                WHERE k.scope = ?1 AND k.idempotency_key = ?2
                                  AND k.expires_at_ms > {NOW_MS}) AS key_live,
                        count(*) AS records,
                        COALESCE(sum({bytes}), 0) AS bytes,
                        min(r.expires_at_ms) - {NOW_MS} AS next_expiry_in_ms
                 FROM {t} AS r
                 WHERE r.scope = ?1 AND r.expires_at_ms > {NOW_MS}",
                bytes = row_bytes("octet_length", "r"),
            ),
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

/// The finalize statement for records in `table`, for [`AnyFinalizer`](crate::AnyFinalizer).
#[cfg(feature = "any")]
pub(crate) fn finalize_statement(table: &TableName) -> String {
    Statements::new(table).finalize
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
            pool,
            sql: Arc::new(Statements::new(&table)),
            table,
            quota: None,
            writes: Arc::new(Semaphore::new(1)),
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

    /// Reserves on one connection (a write transaction's, when a quota is checked).
    async fn reserve_on(
        &self,
        connection: &mut SqliteConnection,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        // The upsert returns the row as it stands after it ran: ours if it inserted
        // (tokens are 64 random bits, so a live row holding the very token we just drew
        // is a 1-in-2^64 chance), else the existing row, untouched. A live one is the
        // answer; an expired one is replaced by a second, conditional statement, unless
        // another request replaced (or purge removed) it first, and then we look again.
        for _ in 0..MAX_ATTEMPTS {
            let token = new_token();
            let bind = |sql| {
                sqlx::query(sql)
                    .bind(&id.scope)
                    .bind(&id.key)
                    .bind(&binding.method)
                    .bind(&binding.path)
                    .bind(&binding.body_sha256[..])
                    .bind(token.0)
                    .bind(millis(lease))
                    // In flight under a live lease, a record never expires.
                    .bind(millis(lifetime.max(lease)))
            };
            let row = bind(&self.sql.reserve)
                .fetch_one(&mut *connection)
                .await
                .map_err(backend)?;
            let raw = RawRecord::from_row(&row).map_err(backend)?;
            if raw.fencing_token == token.0 {
                return Ok(Reservation::Reserved(token));
            }
            let expires_at_ms: i64 = row.try_get("expires_at_ms").map_err(backend)?;
            if expires_at_ms > raw.now_ms {
                return Ok(Reservation::Exists(raw.into_record()?));
            }
            let replaced = bind(&self.sql.replace_expired)
                .execute(&mut *connection)
                .await
                .map_err(backend)?;
            if replaced.rows_affected() == 1 {
                return Ok(Reservation::Reserved(token));
            }
        }
        Err(too_many_races("reserve"))
    }

    /// Waits for this store's turn to write.
    ///
    /// SQLite lets one writer into a database at a time. Left to itself, every
    /// connection that finds the write lock taken sleeps in SQLite's busy handler and
    /// tries again, with sleeps that grow: under a few concurrent writers some requests
    /// wait hundreds of milliseconds while the lock is free. Queueing this store's writers
    /// here instead hands the lock on at once, in order. (Writers in other processes on
    /// the same file still meet the busy handler.)
    async fn turn_to_write(&self) -> SemaphorePermit<'_> {
        self.writes
            .acquire()
            .await
            .expect("the write gate is never closed")
    }

    /// Runs a fenced UPDATE or DELETE: the token held the record iff one row matched.
    async fn fenced(&self, query: SqliteQuery<'_>) -> Result<Ownership, StoreError> {
        let _turn = self.turn_to_write().await;
        let done = query.execute(&self.pool).await.map_err(backend)?;
        Ok(ownership(done.rows_affected()))
    }

    /// A statement whose first three parameters are the record id and the token.
    fn owned_query<'q>(
        &self,
        sql: &'q str,
        id: &'q RecordId,
        token: FencingToken,
    ) -> SqliteQuery<'q> {
        sqlx::query(sql).bind(&id.scope).bind(&id.key).bind(token.0)
    }

    /// The fenced finalize, with its parameters.
    fn finalize_query<'q>(
        &'q self,
        id: &'q RecordId,
        token: FencingToken,
        response: &'q StoredResponse,
    ) -> SqliteQuery<'q> {
        self.owned_query(&self.sql.finalize, id, token)
            .bind(i32::from(response.status))
            .bind(response.encode_headers())
            .bind(&response.body[..])
            .bind(trailers_column(response))
    }

    /// Finalizes the request's reservation **inside your transaction**, with the answer
    /// you are about to send, and returns the response to send once the transaction
    /// commits: your mutation and its idempotency record commit together or not at
    /// all. Everything [`PostgresStore::finalize_in`](crate::PostgresStore::finalize_in)
    /// says holds here too, with SQLite's one writer at a time: from its first write,
    /// your transaction holds the database's write lock until it ends, so another
    /// process's takeover waits (up to its busy timeout) and then finds the record
    /// finalized (commit) or still in flight (rollback).
    ///
    /// Begin the transaction with `BEGIN IMMEDIATE` (`pool.begin_with("BEGIN
    /// IMMEDIATE")`) if it reads before it writes: a deferred transaction that read
    /// while another connection wrote cannot start writing (`SQLITE_BUSY`), and every
    /// keyed request writes to the same file.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use axum::extract::State;
    /// use axum::response::{IntoResponse, Response};
    /// use axum::{Extension, Router, body::Body, http::{Request, StatusCode}, routing::post};
    /// use idempotency_core::{IdempotencyLayer, ReservationHandle};
    /// use idempotency_store_sql::{PoolSettings, SqliteStore};
    /// use tower::ServiceExt;
    ///
    /// async fn place_order(
    ///     State(store): State<SqliteStore>,
    ///     reservation: Option<Extension<ReservationHandle>>,
    /// ) -> Result<Response, StatusCode> {
    ///     let failed = |_| StatusCode::SERVICE_UNAVAILABLE; // a 5xx: the layer releases the key
    ///     let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.map_err(failed)?;
    ///     sqlx::query("INSERT INTO orders (item) VALUES ('book')")
    ///         .execute(&mut *tx)
    ///         .await
    ///         .map_err(failed)?;
    ///     let answer = (StatusCode::CREATED, "order placed").into_response();
    ///     let answer = store
    ///         .finalize_in(&mut tx, reservation.as_deref(), answer)
    ///         .await
    ///         .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?; // tx rolls back on drop
    ///     tx.commit().await.map_err(failed)?;
    ///     Ok(answer)
    /// }
    ///
    /// let store = SqliteStore::connect("sqlite::memory:", &PoolSettings::default()).await?.migrate().await?;
    /// sqlx::query("CREATE TABLE orders (item TEXT)").execute(store.pool()).await?;
    /// let app = Router::new()
    ///     .route("/orders", post(place_order))
    ///     .with_state(store.clone())
    ///     .layer(IdempotencyLayer::new(store.clone()));
    ///
    /// let order = || Request::post("/orders").header("idempotency-key", "k1").body(Body::empty()).unwrap();
    /// assert_eq!(app.clone().oneshot(order()).await?.status(), StatusCode::CREATED);
    /// let retry = app.oneshot(order()).await?;
    /// assert_eq!(retry.headers()["idempotent-replayed"], "true");
    /// let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders").fetch_one(store.pool()).await?;
    /// assert_eq!(orders, 1);
    /// # Ok(()) }
    /// ```
    pub async fn finalize_in<B>(
        &self,
        transaction: &mut sqlx::SqliteConnection,
        reservation: Option<&ReservationHandle>,
        response: Response<B>,
    ) -> Result<Response<B>, FinalizeError>
    where
        B: Body<Data = Bytes> + From<Bytes>,
        B::Error: Into<BoxError>,
    {
        let prepared = match in_transaction::prepare(reservation, response).await? {
            Ok(prepared) => prepared,
            Err(unchanged) => return Ok(unchanged),
        };
        let reservation = prepared.reservation();
        let stored = prepared
            .stored()
            .expect("prepare() passes on only answers with something to store");
        let done = self
            .finalize_query(reservation.id(), reservation.token(), stored)
            .execute(transaction)
            .await
            .map_err(FinalizeError::Database)?;
        in_transaction::finish(prepared, ownership(done.rows_affected()))
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
        let _turn = self.turn_to_write().await;
        let Some(quota) = self.quota else {
            let mut connection = self.pool.acquire().await.map_err(backend)?;
            return self
                .reserve_on(&mut connection, id, binding, lease, lifetime)
                .await;
        };
        // One write transaction reads the scope's usage and claims its room: SQLite lets
        // one writer in at a time, so nothing changes the scope in between. A replay is
        // never refused.
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(backend)?;
        let usage = sqlx::query(&self.sql.scope_usage)
            .bind(&id.scope)
            .bind(&id.key)
            .fetch_one(&mut *tx)
            .await
            .map_err(backend)?;
        let usage = ScopeUsage {
            key_live: usage.try_get("key_live").map_err(backend)?,
            records: usage.try_get("records").map_err(backend)?,
            bytes: usage.try_get("bytes").map_err(backend)?,
            next_expiry_in_ms: usage.try_get("next_expiry_in_ms").map_err(backend)?,
        };
        if let Some(refusal) = usage.refusal(&quota) {
            return Err(refusal);
        }
        let reservation = self
            .reserve_on(&mut tx, id, binding, lease, lifetime)
            .await?;
        tx.commit().await.map_err(backend)?;
        Ok(reservation)
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
        self.fenced(
            self.owned_query(&self.sql.renew, id, token)
                .bind(millis(lease)),
        )
        .await
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        self.fenced(self.finalize_query(id, token, response)).await
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        self.fenced(self.owned_query(&self.sql.release, id, token))
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
            .fenced(
                self.owned_query(&self.sql.take_over, id, lapsed)
                    .bind(token.0)
                    .bind(millis(lease)),
            )
            .await?;
        Ok((outcome == Ownership::Held).then_some(token))
    }

    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        let limit = i64::try_from(batch_size).unwrap_or(i64::MAX);
        let _turn = self.turn_to_write().await;
        let done = sqlx::query(&self.sql.purge)
            .bind(limit)
            .execute(&self.pool)
            .await
            .map_err(backend)?;
        Ok(Purged::Deleted(done.rows_affected()))
    }

    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        self.inspect_raw(id)
            .await?
            .map(|raw| raw.to_inspected())
            .transpose()
    }

    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        for _ in 0..MAX_ATTEMPTS {
            let Some(raw) = self.inspect_raw(id).await? else {
                return Ok(Eviction::NotFound);
            };
            let inspected = match evict_verdict(&raw, in_flight)? {
                Ok(inspected) => inspected,
                Err(refused) => return Ok(refused),
            };
            let _turn = self.turn_to_write().await;
            let done = self
                .owned_query(&self.sql.evict, id, FencingToken(raw.fencing_token))
                .bind(raw.in_flight())
                .execute(&self.pool)
                .await
                .map_err(backend)?;
            if done.rows_affected() == 1 {
                return Ok(Eviction::Evicted(inspected));
            }
        }
        Err(too_many_races("evict"))
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
