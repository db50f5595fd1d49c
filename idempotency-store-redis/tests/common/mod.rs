//! Real Redis servers for the tests: each test starts its own `redis-server` processes on
//! free ports of 127.0.0.1 (a single server, or a three-primary cluster made with
//! `redis-cli --cluster create`), in a temporary directory, with the append-only file
//! flushed on every write, and kills them when it ends (also when it fails).
//!
//! Without the `redis-server` binary a test is skipped with a notice, except under
//! `CI=true`, where that is a failure.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

pub mod checks;
pub mod quota;

use idempotency_core::{Binding, Bytes, RecordId, StoredResponse};

pub const LONG: Duration = Duration::from_secs(60);

/// Runs a test body with a hard bound on its time, so a hung server cannot hang CI.
pub async fn bounded<T>(seconds: u64, test: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(seconds), test)
        .await
        .unwrap_or_else(|_| panic!("the test did not finish within {seconds} s"))
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Whether `redis-server` and `redis-cli` can be run; under `CI=true` their absence
/// fails the test, elsewhere it skips it with a notice.
pub fn redis_available() -> bool {
    let found = ["redis-server", "redis-cli"].iter().all(|binary| {
        Command::new(binary)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    });
    if !found {
        let message = "redis-server / redis-cli not found: install Redis 7 \
                       (apt-get install redis-server) to run the Redis store tests";
        if in_ci() {
            panic!("{message} (CI=true: this is a failure, not a skip)");
        }
        eprintln!("SKIPPED: {message}");
    }
    found
}

/// A port that is free on 127.0.0.1, and whose cluster bus port (+10000) is free too.
fn free_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 500) as u16 * 19;
    for _ in 0..2_000 {
        let port = 20_000 + (base + NEXT.fetch_add(1, Ordering::Relaxed) * 7) % 10_000;
        if TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
        {
            return port;
        }
    }
    panic!("no free port pair found on 127.0.0.1 between 20000 and 39999");
}

/// One `redis-server` process with its own directory; killed on drop.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    _tempdir: Option<tempfile::TempDir>,
}

impl RedisServer {
    /// A single server with `appendonly yes`, `appendfsync always`, `noeviction`.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A single server with extra `redis-server` arguments (`--name value` pairs).
    pub fn start_with(extra: &[&str]) -> Self {
        let tempdir = tempfile::tempdir().expect("a temporary directory");
        let dir = tempdir.path().to_path_buf();
        let mut server = Self {
            child: None,
            port: 0,
            dir,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            _tempdir: Some(tempdir),
        };
        for attempt in 0.. {
            server.port = free_port();
            server.spawn();
            if server.wait_ready(Duration::from_secs(20)) {
                return server;
            }
            server.kill();
            assert!(attempt < 3, "redis-server did not start:\n{}", server.log());
        }
        unreachable!()
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.join("stdout.log")).expect("log file");
        let child = Command::new("redis-server")
            .current_dir(&self.dir)
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&self.dir)
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .args(["--save", ""])
            .args(["--maxmemory-policy", "noeviction"])
            .args(["--logfile", "redis.log"])
            .args(&self.extra)
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
    }

    /// Waits until the server answers PING with PONG (not LOADING).
    fn wait_ready(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(child) = &mut self.child
                && let Ok(Some(_)) = child.try_wait()
            {
                return false;
            }
            if ping(self.port) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL: no chance to flush anything it had not flushed).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the killed server again on the same port and directory, and waits until it
    /// has loaded its append-only file.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
        assert!(
            self.wait_ready(Duration::from_secs(20)),
            "redis-server did not come back:\n{}",
            self.log()
        );
    }

    /// Runs `redis-cli` against this server and returns what it printed.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
            + &std::fs::read_to_string(self.dir.join("stdout.log")).unwrap_or_default()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "---- log of redis-server on {} ----\n{}",
                self.port,
                self.log()
            );
        }
    }
}

/// Runs `redis-cli` against the server on `port` and returns what it printed.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    assert!(
        output.status.success(),
        "redis-cli {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn ping(port: u16) -> bool {
    let Ok(mut stream) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
    else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut answer = [0u8; 7];
    stream.read_exact(&mut answer).is_ok() && &answer == b"+PONG\r\n"
}

/// A Redis Cluster of three primaries (no replicas), made by `redis-cli --cluster create`;
/// every node is killed on drop.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ])
            })
            .collect();
        let addresses: Vec<String> = nodes.iter().map(RedisServer::address).collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = Self { nodes };
        cluster.wait_until_ok();
        cluster
    }

    /// A Redis Cluster of three primaries with one replica each (six `redis-server`
    /// processes, `--cluster-replicas 1`), whose nodes declare a silent peer failed after
    /// `node_timeout_ms`, so that a killed primary's replica is promoted about that long
    /// after. Returns when every replica's link to its primary is up.
    pub fn start_with_replicas(node_timeout_ms: u64) -> Self {
        let timeout = node_timeout_ms.to_string();
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    &timeout,
                    // A replica that rejoins syncs at once, instead of after the default
                    // 5 s wait for more replicas to share the transfer.
                    "--repl-diskless-sync-delay",
                    "0",
                ])
            })
            .collect();
        let addresses: Vec<String> = nodes.iter().map(RedisServer::address).collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = Self { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = cluster.nodes.iter().all(|node| {
                node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
                    && node
                        .cli(&["CLUSTER", "NODES"])
                        .lines()
                        .filter(|line| line.contains("master") && !line.contains("fail"))
                        .count()
                        == 3
                    && {
                        let info = node.cli(&["INFO", "replication"]);
                        info.contains("role:master") || info.contains("master_link_status:up")
                    }
            });
            if ready {
                return cluster;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster with replicas did not form within 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every node reports `cluster_state:ok` and knows all three primaries.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = self.nodes.iter().all(|node| {
                node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
                    && node.cli(&["CLUSTER", "SLOTS"]).lines().count() > 0
                    && node
                        .cli(&["CLUSTER", "NODES"])
                        .lines()
                        .filter(|line| line.contains("master") && !line.contains("fail"))
                        .count()
                        == 3
            });
            if ready {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not reach cluster_state:ok within 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The cluster's nodes as `redis://` URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The one-string form: `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,…`.
    pub fn cluster_url(&self) -> String {
        format!(
            "redis+cluster://{}",
            self.nodes
                .iter()
                .map(RedisServer::address)
                .collect::<Vec<_>>()
                .join(",")
        )
    }
}

pub fn id() -> RecordId {
    RecordId::new(
        format!("scope-{}", uuid::Uuid::new_v4()),
        uuid::Uuid::new_v4().to_string(),
    )
}

pub fn binding() -> Binding {
    Binding {
        method: "POST".to_owned(),
        path: "/v1/namespaces/db/tables?x=1".to_owned(),
        body_sha256: [7; 32],
    }
}

pub fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".to_owned(),
            Bytes::from_static(b"application/json"),
        )],
        body: Bytes::from_static(body),
        trailers: Vec::new(),
    }
}

/// How many `EVALSHA` calls the server on `port` has answered (every store operation is
/// one).
pub fn scripts_run(server: &RedisServer) -> u64 {
    let stats = server.cli(&["INFO", "commandstats"]);
    stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// Kills the subscribed (pub/sub) connections of the server; returns how many.
pub fn kill_subscriptions(server: &RedisServer) -> u64 {
    server
        .cli(&["CLIENT", "KILL", "TYPE", "pubsub"])
        .trim()
        .parse()
        .unwrap_or(0)
}
