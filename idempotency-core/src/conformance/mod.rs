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

pub mod model;
mod multi_node;
mod operator;

pub use multi_node::{
    concurrent_purges, run_multi_node, takeover_across_nodes, two_nodes_race_one_winner,
};
pub use operator::{
    evict_deletes_a_completed_record_and_the_key_runs_again, evict_never_acts_on_a_stale_verdict,
    evict_of_an_absent_or_expired_record_finds_nothing,
    evict_refuses_an_in_flight_record_unless_forced, evict_wakes_waiters,
    inspect_shows_state_and_times_without_the_body,
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

/// A reserved key is in flight under a live lease and keeps its binding.
pub async fn reserve_then_load(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    assert!(
        store.load(&id).await.unwrap().is_none(),
        "load of an unknown key must return None"
    );
    let token = reserve_new(store, &id, LONG, LONG).await;
    let record = store
        .load(&id)
        .await
        .unwrap()
        .expect("reserved record not found");
    assert_eq!(record.binding, binding(b"{}"), "binding not kept");
    assert_eq!(
        record.state,
        RecordState::InFlight {
            token,
            lease_lapsed: false
        },
        "a fresh reservation must be in flight under a live lease"
    );
    match store
        .reserve(&id, &binding(b"other"), LONG, LONG)
        .await
        .unwrap()
    {
        Reservation::Exists(existing) => assert_eq!(existing, record),
        Reservation::Reserved(_) => panic!("a second reserve of a live key must not win"),
    }
}

/// Many tasks reserving one key at once: exactly one wins, all others see its record.
pub async fn concurrent_reserves_have_one_winner(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    // Joined futures on one task: the store's own I/O interleaves. The variant with
    // spawned tasks on several threads is `concurrent_reserves_from_tasks`.
    let id = fresh_id();
    let bound = binding(b"{}");
    let attempts = (0..64).map(|_| store.reserve(&id, &bound, LONG, LONG));
    let results = futures_util::future::join_all(attempts).await;
    let winners: Vec<_> = results
        .iter()
        .filter_map(
            |r| match r.as_ref().expect("reserve failed under contention") {
                Reservation::Reserved(token) => Some(*token),
                Reservation::Exists(_) => None,
            },
        )
        .collect();
    assert_eq!(winners.len(), 1, "exactly one of 64 reserves must win");
    for result in &results {
        if let Ok(Reservation::Exists(record)) = result {
            assert_eq!(
                record.state,
                RecordState::InFlight {
                    token: winners[0],
                    lease_lapsed: false
                },
                "losers must see the winner's in-flight record"
            );
        }
    }
}

/// A finalized record is replayed exactly as stored, and a retry cannot reserve it.
pub async fn finalize_then_replay(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let stored = response(br#"{"order":42,"state":"placed"}"#);
    assert_eq!(
        store.finalize(&id, token, &stored).await.unwrap(),
        Ownership::Held
    );
    let record = store
        .load(&id)
        .await
        .unwrap()
        .expect("finalized record lost");
    assert_eq!(record.state, RecordState::Completed(stored.clone()));
    match store
        .reserve(&id, &binding(b"{}"), LONG, LONG)
        .await
        .unwrap()
    {
        Reservation::Exists(existing) => {
            assert_eq!(existing.state, RecordState::Completed(stored))
        }
        Reservation::Reserved(_) => panic!("a finalized key must not be reserved again"),
    }
    assert_eq!(
        store
            .finalize(&id, token, &response(b"again"))
            .await
            .unwrap(),
        Ownership::Lost,
        "a completed record must not be finalized twice"
    );
}

/// Finalize with a token that does not own the record changes nothing.
pub async fn finalize_is_fenced(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let stranger = FencingToken(token.0.wrapping_add(1));
    assert_eq!(
        store
            .finalize(&id, stranger, &response(b"x"))
            .await
            .unwrap(),
        Ownership::Lost,
        "finalize with a foreign token must be refused"
    );
    assert!(matches!(
        store.load(&id).await.unwrap().unwrap().state,
        RecordState::InFlight { .. }
    ));
    assert_eq!(
        store
            .finalize(&fresh_id(), token, &response(b"x"))
            .await
            .unwrap(),
        Ownership::Lost,
        "finalize of an absent record must be refused"
    );
}

/// Release deletes the reservation; the key can then be reserved again.
pub async fn release_frees_the_key(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    assert_eq!(store.release(&id, token).await.unwrap(), Ownership::Held);
    assert!(
        store.load(&id).await.unwrap().is_none(),
        "release must delete"
    );
    let second = reserve_new(store, &id, LONG, LONG).await;
    assert_ne!(second, token, "a new reservation must get a new token");
    assert_eq!(
        store
            .finalize(&id, token, &response(b"late"))
            .await
            .unwrap(),
        Ownership::Lost,
        "the released owner's token must not finalize the new reservation"
    );
}

/// Release with a foreign token, or of a completed record, changes nothing.
pub async fn release_is_fenced(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let stranger = FencingToken(token.0.wrapping_add(1));
    assert_eq!(store.release(&id, stranger).await.unwrap(), Ownership::Lost);
    assert!(store.load(&id).await.unwrap().is_some());
    store
        .finalize(&id, token, &response(b"done"))
        .await
        .unwrap();
    assert_eq!(
        store.release(&id, token).await.unwrap(),
        Ownership::Lost,
        "a completed record must not be released"
    );
    assert!(matches!(
        store.load(&id).await.unwrap().unwrap().state,
        RecordState::Completed(_)
    ));
}

/// Renew keeps a short lease from lapsing; a foreign token cannot renew.
pub async fn renew_extends_the_lease(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, SHORT, LONG).await;
    assert_eq!(
        store.renew(&id, token, LONG).await.unwrap(),
        Ownership::Held
    );
    tokio::time::sleep(SHORT * 2).await;
    assert_eq!(
        store.load(&id).await.unwrap().unwrap().state,
        RecordState::InFlight {
            token,
            lease_lapsed: false
        },
        "a renewed lease must still be live"
    );
    let stranger = FencingToken(token.0.wrapping_add(1));
    assert_eq!(
        store.renew(&id, stranger, LONG).await.unwrap(),
        Ownership::Lost
    );
}

/// After the lease lapses, exactly one of many takeovers wins; the old owner is fenced out.
pub async fn lapsed_lease_is_taken_over_once(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let old = reserve_new(store, &id, SHORT, LONG).await;
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let record = store.load(&id).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RecordState::InFlight {
            token: old,
            lease_lapsed: true
        },
        "the lease must be reported lapsed"
    );
    let takeovers = (0..16).map(|_| store.take_over(&id, old, LONG));
    let winners: Vec<_> = futures_util::future::join_all(takeovers)
        .await
        .into_iter()
        .filter_map(|r| r.expect("take_over failed"))
        .collect();
    assert_eq!(winners.len(), 1, "exactly one takeover must win");
    let new = winners[0];
    assert_ne!(new, old, "a takeover must issue a new token");
    assert_eq!(
        store.finalize(&id, old, &response(b"stale")).await.unwrap(),
        Ownership::Lost,
        "the old owner's finalize must be refused"
    );
    assert_eq!(store.renew(&id, old, LONG).await.unwrap(), Ownership::Lost);
    assert_eq!(store.release(&id, old).await.unwrap(), Ownership::Lost);
    assert_eq!(
        store.finalize(&id, new, &response(b"fresh")).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.load(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(b"fresh"))
    );
}

/// A record under a live lease cannot be taken over.
pub async fn live_lease_is_not_taken_over(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    assert_eq!(store.take_over(&id, token, LONG).await.unwrap(), None);
    assert_eq!(
        store.take_over(&fresh_id(), token, LONG).await.unwrap(),
        None,
        "taking over an absent record must fail"
    );
}

/// A completed record cannot be taken over, even long after its lease would have lapsed.
pub async fn completed_record_is_not_taken_over(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, SHORT, LONG).await;
    store
        .finalize(&id, token, &response(b"done"))
        .await
        .unwrap();
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    assert_eq!(store.take_over(&id, token, LONG).await.unwrap(), None);
}

/// A record past its lifetime (and its last lease) is absent to load and reserve, and
/// fences its old owner.
pub async fn expired_record_counts_as_absent(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, SHORT, SHORT).await;
    store.finalize(&id, token, &response(b"old")).await.unwrap();
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    assert!(
        store.load(&id).await.unwrap().is_none(),
        "an expired record must load as None"
    );
    let fresh = reserve_new(store, &id, LONG, LONG).await;
    assert_ne!(fresh, token);

    // Only a reservation whose lease lapsed too can expire.
    let in_flight = fresh_id();
    let owner = reserve_new(store, &in_flight, SHORT, SHORT).await;
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    assert!(store.load(&in_flight).await.unwrap().is_none());
    assert_eq!(
        store
            .finalize(&in_flight, owner, &response(b"late"))
            .await
            .unwrap(),
        Ownership::Lost,
        "an expired reservation must not be finalized"
    );
}

/// Purge deletes expired records in batches no larger than asked, and nothing live.
pub async fn purge_removes_expired_in_batches(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let scope = format!("purge-{}", uuid::Uuid::new_v4());
    let expiring: Vec<RecordId> = (0..25)
        .map(|i| RecordId::new(scope.clone(), format!("expiring-{i}")))
        .collect();
    let live = RecordId::new(scope.clone(), "live");
    for id in &expiring {
        reserve_new(store, id, SHORT, SHORT).await;
    }
    let live_token = reserve_new(store, &live, LONG, LONG).await;
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;

    // Expired records are absent before any purge.
    for id in &expiring {
        assert!(store.load(id).await.unwrap().is_none());
    }
    match store.purge_expired(10).await.expect("purge failed") {
        Purged::Deleted(first) => {
            assert!(
                first <= 10,
                "purge_expired(10) deleted {first} records, more than its batch"
            );
            let Purged::Deleted(rest) = purge_all_expired(store, 10).await.expect("purge failed")
            else {
                panic!("purge_expired said it deleted records, then that the backend does it")
            };
            // Other tests sharing the store may add expired records of their own.
            assert!(
                first + rest >= 25,
                "purge deleted {} records, expected >= 25",
                first + rest
            );
        }
        // A backend with native expiry has nothing to delete: the records are gone.
        Purged::ByBackend => {}
    }
    for id in &expiring {
        assert!(store.load(id).await.unwrap().is_none());
        // A purged key is really gone: it can be reserved again.
        reserve_new(store, id, LONG, LONG).await;
    }
    assert_eq!(
        store.load(&live).await.unwrap().unwrap().state,
        RecordState::InFlight {
            token: live_token,
            lease_lapsed: false
        },
        "purge must not touch live records"
    );
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

/// A waiter wakes up with the response when the owner finalizes.
pub async fn wait_returns_when_the_owner_finalizes(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let waited = wait_in_background(store, &id, Duration::from_secs(10), async {
        store
            .finalize(&id, token, &response(b"done"))
            .await
            .unwrap();
    })
    .await;
    assert_eq!(
        waited.expect("finalized record lost").state,
        RecordState::Completed(response(b"done"))
    );
}

/// A waiter wakes up with `None` when the owner releases.
pub async fn wait_returns_when_the_owner_releases(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let waited = wait_in_background(store, &id, Duration::from_secs(10), async {
        store.release(&id, token).await.unwrap();
    })
    .await;
    assert_eq!(waited, None);
}

/// A waiter wakes up when the owner's lease lapses, seeing it lapsed.
pub async fn wait_returns_when_the_lease_lapses(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, SHORT, LONG).await;
    let waited = wait_in_background(store, &id, Duration::from_secs(10), async {}).await;
    assert_eq!(
        waited.expect("record lost").state,
        RecordState::InFlight {
            token,
            lease_lapsed: true
        }
    );
}

/// A waiter returns the in-flight record when its timeout passes first.
pub async fn wait_gives_up_after_the_timeout(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let started = tokio::time::Instant::now();
    let waited = store.wait(&id, SHORT).await.unwrap();
    assert!(
        started.elapsed() >= SHORT,
        "wait returned before its timeout"
    );
    assert!(
        started.elapsed() < SHORT * 10,
        "wait overran its timeout by far"
    );
    assert_eq!(
        waited.unwrap().state,
        RecordState::InFlight {
            token,
            lease_lapsed: false
        }
    );
}

/// A 6 MiB binary body (real Iceberg metadata can be this large) round-trips byte for byte.
pub async fn multi_megabyte_body_round_trips(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let body: Vec<u8> = (0..6 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let stored = StoredResponse {
        status: 200,
        headers: vec![(
            "content-type".to_owned(),
            Bytes::from_static(b"application/octet-stream"),
        )],
        body: Bytes::from(body),
        trailers: vec![],
    };
    assert_eq!(
        store.finalize(&id, token, &stored).await.unwrap(),
        Ownership::Held
    );
    let loaded = store.load(&id).await.unwrap().expect("large record lost");
    match loaded.state {
        RecordState::Completed(replayed) => {
            assert_eq!(
                replayed.body.len(),
                stored.body.len(),
                "body length differs"
            );
            assert!(
                replayed == stored,
                "large body differs after the round trip"
            );
        }
        other => panic!("large record not completed: {other:?}"),
    }
}

/// One key in many scopes is many independent records, reserved concurrently.
pub async fn scopes_are_isolated(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let key = uuid::Uuid::new_v4().to_string();
    let ids: Vec<RecordId> = (0..50)
        .map(|i| RecordId::new(format!("tenant-{i}-{}", uuid::Uuid::new_v4()), key.clone()))
        .collect();
    let bound = binding(b"{}");
    let reserved =
        futures_util::future::join_all(ids.iter().map(|id| store.reserve(id, &bound, LONG, LONG)))
            .await;
    let mut tokens = Vec::new();
    for (id, result) in ids.iter().zip(reserved) {
        match result.expect("reserve failed") {
            Reservation::Reserved(token) => tokens.push(token),
            Reservation::Exists(_) => panic!("scope {} saw another scope's record", id.scope),
        }
    }
    store
        .finalize(&ids[0], tokens[0], &response(b"tenant-0"))
        .await
        .unwrap();
    for id in &ids[1..] {
        assert!(
            matches!(
                store.load(id).await.unwrap().unwrap().state,
                RecordState::InFlight { .. }
            ),
            "finalizing one scope changed another"
        );
    }
    let unscoped = RecordId::new("", key);
    assert!(store.load(&unscoped).await.unwrap().is_none());
}

/// 64 reserves of one key from spawned tasks (several threads on a multi-threaded
/// runtime): exactly one wins.
pub async fn concurrent_reserves_from_tasks(store: &Arc<dyn FullStore>) {
    let id = fresh_id();
    let mut tasks = JoinSet::new();
    for _ in 0..64 {
        let store = store.clone();
        let id = id.clone();
        tasks.spawn(async move { store.reserve(&id, &binding(b"{}"), LONG, LONG).await });
    }
    let mut winners = 0;
    while let Some(result) = tasks.join_next().await {
        if let Reservation::Reserved(_) = result.unwrap().expect("reserve failed") {
            winners += 1;
        }
    }
    assert_eq!(winners, 1, "exactly one of 64 spawned reserves must win");
}

/// Renewing several times in a row, within one millisecond, is held every time (a
/// backend that counts changed rows rather than matched rows would say "lost").
pub async fn repeated_renewals_are_held(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    for _ in 0..3 {
        assert_eq!(
            store.renew(&id, token, LONG).await.unwrap(),
            Ownership::Held,
            "renewing a held lease again must be held"
        );
    }
}

/// An owner whose lease lapsed still owns the record until someone takes it over: it may
/// renew and finalize. Once finalized, a second finalize is refused.
pub async fn lapsed_owner_may_finish_until_taken_over(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, Duration::from_millis(50), LONG).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        store
            .renew(&id, token, Duration::from_millis(50))
            .await
            .unwrap(),
        Ownership::Held,
        "an owner whose lease lapsed, not taken over, may renew"
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        store
            .finalize(&id, token, &response(b"late but still the owner"))
            .await
            .unwrap(),
        Ownership::Held,
        "an owner whose lease lapsed, not taken over, may finalize"
    );
    assert_eq!(
        store
            .finalize(&id, token, &response(b"again"))
            .await
            .unwrap(),
        Ownership::Lost,
        "a record is finalized once"
    );
}

/// A takeover replaces the token and the lease, and keeps what the key was bound to.
pub async fn takeover_keeps_the_binding(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let bound = binding(b"the first request");
    let Reservation::Reserved(old) = store
        .reserve(&id, &bound, Duration::from_millis(50), LONG)
        .await
        .unwrap()
    else {
        panic!("reserve of a fresh key did not win")
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let new = store
        .take_over(&id, old, LONG)
        .await
        .unwrap()
        .expect("a lapsed lease must be taken over");
    let record = store
        .load(&id)
        .await
        .unwrap()
        .expect("taken-over record lost");
    assert_eq!(record.binding, bound, "a takeover must keep the binding");
    assert_eq!(
        record.state,
        RecordState::InFlight {
            token: new,
            lease_lapsed: false
        }
    );
}

/// Every reservation of a key gets a token the key never had, however often it is
/// released and reserved again.
pub async fn tokens_are_never_reused(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let mut tokens = std::collections::HashSet::new();
    for _ in 0..20 {
        let token = reserve_new(store, &id, LONG, LONG).await;
        assert!(
            tokens.insert(token),
            "token {token:?} was issued twice for one key"
        );
        assert_eq!(store.release(&id, token).await.unwrap(), Ownership::Held);
    }
}

/// A record in flight under a live lease never expires, however old: it stays visible,
/// cannot be reserved again, survives a purge and can still be finalized.
pub async fn in_flight_record_outlives_its_lifetime_under_a_live_lease(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    let in_flight = RecordState::InFlight {
        token,
        lease_lapsed: false,
    };
    assert_eq!(
        store.load(&id).await.unwrap().map(|r| r.state),
        Some(in_flight.clone()),
        "a record in flight under a live lease must not expire with its lifetime"
    );
    match store
        .reserve(&id, &binding(b"{}"), LONG, LONG)
        .await
        .unwrap()
    {
        Reservation::Exists(record) => assert_eq!(record.state, in_flight),
        Reservation::Reserved(_) => {
            panic!(
                "a record in flight under a live lease was replaced after its lifetime: the request would run twice"
            )
        }
    }
    purge_all_expired(store, 100).await.expect("purge failed");
    assert!(
        store.load(&id).await.unwrap().is_some(),
        "purge deleted a record in flight under a live lease"
    );
    assert_eq!(
        store
            .finalize(&id, token, &response(b"slow"))
            .await
            .unwrap(),
        Ownership::Held
    );
}

/// A slow owner that keeps renewing keeps its record past the lifetime; once it stops,
/// the record expires when both the lease and the lifetime are over.
pub async fn renewals_keep_a_record_alive_past_its_lifetime(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    // Renewals come every quarter lease, so a test machine may stall for most of a
    // lease without losing it.
    let lease = Duration::from_secs(2);
    let token = reserve_new(store, &id, lease, SHORT).await;
    for _ in 0..3 {
        tokio::time::sleep(lease / 4).await;
        assert_eq!(
            store.renew(&id, token, lease).await.unwrap(),
            Ownership::Held
        );
    }
    // Five lifetimes have passed.
    match store
        .reserve(&id, &binding(b"{}"), LONG, LONG)
        .await
        .unwrap()
    {
        Reservation::Exists(record) => assert!(
            matches!(record.state, RecordState::InFlight { token: t, .. } if t == token),
            "a renewed record must still be in flight under its owner"
        ),
        Reservation::Reserved(_) => panic!("a renewed record expired with its lifetime"),
    }
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    assert!(
        store.load(&id).await.unwrap().is_none(),
        "once the lease lapsed past the lifetime, the record must expire"
    );
    let fresh = reserve_new(store, &id, LONG, LONG).await;
    assert_ne!(fresh, token);
}

/// A 204 with no headers and an empty body comes back as exactly that.
pub async fn empty_response_without_headers_round_trips(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let empty = StoredResponse {
        status: 204,
        headers: vec![],
        body: Bytes::new(),
        trailers: vec![],
    };
    assert_eq!(
        store.finalize(&id, token, &empty).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.load(&id).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed(empty)),
        "an empty 204 without headers must round-trip as such"
    );
}

/// Header values are bytes, not text: values that are not UTF-8, values holding `:`
/// and repeated names come back as they went in, in order.
pub async fn header_values_that_are_not_utf8_round_trip(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let stored = StoredResponse {
        status: 201,
        headers: vec![
            (
                "x-latin1".to_owned(),
                Bytes::from_static(b"caf\xe9 \xff\x80"),
            ),
            (
                "link".to_owned(),
                Bytes::from_static(b"<https://a.example:8443/x>; rel=a"),
            ),
            (
                "link".to_owned(),
                Bytes::from_static(b"<https://b.example/y>; rel=b"),
            ),
            ("etag".to_owned(), Bytes::from_static(b"\"\"")),
        ],
        body: Bytes::from_static(b"{}"),
        trailers: vec![],
    };
    assert_eq!(
        store.finalize(&id, token, &stored).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.load(&id).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed(stored)),
        "header values must round-trip byte for byte, in order"
    );
}

/// Trailers (gRPC's status travels in them) come back as they went in, in order, values
/// that are not UTF-8 included, and a response without trailers comes back without any.
pub async fn trailers_round_trip(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let stored = StoredResponse {
        status: 200,
        headers: vec![(
            "content-type".to_owned(),
            Bytes::from_static(b"application/grpc"),
        )],
        body: Bytes::from_static(b"\0\0\0\0\x02\x08\x01"),
        trailers: vec![
            ("grpc-status".to_owned(), Bytes::from_static(b"0")),
            ("grpc-message".to_owned(), Bytes::from_static(b"ok%3A done")),
            (
                "grpc-status-details-bin".to_owned(),
                Bytes::from_static(b"CAMSBGJhZA"),
            ),
            ("x-raw".to_owned(), Bytes::from_static(b"caf\xe9")),
            ("x-raw".to_owned(), Bytes::from_static(b"second")),
        ],
    };
    assert_eq!(
        store.finalize(&id, token, &stored).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.load(&id).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed(stored)),
        "trailers must round-trip byte for byte, in order"
    );
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let without = response(b"{}");
    assert!(without.trailers.is_empty());
    store.finalize(&id, token, &without).await.unwrap();
    assert_eq!(
        store.load(&id).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed(without)),
        "a response without trailers must come back without any"
    );
}

/// Scope and key are two values, not one string: pairs that would read the same when
/// joined (`a:b` + `c` and `a` + `b:c`) are different records, whatever separator,
/// brace or escape they hold.
pub async fn scope_and_key_never_run_together(store: &Arc<dyn FullStore>) {
    let store = store.as_ref();
    let unique = uuid::Uuid::new_v4();
    let pairs = [
        (format!("{unique}:a:b"), "c".to_owned()),
        (format!("{unique}:a"), "b:c".to_owned()),
        (format!("{unique}:a/b"), "c".to_owned()),
        (format!("{unique}:a"), "b/c".to_owned()),
        (format!("{unique}:ab"), "c".to_owned()),
        (format!("{unique}:a"), "bc".to_owned()),
        (format!("{unique}:{{a}}"), "{b}".to_owned()),
        (format!("{unique}:{{a"), "}{b}".to_owned()),
        (format!("{unique}:a\\"), "\\b".to_owned()),
        (format!("{unique}:a\n"), "b".to_owned()),
        (format!("{unique}:é"), "ü".to_owned()),
        (String::new(), format!("{unique}:a:b:c")),
        (format!("{unique}:a:b:c"), String::new()),
    ];
    let mut tokens = Vec::new();
    for (scope, key) in &pairs {
        let id = RecordId::new(scope.clone(), key.clone());
        tokens.push(reserve_new(store, &id, LONG, LONG).await);
    }
    for (i, (scope, key)) in pairs.iter().enumerate() {
        let id = RecordId::new(scope.clone(), key.clone());
        let body = Bytes::from(format!("answer {i}"));
        let answer = StoredResponse {
            status: 200,
            headers: vec![],
            body,
            trailers: vec![],
        };
        assert_eq!(
            store.finalize(&id, tokens[i], &answer).await.unwrap(),
            Ownership::Held,
            "scope {scope:?} with key {key:?} lost its own record"
        );
    }
    for (i, (scope, key)) in pairs.iter().enumerate() {
        let id = RecordId::new(scope.clone(), key.clone());
        let Some(RecordState::Completed(answer)) = store.load(&id).await.unwrap().map(|r| r.state)
        else {
            panic!("scope {scope:?} with key {key:?} lost its record")
        };
        assert_eq!(
            answer.body,
            format!("answer {i}"),
            "scope {scope:?} with key {key:?} got another pair's answer: a replay across callers"
        );
    }
}

/// For a store built with a [`ScopeQuota`](crate::ScopeQuota) of `max_records` records per
/// scope (and no smaller store-wide bound): many concurrent reservations in one scope win
/// exactly `max_records` times and the rest get `QuotaExceeded`; another scope is not
/// affected; a released record gives its room back.
pub async fn scope_quota_holds_under_concurrency(store: &Arc<dyn FullStore>, max_records: u64) {
    let scope = format!("quota-{}", uuid::Uuid::new_v4());
    let mut tasks = JoinSet::new();
    for i in 0..(max_records * 2 + 8) {
        let store = store.clone();
        let id = RecordId::new(scope.clone(), format!("k{i}"));
        tasks.spawn(async move {
            let answer = store.reserve(&id, &binding(b"{}"), LONG, LONG).await;
            (id, answer)
        });
    }
    let mut winners = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined.unwrap() {
            (id, Ok(Reservation::Reserved(token))) => winners.push((id, token)),
            (_, Err(crate::StoreError::QuotaExceeded { .. })) => {}
            (_, other) => panic!("a reserve over the quota answered {other:?}"),
        }
    }
    assert_eq!(
        winners.len() as u64,
        max_records,
        "a scope with a quota of {max_records} records won {} reservations",
        winners.len()
    );
    let other = RecordId::new(format!("{scope}-other"), "k0");
    assert!(
        matches!(
            store.reserve(&other, &binding(b"{}"), LONG, LONG).await,
            Ok(Reservation::Reserved(_))
        ),
        "a scope at its quota locked another scope out"
    );
    let (id, token) = &winners[0];
    assert_eq!(store.release(id, *token).await.unwrap(), Ownership::Held);
    let again = RecordId::new(scope.clone(), "after-release");
    assert!(
        matches!(
            store.reserve(&again, &binding(b"{}"), LONG, LONG).await,
            Ok(Reservation::Reserved(_))
        ),
        "a released record did not give its room back to its scope"
    );
}
