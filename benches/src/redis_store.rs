//! The Redis store against the very scripts it runs, issued raw: reserve + finalize through
//! the store against the same two `EVALSHA` commands sent raw over the store's own
//! connection, and a replay against the same reserve `EVALSHA` on a completed key. Also the
//! layer the `bench-server` binary runs for `--mode redis`, and a Redis server of the
//! benchmark's own.
//!
//! The raw side sends exactly what the store sends (`RedisStore::script(Operation::…)`,
//! the record key from `store.record_key`, the same arguments in the same order), so the
//! ratio is the cost of the store's own code: drawing a token, building the key, decoding
//! the answer, the timeout around each operation.

use std::cell::Cell;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotency_core::{
    Binding, IdempotencyLayer, IdempotencyStore as _, Ownership, RecordId, RecordState,
    Reservation, StoredResponse,
};
use idempotency_store_redis::redis::{self, Value};
use idempotency_store_redis::{Operation, RedisOptions, RedisStore};
use tokio::runtime::Runtime;

use crate::harness::{Paired, paired};
use crate::report::{Row, Table, Verdict, nanos};

/// The key prefix of every record the benchmarks write (never the default one).
pub const PREFIX: &str = "bench-idempotency:";

const LEASE: Duration = Duration::from_secs(20);
const LIFETIME: Duration = Duration::from_secs(30 * 60);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long the Redis benchmarks run.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// Interleaved rounds per comparison.
    pub rounds: usize,
    /// Operations per round.
    pub iters: u64,
}

impl Settings {
    /// A few seconds.
    pub fn quick() -> Self {
        Self {
            rounds: 9,
            iters: 200,
        }
    }

    /// A second or two: every figure once, for `compare --smoke`, not for reading.
    pub fn smoke() -> Self {
        Self {
            rounds: 1,
            iters: 20,
        }
    }

    /// Under a minute.
    pub fn full() -> Self {
        Self {
            rounds: 21,
            iters: 500,
        }
    }
}

/// A `redis-server` of the benchmark's own on a free port of 127.0.0.1, without
/// persistence (as the machine's own Redis runs), killed on drop.
pub struct BenchRedis {
    child: Child,
    /// `redis://127.0.0.1:PORT`.
    pub url: String,
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
}

impl BenchRedis {
    /// Starts it and waits until it answers.
    pub fn start() -> Result<Self, String> {
        Self::start_with(&[])
    }

    /// Starts a replica of `primary` (same settings) and waits until the primary counts
    /// it online.
    pub fn start_replica_of(primary: &BenchRedis) -> Result<Self, String> {
        let replica = Self::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()])?;
        let deadline = Instant::now() + Duration::from_secs(30);
        // Online: the primary counts a replica's acknowledgements only once it has heard
        // from it after the first sync.
        while !(primary
            .info_field("slave0")
            .is_some_and(|slave| slave.contains("state=online"))
            && replica.info_field("master_link_status").as_deref() == Some("up"))
        {
            if Instant::now() > deadline {
                return Err(format!(
                    "the replica on port {} did not sync with its primary on port {} within 30 s",
                    replica.port, primary.port
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(replica)
    }

    /// `--port`, persistence off, `noeviction`, and `extra`.
    fn start_with(extra: &[&str]) -> Result<Self, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let dir = std::env::temp_dir().join(format!("idempotency-bench-redis-{port}"));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--maxmemory-policy", "noeviction"])
            // A replica's first sync starts at once instead of after 5 s.
            .args(["--repl-diskless-sync-delay", "0"])
            .args(extra)
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!("cannot start redis-server ({e}): apt-get install redis-server")
            })?;
        let redis = Self {
            child,
            url: format!("redis://127.0.0.1:{port}"),
            port,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let pong = Command::new("redis-cli")
                .args(["-p", &port.to_string(), "PING"])
                .output()
                .is_ok_and(|o| o.stdout.starts_with(b"PONG"));
            if pong {
                return Ok(redis);
            }
            if Instant::now() > deadline {
                return Err(format!("redis-server did not answer on port {port}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A field of `INFO replication`, by `redis-cli`.
    pub fn info_field(&self, name: &str) -> Option<String> {
        let output = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "INFO", "replication"])
            .output()
            .ok()?;
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .map(|value| value.trim().to_owned())
    }
}

impl Drop for BenchRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Connects the benchmark store (prefix [`PREFIX`]).
pub async fn connect(url: &str) -> Result<RedisStore, BoxError> {
    Ok(RedisStore::connect_with(RedisOptions::from_url(url)?.key_prefix(PREFIX)?).await?)
}

/// The layer the `bench-server` binary runs for `--mode redis`.
pub async fn server_layer(url: Option<&str>) -> Result<IdempotencyLayer, String> {
    let url = url.ok_or("--database-url redis://… is required")?;
    let store = connect(url).await.map_err(|e| e.to_string())?;
    Ok(IdempotencyLayer::new(store))
}

fn binding() -> Binding {
    Binding {
        method: "POST".to_owned(),
        path: crate::app::PATH.to_owned(),
        body_sha256: [7; 32],
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".to_owned(),
            Bytes::from_static(b"application/json"),
        )],
        body: Bytes::from_static(crate::app::RESPONSE_BODY.as_bytes()),
        trailers: Vec::new(),
    }
}

/// The store, and the raw side over the very same connection.
struct Bench {
    store: RedisStore,
}

impl Bench {
    /// `EVALSHA <operation's script> 1 <record key> args…`, sent raw on the store's
    /// connection.
    async fn raw(
        &self,
        operation: Operation,
        id: &RecordId,
        args: &[&[u8]],
    ) -> Result<Value, BoxError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(RedisStore::script(operation).sha1())
            .arg(1)
            .arg(self.store.record_key(id));
        for arg in args {
            cmd.arg(*arg);
        }
        Ok(cmd.query_async(&mut self.store.connection()).await?)
    }

    async fn raw_reserve(&self, id: &RecordId, token: i64) -> Result<Value, BoxError> {
        let b = binding();
        self.raw(
            Operation::Reserve,
            id,
            &[
                token.to_string().as_bytes(),
                LEASE.as_millis().to_string().as_bytes(),
                LIFETIME.as_millis().to_string().as_bytes(),
                b.method.as_bytes(),
                b.path.as_bytes(),
                &b.body_sha256,
            ],
        )
        .await
    }

    async fn raw_reserve_finalize(&self, id: &RecordId, token: i64) -> Result<(), BoxError> {
        match self.raw_reserve(id, token).await? {
            Value::Array(parts)
                if parts.first() == Some(&Value::BulkString(b"reserved".to_vec())) => {}
            other => return Err(format!("raw reserve did not reserve: {other:?}").into()),
        }
        let r = response();
        let (how, channel) = self.store.announcement(id);
        let finalized = self
            .raw(
                Operation::Finalize,
                id,
                &[
                    token.to_string().as_bytes(),
                    r.status.to_string().as_bytes(),
                    &r.encode_headers(),
                    &r.body,
                    &r.encode_trailers(),
                    how.as_bytes(),
                    &channel,
                ],
            )
            .await?;
        match finalized {
            Value::Int(1) => Ok(()),
            other => Err(format!("raw finalize did not hold: {other:?}").into()),
        }
    }

    async fn store_reserve_finalize(&self, id: &RecordId) -> Result<(), BoxError> {
        let Reservation::Reserved(token) =
            self.store.reserve(id, &binding(), LEASE, LIFETIME).await?
        else {
            return Err("already reserved".into());
        };
        match self.store.finalize(id, token, &response()).await? {
            Ownership::Held => Ok(()),
            Ownership::Lost => Err("finalize lost the record".into()),
        }
    }

    /// A replay as the layer does it: `reserve` finds the completed record.
    async fn store_replay(&self, id: &RecordId) -> Result<(), BoxError> {
        match self.store.reserve(id, &binding(), LEASE, LIFETIME).await? {
            Reservation::Exists(record) if matches!(record.state, RecordState::Completed(_)) => {
                Ok(())
            }
            other => Err(format!("did not replay: {other:?}").into()),
        }
    }

    async fn raw_replay(&self, id: &RecordId, token: i64) -> Result<(), BoxError> {
        match self.raw_reserve(id, token).await? {
            Value::Array(parts) if parts.len() == 2 => Ok(()),
            other => Err(format!("raw reserve did not find the record: {other:?}").into()),
        }
    }
}

struct Timer<'a> {
    runtime: &'a Runtime,
    counter: Cell<u64>,
    prefix: String,
}

impl Timer<'_> {
    fn next(&self) -> (RecordId, i64) {
        let n = self.counter.get() + 1;
        self.counter.set(n);
        (
            RecordId::new("", format!("{}-{n}", self.prefix)),
            n as i64 + 1,
        )
    }

    /// Runs `iters` operations on fresh keys; panics on the first error (a benchmark that
    /// silently measures errors measures nothing).
    fn time<F, Fut>(&self, iters: u64, op: F) -> Duration
    where
        F: Fn(RecordId, i64) -> Fut,
        Fut: Future<Output = Result<(), BoxError>>,
    {
        self.runtime.block_on(async {
            let start = Instant::now();
            for _ in 0..iters {
                let (id, token) = self.next();
                if let Err(error) = op(id, token).await {
                    panic!("Redis benchmark operation failed: {error}");
                }
            }
            start.elapsed()
        })
    }

    fn time_over<F, Fut>(&self, ids: &[RecordId], iters: u64, op: F) -> Duration
    where
        F: Fn(RecordId, i64) -> Fut,
        Fut: Future<Output = Result<(), BoxError>>,
    {
        self.runtime.block_on(async {
            let start = Instant::now();
            for i in 0..iters {
                let id = ids[(i as usize) % ids.len()].clone();
                if let Err(error) = op(id, i as i64 + 1).await {
                    panic!("Redis benchmark operation failed: {error}");
                }
            }
            start.elapsed()
        })
    }
}

fn cost_row(name: &str, result: Paired, baseline: &str, target: &str, limit: Option<f64>) -> Row {
    let cost = 1.0 / result.throughput_ratio;
    Row {
        name: name.to_owned(),
        measured: format!("{}/op", nanos(result.subject_ns)),
        baseline: format!("{}/op ({baseline})", nanos(result.baseline_ns)),
        ratio: format!(
            "{cost:.2}× the raw time (median round {:.2}, rounds {:.2}–{:.2})",
            1.0 / result.median_ratio,
            1.0 / result.ratio_range.1,
            1.0 / result.ratio_range.0
        ),
        target: target.to_owned(),
        verdict: limit.map_or(Verdict::Info, |limit| Verdict::from_bool(cost <= limit)),
    }
}

/// Runs the store-vs-raw comparisons against the Redis at `url` and adds their rows.
pub fn run(settings: Settings, url: &str, rows: &mut Vec<Row>, tables: &mut Vec<Table>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let bench = match runtime.block_on(connect(url)) {
        Ok(store) => Bench { store },
        Err(error) => {
            rows.push(Row {
                name: "Redis: store vs raw scripts".to_owned(),
                measured: format!("not reachable at {url}: {error}"),
                baseline: String::new(),
                ratio: String::new(),
                target: String::new(),
                verdict: Verdict::Skipped,
            });
            return;
        }
    };
    let bench = &bench;
    let timer = Timer {
        runtime: &runtime,
        counter: Cell::new(0),
        prefix: format!("redis-{}", std::process::id()),
    };
    // The store sends a script with EVAL the first time a server lacks it; the raw side
    // only ever sends EVALSHA, so let the store load them first.
    runtime
        .block_on(bench.store_reserve_finalize(&timer.next().0))
        .unwrap_or_else(|e| panic!("cannot set up a Redis record: {e}"));
    let first = paired(
        settings.rounds,
        settings.iters,
        |n| {
            timer.time(n, |id, token| async move {
                bench.raw_reserve_finalize(&id, token).await
            })
        },
        |n| {
            timer.time(
                n,
                |id, _| async move { bench.store_reserve_finalize(&id).await },
            )
        },
    );
    rows.push(cost_row(
        "Redis: reserve + finalize, store vs the same 2 scripts (EVALSHA) raw",
        first,
        "raw",
        "≤ 1.2× raw",
        Some(1.2),
    ));
    let completed: Vec<RecordId> = (0..settings.iters.min(200))
        .map(|_| {
            let (id, _) = timer.next();
            runtime
                .block_on(bench.store_reserve_finalize(&id))
                .unwrap_or_else(|e| panic!("cannot set up a Redis record: {e}"));
            id
        })
        .collect();
    let replay = paired(
        settings.rounds,
        settings.iters,
        |n| {
            timer.time_over(&completed, n, |id, token| async move {
                bench.raw_replay(&id, token).await
            })
        },
        |n| {
            timer.time_over(&completed, n, |id, _| async move {
                bench.store_replay(&id).await
            })
        },
    );
    rows.push(cost_row(
        "Redis: replay as the layer does it (reserve finds the record), store vs the same script raw",
        replay,
        "raw",
        "one round trip (≤ 1.2× the raw script)",
        Some(1.2),
    ));
    let mut detail = Table::new(
        "Redis store: one operation at a time (fastest round of each side, per operation)",
        &[
            "operation",
            "through the store",
            "raw EVALSHA on the same connection",
            "store / raw",
        ],
    );
    for (op, result) in [
        ("reserve + finalize (2 scripts)", first),
        ("replay (reserve on a completed key)", replay),
    ] {
        detail.push(vec![
            op.to_owned(),
            nanos(result.subject_ns),
            nanos(result.baseline_ns),
            format!("{:.2}×", 1.0 / result.throughput_ratio),
        ]);
    }
    tables.push(detail);
}
