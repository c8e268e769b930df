"""The production topology as separate processes, each started with the command docker-compose.yml
gives it (api migrating first, the bootstrap one-shot creating the deployment and the runtime's
token, the heads one-shot provisioning exit heads, ingest, worker, beat, runtime server on the
tiny model), over a fresh PostgreSQL database and a Redis: the loop closes with nobody calling a
function in process; the deployment and the runtime's token come from compose's own steps. Traffic
shifts, the workers detect the quality regression and fall back, the alert's
recalibration waits for shadow samples of the new traffic and publishes, and the runtime
applies the new version and exits early again within δ."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from sqlalchemy import text
from sqlalchemy.engine import make_url

from controlplane.db import make_engine
from controlplane.stats.clustered import clopper_pearson
from tests.support.network import free_port
from tests.support.processes import EXITPLANE, ROOT, Processes
from tests.support.services import POSTGRES_URL
from tests.support.waiting import patient_get, wait_until

# slow: every service as its own process
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.postgres]

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DELTA = 0.2
DOMAINS = {"A": " !\"#$%&'(", "B": "abcdefghijklmnopqrstuvwxyz"}


@pytest.fixture
def fresh_database():
    """An empty PostgreSQL database: the api service's own `exitplane db upgrade` builds it."""
    if not POSTGRES_URL:
        raise RuntimeError("this test needs PostgreSQL: run `make test`")
    base = make_url(POSTGRES_URL)
    name = f"exitplane_topology_{os.getpid()}_{int(time.time())}"
    admin = make_engine(base.set(database="postgres").render_as_string(hide_password=False))
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    yield base.set(database=name).render_as_string(hide_password=False)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


# The compose variables an operator of the tiny model would set (compose interpolates them).
TINY = {"EXITPLANE_MODEL_REF": "tiny-llama", "EXITPLANE_NUM_LAYERS": "6",
        "EXITPLANE_EXIT_LAYERS": "2,4",
        "EXITPLANE_SIGNAL": "maxprob", "EXITPLANE_DELTA": str(DELTA), "EXITPLANE_EPSILON": "0.1"}


def _interpolate(word: str, variables: dict[str, str]) -> str:
    """Compose's ${NAME:-default}: the variable when set and not empty, else the default."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: variables.get(m[1]) or m[2], word)


def _command(service: str, replacements: dict[str, str],
             variables: dict[str, str] | None = None) -> list[str]:
    """The service's compose command with hosts, ports and paths of this machine."""
    command = COMPOSE["services"][service]["command"]
    out = []
    for word in command:
        word = _interpolate(word, variables or {})
        for old, new in replacements.items():
            word = word.replace(old, new)
        out.append(word)
    return out


def test_the_compose_services_close_the_loop(fresh_database, private_redis, tmp_path):
    api_port, runtime_port = free_port(), free_port()
    api_url, runtime_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{runtime_port}"
    compose_env = COMPOSE["x-controlplane-env"]
    env = {**os.environ, **{key: str(value) for key, value in compose_env.items()}}
    env.update({
        "PATH": f"{Path(EXITPLANE).parent}:{os.environ['PATH']}",
        "EXITPLANE_DATABASE_URL": fresh_database, "EXITPLANE_REDIS_URL": private_redis.url,
        "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48), "EXITPLANE_PUBLIC_URL": api_url,
        "EXITPLANE_VAR_DIR": str(tmp_path / "var"), "EXITPLANE_LOG_LEVEL": "info",
        # Minutes of production cadence compressed into seconds.
        "EXITPLANE_DRIFT_INTERVAL_S": "3", "EXITPLANE_DRIFT_RECENT_S": "60",
        "EXITPLANE_CALIBRATION_MIN_SAMPLES": "300", "EXITPLANE_CALIBRATION_RETRY_S": "2"})
    token_file = tmp_path / "bootstrap" / "runtime.token"
    heads_file = tmp_path / "runtime-state" / "heads.safetensors"
    replacements = {"0.0.0.0 --port 8000": f"127.0.0.1 --port {api_port}",
                    "http://api:8000": api_url, "0.0.0.0": "127.0.0.1", "8100": str(runtime_port),
                    "/var/lib/exitplane-bootstrap": str(tmp_path / "bootstrap"),
                    "/var/lib/exitplane-runtime": str(tmp_path / "runtime-state")}
    processes = Processes(env, tmp_path)
    try:
        processes.start("api", _command("api", replacements))
        wait_until(lambda: _ready(f"{api_url}/readyz"), 120, "the api to migrate and be ready")
        started = {service: processes.start(service, _command(service, replacements))
                   for service in ("ingest", "worker", "beat")}
        # The ingest worker gives the API the CPU first (EXITPLANE_INGEST_NICE, default 10).
        own = os.getpriority(os.PRIO_PROCESS, 0)
        wait_until(lambda: os.getpriority(os.PRIO_PROCESS, started["ingest"].pid) == max(10, own),
                   60, "the ingest worker to lower its priority")
        assert os.getpriority(os.PRIO_PROCESS, started["worker"].pid) == own
        # The one-shot steps, twice: the second run of each is a no-op.
        for _ in range(2):
            _run(env, _command("bootstrap", replacements, TINY))
        assert token_file.read_text().strip()
        # The heads an operator points EXITPLANE_HEADS_FROM at (trained here, quickly).
        artifact = tmp_path / "artifact" / "heads.safetensors"
        _exitplane(env, "runtime", "provision", "--heads", str(artifact), "--model", "tiny",
                   "--stdlib-chars", "4000", "--prompts", "2", "--steps", "20")
        provisioned = [json.loads(_run({**env, "EXITPLANE_HEADS_FROM": str(artifact)}, [
            *_command("heads", replacements, TINY), "--model", "tiny"]).splitlines()[-1])
            for _ in range(2)]
        assert [p["action"] for p in provisioned] == ["copied", "kept"]
        assert heads_file.exists()

        admin = _exitplane(env, "token", "create", "--name", "ops", "--scope", "admin")
        ops = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {admin}"},
                           timeout=30)
        created = ops.get("/v1/deployments/chat").json()
        assert (created["model_ref"], created["exit_layers"]) == ("tiny-llama", [2, 4])
        # The control plane sets the runtimes' shadow rate: fixed here at the rate this story
        # needs (equal bounds), as an operator would for a fleet this small.
        assert ops.patch("/v1/deployments/chat", json={
            "shadow_rate_min": 0.75, "shadow_rate_max": 0.75}).status_code == 200
        tuned = ops.post("/v1/deployments/chat/threshold-sets", json={
            "thresholds": {"2": 0.1, "4": 0.1}, "reason": "tuned by hand for domain A",
            "activate": True}).json()["version"]
        runtime = _command("runtime", replacements)
        processes.start("runtime", [*runtime, "--model", "tiny", "--shadow-rate", "0.75",
                                    "--max-batch", "16"])
        wait_until(lambda: _ready(f"{runtime_url}/readyz"), 120, "the runtime to apply a set")
        traffic = Traffic(runtime_url)
        assert traffic.send("A", 8)["versions"] == {tuned}

        # The traffic shifts; the workers see the regression and fall back on their own.
        shifted_at = datetime.now(UTC)
        traffic.start("B")
        alert = wait_until(lambda: _alert(ops, "quality_regression"), 180,
                     "the beat-scheduled drift check to fire quality_regression")
        assert alert["deployment"] == "chat"
        audit = patient_get(ops, "/v1/deployments/chat/audit").json()
        [fallback] = [e for e in audit if e["action"] == "alias.fallback"]
        assert (fallback["alias"], fallback["to_version"]) == ("active", 1)
        assert fallback["details"]["alert_id"] == alert["id"]  # the audit names the alert
        # The alert's job waits for B's shadow samples, then publishes and promotes.
        recalibrated = wait_until(lambda: _calibrated_version(ops), 300,
                            "the recalibrated version to become active")
        wait_until(lambda: _applied(ops, recalibrated), 60, "the runtime to apply it")
        traffic.stop()
        jobs = patient_get(ops, "/v1/deployments/chat/calibrations").json()
        assert jobs[0]["trigger"] == "alert" and jobs[0]["result_version"] == recalibrated

        # Fresh B traffic on the recalibrated set: early exits again, within δ.
        since = datetime.now(UTC).replace(second=0, microsecond=0).isoformat()
        served = traffic.send("B", 48)
        assert served["versions"] == {recalibrated}
        assert served["mean_exit_layer"] < 6.0  # some tokens leave early
        with httpx.Client(base_url=api_url, timeout=30, headers={
                "Authorization": f"Bearer {token_file.read_text().strip()}"}) as runtime_api:
            wait_until(lambda: _shadow_tokens(runtime_api, since, recalibrated) >= 200, 60,
                 "the runtime's telemetry to be ingested through the stream")
            windows = patient_get(runtime_api, "/v1/deployments/chat/telemetry/disagreement",
                                  params={"since": since, "version": recalibrated}).json()
        shadow = sum(w["shadow_tokens"] for w in windows)
        wrong = sum(w["mismatches"] for w in windows)
        # The set is certified within δ; the raw rate on a few hundred shadow tokens of a set
        # calibrated close to δ lands above δ about half the time (seen: 135/589 against 0.2).
        # So the check the demo and the quality test make: fail when the tokens show
        # disagreement above δ at 99% (one-sided Clopper-Pearson lower bound; tokens cluster by
        # request, so this token-level bound is if anything too narrow). A set never
        # recalibrated for B (well above δ) still fails it.
        lower, _ = clopper_pearson(wrong / shadow, shadow, 0.01)
        assert lower <= DELTA, (wrong, shadow, lower)
        assert shifted_at < datetime.fromisoformat(alert["fired_at"])
    finally:
        processes.close()
        logs = {p.name: p.read_text()[-3000:] for p in tmp_path.glob("*.log")}
        for name, tail in logs.items():  # shown by pytest when the test failed
            print(f"--- {name} ---\n{tail}")


class Traffic:
    """OpenAI-style completion requests against the runtime server, 4 at a time."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=120)
        self.rng = np.random.default_rng(0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _one(self, domain: str) -> dict:
        prompt = "".join(self.rng.choice(list(DOMAINS[domain]), size=4))
        response = self.http.post("/v1/completions", json={
            "model": "tiny-llama", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        response.raise_for_status()
        return response.json()["exitplane"]

    def send(self, domain: str, requests: int) -> dict:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: self._one(domain), range(requests)))
        return {"versions": {a["threshold_version"] for a in answers},
                "mean_exit_layer": float(np.mean([a["mean_exit_layer"] for a in answers]))}

    def start(self, domain: str) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.send(domain, 8)
                except httpx.HTTPError:
                    if not self._stop.is_set():
                        raise

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)


def _run(env: dict, command: list[str]) -> str:
    """A one-shot service's command, which must succeed (compose's
    service_completed_successfully)."""
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout.strip()


def _exitplane(env: dict, *args: str) -> str:
    done = subprocess.run([EXITPLANE, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.strip()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _alert(ops: httpx.Client, kind: str) -> dict | None:
    alerts = patient_get(ops, "/v1/alerts", params={"deployment": "chat"}).json()
    return next((a for a in alerts if a["kind"] == kind), None)


def _calibrated_version(ops: httpx.Client) -> int | None:
    """The active version once it is a calibrated one. The one runtime is one witness, so a
    recalibration reopening exits from never-exit waits for an operator: approved here as one
    would."""
    jobs = patient_get(ops, "/v1/deployments/chat/calibrations").json()
    if jobs and jobs[0]["promotion"] == "awaiting_approval":
        ops.post(f"/v1/deployments/chat/calibrations/{jobs[0]['id']}/approve",
                 json={"reason": "the operator checked the candidate"}).raise_for_status()
    active = ops.get("/v1/deployments/chat").json()["aliases"].get("active")
    origin = ops.get(f"/v1/deployments/chat/threshold-sets/{active}").json()["origin"]
    return active if origin == "calibration" else None


def _applied(ops: httpx.Client, version: int) -> bool:
    runtimes = patient_get(ops, "/v1/deployments/chat/runtimes").json()
    return bool(runtimes) and all(r["applied_version"] == version for r in runtimes)


def _shadow_tokens(api: httpx.Client, since: str, version: int) -> int:
    windows = patient_get(api, "/v1/deployments/chat/telemetry/disagreement",
                          params={"since": since, "version": version}).json()
    return sum(w["shadow_tokens"] for w in windows)
