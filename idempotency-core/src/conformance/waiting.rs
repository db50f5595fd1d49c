//! Waiting: a duplicate's wait ends when the owner finalizes, releases or lapses, or when
//! its timeout passes.

use super::*;

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
