//! The store on one real `redis-server` (started by the test on a free port, with the
//! append-only file on): the conformance suite, the reference model, native expiry, and
//! two store handles acting as two replicas, directly and through the layer.

mod common;

use std::sync::Arc;

use common::{RedisServer, bounded, checks, quota, redis_available};
use idempotency_core::ScopeQuota;
use idempotency_store_redis::RedisStore;

async fn store(server: &RedisServer) -> RedisStore {
    RedisStore::connect(&server.url())
        .await
        .unwrap_or_else(|error| panic!("connect to the test server: {error}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_conformance_suite() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(120, async {
        checks::conformance_suite(
            Arc::new(store(&server).await),
            Arc::new(store(&server).await),
        )
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matches_the_reference_model_on_random_sequences() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(120, async {
        checks::reference_model(Arc::new(store(&server).await), 1_000, 200).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_expire_natively_and_are_readable_hashes() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(60, async {
        checks::expiry_is_native(&store(&server).await).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_store_handles_act_as_two_replicas() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(120, async {
        let (a, b) = (store(&server).await, store(&server).await);
        checks::sixty_four_racers_over_two_handles_run_once(a, b).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enforces_a_scope_quota_across_two_handles() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(120, async {
        quota::two_handles_race_for_the_last_places(store(&server).await, store(&server).await)
            .await;
        quota::a_byte_quota_counts_answers(store(&server).await).await;
        quota::release_gives_room_back(store(&server).await).await;
        quota::expiry_gives_room_back_and_renewal_keeps_it(store(&server).await).await;
        quota::the_layer_answers_429_with_retry_after(store(&server).await).await;
        quota::every_expired_record_gives_its_bytes_back(store(&server).await).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_conformance_suite_and_the_model_with_a_scope_quota() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(180, async {
        // A quota no check reaches: the layout by scope must keep every other rule.
        let quota = ScopeQuota::default()
            .with_max_records(1_000_000)
            .with_max_bytes(1 << 40);
        let one = store(&server).await.with_scope_quota(quota);
        checks::conformance_suite(
            Arc::new(one.clone()),
            Arc::new(store(&server).await.with_scope_quota(quota)),
        )
        .await;
        checks::reference_model(Arc::new(one.clone()), 5_000, 100).await;
        checks::expiry_is_native(&one).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_woken_by_notices_and_cost_about_a_load_a_second() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(60, async {
        checks::waiters_wake_at_once_and_load_about_once_a_second(
            store(&server).await,
            store(&server).await,
            || common::scripts_run(&server),
            || common::kill_subscriptions(&server),
        )
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_subscription_waiters_poll() {
    use std::time::Duration;

    use idempotency_core::{IdempotencyStore, Ownership, Reservation};
    use tokio::time::Instant;

    if !redis_available() {
        return;
    }
    // A server (or a proxy) that does not let clients subscribe.
    let server = RedisServer::start_with(&["--rename-command", "SUBSCRIBE", ""]);
    bounded(60, async {
        let owner = store(&server).await;
        let waiters_node = store(&server).await;
        let id = common::id();
        let Reservation::Reserved(token) = owner
            .reserve(&id, &common::binding(), common::LONG, common::LONG)
            .await
            .unwrap()
        else {
            panic!("a fresh key was not reserved")
        };
        let started = Instant::now();
        let waiter = {
            let id = id.clone();
            tokio::spawn(async move { waiters_node.wait(&id, Duration::from_secs(20)).await })
        };
        // Half way between two looks of a waiter that looks once a second.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let finalized_at = Instant::now();
        assert_eq!(
            owner
                .finalize(&id, token, &common::response(b"done"))
                .await
                .unwrap(),
            Ownership::Held
        );
        assert!(matches!(
            waiter.await.unwrap().unwrap(),
            idempotency_core::Waited::Settled(_)
        ));
        // Polling looks every 200 ms at most; looking once a second would take longer.
        let woken_after = finalized_at.elapsed();
        assert!(
            woken_after < Duration::from_millis(400),
            "a polling waiter woke {woken_after:?} after the finalize ({:?} after it started)",
            started.elapsed()
        );
    })
    .await;
}
