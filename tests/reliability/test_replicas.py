"""Two API processes (`exitplane up`, as compose runs the api service) over one PostgreSQL
database behave as one: a revoked token gets 401 from both, a token's rate limit is one bucket,
a long-poll held on one wakes when the alias moves through the other (or in a worker), and
/metrics shows the same runtime gauges. With Redis the notices travel by pub/sub; without it
a revocation still reaches every process through the revocation epoch in the database."""

from __future__ import annotations

import itertools
import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.db import make_engine
from tests.support.processes import EXITPLANE, ROOT, Processes, start_api
from tests.support.redis import PrivateRedis
from tests.support.services import migrated_postgres_database
from tests.support.waiting import wait_until

# slow: API replicas as processes
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.postgres]

# The caches are made long on purpose: only a notice (pub/sub or the epoch) can explain a
# prompt 401 or wake-up, never an expiry.
LONG_CACHE_S = "30"
METRICS_TOKEN = "metrics-" + secrets.token_urlsafe(16)
PULL_PER_S = 5.0
_NAMES = itertools.count(1)  # deployments of this module share one store


@pytest.fixture(scope="module")
def database():
    with migrated_postgres_database("exitplane_replicas_") as url:
        yield url


@dataclass
class Replicas:
    """API processes `a` and `b` over one store, and an admin token."""

    a: str
    b: str
    admin: str
    env: dict

    def call(self, base: str, method: str, path: str, token: str, **kwargs) -> httpx.Response:
        return httpx.request(method, base + path, timeout=30,
                             headers={"Authorization": f"Bearer {token}",
                                      **kwargs.pop("headers", {})}, **kwargs)

    def deployment(self) -> str:
        name = f"chat{next(_NAMES)}"
        response = self.call(self.a, "POST", "/v1/deployments", self.admin, json={
            "name": name, "model_ref": "m", "num_layers": 12, "exit_layers": [3, 6, 9]})
        assert response.status_code == 201, response.text
        return name

    def runtime_token(self, deployment: str) -> tuple[int, str]:
        created = self.call(self.a, "POST", "/v1/tokens", self.admin, json={
            "name": f"rt-{deployment}", "scope": "runtime", "deployment": deployment})
        assert created.status_code == 201, created.text
        return created.json()["id"], created.json()["token"]


def _replicas(database: str, tmp_path: Path, redis_url: str, **settings: str):
    env = {**os.environ, "PATH": f"{Path(EXITPLANE).parent}:{os.environ['PATH']}",
           "EXITPLANE_ENVIRONMENT": "production", "EXITPLANE_DATABASE_URL": database,
           "EXITPLANE_REDIS_URL": redis_url, "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48),
           "EXITPLANE_VAR_DIR": str(tmp_path / "var"), "EXITPLANE_LOG_LEVEL": "warning",
           "EXITPLANE_TOKEN_CACHE_TTL_S": LONG_CACHE_S,
           **{f"EXITPLANE_{key.upper()}": value for key, value in settings.items()}}
    processes = Processes(env, tmp_path)
    try:
        a, b = start_api(processes, "api-a"), start_api(processes, "api-b")
        with Session(make_engine(database)) as session:
            _, admin = create_token(session=session, name=f"admin-{tmp_path.name}", scope="admin")
            session.commit()
        yield Replicas(a=a, b=b, admin=admin, env=env)
    finally:
        processes.close()


@pytest.fixture(scope="module")
def with_redis(database, tmp_path_factory):
    redis_server = PrivateRedis()
    redis_server.start()
    try:
        yield from _replicas(database, tmp_path_factory.mktemp("with-redis"), redis_server.url,
                             config_cache_ttl_s=LONG_CACHE_S, rate_limit_pull_per_s=str(PULL_PER_S),
                             # refusals answered at once: the bucket test alternates replicas
                             rate_limit_hold_s="0",
                             metrics_token=METRICS_TOKEN, metrics_cache_ttl_s="0.2")
    finally:
        redis_server.cleanup()


@pytest.fixture(scope="module")
def without_redis(database, tmp_path_factory):
    yield from _replicas(database, tmp_path_factory.mktemp("without-redis"), "",
                         revocation_poll_s="0.5")


class Poller:
    """A runtime polling one API process every 0.5 s with its current ETag (the 304 fast path),
    recording (monotonic time, status) of each answer."""

    def __init__(self, replicas: Replicas, base: str, deployment: str, token: str) -> None:
        self.url = f"{base}/v1/deployments/{deployment}/thresholds?runtime_id=rt-poll"
        self.token, self.answers = token, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        etag = None
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                headers = {"Authorization": f"Bearer {self.token}"}
                if etag:
                    headers["If-None-Match"] = etag
                response = client.get(self.url, headers=headers)
                etag = response.headers.get("etag", etag)
                self.answers.append((time.monotonic(), response.status_code))
                self._stop.wait(0.5)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def first_401_after(self, moment: float) -> float | None:
        return next((t for t, status in self.answers if t >= moment and status == 401), None)


def _revocation_holds(replicas: Replicas, bound_s: float) -> None:
    deployment = replicas.deployment()
    token_id, token = replicas.runtime_token(deployment)
    pollers = [Poller(replicas, base, deployment, token).start()
               for base in (replicas.a, replicas.b)]
    try:
        wait_until(lambda: all(sum(s in (200, 304) for _, s in p.answers) >= 3
                               for p in pollers), 30, "both processes to serve the token")
        revoked_at = time.monotonic()
        revoked = replicas.call(replicas.a, "DELETE", f"/v1/tokens/{token_id}", replicas.admin)
        assert revoked.status_code == 200, revoked.text
        wait_until(lambda: all(p.first_401_after(revoked_at) for p in pollers), bound_s + 10,
                   "both processes to refuse the revoked token")
        time.sleep(1.5)  # a few more polls: once refused, never served again
    finally:
        for poller in pollers:
            poller.stop()
    for poller in pollers:
        first = poller.first_401_after(revoked_at)
        assert first - revoked_at <= bound_s, f"{poller.url}: 401 only after " \
                                              f"{first - revoked_at:.2f} s"
        assert all(status == 401 for t, status in poller.answers if t >= first)
        assert any(status == 304 for t, status in poller.answers if t < revoked_at)


def test_a_revoked_token_is_refused_by_every_process_with_redis(with_redis):
    # Pub/sub reaches the other process within milliseconds; one poll interval on top.
    _revocation_holds(with_redis, bound_s=1.5)


def test_a_revoked_token_is_refused_by_every_process_without_redis(without_redis):
    # The revocation epoch is polled every 0.5 s; one poll interval on top.
    _revocation_holds(without_redis, bound_s=2.0)


def test_a_tokens_rate_limit_is_one_bucket_whichever_process_answers(with_redis):
    replicas = with_redis
    deployment = replicas.deployment()
    _, token = replicas.runtime_token(deployment)
    statuses: dict[str, list[int]] = {replicas.a: [], replicas.b: []}
    retry_after = []
    started = time.monotonic()
    for index in range(40):
        base = (replicas.a, replicas.b)[index % 2]
        response = replicas.call(base, "GET", f"/v1/deployments/{deployment}/thresholds",
                                 token, params={"runtime_id": "rt-limit"})
        statuses[base].append(response.status_code)
        if response.status_code == 429:
            retry_after.append(response.headers.get("retry-after"))
    elapsed = time.monotonic() - started
    allowed = sum(status == 200 for answers in statuses.values() for status in answers)
    # One bucket: a burst of 2 x rate plus what refilled meanwhile; two per-process buckets
    # would let through twice the burst.
    assert allowed <= 2 * PULL_PER_S + PULL_PER_S * elapsed + 1, (allowed, elapsed)
    assert 429 in statuses[replicas.a] and 429 in statuses[replicas.b]
    assert all(value and int(value) >= 1 for value in retry_after)


def _long_poll(replicas: Replicas, base: str, deployment: str, token: str, etag: str,
               out: list) -> threading.Thread:
    def run() -> None:
        response = replicas.call(base, "GET", f"/v1/deployments/{deployment}/thresholds", token,
                                 params={"runtime_id": "rt-wait", "wait": 20},
                                 headers={"If-None-Match": etag})
        out.append((time.monotonic(), response.status_code, response.headers.get("etag")))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_long_poll_wakes_when_the_alias_moves_in_another_process(with_redis):
    replicas = with_redis
    deployment = replicas.deployment()
    _, token = replicas.runtime_token(deployment)
    first = replicas.call(replicas.a, "GET", f"/v1/deployments/{deployment}/thresholds", token,
                          params={"runtime_id": "rt-wait"})
    etag = first.headers["etag"]
    answers: list = []
    waiting = _long_poll(replicas, replicas.a, deployment, token, etag, answers)
    time.sleep(1.0)  # the poll is parked on process A
    assert not answers
    moved_at = time.monotonic()
    published = replicas.call(replicas.b, "POST", f"/v1/deployments/{deployment}/threshold-sets",
                              replicas.admin, json={"thresholds": {"3": 0.9, "6": 0.9, "9": 0.9},
                                                    "reason": "tuned", "activate": True})
    assert published.status_code == 201, published.text
    waiting.join(timeout=25)
    [(returned_at, status, new_etag)] = answers
    assert status == 200 and new_etag != etag
    assert returned_at - moved_at < 2.0  # the wait was 20 s and the caches 30 s


def test_a_move_made_by_a_worker_wakes_every_waiting_poll(with_redis):
    replicas = with_redis
    deployment = replicas.deployment()
    _, token = replicas.runtime_token(deployment)
    assert replicas.call(replicas.a, "POST", f"/v1/deployments/{deployment}/threshold-sets",
                         replicas.admin, json={"thresholds": {"3": 0.8, "6": 0.8, "9": 0.8},
                                               "reason": "v2", "activate": True}
                         ).status_code == 201
    etag = replicas.call(replicas.b, "GET", f"/v1/deployments/{deployment}/thresholds", token,
                         params={"runtime_id": "rt-wait"}).headers["etag"]
    answers: list = []
    waiting = [_long_poll(replicas, base, deployment, token, etag, answers)
               for base in (replicas.a, replicas.b)]
    time.sleep(1.0)
    moved_at = time.monotonic()
    # What the fallback task does, in a process of its own with the workers' environment.
    subprocess.run([sys.executable, "-c", (
        "from sqlalchemy.orm import Session\n"
        "from controlplane.db import make_engine\n"
        "from controlplane.settings import get_settings\n"
        "from controlplane.deployments import service\n"
        "with Session(make_engine(get_settings().database_url)) as session:\n"
        f"    d = service.get_deployment(session=session, name='{deployment}', lock=True)\n"
        "    service.move_alias(session=session, deployment=d, alias='active', version=1,\n"
        "                       actor='worker', reason='fallback', action='alias.fallback')\n"
        "    session.commit()\n")], cwd=ROOT, env=replicas.env, check=True, timeout=60)
    for thread in waiting:
        thread.join(timeout=25)
    assert len(answers) == 2
    for returned_at, status, new_etag in answers:
        assert status == 200 and new_etag != etag
        assert returned_at - moved_at < 5.0  # includes the worker's own start-up


def test_runtime_gauges_are_the_same_from_every_process(with_redis):
    replicas = with_redis
    deployment = replicas.deployment()
    _, token = replicas.runtime_token(deployment)
    beat = replicas.call(replicas.a, "POST", f"/v1/deployments/{deployment}/heartbeats", token,
                         json={"runtime_id": "rt-gauge", "applied_version": 1,
                               "spooled_batches": 3, "dropped_records": 7})
    assert beat.status_code == 200, beat.text
    for base in (replicas.a, replicas.b):
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 401

    def series(base: str) -> list[str]:
        body = httpx.get(f"{base}/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
        return sorted(line for line in body.splitlines()
                      if f'deployment="{deployment}"' in line and "runtime=" in line
                      and "last_seen" not in line)

    def same() -> list[str] | None:
        a, b = series(replicas.a), series(replicas.b)
        return a if a and a == b else None

    lines = wait_until(same, 10, "both processes to show the same runtime gauges")
    assert (f'exitplane_fleet_runtime_spooled_batches{{deployment="{deployment}",'
            f'runtime="rt-gauge"}} 3.0') in lines
    assert (f'exitplane_fleet_runtime_dropped_records_total{{deployment="{deployment}",'
            f'runtime="rt-gauge"}} 7.0') in lines
