//! A conformance suite for store implementations: the request path
//! ([`IdempotencyStore`]), and, for stores that have them, the operators'
//! [`RecordAdmin`] and maintenance's [`PurgeExpired`].
//!
//! Every store in this workspace runs it, and so can yours: enable the `conformance`
//! feature in your dev-dependencies and run a [`Suite`] from a test with a fresh store
//! (multi-threaded runtime recommended, since the races are real). The suite runs the
//! checks that apply to what the store has: give it the capabilities your store
//! implements, and it finds out by itself whether its reservations are records under a
//! lease, which a duplicate sees, or are held unseen until the owner's transaction
//! commits (a duplicate is answered [`Reservation::Busy`]), and skips, by name and with
//! the reason, the checks that do not apply:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use idempotency_core::{FullStore, IdempotencyStore};
//! use idempotency_core::conformance::Suite;
//! # async fn example(request_path_only: Arc<dyn IdempotencyStore>, full: Arc<dyn FullStore>, second_handle: Arc<dyn FullStore>) {
//! // A store that implements the request path alone:
//! Suite::new(request_path_only).run().await;
//! // A store that also implements RecordAdmin and PurgeExpired:
//! Suite::full(full.clone()).run().await;
//! // A store shared by several processes also runs the multi-node checks, with a second
//! // handle on the same backend (its own pool or connection), as two replicas hold it:
//! Suite::full(full).with_second_node(second_handle).run().await;
//! # }
//! ```
//!
//! The [`Suite`] is the one way to run the contract: a check added, split or renamed in
//! a new release reaches every store that runs it, with no edit of the store's tests, and
//! its [`Report`] says what ran and what was skipped and why. The checks inside it are
//! public functions only for this workspace's own tests, and hidden from these docs:
//! don't list them in your tests (a check renamed or split would silently fall out of
//! them); run the suite, and [`Suite::only`] to debug one check.
//!
//! Beside the suite: [`through_layer`] checks run an
//! [`IdempotencyLayer`](crate::IdempotencyLayer) over the store, for what the store alone
//! cannot show (what a waiting retry is answered); [`model`] compares random sequences
//! of operations from several owners with a reference model. Checks panic with a message
//! that says what the store did wrong. They use random keys and scopes, so they can run
//! against a shared database, in parallel, and repeatedly. Timing checks use leases and
//! lifetimes of a few hundred milliseconds and tolerate a slow machine.
//!
//! The rules they check are written on the [request path's trait](crate::IdempotencyStore#the-rules-every-store-keeps)
//! and on [`RecordAdmin`](crate::RecordAdmin#the-rules).

mod expiry;
mod leftovers;
pub mod model;
mod multi_node;
mod operator;
mod ownership;
mod reservation;
mod round_trips;
mod suite;
pub mod through_layer;
mod waiting;

#[doc(hidden)]
pub use expiry::{
    a_held_key_stays_reserved_until_it_expires, expired_record_counts_as_absent,
    expired_reservation_fences_its_owner,
    in_flight_record_outlives_its_lifetime_under_a_live_lease, purge_removes_expired_in_batches,
    renewals_keep_a_record_alive_past_its_lifetime,
};
pub use leftovers::Leftovers;
#[doc(hidden)]
pub use leftovers::{
    an_unknown_outcome_frees_its_key_once_it_expires, nothing_outlives_its_request,
};
#[doc(hidden)]
pub use multi_node::{concurrent_purges, takeover_across_nodes, two_nodes_race_one_winner};
#[doc(hidden)]
pub use operator::{
    evict_deletes_a_completed_record_and_the_key_runs_again, evict_never_acts_on_a_stale_verdict,
    evict_of_an_absent_or_expired_record_finds_nothing,
    evict_refuses_an_in_flight_record_unless_forced, evict_wakes_waiters,
    inspect_shows_state_and_times_without_the_body,
};
#[doc(hidden)]
pub use ownership::{
    completed_record_is_not_taken_over, finalize_is_fenced, finalize_then_replay,
    lapsed_lease_is_taken_over_once, lapsed_owner_may_finish_until_taken_over,
    live_lease_is_not_taken_over, release_frees_the_key, release_is_fenced,
    renew_extends_the_lease, repeated_renewals_are_held, takeover_keeps_the_binding,
    tokens_are_never_reused,
};
#[doc(hidden)]
pub use reservation::{
    a_held_key_shows_its_owners_binding_or_busy, concurrent_reserves_from_tasks,
    concurrent_reserves_have_one_winner, reserve_then_load, scope_and_key_never_run_together,
    scope_quota_holds_under_concurrency, scopes_are_isolated,
};
#[doc(hidden)]
pub use round_trips::{
    empty_response_without_headers_round_trips, header_values_that_are_not_utf8_round_trip,
    multi_megabyte_body_round_trips, trailers_round_trip,
};
pub use suite::{Report, Suite};
#[doc(hidden)]
pub use waiting::{
    a_wait_sees_the_key_released_and_finished_by_another_request,
    a_wait_sees_the_key_released_and_left_by_another_request_whose_lease_lapses,
    wait_gives_up_after_the_timeout, wait_returns_when_the_lease_lapses,
    wait_returns_when_the_owner_finalizes, wait_returns_when_the_owner_releases,
};

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinSet;

use crate::purge::purge_all_expired;
use crate::store::{
    Binding, FencingToken, FullStore, IdempotencyRecord, IdempotencyStore, Ownership, PurgeExpired,
    Purged, RecordAdmin, RecordId, RecordState, Reservation, StoredResponse, Waited,
};

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(300);

fn fresh_id() -> RecordId {
    RecordId::new(
        format!("scope-{}", uuid::Uuid::new_v4()),
        uuid::Uuid::new_v4().to_string(),
    )
}

fn binding(body: &[u8]) -> Binding {
    use sha2::Digest;
    Binding {
        method: "POST".to_owned(),
        path: "/orders".to_owned(),
        body_sha256: sha2::Sha256::digest(body).into(),
    }
}

/// A plain answer whose body is `body`.
fn response_with(body: String) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![],
        body: Bytes::from(body),
        trailers: vec![],
    }
}

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![
            (
                "content-type".to_owned(),
                Bytes::from_static(b"application/json"),
            ),
            ("etag".to_owned(), Bytes::from_static(b"\"v1\"")),
        ],
        body: Bytes::from_static(body),
        trailers: vec![],
    }
}

/// Reserves a key nobody holds and returns its token.
async fn reserve_new<S: IdempotencyStore + ?Sized>(
    store: &S,
    id: &RecordId,
    lease: Duration,
    lifetime: Duration,
) -> FencingToken {
    reserve_bound(store, id, &binding(b"{}"), lease, lifetime).await
}

/// [`reserve_new`] with another binding.
async fn reserve_bound<S: IdempotencyStore + ?Sized>(
    store: &S,
    id: &RecordId,
    bound: &Binding,
    lease: Duration,
    lifetime: Duration,
) -> FencingToken {
    match store
        .reserve(id, bound, lease, lifetime)
        .await
        .expect("reserve failed")
    {
        Reservation::Reserved(token) => token,
        other => panic!("reserve of a key nobody holds answered {other:?}"),
    }
}

/// Reserves a key that no record holds, as the layer does: a store may answer
/// [`Busy`](Reservation::Busy) while something else holds the key for a moment (a
/// waiter, on a store whose waiters take the key's lock), and is then waited for.
async fn reserve_when_free<S: IdempotencyStore + ?Sized>(
    store: &S,
    id: &RecordId,
    bound: &Binding,
    lease: Duration,
    lifetime: Duration,
) -> FencingToken {
    for _ in 0..20 {
        match store
            .reserve(id, bound, lease, lifetime)
            .await
            .expect("reserve failed")
        {
            Reservation::Reserved(token) => {
                return token;
            }
            Reservation::Busy => {
                store
                    .wait(id, Duration::from_secs(1))
                    .await
                    .expect("wait failed");
            }
            other => panic!("reserve of a key no record holds answered {other:?}"),
        }
    }
    panic!("a key nobody holds stayed busy through 20 reservations")
}

/// Waits on `id` while `act` runs (from 100 ms on), and checks that the wait ended
/// before its timeout.
async fn wait_in_background<S: IdempotencyStore + ?Sized>(
    store: &S,
    id: &RecordId,
    timeout: Duration,
    act: impl std::future::Future<Output = ()>,
) -> Waited {
    let started = tokio::time::Instant::now();
    let (waited, ()) = tokio::join!(store.wait(id, timeout), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        act.await;
    });
    assert!(
        started.elapsed() < timeout,
        "wait must return when the record settles, not at its timeout"
    );
    waited.expect("wait failed")
}
