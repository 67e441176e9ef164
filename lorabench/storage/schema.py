"""The Parquet schema of a run's rows, derived from ``lorabench.storage.row.Row``: each field's
type gives its column's (int: int64, float: float64, str: string, bool: bool, list[int]: a list of
int64). ``conform`` brings a file of any age to it.

``python -m lorabench.storage.schema`` prints the columns as the design's Markdown table."""

import typing
from dataclasses import fields

import pyarrow as pa

from lorabench.storage.row import Row

ARROW = {int: pa.int64(), float: pa.float64(), str: pa.string(), bool: pa.bool_(), list[int]: pa.list_(pa.int64())}


def _arrow(annotation) -> pa.DataType:
    """``int | None`` -> int64, and so on."""
    return ARROW[next(a for a in typing.get_args(annotation) if a is not type(None))]


_HINTS = typing.get_type_hints(Row)
SCHEMA = pa.schema([(f.name, _arrow(_HINTS[f.name])) for f in fields(Row)])


def conform(table: pa.Table) -> pa.Table:
    """A file's rows in today's schema: columns added since it was written are null, every column
    in today's order and type; columns the schema does not know (a table made by hand) follow."""
    for f in SCHEMA:
        if f.name not in table.column_names:
            table = table.append_column(f, pa.nulls(len(table), f.type))
    extra = [n for n in table.column_names if n not in SCHEMA.names]
    known = table.select(SCHEMA.names).cast(SCHEMA)
    for name in extra:
        known = known.append_column(name, table[name])
    return known


def markdown() -> str:
    """The columns as a Markdown table, a column without a doc of its own on the line before it."""
    lines, names, doc = ["| column | meaning |", "|---|---|"], [], ""
    for f in fields(Row):
        if f.metadata["doc"] and names:
            lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {doc} |")
            names = []
        if f.metadata["doc"]:
            doc = f.metadata["doc"]
        names.append(f.name)
    lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
