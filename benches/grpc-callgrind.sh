#!/usr/bin/env bash
# Instructions per gRPC call of `grpc-server` over real HTTP/2 on loopback, counted by
# callgrind (instruction counts do not depend on what else the machine runs):
#
#   benches/grpc-callgrind.sh MODE LOAD CALLS_IN_FLIGHT [SECONDS]
#   benches/grpc-callgrind.sh memory fresh 16 5     # MODE bare|memory, LOAD nokey|fresh|fixed
#
# Starts the server under `valgrind --tool=callgrind`, drives it with `grpc-load` for 1 s
# (warm-up; in `fixed` mode this also executes the key once), zeroes the counters, drives
# it again for SECONDS (default 5), dumps the counters, and divides the server's
# instructions (all threads) by the calls it answered in that window. Needs valgrind and
# the release binaries (`cargo build --release --locked -p benches --bins`).
set -euo pipefail
mode=$1
load=$2
conc=$3
secs=${4:-5}
cd "$(dirname "$0")/.."
bin=$(cargo metadata --format-version 1 --no-deps \
    | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)/release
out=$(mktemp -d)/callgrind
valgrind --tool=callgrind --callgrind-out-file="$out.%p" \
    "$bin/grpc-server" --mode "$mode" --listen 127.0.0.1:0 >"$out.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do grep -q "listening on" "$out.log" && break; sleep 0.2; done
addr=$(grep -o "listening on .*" "$out.log" | cut -d' ' -f3)
connections=$(((conc + 15) / 16))
load_args=(--addr "$addr" --mode "$load" --concurrency "$conc" --connections "$connections"
    --fixed-key k-callgrind)
"$bin/grpc-load" "${load_args[@]}" --seconds 1 --nonce warm-$$ >/dev/null
callgrind_control -z "$server" >/dev/null 2>&1
result=$("$bin/grpc-load" "${load_args[@]}" --seconds "$secs" --nonce run-$$)
callgrind_control -d "$server" >/dev/null 2>&1
sleep 1
# The calls of the window, and the one warm-up call grpc-load makes on each connection.
calls=$(($(echo "$result" | grep -o 'requests=[0-9]*' | cut -d= -f2) + connections))
instructions=$(grep -h '^summary:\|^totals:' "$out".*.1 | head -1 | awk '{print $2}')
echo "$mode $load, $conc in flight: $calls calls, $((instructions / calls)) instructions/call ($result)"
