//! Bad input at connect: each mistake gets an error that says what to fix, within a
//! bounded time, and never shows a password.

mod common;

use std::time::{Duration, Instant};

use common::{RedisServer, bounded, redis_available};
use idempotency_store_redis::{ConnectError, OptionsError, RedisOptions, RedisStore};

fn quick(options: RedisOptions) -> RedisOptions {
    options
        .connect_timeout(Duration::from_millis(300))
        .operation_timeout(Duration::from_millis(300))
}

#[tokio::test]
async fn a_url_that_does_not_parse_says_how_to_write_one() {
    let error = RedisStore::connect("redis://app:hunter2@127.0.0.1:not-a-port")
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(error, ConnectError::InvalidUrl { .. }),
        "{error:?}"
    );
    assert!(
        message.contains("redis://[user:password@]host:port"),
        "{message}"
    );
    assert!(!message.contains("hunter2"), "{message}");

    let error = RedisStore::connect("http://127.0.0.1:6379")
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            ConnectError::InvalidOptions(OptionsError::UnsupportedUrl(_))
        ),
        "{error:?}"
    );
    assert!(error.to_string().contains("redis+cluster://"), "{error}");

    let error = RedisStore::connect_with(RedisOptions::cluster([
        "redis://127.0.0.1:7000",
        "nonsense",
    ]))
    .await
    .unwrap_err();
    assert!(
        matches!(error, ConnectError::InvalidUrl { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("nonsense"), "{error}");

    let error = RedisStore::connect_with(RedisOptions::cluster(Vec::<String>::new()))
        .await
        .unwrap_err();
    assert!(matches!(error, ConnectError::NoClusterNodes), "{error:?}");

    let error = RedisOptions::server("redis://127.0.0.1:6379")
        .key_prefix("app:{tag}:")
        .unwrap_err();
    assert!(error.to_string().contains("hash tag"), "{error}");
}

#[tokio::test]
async fn a_port_nobody_listens_on_fails_fast_and_says_to_start_the_server() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let started = Instant::now();
    let error = RedisStore::connect_with(quick(RedisOptions::server(format!(
        "redis://127.0.0.1:{port}"
    ))))
    .await
    .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        matches!(error, ConnectError::Unreachable { .. }),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(message.contains("start the server"), "{message}");
    assert!(message.contains(&port.to_string()), "{message}");
}

#[tokio::test]
async fn a_server_that_never_answers_times_out_with_a_clear_error() {
    // Accepts connections and reads, but never writes a byte back.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let started = Instant::now();
    for options in [
        RedisOptions::server(format!("redis://127.0.0.1:{port}")),
        RedisOptions::cluster([format!("redis://127.0.0.1:{port}")]),
    ] {
        let error = bounded(20, RedisStore::connect_with(quick(options)))
            .await
            .unwrap_err();
        assert!(
            matches!(error, ConnectError::Unreachable { .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains("within"), "{error}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    silent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_policy_is_refused_unless_accepted() {
    if !redis_available() {
        return;
    }
    for policy in ["volatile-lru", "allkeys-lru", "volatile-ttl"] {
        let server = RedisServer::start_with(&["--maxmemory-policy", policy]);
        let error = RedisStore::connect(&server.url()).await.unwrap_err();
        assert!(
            matches!(error, ConnectError::EvictingPolicy { .. }),
            "{error:?}"
        );
        let message = error.to_string();
        assert!(message.contains(policy), "{message}");
        assert!(message.contains("noeviction"), "{message}");
        assert!(message.contains("accept_evicting_policy"), "{message}");
        RedisStore::connect_with(RedisOptions::server(server.url()).accept_evicting_policy(true))
            .await
            .expect("an evicting policy the user accepted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_missing_slots_is_refused_with_the_missing_ranges() {
    if !redis_available() {
        return;
    }
    // A one-node cluster that serves every slot but 16001-16383.
    let node = RedisServer::start_with(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
    ]);
    node.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16000"]);
    let error = bounded(
        30,
        RedisStore::connect_with(RedisOptions::cluster([node.url()])),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, ConnectError::MissingSlots { .. }),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(message.contains("16001-16383"), "{message}");
    assert!(message.contains("16001 of 16384"), "{message}");
    assert!(message.contains("redis-cli --cluster fix"), "{message}");

    // The same node with single-server options: told to connect as a cluster.
    let error = RedisStore::connect(&node.url()).await.unwrap_err();
    assert!(
        matches!(error, ConnectError::IsACluster { .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("RedisOptions::cluster"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_options_on_a_plain_server_are_refused() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let error = bounded(
        30,
        RedisStore::connect_with(RedisOptions::cluster([server.url()])),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, ConnectError::NotACluster { .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("RedisOptions::server"),
        "{error}"
    );
}

/// Collects what the store logs, for the warnings it gives at connect.
#[derive(Clone, Default)]
struct Logged(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logged {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// `replica_acks` on a server without replicas: a warning at connect, and every write
/// fails closed (the reservation it made let go at once); once a replica is attached,
/// writes go through.
#[tokio::test]
async fn replica_acks_without_replicas_warn_at_connect_and_fail_closed() {
    if !redis_available() {
        return;
    }
    let logged = Logged::default();
    let writer = logged.clone();
    let _guard = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .finish(),
    );
    let server = RedisServer::start();
    bounded(60, async {
        let store = RedisStore::connect_with(
            quick(RedisOptions::server(server.url())).replica_acks(1, Duration::from_millis(50)),
        )
        .await
        .expect("a server without replicas is accepted, with a warning");
        let warning = logged.text();
        assert!(
            warning.contains("fewer connected replicas than RedisOptions::replica_acks"),
            "no warning at connect: {warning:?}"
        );
        assert!(warning.contains("connected_replicas=0"), "{warning}");

        use idempotency_core::IdempotencyStore as _;
        let id = common::id();
        let error = store
            .reserve(&id, &common::binding(), common::LONG, common::LONG)
            .await
            .expect_err("a reservation no replica acknowledged must fail");
        let message = error.to_string();
        assert!(
            message.contains("acknowledged by 0 replica(s)"),
            "{message}"
        );
        assert_eq!(
            store.load(&id).await.unwrap(),
            None,
            "the unacknowledged reservation was not let go"
        );

        // A replica attached: the same writes go through, and the warning is gone.
        let replica =
            RedisServer::start_with(&["--replicaof", "127.0.0.1", &server.port.to_string()]);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !replica
            .cli(&["INFO", "replication"])
            .contains("master_link_status:up")
        {
            assert!(Instant::now() < deadline, "the replica did not sync");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let before = logged.text().len();
        let store = RedisStore::connect_with(
            quick(RedisOptions::server(server.url())).replica_acks(1, Duration::from_millis(250)),
        )
        .await
        .unwrap();
        assert!(
            !logged.text()[before..].contains("replica_acks"),
            "a warning although a replica is connected"
        );
        let id = common::id();
        assert!(matches!(
            store
                .reserve(&id, &common::binding(), common::LONG, common::LONG)
                .await
                .unwrap(),
            idempotency_core::Reservation::Reserved(_)
        ));
        assert!(
            replica
                .cli(&["EXISTS", &String::from_utf8_lossy(&store.record_key(&id))])
                .trim()
                == "1",
            "the acknowledged reservation is not on the replica"
        );
    })
    .await;
}
