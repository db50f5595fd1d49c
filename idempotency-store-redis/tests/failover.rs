//! Failover: a Redis Cluster with one replica per primary (six `redis-server`
//! processes on loopback), keyed load through the layer from two service instances, a
//! shard's primary killed (SIGKILL) and its replica promoted by the cluster itself; then
//! the killed node is started again and rejoins as the new primary's replica.
//!
//! Each key is sent until it gets an answer, as the Iceberg Java client sends it: the
//! same key on every attempt, up to six attempts, after `Retry-After` on 503, 409 and 429.
//! The first answer of every fourth key is lost on its way back (the client retries), and
//! after the run every key that was answered is sent once more, as a retry whose answer
//! was lost would be; it must be a replay. The handler counts its executions per key
//! outside the store, so "ran twice" is measured where it happens.
//!
//! Counted per run: mutations executed twice, answers lost (a key answered during the run
//! whose record is gone after the failover: its retry ran it again), keys that failed for
//! good (six attempts without an answer), and how long after the kill the last request
//! failed.
//!
//! Two disruptions: the plain kill, and the kill of a primary whose replica lags (its
//! replication link cut 200 ms before: `CLIENT KILL TYPE master` on the replica, with a
//! `masterauth` the primary refuses so that it cannot reconnect; what the primary
//! acknowledged in those 200 ms never reached the replica, as with a network blip or a
//! busy replica. On loopback a replica otherwise lags by well under a millisecond).
//!
//! - `asynchronous_replication_reports_what_a_failover_loses`: the store's default;
//!   the counts are printed (facts about asynchronous replication, not failures of the
//!   layer).
//! - `replica_acks_lose_nothing_in_a_failover`: `RedisOptions::replica_acks(1, 250 ms)`;
//!   no mutation may run twice and no answer may be lost. Also prints what the option
//!   costs per keyed request on this cluster.
//!
//! ```text
//! cargo test -p idempotency-store-redis --test failover -- --nocapture --test-threads 1
//! ```

mod common;
#[path = "../../test-support/keyed_load.rs"]
mod keyed_load;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use common::{RedisCluster, RedisServer, bounded, redis_available};
use idempotency_store_redis::{RedisOptions, RedisStore};

use keyed_load::{Executions, Seen, app, send, send_to, send_until_answered};

/// How often the handler ran, per mutation: kept in the test process, so a record the
/// store lost does not take the evidence with it.
fn options(cluster: &RedisCluster, acks: bool) -> RedisOptions {
    let options = RedisOptions::cluster(cluster.urls())
        .operation_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_millis(500));
    if acks {
        options.replica_acks(1, Duration::from_millis(250))
    } else {
        options
    }
}

/// The disruption's timeline.
struct Failover {
    killed_at: Instant,
    promoted_after: Duration,
    rejoined_after: Duration,
}

/// A primary and its replica, by their places in `cluster.nodes`.
fn a_shard(cluster: &RedisCluster) -> (usize, usize) {
    let nodes = cluster.nodes[0].cli(&["CLUSTER", "NODES"]);
    let lines: Vec<Vec<&str>> = nodes
        .lines()
        .map(|line| line.split_whitespace().collect())
        .collect();
    let place = |address: &str| {
        let port: u16 = address
            .split(['@', ':'])
            .nth(1)
            .and_then(|p| p.parse().ok())
            .expect("a node address");
        cluster
            .nodes
            .iter()
            .position(|node| node.port == port)
            .expect("a node of the cluster")
    };
    let replica = lines
        .iter()
        .find(|fields| fields[2].contains("slave"))
        .expect("a replica");
    let primary = lines
        .iter()
        .find(|fields| fields[0] == replica[3])
        .expect("the replica's primary");
    (place(primary[1]), place(replica[1]))
}

fn info(node: &RedisServer, field: &str) -> Option<String> {
    common::redis_cli(node.port, &["INFO", "replication"])
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{field}:")))
        .map(|value| value.trim().to_owned())
}

/// Kills a shard's primary (after cutting its replica's link, if `lagging`), waits until
/// the cluster promotes the replica, starts the killed node again and waits until it has
/// rejoined as the new primary's replica.
fn fail_over(cluster: &mut RedisCluster, lagging: bool) -> Failover {
    let (primary, replica) = a_shard(cluster);
    if lagging {
        // The replica cannot reconnect with a password its primary does not take, so
        // its link stays down once cut; 200 ms later the primary is killed.
        cluster.nodes[replica].cli(&["CONFIG", "SET", "masterauth", "not-the-password"]);
        cluster.nodes[replica].cli(&["CLIENT", "KILL", "TYPE", "master"]);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            info(&cluster.nodes[replica], "master_link_status").as_deref(),
            Some("down"),
            "the replication link did not stay down"
        );
    }
    cluster.nodes[primary].kill();
    let killed_at = Instant::now();
    let deadline = killed_at + Duration::from_secs(30);
    while info(&cluster.nodes[replica], "role").as_deref() != Some("master") {
        assert!(
            Instant::now() < deadline,
            "the replica was not promoted within 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let promoted_after = killed_at.elapsed();
    cluster.nodes[replica].cli(&["CONFIG", "SET", "masterauth", ""]);
    cluster.nodes[primary].restart();
    while info(&cluster.nodes[primary], "master_link_status").as_deref() != Some("up") {
        assert!(
            Instant::now() < deadline,
            "the killed primary did not rejoin as a replica within 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Failover {
        killed_at,
        promoted_after,
        rejoined_after: killed_at.elapsed(),
    }
}

/// What one run counted.
#[derive(Debug)]
struct Counts {
    keys: usize,
    executed_twice: usize,
    answers_lost: usize,
    failed_for_good: usize,
    refused: usize,
    attempts: usize,
    promoted_after: Duration,
    rejoined_after: Duration,
    last_failure_after_kill: Option<Duration>,
}

/// Runs keyed load from 24 clients over two service instances through a failover of one
/// shard, then sends every answered key once more; counts.
async fn run(acks: bool, lagging: bool) -> Counts {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "off".to_owned()))
        .try_init();
    let cluster = RedisCluster::start_with_replicas(1000);
    let executions = Executions::default();
    let apps = [
        app(
            RedisStore::connect_with(options(&cluster, acks))
                .await
                .unwrap(),
            executions.clone(),
        ),
        app(
            RedisStore::connect_with(options(&cluster, acks))
                .await
                .unwrap(),
            executions.clone(),
        ),
    ];
    let apps = Arc::new(apps);
    let seen = Arc::new(Seen::default());
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..24 {
        let (apps, seen, stop, next) = (apps.clone(), seen.clone(), stop.clone(), next.clone());
        clients.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let n = next.fetch_add(1, Ordering::Relaxed);
                send_until_answered(&apps, n, &seen).await;
            }
        });
    }
    // The failover blocks this worker thread (the clients run on the others); the
    // cluster stays owned by this frame, so a panic anywhere kills its servers.
    let mut cluster = cluster;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let failover = tokio::task::block_in_place(|| fail_over(&mut cluster, lagging));
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    while let Some(client) = clients.join_next().await {
        client.expect("a client panicked");
    }

    // Every key that was answered, sent again (to the instance that did not answer it
    // first, as a retry after a lost answer may be): a replay, or its answer was lost.
    let answered = seen.answered.lock().unwrap().clone();
    let mut answers_lost = 0;
    for name in &answered {
        let mut answer = send(&apps[1], name).await;
        for _ in 0..20 {
            if answer.status.is_success() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
            answer = send(&apps[0], name).await;
        }
        assert!(
            answer.status.is_success(),
            "{name} answers {}",
            answer.status
        );
        if !answer.replayed {
            answers_lost += 1;
        }
    }
    let executed_twice = executions
        .0
        .lock()
        .unwrap()
        .values()
        .filter(|n| **n > 1)
        .count();
    let last_failure = *seen.last_failure.lock().unwrap();
    drop(cluster);
    Counts {
        keys: next.load(Ordering::Relaxed),
        executed_twice,
        answers_lost,
        failed_for_good: seen.gave_up.load(Ordering::Relaxed),
        refused: seen.refused.load(Ordering::Relaxed),
        attempts: seen.attempts.load(Ordering::Relaxed),
        promoted_after: failover.promoted_after,
        rejoined_after: failover.rejoined_after,
        last_failure_after_kill: last_failure
            .and_then(|at| at.checked_duration_since(failover.killed_at)),
    }
}

fn report(configuration: &str, disruption: &str, counts: &Counts) {
    eprintln!(
        "| {configuration} | {disruption} | {} | {} | {} | {} | {} | {} | {:.1} s | {:.1} s | {} |",
        counts.keys,
        counts.attempts,
        counts.executed_twice,
        counts.answers_lost,
        counts.failed_for_good,
        counts.refused,
        counts.promoted_after.as_secs_f64(),
        counts.rejoined_after.as_secs_f64(),
        counts
            .last_failure_after_kill
            .map_or("none".to_owned(), |d| format!("{:.1} s", d.as_secs_f64())),
    );
}

const HEADER: &str = "| Redis | disruption | keys | attempts | executed twice | answers lost | failed for good | 503/409 answers | promoted after | old primary rejoined after | last refusal after the kill |\n|---|---|---|---|---|---|---|---|---|---|---|";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_replication_reports_what_a_failover_loses() {
    if !redis_available() {
        return;
    }
    let started = Instant::now();
    bounded(150, async {
        eprintln!("{HEADER}");
        let plain = run(false, false).await;
        report("asynchronous (default)", "primary killed", &plain);
        let lagging = run(false, true).await;
        report(
            "asynchronous (default)",
            "primary killed, replica 200 ms behind",
            &lagging,
        );
        for counts in [&plain, &lagging] {
            // What must hold whatever replication loses: the load ran through the
            // failover, and every answered key answers again.
            assert!(counts.keys > 100, "the load did not run: {counts:?}");
        }
    })
    .await;
    eprintln!("took {:.0} s", started.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replica_acks_lose_nothing_in_a_failover() {
    if !redis_available() {
        return;
    }
    let started = Instant::now();
    bounded(150, async {
        cost_per_request().await;
        eprintln!("{HEADER}");
        let plain = run(true, false).await;
        report("replica_acks(1, 250 ms)", "primary killed", &plain);
        let lagging = run(true, true).await;
        report(
            "replica_acks(1, 250 ms)",
            "primary killed, replica 200 ms behind",
            &lagging,
        );
        for counts in [&plain, &lagging] {
            assert!(counts.keys > 100, "the load did not run: {counts:?}");
            assert_eq!(
                counts.executed_twice, 0,
                "with replica acknowledgement a mutation ran twice: {counts:?}"
            );
            assert_eq!(
                counts.answers_lost, 0,
                "with replica acknowledgement an answer was lost: {counts:?}"
            );
            assert!(
                counts.refused > 0,
                "no request met the failover: the test tested nothing: {counts:?}"
            );
        }
    })
    .await;
    eprintln!("took {:.0} s", started.elapsed().as_secs_f64());
}

/// Keyed requests one after the other through the layer on the cluster, with and
/// without `replica_acks(1, …)`, interleaved in rounds; prints the mean and p99 latency
/// of each.
async fn cost_per_request() {
    let cluster = RedisCluster::start_with_replicas(5000);
    let executions = Executions::default();
    let plain = app(
        RedisStore::connect_with(options(&cluster, false))
            .await
            .unwrap(),
        executions.clone(),
    );
    let acked = app(
        RedisStore::connect_with(options(&cluster, true))
            .await
            .unwrap(),
        executions.clone(),
    );
    let cost = |app: Router, prefix: &'static str| async move {
        let mut took = Vec::new();
        for n in 0..300 {
            let name = format!("{prefix}{n}");
            let started = Instant::now();
            let answer = send_to(&app, "quick", &name).await;
            took.push(started.elapsed());
            assert_eq!(answer.status, StatusCode::CREATED);
        }
        took
    };
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for round in 0..3 {
        without.extend(cost(plain.clone(), ["a", "b", "c"][round]).await);
        with.extend(cost(acked.clone(), ["x", "y", "z"][round]).await);
    }
    let summary = |took: &mut Vec<Duration>| {
        took.sort();
        let mean = took.iter().sum::<Duration>() / took.len() as u32;
        let p99 = took[took.len() * 99 / 100];
        (mean, p99)
    };
    let (mean_without, p99_without) = summary(&mut without);
    let (mean_with, p99_with) = summary(&mut with);
    // 16 clients at once, 100 keys each, through one service instance.
    let throughput = |app: Router, prefix: &'static str| async move {
        let started = Instant::now();
        let clients = (0..16).map(|client| {
            let app = app.clone();
            async move {
                for n in 0..100 {
                    let answer = send_to(&app, "quick", &format!("{prefix}{client}-{n}")).await;
                    assert_eq!(answer.status, StatusCode::CREATED);
                }
            }
        });
        futures_util::future::join_all(clients).await;
        1600.0 / started.elapsed().as_secs_f64()
    };
    let mut rates = [Vec::new(), Vec::new()];
    for round in 0..3 {
        rates[0].push(throughput(plain.clone(), ["pa", "pb", "pc"][round]).await);
        rates[1].push(throughput(acked.clone(), ["qa", "qb", "qc"][round]).await);
    }
    let median = |rates: &mut Vec<f64>| {
        rates.sort_by(f64::total_cmp);
        rates[rates.len() / 2]
    };
    let (rate_without, rate_with) = (median(&mut rates[0]), median(&mut rates[1]));
    eprintln!(
        "keyed request (reserve, a handler that takes no time, finalize), one at a time, {} each:\n\
         | Redis store | mean | p99 |\n|---|---|---|\n\
         | asynchronous (default) | {:.2} ms | {:.2} ms |\n\
         | replica_acks(1, 250 ms) | {:.2} ms | {:.2} ms |\n\
         cost of the acknowledgement: {:+.2} ms mean per request (two WAITs)\n\
         16 clients at once, 1,600 keyed requests, median of 3 rounds: {:.0} requests/s \
         asynchronous, {:.0} requests/s with replica_acks ({:.2}x)",
        without.len(),
        mean_without.as_secs_f64() * 1e3,
        p99_without.as_secs_f64() * 1e3,
        mean_with.as_secs_f64() * 1e3,
        p99_with.as_secs_f64() * 1e3,
        (mean_with.as_secs_f64() - mean_without.as_secs_f64()) * 1e3,
        rate_without,
        rate_with,
        rate_with / rate_without,
    );
}
