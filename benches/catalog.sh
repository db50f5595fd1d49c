#!/usr/bin/env bash
# The main job, measured as an operator meets it: the example Iceberg catalog
# (release build) on SQLite and on PostgreSQL, `createNamespace` (a fresh namespace per
# request) and `updateTable` (a property set on one of 64 tables, round robin), each
# unkeyed, keyed with a fresh UUID per request, and replayed (one key, sent again and
# again), in alternating 5 s rounds of `wrk -t1`, 16 and 64 connections. Prints a Markdown
# table of requests per second and keyed / unkeyed ratios.
#
#   benches/catalog.sh                         # SQLite and PostgreSQL, 2 rounds
#   ROUNDS=3 SECONDS_PER_ROUND=5 benches/catalog.sh sqlite
#   benches/catalog.sh postgres redis://127.0.0.1:6379   # records in Redis (--idempotency-store)
#   benches/catalog.sh "sqlite postgres" two-commit      # records reserved in a commit of their own
#   CATALOG_BIN=/tmp/catalog-before benches/catalog.sh postgres   # another build (e.g. another commit's)
#   SMOKE=1 CATALOG_BIN=target/debug/iceberg-catalog benches/catalog.sh   # CI's smoke run
#   PREFILL_RECORDS=1000000 benches/catalog.sh     # a records table that already holds 1M live records
#
# SMOKE=1: one 1 s round at 16 connections (ROUNDS, SECONDS_PER_ROUND and CONNECTIONS
# still apply), figures not worth reading, and a failed request fails the script.
#
# By default the records are in the catalog's database and a keyed change commits once
# (OneCommitStore); `two-commit` runs the catalog with --two-commit, the path before it.
#
# Needs wrk (installed here if missing); PostgreSQL and Redis come from scripts/services.
# Everything runs on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

databases="${1:-sqlite postgres}"
records="${2:-}"
smoke="${SMOKE:-}"
rounds="${ROUNDS:-$([ -n "$smoke" ] && echo 1 || echo 2)}"
seconds="${SECONDS_PER_ROUND:-$([ -n "$smoke" ] && echo 1 || echo 5)}"
connections="${CONNECTIONS:-$([ -n "$smoke" ] && echo 16 || echo "16 64")}"
port=18181

if ! command -v wrk >/dev/null 2>&1; then
  echo "installing wrk (Debian package)…" >&2
  if [ "$(id -u)" -eq 0 ]; then apt-get install -y -qq wrk >&2; else sudo apt-get install -y -qq wrk >&2; fi
fi
scripts/services start >&2
# --two-commit is a comparison only in builds with the examples' test-hooks feature.
features=()
[ "$records" = two-commit ] && features=(--features test-hooks)
if [ -n "${CATALOG_BIN:-}" ]; then
  catalog_bin="$CATALOG_BIN"   # a build of your own (another commit's, to compare)
else
  echo "building the example catalog (release)…" >&2
  cargo build --release --locked -q -p examples "${features[@]}" --bin iceberg-catalog >&2
  target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  catalog_bin="$target_dir/release/iceberg-catalog"
fi

work=$(mktemp -d)
catalog_pid=
cleanup() {
  if [ -n "$catalog_pid" ]; then kill "$catalog_pid" 2>/dev/null || true; wait "$catalog_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/load.lua" <<'LUA'
-- args: mode (nokey | fresh | fixed), operation (namespace | update), nonce
local mode, op, nonce = "nokey", "namespace", 1
local counter = 0
local tid = 0
local started = 0

function setup(thread)
  started = started + 1
  thread:set("tid", started)
end

function init(args)
  mode, op, nonce = args[1], args[2], tonumber(args[3])
end

function request()
  counter = counter + 1
  local n = counter
  if mode == "fixed" then n = 0 end
  local key = string.format("%08x-%04x-4000-8000-%012x", nonce, tid or 0, n)
  local headers = { ["Content-Type"] = "application/json" }
  if mode ~= "nokey" then headers["Idempotency-Key"] = key end
  if op == "namespace" then
    local body = string.format('{"namespace":["n%d_%d_%d"]}', nonce, tid or 0, n)
    return wrk.format("POST", "/v1/namespaces", headers, body)
  end
  local body = string.format(
    '{"requirements":[],"updates":[{"action":"set-properties","updates":{"p":"%d-%d"}}]}',
    nonce, n)
  return wrk.format("POST", string.format("/v1/namespaces/bench/tables/t%d", n % 64), headers, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT requests=%d duration_us=%d non2xx=%d socket_errors=%d\n",
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout))
end
LUA

start_catalog() {
  local database="$1"
  local args=(--listen "127.0.0.1:$port" --database "$database" --warehouse "$work/warehouse")
  case "$records" in
    "") ;;
    two-commit) args+=(--two-commit) ;;
    *) args+=(--idempotency-store "$records") ;;
  esac
  "$catalog_bin" "${args[@]}" >"${CATALOG_LOG:-/dev/null}" 2>&1 &
  catalog_pid=$!
  for _ in $(seq 1 100); do
    curl -sf "http://127.0.0.1:$port/v1/config" >/dev/null && break
    sleep 0.2
  done
  curl -sf -X POST "http://127.0.0.1:$port/v1/namespaces" -d '{"namespace":["bench"]}' >/dev/null
  [ "${PREFILL_RECORDS:-0}" -gt 0 ] && prefill "$database" "$PREFILL_RECORDS"
  for t in $(seq 0 63); do
    curl -sf -X POST "http://127.0.0.1:$port/v1/namespaces/bench/tables" \
      -d "{\"name\":\"t$t\",\"schema\":{\"type\":\"struct\",\"schema-id\":0,\"fields\":[{\"id\":1,\"name\":\"id\",\"required\":true,\"type\":\"long\"}]}}" >/dev/null
  done
}

# prefill URL N: N live finished records (another scope's, expiring in an hour) in the
# catalog's records table, so that every lookup searches a table of that size.
prefill() {
  local now_ms=$(( $(date +%s) * 1000 ))
  # A row per g: scope, key, method, path, body hash, token, created, expires, lease,
  # status, headers, body, trailers; $1 is the database's empty byte string.
  row() {
    echo "'prefill', 'key-' || g, 'POST', '/v1/namespaces', $1, g, $now_ms,
      $now_ms + 3600000, $now_ms, 200, $1, $1, NULL"
  }
  case "$1" in
    postgres*)
      psql "$1" -qc "INSERT INTO idempotency_records
        SELECT $(row "''::bytea") FROM generate_series(1, $2) AS g;
        ANALYZE idempotency_records" >&2 ;;
    sqlite*)
      python3 - "$work/catalog.db" "$2" "SELECT $(row "X''") FROM n" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=30)
db.execute(f"""INSERT INTO idempotency_records
  WITH RECURSIVE n(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM n WHERE g < {int(sys.argv[2])})
  {sys.argv[3]}""")
db.commit()
PY
      ;;
  esac
  echo "prefilled $2 records" >&2
}

stop_catalog() {
  kill "$catalog_pid" 2>/dev/null || true
  wait "$catalog_pid" 2>/dev/null || true
  catalog_pid=
}

nonce=$(( $(date +%s) % 100000 * 1000 ))
# rps MODE OP CONNECTIONS NONCE: one round, requests per second (failures on stderr);
# NONCE makes the round's keys and namespaces its own.
rps() {
  if [ "$1" = fixed ]; then # the one execution the replays replay
    wrk -t1 -c1 -d1s -s "$work/load.lua" "http://127.0.0.1:$port" -- fixed "$2" "$4" >/dev/null
  fi
  local line
  line=$(wrk -t1 -c"$3" -d"${seconds}s" --timeout 10s -s "$work/load.lua" "http://127.0.0.1:$port" -- "$1" "$2" "$4" | grep '^RESULT')
  python3 - "$line" "$1 $2 c$3" "$smoke" <<'PY'
import sys
fields = dict(kv.split("=") for kv in sys.argv[1].split()[1:])
requests, seconds = int(fields["requests"]), int(fields["duration_us"]) / 1e6
failed = int(fields["non2xx"]) + int(fields["socket_errors"])
if failed:
    print(f"{sys.argv[2]}: {failed} of {requests} requests failed", file=sys.stderr)
    if sys.argv[3]:
        sys.exit(1)
print(f"{(requests - failed) / seconds:.0f}")
PY
}

echo "| database | records | operation | c | unkeyed req/s | keyed req/s (fresh key) | keyed / unkeyed | replay req/s | replay / unkeyed |"
echo "|---|---|---|---|---|---|---|---|---|"
for db in $databases; do
  case "$db" in
    sqlite) url="sqlite://$work/catalog.db?mode=rwc" ;;
    postgres)
      name="catalog_bench_$nonce"
      psql -h 127.0.0.1 -U postgres -d postgres -qc "CREATE DATABASE $name" >&2
      url="postgres://postgres@127.0.0.1:5432/$name" ;;
    *) echo "unknown database $db (sqlite or postgres)" >&2; exit 2 ;;
  esac
  start_catalog "$url"
  for op in namespace update; do
    for c in $connections; do
      unkeyed=(); keyed=(); replay=()
      for _ in $(seq 1 "$rounds"); do
        nonce=$((nonce + 3))
        unkeyed+=("$(rps nokey "$op" "$c" "$nonce")")
        keyed+=("$(rps fresh "$op" "$c" "$((nonce + 1))")")
        replay+=("$(rps fixed "$op" "$c" "$((nonce + 2))")")
      done
      python3 - "$db" "${records:-same database, one commit}" "$op" "$c" "${unkeyed[*]}" "${keyed[*]}" "${replay[*]}" <<'PY'
import sys, statistics
db, records, op, c = sys.argv[1:5]
u, k, r = ([float(x) for x in a.split()] for a in sys.argv[5:8])
mu, mk, mr = (statistics.median(x) for x in (u, k, r))
name = {"namespace": "createNamespace", "update": "updateTable"}[op]
fmt = lambda xs: " / ".join(f"{x:,.0f}" for x in xs)
print(f"| {db} | {records} | {name} | {c} | {fmt(u)} | {fmt(k)} | {mk / mu:.2f} | {fmt(r)} | {mr / mu:.2f} |")
PY
    done
  done
  stop_catalog
  if [ "$db" = postgres ]; then
    psql -h 127.0.0.1 -U postgres -d postgres -qc "DROP DATABASE IF EXISTS $name" >&2 || true
  fi
done
