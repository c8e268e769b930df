"""Fleet benchmark: N simulated runtimes against the production topology.

Topology, all real processes: two API processes (`exitplane up --no-workers`, ports A and B),
the ingest worker (`exitplane ingest`), a Celery worker and beat, PostgreSQL (a database of
its own on the bench server) and a private redis-server (append-only, as compose runs it).

The runtimes are simulated in one asyncio process, but with the real client's parts: each has
an `exitplane.client.aggregate.Aggregator` fed vectorised synthetic token streams (a realistic
exit-layer mix, signal histograms per layer, 1% shadow tokens, 1% raw sample), cuts one
`IntervalBatch` per interval, as the shipper does (the counts and the shadow and sampled
records as columns; `--pair`: an `AggregateBatch` and a record batch with `aggregated: true`,
the pair an interval batch stands for) encoded by the shipper's codec
(`exitplane.client.codec`: msgpack of the wire models), POSTs them with the
protocol's content types, retries with the same batch id on 429/503/errors (in memory: no
disk spool), long-polls its threshold set with its ETag, and heartbeats, each over its own
keep-alive HTTP/1.1 connections (`LeanConnection`: plain asyncio streams, since httpx's CPU per
request, paid by one process for 1,000 runtimes, came out of the two cores the API needs).
Half the runtimes talk to API A, half to B.

Phases: the fleet ramps (runtimes x tokens/s each) stage by stage; a stage holds when, after
`--stage-s` seconds of load, the store has counted every token generated up to the stage's end
within `--drain-s` (load still on); the ramp stops at the first stage that does not hold.
The probes are taken in every stage that holds, load still on, and reported for the last one
(an overloaded stage measures its backlog, not the protocol): a probe makes non-waiting pulls
while every runtime holds a long-poll (`pull_p99_ms`), then an alias move through API A
measures how long until each runtime's long-poll returns the new version
(`propagation_p99_ms`, and the max). Each stage also splits the machine's CPU-seconds per
million tokens by component (`cpu_s_per_mtok`: the harness, each API process, the ingest
worker, Celery, Redis, the PostgreSQL backends of the bench database, and `other`, the rest of
the machine).

After the ramp the fleet goes back to the last held size (the others deliver their backlog and
stop) and 5% of the runtimes shift: their traffic moves out of domain, more tokens leave at
the first exit and their shadow tokens no longer match full depth. A 5% shift moves the
fleet-wide exit rates by ~3 points, under the exit-rate detector's 5-point minimum effect, so
that detector is not meant to catch it; the shadow disagreement of the exiting tokens rises
from ~0 to ~5% against δ = 0.01, which the quality detector (`quality_regression`, critical)
is meant to catch; the exit-layer distribution finding also pages (warning) once it persists.
`drift_alert_s` is the time to the first alert that pages (severity warning or critical; an
`info` distribution finding does not count) and `drift_alert_kind` the kinds paging then
(comma-separated: one check often opens several). The load
stops, everything is flushed, and once the telemetry stream is empty `lost` = tokens
generated - tokens in the rollups (null, with `stream_backlog`, if the store never caught up:
tokens still in the stream are late, not lost). Last,
the same topology takes today's path (every token a record, another deployment) and ramps
until it falls behind: `records_mode_tokens_per_s`.

    . var/services/env  # EXITPLANE_BENCH_POSTGRES_URL
    .venv/bin/python bench/fleet.py --steps 250,500,750,1000 --tokens-per-runtime 1000 \
        --records-steps 40,80,160 --drift-timeout-s 180

Prints the command, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controlplane.auth.service import create_token  # noqa: E402
from controlplane.db import make_engine  # noqa: E402
from controlplane.deployments.service import get_deployment  # noqa: E402
from controlplane.telemetry.stream import DEAD_LETTER, GROUP, stream_key  # noqa: E402
from exitplane.client.aggregate import Aggregator  # noqa: E402
from exitplane.client.codec import encode, encode_aggregate, encode_interval  # noqa: E402
from exitplane.wire import (  # noqa: E402
    HISTOGRAM_BINS,
    MAX_AGGREGATE_CELLS,
    OPTIONAL_RECORD_COLUMNS,
    RECORDS_MSGPACK,
    IntervalBatch,
    RecordColumns,
    TelemetryBatch,
)

EXE = str(Path(sys.executable).parent / "exitplane")
NUM_LAYERS, EXIT_LAYERS = 30, [8, 16, 24]
SLOTS = [*EXIT_LAYERS, NUM_LAYERS]
NORMAL_MIX = np.array([0.15, 0.25, 0.25, 0.35])  # exits at 8, 16, 24, full depth
SHIFTED_MIX = np.array([0.75, 0.1, 0.05, 0.1])
# Signal at exit: tokens leave where the signal is high; full-depth ones have lower signals.
_bins = np.arange(HISTOGRAM_BINS)
BIN_MIX = np.stack([np.exp(_bins / 3.0), np.exp(_bins / 3.5), np.exp(_bins / 4.0),
                    np.exp(-((_bins - 8) / 4.0) ** 2)])
BIN_MIX /= BIN_MIX.sum(axis=1, keepdims=True)


def percentile(values: list[float], q: float) -> float | None:
    return None if not values else float(np.percentile(np.array(values), q))


# -- the topology ------------------------------------------------------------------------------

class Topology:
    """PostgreSQL database, private Redis, 2 APIs, ingest worker, Celery worker and beat."""

    def __init__(self, postgres_url: str, workdir: Path, drift_interval_s: float,
                 worker_loglevel: str = "warning", ingest_nice: int | None = None) -> None:
        self.workdir = workdir
        base = make_url(postgres_url)
        self.db_name = f"exitplane_fleet_{os.getpid()}"
        self.admin = make_engine(base.set(database="postgres").render_as_string(
            hide_password=False))
        with self.admin.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}"'))
            c.execute(text(f'CREATE DATABASE "{self.db_name}"'))
        self.db_url = base.set(database=self.db_name).render_as_string(hide_password=False)
        self.redis_port = _free_port()
        self.processes: list[subprocess.Popen] = []
        self.names: list[str] = []
        self._start([shutil.which("redis-server") or "redis-server", "--port",
                     str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(workdir),
                     "--appendonly", "yes", "--save", "", "--protected-mode", "no"], "redis")
        self.env = {**os.environ, "EXITPLANE_DATABASE_URL": self.db_url,
                    "EXITPLANE_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
                    "EXITPLANE_ENVIRONMENT": "production", "EXITPLANE_LOG_LEVEL": "warning",
                    "EXITPLANE_SECRET_KEY": uuid.uuid4().hex + uuid.uuid4().hex,
                    "EXITPLANE_VAR_DIR": str(workdir / "var"),
                    "EXITPLANE_DRIFT_INTERVAL_S": str(drift_interval_s),
                    "EXITPLANE_DRIFT_RECENT_S": "120", "EXITPLANE_DRIFT_LOOKBACK_S": "600",
                    "EXITPLANE_RUNTIME_STALE_AFTER_S": "600"}
        subprocess.run([EXE, "db", "upgrade"], env=self.env, check=True, capture_output=True)
        self.ports = [_free_port(), _free_port()]
        for index, port in enumerate(self.ports):
            self._start([EXE, "up", "--host", "127.0.0.1", "--port", str(port),
                         "--no-migrate", "--no-workers"], f"api-{index}")
        # The ingest worker lowers its own priority (EXITPLANE_INGEST_NICE, the product's
        # default 10 unless `--ingest-nice` says otherwise): it is throughput work that the
        # stream buffers. PostgreSQL (its locks are shared) and Celery stay at the default.
        self._start([EXE, "ingest", "--name", "ingest-1", "--claim-idle-ms", "10000"], "ingest",
                    env=self.env if ingest_nice is None
                    else {**self.env, "EXITPLANE_INGEST_NICE": str(ingest_nice)})
        self._start([EXE, "worker", "--loglevel", worker_loglevel], "worker")
        self._start([EXE, "beat", "--loglevel", "warning"], "beat")
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        deadline = time.monotonic() + 120
        for url in self.urls:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not become ready (logs in {workdir})")
                time.sleep(0.2)
        self.engine = make_engine(self.db_url)

    def _start(self, command: list[str], name: str, env: dict | None = None) -> None:
        log = (self.workdir / f"{name}.log").open("a")
        self.processes.append(subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=env or getattr(self, "env", os.environ)))
        self.names.append(name)

    def nice(self, name: str) -> int:
        """The nice value a started process runs at now."""
        return os.getpriority(os.PRIO_PROCESS, self.processes[self.names.index(name)].pid)

    def backends(self) -> list[int]:
        """PostgreSQL backend pids connected to the bench database."""
        with self.engine.connect() as connection:
            return list(connection.execute(text(
                "SELECT pid FROM pg_stat_activity WHERE datname = :db"),
                {"db": self.db_name}).scalars())

    def exitplane(self, *args: str) -> str:
        return subprocess.run([EXE, *args], env=self.env, check=True, capture_output=True,
                              text=True).stdout.strip()

    def counted(self, deployment: str) -> int:
        with self.engine.connect() as connection:
            return int(connection.execute(text(
                "SELECT coalesce(sum(r.tokens), 0) FROM rollups r JOIN deployments d "
                "ON d.id = r.deployment_id WHERE d.name = :name AND r.layer = :first"),
                {"name": deployment, "first": EXIT_LAYERS[0]}).scalar())

    def backlog(self, deployment: str) -> int:
        """Batches in the deployment's telemetry stream not yet stored by the ingest worker
        (unread plus read and not acknowledged)."""
        client = redis.Redis(port=self.redis_port)
        try:
            groups = client.xinfo_groups(stream_key(deployment))
        except redis.ResponseError:  # no stream yet
            return 0
        finally:
            client.close()
        return sum((group.get("lag") or 0) + (group.get("pending") or 0) for group in groups
                   if group.get("name") in (GROUP, GROUP.encode()))

    def stream_state(self, deployment: str) -> dict:
        """The stream's length, its group as Redis reports it, and the dead letters: what to
        read when `lost` is not 0."""
        client = redis.Redis(port=self.redis_port, decode_responses=True)
        try:
            groups = client.xinfo_groups(stream_key(deployment))
            return {"length": client.xlen(stream_key(deployment)),
                    "dead_letters": client.xlen(DEAD_LETTER),
                    "group": next((g for g in groups if g.get("name") == GROUP), None)}
        except redis.ResponseError as error:
            return {"error": str(error)}
        finally:
            client.close()

    async def drained(self, deployment: str, generated: int, timeout: float) -> bool:
        """Wait until the store has counted `generated` tokens, or the stream is empty (what
        is not counted then is lost), or `timeout`; whether the stream was drained."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await asyncio.to_thread(self.counted, deployment) >= generated:
                return True
            if await asyncio.to_thread(self.backlog, deployment) == 0:
                await asyncio.sleep(2.0)  # a batch in the worker's hands at that instant
                return await asyncio.to_thread(self.backlog, deployment) == 0
            await asyncio.sleep(1.0)
        return await asyncio.to_thread(self.backlog, deployment) == 0

    def rows(self, deployment: str) -> dict[str, int]:
        with self.engine.connect() as connection:
            deployment_id = connection.execute(text(
                "SELECT id FROM deployments WHERE name = :name"), {"name": deployment}).scalar()
            return {table: int(connection.execute(text(
                f"SELECT count(*) FROM {table} WHERE deployment_id = :d"),
                {"d": deployment_id}).scalar())
                for table in ("token_records", "shadow_samples", "rollups",
                              "rollup_histograms", "telemetry_batches")}

    def close(self) -> None:
        redis_server, *services = self.processes  # Redis goes last: the others need it
        for group in (services, [redis_server]):
            for process in group:
                process.terminate()
            for process in group:
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
        self.engine.dispose()
        with self.admin.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
        self.admin.dispose()


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU-seconds so far) of every process on the machine."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _machine_busy_s() -> float:
    """CPU-seconds the whole machine has spent busy (all cores, /proc/stat)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = \
            map(int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


class CpuMeter:
    """CPU-seconds per component between two samples: the harness (this process), each
    topology process with its children (Celery's pool), the PostgreSQL backends of the bench
    database, and `other` (the rest of the machine: other sessions, PostgreSQL's shared
    background processes, the kernel)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def sample(self) -> dict:
        """Cumulative CPU-seconds per component now (per backend pid for PostgreSQL)."""
        procs = _proc_cpu()
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in procs.items():
            children.setdefault(parent, []).append(pid)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        components = {"harness": usage.ru_utime + usage.ru_stime}
        for name, process in zip(self.topology.names, self.topology.processes, strict=True):
            tree, total = [process.pid], 0.0
            while tree:
                pid = tree.pop()
                total += procs.get(pid, (0, 0.0))[1]
                tree.extend(children.get(pid, ()))
            key = name.split("-")[0]  # api-0 and api-1 are one component, "api"
            components[key] = components.get(key, 0.0) + total
        backends = {pid: procs[pid][1] for pid in self.topology.backends() if pid in procs}
        return {"components": components, "backends": backends, "busy": _machine_busy_s()}

    @staticmethod
    def split(before: dict, after: dict, tokens: int) -> dict[str, float]:
        """CPU-seconds per million tokens of each component between two samples."""
        spent = {name: after["components"][name] - before["components"].get(name, 0.0)
                 for name in after["components"]}
        # A backend that appeared meanwhile counts from zero; one that left loses its tail.
        spent["postgres"] = sum(cpu - before["backends"].get(pid, 0.0)
                                for pid, cpu in after["backends"].items())
        spent["other"] = after["busy"] - before["busy"] - sum(spent.values())
        scale = 1e6 / max(1, tokens)
        return {name: round(cpu * scale, 3) for name, cpu in spent.items()}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- simulated runtimes ------------------------------------------------------------------------

# -- the simulated runtimes' transport -----------------------------------------------------------

class TransportError(Exception):
    """A request that got no HTTP answer (refused, reset, timed out)."""


@dataclass
class Answer:
    """What the harness reads of a response."""

    status_code: int
    headers: dict[str, str]
    content: bytes

    def json(self):
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class LeanConnection:
    """One keep-alive HTTP/1.1 connection, one request at a time, over asyncio streams.

    The simulated runtimes' transport: the protocol's requests and status handling are the
    same as through httpx, at a fraction of its CPU per request. httpx took ~40% of the
    harness at 500 runtimes (py-spy), and the harness shares the API's two cores, so its cost
    per request came out of the very figures it measures; each real runtime pays its own client
    on its own machine."""

    def __init__(self, url: str) -> None:
        parts = httpx.URL(url)
        self.host, self.port = parts.host, parts.port
        self._host_header = f"{self.host}:{self.port}".encode()
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(self, method: str, path: str, *, headers: dict[str, str],
                      body: bytes = b"", timeout: float = 60.0) -> Answer:
        if self._streams is not None and self._streams[0].at_eof():
            self.close()  # the server closed it while idle (uvicorn: after 5 s)
        reused = self._streams is not None
        try:
            return await asyncio.wait_for(self._exchange(method, path, headers, body), timeout)
        except (ConnectionError, asyncio.IncompleteReadError) as error:
            self.close()
            if not reused:
                raise TransportError(f"{method} {path}: {error!r}") from error
        except (OSError, asyncio.LimitOverrunError, TimeoutError, ValueError) as error:
            self.close()  # its state is unknown: the next request opens a new one
            raise TransportError(f"{method} {path}: {error!r}") from error
        # A kept-alive connection the server closed as the request left: once more on a new
        # one, as httpx does (the protocol's requests are idempotent: batch ids, GETs).
        try:
            return await asyncio.wait_for(self._exchange(method, path, headers, body), timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                TimeoutError, ValueError) as error:
            self.close()
            raise TransportError(f"{method} {path}: {error!r}") from error

    async def _exchange(self, method: str, path: str, headers: dict[str, str],
                        body: bytes) -> Answer:
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._streams
        head = [f"{method} {path} HTTP/1.1".encode(), b"Host: " + self._host_header,
                b"Content-Length: " + str(len(body)).encode()]
        head += [f"{name}: {value}".encode("latin-1") for name, value in headers.items()]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        await writer.drain()
        status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode(
            "latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        answer_headers = {}
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                answer_headers[name.strip().lower()] = value.strip()
        if answer_headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
            await reader.readuntil(b"\r\n")  # no trailers are sent here
            content = b"".join(chunks)
        else:
            content = await reader.readexactly(int(answer_headers.get("content-length", 0)))
        if answer_headers.get("connection", "").lower() == "close":
            self.close()
        return Answer(status, answer_headers, content)

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


def _no_columns() -> dict[str, list]:
    """Empty record columns: the required ones (the simulated runtimes set no optional column,
    which then stays off the wire)."""
    return {name: [] for name in RecordColumns.model_fields
            if name not in OPTIONAL_RECORD_COLUMNS}


@dataclass
class SimRuntime:
    """One runtime's client state: aggregator, sampled records, outbox, applied version."""

    runtime_id: str
    token: str
    api: int
    aggregate: bool
    version: int
    etag: str
    aggregator: Aggregator = field(default_factory=lambda: Aggregator(
        exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS))
    records: list = field(default_factory=list)
    columns: dict = field(default_factory=lambda: _no_columns())  # interval batches' records
    outbox: deque = field(default_factory=deque)
    seq: int = 0
    shifted: bool = False
    counted_tokens: int = 0  # records mode: tokens in its records not yet cut
    sending: asyncio.Lock = field(default_factory=asyncio.Lock)  # one delivery at a time
    poller: asyncio.Task | None = None
    # Its own connections, as a real runtime has: one for telemetry and heartbeats, one for
    # the long-poll.
    shipping: LeanConnection | None = None
    polling: LeanConnection | None = None
    retired: bool = False  # out of the fleet: delivers its backlog, then stops

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


class Fleet:
    """The asyncio harness: generation ticks, shipping, long-polls and heartbeats."""

    def __init__(self, topology: Topology, deployment: str, tokens: list[str], *,
                 aggregate: bool, rate: float, ship_interval_s: float, raw_sample_rate: float,
                 shadow_rate: float, heartbeat_s: float, version: int, etag: str,
                 bundle: bool = True) -> None:
        self.topology, self.deployment = topology, deployment
        self.aggregate, self.rate = aggregate, rate
        # Aggregating: one interval batch per runtime per interval (the shipper's default),
        # or (bundle False) the pair of an aggregate batch and a sampled record batch.
        self.bundle = aggregate and bundle
        self.ship_interval_s, self.raw_sample_rate = ship_interval_s, raw_sample_rate
        self.shadow_rate, self.heartbeat_s = shadow_rate, heartbeat_s
        self.pool = [SimRuntime(f"{deployment}-rt-{i:04d}", token, i % 2, aggregate, version,
                                etag) for i, token in enumerate(tokens)]
        self.active: list[SimRuntime] = []
        self.rng = np.random.default_rng(14)
        self.generated = 0
        self.wire_bytes = 0
        self.errors = 0
        self.refused = 0
        self.received: dict[str, tuple[int, float]] = {}  # runtime -> (version, when)
        self.pulls_holding = 0
        self.tasks: list[asyncio.Task] = []
        self.generator: asyncio.Task | None = None
        self.http: list[httpx.AsyncClient] = []  # the probes' and the admin's
        self.stopping = False

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = [httpx.AsyncClient(base_url=url, timeout=60, limits=limits)
                     for url in self.topology.urls]
        self.generator = asyncio.create_task(self._generate())
        self.tasks.append(self.generator)

    async def grow(self, count: int) -> None:
        """Bring the fleet to `count` runtimes (new ones start shipping and polling)."""
        for runtime in self.pool[len(self.active):count]:
            self.active.append(runtime)
            url = self.topology.urls[runtime.api]
            runtime.shipping, runtime.polling = LeanConnection(url), LeanConnection(url)
            runtime.poller = asyncio.create_task(self._poll(runtime))
            self.tasks += [asyncio.create_task(self._ship(runtime)), runtime.poller]
        # The fleet's long-lived state (1,000 clients, aggregators, tasks) out of the
        # collector's reach: a full collection over it paused the harness ~0.5 s at a time,
        # delaying every simulated runtime's receipts at once (gc_max_ms in harness_lag_ms).
        gc.collect()
        gc.freeze()
        # What is left to collect is the records and batches of a few seconds, mostly freed by
        # reference counting: collect the young rarely and the old seldom.
        gc.set_threshold(50_000, 50, 100)

    def shrink(self, count: int) -> None:
        """Back to `count` runtimes: the others stop generating and polling, and stop
        shipping once their backlog is delivered."""
        for runtime in self.active[count:]:
            runtime.retired = True
            if runtime.poller is not None:
                runtime.poller.cancel()
        self.active = self.active[:count]

    # generation: one vectorised tick per second for the whole fleet
    async def _generate(self) -> None:
        tick = 1.0
        next_at = time.monotonic()
        while not self.stopping:
            runtimes = list(self.active)
            if runtimes:
                await self._tick(runtimes, tick)
            next_at += tick
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def _tick(self, runtimes: list[SimRuntime], tick: float) -> None:
        n = len(runtimes)
        now = time.time()
        minute = int(now) // 60 * 60
        tokens = self.rng.poisson(self.rate * tick, size=n)
        shadow = self.rng.binomial(tokens, self.shadow_rate)
        mix = np.where(np.array([r.shifted for r in runtimes])[:, None], SHIFTED_MIX, NORMAL_MIX)
        exits = self.rng.multinomial(tokens - shadow, mix)  # (n, 4)
        exits[:, -1] += shadow  # shadow tokens run to full depth
        histogram = self.rng.multinomial(exits, BIN_MIX)  # (n, 4, 20)
        sampled = self.rng.binomial(tokens - shadow, self.raw_sample_rate) if self.aggregate \
            else tokens - shadow
        for done, i in enumerate(np.flatnonzero(tokens)):  # an idle runtime has nothing
            if done % TICK_CHUNK == TICK_CHUNK - 1:
                # Let sends and receipts in between: one pass over 1,000 runtimes held the
                # loop for hundreds of ms, a delay no real runtime's receipt has.
                await asyncio.sleep(0)
            runtime = runtimes[i]
            if runtime.retired:  # retired during this tick: its last cut may be made
                continue
            self.generated += int(tokens[i])
            if self.aggregate:
                runtime.aggregator.add_counts(minute=minute, threshold_version=runtime.version,
                                              exits=exits[i].tolist(),
                                              histogram=histogram[i].tolist())
            else:
                runtime.counted_tokens += int(tokens[i])
            if self.bundle and (shadow[i] or sampled[i]):
                self._columns(runtime, int(shadow[i]), int(sampled[i]), mix[i], now)
            elif shadow[i] or sampled[i]:
                runtime.records.extend(self._records(runtime, int(shadow[i]), int(sampled[i]),
                                                     mix[i], now))

    def _records(self, runtime: SimRuntime, shadow: int, sampled: int, mix: np.ndarray,
                 now: float) -> list[dict]:
        layers = self.rng.choice(SLOTS, size=sampled, p=mix).tolist()
        signals = self.rng.random(sampled + shadow * (1 + len(EXIT_LAYERS))).round(4).tolist()
        request = f"req-{uuid.uuid4().hex[:12]}"
        version = runtime.version
        out = [{"threshold_version": version, "request_id": request, "position": k,
                "exit_layer": layer, "signal_value": signals[k], "latency_us": 1000, "ts": now,
                "shadow": None} for k, layer in enumerate(layers)]
        base = sampled
        for k in range(shadow):
            points = signals[base + 1 + k * 4: base + 4 + k * 4]
            out.append({"threshold_version": version, "request_id": request,
                        "position": sampled + k, "exit_layer": NUM_LAYERS,
                        "signal_value": signals[base + k * 4], "latency_us": 3000, "ts": now,
                        "shadow": [{"layer": layer, "signal": s,
                                    # a shifted runtime's traffic: early answers go wrong
                                    "matched": s > 0.3 and not runtime.shifted}
                                   for layer, s in zip(EXIT_LAYERS, points, strict=True)]})
        return out

    def _columns(self, runtime: SimRuntime, shadow: int, sampled: int, mix: np.ndarray,
                 now: float) -> None:
        """`_records`' records (the same draws), added to the runtime's record columns as an
        interval batch carries them."""
        layers = self.rng.choice(SLOTS, size=sampled, p=mix).tolist()
        signals = self.rng.random(sampled + shadow * (1 + len(EXIT_LAYERS))).round(4).tolist()
        request = f"req-{uuid.uuid4().hex[:12]}"
        into, count = runtime.columns, sampled + shadow
        first = len(into["ts"])
        into["threshold_version"] += [runtime.version] * count
        into["request_id"] += [request] * count
        into["position"] += range(count)
        into["exit_layer"] += layers + [NUM_LAYERS] * shadow
        into["signal_value"] += signals[:sampled] + signals[sampled::1 + len(EXIT_LAYERS)]
        into["latency_us"] += [1000] * sampled + [3000] * shadow
        into["ts"] += [now] * count
        for k in range(shadow):
            points = signals[sampled + 1 + k * 4: sampled + 4 + k * 4]
            into["shadow_record"] += [first + sampled + k] * len(EXIT_LAYERS)
            into["shadow_layer"] += EXIT_LAYERS
            into["shadow_signal"] += points
            # a shifted runtime's traffic: early answers go wrong
            into["shadow_matched"] += [s > 0.3 and not runtime.shifted for s in points]

    # shipping: the shipper's cut, encoding and retry rules
    def _cut(self, runtime: SimRuntime) -> None:
        if self.bundle:
            cells, columns = runtime.aggregator.cut(), runtime.columns
            runtime.columns = _no_columns()
            # As the shipper's: the records' columns as built (`RecordColumns.of` does not
            # check validated records again), the records with the first part of the cells.
            records = RecordColumns.model_construct(**columns) if columns["ts"] else None
            for start in range(0, max(len(cells), 1), MAX_AGGREGATE_CELLS):
                part = cells[start:start + MAX_AGGREGATE_CELLS]
                if not (part or records):
                    break
                batch = encode_interval(deployment=self.deployment,
                                        runtime_id=runtime.runtime_id, seq=runtime.seq,
                                        num_layers=NUM_LAYERS,
                                        raw_sample_rate=self.raw_sample_rate, cells=part,
                                        records=records)
                records = None
                runtime.seq += 1
                runtime.outbox.append((batch.content_type, batch.body))
            return
        if self.aggregate:
            cells = runtime.aggregator.cut()
            for start in range(0, len(cells), MAX_AGGREGATE_CELLS):
                batch = encode_aggregate(deployment=self.deployment,
                                         runtime_id=runtime.runtime_id, seq=runtime.seq,
                                         num_layers=NUM_LAYERS,
                                         raw_sample_rate=self.raw_sample_rate,
                                         cells=cells[start:start + MAX_AGGREGATE_CELLS])
                runtime.seq += 1
                runtime.outbox.append((batch.content_type, batch.body))
        records, runtime.records = runtime.records, []
        for start in range(0, len(records), 5000):
            # The records are dicts here, not the engine's TokenRecords: encode_records would
            # validate each one again, which a real client does not pay (nor should the
            # records path's figure); the wire schema check is made once at start-up.
            payload = {"batch_id": uuid.uuid4().hex, "deployment": self.deployment,
                       "runtime_id": runtime.runtime_id, "seq": runtime.seq,
                       "num_layers": NUM_LAYERS, "records": records[start:start + 5000],
                       "aggregated": self.aggregate}
            runtime.seq += 1
            runtime.outbox.append((RECORDS_MSGPACK, encode(payload, RECORDS_MSGPACK)))
        runtime.counted_tokens = 0

    async def _ship(self, runtime: SimRuntime) -> None:
        await asyncio.sleep(random.random() * self.ship_interval_s)  # spread the fleet
        beat_at = 0.0
        while True:
            # Retired before this cut: the cut holds its last counts (a tick skips a retired
            # runtime). Retired while a delivery was in flight, it cuts once more.
            last = runtime.retired
            self._cut(runtime)
            await self._deliver(runtime)
            if self.heartbeat_s and time.monotonic() >= beat_at:
                beat_at = time.monotonic() + self.heartbeat_s
                # on the shipping connection, so under its lock: `flush` delivers too
                async with runtime.sending:
                    with contextlib.suppress(TransportError):
                        await runtime.shipping.request(
                            "POST", f"/v1/deployments/{self.deployment}/heartbeats",
                            headers={**runtime.auth, "Content-Type": "application/json"},
                            body=json.dumps({"runtime_id": runtime.runtime_id,
                                             "applied_version": runtime.version,
                                             "applied_checksum": runtime.etag,
                                             "ready": True}).encode())
            if self.stopping or (last and not runtime.outbox):
                return
            await asyncio.sleep(self.ship_interval_s)

    async def _deliver(self, runtime: SimRuntime) -> None:
        async with runtime.sending:
            await self._deliver_in_order(runtime)

    async def _deliver_in_order(self, runtime: SimRuntime) -> None:
        attempt = 0
        while runtime.outbox:
            content_type, body = runtime.outbox[0]
            wait = None
            try:
                response = await runtime.shipping.request(
                    "POST", "/v1/telemetry", body=body,
                    headers={**runtime.auth, "Content-Type": content_type})
                status = response.status_code
                if status == 202:
                    self.wire_bytes += len(body)
                    runtime.outbox.popleft()
                    attempt = 0
                    continue
                if status in (429, 503):
                    wait = float(response.headers.get("retry-after", 1))
                elif 400 <= status < 500:  # a bug in the harness: say so, drop it
                    print(f"batch refused ({status}): {response.text[:300]}", file=sys.stderr)
                    self.refused += 1
                    runtime.outbox.popleft()
                    continue
            except TransportError:
                pass
            self.errors += 1
            attempt += 1
            await asyncio.sleep(wait or min(5.0, 0.1 * 2 ** attempt) * random.uniform(0.5, 1))

    async def _poll(self, runtime: SimRuntime) -> None:
        # A runtime starts as the client does: one plain pull for its set, then long-polls.
        started = False
        while not self.stopping:
            try:
                self.pulls_holding += started
                try:
                    response = await runtime.polling.request(
                        "GET", f"/v1/deployments/{self.deployment}/thresholds"
                               f"?runtime_id={runtime.runtime_id}" + ("&wait=60" * started),
                        headers={**runtime.auth, "If-None-Match": f'"{runtime.etag}"'}
                        if started else runtime.auth, timeout=90)
                finally:
                    self.pulls_holding -= started
                    started = True
                if response.status_code == 200:
                    received = time.monotonic()
                    body = response.json()
                    runtime.version, runtime.etag = body["version"], body["checksum"]
                    self.received[runtime.runtime_id] = (body["version"], received)
                    # Applying the set takes a real runtime a moment of its own CPU; here one
                    # process plays every runtime, and 1,000 new long-polls sent back to back
                    # would hold up the receipts still queued behind them.
                    await asyncio.sleep(random.uniform(0.5, 1.5))
                elif response.status_code != 304:
                    await asyncio.sleep(1.0)
            except TransportError:
                await asyncio.sleep(1.0)

    def pending(self) -> int:
        return sum(len(r.outbox) for r in self.pool)

    async def flush(self, timeout: float) -> bool:
        """Stop generating, cut and deliver everything."""
        self.stopping = True
        # The last tick lands first: an overloaded harness's tick can outlast any fixed wait,
        # and counts added after the final cut would be generated but never shipped.
        if self.generator is not None:
            await self.generator
        # Retired runtimes too: one retired while its delivery was in flight holds counts from
        # before it retired (42,236 tokens counted as lost in a run whose top stage failed).
        for runtime in self.pool:
            self._cut(runtime)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await asyncio.gather(*(self._deliver(r) for r in self.pool if r.outbox))
            if not self.pending():
                return True
        return False

    async def close(self) -> None:
        # Loops end on their own too: a cancellation that asyncio.wait_for swallowed (3.11,
        # when the exchange finished as it was cancelled) left a long-poll loop running.
        self.stopping = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for http in self.http:
            await http.aclose()
        for runtime in self.pool:
            for connection in (runtime.shipping, runtime.polling):
                if connection is not None:
                    connection.close()


# -- phases ------------------------------------------------------------------------------------

async def ramp(fleet: Fleet, topology: Topology, steps: list[int], stage_s: float,
               drain_s: float, admin: dict | None = None, pulls: int = 2000) -> list[dict]:
    """Grow the fleet stage by stage until the store does not keep up. With `admin`, each
    stage that holds is probed (pull latency, then an alias move's propagation), load on."""
    stages = []
    meter = CpuMeter(topology)
    for count in steps:
        await fleet.grow(count)
        begin_generated, begin = fleet.generated, time.monotonic()
        cpu_before = await asyncio.to_thread(meter.sample)
        probing = asyncio.create_task(pull_probe(fleet, pulls, budget_s=max(10.0, stage_s - 12))
                                      ) if admin else None
        lag = LoopLag()
        lag.start()
        await asyncio.sleep(stage_s)
        generated, elapsed = fleet.generated, time.monotonic() - begin
        cpu = CpuMeter.split(cpu_before, await asyncio.to_thread(meter.sample),
                             generated - begin_generated)
        deadline = time.monotonic() + drain_s
        caught_up = False
        while time.monotonic() < deadline:
            if await asyncio.to_thread(topology.counted, fleet.deployment) >= generated:
                caught_up = True
                break
            await asyncio.sleep(0.5)
        stage = {"runtimes": count, "tokens_per_s": round((generated - begin_generated)
                                                          / elapsed),
                 "held": caught_up, "pending_batches": fleet.pending(),
                 "catch_up_s": round(time.monotonic() - (deadline - drain_s), 1),
                 "cpu_s_per_mtok": cpu}
        if probing is not None:
            stage["probe"] = await probing
            if caught_up:  # an overloaded stage would time its backlog, not the protocol
                stage["propagation"] = await propagation(fleet, admin)
        stage["harness_lag_ms"] = lag.stop()
        stages.append(stage)
        print(json.dumps({"stage": fleet.deployment, **stage}), file=sys.stderr, flush=True)
        if not caught_up:
            break
    return stages


async def pull_probe(fleet: Fleet, pulls: int = 2000, budget_s: float = 48.0,
                     timeout_s: float = 10.0) -> dict:
    """Non-waiting pulls (current ETag) while every runtime holds a long-poll: `pulls` of
    them, or as many as fit in `budget_s` (a stage must not wait on its probe). A pull that
    fails or takes over `timeout_s` counts as an error, at the time it took.

    The probe is a process of its own, as the runtime that pulls is: timed inside the harness,
    a pull also waited for the event loop of the 1,000 simulated runtimes (their generation
    ticks and responses), which no real runtime's pull waits for; that lag is reported apart
    (`harness_lag_ms`)."""
    await asyncio.sleep(5.0)
    probe = fleet.active[0]
    spec = {"urls": fleet.topology.urls, "deployment": fleet.deployment,
            "auth": probe.auth, "etag": probe.etag, "pulls": pulls, "budget_s": budget_s,
            "timeout_s": timeout_s}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-P", __file__, "--probe", json.dumps(spec),
        stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate()
    figures = json.loads(out.decode().strip().splitlines()[-1])
    return {**figures, "long_polls_held": fleet.pulls_holding}


async def _probe_pulls(spec: dict) -> dict:
    """The probe process (`--probe SPEC`): the pulls of `pull_probe`, one JSON line. It runs
    at the default priority, not at the harness's (`--harness-nice`), as a runtime would."""
    with contextlib.suppress(PermissionError):  # lowering a nice value takes CAP_SYS_NICE
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    clients = [httpx.AsyncClient(base_url=url, timeout=spec["timeout_s"])
               for url in spec["urls"]]
    server_before = [await _server_timings(client) for client in clients]
    latencies, errors = [], 0
    deadline = time.monotonic() + spec["budget_s"]
    try:
        for index in range(spec["pulls"]):
            if time.monotonic() > deadline:
                break
            start = time.perf_counter()
            try:
                response = await clients[index % 2].get(
                    f"/v1/deployments/{spec['deployment']}/thresholds",
                    params={"runtime_id": "probe"},
                    headers={**spec["auth"], "If-None-Match": f'"{spec["etag"]}"'})
                errors += response.status_code not in (200, 304)
            except httpx.HTTPError:
                errors += 1
            latencies.append((time.perf_counter() - start) * 1000)
            await asyncio.sleep(0.02)
        server = [await _server_timings(client) for client in clients]
    finally:
        for client in clients:
            await client.aclose()
    # What the APIs saw in the same seconds (their /metrics, summed over both): the 304s'
    # durations inside the app, how late each event loop woke (`exitplane_event_loop_lag`) and
    # its collector's pauses.
    # A client tail with neither means the wait was outside the processes' Python code.
    inside = {name: {le: sum(after[name].get(le, 0) - before[name].get(le, 0)
                             for before, after in zip(server_before, server, strict=True))
                     for le in server[0][name]} for name in server[0]}
    return {"pull_p99_ms": round(percentile(latencies, 99), 1),
            "pull_p50_ms": round(percentile(latencies, 50), 1), "pulls": len(latencies),
            "slowest_ms": [round(value, 1) for value in sorted(latencies)[-5:]],
            "errors": errors, "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "server_304_over": _over(inside["pull"]), "loop_lag_over": _over(inside["lag"]),
            "gc_pause_over": _over(inside["gc"])}


def _over(buckets: dict[float, float]) -> dict[str, int]:
    """Cumulative bucket counts -> how many samples exceeded 10 / 25 / 50 / 100 ms."""
    total = buckets.get(float("inf"), 0)
    return {f"{int(le * 1000)}ms": int(total - buckets.get(le, 0))
            for le in (0.01, 0.025, 0.05, 0.1)} | {"samples": int(total)}


async def _server_timings(client: httpx.AsyncClient) -> dict[str, dict[float, float]]:
    """Cumulative buckets of an API's GET 304 durations, event-loop lag and garbage
    collection pauses (its /metrics)."""
    text_ = (await client.get("/metrics")).text
    found: dict[str, dict[float, float]] = {"pull": {}, "lag": {}, "gc": {}}
    for family in text_string_to_metric_families(text_):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                continue
            le = float(sample.labels["le"])
            if family.name == "exitplane_event_loop_lag_seconds":
                found["lag"][le] = found["lag"].get(le, 0) + sample.value
            elif family.name == "exitplane_gc_pause_seconds":
                found["gc"][le] = found["gc"].get(le, 0) + sample.value
            elif (family.name == "exitplane_http_request_duration_seconds"
                  and sample.labels.get("method") == "GET"
                  and sample.labels.get("status") == "304"):
                found["pull"][le] = found["pull"].get(le, 0) + sample.value
    return found


TICK_CHUNK = 50  # runtimes generated between two yields to the event loop


class LoopLag:
    """How late the harness's event loop wakes a 100 ms sleeper: the delay every simulated
    runtime's sends and receipts (propagation's included) share."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.gc_pauses: list[float] = []
        self._gc_started = 0.0
        self._task: asyncio.Task | None = None

    def _gc(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_pauses.append((time.perf_counter() - self._gc_started) * 1000)

    async def _watch(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.1)
            self.lags.append((time.perf_counter() - start - 0.1) * 1000)

    def start(self) -> None:
        self.lags, self.gc_pauses = [], []
        gc.callbacks.append(self._gc)
        self._task = asyncio.create_task(self._watch())

    def stop(self) -> dict:
        if self._task is not None:
            self._task.cancel()
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._gc)
        return {"p99_ms": round(percentile(self.lags, 99) or 0, 1),
                "max_ms": round(max(self.lags, default=0), 1),
                "gc_max_ms": round(max(self.gc_pauses, default=0), 1),
                "gc_s": round(sum(self.gc_pauses) / 1000, 2)}


async def propagation(fleet: Fleet, admin: dict, timeout: float = 30.0) -> dict:
    """Publish + activate through API A; time until each runtime's long-poll has it."""
    http = fleet.http[0]
    moved_at, moved_wall = time.monotonic(), time.time()
    response = await http.post(f"/v1/deployments/{fleet.deployment}/threshold-sets",
                               headers=admin, json={"thresholds": {"8": 0.9, "16": 0.85,
                                                                   "24": 0.8},
                                                    "reason": "fleet bench move",
                                                    "activate": True})
    response.raise_for_status()
    answered_ms = (time.monotonic() - moved_at) * 1000  # the move's own request
    version = response.json()["version"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [fleet.received.get(r.runtime_id) for r in fleet.active]
        if all(item is not None and item[0] == version for item in got):
            break
        await asyncio.sleep(0.05)
    delays = [(item[1] - moved_at) * 1000 for r in fleet.active
              if (item := fleet.received.get(r.runtime_id)) and item[0] == version]
    # A runtime that never had the new version counts at the timeout (its delay's lower
    # bound), so a move that missed some runtimes cannot read as a fast one.
    missed = len(fleet.active) - len(delays)
    delays += [timeout * 1000] * missed
    return {"propagation_p99_ms": round(percentile(delays, 99) or -1, 1),
            "propagation_max_ms": round(max(delays, default=-1), 1),
            "propagated": f"{len(delays) - missed}/{len(fleet.active)}", "version": version,
            "first_ms": round(min(delays, default=-1), 1),
            "move_request_ms": round(answered_ms, 1),
            "moved_at": moved_wall}


async def drift(fleet: Fleet, admin: dict, timeout: float,
                activated: float) -> tuple[float | None, str | None]:
    """Shift 5% of the runtimes once the active version (activated at unix time `activated`)
    has its reference: drift detection learns it from the first whole minute after
    activation (controlplane/drift/service.py). Their traffic moves out of domain: more
    tokens leave at the first exit, and their shadow tokens no longer match full depth at any
    exit layer.
    The fleet's exit rates move by ~3 points, below the exit-rate detector's 5-point minimum
    effect, so the detector meant to catch this shift is the quality one: the disagreement
    of the tokens the policy lets exit rises from ~0 to ~5%, above δ = 0.01. The exit-layer
    distribution moves too, and its finding pages (warning) once it persists. Returns seconds
    until an alert that pages (warning or critical) opens, and the kinds paging then; an
    `info` finding (distribution drift alone) pages no one and does not count."""
    steady = (int(activated) // 60 + 1) * 60 + 5  # the reference minute is over
    await asyncio.sleep(max(0.0, steady - time.time()))
    shifted = fleet.active[:max(1, len(fleet.active) // 20)]
    for runtime in shifted:
        runtime.shifted = True
    injected = time.monotonic()
    deadline = injected + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            alerts = (await fleet.http[1].get("/v1/alerts", headers=admin, params={
                "deployment": fleet.deployment, "status": "open"})).json()
            paging = sorted({a["kind"] for a in alerts if a["severity"] in ("warning", "critical")
                             and a["kind"] != "runtime_stale"})
            if paging:  # every kind that pages by then (one check often opens several)
                return round(time.monotonic() - injected, 1), ",".join(paging)
        await asyncio.sleep(0.5)
    return None, None


def make_tokens(topology: Topology, deployment: str, count: int) -> list[str]:
    with Session(topology.engine) as session:
        target = get_deployment(session=session, name=deployment)
        tokens = [create_token(session=session, name=f"{deployment}-{i}", scope="runtime",
                               deployment=target)[1] for i in range(count)]
        session.commit()
    return tokens


async def run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="exitplane-fleet-"))
    topology = Topology(args.postgres_url, workdir, args.drift_interval_s,
                        args.worker_loglevel, args.ingest_nice)
    try:
        admin = {"Authorization": "Bearer " + topology.exitplane(
            "token", "create", "--name", "bench", "--scope", "admin")}
        if args.harness_nice:
            # The simulated fleet stands for machines elsewhere: on this box the scheduler
            # serves the control plane's processes (started above, at the default priority)
            # before it. A harness that cannot keep up generates fewer tokens, so the held
            # figure falls, never rises; its own lag is reported (harness_lag_ms).
            os.setpriority(os.PRIO_PROCESS, 0, args.harness_nice)
        etags = {}
        for name in ("fleet", "fleet-records"):
            httpx.post(f"{topology.urls[0]}/v1/deployments", headers=admin, timeout=30, json={
                "name": name, "model_ref": "bench", "num_layers": NUM_LAYERS,
                "exit_layers": EXIT_LAYERS, "delta": 0.01}).raise_for_status()
            published = httpx.post(
                f"{topology.urls[0]}/v1/deployments/{name}/threshold-sets", headers=admin,
                timeout=30, json={"thresholds": {"8": 0.9, "16": 0.8, "24": 0.7},
                                  "reason": "bench", "activate": True})
            published.raise_for_status()
            etags[name] = published.json()["checksum"]
        steps = [int(step) for step in args.steps.split(",")]
        fleet = Fleet(topology, "fleet", make_tokens(topology, "fleet", max(steps)),
                      aggregate=True, rate=args.tokens_per_runtime,
                      ship_interval_s=args.ship_interval_s, raw_sample_rate=0.01,
                      shadow_rate=0.01, heartbeat_s=args.heartbeat_s, version=2,
                      etag=etags["fleet"], bundle=not args.pair)
        # Sanity: what the harness sends is what the wire schema accepts.
        TelemetryBatch.model_validate({"batch_id": "x" * 16, "deployment": "fleet",
                                       "runtime_id": "r", "seq": 0, "num_layers": NUM_LAYERS,
                                       "records": fleet._records(fleet.pool[0], 2, 3,
                                                                 NORMAL_MIX, time.time()),
                                       "aggregated": True})
        probe = _no_columns()
        fleet._columns(fleet.pool[0], 2, 3, NORMAL_MIX, time.time())
        probe, fleet.pool[0].columns = fleet.pool[0].columns, probe
        IntervalBatch.model_validate({"batch_id": "x" * 16, "deployment": "fleet",
                                      "runtime_id": "r", "seq": 0, "num_layers": NUM_LAYERS,
                                      "raw_sample_rate": 0.01, "records": probe})
        await fleet.start()
        stages = await ramp(fleet, topology, steps, args.stage_s, args.drain_s, admin=admin,
                            pulls=args.probe_pulls)
        held = [stage for stage in stages if stage["held"]]
        best = held[-1] if held else None  # the ramp stops at the first stage that fails
        if best is None:
            raise SystemExit(f"the first stage ({steps[0]} runtimes) did not hold: "
                             "start the ramp lower (--steps)")
        steady, moved = best["probe"], best["propagation"]
        ingest_nice = topology.nice("ingest")
        if args.ramp_only:
            # The pollers closed first: an API process stopped under 1,000 held long-polls
            # waited for each to end before exiting (minutes).
            await fleet.close()
            return {"fleet_tokens_per_s": best["tokens_per_s"], "runtimes": best["runtimes"],
                    "pull_p99_ms": steady["pull_p99_ms"],
                    "propagation_p99_ms": moved["propagation_p99_ms"],
                    "ingest_nice": ingest_nice, "stages": stages}
        if not stages[-1]["held"]:
            # Back to the fleet the store holds; the drift shift is measured once the store
            # has caught up with the others' backlog.
            fleet.shrink(best["runtimes"])
            target = fleet.generated
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and topology.counted("fleet") < target:
                await asyncio.sleep(1.0)
        alert_s, alert_kind = await drift(fleet, admin, args.drift_timeout_s, moved["moved_at"])
        print(json.dumps({"drift_alert_s": alert_s, "kind": alert_kind}), file=sys.stderr,
              flush=True)
        flushed = await fleet.flush(120)
        # `lost` is only what an empty stream did not count: a store still catching up (a
        # loaded machine) is reported as `stream_backlog`, never as lost tokens.
        drained = await topology.drained("fleet", fleet.generated, 600)
        await asyncio.sleep(2.0)
        counted = topology.counted("fleet")
        backlog = topology.backlog("fleet")
        stream_state = topology.stream_state("fleet")
        rows = topology.rows("fleet")
        await fleet.close()

        records = Fleet(topology, "fleet-records",
                        make_tokens(topology, "fleet-records", max(args.records_steps_list)),
                        aggregate=False, rate=args.tokens_per_runtime, ship_interval_s=1.0,
                        raw_sample_rate=1.0, shadow_rate=0.01, heartbeat_s=0, version=2,
                        etag=etags["fleet-records"])
        await records.start()
        record_stages = await ramp(records, topology, args.records_steps_list,
                                   args.records_stage_s, args.drain_s)
        records_flushed = await records.flush(120)
        records_drained = await topology.drained("fleet-records", records.generated, 600)
        record_rows = topology.rows("fleet-records")
        records_counted = topology.counted("fleet-records")
        await records.close()
        record_held = [s["tokens_per_s"] for s in record_stages if s["held"]]
        return {
            "fleet_tokens_per_s": best["tokens_per_s"] if best else 0,
            "runtimes": best["runtimes"] if best else 0,
            "tokens_per_runtime_per_s": args.tokens_per_runtime,
            "wire_bytes_per_token": round(fleet.wire_bytes / max(1, fleet.generated), 4),
            "rows_per_million_tokens": round(sum(rows.values()) * 1e6
                                             / max(1, fleet.generated)),
            "pull_p99_ms": steady["pull_p99_ms"],
            "propagation_p99_ms": moved["propagation_p99_ms"],
            "records_mode_tokens_per_s": max(record_held, default=0),
            "drift_alert_s": alert_s, "drift_alert_kind": alert_kind,
            "drift_interval_s": args.drift_interval_s,
            "lost": fleet.generated - counted if flushed and drained else None,
            "flushed": flushed, "stream_backlog": backlog, "stream": stream_state,
            "generated": fleet.generated, "counted": counted,
            "records_mode_lost": records.generated - records_counted
            if records_flushed and records_drained else None,
            "records_mode_rows_per_million_tokens": round(
                sum(record_rows.values()) * 1e6 / max(1, records.generated)),
            "propagation": moved, "probe": steady,
            "stages": stages, "records_stages": record_stages, "rows": rows,
            "send_retries": fleet.errors, "refused_batches": fleet.refused + records.refused,
            "cpus": os.cpu_count(), "harness_nice": args.harness_nice,
            "ingest_nice": ingest_nice,
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
    finally:
        topology.close()
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=os.environ.get("EXITPLANE_BENCH_POSTGRES_URL"))
    parser.add_argument("--steps", default="125,250,500,1000",
                        help="fleet sizes of the ramp (runtimes)")
    parser.add_argument("--tokens-per-runtime", type=float, default=1000.0)
    parser.add_argument("--stage-s", type=float, default=60.0)
    parser.add_argument("--drain-s", type=float, default=20.0,
                        help="how long the store may take to count a stage's last tokens")
    parser.add_argument("--ship-interval-s", type=float, default=5.0)
    parser.add_argument("--pair", action="store_true",
                        help="aggregating runtimes send an aggregate batch and a sampled record "
                             "batch per interval (before interval batches) instead of one "
                             "interval batch")
    parser.add_argument("--heartbeat-s", type=float, default=15.0)
    parser.add_argument("--records-steps", default="20,40,80,160")
    parser.add_argument("--records-stage-s", type=float, default=30.0)
    parser.add_argument("--drift-interval-s", type=float, default=30.0,
                        help="EXITPLANE_DRIFT_INTERVAL_S of the workers (production default)")
    parser.add_argument("--drift-timeout-s", type=float, default=300.0)
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--probe-pulls", type=int, default=2000,
                        help="non-waiting pulls per stage's probe (one each ~22 ms, within the "
                             "stage); p99 is the 1%% slowest")
    parser.add_argument("--ingest-nice", type=int, default=None,
                        help="the ingest worker's EXITPLANE_INGEST_NICE (default: the "
                             "product's, 10; 0 keeps the default priority); the API processes, "
                             "Celery and "
                             "PostgreSQL stay at the default priority")
    parser.add_argument("--harness-nice", type=int, default=0,
                        help="nice value of the simulated fleet's process (the control plane "
                             "and the pull probe stay at the default priority)")
    parser.add_argument("--worker-loglevel", default="warning",
                        help="the Celery worker's (info logs each task and its duration)")
    parser.add_argument("--ramp-only", action="store_true",
                        help="stop after the ramp (no drift, flush or records phases)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # the probe process (pull_probe)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(asyncio.run(_probe_pulls(json.loads(args.probe)))), flush=True)
        return 0
    if not args.postgres_url:
        parser.error("give --postgres-url or set EXITPLANE_BENCH_POSTGRES_URL "
                     "(. var/services/env)")
    args.records_steps_list = [int(step) for step in args.records_steps.split(",")]
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
