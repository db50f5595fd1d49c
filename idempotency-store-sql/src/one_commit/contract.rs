//! The store contract of [`OneCommitStore`], and how a reservation is settled once its
//! handler is done: the answer kept, released, or held until it expires.

use std::time::Duration;

use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, Reservation,
    StoreError, Waited, async_trait,
};

use crate::common::{backend, new_token};
use crate::record_database::{Dialect, NewRecord, RecordDatabase, wait_for_key_lock};

use super::claims::{Pending, PendingState, Terms};
use super::reserve::Attempt;
use super::reserve::{Conflict, conflict};
use super::{OneCommitStore, Reservations};

#[async_trait]
impl<DB: RecordDatabase> IdempotencyStore for OneCommitStore<DB> {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        // No read of the key comes first, though it would answer a replay in one
        // statement: it costs every first execution a round trip and a pool acquire, and
        // first executions are the many (DESIGN.md, "The one-commit path").
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
                Ok(Reservation::Reserved(token))
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
        // A leased reservation is a committed record, whose owner the typed store waits
        // for (and, on PostgreSQL, for a one-commit owner's lock on another replica) on
        // its own pool: nothing of the handlers' pool is taken from their writes.
        if self.reservations == Reservations::Leased {
            return self.records.wait(id, timeout).await;
        }
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
        // A reservation held unseen (a claim, or a transaction) has no lease: nothing of
        // it can lapse while it holds. Once the handler's transaction ended without the
        // answer, the record it committed in flight, if any, is what holds the key.
        if self.claims.holds_unseen(id, token) {
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
            PendingState::Taken | PendingState::Ended | PendingState::Finalized => {
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

impl<DB: RecordDatabase> OneCommitStore<DB> {
    /// The handler took the transaction and did not finalize in it, and the layer has an
    /// answer to keep: the record is there if the handler committed, or gone with its
    /// rollback, in which case it is reserved again (by the typed store) and finalized.
    pub(super) async fn finalize_after_handler(
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
    pub(super) async fn until_the_handlers_transaction_ended(
        &self,
        id: &RecordId,
    ) -> Result<(), StoreError> {
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
    pub(super) async fn write_own_record(
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

/// What writing a reservation's own record found.
pub(super) enum OwnRecord {
    /// Written, in flight under the reservation's token.
    Written,
    /// A live record holds the key (the handler committed it, or another request did).
    Exists,
    /// Another owner holds the key's lock (PostgreSQL), or its uncommitted row
    /// (MySQL/MariaDB).
    KeyHeldElsewhere,
}
