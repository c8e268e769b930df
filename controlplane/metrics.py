"""Prometheus metrics of the control plane (one registry per process, served at /metrics).

Counters count events of this process; a sum over the API and ingest replicas is the fleet's
total. The gauges here read figures shared by every replica (the stream's lag, the dead-letter
stream's length), so a query takes their `max by` over replicas, never the sum.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from exitplane.kit.build import register_process_metrics

registry = CollectorRegistry()
register_process_metrics(registry)  # the API's and the ingest worker's /metrics

ingested_records = Counter("exitplane_ingested_records", "Token records stored",
                           ["deployment"], registry=registry)
ingested_batches = Counter("exitplane_ingested_batches", "Telemetry batches accepted",
                           ["deployment"], registry=registry)
duplicate_batches = Counter("exitplane_duplicate_batches", "Replayed batches acknowledged",
                            ["deployment"], registry=registry)
rejected_batches = Counter("exitplane_rejected_batches", "Telemetry batches refused",
                           ["reason"], registry=registry)
queued_batches = Counter("exitplane_queued_batches", "Batches appended to the Redis stream",
                         ["deployment"], registry=registry)
# Traffic segments: tokens whose segment was past the deployment's cap, stored as
# `default` (a name kept out is logged once per process; this counts every token of it).
segment_overflow_tokens = Counter(
    "exitplane_segment_overflow_tokens",
    "Tokens stored as segment default because their segment was past the deployment's cap",
    ["deployment"], registry=registry)
# Stream entries the ingest worker could not read or store (moved to the dead-letter stream,
# with the reason in its `error` field), and what that stream holds now (every worker reads
# the same length from Redis).
dead_lettered_batches = Counter("exitplane_dead_lettered_batches",
                                "Telemetry stream entries moved to the dead-letter stream",
                                ["deployment"], registry=registry)
dead_letter_entries = Gauge("exitplane_dead_letter_entries",
                            "Entries in the telemetry dead-letter stream", registry=registry)
# The consumer group's figure (entries not yet delivered plus delivered and not acknowledged),
# the same whichever ingest replica reads it.
stream_lag = Gauge("exitplane_stream_lag_entries",
                   "Stream entries not yet ingested by the consumer group (group-wide)",
                   ["deployment"], registry=registry)
# What tokens cost, counted as their batches are stored (controlplane/telemetry/savings.py
# turns them into time saved): tokens that reported their cost, their wall time, and the layer
# computations non-shadow tokens skipped by exiting early.
tokens_timed = Counter("exitplane_tokens_timed", "Tokens stored with their cost (exit_checks)",
                       ["deployment"], registry=registry)
token_wall_seconds = Counter("exitplane_token_wall_seconds",
                             "Wall time of the tokens stored with their cost, seconds",
                             ["deployment"], registry=registry)
layers_saved = Counter("exitplane_layers_saved",
                       "Layer computations tokens skipped by exiting before full depth",
                       ["deployment"], registry=registry)
# The fleet view (per-runtime applied version, spool, drops, and the exit-behaviour gauges) is
# read from the store at scrape time: controlplane/telemetry/gauges.py.

# The names `refused` (controlplane/telemetry/api.py) counts a telemetry batch under: the
# DomainError class that refused it. Their series exist at 0 from the start.
REJECT_REASONS = ("Invalid", "BadRecord", "BatchTooLarge", "UnsupportedBatchType",
                  "DecodersBusy", "NotFound", "Forbidden", "Unavailable")
_PER_DEPLOYMENT = (ingested_records, ingested_batches, duplicate_batches, queued_batches,
                   segment_overflow_tokens, dead_lettered_batches, tokens_timed,
                   token_wall_seconds, layers_saved)
for _reason in REJECT_REASONS:
    rejected_batches.labels(_reason)
_primed: set[str] = set()


def count_costs(deployment: str, *, timed: int, wall_us: int, layers: int) -> None:
    """Count what a stored batch's tokens cost (`IngestResult`'s cost figures)."""
    tokens_timed.labels(deployment).inc(timed)
    token_wall_seconds.labels(deployment).inc(wall_us / 1e6)
    layers_saved.labels(deployment).inc(layers)


def prime(*, deployments: Iterable[str]) -> None:
    """Create every per-deployment counter's series at 0 for `deployments` (once each), so that
    the first batch of a deployment is an increase a rate() sees, not the series' first
    sample."""
    for name in deployments:
        if name not in _primed:
            for counter in _PER_DEPLOYMENT:
                counter.labels(name)
            _primed.add(name)
