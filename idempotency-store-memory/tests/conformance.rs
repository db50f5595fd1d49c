//! The memory store against the shared conformance suite, plus its own capacity rules.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Binding, FullStore, IdempotencyStore, RecordId, Reservation, StoreError};
use idempotency_store_memory::MemoryStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_conformance_suite() {
    let store: Arc<dyn FullStore> = Arc::new(MemoryStore::new());
    // A second handle on the same map stands in for a second replica: the multi-node
    // checks race two handles on one backend.
    let report = idempotency_core::conformance::Suite::full(store.clone())
        .with_second_node(store)
        .run()
        .await;
    assert!(report.skipped.is_empty(), "{report}");
}

fn binding() -> Binding {
    Binding {
        method: "POST".into(),
        path: "/things".into(),
        body_sha256: [0; 32],
    }
}

#[tokio::test]
async fn full_store_refuses_new_keys_without_evicting_live_ones() {
    let store = MemoryStore::new().with_max_entries(3);
    let long = Duration::from_secs(60);
    for i in 0..3 {
        let id = RecordId::new("", format!("k{i}"));
        assert!(matches!(
            store.reserve(&id, &binding(), long, long).await.unwrap(),
            Reservation::Reserved(_)
        ));
    }
    let error = store
        .reserve(&RecordId::new("", "k3"), &binding(), long, long)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::Full { bound, retry_after: Some(_) } if bound == "3 live records"),
        "{error:?}"
    );
    assert!(error.to_string().contains("raise the bound"), "{error}");
    for i in 0..3 {
        let id = RecordId::new("", format!("k{i}"));
        assert!(store.load(&id).await.unwrap().is_some(), "k{i} was evicted");
    }
    // An existing key still answers with its record at capacity.
    assert!(matches!(
        store
            .reserve(&RecordId::new("", "k0"), &binding(), long, long)
            .await
            .unwrap(),
        Reservation::Exists(_)
    ));
}

#[tokio::test]
async fn full_store_makes_room_by_dropping_expired_records() {
    let store = MemoryStore::new().with_max_entries(2);
    let short = Duration::from_millis(50);
    let long = Duration::from_secs(60);
    for key in ["a", "b"] {
        store
            .reserve(&RecordId::new("", key), &binding(), short, short)
            .await
            .unwrap();
    }
    tokio::time::sleep(short * 2).await;
    assert!(matches!(
        store
            .reserve(&RecordId::new("", "c"), &binding(), long, long)
            .await
            .unwrap(),
        Reservation::Reserved(_)
    ));
    assert_eq!(store.len(), 1, "expired records should have been dropped");
}

#[tokio::test]
async fn matches_the_reference_model_on_random_sequences() {
    let store: Arc<dyn FullStore> = Arc::new(MemoryStore::new());
    idempotency_core::conformance::model::check_random_sequences(&store, 1_000, 300, 80).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_bound_holds_exactly_under_concurrent_reservations() {
    let store = MemoryStore::new().with_max_entries(500);
    let long = Duration::from_secs(60);
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut reserved = 0;
                for i in 0..200 {
                    let id = RecordId::new("", format!("t{task}-{i}"));
                    match store.reserve(&id, &binding(), long, long).await {
                        Ok(Reservation::Reserved(_)) => reserved += 1,
                        Err(StoreError::Full { .. }) => {}
                        other => panic!("unexpected {other:?}"),
                    }
                }
                reserved
            })
        })
        .collect();
    let mut reserved = 0;
    for task in tasks {
        reserved += task.await.unwrap();
    }
    assert_eq!(reserved, 500, "1,600 distinct keys against a bound of 500");
    assert_eq!(store.len(), 500);
}

#[tokio::test]
async fn builds_from_the_properties_configuration() {
    use idempotency_core::config::IdempotencyConfig;
    let config = IdempotencyConfig::from_properties([
        ("idempotency-enabled", "true"),
        ("idempotency-key-lifetime", "PT2H"),
        ("idempotency-max-entries", "10"),
    ])
    .unwrap();
    let store: Arc<dyn FullStore> = Arc::new(MemoryStore::from_config(&config).unwrap());
    assert_eq!(MemoryStore::from_config(&config).unwrap().max_entries(), 10);
    assert!(config.spawn_purge_task(store.clone()).is_none());
    let layer = config.layer(store.clone());
    assert_eq!(layer.lifetime(), Duration::from_secs(7200));
    let id = RecordId::new("", "configured");
    let long = Duration::from_secs(60);
    assert!(matches!(
        store.reserve(&id, &binding(), long, long).await.unwrap(),
        Reservation::Reserved(_)
    ));
}

#[test]
fn the_properties_configuration_is_checked_by_the_store() {
    use idempotency_core::config::{ConfigError, IdempotencyConfig};
    let refused = |pairs: &[(&str, &str)]| -> ConfigError {
        let config = IdempotencyConfig::from_properties(pairs.iter().copied()).unwrap();
        match MemoryStore::from_config(&config) {
            Ok(_) => panic!("{pairs:?} was accepted"),
            Err(error) => error,
        }
    };
    for (value, needle) in [("0", "\"0\""), ("lots", "\"lots\""), ("-5", "\"-5\"")] {
        let message = refused(&[("idempotency-max-entries", value)]).to_string();
        assert!(message.contains("`idempotency-max-entries`"), "{message}");
        assert!(message.contains(needle), "{message}");
        assert!(message.contains("positive integer"), "{message}");
    }
    // Another store's key, or a misspelt one: named, with the keys the store takes.
    for key in ["idempotency-database-url", "idempotency-max-entires"] {
        let error = refused(&[(key, "x")]);
        assert!(matches!(error, ConfigError::UnknownKey { .. }), "{error:?}");
        let message = error.to_string();
        assert!(message.contains(&format!("`{key}`")), "{message}");
        assert!(
            message.contains("idempotency-store-type=memory"),
            "{message}"
        );
        assert!(
            message.contains("the memory store takes idempotency-max-entries"),
            "{message}"
        );
    }
    let message = refused(&[("idempotency-store-type", "redis")]).to_string();
    assert!(message.contains("`idempotency-store-type`"), "{message}");
    assert!(message.contains("\"redis\""), "{message}");
}

fn answer(bytes: usize) -> idempotency_core::StoredResponse {
    idempotency_core::StoredResponse {
        status: 200,
        headers: vec![],
        body: vec![b'x'; bytes].into(),
        trailers: vec![],
    }
}

#[tokio::test]
async fn the_bound_counts_bytes_too() {
    let store = MemoryStore::new().with_max_bytes(10_000);
    let long = Duration::from_secs(60);
    for i in 0..2 {
        let id = RecordId::new("", format!("big-{i}"));
        let Reservation::Reserved(token) =
            store.reserve(&id, &binding(), long, long).await.unwrap()
        else {
            panic!("not reserved")
        };
        store.finalize(&id, token, &answer(5_000)).await.unwrap();
    }
    assert!(store.bytes() > 9_000, "{} bytes counted", store.bytes());
    let error = store
        .reserve(&RecordId::new("", "one-more"), &binding(), long, long)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::Full { bound, .. } if bound.contains("bytes")),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_scope_at_its_quota_does_not_lock_out_the_others() {
    let store = MemoryStore::new().with_scope_quota(
        idempotency_core::ScopeQuota::default()
            .with_max_records(2)
            .with_max_bytes(50_000),
    );
    let long = Duration::from_secs(60);
    for i in 0..2 {
        let id = RecordId::new("greedy", format!("k{i}"));
        assert!(matches!(
            store.reserve(&id, &binding(), long, long).await.unwrap(),
            Reservation::Reserved(_)
        ));
    }
    let error = store
        .reserve(&RecordId::new("greedy", "k2"), &binding(), long, long)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::QuotaExceeded { bound, .. } if bound == "2 records"),
        "{error:?}"
    );
    for other in ["modest", ""] {
        assert!(
            matches!(
                store
                    .reserve(&RecordId::new(other, "k0"), &binding(), long, long)
                    .await
                    .unwrap(),
                Reservation::Reserved(_)
            ),
            "scope {other:?} was locked out"
        );
    }
    // A released record gives its room back to its scope.
    let id = RecordId::new("greedy", "k0");
    let Reservation::Exists(record) = store.reserve(&id, &binding(), long, long).await.unwrap()
    else {
        panic!("k0 is held")
    };
    let idempotency_core::RecordState::InFlight { token, .. } = record.state else {
        panic!("k0 is in flight")
    };
    store.release(&id, token).await.unwrap();
    assert!(matches!(
        store
            .reserve(&RecordId::new("greedy", "k2"), &binding(), long, long)
            .await
            .unwrap(),
        Reservation::Reserved(_)
    ));
    // Bytes count against the quota too.
    let byte_bound = MemoryStore::new()
        .with_scope_quota(idempotency_core::ScopeQuota::default().with_max_bytes(10_000));
    let id = RecordId::new("t", "large");
    let Reservation::Reserved(token) = byte_bound
        .reserve(&id, &binding(), long, long)
        .await
        .unwrap()
    else {
        panic!("not reserved")
    };
    byte_bound
        .finalize(&id, token, &answer(20_000))
        .await
        .unwrap();
    assert!(matches!(
        byte_bound
            .reserve(&RecordId::new("t", "next"), &binding(), long, long)
            .await,
        Err(StoreError::QuotaExceeded { .. })
    ));
}

#[tokio::test]
async fn a_full_store_says_when_room_will_be_free() {
    let store = MemoryStore::new().with_max_entries(2);
    for (key, lifetime) in [("soon", 1_000), ("later", 5_000)] {
        let lifetime = Duration::from_millis(lifetime);
        store
            .reserve(
                &RecordId::new("", key),
                &binding(),
                Duration::from_millis(10),
                lifetime,
            )
            .await
            .unwrap();
    }
    let error = store
        .reserve(
            &RecordId::new("", "third"),
            &binding(),
            Duration::from_secs(1),
            Duration::from_secs(60),
        )
        .await
        .unwrap_err();
    let StoreError::Full {
        retry_after: Some(retry_after),
        ..
    } = error
    else {
        panic!("{error:?}")
    };
    assert!(
        retry_after > Duration::from_millis(500) && retry_after <= Duration::from_millis(1_000),
        "room in {retry_after:?}, expected when the first record expires"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enforces_a_scope_quota_under_concurrency() {
    let store: Arc<dyn FullStore> = Arc::new(
        MemoryStore::new()
            .with_scope_quota(idempotency_core::ScopeQuota::default().with_max_records(5)),
    );
    idempotency_core::conformance::scope_quota_holds_under_concurrency(&store, 5).await;
}

/// A body that is a slice of a larger buffer (tonic encodes each answer into an 8 KiB
/// one) is kept in an allocation of its own: a record that held the buffer would take
/// several kilobytes of memory for a few bytes of answer, beyond what `max_bytes` counts.
#[tokio::test]
async fn a_record_keeps_its_answer_not_the_buffer_it_was_cut_from() {
    let store = MemoryStore::new();
    let long = Duration::from_secs(60);
    let id = RecordId::new("", "sliced");
    let Reservation::Reserved(token) = store.reserve(&id, &binding(), long, long).await.unwrap()
    else {
        panic!("a new key is reserved");
    };
    let buffer = bytes::Bytes::from(vec![7u8; 8192]);
    let answer = idempotency_core::StoredResponse {
        status: 200,
        headers: Vec::new(),
        body: buffer.slice(..10),
        trailers: Vec::new(),
    };
    store.finalize(&id, token, &answer).await.unwrap();
    drop(answer);
    assert!(
        buffer.is_unique(),
        "the store still refers to the 8 KiB buffer its 10-byte answer was cut from"
    );
    let Reservation::Exists(record) = store.reserve(&id, &binding(), long, long).await.unwrap()
    else {
        panic!("the finalized key is found");
    };
    let kept = idempotency_core::StoredResponse {
        status: 200,
        headers: Vec::new(),
        body: bytes::Bytes::from(vec![7u8; 10]),
        trailers: Vec::new(),
    };
    assert_eq!(record.state, idempotency_core::RecordState::Completed(kept));
}
