"""Processes started as operators start them: `exitplane` commands, Celery workers, the API
(`exitplane up`), Prometheus; each writes its output to a file of its own, and the ends of those
logs go into a failing test's report."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import yaml

from tests.support.network import free_port
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
EXITPLANE = str(Path(sys.executable).parent / "exitplane")
PROMETHEUS = "/usr/bin/prometheus"
RULES = ROOT / "dashboards" / "prometheus" / "alerts.yml"
_worker_names = itertools.count(1)


def stop_processes(processes: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM to each (all first, so that they shut down side by side), then SIGKILL to any
    that has not exited `timeout` seconds later."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop_process(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `timeout` seconds."""
    stop_processes([process], timeout)


class CeleryWorker:
    """`celery worker` (solo pool, as the tests' one-process stacks need) in a subprocess, on
    the store and broker that env names; its output goes to log."""

    def __init__(self, *, env: dict[str, str], log: Path, name: str = "worker") -> None:
        self.log = log
        # A node name of its own per process and worker: two test sessions on one broker
        # never see each other's workers as duplicates.
        node = f"{name}-{os.getpid()}-{next(_worker_names)}@localhost"
        with log.open("a") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                 "--pool=solo", "--loglevel=INFO", "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "-n", node],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> CeleryWorker:
        """Return once the worker consumes tasks; raise with its log if it died or hung."""
        deadline = time.monotonic() + timeout
        while "ready." not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"celery worker did not start:\n{self.log.read_text()}")
            time.sleep(0.2)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (a warm shutdown: the running task finishes), then SIGKILL after timeout."""
        if self.process.poll() is None:
            stop_process(self.process, timeout)


class Processes:
    """Service processes of the test (ingest worker, Celery workers), stopped at the end."""

    def __init__(self, env: dict, logs: Path) -> None:
        self.env, self.logs, self.running = env, logs, []

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("a") as out:
            process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=out,
                                       stderr=subprocess.STDOUT)
        self.running.append(process)
        return process

    def stop(self, process: subprocess.Popen) -> None:
        stop_process(process)

    def close(self) -> None:
        for process in self.running:
            if process.poll() is None:
                self.stop(process)

    def celery_worker(self, name: str) -> subprocess.Popen:
        """A Celery worker (`CeleryWorker`) logging to <logs>/<name>.log."""
        process = CeleryWorker(env=self.env, log=self.logs / f"{name}.log", name=name).process
        self.running.append(process)
        return process


def start_api(processes: Processes, name: str) -> str:
    """One API process as compose runs it (`exitplane up --no-workers`, the schema already
    migrated) on a free loopback port; returns its base URL once it answers /readyz."""
    port = free_port()
    process = processes.start(name, [EXITPLANE, "up", "--host", "127.0.0.1", "--port", str(port),
                                     "--no-migrate", "--no-workers"])
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"{name} exited: see {processes.logs / (name + '.log')}")
        try:
            return httpx.get(f"{base}/readyz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, 90, f"{name} to be ready")
    return base


def shipped_env(var_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a process run as shipped: none of the test session's EXITPLANE_*
    settings (the embedded defaults), its var dir `var_dir`, warnings only, and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXITPLANE_")}
    return env | {"EXITPLANE_VAR_DIR": str(var_dir), "EXITPLANE_LOG_LEVEL": "warning", **extra}


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m exitplane.cli <args>` run to its end; its result, whatever its exit status."""
    return subprocess.run([sys.executable, "-m", "exitplane.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


class ExitplaneUp:
    """A real `exitplane up` (API only) on a free loopback port."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "exitplane.cli", "up", "--no-workers", "--port",
             str(self.port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
            stderr=log.open("w"))
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the API did not come up"
            time.sleep(0.3)

    def page(self, cookie: str) -> httpx.Response:
        return httpx.get(f"{self.url}/ui/tokens", cookies={"exitplane_session": cookie},
                         follow_redirects=False, timeout=10)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def answers(url: str) -> bool:
    """Whether `url` answers 200 now (a refused connection or a timeout is no answer)."""
    try:
        return httpx.get(url, timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def spawn(command: list[str], *, out: Path, env: dict[str, str] | None = None,
          cwd: Path = ROOT, err: Path | None = None) -> subprocess.Popen:
    """`command` with its stdout written to `out`, its stderr to `err` (else to `out` too)."""
    with out.open("w") as stdout:
        if err is None:
            return subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout,
                                    stderr=subprocess.STDOUT)
        with err.open("w") as stderr:
            return subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr)


def cli(env: dict[str, str], *args: str) -> str:
    """`exitplane <args>` run to its end (failing the test when it fails); its stdout."""
    return subprocess.run([EXITPLANE, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=120).stdout.strip()


def provision_chat(env: dict[str, str], tmp_path: Path) -> tuple[Path, str]:
    """An operator's bootstrap through the CLI: deployment `chat` of the tiny model (exits at
    layers 2 and 4), a runtime token for it in tmp_path/runtime.token and an admin token;
    (the runtime token's file, the admin token)."""
    cli(env, "bootstrap", "deployment", "--name", "chat", "--model-ref", "tiny-llama",
        "--num-layers", "6", "--exit-layers", "2,4", "--signal", "maxprob", "--delta", "0.2")
    token_file = tmp_path / "runtime.token"
    cli(env, "bootstrap", "token", "--name", "rt", "--scope", "runtime", "--deployment", "chat",
        "--out", str(token_file), "--if-missing")
    return token_file, cli(env, "bootstrap", "token", "--name", "ops", "--scope", "admin")


def start_prometheus(tmp_path: Path, port: int, scrape_configs: list[dict],
                     env: dict[str, str] | None = None) -> subprocess.Popen:
    """Prometheus on 127.0.0.1:`port` scraping `scrape_configs` every second with the alert
    rules loaded, its data and its log (prometheus.log) under tmp_path."""
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)], "scrape_configs": scrape_configs}))
    return spawn([PROMETHEUS, f"--config.file={config}",
                  f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                  f"--web.listen-address=127.0.0.1:{port}"],
                 out=tmp_path / "prometheus.log", env=env)


def print_tails(logs: Iterable[Path], chars: int, *, failed_only: bool = False) -> None:
    """Print the last `chars` characters of each log, for the report of a failing test;
    `failed_only`: only the logs with a traceback or an ERROR in them."""
    for log in logs:
        text = log.read_text()
        if not failed_only or "Traceback" in text or "ERROR" in text:
            print(f"--- {log.name} ---\n{text[-chars:]}")
