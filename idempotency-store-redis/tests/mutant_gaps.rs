//! Checks that cargo-mutants found missing on one real `redis-server` (see TESTING.md,
//! "Mutation testing"): what the store's waiters do with the notices of other keys.

mod common;

use std::time::Duration;

use common::{LONG, RedisServer, binding, bounded, id, redis_available, response};
use idempotency_core::{IdempotencyStore, Ownership, RecordId, Reservation, Waited};
use idempotency_store_redis::RedisStore;

async fn store(server: &RedisServer) -> RedisStore {
    RedisStore::connect(&server.url())
        .await
        .unwrap_or_else(|error| panic!("connect to the test server: {error}"))
}

async fn reserve_new(store: &RedisStore, id: &RecordId) -> idempotency_core::FencingToken {
    match store.reserve(id, &binding(), LONG, LONG).await.unwrap() {
        Reservation::Reserved(token) => token,
        other => panic!("a fresh key answered {other:?}"),
    }
}

/// On a single server every record's notice comes on one channel: a waiter looks at its
/// record again for its own key's notice, not for every other key's. 10 waiters on one
/// key while 100 other keys are finalized cost about a load a second each, not one per
/// notice (1 000).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_do_not_look_again_for_other_keys_notices() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(60, async {
        let owner = store(&server).await;
        let waiters_node = store(&server).await;
        let waited = id();
        let token = reserve_new(&owner, &waited).await;
        // Subscribe (and load the scripts) first, so that the count below is the waiters'.
        waiters_node.wait(&waited, Duration::ZERO).await.unwrap();
        let waiters: Vec<_> = (0..10)
            .map(|_| {
                let store = waiters_node.clone();
                let id = waited.clone();
                tokio::spawn(async move { store.wait(&id, Duration::from_secs(20)).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = common::scripts_run(&server);
        for _ in 0..100 {
            let other = id();
            let token = reserve_new(&owner, &other).await;
            assert_eq!(
                owner
                    .finalize(&other, token, &response(b"other"))
                    .await
                    .unwrap(),
                Ownership::Held
            );
        }
        assert_eq!(
            owner
                .finalize(&waited, token, &response(b"done"))
                .await
                .unwrap(),
            Ownership::Held
        );
        for waiter in waiters {
            assert!(matches!(waiter.await.unwrap().unwrap(), Waited::Settled(_)));
        }
        let spent = common::scripts_run(&server) - before;
        // The owner's 201 scripts; each waiter one load when woken, and one a second
        // meanwhile (the 100 finalizes take well under 3 s, even on a loaded machine).
        assert!(
            spent <= 201 + 10 * 4,
            "10 waiters ran {} scripts while 100 other keys settled",
            spent - 201
        );
    })
    .await;
}
