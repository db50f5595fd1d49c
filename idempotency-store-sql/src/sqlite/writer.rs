//! The SQLite store's writer: one task per store runs every write, and commits the writes
//! that queued while it was busy in one transaction (group commit).
//!
//! SQLite lets one connection write at a time, and with `synchronous = FULL` (its
//! default, kept here) every commit waits for the disk to flush the WAL. Each request
//! that commits on its own therefore pays a flush and queues behind everybody else's:
//! under a few concurrent writers throughput stays at what one connection gets, and the
//! tail is every flush ahead in the queue. Committing whatever is waiting together
//! pays one flush for the whole group, and no caller is answered before the commit that
//! holds its write: a write that was answered survives a crash, as before.
//!
//! A write that finds nobody writing runs at once on the caller's task, as its own
//! statement: at low concurrency nothing changes. Only writes that find the turn taken
//! queue for the task, which commits them together once the turn is free.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_core::{Binding, FencingToken, RecordId, Reservation, ScopeQuota, StoreError};
use sqlx::sqlite::{SqliteConnection, SqlitePool};
use sqlx::{Connection, FromRow, Row};
use tokio::sync::{Mutex as AsyncMutex, mpsc, oneshot};

use super::{SqliteQuery, Statements};
use crate::common::{
    EncodedAnswer, MAX_ATTEMPTS, RawRecord, ScopeUsage, backend, millis, new_token,
    reservation_query, too_many_races,
};

/// The most writes committed in one transaction. Every write in a batch waits for the
/// whole batch, so a bound keeps the wait of the first one short; 64 is more than the
/// connections a service usually keeps open at once.
const MAX_BATCH: usize = 64;

/// One write, with everything it needs to run on the writer's connection.
pub(super) enum Write {
    /// Reserve a key that has no live record (the caller looked first).
    Reserve {
        id: RecordId,
        binding: Binding,
        lease: Duration,
        lifetime: Duration,
        quota: Option<ScopeQuota>,
    },
    /// Extend the lease of the record `token` holds.
    Renew {
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    },
    /// Store the answer in the record `token` holds.
    Finalize {
        id: RecordId,
        token: FencingToken,
        answer: EncodedAnswer,
    },
    /// Delete the in-flight record `token` holds.
    Release { id: RecordId, token: FencingToken },
    /// Hand the record `lapsed` held, whose lease lapsed, to `token`.
    TakeOver {
        id: RecordId,
        lapsed: FencingToken,
        token: FencingToken,
        lease: Duration,
    },
    /// Delete the live record `token` holds, if it is (or is not) in flight.
    Evict {
        id: RecordId,
        token: FencingToken,
        in_flight: bool,
    },
    /// Delete up to `limit` expired records.
    Purge { limit: i64 },
}

/// What a write did: a reservation for [`Write::Reserve`], the rows it changed for
/// every other write.
pub(super) enum Written {
    Reservation(Reservation),
    Rows(u64),
}

impl Written {
    /// The answer to a [`Write::Reserve`].
    pub(super) fn reservation(self) -> Reservation {
        match self {
            Written::Reservation(reservation) => reservation,
            Written::Rows(_) => unreachable!("a reserve is answered with a reservation"),
        }
    }

    /// The answer to any other write.
    pub(super) fn rows(self) -> u64 {
        match self {
            Written::Rows(rows) => rows,
            Written::Reservation(_) => {
                unreachable!("only a reserve is answered with a reservation")
            }
        }
    }
}

/// The finalize statement with its parameters: the record id, the token, and the answer
/// (its parameters 4 to 7).
pub(super) fn finalize_query<'q>(
    sql: &'q Statements,
    id: &'q RecordId,
    token: FencingToken,
    answer: &'q EncodedAnswer,
) -> SqliteQuery<'q> {
    owned_query(&sql.finalize, id, token)
        .bind(answer.status)
        .bind(&answer.headers[..])
        .bind(&answer.body[..])
        .bind(answer.trailers.as_deref())
}

/// The reserve statement with its parameters.
pub(super) fn reserve_query<'q>(
    sql: &'q Statements,
    id: &'q RecordId,
    binding: &'q Binding,
    token: FencingToken,
    lease: Duration,
    lifetime: Duration,
) -> SqliteQuery<'q> {
    reservation_query(&sql.reserve, id, binding, token, lease, lifetime)
}

/// A statement whose first three parameters are the record id and a token.
pub(super) fn owned_query<'q>(
    sql: &'q str,
    id: &'q RecordId,
    token: FencingToken,
) -> SqliteQuery<'q> {
    sqlx::query(sql).bind(&id.scope).bind(&id.key).bind(token.0)
}

struct Job {
    write: Write,
    sql: Arc<Statements>,
    reply: oneshot::Sender<Result<Written, StoreError>>,
}

/// The handle to a store's writer task, shared by the store's clones. The task starts
/// with the first write that has to queue, on the runtime of that write, and ends when
/// the last clone of the store is dropped; if its runtime shut down, the next queued
/// write starts another.
#[derive(Debug)]
pub(super) struct Writer {
    pool: SqlitePool,
    /// The turn to write: held by a write running on its caller's task, or by the task
    /// while it commits a batch. Fair: once the task waits for it, callers queue.
    turn: Arc<AsyncMutex<()>>,
    jobs: Mutex<Option<mpsc::UnboundedSender<Job>>>,
}

impl Writer {
    pub(super) fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            turn: Arc::new(AsyncMutex::new(())),
            jobs: Mutex::new(None),
        }
    }

    /// Runs `write` and answers once it is committed.
    pub(super) async fn write(
        &self,
        sql: &Arc<Statements>,
        write: Write,
    ) -> Result<Written, StoreError> {
        // A quota is read and claimed in one transaction, which the task runs.
        let turn = if write.needs_transaction() {
            None
        } else {
            self.turn.try_lock().ok()
        };
        if let Some(_turn) = turn {
            let mut connection = self.pool.acquire().await.map_err(backend)?;
            return write.run(sql, &mut connection).await;
        }
        let (reply, answer) = oneshot::channel();
        self.send(Job {
            write,
            sql: Arc::clone(sql),
            reply,
        });
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::backend(
                "the SQLite store's writer stopped before answering: its runtime is shutting down",
            ))
        })
    }

    fn send(&self, job: Job) {
        let mut jobs = self
            .jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let job = match jobs.as_ref() {
            Some(sender) => match sender.send(job) {
                Ok(()) => return,
                // The task is gone with its runtime.
                Err(mpsc::error::SendError(job)) => job,
            },
            None => job,
        };
        let (sender, receiver) = mpsc::unbounded_channel();
        tokio::spawn(run(self.pool.clone(), Arc::clone(&self.turn), receiver));
        // The receiver was just created and is held by the task.
        let _ = sender.send(job);
        *jobs = Some(sender);
    }
}

/// The writer task: takes what is waiting, up to [`MAX_BATCH`], commits it, answers,
/// and goes again.
async fn run(pool: SqlitePool, turn: Arc<AsyncMutex<()>>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while jobs.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let turn = turn.lock().await;
        // What queued while the turn was taken goes in this batch too.
        while batch.len() < MAX_BATCH {
            let Ok(job) = jobs.try_recv() else { break };
            batch.push(job);
        }
        // A reservation nobody waits for any more (the request was dropped) would only
        // hold its key until the lease lapsed. Every other write is made: an answer
        // worth storing is still worth storing.
        batch.retain(|job| !(job.write.is_reserve() && job.reply.is_closed()));
        let results = match commit(&pool, &batch).await {
            Ok(results) => results,
            Err(Failed::Write(error)) if batch.len() == 1 => vec![Err(error)],
            // One write's trouble must not fail the others: each runs again alone, and
            // gets its own answer.
            Err(Failed::Write(_)) => {
                let mut results = Vec::with_capacity(batch.len());
                for job in &batch {
                    let alone = commit(&pool, std::slice::from_ref(job)).await;
                    results.push(match alone {
                        Ok(mut one) => one.remove(0),
                        Err(Failed::Write(error)) => Err(error),
                        Err(Failed::Start(error)) => Err(backend(error)),
                    });
                }
                results
            }
            // No connection, or no write lock within the busy timeout: nothing ran, and
            // trying each write alone would make the last one wait that long N times.
            Err(Failed::Start(error)) => {
                let error = Arc::new(error);
                let shared = || Err(StoreError::backend(SharedError(Arc::clone(&error))));
                batch.iter().map(|_| shared()).collect()
            }
        };
        drop(turn);
        for (job, result) in batch.drain(..).zip(results) {
            let _ = job.reply.send(result);
        }
    }
}

/// Why a batch committed nothing.
enum Failed {
    /// It could not start: no connection, or no write lock.
    Start(sqlx::Error),
    /// A write, or the commit, failed; the transaction was rolled back.
    Write(StoreError),
}

/// One driver error, the answer of every write of a batch that could not start.
#[derive(Debug)]
struct SharedError(Arc<sqlx::Error>);

impl std::fmt::Display for SharedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SharedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Runs `batch` and commits it: in one `BEGIN IMMEDIATE` transaction, or a lone write as
/// its own statement. `Err` when nothing of it was committed; otherwise each write's own
/// answer, where a quota's refusal is an answer.
async fn commit(
    pool: &SqlitePool,
    batch: &[Job],
) -> Result<Vec<Result<Written, StoreError>>, Failed> {
    let needs_transaction = match batch {
        [] => return Ok(Vec::new()),
        [one] => one.write.needs_transaction(),
        _ => true,
    };
    let mut connection = pool.acquire().await.map_err(Failed::Start)?;
    if !needs_transaction {
        let one = &batch[0];
        return match one.write.run(&one.sql, &mut connection).await {
            Err(error @ StoreError::Backend(_)) => Err(Failed::Write(error)),
            answer => Ok(vec![answer]),
        };
    }
    let mut transaction = connection
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(Failed::Start)?;
    let mut results = Vec::with_capacity(batch.len());
    for job in batch {
        match job.write.run(&job.sql, &mut transaction).await {
            Err(error @ StoreError::QuotaExceeded { .. }) => results.push(Err(error)),
            // Dropping the transaction rolls it back.
            Err(error) => return Err(Failed::Write(error)),
            Ok(written) => results.push(Ok(written)),
        }
    }
    transaction
        .commit()
        .await
        .map_err(|error| Failed::Write(backend(error)))?;
    Ok(results)
}
impl Write {
    fn is_reserve(&self) -> bool {
        matches!(self, Write::Reserve { .. })
    }

    /// A quota is read and claimed in one transaction.
    fn needs_transaction(&self) -> bool {
        matches!(self, Write::Reserve { quota: Some(_), .. })
    }

    async fn run(
        &self,
        sql: &Statements,
        connection: &mut SqliteConnection,
    ) -> Result<Written, StoreError> {
        let query = match self {
            Write::Reserve {
                id,
                binding,
                lease,
                lifetime,
                quota,
            } => {
                if let Some(quota) = quota {
                    let usage = scope_usage(sql, connection, id).await?;
                    if let Some(refusal) = usage.refusal(quota) {
                        return Err(refusal);
                    }
                }
                return reserve(sql, connection, id, binding, *lease, *lifetime)
                    .await
                    .map(Written::Reservation);
            }
            Write::Renew { id, token, lease } => {
                owned_query(&sql.renew, id, *token).bind(millis(*lease))
            }
            Write::Finalize { id, token, answer } => finalize_query(sql, id, *token, answer),
            Write::Release { id, token } => owned_query(&sql.release, id, *token),
            Write::TakeOver {
                id,
                lapsed,
                token,
                lease,
            } => owned_query(&sql.take_over, id, *lapsed)
                .bind(token.0)
                .bind(millis(*lease)),
            Write::Evict {
                id,
                token,
                in_flight,
            } => owned_query(&sql.evict, id, *token).bind(*in_flight),
            Write::Purge { limit } => sqlx::query(&sql.purge).bind(*limit),
        };
        let done = query.execute(connection).await.map_err(backend)?;
        Ok(Written::Rows(done.rows_affected()))
    }
}

/// What the scope of `id` holds, read in the reserving transaction.
async fn scope_usage(
    sql: &Statements,
    connection: &mut SqliteConnection,
    id: &RecordId,
) -> Result<ScopeUsage, StoreError> {
    let usage = sqlx::query(&sql.scope_usage)
        .bind(&id.scope)
        .bind(&id.key)
        .fetch_one(&mut *connection)
        .await
        .map_err(backend)?;
    Ok(ScopeUsage {
        key_live: usage.try_get("key_live").map_err(backend)?,
        records: usage.try_get("records").map_err(backend)?,
        bytes: usage.try_get("bytes").map_err(backend)?,
        next_expiry_in_ms: usage.try_get("next_expiry_in_ms").map_err(backend)?,
    })
}

/// Inserts the record, or reports the live one that holds the key, or replaces an
/// expired one.
///
/// The upsert returns the row as it stands after it ran: ours if it inserted (tokens are
/// 64 random bits, so a live row holding the very token we just drew is a 1-in-2^64
/// chance), else the existing row, untouched. A live one is the answer; an expired one is
/// replaced by a second, conditional statement, unless purge removed it first, and then
/// we look again.
async fn reserve(
    sql: &Statements,
    connection: &mut SqliteConnection,
    id: &RecordId,
    binding: &Binding,
    lease: Duration,
    lifetime: Duration,
) -> Result<Reservation, StoreError> {
    for _ in 0..MAX_ATTEMPTS {
        let token = new_token();
        let row = reserve_query(sql, id, binding, token, lease, lifetime)
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
        let replaced = reservation_query(&sql.replace_expired, id, binding, token, lease, lifetime)
            .execute(&mut *connection)
            .await
            .map_err(backend)?;
        if replaced.rows_affected() == 1 {
            return Ok(Reservation::Reserved(token));
        }
    }
    Err(too_many_races("reserve"))
}
