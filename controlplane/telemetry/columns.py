"""A telemetry batch column by column: what ingestion checks, stores and rolls up.

`parse_batch` accepts exactly what `TelemetryBatch.model_validate` accepts and fails with the
same ValidationError, without building a model per record. Every column goes through one
pydantic validator made from the wire model's own field (the wire schema stays the one
definition). What a field cannot say (the models' own validators, listed in MODEL_RULES) is
only guarded here: a payload that might break one of those rules, or that this path does not
take (a bad value, a missing field, an odd type), is handed to `TelemetryBatch` itself, which
then accepts it or names the first bad record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import TypeAdapter, ValidationError

from exitplane.wire import (
    DEFAULT_SEGMENT,
    RECORD_COLUMNS,
    IntervalBatch,
    ShadowPoint,
    TelemetryBatch,
    TokenRecord,
)

# The wire models' validators beyond their fields, each guarded in `_parse_columns`.
MODEL_RULES = {"TelemetryBatch._layers_within_model", "TokenRecord._shadow_layers_unique",
               "TokenRecord._shadow_request_labelled"}

_DTYPES = {int: np.int64, float: np.float64, bool: np.bool_}
# An optional count (`int | None`, e.g. a token's exit checks) the record left off.
_NOT_REPORTED = -1


def _field_type(model, name: str):
    """The annotated type of one field of a wire model, constraints included."""
    field = model.model_fields[name]
    return Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation


def _column_adapters(model, skip: str = "") -> dict[str, TypeAdapter]:
    return {name: TypeAdapter(list[_field_type(model, name)])
            for name in model.model_fields if name != skip}


_HEADER = {name: TypeAdapter(_field_type(TelemetryBatch, name))
           for name in TelemetryBatch.model_fields if name != "records"}
# Header fields a batch may leave out (fields added later, with their defaults).
_HEADER_DEFAULTS = {name: field.default for name, field in TelemetryBatch.model_fields.items()
                    if name in _HEADER and not field.is_required()}
_RECORDS = TypeAdapter(Annotated[list[Any], *TelemetryBatch.model_fields["records"].metadata])
_RECORD_COLUMNS = _column_adapters(TokenRecord, skip="shadow")
# Record fields a record may leave out (fields added later, e.g. `segment`), with their defaults.
_RECORD_DEFAULTS = {name: field.default for name, field in TokenRecord.model_fields.items()
                    if name in _RECORD_COLUMNS and not field.is_required()}
_POINT_COLUMNS = _column_adapters(ShadowPoint)


class _NotFast(Exception):
    """The payload needs the model's own validation (to accept it or to name what is wrong)."""


@dataclass(frozen=True, eq=False)
class BatchColumns:
    """One validated batch: the header fields and one array (or list) per record field.

    Shadow points are flat: point i belongs to record `shadowed[shadow_owner[i]]`, in the order
    the runtime sent them; `shadowed` lists the records whose shadow is not None."""

    batch_id: str
    deployment: str
    runtime_id: str
    seq: int
    num_layers: int
    threshold_version: np.ndarray  # int64 (n,)
    request_id: list[str]
    position: np.ndarray  # int64 (n,)
    exit_layer: np.ndarray  # int64 (n,)
    signal_value: np.ndarray  # float64 (n,), NaN where the exits were not checked
    latency_us: np.ndarray  # int64 (n,)
    ts: np.ndarray  # float64 (n,), unix seconds
    shadowed: np.ndarray  # int64 (m,), ascending record indices
    shadow_owner: np.ndarray  # int64 (k,), index into `shadowed`
    shadow_layer: np.ndarray  # int64 (k,)
    shadow_signal: np.ndarray  # float64 (k,)
    shadow_matched: np.ndarray  # bool (k,)
    segment: list[str]  # each record's traffic segment ('default' when the record names none)
    exit_checks: np.ndarray  # int64 (n,), the token's exit checks; -1 where not reported
    shadow_request: np.ndarray  # bool (n,): the token belongs to a shadow request
    request_end: np.ndarray  # bool (n,): the request's last generated token
    aggregated: bool = False  # counted by the runtime's aggregate batches: no rollup counts
    # The runtime's lineage as the batch reports it (None: unknown; controlplane.runtimes.lineage)
    model_revision: str | None = None
    head_digest: str | None = None

    def __len__(self) -> int:
        return len(self.ts)

    @classmethod
    def from_model(cls, batch: TelemetryBatch) -> BatchColumns:
        """The columns of an already validated batch."""
        records = batch.records
        shadowed = [index for index, record in enumerate(records) if record.shadow is not None]
        points = [point for index in shadowed for point in records[index].shadow]
        return cls._build(
            batch.model_dump(exclude={"records"}),
            {name: [getattr(record, name) for record in records] for name in _RECORD_COLUMNS},
            shadowed, [len(records[index].shadow) for index in shadowed],
            {name: [getattr(point, name) for point in points] for name in _POINT_COLUMNS})

    @classmethod
    def _build(cls, header: dict, columns: dict[str, list], shadowed: list[int],
               points_per_record: list[int], points: dict[str, list]) -> BatchColumns:
        arrays = {name: _array(TokenRecord, name, values) for name, values in columns.items()}
        point_arrays = {f"shadow_{name}": _array(ShadowPoint, name, values)
                        for name, values in points.items()}
        return cls(**header, **arrays, **point_arrays,
                   shadowed=np.array(shadowed, dtype=np.int64),
                   shadow_owner=np.repeat(np.arange(len(shadowed)), points_per_record))

    @classmethod
    def of_interval(cls, batch: IntervalBatch) -> BatchColumns | None:
        """The records of an (already validated) interval batch, as the `aggregated` record
        batch they stand for: same id, counted by the batch's cells. None without records."""
        columns = batch.records
        if columns is None:
            return None
        owner = np.array(columns.shadow_record, dtype=np.int64)
        order = np.argsort(owner, kind="stable")  # points grouped by record, in sent order
        shadowed, owner_index = np.unique(owner[order], return_inverse=True)
        return cls(batch_id=batch.batch_id, deployment=batch.deployment,
                   runtime_id=batch.runtime_id, seq=batch.seq, num_layers=batch.num_layers,
                   **{name: _array(TokenRecord, name, getattr(columns, name))
                      for name in RECORD_COLUMNS},
                   shadowed=shadowed.astype(np.int64), shadow_owner=owner_index.astype(np.int64),
                   shadow_layer=np.array(columns.shadow_layer, dtype=np.int64)[order],
                   shadow_signal=np.array(columns.shadow_signal, dtype=np.float64)[order],
                   shadow_matched=np.array(columns.shadow_matched, dtype=np.bool_)[order],
                   segment=columns.segment or [DEFAULT_SEGMENT] * len(columns),
                   exit_checks=_array(TokenRecord, "exit_checks",
                                      columns.exit_checks or [None] * len(columns)),
                   shadow_request=np.array(columns.shadow_request or [False] * len(columns),
                                           dtype=np.bool_),
                   request_end=np.array(columns.request_end or [False] * len(columns),
                                        dtype=np.bool_),
                   aggregated=True, model_revision=batch.model_revision,
                   head_digest=batch.head_digest)

    def to_wire(self) -> dict:
        """The batch as `TelemetryBatch.model_dump(mode="json")` gives it."""
        names = list(_RECORD_COLUMNS)
        columns = [_listed(getattr(self, name)) for name in names]
        records = [dict(zip(names, values, strict=True)) | {"shadow": None}
                   for values in zip(*columns, strict=True)]
        for record in records:  # left off the wire when default, as the model dumps it
            if record["segment"] == _RECORD_DEFAULTS["segment"]:
                del record["segment"]
            if record["exit_checks"] == _NOT_REPORTED:
                del record["exit_checks"]
            for flag in ("shadow_request", "request_end"):
                if not record[flag]:
                    del record[flag]
        for index in self.shadowed.tolist():
            records[index]["shadow"] = []
        point_names = list(_POINT_COLUMNS)
        point_columns = [_listed(getattr(self, f"shadow_{name}")) for name in point_names]
        for owner, values in zip(self.shadowed[self.shadow_owner].tolist(),
                                 zip(*point_columns, strict=True), strict=True):
            records[owner]["shadow"].append(dict(zip(point_names, values, strict=True)))
        lineage = {name: getattr(self, name) for name in ("model_revision", "head_digest")
                   if getattr(self, name) is not None}  # left off when unknown, as dumped
        return {"batch_id": self.batch_id, "deployment": self.deployment,
                "runtime_id": self.runtime_id, "seq": self.seq, "num_layers": self.num_layers,
                "records": records, "aggregated": self.aggregated, **lineage}


def parse_batch(payload: Any) -> BatchColumns:
    """Validate a decoded batch (msgpack or JSON) the way `TelemetryBatch` does, column-wise.

    Raises the ValidationError `TelemetryBatch.model_validate(payload)` raises."""
    try:
        return _parse_columns(payload)
    except _NotFast:
        return BatchColumns.from_model(TelemetryBatch.model_validate(payload))


def _parse_columns(payload: Any) -> BatchColumns:
    if type(payload) is not dict:
        raise _NotFast
    try:
        header = {name: adapter.validate_python(payload[name] if name in payload
                                                 else _HEADER_DEFAULTS[name])
                  for name, adapter in _HEADER.items()}
        records = _RECORDS.validate_python(payload["records"])
        if set(map(type, records)) != {dict}:
            raise _NotFast
        columns = {name: adapter.validate_python(
                       [record[name] for record in records] if name not in _RECORD_DEFAULTS
                       else [record.get(name, _RECORD_DEFAULTS[name]) for record in records])
                   for name, adapter in _RECORD_COLUMNS.items()}
        shadowed = [index for index, record in enumerate(records)
                    if record.get("shadow") is not None]
        shadows = [records[index]["shadow"] for index in shadowed]
        if any(type(shadow) is not list for shadow in shadows):
            raise _NotFast
        points = [point for shadow in shadows for point in shadow]
        if any(type(point) is not dict for point in points):
            raise _NotFast
        point_columns = {name: adapter.validate_python([point[name] for point in points])
                         for name, adapter in _POINT_COLUMNS.items()}
    except (KeyError, ValidationError) as error:
        raise _NotFast from error
    batch = BatchColumns._build(header, columns, shadowed, [len(s) for s in shadows],
                                point_columns)
    # Guards for MODEL_RULES: no exit layer past the model, no shadow layer twice in a record,
    # a shadow request's token at full depth with shadow points.
    if len(batch) and batch.exit_layer.max() > batch.num_layers:
        raise _NotFast
    if batch.shadow_request.any():
        flagged = np.flatnonzero(batch.shadow_request)
        labelled = batch.shadowed[np.unique(batch.shadow_owner)]
        if (batch.exit_layer[flagged] != batch.num_layers).any() \
                or not np.isin(flagged, labelled).all():
            raise _NotFast
    order = np.lexsort((batch.shadow_layer, batch.shadow_owner))
    owner, layer = batch.shadow_owner[order], batch.shadow_layer[order]
    if np.any((owner[1:] == owner[:-1]) & (layer[1:] == layer[:-1])):
        raise _NotFast
    return batch


def _array(model, name: str, values: list) -> np.ndarray | list:
    annotation = model.model_fields[name].annotation
    if annotation == float | None:  # e.g. an unchecked token's signal: None travels as NaN
        return np.array([np.nan if value is None else value for value in values],
                        dtype=np.float64)
    if annotation == int | None:  # e.g. exit checks not reported: None travels as -1
        return np.array([_NOT_REPORTED if value is None else value for value in values],
                        dtype=np.int64)
    dtype = _DTYPES.get(annotation)
    return values if dtype is None else np.array(values, dtype=dtype)


def _listed(values: np.ndarray | list) -> list:
    if isinstance(values, np.ndarray) and values.dtype.kind == "f" and np.isnan(values).any():
        return [None if value != value else value for value in values.tolist()]
    return values.tolist() if isinstance(values, np.ndarray) else values
