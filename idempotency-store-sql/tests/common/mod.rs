//! Helpers shared by the backend test binaries: unique tables, the skip-or-fail rule for
//! unreachable servers, and store-level checks that go beyond the conformance suite
//! (several nodes with their own pools, concurrent migrations and purges).
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Binding, IdempotencyStore, Ownership, RecordId, RecordState, Reservation, StoredResponse,
};

pub const LONG: Duration = Duration::from_secs(60);

/// A table name no other test (or test process) uses.
pub fn unique_table() -> String {
    format!(
        "idem_test_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    )
}

/// Under `CI=true` an unreachable database fails the test; elsewhere it is skipped with a
/// notice. Returns `None` when the caller should return (skip).
pub fn unreachable<T>(
    backend: &str,
    url: &str,
    env: &str,
    error: impl std::fmt::Display,
) -> Option<T> {
    let message =
        format!("{backend} at {url} is unreachable ({error}); start it or point {env} at one");
    if std::env::var("CI").is_ok_and(|ci| ci == "true") {
        panic!("{message} (CI=true: a database that cannot be reached fails the run)");
    }
    eprintln!("SKIPPED: {message}");
    None
}

pub fn id() -> RecordId {
    RecordId::new(
        format!("scope-{}", uuid::Uuid::new_v4()),
        uuid::Uuid::new_v4().to_string(),
    )
}

pub fn binding() -> Binding {
    Binding {
        method: "POST".to_owned(),
        path: "/v1/namespaces/db/tables?x=1".to_owned(),
        body_sha256: [7; 32],
    }
}

pub fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".to_owned(),
            bytes::Bytes::from_static(b"application/json"),
        )],
        body: bytes::Bytes::from_static(body),
    }
}

/// Two nodes (separate pools) race 64 reserves of each of several keys: exactly one
/// winner per key, and every loser sees the winner's token.
pub async fn two_nodes_race_one_winner(a: Arc<dyn IdempotencyStore>, b: Arc<dyn IdempotencyStore>) {
    for _ in 0..5 {
        let id = id();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..64 {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let id = id.clone();
            tasks.spawn(async move { store.reserve(&id, &binding(), LONG, LONG).await });
        }
        let mut winners = Vec::new();
        let mut seen = Vec::new();
        while let Some(result) = tasks.join_next().await {
            match result.unwrap().expect("reserve failed under contention") {
                Reservation::Reserved(token) => winners.push(token),
                Reservation::Exists(record) => match record.state {
                    RecordState::InFlight {
                        token,
                        lease_lapsed: false,
                    } => seen.push(token),
                    other => panic!("loser saw {other:?}"),
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
            "a loser saw another token"
        );
        // The winner finalizes on node A; a retry on node B gets the replay.
        let winner = winners[0];
        assert_eq!(
            a.finalize(&id, winner, &response(b"ok")).await.unwrap(),
            Ownership::Held
        );
        match b.reserve(&id, &binding(), LONG, LONG).await.unwrap() {
            Reservation::Exists(record) => {
                assert_eq!(record.state, RecordState::Completed(response(b"ok")))
            }
            Reservation::Reserved(_) => panic!("a finalized key was reserved again on node B"),
        }
    }
}

/// A reservation whose lease lapsed on node A is taken over by node B; A's late
/// finalize, renew and release are refused; B's finalize holds.
pub async fn takeover_across_nodes(a: Arc<dyn IdempotencyStore>, b: Arc<dyn IdempotencyStore>) {
    let id = id();
    let Reservation::Reserved(old) = a
        .reserve(&id, &binding(), Duration::from_millis(200), LONG)
        .await
        .unwrap()
    else {
        panic!("fresh key not reserved")
    };
    tokio::time::sleep(Duration::from_millis(350)).await;
    let lapsed = match b.reserve(&id, &binding(), LONG, LONG).await.unwrap() {
        Reservation::Exists(record) => record.state,
        Reservation::Reserved(_) => panic!("an in-flight key was reserved again"),
    };
    assert_eq!(
        lapsed,
        RecordState::InFlight {
            token: old,
            lease_lapsed: true
        }
    );
    let new = b
        .take_over(&id, old, LONG)
        .await
        .unwrap()
        .expect("take over failed");
    assert_ne!(new, old);
    assert_eq!(
        b.take_over(&id, old, LONG).await.unwrap(),
        None,
        "taken over twice"
    );
    assert_eq!(a.renew(&id, old, LONG).await.unwrap(), Ownership::Lost);
    assert_eq!(
        a.finalize(&id, old, &response(b"late")).await.unwrap(),
        Ownership::Lost
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

/// Released keys get a fresh token on every re-reservation (tokens are never reused).
pub async fn tokens_are_not_reused(store: &dyn IdempotencyStore) {
    let id = id();
    let mut tokens = std::collections::HashSet::new();
    for _ in 0..20 {
        let Reservation::Reserved(token) =
            store.reserve(&id, &binding(), LONG, LONG).await.unwrap()
        else {
            panic!("released key not reserved again")
        };
        assert!(tokens.insert(token), "token {token:?} reused");
        assert_eq!(store.release(&id, token).await.unwrap(), Ownership::Held);
    }
}

/// Renewing twice within one millisecond still counts as held (MySQL reports found
/// rows, not changed rows), and a lapsed-but-not-taken-over owner may still finalize.
pub async fn renew_and_finalize_edge_cases(store: &dyn IdempotencyStore) {
    let first = id();
    let Reservation::Reserved(token) = store.reserve(&first, &binding(), LONG, LONG).await.unwrap()
    else {
        panic!("fresh key not reserved")
    };
    for _ in 0..3 {
        assert_eq!(
            store.renew(&first, token, LONG).await.unwrap(),
            Ownership::Held
        );
    }
    let other = id();
    let Reservation::Reserved(short) = store
        .reserve(&other, &binding(), Duration::from_millis(50), LONG)
        .await
        .unwrap()
    else {
        panic!("fresh key not reserved")
    };
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(
        store
            .finalize(&other, short, &response(b"late but still the owner"))
            .await
            .unwrap(),
        Ownership::Held
    );
    // Finalizing twice is refused: the record is no longer in flight.
    assert_eq!(
        store
            .finalize(&other, short, &response(b"again"))
            .await
            .unwrap(),
        Ownership::Lost
    );
    // An empty body and no headers round-trip as such.
    let empty = StoredResponse {
        status: 204,
        headers: vec![],
        body: bytes::Bytes::new(),
    };
    assert_eq!(
        store.finalize(&first, token, &empty).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.load(&first).await.unwrap().unwrap().state,
        RecordState::Completed(empty)
    );
}

/// Several nodes purge at once: every expired row is deleted exactly once, without errors,
/// and live rows stay.
pub async fn concurrent_purges(nodes: Vec<Arc<dyn IdempotencyStore>>) {
    let scope = format!("purge-{}", uuid::Uuid::new_v4());
    let ids: Vec<RecordId> = (0..120)
        .map(|i| RecordId::new(scope.clone(), format!("k{i}")))
        .collect();
    let bound = binding();
    futures_util::future::join_all(
        ids.iter()
            .map(|id| nodes[0].reserve(id, &bound, LONG, Duration::from_millis(100))),
    )
    .await
    .into_iter()
    .for_each(|r| assert!(matches!(r.unwrap(), Reservation::Reserved(_))));
    let live = RecordId::new(scope.clone(), "live");
    nodes[0]
        .reserve(&live, &binding(), LONG, LONG)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    let deleted: u64 = futures_util::future::join_all(
        nodes
            .iter()
            .map(|node| idempotency_core::store::purge_all_expired(node.as_ref(), 7)),
    )
    .await
    .into_iter()
    .map(|r| r.expect("concurrent purge failed"))
    .sum();
    // Tests in other processes never share this table, so the count is exact.
    assert_eq!(deleted, 120);
    for id in &ids {
        assert!(nodes[1].load(id).await.unwrap().is_none());
    }
    assert!(
        nodes[1].load(&live).await.unwrap().is_some(),
        "purge deleted a live row"
    );
}
