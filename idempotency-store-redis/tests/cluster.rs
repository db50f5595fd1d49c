//! The store on a real three-primary Redis Cluster that the test creates itself
//! (`redis-cli --cluster create … --cluster-replicas 0 --cluster-yes` over three
//! `redis-server` processes on free ports): the conformance suite and the reference model,
//! records spread over every primary, and two store handles acting as two replicas.

mod common;

use std::sync::Arc;

use common::{RedisCluster, bounded, checks, quota, redis_available};
use idempotency_core::{IdempotencyStore, ScopeQuota};
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
        checks::conformance_suite(
            Arc::new(store.clone()),
            Arc::new(self::store(&cluster).await),
        )
        .await;
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
        checks::sixty_four_racers_over_two_handles_run_once(a, b).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enforces_a_scope_quota_across_two_handles_on_a_cluster() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    bounded(180, async {
        quota::two_handles_race_for_the_last_places(store(&cluster).await, store(&cluster).await)
            .await;
        quota::a_byte_quota_counts_answers(store(&cluster).await).await;
        quota::release_gives_room_back(store(&cluster).await).await;
        quota::expiry_gives_room_back_and_renewal_keeps_it(store(&cluster).await).await;
        quota::the_layer_answers_429_with_retry_after(store(&cluster).await).await;
        quota::every_expired_record_gives_its_bytes_back(store(&cluster).await).await;

        // A scope's records and its accounting keys share one slot (so one primary),
        // while scopes spread over the primaries.
        let quota = ScopeQuota::default().with_max_records(100);
        let store = store(&cluster).await.with_scope_quota(quota);
        let slot = |key: &[u8]| -> String {
            cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", &String::from_utf8_lossy(key)])
        };
        let mut slots = std::collections::HashSet::new();
        for s in 0..30 {
            let scope = format!("tenant-{s}");
            let [expiries, bytes] = store.key_prefix().scope_accounting_keys(&scope);
            let expected = slot(&expiries);
            assert_eq!(slot(&bytes), expected);
            for k in 0..3 {
                let id = idempotency_core::RecordId::new(scope.clone(), format!("key-{k}"));
                assert_eq!(slot(&store.record_key(&id)), expected, "{id:?}");
                store
                    .reserve(&id, &common::binding(), common::LONG, common::LONG)
                    .await
                    .unwrap();
            }
            slots.insert(expected);
        }
        assert!(
            slots.len() > 20,
            "scopes do not spread over slots: {slots:?}"
        );
        for node in &cluster.nodes {
            let keys: u64 = node.cli(&["DBSIZE"]).trim().parse().unwrap();
            assert!(keys > 0, "node {} holds no scope", node.port);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn passes_the_conformance_suite_with_a_scope_quota_on_a_cluster() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    bounded(240, async {
        let quota = ScopeQuota::default()
            .with_max_records(1_000_000)
            .with_max_bytes(1 << 40);
        let store = store(&cluster).await.with_scope_quota(quota);
        checks::conformance_suite(
            Arc::new(store.clone()),
            Arc::new(self::store(&cluster).await.with_scope_quota(quota)),
        )
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_woken_by_shard_notices_on_a_cluster() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    bounded(90, async {
        let scripts_run = || cluster.nodes.iter().map(common::scripts_run).sum::<u64>();
        let kill_subscriptions = || {
            cluster
                .nodes
                .iter()
                .map(common::kill_subscriptions)
                .sum::<u64>()
        };
        checks::waiters_wake_at_once_and_load_about_once_a_second(
            store(&cluster).await,
            store(&cluster).await,
            scripts_run,
            kill_subscriptions,
        )
        .await;
        // With a quota too (another layout: the shard channel follows the record's slot).
        let quota = ScopeQuota::default().with_max_records(100);
        checks::waiters_wake_at_once_and_load_about_once_a_second(
            store(&cluster).await.with_scope_quota(quota),
            store(&cluster).await.with_scope_quota(quota),
            scripts_run,
            kill_subscriptions,
        )
        .await;
    })
    .await;
}

/// The seeded simulation of the layer (see the `simulation` crate) over the cluster:
/// concurrent clients on a few keys, faults between the layer and the store, keys
/// expiring mid-run, every history checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulation_keeps_every_rule_on_a_cluster() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    bounded(180, async {
        let store = Arc::new(store(&cluster).await);
        let target = simulation::Target {
            store: store.clone(),
            purge: Some(store),
            leftovers: None,
            namespace: String::new(),
            effects: None,
            own_faults: None,
            reservations_unseen: false,
        };
        let settings = simulation::Settings {
            clock_tolerance: std::time::Duration::from_millis(50),
            ..simulation::Settings::quick()
        };
        for seed in simulation::seeds(3) {
            simulation::simulate(&target, &settings, seed)
                .await
                .assert_passed("a Redis Cluster");
        }
    })
    .await;
}
