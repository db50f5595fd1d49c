#!/usr/bin/env bash
# Runs the whole benchmark comparison of BENCHMARKS.md and prints the tables (Markdown).
#
#   benches/run.sh --quick            # about 15–20 minutes on 2 cores, plus the release build
#   benches/run.sh                    # the full run (about half an hour)
#   benches/run.sh --quick --out /tmp/results.md --only http,sql,redis
#   benches/run.sh --quick --only grpc   # bare tonic against the layer (gRPC profile)
#   benches/run.sh --smoke            # CI: every table once, tiny, checked (a few minutes)
#   benches/run.sh --smoke --only sql # the smoke run of `compare`'s sections only
#
# --smoke builds in the DEBUG profile (the target directory's debug build, which the
# test suite has mostly compiled already: no release build in CI) and runs
# `compare --smoke` (every section, tiny runs and sizes; it fails on a skipped row, a
# missing table, a figure that is missing or not finite, or a load run with errors), then,
# unless arguments for `compare` were given, the smoke form (SMOKE=1) of each measuring
# script BENCHMARKS.md names, on the debug catalog, each output checked by
# benches/check-tables.py. Any failure exits non-zero. Its figures are not worth reading.
#
# Every argument goes to the `compare` binary (see benches/src/bin/compare.rs). It needs:
# wrk (Debian package, installed here if missing), PostgreSQL at
# postgres://postgres@127.0.0.1:5432/test and MariaDB at mysql://root@127.0.0.1:3306/test,
# which scripts/services installs and starts when they are missing (with the NATS server the
# queue consumer's script drains; override with
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

target_dir=$(cargo metadata --format-version 1 --no-deps \
    | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)
peer_dir=benches/peer-idempotent

if [ "${1:-}" = --smoke ]; then
    shift
    started=$SECONDS
    echo "building the benchmark binaries, the example catalog and the peer (debug)…" >&2
    cargo build --locked -p benches --features sql,redis --bins >&2
    # The catalog with its comparison switches (--two-commit), as the scripts want it.
    cargo build --locked -p examples --features test-hooks --bin iceberg-catalog --bin nats-orders >&2
    cargo build --locked --ignore-rust-version \
        --manifest-path "$peer_dir/Cargo.toml" --target-dir "$peer_dir/target" >&2
    echo "compare --smoke…" >&2
    "$target_dir/debug/compare" --smoke --peer "$peer_dir/target/debug/peer-idempotent" "$@"
    if [ $# -gt 0 ]; then
        exit 0
    fi
    catalog="$target_dir/debug/iceberg-catalog"
    check=benches/check-tables.py
    smoke() { echo "smoke: $*" >&2; }
    # (Its records-in-Redis and --two-commit forms start the same catalog with the flags
    # statement-counts.py runs below.)
    smoke "benches/catalog.sh"
    SMOKE=1 PREFILL_RECORDS=1000 CATALOG_BIN="$catalog" benches/catalog.sh "sqlite postgres" | "$check" --tables 1
    smoke "benches/catalog-snapshots.sh"
    SMOKE=1 CATALOG_BIN="$catalog" benches/catalog-snapshots.sh | "$check" --tables 1
    for db in sqlite postgres; do
        smoke "benches/catalog-cpu.sh $db"
        SMOKE=1 CATALOG_BIN="$catalog" benches/catalog-cpu.sh "$db" \
            | "$check" --lines 2 --pattern '[0-9]+ req/s, catalog [0-9]+ us/req, postgres [0-9]+ us/req'
    done
    smoke "benches/statement-counts.py"
    SMOKE=1 CATALOG="$catalog" benches/statement-counts.py | "$check" --tables 1 \
        --may-be-empty "Redis commands"
    smoke "benches/statement-costs.py"
    SMOKE=1 CATALOG="$catalog" benches/statement-costs.py | "$check" --tables 3 \
        --may-be-empty "calls per request"
    smoke "benches/nats-consumer.sh"
    SMOKE=1 NATS_ORDERS_BIN="$target_dir/debug/nats-orders" benches/nats-consumer.sh \
        | "$check" --tables 1
    echo "smoke: every benchmark and measuring script ran, every figure checked ($((SECONDS - started)) s)" >&2
    exit 0
fi

echo "building the benchmark binaries (release)…" >&2
cargo build --release --locked -p benches --features sql,redis --bins >&2

# The peer (`idempotent` 2.x, with its memory and Valkey/Redis stores) declares
# rust-version 1.98; it is its own workspace with its own lockfile and builds on 1.95 with
# --ignore-rust-version.
echo "building the idempotent-crate peer server (release)…" >&2
cargo build --release --locked --ignore-rust-version \
    --manifest-path "$peer_dir/Cargo.toml" --target-dir "$peer_dir/target" >&2

exec "$target_dir/release/compare" --peer "$peer_dir/target/release/peer-idempotent" "$@"
