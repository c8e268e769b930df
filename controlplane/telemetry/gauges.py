"""Store-backed gauges for Prometheus: what `dashboards/prometheus/alerts.yml` alerts on.

Read from the store at scrape time, so every API replica exports the same values whichever
process ingested the telemetry. Every query over them (dashboard, rules) first collapses the
replicas with `max by` the family's own labels, and only then sums or counts: a sum or count over
the raw series would count each value once per API replica.

- exitplane_exit_rate{deployment,layer}: conditional exit rate of the active version over the
  last `WINDOW` (exits / tokens that reached the layer); exitplane_tokens_checked: that
  denominator, so rules can ignore thin traffic
- exitplane_shadow_disagreement{deployment}, exitplane_shadow_tokens, and
  exitplane_disagreement_target (the deployment's δ)
- exitplane_last_ingest_timestamp_seconds{deployment}
- the fleet view, one series per runtime: exitplane_fleet_runtime_last_seen_timestamp_seconds
  {deployment,runtime}, exitplane_fleet_runtime_behind_active (1 when it applies neither the
  active nor the canary version), exitplane_fleet_runtime_applied_version,
  exitplane_fleet_runtime_spooled_batches and exitplane_fleet_runtime_dropped_records_total
  (from the runtime's last heartbeat, whichever process took it); runtimes silent for a day, or
  deleted, are left out: their series disappear. The `fleet_` prefix keeps them apart from the
  runtime server's own exitplane_runtime_* families (one process, no runtime label)
- exitplane_alerts_open{deployment,kind,severity,segment}
- exitplane_mean_exit_depth{deployment} and exitplane_estimated_speedup{deployment} (layers a
  token ran through on average over the last `WINDOW`, active version; speed-up = num_layers /
  mean depth, the estimate calibration reports)
- exitplane_net_seconds_saved_last_hour{deployment}: what early exit saved over the last hour
  (telemetry/savings.py), net of exit checks and shadow tokens; negative when it cost time
- exitplane_shadow_requests{deployment,segment}: complete shadow requests of the active version
  over the last `ANSWER_WINDOW` (trust-filtered, `telemetry.shadow_requests`, each witness cut
  to its share like every answer figure, `ShadowRequests.capped`), and
  exitplane_answer_identical_share{deployment,segment}: the share of them whose whole answer
  under the active set (each request under its segment's thresholds) is the full-depth answer
  (`ShadowRequests.divergence_by_segment`); no series for a deployment without such requests

The exit-behaviour gauges (exit_rate, tokens_checked, shadow_disagreement, shadow_tokens,
mean_exit_depth, estimated_speedup) and the answer gauges carry a `segment` label: segment=""
is the whole deployment (Prometheus drops empty labels, so rules that name no segment read it),
and a deployment that knows traffic segments also gets one series per registered segment and
`default`, at most EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT + 1 of them. The rules select
{segment=""} for the deployment and {segment!=""} for its segments.

The /metrics route runs the collection off the event loop; the values are cached for `ttl`
seconds (EXITPLANE_METRICS_CACHE_TTL_S) so frequent scrapes cost one set of queries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from datetime import timedelta

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from controlplane import metrics
from controlplane.alerts.models import Alert
from controlplane.db import utcnow
from controlplane.deployments.models import Alias, Deployment, DeploymentSegment
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.deployments.service import get_threshold_set
from controlplane.runtimes.models import Runtime
from controlplane.runtimes.service import FORGET_AFTER
from controlplane.settings import get_settings
from controlplane.stats.robust_evidence import EvidencePolicy
from controlplane.telemetry.models import Rollup, TelemetryBatchRow
from controlplane.telemetry.savings import savings
from controlplane.telemetry.shadow_requests import shadow_request_evidence
from exitplane.wire import DEFAULT_SEGMENT

log = logging.getLogger("exitplane.metrics")

WINDOW = timedelta(minutes=5)
SAVINGS_WINDOW = timedelta(hours=1)
# Shadow requests are a small share of the traffic: the answer gauges read the last hour's,
# at most ANSWER_MAX_REQUESTS of the newest per deployment.
ANSWER_WINDOW = timedelta(hours=1)
ANSWER_MAX_REQUESTS = 5000
# The segment label of a series about the whole deployment: empty, which Prometheus treats as
# no label, so a rule that names no segment (or selects {segment=""}) reads it.
WHOLE_DEPLOYMENT = ""


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    specs = {
        "exit_rate": ("Conditional exit rate of the active version over the last 5 minutes",
                      ["deployment", "layer", "segment"]),
        "tokens_checked": ("Tokens that reached the layer in the last 5 minutes (active version)",
                           ["deployment", "layer", "segment"]),
        "shadow_disagreement": ("Shadow tokens the active policy would have answered "
                                "differently from full depth, last 5 minutes",
                                ["deployment", "segment"]),
        "shadow_tokens": ("Shadow tokens in the last 5 minutes (active version)",
                          ["deployment", "segment"]),
        "disagreement_target": ("The deployment's maximum disagreement δ", ["deployment"]),
        "active_version": ("Threshold version the active alias points at", ["deployment"]),
        "last_ingest_timestamp_seconds": ("When the last telemetry batch was stored",
                                          ["deployment"]),
        "fleet_runtime_last_seen_timestamp_seconds": ("A runtime's last heartbeat",
                                                      ["deployment", "runtime"]),
        "fleet_runtime_behind_active": ("1 when a runtime applies neither the active nor the "
                                        "canary version", ["deployment", "runtime"]),
        "fleet_runtime_applied_version": ("Threshold version a runtime applies (last "
                                          "heartbeat)", ["deployment", "runtime"]),
        "fleet_runtime_spooled_batches": ("Telemetry batches a runtime holds on disk (last "
                                          "heartbeat)", ["deployment", "runtime"]),
        "alerts_open": ("Open (firing or acknowledged) alerts; segment is empty for the "
                        "default segment's", ["deployment", "kind", "severity", "segment"]),
        "mean_exit_depth": ("Mean layers run per token, last 5 minutes (active version)",
                            ["deployment", "segment"]),
        "estimated_speedup": ("num_layers / mean exit depth, last 5 minutes (active version)",
                              ["deployment", "segment"]),
        "shadow_requests": ("Complete shadow requests of the active version in the last hour",
                            ["deployment", "segment"]),
        "answer_identical_share": ("Share of the last hour's shadow requests whose whole answer "
                                   "under the active set equals the full-depth answer",
                                   ["deployment", "segment"]),
        "net_seconds_saved_last_hour": ("Accelerator seconds early exit saved against full "
                                        "depth over the last hour, net of exit checks and "
                                        "shadow tokens (negative: a loss; no series without "
                                        "a cost model)", ["deployment"]),
    }
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        name: GaugeMetricFamily(f"exitplane_{name}", doc, labels=labels)
        for name, (doc, labels) in specs.items()}
    # A runtime's own cumulative count, relayed by its heartbeats (a restart starts it at 0
    # again, which rate() reads as a counter reset).
    families["fleet_runtime_dropped_records"] = CounterMetricFamily(
        "exitplane_fleet_runtime_dropped_records",
        "Telemetry records a runtime dropped since it started (last heartbeat)",
        labels=["deployment", "runtime"])
    return families


class StoreCollector(Collector):
    """Collects the gauges above from the store of the most recently bound session factory."""

    def __init__(self) -> None:
        self._factory = None
        self.ttl = 0.0
        self._cached: tuple[float, list[GaugeMetricFamily]] | None = None
        self._lock = threading.Lock()

    def bind(self, factory) -> None:
        with self._lock:
            self._factory = factory
            self._cached = None

    def describe(self):
        return list(_families().values())

    def collect(self):
        with self._lock:  # one scrape at a time queries the store; the others reuse its values
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] > self.ttl:
                self._cached = (now, self._collect_now())
            families = self._cached[1]
        yield from families

    def _collect_now(self) -> list[GaugeMetricFamily]:
        families = _families()
        if self._factory is not None:
            try:
                with self._factory() as session:
                    _fill(session, families)
            except Exception as error:  # a scrape must not fail because the store is away
                log.warning("store metrics unavailable: %s", error)
                families = _families()
        return list(families.values())


def _fill(session, families: dict[str, GaugeMetricFamily]) -> None:
    now = utcnow()
    deployments = {d.id: d for d in session.scalars(select(Deployment))}
    # Every deployment's counters exist at 0 from the scrape after it was created on: a rate
    # over them then sees its first batch (prime is idempotent and costs a dict lookup each).
    metrics.prime(deployments=[d.name for d in deployments.values()])
    aliases: dict[int, dict[str, int]] = defaultdict(dict)
    for row in session.execute(select(Alias.deployment_id, Alias.name, Alias.version)):
        aliases[row.deployment_id][row.name] = row.version
    for deployment in deployments.values():
        active = aliases[deployment.id].get("active")
        families["disagreement_target"].add_metric([deployment.name], deployment.delta)
        if active is not None:
            families["active_version"].add_metric([deployment.name], active)

    _fill_exit_behaviour(session, families, deployments, aliases, now)
    _fill_answers(session, families, deployments, aliases, now)

    for report in savings(session=session, deployments=list(deployments.values()),
                          since=now - SAVINGS_WINDOW):
        if report["time"] is not None:
            families["net_seconds_saved_last_hour"].add_metric(
                [report["deployment"]], report["time"]["net_saved_s"])

    for row in session.execute(select(TelemetryBatchRow.deployment_id,
                                      func.max(TelemetryBatchRow.received_at).label("last"))
                               .group_by(TelemetryBatchRow.deployment_id)):
        if row.deployment_id in deployments and row.last is not None:
            last = row.last if row.last.tzinfo else row.last.replace(tzinfo=now.tzinfo)
            families["last_ingest_timestamp_seconds"].add_metric(
                [deployments[row.deployment_id].name], last.timestamp())

    for runtime in session.scalars(select(Runtime).where(
            Runtime.last_seen >= now - FORGET_AFTER)):
        deployment = deployments.get(runtime.deployment_id)
        if deployment is None:
            continue
        labels = [deployment.name, runtime.runtime_id]
        families["fleet_runtime_last_seen_timestamp_seconds"].add_metric(
            labels, runtime.last_seen.timestamp())
        current = {aliases[deployment.id].get("active"), aliases[deployment.id].get("canary")}
        families["fleet_runtime_behind_active"].add_metric(
            labels, 0.0 if runtime.applied_version in current else 1.0)
        if runtime.applied_version is not None:
            families["fleet_runtime_applied_version"].add_metric(labels, runtime.applied_version)
        families["fleet_runtime_spooled_batches"].add_metric(labels, runtime.spooled_batches)
        families["fleet_runtime_dropped_records"].add_metric(labels, runtime.dropped_records)

    for row in session.execute(select(Alert.deployment_id, Alert.kind, Alert.severity,
                                      Alert.segment, func.count().label("n"))
                               .where(Alert.open_key.is_not(None))
                               .group_by(Alert.deployment_id, Alert.kind, Alert.severity,
                                         Alert.segment)):
        if row.deployment_id in deployments:
            # An empty label is no label to Prometheus: a default alert's series is unchanged.
            segment = "" if row.segment == DEFAULT_SEGMENT else row.segment
            families["alerts_open"].add_metric(
                [deployments[row.deployment_id].name, row.kind, row.severity, segment], row.n)


def _fill_exit_behaviour(session, families: dict[str, GaugeMetricFamily],
                         deployments: dict[int, Deployment],
                         aliases: dict[int, dict[str, int]], now) -> None:
    """The exit-behaviour gauges of each deployment's active version over the last WINDOW:
    the whole deployment under segment="" (Prometheus stores an empty label as no label, so
    these are the series a deployment without segments exports) and, for a deployment that
    knows segments, one series per registered segment and `default`. Rollup rows of any other
    name count only in the whole-deployment series, so the cardinality is bounded by the
    registry cap."""
    segmented: dict[int, set[str]] = defaultdict(set)
    for row in session.execute(select(DeploymentSegment.deployment_id, DeploymentSegment.name)
                               .where(DeploymentSegment.removed_at.is_(None))):
        segmented[row.deployment_id].add(row.name)
    rollups = session.execute(
        select(Rollup.deployment_id, Rollup.version, Rollup.segment, Rollup.layer,
               func.sum(Rollup.tokens).label("tokens"), func.sum(Rollup.exits).label("exits"),
               func.sum(Rollup.shadow_total).label("shadow"),
               func.sum(Rollup.policy_mismatches).label("mismatches"))
        .where(Rollup.minute >= now - WINDOW)
        .group_by(Rollup.deployment_id, Rollup.version, Rollup.segment, Rollup.layer))
    # (deployment id, segment label) -> layer -> [tokens, exits, shadow, mismatches]
    sums: dict[tuple[int, str], dict[int, list[int]]] = defaultdict(
        lambda: defaultdict(lambda: [0, 0, 0, 0]))
    for row in rollups:
        deployment = deployments.get(row.deployment_id)
        if deployment is None or row.version != aliases[deployment.id].get("active"):
            continue
        if row.layer not in deployment.exit_layers:
            continue
        labels = [WHOLE_DEPLOYMENT]
        known = segmented.get(deployment.id)
        if known and (row.segment in known or row.segment == DEFAULT_SEGMENT):
            labels.append(row.segment)
        for label in labels:
            counts = sums[deployment.id, label][row.layer]
            for i, value in enumerate((row.tokens, row.exits, row.shadow, row.mismatches)):
                counts[i] += int(value or 0)
    for (deployment_id, segment), by_layer in sorted(sums.items()):
        deployment = deployments[deployment_id]
        first = deployment.exit_layers[0]
        exits_total = exited_layers = mismatches = 0
        for layer, (tokens, exits, _, layer_mismatches) in sorted(by_layer.items()):
            labels = [deployment.name, str(layer), segment]
            families["tokens_checked"].add_metric(labels, tokens)
            if tokens:
                families["exit_rate"].add_metric(labels, exits / tokens)
            exits_total += exits
            exited_layers += exits * layer
            mismatches += layer_mismatches
        # Every token reaches the first exit layer; a shadow token is labelled there once.
        tokens, _, shadow, _ = by_layer.get(first, [0, 0, 0, 0])
        labels = [deployment.name, segment]
        if tokens:
            mean = (exited_layers + (tokens - exits_total) * deployment.num_layers) / tokens
            families["mean_exit_depth"].add_metric(labels, mean)
            families["estimated_speedup"].add_metric(labels, deployment.num_layers / mean)
        families["shadow_tokens"].add_metric(labels, shadow)
        if shadow:
            families["shadow_disagreement"].add_metric(labels, mismatches / shadow)


def _fill_answers(session, families: dict[str, GaugeMetricFamily],
                  deployments: dict[int, Deployment], aliases: dict[int, dict[str, int]],
                  now) -> None:
    """The answer gauges of each deployment's active version over the last ANSWER_WINDOW, with
    the segment labels of the exit-behaviour gauges (`_fill_exit_behaviour`)."""
    segmented: dict[int, set[str]] = defaultdict(set)
    for row in session.execute(select(DeploymentSegment.deployment_id, DeploymentSegment.name)
                               .where(DeploymentSegment.removed_at.is_(None))):
        segmented[row.deployment_id].add(row.name)
    policy = EvidencePolicy.from_settings(get_settings())
    for deployment in deployments.values():
        active = aliases[deployment.id].get("active")
        if active is None:
            continue
        layers = sorted(deployment.exit_layers)
        evidence = shadow_request_evidence(
            session=session, deployment_id=deployment.id, width=len(layers),
            since=now - ANSWER_WINDOW, version=active, limit=ANSWER_MAX_REQUESTS)
        if not len(evidence):
            continue
        # the same cut as the answers panel and the drift check (seed 0): one witness that
        # floods shadow requests moves the gauge no more than its share
        evidence = evidence.capped(policy, seed=0)
        threshold_set = get_threshold_set(session=session, deployment=deployment,
                                          version=active)
        same = evidence.divergence_by_segment(
            lambda name, chosen=threshold_set, order=layers:
            [thresholds_for(chosen, name)[k] for k in order]) < 0
        # label -> [requests, identical]
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        known = segmented.get(deployment.id)
        for segment, identical in zip(evidence.segments, same.tolist(), strict=True):
            labels = [WHOLE_DEPLOYMENT]
            if known and (segment in known or segment == DEFAULT_SEGMENT):
                labels.append(segment)
            for label in labels:
                counts[label][0] += 1
                counts[label][1] += int(identical)
        for label, (requests, identical) in sorted(counts.items()):
            families["shadow_requests"].add_metric([deployment.name, label], requests)
            families["answer_identical_share"].add_metric([deployment.name, label],
                                                          identical / requests)


store_collector = StoreCollector()
metrics.registry.register(store_collector)
