//! [`OneCommitStore`]: the reservation, the handler's mutation and its answer written in
//! one transaction and committed once. It sits above the backends (it uses their
//! statements) and beside [`AnyFinalizer`], which writes its answers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body::Body;
use idempotency_core::{
    Binding, BoxError, EvictInFlight, Eviction, FencingToken, FullStore, IdempotencyRecord,
    IdempotencyStore, InspectedRecord, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId,
    Reservation, ReservationHandle, ScopeQuota, StoreError, Waited, async_trait,
};
use sqlx::{Pool, Transaction};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, oneshot};

use crate::commit_outcome::{CommitError, OutcomeCheck};
use crate::common::{backend, new_token};
use crate::in_transaction::{FinalizeError, finalize_with, finish, prepare};
use crate::record_database::{Dialect, NewRecord, RecordDatabase, wait_for_key_lock};
use crate::table::TableName;

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
/// transaction-scoped advisory lock (after finding no record under the key), on
/// MySQL/MariaDB it inserts the in-flight record, uncommitted. The handler takes that
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
///   renewals cost nothing, and a slow handler is never run twice beside itself.
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
/// store alone (or under [`RecordsElsewhere`](crate::RecordsElsewhere)) when the
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
/// use idempotency_store_sql::{OneCommitStore, PostgresStore, TableName, Tx, TxError};
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
/// async fn place(mut tx: Tx<Arc<OneCommitStore<Postgres>>>) -> Response {
///     sqlx::query("INSERT INTO orders (item) VALUES ('book')").execute(&mut *tx).await.unwrap();
///     let answer = (http::StatusCode::CREATED, "order placed").into_response();
///     // The one commit: record, order and answer.
///     tx.commit(answer).await.unwrap_or_else(TxError::into_response)
/// }
/// let app: Router = Router::new()
///     .route("/orders", post(place))
///     .with_state(store.clone())
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
    /// MariaDB: the reservation's insert, `sql.insert_in_flight` with its own lock wait
    /// bound (`SET STATEMENT … FOR`); elsewhere the session's is set around it.
    bounded_reserve: Option<String>,
    /// The reservations whose record is not committed yet.
    claims: Arc<Claims<DB>>,
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
    /// PostgreSQL (only): the reservation, the key's advisory lock taken unless a record
    /// holds the key.
    lock_key: Option<String>,
    /// PostgreSQL (only): the key's record looked up again once its lock is taken (see
    /// [`crate::postgres::record_of_key_statement`]).
    lookup_after_lock: Option<String>,
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

/// The transaction inside a [`Tx`](crate::Tx) on a [`OneCommitStore`] or
/// [`RecordsElsewhere`](crate::RecordsElsewhere): the one its request's record was
/// reserved in, or a new one. It holds the store's room for one open write transaction
/// until it ends; dropped, it rolls back.
///
/// A `COMMIT` whose answer is lost never lets a retry run the change twice:
/// [`commit`](Self::commit) tells a change that did not commit from one whose outcome is
/// unknown (see [`CommitError`]), and for a keyed transaction on PostgreSQL asks the
/// database what happened.
pub struct WriteTransaction<DB: RecordDatabase> {
    /// `Some` until it commits or rolls back.
    transaction: Option<Transaction<'static, DB>>,
    room: Option<OwnedSemaphorePermit>,
    /// SQLite: the reservation's claim, let go once the transaction ended.
    claim: Option<ClaimGuard<DB>>,
    /// A keyed request whose record is kept elsewhere: the pool to ask, after a `COMMIT`
    /// whose answer was lost, whether it committed.
    asks_after_lost_commit: Option<Pool<DB>>,
}

/// A transaction on `pool`; on SQLite, one that takes the write lock at once.
///
/// Begun on a task of its own and handed over: a caller that goes away while `BEGIN` runs
/// (its client hung up) would otherwise leave the connection in a transaction that nobody
/// ends — on SQLite, holding the database's write lock for good.
async fn begin_on<DB: RecordDatabase>(
    pool: &Pool<DB>,
) -> Result<Transaction<'static, DB>, sqlx::Error> {
    let pool = pool.clone();
    let immediate = DB::is_sqlite(&pool);
    let (handover, begun) = oneshot::channel();
    tokio::spawn(async move {
        let transaction = if immediate {
            pool.begin_with("BEGIN IMMEDIATE").await
        } else {
            pool.begin().await
        };
        if let Err(Ok(abandoned)) = handover.send(transaction) {
            let _ = abandoned.rollback().await;
        }
    });
    begun.await.unwrap_or(Err(sqlx::Error::PoolClosed))
}

impl<DB: RecordDatabase> WriteTransaction<DB> {
    /// A transaction on `pool` without a one-commit store (idempotency off, or records
    /// elsewhere), with the same care: on SQLite it takes the write lock at once, and a
    /// caller that goes away while it begins, commits or rolls back leaves no
    /// connection inside a transaction.
    ///
    /// Give it the request's `reservation` when the records are kept in another store
    /// than this database (Redis, say): if the answer to its `COMMIT` is lost, the
    /// commit then asks the database what happened before it answers (PostgreSQL; see
    /// [`CommitError`]), which costs one more statement before `COMMIT`. A request without
    /// a key, or whose record is in this database, needs no question: pass `None`.
    pub(crate) async fn begin_on(
        pool: &Pool<DB>,
        reservation: Option<&ReservationHandle>,
    ) -> Result<Self, sqlx::Error> {
        let mut transaction = Self::open(begin_on(pool).await?, None);
        transaction.asks_after_lost_commit = reservation.map(|_| pool.clone());
        Ok(transaction)
    }

    fn new(transaction: Transaction<'static, DB>, room: OwnedSemaphorePermit) -> Self {
        Self::open(transaction, Some(room))
    }

    fn open(transaction: Transaction<'static, DB>, room: Option<OwnedSemaphorePermit>) -> Self {
        Self {
            transaction: Some(transaction),
            room,
            claim: None,
            asks_after_lost_commit: None,
        }
    }

    fn holding(mut self, claim: ClaimGuard<DB>) -> Self {
        self.claim = Some(claim);
        self
    }

    /// Commits the transaction: for a keyed request, the record, the mutation and the
    /// answer, once.
    ///
    /// A failed commit says whether anything of it may be in the database
    /// ([`CommitError::Unknown`]) or not ([`CommitError::NotCommitted`]). When the answer
    /// to `COMMIT` was lost and the transaction belongs to a keyed request whose records are
    /// elsewhere ([`RecordsElsewhere`](crate::RecordsElsewhere)), it asks the database first, for up to
    /// [`OUTCOME_CHECK_FOR`](crate::OUTCOME_CHECK_FOR), and is `Ok` if it committed after
    /// all.
    pub async fn commit(mut self) -> Result<(), CommitError> {
        let backend = Dialect::of(DB::backend_name(&self));
        if let Err(error) = self.record_in_flight_unless_finalized().await {
            let _ = self.rollback().await;
            return Err(CommitError::NotCommitted(error));
        }
        let check = match self.asks_after_lost_commit.take() {
            Some(pool) => Some(OutcomeCheck::prepare(pool, &mut self).await?),
            None => None,
        };
        let Err(error) = self.end(Transaction::commit).await else {
            return Ok(());
        };
        match check {
            Some(check) => check.outcome(backend, error).await,
            None => Err(CommitError::after(backend, error)),
        }
    }

    /// PostgreSQL: a reservation's transaction about to commit without its answer inserts
    /// the record in flight, which keeps the key held once the `COMMIT` lets the key's
    /// lock go (the layer then writes the answer into it).
    async fn record_in_flight_unless_finalized(&mut self) -> Result<(), sqlx::Error> {
        let Some(claim) = &self.claim else {
            return Ok(());
        };
        let Some((in_flight, terms)) = claim.unrecorded() else {
            return Ok(());
        };
        let (statement, lock_key) = (in_flight.statement.clone(), in_flight.lock_key);
        let (id, token) = (claim.id.clone(), claim.token);
        let (_, inserted) = DB::insert_in_flight(
            &mut **self,
            &statement,
            &NewRecord::new(&id, &terms.binding, token, terms.lease, terms.lifetime),
            Some(lock_key),
        )
        .await?;
        if inserted == 1 {
            Ok(())
        } else {
            Err(sqlx::Error::Protocol(
                "another request committed a record under this idempotency key while this \
                 one ran; nothing of this one was committed"
                    .into(),
            ))
        }
    }

    /// Rolls the transaction back, a reservation with it.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        self.end(Transaction::rollback).await
    }

    /// Commits or rolls back on a task of its own, which finishes even if the caller goes
    /// away meanwhile (a connection must not go back to the pool half way through), and
    /// gives the room and the claim back once it is done.
    async fn end<F>(mut self, how: fn(Transaction<'static, DB>) -> F) -> Result<(), sqlx::Error>
    where
        F: Future<Output = Result<(), sqlx::Error>> + Send + 'static,
    {
        let transaction = self.transaction.take().expect("open until it ends");
        let held = (self.room.take(), self.claim.take());
        let ended = tokio::spawn(async move {
            let ended = how(transaction).await;
            drop(held);
            ended
        });
        ended.await.unwrap_or(Err(sqlx::Error::PoolClosed))
    }
}

impl<DB: RecordDatabase> Drop for WriteTransaction<DB> {
    /// Rolls back a transaction dropped while open, and gives its room (and its pooled
    /// connection) back only once that is done: sqlx alone would return the connection
    /// with the rollback still queued, and the next `BEGIN` on it would fail.
    fn drop(&mut self) {
        let Some(transaction) = self.transaction.take() else {
            return;
        };
        let (room, claim) = (self.room.take(), self.claim.take());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = transaction.rollback().await;
                drop((room, claim));
            });
        }
    }
}

impl<DB: RecordDatabase> std::ops::Deref for WriteTransaction<DB> {
    type Target = Transaction<'static, DB>;

    fn deref(&self) -> &Self::Target {
        self.transaction.as_ref().expect("open until it ends")
    }
}

impl<DB: RecordDatabase> std::ops::DerefMut for WriteTransaction<DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.transaction.as_mut().expect("open until it ends")
    }
}

impl<DB: RecordDatabase> std::fmt::Debug for WriteTransaction<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteTransaction").finish_non_exhaustive()
    }
}

/// A reservation whose record is not committed yet, with the token it was given.
struct Pending<DB: RecordDatabase> {
    token: FencingToken,
    state: PendingState<DB>,
    terms: Terms,
}

enum PendingState<DB: RecordDatabase> {
    /// SQLite: this process's claim on the key; nothing is written yet.
    Claimed,
    /// The record is in this transaction, which the handler has not taken.
    Open(WriteTransaction<DB>),
    /// The handler took the transaction; it commits or rolls it back.
    Taken,
    /// SQLite: the handler wrote the record in its transaction; the claim goes when that
    /// transaction ends.
    Finalized,
    /// The layer is settling it (finalizing or releasing); it goes once that is done,
    /// so that a duplicate waiting on it finds the record written, or none.
    Settling,
}

/// The reservations whose record is not committed yet, by record, and the signal that
/// one settled, which SQLite's duplicates wait for.
struct Claims<DB: RecordDatabase> {
    pending: Mutex<HashMap<RecordId, Pending<DB>>>,
    settled: Notify,
}

impl<DB: RecordDatabase> Default for Claims<DB> {
    fn default() -> Self {
        Self {
            pending: Mutex::default(),
            settled: Notify::new(),
        }
    }
}

impl<DB: RecordDatabase> Claims<DB> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RecordId, Pending<DB>>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes the reservation `token` holds on `id`, and tells the waiters.
    fn forget(&self, id: &RecordId, token: FencingToken) -> Option<Pending<DB>> {
        let mut pending = self.lock();
        if pending.get(id).is_none_or(|entry| entry.token != token) {
            return None;
        }
        let entry = pending.remove(id);
        drop(pending);
        self.settled.notify_waiters();
        entry
    }

    /// Marks the reservation `token` holds on `id` as being settled, and hands over its
    /// state and terms; the reservation stays (duplicates keep waiting on it) until the
    /// returned guard is dropped.
    fn settle(
        self: &Arc<Self>,
        id: &RecordId,
        token: FencingToken,
    ) -> Option<(PendingState<DB>, Terms, SettlingGuard<DB>)> {
        let mut pending = self.lock();
        let entry = pending.get_mut(id).filter(|entry| {
            entry.token == token && !matches!(entry.state, PendingState::Settling)
        })?;
        let state = std::mem::replace(&mut entry.state, PendingState::Settling);
        let guard = SettlingGuard {
            claims: self.clone(),
            id: id.clone(),
            token,
        };
        Some((state, entry.terms.clone(), guard))
    }

    /// Whether `id` itself is reserved here, and how many reservations of its scope are,
    /// with the bytes their records hold so far.
    fn pending_in_scope(&self, id: &RecordId) -> (bool, i64, i64) {
        let pending = self.lock();
        let (mut count, mut bytes) = (0, 0);
        for (other, entry) in pending.iter().filter(|(other, _)| other.scope == id.scope) {
            count += 1;
            bytes += other.reserved_bytes(&entry.terms.binding) as i64;
        }
        (pending.contains_key(id), count, bytes)
    }

    /// Marks the reservation as finalized in its handler's transaction.
    fn finalized(&self, id: &RecordId, token: FencingToken) {
        if let Some(entry) = self.lock().get_mut(id).filter(|entry| entry.token == token) {
            entry.state = PendingState::Finalized;
        }
    }
}

/// A reservation being settled by the layer: it goes, and its waiters are told, when the
/// settling is done (or abandoned).
struct SettlingGuard<DB: RecordDatabase> {
    claims: Arc<Claims<DB>>,
    id: RecordId,
    token: FencingToken,
}

impl<DB: RecordDatabase> Drop for SettlingGuard<DB> {
    fn drop(&mut self) {
        self.claims.forget(&self.id, self.token);
    }
}

/// A reservation held by the handler's transaction (SQLite: a claim in this process;
/// PostgreSQL: the key's advisory lock too). When the transaction ends, a reservation
/// whose record was written in it goes (after the commit, so that a duplicate that was
/// waiting reads the record); one whose record was not stays for the layer to settle.
struct ClaimGuard<DB: RecordDatabase> {
    claims: Arc<Claims<DB>>,
    id: RecordId,
    token: FencingToken,
    /// PostgreSQL: how to keep the key held past a `COMMIT` without the answer.
    in_flight: Option<InFlightUnlessFinalized>,
}

/// PostgreSQL: the in-flight record a reservation's transaction inserts before a `COMMIT`
/// without its answer (the advisory lock goes with the `COMMIT`; the record keeps the key
/// held until the layer writes the answer).
struct InFlightUnlessFinalized {
    statement: Arc<str>,
    lock_key: i64,
}

impl<DB: RecordDatabase> ClaimGuard<DB> {
    /// The terms of the reservation if its record is still to be written in the
    /// transaction and must be inserted in flight before it commits.
    fn unrecorded(&self) -> Option<(&InFlightUnlessFinalized, Terms)> {
        let in_flight = self.in_flight.as_ref()?;
        let claims = self.claims.lock();
        let entry = claims.get(&self.id).filter(|entry| {
            entry.token == self.token && matches!(entry.state, PendingState::Taken)
        })?;
        Some((in_flight, entry.terms.clone()))
    }
}

impl<DB: RecordDatabase> Drop for ClaimGuard<DB> {
    fn drop(&mut self) {
        let finalized = self.claims.lock().get(&self.id).is_some_and(|entry| {
            entry.token == self.token && matches!(entry.state, PendingState::Finalized)
        });
        if finalized {
            self.claims.forget(&self.id, self.token);
        }
    }
}

/// What the reservation asked for, to reserve again with a typed store if the handler
/// rolled its transaction back and the layer still has an answer to keep.
#[derive(Clone)]
struct Terms {
    binding: Binding,
    lease: Duration,
    lifetime: Duration,
}

/// What a handler takes of its reservation.
enum Taken<DB: RecordDatabase> {
    Open(WriteTransaction<DB>),
    Claimed,
}

/// What an attempt to reserve a key in a transaction found.
enum Attempt<DB: RecordDatabase> {
    /// Reserved in this open transaction.
    Held(WriteTransaction<DB>),
    /// A committed record holds the key.
    Committed,
    /// Another transaction holds the key (its owner runs), still when the wait ended.
    Busy,
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
        // flight and finalizes it; PostgreSQL takes the key's lock and SQLite claims the
        // key in the process, and both insert the record finished.
        let (dialect, sql): (Dialect, Statements) = match name.as_str() {
            #[cfg(feature = "postgres")]
            "PostgreSQL" => (
                Dialect::Postgres,
                Statements {
                    lock_key: Some(crate::postgres::reserve_lock_statement(table)),
                    lookup_after_lock: Some(crate::postgres::record_of_key_statement(table)),
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
                    lock_key: None,
                    lookup_after_lock: None,
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
                    lock_key: None,
                    lookup_after_lock: None,
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
            // MariaDB bounds the reservation's lock wait in the insert itself
            // (`SET STATEMENT … FOR`): two statements fewer than setting the session's.
            bounded_reserve: mariadb.then(|| {
                format!(
                    "SET STATEMENT innodb_lock_wait_timeout = {MYSQL_RESERVE_LOCK_WAIT_SECS} \
                     FOR {}",
                    &*sql.insert_in_flight
                )
            }),
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

    /// Refuses a new record in `id`'s scope past `quota`: the scope's committed records
    /// and this process's reservations of it not committed yet. The returned guard keeps
    /// the next check waiting until the reservation it allowed is registered.
    async fn within_quota(
        &self,
        quota: &ScopeQuota,
        id: &RecordId,
    ) -> Result<tokio::sync::MutexGuard<'_, ()>, StoreError> {
        let checking = self.quota_check.lock().await;
        let mut connection = self.pool.acquire().await.map_err(backend)?;
        let (key_live, records, bytes, next_expiry_in_ms) =
            DB::scope_usage(&mut connection, &self.sql.scope_usage, id)
                .await
                .map_err(backend)?;
        drop(connection);
        let (key_pending, pending, pending_bytes) = self.claims.pending_in_scope(id);
        let usage = crate::common::ScopeUsage {
            key_live: key_live || key_pending,
            records: records + pending,
            bytes: bytes + pending_bytes,
            next_expiry_in_ms,
        };
        match usage.refusal(quota) {
            Some(refusal) => Err(refusal),
            None => Ok(checking),
        }
    }

    /// The transaction for a handler to write its mutation in: the one its request's
    /// record was reserved in (keyed requests), or a new one (requests without a key, or
    /// keyed ones that a typed store reserved: a record that had expired, say). Write,
    /// then [`finalize_in`](Self::finalize_in), then commit: for a keyed request, that one
    /// commit holds the record, the mutation and the answer.
    ///
    /// Dropping a reservation's transaction rolls the reservation back with it: the layer
    /// then keeps the handler's answer as a typed store would (two commits).
    ///
    /// Write transactions, keyed or not, take at most half the pool's connections at once
    /// (SQLite: one, the database's single writer), so that a handler that holds one always
    /// finds a connection to read with; past the pool's acquire timeout, this fails.
    pub(crate) async fn begin(
        &self,
        reservation: Option<&ReservationHandle>,
    ) -> Result<WriteTransaction<DB>, StoreError> {
        if let Some(reservation) = reservation {
            let (id, token) = (reservation.id(), reservation.token());
            let claim = |in_flight| ClaimGuard {
                claims: self.claims.clone(),
                id: id.clone(),
                token,
                in_flight,
            };
            match self.take(id, token) {
                // PostgreSQL: the record is written whole by `finalize_in`, in this
                // transaction; if the handler commits without it, the record is
                // inserted in flight at its `COMMIT`, so that the key stays held.
                Some(Taken::Open(transaction)) if self.dialect == Dialect::Postgres => {
                    let in_flight = InFlightUnlessFinalized {
                        statement: self.sql.insert_in_flight.clone(),
                        lock_key: self.table.record_lock_key(id),
                    };
                    return Ok(transaction.holding(claim(Some(in_flight))));
                }
                Some(Taken::Open(transaction)) => return Ok(transaction),
                // SQLite: the record is written whole by `finalize_in`, in this
                // transaction, and the claim is let go when it ends.
                Some(Taken::Claimed) => {
                    let room = self.room().await?;
                    let transaction = self.begin_raw().await.map_err(backend)?;
                    return Ok(WriteTransaction::new(transaction, room).holding(claim(None)));
                }
                None => {}
            }
        }
        let room = self.room().await?;
        let transaction = self.begin_raw().await.map_err(backend)?;
        Ok(WriteTransaction::new(transaction, room))
    }

    /// Marks the reservation `token` holds on `id` as taken by its handler, and hands over
    /// what the handler writes in: the open transaction, or (SQLite) word that the
    /// handler's own transaction will hold the record. `None` once taken.
    fn take(&self, id: &RecordId, token: FencingToken) -> Option<Taken<DB>> {
        let mut pending = self.claims.lock();
        let entry = pending.get_mut(id).filter(|entry| entry.token == token)?;
        if !matches!(entry.state, PendingState::Open(_) | PendingState::Claimed) {
            return None;
        }
        match std::mem::replace(&mut entry.state, PendingState::Taken) {
            PendingState::Open(transaction) => Some(Taken::Open(transaction)),
            _ => Some(Taken::Claimed),
        }
    }

    /// PostgreSQL, SQLite: writes a reservation's record, finished with `response`, in
    /// `connection`'s transaction; `Lost` if a live record holds the key (another process
    /// committed it while this request ran).
    async fn write_completed(
        &self,
        connection: &mut DB::Connection,
        id: &RecordId,
        token: FencingToken,
        terms: &Terms,
        response: &idempotency_core::StoredResponse,
    ) -> Result<Ownership, sqlx::Error> {
        let statement = self.sql.insert_completed.as_deref().expect(
            "only PostgreSQL and SQLite write a finished record, and both have the statement",
        );
        let written = DB::insert_completed(
            connection,
            statement,
            &NewRecord::new(id, &terms.binding, token, terms.lease, terms.lifetime),
            response,
        )
        .await?;
        Ok(crate::common::ownership(written))
    }

    /// SQLite: the finished record, in a transaction of its own, for a handler that wrote
    /// none in its transaction.
    async fn record_alone(
        &self,
        id: &RecordId,
        token: FencingToken,
        terms: &Terms,
        response: &idempotency_core::StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let room = self.room().await?;
        let mut transaction = self.begin_raw().await.map_err(backend)?;
        let held = self
            .write_completed(&mut transaction, id, token, terms, response)
            .await
            .map_err(backend)?;
        if held == Ownership::Held {
            transaction.commit().await.map_err(backend)?;
        } else {
            transaction.rollback().await.map_err(backend)?;
        }
        drop(room);
        Ok(held)
    }

    /// MySQL/MariaDB: inserts the in-flight record in `transaction`: `(committed, inserted)` (see
    /// [`RecordDatabase::insert_in_flight`]).
    async fn insert_in_flight(
        &self,
        transaction: &mut DB::Connection,
        id: &RecordId,
        binding: &Binding,
        token: FencingToken,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<(i64, i64), sqlx::Error> {
        let statement = self
            .bounded_reserve
            .as_deref()
            .unwrap_or(&self.sql.insert_in_flight);
        DB::insert_in_flight(
            transaction,
            statement,
            &NewRecord::new(id, binding, token, lease, lifetime),
            None,
        )
        .await
    }

    /// Room for one more open write transaction.
    async fn room(&self) -> Result<OwnedSemaphorePermit, StoreError> {
        match tokio::time::timeout(self.open_wait, self.open.clone().acquire_owned()).await {
            Ok(Ok(room)) => Ok(room),
            _ => Err(StoreError::backend(format!(
                "no room for another write transaction within {:?}: each holds a pooled \
                 connection, and at most half the pool's are used for them (SQLite: one); \
                 raise the pool's size, or shorten the handlers' transactions",
                self.open_wait
            ))),
        }
    }

    /// A transaction on the pool; on SQLite, one that takes the write lock at once.
    async fn begin_raw(&self) -> Result<Transaction<'static, DB>, sqlx::Error> {
        begin_on(&self.pool).await
    }

    /// Writes `response` into the request's record inside `transaction` and returns the
    /// answer to send once it commits, as [`AnyFinalizer::finalize_in`](crate::AnyFinalizer::finalize_in) does; a request
    /// without a key gets its response back untouched. On an error, roll the transaction
    /// back.
    pub(crate) async fn finalize_in<B>(
        &self,
        transaction: &mut DB::Connection,
        reservation: Option<&ReservationHandle>,
        response: Response<B>,
    ) -> Result<Response<B>, FinalizeError>
    where
        B: Body<Data = Bytes> + From<Bytes>,
        B::Error: Into<BoxError>,
    {
        // PostgreSQL and SQLite: the record is inserted here, finished, for a reservation
        // whose transaction (SQLite: claim) the handler holds.
        if let Some(reservation) = reservation
            && let Some(terms) = self.held_terms(reservation)
        {
            let prepared = match prepare(Some(reservation), response).await? {
                Ok(prepared) => prepared,
                Err(unchanged) => return Ok(unchanged),
            };
            let stored = prepared
                .stored()
                .expect("prepare() keeps only answers to store");
            let (id, token) = (reservation.id(), reservation.token());
            let ownership = self
                .write_completed(transaction, id, token, &terms, stored)
                .await
                .map_err(FinalizeError::Database)?;
            if ownership == Ownership::Held {
                // The reservation goes when the transaction ends (`ClaimGuard`): a
                // duplicate waiting for it then reads the committed record.
                self.claims.finalized(id, token);
            }
            return finish(prepared, ownership);
        }
        let answer =
            finalize_with::<DB, B>(transaction, &self.sql.finalize, reservation, response).await?;
        // Finalized (or nothing to keep): the layer will not call finalize or release for it.
        if let Some(reservation) = reservation {
            self.forget(reservation.id(), reservation.token());
        }
        Ok(answer)
    }

    /// Writes `answer` into the record `token` holds, in `connection`'s transaction.
    async fn write_answer(
        &self,
        connection: &mut DB::Connection,
        id: &RecordId,
        token: FencingToken,
        answer: &idempotency_core::StoredResponse,
    ) -> Result<Ownership, sqlx::Error> {
        let written = DB::write_answer(connection, &self.sql.finalize, id, token, answer).await?;
        Ok(crate::common::ownership(written))
    }

    /// The typed store that keeps the committed records.
    pub fn records(&self) -> &Arc<dyn FullStore> {
        &self.records
    }

    /// Removes the reservation `token` holds on `id` from the pending ones.
    fn forget(&self, id: &RecordId, token: FencingToken) -> Option<Pending<DB>> {
        self.claims.forget(id, token)
    }

    fn is_pending(&self, id: &RecordId, token: FencingToken) -> bool {
        self.claims
            .lock()
            .get(id)
            .is_some_and(|entry| entry.token == token)
    }

    /// The terms of a reservation whose record `finalize_in` writes whole: one whose
    /// handler took its transaction (PostgreSQL) or claim (SQLite; claimed, not taken, when
    /// the handler began a transaction of its own). `None` for any other, and on
    /// MySQL/MariaDB, whose record is in flight already.
    fn held_terms(&self, reservation: &ReservationHandle) -> Option<Terms> {
        if self.dialect == Dialect::MySql {
            return None;
        }
        self.claims
            .lock()
            .get(reservation.id())
            .filter(|entry| {
                entry.token == reservation.token()
                    && matches!(entry.state, PendingState::Taken | PendingState::Claimed)
            })
            .map(|entry| entry.terms.clone())
    }

    /// SQLite: claims the key in this process, unless a request in it holds it.
    fn claim(&self, id: &RecordId, token: FencingToken, terms: Terms) -> bool {
        let mut pending = self.claims.lock();
        if pending.contains_key(id) {
            return false;
        }
        let state = PendingState::Claimed;
        pending.insert(
            id.clone(),
            Pending {
                token,
                state,
                terms,
            },
        );
        true
    }

    /// SQLite: waits up to `timeout` for this process's claim on `id` to go: `true` once
    /// it went, `false` if it is still held.
    async fn wait_for_claim(&self, id: &RecordId, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let settled = self.claims.settled.notified();
            let mut settled = std::pin::pin!(settled);
            settled.as_mut().enable();
            let held = self.claims.lock().contains_key(id);
            if !held {
                return true;
            }
            if tokio::time::timeout_at(deadline, settled).await.is_err() {
                return false;
            }
        }
    }

    /// SQLite's reservation: the record committed under the key, if any (replays and
    /// reused keys are answered from it), else this process's claim on the key. One read:
    /// it comes after the claim, so a record that an owner in this process committed
    /// before it let its claim go is seen. A replay whose claim is taken (by another
    /// replay of the key, reading) is answered from the read all the same: replays never
    /// wait for each other.
    async fn claim_and_read(
        &self,
        id: &RecordId,
        token: FencingToken,
        terms: Terms,
    ) -> Result<Reservation, StoreError> {
        let claimed = self.claim(id, token, terms);
        let read = self.records.load(id).await;
        if claimed && !matches!(read, Ok(None)) {
            self.forget(id, token);
        }
        match read? {
            Some(record) => Ok(Reservation::Exists(record)),
            None if claimed => Ok(Reservation::ReservedUncommitted(token)),
            None => Ok(Reservation::Busy),
        }
    }

    /// PostgreSQL, MySQL/MariaDB: opens a transaction and reserves the key in it, without
    /// waiting for a duplicate's owner (PostgreSQL: takes the key's advisory lock, the
    /// record is inserted finished at `finalize_in`) or for at most
    /// [`MYSQL_RESERVE_LOCK_WAIT_SECS`] (MySQL/MariaDB: inserts the in-flight record).
    async fn reserve_in_transaction(
        &self,
        id: &RecordId,
        binding: &Binding,
        token: FencingToken,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Attempt<DB>, StoreError> {
        let room = self.room().await?;
        for _ in 0..MAX_DEADLOCK_RETRIES {
            let mut transaction = self.begin_raw().await.map_err(backend)?;
            let session_lock_wait =
                self.dialect == Dialect::MySql && self.bounded_reserve.is_none();
            if session_lock_wait {
                set_lock_wait::<DB>(&mut transaction, Some(MYSQL_RESERVE_LOCK_WAIT_SECS)).await?;
            }
            let inserted = match self.dialect {
                Dialect::Postgres => {
                    let lock = self.table.record_lock_key(id);
                    let statement = self
                        .sql
                        .lock_key
                        .as_deref()
                        .expect("PostgreSQL's statements take the key's lock");
                    match DB::lock_key(&mut transaction, statement, id, lock).await {
                        // The lookup saw the table as the statement began: a transaction
                        // that committed the key's record and let go of its lock while the
                        // statement ran is not in it. Under the lock, a statement of its
                        // own sees that record (found by the simulation: a duplicate ran
                        // beside a record committed a moment before).
                        Ok((false, true)) => {
                            let lookup = self
                                .sql
                                .lookup_after_lock
                                .as_deref()
                                .expect("PostgreSQL's statements look the key up again");
                            DB::rows_of_key(&mut transaction, lookup, id)
                                .await
                                .map(|rows| if rows > 0 { (1, 0) } else { (0, 1) })
                        }
                        other => other
                            .map(|(committed, locked)| (i64::from(committed), i64::from(locked))),
                    }
                }
                Dialect::MySql | Dialect::Sqlite => {
                    self.insert_in_flight(&mut transaction, id, binding, token, lease, lifetime)
                        .await
                }
            };
            if session_lock_wait {
                // The handler's statements (and the pool's next user) wait as long as usual.
                set_lock_wait::<DB>(&mut transaction, None).await?;
            }
            match inserted {
                Ok((_, 1)) => {
                    return Ok(Attempt::Held(WriteTransaction::new(transaction, room)));
                }
                Ok((committed, _)) => {
                    let _ = transaction.rollback().await;
                    // PostgreSQL: a record holds the key, or its lock is held by the
                    // transaction of the owner running it.
                    return Ok(if committed > 0 {
                        Attempt::Committed
                    } else {
                        Attempt::Busy
                    });
                }
                Err(error) => {
                    // A failed statement may have ended the transaction; a rollback that
                    // fails changes nothing here.
                    let _ = transaction.rollback().await;
                    match conflict(&error) {
                        Conflict::Duplicate => return Ok(Attempt::Committed),
                        Conflict::Busy => return Ok(Attempt::Busy),
                        Conflict::Deadlock => continue,
                        Conflict::Other => return Err(backend(error)),
                    }
                }
            }
        }
        Ok(Attempt::Busy)
    }

    /// Waits up to `timeout` for the transaction that holds the key to end: `true` if it
    /// ended (or none held it), `false` if it still runs.
    async fn wait_for_owner(&self, id: &RecordId, timeout: Duration) -> Result<bool, StoreError> {
        match self.dialect {
            Dialect::Postgres => {
                let lock = self.table.record_lock_key(id);
                wait_for_key_lock(&self.pool, lock, timeout)
                    .await
                    .map_err(backend)
            }
            Dialect::MySql => self.wait_on_owners_row(id, timeout).await,
            // SQLite's duplicates wait for the owner's claim instead.
            Dialect::Sqlite => Ok(false),
        }
    }

    /// MySQL/MariaDB: waits up to `timeout` on the owner's uncommitted row with a locking
    /// read of the key's row, which waits for the transaction that inserted it; true
    /// once that transaction ended (committed or rolled back), false if it still runs.
    async fn wait_on_owners_row(
        &self,
        id: &RecordId,
        timeout: Duration,
    ) -> Result<bool, StoreError> {
        let mut transaction = self.begin_raw().await.map_err(backend)?;
        let seconds = timeout.as_secs_f64().ceil().max(1.0) as u64;
        set_lock_wait::<DB>(&mut transaction, Some(seconds)).await?;
        let read = DB::rows_of_key(&mut transaction, &owners_row_statement(&self.table), id).await;
        set_lock_wait::<DB>(&mut transaction, None).await?;
        let _ = transaction.rollback().await;
        match read {
            Ok(_) => Ok(true),
            Err(error) => match conflict(&error) {
                Conflict::Deadlock => Ok(true),
                Conflict::Busy => Ok(false),
                Conflict::Duplicate | Conflict::Other => Err(backend(error)),
            },
        }
    }

    /// The handler took the transaction and did not finalize in it, and the layer has an
    /// answer to keep: the record is there if the handler committed, or gone with its
    /// rollback, in which case it is reserved again (by the typed store) and finalized.
    async fn finalize_after_handler(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &idempotency_core::StoredResponse,
        terms: Terms,
    ) -> Result<Ownership, StoreError> {
        self.until_the_handlers_transaction_ended(id).await?;
        if self.records.finalize(id, token, response).await? == Ownership::Held {
            return Ok(Ownership::Held);
        }
        // Rolled back: the reservation's record, under its own token, then the answer.
        let lasts = terms.lifetime.max(terms.lease);
        match self
            .write_own_record(id, token, &terms.binding, lasts)
            .await?
        {
            OwnRecord::Written => self.records.finalize(id, token, response).await,
            OwnRecord::Exists | OwnRecord::KeyHeldElsewhere => Ok(Ownership::Lost),
        }
    }

    /// PostgreSQL: waits until the transaction the handler took has ended (it holds the
    /// key's advisory lock until then), so that what it committed, if anything, can be
    /// seen. MySQL/MariaDB's statements wait on the record's row lock by themselves, and
    /// SQLite's on the database's write lock.
    async fn until_the_handlers_transaction_ended(&self, id: &RecordId) -> Result<(), StoreError> {
        if self.dialect != Dialect::Postgres {
            return Ok(());
        }
        let lock = self.table.record_lock_key(id);
        if wait_for_key_lock(&self.pool, lock, self.open_wait)
            .await
            .map_err(backend)?
        {
            return Ok(());
        }
        Err(StoreError::backend(format!(
            "the handler's transaction still held its idempotency key after {:?}; it has to \
             end (commit or roll back) before the key can be settled",
            self.open_wait
        )))
    }

    /// Writes the reservation's record, in flight under its own token for `lasts` (lease
    /// and lifetime), in a statement of its own: for a reservation whose handler's
    /// transaction ended without the record. Nothing is written where a live record holds
    /// the key ([`OwnRecord::Exists`]: the handler committed one, or another request did)
    /// or another owner holds the key's lock ([`OwnRecord::KeyHeldElsewhere`]).
    async fn write_own_record(
        &self,
        id: &RecordId,
        token: FencingToken,
        binding: &Binding,
        lasts: Duration,
    ) -> Result<OwnRecord, StoreError> {
        let mut connection = self.pool.acquire().await.map_err(backend)?;
        let lock = (self.dialect == Dialect::Postgres).then(|| self.table.record_lock_key(id));
        let written = DB::insert_in_flight(
            &mut connection,
            &self.sql.insert_in_flight,
            &NewRecord::new(id, binding, token, lasts, lasts),
            lock,
        )
        .await;
        match written {
            Ok((_, 1)) => Ok(OwnRecord::Written),
            Ok((committed, _)) if committed > 0 || lock.is_none() => Ok(OwnRecord::Exists),
            Ok(_) => Ok(OwnRecord::KeyHeldElsewhere),
            Err(error) => match conflict(&error) {
                Conflict::Duplicate => Ok(OwnRecord::Exists),
                Conflict::Busy => Ok(OwnRecord::KeyHeldElsewhere),
                Conflict::Deadlock | Conflict::Other => Err(backend(error)),
            },
        }
    }
}

/// Sets (or, `None`, resets) how long InnoDB statements of this session wait for a row
/// lock.
/// MySQL/MariaDB: a locking read of a key's row, which waits for an uncommitted insert
/// of that row to commit or roll back. Parameters: scope, key.
fn owners_row_statement(table: &TableName) -> String {
    format!("SELECT 1 FROM `{table}` WHERE scope = ? AND idempotency_key = ? LOCK IN SHARE MODE")
}

async fn set_lock_wait<DB: RecordDatabase>(
    connection: &mut DB::Connection,
    seconds: Option<u64>,
) -> Result<(), StoreError> {
    let value = seconds.map_or("DEFAULT".to_owned(), |s| s.to_string());
    let statement = format!("SET SESSION innodb_lock_wait_timeout = {value}");
    DB::run(connection, &statement).await.map_err(backend)?;
    Ok(())
}

/// What writing a reservation's own record found.
enum OwnRecord {
    /// Written, in flight under the reservation's token.
    Written,
    /// A live record holds the key (the handler committed it, or another request did).
    Exists,
    /// Another owner holds the key's lock (PostgreSQL), or its uncommitted row
    /// (MySQL/MariaDB).
    KeyHeldElsewhere,
}

/// How a statement on a contended key failed.
#[derive(Debug, PartialEq, Eq)]
enum Conflict {
    /// A committed record holds the key.
    Duplicate,
    /// The wait for another transaction's lock ended first.
    Busy,
    /// A deadlock victim: try again.
    Deadlock,
    /// Anything else.
    Other,
}

fn conflict(error: &sqlx::Error) -> Conflict {
    let Some(database) = error.as_database_error() else {
        return Conflict::Other;
    };
    if database.kind() == sqlx::error::ErrorKind::UniqueViolation {
        return Conflict::Duplicate;
    }
    match database.code().as_deref() {
        // PostgreSQL: lock_not_available (lock_timeout), deadlock_detected.
        Some("55P03") => return Conflict::Busy,
        Some("40P01") => return Conflict::Deadlock,
        _ => {}
    }
    #[cfg(feature = "mysql")]
    if let Some(mysql) = database.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return match mysql.number() {
            1205 => Conflict::Busy,     // ER_LOCK_WAIT_TIMEOUT
            1213 => Conflict::Deadlock, // ER_LOCK_DEADLOCK
            _ => Conflict::Other,
        };
    }
    #[cfg(feature = "sqlite")]
    if database
        .try_downcast_ref::<sqlx::sqlite::SqliteError>()
        .is_some()
    {
        // SQLITE_BUSY and its extended codes: the write lock stayed taken.
        let busy = database
            .code()
            .and_then(|code| code.parse::<i32>().ok())
            .is_some_and(|code| code & 0xff == 5);
        if busy {
            return Conflict::Busy;
        }
    }
    Conflict::Other
}

#[async_trait]
impl<DB: RecordDatabase> IdempotencyStore for OneCommitStore<DB> {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let _checked = match &self.quota {
            Some(quota) => Some(self.within_quota(quota, id).await?),
            None => None,
        };
        let token = new_token();
        if self.reservations == Reservations::Leased {
            return self.records.reserve(id, binding, lease, lifetime).await;
        }
        let terms = Terms {
            binding: binding.clone(),
            lease,
            lifetime,
        };
        if self.dialect == Dialect::Sqlite {
            return self.claim_and_read(id, token, terms).await;
        }
        match self
            .reserve_in_transaction(id, binding, token, lease, lifetime)
            .await?
        {
            Attempt::Held(transaction) => {
                let state = PendingState::Open(transaction);
                self.claims.lock().insert(
                    id.clone(),
                    Pending {
                        token,
                        state,
                        terms,
                    },
                );
                Ok(Reservation::ReservedUncommitted(token))
            }
            // A committed record (finished, in flight under a typed store, or expired):
            // the typed store's rules, which replace an expired one.
            Attempt::Committed => self.records.reserve(id, binding, lease, lifetime).await,
            // Another transaction holds the key, whose record nobody can read yet.
            Attempt::Busy => Ok(Reservation::Busy),
        }
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.records.load(id).await
    }

    /// Waits for the transaction (or, on SQLite, this process's claim) that holds the
    /// key to end, then reads the key as it then stands: the record its owner committed,
    /// or none (it rolled back). An owner still running when the wait ends has no record
    /// to show.
    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let ended = match self.dialect {
            Dialect::Sqlite => self.wait_for_claim(id, timeout).await,
            Dialect::Postgres | Dialect::MySql => self.wait_for_owner(id, timeout).await?,
        };
        if !ended {
            return Ok(Waited::Running(None));
        }
        // A committed record may be in flight under a typed store's lease (another
        // replica's, reserved in a commit of its own): its owner runs, and is waited for
        // as the typed store's owners are.
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        self.records.wait(id, left).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        // The layer never renews an uncommitted reservation (it has no lease); one that
        // is asked to anyway is held, and nothing of it can lapse.
        if self.is_pending(id, token) {
            return Ok(Ownership::Held);
        }
        self.records.renew(id, token, lease).await
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &idempotency_core::StoredResponse,
    ) -> Result<Ownership, StoreError> {
        // The reservation stays (duplicates wait on it) until the record is written.
        let Some((state, terms, _settling)) = self.claims.settle(id, token) else {
            return self.records.finalize(id, token, response).await;
        };
        let mut transaction = match state {
            PendingState::Open(transaction) => transaction,
            // SQLite: the handler wrote no record in a transaction of its own (it took
            // none, or did not finalize in it): the record, alone.
            _ if self.dialect == Dialect::Sqlite => {
                return self.record_alone(id, token, &terms, response).await;
            }
            // The handler took the transaction and committed it without the answer, or
            // rolled it back.
            _ => {
                return self
                    .finalize_after_handler(id, token, response, terms)
                    .await;
            }
        };
        let held = match self.dialect {
            // The key's lock is held; the record is written once, finished.
            Dialect::Postgres => {
                self.write_completed(&mut transaction, id, token, &terms, response)
                    .await
            }
            _ => {
                self.write_answer(&mut transaction, id, token, response)
                    .await
            }
        }
        .map_err(StoreError::backend)?;
        if held == Ownership::Held {
            transaction.commit().await.map_err(StoreError::backend)?;
        }
        Ok(held)
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        let Some((state, _, _settling)) = self.claims.settle(id, token) else {
            return self.records.release(id, token).await;
        };
        match state {
            // Nothing was written: letting the claim go (with `_settling`) releases it.
            PendingState::Claimed | PendingState::Settling => Ok(Ownership::Held),
            // The reservation is this transaction: rolling it back releases it.
            PendingState::Open(transaction) => {
                transaction.rollback().await.map_err(backend)?;
                Ok(Ownership::Held)
            }
            // The handler's transaction ended: the in-flight record it committed without
            // its answer is deleted; if it committed none (it rolled back), nothing of the
            // reservation is left, which is what releasing asks for, unless another
            // request's record holds the key by now.
            PendingState::Taken | PendingState::Finalized => {
                self.until_the_handlers_transaction_ended(id).await?;
                if self.records.release(id, token).await? == Ownership::Held {
                    return Ok(Ownership::Held);
                }
                Ok(match self.records.load(id).await? {
                    None => Ownership::Held,
                    Some(_) => Ownership::Lost,
                })
            }
        }
    }

    /// Commits the reservation as an in-flight record under its token that lasts
    /// `kept_for`, and lets go of everything it held (the transaction, the key's lock, the
    /// claim): the key stays held until that record expires, and frees then.
    async fn hold(
        &self,
        id: &RecordId,
        token: FencingToken,
        kept_for: Duration,
    ) -> Result<Ownership, StoreError> {
        let Some((state, terms, _settling)) = self.claims.settle(id, token) else {
            return self.records.hold(id, token, kept_for).await;
        };
        let mut transaction = match state {
            PendingState::Open(transaction) => transaction,
            // The handler's transaction ended, or never began: the record it committed,
            // or one written now.
            _ => {
                self.until_the_handlers_transaction_ended(id).await?;
                return match self
                    .write_own_record(id, token, &terms.binding, kept_for)
                    .await?
                {
                    OwnRecord::Written => Ok(Ownership::Held),
                    OwnRecord::Exists => self.records.hold(id, token, kept_for).await,
                    OwnRecord::KeyHeldElsewhere => Ok(Ownership::Lost),
                };
            }
        };
        match self.dialect {
            // The transaction holds the key's lock and nothing else: the record is
            // inserted in it, in flight for `kept_for`.
            Dialect::Postgres => {
                let (_, inserted) = DB::insert_in_flight(
                    &mut transaction,
                    &self.sql.insert_in_flight,
                    &NewRecord::new(id, &terms.binding, token, kept_for, kept_for),
                    Some(self.table.record_lock_key(id)),
                )
                .await
                .map_err(backend)?;
                if inserted != 1 {
                    transaction.rollback().await.map_err(backend)?;
                    return Ok(Ownership::Lost);
                }
                transaction.commit().await.map_err(StoreError::backend)?;
                Ok(Ownership::Held)
            }
            // The transaction holds the in-flight record: committed, then held.
            _ => {
                transaction.commit().await.map_err(StoreError::backend)?;
                self.records.hold(id, token, kept_for).await
            }
        }
    }

    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        self.records.take_over(id, lapsed, lease).await
    }
}

#[async_trait]
impl<DB: RecordDatabase> RecordAdmin for OneCommitStore<DB> {
    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        self.records.inspect(id).await
    }

    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        self.records.evict(id, in_flight).await
    }
}

#[async_trait]
impl<DB: RecordDatabase> PurgeExpired for OneCommitStore<DB> {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        self.records.purge_expired(batch_size).await
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
