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
/// and foreground statements queued behind a batch get through before the next one
/// starts. Resting makes a large purge take about four times as long; resting longer did
/// not lower the reservations' p99 further (the workspace's BENCHMARKS.md, "Purge under
/// load").
pub const PURGE_REST_FACTOR: u32 = 3;

/// How long one batch of [`purge_all_expired`] should take at most: the batch size
/// halves while batches take longer (down to 10 rows, or the size asked for if smaller),
/// and doubles back (up to the size asked for) while they take less than half of it. A
/// reservation that queues behind a batch then waits about this long at worst, which
/// keeps the reservations' p99 during a purge under twice the p99 without one; the floor
/// of 10 rows keeps a loaded database, where no statement is that short, from purging a
/// row or two per statement. The measurements are in the workspace's BENCHMARKS.md
/// ("Purge under load").
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
