"""Telemetry batches as runtimes send them: token records (shadow tokens among them, segments),
the batch around them, aggregate batches of per-minute cells, and their encodings on the wire
(JSON or msgpack)."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Sequence

import msgpack

from exitplane.wire import INTERVAL_MSGPACK
from tests.support.deployments import FULL, LAYERS


def telemetry_batch(records: list[dict], *, deployment: str = "chat", runtime_id: str = "rt-1",
                    seq: int = 0, num_layers: int = FULL, batch_id: str | None = None,
                    **fields) -> dict:
    """A record batch carrying `records` (a new batch id unless `batch_id`); `fields`: more of
    the wire's batch fields (lineage, `aggregated`, ...)."""
    return {"batch_id": batch_id or uuid.uuid4().hex, "deployment": deployment,
            "runtime_id": runtime_id, "seq": seq, "num_layers": num_layers,
            "records": records, **fields}


def aggregate_batch(cells: list[dict], *, deployment: str = "chat", runtime_id: str = "rt-1",
                    seq: int = 0, num_layers: int = FULL, raw_sample_rate: float = 0.0,
                    **fields) -> dict:
    """An aggregate batch of per-minute `cells`, under a new batch id."""
    return {"batch_id": uuid.uuid4().hex, "deployment": deployment, "runtime_id": runtime_id,
            "seq": seq, "num_layers": num_layers, "raw_sample_rate": raw_sample_rate,
            "cells": cells, **fields}


def shadow_points(rng: random.Random, layers: Sequence[int] = LAYERS) -> list[dict]:
    """A shadow token's points: a random signal at each exit layer, matching full depth 80% of
    the time."""
    return [{"layer": k, "signal": rng.random(), "matched": rng.random() < 0.8} for k in layers]


def token_records(rng: random.Random, n: int = 50, *, version: int | Sequence[int] = (0, 2),
                  requests: int = 5, spacing_s: float = 0.7, latency_us: int | None = None,
                  segments: Sequence[str] | None = None, shadow_rate: float = 0.3,
                  ts: float | None = None) -> list[dict]:
    """`n` token records of random exits and signals, `spacing_s` apart from `ts` (now), over
    `requests` requests; `version`: the threshold version each names, or versions to draw
    from; `latency_us`: random (100 to 5000) unless given; `segments`: cycled through,
    `default` left off the wire as a runtime leaves it; a `shadow_rate` share are shadow
    tokens (full depth, a point at each exit layer)."""
    now = ts or time.time()
    records = []
    for i in range(n):
        exit_layer = rng.choice([*LAYERS, FULL])
        record = {"threshold_version": version if isinstance(version, int)
                  else rng.choice(version),
                  "request_id": f"r{i % requests}", "position": i, "exit_layer": exit_layer,
                  "signal_value": rng.random(),
                  "latency_us": rng.randint(100, 5000) if latency_us is None else latency_us,
                  "ts": now + i * spacing_s}
        if segments is not None:
            segment = segments[i % len(segments)]
            if segment != "default":
                record["segment"] = segment
        if rng.random() < shadow_rate:
            record["exit_layer"] = FULL
            record["shadow"] = shadow_points(rng)
        records.append(record)
    return records


def random_batch(rng: random.Random, n: int = 50, deployment: str = "chat", seq: int = 0,
                 shadow_rate: float = 0.3, runtime_id: str = "rt-1",
                 ts: float | None = None) -> dict:
    """A record batch of `n` random token records (`token_records`'s defaults)."""
    return telemetry_batch(token_records(rng, n, shadow_rate=shadow_rate, ts=ts),
                           deployment=deployment, runtime_id=runtime_id, seq=seq)


def segment_records(rng: random.Random, n: int, segments=("default", "chat", "code"),
                    shadow_rate: float = 0.3, ts: float | None = None) -> list[dict]:
    """`n` token records at version 2 spread over `segments`, over 7 requests."""
    return token_records(rng, n, version=2, requests=7, spacing_s=0.9, latency_us=100,
                         segments=segments, shadow_rate=shadow_rate, ts=ts)


def encode_batch(payload: dict, content_type: str) -> bytes:
    """`payload` encoded as `content_type` says: msgpack for the msgpack types, else JSON."""
    return msgpack.packb(payload) if "msgpack" in content_type else json.dumps(payload).encode()


def post_telemetry(client, headers, payload: dict, content_type: str = INTERVAL_MSGPACK):
    """POST `payload` to /v1/telemetry encoded as `content_type`."""
    return client.post("/v1/telemetry", content=encode_batch(payload, content_type),
                       headers={**headers, "Content-Type": content_type})


def segment_of(record: dict) -> str:
    """The segment a token record belongs to (`default` when it names none)."""
    return record.get("segment", "default")


def expected_exits(records: list[dict]) -> dict[tuple[str, int], tuple[int, int]]:
    """(segment, layer) -> (tokens that reached it, tokens that exited there), recounted."""
    out = {}
    for segment in {segment_of(record) for record in records}:
        mine = [record for record in records if segment_of(record) == segment]
        for layer in [*LAYERS, FULL]:
            out[(segment, layer)] = (sum(r["exit_layer"] >= layer for r in mine),
                                     sum(r["exit_layer"] == layer for r in mine))
    return out
