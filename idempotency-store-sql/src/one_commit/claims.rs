//! This process's reservations not committed yet: what each holds (`T`, its open
//! transaction; on SQLite a claim), and the guards that let them go.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency_core::{Binding, FencingToken, RecordId};
use tokio::sync::Notify;

/// A reservation whose record is not committed yet, with the token it was given.
pub(super) struct Pending<T> {
    pub(super) token: FencingToken,
    pub(super) state: PendingState<T>,
    pub(super) terms: Terms,
}

pub(super) enum PendingState<T> {
    /// SQLite: this process's claim on the key; nothing is written yet.
    Claimed,
    /// The record is in this transaction, which the handler has not taken.
    Open(T),
    /// The handler took the transaction; it commits or rolls it back.
    Taken,
    /// PostgreSQL, MySQL/MariaDB: the transaction the handler took ended without the
    /// answer: it committed the record in flight, under its lease, or rolled back and
    /// left nothing. Only the table tells which.
    Ended,
    /// SQLite: the handler wrote the record in its transaction; the claim goes when that
    /// transaction ends.
    Finalized,
    /// The layer is settling it (finalizing or releasing); it goes once that is done,
    /// so that a duplicate waiting on it finds the record written, or none.
    Settling,
}

/// The reservations whose record is not committed yet, by record, and the signal that
/// one settled, which SQLite's duplicates wait for.
pub(super) struct Claims<T> {
    pub(super) pending: Mutex<HashMap<RecordId, Pending<T>>>,
    pub(super) settled: Notify,
}

impl<T> Default for Claims<T> {
    fn default() -> Self {
        Self {
            pending: Mutex::default(),
            settled: Notify::new(),
        }
    }
}

impl<T> Claims<T> {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RecordId, Pending<T>>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes the reservation `token` holds on `id`, and tells the waiters.
    pub(super) fn forget(&self, id: &RecordId, token: FencingToken) -> Option<Pending<T>> {
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
    pub(super) fn settle(
        self: &Arc<Self>,
        id: &RecordId,
        token: FencingToken,
    ) -> Option<(PendingState<T>, Terms, SettlingGuard<T>)> {
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
    pub(super) fn pending_in_scope(&self, id: &RecordId) -> (bool, i64, i64) {
        let pending = self.lock();
        let (mut count, mut bytes) = (0, 0);
        for (other, entry) in pending.iter().filter(|(other, _)| other.scope == id.scope) {
            count += 1;
            bytes += other.reserved_bytes(&entry.terms.binding) as i64;
        }
        (pending.contains_key(id), count, bytes)
    }

    /// Whether this process holds the key for `token` where nobody else can see it: a
    /// claim, or a transaction not ended yet. Once the handler's transaction ended
    /// without the answer, whatever holds the key is in the table.
    pub(super) fn holds_unseen(&self, id: &RecordId, token: FencingToken) -> bool {
        self.lock().get(id).is_some_and(|entry| {
            entry.token == token && !matches!(entry.state, PendingState::Ended)
        })
    }

    /// Marks the reservation as finalized in its handler's transaction.
    pub(super) fn finalized(&self, id: &RecordId, token: FencingToken) {
        if let Some(entry) = self.lock().get_mut(id).filter(|entry| entry.token == token) {
            entry.state = PendingState::Finalized;
        }
    }
}

/// A reservation being settled by the layer: it goes, and its waiters are told, when the
/// settling is done (or abandoned).
pub(super) struct SettlingGuard<T> {
    pub(super) claims: Arc<Claims<T>>,
    pub(super) id: RecordId,
    pub(super) token: FencingToken,
}

impl<T> Drop for SettlingGuard<T> {
    fn drop(&mut self) {
        self.claims.forget(&self.id, self.token);
    }
}

/// A reservation held by the handler's transaction (SQLite: a claim in this process;
/// PostgreSQL: the key's advisory lock too). When the transaction ends, a reservation
/// whose record was written in it goes (after the commit, so that a duplicate that was
/// waiting reads the record); one whose record was not stays for the layer to settle.
pub(super) struct ClaimGuard<T> {
    pub(super) claims: Arc<Claims<T>>,
    pub(super) id: RecordId,
    pub(super) token: FencingToken,
    /// PostgreSQL: how to keep the key held past a `COMMIT` without the answer.
    pub(super) in_flight: Option<InFlightUnlessFinalized>,
    /// PostgreSQL, MySQL/MariaDB: the transaction is what holds the key, so that once it
    /// ended without the answer the reservation is whatever it left in the table.
    /// SQLite's claim holds the key until the layer settles it.
    pub(super) held_by_transaction: bool,
}

/// PostgreSQL: the in-flight record a reservation's transaction inserts before a `COMMIT`
/// without its answer (the advisory lock goes with the `COMMIT`; the record keeps the key
/// held until the layer writes the answer).
pub(super) struct InFlightUnlessFinalized {
    pub(super) statement: Arc<str>,
    pub(super) lock_key: i64,
}

impl<T> ClaimGuard<T> {
    /// The terms of the reservation if its record is still to be written in the
    /// transaction and must be inserted in flight before it commits.
    pub(super) fn unrecorded(&self) -> Option<(&InFlightUnlessFinalized, Terms)> {
        let in_flight = self.in_flight.as_ref()?;
        let claims = self.claims.lock();
        let entry = claims.get(&self.id).filter(|entry| {
            entry.token == self.token && matches!(entry.state, PendingState::Taken)
        })?;
        Some((in_flight, entry.terms.clone()))
    }
}

impl<T> Drop for ClaimGuard<T> {
    fn drop(&mut self) {
        let mut claims = self.claims.lock();
        let Some(entry) = claims
            .get_mut(&self.id)
            .filter(|entry| entry.token == self.token)
        else {
            return;
        };
        match entry.state {
            PendingState::Finalized => {
                drop(claims);
                self.claims.forget(&self.id, self.token);
            }
            PendingState::Taken if self.held_by_transaction => entry.state = PendingState::Ended,
            _ => {}
        }
    }
}

/// What the reservation asked for, to reserve again with a typed store if the handler
/// rolled its transaction back and the layer still has an answer to keep.
#[derive(Clone)]
pub(super) struct Terms {
    pub(super) binding: Binding,
    pub(super) lease: Duration,
    pub(super) lifetime: Duration,
}
