"""Peer measurement: dlt's ``sql_database`` source loading one PostgreSQL table into a local Iceberg table.

Run by the peer venv's python (``bench/peer_venv.sh`` makes ``.venv-peer``), never by the project's:
it imports nothing from this repository. One full load of ``--table`` through dlt's ``filesystem``
destination with ``table_format="iceberg"`` into ``file://DEST/bucket``, then a read-back of the loaded
rows with pyiceberg, then ONE JSON line on stdout::

    {"backend": ..., "rows": ..., "seconds": ..., "rows_per_second": ..., ...}

``seconds`` covers the whole dlt run: table reflection, extract, normalize and load (``pipeline.run``);
the per-step split from dlt's trace rides along. It excludes interpreter start, imports and the read-back.

Settings (dlt's own defaults unless said otherwise):

* ``backend``: ``pyarrow`` (SQLAlchemy + psycopg2 with a server-side cursor, rows to Arrow) or
  ``connectorx`` (dlt's default ``return_type="arrow"``, ``protocol="binary"``: one Arrow table).
* ``chunk_size`` 50,000 rows and ``reflection_level="full"`` (dlt's defaults; both are options),
  ``write_disposition="append"`` (``sql_table``'s default: a full load into a fresh table),
  one normalize worker and dlt's default load workers (the Iceberg load is one job per table).
* The Iceberg catalog is pyiceberg's SQL catalog in ``DEST/catalog.db`` (SQLite), configured through
  dlt's ``iceberg_catalog`` section, so that the table can be read back after the run.
* Everything dlt writes (pipelines dir, its data dir, the bucket) lives under ``--dest``, which must
  be missing or empty; telemetry is off.
* connectorx hands ``jsonb`` over as quoted JSON text; dlt's documented ``unwrap_json_connector_x``
  map turns it back into the JSON text (SQL NULL stays NULL), applied to every json/jsonb column.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _configure(dest: Path) -> None:
    """Keep dlt inside ``dest`` (not ~/.dlt, not the caller's ./.dlt) and point it at a SQLite catalog there."""
    os.environ["DLT_DATA_DIR"] = str(dest / "dlt_data")
    os.environ["DLT_PROJECT_DIR"] = str(dest)
    os.environ["RUNTIME__DLTHUB_TELEMETRY"] = "false"
    os.environ["ICEBERG_CATALOG__ICEBERG_CATALOG_NAME"] = "peer"
    os.environ["ICEBERG_CATALOG__ICEBERG_CATALOG_TYPE"] = "sql"
    os.environ["ICEBERG_CATALOG__ICEBERG_CATALOG_CONFIG"] = json.dumps(
        {"type": "sql", "uri": f"sqlite:///{dest / 'catalog.db'}", "warehouse": (dest / "bucket").as_uri()}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--dsn", required=True, help="SQLAlchemy URL, e.g. postgresql://postgres@127.0.0.1:5432/bench")
    parser.add_argument("--table", required=True, help="source table (schema public)")
    parser.add_argument("--backend", required=True, choices=["pyarrow", "connectorx"])
    parser.add_argument("--dest", required=True, type=Path, help="missing or empty directory for everything dlt writes")
    parser.add_argument("--chunk-size", type=int, default=50_000, help="rows per extracted item (dlt's default)")
    parser.add_argument(
        "--reflection-level",
        default="full",
        choices=["minimal", "full", "full_with_precision"],
        help="how much of the column types dlt reflects (dlt's default: full)",
    )
    args = parser.parse_args(argv)

    dest: Path = args.dest.resolve()
    if dest.exists() and any(dest.iterdir()):
        parser.error(f"--dest {dest} is not empty: the load must go into a fresh Iceberg table")
    dest.mkdir(parents=True, exist_ok=True)
    _configure(dest)

    import dlt
    import sqlalchemy as sa
    from dlt.common.libs.pyiceberg import get_iceberg_tables
    from dlt.sources.sql_database import sql_table
    from dlt.sources.sql_database.helpers import unwrap_json_connector_x

    # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; name psycopg2, the driver dlt documents.
    dsn = sa.engine.make_url(args.dsn)
    if dsn.drivername == "postgresql":
        dsn = dsn.set(drivername="postgresql+psycopg2")
    engine = sa.create_engine(dsn)
    with engine.connect() as conn:
        source_rows = conn.execute(sa.text(f'SELECT count(*) FROM "{args.table}"')).scalar_one()
        json_columns = [
            name
            for (name,) in conn.execute(
                sa.text(
                    "SELECT column_name FROM information_schema.columns WHERE table_schema = 'public' "
                    "AND table_name = :t AND data_type IN ('json', 'jsonb')"
                ),
                {"t": args.table},
            )
        ]
    engine.dispose()

    pipeline = dlt.pipeline(
        pipeline_name=f"peer_{args.table}_{args.backend}",
        pipelines_dir=str(dest / "pipelines"),
        destination=dlt.destinations.filesystem(bucket_url=(dest / "bucket").as_uri()),
        dataset_name="peer",
        progress="log" if os.environ.get("PEER_DLT_PROGRESS") else None,
    )

    started = time.perf_counter()
    resource = sql_table(
        credentials=dsn.render_as_string(hide_password=False),
        table=args.table,
        schema="public",
        backend=args.backend,
        chunk_size=args.chunk_size,
        reflection_level=args.reflection_level,
        write_disposition="append",
    )
    if args.backend == "connectorx":
        for name in json_columns:
            resource.add_map(unwrap_json_connector_x(name))
    info = pipeline.run(resource, table_format="iceberg", loader_file_format="parquet")
    seconds = time.perf_counter() - started
    info.raise_on_failed_jobs()

    steps: dict[str, float] = {}
    trace = pipeline.last_trace
    for step in trace.steps if trace else []:
        if step.step in ("extract", "normalize", "load") and step.finished_at and step.started_at:
            steps[f"{step.step}_seconds"] = round((step.finished_at - step.started_at).total_seconds(), 3)

    iceberg_table = get_iceberg_tables(pipeline, args.table)[args.table]
    first_column = iceberg_table.schema().fields[0].name
    loaded_rows = iceberg_table.scan(selected_fields=(first_column,)).to_arrow().num_rows
    if loaded_rows != source_rows:
        print(f"row count mismatch: source {source_rows}, Iceberg {loaded_rows}", file=sys.stderr)
        return 1

    report: dict[str, Any] = {
        "backend": args.backend,
        "table": args.table,
        "rows": loaded_rows,
        "seconds": round(seconds, 3),
        "rows_per_second": round(loaded_rows / seconds, 1),
        **steps,
        "chunk_size": args.chunk_size,
        "reflection_level": args.reflection_level,
        "iceberg_types": {field.name: str(field.field_type) for field in iceberg_table.schema().fields},
        "dlt": dlt.__version__,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
