//! [`OneCommitStore`]: the store behind a handler's [`Tx`](crate::Tx), whose reservation,
//! by default, rides in the handler's own transaction, so that the reservation, the
//! handler's mutation and its answer are committed once. It sits above the backends (it
//! uses their statements):
//!
//! - `claims`: this process's reservations not committed yet;
//! - `reserve`: how a key is reserved and waited for, in each dialect;
//! - `handler`: the handler's transaction and the answer written in it;
//! - `contract`: the store contract, and the settling of a reservation after its handler;
//! - `transaction`: [`WriteTransaction`], what a `Tx` holds.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{FullStore, ScopeQuota, StoreError};
use sqlx::Pool;
use tokio::sync::Semaphore;

use crate::common::backend;
use crate::in_transaction::FinalizeError;
use crate::record_database::{Dialect, RecordDatabase};
use crate::table::TableName;

mod claims;
mod contract;
mod handler;
mod reserve;
#[cfg(all(test, feature = "mysql", feature = "postgres"))]
mod tests;
mod transaction;

use claims::Claims;
pub use transaction::WriteTransaction;

/// How long a MySQL/MariaDB reservation waits on a duplicate's uncommitted row before it
/// answers "in flight" (InnoDB counts whole seconds; 1 is its least on MySQL).
const MYSQL_RESERVE_LOCK_WAIT_SECS: u64 = 1;

/// Deadlocks (InnoDB picks a victim among duplicates waiting on one row) tried again.
const MAX_DEADLOCK_RETRIES: usize = 3;

/// The store for handlers that write through [`Tx`](crate::Tx): by default its
/// reservations ride in the handler's own transaction, so that a first execution commits
/// **once** (the in-flight record, the mutation and the stored answer together); with
/// [`Reservations::Leased`] a reservation is a committed record with a lease, and the
/// handler's `Tx` writes the answer into it with the change (two commits).
///
/// # How it works (uncommitted reservations, the default)
///
/// The layer's reservation opens a transaction on the pool the handler writes with (a
/// `PgPool`, `MySqlPool` or `SqlitePool`, or an `AnyPool` on any of them: see
/// [`RecordDatabase`]) and holds the key in it: on PostgreSQL it takes the key's
/// transaction-scoped advisory lock in the `BEGIN`'s round trip, then looks the key up
/// once, on MySQL/MariaDB it inserts the in-flight record, uncommitted (MariaDB in the round trip
/// that opens the transaction). The handler takes that
/// transaction (its `Tx`), writes its mutation, hands its answer over (`Tx::commit`:
/// PostgreSQL inserts the record finished, once — one row, as the mutation's own;
/// MySQL/MariaDB writes the answer into the in-flight record) and commits. If it does
/// not take the transaction (it writes nothing, or fails before it writes), the layer
/// writes the record in that transaction and commits it; a 5xx or a release status rolls
/// it back, which leaves no record. A handler that commits the reservation's transaction
/// without its answer gets the in-flight record inserted before its `COMMIT`
/// (PostgreSQL), and the layer writes the answer into it afterwards.
///
/// SQLite has one writer for the whole database, so a transaction held open while the
/// handler runs would make every handler wait for the one before it. There the
/// reservation is this process's claim on the key (a duplicate in the process waits for
/// it), and the record is inserted finished in the transaction the handler begins:
/// the write lock is held from there to the commit only, as without a key.
///
/// With leased reservations the answer is one fenced `UPDATE` of the record in the
/// handler's transaction, which holds the record's row lock (SQLite: the database's write
/// lock) until it ends: a replica that meanwhile finds the lease lapsed and tries to take
/// the record over waits, and then finds it finished (commit: it replays) or still in
/// flight (rollback: it takes over and runs the request).
///
/// Every guarantee of leased reservations holds for uncommitted ones too:
///
/// - **A crash at any instant leaves nothing or both**: until the one commit, the record
///   exists only in the open transaction, which the database rolls back when the process
///   dies; the retry then runs once.
/// - **Duplicates wait, then replay**: a duplicate of a running request cannot see the
///   uncommitted record; it finds the key busy (PostgreSQL: the key's advisory lock,
///   held by the owner's transaction; MySQL/MariaDB: the uncommitted row's lock;
///   SQLite: the owner's claim in this process), waits for the owner to finish, bounded
///   by the layer's in-flight wait, and then replays the committed answer, runs the
///   request itself (the owner rolled back), or gets the in-flight answer.
/// - **A key reused with another request gets 422**, once the first request committed
///   (while it runs, the duplicate waits, as above).
/// - **Several replicas sharing the database run a request once**: one owner holds the
///   key (PostgreSQL: its advisory lock, which a typed store's reservation on another
///   replica respects too; MySQL/MariaDB: the record's primary key); the others wait on
///   it. The primary key has the last word: an owner that finds a record committed under
///   its key when it inserts its own (PostgreSQL, a narrow race with a commit that
///   landed as it took the lock) rolls back, answering a 5xx that changed nothing, and
///   the retry is replayed. (SQLite, several processes on one
///   file: a duplicate in another process runs its handler up to its transaction, finds
///   the key committed there, and fails with a 5xx that changed nothing; the client's
///   retry is replayed.)
/// - **No lease to lose**: an uncommitted record cannot be taken over, so the layer's
///   renewals cost nothing (each asks this process whether the transaction still holds
///   the key), and a slow handler is never run twice beside itself. Once the handler's
///   transaction committed without the answer, the record it left in flight is renewed
///   as a leased one.
///
/// # What it costs, and when to use it
///
/// On PostgreSQL and MySQL/MariaDB a keyed request holds a transaction, and with it a
/// pooled connection, from its reservation until its commit, i.e. while the handler runs
/// — the handler uses that connection instead of acquiring one — and duplicates wait on
/// the owner's locks. Write transactions (keyed or not, each a `Tx`) take at
/// most half the pool, so that their handlers always find a connection to read with: size
/// the pool for it. On SQLite write transactions queue for the one writer's place in the
/// process, so that waiting writers hold no pooled connections.
///
/// Use it when the handler's state lives in the same database as the records: a first
/// execution then costs one durable commit, as the same request without a key. A typed
/// store alone (or under [`Writes::records_elsewhere`](crate::Writes::records_elsewhere)) when the
/// handler's state lives elsewhere.
///
/// Records committed by other stores on the same table (a typed store on another
/// replica) are read and handled by `records`, the typed store this one is built on:
/// replays, 422s and expired records work across both.
///
/// A [`ScopeQuota`] is given to this store ([`with_scope_quota`](Self::with_scope_quota)),
/// not to `records`: it counts the scope's committed records and this process's
/// reservations not committed yet. Another replica's uncommitted reservations cannot be
/// seen, so with several replicas a scope may pass its quota by at most the write
/// transactions the other replicas hold open at that moment (half their pools).
///
/// On the pool of a typed store, with the [`Tx`](crate::Tx) extractor (feature `axum`):
///
/// ```no_run
/// # #[cfg(all(feature = "postgres", feature = "axum"))]
/// # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::sync::Arc;
/// use axum::{Router, response::{IntoResponse, Response}, routing::post};
/// use idempotency_core::{IdempotencyLayer, SingleScope};
/// use idempotency_store_sql::{OneCommitStore, PostgresStore, TableName, Tx, TxError, Writes};
/// use sqlx::{PgPool, Postgres};
///
/// let records = PostgresStore::connect("postgres://app@db/orders", &Default::default())
///     .await?
///     .migrate()
///     .await?;
/// let pool: PgPool = records.pool().clone();
/// let store = Arc::new(OneCommitStore::new(Arc::new(records), pool, &TableName::default()).await?);
///
/// // The reservation's transaction, or a new one for a request without a key.
/// async fn place(mut tx: Tx<Writes<Postgres>>) -> Response {
///     sqlx::query("INSERT INTO orders (item) VALUES ('book')").execute(&mut *tx).await.unwrap();
///     let answer = (http::StatusCode::CREATED, "order placed").into_response();
///     // The one commit: record, order and answer.
///     tx.commit(answer).await.unwrap_or_else(TxError::into_response)
/// }
/// let app: Router = Router::new()
///     .route("/orders", post(place))
///     .with_state(Writes::with_records(store.clone()))
///     .layer(IdempotencyLayer::from_shared_store(store).with_scope(SingleScope));
/// # drop(app); Ok(()) }
/// ```
pub struct OneCommitStore<DB: RecordDatabase> {
    /// Everything that is not a one-commit reservation: committed records, typed.
    records: Arc<dyn FullStore>,
    pool: Pool<DB>,
    dialect: Dialect,
    table: TableName,
    /// The statements of this path, in the pool's dialect.
    sql: Statements,
    /// The server is MariaDB (a dialect of MySQL's here): it bounds a statement's lock
    /// wait in the statement (`SET STATEMENT … FOR`) and reserves in the `BEGIN`'s
    /// round trip; MySQL 8 sets the session's lock wait around the statement.
    mariadb: bool,
    /// The reservations whose record is not committed yet.
    claims: Arc<Claims<WriteTransaction<DB>>>,
    /// Room for open write transactions, each holding a pooled connection: half the
    /// pool, so that their handlers always find a connection to read with (SQLite: one,
    /// the database's single writer, queued here rather than on pooled connections).
    open: Arc<Semaphore>,
    /// How long a write transaction waits for room (the pool's acquire timeout).
    open_wait: Duration,
    /// What a reservation is: the handler's open transaction, or a committed record.
    reservations: Reservations,
    /// The bound on each scope's records, if any.
    quota: Option<ScopeQuota>,
    /// Held from a quota check until the reservation it allowed is registered, so that
    /// reservations of this store are counted one after the other.
    quota_check: tokio::sync::Mutex<()>,
}

/// What a reservation of a [`OneCommitStore`] is, set with
/// [`with_reservations`](OneCommitStore::with_reservations). Either way a handler writes
/// through [`Tx`](crate::Tx), a crash at any instant leaves its write and its record both
/// or neither, and duplicates wait and then replay.
///
/// | | `Uncommitted` (default) | `Leased` |
/// | --- | --- | --- |
/// | what holds the key while the handler runs | its open transaction (PostgreSQL: the key's advisory lock; MySQL/MariaDB: the uncommitted record; SQLite: this process's claim) | a committed in-flight record whose lease the layer renews |
/// | commits per keyed first execution | 1: record, write and answer together | 2: the reservation's, then the handler's write with its answer |
/// | a pooled connection is held | from the reservation to the handler's commit | only while the handler's transaction is open |
/// | a handler that runs past its lease | cannot be taken over (there is no lease) | is taken over by a retry, and its late commit is refused |
/// | use it when | the handler writes through `Tx` and runs briefly | the handler runs for minutes, or writes outside `Tx` first |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reservations {
    /// The key is held by the handler's open transaction, and the record is written in
    /// it: one commit per keyed first execution.
    #[default]
    Uncommitted,
    /// The key is held by a committed in-flight record with a lease, as the typed store
    /// the [`OneCommitStore`] is built on writes it; the handler's `Tx` writes the answer
    /// into it with the change.
    Leased,
}

/// The statements of the one-commit path, in one dialect.
struct Statements {
    /// PostgreSQL (only): the reservation's look at the key once its transaction began
    /// with the key's lock (see [`crate::postgres::look_under_lock_statement`]).
    look_under_lock: Option<Arc<str>>,
    /// PostgreSQL (only): the reservation's `BEGIN`, which tries the key's lock (see
    /// [`crate::postgres::begin_locking_statement`]), given the lock key.
    begin_locking: Option<fn(i64) -> String>,
    /// MySQL/MariaDB (only): a duplicate's wait for the owner's uncommitted row (see
    /// `crate::mysql::owners_row_statement`).
    owners_row: Option<Arc<str>>,
    /// The in-flight record under a reservation's token. MySQL/MariaDB: the reservation
    /// itself (also a duplicate's probe). PostgreSQL: the record of a handler that commits
    /// the reservation's transaction without its answer. Every dialect: the record of a
    /// reservation that outlives the handler's transaction ([`OneCommitStore::write_own_record`]).
    insert_in_flight: Arc<str>,
    /// PostgreSQL, SQLite (MySQL/MariaDB finalize their reservation's row instead): the
    /// insert of the finished record, written whole in the handler's transaction.
    insert_completed: Option<String>,
    /// The answer's write into a record in flight (MySQL/MariaDB's reservations, and
    /// records a typed store reserved; PostgreSQL: without announcing it).
    finalize: String,
    /// What a scope holds, for its quota.
    scope_usage: String,
}

impl<DB: RecordDatabase> OneCommitStore<DB> {
    /// A one-commit store writing reservations through `pool` (the pool the handler
    /// writes with) into `table`, where `records` (a typed store on the same database
    /// and table, e.g. from [`open`](crate::open)) keeps everything committed.
    ///
    /// Fails if the pool's database cannot be reached, or is one this build has no
    /// feature for (`postgres`, `mysql`, `sqlite`).
    pub async fn new(
        records: Arc<dyn FullStore>,
        pool: Pool<DB>,
        table: &TableName,
    ) -> Result<Self, StoreError> {
        let mut connection = pool.acquire().await.map_err(backend)?;
        let name = DB::backend_name(&connection).to_owned();
        // The statements of this path, in the pool's dialect: MySQL inserts the record in
        // flight (MariaDB in the `BEGIN`'s round trip) and finalizes it; PostgreSQL takes
        // the key's lock and SQLite claims the key in the process, and both insert the
        // record finished.
        let (dialect, sql): (Dialect, Statements) = match name.as_str() {
            #[cfg(feature = "postgres")]
            "PostgreSQL" => (
                Dialect::Postgres,
                Statements {
                    look_under_lock: Some(crate::postgres::look_under_lock_statement(table).into()),
                    begin_locking: Some(crate::postgres::begin_locking_statement),
                    owners_row: None,
                    insert_in_flight: crate::postgres::insert_in_flight_statement(table).into(),
                    insert_completed: Some(crate::postgres::insert_completed_statement(table)),
                    finalize: crate::postgres::finalize_quietly_statement(table),
                    scope_usage: crate::postgres::scope_usage_statement(table),
                },
            ),
            #[cfg(feature = "mysql")]
            "MySQL" => (
                Dialect::MySql,
                Statements {
                    look_under_lock: None,
                    begin_locking: None,
                    owners_row: Some(crate::mysql::owners_row_statement(table).into()),
                    insert_in_flight: crate::mysql::insert_in_flight_statement(table).into(),
                    insert_completed: None,
                    finalize: crate::mysql::finalize_statement(table),
                    scope_usage: crate::mysql::scope_usage_statement(table),
                },
            ),
            #[cfg(feature = "sqlite")]
            "SQLite" => (
                Dialect::Sqlite,
                Statements {
                    look_under_lock: None,
                    begin_locking: None,
                    owners_row: None,
                    insert_in_flight: crate::sqlite::insert_in_flight_statement(table).into(),
                    insert_completed: Some(crate::sqlite::insert_completed_statement(table)),
                    finalize: crate::sqlite::finalize_statement(table),
                    scope_usage: crate::sqlite::scope_usage_statement(table),
                },
            ),
            _ => {
                return Err(StoreError::backend(FinalizeError::WrongDatabase {
                    expected: "PostgreSQL, MySQL/MariaDB or SQLite, with this crate's feature for it",
                    found: name,
                }));
            }
        };
        let mariadb = dialect == Dialect::MySql
            && DB::text(&mut connection, "SELECT VERSION()")
                .await
                .map_err(backend)?
                .contains("MariaDB");
        let room = match dialect {
            Dialect::Sqlite => 1,
            Dialect::Postgres | Dialect::MySql => {
                (pool.options().get_max_connections() as usize / 2).max(1)
            }
        };
        let open_wait = pool.options().get_acquire_timeout();
        Ok(Self {
            open: Arc::new(Semaphore::new(room)),
            open_wait,
            records,
            pool,
            dialect,
            table: table.clone(),
            mariadb,
            reservations: Reservations::default(),
            quota: None,
            quota_check: tokio::sync::Mutex::new(()),
            sql,
            claims: Arc::default(),
        })
    }

    /// What a reservation is (see [`Reservations`]; by default
    /// [`Reservations::Uncommitted`]). The handler's code is the same either way.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo(records: std::sync::Arc<dyn idempotency_core::FullStore>, pool: sqlx::PgPool)
    /// # -> Result<(), idempotency_core::StoreError> {
    /// use idempotency_store_sql::{OneCommitStore, Reservations, TableName};
    ///
    /// // Handlers that run for minutes: a committed record with a lease, renewed while
    /// // they run, rather than a transaction and a pooled connection held all along.
    /// let store = OneCommitStore::new(records, pool, &TableName::default())
    ///     .await?
    ///     .with_reservations(Reservations::Leased);
    /// # drop(store); Ok(()) }
    /// ```
    pub fn with_reservations(mut self, reservations: Reservations) -> Self {
        self.reservations = reservations;
        // PostgreSQL: duplicates of a leased reservation listen for its record's answer
        // (the typed store's `wait`), so the answer written in the handler's transaction
        // is announced, as the typed store's own finalize announces it.
        #[cfg(feature = "postgres")]
        if self.dialect == Dialect::Postgres {
            self.sql.finalize = match reservations {
                Reservations::Leased => crate::postgres::finalize_statement(&self.table),
                Reservations::Uncommitted => {
                    crate::postgres::finalize_quietly_statement(&self.table)
                }
            };
        }
        self
    }

    /// Bounds the live records of each scope (see [`ScopeQuota`]); past it, a new key is
    /// refused with `StoreError::QuotaExceeded` (the layer answers 429), a replay never.
    pub fn with_scope_quota(mut self, quota: ScopeQuota) -> Self {
        self.quota = Some(quota);
        self
    }

    /// The typed store that keeps the committed records.
    pub fn records(&self) -> &Arc<dyn FullStore> {
        &self.records
    }
}

impl<DB: RecordDatabase> std::fmt::Debug for OneCommitStore<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OneCommitStore")
            .field("dialect", &self.dialect)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}
