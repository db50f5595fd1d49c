//! Checks of the operators' operations: [`RecordAdmin::inspect`] and
//! [`RecordAdmin::evict`].

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::{LONG, SHORT, binding, fresh_id, reserve_new, response, wait_in_background};
use crate::store::{
    EvictInFlight, Eviction, InspectedRecord, InspectedState, Ownership, RecordAdmin, RecordId,
    RecordState, Reservation, Waited,
};

/// Millisecond rounding of the stored times, plus a slow machine between two statements.
const TIME_SLACK: Duration = Duration::from_secs(2);

fn inspect_live(record: Option<InspectedRecord>, what: &str) -> InspectedRecord {
    record.unwrap_or_else(|| panic!("inspect found no record {what}"))
}

/// The times an inspection carries, which a store that passes the suite must report.
struct Times {
    created_at: SystemTime,
    expires_at: SystemTime,
    inspected_at: SystemTime,
}

fn times(record: &InspectedRecord) -> Times {
    let (Some(created_at), Some(expires_at), Some(inspected_at)) =
        (record.created_at, record.expires_at, record.inspected_at)
    else {
        panic!(
            "inspect must report created_at, expires_at and inspected_at (the trait's default \
             reports none: override RecordAdmin::inspect): {record:?}"
        )
    };
    // The store's clock may differ from ours, but not by an hour: this catches seconds
    // taken for milliseconds and the like.
    let ours = SystemTime::now();
    let apart = ours
        .duration_since(inspected_at)
        .or_else(|_| inspected_at.duration_since(ours))
        .unwrap_or_default();
    assert!(
        apart < Duration::from_secs(3600),
        "inspected_at {inspected_at:?} is {apart:?} away from this machine's clock; are the units right?"
    );
    Times {
        created_at,
        expires_at,
        inspected_at,
    }
}

/// Two readings of one stored time, allowing a store that converts clocks a few
/// microseconds of jitter.
fn assert_same_time(first: SystemTime, second: SystemTime, what: &str) {
    let apart = first
        .duration_since(second)
        .or_else(|_| second.duration_since(first))
        .unwrap_or_default();
    assert!(
        apart <= Duration::from_millis(10),
        "{what}: read {first:?}, then {second:?}"
    );
}

/// `later` is `after` past `earlier`, give or take [`TIME_SLACK`].
fn assert_about(earlier: SystemTime, later: SystemTime, after: Duration, what: &str) {
    let actual = later.duration_since(earlier).unwrap_or_else(|_| {
        panic!("{what}: {later:?} comes before {earlier:?}");
    });
    let gap = actual.abs_diff(after);
    assert!(
        gap <= TIME_SLACK,
        "{what}: expected about {after:?}, the store says {actual:?}"
    );
}

/// Inspection shows binding, state, status and times, never the body, and changes
/// nothing; a takeover keeps the creation time; an expired record is absent.
pub async fn inspect_shows_state_and_times_without_the_body<S: RecordAdmin + ?Sized>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    let id = fresh_id();
    assert!(
        store.inspect(&id).await.unwrap().is_none(),
        "inspect of an unknown key must return None"
    );
    let lifetime = LONG * 2;
    let token = match store
        .reserve(&id, &binding(b"{}"), LONG, lifetime)
        .await
        .unwrap()
    {
        Reservation::Reserved(token) => token,
        other => panic!("a reserve of a key nobody holds answered {other:?}"),
    };

    let reserved = inspect_live(store.inspect(&id).await.unwrap(), "after reserve");
    assert_eq!(
        reserved.binding,
        binding(b"{}"),
        "inspect must show the binding"
    );
    let InspectedState::InFlight {
        lease_lapsed: false,
        lease_expires_at: Some(lease_expires_at),
    } = reserved.state
    else {
        panic!(
            "a fresh reservation must inspect as in flight under a live lease, with its end: {:?}",
            reserved.state
        )
    };
    let at_reserve = times(&reserved);
    assert!(
        at_reserve.created_at <= at_reserve.inspected_at,
        "created_at is after inspected_at"
    );
    assert_about(
        at_reserve.created_at,
        at_reserve.expires_at,
        lifetime,
        "expires_at - created_at (the lifetime)",
    );
    assert_about(
        at_reserve.created_at,
        lease_expires_at,
        LONG,
        "lease_expires_at - created_at (the lease)",
    );
    assert_eq!(
        store.load(&id).await.unwrap().map(|record| record.state),
        Some(RecordState::InFlight {
            token,
            lease_lapsed: false
        }),
        "inspect must change nothing"
    );

    let mut stored = response(b"{\"secret\":\"only for the caller\"}");
    stored.status = 201;
    assert_eq!(
        store.finalize(&id, token, &stored).await.unwrap(),
        Ownership::Held
    );
    let completed = inspect_live(store.inspect(&id).await.unwrap(), "after finalize");
    assert_eq!(
        completed.state,
        InspectedState::Completed { status: 201 },
        "a finalized record must inspect as completed, with its status"
    );
    let at_finalize = times(&completed);
    assert_same_time(
        at_finalize.created_at,
        at_reserve.created_at,
        "finalize must keep created_at",
    );
    assert_same_time(
        at_finalize.expires_at,
        at_reserve.expires_at,
        "finalize must keep expires_at",
    );

    // A takeover keeps the creation time and grants a new lease.
    let crashed = fresh_id();
    let lapsed = reserve_new(store, &crashed, SHORT, LONG).await;
    let before = times(&inspect_live(
        store.inspect(&crashed).await.unwrap(),
        "after reserve",
    ));
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let lapsed_record = inspect_live(store.inspect(&crashed).await.unwrap(), "whose lease lapsed");
    assert!(
        matches!(
            lapsed_record.state,
            InspectedState::InFlight {
                lease_lapsed: true,
                ..
            }
        ),
        "a lapsed lease must inspect as lapsed: {:?}",
        lapsed_record.state
    );
    store
        .take_over(&crashed, lapsed, LONG)
        .await
        .unwrap()
        .expect("take over a lapsed lease");
    let taken = inspect_live(store.inspect(&crashed).await.unwrap(), "after takeover");
    assert_same_time(
        times(&taken).created_at,
        before.created_at,
        "a takeover keeps the creation time",
    );
    assert!(matches!(
        taken.state,
        InspectedState::InFlight {
            lease_lapsed: false,
            ..
        }
    ));

    // Expired: absent.
    let expiring = fresh_id();
    let owner = reserve_new(store, &expiring, SHORT, SHORT).await;
    store
        .finalize(&expiring, owner, &response(b"old"))
        .await
        .unwrap();
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    assert!(
        store.inspect(&expiring).await.unwrap().is_none(),
        "an expired record must inspect as None"
    );
}

/// Evicting a completed record deletes it, in its scope only, and the key runs again.
pub async fn evict_deletes_a_completed_record_and_the_key_runs_again<S: RecordAdmin + ?Sized>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    let id = fresh_id();
    let neighbour = RecordId::new(format!("{}-other", id.scope), id.key.clone());
    for id in [&id, &neighbour] {
        let token = reserve_new(store, id, LONG, LONG).await;
        store
            .finalize(id, token, &response(b"wrong answer"))
            .await
            .unwrap();
    }
    match store.evict(&id, EvictInFlight::Refuse).await.unwrap() {
        Eviction::Evicted(record) => assert_eq!(
            record.state,
            InspectedState::Completed { status: 200 },
            "evict must say what it deleted"
        ),
        other => panic!("evicting a completed record must delete it: {other:?}"),
    }
    assert!(
        store.load(&id).await.unwrap().is_none(),
        "evicted, yet loaded"
    );
    assert!(store.inspect(&id).await.unwrap().is_none());
    assert_eq!(
        store.evict(&id, EvictInFlight::Force).await.unwrap(),
        Eviction::NotFound,
        "a second eviction finds nothing"
    );
    assert!(
        matches!(
            store.load(&neighbour).await.unwrap().map(|r| r.state),
            Some(RecordState::Completed(_))
        ),
        "evicting a key in one scope must leave the same key in another scope alone"
    );
    // The next request with the key runs as a first execution.
    let token = reserve_new(store, &id, LONG, LONG).await;
    store.release(&id, token).await.unwrap();
}

/// An in-flight record is left alone unless forced; forced, its owner is fenced out.
pub async fn evict_refuses_an_in_flight_record_unless_forced<S: RecordAdmin + ?Sized>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    let id = fresh_id();
    let owner = reserve_new(store, &id, LONG, LONG).await;
    match store.evict(&id, EvictInFlight::Refuse).await.unwrap() {
        Eviction::InFlight(record) => assert!(
            matches!(
                record.state,
                InspectedState::InFlight {
                    lease_lapsed: false,
                    ..
                }
            ),
            "the refusal must say the lease is live: {record:?}"
        ),
        other => panic!("evicting an in-flight record without force must be refused: {other:?}"),
    }
    assert_eq!(
        store.renew(&id, owner, LONG).await.unwrap(),
        Ownership::Held,
        "a refused eviction must leave the owner its record"
    );

    match store.evict(&id, EvictInFlight::Force).await.unwrap() {
        Eviction::Evicted(record) => assert!(record.is_in_flight(), "{record:?}"),
        other => panic!("a forced eviction of an in-flight record must delete it: {other:?}"),
    }
    assert!(store.load(&id).await.unwrap().is_none());
    assert_eq!(
        store
            .finalize(&id, owner, &response(b"late"))
            .await
            .unwrap(),
        Ownership::Lost,
        "the owner of an evicted record must not write it back"
    );
    assert_eq!(store.release(&id, owner).await.unwrap(), Ownership::Lost);
    let next = reserve_new(store, &id, LONG, LONG).await;
    assert_ne!(next, owner);

    // A crashed owner's reservation is still in flight: refused too, and says it lapsed.
    let crashed = fresh_id();
    reserve_new(store, &crashed, SHORT, LONG).await;
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    match store.evict(&crashed, EvictInFlight::Refuse).await.unwrap() {
        Eviction::InFlight(record) => assert!(
            matches!(
                record.state,
                InspectedState::InFlight {
                    lease_lapsed: true,
                    ..
                }
            ),
            "the refusal must say the lease lapsed: {record:?}"
        ),
        other => panic!("a lapsed reservation is still in flight: {other:?}"),
    }
}

/// Evicting an unknown or expired key finds nothing; the expired key can be reserved.
pub async fn evict_of_an_absent_or_expired_record_finds_nothing<S: RecordAdmin + ?Sized>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    assert_eq!(
        store
            .evict(&fresh_id(), EvictInFlight::Force)
            .await
            .unwrap(),
        Eviction::NotFound
    );
    let id = fresh_id();
    let token = reserve_new(store, &id, SHORT, SHORT).await;
    store.finalize(&id, token, &response(b"old")).await.unwrap();
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    assert_eq!(
        store.evict(&id, EvictInFlight::Force).await.unwrap(),
        Eviction::NotFound,
        "an expired record counts as absent"
    );
    let token = reserve_new(store, &id, LONG, LONG).await;
    store.release(&id, token).await.unwrap();
}

/// A duplicate waiting on a record is woken when an operator evicts it, and finds it
/// absent.
pub async fn evict_wakes_waiters<S: RecordAdmin + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
    let id = fresh_id();
    reserve_new(store, &id, LONG, LONG).await;
    let waited = wait_in_background(store, &id, Duration::from_secs(10), async {
        let eviction = store.evict(&id, EvictInFlight::Force).await.unwrap();
        assert!(matches!(eviction, Eviction::Evicted(_)), "{eviction:?}");
    })
    .await;
    assert_eq!(
        waited,
        Waited::Gone,
        "an evicted record must be absent to its waiters"
    );
}

/// Eviction racing the owner's finalize decides on the record as it stands: refused
/// while in flight (and the answer is then stored), or deleted once completed; never a
/// completed record lost to a verdict taken while it was in flight.
pub async fn evict_never_acts_on_a_stale_verdict<S: RecordAdmin + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
    for _ in 0..20 {
        let id = fresh_id();
        let owner = reserve_new(store, &id, LONG, LONG).await;
        let done = response(b"done");
        let (finalized, eviction) = tokio::join!(
            store.finalize(&id, owner, &done),
            store.evict(&id, EvictInFlight::Refuse)
        );
        assert_eq!(
            finalized.unwrap(),
            Ownership::Held,
            "an eviction that is refused in flight must not take the record from its owner"
        );
        let now = store.load(&id).await.unwrap().map(|record| record.state);
        match eviction.unwrap() {
            Eviction::InFlight(_) => assert_eq!(
                now,
                Some(RecordState::Completed(done)),
                "refused while in flight: the owner's answer must be stored"
            ),
            Eviction::Evicted(record) => {
                assert_eq!(
                    record.state,
                    InspectedState::Completed { status: 200 },
                    "without force only a completed record may be evicted"
                );
                assert_eq!(now, None, "evicted, yet loaded");
            }
            Eviction::NotFound => panic!("the record was live throughout"),
        }
    }
}
