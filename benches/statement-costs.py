#!/usr/bin/env python3
"""What each statement of one `createNamespace` costs PostgreSQL, unkeyed and keyed.

Starts a PostgreSQL cluster of its own (a temporary directory, a free port, the server of
scripts/services with `pg_stat_statements` loaded), runs the example catalog on it,
sends warm-up requests, then N unkeyed and N keyed `createNamespace` requests one at a
time, and prints, as Markdown:

- per request and statement (`pg_stat_statements`, reset before each kind): calls, and
  the time PostgreSQL spent in it (planning and execution; a `COMMIT`'s includes its
  WAL flush);
- per request: the CPU of all the cluster's processes (`/proc/<pid>/stat`, user +
  system), and of the catalog.

    benches/statement-costs.py                 # N = 2000
    N=500 CATALOG=target/release/iceberg-catalog benches/statement-costs.py
    SMOKE=1 CATALOG=target/debug/iceberg-catalog benches/statement-costs.py   # CI's smoke run

SMOKE=1: 10 requests of each kind after 10 warm-up pairs (N still applies): every figure
once, not worth reading.

Needs the PostgreSQL binaries scripts/services installs, and the catalog's release build
(`cargo build --release -p examples --bin iceberg-catalog`). Run it on a quiet machine.
"""

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOG = os.path.abspath(os.environ.get("CATALOG", os.path.join(ROOT, "target", "release", "iceberg-catalog")))
SMOKE = bool(os.environ.get("SMOKE"))
N = int(os.environ.get("N", "10" if SMOKE else "2000"))
WARM_UP = 10 if SMOKE else 100
TICK_US = 1_000_000 / os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin():
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if not found:
        sys.exit("no PostgreSQL server: run scripts/services start first (it installs it)")
    return os.path.dirname(found[-1])


def as_postgres(args, **kwargs):
    """Runs a server program as the `postgres` user when this is root (initdb refuses root)."""
    if os.geteuid() == 0:
        args = ["runuser", "-u", "postgres", "--"] + args
    return subprocess.run(args, check=True, **kwargs)


def cpu_ticks(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except FileNotFoundError:
            pass
    return total


def cluster_pids(postmaster):
    children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True).stdout.split()
    return [postmaster] + [int(p) for p in children]


def psql(port, sql):
    out = subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-d", "test", "-tAF", "\t", "-c", sql],
        check=True, capture_output=True, text=True).stdout
    return [line.split("\t") for line in out.splitlines() if line]


def post(base, key):
    body = json.dumps({"namespace": [f"c{uuid.uuid4().hex}"]}).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(base + "/v1/namespaces", data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request) as answer:
        assert answer.status == 200, answer.status


def short(query):
    query = re.sub(r"\s+", " ", query).strip()
    return (query[:90] + "…") if len(query) > 90 else query


def main():
    bindir = postgres_bin()
    data = tempfile.mkdtemp(prefix="statement-costs-")
    if os.geteuid() == 0:
        shutil.chown(data, "postgres", "postgres")
    port = free_port()
    as_postgres([f"{bindir}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "--encoding=UTF8",
                 "--locale=C.UTF-8"], stdout=subprocess.DEVNULL)
    options = (f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories='' "
               "-c max_connections=300 -c shared_preload_libraries=pg_stat_statements "
               "-c pg_stat_statements.track=all -c pg_stat_statements.track_utility=on "
               "-c pg_stat_statements.track_planning=on")
    as_postgres([f"{bindir}/pg_ctl", "-D", data, "-l", f"{data}/server.log", "-w", "-t", "60", "start", "-o", options],
                stdout=subprocess.DEVNULL)
    catalog = None
    try:
        subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-d", "postgres", "-qc",
                        "CREATE DATABASE test"], check=True)
        psql(port, "CREATE EXTENSION pg_stat_statements")
        with open(f"{data}/postmaster.pid") as f:
            postmaster = int(f.readline())
        listen = free_port()
        work = tempfile.mkdtemp()
        log = open(os.path.join(work, "catalog.log"), "w")
        catalog = subprocess.Popen(
            [CATALOG, "--listen", f"127.0.0.1:{listen}", "--database", f"postgres://postgres@127.0.0.1:{port}/test",
             "--warehouse", os.path.join(work, "warehouse")], cwd=work, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{listen}"
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        for _ in range(WARM_UP):
            post(base, None)
            post(base, str(uuid.uuid4()))
        print(f"PostgreSQL per `createNamespace`, {N} requests of each kind one at a time:\n")
        summary = []
        for keyed in (False, True):
            kind = "keyed" if keyed else "unkeyed"
            psql(port, "SELECT pg_stat_statements_reset()")
            pids = cluster_pids(postmaster)
            before, catalog_before = cpu_ticks(pids), cpu_ticks([catalog.pid])
            started = time.monotonic()
            for _ in range(N):
                post(base, str(uuid.uuid4()) if keyed else None)
            elapsed = time.monotonic() - started
            pids = cluster_pids(postmaster)
            database_us = (cpu_ticks(pids) - before) * TICK_US / N
            catalog_us = (cpu_ticks([catalog.pid]) - catalog_before) * TICK_US / N
            rows = psql(port, "SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls, total_plan_time + total_exec_time "
                              "FROM pg_stat_statements "
                              "WHERE query NOT LIKE '%pg_stat_statements%' AND calls >= " + str(N // 2) +
                              " ORDER BY 3 DESC")
            print(f"| {kind}: statement | calls per request | µs per request |")
            print("| --- | --- | --- |")
            in_statements = 0.0
            for query, calls, total_ms in rows:
                us = float(total_ms) * 1000 / N
                in_statements += us
                print(f"| `{short(query)}` | {int(calls) / N:.2f} | {us:.1f} |")
            print(f"| **all statements** | | **{in_statements:.1f}** |\n")
            summary.append((kind, N / elapsed, in_statements, database_us, catalog_us))
        print("| request | requests/s (one at a time) | µs in statements | PostgreSQL CPU µs | catalog CPU µs |")
        print("| --- | --- | --- | --- | --- |")
        for kind, rate, in_statements, database_us, catalog_us in summary:
            print(f"| {kind} | {rate:.0f} | {in_statements:.1f} | {database_us:.0f} | {catalog_us:.0f} |")
    finally:
        if catalog:
            catalog.terminate()
            catalog.wait()
        as_postgres([f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "stop"], stdout=subprocess.DEVNULL)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
