"""The Spark SQL the materializer sends: quoted identifiers and the MERGE INTO statement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The folded batch's own columns, beside the table's: named so that no ordinary column name meets them
# (a table may well have an "_op" column).
OP_COLUMN = "_pg2iceberg_op"
UNCHANGED_COLUMN = "_pg2iceberg_unchanged"


def spark_identifier(*parts: str) -> str:
    """Backtick-quoted Spark SQL identifier."""
    return ".".join("`" + part.replace("`", "``") + "`" for part in parts)


def spark_string(value: str) -> str:
    """A Spark SQL string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _keys_match(key: list[str]) -> str:
    """The join condition of target ``t`` and source ``s`` on the primary key."""
    return " AND ".join(f"t.{spark_identifier(k)} = s.{spark_identifier(k)}" for k in key)


def merge_statement(
    target: str,
    source_view: str,
    columns: list[str],
    key: list[str],
    keep_unchanged: bool = True,
    soft_delete: Sequence[str] = (),
) -> str:
    """MERGE INTO: delete, update (unchanged TOAST columns keep the target's value) or insert per key.

    ``keep_unchanged=False`` gives the plain statement (every column from the source), for a source
    without unchanged columns. With ``soft_delete`` (the deletion and change metadata columns), a
    delete keeps the row and sets those columns from the source instead.
    """
    on = _keys_match(key)
    assignments = ", ".join(
        (
            f"t.{spark_identifier(c)} = CASE WHEN array_contains(s.{UNCHANGED_COLUMN}, {spark_string(c)}) "
            f"THEN t.{spark_identifier(c)} ELSE s.{spark_identifier(c)} END"
            if keep_unchanged
            else f"t.{spark_identifier(c)} = s.{spark_identifier(c)}"
        )
        for c in columns
        if c not in key
    )
    column_list = ", ".join(spark_identifier(c) for c in columns)
    values = ", ".join(f"s.{spark_identifier(c)}" for c in columns)
    update = f"WHEN MATCHED AND s.{OP_COLUMN} = 'U' THEN UPDATE SET {assignments} " if assignments else ""
    delete = "DELETE"
    if soft_delete:
        delete = "UPDATE SET " + ", ".join(f"t.{spark_identifier(c)} = s.{spark_identifier(c)}" for c in soft_delete)
    return (
        f"MERGE INTO {target} t USING {source_view} s ON {on} "
        f"WHEN MATCHED AND s.{OP_COLUMN} = 'D' THEN {delete} "
        f"{update}"
        f"WHEN NOT MATCHED AND s.{OP_COLUMN} = 'U' THEN INSERT ({column_list}) VALUES ({values})"
    )


def soft_delete_all_statement(target: str, values: dict[str, str], deleted_at: str) -> str:
    """Mark every live row of ``target`` deleted: set ``values`` (column -> Spark SQL expression) where
    ``deleted_at`` is NULL (a soft-deleting table's TRUNCATE)."""
    assignments = ", ".join(f"{spark_identifier(c)} = {value}" for c, value in values.items())
    return f"UPDATE {target} SET {assignments} WHERE {spark_identifier(deleted_at)} IS NULL"


def fill_statement(target: str, source_view: str, columns: list[str]) -> str:
    """Set ``columns`` of every row of ``target`` to the values in the one row of ``source_view``."""
    assignments = ", ".join(f"t.{spark_identifier(c)} = s.{spark_identifier(c)}" for c in columns)
    return f"MERGE INTO {target} t USING {source_view} s ON true WHEN MATCHED THEN UPDATE SET {assignments}"


def call_procedure(spark: Any, catalog: str, procedure: str, arguments: dict[str, str]) -> dict[str, Any]:
    """``CALL catalog.system.procedure(name => value, ...)`` (values are SQL literals): its one result
    row as a dict."""
    text = ", ".join(f"{name} => {value}" for name, value in arguments.items())
    rows = spark.sql(f"CALL {spark_identifier(catalog)}.system.{procedure}({text})").collect()
    return rows[0].asDict() if rows else {}


def delete_keys_statement(target: str, source_view: str, key: list[str]) -> str:
    """Delete every row of ``target`` whose key is in ``source_view``: a MERGE with only a MATCHED
    clause, which Spark plans as an inner join and so can broadcast the batch's keys rather than
    shuffle the target."""
    keys = ", ".join(spark_identifier(k) for k in key)
    on = _keys_match(key)
    return f"MERGE INTO {target} t USING (SELECT {keys} FROM {source_view}) s ON {on} WHEN MATCHED THEN DELETE"


def insert_upserts_statement(target: str, source_view: str, columns: list[str]) -> str:
    """Append the upserted rows of ``source_view`` (``columns`` in the table's order)."""
    values = ", ".join(spark_identifier(c) for c in columns)
    return f"INSERT INTO {target} SELECT {values} FROM {source_view} WHERE {OP_COLUMN} = 'U'"
