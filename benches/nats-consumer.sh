#!/usr/bin/env bash
# The queue consumer as an operator meets it: the example `nats-orders` (release build)
# drains ORDERS order messages from NATS JetStream into PostgreSQL, once with the layer
# (each order's row and record in one commit) and once without (a plain INSERT per
# message), in alternating rounds, one consumer at a time. Prints a Markdown table of
# messages per second and the ratio of the two, each round's pair measured back to back.
#
#   benches/nats-consumer.sh                    # 3 rounds of 5,000 orders
#   ROUNDS=5 ORDERS=20000 benches/nats-consumer.sh
#   SMOKE=1 NATS_ORDERS_BIN=target/debug/nats-orders benches/nats-consumer.sh   # CI's smoke run
#
# SMOKE=1: one round of 100 orders, figures not worth reading. The time runs from the
# consumer's start (the orders already in the stream) to the last order's row, polled
# every 20 ms. NATS and PostgreSQL come from scripts/services; everything is on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

smoke="${SMOKE:-}"
rounds="${ROUNDS:-$([ -n "$smoke" ] && echo 1 || echo 3)}"
orders="${ORDERS:-$([ -n "$smoke" ] && echo 100 || echo 5000)}"
database="${BENCH_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}"

scripts/services start >&2
if [ -n "${NATS_ORDERS_BIN:-}" ]; then
  bin="$NATS_ORDERS_BIN"
else
  echo "building nats-orders (release)…" >&2
  cargo build --release --locked -q -p examples --bin nats-orders >&2
  target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  bin="$target_dir/release/nats-orders"
fi

sql() { psql "$database" -tAq -c "$1"; }
consumer_pid=
prefixes=()
cleanup() {
  if [ -n "$consumer_pid" ]; then kill "$consumer_pid" 2>/dev/null || true; wait "$consumer_pid" 2>/dev/null || true; fi
  for prefix in "${prefixes[@]}"; do
    sql "DROP TABLE IF EXISTS ${prefix}_orders; DROP TABLE IF EXISTS ${prefix}_records" >/dev/null 2>&1 || true
  done
}
trap cleanup EXIT

# Messages per second of one drain: publish the orders, then time one consumer from its
# start until every order has its row.
drain() {
  local mode="$1" id prefix stream started rows elapsed
  id="$(python3 -c 'import uuid; print(uuid.uuid4().hex[:12])')"
  stream="BENCH_$id" prefix="bench_nats_$id"
  prefixes+=("$prefix")
  "$bin" --database "$database" --stream "$stream" --table-prefix "$prefix" --publish "$orders" >&2
  local flags=()
  [ "$mode" = without ] && flags=(--without-idempotency)
  started=$(date +%s.%N)
  "$bin" --database "$database" --stream "$stream" --table-prefix "$prefix" "${flags[@]}" 2>/dev/null &
  consumer_pid=$!
  while :; do
    rows="$(sql "SELECT COUNT(*) FROM ${prefix}_orders" 2>/dev/null || echo 0)"
    [ "$rows" -ge "$orders" ] && break
    if ! kill -0 "$consumer_pid" 2>/dev/null; then echo "nats-orders ($mode) exited early" >&2; exit 1; fi
    sleep 0.02
  done
  elapsed="$(python3 -c "import time; print(time.time() - $started)")"
  kill "$consumer_pid"; wait "$consumer_pid" 2>/dev/null || true; consumer_pid=
  sql "DROP TABLE IF EXISTS ${prefix}_orders; DROP TABLE IF EXISTS ${prefix}_records" >/dev/null
  python3 -c "print(round($orders / $elapsed))"
}

echo "| round | without the layer (msg/s) | with it, one commit (msg/s) | with / without |"
echo "| --- | --- | --- | --- |"
for round in $(seq 1 "$rounds"); do
  without="$(drain without)"
  with="$(drain with)"
  echo "| $round | $without | $with | $(python3 -c "print(f'{$with / $without:.2f}')") |"
done
