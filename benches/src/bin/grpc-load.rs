//! A gRPC load generator for the benchmark service, on tonic's client:
//! `grpc-load --addr ADDR [--mode nokey|fresh|fixed] [--concurrency 16] [--connections N]
//! [--seconds 2] [--nonce S] [--fixed-key K]`.
//!
//! Keeps `--concurrency` unary calls in flight over `--connections` HTTP/2 connections
//! (default: as many connections as calls, one call per connection, like `wrk`) for
//! `--seconds`, on one thread, then prints one line:
//! `RESULT requests=N rps=R p50_us=… p99_us=… errors=E` (errors: calls that did not
//! end with `OK`). Every call carries a unique `x-request-id`; `fresh` adds a new
//! `idempotency-key` per call, `fixed` the same one on every call.

use std::net::SocketAddr;
use std::time::Duration;

use benches::grpc::{KeyMode, LoadSettings, drive, result_line};

fn main() {
    let mut addr: Option<SocketAddr> = None;
    let mut connections: Option<usize> = None;
    let mut settings = LoadSettings {
        concurrency: 16,
        connections: 0,
        duration: Duration::from_secs(2),
        mode: KeyMode::None,
        nonce: std::process::id().to_string(),
        fixed_key: "k-fixed".to_owned(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--addr" => addr = Some(value.parse().expect("--addr takes ip:port")),
            "--mode" => {
                settings.mode = KeyMode::parse(&value).expect("--mode takes nokey, fresh or fixed")
            }
            "--concurrency" => {
                settings.concurrency = value.parse().expect("--concurrency takes a number")
            }
            "--connections" => {
                connections = Some(value.parse().expect("--connections takes a number"))
            }
            "--seconds" => {
                settings.duration =
                    Duration::from_secs_f64(value.parse().expect("--seconds takes a number"))
            }
            "--nonce" => settings.nonce = value,
            "--fixed-key" => settings.fixed_key = value,
            other => panic!("unknown argument {other}"),
        }
    }
    let addr = addr.expect("--addr is required");
    settings.connections = connections.unwrap_or(settings.concurrency).max(1);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(drive(addr, settings)) {
        Ok(result) => println!("{}", result_line(&result)),
        Err(error) => {
            eprintln!("grpc-load: {error}");
            std::process::exit(1);
        }
    }
}
