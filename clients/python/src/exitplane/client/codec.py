"""Telemetry batches as they travel: the wire models encoded with the protocol's content types
(msgpack or JSON; docs/protocol.md, "Telemetry"), and `EncodedBatch`, one encoded batch with
the id, seq and counts the sender, the spool, a 413 split and a 415 fallback need without
decoding it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from exitplane.wire import (
    AGGREGATE_JSON,
    AGGREGATE_MSGPACK,
    INTERVAL_JSON,
    INTERVAL_MSGPACK,
    OPTIONAL_RECORD_COLUMNS,
    RECORD_COLUMNS,
    RECORDS_JSON,
    RECORDS_MSGPACK,
    SHADOW_COLUMNS,
    AggregateBatch,
    AggregateCell,
    IntervalBatch,
    Lineage,
    RecordColumns,
    TelemetryBatch,
    TokenRecord,
)

# encoding -> content types of (record batches, aggregate batches, interval batches)
ENCODINGS = {"msgpack": (RECORDS_MSGPACK, AGGREGATE_MSGPACK, INTERVAL_MSGPACK),
             "json": (RECORDS_JSON, AGGREGATE_JSON, INTERVAL_JSON)}
_AGGREGATE_OF = {INTERVAL_MSGPACK: AGGREGATE_MSGPACK, INTERVAL_JSON: AGGREGATE_JSON}
_RECORDS_OF = {INTERVAL_MSGPACK: RECORDS_MSGPACK, INTERVAL_JSON: RECORDS_JSON}


@dataclass(frozen=True)
class EncodedBatch:
    """One batch as sent: id, sequence number, record count (for an aggregate or interval
    batch: the tokens it counts), content type and body; `rows`: the records an interval batch
    carries besides its counts."""

    batch_id: str
    seq: int
    records: int
    content_type: str
    body: bytes
    rows: int = 0

    @property
    def is_aggregate(self) -> bool:
        """Whether it carries token counts (an aggregate or interval batch)."""
        return self.content_type in (AGGREGATE_MSGPACK, AGGREGATE_JSON, *_AGGREGATE_OF)

    @property
    def is_interval(self) -> bool:
        return self.content_type in _AGGREGATE_OF

    def pack(self) -> bytes:
        """The spool record: id, seq, count, content type and body (and the rows of an
        interval batch) in one msgpack array."""
        fields = [self.batch_id, self.seq, self.records, self.content_type, self.body]
        return msgpack.packb([*fields, self.rows] if self.rows else fields, use_bin_type=True)

    @classmethod
    def unpack(cls, payload: bytes) -> EncodedBatch:
        """Read a spool record back, with or without an interval batch's rows."""
        return cls(*msgpack.unpackb(payload, raw=False))

    def decode(self) -> dict[str, Any]:
        """The batch as a dict (the model_dump of its TelemetryBatch or AggregateBatch)."""
        if "msgpack" in self.content_type:
            return msgpack.unpackb(self.body, raw=False)
        return json.loads(self.body)

    def split(self) -> list[EncodedBatch]:
        """Two halves with ids derived from this one (deterministic, so replays match)."""
        payload = self.decode()
        if self.is_interval:
            return self._split_interval(payload)
        field = "cells" if self.is_aggregate else "records"
        items = payload[field]
        if len(items) < 2:
            return []
        middle = len(items) // 2
        halves = []
        for suffix, part in (("a", items[:middle]), ("b", items[middle:])):
            half = {**payload, "batch_id": self.batch_id + suffix, field: part}
            count = sum(cell["exits"] for cell in part) if self.is_aggregate else len(part)
            halves.append(EncodedBatch(half["batch_id"], self.seq, count, self.content_type,
                                       encode(half, self.content_type)))
        return halves

    def _split_interval(self, payload: dict[str, Any]) -> list[EncodedBatch]:
        """An interval batch's halves: half of its cells and half of its records each (its
        cells in one half and its records in the other when it has one of each)."""
        cells = payload.get("cells") or []
        columns = payload.get("records")
        rows = len(columns["threshold_version"]) if columns else 0
        if len(cells) + rows < 2:
            return []
        cut_cells, cut_rows = len(cells) // 2, rows // 2
        if len(cells) < 2 and rows < 2:  # one cell and one record
            cut_cells, cut_rows = 1, 0
        parts = (((cells[:cut_cells], _rows(columns, 0, cut_rows)), "a"),
                 ((cells[cut_cells:], _rows(columns, cut_rows, rows)), "b"))
        halves = []
        for (part_cells, part_rows), suffix in parts:
            half = {**payload, "batch_id": self.batch_id + suffix, "cells": part_cells}
            half.pop("records", None)
            if part_rows is not None:
                half["records"] = part_rows
            halves.append(EncodedBatch(
                half["batch_id"], self.seq, sum(cell["exits"] for cell in part_cells),
                self.content_type, encode(half, self.content_type),
                len(part_rows["threshold_version"]) if part_rows else 0))
        return halves

    def unbundled(self) -> list[EncodedBatch]:
        """An interval batch as the aggregate batch and the `aggregated` record batch it
        stands for (ids `<id>c` and `<id>r`, same seq): what a control plane that answers 415
        to interval batches takes. Empty parts are left out."""
        payload = self.decode()
        out = []
        if payload.get("cells"):
            cells = {key: value for key, value in payload.items() if key != "records"}
            cells["batch_id"] = self.batch_id + "c"
            out.append(EncodedBatch(cells["batch_id"], self.seq, self.records,
                                    _AGGREGATE_OF[self.content_type],
                                    encode(cells, _AGGREGATE_OF[self.content_type])))
        if payload.get("records"):
            records = RecordColumns.model_validate(payload["records"]).records()
            out.append(encode_records(
                deployment=payload["deployment"], runtime_id=payload["runtime_id"],
                seq=self.seq, num_layers=payload["num_layers"], records=records,
                aggregated=True, content_type=_RECORDS_OF[self.content_type],
                batch_id=self.batch_id + "r", lineage=Lineage.model_validate(payload)))
        return out


def _rows(columns: dict[str, Any] | None, start: int, stop: int) -> dict[str, Any] | None:
    """Records start..stop-1 of an interval batch's record columns (None when empty), their
    shadow points renumbered."""
    if not columns or stop <= start:
        return None
    out = {name: values[start:stop] if name in _RECORD_FIELDS and values is not None
           else values for name, values in columns.items()}
    points = [index for index, owner in enumerate(columns.get("shadow_record") or ())
              if start <= owner < stop]
    for name in _SHADOW_FIELDS:
        if name in columns:
            values = columns[name]
            out[name] = [values[index] - start if name == "shadow_record" else values[index]
                         for index in points]
    return out


_RECORD_FIELDS = (*RECORD_COLUMNS, *OPTIONAL_RECORD_COLUMNS)
_SHADOW_FIELDS = tuple(f"shadow_{name}" for name in ("record", *SHADOW_COLUMNS))


def _lineage(lineage: Lineage | None) -> dict[str, str]:
    """The lineage fields a batch carries (none when unknown)."""
    return {} if lineage is None else lineage.model_dump()


def encode(payload: dict[str, Any], content_type: str) -> bytes:
    """A batch's dict as the body of `content_type` (msgpack or compact JSON)."""
    if "msgpack" in content_type:
        return msgpack.packb(payload, use_bin_type=True)
    return json.dumps(payload, separators=(",", ":")).encode()


def encode_records(*, deployment: str, runtime_id: str, seq: int, num_layers: int,
                   records: Sequence[TokenRecord | dict], aggregated: bool,
                   content_type: str = RECORDS_MSGPACK,
                   batch_id: str | None = None, lineage: Lineage | None = None) -> EncodedBatch:
    """A record batch (validated by the wire schema: ValidationError when a record is bad)
    with a fresh batch id (or `batch_id`), carrying the runtime's `lineage` if given."""
    batch = TelemetryBatch(batch_id=batch_id or uuid.uuid4().hex, deployment=deployment,
                           runtime_id=runtime_id, seq=seq, num_layers=num_layers,
                           records=records, aggregated=aggregated, **_lineage(lineage))
    return EncodedBatch(batch.batch_id, seq, len(records), content_type,
                        encode(batch.model_dump(mode="json"), content_type))


def encode_aggregate(*, deployment: str, runtime_id: str, seq: int, num_layers: int,
                     raw_sample_rate: float, cells: Sequence[AggregateCell],
                     content_type: str = AGGREGATE_MSGPACK,
                     lineage: Lineage | None = None) -> EncodedBatch:
    """An aggregate batch (at most MAX_AGGREGATE_CELLS cells) with a fresh batch id."""
    batch = AggregateBatch(batch_id=uuid.uuid4().hex, deployment=deployment,
                           runtime_id=runtime_id, seq=seq, num_layers=num_layers,
                           raw_sample_rate=raw_sample_rate, cells=cells, **_lineage(lineage))
    return EncodedBatch(batch.batch_id, seq, batch.tokens, content_type,
                        encode(batch.model_dump(mode="json"), content_type))


def encode_interval(*, deployment: str, runtime_id: str, seq: int, num_layers: int,
                    raw_sample_rate: float, cells: Sequence[AggregateCell],
                    records: RecordColumns | None,
                    content_type: str = INTERVAL_MSGPACK,
                    lineage: Lineage | None = None) -> EncodedBatch:
    """An interval batch (counts and records, at least one of them) with a fresh batch id;
    `records` as `RecordColumns.of(token_records)` gives them (checked when the records
    were)."""
    batch = IntervalBatch(batch_id=uuid.uuid4().hex, deployment=deployment,
                          runtime_id=runtime_id, seq=seq, num_layers=num_layers,
                          raw_sample_rate=raw_sample_rate, cells=cells, records=records,
                          **_lineage(lineage))
    return EncodedBatch(batch.batch_id, seq, batch.tokens, content_type,
                        encode(batch.model_dump(mode="json"), content_type),
                        len(records) if records is not None else 0)
