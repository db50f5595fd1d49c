#!/usr/bin/env python3
"""Server time of one Redis replay: the reserve script on a finished record, as Redis
itself counts it (`INFO commandstats`, `usec_per_call` of `evalsha`).

Starts a redis-server of its own on a free loopback port, loads the store's reserve script
(the prelude and the reserve part of idempotency-store-redis/src/lua.rs, at the working
tree or, with --rev REV, at a commit: several revisions are measured round by round,
interleaved), writes a finished record, then runs `redis-benchmark` EVALSHA rounds on it
and prints the median per revision as a Markdown table:

    benches/redis-server-time.py                       # the working tree
    benches/redis-server-time.py --rev HEAD~1 --rev .  # a commit against the working tree
    ROUNDS=3 REQUESTS=50000 benches/redis-server-time.py

Needs redis-server and redis-benchmark (Debian's redis-tools; scripts/services installs
them). The record and the arguments are those of a keyed POST replayed: 9 fields, a
60-byte body.
"""

import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LUA = "idempotency-store-redis/src/lua.rs"
ROUNDS = int(os.environ.get("ROUNDS", "5"))
REQUESTS = int(os.environ.get("REQUESTS", "300000"))
CLIENTS = int(os.environ.get("CLIENTS", "16"))
KEY = "idempotency:{0::bench-replay}"


def lua_source(rev):
    """The prelude and the reserve script, as the store sends them."""
    if rev == ".":
        with open(os.path.join(ROOT, LUA)) as file:
            text = file.read()
    else:
        text = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{LUA}"],
                              check=True, capture_output=True, text=True).stdout
    constants = dict(re.findall(r'pub\(crate\) const (\w+): &str = r#"(.*?)"#;', text, re.S))
    return constants["PRELUDE"] + "\n" + constants["RESERVE"]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cli(port, *args):
    return subprocess.run(["redis-cli", "-p", str(port), *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def main():
    revs = []
    args = sys.argv[1:]
    while args:
        if args[0] == "--rev" and len(args) > 1:
            revs.append(args[1])
            args = args[2:]
        else:
            sys.exit(f"unknown argument {args[0]!r}; see the docstring")
    revs = revs or ["."]
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no", "--dir", workdir],
                                  stdout=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    cli(port, "PING")
                    break
                except subprocess.CalledProcessError:
                    time.sleep(0.05)
            shas = {rev: cli(port, "SCRIPT", "LOAD", lua_source(rev)) for rev in revs}
            # A finished record, alive for an hour (both ways of setting its key's expiry
            # leave it alive: the scripts read it as a replay).
            now_ms = int(time.time() * 1000)
            cli(port, "HSET", KEY, "method", "POST", "path", "/v1/orders",
                "body_sha256", "a" * 32, "fencing_token", "4242",
                "created_at_ms", str(now_ms), "expires_at_ms", str(now_ms + 3_600_000),
                "lease_expires_at_ms", str(now_ms + 30_000), "response_status", "201",
                "response_headers", "content-type:application/json\n",
                "response_body", '{"id":"order-1","item":"book","quantity":1,"status":"placed"}')
            cli(port, "PEXPIREAT", KEY, str(now_ms + 3_600_000))
            times = {rev: [] for rev in revs}
            for _ in range(ROUNDS):
                for rev in revs:
                    cli(port, "CONFIG", "RESETSTAT")
                    subprocess.run(["redis-benchmark", "-p", str(port), "-q", "-n", str(REQUESTS),
                                    "-c", str(CLIENTS), "EVALSHA", shas[rev], "1", KEY, "4243",
                                    "30000", "86400000", "POST", "/v1/orders", "a" * 32],
                                   check=True, capture_output=True)
                    stats = cli(port, "INFO", "commandstats")
                    match = re.search(r"cmdstat_evalsha:calls=(\d+),usec=\d+,usec_per_call=([\d.]+)", stats)
                    if not match or int(match.group(1)) < REQUESTS:
                        sys.exit(f"redis-benchmark did not run the script {REQUESTS} times: {stats}")
                    times[rev].append(float(match.group(2)))
            print("| reserve script at | server µs per replay (median) | rounds |")
            print("| --- | --- | --- |")
            for rev in revs:
                rounds = " / ".join(f"{t:.2f}" for t in times[rev])
                print(f"| {'working tree' if rev == '.' else rev} | {statistics.median(times[rev]):.2f} | {rounds} |")
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
