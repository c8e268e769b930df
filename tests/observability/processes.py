"""What the observability tests share: `exitplane` processes started as operators start them,
each writing its output to a file of its own, a production deployment provisioned through the
CLI, Debian's Prometheus scraping them, and the ends of their logs for a test's report."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXITPLANE = str(Path(sys.executable).parent / "exitplane")
PROMETHEUS = "/usr/bin/prometheus"
RULES = ROOT / "dashboards" / "prometheus" / "alerts.yml"


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
    cli(env, "deployment", "ensure", "--name", "chat", "--model-ref", "tiny-llama",
        "--num-layers", "6", "--exit-layers", "2,4", "--signal", "maxprob", "--delta", "0.2")
    token_file = tmp_path / "runtime.token"
    cli(env, "token", "create", "--name", "rt", "--scope", "runtime", "--deployment", "chat",
        "--out", str(token_file), "--if-missing")
    return token_file, cli(env, "token", "create", "--name", "ops", "--scope", "admin")


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
