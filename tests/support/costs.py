"""Timed token records: what runtimes report when each token's wall time follows a known cost
model, `overhead_us + layer_us * depth + check_us * checks`, and the savings those records
add up to, recounted by hand."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tests.support.batches import shadow_points
from tests.support.deployments import FULL, LAYERS


@dataclass(frozen=True)
class KnownCost:
    overhead_us: int = 200
    layer_us: int = 30
    check_us: int = 25

    def token_us(self, depth: int, checks: int) -> int:
        return self.overhead_us + self.layer_us * depth + self.check_us * checks

    @property
    def full_depth_us(self) -> int:
        return self.overhead_us + self.layer_us * FULL


def checks_at(depth: int) -> int:
    """The exit checks a token makes on its way to `depth`: one per exit layer up to it."""
    return sum(layer <= depth for layer in LAYERS)


def timed_records(rng: random.Random, n: int, cost: KnownCost, *, version: int = 2,
                  shadow_rate: float = 0.2, exits=(*LAYERS, FULL), timed: bool = True,
                  ts: float | None = None, segment: str | None = None) -> list[dict]:
    """`n` token records a second apart ending about a minute ago, exiting at a layer drawn
    from `exits` (shadow tokens at full depth), each with its wall time under `cost` and,
    when `timed`, its exit checks."""
    start = (ts or time.time() - 60) - n
    records = []
    for i in range(n):
        shadow = rng.random() < shadow_rate
        depth = FULL if shadow else rng.choice(exits)
        record = {"threshold_version": version, "request_id": f"r{i % 7}", "position": i,
                  "exit_layer": depth, "signal_value": rng.random(),
                  "latency_us": cost.token_us(depth, checks_at(depth)), "ts": start + i}
        if timed:
            record["exit_checks"] = checks_at(depth)
        if shadow:
            record["shadow"] = shadow_points(rng)
        if segment is not None:
            record["segment"] = segment
        records.append(record)
    return records


def expected_savings(records: list[dict], cost: KnownCost) -> dict[str, float]:
    """Seconds at full depth, spent and net saved, and the layers saved, of `records`."""
    full = len(records) * cost.full_depth_us / 1e6
    spent = sum(record["latency_us"] for record in records) / 1e6
    layers = sum(FULL - record["exit_layer"] for record in records if not record.get("shadow"))
    return {"full_depth_s": full, "spent_s": spent, "net_saved_s": full - spent,
            "layers_saved": layers}
