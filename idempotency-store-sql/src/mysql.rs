//! [`MySqlStore`]: the MySQL 8 / MariaDB 10.6+ backend.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, Reservation,
    ScopeQuota, StoreError, StoredResponse, async_trait,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlDatabaseError, MySqlPool, MySqlRow};
use sqlx::{Connection, Row};
use tokio::sync::OnceCell;

use crate::common::{
    EncodedAnswer, MAX_ATTEMPTS, Operation, PoolSettings, RawInspection, RawRecord, ScopeUsage,
    backend, evict_verdict, millis, new_token, new_token_other_than, ownership, row_bytes,
    too_many_races,
};
use crate::table::{InvalidTableName, TableName};

type MySqlQuery<'q> = sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>;

/// "Now" by the database clock, in epoch milliseconds. Computed from `UTC_TIMESTAMP`
/// with plain DATETIME arithmetic, so neither the session time zone nor a daylight-saving
/// fold can shift it; MySQL and MariaDB evaluate it once per statement.
const NOW_MS: &str =
    "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

/// (The markers are set inside `IF(LAST_INSERT_ID(n) = n, value, NULL)`: the optimizer
/// cannot fold that away, as it folds `LAST_INSERT_ID(n) IS NULL`, and were the marker
/// ever missing, the outcome check fails closed with an error instead of guessing.)
///
/// `LAST_INSERT_ID` value that reserve's VALUES list sets: the row was inserted (or, with
/// two affected rows, an expired row was replaced).
const MARK_INSERTED: u64 = 1;
/// `LAST_INSERT_ID` value that reserve's ON DUPLICATE KEY UPDATE sets when the existing
/// row is live and was left as it is.
const MARK_EXISTING: u64 = 2;

/// The widest values the MySQL schema holds. Longer ones are refused before they reach
/// the server, which could otherwise truncate them silently when not in strict mode.
const MAX_KEY_CHARS: usize = 255;
const MAX_METHOD_CHARS: usize = 255;
const MAX_PATH_BYTES: usize = 65_535;

/// ER_LOCK_DEADLOCK: InnoDB rolled the statement back; running it again is safe.
const ER_LOCK_DEADLOCK: u16 = 1213;

/// An [`IdempotencyStore`] on MySQL 8 or MariaDB 10.6+ (InnoDB). Cheap to clone: clones
/// share the pool.
///
/// The two servers take different reserve statements: MariaDB's `INSERT … RETURNING`
/// answers a replay in one statement, while MySQL 8, which has no `RETURNING`, needs a
/// second statement to read the existing row. The store asks the server which it is
/// (`SELECT VERSION()`) once, in [`connect`](Self::connect) and
/// [`migrate`](Self::migrate), or at its first reserve when built with
/// [`new`](Self::new), and remembers the answer.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency_store_sql::{MySqlStore, PoolSettings};
///
/// let store = MySqlStore::connect("mysql://app@db/catalog", &PoolSettings::default())
///     .await?
///     .migrate()
///     .await?;
/// # drop(store); Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct MySqlStore {
    pool: MySqlPool,
    table: TableName,
    sql: Arc<Statements>,
    /// Which server the pool talks to, learned once and shared by clones.
    flavor: Arc<OnceCell<Flavor>>,
    quota: Option<ScopeQuota>,
}

/// The server behind the pool, as far as reserve is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavor {
    /// MySQL 8: no `RETURNING`, so a key held by a live row takes a second statement.
    MySql,
    /// MariaDB (10.5+): `INSERT … ON DUPLICATE KEY UPDATE … RETURNING` hands back the row
    /// as it stands after the statement, so every reserve is one statement.
    MariaDb,
}

#[derive(Debug)]
struct Statements {
    migrate: String,
    /// What a scope holds, read with a locking read (the scope's index range stays
    /// locked until the transaction ends) when a quota is set.
    scope_usage: String,
    /// MySQL 8's reserve: outcome read from the OK packet, row read by `load`.
    reserve: String,
    /// MariaDB's reserve: the same upsert, returning the row.
    reserve_returning: String,
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
        let t = format!("`{table}`");
        let index = table.expiry_index_name();
        // Parameters: scope, key, token, in this order, after any SET parameters.
        let owned = format!(
            "scope = ? AND idempotency_key = ? AND fencing_token = ? \
             AND response_status IS NULL AND expires_at_ms > {NOW_MS}"
        );
        // ON DUPLICATE KEY UPDATE assigns left to right, and each assignment sees the
        // columns assigned before it. Every assignment tests the *old* expires_at_ms, so
        // expires_at_ms is assigned last.
        let expired = "expires_at_ms <= VALUES(created_at_ms)";
        let replace =
            |column: &str| format!("{column} = IF({expired}, VALUES({column}), {column})");
        // The two reserve statements differ only in how they report the outcome: MySQL 8's
        // sets LAST_INSERT_ID markers (in the new row's created_at_ms and in the kept
        // row's fencing_token), MariaDB's returns the row.
        // Parameters: scope, key, method, path, body_sha256, token, lifetime, lease.
        let upsert = |created_at_ms: &str, kept_token: &str, returning: &str| {
            format!(
                "INSERT INTO {t}
                    (scope, idempotency_key, method, path, body_sha256, fencing_token,
                     created_at_ms, expires_at_ms, lease_expires_at_ms,
                     response_status, response_headers, response_body)
                 VALUES (?, ?, ?, ?, ?, ?, {created_at_ms},
                         {NOW_MS} + ?, {NOW_MS} + ?, NULL, NULL, NULL)
                 ON DUPLICATE KEY UPDATE
                    {method},
                    {path},
                    {body_sha256},
                    fencing_token = IF({expired}, VALUES(fencing_token), {kept_token}),
                    {created_at_ms_column},
                    {lease_expires_at_ms},
                    response_status = IF({expired}, NULL, response_status),
                    response_headers = IF({expired}, NULL, response_headers),
                    response_body = IF({expired}, NULL, response_body),
                    response_trailers = IF({expired}, NULL, response_trailers),
                    {expires_at_ms}
                 {returning}",
                method = replace("method"),
                path = replace("path"),
                body_sha256 = replace("body_sha256"),
                created_at_ms_column = replace("created_at_ms"),
                lease_expires_at_ms = replace("lease_expires_at_ms"),
                expires_at_ms = replace("expires_at_ms"),
            )
        };
        // A record as `RawRecord` decodes it. sqlx reads utf8mb4_bin text columns as
        // binary (the server flags them BINARY), so the two text columns are cast to the
        // connection's charset.
        let record_columns = format!(
            "CAST(method AS CHAR CHARACTER SET utf8mb4) AS method,
             CAST(path AS CHAR CHARACTER SET utf8mb4) AS path, body_sha256, fencing_token,
             lease_expires_at_ms, {NOW_MS} AS now_ms, response_status, response_headers,
             response_body, response_trailers"
        );
        Self {
            // Locking the scope's rows (and the gaps between them) until the reservation
            // commits, so that the usage read is still true when it does.
            scope_usage: format!("{} FOR UPDATE", scope_usage_statement(table)),
            migrate: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    scope               VARCHAR(255) NOT NULL,
                    idempotency_key     VARCHAR(255) NOT NULL,
                    method              VARCHAR(255) NOT NULL,
                    path                TEXT         NOT NULL,
                    body_sha256         BINARY(32)   NOT NULL,
                    fencing_token       BIGINT       NOT NULL,
                    created_at_ms       BIGINT       NOT NULL,
                    expires_at_ms       BIGINT       NOT NULL,
                    lease_expires_at_ms BIGINT       NOT NULL,
                    response_status     INT          NULL,
                    response_headers    MEDIUMBLOB   NULL,
                    response_body       LONGBLOB     NULL,
                    response_trailers   MEDIUMBLOB   NULL,
                    PRIMARY KEY (scope, idempotency_key),
                    KEY `{index}` (expires_at_ms)
                ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            ),
            reserve: upsert(
                &format!("IF(LAST_INSERT_ID({MARK_INSERTED}) = {MARK_INSERTED}, {NOW_MS}, NULL)"),
                &format!(
                    "IF(LAST_INSERT_ID({MARK_EXISTING}) = {MARK_EXISTING}, fencing_token, NULL)"
                ),
                "",
            ),
            // No markers: the returned row's fencing token tells the outcome. The
            // RETURNING list is the one `load` selects, so both decode alike.
            reserve_returning: upsert(
                NOW_MS,
                "fencing_token",
                &format!("RETURNING {record_columns}"),
            ),
            load: format!(
                "SELECT {record_columns}
                 FROM {t}
                 WHERE scope = ? AND idempotency_key = ? AND expires_at_ms > {NOW_MS}"
            ),
            // The expiry moves with the lease, so a record in flight under a live lease
            // never expires. The lease is bound twice rather than read back from the
            // first assignment, which MariaDB's SIMULTANEOUS_ASSIGNMENT mode would change.
            renew: format!(
                "UPDATE {t} SET lease_expires_at_ms = {NOW_MS} + ?,
                     expires_at_ms = GREATEST(expires_at_ms, {NOW_MS} + ?)
                 WHERE {owned}"
            ),
            finalize: format!(
                "UPDATE {t}
                 SET response_status = ?, response_headers = ?, response_body = ?,
                     response_trailers = ?
                 WHERE {owned}"
            ),
            release: format!("DELETE FROM {t} WHERE {owned}"),
            take_over: format!(
                "UPDATE {t}
                 SET fencing_token = ?, lease_expires_at_ms = {NOW_MS} + ?,
                     expires_at_ms = GREATEST(expires_at_ms, {NOW_MS} + ?)
                 WHERE {owned} AND lease_expires_at_ms <= {NOW_MS}"
            ),
            purge: format!("DELETE FROM {t} WHERE expires_at_ms <= {NOW_MS} LIMIT ?"),
            inspect: format!(
                "SELECT CAST(method AS CHAR CHARACTER SET utf8mb4) AS method,
                        CAST(path AS CHAR CHARACTER SET utf8mb4) AS path, body_sha256,
                        fencing_token, created_at_ms, expires_at_ms, lease_expires_at_ms,
                        {NOW_MS} AS now_ms, response_status
                 FROM {t}
                 WHERE scope = ? AND idempotency_key = ? AND expires_at_ms > {NOW_MS}"
            ),
            evict: format!(
                "DELETE FROM {t}
                 WHERE scope = ? AND idempotency_key = ? AND fencing_token = ?
                   AND (response_status IS NULL) = ? AND expires_at_ms > {NOW_MS}"
            ),
        }
    }
}

/// The finalize statement for records in `table`, for [`AnyFinalizer`](crate::AnyFinalizer).
pub(crate) fn finalize_statement(table: &TableName) -> String {
    Statements::new(table).finalize
}

/// A plain insert of an in-flight record, for the [one-commit path](crate::OneCommitStore):
/// no conflict handling, so that a duplicate key fails (or, while the key's row is
/// uncommitted, waits for its transaction). Parameters: scope, key, method, path,
/// body_sha256, token, lifetime, lease.
pub(crate) fn insert_in_flight_statement(table: &TableName) -> String {
    format!(
        "INSERT INTO `{table}`
         (scope, idempotency_key, method, path, body_sha256, fencing_token,
          created_at_ms, expires_at_ms, lease_expires_at_ms)
         VALUES (?, ?, ?, ?, ?, ?, {NOW_MS}, {NOW_MS} + ?, {NOW_MS} + ?)"
    )
}

impl MySqlStore {
    /// A store on the caller's pool (shared, e.g. with a catalog), using the table
    /// [`idempotency_records`](crate::DEFAULT_TABLE_NAME).
    ///
    /// The store relies on sqlx's MySQL connections reporting *found* rather than
    /// *changed* rows (`CLIENT_FOUND_ROWS`, which sqlx always sets), so that renewing a
    /// lease to the value it already has still counts as held.
    ///
    /// Whether the server is MySQL or MariaDB is learned by [`migrate`](Self::migrate) or
    /// the first reserve (see [`sql`](Self::sql)).
    pub fn new(pool: MySqlPool) -> Self {
        let table = TableName::default();
        Self {
            pool,
            sql: Arc::new(Statements::new(&table)),
            table,
            flavor: Arc::new(OnceCell::new()),
            quota: None,
        }
    }

    /// Opens a pool of its own to `url` (`mysql://user:password@host:port/db`;
    /// `mariadb://` is accepted as a synonym).
    pub async fn connect(url: &str, settings: &PoolSettings) -> Result<Self, StoreError> {
        let options: MySqlConnectOptions = mysql_url(url).parse().map_err(backend)?;
        Self::connect_with(options, settings).await
    }

    /// Opens a pool of its own with explicit connect options.
    pub async fn connect_with(
        options: MySqlConnectOptions,
        settings: &PoolSettings,
    ) -> Result<Self, StoreError> {
        let pool = settings
            .pool_options()
            .connect_with(options)
            .await
            .map_err(backend)?;
        let store = Self::new(pool);
        store.flavor().await?;
        Ok(store)
    }

    /// Uses the table `name` instead of the default.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, InvalidTableName> {
        self.table = TableName::new(name)?;
        self.sql = Arc::new(Statements::new(&self.table));
        Ok(self)
    }

    /// Bounds what each scope may hold (see [`ScopeQuota`]). Reservations of a new key
    /// then run in a REPEATABLE READ transaction whose first read of the scope's records
    /// locks the scope's range of the primary key, so that nodes sharing the table check
    /// and claim the quota one at a time (InnoDB may pick one of two such transactions as
    /// a deadlock victim; it is run again). A quota costs a transaction and a scan of the
    /// scope's live records per new key.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::MySqlPool) {
    /// use idempotency_core::ScopeQuota;
    /// use idempotency_store_sql::MySqlStore;
    ///
    /// let store = MySqlStore::new(pool).with_scope_quota(ScopeQuota::default().with_max_records(10_000));
    /// # drop(store); }
    /// ```
    pub fn with_scope_quota(mut self, quota: ScopeQuota) -> Self {
        self.quota = Some(quota);
        self
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The table the store uses.
    pub fn table_name(&self) -> &TableName {
        &self.table
    }

    /// The SQL this store runs for `operation`, exactly as it sends it.
    ///
    /// Reserve depends on the server: on MariaDB it is the upsert with `RETURNING`, on
    /// MySQL 8 the upsert without (followed, when a live row holds the key, by the
    /// [`Load`](Operation::Load) statement). Until the store has learned which server it
    /// talks to (a store from [`new`](Self::new) before `migrate` or its first reserve),
    /// this shows the MySQL 8 form.
    pub fn sql(&self, operation: Operation) -> &str {
        let sql = &self.sql;
        match operation {
            Operation::Reserve => match self.flavor.get() {
                Some(Flavor::MariaDb) => &sql.reserve_returning,
                Some(Flavor::MySql) | None => &sql.reserve,
            },
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

    /// Creates the table (with its expiry index declared inside `CREATE TABLE`, since
    /// MySQL 8 has no `CREATE INDEX IF NOT EXISTS`) if it does not exist, then adds the
    /// columns a table created by an earlier release lacks (`response_trailers`: MySQL 8
    /// has no `ADD COLUMN IF NOT EXISTS`, so the catalog is checked first; a nullable
    /// column at the end is added in place, without copying the table). Safe to call
    /// from several nodes at once: MySQL and MariaDB serialize the DDL on a metadata lock,
    /// and a column another migrator added first is taken as added.
    pub async fn migrate(self) -> Result<Self, StoreError> {
        retry_deadlocks(|| sqlx::raw_sql(&self.sql.migrate).execute(&self.pool))
            .await
            .map_err(backend)?;
        let has_trailers: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.COLUMNS
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?
               AND COLUMN_NAME = 'response_trailers'",
        )
        .bind(self.table.as_str())
        .fetch_one(&self.pool)
        .await
        .map_err(backend)?;
        if has_trailers == 0 {
            let add = format!(
                "ALTER TABLE `{}` ADD COLUMN response_trailers MEDIUMBLOB NULL",
                self.table
            );
            match retry_deadlocks(|| sqlx::raw_sql(&add).execute(&self.pool)).await {
                Ok(_) => {}
                // ER_DUP_FIELDNAME: another migrator added it between our check and ALTER.
                Err(sqlx::Error::Database(error))
                    if error
                        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                        .is_some_and(|error| error.number() == 1060) => {}
                Err(error) => return Err(backend(error)),
            }
        }
        self.flavor().await?;
        Ok(self)
    }

    /// Which server the pool talks to: asked once, then remembered. (A pool cannot mix
    /// servers, and a failed query leaves it unknown, to be asked again next time.)
    async fn flavor(&self) -> Result<Flavor, StoreError> {
        self.flavor
            .get_or_try_init(|| async {
                let version: String = sqlx::query_scalar("SELECT VERSION()")
                    .fetch_one(&self.pool)
                    .await
                    .map_err(backend)?;
                Ok(if version.contains("MariaDB") {
                    Flavor::MariaDb
                } else {
                    Flavor::MySql
                })
            })
            .await
            .copied()
    }

    /// MariaDB: one statement whatever the key holds. It inserts, replaces an expired row,
    /// or leaves a live row as it is, and returns the row as it stands afterwards. Tokens
    /// are 64 random bits, so the row carries our token exactly when we reserved (a live
    /// row holding the very token we just drew is a 1-in-2^64 chance).
    async fn reserve_returning(
        &self,
        connection: &mut MySqlConnection,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let token = new_token();
        // `self.flavor()` was asked first: this is MariaDB's statement.
        let row = self
            .reserve_query(id, binding, token, lease, lifetime)
            .fetch_one(connection)
            .await
            .map_err(backend)?;
        let raw = record_by_position(&row).map_err(backend)?;
        if raw.fencing_token == token.0 {
            Ok(Reservation::Reserved(token))
        } else {
            Ok(Reservation::Exists(raw.into_record()?))
        }
    }

    /// MySQL 8: the upsert reports through the OK packet whether it reserved; when a live
    /// row holds the key, a second statement reads it. That row may go away in between
    /// (released or purged), and then the upsert runs again.
    async fn reserve_then_load(
        &self,
        connection: &mut MySqlConnection,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        for _ in 0..MAX_ATTEMPTS {
            let token = new_token();
            // `self.flavor()` was asked first: this is MySQL 8's statement.
            let done = self
                .reserve_query(id, binding, token, lease, lifetime)
                .execute(&mut *connection)
                .await
                .map_err(backend)?;
            match (done.rows_affected(), done.last_insert_id()) {
                // Inserted (1), or an expired row replaced (2 changed rows).
                (1, MARK_INSERTED) | (2, _) => return Ok(Reservation::Reserved(token)),
                // A live row holds the key and was left unchanged (found rows: 1).
                (0 | 1, MARK_EXISTING) => {
                    let raw: Option<RawRecord> = sqlx::query_as(&self.sql.load)
                        .bind(&id.scope)
                        .bind(&id.key)
                        .fetch_optional(&mut *connection)
                        .await
                        .map_err(backend)?;
                    if let Some(record) = raw.map(RawRecord::into_record).transpose()? {
                        return Ok(Reservation::Exists(record));
                    }
                }
                (rows, mark) => {
                    return Err(StoreError::backend(format!(
                        "unexpected outcome of the MySQL reserve statement \
                         ({rows} rows affected, LAST_INSERT_ID {mark})"
                    )));
                }
            }
        }
        Err(too_many_races("reserve"))
    }

    /// Reserves on one connection (a transaction's, when a quota is checked).
    async fn reserve_on(
        &self,
        connection: &mut MySqlConnection,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        match self.flavor().await? {
            Flavor::MariaDb => {
                self.reserve_returning(connection, id, binding, lease, lifetime)
                    .await
            }
            Flavor::MySql => {
                self.reserve_then_load(connection, id, binding, lease, lifetime)
                    .await
            }
        }
    }

    /// Reserves after checking the scope's quota, in one transaction that holds the
    /// scope's index range from its first read to its commit. A replay is never refused.
    async fn reserve_within_quota(
        &self,
        quota: &ScopeQuota,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let mut connection = self.pool.acquire().await.map_err(backend)?;
        // The locking read locks the range (and the gap after it) only under REPEATABLE
        // READ; this applies to the next transaction of this connection alone.
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *connection)
            .await
            .map_err(backend)?;
        let mut tx = connection.begin().await.map_err(backend)?;
        let usage = sqlx::query(&self.sql.scope_usage)
            .bind(&id.scope)
            .bind(&id.key)
            .bind(&id.scope)
            .fetch_one(&mut *tx)
            .await
            .map_err(backend)?;
        let usage = ScopeUsage {
            key_live: usage.try_get::<i64, _>("key_live").map_err(backend)? > 0,
            records: usage.try_get("records").map_err(backend)?,
            bytes: usage.try_get("bytes").map_err(backend)?,
            next_expiry_in_ms: usage.try_get("next_expiry_in_ms").map_err(backend)?,
        };
        if let Some(refusal) = usage.refusal(quota) {
            return Err(refusal);
        }
        let reservation = self
            .reserve_on(&mut tx, id, binding, lease, lifetime)
            .await?;
        tx.commit().await.map_err(backend)?;
        Ok(reservation)
    }
}

/// Whether a store error is InnoDB's deadlock, whose statement (or transaction) was
/// rolled back whole and can run again.
fn is_deadlock_error(error: &StoreError) -> bool {
    let StoreError::Backend(source) = error else {
        return false;
    };
    source
        .downcast_ref::<sqlx::Error>()
        .is_some_and(is_deadlock)
}

impl MySqlStore {
    /// The fenced finalize ([`sql`](Self::sql)`(Operation::Finalize)`) with its
    /// parameters, as the store's finalize sends it (the answer encoded by the caller, so
    /// that a retried statement does not encode it again).
    ///
    /// Not part of the API: it exists for the benchmarks, which issue the store's
    /// statements raw and must bind them exactly as the store does.
    #[doc(hidden)]
    pub fn finalize_query<'q>(
        &'q self,
        id: &'q RecordId,
        token: FencingToken,
        answer: &'q EncodedAnswer,
    ) -> MySqlQuery<'q> {
        sqlx::query(&self.sql.finalize)
            .bind(answer.status)
            .bind(&answer.headers[..])
            .bind(&answer.body[..])
            .bind(answer.trailers.as_deref())
            .bind(&id.scope)
            .bind(&id.key)
            .bind(token.0)
    }

    /// The reserve statement ([`sql`](Self::sql)`(Operation::Reserve)`: MariaDB's or
    /// MySQL 8's, once the store knows which server it talks to) with its parameters, as
    /// the store's reserve sends it.
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
    ) -> MySqlQuery<'q> {
        sqlx::query(self.sql(Operation::Reserve))
            .bind(&id.scope)
            .bind(&id.key)
            .bind(&binding.method)
            .bind(&binding.path)
            .bind(&binding.body_sha256[..])
            .bind(token.0)
            // In flight under a live lease, a record never expires.
            .bind(millis(lifetime.max(lease)))
            .bind(millis(lease))
    }
}

/// sqlx knows only the `mysql` scheme; `mariadb://` means the same server protocol.
pub(crate) fn mysql_url(url: &str) -> std::borrow::Cow<'_, str> {
    match url.strip_prefix("mariadb:") {
        Some(rest) => format!("mysql:{rest}").into(),
        None => url.into(),
    }
}

fn is_deadlock(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
        .is_some_and(|error| error.number() == ER_LOCK_DEADLOCK)
}

/// Runs `statement` again when InnoDB picked it as a deadlock victim (it was rolled back
/// whole, so running it again is safe), a bounded number of times.
async fn retry_deadlocks<T, F, Fut>(mut statement: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let mut attempt = 1;
    loop {
        match statement().await {
            Err(error) if attempt < MAX_ATTEMPTS && is_deadlock(&error) => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(attempt as u64)).await;
            }
            outcome => return outcome,
        }
    }
}

/// Decodes a row of `record_columns` by position. MariaDB answers the prepare of an
/// `INSERT … RETURNING` without result metadata, so sqlx knows the returned columns'
/// types but not their names, and a lookup by name finds nothing.
fn record_by_position(row: &MySqlRow) -> Result<RawRecord, sqlx::Error> {
    Ok(RawRecord {
        method: row.try_get(0)?,
        path: row.try_get(1)?,
        body_sha256: row.try_get(2)?,
        fencing_token: row.try_get(3)?,
        lease_expires_at_ms: row.try_get(4)?,
        now_ms: row.try_get(5)?,
        response_status: row.try_get(6)?,
        response_headers: row.try_get(7)?,
        response_body: row.try_get(8)?,
        response_trailers: row.try_get(9)?,
    })
}

fn check_lengths(id: &RecordId, binding: &Binding) -> Result<(), StoreError> {
    let too_long = |what: &str, limit: &str| {
        Err(StoreError::backend(format!(
            "the MySQL idempotency store holds {what} of at most {limit}"
        )))
    };
    if id.scope.chars().count() > MAX_KEY_CHARS {
        return too_long("scopes", "255 characters");
    }
    if id.key.chars().count() > MAX_KEY_CHARS {
        return too_long("keys", "255 characters");
    }
    if binding.method.chars().count() > MAX_METHOD_CHARS {
        return too_long("methods", "255 characters");
    }
    if binding.path.len() > MAX_PATH_BYTES {
        return too_long("paths", "65,535 bytes");
    }
    Ok(())
}

#[async_trait]
impl IdempotencyStore for MySqlStore {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        check_lengths(id, binding)?;
        let mut attempt = 1;
        loop {
            let reserved = match &self.quota {
                None => {
                    let mut connection = self.pool.acquire().await.map_err(backend)?;
                    self.reserve_on(&mut connection, id, binding, lease, lifetime)
                        .await
                }
                Some(quota) => {
                    self.reserve_within_quota(quota, id, binding, lease, lifetime)
                        .await
                }
            };
            match reserved {
                Err(error) if attempt < MAX_ATTEMPTS && is_deadlock_error(&error) => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(attempt as u64)).await;
                }
                outcome => return outcome,
            }
        }
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        let raw: Option<RawRecord> = retry_deadlocks(|| {
            sqlx::query_as(&self.sql.load)
                .bind(&id.scope)
                .bind(&id.key)
                .fetch_optional(&self.pool)
        })
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
        let done = retry_deadlocks(|| {
            sqlx::query(&self.sql.renew)
                .bind(millis(lease))
                .bind(millis(lease))
                .bind(&id.scope)
                .bind(&id.key)
                .bind(token.0)
                .execute(&self.pool)
        })
        .await
        .map_err(backend)?;
        Ok(ownership(done.rows_affected()))
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let answer = EncodedAnswer::new(response);
        let done = retry_deadlocks(|| self.finalize_query(id, token, &answer).execute(&self.pool))
            .await
            .map_err(backend)?;
        Ok(ownership(done.rows_affected()))
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        let done = retry_deadlocks(|| {
            sqlx::query(&self.sql.release)
                .bind(&id.scope)
                .bind(&id.key)
                .bind(token.0)
                .execute(&self.pool)
        })
        .await
        .map_err(backend)?;
        Ok(ownership(done.rows_affected()))
    }

    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        let token = new_token_other_than(lapsed);
        let done = retry_deadlocks(|| {
            sqlx::query(&self.sql.take_over)
                .bind(token.0)
                .bind(millis(lease))
                .bind(millis(lease))
                .bind(&id.scope)
                .bind(&id.key)
                .bind(lapsed.0)
                .execute(&self.pool)
        })
        .await
        .map_err(backend)?;
        Ok((ownership(done.rows_affected()) == Ownership::Held).then_some(token))
    }
}

#[async_trait]
impl RecordAdmin for MySqlStore {
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
            let done = retry_deadlocks(|| {
                sqlx::query(&self.sql.evict)
                    .bind(&id.scope)
                    .bind(&id.key)
                    .bind(raw.fencing_token)
                    .bind(raw.in_flight())
                    .execute(&self.pool)
            })
            .await
            .map_err(backend)?;
            if done.rows_affected() == 1 {
                return Ok(Eviction::Evicted(inspected));
            }
        }
        Err(too_many_races("evict"))
    }
}

#[async_trait]
impl PurgeExpired for MySqlStore {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        let limit = u64::try_from(batch_size).unwrap_or(u64::MAX);
        let done = retry_deadlocks(|| sqlx::query(&self.sql.purge).bind(limit).execute(&self.pool))
            .await
            .map_err(backend)?;
        Ok(Purged::Deleted(done.rows_affected()))
    }
}

impl MySqlStore {
    async fn inspect_raw(&self, id: &RecordId) -> Result<Option<RawInspection>, StoreError> {
        retry_deadlocks(|| {
            sqlx::query_as(&self.sql.inspect)
                .bind(&id.scope)
                .bind(&id.key)
                .fetch_optional(&self.pool)
        })
        .await
        .map_err(backend)
    }
}

/// What a scope holds, for its quota (`ScopeUsage`): whether the reserving key is live,
/// the scope's live records, their bytes, and when the next of them expires. A plain
/// read: it does not wait for transactions that hold rows of the scope.
pub(crate) fn scope_usage_statement(table: &TableName) -> String {
    let t = format!("`{table}`");
    format!(
        "SELECT (SELECT COUNT(*) FROM {t} AS k
                 WHERE k.scope = ? AND k.idempotency_key = ?
                   AND k.expires_at_ms > {NOW_MS}) AS key_live,
                COUNT(*) AS records,
                CAST(COALESCE(SUM({bytes}), 0) AS SIGNED) AS bytes,
                MIN(r.expires_at_ms) - {NOW_MS} AS next_expiry_in_ms
         FROM {t} AS r
         WHERE r.scope = ? AND r.expires_at_ms > {NOW_MS}",
        bytes = row_bytes("OCTET_LENGTH", "r"),
    )
}

#[cfg(test)]
mod tests {
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
}
