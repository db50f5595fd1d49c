"""Drives the iceberg-catalog server with PyIceberg, a real Iceberg REST client.

Usage: python pyiceberg_roundtrip.py CATALOG_URI NAMESPACE

Creates NAMESPACE and a table in it, appends rows with pyarrow (data files go straight
to the table's file:// location), appends more, reads everything back through the
catalog, evolves the schema, renames and drops the table, and prints one JSON object
that the Rust test asserts on. Any failure raises, so the exit code is non-zero.
"""

import json
import sys

import pyarrow as pa
import pyiceberg
from pyiceberg.catalog.rest import RestCatalog
from pyiceberg.exceptions import NoSuchTableError, TableAlreadyExistsError
from pyiceberg.schema import Schema
from pyiceberg.types import LongType, NestedField, StringType
from pyiceberg.view.metadata import SQLViewRepresentation, ViewRepresentation, ViewVersion


def main() -> None:
    uri, namespace = sys.argv[1], sys.argv[2]
    catalog = RestCatalog("it", uri=uri)
    summary = {"pyiceberg": pyiceberg.__version__, "pyarrow": pa.__version__}

    catalog.create_namespace(namespace, {"owner": "pyiceberg-test"})
    summary["namespaces"] = [list(ns) for ns in catalog.list_namespaces()]
    summary["namespace_properties"] = catalog.load_namespace_properties(namespace)

    schema = Schema(
        NestedField(1, "id", LongType(), required=True),
        NestedField(2, "name", StringType(), required=False),
        identifier_field_ids=[1],
    )
    identifier = f"{namespace}.events"
    table = catalog.create_table(identifier, schema=schema)
    summary["location"] = table.location()
    summary["first_metadata_location"] = table.metadata_location

    try:
        catalog.create_table(identifier, schema=schema)
        summary["second_create"] = "created"
    except TableAlreadyExistsError:
        summary["second_create"] = "TableAlreadyExistsError"

    arrow_schema = pa.schema(
        [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string())]
    )
    table.append(pa.Table.from_pylist([{"id": 1, "name": "a"}, {"id": 2, "name": "b"}], schema=arrow_schema))
    table.append(pa.Table.from_pylist([{"id": 3, "name": "c"}], schema=arrow_schema))

    reloaded = catalog.load_table(identifier)
    rows = reloaded.scan().to_arrow().sort_by("id").to_pylist()
    summary["rows"] = rows
    summary["snapshots"] = len(reloaded.metadata.snapshots)
    summary["metadata_location"] = reloaded.metadata_location

    with reloaded.update_schema() as update:
        update.add_column("score", LongType())
    summary["columns"] = [f.name for f in catalog.load_table(identifier).schema().fields]

    # A create transaction: stage-create, then one commit with assert-create that both
    # creates the table and adds its first snapshot.
    staged = catalog.create_table_transaction(f"{namespace}.staged", schema=schema)
    staged.append(pa.Table.from_pylist([{"id": 10, "name": "z"}], schema=arrow_schema))
    staged.commit_transaction()
    summary["staged_rows"] = catalog.load_table(f"{namespace}.staged").scan().to_arrow().to_pylist()

    view_version = ViewVersion(
        version_id=1,
        schema_id=0,
        summary={"engine-name": "pyiceberg-test"},
        representations=[
            ViewRepresentation(SQLViewRepresentation(type="sql", sql=f"SELECT id FROM {identifier}", dialect="spark"))
        ],
        default_namespace=[namespace],
    )
    view = catalog.create_view(f"{namespace}.recent", schema=schema, view_version=view_version)
    summary["view_sql"] = view.metadata.versions[-1].representations[0].root.sql
    summary["views"] = [list(v) for v in catalog.list_views(namespace)]
    summary["view_exists"] = catalog.view_exists(f"{namespace}.recent")
    catalog.drop_view(f"{namespace}.recent")
    summary["view_exists_after_drop"] = catalog.view_exists(f"{namespace}.recent")

    summary["tables"] = sorted(list(t) for t in catalog.list_tables(namespace))
    catalog.drop_table(f"{namespace}.staged")
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

    print(json.dumps(summary))


if __name__ == "__main__":
    main()
