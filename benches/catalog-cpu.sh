#!/usr/bin/env bash
# Where the CPU goes: the example catalog (release build) serves `createNamespace`
# at 16 connections, unkeyed and keyed (a fresh key per request), two 5 s rounds each, and
# the catalog's and PostgreSQL's CPU ticks (/proc/<pid>/stat, user + system) over each
# round are divided by its requests. Run it on a quiet machine.
#
#   benches/catalog-cpu.sh postgres                 # one commit (the catalog's default)
#   benches/catalog-cpu.sh postgres --two-commit
#   benches/catalog-cpu.sh sqlite
#   CATALOG_BIN=/tmp/catalog-before benches/catalog-cpu.sh postgres   # another build
#   SMOKE=1 CATALOG_BIN=target/debug/iceberg-catalog benches/catalog-cpu.sh sqlite   # CI's smoke run
#
# SMOKE=1: one 1 s round of each (ROUNDS and SECONDS_PER_ROUND still apply), figures not
# worth reading, and a failed request fails the script.
#
# Needs wrk and the services of scripts/services (as benches/catalog.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
db="$1"; shift; extra=("$@")
smoke="${SMOKE:-}"
rounds="${ROUNDS:-$([ -n "$smoke" ] && echo 1 || echo 2)}"
seconds="${SECONDS_PER_ROUND:-$([ -n "$smoke" ] && echo 1 || echo 5)}"
# --two-commit is a comparison only in builds with the examples' test-hooks feature.
if [ -n "${CATALOG_BIN:-}" ]; then
  catalog_bin="$CATALOG_BIN"   # a build of your own (another commit's, to compare)
else
  cargo build --release --locked -q -p examples --features test-hooks --bin iceberg-catalog
  target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  catalog_bin="$target_dir/release/iceberg-catalog"
fi
port=18383
work=$(mktemp -d)
case "$db" in
  sqlite) url="sqlite://$work/c.db?mode=rwc" ;;
  postgres) name="cpu_$RANDOM$RANDOM"; psql -h 127.0.0.1 -U postgres -d postgres -qc "CREATE DATABASE $name"; url="postgres://postgres@127.0.0.1:5432/$name" ;;
esac
"$catalog_bin" --listen 127.0.0.1:$port --database "$url" --warehouse "$work/wh" "${extra[@]}" >/dev/null 2>&1 &
pid=$!
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$port/v1/config" >/dev/null && break
  sleep 0.2
done
cat > $work/ns.lua <<'LUA'
local counter = 0
local mode, nonce = "nokey", 0
init = function(args) mode = args[1]; nonce = tonumber(args[2]) end
request = function()
  counter = counter + 1
  local h = {["Content-Type"]="application/json"}
  if mode == "fresh" then h["Idempotency-Key"] = string.format("%08x-%04x-4000-8000-%012x", nonce, 0, counter) end
  return wrk.format("POST", "/v1/namespaces", h, string.format('{"namespace":["n%d_%d"]}', nonce, counter))
end
LUA
ticks() { awk '{print $14+$15}' /proc/$1/stat; }
pgticks() { t=0; for p in $(pgrep -u postgres postgres 2>/dev/null); do v=$(awk '{print $14+$15}' /proc/$p/stat 2>/dev/null || echo 0); t=$((t+v)); done; echo $t; }
n=1
for round in $(seq 1 "$rounds"); do
for mode in nokey fresh; do
  n=$((n+1))
  c0=$(ticks $pid); p0=$(pgticks)
  out=$(wrk -t1 -c16 -d"${seconds}s" -s $work/ns.lua http://127.0.0.1:$port -- $mode $((RANDOM*100+n)))
  if [ -n "$smoke" ] && echo "$out" | grep -q 'Non-2xx\|Socket errors'; then
    echo "$db $mode: requests failed: $out" >&2; kill $pid; exit 1
  fi
  c1=$(ticks $pid); p1=$(pgticks)
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  python3 -c "import sys; r=$reqs; print(f'$db ${extra[*]:-one-commit} $mode: {float(\"$rps\"):.0f} req/s, catalog {($c1-$c0)*10000/r:.0f} us/req, postgres {($p1-$p0)*10000/r:.0f} us/req')"
done
done
kill $pid; wait $pid 2>/dev/null || true
rm -rf "$work"
if [ "$db" = postgres ]; then psql -h 127.0.0.1 -U postgres -d postgres -qc "DROP DATABASE IF EXISTS $name" || true; fi
