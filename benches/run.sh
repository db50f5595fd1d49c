#!/usr/bin/env bash
# Runs the whole benchmark comparison of BENCHMARKS.md and prints the tables (Markdown).
#
#   benches/run.sh --quick            # a few minutes on 2 cores
#   benches/run.sh                    # the full run (about half an hour)
#   benches/run.sh --quick --out /tmp/results.md --only http,sql,redis
#   benches/run.sh --quick --only grpc   # bare tonic against the layer (gRPC profile)
#
# Every argument goes to the `compare` binary (see benches/src/bin/compare.rs). It needs:
# wrk (Debian package, installed here if missing), PostgreSQL at
# postgres://postgres@127.0.0.1:5432/test and MariaDB at mysql://root@127.0.0.1:3306/test,
# which scripts/services installs and starts when they are missing (override with
# BENCH_POSTGRES_URL / BENCH_MYSQL_URL); a database that does not answer is reported as
# skipped. The gRPC part needs nothing installed: its server and its tonic
# load generator (grpc-server, grpc-load) are built here. The Redis benchmarks start a
# redis-server of their own on a free port (or use BENCH_REDIS_URL). Everything runs on
# 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v wrk >/dev/null 2>&1; then
    echo "installing wrk (Debian package)…" >&2
    sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
    sudo_if_needed apt-get update -qq >&2
    sudo_if_needed apt-get install -y -qq wrk >&2
fi

# PostgreSQL, MariaDB and Redis as the test suite gets them (installed and started when
# missing); BENCH_POSTGRES_URL / BENCH_MYSQL_URL point elsewhere.
scripts/services start >&2

echo "building the benchmark binaries (release)…" >&2
cargo build --release --locked -p benches --features sql,redis --bins >&2

# The peer (`idempotent` 2.x, with its memory and Valkey/Redis stores) declares
# rust-version 1.98; it is its own workspace with its own lockfile and builds on 1.95 with
# --ignore-rust-version.
peer_dir=benches/peer-idempotent
echo "building the idempotent-crate peer server (release)…" >&2
cargo build --release --locked --ignore-rust-version \
    --manifest-path "$peer_dir/Cargo.toml" --target-dir "$peer_dir/target" >&2

target_dir=$(cargo metadata --format-version 1 --no-deps \
    | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)
exec "$target_dir/release/compare" --peer "$peer_dir/target/release/peer-idempotent" "$@"
