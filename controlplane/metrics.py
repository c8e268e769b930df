"""Prometheus metrics of the control plane (one registry per process, served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from exitplane.build import register_build_info

registry = CollectorRegistry()
register_build_info(registry)  # the API's and the ingest worker's /metrics

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
stream_lag = Gauge("exitplane_stream_lag_entries", "Stream entries not yet ingested",
                   ["deployment"], registry=registry)
# Runtime gauges (applied version, spool, drops) are read from the store at scrape time:
# controlplane/alerts/exporter.py, so every API process shows the same series.
