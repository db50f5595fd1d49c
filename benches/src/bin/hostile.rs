//! `hostile`: the hostile-client cases (slow uploads, oversized bodies, duplicates, key
//! floods, large answers), measured against a server process of its own (this binary,
//! run as `hostile serve`), so that the memory figures are the server's alone.
//!
//! ```text
//! cargo run --release -p benches --features sql --bin hostile -- [--postgres postgres://postgres@127.0.0.1/postgres]
//! ```
//!
//! The server is an axum app behind the layer with its defaults (memory budget 256 MiB,
//! request bodies of 8 MiB at most, a body deadline shortened to 10 s so the run ends
//! sooner), with four routes: `POST /fast` (201), `POST /slow?ms=N` (201 after N ms),
//! `POST /fail` (400 echoing the request body, as many services' validation errors do)
//! and `POST /stream` (a 512 MiB answer, streamed). Its store is the memory store or
//! PostgreSQL (a database the run creates and drops). The cases without PostgreSQL run
//! with `--postgres none`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Query;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use idempotency_core::{CredentialScope, IdempotencyLayer, ScopeQuota};
use idempotency_store_memory::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BODY: usize = 8_000_000;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    if args.first().map(String::as_str) == Some("serve") {
        runtime.block_on(serve(&args[1..]));
    } else {
        let postgres = value_of(&args, "--postgres")
            .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        runtime.block_on(measure(postgres));
    }
}

fn value_of(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|arg| arg == name)
        .and_then(|at| args.get(at + 1).cloned())
}

// ------------------------------------------------------------------------------------
// The server
// ------------------------------------------------------------------------------------

#[derive(serde::Deserialize)]
struct Slow {
    ms: u64,
}

async fn serve(args: &[String]) {
    let store = value_of(args, "--store").unwrap_or_else(|| "memory".to_owned());
    let quota_records = value_of(args, "--quota-records").map(|v| v.parse().expect("records"));
    let quota_bytes = value_of(args, "--quota-bytes").map(|v| v.parse().expect("bytes"));
    let mut quota = ScopeQuota::default();
    if let Some(records) = quota_records {
        quota = quota.with_max_records(records);
    }
    if let Some(bytes) = quota_bytes {
        quota = quota.with_max_bytes(bytes);
    }
    let quota = (quota_records.is_some() || quota_bytes.is_some()).then_some(quota);
    let layer = match store.as_str() {
        "memory" => {
            let mut store = MemoryStore::new();
            if let Some(quota) = quota {
                store = store.with_scope_quota(quota);
            }
            IdempotencyLayer::new(store)
        }
        #[cfg(feature = "sql")]
        "postgres" => {
            let url = value_of(args, "--database-url").expect("--database-url");
            let mut store = idempotency_store_sql::PostgresStore::connect(
                &url,
                &idempotency_store_sql::PoolSettings::default(),
            )
            .await
            .expect("connect")
            .migrate()
            .await
            .expect("migrate");
            if let Some(quota) = quota {
                store = store.with_scope_quota(quota);
            }
            IdempotencyLayer::new(store)
        }
        other => panic!("unknown --store {other}"),
    }
    .with_scope(CredentialScope::default())
    .with_request_body_timeout(Duration::from_secs(10));

    let app = Router::new()
        .route("/fast", post(|| async { StatusCode::CREATED }))
        .route(
            "/slow",
            post(|Query(slow): Query<Slow>| async move {
                tokio::time::sleep(Duration::from_millis(slow.ms)).await;
                (StatusCode::CREATED, "done")
            }),
        )
        .route(
            "/fail",
            post(|body: Bytes| async move { (StatusCode::BAD_REQUEST, body) }),
        )
        .route(
            "/stream",
            post(|| async {
                let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
                let chunks = (0..8192).map(move |_| Ok::<_, std::io::Error>(chunk.clone()));
                Body::from_stream(futures_util::stream::iter(chunks))
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    println!("listening on {}", listener.local_addr().expect("address"));
    axum::serve(listener, app).await.expect("serve");
}

struct Server {
    child: Child,
    address: SocketAddr,
}

impl Server {
    fn start(extra: &[&str]) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .arg("serve")
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the server's first line");
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .expect("listening on ADDR")
            .parse()
            .expect("an address");
        Self { child, address }
    }

    /// The server's resident memory now and at its peak, in MB.
    fn memory_mb(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find(|line| line.starts_with(name))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
                .map_or(0, |kb| kb / 1024)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ------------------------------------------------------------------------------------
// The cases
// ------------------------------------------------------------------------------------

async fn measure(postgres: String) {
    println!("| case | figure |\n|---|---|");
    if std::env::var("HOSTILE_ONLY").as_deref() == Ok("postgres") {
        #[cfg(feature = "sql")]
        postgres_cases(&postgres).await;
        return;
    }
    slow_bodies(500).await;
    oversized_declared_length().await;
    duplicates_holding_large_bodies(200).await;
    streamed_answer().await;
    memory_store_scopes().await;
    #[cfg(feature = "sql")]
    if postgres != "none" {
        postgres_cases(&postgres).await;
    }
    let _ = postgres;
}

fn keyed_head(path: &str, key: &str, length: usize, credential: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\nauthorization: {credential}\r\n\
         content-length: {length}\r\n\r\n"
    )
}

/// Sends `head` and `bytes` of a body on a new connection, then waits up to `wait` for
/// the status code of the answer (0: none came).
async fn send_raw(address: SocketAddr, head: String, bytes: usize, wait: Duration) -> u16 {
    let Ok(mut stream) = TcpStream::connect(address).await else {
        return 0;
    };
    if stream.write_all(head.as_bytes()).await.is_err() {
        return read_status(&mut stream, wait).await;
    }
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min(bytes - sent);
        match tokio::time::timeout(Duration::from_secs(5), stream.write_all(&chunk[..n])).await {
            Ok(Ok(())) => sent += n,
            _ => break,
        }
    }
    read_status(&mut stream, wait).await
}

async fn read_status(stream: &mut TcpStream, wait: Duration) -> u16 {
    let mut buffer = vec![0u8; 4096];
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Ok(read)) = tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
        if read == 0 {
            break;
        }
        text.push_str(&String::from_utf8_lossy(&buffer[..read]));
        if text.contains("\r\n") {
            break;
        }
    }
    text.split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or(0)
}

/// Samples the server's memory every 200 ms until `done` is set; returns the peak RSS.
fn sample_memory(server: &Server, done: Arc<AtomicUsize>) -> std::thread::JoinHandle<u64> {
    let pid_status = format!("/proc/{}/status", server.child.id());
    std::thread::spawn(move || {
        let mut peak = 0;
        while done.load(Ordering::Relaxed) == 0 {
            let status = std::fs::read_to_string(&pid_status).unwrap_or_default();
            if let Some(kb) = status
                .lines()
                .find(|line| line.starts_with("VmRSS:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
            {
                peak = peak.max(kb / 1024);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        peak
    })
}

fn tally(statuses: &[u16]) -> String {
    let mut counts: Vec<(u16, usize)> = Vec::new();
    for status in statuses {
        match counts.iter_mut().find(|(s, _)| s == status) {
            Some((_, n)) => *n += 1,
            None => counts.push((*status, 1)),
        }
    }
    counts.sort();
    counts
        .iter()
        .map(|(status, n)| format!("{n}× {status}"))
        .collect::<Vec<_>>()
        .join(", ")
}

async fn slow_bodies(connections: usize) {
    let server = Server::start(&[]);
    let (baseline, _) = server.memory_mb();
    let done = Arc::new(AtomicUsize::new(0));
    let sampler = sample_memory(&server, done.clone());
    let started = Instant::now();
    let tasks: Vec<_> = (0..connections)
        .map(|i| {
            let address = server.address;
            let head = keyed_head("/fast", &format!("slow-{i}"), BODY, "Bearer a");
            tokio::spawn(
                async move { send_raw(address, head, BODY - 1, Duration::from_secs(30)).await },
            )
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap_or(0));
    }
    let took = started.elapsed();
    done.store(1, Ordering::Relaxed);
    let peak = sampler.join().unwrap_or(0).max(server.memory_mb().1);
    println!(
        "| {connections} keyed connections send all but the last byte of an 8 MB body and hold | server RSS peak {peak} MB (baseline {baseline} MB); answers: {}; all answered within {:.1} s |",
        tally(&statuses),
        took.as_secs_f64()
    );
}

async fn oversized_declared_length() {
    let server = Server::start(&[]);
    let mut stream = TcpStream::connect(server.address).await.expect("connect");
    stream
        .write_all(
            b"POST /fast HTTP/1.1\r\nhost: x\r\nidempotency-key: huge\r\nauthorization: Bearer a\r\n\
              content-length: 1073741824\r\nexpect: 100-continue\r\n\r\n",
        )
        .await
        .expect("write");
    let mut buffer = vec![0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buffer))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(0);
    let answer = String::from_utf8_lossy(&buffer[..read]);
    println!(
        "| `Content-Length: 1 GiB` with `Expect: 100-continue` | first line: `{}`; `100 Continue` sent: {} |",
        answer.lines().next().unwrap_or(""),
        answer.contains("100 Continue")
    );
}

async fn duplicates_holding_large_bodies(duplicates: usize) {
    let server = Server::start(&[]);
    let (baseline, _) = server.memory_mb();
    let done = Arc::new(AtomicUsize::new(0));
    let sampler = sample_memory(&server, done.clone());
    let tasks: Vec<_> = (0..duplicates)
        .map(|_| {
            let address = server.address;
            let head = keyed_head("/slow?ms=5000", "one-slow-key", BODY, "Bearer a");
            tokio::spawn(
                async move { send_raw(address, head, BODY, Duration::from_secs(40)).await },
            )
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap_or(0));
    }
    done.store(1, Ordering::Relaxed);
    let peak = sampler.join().unwrap_or(0).max(server.memory_mb().1);
    println!(
        "| {duplicates} duplicates of a 5 s request, each with an 8 MB body | server RSS peak {peak} MB (baseline {baseline} MB); answers: {} |",
        tally(&statuses)
    );
}

async fn streamed_answer() {
    let server = Server::start(&[]);
    let (baseline, _) = server.memory_mb();
    let done = Arc::new(AtomicUsize::new(0));
    let sampler = sample_memory(&server, done.clone());
    let client = reqwest::Client::new();
    let mut response = client
        .post(format!("http://{}/stream", server.address))
        .header("idempotency-key", "stream-1")
        .header("authorization", "Bearer a")
        .send()
        .await
        .expect("send");
    let status = response.status();
    let mut received = 0u64;
    while let Ok(Some(chunk)) = response.chunk().await {
        received += chunk.len() as u64;
    }
    done.store(1, Ordering::Relaxed);
    let peak = sampler.join().unwrap_or(0).max(server.memory_mb().1);
    println!(
        "| a keyed route streams 512 MiB | {status}, {} MiB received; server RSS peak {peak} MB (baseline {baseline} MB) |",
        received >> 20
    );
}

async fn memory_store_scopes() {
    use idempotency_core::{Binding, IdempotencyStore, RecordId};
    let binding = Binding {
        method: "POST".into(),
        path: "/fast".into(),
        body_sha256: [0; 32],
    };
    let long = Duration::from_secs(1800);
    let store = MemoryStore::new().with_scope_quota(ScopeQuota::default().with_max_records(1_000));
    let started = Instant::now();
    let mut greedy_refused = 0;
    for i in 0..20_000 {
        let id = RecordId::new("greedy", format!("k{i}"));
        if store.reserve(&id, &binding, long, long).await.is_err() {
            greedy_refused += 1;
        }
    }
    let filled_in = started.elapsed();
    let others_ok = store
        .reserve(&RecordId::new("another", "k0"), &binding, long, long)
        .await
        .is_ok();
    println!(
        "| memory store (10,000 records, per-scope quota 1,000): one client sends 20,000 keys | {greedy_refused} refused with 429 in {:.2} s; another scope still reserves: {others_ok} |",
        filled_in.as_secs_f64()
    );

    let full = MemoryStore::new()
        .with_max_entries(1_000_000)
        .with_max_bytes(u64::MAX);
    for i in 0..1_000_000 {
        full.reserve(&RecordId::new("", format!("k{i}")), &binding, long, long)
            .await
            .expect("room");
    }
    let started = Instant::now();
    let tries = 1_000;
    let mut retry_after = None;
    for i in 0..tries {
        if let Err(idempotency_core::StoreError::Full {
            retry_after: after, ..
        }) = full
            .reserve(
                &RecordId::new("", format!("over-{i}")),
                &binding,
                long,
                long,
            )
            .await
        {
            retry_after = after;
        }
    }
    println!(
        "| a reserve refused by a full memory store of 1,000,000 records | {:.1} µs each; Retry-After {:?} |",
        started.elapsed().as_secs_f64() * 1e6 / f64::from(tries),
        retry_after.map(|after| after.as_secs())
    );
}

#[cfg(feature = "sql")]
async fn postgres_cases(admin_url: &str) {
    use idempotency_store_sql::sqlx;
    let database = format!("idem_hostile_{}", std::process::id());
    let admin = sqlx::PgPool::connect(admin_url).await.expect("PostgreSQL");
    sqlx::query(&format!("CREATE DATABASE {database}"))
        .execute(&admin)
        .await
        .expect("create database");
    let url = match admin_url.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{database}"),
        None => admin_url.to_owned(),
    };
    let pool = sqlx::PgPool::connect(&url)
        .await
        .expect("the run's database");

    // Failing requests with unique keys: every 400 is an answer the store keeps.
    for quota in [None, Some(("10000", "268435456"))] {
        sqlx::query("DROP TABLE IF EXISTS idempotency_records")
            .execute(&pool)
            .await
            .expect("drop");
        let mut args = vec!["--store", "postgres", "--database-url", url.as_str()];
        if let Some((records, bytes)) = quota {
            args.extend(["--quota-records", records, "--quota-bytes", bytes]);
        }
        let server = Server::start(&args);
        let client = reqwest::Client::new();
        let started = Instant::now();
        let refused = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let statuses = Arc::new(std::sync::Mutex::new(Vec::new()));
        let tasks: Vec<_> = (0..32)
            .map(|worker| {
                let client = client.clone();
                let address = server.address;
                let refused = refused.clone();
                let sent = sent.clone();
                let statuses = statuses.clone();
                tokio::spawn(async move {
                    for i in 0..625 {
                        let answer = client
                            .post(format!("http://{address}/fail"))
                            .header("idempotency-key", format!("fail-{worker}-{i}"))
                            .header("authorization", "Bearer a")
                            .body("{\"bad\":true}")
                            .send()
                            .await;
                        sent.fetch_add(1, Ordering::Relaxed);
                        let status = answer.as_ref().map_or(0, |a| a.status().as_u16());
                        statuses.lock().unwrap().push(status);
                        if status == 429 {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for task in tasks {
            let _ = task.await;
        }
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
            .fetch_one(&pool)
            .await
            .expect("count");
        println!(
            "| PostgreSQL, {} keys on requests that fail with 400, quota {} | {rows} rows kept, {} refused with 429, in {:.1} s; answers: {} |",
            sent.load(Ordering::Relaxed),
            quota.map_or("none".to_owned(), |(r, b)| format!(
                "{r} records / {b} bytes"
            )),
            refused.load(Ordering::Relaxed),
            started.elapsed().as_secs_f64(),
            tally(&statuses.lock().unwrap())
        );

        // A 60 KB query string and a 2 MiB body the 400 echoes.
        let query = "q=".to_owned() + &"x".repeat(60_000);
        // Bytes PostgreSQL cannot compress away, as a real payload would be.
        let mut state = 0x9E37_79B9_7F4A_7C15_u64;
        let body: Vec<u8> = (0..2 * 1024 * 1024)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                b'a' + (state % 26) as u8
            })
            .collect();
        let started = Instant::now();
        statuses.lock().unwrap().clear();
        let tasks: Vec<_> = (0..16)
            .map(|worker| {
                let client = client.clone();
                let address = server.address;
                let query = query.clone();
                let body = body.clone();
                let statuses = statuses.clone();
                tokio::spawn(async move {
                    for i in 0..63 {
                        let answer = client
                            .post(format!("http://{address}/fail?{query}"))
                            .header("idempotency-key", format!("echo-{worker}-{i}"))
                            // Another caller than the failing requests above: its own quota.
                            .header("authorization", "Bearer b")
                            .body(body.clone())
                            .send()
                            .await;
                        statuses
                            .lock()
                            .unwrap()
                            .push(answer.map_or(0, |a| a.status().as_u16()));
                    }
                })
            })
            .collect();
        for task in tasks {
            let _ = task.await;
        }
        let size: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('idempotency_records')")
            .fetch_one(&pool)
            .await
            .expect("size");
        println!(
            "| PostgreSQL, 1,008 requests with a 60 KB query and a 2 MiB body echoed by the 400, quota {} | table {} MB after {:.1} s |",
            quota.map_or("none".to_owned(), |(r, b)| format!(
                "{r} records / {b} bytes"
            )),
            size >> 20,
            started.elapsed().as_secs_f64()
        );
        drop(server);
    }

    // Duplicates waiting on one slow key.
    sqlx::query("DROP TABLE IF EXISTS idempotency_records")
        .execute(&pool)
        .await
        .expect("drop");
    let server = Server::start(&["--store", "postgres", "--database-url", url.as_str()]);
    let transactions = || async {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let committed: i64 = sqlx::query_scalar(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(&admin_for(&url).await)
        .await
        .expect("stats");
        committed
    };
    let before = transactions().await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let tasks: Vec<_> = (0..2_000)
        .map(|_| {
            let client = client.clone();
            let address = server.address;
            tokio::spawn(async move {
                client
                    .post(format!("http://{address}/slow?ms=5000"))
                    .header("idempotency-key", "one-key")
                    .header("authorization", "Bearer a")
                    .send()
                    .await
                    .map(|a| a.status().as_u16())
                    .unwrap_or(0)
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap_or(0));
    }
    let after = transactions().await;
    println!(
        "| PostgreSQL, 2,000 duplicates of one 5 s request | {} transactions on the database ({:.1} per duplicate); answers: {} |",
        after - before,
        (after - before) as f64 / 2_000.0,
        tally(&statuses)
    );
    drop(server);
    drop(pool);
    let _ = sqlx::query(&format!("DROP DATABASE {database} WITH (FORCE)"))
        .execute(&admin)
        .await;
}

#[cfg(feature = "sql")]
async fn admin_for(url: &str) -> idempotency_store_sql::sqlx::PgPool {
    idempotency_store_sql::sqlx::PgPool::connect(url)
        .await
        .expect("stats connection")
}
