//! The memory store against the shared conformance suite, plus its own capacity rules.

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Binding, IdempotencyStore, RecordId, Reservation, StoreError};
use idempotency_store_memory::MemoryStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_conformance_suite() {
    let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    idempotency_core::conformance::run_all(&store).await;
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
    assert!(matches!(error, StoreError::Full { max_entries: 3 }));
    assert!(error.to_string().contains("raise max_entries"));
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
    let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
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
    let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::from_config(&config));
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
