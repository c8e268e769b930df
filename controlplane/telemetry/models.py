"""ORM for telemetry: received batches (idempotency), raw token records, shadow samples laid
out for the calibrator, and per-minute rollups per deployment / version / runtime / layer."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, Index, LargeBinary, SmallInteger, String
from sqlalchemy.orm import Mapped, mapped_column

from controlplane.db import Base, utcnow
from exitplane.wire import DEFAULT_SEGMENT
from exitplane.wire import HISTOGRAM_BINS as HISTOGRAM_BINS

PARTITIONED_TABLES = ("token_records", "shadow_samples")


def is_partition(table_name: str) -> bool:
    """Partitions (token_records_p20261129, ..._default) live outside the ORM metadata."""
    return any(table_name.startswith(f"{parent}_") for parent in PARTITIONED_TABLES)


class TelemetryBatchRow(Base):
    """One accepted batch; its id, within its deployment, makes a replay a no-op (another
    deployment's batch with the same id is its own)."""

    __tablename__ = "telemetry_batches"

    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"),
                                               primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    runtime_id: Mapped[str] = mapped_column(String(128))
    seq: Mapped[int] = mapped_column(BigInteger)
    records: Mapped[int]
    received_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    # 'records' (every token a record), 'sampled' (an aggregating runtime's records: shadow
    # tokens and a sample) or 'aggregate' (exact counts; `records` is then its cell count; an
    # interval batch is one too, its records stored as rows under the same id).
    kind: Mapped[str] = mapped_column(String(16), default="records", server_default="records")
    tokens: Mapped[int | None] = mapped_column(BigInteger)  # tokens it adds to the rollups
    raw_sample_rate: Mapped[float | None]
    # The runtime token that posted the batch (NULL: written without one, e.g. by a service).
    token_id: Mapped[int | None]


class TokenRecordRow(Base):
    """A generated token as the runtime reported it. On PostgreSQL the table is partitioned
    by day on `ts` (see the migration), so retention drops whole partitions."""

    __tablename__ = "token_records"
    __table_args__ = (Index("ix_token_records_deployment_id_ts", "deployment_id", "ts"),
                      {"postgresql_partition_by": "RANGE (ts)"})

    deployment_id: Mapped[int] = mapped_column(primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    idx: Mapped[int] = mapped_column(primary_key=True)
    ts: Mapped[datetime] = mapped_column(primary_key=True)
    runtime_id: Mapped[str] = mapped_column(String(128))
    threshold_version: Mapped[int]
    request_id: Mapped[str] = mapped_column(String(128))
    position: Mapped[int]
    exit_layer: Mapped[int] = mapped_column(SmallInteger)
    signal_value: Mapped[float | None]  # NULL: the token's exits were not checked
    latency_us: Mapped[int]
    shadow: Mapped[bool]
    # The request's traffic segment; 'default' for unsegmented traffic.
    segment: Mapped[str] = mapped_column(String(64), default=DEFAULT_SEGMENT,
                                         server_default=DEFAULT_SEGMENT)


class ShadowSampleRow(Base):
    """A shadow token's labels at every exit point, in the deployment's exit-layer order:
    `signals` is little-endian float32[L], `matched` uint8[L] (1 = that layer's top-1 equals
    full depth's). Reading n rows gives the (n, L) matrices the calibrator wants."""

    __tablename__ = "shadow_samples"
    __table_args__ = (Index("ix_shadow_samples_deployment_id_ts", "deployment_id", "ts"),
                      {"postgresql_partition_by": "RANGE (ts)"})

    deployment_id: Mapped[int] = mapped_column(primary_key=True)
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    idx: Mapped[int] = mapped_column(primary_key=True)
    ts: Mapped[datetime] = mapped_column(primary_key=True)
    threshold_version: Mapped[int]
    runtime_id: Mapped[str] = mapped_column(String(128))
    # Who vouches for it (controlplane/runtimes/witnesses.py): 'token:<id>' for the credential
    # that posted it, 'runtime:<id>' when none did; '' (stored before) reads as its runtime.
    witness: Mapped[str] = mapped_column(String(140), default="", server_default="")
    # Seconds between `ts` and when the sample was stored (NULL: stored before this was kept);
    # evidence stamped implausibly long before it arrived never counts (settings:
    # evidence_max_delay_s)
    arrival_delay_s: Mapped[float | None]
    # Shadow tokens of one request are correlated: quality tests cluster them by request.
    request_id: Mapped[str | None] = mapped_column(String(128))
    signals: Mapped[bytes] = mapped_column(LargeBinary)
    matched: Mapped[bytes] = mapped_column(LargeBinary)
    # The request's traffic segment; 'default' for unsegmented traffic.
    segment: Mapped[str] = mapped_column(String(64), default=DEFAULT_SEGMENT,
                                         server_default=DEFAULT_SEGMENT)


class Rollup(Base):
    """Per minute, deployment, version, runtime, traffic segment and layer (exit layers plus
    full depth):

    - tokens: tokens whose check at this layer ran (exit layer >= this layer)
    - exits: tokens that left at this layer
    - shadow_total / shadow_matches: shadow tokens labelled at this layer / matching full depth
    - policy_exits / policy_mismatches: shadow tokens the active policy would have let out here
      / of those, the ones whose answer differed from full depth (the disagreement)
    - timed_tokens / latency_us / exit_checks: of the tokens that left here, those whose cost
      was reported / their summed wall time (microseconds) and exit checks (the savings' cost
      model is fitted on these, telemetry/savings.py)
    - shadow_tokens: of the tokens that left here, the shadow ones (full depth, every check)
    """

    __tablename__ = "rollups"

    deployment_id: Mapped[int] = mapped_column(primary_key=True)
    version: Mapped[int] = mapped_column(primary_key=True)
    runtime_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    minute: Mapped[datetime] = mapped_column(primary_key=True)
    # The traffic segment; 'default' for unsegmented traffic.
    segment: Mapped[str] = mapped_column(String(64), primary_key=True, default=DEFAULT_SEGMENT,
                                         server_default=DEFAULT_SEGMENT)
    layer: Mapped[int] = mapped_column(primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    exits: Mapped[int] = mapped_column(BigInteger, default=0)
    shadow_total: Mapped[int] = mapped_column(BigInteger, default=0)
    shadow_matches: Mapped[int] = mapped_column(BigInteger, default=0)
    policy_exits: Mapped[int] = mapped_column(BigInteger, default=0)
    policy_mismatches: Mapped[int] = mapped_column(BigInteger, default=0)
    timed_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    latency_us: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    exit_checks: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    shadow_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class RollupHistogram(Base):
    """Signal-at-exit histogram per minute, deployment, version, runtime, segment, layer and bin."""

    __tablename__ = "rollup_histograms"

    deployment_id: Mapped[int] = mapped_column(primary_key=True)
    version: Mapped[int] = mapped_column(primary_key=True)
    runtime_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    minute: Mapped[datetime] = mapped_column(primary_key=True)
    # The traffic segment; 'default' for unsegmented traffic.
    segment: Mapped[str] = mapped_column(String(64), primary_key=True, default=DEFAULT_SEGMENT,
                                         server_default=DEFAULT_SEGMENT)
    layer: Mapped[int] = mapped_column(primary_key=True)
    bin: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger, default=0)



class ShadowRequestTokenRow(Base):
    """A shadow request's token waiting for the rest of its request (assembly,
    telemetry/shadow_requests.py): its labels at every exit point as in `ShadowSampleRow`, and
    whether it is the request's last. Rows leave when their request is complete (it becomes a
    `ShadowRequestRow`) or expire (settings: shadow_request_ttl_s)."""

    __tablename__ = "shadow_request_tokens"
    __table_args__ = (Index("ix_shadow_request_tokens_deployment_id_ts", "deployment_id", "ts"),)

    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"),
                                               primary_key=True)
    runtime_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    position: Mapped[int] = mapped_column(primary_key=True)
    ts: Mapped[datetime]
    threshold_version: Mapped[int]
    segment: Mapped[str] = mapped_column(String(64))
    witness: Mapped[str] = mapped_column(String(140))
    # The lineage the token's batch reported ('' unknown).
    model_revision: Mapped[str] = mapped_column(String(128))
    head_digest: Mapped[str] = mapped_column(String(71))
    arrival_delay_s: Mapped[float]
    request_end: Mapped[bool]
    signals: Mapped[bytes] = mapped_column(LargeBinary)  # float32[L], little-endian
    matched: Mapped[bytes] = mapped_column(LargeBinary)  # uint8[L]


class ShadowRequestRow(Base):
    """A complete shadow request: a request served entirely at full depth, with every token's
    labels at every exit point in position order. `signals` is little-endian float32[T, L],
    `matched` uint8[T, L] (T tokens, L exit layers in order): for any threshold set, whether
    its answer would have differed from full depth (`stats.answers`)."""

    __tablename__ = "shadow_requests"
    __table_args__ = (Index("ix_shadow_requests_deployment_id_ts", "deployment_id", "ts"),)

    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"),
                                               primary_key=True)
    runtime_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    ts: Mapped[datetime]  # its first token's
    threshold_version: Mapped[int]
    segment: Mapped[str] = mapped_column(String(64))
    witness: Mapped[str] = mapped_column(String(140))
    model_revision: Mapped[str] = mapped_column(String(128))
    head_digest: Mapped[str] = mapped_column(String(71))
    # The largest delay between a token's `ts` and its arrival (the backdating rule)
    arrival_delay_s: Mapped[float]
    tokens: Mapped[int]
    signals: Mapped[bytes] = mapped_column(LargeBinary)
    matched: Mapped[bytes] = mapped_column(LargeBinary)
    completed_at: Mapped[datetime] = mapped_column(default=utcnow)
