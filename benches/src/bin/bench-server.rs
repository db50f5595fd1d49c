//! The benchmark app over HTTP: `bench-server --mode
//! bare|memory|sqlite|sqlite-raw|postgres|mysql|redis --listen 127.0.0.1:0 [--threads 1]
//! [--database-url URL]`.
//!
//! `sqlite-raw` is the baseline of the SQLite store: the store's reserve and finalize
//! statements issued by hand around the handler through one writer connection
//! (`benches::sql::sqlite_raw_app`).
//!
//! Prints `listening on ADDR` once it accepts connections, then serves until killed.

use std::io::Write as _;
use std::net::SocketAddr;

use idempotency_core::IdempotencyLayer;
use idempotency_store_memory::MemoryStore;

struct Args {
    mode: String,
    listen: SocketAddr,
    threads: usize,
    database_url: Option<String>,
    max_entries: usize,
}

fn parse_args() -> Args {
    let mut parsed = Args {
        mode: "bare".to_owned(),
        listen: "127.0.0.1:0".parse().expect("default address"),
        threads: 1,
        database_url: None,
        max_entries: 100_000_000,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--mode" => parsed.mode = value,
            "--listen" => parsed.listen = value.parse().expect("--listen takes ip:port"),
            "--threads" => parsed.threads = value.parse().expect("--threads takes a number"),
            "--database-url" => parsed.database_url = Some(value),
            "--max-entries" => {
                parsed.max_entries = value.parse().expect("--max-entries takes a number")
            }
            other => panic!("unknown argument {other}"),
        }
    }
    parsed
}

async fn layer(args: &Args) -> Option<IdempotencyLayer> {
    match args.mode.as_str() {
        "bare" | "sqlite-raw" => None,
        // The default bound (10,000) would fill up under a fresh-key load and answer 503.
        "memory" => Some(IdempotencyLayer::new(
            MemoryStore::new()
                .with_max_entries(args.max_entries)
                .with_max_bytes(u64::MAX),
        )),
        #[cfg(feature = "sql")]
        mode @ ("sqlite" | "postgres" | "mysql") => Some(
            benches::sql::server_layer(mode, args.database_url.as_deref())
                .await
                .unwrap_or_else(|error| panic!("cannot set up the {mode} store: {error}")),
        ),
        #[cfg(feature = "redis")]
        "redis" => Some(
            benches::redis_store::server_layer(args.database_url.as_deref())
                .await
                .unwrap_or_else(|error| panic!("cannot set up the Redis store: {error}")),
        ),
        other => panic!(
            "unknown --mode {other} (bare, memory{}{})",
            if cfg!(feature = "sql") {
                ", sqlite, sqlite-raw, postgres, mysql"
            } else {
                "; the SQL modes need --features sql"
            },
            if cfg!(feature = "redis") {
                ", redis"
            } else {
                "; redis needs --features redis"
            }
        ),
    }
}

fn main() {
    let args = parse_args();
    let _ = &args.database_url;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        #[cfg(feature = "sql")]
        let raw = match args.mode.as_str() {
            "sqlite-raw" => Some(
                benches::sql::sqlite_raw_app(args.database_url.as_deref())
                    .await
                    .unwrap_or_else(|error| panic!("cannot set up sqlite-raw: {error}")),
            ),
            _ => None,
        };
        #[cfg(not(feature = "sql"))]
        if args.mode == "sqlite-raw" {
            panic!("--mode sqlite-raw needs --features sql");
        }
        let layer = layer(&args).await;
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .expect("bind the listen address");
        let mut stdout = std::io::stdout();
        writeln!(
            stdout,
            "listening on {}",
            listener.local_addr().expect("local address")
        )
        .and_then(|()| stdout.flush())
        .expect("stdout");
        #[cfg(feature = "sql")]
        if let Some(raw) = raw {
            raw.serve(listener).await.expect("serve");
            return;
        }
        // The layer wraps the whole app, as the README recommends (and as the Iceberg
        // profile needs, to reload credentials through the router).
        match layer {
            Some(layer) => {
                let app = tower::Layer::layer(&layer, benches::app::bare());
                axum::serve(
                    listener,
                    axum::ServiceExt::<axum::extract::Request>::into_make_service(app),
                )
                .await
            }
            None => axum::serve(listener, benches::app::bare()).await,
        }
        .expect("serve");
    });
}
