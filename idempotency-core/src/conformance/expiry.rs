//! Expiry: an expired record counts as absent, a record in flight under a live lease never
//! expires, and the purge deletes expired records in batches.

use super::*;

/// A completed record past its lifetime is absent to load and reserve.
pub async fn expired_record_counts_as_absent<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
    store.release(&id, fresh).await.unwrap();
}

/// A reservation past its lifetime and its lease is absent, and fences its old owner.
pub async fn expired_reservation_fences_its_owner<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
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

/// A record in flight under a live lease never expires, however old: it stays visible,
/// cannot be reserved again, survives a purge and can still be finalized.
pub async fn in_flight_record_outlives_its_lifetime_under_a_live_lease<S: PurgeExpired + ?Sized>(
    store: &Arc<S>,
) {
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
        other => {
            panic!(
                "a record in flight under a live lease was replaced after its lifetime (the request would run twice): {other:?}"
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
pub async fn renewals_keep_a_record_alive_past_its_lifetime<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
) {
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
        other => panic!("a renewed record expired with its lifetime: {other:?}"),
    }
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    assert!(
        store.load(&id).await.unwrap().is_none(),
        "once the lease lapsed past the lifetime, the record must expire"
    );
    let fresh = reserve_new(store, &id, LONG, LONG).await;
    assert_ne!(fresh, token);
}

/// Purge deletes expired records in batches no larger than asked, and nothing live.
/// (Reservations that expire in flight are purged in the [`model`](super::model)'s
/// sequences.)
pub async fn purge_removes_expired_in_batches<S: PurgeExpired + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
    let scope = format!("purge-{}", uuid::Uuid::new_v4());
    let expiring: Vec<RecordId> = (0..25)
        .map(|i| RecordId::new(scope.clone(), format!("expiring-{i}")))
        .collect();
    let live = RecordId::new(scope.clone(), "live");
    for id in &expiring {
        let token = reserve_new(store, id, SHORT, SHORT).await;
        store.finalize(id, token, &response(b"old")).await.unwrap();
    }
    let live_token = reserve_new(store, &live, LONG, LONG).await;
    store
        .finalize(&live, live_token, &response(b"live"))
        .await
        .unwrap();
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
        let token = reserve_new(store, id, LONG, LONG).await;
        store.release(id, token).await.unwrap();
    }
    assert_eq!(
        store.load(&live).await.unwrap().unwrap().state,
        RecordState::Completed(response(b"live")),
        "purge must not touch live records"
    );
}

/// An owner that cannot tell whether its change took effect holds its key until the
/// record expires ([`IdempotencyStore::hold`]): meanwhile every reservation finds the key
/// in flight under a live lease (past the record's lifetime too), nobody can take it
/// over, and afterwards the key is free.
pub async fn a_held_key_stays_reserved_until_it_expires<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    let id = fresh_id();
    // As the layer reserves: a lease no longer than the lifetime.
    let token = reserve_new(store, &id, SHORT, SHORT).await;
    let kept_for = Duration::from_millis(1_500);
    let held_at = tokio::time::Instant::now();
    assert_eq!(
        store.hold(&id, token, kept_for).await.expect("hold failed"),
        Ownership::Held,
        "the owner of a fresh reservation could not hold its key"
    );
    // Past the lease and the lifetime the reservation asked for, before the end of the
    // hold.
    tokio::time::sleep(SHORT + Duration::from_millis(200)).await;
    match store
        .reserve(&id, &binding(b"{}"), LONG, LONG)
        .await
        .expect("reserve failed")
    {
        Reservation::Exists(IdempotencyRecord {
            state:
                RecordState::InFlight {
                    token: holder,
                    lease_lapsed: false,
                },
            ..
        }) => {
            assert_eq!(holder, token, "a held record must keep its owner's token");
            assert_eq!(
                store
                    .take_over(&id, holder, LONG)
                    .await
                    .expect("take over failed"),
                None,
                "a held key must not be taken over before it expires"
            );
        }
        other => panic!(
            "a held key must stay in flight to every reservation until it expires (a retry \
             would run a change whose outcome is unknown); reserve answered {other:?}"
        ),
    }
    tokio::time::sleep_until(held_at + kept_for + Duration::from_millis(300)).await;
    let fresh = reserve_when_free(store, &id, &binding(b"{}"), LONG, LONG).await;
    assert_ne!(fresh, token, "a key reserved again must get a new token");
    store.release(&id, fresh).await.expect("release failed");
}
