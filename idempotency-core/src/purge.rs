//! The purge helpers: [`purge_all_expired`] and [`spawn_purge_task`] run
//! [`PurgeExpired::purge_expired`] in paced batches and record what they did in the
//! [metrics](crate::metrics). They sit above the storage contract (`crate::store`), which
//! imports nothing of them.

use std::sync::Arc;
use std::time::Duration;

use crate::metrics::{self, StoreCall};
use crate::store::{PurgeExpired, Purged, StoreError};

/// How long [`purge_all_expired`] rests after each full batch, as a multiple of the time
/// that batch took: the purge then keeps the database busy at most a quarter of the time,
/// and foreground statements queued behind a batch (its WAL flush, its CPU, its I/O) get
/// through before the next one starts.
///
/// Chosen by measurement (BENCHMARKS.md, purge of 1,000,000 expired PostgreSQL rows in
/// batches of 100): reservation p99 during the purge was 2.7× the p99 without a purge
/// when the batches ran back to back, 2.1× resting 3× as long as each batch, and no better
/// resting 1× or 9×: once more than 1% of reservations meet a batch at all, the p99 is
/// set by how long a batch lasts, not by how often one runs (see [`PURGE_BATCH_TIME`]).
/// Resting makes the purge take about 4 times as long as back to back.
pub const PURGE_REST_FACTOR: u32 = 3;

/// How long one batch of [`purge_all_expired`] should take at most: the batch size
/// halves while batches take longer (down to 10 rows, or the size asked for if smaller),
/// and doubles back (up to the size asked for) while they take less than half of it. A
/// reservation that queues behind a batch then waits about this long at worst, unless the
/// database is so slow that even 10 rows take longer.
///
/// Chosen by measurement (BENCHMARKS.md, "Issue 15"): with a bound of 1 ms the
/// reservation p99 during a purge of 1,000,000 PostgreSQL rows was a steady 768–782 µs,
/// while the p99 without a purge it is compared with moved between 337 and 422 µs, so the
/// ratio landed on either side of 2× (1.83–2.28× in five quick runs). A batch must stay
/// well under twice the quiet p99 for a reservation that meets one to stay under 2× it;
/// 0.5 ms leaves that margin: on a quiet machine the p99 during the purge was 637–753 µs
/// and the ratio 1.47–1.80× in five quick runs in a row (1.70× in a full run). The price
/// is speed: 1,000,000 rows took 270–302 s, against 41–63 s at 1 ms.
///
/// The floor of 10 rows is for a loaded machine, where one statement with its commit
/// takes longer than the bound whatever its size: halving further then only multiplies the
/// statements and commits the purge needs without making any of them shorter. Without the
/// floor (and with a bound of 1 ms) the batches came down to 1 or 2 rows: 23,046 batches,
/// 205 rows a second, at a load average of 4–6; with it (and 0.5 ms), 750 rows a second
/// at a load average of 3–4. Ten rows cost little more than one: deleting 100 took
/// 0.66 ms of execution there, a few µs a row, against a round trip and a commit of
/// hundreds.
pub const PURGE_BATCH_TIME: Duration = Duration::from_micros(500);

/// The size a batch of [`purge_all_expired`] does not shrink below (see
/// [`PURGE_BATCH_TIME`]).
const PURGE_MIN_BATCH: usize = 10;

/// Runs [`PurgeExpired::purge_expired`] until a batch comes back short, and says how
/// many records it deleted in all (or [`Purged::ByBackend`] for a store that expires
/// records by itself).
///
/// Each batch is its own short statement of at most `batch_size` records, sized to take
/// about [`PURGE_BATCH_TIME`], and after each full batch the purge rests for
/// [`PURGE_REST_FACTOR`] times as long as the batch took, so a large backlog is worked off
/// in the gaps of the foreground traffic instead of competing with it for the database.
/// Batches shrink and rests grow when the database is busy and batches slow down. A rest
/// under a millisecond (the memory store's batches) only yields: tokio's timer would round
/// it up to a whole millisecond and slow such a purge twentyfold.
/// Needs tokio's timer, like [`spawn_purge_task`].
pub async fn purge_all_expired<S: PurgeExpired + ?Sized>(
    store: &S,
    batch_size: usize,
) -> Result<Purged, StoreError> {
    let max_batch = batch_size.max(1);
    let min_batch = PURGE_MIN_BATCH.min(max_batch);
    let mut batch_size = max_batch;
    let mut total = 0;
    loop {
        let started = tokio::time::Instant::now();
        let purged = store.purge_expired(batch_size).await;
        metrics::store_duration(StoreCall::Purge, purged.is_ok(), started.elapsed());
        let deleted = match purged? {
            Purged::Deleted(deleted) => deleted,
            Purged::ByBackend => return Ok(Purged::ByBackend),
        };
        metrics::records_purged(deleted);
        total += deleted;
        if deleted < batch_size as u64 {
            return Ok(Purged::Deleted(total));
        }
        let took = started.elapsed();
        if took > PURGE_BATCH_TIME {
            batch_size = (batch_size / 2).max(min_batch);
        } else if took < PURGE_BATCH_TIME / 2 {
            batch_size = (batch_size * 2).min(max_batch);
        }
        let rest = took * PURGE_REST_FACTOR;
        if rest < Duration::from_millis(1) {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(rest).await;
        }
    }
}

/// Starts a tokio task that purges expired records every `interval`, in batches of
/// `batch_size`, paced as [`purge_all_expired`] paces them. Errors are logged and the task
/// carries on; abort the returned handle to stop it. For a store that expires records by
/// itself the task ends after its first round.
pub fn spawn_purge_task(
    store: Arc<dyn PurgeExpired>,
    interval: Duration,
    batch_size: usize,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            match purge_all_expired(store.as_ref(), batch_size).await {
                Ok(Purged::Deleted(0)) => {}
                Ok(Purged::Deleted(deleted)) => {
                    tracing::debug!(deleted, "purged expired idempotency records")
                }
                Ok(Purged::ByBackend) => {
                    tracing::debug!(
                        "the idempotency store expires records by itself; no purge task needed"
                    );
                    return;
                }
                Err(error) => tracing::warn!(%error, "purging expired idempotency records failed"),
            }
        }
    })
}
