"""The control plane's HTTP API, composed: the app and its state, the layers in front of
FastAPI (request context, pull and telemetry fast paths, body gate), error handling, probes and
the domains' routers (the admin UI is mounted on it by the composition root, `exitplane.app`)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import redis
import redis.asyncio
from anyio import to_thread
from fastapi import FastAPI
from sqlalchemy.engine import Engine

from controlplane import collector, observability
from controlplane.alerts.api import router as alerts_router
from controlplane.auth.deps import PrincipalCache, token_reader
from controlplane.auth.service import digest
from controlplane.auth.users_api import router as users_router
from controlplane.coordination.bus import Bus
from controlplane.db import get_engine, session_factory
from controlplane.deployments.api import router as deployments_router
from controlplane.deployments.audit_api import router as audit_router
from controlplane.deployments.cache import DeploymentCache
from controlplane.deployments.delivery import ConfigDelivery
from controlplane.deployments.tokens_api import router as auth_router
from controlplane.edge.body import BodySizeLimit
from controlplane.edge.front import ControlPlaneAPI, RequestContext
from controlplane.edge.handlers import install_exception_handlers
from controlplane.edge.openapi import documenting_our_validation_errors, serve_docs
from controlplane.edge.probes import add_probes
from controlplane.edge.pull_fast_path import NotModifiedFastPath
from controlplane.edge.telemetry_fast_path import TelemetryFastPath
from controlplane.flows import fallback
from controlplane.flows.api import router as calibration_router
from controlplane.flows.curve_api import router as curve_router
from controlplane.flows.removal_api import router as removal_router
from controlplane.guards.route_guard import RouteGuard, install_guards
from controlplane.keys import weak_secret_problem
from controlplane.memory import return_large_blocks_to_the_os
from controlplane.runtimes.api import router as runtimes_router
from controlplane.runtimes.beats import HeartbeatBuffer
from controlplane.runtimes.outlier_api import router as outliers_router
from controlplane.runtimes.witnesses import ClaimCache
from controlplane.settings import Settings, get_settings
from controlplane.telemetry.api import router as telemetry_router
from controlplane.telemetry.gauges import store_collector
from controlplane.telemetry.savings_api import router as savings_router
from controlplane.telemetry.service import ensure_partitions
from exitplane import __version__
from exitplane.kit import tracing
from exitplane.kit.logs import access_log_enabled

log = logging.getLogger("exitplane.api")


def create_api(settings: Settings | None = None, engine: Engine | None = None) -> FastAPI:
    """Build the API for `settings` (default: the environment's), optionally on `engine`."""
    settings = settings or get_settings()
    problem = weak_secret_problem(settings, settings.host)
    if problem:
        raise RuntimeError(problem)
    engine = engine or get_engine(settings.effective_database_url)
    factory = session_factory(engine)
    fallback.install()  # alerts this process fires get the automatic fallback
    return_large_blocks_to_the_os()  # controlplane/memory.py: freed bodies and hashes

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await to_thread.run_sync(_prepare_store, factory)
        app.state.bus.start()
        collector.freeze_startup()  # controlplane/collector.py: the pull tail at fleet load
        async with (observability.loop_lag_watcher(),
                    collector.scheduled_full_collections(settings.api_gc_full_interval_s)):
            yield
        app.state.bus.close()
        app.state.config_delivery.close()
        await to_thread.run_sync(app.state.heartbeats.close)

    app = ControlPlaneAPI(title="exitplane control plane", version=__version__,
                          lifespan=lifespan, docs_url=None, redoc_url=None)
    app.openapi = documenting_our_validation_errors(app.openapi, app)
    serve_docs(app)
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = factory
    store_collector.bind(factory)  # /metrics reads alert-rule gauges from this store
    # Whatever limits, revokes or wakes up is shared by every API process (Redis, else the
    # store's epochs); see controlplane/coordination/.
    # Without Redis the bus polls the store's epochs, except on SQLite: the embedded default
    # runs one API process (told in process), and every SQLite transaction takes the write
    # lock; there a second process still honours the token cache's maximum age.
    polled = factory if engine.dialect.name != "sqlite" else None
    app.state.bus = Bus(redis_url=settings.redis_url, session_factory=polled,
                        epoch_poll_s=settings.revocation_poll_s)
    app.state.principal_cache = PrincipalCache(settings.token_cache_ttl_s,
                                               load=token_reader(factory))
    app.state.bus.subscribe("revocation", app.state.principal_cache.on_revocation)
    install_guards(app, settings)  # rate limiters, refusal hold, read turns, decode budget
    app.state.config_delivery = ConfigDelivery(
        factory, settings.config_cache_ttl_s, bus=app.state.bus,
        long_polls_per_token=settings.long_polls_per_token)
    app.state.deployment_cache = DeploymentCache(factory)  # the stream path's batch checks
    app.state.bus.subscribe("config", app.state.deployment_cache.forget)
    app.state.heartbeats = HeartbeatBuffer(factory, interval_s=settings.heartbeat_flush_s)
    app.state.runtime_claims = ClaimCache()  # which runtime ids each token reports under
    # Bounded waits: a Redis that is away answers 503 quickly instead of holding a worker thread.
    app.state.redis = (redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2,
                                            socket_timeout=5)
                       if settings.redis_url else None)

    # An asyncio client for what the event loop sends itself (the telemetry fast path).
    app.state.redis_async = (redis.asyncio.Redis.from_url(
        settings.redis_url, socket_connect_timeout=2, socket_timeout=5)
        if settings.redis_url else None)

    if settings.telemetry_fast_path:  # inside the body gate: its limits stay the gate's
        app.add_middleware(TelemetryFastPath, threads=settings.telemetry_threads)
    app.add_middleware(BodySizeLimit, settings=settings)
    fast_pull = {"delivery": app.state.config_delivery, "principals": app.state.principal_cache,
                 "digest": digest, "limiters": app.state.rate_limiters, "settings": settings,
                 "route": next(route for route in deployments_router.routes
                               if route.path == "/v1/deployments/{name}/thresholds")}
    if tracing.enabled():  # every request a span: the pull's fast path inside the tracing layer
        app.add_middleware(NotModifiedFastPath, **fast_pull)
        behind_context = app.behind_front
    else:
        behind_context = NotModifiedFastPath(app.behind_front, **fast_pull)
    # Outermost: request id, access log and duration cover every layer below.
    access_lines = settings.access_log if settings.access_log is not None \
        else access_log_enabled(settings.environment)
    app.front = RequestContext(behind_context, access_log=access_lines)
    if not tracing.enabled() and not access_lines:
        # A plain 304 pull is answered before the context, with its request id and duration.
        app.front = NotModifiedFastPath(app.front, **fast_pull, front=True)

    install_exception_handlers(app)
    store_collector.ttl = settings.metrics_cache_ttl_s

    add_probes(app, settings, engine)

    tracing.instrument_app(app, engine)  # OpenTelemetry, when OTEL_* configures it
    # Every route takes its rate as the policy table says (controlplane/guards/policy.py).
    for router in (deployments_router, runtimes_router, auth_router, telemetry_router,
                   alerts_router, calibration_router, outliers_router, curve_router,
                   savings_router, audit_router, removal_router, users_router):
        app.include_router(router, dependencies=[RouteGuard])
    return app


def _prepare_store(factory) -> None:
    """Create the coming days' telemetry partitions (PostgreSQL); a failure only logs."""
    try:
        with factory() as session:
            ensure_partitions(session=session)
            session.commit()
    except Exception as error:  # the API must start even when the store is briefly away
        log.warning("could not prepare telemetry partitions: %s", error)
