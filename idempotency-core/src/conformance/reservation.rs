//! Reservation: one winner among racers, and records found by their whole (scope, key).

use super::*;

/// A reserved key is in flight under a live lease and keeps its binding.
pub async fn reserve_then_load<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
        other => panic!("a second reserve of a key in flight must see its record: {other:?}"),
    }
}

/// A key held by an owner is shown to everyone else as it is — the owner's record, bound
/// as the owner bound it — or as [`Busy`](Reservation::Busy) by a store that cannot show
/// it (a reservation held unseen, in the owner's transaction): never as a record
/// the store does not hold (bound like the caller), never reserved twice. Once finalized
/// it is the completed record, bound as its owner reserved it; once released the key is
/// free.
pub async fn a_held_key_shows_its_owners_binding_or_busy<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    let id = fresh_id();
    let mine = binding(b"the owner's request");
    let token = reserve_bound(store, &id, &mine, LONG, LONG).await;
    for other in [binding(b"the owner's request"), binding(b"another request")] {
        match store.reserve(&id, &other, LONG, LONG).await.unwrap() {
            Reservation::Busy => {}
            Reservation::Exists(record) => assert_eq!(
                record.binding, mine,
                "a reserve of a held key was shown a record bound to another request than the owner's: one the store does not hold"
            ),
            answer => panic!("a reserve of a key held by another owner answered {answer:?}"),
        }
    }
    assert_eq!(
        store.release(&id, token).await.unwrap(),
        Ownership::Held,
        "the owner could not release its reservation"
    );
    let token = reserve_bound(store, &id, &mine, LONG, LONG).await;
    assert_eq!(
        store
            .finalize(&id, token, &response(b"done"))
            .await
            .unwrap(),
        Ownership::Held
    );
    match store
        .reserve(&id, &binding(b"another request"), LONG, LONG)
        .await
        .unwrap()
    {
        Reservation::Exists(record) => {
            assert_eq!(record.binding, mine, "the record lost its owner's binding");
            assert_eq!(record.state, RecordState::Completed(response(b"done")));
        }
        answer => panic!("a reserve of a finalized key answered {answer:?}"),
    }
}

/// Many tasks reserving one key at once: exactly one wins, all others see its record.
pub async fn concurrent_reserves_have_one_winner<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
                Reservation::Exists(_) | Reservation::Busy => None,
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
    store.release(&id, winners[0]).await.unwrap();
}

/// 64 reserves of one key from spawned tasks (several threads on a multi-threaded
/// runtime): exactly one wins.
pub async fn concurrent_reserves_from_tasks<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
    let id = fresh_id();
    let mut tasks = JoinSet::new();
    for _ in 0..64 {
        let store = store.clone();
        let id = id.clone();
        tasks.spawn(async move { store.reserve(&id, &binding(b"{}"), LONG, LONG).await });
    }
    let mut winners = Vec::new();
    while let Some(result) = tasks.join_next().await {
        if let Reservation::Reserved(token) = result.unwrap().expect("reserve failed") {
            winners.push(token);
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one of 64 spawned reserves must win"
    );
    store.release(&id, winners[0]).await.unwrap();
}

/// One key in many scopes is many independent records, reserved and finalized
/// concurrently: each scope gets its own token and keeps its own answer.
pub async fn scopes_are_isolated<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
    let key = uuid::Uuid::new_v4().to_string();
    let ids: Vec<RecordId> = (0..50)
        .map(|i| RecordId::new(format!("tenant-{i}-{}", uuid::Uuid::new_v4()), key.clone()))
        .collect();
    let answer = |i: usize| response_with(format!("tenant-{i}"));
    let finished =
        futures_util::future::join_all(ids.iter().enumerate().map(|(i, id)| async move {
            let token = match store.reserve(id, &binding(b"{}"), LONG, LONG).await {
                Ok(Reservation::Reserved(token)) => token,
                other => panic!(
                    "scope {} saw another scope's reservation: {other:?}",
                    id.scope
                ),
            };
            store.finalize(id, token, &answer(i)).await.unwrap()
        }))
        .await;
    for (id, finished) in ids.iter().zip(finished) {
        assert_eq!(
            finished,
            Ownership::Held,
            "scope {} lost its record",
            id.scope
        );
    }
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            store.load(id).await.unwrap().map(|record| record.state),
            Some(RecordState::Completed(answer(i))),
            "scope {} got another scope's answer",
            id.scope
        );
    }
    let unscoped = RecordId::new("", key);
    assert!(store.load(&unscoped).await.unwrap().is_none());
}

/// Scope and key are two values, not one string: pairs that would read the same when
/// joined (`a:b` + `c` and `a` + `b:c`) are different records, whatever separator,
/// brace or escape they hold.
pub async fn scope_and_key_never_run_together<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
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
    // Each pair reserved and finalized in turn: a pair that shared a record with an
    // earlier one would find it held.
    for (i, (scope, key)) in pairs.iter().enumerate() {
        let id = RecordId::new(scope.clone(), key.clone());
        let token = reserve_new(store, &id, LONG, LONG).await;
        assert_eq!(
            store
                .finalize(&id, token, &response_with(format!("answer {i}")))
                .await
                .unwrap(),
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
pub async fn scope_quota_holds_under_concurrency<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
    max_records: u64,
) {
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
