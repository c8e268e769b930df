"""The Grafana dashboard and the alert rules read the right values from a replicated production
topology: two API processes, two ingest workers (Redis mode), two Celery workers and beat on
PostgreSQL and Redis, with six simulated runtimes (tests/observability/simulated_runtime.py, each
its own process running the real threshold client and shipper), scraped by Debian's Prometheus
with one job per workload as the Kubernetes manifests declare them. Each dashboard query is read
from exitplane.json, its variables substituted as Grafana does, evaluated through Prometheus'
HTTP API and compared with the truth: what the runtimes sent, the store, and Redis.

The topology makes the replica mistakes visible: every API replica exports the same fleet view
and every ingest replica the same stream lag, so a query that sums or counts raw series reads
twice the truth (asserted too, so the test would see a dashboard that does)."""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.db import make_engine
from controlplane.runtimes.models import Runtime
from controlplane.telemetry.models import Rollup
from controlplane.telemetry.stream import GROUP, STREAM_PREFIX, STREAMS_KEY
from tests.support.network import free_port
from tests.support.processes import (
    EXITPLANE,
    PROMETHEUS,
    ROOT,
    answers,
    print_tails,
    spawn,
    start_prometheus,
    stop_processes,
)
from tests.support.services import REDIS_URL, migrated_postgres_database
from tests.support.simulated_runtime import EXIT_LAYERS, NUM_LAYERS, pattern
from tests.support.waiting import wait_until

# slow: twelve processes and a Prometheus
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis, pytest.mark.integration]

DASHBOARD = ROOT / "dashboards" / "grafana" / "exitplane.json"
MANIFESTS = ROOT / "deploy" / "k8s"

THRESHOLD = 0.5  # both exit layers, the active set (v2)
DELTA = 0.3
IN_SYNC, BEHIND = 4, 2  # runtimes applying v2; runtimes refusing it (on their built-in set)
TOKENS = 400  # per runtime in sync
GHOSTS = 7  # stream entries a vanished consumer holds: the consumer group's lag
LONG_POLL_S = 4.5
PULL = "/v1/deployments/{name}/thresholds"
# Grafana's values for the dashboard's variables: All deployments, a rate window that spans
# several of this test's 1 s scrapes.
VARIABLES = {"$deployment": ".*", "$__rate_interval": "1m"}


class Prometheus:
    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, expr: str) -> list[dict]:
        answer = httpx.get(f"{self.base}/api/v1/query", params={"query": expr},
                           timeout=10).json()
        assert answer.get("status") == "success", (expr, answer)
        return answer["data"]["result"]

    def values(self, expr: str, *labels: str) -> dict[tuple, float]:
        """{(label values...): value} of an instant query."""
        return {tuple(r["metric"].get(label, "") for label in labels): float(r["value"][1])
                for r in self.query(expr)}


def panel_queries(title: str) -> list[str]:
    """The panel's queries from exitplane.json, with the variables substituted."""
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title]
    assert len(panels) == 1, f"one panel titled {title!r}"
    queries = []
    for target in panels[0]["targets"]:
        expr = target["expr"]
        for name, value in VARIABLES.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, expr
        queries.append(expr)
    return queries


def deployment_variable_metric() -> str:
    variable = next(v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]
                    if v["name"] == "deployment")
    definition = variable["definition"]
    assert definition.startswith("label_values(") and definition.endswith(", deployment)")
    return definition.removeprefix("label_values(").removesuffix(", deployment)")


def scrape_jobs() -> dict[str, str]:
    """Workload -> the port its pods declare for Prometheus, from the Kubernetes manifests:
    the `prometheus.io/port` annotation of the pod template, or its container port named
    `metrics` (a PodMonitor scrapes that one)."""
    jobs = {}
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "Deployment":
                continue
            template = doc["spec"]["template"]
            component = template["metadata"]["labels"].get("app.kubernetes.io/component")
            annotations = template["metadata"].get("annotations") or {}
            ports = {port.get("name"): port["containerPort"]
                     for container in template["spec"]["containers"]
                     for port in container.get("ports") or []}
            if annotations.get("prometheus.io/scrape") == "true":
                jobs[component] = str(annotations.get("prometheus.io/port"))
            elif "metrics" in ports:
                jobs[component] = str(ports["metrics"])
    return jobs


def truth_exit_behaviour() -> tuple[dict[int, float], float]:
    """Exit rate per exit layer and the shadow disagreement of what the runtimes in sync sent
    (every one the same pattern), computed here from the pattern itself."""
    tokens = {layer: 0 for layer in EXIT_LAYERS}
    exits = dict(tokens)
    shadow = mismatches = 0
    for position in range(TOKENS):
        exit_layer, _, points = pattern(position)
        for layer in EXIT_LAYERS:
            tokens[layer] += exit_layer >= layer
            exits[layer] += exit_layer == layer
        if points:
            shadow += 1
            first = next((p for p in points if p.signal >= THRESHOLD), None)
            mismatches += first is not None and not first.matched
    return {layer: exits[layer] / tokens[layer] for layer in EXIT_LAYERS}, mismatches / shadow


def test_dashboard_and_rules_read_the_truth_from_a_replicated_topology(tmp_path):
    if not REDIS_URL or not os.path.exists(PROMETHEUS):
        raise RuntimeError("needs PostgreSQL, Redis and Debian's prometheus package")
    declared = scrape_jobs()
    assert {"api", "ingest", "worker"} <= set(declared), \
        f"deploy/k8s declares metrics for {sorted(declared)} only"
    started = time.monotonic()
    with migrated_postgres_database("exitplane_topology_") as database:
        print(f"migrated in {time.monotonic() - started:.0f} s")
        _run(tmp_path, database)


def _run(tmp_path: Path, database: str) -> None:
    redis_url = REDIS_URL.rsplit("/", 1)[0] + "/11"  # a database of this test's own
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    # A consumer that read entries and vanished: they stay pending (the ingest workers are told
    # to reclaim only after an hour), so the group's lag is GHOSTS, the same for every replica.
    stream = STREAM_PREFIX + "chat"
    r.sadd(STREAMS_KEY, stream)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for i in range(GHOSTS):
        r.xadd(stream, {"ghost": str(i)})
    r.xreadgroup(GROUP, "vanished", {stream: ">"}, count=GHOSTS)

    engine = make_engine(database)
    with Session(engine) as session:
        _, admin = create_token(session=session, name="ops", scope="admin")
        session.commit()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXITPLANE_")}
    env.update({"EXITPLANE_ENVIRONMENT": "production", "EXITPLANE_DATABASE_URL": database,
                "EXITPLANE_REDIS_URL": redis_url, "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48),
                "EXITPLANE_VAR_DIR": str(tmp_path / "var"), "EXITPLANE_LOG_LEVEL": "warning",
                "EXITPLANE_ACCESS_LOG": "0", "EXITPLANE_METRICS_CACHE_TTL_S": "1"})
    ports = {name: free_port() for name in ("api-a", "api-b", "ingest-a", "ingest-b",
                                            "worker-a", "worker-b", "beat-a", "prometheus")}
    commands = {
        **{name: ["up", "--host", "127.0.0.1", "--port", str(ports[name]), "--no-migrate",
                  "--no-workers"] for name in ("api-a", "api-b")},
        **{name: ["ingest", "--name", name, "--claim-idle-ms", "3600000"]
           for name in ("ingest-a", "ingest-b")},
        **{name: ["worker"] for name in ("worker-a", "worker-b")}, "beat-a": ["beat"]}
    processes: list[subprocess.Popen] = []
    t0 = time.monotonic()
    try:
        for name, args in commands.items():
            processes.append(spawn([EXITPLANE, *args], out=tmp_path / f"{name}.log", env={
                **env, "EXITPLANE_WORKER_METRICS_PORT": str(ports[name])}))
        # One job per workload, named exitplane-<component> as alerts.yml expects.
        processes.append(start_prometheus(tmp_path, ports["prometheus"], [
            {"job_name": f"exitplane-{workload}", "static_configs": [{
                "targets": [f"127.0.0.1:{port}" for name, port in ports.items()
                            if name.startswith(f"{workload}-")]}]}
            for workload in ("api", "ingest", "worker", "beat")], env=env))
        apis = [f"http://127.0.0.1:{ports[name]}" for name in ("api-a", "api-b")]
        for api in apis:
            wait_until(lambda api=api: answers(f"{api}/readyz"), 120, f"{api} to be ready")
        print(f"APIs ready in {time.monotonic() - t0:.0f} s")
        ops = httpx.Client(base_url=apis[0], timeout=30,
                           headers={"Authorization": f"Bearer {admin}"})
        assert ops.post("/v1/deployments", json={
            "name": "chat", "model_ref": "m", "num_layers": NUM_LAYERS,
            "exit_layers": EXIT_LAYERS, "signal": "maxprob", "delta": DELTA}).status_code == 201
        assert ops.post("/v1/deployments/chat/threshold-sets", json={
            "thresholds": dict.fromkeys(map(str, EXIT_LAYERS), THRESHOLD), "reason": "exits",
            "activate": True}).json()["version"] == 2
        created = ops.post("/v1/tokens", json={"name": "rt", "scope": "runtime",
                                               "deployment": "chat"})
        token_file = tmp_path / "runtime.token"
        token_file.write_text(created.json()["token"])

        runtimes = {f"rt-{i}": i >= IN_SYNC for i in range(IN_SYNC + BEHIND)}  # id -> behind
        for i, (runtime_id, behind) in enumerate(runtimes.items()):
            processes.append(spawn(
                [sys.executable, "-m", "tests.support.simulated_runtime",
                 "--api", apis[i % 2], "--token-file", str(token_file),
                 "--runtime-id", runtime_id, "--state-dir", str(tmp_path / runtime_id),
                 "--tokens", str(TOKENS), "--long-poll-s", str(LONG_POLL_S),
                 *(["--refuse-above", "1"] if behind else [])],
                out=tmp_path / f"{runtime_id}.log", env=env))
        sent = {runtime_id: wait_until(
            lambda runtime_id=runtime_id: _read_json(tmp_path / runtime_id / "sent.json"),
            120, f"{runtime_id} to send its telemetry") for runtime_id in runtimes}
        print(f"runtimes sent by {time.monotonic() - t0:.0f} s")
        assert [s["version"] for s in sent.values()] == [2] * IN_SYNC + [0] * BEHIND, sent
        assert sum(s["tokens"] for s in sent.values()) == IN_SYNC * TOKENS

        # The truth, from the store and Redis: every record stored, every runtime seen.
        def stored() -> int:
            with Session(engine) as session:
                return session.scalar(select(func.coalesce(func.sum(Rollup.tokens), 0)).where(
                    Rollup.layer == EXIT_LAYERS[0], Rollup.version == 2))

        wait_until(lambda: stored() == IN_SYNC * TOKENS, 90, "the ingest workers to store all")
        with Session(engine) as session:
            wait_until(lambda: session.scalar(select(func.count()).select_from(Runtime)) ==
                       len(runtimes), 30, "every runtime's heartbeat")

        def group_lag() -> int:  # entries not delivered yet, plus delivered and not acknowledged
            group = next(g for g in r.xinfo_groups(stream) if g["name"].decode() == GROUP)
            return (group.get("lag") or 0) + group["pending"]

        # A worker acknowledges the entries it read once their transaction committed.
        wait_until(lambda: group_lag() == GHOSTS, 30, "the stream to hold only the ghosts")
        lag_truth = group_lag()
        exit_truth, disagreement_truth = truth_exit_behaviour()
        print(f"stored by {time.monotonic() - t0:.0f} s")

        # Non-waiting pulls with a current ETag (304), timed from here, through both replicas.
        auth = {"Authorization": f"Bearer {created.json()['token']}"}
        etag = httpx.get(f"{apis[0]}/v1/deployments/chat/thresholds",
                         params={"runtime_id": "probe"}, headers=auth).headers["etag"]
        probe = []
        pullers = [httpx.Client(base_url=api, headers={**auth, "If-None-Match": etag})
                   for api in apis]  # kept alive, as a runtime's connection is
        # Prometheus scrapes both replicas' 304 series before the timed pulls, so the rate
        # window holds samples from before and after them.
        prometheus = Prometheus(f"http://127.0.0.1:{ports['prometheus']}")
        wait_until(lambda: len(prometheus.query("up == 1")) == 7, 60, "seven healthy targets")
        for puller in pullers:
            assert puller.get("/v1/deployments/chat/thresholds",
                              params={"runtime_id": "probe"}).status_code == 304
        pull_count = ('exitplane_http_request_duration_seconds_count'
                      f'{{route="{PULL}",status="304"}}')
        wait_until(lambda: len(prometheus.query(pull_count)) == 2, 30,
                   "the 304 series of both API replicas to be scraped")
        for i in range(60):
            started = time.perf_counter()
            answer = pullers[i % 2].get("/v1/deployments/chat/thresholds",
                                        params={"runtime_id": "probe"})
            probe.append(time.perf_counter() - started)
            assert answer.status_code == 304
        for puller in pullers:
            puller.close()
        probe_p95 = sorted(probe)[int(0.95 * len(probe)) - 1]

        truth = {"Stream lag": lag_truth, "Runtimes behind": BEHIND,
                 **{f"Exit rate layer {layer}": rate for layer, rate in exit_truth.items()},
                 "Disagreement": disagreement_truth, "δ": DELTA,
                 "Applied version series": len(runtimes)}

        def dashboard() -> dict[str, float]:
            [lag] = panel_queries("Stream lag")
            [behind] = panel_queries("Runtimes behind")
            [exit_rate] = panel_queries("Exit rate by layer")
            disagreement, delta = panel_queries("Shadow disagreement vs δ")
            [applied] = panel_queries("Applied threshold version")
            shown = {"Stream lag": sum(prometheus.values(lag).values()),
                     "Runtimes behind": sum(prometheus.values(behind).values()),
                     "Disagreement": prometheus.values(disagreement, "deployment").get(
                         ("chat",), math.nan),
                     "δ": prometheus.values(delta, "deployment").get(("chat",), math.nan),
                     "Applied version series": len(prometheus.values(applied, "deployment",
                                                                     "runtime"))}
            rates = prometheus.values(exit_rate, "layer")
            for layer in EXIT_LAYERS:
                shown[f"Exit rate layer {layer}"] = rates.get((str(layer),), math.nan)
            return shown

        deadline = time.monotonic() + 30  # the fleet view is cached a second, scraped each
        while True:
            shown = dashboard()
            right = all(math.isclose(shown[key], value, rel_tol=1e-9)
                        for key, value in truth.items())
            if right or time.monotonic() > deadline:
                break
            time.sleep(1)
        report = {key: {"dashboard": shown[key], "truth": value} for key, value in truth.items()}
        assert right, {key: shown_truth for key, shown_truth in report.items()
                       if not math.isclose(shown_truth["dashboard"], shown_truth["truth"],
                                           rel_tol=1e-9)}

        # The pull route's latency leaves the long-poll waits out; the waits have their own.
        [latency] = panel_queries("API latency by route (p95, long-poll waits excluded)")

        def shown_pull_p95() -> float | None:
            """None while the rate window holds no increase (the quantile is NaN)."""
            value = prometheus.values(latency, "route", "status").get((PULL, "304"), math.nan)
            return None if math.isnan(value) else value

        pull_p95 = wait_until(shown_pull_p95, 30, "the 304 pulls in the pull latency panel")

        def shown_waits() -> tuple[float, float] | None:
            """(p50, p95) of the waits, None while the rate window holds no finished wait."""
            values = [prometheus.values(q).get((), math.nan)
                      for q in panel_queries("Threshold long-poll wait")]
            return None if any(math.isnan(v) for v in values) else tuple(values)

        wait_p50, wait_p95 = wait_until(shown_waits, 30, "finished waits in the wait panel")
        report["Pull p95 (304)"] = {"dashboard": pull_p95, "truth": probe_p95}
        report["Long-poll wait p95"] = {"dashboard": wait_p95, "truth": LONG_POLL_S}
        print(json.dumps(report, indent=1, ensure_ascii=False))
        # Read from buckets (interpolated within one) on a shared machine: the p95 is the
        # API's answer time, an order below the waits (all of which it would read with them).
        assert pull_p95 < LONG_POLL_S / 10, report
        # The waits sit in the bucket of 4.5 s, (2.5, 5], or the next for one woken late.
        assert 2.5 < wait_p50 <= wait_p95 <= 10.0, report

        # The same figures summed over the raw series (one per replica) read double: the
        # topology does exercise the replicas.
        assert prometheus.values("sum(exitplane_stream_lag_entries)")[()] == 2 * GHOSTS
        assert prometheus.values("count(exitplane_fleet_runtime_behind_active == 1)")[()] == \
            2 * BEHIND

        # $deployment reads a metric every API replica exports, and only the API.
        variable = deployment_variable_metric()
        assert prometheus.values(f"count by (job, deployment) ({variable})", "job",
                                 "deployment") == {("exitplane-api", "chat"): 2.0}
        # Every process exports its process and build-info collectors.
        for family in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                       "exitplane_build_info", "python_info"):
            assert prometheus.values(f"count by (job) ({family})", "job") == {
                ("exitplane-api",): 2.0, ("exitplane-ingest",): 2.0,
                ("exitplane-worker",): 2.0, ("exitplane-beat",): 1.0}, family

        # The rules load and evaluate; the old-version rule names each runtime behind once.
        groups = httpx.get(f"{prometheus.base}/api/v1/rules", timeout=10).json()["data"]
        rules = [rule for group in groups["groups"] for rule in group["rules"]]
        assert rules and all(rule["health"] == "ok" for rule in rules), rules
        behind_rule = next(rule for rule in rules if rule["name"] == "ExitplaneRuntimeOnOldVersion")
        named = prometheus.values(behind_rule["query"], "deployment", "runtime")
        assert sorted(named) == [("chat", rid) for rid, behind in runtimes.items() if behind]
        lag_rule = next(rule for rule in rules if rule["name"] == "ExitplaneStreamLagHigh")
        assert prometheus.values(lag_rule["query"].replace("> 1000", ">= 0"), "deployment") == \
            {("chat",): GHOSTS}
    finally:
        stop_processes(processes)
        engine.dispose()
        r.flushdb()
        print_tails(sorted(tmp_path.glob("*.log")), 3000, failed_only=True)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
