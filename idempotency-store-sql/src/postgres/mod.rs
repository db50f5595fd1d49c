//! [`PostgresStore`]: the PostgreSQL backend.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, Reservation,
    ScopeQuota, StoreError, StoredResponse, Waited, async_trait, wait_by_polling,
};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgRow};
use sqlx::{FromRow, Row};
use tokio::sync::{OnceCell, broadcast};
use tokio::time::Instant;

use crate::common::{
    EncodedAnswer, MAX_ATTEMPTS, Operation, RawInspection, RawRecord, ScopeUsage, backend,
    evict_as_read, millis, new_token, new_token_other_than, notice_for, ownership,
    reservation_query, too_many_races,
};
use crate::pool_settings::{PoolSettings, SynchronousReplication};
use crate::synchronous;
use crate::table::{InvalidTableName, TableName};

mod notices;
mod statements;

use notices::{Notices, SAFETY_POLL};
use statements::Statements;
pub(crate) use statements::{
    begin_locking_statement, finalize_quietly_statement, finalize_statement,
    insert_completed_statement, insert_in_flight_statement, look_under_lock_statement,
    scope_usage_statement,
};

type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// An [`IdempotencyStore`] on PostgreSQL (12 or later). Cheap to clone: clones share the
/// pool.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency_store_sql::{PoolSettings, PostgresStore};
///
/// let store = PostgresStore::connect("postgres://app@db/catalog", &PoolSettings::default())
///     .await?
///     .with_table_name("idempotency_records")?
///     .migrate()
///     .await?;
/// # drop(store); Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct PostgresStore {
    pool: PgPool,
    table: TableName,
    sql: Arc<Statements>,
    /// Started by the first `wait`; `None` inside when LISTEN is not available.
    notices: Arc<OnceCell<Option<Notices>>>,
    quota: Option<ScopeQuota>,
}

impl PostgresStore {
    /// A store on the caller's pool (shared, e.g. with a catalog), using the table
    /// [`idempotency_records`](crate::DEFAULT_TABLE_NAME).
    pub fn new(pool: PgPool) -> Self {
        let table = TableName::default();
        Self {
            pool,
            sql: Arc::new(Statements::new(&table)),
            table,
            notices: Arc::default(),
            quota: None,
        }
    }

    /// Opens a pool of its own to `url` (`postgres://user:password@host:port/db`), whose
    /// query may also say `synchronous-replication=require|warn|off` (see
    /// [`PoolSettings::synchronous_replication`]).
    pub async fn connect(url: &str, settings: &PoolSettings) -> Result<Self, StoreError> {
        let (url, from_url) = synchronous::split_url(url).map_err(StoreError::backend)?;
        let expect = synchronous::combine(from_url, settings.synchronous_replication)
            .map_err(StoreError::backend)?;
        let options: PgConnectOptions = url.parse().map_err(backend)?;
        Self::connect_with(options, &settings.clone().synchronous_replication(expect)).await
    }

    /// Opens a pool of its own with explicit connect options, and checks the server's
    /// synchronous replication if the settings ask for it.
    pub async fn connect_with(
        options: PgConnectOptions,
        settings: &PoolSettings,
    ) -> Result<Self, StoreError> {
        let pool = settings
            .pool_options()
            .connect_with(options)
            .await
            .map_err(backend)?;
        synchronous::check(&pool, settings.synchronous_replication).await?;
        Ok(Self::new(pool))
    }

    /// Checks that the server this store's pool connects to replicates commits
    /// synchronously (`synchronous_standby_names` names a standby, `synchronous_commit`
    /// waits for it), and refuses ([`NotSynchronous`](crate::NotSynchronous), naming
    /// both settings and their values) or warns as `expect` says. For a store made with
    /// [`new`](Self::new) from a pool of your own; [`connect`](Self::connect) checks by
    /// itself when its settings ask for it.
    pub async fn check_synchronous_replication(
        &self,
        expect: SynchronousReplication,
    ) -> Result<(), StoreError> {
        synchronous::check(&self.pool, expect).await
    }

    /// Uses the table `name` instead of the default.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, InvalidTableName> {
        self.table = TableName::new(name)?;
        self.sql = Arc::new(Statements::new(&self.table));
        self.notices = Arc::default();
        Ok(self)
    }

    /// Bounds what each scope may hold (see [`ScopeQuota`]). Reservations of a new key
    /// then take a transaction-scoped advisory lock on the scope, so that nodes sharing
    /// the table check and claim the quota one at a time: a quota costs a transaction and
    /// a scan of the scope's live records per new key.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// use idempotency_core::ScopeQuota;
    /// use idempotency_store_sql::PostgresStore;
    ///
    /// let store = PostgresStore::new(pool)
    ///     .with_scope_quota(ScopeQuota::default().with_max_records(10_000).with_max_bytes(256 << 20));
    /// # drop(store); }
    /// ```
    pub fn with_scope_quota(mut self, quota: ScopeQuota) -> Self {
        self.quota = Some(quota);
        self
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &PgPool {
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

    /// Creates the table and its expiry index if they do not exist, and adds the columns
    /// a table created by an earlier release lacks (`response_trailers`, with
    /// `ADD COLUMN IF NOT EXISTS`).
    ///
    /// Safe to call from several nodes at once: the DDL runs in a transaction that first
    /// takes a transaction-scoped advisory lock derived from the table name, because two
    /// concurrent `CREATE TABLE IF NOT EXISTS` can otherwise fail on PostgreSQL with a
    /// unique violation in `pg_type`.
    pub async fn migrate(self) -> Result<Self, StoreError> {
        let mut tx = self.pool.begin().await.map_err(backend)?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(self.table.lock_key())
            .execute(&mut *tx)
            .await
            .map_err(backend)?;
        sqlx::raw_sql(&self.sql.migrate)
            .execute(&mut *tx)
            .await
            .map_err(backend)?;
        tx.commit().await.map_err(backend)?;
        Ok(self)
    }

    /// The reserve statement ([`sql`](Self::sql)`(Operation::Reserve)`) with its
    /// parameters, as the store's reserve sends it.
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
    ) -> PgQuery<'q> {
        reservation_query(&self.sql.reserve, id, binding, token, lease, lifetime)
            .bind(self.table.record_lock_key(id))
    }

    /// Reserves on one connection (a transaction's, when a quota is checked).
    async fn reserve_on(
        &self,
        connection: &mut PgConnection,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        for _ in 0..MAX_ATTEMPTS {
            let token = new_token();
            let row: Option<PgRow> = self
                .reserve_query(id, binding, token, lease, lifetime)
                .fetch_optional(&mut *connection)
                .await
                .map_err(backend)?;
            match row {
                // A one-commit owner (another replica's `OneCommitStore`) holds the key,
                // its record not written yet.
                Some(row) if row.try_get::<bool, _>("busy").map_err(backend)? => {
                    return Ok(Reservation::Busy);
                }
                Some(row) if row.try_get::<bool, _>("reserved").map_err(backend)? => {
                    return Ok(Reservation::Reserved(token));
                }
                // An expired record counts as absent: replace it, unless another request
                // replaced (or purge removed) it first, in which case look again.
                Some(row) if row.try_get::<bool, _>("expired").map_err(backend)? => {
                    let replaced = reservation_query(
                        &self.sql.replace_expired,
                        id,
                        binding,
                        token,
                        lease,
                        lifetime,
                    )
                    .execute(&mut *connection)
                    .await
                    .map_err(backend)?;
                    if replaced.rows_affected() == 1 {
                        return Ok(Reservation::Reserved(token));
                    }
                }
                Some(row) => {
                    let raw = RawRecord::from_row(&row).map_err(backend)?;
                    return Ok(Reservation::Exists(raw.into_record()?));
                }
                // The key is held by a row that the statement's snapshot cannot see: it
                // was inserted by a transaction that committed after the statement began.
                // Read it with a fresh snapshot; if it is gone again, try again.
                None => {
                    if let Some(record) = self.load_on(&mut *connection, id).await? {
                        return Ok(Reservation::Exists(record));
                    }
                }
            }
        }
        Err(too_many_races("reserve"))
    }

    /// A key without a record may be held by a one-commit owner (another replica's
    /// `OneCommitStore`, whose record is written when it commits) through the key's
    /// advisory lock: waits until `deadline` for it to let go. `true` once no one holds
    /// the lock (asked without waiting first, the common case), `false` if it is still
    /// held at `deadline`.
    async fn wait_for_lock_holder(
        &self,
        id: &RecordId,
        deadline: Instant,
    ) -> Result<bool, StoreError> {
        let lock = self.table.record_lock_key(id);
        let free: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
            .bind(lock)
            .fetch_one(&self.pool)
            .await
            .map_err(backend)?;
        if free {
            return Ok(true);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        crate::record_database::wait_for_key_lock(&self.pool, lock, left)
            .await
            .map_err(backend)
    }

    async fn load_on(
        &self,
        connection: &mut PgConnection,
        id: &RecordId,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let raw: Option<RawRecord> = sqlx::query_as(&self.sql.load)
            .bind(&id.scope)
            .bind(&id.key)
            .fetch_optional(connection)
            .await
            .map_err(backend)?;
        raw.map(RawRecord::into_record).transpose()
    }

    /// Runs a fenced statement that announces what it did: the token held the record iff
    /// it returned its one row.
    async fn fenced_and_announced(&self, query: PgQuery<'_>) -> Result<Ownership, StoreError> {
        let row = query.fetch_optional(&self.pool).await.map_err(backend)?;
        Ok(ownership(u64::from(row.is_some())))
    }

    /// Runs a fenced UPDATE or DELETE: the token held the record iff one row matched.
    async fn fenced(&self, query: PgQuery<'_>) -> Result<Ownership, StoreError> {
        let done = query.execute(&self.pool).await.map_err(backend)?;
        Ok(ownership(done.rows_affected()))
    }

    /// A statement whose first three parameters are the record id and the token.
    fn owned_query<'q>(&self, sql: &'q str, id: &'q RecordId, token: FencingToken) -> PgQuery<'q> {
        sqlx::query(sql).bind(&id.scope).bind(&id.key).bind(token.0)
    }

    /// The fenced finalize ([`sql`](Self::sql)`(Operation::Finalize)`) with its
    /// parameters, as the store's finalize sends it; it returns a row iff the token held.
    ///
    /// Not part of the API: it exists for the benchmarks, which issue the store's
    /// statements raw and must bind them exactly as the store does.
    #[doc(hidden)]
    pub fn finalize_query<'q>(
        &'q self,
        id: &'q RecordId,
        token: FencingToken,
        answer: &'q EncodedAnswer,
    ) -> PgQuery<'q> {
        self.owned_query(&self.sql.finalize, id, token)
            .bind(answer.status)
            .bind(&answer.headers[..])
            .bind(&answer.body[..])
            .bind(notice_for(id))
            .bind(answer.trailers.as_deref())
    }
}

#[async_trait]
impl IdempotencyStore for PostgresStore {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let Some(quota) = self.quota else {
            let mut connection = self.pool.acquire().await.map_err(backend)?;
            return self
                .reserve_on(&mut connection, id, binding, lease, lifetime)
                .await;
        };
        // The scope's lock is held until the transaction ends, so the usage read here
        // is still true when the new row commits. A replay is never refused.
        let mut tx = self.pool.begin().await.map_err(backend)?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(self.table.scope_lock_key(&id.scope))
            .execute(&mut *tx)
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

    /// Waits on the announcements of settled records (LISTEN/NOTIFY) instead of polling:
    /// a waiter loads its record when its announcement comes, and otherwise once a
    /// second (a lapsed lease is not announced).
    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        let Some(mut notices) = self.notices().await else {
            return wait_by_polling(self, id, timeout).await;
        };
        let notice = notice_for(id);
        let deadline = Instant::now() + timeout;
        loop {
            let record = self.load(id).await?;
            if record.is_none() && !self.wait_for_lock_holder(id, deadline).await? {
                return Ok(Waited::Running(None));
            }
            let now = Instant::now();
            if let Some(waited) = Waited::after_load(record, now >= deadline) {
                return Ok(waited);
            }
            let look_again_at = deadline.min(now + SAFETY_POLL);
            loop {
                match tokio::time::timeout_at(look_again_at, notices.recv()).await {
                    Ok(Ok(heard)) if *heard == *notice => break,
                    Ok(Ok(_)) => {}
                    // Missed some: this record's may be among them.
                    Ok(Err(broadcast::error::RecvError::Lagged(_))) => break,
                    Ok(Err(broadcast::error::RecvError::Closed)) => {
                        return wait_by_polling(
                            self,
                            id,
                            deadline.saturating_duration_since(Instant::now()),
                        )
                        .await;
                    }
                    Err(_time_to_look) => break,
                }
            }
        }
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
        let answer = EncodedAnswer::new(response);
        self.fenced_and_announced(self.finalize_query(id, token, &answer))
            .await
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        self.fenced_and_announced(
            self.owned_query(&self.sql.release, id, token)
                .bind(notice_for(id)),
        )
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
}

#[async_trait]
impl RecordAdmin for PostgresStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        self.inspect_raw(id)
            .await?
            .map(|raw| raw.to_inspected())
            .transpose()
    }

    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        let inspect = || self.inspect_raw(id);
        let delete = |token: FencingToken, in_flight: bool| async move {
            let done = sqlx::query(&self.sql.evict)
                .bind(&id.scope)
                .bind(&id.key)
                .bind(token.0)
                .bind(in_flight)
                .execute(&self.pool)
                .await
                .map_err(backend)?;
            Ok(done.rows_affected() == 1)
        };
        evict_as_read(inspect, delete, in_flight).await
    }
}

#[async_trait]
impl PurgeExpired for PostgresStore {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        let limit = i64::try_from(batch_size).unwrap_or(i64::MAX);
        let done = sqlx::query(&self.sql.purge)
            .bind(limit)
            .execute(&self.pool)
            .await
            .map_err(backend)?;
        Ok(Purged::Deleted(done.rows_affected()))
    }
}

impl PostgresStore {
    async fn inspect_raw(&self, id: &RecordId) -> Result<Option<RawInspection>, StoreError> {
        sqlx::query_as(&self.sql.inspect)
            .bind(&id.scope)
            .bind(&id.key)
            .fetch_optional(&self.pool)
            .await
            .map_err(backend)
    }
}
