"""`exitplane demo`: the whole loop on the real model, on the embedded default.

The control plane (API, a Celery worker and beat on the SQLite broker) runs as real processes;
the runtime (SmolLM2-135M-Instruct with the exit heads shipped for the demo) runs in this process
and talks to it over HTTP exactly as a deployed runtime would: it pulls thresholds and ships
telemetry. The story, in five phases:

1. calibrate: chat traffic, all shadow, until a calibration certifies a first version;
2. serve chat with it (early exit), then check the speed: the same chat prompts at full depth,
   with the version, and with it plus shadow tokens (`demo_speed`: whether early exit pays
   on this machine, after its checks and shadow tokens);
3. drift: the traffic switches to Python code; when the version's quality breaks there, the
   workers detect it, make the conservative set active on their own and queue a recalibration
   on the new traffic; when the shadow tokens show it holds within δ (a 90% bound), nothing
   falls back and the operator re-tunes for the new traffic;
4. recalibrate: code traffic, all shadow, until the recalibrated version is active;
5. serve code with it: the exit rate recovers and disagreement stays within δ.

A phase moves on when the control plane's statistics have the evidence they need (shadow tokens
per exit layer for a calibration, shadow tokens in a drift window, served tokens for an exit
rate: `Evidence`, derived from the settings the control plane runs with), never after a fixed
time, and prints one progress line saying what it waits for. The safety limit scales with the
runtime's measured speed (`safety_limit_s`), so a slow machine gets the time its tokens take;
`--throttle F` runs the runtime at 1/F of its speed to show it.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import click
import httpx

from exitplane.demo_speed import (
    AnswerCheck,
    SpeedCheck,
    answer_check,
    echo_speed,
    held_out_chat,
    speed_check,
)
from exitplane.ops.api import write_token_file

# Domain B: raw Python source to continue (the model completes code, no chat template).
CODE_FILES = ("textwrap.py", "fractions.py", "heapq.py", "bisect.py", "statistics.py",
              "colorsys.py", "shlex.py", "glob.py", "fnmatch.py", "calendar.py", "string.py",
              "difflib.py", "csv.py", "getopt.py", "netrc.py", "quopri.py")

# The exit heads the demo serves, shipped with the package and pinned by digest. They were made
# by the project's own training command, on the default model (docs/getting-started/demo.md),
# from the model's answers to chat prompts (runtime.corpus.TRAIN_PROMPTS); the demo serves
# other, held-out chat prompts, and Python source is a new domain to them, which is the shift
# the story shows.
DEMO_HEADS = Path(__file__).with_name("data") / "demo-heads.safetensors"
DEMO_HEADS_SHA256 = "5569647bdf590c0f771a5fbb184aaadf08fde28a47d5509c53f010c2c2b81ce2"
DEMO_HEADS_COMMAND = (
    "exitplane runtime train-heads --mode post-hoc --exit-layers 12,15,18,21,24,27 "
    "--prompts 48 --stdlib-chars 0 --steps 96 --budget-s 7200 --dtype float16 "
    "--out exitplane/data/demo-heads.safetensors")

# The sign-in the demo leaves for its UI (an admin: the newcomer may act, not only look).
UI_USERNAME = "demo"
UI_PASSWORD_FILE = "ui-password"
ADMIN_TOKEN_FILE = "admin.token"

PHASES = 5
SHADOW_SERVING = 0.25  # share of served traffic shadowed while a version serves
SHADOW_DRIFT = 0.5  # after the switch to code: the quality test's windows fill twice as fast


def control_plane_settings(*, quick: bool) -> dict[str, object]:
    """The settings (`controlplane.settings.Settings` fields) the demo's control plane runs
    with; `Evidence` derives the phases' targets from the same values.

    The quality test's longest window (the recent window) covers every version's whole life in
    the demo, so the windows hold the shadow tokens the test needs at any speed; the shorter
    ones see a change sooner where tokens come fast."""
    # A check every 15 s: detection waits for tokens, not for checks, and every check costs
    # the runtime CPU on a small machine.
    return {"drift_interval_s": 15.0, "drift_recent_s": 3600.0,
            "drift_quality_windows_s": [120.0, 600.0, 3600.0],
            "calibration_min_samples": 300 if quick else 600,
            "calibration_retry_s": 5.0, "calibration_lookback_s": 3600.0,
            # Few samples: a larger share fits the match model the path is drawn from.
            "calibration_learn_fraction": 0.5,
            "log_level": "warning"}


def settings_env(values: dict[str, object]) -> dict[str, str]:
    """`EXITPLANE_*` environment variables for `values` (lists as JSON)."""
    return {f"EXITPLANE_{name.upper()}": json.dumps(value) if isinstance(value, list)
            else str(value) for name, value in values.items()}


@dataclass(frozen=True)
class Evidence:
    """How much traffic the control plane's statistics need before each phase can move on."""

    calibration_shadow: int  # shadow tokens per exit layer a calibration reads at least
    quality_shadow: int  # shadow tokens a quality window holds before it is tested
    quality_alpha: float  # the level each quality window of each check is tested at
    last_good_shadow: int  # shadow tokens a version needs to count as the last good one
    served_tokens: int  # served tokens a serving phase shows its exit rate on

    @classmethod
    def from_settings(cls, settings, *, served_tokens: int) -> Evidence:
        from controlplane.calibration.service import CalibrationPolicy
        from controlplane.drift.window_checks import DriftOptions

        policy, drift = CalibrationPolicy.from_settings(settings), DriftOptions.from_settings(
            settings)
        return cls(calibration_shadow=policy.min_samples_per_layer,
                   quality_shadow=drift.min_shadow_tokens, quality_alpha=drift.quality_look_alpha,
                   last_good_shadow=policy.bounds.min_shadow_tokens,
                   served_tokens=served_tokens)

    def calibration_target(self, attempt: int) -> int:
        """Shadow tokens to collect before calibration attempt `attempt` (1, 2, ...): a
        calibration that certified nothing gets another minimum's worth."""
        return attempt * self.calibration_shadow

    def planned_tokens(self) -> int:
        """Tokens the story may take: two calibrations' worth of shadow tokens twice, both
        serving phases, and the drift phase up to its cap (what the safety limit scales)."""
        serving = math.ceil(self.served_tokens / (1 - SHADOW_SERVING))
        drift = math.ceil(self.drift_cap() / SHADOW_DRIFT)
        return 2 * self.calibration_target(2) + 2 * serving + drift

    def drift_cap(self) -> int:
        """Code shadow tokens after which no reaction means there is none to come: enough for
        the quality test to see disagreement at 1.5 δ (`tokens_to_show`) at δ = 0.05."""
        return max(20 * self.quality_shadow, 2 * self.calibration_shadow)


# Phase 4 under the conservative fallback (all shadow: the exit rate to beat is none).
COLLECTING = "B code: conservative fallback (collecting samples)"


def first_sentence(text: str | None, limit: int = 120) -> str:
    """A job's reason for the timeline: its first sentence, cut at a word (with "...") when
    longer than `limit` characters."""
    sentence = (text or "").split(". ")[0].rstrip(".")
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0] + "..."


def held_bound(stats: PhaseStats) -> float:
    """The 90% upper bound on a phase's shadow disagreement (one-sided Clopper-Pearson)."""
    from controlplane.calibration.learn_then_test import binomial_upper_bound

    return binomial_upper_bound(stats.disagreements, stats.shadow, 0.1)


def tokens_to_show(disagreement: float, delta: float, alpha: float, *, minimum: int = 1,
                   limit: int = 1_000_000) -> int | None:
    """Shadow tokens on which `disagreement` has its one-sided (1 - alpha) Clopper-Pearson lower
    bound above δ, as the quality test asks (tokens as independent; requests cluster them, so
    the control plane may need more); None when it never does (disagreement <= δ)."""
    from controlplane.stats.clustered import clopper_pearson

    if disagreement <= delta:
        return None
    low, high = max(1, minimum), max(1, minimum)
    while clopper_pearson(disagreement, high, alpha)[0] <= delta:
        if high >= limit:
            return None
        low, high = high, min(limit, 2 * high)
    while low < high:
        mid = (low + high) // 2
        if clopper_pearson(disagreement, mid, alpha)[0] > delta:
            high = mid
        else:
            low = mid + 1
    return high


def safety_limit_s(planned_tokens: int, tokens_per_s: float, *, factor: float = 3.0,
                   allowance_s: float = 600.0) -> float:
    """How long the story may run: `factor` times what its planned tokens take at the speed
    measured so far, plus an allowance for the control plane's own work (drift checks,
    calibration jobs); unbounded until a speed was measured."""
    if tokens_per_s <= 0:
        return math.inf
    return allowance_s + factor * planned_tokens / tokens_per_s


def throttle_pause(elapsed_s: float, throttle: float) -> float:
    """Seconds to sleep after work that took `elapsed_s`, so that it runs at 1/`throttle` of
    its speed."""
    return max(0.0, throttle - 1.0) * elapsed_s


def phase_line(index: int, name: str, have: int, target: int | None, unit: str,
               note: str = "") -> str:
    """'phase 2/5 drift: 412/1000 shadow tokens on code traffic (note)'."""
    count = f"{have}/{target}" if target else str(have)
    return f"phase {index}/{PHASES} {name}: {count} {unit}" + (f" ({note})" if note else "")


def progress_step(before: int, now: int, target: int | None) -> bool:
    """Whether a progress line written to a log (not a terminal) is due: a target's quarters
    passed, or the count doubled where there is no target."""
    if target:
        return min(4, 4 * now // target) > min(4, 4 * before // target)
    return now > 0 and (before == 0 or now.bit_length() > before.bit_length())


class Progress:
    """One progress line per phase: rewritten in place on a terminal, written at its quarters
    (or each doubling) to a log."""

    def __init__(self, stream=None, *, start: float | None = None) -> None:
        self.stream = stream or sys.stdout
        self.start = time.monotonic() if start is None else start
        self.tty = self.stream.isatty()
        self.key: tuple | None = None
        self.have = 0
        self.width = 0

    def show(self, index: int, name: str, have: int, target: int | None, unit: str,
             note: str = "") -> None:
        at = time.monotonic() - self.start
        line = f"[{at:7.1f}s] {phase_line(index, name, have, target, unit, note)}"
        key = (index, name, unit)
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = max(self.width, len(line))
        elif key != self.key or progress_step(self.have, have, target):
            self.stream.write(line + "\n")
        self.stream.flush()
        self.key, self.have = key, have

    def done(self) -> None:
        """End the current line (before other output)."""
        if self.tty and self.key is not None:
            self.stream.write("\n")
            self.stream.flush()
        self.key, self.have, self.width = None, 0, 0


@dataclass
class PhaseStats:
    """What one phase of the workload did, from the runtime's own token records."""

    name: str
    tokens: int = 0
    seconds: float = 0.0
    exits: int = 0
    depth_sum: int = 0
    served: int = 0  # non-shadow tokens
    shadow: int = 0
    disagreements: int = 0
    versions: set[int] = field(default_factory=set)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def exit_rate(self) -> float:
        return self.exits / self.served if self.served else 0.0

    @property
    def mean_exit_layer(self) -> float:
        return self.depth_sum / self.served if self.served else 0.0

    @property
    def disagreement(self) -> float | None:
        return self.disagreements / self.shadow if self.shadow else None

    def count(self, record, thresholds: dict[int, float], num_layers: int) -> None:
        """Add one token record; a shadow token disagrees when `thresholds` (its version's
        policy) would have exited where top-1 differed from full depth."""
        self.tokens += 1
        self.versions.add(record.threshold_version)
        if record.shadow is None:
            self.served += 1
            self.depth_sum += record.exit_layer
            self.exits += record.exit_layer < num_layers
            return
        self.shadow += 1
        exit_point = next((p for p in sorted(record.shadow, key=lambda p: p.layer)
                           if p.signal > thresholds.get(p.layer, 1.0)), None)
        self.disagreements += exit_point is not None and not exit_point.matched


class Timeline:
    def __init__(self, progress: Progress | None = None) -> None:
        self.start = time.monotonic()
        self.events: list[tuple[float, str]] = []
        self.progress = progress

    def mark(self, text: str) -> None:
        at = time.monotonic() - self.start
        self.events.append((at, text))
        if self.progress is not None:
            self.progress.done()
        click.echo(f"[{at:7.1f}s] {text}")


@dataclass(frozen=True)
class SignIn:
    """The UI user the demo creates: its name and the 0600 file holding its password."""

    url: str
    username: str
    password_file: Path

    def describe(self, *, running: bool) -> str:
        where = (f"{self.url}/ui" if running else f"{self.url}/ui after `EXITPLANE_VAR_DIR="
                 f"{self.password_file.parent} exitplane up --port {self.url.rsplit(':', 1)[1]}`")
        return (f"UI sign-in: {where}\n  username: {self.username}\n  password: in "
                f"{self.password_file} (readable by you only)")


def write_password_file(path: Path) -> str:
    """A generated password, written to `path` readable and writable by its owner only (0600,
    set as the file is created, so it is never readable by others)."""
    password = secrets.token_urlsafe(18)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(password + "\n")
    return password


class ControlPlane:
    """The API, a worker and beat as child processes on the embedded default."""

    def __init__(self, var_dir: Path, port: int, env: dict[str, str]) -> None:
        self.var_dir, self.port, self.env = var_dir, port, env
        self.url = f"http://127.0.0.1:{port}"
        self.processes: list[subprocess.Popen] = []
        self.exe = str(Path(sys.executable).parent / "exitplane")
        self.sign_in: SignIn | None = None

    def cli(self, *args: str) -> str:
        done = subprocess.run([self.exe, *args], env=self.env, capture_output=True, text=True)
        if done.returncode != 0:
            raise click.ClickException(f"exitplane {' '.join(args)} failed: {done.stderr[-800:]}")
        return done.stdout.strip()

    def create_admin_token(self) -> str:
        """An admin API token for the demo's own calls, also left in `<var dir>/admin.token`
        (0600) for the newcomer's curl or `exitplane --token-file`."""
        secret = self.cli("bootstrap", "token", "--name", "demo-admin", "--scope", "admin")
        write_token_file(str(self.var_dir / ADMIN_TOKEN_FILE), secret)
        return secret

    def create_sign_in(self) -> SignIn:
        """A UI admin with a generated password in `<var dir>/ui-password` (0600)."""
        path = self.var_dir / UI_PASSWORD_FILE
        write_password_file(path)
        self.cli("bootstrap", "user", "--username", UI_USERNAME, "--role", "admin",
                 "--password-file", str(path))
        self.sign_in = SignIn(url=self.url, username=UI_USERNAME, password_file=path)
        return self.sign_in

    def start(self) -> None:
        logs = self.var_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name, args in (("api", ["up", "--port", str(self.port), "--no-migrate",
                                    "--no-workers"]),
                           ("worker", ["worker"]), ("beat", ["beat"])):
            log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the child
            self.processes.append(subprocess.Popen([self.exe, *args], env=self.env, stdout=log,
                                                   stderr=subprocess.STDOUT))
        # Start-up only (imports, migrations checked): a loaded machine may take minutes.
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if any(p.poll() is not None for p in self.processes):
                break
            time.sleep(0.5)
        raise click.ClickException(f"the control plane did not start; see {logs}")

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def load_demo_heads(path: Path = DEMO_HEADS, expected_digest: str = DEMO_HEADS_SHA256):
    """The shipped exit heads, verified against the digest pinned in this module."""
    from runtime.heads import ExitHeads
    from runtime.model import DEFAULT_MODEL

    if not path.exists():
        raise click.ClickException(f"the demo's exit heads {path} are missing from this "
                                   f"installation; make them with `{DEMO_HEADS_COMMAND}`")
    try:
        heads = ExitHeads.load(path, expected_digest=expected_digest)
    except ValueError as error:
        raise click.ClickException(f"{error}; reinstall exitplane or make them again with "
                                   f"`{DEMO_HEADS_COMMAND}`") from None
    if heads.metadata.get("model") != DEFAULT_MODEL:
        raise click.ClickException(f"{path} holds exit heads for {heads.metadata.get('model')!r},"
                                   f" not the demo's model {DEFAULT_MODEL!r}")
    return heads


def _cycle(prompts: list[list[int]]) -> Iterator[list[int]]:
    """`prompts` round robin, without end."""
    while True:
        yield from prompts


def _code_prompts(tokenizer, count: int, tokens: int = 96) -> list[list[int]]:
    """Openings of standard-library modules (not the ones the heads were trained on)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in CODE_FILES:
        path = root / name
        if path.exists():
            ids = tokenizer(path.read_text(errors="replace"), add_special_tokens=False)
            start = min(400, max(0, len(ids["input_ids"]) - tokens))
            prompts.append(ids["input_ids"][start:start + tokens])
    return (prompts * (count // max(1, len(prompts)) + 1))[:count]


@dataclass
class Pace:
    """The tokens the runtime generated and the seconds its steps took (throttle included)."""

    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def paced_step(step, pace: Pace, throttle: float, *, sleep=time.sleep,
               clock=time.perf_counter):
    """`step` (an engine step: returns one output per token) that counts its tokens and seconds
    into `pace` and, throttled, sleeps `throttle_pause` after each call."""

    def paced():
        started = clock()
        outputs = step()
        sleep(throttle_pause(clock() - started, throttle))
        pace.tokens += len(outputs)
        pace.seconds += clock() - started
        return outputs

    return paced


def serve_stream(engine, records: list, stats: PhaseStats, prompts: Iterator[list[int]],
                 max_new_tokens: int, thresholds_of, *, stop, check_every: int = 8) -> None:
    """Keep `engine`'s batch full with `prompts` until stop(), asked every `check_every`
    steps, adding the records its steps append to `records` to `stats` (a shadow token
    disagrees when the policy of its version would have exited where top-1 differed);
    requests still running then are cancelled, so a phase ends where its evidence is
    complete, not where a batch is."""
    num_layers = engine.parts.num_layers
    running: set[str] = set()
    steps = 0
    try:
        while True:
            while len(running) < engine.config.max_batch:
                running.add(engine.add_request(next(prompts),
                                               max_new_tokens=max_new_tokens))
            before = len(records)
            started = time.perf_counter()
            outputs = engine.step()
            stats.seconds += time.perf_counter() - started
            running -= {output.request_id for output in outputs if output.finished}
            for record in records[before:]:
                stats.count(record, thresholds_of(record.threshold_version), num_layers)
            steps += 1
            if steps % check_every == 0 and stop():
                return
    finally:
        for request_id in running:
            engine.cancel(request_id)


class Runtime:
    """The in-process runtime: engine + threshold client + shipper, and phase bookkeeping."""

    def __init__(self, *, model, heads, cp_url: str, deployment: str, token: str,
                 state_dir: Path, shadow_rate: float, throttle: float = 1.0) -> None:
        from exitplane.client.shipper import TelemetryShipper
        from exitplane.client.thresholds import ThresholdClient
        from runtime.engine import Engine, EngineConfig
        from runtime.model import model_revision

        self.model = model
        self.engine = Engine(model, heads=heads, runtime_id="demo-runtime-1",
                             config=EngineConfig(max_batch=8, shadow_rate=shadow_rate),
                             model_revision=model_revision(None))
        self.pace, self.throttle = Pace(), throttle
        # Every step (the default story's and the segments story's) is measured, and slowed
        # by the throttle as evenly as a CPU shared with other work would slow it.
        self.engine.step = paced_step(self.engine.step, self.pace, throttle)
        self.shipper = TelemetryShipper(base_url=cp_url, token=token, deployment=deployment,
                                        runtime_id=self.engine.runtime_id,
                                        num_layers=self.engine.parts.num_layers,
                                        spool_dir=state_dir / "spool", batch_interval_s=0.5,
                                        batch_records=200, head_digest=self.engine.head_digest,
                                        model_revision=self.engine.model_revision).start()
        self.records: list = []

        def on_record(record) -> None:
            self.shipper.submit(record)
            self.records.append(record)

        self.engine.on_record = on_record
        self.client = ThresholdClient(self.engine, base_url=cp_url, deployment=deployment,
                                      token=token, cache_path=state_dir / "thresholds.json",
                                      long_poll_s=5.0, heartbeat_interval_s=5.0,
                                      telemetry=self.shipper).start()
        self.client.wait_ready(30)

    def serve(self, stats: PhaseStats, prompts: Iterator[list[int]], max_new_tokens: int,
              thresholds_of, *, stop, check_every: int = 8) -> None:
        """`serve_stream` on this runtime's engine and records."""
        serve_stream(self.engine, self.records, stats, prompts, max_new_tokens, thresholds_of,
                     stop=stop, check_every=check_every)

    def close(self) -> None:
        self.client.stop()
        self.shipper.close(30)


def _api(cp: ControlPlane, token: str) -> httpx.Client:
    return httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {token}"},
                        timeout=60)


def _wait(predicate, timeout: float, step) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        step()
    return False


def run_demo(*, quick: bool, serve: bool, port: int, story=None, throttle: float = 1.0) -> int:
    """Run the story end to end; returns 0 when every step of the loop was seen. `story`: the
    function that tells it on the set-up control plane and runtime (`_story`'s arguments),
    this module's story by default (`exitplane.demo_segments.segments_story`)."""
    import torch

    from controlplane.settings import Settings
    from runtime import corpus
    from runtime.heads import file_sha256
    from runtime.model import DEFAULT_MODEL, load_model, model_revision

    if throttle < 1:
        raise click.ClickException(f"--throttle {throttle:g}: use 1 (full speed) or more")
    with socket.socket() as probe:  # a control plane left running would answer instead
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise click.ClickException(f"port {port} is already in use (another exitplane "
                                       "demo or `exitplane up`?); stop it or pass --port")
    # SIGTERM unwinds like Ctrl-C, so the `finally` below stops the processes it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    timeline = Timeline()
    progress = timeline.progress = Progress(start=timeline.start)
    var_dir = Path(os.environ.get("EXITPLANE_VAR_DIR", "var")).resolve()
    demo_dir = var_dir / "demo"
    shutil.rmtree(demo_dir, ignore_errors=True)
    demo_dir.mkdir(parents=True)
    delta, epsilon = 0.05, 0.1
    values = control_plane_settings(quick=quick)
    evidence = Evidence.from_settings(Settings(**values, var_dir=demo_dir),
                                      served_tokens=200 if quick else 400)
    env = {**os.environ, **settings_env(values), "EXITPLANE_VAR_DIR": str(demo_dir),
           "EXITPLANE_PORT": str(port)}
    env.pop("EXITPLANE_DATABASE_URL", None)
    env.pop("EXITPLANE_REDIS_URL", None)
    cp = ControlPlane(demo_dir, port, env)
    cp.cli("db", "upgrade")
    admin = cp.create_admin_token()
    cp.create_sign_in()
    heads = load_demo_heads()
    cp.start()
    timeline.mark(f"control plane up at {cp.url} (SQLite store, SQLite broker, worker + beat)")
    runtime = None
    try:
        model, tokenizer = load_model(None)
        timeline.mark(f"exit heads {DEMO_HEADS.name} (sha256 {DEMO_HEADS_SHA256[:12]}..., "
                      f"exit layers {', '.join(map(str, heads.exit_layers))})")
        api = _api(cp, admin)
        api.post("/v1/deployments", json={
            "name": "demo", "model_ref": DEFAULT_MODEL, "head_digest": file_sha256(DEMO_HEADS),
            "model_revision": model_revision(None),
            "num_layers": len(model.model.layers), "exit_layers": list(heads.exit_layers),
            "signal": "learned", "delta": delta, "epsilon": epsilon,
            "policy": "auto"}).raise_for_status()
        runtime_token = api.post("/v1/tokens", json={
            "name": "demo-runtime", "scope": "runtime",
            "deployment": "demo"}).json()["token"]
        timeline.mark(f"deployment 'demo' created (δ={delta}, ε={epsilon}, policy auto)")
        runtime = Runtime(model=model, heads=heads, cp_url=cp.url, deployment="demo",
                          token=runtime_token, state_dir=demo_dir / "runtime", shadow_rate=1.0,
                          throttle=throttle)
        told = dict(cp=cp, api=api, runtime=runtime, tokenizer=tokenizer, corpus=corpus,
                    timeline=timeline, quick=quick, delta=delta, epsilon=epsilon,
                    min_samples=evidence.calibration_shadow, serve=serve)
        if story is None:
            return _story(**told, evidence=evidence, progress=progress)
        return story(**told)
    finally:
        if runtime is not None:
            runtime.close()
        cp.stop()
        if not serve and cp.sign_in is not None:
            click.echo("\n" + cp.sign_in.describe(running=False))


class _DefaultStory:
    """The default story's phases over one control plane and runtime (module docstring)."""

    def __init__(self, *, api, runtime, tokenizer, corpus, timeline, quick, delta, epsilon,
                 evidence: Evidence, progress: Progress) -> None:
        self.api, self.runtime, self.timeline = api, runtime, timeline
        self.delta, self.epsilon, self.evidence, self.progress = delta, epsilon, evidence, progress
        # Chat traffic of the kind the heads were trained for, on prompts their training never
        # saw (as a deployment's live traffic is); Python source is new to them.
        trained = int(runtime.engine.heads.metadata["config"]["generation_prompts"])
        self.chat_prompts = held_out_chat(corpus, trained)
        self.chat = [corpus.chat_prompt_ids(tokenizer, p) for p in self.chat_prompts]
        self.tokenizer, self.corpus, self.quick = tokenizer, corpus, quick
        self.speed: SpeedCheck | None = None
        self.answers: AnswerCheck | None = None
        self.code = _code_prompts(tokenizer, 64)
        self.streams = {"chat": _cycle(self.chat), "code": _cycle(self.code)}
        self.new_tokens = 48 if quick else 64
        self.phases: list[PhaseStats] = []
        self.known: dict[int, dict] = {}
        self.started = time.monotonic()
        self.failure = ""

    # -- the control plane, as an operator reads it ---------------------------------------------

    def threshold_set(self, version: int) -> dict:
        if version not in self.known:
            self.known[version] = self.api.get(
                f"/v1/deployments/demo/threshold-sets/{version}").json()
        return self.known[version]

    def thresholds_of(self, version: int) -> dict[int, float]:
        if version == 0:
            return {}
        return {int(k): float(v) for k, v in self.threshold_set(version)["thresholds"].items()}

    def active_version(self) -> int:
        return self.api.get("/v1/deployments/demo").json()["aliases"]["active"]

    def newest_job(self) -> dict | None:
        jobs = self.api.get("/v1/deployments/demo/calibrations", params={"limit": 1}).json()
        return jobs[0] if jobs else None

    # -- serving ---------------------------------------------------------------------------------

    def over_limit(self) -> bool:
        """The safety limit (`safety_limit_s`) at the speed measured so far."""
        elapsed = time.monotonic() - self.started
        limit = safety_limit_s(self.evidence.planned_tokens(), self.runtime.pace.tokens_per_s)
        if elapsed <= limit:
            return False
        self.failure = (f"safety limit: {elapsed:.0f} s > {limit:.0f} s (3x the "
                        f"{self.evidence.planned_tokens()} planned tokens at the "
                        f"{self.runtime.pace.tokens_per_s:.1f} tokens/s measured, + 600 s)")
        return True

    def serve(self, stats: PhaseStats, traffic: str, *, done, show) -> bool:
        """Serve `traffic` ('chat' or 'code'), showing progress as it goes, until done();
        False when the safety limit ended it first."""
        finished: list[bool] = []

        def stop() -> bool:
            show()
            if done():
                finished.append(True)
                return True
            return self.over_limit()

        show()
        if not done():
            self.runtime.serve(stats, self.streams[traffic], self.new_tokens,
                               self.thresholds_of, stop=stop)
        else:
            finished.append(True)
        show()
        return bool(finished)

    def wait(self, predicate, show) -> bool:
        """Poll the control plane until predicate() (no traffic meanwhile); False at the
        safety limit."""
        while not predicate():
            if self.over_limit():
                return False
            show()
            time.sleep(1)
        return True

    def applied(self, version: int) -> None:
        """Wait until the runtime applies `version` (its long poll answers within seconds)."""
        _wait(lambda: self.runtime.client.applied_version == version, 120,
              lambda: time.sleep(0.5))

    # -- the phases ------------------------------------------------------------------------------

    def calibrate_on_chat(self) -> int | None:
        """Phase 1: all shadow, a calibration after each minimum's worth of shadow tokens."""
        stats = PhaseStats("A chat: collect shadow samples (never exit)")
        self.phases.append(stats)
        unit = "shadow tokens on chat traffic (the calibration's minimum per exit layer)"
        for attempt in range(1, 5):
            target = self.evidence.calibration_target(attempt)
            if not self.serve(stats, "chat", done=lambda t=target: stats.shadow >= t,
                              show=lambda t=target: self.progress.show(
                                  1, "calibrate", stats.shadow, t, unit)):
                return None
            self.runtime.shipper.flush(30)
            job = self.api.post("/v1/deployments/demo/calibrations", json={
                "reason": f"calibration on chat traffic ({stats.shadow} shadow tokens)"}
            ).json()["job"]
            self.timeline.mark(f"calibration job {job['id']} requested on {stats.shadow} "
                               "shadow tokens")
            finished = self.job_finished(job["id"], 1, "calibrate", stats.shadow)
            if finished is None:
                return None
            if finished.get("result_version") is not None:
                version = finished["result_version"]
                summary = finished.get("summary") or {}
                rate = summary.get("exit_rate")
                self.timeline.mark(f"version {version} certified (expected exit rate "
                                   + (f"{rate:.1%})" if isinstance(rate, float) else f"{rate})"))
                if finished.get("promotion") == "awaiting_approval":
                    self.approve(finished)
                return version
            self.timeline.mark(f"job {job['id']} published nothing "
                               f"({first_sentence(finished.get('status_reason'))}); collecting "
                               "another minimum of shadow samples")
        self.failure = "four calibrations on chat traffic certified nothing"
        return None

    def approve(self, job: dict) -> None:
        """Approve a candidate the promotion bounds hold back, as the operator would: the
        demo's one runtime is one witness, so a set that opens exits waits for a person."""
        hold = (job.get("summary") or {}).get("promotion_hold", "")
        self.timeline.mark(f"candidate v{job['result_version']} waits for approval: {hold}")
        self.api.post(f"/v1/deployments/demo/calibrations/{job['id']}/approve", json={
            "reason": "the demo approves as the operator: the candidate was certified on "
                      "the traffic's shadow samples"}).raise_for_status()
        self.timeline.mark(f"approved v{job['result_version']} as the operator")

    def job_finished(self, job_id: int, index: int, name: str, have: int) -> dict | None:
        found: dict = {}

        def finished() -> bool:
            found.update(self.api.get(f"/v1/deployments/demo/calibrations/{job_id}").json())
            return found.get("status") in ("succeeded", "failed")

        ok = self.wait(finished, lambda: self.progress.show(
            index, name, have, None, "shadow tokens", f"job {job_id} {found.get('status')}"))
        return found if ok else None

    def serve_version(self, index: int, name: str, stats: PhaseStats, traffic: str,
                      version: int) -> bool:
        """Phases 2 and 5: serve with `version` until its exit rate rests on enough tokens."""
        self.runtime.engine.config.shadow_rate = SHADOW_SERVING
        self.phases.append(stats)
        target = self.evidence.served_tokens
        return self.serve(stats, traffic, done=lambda: stats.served >= target,
                          show=lambda: self.progress.show(
                              index, name, stats.served, target, f"served tokens under v{version}",
                              f"exit rate {stats.exit_rate:.0%}"))

    def drift(self, version_a: int) -> bool:
        """Phase 3: code traffic until the control plane reacts (a fallback, or a
        recalibration queued by an alert), or until the code shadow tokens show the version
        holds there within δ (a 90% bound over at least a calibration's minimum of them), or
        the drift cap's worth of them passed with no reaction from the quality test: then
        nothing falls back, and the operator queues a recalibration for the new traffic."""
        self.runtime.engine.config.shadow_rate = SHADOW_DRIFT
        stats = PhaseStats("B code: after the shift")
        self.phases.append(stats)
        cap = self.evidence.drift_cap()
        hold = max(self.evidence.calibration_shadow, 4 * self.evidence.quality_shadow)
        reacted: dict = {}
        shifted = datetime.now(UTC)

        def done() -> bool:
            active = self.active_version()
            job = self.newest_job()
            if active != version_a or (job and job["trigger"] == "alert"):
                reacted.update(active=active, job=job)
                return True
            if stats.shadow >= hold and held_bound(stats) <= self.delta:
                reacted.update(held=held_bound(stats))
                return True
            if stats.shadow >= cap:  # the quality test, at its level, finds no breach
                reacted.update(held=held_bound(stats))
                return True
            return False

        def show() -> None:
            rate = stats.disagreement
            if rate is None:
                note = f"the quality test needs at least {self.evidence.quality_shadow} a window"
            elif rate <= self.delta:
                note = f"{rate:.1%} disagree under v{version_a}: within δ={self.delta:g} so far"
            else:
                need = tokens_to_show(rate, self.delta, self.evidence.quality_alpha,
                                      minimum=self.evidence.quality_shadow)
                note = (f"{rate:.1%} disagree under v{version_a}; at that rate the quality test"
                        f" shows it above δ={self.delta:g} on about {need}" if need else
                        f"{rate:.1%} disagree under v{version_a}: too close to δ={self.delta:g}"
                        " to show")
            self.progress.show(3, "drift", stats.shadow, None,
                               "shadow tokens on code traffic", note)

        if not self.serve(stats, "code", done=done, show=show) or not reacted:
            return False
        if "held" in reacted:
            self.runtime.shipper.flush(30)
            job = self.api.post("/v1/deployments/demo/calibrations", json={
                "since": shifted.isoformat(),
                "reason": f"traffic changed to code; v{version_a} holds there: re-tune for it"}
            ).json()["job"]
            why = (f"90% bound {reacted['held']:.1%} <= δ={self.delta:g}"
                   if reacted["held"] <= self.delta else
                   f"the quality test finds no breach of δ={self.delta:g}")
            self.timeline.mark(
                f"quality held on code: {stats.disagreement:.1%} disagree under v{version_a} "
                f"on {stats.shadow} shadow tokens ({why}), so nothing falls back; the operator "
                f"re-tunes for the new traffic (calibration job {job['id']})")
            return True
        alerts = self.api.get("/v1/alerts", params={"deployment": "demo"}).json()
        fired = ", ".join(sorted({a["kind"] for a in alerts})) or "none listed"
        active = reacted["active"]
        how = (f"conservative set v{active} is active" if active != version_a
               else f"v{version_a} stays active (its shadow tokens stay within δ)")
        self.timeline.mark(f"drift detected ({fired}) on {stats.shadow} code shadow tokens; "
                           f"{how}; recalibration queued")
        return True

    def recalibrate(self, version_a: int) -> int | None:
        """Phase 4: all shadow on code until a recalibrated version is active."""
        self.runtime.engine.config.shadow_rate = 1.0
        held = self.active_version() == version_a  # quality held: no fallback to watch
        stats = PhaseStats(f"B code: collecting samples (v{version_a} stays)" if held
                           else COLLECTING)
        self.phases.append(stats)
        since = datetime.now(UTC)
        seen: dict = {"approved": set(), "noted": set(), "attempt": 1}
        unit = "shadow tokens on code since the drift (the calibration's minimum per exit layer)"

        def done() -> bool:
            active = self.active_version()
            if active != version_a and self.threshold_set(active)["origin"] == "calibration":
                seen["version"] = active
                return True
            job = self.newest_job()
            if job is not None:
                self.follow(job, stats, since, seen)
            if stats.shadow >= self.evidence.calibration_target(4):
                self.failure = (f"no recalibrated version on {stats.shadow} code shadow tokens"
                                f" (job {job and job['id']}: {job and job['status_reason']})")
                return True
            return False

        def show() -> None:
            job = seen.get("job") or {}
            self.progress.show(4, "recalibrate", stats.shadow,
                               self.evidence.calibration_target(seen["attempt"]), unit,
                               f"job {job.get('id')} {job.get('status')}" if job else "")

        if not self.serve(stats, "code", done=done, show=show) or "version" not in seen:
            return None
        return seen["version"]

    def follow(self, job: dict, stats: PhaseStats, since: datetime, seen: dict) -> None:
        """What a recalibration job's state asks of the demo: a candidate held back by the
        promotion bounds is approved as an operator would; a job that failed is requested
        again on more samples."""
        seen["job"] = job
        if job["status"] == "waiting_for_data" and job["id"] not in seen["noted"]:
            seen["noted"].add(job["id"])
            seen["attempt"] = max(seen["attempt"], 2 if "certified" in job["status_reason"]
                                  else 1)
            self.timeline.mark(f"calibration job {job['id']} waits for more code samples "
                               f"({job['status_reason'][:90]})")
        if job["promotion"] == "awaiting_approval" and job["id"] not in seen["approved"]:
            seen["approved"].add(job["id"])
            self.approve(job)
        if job["status"] == "failed" and stats.shadow >= self.evidence.calibration_target(
                seen["attempt"] + 1):
            seen["attempt"] += 1
            self.runtime.shipper.flush(30)
            created = self.api.post("/v1/deployments/demo/calibrations", json={
                "since": since.isoformat(),
                "reason": f"recalibration on code traffic ({stats.shadow} shadow tokens)"})
            self.timeline.mark(f"job {job['id']} failed ({first_sentence(job['status_reason'])}); "
                               f"job {created.json()['job']['id']} requested on "
                               f"{stats.shadow} shadow tokens")

    def check_speed(self, version: int) -> None:
        """The same chat prompts at full depth, with `version`, and with it plus the serving
        phase's shadow tokens (`demo_speed.speed_check`)."""
        self.progress.show(2, "speed check", 0, None, "tokens",
                           "the same chat prompts at full depth and with early exit")
        self.speed = speed_check(
            self.runtime.model, self.runtime.engine.heads, self.tokenizer, self.corpus,
            self.chat_prompts[:6 if self.quick else 12], version=version,
            thresholds=self.thresholds_of(version), shadow_rate=SHADOW_SERVING,
            new_tokens=24 if self.quick else 48)
        figures = self.speed.figures
        self.timeline.mark(f"speed check on the same chat prompts: early exit "
                           f"{figures['measured_speedup']:.2f}x full depth, "
                           f"{figures['watched_speedup']:.2f}x with shadow tokens")
        self.answers = answer_check(
            self.runtime.model, self.runtime.engine.heads, self.tokenizer, self.corpus,
            self.chat_prompts[:6 if self.quick else 12], version=version,
            thresholds=self.thresholds_of(version), new_tokens=24 if self.quick else 48)
        self.timeline.mark(f"answer check on the same chat prompts: {self.answers.identical} "
                           f"of {self.answers.prompts} answers identical to full depth "
                           f"under v{version}")

    def tell(self) -> bool:
        version_a = self.calibrate_on_chat()
        if version_a is None:
            return False
        self.applied(version_a)
        self.timeline.mark(f"version {version_a} active and applied by the runtime")
        chat = PhaseStats("A chat: early exit (calibrated)")
        if not self.serve_version(2, "serve chat", chat, "chat", version_a):
            return False
        if self.active_version() != version_a:
            self.failure = (f"v{version_a} did not hold on chat traffic itself ({chat.shadow} "
                            f"shadow tokens, {chat.disagreement or 0:.1%} disagree): the "
                            "control plane fell back before the switch")
            return False
        self.timeline.mark(f"chat phase: exit rate {chat.exit_rate:.0%}, mean exit layer "
                           f"{chat.mean_exit_layer:.1f}, {chat.tok_s:.1f} tok/s")
        self.check_speed(version_a)
        self.timeline.mark("workload switches to Python code")
        if not self.drift(version_a) or self.failure:
            return False
        version_b = self.recalibrate(version_a)
        if version_b is None:
            return False
        self.applied(version_b)
        self.timeline.mark(f"recalibrated version {version_b} active and applied by the runtime")
        recovered = PhaseStats("B code: recalibrated")
        if not self.serve_version(5, "serve code", recovered, "code", version_b):
            return False
        self.runtime.shipper.flush(30)
        return True


def _story(*, cp, api, runtime, tokenizer, corpus, timeline, quick, delta, epsilon,
           min_samples, serve, evidence: Evidence, progress: Progress) -> int:
    """The default story (module docstring); 0 when the loop closed."""
    story = _DefaultStory(api=api, runtime=runtime, tokenizer=tokenizer, corpus=corpus,
                          timeline=timeline, quick=quick, delta=delta, epsilon=epsilon,
                          evidence=evidence, progress=progress)
    told = story.tell()
    if not told:
        timeline.mark(f"the story stopped: {story.failure or 'see the timeline'}")
    pace = runtime.pace
    click.echo(f"\nDemo time: {time.monotonic() - timeline.start:.0f} s; runtime speed "
               f"{pace.tokens_per_s:.1f} tokens/s over {pace.tokens} tokens"
               + (f" (throttled to 1/{runtime.throttle:g})" if runtime.throttle > 1 else ""))
    ok = _report(timeline, story.phases, delta, epsilon, speed=story.speed,
                 answers=story.answers, ui_url=f"{cp.url}/ui/deployments/demo") and told
    if serve:
        hold_ui(cp)
    return 0 if ok else 1


def hold_ui(cp: ControlPlane) -> None:
    """Keep the control plane and its UI up after the summary, until Ctrl-C."""
    signin = cp.sign_in.describe(running=True) if cp.sign_in else f"The UI is at {cp.url}/ui"
    click.echo(f"\n{signin}\nCtrl-C to stop.")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass


def _wait_job(api: httpx.Client, job_id: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        job = api.get(f"/v1/deployments/demo/calibrations/{job_id}").json()
        if job.get("status") in ("succeeded", "failed"):
            return job
        time.sleep(1)
    return job


def _ratio(value: float | None) -> str:
    """A disagreement rate as the summary prints it: three decimals, or "-" when not measured."""
    return "-" if value is None else f"{value:.3f}"


def _report(timeline: Timeline, phases: list[PhaseStats], delta: float, epsilon: float, *,
            speed: SpeedCheck | None = None, answers: AnswerCheck | None = None,
            ui_url: str = "/ui/deployments/demo") -> bool:
    """Print the timeline and summary; True when the loop closed: the recalibrated phase exits
    more than the fallback and its shadow tokens do not show disagreement above δ at 1-ε (a
    one-sided Clopper-Pearson lower bound, the judgement the quality test makes: on ~100
    shadow tokens the raw rate of a set calibrated close to δ lands above δ about half the
    time, which says nothing about the set)."""
    from controlplane.stats.clustered import clopper_pearson

    click.echo("\nTimeline")
    for at, text in timeline.events:
        click.echo(f"  {at:7.1f}s  {text}")
    click.echo("\nSummary")
    click.echo(f"  {'phase':<50}{'tok/s':>7}{'exit rate':>10}{'mean exit':>10}"
               f"{'shadow':>8}{'disagree':>9}  versions")
    for p in phases:
        disagreement = _ratio(p.disagreement)
        depth = f"{p.mean_exit_layer:.1f}" if p.served else "full"  # all-shadow: full depth
        click.echo(f"  {p.name:<50}{p.tok_s:>7.1f}{p.exit_rate:>10.1%}{depth:>10}"
                   f"{p.shadow:>8}{disagreement:>9}  {sorted(p.versions)}")
    by_name = {p.name: p for p in phases}
    recovered = by_name.get("B code: recalibrated")
    fallback = next((p for p in phases if p.name.startswith("B code: collecting")
                     or p.name == COLLECTING), None)
    lower = (clopper_pearson(recovered.disagreement or 0.0, recovered.shadow, epsilon)[0]
             if recovered else 1.0)
    ok = bool(recovered and fallback and recovered.exit_rate > fallback.exit_rate
              and lower <= delta)
    echo_speed(speed, ui_url, answers)
    click.echo(f"\nloop closed: {'yes' if ok else 'no'} (after recalibration: exit rate "
               f"{recovered.exit_rate if recovered else 0:.1%}, disagreement "
               f"{_ratio(recovered.disagreement if recovered else None)}, lower "
               f"{1 - epsilon:.0%} "
               f"bound {lower:.3f} vs δ {delta})")
    return ok
