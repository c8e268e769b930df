"""Debian's real Prometheus scrapes a running production stack (API, ingest worker, Celery worker
on PostgreSQL and Redis, and a runtime server on the tiny model, each its own process) with the
alert rules loaded, and every metric the Grafana dashboard and the rules read has samples."""

from __future__ import annotations

import json
import os
import re
import secrets
import time

import httpx
import pytest
import redis
import yaml
from sqlalchemy.orm import Session

from controlplane.db import make_engine
from tests.support.batches import telemetry_batch
from tests.support.network import free_port
from tests.support.processes import (
    EXITPLANE,
    PROMETHEUS,
    ROOT,
    RULES,
    answers,
    print_tails,
    provision_chat,
    spawn,
    start_prometheus,
    stop_processes,
)
from tests.support.services import POSTGRES_URL, REDIS_URL, empty_postgres
from tests.support.waiting import wait_until

# slow: a real Prometheus scraping real processes
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis, pytest.mark.integration]

DASHBOARD = ROOT / "dashboards" / "grafana" / "exitplane.json"


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


def _referenced() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
             for t in p.get("targets", [])]
    exprs += [rule["expr"] for rule in _rules()]
    return {name for expr in exprs for name in re.findall(r"\bexitplane_[a-z0-9_]+", expr)}


def _query(prometheus: str, expr: str) -> list:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    return answer["data"]["result"] if answer.get("status") == "success" else []


def _batch(seq: int) -> dict:
    return telemetry_batch([{"threshold_version": 1, "request_id": "r", "position": i,
                             "exit_layer": 6, "signal_value": 0.5, "latency_us": 100,
                             "ts": time.time()} for i in range(3)],
                           runtime_id="rt-replayed", seq=seq, num_layers=6)


def test_prometheus_finds_every_metric_the_dashboard_and_rules_read(postgres_migrated,
                                                                     tmp_path):
    if not (POSTGRES_URL and REDIS_URL) or not os.path.exists(PROMETHEUS):
        raise RuntimeError("needs PostgreSQL, Redis and Debian's prometheus package")
    empty_postgres(postgres_migrated)
    redis_url = REDIS_URL.rsplit("/", 1)[0] + "/13"  # a database of this test's own
    redis.Redis.from_url(redis_url).flushdb()
    ports = {name: free_port() for name in ("api", "ingest", "worker", "runtime", "prometheus")}
    api = f"http://127.0.0.1:{ports['api']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXITPLANE_LOG")}
    env.update({"EXITPLANE_ENVIRONMENT": "production", "EXITPLANE_DATABASE_URL": postgres_migrated,
                "EXITPLANE_REDIS_URL": redis_url,
                "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48),
                "EXITPLANE_VAR_DIR": str(tmp_path / "var"), "EXITPLANE_PUBLIC_URL": api,
                "EXITPLANE_ACCESS_LOG": "0"})
    token_file, admin = provision_chat(env, tmp_path)
    commands = {
        "api": ["up", "--port", str(ports["api"]), "--no-migrate", "--no-workers"],
        "ingest": ["ingest"], "worker": ["worker"],
        "runtime": ["runtime", "serve", "--model", "tiny", "--deployment", "chat",
                    "--control-plane", api, "--token-file", str(token_file), "--state-dir",
                    str(tmp_path / "runtime"), "--port", str(ports["runtime"]),
                    "--shadow-rate", "0.5", "--shadow-request-rate", "0.5"]}
    processes = []
    try:
        for name, args in commands.items():
            processes.append(spawn([EXITPLANE, *args], out=tmp_path / f"{name}.log", env={
                **env, "EXITPLANE_WORKER_METRICS_PORT": str(ports[name])}))
        wait_until(lambda: answers(f"{api}/readyz"), 120, "the API")
        ops = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {admin}"},
                           timeout=30)
        assert ops.post("/v1/deployments/chat/threshold-sets", json={
            "thresholds": {"2": 0.1, "4": 0.1}, "reason": "exits", "activate": True}
        ).status_code == 201
        runtime = f"http://127.0.0.1:{ports['runtime']}"
        wait_until(lambda: answers(f"{runtime}/readyz"), 120, "the runtime")
        for prompt in ("abc", "hello", "xyz!", "0123"):
            httpx.post(f"{runtime}/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
                "temperature": 0}).raise_for_status()  # greedy: shadow requests may be drawn
        # A refused batch and a replayed one, as a broken or retrying runtime would send.
        shipper = httpx.Client(base_url=api, timeout=30, headers={
            "Authorization": f"Bearer {token_file.read_text().strip()}"})
        assert shipper.post("/v1/telemetry", json={"records": "nope"}).status_code == 422
        replayed = _batch(0)
        for _ in range(2):
            assert shipper.post("/v1/telemetry", json=replayed).status_code == 202
        ops.post("/v1/deployments/chat/calibrations", json={"reason": "a worker task"})
        _open_alert(postgres_migrated)
        _code_segment_traffic(postgres_migrated)

        prometheus = f"http://127.0.0.1:{ports['prometheus']}"
        processes.append(start_prometheus(tmp_path, ports["prometheus"], [
            {"job_name": name, "static_configs": [{"targets": [f"127.0.0.1:{ports[name]}"]}]}
            for name in ("api", "ingest", "worker", "runtime")]))
        wait_until(lambda: answers(f"{prometheus}/-/ready"), 60, "Prometheus")
        wait_until(lambda: len(_query(prometheus, 'up == 1')) == 4, 60, "four healthy targets")

        referenced = _referenced()
        assert len(referenced) >= 25

        def missing() -> set[str]:
            return {name for name in referenced if not _query(prometheus, f"count({name})")}

        still = missing()
        deadline = time.monotonic() + 90
        while still and time.monotonic() < deadline:
            time.sleep(2)
            still = missing()
        assert still == set(), f"no samples for {sorted(still)}"
        # segment="" is stored as no label: the whole deployment's series carry no segment
        # label; the code segment and default have series of their own.
        whole = _query(prometheus, 'exitplane_exit_rate{deployment="chat",segment=""}')
        assert whole and all("segment" not in r["metric"] for r in whole), whole
        for segment in ("code", "default"):
            wait_until(lambda segment=segment: _query(
                prometheus, f'exitplane_exit_rate{{deployment="chat",segment="{segment}"}}'),
                60, f"the {segment} segment's exit rate")
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        assert len(rules) == len(_rules()) and all(rule["health"] == "ok" for rule in rules), \
            rules
    finally:
        stop_processes(processes)
        print_tails(tmp_path.glob("*.log"), 3000)


def _open_alert(url: str) -> None:
    """An open alert in the store (drift detection would take minutes of traffic)."""
    from controlplane.alerts.service import Condition, fire
    from controlplane.deployments.service import get_deployment

    engine = make_engine(url)
    with Session(engine) as session:
        fire(session=session, deployment=get_deployment(session=session, name="chat"),
             condition=Condition(kind="distribution_drift", severity="warning",
                                 summary="signal distribution moved", subject="2", layer=2))
        session.commit()
    engine.dispose()


def _code_segment_traffic(url: str) -> None:
    """`chat` learns the code segment, and a minute of code rollups under the active version
    (written through the ORM: seg-ingest's write path stores posted traffic's segment)."""
    from controlplane.db import utcnow
    from controlplane.deployments.segments import admit_segments
    from controlplane.deployments.service import aliases_of, get_deployment
    from controlplane.telemetry.models import Rollup

    engine = make_engine(url)
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        admit_segments(session=session, deployment_id=deployment.id, names=["code"], auto=True)
        minute = utcnow().replace(second=0, microsecond=0)
        active = aliases_of(session=session, deployment=deployment)["active"]
        for layer, tokens, exits in ((2, 50, 5), (4, 45, 5), (6, 40, 40)):
            session.add(Rollup(deployment_id=deployment.id, version=active, runtime_id="rt-x",
                               minute=minute, segment="code", layer=layer, tokens=tokens,
                               exits=exits))
        session.commit()
    engine.dispose()
