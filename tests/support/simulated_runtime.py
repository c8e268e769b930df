"""A simulated runtime, run as its own process by the replica-topology test: the real threshold
client and telemetry shipper (`exitplane.client`) around an engine stand-in that generates a
fixed mix of token records, so the test knows the exit rates and the disagreement the dashboard
must show.

    python -m tests.observability.simulated_runtime --api URL --token-file F --runtime-id ID \
        --state-dir DIR --tokens 400 [--refuse-above 1]

With `--refuse-above V` the engine refuses every set of a version above V (as a runtime whose
exit heads do not fit the new set would): it serves its built-in set and the fleet view counts
it behind. Writes `<state-dir>/sent.json` (what it sent, under which version) once its records
are handed to the shipper and delivered, then keeps pulling and heartbeating until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
import uuid
from pathlib import Path

from exitplane.client.shipper import TelemetryShipper
from exitplane.client.thresholds import ThresholdClient
from exitplane.wire import ShadowPoint, ThresholdSetWire, TokenRecord

NUM_LAYERS = 6
EXIT_LAYERS = [2, 4]


def pattern(position: int) -> tuple[int, float | None, list[ShadowPoint] | None]:
    """(exit layer, signal, shadow points) of token `position`: per 20 tokens, 6 leave at layer
    2, 4 at layer 4, 6 run to full depth, and 4 are shadow tokens (full depth, labelled at both
    exit layers) of which one would have left at layer 2 with another answer (thresholds 0.5)."""
    i = position % 20
    if i < 6:
        return 2, 0.9, None
    if i < 10:
        return 4, 0.8, None
    if i < 16:
        return NUM_LAYERS, 0.2, None
    shadows = {16: ((0.9, False), (0.9, True)),   # would leave at 2: a different answer
               17: ((0.9, True), (0.9, True)),    # would leave at 2: the same answer
               18: ((0.1, False), (0.7, True)),   # would leave at 4: the same answer
               19: ((0.1, False), (0.1, False))}  # would run to full depth
    points = [ShadowPoint(layer=layer, signal=signal, matched=matched)
              for layer, (signal, matched) in zip(EXIT_LAYERS, shadows[i], strict=True)]
    return NUM_LAYERS, 0.1, points


class Engine:
    """What the threshold client drives: exit layers and a threshold swap, refusing versions
    above `refuse_above` when set."""

    exit_layers = EXIT_LAYERS

    def __init__(self, refuse_above: int | None) -> None:
        self.refuse_above = refuse_above
        self.applied: ThresholdSetWire | None = None

    def set_thresholds(self, threshold_set: ThresholdSetWire) -> None:
        if self.refuse_above is not None and threshold_set.version > self.refuse_above:
            raise ValueError(f"these exit heads do not fit set v{threshold_set.version}")
        self.applied = threshold_set


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", required=True)
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--deployment", default="chat")
    parser.add_argument("--runtime-id", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--refuse-above", type=int, default=None)
    parser.add_argument("--long-poll-s", type=float, default=4.5)
    args = parser.parse_args()
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    token = Path(args.token_file).read_text().strip()
    shipper = TelemetryShipper(base_url=args.api, token=token, deployment=args.deployment,
                               runtime_id=args.runtime_id, num_layers=NUM_LAYERS,
                               spool_dir=state / "spool", batch_records=50,
                               batch_interval_s=0.2, fsync=False).start()
    engine = Engine(args.refuse_above)
    client = ThresholdClient(engine, base_url=args.api, deployment=args.deployment, token=token,
                             runtime_id=args.runtime_id, cache_path=state / "thresholds.json",
                             long_poll_s=args.long_poll_s, heartbeat_interval_s=args.long_poll_s,
                             backoff_initial_s=1.0, backoff_max_s=5.0,
                             telemetry=shipper).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client.wait_ready(60)
    sent = 0
    version = client.applied_version or 0
    if not client.degraded:  # a runtime on its built-in set sends nothing here
        request = uuid.uuid4().hex
        for position in range(args.tokens):
            exit_layer, signal_value, shadow = pattern(position)
            shipper.submit(TokenRecord(threshold_version=version, request_id=request,
                                       position=position, exit_layer=exit_layer,
                                       signal_value=signal_value, latency_us=100,
                                       ts=time.time(), shadow=shadow))
            sent += 1
        shipper.flush(60)
    (state / "sent.json").write_text(json.dumps({
        "runtime_id": args.runtime_id, "version": version, "tokens": sent,
        "degraded": client.degraded, "dropped": shipper.dropped_records}))
    stop.wait()
    client.stop()
    shipper.close(10)


if __name__ == "__main__":
    main()
