//! Replica acknowledgements as an operator turns them on (the store URL's `replica-acks`
//! parameter, the `idempotency-redis-replica-acks` property), on a primary with one
//! replica of the test's own: the store's writes make the primary `WAIT`, what the store
//! acknowledged is on the replica, too few replicas fail closed, and a pending `WAIT`
//! holds up no other request.

mod common;

use std::time::{Duration, Instant};

use common::{RedisServer, binding, bounded, redis_available, response};
use idempotency_core::config::IdempotencyConfig;
use idempotency_core::{IdempotencyStore, Ownership, RecordId, Reservation};
use idempotency_store_redis::{RedisOptions, RedisStore};

const LEASE: Duration = Duration::from_secs(30);
const LIFETIME: Duration = Duration::from_secs(600);

/// A primary (which starts a replica's sync at once) and its replica, online.
fn primary_and_replica() -> (RedisServer, RedisServer) {
    let primary = RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]);
    // Without its own append-only file: its acknowledgements then do not wait for its
    // disk, which other processes on a test machine may keep busy.
    let replica = RedisServer::start_with(&[
        "--replicaof",
        "127.0.0.1",
        &primary.port.to_string(),
        "--appendonly",
        "no",
    ]);
    let deadline = Instant::now() + Duration::from_secs(30);
    // Online: the primary counts a replica's acknowledgements only once it has heard
    // from it after the first sync (up to a second after the replica's link is up).
    while !(info(&primary, "slave0").is_some_and(|slave| slave.contains("state=online"))
        && info(&replica, "master_link_status").as_deref() == Some("up"))
    {
        assert!(
            Instant::now() < deadline,
            "the replica did not sync within 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (primary, replica)
}

fn info(server: &RedisServer, field: &str) -> Option<String> {
    server
        .cli(&["INFO", "replication"])
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{field}:")))
        .map(|value| value.trim().to_owned())
}

/// How many `WAIT`s the server has run.
fn waits_run(server: &RedisServer) -> u64 {
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_wait:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// Reserves and finalizes a fresh key; answers its id.
async fn execute(store: &RedisStore, key: &str) -> RecordId {
    let id = RecordId::new("", key);
    let Reservation::Reserved(token) = store
        .reserve(&id, &binding(), LEASE, LIFETIME)
        .await
        .unwrap()
    else {
        panic!("{key} was not reserved");
    };
    assert_eq!(
        store
            .finalize(&id, token, &response(b"{\"ok\":true}"))
            .await
            .unwrap(),
        Ownership::Held
    );
    id
}

/// Each acknowledged write made the primary `WAIT`, and once the store answered, the
/// record was on the replica.
async fn acknowledged_writes_are_on_the_replica(
    store: &RedisStore,
    primary: &RedisServer,
    replica: &RedisServer,
) {
    let before = waits_run(primary);
    for n in 0..20 {
        let id = execute(store, &format!("acked-{n}")).await;
        let on_replica = replica.cli(&[
            "HGET",
            std::str::from_utf8(&store.record_key(&id)).unwrap(),
            "response_status",
        ]);
        assert_eq!(
            on_replica.trim(),
            "201",
            "record {n} was acknowledged but is not on the replica"
        );
    }
    let waits = waits_run(primary) - before;
    assert!(
        waits >= 40,
        "20 reserves and 20 finalizes made the primary run {waits} WAITs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_url_turns_replica_acknowledgement_on() {
    if !redis_available() {
        return;
    }
    bounded(60, async {
        let (primary, replica) = primary_and_replica();
        let url = format!("{}?replica-acks=1&replica-ack-timeout=2s", primary.url());
        let store = RedisStore::connect(&url).await.unwrap();
        assert_eq!(
            store.replica_acks().map(|acks| acks.replicas),
            Some(1),
            "the URL parameter did not reach the store"
        );
        acknowledged_writes_are_on_the_replica(&store, &primary, &replica).await;

        // Without the parameter the store never waits.
        let plain = RedisStore::connect(&primary.url()).await.unwrap();
        let before = waits_run(&primary);
        execute(&plain, "plain").await;
        assert_eq!(waits_run(&primary), before);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_properties_turn_replica_acknowledgement_on() {
    if !redis_available() {
        return;
    }
    bounded(60, async {
        let (primary, replica) = primary_and_replica();
        let config = IdempotencyConfig::from_properties([
            ("idempotency-enabled", "true".to_owned()),
            ("idempotency-store-type", "redis".to_owned()),
            ("idempotency-redis-url", primary.url()),
            ("idempotency-redis-replica-acks", "1".to_owned()),
            ("idempotency-redis-replica-ack-timeout", "PT2S".to_owned()),
            ("idempotency-redis-key-prefix", "props:".to_owned()),
        ])
        .unwrap();
        let store = idempotency_store_redis::open(&config).await.unwrap();
        assert_eq!(store.key_prefix().as_str(), "props:");
        acknowledged_writes_are_on_the_replica(&store, &primary, &replica).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_few_replicas_fail_closed_and_leave_no_reservation() {
    if !redis_available() {
        return;
    }
    bounded(60, async {
        let (primary, _replica) = primary_and_replica();
        // Two acknowledgements asked for, one replica there.
        let url = format!("{}?replica-acks=2&replica-ack-timeout=100ms", primary.url());
        let store = RedisStore::connect(&url).await.unwrap();
        let id = RecordId::new("", "refused");
        let error = store
            .reserve(&id, &binding(), LEASE, LIFETIME)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("Redis reserve was acknowledged by"),
            "{error}"
        );
        assert!(
            error.contains("fewer than the 2 RedisOptions::replica_acks asks for"),
            "{error}"
        );
        // The reservation it made was let go: the key is free for the retry.
        let plain = RedisStore::connect(&primary.url()).await.unwrap();
        assert!(plain.load(&id).await.unwrap().is_none());
    })
    .await;
}

/// A takeover the replicas did not acknowledge fails closed like a reservation: the
/// record it took over is let go (no request ran under the new token), so the key is free
/// for the retry at once instead of held until the new lease lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_too_few_replicas_acknowledged_is_let_go() {
    if !redis_available() {
        return;
    }
    bounded(60, async {
        let (primary, _replica) = primary_and_replica();
        let plain = RedisStore::connect(&primary.url()).await.unwrap();
        let id = RecordId::new("", "taken-over-unacknowledged");
        let Reservation::Reserved(lapsed) = plain
            .reserve(&id, &binding(), Duration::from_millis(50), LIFETIME)
            .await
            .unwrap()
        else {
            panic!("a fresh key was not reserved");
        };
        tokio::time::sleep(Duration::from_millis(150)).await;
        // Two acknowledgements asked for, one replica there.
        let url = format!("{}?replica-acks=2&replica-ack-timeout=100ms", primary.url());
        let store = RedisStore::connect(&url).await.unwrap();
        let error = store
            .take_over(&id, lapsed, LEASE)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("Redis take_over was acknowledged by"),
            "{error}"
        );
        assert!(
            plain.load(&id).await.unwrap().is_none(),
            "the record of an unacknowledged takeover is still there"
        );
    })
    .await;
}

/// While writes wait for a replica that does not answer, the store's other requests go
/// through at once, and the waiting writes wait side by side, not one after the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_wait_holds_up_no_other_request() {
    if !redis_available() {
        return;
    }
    bounded(60, async {
        let (primary, replica) = primary_and_replica();
        let ack_timeout = Duration::from_millis(1500);
        let store = RedisStore::connect_with(
            RedisOptions::server(primary.url())
                .replica_acks(1, ack_timeout)
                .operation_timeout(Duration::from_secs(10)),
        )
        .await
        .unwrap();
        let done = execute(&store, "done-before").await;
        // The replica's link cut, and kept down: it cannot reconnect with a password
        // its primary refuses.
        replica.cli(&["CONFIG", "SET", "masterauth", "not-the-password"]);
        replica.cli(&["CLIENT", "KILL", "TYPE", "master"]);

        let started = Instant::now();
        let writes: Vec<_> = (0..8)
            .map(|n| {
                let store = store.clone();
                tokio::spawn(async move {
                    store
                        .reserve(
                            &RecordId::new("", format!("stuck-{n}")),
                            &binding(),
                            LEASE,
                            LIFETIME,
                        )
                        .await
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(200)).await;
        // A read meanwhile (a replay is a reserve, a write: it would wait for a lane).
        let loaded_at = Instant::now();
        let record = store.load(&done).await.unwrap();
        let load_took = loaded_at.elapsed();
        assert!(record.is_some());
        assert!(
            load_took < ack_timeout / 2,
            "a load waited {load_took:?} behind the pending WAITs"
        );
        for write in writes {
            let error = write.await.unwrap().unwrap_err().to_string();
            assert!(error.contains("acknowledged by 0 replica(s)"), "{error}");
        }
        let all_took = started.elapsed();
        // One after the other they would take 8 × 1.5 s.
        assert!(
            all_took < ack_timeout * 3,
            "8 writes waiting for a silent replica took {all_took:?}"
        );
    })
    .await;
}
