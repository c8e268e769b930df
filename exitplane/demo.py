"""`exitplane demo`: the whole loop on the real model, on the embedded default.

The control plane (API, a Celery worker and beat on the SQLite broker) runs as real processes;
the runtime (SmolLM2-135M-Instruct with exit heads) runs in this process and talks to it over
HTTP exactly as a deployed runtime would: it pulls thresholds and ships telemetry. The story:

1. serve chat answers with shadow sampling, calibrate, activate a first version;
2. switch the workload to Python code: the workers detect the drift, make the conservative set
   active on their own and queue a recalibration on the new traffic;
3. the runtime applies the recalibrated version: exit rate recovers, disagreement stays <= δ.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx

# Domain B: raw Python source to continue (the model completes code, no chat template).
CODE_FILES = ("textwrap.py", "fractions.py", "heapq.py", "bisect.py", "statistics.py",
              "colorsys.py", "shlex.py", "glob.py", "fnmatch.py", "calendar.py", "string.py",
              "difflib.py", "csv.py", "getopt.py", "netrc.py", "quopri.py")

# Adapter steps of the --quick demo's exit heads (the full demo trains TrainConfig's default).
QUICK_ADAPTER_STEPS = 96


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
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.events: list[tuple[float, str]] = []

    def mark(self, text: str) -> None:
        at = time.monotonic() - self.start
        self.events.append((at, text))
        click.echo(f"[{at:7.1f}s] {text}")


class ControlPlane:
    """The API, a worker and beat as child processes on the embedded default."""

    def __init__(self, var_dir: Path, port: int, env: dict[str, str]) -> None:
        self.var_dir, self.port, self.env = var_dir, port, env
        self.url = f"http://127.0.0.1:{port}"
        self.processes: list[subprocess.Popen] = []
        self.exe = str(Path(sys.executable).parent / "exitplane")

    def cli(self, *args: str) -> str:
        done = subprocess.run([self.exe, *args], env=self.env, capture_output=True, text=True)
        if done.returncode != 0:
            raise click.ClickException(f"exitplane {' '.join(args)} failed: {done.stderr[-800:]}")
        return done.stdout.strip()

    def start(self) -> None:
        logs = self.var_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name, args in (("api", ["up", "--port", str(self.port), "--no-migrate",
                                    "--no-workers"]),
                           ("worker", ["worker"]), ("beat", ["beat"])):
            log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the child
            self.processes.append(subprocess.Popen([self.exe, *args], env=self.env, stdout=log,
                                                   stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
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


def heads_config(quick: bool):
    """How the demo trains its exit heads. --quick trains on less text (the model's 64-token
    answers to 16 prompts, 60k characters of stdlib source) and fewer adapter steps, so that a
    fresh clone closes the loop soon. The step count, not the clock, ends training: heads cut
    short by a deadline on a slow machine exit so rarely that the shift to code no longer hurts
    quality, and the story (drift -> fallback -> recalibration) has nothing to react to. The
    budget is a cap for a pathologically slow machine, far above what the steps take."""
    from runtime.model import DEFAULT_MODEL
    from runtime.train import TrainConfig

    if quick:
        return TrainConfig(mode="post-hoc", adapter_steps=QUICK_ADAPTER_STEPS,
                           time_budget_s=900.0, generation_prompts=16, generation_tokens=64,
                           stdlib_chars=60_000, model_name=DEFAULT_MODEL)
    return TrainConfig(mode="post-hoc", time_budget_s=2600.0, model_name=DEFAULT_MODEL)


def _heads(model, tokenizer, quick: bool, timeline: Timeline):
    """Cached exit heads for the default model, trained on first use (progress bar)."""
    from runtime.cli import default_heads_path
    from runtime.heads import ExitHeads
    from runtime.train import train_heads

    path = default_heads_path("post-hoc")
    if path.exists():
        timeline.mark(f"exit heads loaded from {path}")
        return ExitHeads.load(path), path, False
    timeline.mark("training exit heads (post-hoc; cached for the next run)")
    config = heads_config(quick)
    heads = train_heads(model, tokenizer, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    heads.save(path)
    meta = heads.metadata
    last = str(heads.exit_layers[-1])
    timeline.mark(f"exit heads trained and saved to {path} ({meta['train_steps']} adapter steps "
                  f"on {meta['data']['tokens']} tokens in {meta['train_seconds']:.0f} s; "
                  f"held-out agreement at layer {last}: {meta['heldout'][last]['agreement']:.0%})")
    return ExitHeads.load(path), path, True


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


class Runtime:
    """The in-process runtime: engine + threshold client + shipper, and phase bookkeeping."""

    def __init__(self, *, model, heads, cp_url: str, deployment: str, token: str,
                 state_dir: Path, shadow_rate: float) -> None:
        from exitplane.client.shipper import TelemetryShipper
        from exitplane.client.thresholds import ThresholdClient
        from runtime.engine import Engine, EngineConfig
        from runtime.model import model_revision

        self.engine = Engine(model, heads=heads, runtime_id="demo-runtime-1",
                             config=EngineConfig(max_batch=4, shadow_rate=shadow_rate),
                             model_revision=model_revision(None))
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

    def run(self, stats: PhaseStats, prompts: list[list[int]], max_new_tokens: int,
            thresholds_of) -> None:
        """Generate `prompts` (one batch), adding what happened to `stats`; a shadow token
        disagrees when the policy of its version would have exited where top-1 differed."""
        num_layers = self.engine.parts.num_layers
        before = len(self.records)
        started = time.perf_counter()
        self.engine.generate(prompts, max_new_tokens=max_new_tokens)
        stats.seconds += time.perf_counter() - started
        for record in self.records[before:]:
            stats.count(record, thresholds_of(record.threshold_version), num_layers)

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


def run_demo(*, quick: bool, serve: bool, port: int, story=None) -> int:
    """Run the story end to end; returns 0 when every step of the loop was seen. `story`: the
    function that tells it on the set-up control plane and runtime (`_story`'s arguments),
    this module's story by default (`exitplane.demo_segments.segments_story`)."""
    import torch

    from runtime import corpus
    from runtime.heads import file_sha256
    from runtime.model import DEFAULT_MODEL, load_model, model_revision

    with socket.socket() as probe:  # a control plane left running would answer instead
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise click.ClickException(f"port {port} is already in use (another exitplane "
                                       "demo or `exitplane up`?); stop it or pass --port")
    # SIGTERM unwinds like Ctrl-C, so the `finally` below stops the processes it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    timeline = Timeline()
    var_dir = Path(os.environ.get("EXITPLANE_VAR_DIR", "var")).resolve()
    demo_dir = var_dir / "demo"
    shutil.rmtree(demo_dir, ignore_errors=True)
    demo_dir.mkdir(parents=True)
    delta, epsilon = 0.05, 0.1
    min_samples = 300 if quick else 600
    env = {**os.environ, "EXITPLANE_VAR_DIR": str(demo_dir), "EXITPLANE_PORT": str(port),
           "EXITPLANE_DRIFT_INTERVAL_S": "5", "EXITPLANE_DRIFT_RECENT_S": "120",
           "EXITPLANE_CALIBRATION_MIN_SAMPLES": str(min_samples),
           "EXITPLANE_CALIBRATION_RETRY_S": "5", "EXITPLANE_CALIBRATION_LOOKBACK_S": "3600",
           # Few samples: a larger share fits the match model the path is drawn from.
           "EXITPLANE_CALIBRATION_LEARN_FRACTION": "0.5",
           "EXITPLANE_LOG_LEVEL": "warning"}
    env.pop("EXITPLANE_DATABASE_URL", None)
    env.pop("EXITPLANE_REDIS_URL", None)
    cp = ControlPlane(demo_dir, port, env)
    cp.cli("db", "upgrade")
    admin = cp.cli("token", "create", "--name", "demo-admin", "--scope", "admin")
    (demo_dir / "admin.token").write_text(admin + "\n")
    cp.start()
    timeline.mark(f"control plane up at {cp.url} (SQLite store, SQLite broker, worker + beat)")
    runtime = None
    try:
        model, tokenizer = load_model(None)
        heads, heads_path, trained = _heads(model, tokenizer, quick, timeline)
        if trained:  # training leaves the model it used behind; serve a fresh copy
            model, tokenizer = load_model(None)
        api = _api(cp, admin)
        api.post("/v1/deployments", json={
            "name": "demo", "model_ref": DEFAULT_MODEL, "head_digest": file_sha256(heads_path),
            "model_revision": model_revision(None),
            "num_layers": len(model.model.layers), "exit_layers": list(heads.exit_layers),
            "signal": "learned", "delta": delta, "epsilon": epsilon,
            "policy": "auto"}).raise_for_status()
        runtime_token = api.post("/v1/tokens", json={
            "name": "demo-runtime", "scope": "runtime",
            "deployment": "demo"}).json()["token"]
        timeline.mark(f"deployment 'demo' created (δ={delta}, ε={epsilon}, policy auto)")
        runtime = Runtime(model=model, heads=heads, cp_url=cp.url, deployment="demo",
                          token=runtime_token, state_dir=demo_dir / "runtime", shadow_rate=1.0)
        tell = story or _story
        return tell(cp=cp, api=api, runtime=runtime, tokenizer=tokenizer, corpus=corpus,
                    timeline=timeline, quick=quick, delta=delta, epsilon=epsilon,
                    min_samples=min_samples,
                    serve=serve)
    finally:
        if runtime is not None:
            runtime.close()
        cp.stop()


def _story(*, cp, api, runtime, tokenizer, corpus, timeline, quick, delta, epsilon,
           min_samples, serve) -> int:
    chat = [corpus.chat_prompt_ids(tokenizer, p)
            for p in corpus.TRAIN_PROMPTS + corpus.HELD_OUT_PROMPTS]
    code = _code_prompts(tokenizer, 64)
    new_tokens = 48 if quick else 64
    phases: list[PhaseStats] = []

    def active_version() -> int:
        return api.get("/v1/deployments/demo").json()["aliases"]["active"]

    known: dict[int, dict[int, float]] = {0: {}}

    def thresholds_of(version: int) -> dict[int, float]:
        if version not in known:
            body = api.get(f"/v1/deployments/demo/threshold-sets/{version}").json()
            known[version] = {int(k): float(v) for k, v in body["thresholds"].items()}
        return known[version]

    def serve_until(stats: PhaseStats, prompts, done, timeout: float) -> bool:
        """Keep serving `prompts` (round robin, 4 at a time) until done() or timeout."""
        deadline = time.monotonic() + timeout
        cursor = 0
        while time.monotonic() < deadline:
            batch = [prompts[(cursor + i) % len(prompts)] for i in range(4)]
            cursor += 4
            runtime.run(stats, batch, new_tokens, thresholds_of)
            if done():
                return True
        return False

    # 1. Chat traffic, all shadow, until a first calibration certifies a version.
    warmup = PhaseStats("A chat: collect shadow samples (never exit)")
    phases.append(warmup)
    version_a = None
    for attempt in range(1, 5):
        serve_until(warmup, chat, lambda n=attempt: warmup.shadow >= n * min_samples + 40, 900)
        runtime.shipper.flush(30)
        job = api.post("/v1/deployments/demo/calibrations", json={
            "reason": f"calibration on chat traffic (attempt {attempt})"}).json()["job"]
        timeline.mark(f"calibration job {job['id']} requested on {warmup.shadow} shadow tokens")
        done = _wait_job(api, job["id"], timeout=300)
        if done.get("result_version") is not None:
            version_a = done["result_version"]
            break
        timeline.mark(f"job {job['id']} published nothing ({done.get('status_reason')}); "
                      "collecting more shadow samples")
    if version_a is None:
        _report(timeline, phases, delta, epsilon)
        return 1
    _wait(lambda: runtime.client.applied_version == version_a, 60, lambda: time.sleep(0.5))
    timeline.mark(f"version {version_a} active and applied by the runtime "
                  f"(expected exit rate {done['summary'].get('exit_rate')})")

    runtime.engine.config.shadow_rate = 0.25
    serving_a = PhaseStats("A chat: early exit (calibrated)")
    phases.append(serving_a)
    serve_until(serving_a, chat, lambda: serving_a.tokens >= (300 if quick else 600), 600)
    timeline.mark(f"chat phase: exit rate {serving_a.exit_rate:.0%}, "
                  f"mean exit layer {serving_a.mean_exit_layer:.1f}, {serving_a.tok_s:.1f} tok/s")

    # 2. The traffic shifts to Python code.
    timeline.mark("workload switches to Python code")
    shifted = PhaseStats("B code: after the shift")
    phases.append(shifted)
    fell_back = serve_until(shifted, code, lambda: active_version() != version_a, 420)
    if not fell_back:
        timeline.mark("no drift reaction within the time limit")
        _report(timeline, phases, delta, epsilon)
        return 1
    alerts = api.get("/v1/alerts", params={"deployment": "demo"}).json()
    fired = ", ".join(sorted({a["kind"] for a in alerts})) or "none listed"
    timeline.mark(f"drift detected ({fired}); conservative set is active "
                  f"(v{active_version()}), recalibration queued")

    runtime.engine.config.shadow_rate = 1.0
    fallback = PhaseStats("B code: conservative fallback (collecting samples)")
    phases.append(fallback)

    waiting_noted: set[int] = set()

    def recalibrated() -> bool:
        version = active_version()
        if version != version_a and api.get(
                f"/v1/deployments/demo/threshold-sets/{version}").json()["origin"] == "calibration":
            return True
        jobs = api.get("/v1/deployments/demo/calibrations").json()
        if jobs and jobs[0]["status"] == "waiting_for_data" and jobs[0]["id"] not in waiting_noted:
            # The alert's job found nothing it can certify on the first code samples; it waits
            # for the window to grow and tries again by itself.
            waiting_noted.add(jobs[0]["id"])
            timeline.mark(f"calibration job {jobs[0]['id']} waits for more code samples "
                          f"({jobs[0]['status_reason'][:70]}...)")
        return False

    if not serve_until(fallback, code, recalibrated, 900):
        timeline.mark("recalibration did not publish within the time limit")
        _report(timeline, phases, delta, epsilon)
        return 1
    version_b = active_version()
    _wait(lambda: runtime.client.applied_version == version_b, 60, lambda: time.sleep(0.5))
    timeline.mark(f"recalibrated version {version_b} active and applied by the runtime")

    runtime.engine.config.shadow_rate = 0.25
    recovered = PhaseStats("B code: recalibrated")
    phases.append(recovered)
    serve_until(recovered, code, lambda: recovered.tokens >= (300 if quick else 600), 600)
    runtime.shipper.flush(30)
    ok = _report(timeline, phases, delta, epsilon)
    if serve:
        hold_ui(cp)
    return 0 if ok else 1


def hold_ui(cp: ControlPlane) -> None:
    """Keep the control plane and its UI up after the summary, until Ctrl-C."""
    click.echo(f"\nThe UI is at {cp.url}/ui (admin token in var/demo/admin.token; create a "
               f"user with `exitplane user create`). Ctrl-C to stop.")
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


def _report(timeline: Timeline, phases: list[PhaseStats], delta: float,
            epsilon: float) -> bool:
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
        disagreement = "-" if p.disagreement is None else f"{p.disagreement:.3f}"
        depth = f"{p.mean_exit_layer:.1f}" if p.served else "full"  # all-shadow: full depth
        click.echo(f"  {p.name:<50}{p.tok_s:>7.1f}{p.exit_rate:>10.1%}{depth:>10}"
                   f"{p.shadow:>8}{disagreement:>9}  {sorted(p.versions)}")
    by_name = {p.name: p for p in phases}
    recovered = by_name.get("B code: recalibrated")
    fallback = by_name.get("B code: conservative fallback (collecting samples)")
    lower = (clopper_pearson(recovered.disagreement or 0.0, recovered.shadow, epsilon)[0]
             if recovered else 1.0)
    ok = bool(recovered and fallback and recovered.exit_rate > fallback.exit_rate
              and lower <= delta)
    click.echo(f"\nloop closed: {'yes' if ok else 'no'} (after recalibration: exit rate "
               f"{recovered.exit_rate if recovered else 0:.1%}, disagreement "
               f"{(recovered.disagreement if recovered else None)}, lower {1 - epsilon:.0%} "
               f"bound {lower:.3f} vs δ {delta})")
    return ok
