"""Per-step cost of a decode step's row plan: the per-segment threshold rows a
policy derives once (`RowPlan.build` gathers them) against deriving them at every step, as
the engine did before (a map look-up, a served-layer set and two arrays per distinct segment,
then np.stack over rows). Host-side only; the model is not loaded.

    .venv/bin/python -P bench/row_plan.py --batch 32 --segments 4 --exit-layers 14

Prints the command, then one JSON line: microseconds per step for each, and whether both
give the same plan.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import timeit

import numpy as np

from exitplane.wire import NEVER_EXIT, Signal
from runtime.policy import ExitPolicy, RowPlan


def per_step_derivation(policy: ExitPolicy, segments: list[str],
                        shadow: list[bool]) -> tuple[np.ndarray, np.ndarray, frozenset[int]]:
    """The plan and checked layers as a step derived them before the policy kept its rows."""
    layers = policy.layers
    by_segment = {}
    for name in set(segments):
        by_layer = policy.for_segment(name)
        live = frozenset(k for k, t in by_layer.items() if t < NEVER_EXIT)
        limit = np.array([by_layer.get(k, NEVER_EXIT) for k in layers], dtype=np.float32)
        by_segment[name] = (limit, np.array([k in live for k in layers], dtype=bool), live)
    limits = np.stack([by_segment[name][0] for name in segments])
    counted = np.stack([by_segment[name][1] if by_segment[name][1].any()
                        else np.full(len(layers), bool(row_shadow))
                        for name, row_shadow in zip(segments, shadow, strict=True)])
    checked = frozenset(layers) if any(shadow) else frozenset().union(
        *(by_segment[name][2] for name in set(segments)))
    return limits, counted, checked


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench/row_plan.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--segments", type=int, default=4,
                        help="distinct segments, default included")
    parser.add_argument("--exit-layers", type=int, default=14)
    parser.add_argument("--shadow-rate", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()
    rng = random.Random(0)
    layers = list(range(2, 2 + 2 * args.exit_layers, 2))
    names = [f"s{i}" for i in range(args.segments - 1)]
    policy = ExitPolicy(version=1, signal=Signal.learned,
                        thresholds={k: 0.9 for k in layers},
                        segments={name: {k: rng.choice([0.7, 0.8, 1.0]) for k in layers}
                                  for name in names})
    segments = [rng.choice(["default", *names]) for _ in range(args.batch)]
    shadow = [rng.random() < args.shadow_rate for _ in segments]

    def cached_step() -> tuple:
        plan = RowPlan.build(policy, segments, shadow)
        return plan, policy.checked_layers(shadow=any(shadow), segments=segments)

    plan, checked = cached_step()
    limits, counted, checked_before = per_step_derivation(policy, segments, shadow)
    same = (np.array_equal(plan.limits, limits) and np.array_equal(plan.counted, counted)
            and checked == checked_before)
    timings = {}
    for name, step in (("per_policy_us", cached_step),
                       ("per_step_us", lambda: per_step_derivation(policy, segments, shadow))):
        timings[name] = round(min(timeit.repeat(step, number=args.steps, repeat=3))
                              / args.steps * 1e6, 2)
    print("command:", " ".join([sys.executable, "-P", *sys.argv]))
    print(json.dumps({"batch": args.batch, "segments": args.segments,
                      "exit_layers": args.exit_layers, "shadow_rate": args.shadow_rate,
                      **timings, "speedup": round(timings["per_step_us"]
                                                  / timings["per_policy_us"], 2),
                      "same_plan": same}))


if __name__ == "__main__":
    main()
