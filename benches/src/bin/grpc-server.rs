//! The gRPC benchmark service over HTTP/2: `grpc-server --mode bare|memory
//! --listen 127.0.0.1:0 [--threads 1] [--max-entries N]`.
//!
//! `bare` is tonic alone; `memory` is the same server with `idempotency_grpc::layer` over a
//! memory store, added with tonic's `Server::builder().layer(…)` as the README shows.
//! Prints `listening on ADDR` once it accepts connections, then serves until killed.

use std::io::Write as _;
use std::net::SocketAddr;

use benches::grpc::{BenchOrders, OrdersServer};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

struct Args {
    mode: String,
    listen: SocketAddr,
    threads: usize,
    max_entries: usize,
}

fn parse_args() -> Args {
    let mut parsed = Args {
        mode: "bare".to_owned(),
        listen: "127.0.0.1:0".parse().expect("default address"),
        threads: 1,
        max_entries: 100_000_000,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--mode" => parsed.mode = value,
            "--listen" => parsed.listen = value.parse().expect("--listen takes ip:port"),
            "--threads" => parsed.threads = value.parse().expect("--threads takes a number"),
            "--max-entries" => {
                parsed.max_entries = value.parse().expect("--max-entries takes a number")
            }
            other => panic!("unknown argument {other}"),
        }
    }
    parsed
}

fn main() {
    let args = parse_args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
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
        let incoming = TcpIncoming::from(listener);
        let service = OrdersServer::new(BenchOrders);
        match args.mode.as_str() {
            "bare" => {
                Server::builder()
                    .add_service(service)
                    .serve_with_incoming(incoming)
                    .await
            }
            "memory" => {
                Server::builder()
                    .layer(benches::grpc::memory_layer(args.max_entries))
                    .add_service(service)
                    .serve_with_incoming(incoming)
                    .await
            }
            other => panic!("unknown --mode {other} (bare, memory)"),
        }
        .expect("serve");
    });
}
