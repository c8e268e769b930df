"""Bulk writes of column tables: PostgreSQL gets one binary COPY per table and one
`unnest` upsert per rollup table; other backends get executemany.

A table is a dict of column name -> values for n rows: a numpy array (integers, floats,
booleans, datetime64 for timestamps, (n, k) uint8 for fixed-width bytes) or, for text, a
list of str. The binary encoding follows each column's SQL type in the ORM model.
"""

from __future__ import annotations

from datetime import UTC

import numpy as np
from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    insert,
)
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeDecorator

Table = dict[str, np.ndarray | list]

_SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags, header extension length
_TRAILER = b"\xff\xff"
_PG_EPOCH = np.datetime64("2000-01-01T00:00:00", "us")


def write_rows(session: Session, model, table: Table) -> None:
    """Insert the rows of `table` into `model`'s table."""
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        quote = connection.dialect.identifier_preparer.quote
        columns = ", ".join(quote(column) for column in table)
        raw = connection.connection.driver_connection
        with raw.cursor() as cursor, cursor.copy(
                f"COPY {quote(model.__tablename__)} ({columns}) FROM STDIN (FORMAT BINARY)"
        ) as copy:
            copy.write(binary_copy(model, table))
        return
    session.execute(insert(model), _rows_of(table))


def add_counts(session: Session, model, table: Table, counters: tuple[str, ...]) -> None:
    """Add the `counters` of `table` onto the rows with the same primary key, or insert them.

    Rows must have distinct keys; sorted keys let concurrent writers lock in one order."""
    if not table or not len(next(iter(table.values()))):
        return  # e.g. sampled records only, none of them shadow: nothing to count
    keys = [column.name for column in model.__table__.primary_key.columns]
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        quote = connection.dialect.identifier_preparer.quote
        name, columns = quote(model.__tablename__), ", ".join(quote(column) for column in table)
        arrays = ", ".join(f"%s::{model.__table__.c[column].type.compile(connection.dialect)}[]"
                           for column in table)
        additions = ", ".join(f"{quote(counter)} = {name}.{quote(counter)} + "
                              f"excluded.{quote(counter)}" for counter in counters)
        # One statement whatever the row count; ORDER BY keeps the caller's (sorted) order.
        connection.exec_driver_sql(
            f"INSERT INTO {name} ({columns}) SELECT {columns} FROM unnest({arrays}) "
            f"WITH ORDINALITY AS increments ({columns}, ordinality) ORDER BY ordinality "
            f"ON CONFLICT ({', '.join(quote(key) for key in keys)}) DO UPDATE SET {additions}",
            tuple(_array_literal(values) for values in table.values()))
        return
    statement = sqlite_insert(model)
    statement = statement.on_conflict_do_update(
        index_elements=keys,
        set_={counter: getattr(model, counter) + statement.excluded[counter]
              for counter in counters})
    connection.execute(statement, _rows_of(table))


def _rows_of(table: Table) -> list[dict]:
    """The rows of `table` as dicts of Python values (executemany parameters)."""
    names = list(table)
    columns = [_python_values(values) for values in table.values()]
    return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]


def _array_literal(values: np.ndarray | list) -> str:
    """`values` as a PostgreSQL array literal such as '{1,2}' (for a `%s::type[]` parameter);
    built in bulk, where the driver would adapt element by element."""
    if isinstance(values, list):  # text
        items = ('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' for value in values)
    elif values.dtype.kind == "M":
        items = np.datetime_as_string(values.astype("datetime64[us]"), timezone="UTC").tolist()
    else:
        items = map(str, values.tolist())
    return "{" + ",".join(items) + "}"


def _python_values(values: np.ndarray | list) -> list:
    if not isinstance(values, np.ndarray):
        return values
    if values.dtype.kind == "M":
        return [moment.replace(tzinfo=UTC) for moment in values.astype("datetime64[us]").tolist()]
    if values.ndim == 2:
        return [row.tobytes() for row in values]
    if values.dtype.kind == "f" and np.isnan(values).any():  # NaN stands for NULL
        return [None if value != value else value for value in values.tolist()]
    return values.tolist()


def binary_copy(model, table: Table) -> bytes:
    """The rows of `table` in PostgreSQL's binary COPY format, typed by `model`'s columns.

    Rows are grouped by the byte lengths of their variable-width values, so that each group is
    one fixed-layout numpy record array; the output does not keep the order of the rows."""
    count = len(next(iter(table.values())))
    fixed: dict[str, np.ndarray] = {}  # (n,) typed or (n, width) bytes
    varying: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # (n, longest) bytes, lengths
    nulls: dict[str, np.ndarray] = {}  # (n,) bool: NULL rows of a float column (NaN values)
    for name, values in table.items():
        sql_type = model.__table__.c[name].type
        if isinstance(sql_type, TypeDecorator):  # e.g. UTCDateTime: encoded as what it wraps
            sql_type = sql_type.impl
        if not isinstance(sql_type, String):
            if isinstance(values, np.ndarray) and values.dtype.kind == "f" \
                    and np.isnan(values).any():
                nulls[name] = np.isnan(values)
            fixed[name] = _binary_column(sql_type, values)
            continue
        data, lengths = _utf8(values)
        if lengths.min(initial=0) == lengths.max(initial=0):
            fixed[name] = data[:, :lengths.max(initial=0)]
        else:
            varying[name] = data, lengths
    if varying or nulls:
        keys = [lengths for _, lengths in varying.values()] + list(nulls.values())
        values_of, group_of = number_groups(*keys)
        groups = [(np.flatnonzero(group_of == group),
                   {name: int(width[group]) for name, width in zip(varying, values_of,
                                                                   strict=False)},
                   {name for name, null in zip(nulls, values_of[len(varying):], strict=True)
                    if null[group]})
                  for group in range(len(values_of[0]))]
    else:
        groups = [(np.arange(count), {}, set())]
    parts = [_SIGNATURE]
    for rows, width, null in groups:
        layout = [("fields", ">i2")]
        for name in table:
            layout.append((f"{name}.length", ">i4"))
            if name in null:  # a NULL field is its length -1 and no bytes
                continue
            layout.append((name, fixed[name].dtype, fixed[name].shape[1:]) if name in fixed
                          else (name, np.uint8, (width[name],)))
        block = np.empty(len(rows), dtype=layout)
        block["fields"] = len(table)
        for name in table:
            if name in null:
                block[f"{name}.length"] = -1
                continue
            block[f"{name}.length"] = block.dtype[name].itemsize
            block[name] = fixed[name][rows] if name in fixed else \
                varying[name][0][rows, :width[name]]
        parts.append(block.tobytes())
    parts.append(_TRAILER)
    return b"".join(parts)


def number_groups(*keys: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Number the distinct rows of the key columns in sorted (lexicographic) order.

    Returns each key column's value per group, and each row's group number."""
    if not keys:
        return [], np.zeros(0, dtype=np.int64)
    uniques, codes = zip(*(_distinct(np.asarray(key)) for key in keys), strict=True)
    sizes = [len(unique) for unique in uniques]
    groups, group_of = _distinct(np.ravel_multi_index(codes, sizes))
    return ([unique[code] for unique, code in zip(uniques, np.unravel_index(groups, sizes),
                                                  strict=True)], group_of)


def _distinct(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What `np.unique(key, return_inverse=True)` gives (sorted values, each row's index).

    Integers (and times) within a small span are counted into a table instead of sorted: the
    rollup keys (versions, runtime and segment numbers, minutes) are such, and ingestion pays
    for a sort per key per batch otherwise."""
    if key.dtype.kind == "M":
        values, inverse = _distinct(key.view(np.int64))
        return values.view(key.dtype), inverse
    if key.dtype.kind in "iu" and len(key):
        low = int(key.min())
        span = int(key.max()) - low + 1
        if span <= max(4 * len(key), 1 << 16):
            offset = (key - low).astype(np.int64)
            present = np.zeros(span, dtype=bool)
            present[offset] = True
            rank = np.cumsum(present) - 1
            return (np.flatnonzero(present) + low).astype(key.dtype), rank[offset]
    values, inverse = np.unique(key, return_inverse=True)
    return values, inverse.ravel()


def _utf8(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes of each value as the rows of an (n, longest) uint8 array, and their lengths."""
    if values and values.count(values[0]) == len(values):  # e.g. a batch's id on all its rows
        encoded = np.frombuffer(values[0].encode(), dtype=np.uint8)
        return (np.broadcast_to(encoded, (len(values), len(encoded))),
                np.full(len(values), len(encoded)))
    try:
        encoded = np.array(values, dtype=np.bytes_)  # ASCII only
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    except UnicodeEncodeError:
        utf8 = [value.encode() for value in values]
        encoded = np.array(utf8, dtype=np.bytes_)
        lengths = np.fromiter(map(len, utf8), dtype=np.int64, count=len(utf8))
    # Rows are NUL-padded to the longest value; `lengths` says where each one really ends.
    return encoded.view(np.uint8).reshape(len(values), encoded.dtype.itemsize), lengths


def _binary_column(sql_type, values: np.ndarray) -> np.ndarray:
    """Fixed-width values as the big-endian binary form PostgreSQL receives for `sql_type`."""
    if isinstance(sql_type, DateTime):
        return (values.astype("datetime64[us]") - _PG_EPOCH).astype(">i8")
    if isinstance(sql_type, Boolean):
        return np.asarray(values, dtype=np.bool_)
    if isinstance(sql_type, LargeBinary):  # (n, k) bytes per row
        return np.ascontiguousarray(values, dtype=np.uint8)
    for kind, dtype in ((SmallInteger, ">i2"), (BigInteger, ">i8"), (Integer, ">i4"),
                        (Float, ">f8")):
        if isinstance(sql_type, kind):
            return np.asarray(values).astype(dtype)
    raise TypeError(f"no binary COPY encoding for {sql_type!r}")
