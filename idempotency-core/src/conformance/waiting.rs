//! Waiting: a duplicate's wait ends when the owner finalizes, releases or lapses, or when
//! its timeout passes, and says how the key then stands — also when, meanwhile, the key
//! was released and taken by another request.

use super::*;

/// A waiter wakes up with the response when the owner finalizes.
pub async fn wait_returns_when_the_owner_finalizes<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
    match waited {
        Waited::Settled(record) => {
            assert_eq!(record.binding, binding(b"{}"));
            assert_eq!(record.state, RecordState::Completed(response(b"done")));
        }
        other => panic!("a waiter on a record finalized meanwhile got {other:?}"),
    }
}

/// A waiter wakes up with [`Waited::Gone`] when the owner releases.
pub async fn wait_returns_when_the_owner_releases<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let waited = wait_in_background(store, &id, Duration::from_secs(10), async {
        store.release(&id, token).await.unwrap();
    })
    .await;
    assert_eq!(waited, Waited::Gone);
}

/// A waiter wakes up when the owner's lease lapses, seeing it lapsed.
pub async fn wait_returns_when_the_lease_lapses<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, SHORT, LONG).await;
    let waited = wait_in_background(store, &id, Duration::from_secs(10), async {}).await;
    match waited {
        Waited::Settled(record) => assert_eq!(
            record.state,
            RecordState::InFlight {
                token,
                lease_lapsed: true
            }
        ),
        other => panic!("a waiter on a lease that lapsed got {other:?}"),
    }
}

/// A waiter answers [`Waited::Running`] when its timeout passes first: with the owner's
/// record if the store can show it, never with one it does not hold.
pub async fn wait_gives_up_after_the_timeout<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let started = tokio::time::Instant::now();
    let waited = store.wait(&id, SHORT).await.unwrap();
    let waited_for = started.elapsed();
    // Some databases count lock waits in whole seconds.
    assert!(waited_for >= SHORT, "wait returned before its timeout");
    assert!(
        waited_for < SHORT + Duration::from_secs(3),
        "wait overran its timeout by far: {waited_for:?}"
    );
    match waited {
        Waited::Running(None) => {}
        Waited::Running(Some(record)) => {
            assert_eq!(record.binding, binding(b"{}"));
            assert_eq!(
                record.state,
                RecordState::InFlight {
                    token,
                    lease_lapsed: false
                }
            );
        }
        other => panic!("a waiter on an owner that is still running got {other:?}"),
    }
    store.release(&id, token).await.unwrap();
}

/// While a duplicate waits, the owner releases the key, and another request (another
/// binding) reserves and finishes it. The wait ends as the key then stands: gone (the
/// waiter reserves again and finds the other request's record), or settled with the
/// other request's record, bound as that request bound it — never a record bound like
/// the waiter, which the store does not hold.
pub async fn a_wait_sees_the_key_released_and_finished_by_another_request<
    S: IdempotencyStore + ?Sized,
>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    let id = fresh_id();
    let (waiter, other) = (binding(b"X"), binding(b"Y"));
    let first = reserve_bound(store, &id, &waiter, LONG, LONG).await;
    let waited = wait_in_background(store, &id, Duration::from_secs(10), async {
        store.release(&id, first).await.unwrap();
        let second = reserve_when_free(store, &id, &other, LONG, LONG).await;
        assert_eq!(
            store
                .finalize(&id, second, &response(b"Y's answer"))
                .await
                .unwrap(),
            Ownership::Held
        );
    })
    .await;
    match waited {
        Waited::Gone => {}
        Waited::Settled(record) => assert_eq!(
            record.binding, other,
            "a wait returned a record bound like the waiter, but the key now holds another request's"
        ),
        Waited::Running(record) => panic!(
            "the wait outlasted the owners' release and the other request's finalize: Running({record:?})"
        ),
    }
    match store.reserve(&id, &waiter, LONG, LONG).await.unwrap() {
        Reservation::Exists(record) => {
            assert_eq!(record.binding, other, "the key lost its binding");
            assert_eq!(
                record.state,
                RecordState::Completed(response(b"Y's answer"))
            );
        }
        answer => panic!("a reserve of a key finished by another request answered {answer:?}"),
    }
}

/// While a duplicate waits, the owner releases the key, and another request (another
/// binding) reserves it with a short lease and stops renewing it. The wait ends as the
/// key then stands, with the other request's binding — never one like the waiter's, or
/// the waiter would take that request's record over — and a takeover keeps that binding.
pub async fn a_wait_sees_the_key_released_and_left_by_another_request_whose_lease_lapses<
    S: IdempotencyStore + ?Sized,
>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    let id = fresh_id();
    let (waiter, other) = (binding(b"X"), binding(b"Y"));
    let first = reserve_bound(store, &id, &waiter, LONG, LONG).await;
    let second = std::sync::Mutex::new(None);
    let waited = wait_in_background(store, &id, Duration::from_secs(10), async {
        store.release(&id, first).await.unwrap();
        let token = reserve_when_free(store, &id, &other, SHORT, LONG).await;
        *second.lock().unwrap() = Some(token);
    })
    .await;
    let second = second.into_inner().unwrap().expect("reserved");
    match waited {
        Waited::Gone => {}
        Waited::Settled(record) | Waited::Running(Some(record)) => {
            assert_eq!(
                record.binding, other,
                "a wait returned a record bound like the waiter, but the key now holds another request's"
            );
            assert!(
                matches!(record.state, RecordState::InFlight { token, .. } if token == second),
                "the wait returned {:?}, not the other request's reservation",
                record.state
            );
        }
        Waited::Running(None) => {
            panic!("a store whose reservations have a lease could not show the record it holds")
        }
    }
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let lapsed = match store.reserve(&id, &waiter, LONG, LONG).await.unwrap() {
        Reservation::Exists(record) => {
            assert_eq!(record.binding, other, "the key lost its binding");
            record.state
        }
        answer => panic!("a reserve of a key held by another request answered {answer:?}"),
    };
    assert_eq!(
        lapsed,
        RecordState::InFlight {
            token: second,
            lease_lapsed: true
        }
    );
    let taken = store
        .take_over(&id, second, LONG)
        .await
        .unwrap()
        .expect("a lapsed lease must be taken over");
    let record = store
        .load(&id)
        .await
        .unwrap()
        .expect("taken-over record lost");
    assert_eq!(record.binding, other, "a takeover must keep the binding");
    store.release(&id, taken).await.unwrap();
}
