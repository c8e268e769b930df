"""The `exitplane` command: the control plane's processes (up, worker, beat, ingest), the
database and bootstrap commands (cli_db.py), the operator commands over the API (ops/), the
demo, and (lazily) the runtime."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
from contextlib import contextmanager

import click

from exitplane.cli_db import DeprecatedCommand, db, register_database_commands
from exitplane.ops import register as register_operator_commands
from exitplane.ops.api import fail as _fail
from exitplane.ops.api import moment as _moment


class LazyGroup(click.Group):
    """A group whose commands live in a module imported only when used (torch is heavy)."""

    def __init__(self, *args, target: str, extra: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._target = target
        self._extra = extra

    def _load(self) -> click.Group:
        module_name, _, attribute = self._target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise click.ClickException(
                f"{error}; install the extra with: pip install 'exitplane[{self._extra}]'"
            ) from error
        return getattr(module, attribute)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return self._load().list_commands(ctx)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load().get_command(ctx, name)


def _database_problem(error: Exception) -> str | None:
    """One line for an error that says the database cannot be reached or opened, or holds no
    exitplane schema yet, else None."""
    if type(error).__module__ != "sqlalchemy.exc" or type(error).__name__ not in (
            "OperationalError", "InterfaceError", "ProgrammingError"):
        return None
    from controlplane.settings import get_settings

    reason = (str(getattr(error, "orig", None) or error).strip().splitlines() or ["?"])[0]
    if "no such table" in reason or ("relation" in reason and "does not exist" in reason):
        return (f"the database at {_redact(get_settings().effective_database_url)} is not "
                f"migrated ({reason}): run `exitplane db upgrade` first (`exitplane up` "
                "migrates before serving)")
    if type(error).__name__ == "ProgrammingError":
        return None
    return (f"cannot reach the database at {_redact(get_settings().effective_database_url)}: "
            f"{reason}")


class _Main(click.Group):
    """The root group: a bad EXITPLANE_* setting or an unreachable database ends any command
    with one line, not a trace."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Exception as error:
            problem = _database_problem(error)
            if problem:
                _fail(problem)
            if type(error).__name__ != "ValidationError" or "Settings" not in str(error):
                raise
            first = error.errors()[0]  # type: ignore[attr-defined]
            name = "EXITPLANE_" + "_".join(str(p) for p in first["loc"]).upper()
            _fail(f"invalid setting {name}: {first['msg']}")


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="exitplane", prog_name="exitplane",
                      help="Print the installed version and exit.")
def main() -> None:
    """exitplane: control plane for early-exit language models."""


main.add_command(LazyGroup("runtime", target="runtime.cli:runtime_cli", extra="runtime",
                           help="Early-exit runtime: generate, train heads, benchmark."))


main.add_command(db)
register_database_commands(main)
register_operator_commands(main)


@main.command()
@click.option("--host", default=None, help="default: EXITPLANE_HOST or 127.0.0.1")
@click.option("--port", type=int, default=None, help="default: EXITPLANE_PORT or 8000")
@click.option("--migrate/--no-migrate", default=True, show_default=True,
              help="apply database migrations before serving")
@click.option("--workers/--no-workers", default=None,
              help="also run a Celery worker and beat as subprocesses "
                   "(default: on in the embedded environment)")
def up(host: str | None, port: int | None, migrate: bool, workers: bool | None) -> None:
    """Run the control plane API (migrating the database first), with worker and beat."""
    from controlplane.keys import secret_key, weak_secret_problem
    from controlplane.settings import get_settings

    settings = get_settings()
    _configure_logging("api", settings)
    problem = weak_secret_problem(settings, host or settings.host)
    if problem:
        _fail(problem)
    secret_key(settings)  # generated now, before the worker and beat read it
    if migrate:
        _migrate(settings.effective_database_url)
    if workers is None:
        workers = settings.environment == "embedded"
    with background_workers(enabled=workers):
        serve_api(host=host, port=port, migrate=False)


@main.command()
@click.option("--loglevel", default=None,
              help="debug, info, warning or error (default: EXITPLANE_LOG_LEVEL, else info)")
@click.option("--concurrency", type=int, default=None,
              help="prefork worker processes (default: the solo pool, one task at a time)")
def worker(loglevel: str | None, concurrency: int | None) -> None:
    """Run a Celery worker: drift detection, alert delivery, recalibration, retention."""
    from workers.app import app

    pool = [f"--concurrency={concurrency}", "--pool=prefork"] if concurrency else ["--pool=solo"]
    app.worker_main([*_celery_options(), "worker", f"--loglevel={_loglevel(loglevel)}", *pool])


@main.command()
@click.option("--loglevel", default=None,
              help="debug, info, warning or error (default: EXITPLANE_LOG_LEVEL, else info)")
def beat(loglevel: str | None) -> None:
    """Run Celery beat: drift checks every 30 s, stale runtimes, canaries, daily retention."""
    from workers.app import app

    app.start([*_celery_options(), "beat", f"--loglevel={_loglevel(loglevel)}"])


def _loglevel(given: str | None) -> str:
    from controlplane.settings import get_settings

    return given or get_settings().log_level


def _celery_options() -> list[str]:
    """Celery's plain-text start banners stay off where the logs are JSON (one object a line).
    Logging is set up now, for what Celery warns before its own setup (the workers' signal
    sets it up again with the level chosen)."""
    from controlplane.settings import get_settings
    from exitplane.kit.logs import log_format

    settings = get_settings()
    _configure_logging("beat" if "beat" in sys.argv else "worker", settings)
    try:
        fmt = log_format(settings.environment, settings.log_format)
    except ValueError as error:
        _fail(str(error))
    return ["--quiet"] if fmt == "json" else []


@contextmanager
def background_workers(*, enabled: bool):
    """A worker and beat as subprocesses for the embedded default, stopped on the way out."""
    if not enabled:
        yield
        return
    import signal
    import subprocess

    # uvicorn re-raises the SIGTERM it caught after shutting down; as SystemExit it unwinds
    # through the `finally` below instead of killing us with the children still running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Quieter than the API unless EXITPLANE_LOG_LEVEL says otherwise.
    level = [] if os.environ.get("EXITPLANE_LOG_LEVEL") else ["--loglevel=warning"]
    processes = [subprocess.Popen([sys.executable, "-m", "exitplane.cli", name, *level])
                 for name in ("worker", "beat")]
    logging.getLogger("exitplane.api").info("exitplane worker (pid %d) and beat (pid %d) started",
                                            processes[0].pid, processes[1].pid)
    try:
        yield
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@main.command()
@click.option("--quick", is_flag=True, help="a shorter run (fewer tokens per phase)")
@click.option("--serve/--no-serve", default=True, show_default=True,
              help="keep the control plane and its UI up after the summary")
@click.option("--port", type=int, default=8000, show_default=True,
              help="port of the control plane and its UI")
@click.option("--story", type=click.Choice(["default", "segments"]), default="default",
              show_default=True, help="segments: chat and code as two traffic segments; a drift "
              "within code falls back and recalibrates code alone")
@click.option("--throttle", type=click.FloatRange(min=1.0), default=1.0, show_default=True,
              help="run the runtime at 1/F of its speed (it sleeps F-1 times each step's time), "
              "as on a machine that gives it a fraction of its CPU; phases wait for the "
              "evidence they need, however long it takes")
def demo(quick: bool, serve: bool, port: int, story: str, throttle: float) -> None:
    """The whole loop on the real model: calibrate, shift, fall back, recalibrate, recover."""
    from exitplane.demo import run_demo
    from exitplane.demo_segments import segments_story

    told = segments_story if story == "segments" else None
    sys.exit(run_demo(quick=quick, serve=serve, port=port, story=told, throttle=throttle))


def _lower_priority(nice: int) -> None:
    """Run this process at `nice` (EXITPLANE_INGEST_NICE) unless it already runs lower; a
    process only ever gives priority away here."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > current:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        logging.getLogger("exitplane.ingest").info("running at nice %d", nice)


@main.command()
@click.option("--name", default=None, help="consumer name (default: host-pid)")
@click.option("--claim-idle-ms", default=30_000, show_default=True,
              help="reclaim entries another consumer left pending this long")
def ingest(name: str | None, claim_idle_ms: int) -> None:
    """Production ingest worker: Redis stream -> store (needs EXITPLANE_REDIS_URL)."""
    import signal
    import socket
    import threading

    import redis
    from sqlalchemy import select

    from controlplane.db import session_factory
    from controlplane.deployments.models import Deployment
    from controlplane.settings import get_settings
    from controlplane.telemetry.service import ensure_partitions
    from controlplane.telemetry.stream import StreamIngestor

    settings = get_settings()
    if not settings.redis_url:
        _fail("EXITPLANE_REDIS_URL is not set; the embedded default writes telemetry directly")
    _configure_logging("ingest", settings)
    from controlplane.db import get_engine
    from exitplane.kit.tracing import configure_tracing, instrument_engine

    if configure_tracing("exitplane-ingest"):
        instrument_engine(get_engine(settings.effective_database_url))
    _lower_priority(settings.ingest_nice)
    factory = session_factory()
    with factory() as session:
        ensure_partitions(session=session)
        session.commit()
        deployments = session.scalars(select(Deployment.name)).all()
    if settings.worker_metrics_port:  # ingested/duplicate counts and stream lag live here
        from prometheus_client import start_http_server

        from controlplane.metrics import prime, registry

        prime(deployments=deployments)  # the counters exist at 0 before the first batch

        start_http_server(settings.worker_metrics_port, registry=registry)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    consumer = StreamIngestor(redis.Redis.from_url(settings.redis_url), factory,
                              name=name or f"{socket.gethostname()}-{os.getpid()}",
                              claim_idle_ms=claim_idle_ms)
    logging.getLogger("exitplane.ingest").info("ingest worker %s reading telemetry streams",
                                               consumer.name)
    heartbeat = None
    if settings.heartbeat_file:  # a cycle: a blocking read (1 s), then a write to the store
        from exitplane.kit.liveness import promise

        heartbeat = lambda: promise(settings.heartbeat_file, 120.0)  # noqa: E731
    consumer.run_forever(stop, each_cycle=heartbeat)


@main.command("dead-letters")
@click.option("--replay", is_flag=True,
              help="move them back to their streams for the ingest workers to read again")
@click.option("--id", "entry_ids", multiple=True, help="only this entry (repeatable)")
def dead_letters(replay: bool, entry_ids: tuple[str, ...]) -> None:
    """Telemetry batches the ingest workers could not store (needs EXITPLANE_REDIS_URL): one
    line each (entry, deployment, kind, batch id, why); --replay after fixing the cause."""
    import redis

    from controlplane.settings import get_settings
    from controlplane.telemetry import stream

    settings = get_settings()
    if not settings.redis_url:
        _fail("EXITPLANE_REDIS_URL is not set; without Redis batches are stored or refused "
              "by the API and never dead-lettered")
    client = redis.Redis.from_url(settings.redis_url)
    try:
        if replay:
            moved = stream.replay_dead_letters(client, list(entry_ids) or None)
            click.echo(f"moved {moved} entries back to their streams")
            return
        for letter in stream.dead_letters(client):
            if not entry_ids or letter.entry_id in entry_ids:
                click.echo("\t".join((letter.entry_id, letter.deployment, letter.kind,
                                      letter.batch_id, letter.error)))
    except redis.RedisError as error:
        _fail(f"Redis at {_redact(settings.redis_url)}: {error}")
    finally:
        client.close()


@main.command(cls=DeprecatedCommand,
              instead="`exitplane calibrations start DEPLOYMENT --wait` (over the API)")
@click.option("--deployment", required=True, help="the deployment to recalibrate")
@click.option("--since", default=None,
              help="window start: ISO time (UTC if no offset) or an age like 30m, 6h, 2d "
                   "(default: EXITPLANE_CALIBRATION_LOOKBACK_S ago)")
@click.option("--until", default=None, help="window end, same forms (default: now)")
@click.option("--reason", default="requested from the command line", show_default=True,
              help="why, for the audit log")
@click.option("--enqueue", is_flag=True, help="hand the job to the workers instead of "
                                              "running it here")
@click.option("--segment", default=None, help="recalibrate this traffic segment alone (its "
                                              "shadow tokens, its map); default: all")
def calibrate(deployment: str, since: str | None, until: str | None, reason: str,
              enqueue: bool, segment: str | None) -> None:
    """Deprecated: recalibrate a deployment's thresholds on its recent shadow samples, in
    this process, with database access. Over the API: `exitplane calibrations start`."""
    import json

    from controlplane.calibration.models import CalibrationJob
    from controlplane.calibration.service import (
        CalibrationPolicy,
        calibrate_window,
        request_calibration,
        start_job,
    )
    from controlplane.db import session_scope
    from controlplane.deployments.service import get_deployment
    from controlplane.errors import DomainError
    from controlplane.flows.recalibration import apply_outcome, read_window
    from controlplane.settings import get_settings

    settings = get_settings()
    policy = CalibrationPolicy.from_settings(settings)
    try:
        window = [_moment(value) if value else None for value in (since, until)]
        with session_scope() as session:
            target = get_deployment(session=session, name=deployment, lock=True)
            job, created = request_calibration(
                session=session, deployment=target, actor="cli", trigger="manual",
                since=window[0], until=window[1], reason=reason, policy=policy,
                enqueue=enqueue, segment=segment)
            job_id = job.id
        if not created:
            click.echo(f"calibration job {job_id} is already open; continuing it", err=True)
        if enqueue:
            click.echo(json.dumps({"job": job_id, "status": "queued"}))
            return
        with session_scope() as session:
            start_job(session=session, job=session.get(CalibrationJob, job_id))
        # The worker's three steps (short transactions around the slow middle one), each a
        # step of the bar the operator watches.
        with click.progressbar(length=3, label="calibrating", file=sys.stderr,
                               item_show_func=lambda step: step) as bar:
            bar.update(0, "reading shadow samples")
            with session_scope() as session:
                window = read_window(session=session, job=session.get(CalibrationJob, job_id),
                                     seed=policy.seed)
            bar.update(1, "selecting thresholds")
            result = calibrate_window(window, policy) if window is not None else None
            bar.update(1, "recording and publishing")
            with session_scope() as session:
                job = session.get(CalibrationJob, job_id)
                if result is not None:
                    job = apply_outcome(session=session, job=job, outcome=result, policy=policy)
                bar.update(1, "done")
                outcome = {"job": job.id, "status": job.status, "reason": job.status_reason,
                           "version": job.result_version, "promotion": job.promotion,
                           "thresholds": job.summary.get("thresholds"),
                           "exit_rate": job.summary.get("exit_rate"),
                           "risk_bound": job.summary.get("risk_bound")}
                if job.segment is not None or "segments" in job.summary:
                    outcome |= {"segment": job.segment,
                                "segments": job.summary.get("segments")}
    except (DomainError, ValueError) as error:
        _fail(str(error))
    click.echo(json.dumps(outcome, indent=2))
    if outcome["status"] == "waiting_for_data":
        click.echo(f"job {outcome['job']} stays open: the workers retry it, or rerun this "
                   "command once more shadow samples arrived", err=True)
    if outcome["status"] == "failed":
        sys.exit(1)


def serve_api(*, host: str | None, port: int | None, migrate: bool) -> None:
    import uvicorn

    from controlplane.settings import get_settings
    from exitplane.app import create_app

    settings = get_settings()
    _configure_logging("api", settings)
    from exitplane.kit.tracing import configure_tracing

    configure_tracing("exitplane-api")
    if migrate:
        _migrate(settings.effective_database_url)
    host = host or settings.host
    port = port or settings.port
    logging.getLogger("exitplane.api").info(
        "exitplane control plane listening on http://%s:%s (API docs: http://%s:%s/docs; "
        "store: %s)", host, port, host, port, _redact(settings.effective_database_url))
    app = create_app(settings)
    # What is alive now (modules, ORM metadata, routes) lives as long as the process. Frozen,
    # it is not walked by every full collection while requests allocate
    # (docs/concepts/api-process.md).
    gc.freeze()
    # Our handler and the request-context middleware log access lines (with request ids);
    # uvicorn's own config would install a second, differently shaped handler.
    # proxy_headers=False: uvicorn would take X-Forwarded-For from any loopback peer; the app
    # reads it from EXITPLANE_TRUSTED_PROXIES only (controlplane/auth/clients.py).
    uvicorn.run(app, host=host, port=port, log_level=settings.log_level, log_config=None,
                access_log=False, proxy_headers=False)


def _configure_logging(process_name: str, settings) -> None:
    from exitplane.kit.logs import configure_logging

    try:
        configure_logging(process_name, level=settings.log_level, fmt=settings.log_format,
                          environment=settings.environment)
    except ValueError as error:
        _fail(str(error))


def _migrate(url: str) -> None:
    from controlplane.migrate import upgrade

    upgrade(url)


def _redact(url: str) -> str:
    """Hide the password in a database URL."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":
    main()
