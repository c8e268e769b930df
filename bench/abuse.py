"""Abuse benchmark: an honest fleet on the production topology while one token, or one anonymous
client, tries to exhaust the control plane.

The topology and the honest fleet are bench/fleet.py's (`Topology`: PostgreSQL, a private
Redis, two API processes, the ingest worker, a Celery worker and beat; `Fleet`: simulated
runtimes with the real client's aggregation and codec, interval batches, long-polls and
heartbeats, one runtime token each). With the fleet running, the honest pull latency is
measured first without abuse (fleet.py's pull probe, a process of its own), then each abuse
pattern runs for `--seconds` in a process of its own, at the rate one client reaches from one
machine, while the probe measures the pulls again:

- `segment_names` (a leaked runtime token): aggregate batches of 10,000 cells, each cell with a
  segment name never seen before, two at a time.
- `signin_flood` (anonymous): UI sign-ins with random user names, 40 at a time.
- `signin_one_user` (anonymous): wrong passwords for one real user, 30 at a time.
- `slow_bodies` (anonymous): 20 connections declaring 16 MiB telemetry bodies, sending 15 MiB
  and holding on, again and again.
- `decode_amplification` (a runtime token): 14 MiB msgpack batches of tiny values (bench/
  telemetry_bounds.py's), 8 at a time.
- `heavy_reads` (a runtime token): telemetry reads of the fleet's deployment, 8 at a time.
- `nested_json` (anonymous, and a runtime token): deeply nested JSON bodies on heartbeats and
  telemetry.
- `runtime_ids` (a leaked runtime token): heartbeats from new runtime ids, 4 at a time.

Then the fleet stops, everything is flushed and counted. Prints the command, one JSON line per
pattern on stderr, then one JSON line with: `honest_lost` (tokens the honest fleet generated
minus tokens stored; null when the stream did not drain), `errors_5xx` (5xx answered to anyone,
from the APIs' own request metrics), `max_rss_growth_mib` (the largest growth of an API or
ingest process's resident memory, process tree included, during a pattern over its level when
the pattern began), `worst_pull_p99_ratio` (the honest pull p99 under the worst pattern over
the p99 without abuse), and per pattern the figures behind them.

    . var/services/env  # EXITPLANE_BENCH_POSTGRES_URL
    .venv/bin/python bench/abuse.py --runtimes 200 --seconds 60
    .venv/bin/python bench/abuse.py --runtimes 20 --seconds 10 --patterns heavy_reads

Targets: honest_lost == 0, errors_5xx == 0, max_rss_growth_mib <= 64,
worst_pull_p99_ratio <= 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgpack
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet import (  # noqa: E402
    EXIT_LAYERS,
    NUM_LAYERS,
    Fleet,
    Topology,
    make_tokens,
    pull_probe,
)
from bench.signin_flood import CSRF_FIELD  # noqa: E402
from bench.telemetry_bounds import MIB, expanding_batch, unauth_slow_bodies  # noqa: E402
from exitplane.wire import AGGREGATE_MSGPACK, HISTOGRAM_BINS  # noqa: E402

PATTERNS = ("segment_names", "signin_flood", "signin_one_user", "slow_bodies",
            "decode_amplification", "heavy_reads", "nested_json", "runtime_ids")
USER, PASSWORD = "ops", "a real password, long enough 42"


# -- the attacks (each in a process of its own: `--attack SPEC`) -------------------------------

def _until(deadline: float, workers: int, act) -> Counter:
    """Run `act(client, index)` on `workers` threads until `deadline`; the answers' statuses."""
    answers: Counter = Counter()
    lock = threading.Lock()

    def worker(index: int) -> None:
        with httpx.Client(timeout=120) as client:
            count = 0
            while time.monotonic() < deadline:
                try:
                    status = act(client, index * 1_000_000 + count)
                except httpx.HTTPError as error:
                    status = type(error).__name__
                count += 1
                with lock:
                    answers[str(status)] += 1

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(worker, range(workers)))
    return answers


def _segment_batch(index: int) -> bytes:
    minute = int(time.time()) // 60 * 60
    cells = [{"minute": minute, "threshold_version": 2, "layer": NUM_LAYERS,
              "segment": f"s{index:x}-{k:x}-{secrets.token_hex(3)}", "exits": 0,
              "histogram": [0] * HISTOGRAM_BINS} for k in range(10_000)]
    return msgpack.packb({"batch_id": uuid.uuid4().hex, "deployment": "fleet",
                          "runtime_id": "leaked", "seq": index, "num_layers": NUM_LAYERS,
                          "raw_sample_rate": 0.0, "cells": cells}, use_bin_type=True)


def _nested(depth: int = 30_000) -> bytes:
    """A JSON body nested `depth` deep: within the 64 KiB limit of a heartbeat's body."""
    return b'{"runtime_id": ' + b"[" * depth + b"]" * depth + b"}"


def attack(spec: dict) -> dict:
    """One pattern against the APIs for `spec["seconds"]`; the statuses it was answered."""
    urls, pattern = spec["urls"], spec["pattern"]
    deadline = time.monotonic() + spec["seconds"]
    fleet_auth = {"Authorization": f"Bearer {spec['fleet_token']}"}
    chat_auth = {"Authorization": f"Bearer {spec['chat_token']}"}

    def url(index: int, path: str) -> str:
        return urls[index % len(urls)] + path

    if pattern == "segment_names":
        return _until(deadline, 2, lambda c, i: c.post(
            url(i, "/v1/telemetry"), content=_segment_batch(i),
            headers={**fleet_auth, "Content-Type": AGGREGATE_MSGPACK}).status_code)
    if pattern in ("signin_flood", "signin_one_user"):
        one_user = pattern == "signin_one_user"

        def sign_in(client: httpx.Client, i: int):
            form = client.get(url(i, "/ui/login"))
            match = CSRF_FIELD.search(form.text)
            return client.post(url(i, "/ui/login"), data={
                "username": USER if one_user else f"nobody-{secrets.token_hex(6)}",
                "password": "not the password", "csrf_token": match.group(1) if match else ""}
            ).status_code
        return _until(deadline, 30 if one_user else 40, sign_in)
    if pattern == "slow_bodies":
        answers: Counter = Counter()
        index = 0
        while time.monotonic() < deadline:
            port = int(urls[index % len(urls)].rsplit(":", 1)[1])
            answers.update(str(status) for status in unauth_slow_bodies(
                SimpleNamespace(port=port)))
            index += 1
        return answers
    if pattern == "decode_amplification":
        body = expanding_batch(14 * MIB)
        return _until(deadline, 8, lambda c, i: c.post(
            url(i, "/v1/telemetry"), content=body,
            headers={**chat_auth, "Content-Type": "application/msgpack"}).status_code)
    if pattern == "heavy_reads":
        paths = ["/v1/deployments/fleet/telemetry/count",
                 "/v1/deployments/fleet/telemetry/exit-rates",
                 "/v1/deployments/fleet/telemetry/signal-histogram",
                 "/v1/deployments/fleet/telemetry/disagreement"]
        return _until(deadline, 8, lambda c, i: c.get(
            url(i, paths[i % len(paths)]), headers=fleet_auth).status_code)
    if pattern == "nested_json":
        body = _nested()
        targets = [("/v1/deployments/fleet/heartbeats", {}),
                   ("/v1/deployments/fleet/heartbeats", fleet_auth),
                   ("/v1/telemetry", fleet_auth)]
        return _until(deadline, 4, lambda c, i: c.post(
            url(i, targets[i % 3][0]), content=body,
            headers={**targets[i % 3][1], "Content-Type": "application/json"}).status_code)
    if pattern == "runtime_ids":
        return _until(deadline, 4, lambda c, i: c.post(
            url(i, "/v1/deployments/fleet/heartbeats"), headers=fleet_auth,
            json={"runtime_id": f"fake-{i}-{secrets.token_hex(4)}"}).status_code)
    raise SystemExit(f"unknown pattern {pattern!r}")


# -- what the control plane's processes show ---------------------------------------------------

class Memory:
    """Resident memory of the API and ingest processes (each with its children), sampled
    every 0.2 s; the peak of each since `mark()`."""

    def __init__(self, topology: Topology) -> None:
        self.processes = {name: psutil.Process(process.pid)
                          for name, process in zip(topology.names, topology.processes,
                                                   strict=True)
                          if name.startswith(("api", "ingest"))}
        self.start, self.peak = self.now(), self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def now(self) -> dict[str, float]:
        rss = {}
        for name, process in self.processes.items():
            try:
                tree = [process, *process.children(recursive=True)]
                rss[name] = sum(p.memory_info().rss for p in tree) / MIB
            except psutil.Error:
                rss[name] = 0.0
        return rss

    def mark(self) -> None:
        self.start = self.now()
        self.peak = dict(self.start)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            for name, rss in self.now().items():
                self.peak[name] = max(self.peak.get(name, 0.0), rss)

    def growth(self) -> dict[str, float]:
        return {name: round(self.peak[name] - self.start[name], 1) for name in self.start}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def answered_5xx(urls: list[str]) -> Counter:
    """5xx answers each API counted so far (its request metrics), by status and route."""
    found: Counter = Counter()
    for base in urls:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            if family.name != "exitplane_http_request_duration_seconds":
                continue
            for sample in family.samples:
                status = sample.labels.get("status", "")
                if sample.name.endswith("_count") and status.startswith("5"):
                    found[f"{status} {sample.labels.get('route')}"] += int(sample.value)
    return found


# -- the run -----------------------------------------------------------------------------------

async def _pattern(name: str, spec: dict, fleet: Fleet, memory: Memory, seconds: float) -> dict:
    """Run one pattern (or none: `name` None) for `seconds` with the pull probe alongside."""
    before_5xx = await asyncio.to_thread(answered_5xx, spec["urls"])
    retries = fleet.errors
    memory.mark()
    attacker = None
    if name is not None:
        attacker = await asyncio.create_subprocess_exec(
            sys.executable, "-P", __file__, "--attack",
            json.dumps({**spec, "pattern": name, "seconds": seconds}),
            stdout=asyncio.subprocess.PIPE)
    probe = await pull_probe(fleet, pulls=100_000, budget_s=max(5.0, seconds - 5.0))
    answers = {}
    if attacker is not None:
        out, _ = await attacker.communicate()
        answers = json.loads(out.decode().strip().splitlines()[-1])
    await asyncio.sleep(2.0)  # what the pattern left behind, once it stopped
    after_5xx = await asyncio.to_thread(answered_5xx, spec["urls"])
    return {"pattern": name or "none", "pull_p99_ms": probe["pull_p99_ms"],
            "pull_p50_ms": probe["pull_p50_ms"], "probe_errors": probe["errors"],
            "answers": answers, "errors_5xx": dict(after_5xx - before_5xx),
            "rss_growth_mib": memory.growth(),
            "rss_after_mib": {k: round(v, 1) for k, v in memory.now().items()},
            "honest_send_retries": fleet.errors - retries}


async def run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="exitplane-abuse-"))
    topology = Topology(args.postgres_url, workdir, drift_interval_s=30.0)
    memory = None
    try:
        admin = {"Authorization": "Bearer " + topology.exitplane(
            "bootstrap", "token", "--name", "bench", "--scope", "admin")}
        password = workdir / "password"
        password.write_text(PASSWORD)
        topology.exitplane("bootstrap", "user", "--username", USER, "--role", "admin",
                           "--password-file", str(password))
        etag = None
        # `fleet` is the honest fleet's; `chat` (bench/telemetry_bounds.py's batches name it)
        # is another deployment whose token sends the oversized batches.
        for name, layers, exits in (("fleet", NUM_LAYERS, EXIT_LAYERS), ("chat", 12, [3, 6, 9])):
            httpx.post(f"{topology.urls[0]}/v1/deployments", headers=admin, timeout=30, json={
                "name": name, "model_ref": "bench", "num_layers": layers,
                "exit_layers": exits, "delta": 0.01}).raise_for_status()
            published = httpx.post(
                f"{topology.urls[0]}/v1/deployments/{name}/threshold-sets", headers=admin,
                timeout=30, json={"thresholds": {str(k): 0.9 for k in exits},
                                  "reason": "bench", "activate": True})
            published.raise_for_status()
            etag = etag or published.json()["checksum"]
        honest = make_tokens(topology, "fleet", args.runtimes + 1)
        spec = {"urls": topology.urls, "fleet_token": make_tokens(topology, "fleet", 1)[0],
                "chat_token": make_tokens(topology, "chat", 1)[0]}
        fleet = Fleet(topology, "fleet", honest[:-1], aggregate=True,
                      rate=args.tokens_per_runtime, ship_interval_s=args.ship_interval_s,
                      raw_sample_rate=0.01, shadow_rate=0.01, heartbeat_s=15.0, version=2,
                      etag=etag)
        await fleet.start()
        await fleet.grow(args.runtimes)
        await asyncio.sleep(args.settle_s)
        memory = Memory(topology)
        results = []
        for name in [None, *args.patterns]:
            result = await _pattern(name, spec, fleet, memory, args.seconds)
            print(json.dumps(result), file=sys.stderr, flush=True)
            results.append(result)
        # Can an honest runtime still join the fleet after all that?
        joined = httpx.post(f"{topology.urls[0]}/v1/deployments/fleet/heartbeats", timeout=30,
                            headers={"Authorization": f"Bearer {honest[-1]}"},
                            json={"runtime_id": "late-joiner"}).status_code
        flushed = await fleet.flush(180)
        drained = await topology.drained("fleet", fleet.generated, 600)
        await asyncio.sleep(2.0)
        counted = topology.counted("fleet")
        await fleet.close()
        baseline, patterns = results[0], results[1:]
        ratios = {r["pattern"]: round(r["pull_p99_ms"] / max(baseline["pull_p99_ms"], 0.1), 2)
                  for r in patterns}
        growth = {r["pattern"]: max(r["rss_growth_mib"].values()) for r in results}
        errors = sum(sum(r["errors_5xx"].values()) for r in results)
        return {
            "honest_lost": fleet.generated - counted if flushed and drained else None,
            "errors_5xx": errors,
            "max_rss_growth_mib": max(growth.values()),
            "worst_pull_p99_ratio": max(ratios.values(), default=None),
            "targets_missed": [target for target, missed in (
                ("honest_lost", fleet.generated - counted != 0 or not (flushed and drained)),
                ("errors_5xx", errors != 0), ("max_rss_growth_mib", max(growth.values()) > 64),
                ("worst_pull_p99_ratio", max(ratios.values(), default=0) > 3)) if missed],
            "pull_p99_ratio": ratios, "rss_growth_mib": growth,
            "errors_5xx_by_pattern": {r["pattern"]: r["errors_5xx"] for r in results
                                      if r["errors_5xx"]},
            "baseline_pull_p99_ms": baseline["pull_p99_ms"],
            "late_runtime_joined": joined,
            "generated": fleet.generated, "counted": counted,
            "runtimes": args.runtimes, "seconds": args.seconds,
            "tokens_per_runtime_per_s": args.tokens_per_runtime,
            "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
            "patterns": results,
        }
    finally:
        if memory is not None:
            memory.close()
        topology.close()
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=os.environ.get("EXITPLANE_BENCH_POSTGRES_URL"))
    parser.add_argument("--runtimes", type=int, default=200, help="honest simulated runtimes")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="how long each pattern (and the baseline) runs")
    parser.add_argument("--patterns", default=",".join(PATTERNS),
                        help=f"comma-separated, of: {', '.join(PATTERNS)}")
    parser.add_argument("--tokens-per-runtime", type=float, default=200.0,
                        help="tokens per second each honest runtime generates")
    parser.add_argument("--ship-interval-s", type=float, default=5.0)
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="fleet running before the baseline is taken")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--attack", help=argparse.SUPPRESS)  # an attacker process
    args = parser.parse_args()
    if args.attack:
        print(json.dumps(attack(json.loads(args.attack))), flush=True)
        return 0
    if not args.postgres_url:
        parser.error("give --postgres-url or set EXITPLANE_BENCH_POSTGRES_URL "
                     "(. var/services/env)")
    args.patterns = [name for name in args.patterns.split(",") if name]
    unknown = set(args.patterns) - set(PATTERNS)
    if unknown:
        parser.error(f"unknown patterns: {', '.join(sorted(unknown))}")
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
