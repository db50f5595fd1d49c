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
        checks::conformance_suite(Arc::new(store(&server).await)).await;
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
        checks::two_handles(Arc::new(a.clone()), Arc::new(b.clone())).await;
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
        checks::conformance_suite(Arc::new(one.clone())).await;
        checks::reference_model(Arc::new(one.clone()), 5_000, 100).await;
        checks::expiry_is_native(&one).await;
        checks::two_handles(
            Arc::new(one.clone()),
            Arc::new(store(&server).await.with_scope_quota(quota)),
        )
        .await;
    })
    .await;
}

/// The server's count of `EVALSHA` calls so far (every store operation is one).
fn scripts_run(server: &RedisServer) -> u64 {
    let stats = server.cli(&["INFO", "commandstats"]);
    let line = stats
        .lines()
        .find(|line| line.starts_with("cmdstat_evalsha:"))
        .unwrap_or_else(|| panic!("no EVALSHA in {stats}"));
    line["cmdstat_evalsha:calls=".len()..]
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_woken_by_notices_and_cost_about_a_load_a_second() {
    use std::time::Duration;

    use idempotency_core::{IdempotencyStore, Ownership, RecordState, Reservation};
    use tokio::time::Instant;

    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    bounded(60, async {
        let owner = store(&server).await;
        // The waiters' replica: a connection (and a subscription) of its own.
        let waiters_node = store(&server).await;
        let reserve = |id| {
            let owner = owner.clone();
            async move {
                match owner
                    .reserve(&id, &common::binding(), common::LONG, common::LONG)
                    .await
                    .unwrap()
                {
                    Reservation::Reserved(token) => token,
                    other => panic!("a fresh key answered {other:?}"),
                }
            }
        };
        let id = common::id();
        let token = reserve(id.clone()).await;
        // Start the subscription (and load the scripts) first, so that the count below is
        // the waiters' alone.
        waiters_node.wait(&id, Duration::ZERO).await.unwrap();
        let before = scripts_run(&server);
        let waiters: Vec<_> = (0..50)
            .map(|_| {
                let store = waiters_node.clone();
                let id = id.clone();
                tokio::spawn(async move { store.wait(&id, Duration::from_secs(20)).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let finalized_at = Instant::now();
        assert_eq!(
            owner
                .finalize(&id, token, &common::response(b"done"))
                .await
                .unwrap(),
            Ownership::Held
        );
        for waiter in waiters {
            let record = waiter
                .await
                .unwrap()
                .unwrap()
                .expect("the finalized record");
            assert_eq!(
                record.state,
                RecordState::Completed(common::response(b"done"))
            );
        }
        let woken_after = finalized_at.elapsed();
        let spent = scripts_run(&server) - before;
        // Without a notice a waiter looks again after 1 s at the latest.
        assert!(
            woken_after < Duration::from_millis(300),
            "waiters woke {woken_after:?} after the finalize"
        );
        // Polling (5 ms doubling to 200 ms) would be about 17 loads per waiter in 3 s;
        // listening is one at the start, one a second, one when woken.
        assert!(
            spent <= 50 * 6 + 1,
            "50 waiters ran {spent} scripts in 3 s of waiting"
        );

        // A release wakes its waiters too, who then find no record.
        let released = common::id();
        let token = reserve(released.clone()).await;
        let waiter = {
            let store = waiters_node.clone();
            let id = released.clone();
            tokio::spawn(async move { store.wait(&id, Duration::from_secs(20)).await })
        };
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let released_at = Instant::now();
        assert_eq!(
            owner.release(&released, token).await.unwrap(),
            Ownership::Held
        );
        assert!(waiter.await.unwrap().unwrap().is_none());
        let woken_after = released_at.elapsed();
        assert!(
            woken_after < Duration::from_millis(300),
            "a waiter woke {woken_after:?} after the release"
        );
    })
    .await;
}
