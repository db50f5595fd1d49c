//! Ownership: finalize, release and renew are fenced by the token; a lapsed lease is taken
//! over once, with a new token, and only then does its old owner lose the record.

use super::*;

/// A finalized record is replayed exactly as stored, and a retry cannot reserve it.
pub async fn finalize_then_replay<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
        other => panic!("a finalized key must be replayed, not {other:?}"),
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
pub async fn finalize_is_fenced<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
pub async fn release_frees_the_key<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
pub async fn release_is_fenced<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
pub async fn renew_extends_the_lease<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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

/// Renewing several times in a row, within one millisecond, is held every time (a
/// backend that counts changed rows rather than matched rows would say "lost").
pub async fn repeated_renewals_are_held<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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

/// After the lease lapses, exactly one of many takeovers wins; the old owner is fenced out.
pub async fn lapsed_lease_is_taken_over_once<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
pub async fn live_lease_is_not_taken_over<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
pub async fn completed_record_is_not_taken_over<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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

/// An owner whose lease lapsed still owns the record until someone takes it over: it may
/// renew and finalize. Once finalized, a second finalize is refused.
pub async fn lapsed_owner_may_finish_until_taken_over<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
) {
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
pub async fn takeover_keeps_the_binding<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
pub async fn tokens_are_never_reused<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
