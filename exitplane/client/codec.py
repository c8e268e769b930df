"""Telemetry batches as they travel: the wire models encoded with the protocol's content types
(msgpack or JSON; docs/protocol.md, "Telemetry"), and `EncodedBatch`, one encoded batch with
the id, seq and count the sender, the spool and a 413 split need without decoding it."""

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
    RECORDS_JSON,
    RECORDS_MSGPACK,
    AggregateBatch,
    AggregateCell,
    TelemetryBatch,
    TokenRecord,
)

ENCODINGS = {"msgpack": (RECORDS_MSGPACK, AGGREGATE_MSGPACK),
             "json": (RECORDS_JSON, AGGREGATE_JSON)}


@dataclass(frozen=True)
class EncodedBatch:
    """One batch as sent: id, sequence number, record count (for an aggregate batch: the
    tokens it counts), content type and body."""

    batch_id: str
    seq: int
    records: int
    content_type: str
    body: bytes

    @property
    def is_aggregate(self) -> bool:
        return self.content_type in (AGGREGATE_MSGPACK, AGGREGATE_JSON)

    def pack(self) -> bytes:
        """The spool record: id, seq, count, content type and body in one msgpack array."""
        return msgpack.packb([self.batch_id, self.seq, self.records, self.content_type,
                              self.body], use_bin_type=True)

    @classmethod
    def unpack(cls, payload: bytes) -> EncodedBatch:
        """Read a spool record back."""
        batch_id, seq, records, content_type, body = msgpack.unpackb(payload, raw=False)
        return cls(batch_id, seq, records, content_type, body)

    def decode(self) -> dict[str, Any]:
        """The batch as a dict (the model_dump of its TelemetryBatch or AggregateBatch)."""
        if "msgpack" in self.content_type:
            return msgpack.unpackb(self.body, raw=False)
        return json.loads(self.body)

    def split(self) -> list[EncodedBatch]:
        """Two halves with ids derived from this one (deterministic, so replays match)."""
        payload = self.decode()
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


def encode(payload: dict[str, Any], content_type: str) -> bytes:
    """A batch's dict as the body of `content_type` (msgpack or compact JSON)."""
    if "msgpack" in content_type:
        return msgpack.packb(payload, use_bin_type=True)
    return json.dumps(payload, separators=(",", ":")).encode()


def encode_records(*, deployment: str, runtime_id: str, seq: int, num_layers: int,
                   records: Sequence[TokenRecord | dict], aggregated: bool,
                   content_type: str = RECORDS_MSGPACK) -> EncodedBatch:
    """A record batch (validated by the wire schema: ValidationError when a record is bad)
    with a fresh batch id."""
    batch = TelemetryBatch(batch_id=uuid.uuid4().hex, deployment=deployment,
                           runtime_id=runtime_id, seq=seq, num_layers=num_layers,
                           records=records, aggregated=aggregated)
    return EncodedBatch(batch.batch_id, seq, len(records), content_type,
                        encode(batch.model_dump(mode="json"), content_type))


def encode_aggregate(*, deployment: str, runtime_id: str, seq: int, num_layers: int,
                     raw_sample_rate: float, cells: Sequence[AggregateCell],
                     content_type: str = AGGREGATE_MSGPACK) -> EncodedBatch:
    """An aggregate batch (at most MAX_AGGREGATE_CELLS cells) with a fresh batch id."""
    batch = AggregateBatch(batch_id=uuid.uuid4().hex, deployment=deployment,
                           runtime_id=runtime_id, seq=seq, num_layers=num_layers,
                           raw_sample_rate=raw_sample_rate, cells=cells)
    return EncodedBatch(batch.batch_id, seq, batch.tokens, content_type,
                        encode(batch.model_dump(mode="json"), content_type))
