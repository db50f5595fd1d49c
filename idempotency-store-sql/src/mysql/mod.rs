//! [`MySqlStore`]: the MySQL 8 / MariaDB 10.6+ backend.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, Reservation,
    ScopeQuota, StoreError, StoredResponse, async_trait,
};
use sqlx::Row;
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlPool, MySqlRow};
use tokio::sync::OnceCell;

use crate::common::{
    EncodedAnswer, MAX_ATTEMPTS, Operation, RawInspection, RawRecord, backend, evict_as_read,
    millis, new_token_other_than, ownership,
};
use crate::pool_settings::PoolSettings;
use crate::table::{InvalidTableName, TableName};

mod reserve;
mod statements;
#[cfg(test)]
mod tests;

use reserve::Flavor;
use statements::Statements;
pub(crate) use statements::{
    finalize_statement, insert_in_flight_statement, owners_row_statement, reserve_begin_statement,
    scope_usage_statement,
};

type MySqlQuery<'q> = sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>;

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

/// An error that may be InnoDB's answer to a statement it picked as a deadlock's victim.
trait DeadlockVictim {
    /// Whether it is: the statement (or its transaction) was rolled back whole, so
    /// running it again is safe.
    fn is_deadlock(&self) -> bool;
}

impl DeadlockVictim for sqlx::Error {
    fn is_deadlock(&self) -> bool {
        self.as_database_error()
            .and_then(|error| error.try_downcast_ref::<MySqlDatabaseError>())
            .is_some_and(|error| error.number() == ER_LOCK_DEADLOCK)
    }
}

impl DeadlockVictim for StoreError {
    fn is_deadlock(&self) -> bool {
        let StoreError::Backend(source) = self else {
            return false;
        };
        source
            .downcast_ref::<sqlx::Error>()
            .is_some_and(DeadlockVictim::is_deadlock)
    }
}

/// Runs `statement` again when InnoDB picked it as a deadlock victim, at most
/// [`MAX_ATTEMPTS`] times in all.
async fn retry_deadlocks<T, E, F, Fut>(mut statement: F) -> Result<T, E>
where
    E: DeadlockVictim,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut attempt = 1;
    loop {
        match statement().await {
            Err(error) if attempt < MAX_ATTEMPTS && error.is_deadlock() => {
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
        retry_deadlocks(|| async move {
            match &self.quota {
                None => {
                    let mut connection = self.pool.acquire().await.map_err(backend)?;
                    self.reserve_on(&mut connection, id, binding, lease, lifetime)
                        .await
                }
                Some(quota) => {
                    self.reserve_within_quota(quota, id, binding, lease, lifetime)
                        .await
                }
            }
        })
        .await
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
        let inspect = || self.inspect_raw(id);
        let delete = |token: FencingToken, in_flight: bool| async move {
            let done = retry_deadlocks(|| {
                sqlx::query(&self.sql.evict)
                    .bind(&id.scope)
                    .bind(&id.key)
                    .bind(token.0)
                    .bind(in_flight)
                    .execute(&self.pool)
            })
            .await
            .map_err(backend)?;
            Ok(done.rows_affected() == 1)
        };
        evict_as_read(inspect, delete, in_flight).await
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
