//! [`PostgresStore`]: the PostgreSQL backend.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, Reservation,
    ScopeQuota, StoreError, StoredResponse, Waited, async_trait, wait_by_polling,
};
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgRow};
use sqlx::{FromRow, Row};
use tokio::sync::{OnceCell, broadcast};
use tokio::time::Instant;

use crate::common::{
    EncodedAnswer, MAX_ATTEMPTS, Operation, PoolSettings, REPLACE_WITH_EXCLUDED, RawInspection,
    RawRecord, ScopeUsage, backend, evict_verdict, hex, millis, new_token, new_token_other_than,
    notice_for, ownership, row_bytes, too_many_races,
};
use crate::synchronous;
use crate::table::{InvalidTableName, TableName};
use idempotency_core::config::SynchronousReplication;

type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// A statement that reserves (the reserve, or the replacement of an expired record) with
/// its first eight parameters: scope, key, method, path, body hash, token, lease, lifetime.
fn record_query<'q>(
    sql: &'q str,
    id: &'q RecordId,
    binding: &'q Binding,
    token: FencingToken,
    lease: Duration,
    lifetime: Duration,
) -> PgQuery<'q> {
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
}

/// "Now" by the database clock, in epoch milliseconds.
const NOW_MS: &str = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

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

/// How often a waiter looks at its record although no notice came: a lapsed lease is
/// not announced, and a notice can be lost while the listening connection reconnects.
const SAFETY_POLL: Duration = Duration::from_secs(1);

/// The announcements of settled records (finalized or released), heard on one
/// connection per store and handed to every waiter of this process.
#[derive(Debug)]
struct Notices {
    sender: broadcast::Sender<Arc<str>>,
    _listening: AbortOnDrop,
}

#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Notices {
    async fn start(pool: &PgPool, channel: &str) -> Result<Self, sqlx::Error> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(channel).await?;
        let (sender, _) = broadcast::channel(1024);
        let announce = sender.clone();
        let listening = tokio::spawn(async move {
            loop {
                match listener.recv().await {
                    Ok(notice) => {
                        let _ = announce.send(Arc::from(notice.payload()));
                    }
                    // The listener reconnects on the next `recv`; waiters meanwhile
                    // fall back on their safety poll.
                    Err(error) => {
                        tracing::warn!(%error, "idempotency: listening for settled records failed; retrying");
                        tokio::time::sleep(SAFETY_POLL).await;
                    }
                }
            }
        });
        Ok(Self {
            sender,
            _listening: AbortOnDrop(listening),
        })
    }
}

#[derive(Debug)]
struct Statements {
    /// The channel finalize and release notify, derived from the table name.
    channel: String,
    /// What a scope holds, read under the scope's lock when a quota is set.
    scope_usage: String,
    migrate: String,
    reserve: String,
    replace_expired: String,
    load: String,
    renew: String,
    finalize: String,
    /// `finalize` without its announcement, bound the same way ($7 is read and unused).
    finalize_quietly: String,
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
            "scope = $1 AND idempotency_key = $2 AND fencing_token = $3 \
             AND response_status IS NULL AND expires_at_ms > {NOW_MS}"
        );
        let channel = format!("idempotency_{}", hex(&Sha256::digest(table.as_str())[..8]));
        // The fenced write of the answer, then `announce` (a text expression) for each row
        // written.
        let finalize = |announce: &str| {
            format!(
                "WITH done AS (
                     UPDATE {t}
                     SET response_status = $4, response_headers = $5, response_body = $6,
                         response_trailers = $8
                     WHERE {owned}
                     RETURNING 1)
                 SELECT 1 AS held FROM done WHERE {announce} IS NOT NULL"
            )
        };
        Self {
            migrate: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    scope               TEXT    NOT NULL,
                    idempotency_key     TEXT    NOT NULL,
                    method              TEXT    NOT NULL,
                    path                TEXT    NOT NULL,
                    body_sha256         BYTEA   NOT NULL,
                    fencing_token       BIGINT  NOT NULL,
                    created_at_ms       BIGINT  NOT NULL,
                    expires_at_ms       BIGINT  NOT NULL,
                    lease_expires_at_ms BIGINT  NOT NULL,
                    response_status     INTEGER NULL,
                    response_headers    BYTEA   NULL,
                    response_body       BYTEA   NULL,
                    response_trailers   BYTEA   NULL,
                    PRIMARY KEY (scope, idempotency_key)
                );
                CREATE INDEX IF NOT EXISTS \"{index}\" ON {t} (expires_at_ms);
                ALTER TABLE {t} ADD COLUMN IF NOT EXISTS response_trailers BYTEA NULL;"
            ),
            // DO NOTHING, not DO UPDATE: a conflicting live row is then neither locked nor
            // written, so a replay is a read. An expired row comes back flagged and is
            // replaced by `replace_expired`. A key without a row is inserted only if its
            // advisory lock ($9) is free: a one-commit owner holds it while its record is
            // not written yet (see `reserve_lock_statement`); the answer is then one row
            // flagged `busy`.
            reserve: format!(
                "WITH clock AS MATERIALIZED (SELECT {NOW_MS} AS now_ms),
                free AS MATERIALIZED (
                    SELECT CASE WHEN EXISTS (SELECT 1 FROM {t}
                                             WHERE scope = $1 AND idempotency_key = $2)
                                THEN TRUE ELSE pg_try_advisory_xact_lock($9::bigint) END AS free
                ),
                ins AS (
                    INSERT INTO {t}
                        (scope, idempotency_key, method, path, body_sha256, fencing_token,
                         created_at_ms, expires_at_ms, lease_expires_at_ms,
                         response_status, response_headers, response_body)
                    SELECT $1::text, $2::text, $3::text, $4::text, $5::bytea, $6::bigint,
                           now_ms, now_ms + $8::bigint, now_ms + $7::bigint, NULL, NULL, NULL
                    FROM clock, free
                    WHERE free.free
                    ON CONFLICT (scope, idempotency_key) DO NOTHING
                    RETURNING fencing_token
                )
                SELECT FALSE AS busy, TRUE AS reserved, FALSE AS expired, NULL::text AS method,
                       NULL::text AS path, NULL::bytea AS body_sha256, fencing_token,
                       NULL::bigint AS lease_expires_at_ms, NULL::bigint AS now_ms,
                       NULL::integer AS response_status, NULL::bytea AS response_headers,
                       NULL::bytea AS response_body, NULL::bytea AS response_trailers
                FROM ins
                UNION ALL
                SELECT FALSE, FALSE, e.expires_at_ms <= clock.now_ms, e.method, e.path,
                       e.body_sha256, e.fencing_token, e.lease_expires_at_ms, clock.now_ms,
                       e.response_status, e.response_headers, e.response_body,
                       e.response_trailers
                FROM {t} AS e, clock
                WHERE e.scope = $1 AND e.idempotency_key = $2
                  AND NOT EXISTS (SELECT 1 FROM ins)
                UNION ALL
                SELECT TRUE, FALSE, FALSE, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                       NULL, NULL
                FROM free WHERE NOT free.free"
            ),
            replace_expired: format!(
                "WITH clock AS MATERIALIZED (SELECT {NOW_MS} AS now_ms)
                 UPDATE {t} AS r SET
                     method = $3, path = $4, body_sha256 = $5, fencing_token = $6,
                     created_at_ms = clock.now_ms,
                     expires_at_ms = clock.now_ms + $8::bigint,
                     lease_expires_at_ms = clock.now_ms + $7::bigint,
                     response_status = NULL, response_headers = NULL, response_body = NULL,
                     response_trailers = NULL
                 FROM clock
                 WHERE r.scope = $1 AND r.idempotency_key = $2
                   AND r.expires_at_ms <= clock.now_ms"
            ),
            load: format!(
                "SELECT r.method, r.path, r.body_sha256, r.fencing_token, r.lease_expires_at_ms,
                        clock.now_ms, r.response_status, r.response_headers, r.response_body,
                        r.response_trailers
                 FROM {t} AS r, (SELECT {NOW_MS} AS now_ms) AS clock
                 WHERE r.scope = $1 AND r.idempotency_key = $2
                   AND r.expires_at_ms > clock.now_ms"
            ),
            // The expiry moves with the lease, so a record in flight under a live lease
            // never expires; one clock reading serves both.
            renew: format!(
                "UPDATE {t} SET lease_expires_at_ms = clock.now_ms + $4::bigint,
                     expires_at_ms = GREATEST(expires_at_ms, clock.now_ms + $4::bigint)
                 FROM (SELECT {NOW_MS} AS now_ms) AS clock
                 WHERE {owned}"
            ),
            // Finalize and release announce the settled record to waiters (on every
            // node) in the same statement; the notice is sent when it commits (inside a
            // handler's transaction too). Finalize returns an integer, not pg_notify's
            // void, which sqlx's `Any` driver cannot read.
            finalize: finalize(&format!("pg_notify('{channel}', $7)")),
            finalize_quietly: finalize("$7::text"),
            release: format!(
                "WITH done AS (DELETE FROM {t} WHERE {owned} RETURNING 1)
                 SELECT pg_notify('{channel}', $4) FROM done"
            ),
            take_over: format!(
                "UPDATE {t}
                 SET fencing_token = $4, lease_expires_at_ms = clock.now_ms + $5::bigint,
                     expires_at_ms = GREATEST(expires_at_ms, clock.now_ms + $5::bigint)
                 FROM (SELECT {NOW_MS} AS now_ms) AS clock
                 WHERE {owned} AND lease_expires_at_ms <= clock.now_ms"
            ),
            channel,
            scope_usage: scope_usage_statement(table),
            purge: format!(
                "DELETE FROM {t} AS d
                 USING (SELECT scope, idempotency_key FROM {t}
                        WHERE expires_at_ms <= {NOW_MS}
                        LIMIT $1
                        FOR UPDATE SKIP LOCKED) AS x
                 WHERE d.scope = x.scope AND d.idempotency_key = x.idempotency_key"
            ),
            inspect: format!(
                "SELECT r.method, r.path, r.body_sha256, r.fencing_token, r.created_at_ms,
                        r.expires_at_ms, r.lease_expires_at_ms, clock.now_ms, r.response_status
                 FROM {t} AS r, (SELECT {NOW_MS} AS now_ms) AS clock
                 WHERE r.scope = $1 AND r.idempotency_key = $2
                   AND r.expires_at_ms > clock.now_ms"
            ),
            evict: format!(
                "DELETE FROM {t}
                 WHERE scope = $1 AND idempotency_key = $2 AND fencing_token = $3
                   AND (response_status IS NULL) = $4::boolean AND expires_at_ms > {NOW_MS}"
            ),
        }
    }
}

/// The finalize statement for records in `table`, announced to the waiters of every
/// replica: for the answers written in a handler's transaction under a leased reservation.
pub(crate) fn finalize_statement(table: &TableName) -> String {
    Statements::new(table).finalize
}

/// The finalize statement without its announcement, for the one-commit path, whose
/// duplicates wait on the record's advisory lock rather than listen: a transaction that
/// notifies takes PostgreSQL's global notification lock at its commit, which serializes
/// the commits of every such transaction. Bound as [`finalize_statement`] is.
pub(crate) fn finalize_quietly_statement(table: &TableName) -> String {
    Statements::new(table).finalize_quietly
}

/// The one-commit path's reservation ([`OneCommitStore`](crate::OneCommitStore)): takes
/// the key's advisory lock for the transaction, unless a record holds the key. Nothing is
/// written: the record is inserted once, finished, by [`insert_completed_statement`] in
/// the same transaction. `committed`: a record (live or expired) holds the key; `locked`:
/// the lock is this transaction's (not: another transaction holds it, a duplicate of a
/// running request). A replay never takes the lock, so replays never wait on each other.
/// Parameters: scope, key, the record's lock.
pub(crate) fn reserve_lock_statement(table: &TableName) -> String {
    format!(
        "WITH existing AS MATERIALIZED (
             SELECT 1 FROM \"{table}\" WHERE scope = $1::text AND idempotency_key = $2::text
         )
         SELECT EXISTS (SELECT 1 FROM existing) AS committed,
                CASE WHEN EXISTS (SELECT 1 FROM existing) THEN FALSE
                     ELSE pg_try_advisory_xact_lock($3::bigint) END AS locked"
    )
}

/// The one-commit path's second look at a key, once [`reserve_lock_statement`] took its
/// lock: in PostgreSQL's default isolation a statement sees the table as it was when the
/// statement began, so a record committed by the lock's previous holder while the lock
/// statement ran is only seen by a later statement. Parameters: scope, key.
pub(crate) fn record_of_key_statement(table: &TableName) -> String {
    format!("SELECT 1 FROM \"{table}\" WHERE scope = $1::text AND idempotency_key = $2::text")
}

/// The one-commit path's record, inserted finished in the handler's transaction under the
/// key's advisory lock (see [`reserve_lock_statement`]); an expired record is replaced,
/// and a live one (committed by another store since the lock was taken) is left alone:
/// no row inserted. Bound as the SQLite statement of the same name is.
pub(crate) fn insert_completed_statement(table: &TableName) -> String {
    format!(
        "INSERT INTO \"{table}\" AS r
             (scope, idempotency_key, method, path, body_sha256, fencing_token,
              created_at_ms, expires_at_ms, lease_expires_at_ms,
              response_status, response_headers, response_body, response_trailers)
         SELECT $1::text, $2::text, $3::text, $4::text, $5::bytea, $6::bigint,
                n, n + $7::bigint, n + $8::bigint,
                $9::integer, $10::bytea, $11::bytea, $12::bytea
         FROM (SELECT {NOW_MS} AS n) AS clock
         ON CONFLICT (scope, idempotency_key) DO UPDATE SET {REPLACE_WITH_EXCLUDED}
         WHERE r.expires_at_ms <= excluded.created_at_ms"
    )
}

/// The one-commit path's in-flight record, for a handler that commits the reservation's
/// transaction without its answer (the layer writes the answer afterwards): inserted
/// just before that `COMMIT`, so that the key stays held. It inserts only if no record
/// holds the key and the key's advisory lock is free or already this transaction's
/// (`committed`: a record holds the key; `inserted`: this one went in). Parameters:
/// scope, key, method, path, body_sha256, token, lifetime, lease, the record's lock.
pub(crate) fn insert_in_flight_statement(table: &TableName) -> String {
    format!(
        "WITH existing AS MATERIALIZED (
             SELECT 1 FROM \"{table}\" WHERE scope = $1::text AND idempotency_key = $2::text
         ),
         ins AS (
             INSERT INTO \"{table}\"
                 (scope, idempotency_key, method, path, body_sha256, fencing_token,
                  created_at_ms, expires_at_ms, lease_expires_at_ms)
             SELECT $1::text, $2::text, $3::text, $4::text, $5::bytea, $6::bigint,
                    n, n + $7::bigint, n + $8::bigint
             FROM (SELECT {NOW_MS} AS n) AS clock
             WHERE CASE WHEN EXISTS (SELECT 1 FROM existing) THEN FALSE
                        ELSE pg_try_advisory_xact_lock($9::bigint) END
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM existing) AS committed,
                (SELECT count(*) FROM ins) AS inserted"
    )
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
        record_query(&self.sql.reserve, id, binding, token, lease, lifetime)
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
                    let replaced = record_query(
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

    /// Hears the announcements of settled records, starting the listener on first use;
    /// `None` when the database does not let us LISTEN (e.g. behind a pooler in
    /// transaction mode), and waiters then poll.
    async fn notices(&self) -> Option<broadcast::Receiver<Arc<str>>> {
        let notices = self
            .notices
            .get_or_init(|| async {
                match Notices::start(&self.pool, &self.sql.channel).await {
                    Ok(notices) => Some(notices),
                    Err(error) => {
                        tracing::warn!(%error, "idempotency: cannot LISTEN for settled records; duplicates will poll instead");
                        None
                    }
                }
            })
            .await;
        notices.as_ref().map(|notices| notices.sender.subscribe())
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
        for _ in 0..MAX_ATTEMPTS {
            let Some(raw) = self.inspect_raw(id).await? else {
                return Ok(Eviction::NotFound);
            };
            let inspected = match evict_verdict(&raw, in_flight)? {
                Ok(inspected) => inspected,
                Err(refused) => return Ok(refused),
            };
            let done = sqlx::query(&self.sql.evict)
                .bind(&id.scope)
                .bind(&id.key)
                .bind(raw.fencing_token)
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

/// What a scope holds, for its quota (`ScopeUsage`): whether the reserving key is live,
/// the scope's live records, their bytes, and when the next of them expires.
pub(crate) fn scope_usage_statement(table: &TableName) -> String {
    let t = format!("\"{table}\"");
    format!(
        "SELECT EXISTS (SELECT 1 FROM {t} AS k
                        WHERE k.scope = $1 AND k.idempotency_key = $2
                          AND k.expires_at_ms > clock.now_ms) AS key_live,
                count(r.scope) AS records,
                COALESCE(sum({bytes}), 0)::bigint AS bytes,
                min(r.expires_at_ms) - clock.now_ms AS next_expiry_in_ms
         FROM (SELECT {NOW_MS} AS now_ms) AS clock
         LEFT JOIN {t} AS r ON r.scope = $1 AND r.expires_at_ms > clock.now_ms
         GROUP BY clock.now_ms",
        bytes = row_bytes("octet_length", "r"),
    )
}
