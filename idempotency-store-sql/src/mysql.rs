//! [`MySqlStore`]: the MySQL 8 / MariaDB 10.6+ backend.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{
    Binding, FencingToken, IdempotencyRecord, IdempotencyStore, Ownership, RecordId, Reservation,
    StoreError, StoredResponse,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlPool};

use crate::common::{
    MAX_ATTEMPTS, Operation, PoolSettings, RawRecord, backend, millis, new_token,
    new_token_other_than, ownership, too_many_races,
};
use crate::table::{InvalidTableName, TableName};

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
}

#[derive(Debug)]
struct Statements {
    migrate: String,
    reserve: String,
    load: String,
    renew: String,
    finalize: String,
    release: String,
    take_over: String,
    purge: String,
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
        Self {
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
                    PRIMARY KEY (scope, idempotency_key),
                    KEY `{index}` (expires_at_ms)
                ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            ),
            reserve: format!(
                "INSERT INTO {t}
                    (scope, idempotency_key, method, path, body_sha256, fencing_token,
                     created_at_ms, expires_at_ms, lease_expires_at_ms,
                     response_status, response_headers, response_body)
                 VALUES (?, ?, ?, ?, ?, ?,
                         IF(LAST_INSERT_ID({MARK_INSERTED}) = {MARK_INSERTED}, {NOW_MS}, NULL),
                         {NOW_MS} + ?, {NOW_MS} + ?, NULL, NULL, NULL)
                 ON DUPLICATE KEY UPDATE
                    {method},
                    {path},
                    {body_sha256},
                    fencing_token = IF({expired}, VALUES(fencing_token),
                        IF(LAST_INSERT_ID({MARK_EXISTING}) = {MARK_EXISTING}, fencing_token, NULL)),
                    {created_at_ms},
                    {lease_expires_at_ms},
                    response_status = IF({expired}, NULL, response_status),
                    response_headers = IF({expired}, NULL, response_headers),
                    response_body = IF({expired}, NULL, response_body),
                    {expires_at_ms}",
                method = replace("method"),
                path = replace("path"),
                body_sha256 = replace("body_sha256"),
                created_at_ms = replace("created_at_ms"),
                lease_expires_at_ms = replace("lease_expires_at_ms"),
                expires_at_ms = replace("expires_at_ms"),
            ),
            // sqlx reads utf8mb4_bin text columns as binary (the server flags them
            // BINARY), so the two text columns are cast to the connection's charset.
            load: format!(
                "SELECT CAST(method AS CHAR CHARACTER SET utf8mb4) AS method,
                        CAST(path AS CHAR CHARACTER SET utf8mb4) AS path, body_sha256, fencing_token, lease_expires_at_ms,
                        {NOW_MS} AS now_ms, response_status, response_headers, response_body
                 FROM {t}
                 WHERE scope = ? AND idempotency_key = ? AND expires_at_ms > {NOW_MS}"
            ),
            renew: format!(
                "UPDATE {t} SET lease_expires_at_ms = {NOW_MS} + ? WHERE {owned}"
            ),
            finalize: format!(
                "UPDATE {t}
                 SET response_status = ?, response_headers = ?, response_body = ?
                 WHERE {owned}"
            ),
            release: format!("DELETE FROM {t} WHERE {owned}"),
            take_over: format!(
                "UPDATE {t}
                 SET fencing_token = ?, lease_expires_at_ms = {NOW_MS} + ?
                 WHERE {owned} AND lease_expires_at_ms <= {NOW_MS}"
            ),
            purge: format!("DELETE FROM {t} WHERE expires_at_ms <= {NOW_MS} LIMIT ?"),
        }
    }
}

impl MySqlStore {
    /// A store on the caller's pool (shared, e.g. with a catalog), using the table
    /// [`idempotency_records`](crate::DEFAULT_TABLE_NAME).
    ///
    /// The store relies on sqlx's MySQL connections reporting *found* rather than
    /// *changed* rows (`CLIENT_FOUND_ROWS`, which sqlx always sets), so that renewing a
    /// lease to the value it already has still counts as held.
    pub fn new(pool: MySqlPool) -> Self {
        let table = TableName::default();
        Self {
            pool,
            sql: Arc::new(Statements::new(&table)),
            table,
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
        Ok(Self::new(pool))
    }

    /// Uses the table `name` instead of the default.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, InvalidTableName> {
        self.table = TableName::new(name)?;
        self.sql = Arc::new(Statements::new(&self.table));
        Ok(self)
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
        }
    }

    /// Creates the table (with its expiry index declared inside `CREATE TABLE`, since
    /// MySQL 8 has no `CREATE INDEX IF NOT EXISTS`) if it does not exist. Safe to call
    /// from several nodes at once: MySQL and MariaDB serialize the DDL on a metadata lock.
    pub async fn migrate(self) -> Result<Self, StoreError> {
        retry_deadlocks(|| sqlx::raw_sql(&self.sql.migrate).execute(&self.pool))
            .await
            .map_err(backend)?;
        Ok(self)
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
        for _ in 0..MAX_ATTEMPTS {
            let token = new_token();
            let done = retry_deadlocks(|| {
                sqlx::query(&self.sql.reserve)
                    .bind(&id.scope)
                    .bind(&id.key)
                    .bind(&binding.method)
                    .bind(&binding.path)
                    .bind(&binding.body_sha256[..])
                    .bind(token.0)
                    .bind(millis(lifetime))
                    .bind(millis(lease))
                    .execute(&self.pool)
            })
            .await
            .map_err(backend)?;
            match (done.rows_affected(), done.last_insert_id()) {
                // Inserted (1), or an expired row replaced (2 changed rows).
                (1, MARK_INSERTED) | (2, _) => return Ok(Reservation::Reserved(token)),
                // A live row holds the key and was left unchanged (found rows: 1).
                (0 | 1, MARK_EXISTING) => {
                    if let Some(record) = self.load(id).await? {
                        return Ok(Reservation::Exists(record));
                    }
                    // Released or purged between the two statements: try again.
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
        let headers = response.encode_headers();
        let done = retry_deadlocks(|| {
            sqlx::query(&self.sql.finalize)
                .bind(i32::from(response.status))
                .bind(&headers[..])
                .bind(&response.body[..])
                .bind(&id.scope)
                .bind(&id.key)
                .bind(token.0)
                .execute(&self.pool)
        })
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
                .bind(&id.scope)
                .bind(&id.key)
                .bind(lapsed.0)
                .execute(&self.pool)
        })
        .await
        .map_err(backend)?;
        Ok((ownership(done.rows_affected()) == Ownership::Held).then_some(token))
    }

    async fn purge_expired(&self, batch_size: usize) -> Result<u64, StoreError> {
        let limit = u64::try_from(batch_size).unwrap_or(u64::MAX);
        let done = retry_deadlocks(|| sqlx::query(&self.sql.purge).bind(limit).execute(&self.pool))
            .await
            .map_err(backend)?;
        Ok(done.rows_affected())
    }
}
