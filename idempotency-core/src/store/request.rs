//! The request path: [`IdempotencyStore`], the trait the layer calls, and the waiting
//! helpers a store may build its `wait` on.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::record::{
    Binding, FencingToken, IdempotencyRecord, Ownership, RecordId, Reservation, StoreError,
    StoredResponse, Waited,
};

/// The request path: what the layer calls on a store for every keyed request, and what a
/// backend must do so that the layer can guarantee "at most once per key".
///
/// This is the store trait the layer holds (`Arc<dyn IdempotencyStore>`). What operators
/// call ([`RecordAdmin`]: inspect, evict) and what maintenance calls ([`PurgeExpired`]:
/// delete expired records) are traits of their own, each extending this one; a store
/// implements all three, and [`FullStore`] names a store that does.
///
/// Each method is atomic on its own: exactly one of many concurrent `reserve` calls for
/// one [`RecordId`] gets the key, and the fenced methods change a record only while the
/// given token owns it. A record moves through a small life:
///
/// ```text
///   (absent) --reserve--> in flight (token T, lease) --finalize(T)--> completed --(lifetime)--> expired
///                          |   ^  |                                                             |
///                          |   |  +--release(T)--> (absent)                     purge_expired --+
///                          |   +--renew(T)--+
///                          +--lease lapses--> take_over(T) --> in flight (token T')
/// ```
///
/// # Who calls what, and what each answer obliges the caller to do
///
/// The layer calls [`reserve`](Self::reserve) first, and acts on its [`Reservation`]:
///
/// | `reserve` answers | the store knows | the layer then |
/// |---|---|---|
/// | [`Reserved(T)`](Reservation::Reserved) | the caller owns the key | runs the request, [`renew`](Self::renew)s the reservation meanwhile, then [`finalize`](Self::finalize)s, [`release`](Self::release)s or [`hold`](Self::hold)s (outcome unknown) with `T`; if none of those took, releases it |
/// | [`Exists(record)`](Reservation::Exists) | a live record holds the key | checks the record's binding (another request's record: refused, whatever its state), then replays a completed record, takes over a lapsed lease ([`take_over`](Self::take_over)), or waits for a live one |
/// | [`Busy`](Reservation::Busy) | another owner holds the key, whose record it cannot show | waits, then reserves again |
///
/// A wait ([`wait`](Self::wait)) answers a [`Waited`]: [`Settled(record)`](Waited::Settled)
/// is checked exactly like a record `reserve` returned (binding first: the key may have
/// been released and reserved by another request meanwhile), [`Gone`](Waited::Gone)
/// sends the caller back to `reserve`, and [`Running`](Waited::Running) means the owner
/// outlasted the wait (the caller answers "in flight", or "key reused" if the record it
/// can see is bound to another request). The fenced methods answer [`Ownership`]:
/// [`Lost`](Ownership::Lost) means nothing changed, and the caller does not own the key
/// any more.
///
/// A store answers what it knows and nothing more: it never makes up a record, a token
/// or a binding to fit an answer. A store that cannot show a record says
/// [`Busy`](Reservation::Busy) or [`Running(None)`](Waited::Running).
///
/// # Two kinds of reservation, one contract
///
/// A reservation is either a **record under a lease**, committed where every duplicate
/// sees it (and may take it over once the lease lapses), or **held unseen**, by a
/// transaction of the store's own that commits the record with the request's write (a
/// lock, an uncommitted row): duplicates get [`Busy`](Reservation::Busy) until it ends,
/// and nothing of it can lapse. Which kind is the store's business: the layer makes the
/// same calls for both, and each answer is backed by what the store holds. What an
/// unseen reservation holds (a transaction, a lock, a pooled connection) is let go by
/// `finalize`, `release` and `hold` whether they succeed or fail, and by `release`
/// called after them: nothing outlives its request.
///
/// # The rules every store keeps
///
/// The [conformance suite](crate::conformance) checks each of them.
///
/// - **One clock.** "Now" is the store's own clock (the database's, for a store shared by
///   several processes), which is why the trait passes durations, never instants: the
///   store adds them to its clock, so clock skew between nodes cannot cause a double
///   execution.
/// - **Deadlines.** A lease or a lifetime that ends at `t` has lapsed (or expired) at
///   `t`: `now >= deadline` is lapsed.
/// - **Expiry.** A record expires `lifetime` after it was first reserved, or at the end
///   of the last lease it was granted if that is later. An expired record counts as
///   absent everywhere (load, reserve, the fenced operations), even before
///   [`purge_expired`](super::PurgeExpired::purge_expired) removes it. So **a record in
///   flight under a live lease never expires**, however old: reserve, renew and take_over
///   each extend the expiry to at least the end of the lease they grant, and a slow owner
///   that keeps renewing can never be run a second time beside itself. (The layer keeps
///   its lease no longer than the lifetime, so a quick request's record lives exactly
///   its lifetime.)
/// - **Identity.** A record is found by its whole [`RecordId`]: scope and key are
///   separate values, and no two different pairs may share a record, whatever bytes they
///   hold (scope `a:b` with key `c` is not scope `a` with key `b:c`).
/// - **Fencing.** Every reservation and every takeover issues a new [`FencingToken`],
///   never one the key had before. Renew, finalize and release take effect only while
///   the record exists, has not expired, is in flight and holds the given token; so an
///   owner whose lease lapsed may still renew, finalize or release until someone takes
///   over, and never after.
/// - **Takeover** keeps the record's binding, creation time and expiry (extended to the
///   end of the new lease if it would end sooner) and replaces only the token and lease.
/// - **Honest answers.** Every record a store returns is one it holds, with the binding
///   and token it holds; a wait's answer reflects the key as it then stands, even when
///   it now belongs to another request.
/// - **Round trips.** A finalized [`StoredResponse`] comes back exactly as stored: any
///   status, no headers or many, header values that are not UTF-8, an empty body or a
///   body of several megabytes, no trailers or several.
/// - **Inspection and eviction**, for operators: see [`RecordAdmin`], whose rules the
///   suite checks too.
///
/// # Writing a store
///
/// A store depends on this crate alone: it re-exports [`async_trait`](crate::async_trait)
/// and [`Bytes`](crate::Bytes). Implement [`IdempotencyStore`] (and, for operators and
/// maintenance, [`RecordAdmin`] and [`PurgeExpired`]: the store is then a
/// [`FullStore`]) and run the conformance [`Suite`](crate::conformance::Suite) against
/// it (feature `conformance`), which runs every check that applies to what the store
/// implements and reports the others skipped, with the reason. The `custom_store`
/// example in this crate is a skeleton that does all of it, and the repository's
/// `docs/writing-a-store.md` walks through it: the traits, the suite, concurrency and
/// time in tests, the simulation.
///
/// [`RecordAdmin`]: super::RecordAdmin
/// [`PurgeExpired`]: super::PurgeExpired
/// [`FullStore`]: super::FullStore
#[async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Gives the caller the key if no live record holds it (an expired one is replaced),
    /// or says what holds it: see [`Reservation`].
    ///
    /// A leased reservation lapses `lease` after now and its record expires `lifetime`
    /// after now (or when the lease lapses, if that is later), both by the store's
    /// clock. The new token must differ from every token the key had before.
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError>;

    /// Reads the live record, if any.
    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError>;

    /// Waits until the key's owner is done — its record completed, was released or
    /// expired, or its lease lapsed — or until `timeout` passes, and says how the key
    /// then stands: see [`Waited`].
    ///
    /// The default is [`wait_by_polling`]: at most [`MAX_POLLS_PER_SECOND`] loads per
    /// second per waiter. Stores that can notify waiters should override it, and so must
    /// a store whose owners can hold a key without a record it can [`load`](Self::load)
    /// (one that answers [`Busy`](Reservation::Busy)).
    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        wait_by_polling(self, id, timeout).await
    }

    /// Extends the lease of the record `token` owns to `lease` from now, and its expiry to
    /// the end of that lease if it would end sooner. Called every third of the lease
    /// while the owner's request runs. A reservation held unseen (by a transaction of the
    /// store's) has no lease to extend: `Held` while that transaction still holds the key
    /// for `token`, `Lost` once it does not.
    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError>;

    /// Keeps the key `token` owns reserved for `kept_for` from now (the rest of the
    /// record's life), for an owner that can neither finalize nor release it: its
    /// change may or may not have taken effect
    /// ([`OutcomeUnknown`](crate::OutcomeUnknown)). Afterwards the record is in flight
    /// under a lease that lasts `kept_for`, and its expiry is at least that far away, so
    /// that no retry runs the change again before the record expires, and every retry
    /// after it does.
    ///
    /// It ends the reservation, whatever its kind: a store whose reservation is held
    /// unseen (by a transaction of its own) commits an in-flight record here, under the
    /// reservation's token, and holds nothing (no transaction, lock or connection)
    /// afterwards. `Held` only if such a record now holds the key under `token`.
    ///
    /// The default [renews](Self::renew) the lease for `kept_for`, which is exactly this
    /// for a record under a lease; a store whose reservations are held unseen must
    /// implement it.
    async fn hold(
        &self,
        id: &RecordId,
        token: FencingToken,
        kept_for: Duration,
    ) -> Result<Ownership, StoreError> {
        self.renew(id, token, kept_for).await
    }

    /// Completes the record `token` owns with `response`.
    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError>;

    /// Deletes the in-flight record `token` owns (or, for a reservation held unseen,
    /// ends what holds it), so that a retry runs again.
    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError>;

    /// Takes over an in-flight record whose lease has lapsed while `lapsed` still owns it:
    /// issues a new token (one the key never had) and a new lease of `lease` from now,
    /// extending the expiry to the end of that lease if it would end sooner; the binding,
    /// creation time and expiry are otherwise kept. Returns `None` when the lease is live,
    /// the token changed, or the record is gone, expired or completed.
    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError>;

    /// [`reserve`](Self::reserve), answered at once by a store that never has to wait to
    /// answer it (one that keeps its records in memory), or `None` (the default): the
    /// layer then awaits [`reserve`](Self::reserve).
    ///
    /// It is an optimization, not a second operation: called through
    /// `Arc<dyn IdempotencyStore>`, every `async` method costs a boxed future (an
    /// allocation), which is a large share of what an in-memory reservation costs. A
    /// store that answers here must answer exactly as `reserve` would, with the same
    /// effects; the layer calls one or the other for a given reservation, never both.
    fn reserve_now(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Option<Result<Reservation, StoreError>> {
        let _ = (id, binding, lease, lifetime);
        None
    }

    /// [`finalize`](Self::finalize), answered at once, or `None` (the default): as
    /// [`reserve_now`](Self::reserve_now) is to [`reserve`](Self::reserve).
    fn finalize_now(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Option<Result<Ownership, StoreError>> {
        let _ = (id, token, response);
        None
    }
}

/// The most loads per second [`wait_by_polling`] sends for one waiter, once its backoff
/// has grown (it starts at 5 ms and doubles).
pub const MAX_POLLS_PER_SECOND: u32 = 5;

/// [`IdempotencyStore::wait`] by polling [`load`](IdempotencyStore::load) with a backoff
/// that starts at 5 ms and doubles up to 200 ms: a quick owner is noticed at once, and a
/// waiter costs at most [`MAX_POLLS_PER_SECOND`] loads per second after that.
pub async fn wait_by_polling<S: IdempotencyStore + ?Sized>(
    store: &S,
    id: &RecordId,
    timeout: Duration,
) -> Result<Waited, StoreError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pause = Duration::from_millis(5);
    loop {
        let record = store.load(id).await?;
        let now = tokio::time::Instant::now();
        if let Some(waited) = Waited::after_load(record, now >= deadline) {
            return Ok(waited);
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(Duration::from_secs(1) / MAX_POLLS_PER_SECOND);
    }
}

/// Forwards every method, provided ones included: `#[deny(clippy::missing_trait_methods)]`
/// makes a method added to the trait and not forwarded here an error, rather than a
/// silent fall back to its default.
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl<T: IdempotencyStore + ?Sized> IdempotencyStore for Arc<T> {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        (**self).reserve(id, binding, lease, lifetime).await
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        (**self).load(id).await
    }

    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        (**self).wait(id, timeout).await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        (**self).renew(id, token, lease).await
    }

    async fn hold(
        &self,
        id: &RecordId,
        token: FencingToken,
        kept_for: Duration,
    ) -> Result<Ownership, StoreError> {
        (**self).hold(id, token, kept_for).await
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        (**self).finalize(id, token, response).await
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        (**self).release(id, token).await
    }

    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        (**self).take_over(id, lapsed, lease).await
    }

    fn reserve_now(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Option<Result<Reservation, StoreError>> {
        (**self).reserve_now(id, binding, lease, lifetime)
    }

    fn finalize_now(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Option<Result<Ownership, StoreError>> {
        (**self).finalize_now(id, token, response)
    }
}
