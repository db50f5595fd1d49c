//! The store on a real three-primary Redis Cluster that the test creates itself
//! (`redis-cli --cluster create … --cluster-replicas 0 --cluster-yes` over three
//! `redis-server` processes on free ports): the conformance suite and the reference model,
//! records spread over every primary, and two store handles acting as two replicas.

mod common;

use std::sync::Arc;

use common::{RedisCluster, bounded, checks, redis_available};
use idempotency_core::IdempotencyStore;
use idempotency_store_redis::{RedisOptions, RedisStore};

async fn store(cluster: &RedisCluster) -> RedisStore {
    RedisStore::connect_with(RedisOptions::cluster(cluster.urls()))
        .await
        .unwrap_or_else(|error| panic!("connect to the test cluster: {error}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_conformance_suite_and_the_model_on_a_cluster() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    bounded(240, async {
        let store = store(&cluster).await;
        checks::conformance_suite(Arc::new(store.clone())).await;
        checks::reference_model(Arc::new(store.clone()), 2_000, 100).await;
        checks::expiry_is_native(&store).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_spread_over_every_primary() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    bounded(60, async {
        // Through the one-string form a flag or config file uses.
        let store = RedisStore::connect(&cluster.cluster_url()).await.unwrap();
        for _ in 0..60 {
            let id = common::id();
            assert!(matches!(
                store
                    .reserve(&id, &common::binding(), common::LONG, common::LONG)
                    .await
                    .unwrap(),
                idempotency_core::Reservation::Reserved(_)
            ));
        }
        for node in &cluster.nodes {
            let keys: u64 = node.cli(&["DBSIZE"]).trim().parse().unwrap();
            assert!(
                keys > 0,
                "node {} holds no record: records are not spread by slot",
                node.port
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_store_handles_act_as_two_replicas_on_a_cluster() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    bounded(120, async {
        let (a, b) = (store(&cluster).await, store(&cluster).await);
        checks::two_handles(Arc::new(a.clone()), Arc::new(b.clone())).await;
        checks::sixty_four_racers_over_two_handles_run_once(a, b).await;
    })
    .await;
}
