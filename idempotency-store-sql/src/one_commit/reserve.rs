//! How [`OneCommitStore`] reserves a key in the handler's transaction and waits for a
//! duplicate's owner, in each dialect.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Binding, FencingToken, RecordId, Reservation, ScopeQuota, StoreError};
use sqlx::{Pool, Transaction};
use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::oneshot;

use crate::common::backend;
use crate::record_database::{Dialect, NewRecord, RecordDatabase, wait_for_key_lock};

use super::claims::{Claims, Pending, PendingState, Terms};
use super::transaction::{WriteTransaction, begin_on};
use super::{MAX_DEADLOCK_RETRIES, MYSQL_RESERVE_LOCK_WAIT_SECS, OneCommitStore};

impl<DB: RecordDatabase> OneCommitStore<DB> {
    /// Refuses a new record in `id`'s scope past `quota`: the scope's committed records
    /// and this process's reservations of it not committed yet. The returned guard keeps
    /// the next check waiting until the reservation it allowed is registered.
    pub(super) async fn within_quota(
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

    /// PostgreSQL, MySQL/MariaDB: opens a transaction and reserves the key in it, without
    /// waiting for a duplicate's owner (PostgreSQL: takes the key's advisory lock, the
    /// record is inserted finished at `finalize_in`) or for at most
    /// [`MYSQL_RESERVE_LOCK_WAIT_SECS`] (MySQL/MariaDB: inserts the in-flight record;
    /// MariaDB in the `BEGIN`'s round trip).
    ///
    /// Runs on a task of its own, and hands the transaction over: a caller that goes away
    /// while a statement runs (its client hung up) would otherwise leave the connection
    /// in the middle of a statement, which sqlx neither ends nor returns to the pool in
    /// time, and on MariaDB inside a transaction holding the key's row.
    pub(super) async fn reserve_in_transaction(
        &self,
        id: &RecordId,
        binding: &Binding,
        token: FencingToken,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Attempt<DB>, StoreError> {
        let room = self.room().await?;
        let record = NewRecord::new(id, binding, token, lease, lifetime);
        let lock_key = self.table.record_lock_key(id);
        let reserving = Reserving {
            lock: self
                .sql
                .begin_locking
                .map(|begin| begin(lock_key))
                .zip(self.sql.look_under_lock.clone()),
            lock_key,
            begin_reserved: self.reserve_begin_statement(&record),
            insert: self.sql.insert_in_flight.clone(),
            id: id.clone(),
            binding: binding.clone(),
            token,
            lease,
            lifetime,
        };
        let pool = self.pool.clone();
        let (handover, attempted) = oneshot::channel();
        tokio::spawn(async move {
            let attempt = reserving.attempt(&pool, room).await;
            if let Err(Ok(Attempt::Held(abandoned))) = handover.send(attempt) {
                let _ = abandoned.rollback().await;
            }
        });
        attempted.await.unwrap_or_else(|_| {
            Err(StoreError::backend(
                "the reservation's task ended without an answer",
            ))
        })
    }

    /// MariaDB (only): the reservation of `record`, sent as its transaction's `BEGIN`
    /// (see `crate::mysql::reserve_begin_statement`). MySQL 8 begins, then inserts.
    #[cfg_attr(not(feature = "mysql"), allow(unused_variables))]
    pub(super) fn reserve_begin_statement(&self, record: &NewRecord<'_>) -> Option<String> {
        #[cfg(feature = "mysql")]
        if self.mariadb {
            return Some(crate::mysql::reserve_begin_statement(
                &self.table,
                record,
                MYSQL_RESERVE_LOCK_WAIT_SECS,
            ));
        }
        None
    }

    /// Waits up to `timeout` for the transaction that holds the key to end: `true` if it
    /// ended (or none held it), `false` if it still runs.
    pub(super) async fn wait_for_owner(
        &self,
        id: &RecordId,
        timeout: Duration,
    ) -> Result<bool, StoreError> {
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
    pub(super) async fn wait_on_owners_row(
        &self,
        id: &RecordId,
        timeout: Duration,
    ) -> Result<bool, StoreError> {
        let statement = self
            .sql
            .owners_row
            .clone()
            .expect("MySQL's statements have the owner's row's locking read");
        let (pool, id) = (self.pool.clone(), id.clone());
        let mariadb = self.mariadb;
        // On a task of its own, as a reservation is: a caller that goes away during the
        // locking read must not leave the connection inside its transaction. InnoDB
        // bounds the read in whole seconds; the caller stops waiting at `timeout` all the
        // same, and the task ends within the second.
        let (handover, waited) = oneshot::channel();
        tokio::spawn(async move {
            let waited = wait_on_owners_row(&pool, &statement, mariadb, &id, timeout).await;
            let _ = handover.send(waited);
        });
        match tokio::time::timeout(timeout, waited).await {
            Err(_) => Ok(false),
            Ok(waited) => waited.unwrap_or_else(|_| {
                Err(StoreError::backend(
                    "the wait's task ended without an answer",
                ))
            }),
        }
    }

    /// Room for one more open write transaction.
    pub(super) async fn room(&self) -> Result<OwnedSemaphorePermit, StoreError> {
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
    pub(super) async fn begin_raw(&self) -> Result<Transaction<'static, DB>, sqlx::Error> {
        begin_on(&self.pool).await
    }
}

/// One reservation in a transaction, with everything it needs owned, so that it runs on
/// a task of its own.
struct Reserving {
    /// PostgreSQL (only): the `BEGIN` that tries the key's lock, and the look at the key
    /// in the transaction it opened.
    lock: Option<(String, Arc<str>)>,
    /// PostgreSQL: the key's lock.
    lock_key: i64,
    /// MariaDB (only): the reservation, sent as the transaction's `BEGIN` (see
    /// `crate::mysql::reserve_begin_statement`).
    begin_reserved: Option<String>,
    /// MySQL 8: the in-flight record's insert, after `BEGIN`.
    insert: Arc<str>,
    id: RecordId,
    binding: Binding,
    token: FencingToken,
    lease: Duration,
    lifetime: Duration,
}

/// How one try at a reservation ended.
enum Tried<DB: sqlx::Database> {
    /// The key is held in this transaction.
    Held(Transaction<'static, DB>),
    /// PostgreSQL: a record holds the key.
    Committed,
    /// PostgreSQL: the transaction of the owner running it holds the key.
    Busy,
    /// The database's error (a duplicate key, a lock wait that timed out, a deadlock,
    /// …), with nothing of the try left open.
    Failed(sqlx::Error),
}

impl Reserving {
    /// Reserves the key in a transaction of `pool`, trying again after a deadlock.
    async fn attempt<DB: RecordDatabase>(
        self,
        pool: &Pool<DB>,
        room: OwnedSemaphorePermit,
    ) -> Result<Attempt<DB>, StoreError> {
        for _ in 0..MAX_DEADLOCK_RETRIES {
            let tried = match (&self.lock, &self.begin_reserved) {
                (Some((begin, look)), _) => self.lock_key(pool, begin, look).await,
                // One round trip: `BEGIN` and the insert. A failure leaves the
                // connection outside any transaction.
                (None, Some(begin)) => match pool.begin_with(begin.clone()).await {
                    Ok(transaction) => Tried::Held(transaction),
                    Err(error) => Tried::Failed(error),
                },
                (None, None) => self.insert_in_flight(pool).await?,
            };
            match tried {
                Tried::Held(transaction) => {
                    return Ok(Attempt::Held(WriteTransaction::new(transaction, room)));
                }
                Tried::Committed => return Ok(Attempt::Committed),
                Tried::Busy => return Ok(Attempt::Busy),
                Tried::Failed(error) => match conflict(&error) {
                    Conflict::Duplicate => return Ok(Attempt::Committed),
                    Conflict::Busy => return Ok(Attempt::Busy),
                    Conflict::Deadlock => continue,
                    Conflict::Other => return Err(backend(error)),
                },
            }
        }
        Ok(Attempt::Busy)
    }

    /// PostgreSQL: a transaction holding the key's advisory lock, unless a record or
    /// another transaction holds the key. Two round trips: the `BEGIN` that tries the
    /// lock, then a look at the key that sees every record committed before the lock was
    /// taken.
    async fn lock_key<DB: RecordDatabase>(
        &self,
        pool: &Pool<DB>,
        begin: &str,
        look: &str,
    ) -> Tried<DB> {
        let mut transaction = match pool.begin_with(begin.to_owned()).await {
            Ok(transaction) => transaction,
            Err(error) => return Tried::Failed(error),
        };
        let tried = match DB::look_under_lock(&mut transaction, look, &self.id, self.lock_key).await
        {
            Ok((false, true)) => return Tried::Held(transaction),
            Ok((true, _)) => Tried::Committed,
            Ok((false, false)) => Tried::Busy,
            Err(error) => Tried::Failed(error),
        };
        // A failed statement may have ended the transaction; a rollback that fails
        // changes nothing here.
        let _ = transaction.rollback().await;
        tried
    }

    /// MySQL 8: a transaction with the key's record inserted in flight, or the insert's
    /// error (its transaction rolled back).
    async fn insert_in_flight<DB: RecordDatabase>(
        &self,
        pool: &Pool<DB>,
    ) -> Result<Tried<DB>, StoreError> {
        let mut transaction = pool.begin().await.map_err(backend)?;
        set_lock_wait::<DB>(&mut transaction, Some(MYSQL_RESERVE_LOCK_WAIT_SECS)).await?;
        let record = NewRecord::new(
            &self.id,
            &self.binding,
            self.token,
            self.lease,
            self.lifetime,
        );
        let inserted = DB::insert_in_flight(&mut transaction, &self.insert, &record, None).await;
        // The handler's statements (and the pool's next user) wait as long as usual.
        set_lock_wait::<DB>(&mut transaction, None).await?;
        match inserted {
            Ok(_) => Ok(Tried::Held(transaction)),
            Err(error) => {
                // A rollback that fails changes nothing here: the connection goes.
                let _ = transaction.rollback().await;
                Ok(Tried::Failed(error))
            }
        }
    }
}

/// MySQL/MariaDB: [`OneCommitStore::wait_on_owners_row`], on `pool`.
async fn wait_on_owners_row<DB: RecordDatabase>(
    pool: &Pool<DB>,
    statement: &str,
    mariadb: bool,
    id: &RecordId,
    timeout: Duration,
) -> Result<bool, StoreError> {
    // Bounded, the wait for a pooled connection included.
    let Ok(acquired) = tokio::time::timeout(timeout, pool.acquire()).await else {
        return Ok(false);
    };
    let mut connection = acquired.map_err(backend)?;
    // InnoDB counts whole seconds.
    let seconds = timeout.as_secs_f64().ceil().max(1.0) as u64;
    // A locking read outside any transaction: it waits for the owner's row, and lets go
    // of what it took as soon as it ends.
    let read = if mariadb {
        let bounded = format!("SET STATEMENT innodb_lock_wait_timeout = {seconds} FOR {statement}");
        DB::rows_of_key(&mut connection, &bounded, id).await
    } else {
        set_lock_wait::<DB>(&mut connection, Some(seconds)).await?;
        let read = DB::rows_of_key(&mut connection, statement, id).await;
        set_lock_wait::<DB>(&mut connection, None).await?;
        read
    };
    match read {
        Ok(_) => Ok(true),
        Err(error) => match conflict(&error) {
            Conflict::Deadlock => Ok(true),
            Conflict::Busy => Ok(false),
            Conflict::Duplicate | Conflict::Other => Err(backend(error)),
        },
    }
}

/// Sets (or, `None`, resets) how long InnoDB statements of this session wait for a row
/// lock.
pub(super) async fn set_lock_wait<DB: RecordDatabase>(
    connection: &mut DB::Connection,
    seconds: Option<u64>,
) -> Result<(), StoreError> {
    let value = seconds.map_or("DEFAULT".to_owned(), |s| s.to_string());
    let statement = format!("SET SESSION innodb_lock_wait_timeout = {value}");
    DB::run(connection, &statement).await.map_err(backend)?;
    Ok(())
}

/// How a statement on a contended key failed.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Conflict {
    /// A committed record holds the key.
    Duplicate,
    /// The wait for another transaction's lock ended first.
    Busy,
    /// A deadlock victim: try again.
    Deadlock,
    /// Anything else.
    Other,
}

pub(super) fn conflict(error: &sqlx::Error) -> Conflict {
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

/// Lets go of a claim when dropped: the claim of a reservation that is not made.
struct Unclaim<'a, T> {
    claims: &'a Claims<T>,
    id: &'a RecordId,
    token: FencingToken,
}

impl<T> Drop for Unclaim<'_, T> {
    fn drop(&mut self) {
        self.claims.forget(self.id, self.token);
    }
}

/// What an attempt to reserve a key in a transaction found.
pub(super) enum Attempt<DB: RecordDatabase> {
    /// Reserved in this open transaction.
    Held(WriteTransaction<DB>),
    /// A committed record holds the key.
    Committed,
    /// Another transaction holds the key (its owner runs), still when the wait ended.
    Busy,
}

impl<DB: RecordDatabase> OneCommitStore<DB> {
    /// SQLite: claims the key in this process, unless a request in it holds it.
    pub(super) fn claim(&self, id: &RecordId, token: FencingToken, terms: Terms) -> bool {
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
    pub(super) async fn wait_for_claim(&self, id: &RecordId, timeout: Duration) -> bool {
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
    pub(super) async fn claim_and_read(
        &self,
        id: &RecordId,
        token: FencingToken,
        terms: Terms,
    ) -> Result<Reservation, StoreError> {
        let claimed = self.claim(id, token, terms);
        // A caller that goes away during the read leaves no claim behind: nobody would
        // settle it, and the key would answer "busy" for as long as the process lives.
        let unclaim = claimed.then(|| Unclaim {
            claims: &self.claims,
            id,
            token,
        });
        let read = self.records.load(id).await;
        if matches!(read, Ok(None)) {
            std::mem::forget(unclaim);
        } else {
            drop(unclaim);
        }
        match read? {
            Some(record) => Ok(Reservation::Exists(record)),
            None if claimed => Ok(Reservation::Reserved(token)),
            None => Ok(Reservation::Busy),
        }
    }
}
