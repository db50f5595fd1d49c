"""Drives rustberg-catalog with PyIceberg, every mutation keyed and its first answer lost.

Usage: python pyiceberg_keyed.py CATALOG_URI NAMESPACE

PyIceberg 0.12 sends no Idempotency-Key yet. This script gives every POST and DELETE it
sends a fresh UUID key, sends it, throws the answer away (the answer that never arrived),
and sends it again with the same key: PyIceberg only ever sees the second answer, which
must be the layer's replay of the first. If a mutation ran twice (a second commit on the
same base, a second create of one table), PyIceberg raises and the script fails.

It creates NAMESPACE and a table, appends twice, reads the rows back, evolves the schema,
renames and drops the table and the namespace, and prints one JSON object that the Rust
test asserts on. PyIceberg asks for vended credentials and accepts gzip, as it does by
default.
"""

import json
import sys
import uuid
from urllib.parse import urlsplit

import pyarrow as pa
import pyiceberg
import requests
from pyiceberg.catalog.rest import RestCatalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField, StringType

stats = {
    "keyed": 0,
    "replayed": 0,
    "not_replayed": [],
    "gzip_answers": 0,
    "fresh_credentials_on_replay": None,
}


def secret_of(response):
    try:
        credentials = response.json().get("storage-credentials") or []
    except ValueError:
        return None
    for credential in credentials:
        secret = credential.get("config", {}).get("s3.secret-access-key")
        if secret:
            return secret
    return None


def keyed_twice(session):
    """Wraps the session's send: each mutation is keyed and sent twice."""
    original = session.send

    def send(request, **kwargs):
        if request.method not in ("POST", "DELETE"):
            response = original(request, **kwargs)
            if response.headers.get("content-encoding") == "gzip":
                stats["gzip_answers"] += 1
            return response
        request.headers["Idempotency-Key"] = str(uuid.uuid4())
        lost = original(request, **kwargs)
        lost_secret = secret_of(lost)
        lost.close()
        retry = original(request, **kwargs)
        stats["keyed"] += 1
        if retry.headers.get("content-encoding") == "gzip":
            stats["gzip_answers"] += 1
        if retry.headers.get("idempotent-replayed") == "true":
            stats["replayed"] += 1
        else:
            path = urlsplit(request.url).path
            stats["not_replayed"].append(f"{request.method} {path} {retry.status_code}")
        retry_secret = secret_of(retry)
        if lost_secret is not None:
            fresh = retry_secret is not None and retry_secret != lost_secret
            previous = stats["fresh_credentials_on_replay"]
            stats["fresh_credentials_on_replay"] = fresh if previous is None else previous and fresh
        return retry

    session.send = send


def main() -> None:
    uri, namespace = sys.argv[1], sys.argv[2]

    # What PyIceberg's own HTTP client gets for /v1/config: requests accepts gzip.
    config = requests.get(f"{uri}/v1/config", timeout=30)
    config.raise_for_status()

    catalog = RestCatalog("rustberg", uri=uri)
    keyed_twice(catalog._session)
    summary = {
        "pyiceberg": pyiceberg.__version__,
        "config_lifetime": config.json().get("idempotency-key-lifetime"),
        "config_encoding": config.headers.get("content-encoding"),
    }

    catalog.create_namespace(namespace, {"owner": "pyiceberg-test"})
    schema = Schema(
        NestedField(1, "id", LongType(), required=True),
        NestedField(2, "name", StringType(), required=False),
        identifier_field_ids=[1],
    )
    identifier = f"{namespace}.events"
    table = catalog.create_table(identifier, schema=schema)

    arrow_schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string())])
    table.append(pa.Table.from_pylist([{"id": 1, "name": "a"}, {"id": 2, "name": "b"}], schema=arrow_schema))
    table.append(pa.Table.from_pylist([{"id": 3, "name": "c"}], schema=arrow_schema))

    reloaded = catalog.load_table(identifier)
    summary["rows"] = reloaded.scan().to_arrow().sort_by("id").to_pylist()
    summary["snapshots"] = len(reloaded.metadata.snapshots)

    with reloaded.update_schema() as update:
        update.add_column("score", LongType())
    summary["columns"] = [f.name for f in catalog.load_table(identifier).schema().fields]

    catalog.update_namespace_properties(namespace, updates={"stage": "done"})
    catalog.rename_table(identifier, f"{namespace}.events_renamed")
    summary["renamed_rows"] = catalog.load_table(f"{namespace}.events_renamed").scan().to_arrow().num_rows
    catalog.drop_table(f"{namespace}.events_renamed")
    try:
        catalog.load_table(f"{namespace}.events_renamed")
        summary["after_drop"] = "found"
    except NoSuchTableError:
        summary["after_drop"] = "NoSuchTableError"
    catalog.drop_namespace(namespace)
    summary["namespace_dropped"] = namespace not in [ns[0] for ns in catalog.list_namespaces()]

    summary.update(stats)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
