"""The wire schema shared by runtimes and the control plane: threshold sets, token records,
telemetry batches, aggregate batches, interval batches and heartbeats. Pydantic only, so the
runtime box never imports the server.

Signal convention: every signal is a confidence in [0, 1] (entropy is reported as
1 - H / ln(V)); a token exits at a layer when its signal is strictly greater than that layer's
threshold. A threshold of 1.0 therefore never exits.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

NEVER_EXIT = 1.0
MAX_BATCH_RECORDS = 50_000
INT32 = 2**31 - 1  # what an INTEGER column holds on every backend
INT63 = 2**63 - 1
MAX_TS = 1e10  # unix seconds (year 2286): anything later is a clock bug
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
# Traffic segments are named like deployments; `default` is the set's own
# `thresholds`, which every segment without a map of its own (or an unknown one) applies.
DEFAULT_SEGMENT = "default"
# How many segments besides `default` a deployment knows by default (the control plane's
# EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT; runtimes track as many): bounds the label's cardinality.
DEFAULT_MAX_SEGMENTS = 16
# A runtime's id: what the fleet view, gauges, logs and alerts show, so printable and bounded.
# Pulls, heartbeats and telemetry take the same ids (one definition: RuntimeId).
RUNTIME_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
RUNTIME_ID = re.compile(RUNTIME_ID_PATTERN)
# What a threshold set's checksum (and a heartbeat's applied_checksum) looks like: sha256 hex.
CHECKSUM_PATTERN = r"^[0-9a-f]{64}$"
# Free text a runtime sends that the store keeps (request ids, a heartbeat's error): any
# characters but NUL, which a PostgreSQL text column cannot hold (the store would refuse the
# whole batch or write, so the API refuses the one request instead).
NO_NUL_PATTERN = r"^[^\x00]*$"
HISTOGRAM_BINS = 20  # signal-at-exit histograms: 20 bins of width 0.05 over [0, 1]
MAX_AGGREGATE_CELLS = 50_000
# Tokens one aggregate (or interval) batch may account for: 2**40, about 10**12, far past any
# runtime's interval, and small enough that the store's sums of such batches (per rollup key,
# per ingest read of many batches) stay within a BIGINT. A batch over it is refused whole.
MAX_BATCH_TOKENS = 2**40
RuntimeId = Annotated[str, Field(min_length=1, max_length=128, pattern=RUNTIME_ID_PATTERN)]
# Lineage (docs/protocol.md, "Lineage"): the exit-heads digest and the model revision a runtime
# serves, and a deployment names; compared as exact strings. A digest fits the deployment's
# column (71: "sha256:" and 64 hex digits); a revision is a commit, a tag or a file's digest.
HEAD_DIGEST_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,70}$"
MODEL_REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,127}$"
HeadDigest = Annotated[str, Field(min_length=1, max_length=71, pattern=HEAD_DIGEST_PATTERN)]
ModelRevision = Annotated[str, Field(min_length=1, max_length=128,
                                     pattern=MODEL_REVISION_PATTERN)]

# Content types of POST /v1/telemetry: record batches, and aggregate batches (docs/protocol.md).
RECORDS_MSGPACK = "application/msgpack"
RECORDS_JSON = "application/json"
AGGREGATE_MSGPACK = "application/vnd.exitplane.aggregate+msgpack"
AGGREGATE_JSON = "application/vnd.exitplane.aggregate+json"
# An aggregating runtime's interval in one request: its counts and its records, column by column.
INTERVAL_MSGPACK = "application/vnd.exitplane.interval+msgpack"
INTERVAL_JSON = "application/vnd.exitplane.interval+json"


if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # the client supports 3.10: what 3.11's StrEnum does for these enums
    class StrEnum(str, enum.Enum):
        __str__ = str.__str__
        __format__ = str.__format__


class Signal(StrEnum):
    """How an exit point measures confidence."""

    learned = "learned"
    maxprob = "maxprob"
    margin = "margin"
    entropy = "entropy"
    saturation = "saturation"


class Origin(StrEnum):
    """Where a threshold set came from."""

    manual = "manual"
    calibration = "calibration"
    fallback = "fallback"
    rollback = "rollback"


Threshold = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Layer = Annotated[int, Field(ge=0, le=1023)]


def canonical_json(payload: Any) -> bytes:
    """Serialise with sorted keys and no whitespace: the bytes the checksum is taken over."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def threshold_checksum(*, deployment: str, version: int, signal: str,
                       thresholds: dict[int, float],
                       segments: dict[str, dict[int, float]] | None = None,
                       head_digest: str | None = None) -> str:
    """sha256 over the canonical JSON of what a runtime applies; also the HTTP ETag.

    The segment map enters the canonical JSON only when it names a segment, and the heads
    digest only when the set names one, so a set without them has the same checksum for
    every runtime and client, whichever fields they know (ETags, vectors).
    """
    body: dict[str, Any] = {
        "deployment": deployment,
        "version": version,
        "signal": str(signal),
        "thresholds": _layer_map(thresholds),
    }
    if segments:
        body["segments"] = {name: _layer_map(by_layer) for name, by_layer in segments.items()}
    if head_digest:
        body["head_digest"] = head_digest
    return hashlib.sha256(canonical_json(body)).hexdigest()


def _layer_map(thresholds: dict[int, float]) -> dict[str, float]:
    return {str(layer): float(value) for layer, value in sorted(thresholds.items())}


# The exit layers a deployment (and a runtime serving without exit heads, and head training)
# uses when none are named: a function of the model's depth alone, so the control plane, the
# runtime and the CLI help agree. Exits start at 40% of depth, where exit heads begin to agree
# with the full model often enough to pay for their checks (SmolLM2-135M, 30 layers: 12, 15,
# ..., 27, the layers of the heads the package ships; the tiny test model, 6 layers: 2, 4).
DEFAULT_EXIT_LAYERS_RULE = ("every 3rd layer below full depth from 40% of depth (at least layer "
                            "6); models under 12 layers every 2nd from 2; a 2-layer model "
                            "layer 1")


def default_exit_layers(num_layers: int) -> list[int]:
    """The default exit layers of a model with `num_layers` decoder layers
    (DEFAULT_EXIT_LAYERS_RULE); empty for a model too shallow to exit (one layer)."""
    start, step = (max(6, 2 * num_layers // 5), 3) if num_layers >= 12 else (2, 2)
    return list(range(start, num_layers, step)) or list(range(1, num_layers))


def validate_thresholds(thresholds: dict[int, float], exit_layers: list[int]) -> None:
    """Raise ValueError unless `thresholds` covers exactly `exit_layers` with values in [0, 1]."""
    unknown = sorted(set(thresholds) - set(exit_layers))
    if unknown:
        raise ValueError(f"unknown exit layers {unknown}; this deployment exits at {exit_layers}")
    missing = sorted(set(exit_layers) - set(thresholds))
    if missing:
        raise ValueError(f"missing thresholds for exit layers {missing}")
    for layer, value in thresholds.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"threshold for layer {layer} must be a number, got {value!r}")
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"threshold for layer {layer} is {value}; signals are in [0, 1]")


SegmentName = Annotated[str, Field(pattern=NAME_PATTERN)]


class ThresholdSetWire(BaseModel):
    """What a runtime pulls and applies: one immutable version of per-exit-layer thresholds,
    optionally with its own per-layer thresholds for some traffic segments."""

    model_config = ConfigDict(frozen=True)

    deployment: str
    version: int = Field(ge=0, le=INT32)
    signal: Signal
    thresholds: dict[Layer, Threshold]
    # Absent (never null on the wire) when the set has no segments: such a set serialises and
    # checksums as a set that has no segment field at all.
    segments: dict[SegmentName, dict[Layer, Threshold]] | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="per-segment thresholds; segments not named here apply `thresholds`")
    # The exit heads the set was made for (a set that can exit names its deployment's heads);
    # absent when it fits any heads (a never-exit set, a deployment naming no digest). A
    # runtime serving other heads refuses the set.
    head_digest: HeadDigest | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="digest of the exit heads the set was made for; absent: any heads")
    checksum: str = Field(pattern=CHECKSUM_PATTERN)

    @field_validator("segments")
    @classmethod
    def _segments_well_formed(cls, segments: dict | None) -> dict | None:
        if not segments:
            return None  # {} and null are one thing: no segments (one checksum rule)
        if DEFAULT_SEGMENT in segments:
            raise ValueError(f"segment {DEFAULT_SEGMENT!r} is the set's own `thresholds`; "
                             "do not repeat it under `segments`")
        return segments

    def expected_checksum(self) -> str:
        return threshold_checksum(deployment=self.deployment, version=self.version,
                                  signal=self.signal, thresholds=self.thresholds,
                                  segments=self.segments, head_digest=self.head_digest)

    def verify(self) -> None:
        """Raise ValueError when the checksum does not match the content (tampered or torn)."""
        if self.checksum != self.expected_checksum():
            raise ValueError(f"checksum mismatch for {self.deployment} v{self.version}")

    def for_segment(self, segment: str | None) -> dict[int, float]:
        """The per-layer thresholds a row of `segment` applies: its own map if the set has
        one, else `default`'s (unknown, missing and `default` itself)."""
        if segment and self.segments and segment in self.segments:
            return self.segments[segment]
        return self.thresholds

    def fits_heads(self, head_digest: str | None) -> bool:
        """Whether a runtime serving the exit heads `head_digest` may apply this set: always
        when the set names no heads or the runtime does not know its own (None)."""
        return self.head_digest is None or head_digest is None or \
            self.head_digest == head_digest

    @classmethod
    def build(cls, *, deployment: str, version: int, signal: Signal | str,
              thresholds: dict[int, float],
              segments: dict[str, dict[int, float]] | None = None,
              head_digest: str | None = None) -> ThresholdSetWire:
        checksum = threshold_checksum(deployment=deployment, version=version, signal=signal,
                                      thresholds=thresholds, segments=segments,
                                      head_digest=head_digest or None)
        return cls(deployment=deployment, version=version, signal=Signal(signal),
                   thresholds=thresholds, segments=segments or None,
                   head_digest=head_digest or None, checksum=checksum)

    @classmethod
    def never_exit(cls, *, deployment: str, signal: Signal | str,
                   exit_layers: list[int]) -> ThresholdSetWire:
        """The built-in conservative set (version 0): every threshold 1.0, nothing exits."""
        return cls.build(deployment=deployment, version=0, signal=signal,
                         thresholds=dict.fromkeys(exit_layers, NEVER_EXIT))


class ThresholdPull(ThresholdSetWire):
    """What a threshold pull answers: the set and, outside its checksum, the shadow rate the
    control plane asks runtimes to apply (absent while it asks none: runtimes apply their
    own). docs/protocol.md, "Shadow rate"."""

    shadow_rate: float | None = Field(
        default=None, ge=0, le=1, exclude_if=lambda value: value is None,
        description="share of tokens to run to full depth as shadow tokens, as the control "
        "plane decided it; absent: the runtime applies its own rate")

    shadow_request_rate: float | None = Field(
        default=None, ge=0, le=1, exclude_if=lambda value: value is None,
        description="share of whole requests to serve at full depth as shadow requests, as "
        "the control plane decided it; absent: the runtime applies its own rate")

    def threshold_set(self) -> ThresholdSetWire:
        """The set alone (what is applied, cached and checksummed)."""
        return ThresholdSetWire.model_validate(
            self.model_dump(exclude={"shadow_rate", "shadow_request_rate"}))


def pull_etag(checksum: str, shadow_rate: float | None,
              shadow_request_rate: float | None = None) -> str:
    """The entity tag of a pull answer (without quotes): the set's checksum, followed by
    `.s<rate>` when the answer carries a shadow rate to a runtime that applies it
    (`applies_shadow_rate=true`) and `.r<rate>` when it carries a shadow-request rate to a
    runtime that serves shadow requests at it (`applies_shadow_requests=true`), so a change
    of either rate alone changes the tag. Pass None for a rate the runtime does not apply."""
    tag = checksum if shadow_rate is None else f"{checksum}.s{shadow_rate:.6g}"
    return tag if shadow_request_rate is None else f"{tag}.r{shadow_request_rate:.6g}"


class ShadowPoint(BaseModel):
    """One exit point of a shadow token: its signal and whether its top-1 matched full depth."""

    model_config = ConfigDict(frozen=True)

    layer: Layer
    signal: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    # JSON true/false (msgpack booleans) only: "yes", 1 or "true" are refused, not guessed.
    matched: StrictBool


class TokenRecord(BaseModel):
    """One generated token: where it exited and how confident it was."""

    model_config = ConfigDict(frozen=True)

    threshold_version: int = Field(ge=0, le=INT32)
    request_id: str = Field(min_length=1, max_length=128, pattern=NO_NUL_PATTERN)
    position: int = Field(ge=0, le=INT32)
    # The number of decoder layers the token ran; num_layers means full depth.
    exit_layer: int = Field(ge=0, le=1024)
    # None: this token's exits were not checked (e.g. a never-exit set skips the checks), so
    # it has no signal; consumers leave it out of signal distributions instead of reading 0.
    signal_value: float | None = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    # Wall time the token took, microseconds: its share of the step that produced it.
    latency_us: int = Field(ge=0, le=INT32)
    ts: float = Field(gt=0, le=MAX_TS, description="unix seconds when the token was produced")
    shadow: list[ShadowPoint] | None = None
    # How many exit checks (signals) the token computed on its way to `exit_layer`: with
    # `latency_us` and the depth, what the control plane fits its cost model on. Left off the
    # wire when not reported; such tokens count as served but not timed.
    exit_checks: int | None = Field(
        default=None, ge=0, le=1024, exclude_if=lambda value: value is None,
        description="exit checks the token computed (absent: not reported)")
    # The traffic segment the token's request belongs to; left off the wire when it
    # is `default`, so unsegmented traffic encodes with no segment field.
    segment: SegmentName = Field(default=DEFAULT_SEGMENT,
                                 exclude_if=lambda value: value == DEFAULT_SEGMENT)
    # A token of a shadow request: a request served entirely at full depth, every token
    # carrying the shadow points of every exit layer checked (docs/protocol.md, "Shadow
    # requests"). Its batch checks exit_layer == num_layers. Left off the wire when false.
    shadow_request: StrictBool = Field(
        default=False, exclude_if=lambda value: value is False,
        description="the token belongs to a request served entirely at full depth")
    # The request's last generated token: its answer is complete. Left off when false.
    request_end: StrictBool = Field(
        default=False, exclude_if=lambda value: value is False,
        description="the request's last generated token (its answer is complete)")

    @field_validator("shadow")
    @classmethod
    def _shadow_layers_unique(cls, points: list[ShadowPoint] | None) -> list[ShadowPoint] | None:
        if points is not None and len({p.layer for p in points}) != len(points):
            raise ValueError("shadow points repeat an exit layer")
        return points

    @model_validator(mode="after")
    def _shadow_request_labelled(self) -> TokenRecord:
        if self.shadow_request and not self.shadow:
            raise ValueError("a shadow_request token carries the shadow points of every exit "
                             "layer checked (shadow is empty)")
        return self


class Lineage(BaseModel):
    """What a runtime serves, as it reports it in heartbeats and telemetry batches: its model
    revision and exit-heads digest. Either left out (never null on the wire) is unknown: the
    runtime keeps working, and only what it does report is compared with its deployment's."""

    model_revision: ModelRevision | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="the model revision the runtime serves; absent: unknown")
    head_digest: HeadDigest | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="digest of the exit heads the runtime serves; absent: unknown")


def signal_bin(signal: float) -> int:
    """The histogram bin of a signal in [0, 1] (1.0 falls in the last bin)."""
    return min(int(signal * HISTOGRAM_BINS), HISTOGRAM_BINS - 1)


class TelemetryBatch(Lineage):
    """A runtime's unit of shipping: idempotent by batch_id, ordered by seq."""

    batch_id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    deployment: str = Field(pattern=NAME_PATTERN)
    runtime_id: RuntimeId
    seq: int = Field(ge=0, le=INT63)
    num_layers: int = Field(ge=1, le=1024)
    records: list[TokenRecord] = Field(min_length=1, max_length=MAX_BATCH_RECORDS)
    # True: the runtime counts every token in its aggregate batches, so these records are kept
    # as rows (shadow labels, samples) but add only their shadow labels to the rollups.
    aggregated: StrictBool = False

    @model_validator(mode="after")
    def _layers_within_model(self) -> TelemetryBatch:
        for index, record in enumerate(self.records):
            if record.exit_layer > self.num_layers:
                raise ValueError(f"record {index}: exit_layer {record.exit_layer} exceeds "
                                 f"num_layers {self.num_layers}")
            if record.shadow_request and record.exit_layer != self.num_layers:
                raise _shadow_request_depth(index, record.exit_layer, self.num_layers)
        return self


def _shadow_request_depth(index: int, exit_layer: int, num_layers: int) -> ValueError:
    return ValueError(f"record {index}: a shadow_request token runs at full depth, but its "
                      f"exit_layer is {exit_layer}, not num_layers {num_layers}")


class AggregateCell(BaseModel):
    """What one runtime saw in one minute, under one threshold version, at one layer: how
    many tokens left there (`exits`; full depth is layer num_layers) and the histogram of their
    signal at exit (tokens whose exits were not checked have no signal and are left out)."""

    model_config = ConfigDict(frozen=True)

    minute: int = Field(ge=0, le=int(MAX_TS), multiple_of=60,
                        description="unix seconds of the minute's start (ts // 60 * 60)")
    threshold_version: int = Field(ge=0, le=INT32)
    layer: int = Field(ge=0, le=1024)
    # The traffic segment of the tokens counted here; left off the wire when `default`.
    segment: SegmentName = Field(default=DEFAULT_SEGMENT,
                                 exclude_if=lambda value: value == DEFAULT_SEGMENT)
    exits: int = Field(ge=0, le=MAX_BATCH_TOKENS)
    histogram: list[Annotated[int, Field(ge=0, le=MAX_BATCH_TOKENS)]] = Field(
        min_length=HISTOGRAM_BINS, max_length=HISTOGRAM_BINS)
    # What the `exits` tokens cost, summed over them: wall time in microseconds and exit checks
    # computed. Both left off the wire when the runtime does not time its tokens (then
    # together: one without the other is refused).
    latency_us: int | None = Field(default=None, ge=0, le=INT63,
                                   exclude_if=lambda value: value is None,
                                   description="summed wall time of the cell's tokens, us")
    exit_checks: int | None = Field(default=None, ge=0, le=MAX_BATCH_TOKENS * 1024,
                                    exclude_if=lambda value: value is None,
                                    description="summed exit checks of the cell's tokens")

    @model_validator(mode="after")
    def _histogram_within_exits(self) -> AggregateCell:
        if sum(self.histogram) > self.exits:
            raise ValueError(f"histogram counts {sum(self.histogram)} tokens, more than the "
                             f"{self.exits} that exited")
        if (self.latency_us is None) != (self.exit_checks is None):
            raise ValueError("latency_us and exit_checks come together or not at all")
        return self


class AggregateBatch(Lineage):
    """Exact counts of every token a runtime generated since its last aggregate batch, merged
    additively into the rollups; idempotent by batch_id like a record batch."""

    batch_id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    deployment: str = Field(pattern=NAME_PATTERN)
    runtime_id: RuntimeId
    seq: int = Field(ge=0, le=INT63)
    num_layers: int = Field(ge=1, le=1024)
    raw_sample_rate: float = Field(ge=0.0, le=1.0, allow_inf_nan=False, description=(
        "share of non-shadow tokens this runtime also ships as records"))
    cells: list[AggregateCell] = Field(min_length=1, max_length=MAX_AGGREGATE_CELLS)

    @model_validator(mode="after")
    def _cells_fit(self) -> AggregateBatch:
        seen: set[tuple[int, int, str, int]] = set()
        total = 0
        for index, cell in enumerate(self.cells):
            total += cell.exits
            if total > MAX_BATCH_TOKENS:
                raise ValueError(f"cells 0-{index} account for {total} tokens, more than a "
                                 f"batch may ({MAX_BATCH_TOKENS}): ship them in more batches")
            if cell.layer > self.num_layers:
                raise ValueError(f"cell {index}: layer {cell.layer} exceeds num_layers "
                                 f"{self.num_layers}")
            key = (cell.minute, cell.threshold_version, cell.segment, cell.layer)
            if key in seen:
                raise ValueError(f"cell {index}: (minute, threshold_version, segment, layer) "
                                 f"{key} repeats an earlier cell")
            seen.add(key)
        return self

    @property
    def tokens(self) -> int:
        """Tokens this batch accounts for (each token exits at exactly one layer)."""
        return sum(cell.exits for cell in self.cells)


def _column(model: type[BaseModel], name: str, max_length: int | None = None) -> Any:
    """A list of `model`'s field `name`, constraints included: a column of that field, so the
    field stays the one definition of what a value may be."""
    field = model.model_fields[name]
    item = Annotated[(field.annotation, *field.metadata)] if field.metadata \
        else field.annotation
    return list[item] if max_length is None else Annotated[list[item],
                                                           Field(max_length=max_length)]


# A record column holds one entry per record; the shadow columns (one entry per shadow point)
# are bounded by the control plane's EXITPLANE_TELEMETRY_MAX_BATCH_ITEMS (413: split).
_VersionColumn = _column(TokenRecord, "threshold_version", MAX_BATCH_RECORDS)
_RequestColumn = _column(TokenRecord, "request_id", MAX_BATCH_RECORDS)
_PositionColumn = _column(TokenRecord, "position", MAX_BATCH_RECORDS)
_ExitLayerColumn = _column(TokenRecord, "exit_layer", MAX_BATCH_RECORDS)
_SignalValueColumn = _column(TokenRecord, "signal_value", MAX_BATCH_RECORDS)
_LatencyColumn = _column(TokenRecord, "latency_us", MAX_BATCH_RECORDS)
_TsColumn = _column(TokenRecord, "ts", MAX_BATCH_RECORDS)
_ExitChecksColumn = _column(TokenRecord, "exit_checks", MAX_BATCH_RECORDS)
_PointLayerColumn = _column(ShadowPoint, "layer")
_PointSignalColumn = _column(ShadowPoint, "signal")
_PointMatchedColumn = _column(ShadowPoint, "matched")
RECORD_COLUMNS = ("threshold_version", "request_id", "position", "exit_layer", "signal_value",
                  "latency_us", "ts")
# Record columns left off (null) when no record sets them.
OPTIONAL_RECORD_COLUMNS = ("segment", "exit_checks", "shadow_request", "request_end")
SHADOW_COLUMNS = ("layer", "signal", "matched")


class RecordColumns(BaseModel):
    """Token records column by column: entry i of every record column is record i, each entry
    checked as the `TokenRecord` field of the same name. Shadow points are flat: point j
    belongs to record `shadow_record[j]`, each checked as the `ShadowPoint` field. Decoding
    a few lists costs a fraction of decoding one map per record (the fleet's sampled records)."""

    model_config = ConfigDict(frozen=True)

    threshold_version: _VersionColumn
    request_id: _RequestColumn
    position: _PositionColumn
    exit_layer: _ExitLayerColumn
    signal_value: _SignalValueColumn
    latency_us: _LatencyColumn
    ts: _TsColumn
    # Each record's traffic segment; left off (null) when every record is `default`.
    segment: list[SegmentName] | None = Field(default=None, max_length=MAX_BATCH_RECORDS,
                                              exclude_if=lambda value: value is None)
    # Each record's exit checks; left off (null) when no record reports them.
    exit_checks: _ExitChecksColumn | None = Field(default=None,
                                                  exclude_if=lambda value: value is None)
    # Each record's `shadow_request` and `request_end`; each left off (null) when false for
    # every record.
    shadow_request: list[StrictBool] | None = Field(default=None, max_length=MAX_BATCH_RECORDS,
                                                    exclude_if=lambda value: value is None)
    request_end: list[StrictBool] | None = Field(default=None, max_length=MAX_BATCH_RECORDS,
                                                 exclude_if=lambda value: value is None)
    shadow_record: list[Annotated[int, Field(ge=0, lt=MAX_BATCH_RECORDS)]] = Field(
        default_factory=list)
    shadow_layer: _PointLayerColumn = Field(default_factory=list)
    shadow_signal: _PointSignalColumn = Field(default_factory=list)
    shadow_matched: _PointMatchedColumn = Field(default_factory=list)

    @model_validator(mode="after")
    def _aligned(self) -> RecordColumns:
        count = len(self.threshold_version)
        if not 1 <= count <= MAX_BATCH_RECORDS:
            raise ValueError(f"records: 1 to {MAX_BATCH_RECORDS} records, not {count}")
        optional = tuple(name for name in OPTIONAL_RECORD_COLUMNS
                         if getattr(self, name) is not None)
        for name in RECORD_COLUMNS[1:] + optional:
            if len(getattr(self, name)) != count:
                raise ValueError(f"column {name} has {len(getattr(self, name))} entries, "
                                 f"threshold_version {count}")
        points = len(self.shadow_record)
        for name in SHADOW_COLUMNS:
            if len(getattr(self, f"shadow_{name}")) != points:
                raise ValueError(f"column shadow_{name} has "
                                 f"{len(getattr(self, f'shadow_{name}'))} entries, "
                                 f"shadow_record {points}")
        if points and max(self.shadow_record) >= count:
            raise ValueError(f"shadow_record {max(self.shadow_record)} names no record (there "
                             f"are {count})")
        if len(set(zip(self.shadow_record, self.shadow_layer, strict=True))) != points:
            raise ValueError("shadow points repeat an exit layer of a record")
        if self.shadow_request is not None:
            labelled = set(self.shadow_record)
            for index, flagged in enumerate(self.shadow_request):
                if flagged and index not in labelled:
                    raise ValueError(f"record {index}: a shadow_request token carries the "
                                     "shadow points of every exit layer checked (it has none)")
        return self

    def __len__(self) -> int:
        return len(self.threshold_version)

    @classmethod
    def of(cls, records: Sequence[TokenRecord]) -> RecordColumns:
        """The columns of already validated records (nothing is checked again)."""
        segments = [record.segment for record in records]
        checks = [record.exit_checks for record in records]
        shadow_requests = [record.shadow_request for record in records]
        ends = [record.request_end for record in records]
        points = [(index, point) for index, record in enumerate(records)
                  for point in record.shadow or ()]
        return cls.model_construct(
            **{name: [getattr(record, name) for record in records] for name in RECORD_COLUMNS},
            segment=None if all(name == DEFAULT_SEGMENT for name in segments) else segments,
            exit_checks=None if all(value is None for value in checks) else checks,
            shadow_request=shadow_requests if any(shadow_requests) else None,
            request_end=ends if any(ends) else None,
            shadow_record=[index for index, _ in points],
            **{f"shadow_{name}": [getattr(point, name) for _, point in points]
               for name in SHADOW_COLUMNS})

    def records(self) -> list[TokenRecord]:
        """The records one by one (a runtime falling back to record batches)."""
        shadows: dict[int, list[ShadowPoint]] = {}
        for index, layer, signal, matched in zip(self.shadow_record, self.shadow_layer,
                                                 self.shadow_signal, self.shadow_matched,
                                                 strict=True):
            shadows.setdefault(index, []).append(
                ShadowPoint(layer=layer, signal=signal, matched=matched))
        segments = self.segment or [DEFAULT_SEGMENT] * len(self)
        checks = self.exit_checks or [None] * len(self)
        shadow_requests = self.shadow_request or [False] * len(self)
        ends = self.request_end or [False] * len(self)
        return [TokenRecord(**dict(zip(RECORD_COLUMNS, values, strict=True)),
                            shadow=shadows.get(index), segment=segments[index],
                            exit_checks=checks[index], shadow_request=shadow_requests[index],
                            request_end=ends[index])
                for index, values in enumerate(zip(*(getattr(self, name)
                                                     for name in RECORD_COLUMNS), strict=True))]


class IntervalBatch(AggregateBatch):
    """An aggregating runtime's interval in one request: the exact counts of every token it
    generated (`cells`, as in an aggregate batch) and the records of its shadow and sampled
    tokens (`records`, column by column; stored as an `aggregated` record batch's would be:
    rows and shadow labels, no token counts). One batch id covers both, so a replay adds
    neither twice."""

    cells: list[AggregateCell] = Field(default_factory=list, max_length=MAX_AGGREGATE_CELLS)
    records: RecordColumns | None = Field(default=None, exclude_if=lambda value: value is None)

    @model_validator(mode="after")
    def _records_fit(self) -> IntervalBatch:
        if not self.cells and self.records is None:
            raise ValueError("an interval batch carries cells, records or both")
        if self.records is not None:
            flags = self.records.shadow_request or [False] * len(self.records)
            for index, (layer, flagged) in enumerate(zip(self.records.exit_layer, flags,
                                                         strict=True)):
                if layer > self.num_layers:
                    raise ValueError(f"record {index}: exit_layer {layer} exceeds num_layers "
                                     f"{self.num_layers}")
                if flagged and layer != self.num_layers:
                    raise _shadow_request_depth(index, layer, self.num_layers)
        return self


class Heartbeat(Lineage):
    """A runtime's periodic report of what it serves and applies and how its shipping is
    doing."""

    runtime_id: RuntimeId
    applied_version: int | None = Field(default=None, ge=0, le=INT32)
    applied_checksum: str | None = Field(default=None, pattern=CHECKSUM_PATTERN)
    ready: StrictBool = True
    error: str | None = Field(default=None, max_length=2000, pattern=NO_NUL_PATTERN)
    spooled_batches: int = Field(default=0, ge=0, le=INT32)
    dropped_records: int = Field(default=0, ge=0, le=INT32)
    refused_version: int | None = Field(
        default=None, ge=0, le=INT32, exclude_if=lambda value: value is None,
        description="the version of the threshold set the runtime refused last, while that "
                    "refusal stands (it serves an older set or the built-in one; `error` says "
                    "why); absent: none")


def check_runtime_id(runtime_id: str) -> str:
    """`runtime_id` if the control plane takes it, else ValueError saying why: a client checks
    at construction, since every pull, heartbeat and batch with it would be refused (422)."""
    if not RUNTIME_ID.fullmatch(runtime_id):
        raise ValueError(f"runtime id {runtime_id[:140]!r} must match {RUNTIME_ID_PATTERN} "
                         "(letters, digits, '_.:-'; at most 128)")
    return runtime_id
