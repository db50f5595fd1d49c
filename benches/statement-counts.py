#!/usr/bin/env python3
"""Statements and round trips of one `createNamespace`, unkeyed and keyed.

Runs the example catalog (debug or release build, whichever `CATALOG` names; the release
build by default) with its database behind a counting TCP proxy, sends warm-up requests
(so that every pooled connection has its statements prepared), then N unkeyed and N keyed
`createNamespace` requests one at a time, and N retries of the keyed ones (replays), and
prints per request, as a Markdown table:

- PostgreSQL: statements (`Q` simple queries + `E` executes) and round trips (`Q` + `S`
  syncs), and of those the ones that only prepare a statement (parse and describe) and
  the pool's health checks (a lone sync before a connection is handed out);
- MySQL/MariaDB: statements (`COM_QUERY` + `COM_STMT_EXECUTE`) and round trips (every
  command that is answered: all but `COM_STMT_CLOSE`), and of those the prepares
  (`COM_STMT_PREPARE`) and health checks (`COM_PING`);
- Redis (records in Redis): commands, from `INFO commandstats`.

    benches/statement-counts.py                      # PostgreSQL and MariaDB, each way of keeping records
    N=50 benches/statement-counts.py postgres
    SMOKE=1 CATALOG=target/debug/iceberg-catalog benches/statement-counts.py   # CI's smoke run

SMOKE=1: 3 requests of each kind after 10 warm-up pairs (N still applies): every figure
once, not worth reading. Every run fails if a key adds more statements to a first
execution, or a replay sends more, than BUDGETS (what BENCHMARKS.md states) allows.

Needs the servers of scripts/services (PostgreSQL on 5432, MariaDB on 3306, Redis on
6379) and the catalog built with its comparison switches, for `--two-commit`
(`cargo build --release -p examples --features test-hooks --bin iceberg-catalog`).
"""

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOG = os.path.abspath(os.environ.get("CATALOG", os.path.join(ROOT, "target", "release", "iceberg-catalog")))
SMOKE = bool(os.environ.get("SMOKE"))
N = int(os.environ.get("N", "3" if SMOKE else "20"))
WARM_UP = 10 if SMOKE else 40
DATABASES = {
    "postgres": ("postgres://postgres@127.0.0.1:{port}/test", 5432),
    "mysql": ("mysql://root@127.0.0.1:{port}/test", 3306),
}
RECORDS = ["with-the-change", "two-commit", "redis"]


class Counts:
    def __init__(self):
        self.reset()

    def reset(self):
        self.statements = 0
        self.round_trips = 0
        # PostgreSQL: round trips that only prepare a statement, and lone syncs (the pool's
        # health check before it hands a connection out).
        self.prepares = 0
        self.health_checks = 0


async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def count_postgres(reader, writer, counts):
    untyped = True
    since_sync = b""
    try:
        while True:
            if untyped:
                length = struct.unpack(">I", await reader.readexactly(4))[0]
                body = await reader.readexactly(length - 4)
                writer.write(struct.pack(">I", length) + body)
                code = struct.unpack(">I", body[:4])[0]
                untyped = code in (80877103, 80877104)
            else:
                kind = await reader.readexactly(1)
                length_bytes = await reader.readexactly(4)
                body = await reader.readexactly(struct.unpack(">I", length_bytes)[0] - 4)
                writer.write(kind + length_bytes + body)
                if kind == b"Q":
                    counts.statements += 1
                    counts.round_trips += 1
                elif kind == b"E":
                    counts.statements += 1
                elif kind == b"S":
                    counts.round_trips += 1
                    if not since_sync:
                        counts.health_checks += 1
                    elif b"P" in since_sync and b"E" not in since_sync:
                        counts.prepares += 1
                    since_sync = b""
                    continue
                since_sync += kind
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def count_mysql(reader, writer, counts):
    try:
        while True:
            header = await reader.readexactly(4)
            length = header[0] | header[1] << 8 | header[2] << 16
            payload = await reader.readexactly(length)
            writer.write(header + payload)
            await writer.drain()
            # Commands start a sequence (0); the handshake's packets do not count.
            if header[3] != 0 or not payload:
                continue
            command = payload[0]
            if command in (0x03, 0x17):
                counts.statements += 1
            elif command == 0x16:
                counts.prepares += 1
            elif command == 0x0E:
                counts.health_checks += 1
            if command != 0x19:
                counts.round_trips += 1
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def proxy(wire, upstream_port, counts):
    async def client(reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        counter = count_postgres if wire == "postgres" else count_mysql
        try:
            await asyncio.gather(counter(reader, up_writer, counts), pipe(up_reader, writer))
        except asyncio.CancelledError:
            pass  # the proxy's connections still open when the script ends

    server = await asyncio.start_server(client, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base, body, key):
    request = urllib.request.Request(
        base + "/v1/namespaces",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **({"Idempotency-Key": key} if key else {})},
        method="POST",
    )
    with urllib.request.urlopen(request) as answer:
        assert answer.status == 200, answer.status


def redis_commands():
    out = subprocess.run(["redis-cli", "-p", "6379", "INFO", "commandstats"], capture_output=True, text=True).stdout
    total = 0
    for line in out.splitlines():
        if line.startswith("cmdstat_") and not line.startswith("cmdstat_info"):
            total += int(line.split("calls=")[1].split(",")[0])
    return total


async def measure(database, records):
    template, upstream_port = DATABASES[database]
    counts = Counts()
    server, port = await proxy(database, upstream_port, counts)
    listen = free_port()
    args = [CATALOG, "--listen", f"127.0.0.1:{listen}", "--database", template.format(port=port)]
    if records == "two-commit":
        args.append("--two-commit")
    if records == "redis":
        args += ["--idempotency-store", f"redis://127.0.0.1:6379/?key-prefix=counts{uuid.uuid4().hex[:8]}:"]
    work = tempfile.mkdtemp()
    log = open(os.path.join(work, "catalog.log"), "w")
    catalog = subprocess.Popen(args, cwd=work, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{listen}"
    loop = asyncio.get_running_loop()
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=0.2).close()
                break
            except OSError:
                await asyncio.sleep(0.1)
        sent = []

        def run(key, body=None):
            body = body or {"namespace": [f"c{uuid.uuid4().hex}"]}
            if key:
                sent.append((key, body))
            return loop.run_in_executor(None, post, base, body, key)

        for _ in range(WARM_UP):
            await run(None)
            await run(str(uuid.uuid4()))
        rows = []
        for request in ("unkeyed", "keyed", "replayed"):
            # The replays are retries of the keyed requests just sent: same keys, same bodies.
            first_executions = sent[-N:]
            counts.reset()
            commands = redis_commands()
            for i in range(N):
                if request == "replayed":
                    await run(*first_executions[i])
                else:
                    await run(str(uuid.uuid4()) if request == "keyed" else None)
            await asyncio.sleep(0.2)
            redis = (redis_commands() - commands) / N if records == "redis" else None
            rows.append((request, counts.statements / N, counts.round_trips / N, counts.prepares / N, counts.health_checks / N, redis))
        return rows
    finally:
        catalog.terminate()
        catalog.wait()
        server.close()


# What BENCHMARKS.md states, per database and way of keeping records: the most statements
# a key adds to a first execution, and the most a replay sends. A run past either fails.
BUDGETS = {
    ("postgres", "with-the-change"): (2, 4),
    ("postgres", "two-commit"): (2, 1),
    ("postgres", "redis"): (1, 0),
    ("mysql", "with-the-change"): (1, 2),
    ("mysql", "two-commit"): (2, 1),
    ("mysql", "redis"): (0, 0),
}


def over_budget(database, records, rows):
    """The budgets of BUDGETS that these rows break, in words."""
    added, replay = BUDGETS[(database, records)]
    statements = {request: count for request, count, *_ in rows}
    broken = []
    if statements["keyed"] - statements["unkeyed"] > added + 0.5:
        broken.append(f"a key adds {statements['keyed'] - statements['unkeyed']:.1f} statements (at most {added})")
    if statements["replayed"] > replay + 0.5:
        broken.append(f"a replay sends {statements['replayed']:.1f} statements (at most {replay})")
    return [f"{database}, records {records}: {what}" for what in broken]


async def main():
    databases = sys.argv[1].split() if len(sys.argv) > 1 else ["postgres", "mysql"]
    print("| database | records | request | statements | round trips | of which prepares | of which health checks | Redis commands |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    broken = []
    for database in databases:
        for records in RECORDS:
            rows = await measure(database, records)
            for request, statements, round_trips, prepares, checks, redis in rows:
                redis = "" if redis is None else f"{redis:.1f}"
                print(f"| {database} | {records} | {request} | {statements:.1f} | {round_trips:.1f} | {prepares:.1f} | {checks:.1f} | {redis} |", flush=True)
            broken += over_budget(database, records, rows)
    if broken:
        print("statement budgets broken:\n  " + "\n  ".join(broken), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())
