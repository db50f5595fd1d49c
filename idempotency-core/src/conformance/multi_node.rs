//! Checks for stores shared by several processes, run with two handles on one backend
//! (separate pools or connections), the way two replicas hold them.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use super::{LONG, binding, fresh_id, response};
use crate::purge::purge_all_expired;
use crate::store::{
    IdempotencyStore, Ownership, PurgeExpired, Purged, RecordId, RecordState, Reservation,
};

/// Two nodes race 64 reserves of each of several keys: exactly one winner per key, every
/// loser sees the winner's token, and a record finalized on one node is a replay on the
/// other.
pub async fn two_nodes_race_one_winner<S: IdempotencyStore + ?Sized>(a: &Arc<S>, b: &Arc<S>) {
    for _ in 0..5 {
        let id = fresh_id();
        let mut tasks = JoinSet::new();
        for i in 0..64 {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let id = id.clone();
            tasks.spawn(async move { store.reserve(&id, &binding(b"{}"), LONG, LONG).await });
        }
        let mut winners = Vec::new();
        let mut seen = Vec::new();
        while let Some(result) = tasks.join_next().await {
            match result.unwrap().expect("reserve failed under contention") {
                Reservation::Reserved(token) => winners.push(token),
                Reservation::Busy => {}
                Reservation::Exists(record) => match record.state {
                    RecordState::InFlight {
                        token,
                        lease_lapsed: false,
                    } => seen.push(token),
                    other => panic!("a losing reserve saw {other:?}"),
                },
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "exactly one of 64 reserves over two nodes must win"
        );
        assert!(
            seen.iter().all(|token| *token == winners[0]),
            "a losing reserve saw another token than the winner's"
        );
        assert_eq!(
            a.finalize(&id, winners[0], &response(b"ok")).await.unwrap(),
            Ownership::Held
        );
        match b.reserve(&id, &binding(b"{}"), LONG, LONG).await.unwrap() {
            Reservation::Exists(record) => {
                assert_eq!(record.state, RecordState::Completed(response(b"ok")))
            }
            other => panic!("a key finalized on node A answered {other:?} on node B"),
        }
    }
}

/// A reservation whose lease lapsed on node A is taken over by node B, once; A's late
/// renew, finalize and release are refused; B's finalize holds.
pub async fn takeover_across_nodes<S: IdempotencyStore + ?Sized>(a: &Arc<S>, b: &Arc<S>) {
    let id = fresh_id();
    let Reservation::Reserved(old) = a
        .reserve(&id, &binding(b"{}"), Duration::from_millis(200), LONG)
        .await
        .unwrap()
    else {
        panic!("reserve of a fresh key did not win")
    };
    tokio::time::sleep(Duration::from_millis(350)).await;
    match b.reserve(&id, &binding(b"{}"), LONG, LONG).await.unwrap() {
        Reservation::Exists(record) => assert_eq!(
            record.state,
            RecordState::InFlight {
                token: old,
                lease_lapsed: true
            },
            "node B must see node A's lapsed lease"
        ),
        other => panic!("an in-flight key answered {other:?}"),
    }
    let new = b
        .take_over(&id, old, LONG)
        .await
        .unwrap()
        .expect("node B could not take over a lapsed lease");
    assert_ne!(new, old);
    assert_eq!(
        b.take_over(&id, old, LONG).await.unwrap(),
        None,
        "a record was taken over twice from one token"
    );
    assert_eq!(a.renew(&id, old, LONG).await.unwrap(), Ownership::Lost);
    assert_eq!(
        a.finalize(&id, old, &response(b"late")).await.unwrap(),
        Ownership::Lost,
        "the fenced-out owner on node A overwrote node B's record"
    );
    assert_eq!(a.release(&id, old).await.unwrap(), Ownership::Lost);
    assert_eq!(b.renew(&id, new, LONG).await.unwrap(), Ownership::Held);
    assert_eq!(
        b.finalize(&id, new, &response(b"new")).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        a.load(&id).await.unwrap().unwrap().state,
        RecordState::Completed(response(b"new"))
    );
}

/// Both nodes purge at once: every expired record is deleted once, without errors, and
/// live records stay. A store that expires records by itself only has to lose them.
pub async fn concurrent_purges<S: PurgeExpired + ?Sized>(a: &Arc<S>, b: &Arc<S>) {
    let scope = format!("purge-{}", uuid::Uuid::new_v4());
    let ids: Vec<RecordId> = (0..120)
        .map(|i| RecordId::new(scope.clone(), format!("k{i}")))
        .collect();
    let short = Duration::from_millis(100);
    let bound = binding(b"{}");
    let reserved =
        futures_util::future::join_all(ids.iter().map(|id| a.reserve(id, &bound, short, short)))
            .await;
    for result in reserved {
        assert!(matches!(result.unwrap(), Reservation::Reserved(_)));
    }
    let live = RecordId::new(scope.clone(), "live");
    a.reserve(&live, &bound, LONG, LONG).await.unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    let (on_a, on_b) = tokio::join!(
        purge_all_expired(a.as_ref(), 7),
        purge_all_expired(b.as_ref(), 7)
    );
    match (
        on_a.expect("concurrent purge failed"),
        on_b.expect("concurrent purge failed"),
    ) {
        // Other tests sharing the backend may add expired records of their own.
        (Purged::Deleted(x), Purged::Deleted(y)) => assert!(
            x + y >= 120,
            "two purges deleted {} records, expected at least 120",
            x + y
        ),
        (Purged::ByBackend, Purged::ByBackend) => {}
        other => panic!("two handles on one backend purged differently: {other:?}"),
    }
    for id in &ids {
        assert!(b.load(id).await.unwrap().is_none());
    }
    assert!(
        b.load(&live).await.unwrap().is_some(),
        "purge deleted a live record"
    );
}
