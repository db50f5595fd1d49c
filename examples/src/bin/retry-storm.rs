//! A retry storm: N keyed mutations sent through a proxy that loses a share of requests
//! and responses, retried the way the Iceberg Java client retries, once against a
//! server protected by the Idempotency-Key layer and once against the same server
//! without it. It prints how many mutations ran, how many answers were replays, and how
//! many mutations ran more than once.
//!
//! ```text
//! cargo run -p examples --bin retry-storm -- --operations 300 --drop-percent 20
//! ```
//!
//! The protected server keeps its records in SQLite in a temporary file, the embedded
//! default. Everything listens on 127.0.0.1 and stops by itself.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use idempotency_core::IdempotencyLayer;
use idempotency_store_sql::{PoolSettings, SqliteStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Counts how often each operation really ran on the server.
#[derive(Clone, Default)]
struct Executions(Arc<Mutex<HashMap<String, u32>>>);

#[derive(Clone, Copy, Debug)]
struct Storm {
    operations: usize,
    drop_percent: u64,
    concurrency: usize,
}

#[derive(Debug, Default)]
struct Report {
    ran: usize,
    ran_twice: usize,
    replayed: u64,
    gave_up: u64,
    attempts: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut storm = Storm {
        operations: 300,
        drop_percent: 20,
        concurrency: 16,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value =
            || -> Result<String, String> { args.next().ok_or(format!("{flag} needs a value")) };
        match flag.as_str() {
            "--operations" => storm.operations = value()?.parse()?,
            "--drop-percent" => storm.drop_percent = value()?.parse()?,
            "--concurrency" => storm.concurrency = value()?.parse()?,
            other => {
                return Err(format!(
                    "unknown flag {other}; use --operations N, --drop-percent P, --concurrency C"
                )
                .into());
            }
        }
    }

    let state_dir = std::env::temp_dir().join(format!("retry-storm-{}", std::process::id()));
    std::fs::create_dir_all(&state_dir)?;
    let url = format!(
        "sqlite://{}?mode=rwc",
        state_dir.join("idempotency.db").display()
    );
    let store = SqliteStore::connect(&url, &PoolSettings::default())
        .await?
        .migrate()
        .await?;
    let with_layer = run(storm, Some(IdempotencyLayer::new(store))).await?;
    let without = run(storm, None).await?;
    let _ = std::fs::remove_dir_all(&state_dir);

    println!(
        "\n{} keyed mutations, {}% of requests and responses lost, {} clients at once\n",
        storm.operations, storm.drop_percent, storm.concurrency
    );
    println!(
        "| server            | ran | ran twice or more | answers replayed | attempts | gave up |"
    );
    println!(
        "|-------------------|-----|-------------------|------------------|----------|---------|"
    );
    for (name, report) in [("with the layer", &with_layer), ("without it", &without)] {
        println!(
            "| {name:<17} | {:>3} | {:>17} | {:>16} | {:>8} | {:>7} |",
            report.ran, report.ran_twice, report.replayed, report.attempts, report.gave_up
        );
    }
    if with_layer.ran_twice > 0 {
        return Err("a mutation ran twice behind the idempotency layer".into());
    }
    Ok(())
}

/// Starts a server (with the layer if given) and a lossy proxy in front of it, drives
/// the storm through the proxy and counts what happened on the server.
async fn run(
    storm: Storm,
    layer: Option<IdempotencyLayer>,
) -> Result<Report, Box<dyn std::error::Error>> {
    let executions = Executions::default();
    let app = Router::new()
        .route("/v1/namespaces/{namespace}/tables", post(create_table))
        .with_state(executions.clone());
    let app = match layer {
        Some(layer) => app.layer(layer),
        None => app,
    };
    let server = TcpListener::bind("127.0.0.1:0").await?;
    let server_addr = server.local_addr()?;
    let server_task = tokio::spawn(async move { axum::serve(server, app).await });
    let proxy = TcpListener::bind("127.0.0.1:0").await?;
    let proxy_addr = proxy.local_addr()?;
    let proxy_task = tokio::spawn(lossy_proxy(proxy, server_addr, storm.drop_percent));

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(0)
        .build()?;
    let replayed = Arc::new(AtomicU64::new(0));
    let gave_up = Arc::new(AtomicU64::new(0));
    let attempts = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicU64::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..storm.concurrency {
        let (client, replayed, gave_up, attempts, next) = (
            client.clone(),
            replayed.clone(),
            gave_up.clone(),
            attempts.clone(),
            next.clone(),
        );
        clients.spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::SeqCst) as usize;
                if n >= storm.operations {
                    return;
                }
                let outcome = send_with_retries(&client, proxy_addr, n, &attempts).await;
                match outcome {
                    Some(true) => {
                        replayed.fetch_add(1, Ordering::SeqCst);
                    }
                    Some(false) => {}
                    None => {
                        gave_up.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        });
    }
    while clients.join_next().await.is_some() {}
    // Mutations whose answers were lost may still be finishing on the server.
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy_task.abort();
    server_task.abort();

    let executions = executions.0.lock().expect("counter lock");
    Ok(Report {
        ran: executions.len(),
        ran_twice: executions.values().filter(|n| **n > 1).count(),
        replayed: replayed.load(Ordering::SeqCst),
        gave_up: gave_up.load(Ordering::SeqCst),
        attempts: attempts.load(Ordering::SeqCst),
    })
}

/// The mutation: "creates a table" and counts that it ran.
async fn create_table(
    State(executions): State<Executions>,
    Path(namespace): Path<String>,
    body: String,
) -> (StatusCode, String) {
    tokio::time::sleep(Duration::from_millis(5)).await;
    *executions
        .0
        .lock()
        .expect("counter lock")
        .entry(body.clone())
        .or_default() += 1;
    (
        StatusCode::OK,
        format!(r#"{{"namespace":"{namespace}","created":{body}}}"#),
    )
}

/// Sends operation `n` with one key until it gets an answer, like the Iceberg Java
/// client: up to 5 retries with exponential backoff, on lost connections, timeouts, 429
/// and 503 (honouring `Retry-After`). Returns whether the answer was a replay, or `None`
/// if it gave up.
async fn send_with_retries(
    client: &reqwest::Client,
    proxy: SocketAddr,
    n: usize,
    attempts: &AtomicU64,
) -> Option<bool> {
    let key = uuid::Uuid::new_v4().to_string();
    let url = format!("http://{proxy}/v1/namespaces/storm/tables");
    let body = format!(r#"{{"name":"table-{n}"}}"#);
    let mut backoff = Duration::from_millis(50);
    for _ in 0..6 {
        attempts.fetch_add(1, Ordering::SeqCst);
        let sent = client
            .post(&url)
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await;
        match sent {
            Ok(response) if response.status().is_success() => {
                return Some(response.headers().contains_key("idempotent-replayed"));
            }
            Ok(response)
                if response.status() == StatusCode::SERVICE_UNAVAILABLE
                    || response.status() == StatusCode::TOO_MANY_REQUESTS
                    || response.status() == StatusCode::CONFLICT =>
            {
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .map(Duration::from_secs);
                tokio::time::sleep(retry_after.unwrap_or(backoff)).await;
            }
            Ok(_) => return None,
            Err(_) => tokio::time::sleep(backoff).await,
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
    None
}

/// A TCP proxy that, for `drop_percent` of connections, either closes the connection
/// before the request reaches the server or lets the server answer and then throws the
/// answer away. Each connection carries one request (the client keeps none idle).
async fn lossy_proxy(listener: TcpListener, server: SocketAddr, drop_percent: u64) {
    let seed = AtomicU64::new(0x5eed);
    loop {
        let Ok((mut client, _)) = listener.accept().await else {
            return;
        };
        let roll = splitmix(seed.fetch_add(1, Ordering::Relaxed)) % 200;
        tokio::spawn(async move {
            if roll < drop_percent {
                return; // lost on the way in: the server never sees the request
            }
            let Ok(mut upstream) = TcpStream::connect(server).await else {
                return;
            };
            let lose_answer = roll < 2 * drop_percent;
            let (mut client_read, mut client_write) = client.split();
            let (mut upstream_read, mut upstream_write) = upstream.split();
            let forward = tokio::io::copy(&mut client_read, &mut upstream_write);
            let backward = async {
                let mut buffer = vec![0u8; 16 * 1024];
                loop {
                    let n = upstream_read.read(&mut buffer).await?;
                    if n == 0 || lose_answer {
                        // Lost on the way out: the server ran the request, the client
                        // sees its connection reset.
                        return Ok::<_, std::io::Error>(());
                    }
                    client_write.write_all(&buffer[..n]).await?;
                }
            };
            tokio::select! {
                _ = forward => {}
                _ = backward => {}
            }
        });
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
