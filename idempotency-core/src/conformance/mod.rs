//! A conformance suite for store implementations: the request path
//! ([`IdempotencyStore`]), the operators' [`RecordAdmin`] and maintenance's
//! [`PurgeExpired`], together a [`FullStore`].
//!
//! Every store in this workspace runs it, and so can yours: enable the `conformance`
//! feature in your dev-dependencies and call [`run_all`] from a test with a fresh store
//! (multi-threaded runtime recommended, since the races are real). A store shared by
//! several processes should also run [`run_multi_node`] with two handles on one backend
//! (two pools, two connections), as two replicas would hold them:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use idempotency_core::FullStore;
//! # async fn example(store: Arc<dyn FullStore>, second_handle: Arc<dyn FullStore>) {
//! idempotency_core::conformance::run_all(&store).await;
//! idempotency_core::conformance::run_multi_node(&store, &second_handle).await;
//! # }
//! ```
//!
//! Each check is also a public `async fn` taking the store as `&Arc<dyn FullStore>`
//! (`Arc::new(my_store)` coerces to it), so a backend can run them one by one. Most
//! exercise the request path alone; the purge checks use [`PurgeExpired`] too, and
//! [`inspect_shows_state_and_times_without_the_body`] and the `evict_*` checks
//! [`RecordAdmin`]. [`model`] compares random sequences of
//! operations from several owners with a reference model. Checks panic with a message
//! that says what the store did wrong. They use random keys and scopes, so they can run
//! against a shared database, in parallel, and repeatedly. Timing checks use leases and
//! lifetimes of a few hundred milliseconds and tolerate a slow machine.
//!
//! The rules they check are written on the [request path's trait](crate::IdempotencyStore#the-rules-every-store-keeps)
//! and on [`RecordAdmin`](crate::RecordAdmin#the-rules).

mod expiry;
pub mod model;
mod multi_node;
mod operator;
mod ownership;
mod reservation;
mod round_trips;
mod waiting;

pub use expiry::{
    expired_record_counts_as_absent, in_flight_record_outlives_its_lifetime_under_a_live_lease,
    purge_removes_expired_in_batches, renewals_keep_a_record_alive_past_its_lifetime,
};
pub use multi_node::{
    concurrent_purges, run_multi_node, takeover_across_nodes, two_nodes_race_one_winner,
};
pub use operator::{
    evict_deletes_a_completed_record_and_the_key_runs_again, evict_never_acts_on_a_stale_verdict,
    evict_of_an_absent_or_expired_record_finds_nothing,
    evict_refuses_an_in_flight_record_unless_forced, evict_wakes_waiters,
    inspect_shows_state_and_times_without_the_body,
};
pub use ownership::{
    completed_record_is_not_taken_over, finalize_is_fenced, finalize_then_replay,
    lapsed_lease_is_taken_over_once, lapsed_owner_may_finish_until_taken_over,
    live_lease_is_not_taken_over, release_frees_the_key, release_is_fenced,
    renew_extends_the_lease, repeated_renewals_are_held, takeover_keeps_the_binding,
    tokens_are_never_reused,
};
pub use reservation::{
    concurrent_reserves_from_tasks, concurrent_reserves_have_one_winner, reserve_then_load,
    scope_and_key_never_run_together, scope_quota_holds_under_concurrency, scopes_are_isolated,
};
pub use round_trips::{
    empty_response_without_headers_round_trips, header_values_that_are_not_utf8_round_trip,
    multi_megabyte_body_round_trips, trailers_round_trip,
};
pub use waiting::{
    wait_gives_up_after_the_timeout, wait_returns_when_the_lease_lapses,
    wait_returns_when_the_owner_finalizes, wait_returns_when_the_owner_releases,
};

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinSet;

use crate::purge::purge_all_expired;
use crate::store::{
    Binding, FencingToken, FullStore, IdempotencyStore, Ownership, Purged, RecordId, RecordState,
    Reservation, StoredResponse,
};
#[cfg(doc)]
use crate::store::{PurgeExpired, RecordAdmin};

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(300);

/// Runs every single-store check in this module and the [`model`], one after another.
pub async fn run_all(store: &Arc<dyn FullStore>) {
    concurrent_reserves_from_tasks(store).await;
    reserve_then_load(store).await;
    concurrent_reserves_have_one_winner(store).await;
    finalize_then_replay(store).await;
    finalize_is_fenced(store).await;
    release_frees_the_key(store).await;
    release_is_fenced(store).await;
    renew_extends_the_lease(store).await;
    repeated_renewals_are_held(store).await;
    lapsed_owner_may_finish_until_taken_over(store).await;
    lapsed_lease_is_taken_over_once(store).await;
    takeover_keeps_the_binding(store).await;
    live_lease_is_not_taken_over(store).await;
    completed_record_is_not_taken_over(store).await;
    tokens_are_never_reused(store).await;
    expired_record_counts_as_absent(store).await;
    in_flight_record_outlives_its_lifetime_under_a_live_lease(store).await;
    renewals_keep_a_record_alive_past_its_lifetime(store).await;
    purge_removes_expired_in_batches(store).await;
    wait_returns_when_the_owner_finalizes(store).await;
    wait_returns_when_the_owner_releases(store).await;
    wait_returns_when_the_lease_lapses(store).await;
    wait_gives_up_after_the_timeout(store).await;
    multi_megabyte_body_round_trips(store).await;
    empty_response_without_headers_round_trips(store).await;
    header_values_that_are_not_utf8_round_trip(store).await;
    trailers_round_trip(store).await;
    scopes_are_isolated(store).await;
    scope_and_key_never_run_together(store).await;
    inspect_shows_state_and_times_without_the_body(store).await;
    evict_deletes_a_completed_record_and_the_key_runs_again(store).await;
    evict_refuses_an_in_flight_record_unless_forced(store).await;
    evict_of_an_absent_or_expired_record_finds_nothing(store).await;
    evict_wakes_waiters(store).await;
    evict_never_acts_on_a_stale_verdict(store).await;
    model::check_random_sequences(store, 0, 20, 60).await;
}

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

async fn reserve_new(
    store: &dyn IdempotencyStore,
    id: &RecordId,
    lease: Duration,
    lifetime: Duration,
) -> FencingToken {
    match store
        .reserve(id, &binding(b"{}"), lease, lifetime)
        .await
        .expect("reserve failed")
    {
        Reservation::Reserved(token) => token,
        Reservation::Exists(record) => {
            panic!("reserve of a fresh key returned an existing record: {record:?}")
        }
    }
}

async fn wait_in_background(
    store: &dyn IdempotencyStore,
    id: &RecordId,
    timeout: Duration,
    act: impl std::future::Future<Output = ()>,
) -> Option<crate::IdempotencyRecord> {
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
