#!/usr/bin/env bash
# Keyed commits to tables with many snapshots: what a keyed `updateTable` costs
# in the store and in time as its table grows, with its answer stored as a pointer to its
# metadata file (the catalog's default) and stored whole (`--store-whole-metadata`, what a
# catalog without a metadata reader does), side by side.
#
# The example catalog (release build) on SQLite and on PostgreSQL; one table grown by
# unkeyed add-snapshot commits to each size; at each size, for each path, alternating
# blocks of 25 unkeyed and 25 keyed add-snapshot commits over one connection (each keyed
# commit with a fresh key), the records table's size read before and after the keyed
# blocks, then three blocks of 50 replays of one keyed commit (the fastest block counts).
# Prints a Markdown table.
#
#   benches/catalog-snapshots.sh                          # SQLite and PostgreSQL, 200 1200 3200
#   benches/catalog-snapshots.sh sqlite "200 1200"        # one database, other sizes
#   ROUNDS=4 benches/catalog-snapshots.sh postgres        # more alternating blocks per figure
#   CATALOG_BIN=/tmp/catalog-before benches/catalog-snapshots.sh   # another build (no build here)
#   SMOKE=1 CATALOG_BIN=target/debug/iceberg-catalog benches/catalog-snapshots.sh   # CI's smoke run
#
# SMOKE=1: 10 snapshots, one round of blocks of 5 commits and 10 replays: every figure
# once, not worth reading.
#
# "stored per keyed commit": growth of the records table (its pages, indexes and TOAST
# included: SQLite's dbstat, PostgreSQL's pg_total_relation_size) over the keyed blocks,
# divided by their commits; "answer bytes stored": the stored answers' body and headers.
# PostgreSQL comes from scripts/services (started if it does not answer); everything runs
# on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

databases="${1:-sqlite postgres}"
smoke="${SMOKE:-}"
sizes="${2:-$([ -n "$smoke" ] && echo 10 || echo "200 1200 3200")}"
rounds="${ROUNDS:-$([ -n "$smoke" ] && echo 1 || echo 2)}"
port=18191

if [[ " $databases " == *" postgres "* ]] \
  && ! psql -h 127.0.0.1 -U postgres -d postgres -tAc 'SELECT 1' >/dev/null 2>&1; then
  scripts/services start >&2
fi
if [ -n "${CATALOG_BIN:-}" ]; then
  catalog_bin="$CATALOG_BIN"   # a build of your own (another commit's, to compare)
else
  echo "building the example catalog (release)…" >&2
  cargo build --release --locked -q -p examples --bin iceberg-catalog >&2
  target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  catalog_bin="$target_dir/release/iceberg-catalog"
fi

work=$(mktemp -d)
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

python3 - "$catalog_bin" "$work" "$port" "$databases" "$sizes" "$rounds" "$smoke" <<'PY'
import http.client, json, os, sqlite3, subprocess, sys, time, uuid

binary, work, port, databases, sizes, rounds, smoke = sys.argv[1:8]
port, rounds = int(port), int(rounds)
sizes = [int(s) for s in sizes.split()]
BLOCK, REPLAYS = (5, 10) if smoke else (25, 50)
PATHS = [("pointer", []), ("whole", ["--store-whole-metadata"])]
TABLE = "/v1/namespaces/bench/tables/events"


class Catalog:
    def __init__(self, database, extra):
        log = open(os.path.join(work, "catalog.log"), "a")
        self.process = subprocess.Popen(
            [binary, "--listen", f"127.0.0.1:{port}", "--database", database,
             "--warehouse", os.path.join(work, "warehouse")] + extra,
            stdout=log, stderr=log)
        for _ in range(200):
            try:
                self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                self.request("GET", "/v1/config")
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("the catalog did not start: see " + log.name)

    def request(self, method, path, body=None, key=None):
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        self.connection.request(method, path, body=body, headers=headers)
        response = self.connection.getresponse()
        return response.status, response.read()

    def stop(self):
        self.connection.close()
        self.process.terminate()
        self.process.wait()


class Snapshots:
    """add-snapshot commits, each its own snapshot after the last."""
    def __init__(self):
        self.last = 0

    def next_body(self):
        self.last += 1
        n = self.last
        return json.dumps({"requirements": [], "updates": [
            {"action": "add-snapshot", "snapshot": {
                "snapshot-id": n, "parent-snapshot-id": n - 1 if n > 1 else None,
                "sequence-number": n, "timestamp-ms": int(time.time() * 1000),
                "manifest-list": f"file:///bench/snap-{n}-{uuid.uuid4()}.avro",
                "summary": {"operation": "append", "added-data-files": "1",
                            "added-records": "1000", "total-records": str(n * 1000)},
                "schema-id": 0}},
            {"action": "set-snapshot-ref", "ref-name": "main", "type": "branch", "snapshot-id": n}]})


def commit(catalog, snapshots, key=None):
    status, body = catalog.request("POST", TABLE, snapshots.next_body(), key)
    if status != 200:
        raise SystemExit(f"commit failed: {status} {body[:300]!r}")
    return body


def records_size(kind, database):
    if kind == "sqlite":
        path = database.split("://", 1)[1].split("?")[0]
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            pages = db.execute("SELECT COALESCE(SUM(pgsize), 0) FROM dbstat "
                               "WHERE name LIKE '%idempotency_records%'").fetchone()[0]
            answers = db.execute("SELECT COALESCE(SUM(LENGTH(response_body) + "
                                 "LENGTH(response_headers)), 0) FROM idempotency_records").fetchone()[0]
        return pages, answers
    name = database.rsplit("/", 1)[1]
    out = subprocess.check_output(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", name, "-tAc",
         "SELECT pg_total_relation_size('idempotency_records'), "
         "COALESCE(SUM(octet_length(response_body) + octet_length(response_headers)), 0) "
         "FROM idempotency_records"], text=True)
    pages, answers = out.strip().split("|")
    return int(pages), int(answers)


print("| database | snapshots | answer KiB | path | stored per keyed commit | answer bytes stored per keyed commit "
      "| unkeyed commits/s | keyed commits/s | keyed / unkeyed | replays/s | replay / unkeyed |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for kind in databases.split():
    nonce = int(time.time())
    if kind == "sqlite":
        database = f"sqlite://{work}/catalog-{nonce}.db?mode=rwc"
    elif kind == "postgres":
        name = f"snapshots_bench_{nonce}"
        subprocess.check_call(["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres",
                               "-qc", f"CREATE DATABASE {name}"])
        database = f"postgres://postgres@127.0.0.1:5432/{name}"
    else:
        raise SystemExit(f"unknown database {kind} (sqlite or postgres)")
    snapshots = Snapshots()
    catalog = Catalog(database, [])
    catalog.request("POST", "/v1/namespaces", json.dumps({"namespace": ["bench"]}))
    status, body = catalog.request("POST", "/v1/namespaces/bench/tables", json.dumps({
        "name": "events", "schema": {"type": "struct", "schema-id": 0, "fields": [
            {"id": 1, "name": "id", "required": True, "type": "long"}]}}))
    assert status == 200, body
    catalog.stop()
    for size in sizes:
        catalog = Catalog(database, [])
        while snapshots.last < size:
            commit(catalog, snapshots)
        catalog.stop()
        for path, extra in PATHS:
            catalog = Catalog(database, extra)
            unkeyed = keyed = 0.0
            grown = stored_answers = 0
            for _ in range(rounds):
                started = time.perf_counter()
                for _ in range(BLOCK):
                    commit(catalog, snapshots)
                unkeyed += time.perf_counter() - started
                before = records_size(kind, database)
                started = time.perf_counter()
                for _ in range(BLOCK):
                    key = str(uuid.uuid4())
                    body = snapshots.next_body()
                    status, first = catalog.request("POST", TABLE, body, key)
                    assert status == 200, first[:300]
                keyed += time.perf_counter() - started
                after = records_size(kind, database)
                grown += after[0] - before[0]
                stored_answers += after[1] - before[1]
            # Replays of the last keyed commit, which must be its answer byte for byte: the
            # fastest of three blocks, so that one busy moment of the machine does not
            # decide the comparison of the two paths.
            replayed = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                for _ in range(REPLAYS):
                    status, replay = catalog.request("POST", TABLE, body, key)
                    assert status == 200 and replay == first, (status, replay[:300])
                replayed = min(replayed, time.perf_counter() - started)
            catalog.stop()
            commits = rounds * BLOCK
            u, k, r = commits / unkeyed, commits / keyed, REPLAYS / replayed
            print(f"| {kind} | {snapshots.last} | {len(first) / 1024:,.0f} | {path} "
                  f"| {grown / commits / 1024:,.2f} KiB | {stored_answers / commits:,.0f} B "
                  f"| {u:,.1f} | {k:,.1f} | **{k / u:.2f}** | {r:,.0f} | {r / u:.2f} |", flush=True)
    if kind == "postgres":
        subprocess.call(["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres",
                         "-qc", f"DROP DATABASE IF EXISTS {name}"])
PY
