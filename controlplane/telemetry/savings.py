"""What early exit saved over a window, measured from what runtimes report (docs/concepts/
savings.md).

The rollups keep, per layer a token left at, the tokens that reported their cost, their summed
wall time and exit checks, and the shadow tokens. A cost model (controlplane/stats/cost_model.py)
is fitted per deployment and lineage (the model revision and exit-heads digest each runtime's
heartbeats name) on the window's timed rows, one group per (runtime, version, segment, layer).
Then, for the tokens asked about (a segment, a runtime, or all):

- full depth: every token at full depth with no checks (tokens x `full_depth_us`);
- spent: measured wall time where tokens were timed, the model's where not;
- net saved = full depth - spent. Exit checks and shadow tokens (full depth, every check) are
  in `spent`, so the net is net of them; a loss is negative, never clipped;
- the split: saved by exits (layers skipped by non-shadow tokens x time per layer), spent on
  checks (non-shadow tokens' checks x time per check), spent on shadow tokens (their checks),
  and what measurement and model disagree on (`unexplained_s`), which make up the net exactly.

Tokens of a lineage without a model of its own are modelled by the deployment's pooled model;
with no model at all the report says why and gives tokens and layers saved only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.deployments.models import Deployment
from controlplane.runtimes.models import Runtime
from controlplane.settings import Settings, get_settings
from controlplane.stats.cost_model import MIN_TIMED_TOKENS, CostModel, fit_cost_model
from controlplane.telemetry.models import Rollup

_SUMMED = ("exits", "timed_tokens", "latency_us", "exit_checks", "shadow_tokens")
_TIME_FIELDS = ("full_depth_s", "spent_s", "net_saved_s", "saved_by_exits_s", "checks_s",
                "shadow_s", "unexplained_s")


@dataclass(frozen=True)
class _Rows:
    """Rollup sums of one deployment per (runtime, version, segment, layer)."""

    runtime_id: list[str]
    segment: list[str]
    layer: np.ndarray
    exits: np.ndarray
    timed_tokens: np.ndarray
    latency_us: np.ndarray
    exit_checks: np.ndarray
    shadow_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.layer)

    def take(self, keep: np.ndarray) -> _Rows:
        picked = np.flatnonzero(keep).tolist()
        return _Rows(**{name: [value[i] for i in picked] if isinstance(value, list)
                        else value[keep] for name, value in vars(self).items()})


def _window_rows(*, session: Session, deployment_ids: Sequence[int], since: datetime,
                 until: datetime | None) -> dict[int, _Rows]:
    """Per deployment its rollup sums over the window (one query, bounded by the keys)."""
    query = (select(Rollup.deployment_id, Rollup.runtime_id, Rollup.version, Rollup.segment,
                    Rollup.layer, *[func.sum(getattr(Rollup, name)).label(name)
                                    for name in _SUMMED])
             .where(Rollup.deployment_id.in_(deployment_ids), Rollup.minute >= since)
             .group_by(Rollup.deployment_id, Rollup.runtime_id, Rollup.version, Rollup.segment,
                       Rollup.layer))
    if until is not None:
        query = query.where(Rollup.minute < until)
    grouped: dict[int, list] = {}
    for row in session.execute(query):
        grouped.setdefault(row.deployment_id, []).append(row)
    return {deployment_id: _Rows(
        runtime_id=[row.runtime_id for row in rows], segment=[row.segment for row in rows],
        layer=np.array([row.layer for row in rows], dtype=np.int64),
        **{name: np.array([int(getattr(row, name) or 0) for row in rows], dtype=np.int64)
           for name in _SUMMED})
        for deployment_id, rows in grouped.items()}


def _lineages(*, session: Session, deployments: Sequence[Deployment]) -> dict[tuple, tuple]:
    """(deployment id, runtime id) -> (model revision, heads digest) as the runtime's
    heartbeats name them; what a runtime leaves unnamed reads as its deployment's."""
    named = {d.id: (d.model_revision or None, d.head_digest or None) for d in deployments}
    rows = session.execute(select(Runtime.deployment_id, Runtime.runtime_id,
                                  Runtime.model_revision, Runtime.head_digest)
                           .where(Runtime.deployment_id.in_(list(named))))
    return {(row.deployment_id, row.runtime_id): (
        row.model_revision or named[row.deployment_id][0],
        row.head_digest or named[row.deployment_id][1]) for row in rows}


def _fit(rows: _Rows, num_layers: int) -> tuple[CostModel | None, str | None]:
    """The cost model of `rows`' timed tokens, or None and why not."""
    timed = rows.timed_tokens > 0
    count = int(rows.timed_tokens.sum())
    model = fit_cost_model(rows.layer[timed], rows.exit_checks[timed], rows.latency_us[timed],
                           rows.timed_tokens[timed], num_layers=num_layers)
    if model is not None:
        return model, None
    if count == 0:
        return None, "no timed tokens in the window: the runtimes report no exit_checks"
    if count < MIN_TIMED_TOKENS:
        return None, f"{count} timed tokens in the window, fewer than {MIN_TIMED_TOKENS}"
    if len(np.unique(rows.layer[timed])) < 2:
        return None, "timed tokens at one depth only: the time per layer is not identified"
    per_token = rows.exit_checks[timed] / rows.timed_tokens[timed]
    design = np.column_stack([np.ones(len(per_token)), rows.layer[timed], per_token])
    if per_token.any() and np.linalg.matrix_rank(design) < 3:
        return None, ("exit checks per token vary only with depth: the time per check cannot "
                      "be told from the time per layer and the overhead")
    return None, "the timed tokens show no time per layer (wall time does not grow with depth)"


def _checks_per_token(rows: _Rows, exit_layers: Sequence[int]) -> np.ndarray:
    """Per row, the exit checks of one of its tokens: measured where timed, else one check per
    exit layer at or below the depth it left at."""
    assumed = np.searchsorted(np.sort(np.asarray(exit_layers)), rows.layer, side="right")
    measured = rows.exit_checks / np.maximum(rows.timed_tokens, 1)
    return np.where(rows.timed_tokens > 0, measured, assumed).astype(float)


def _time(rows: _Rows, models: list[CostModel], exit_layers: Sequence[int],
          num_layers: int) -> dict[str, float]:
    """The time figures (seconds) of rows, `models[i]` the model of row i."""
    overhead, layer_us, check_us = (np.array([getattr(m, name) for m in models], dtype=float)
                                    for name in ("overhead_us", "layer_us", "check_us"))
    full_depth_us = overhead + layer_us * num_layers
    per_token = _checks_per_token(rows, exit_layers)
    untimed = rows.exits - rows.timed_tokens
    modelled = overhead + layer_us * rows.layer + check_us * per_token
    spent = float((rows.latency_us + untimed * modelled).sum())
    full = float((rows.exits * full_depth_us).sum())
    served = rows.exits - rows.shadow_tokens  # shadow tokens left at full depth
    shadow_checks = rows.shadow_tokens * len(exit_layers)
    checks = np.maximum(rows.exits * per_token - shadow_checks, 0.0)
    by_exits = float((layer_us * (num_layers - rows.layer) * served).sum())
    on_checks = float((check_us * checks).sum())
    on_shadow = float((check_us * shadow_checks).sum())
    net = full - spent
    figures = {"full_depth_s": full, "spent_s": spent, "net_saved_s": net,
               "saved_by_exits_s": by_exits, "checks_s": on_checks, "shadow_s": on_shadow,
               "unexplained_s": net - (by_exits - on_checks - on_shadow)}
    return {name: value / 1e6 for name, value in figures.items()}


def _money(time: dict[str, float] | None, settings: Settings) -> dict | None:
    if time is None:
        return None
    rate = settings.accelerator_hour_cost
    names = ("full_depth_s", "spent_s", "net_saved_s")
    return {"unit": settings.accelerator_cost_unit, "per_accelerator_hour": rate,
            **{name.removesuffix("_s") + "_hours": time[name] / 3600 for name in names},
            **{name.removesuffix("_s"): time[name] / 3600 * rate for name in names}}


def _verdict(time: dict[str, float] | None) -> dict:
    """Speed-up and whether early exit paid, from the time figures (None: no model)."""
    if time is None:
        return {"speedup": None, "pays": None}
    spent = time["spent_s"]
    return {"speedup": time["full_depth_s"] / spent if spent > 0 else None,
            "pays": time["net_saved_s"] > 0}


def deployment_report(*, deployment: Deployment, rows: _Rows | None,
                      lineage_of: dict[tuple, tuple], segment: str | None,
                      runtime_id: str | None, settings: Settings) -> dict:
    """The savings of one deployment over the rows of its window."""
    num_layers, exit_layers = deployment.num_layers, list(deployment.exit_layers)
    rows = rows if rows is not None else _Rows([], [], *(np.zeros(0, dtype=np.int64),) * 6)
    named = (deployment.model_revision or None, deployment.head_digest or None)
    lineage = [lineage_of.get((deployment.id, runtime), named) for runtime in rows.runtime_id]
    pooled, pooled_reason = _fit(rows, num_layers)
    fitted = []
    for key in sorted(set(lineage), key=str):
        own, reason = _fit(rows.take(np.array([item == key for item in lineage], dtype=bool)),
                           num_layers)
        fitted.append((key, own, reason))
    keep = np.ones(len(rows), dtype=bool)
    if segment is not None:
        keep &= np.array([name == segment for name in rows.segment], dtype=bool)
    if runtime_id is not None:
        keep &= np.array([name == runtime_id for name in rows.runtime_id], dtype=bool)
    asked = rows.take(keep)
    model_of = {key: own or pooled for key, own, _ in fitted}
    row_models = [model_of[key] for key, kept in zip(lineage, keep.tolist(), strict=True)
                  if kept]
    covered = np.array([model is not None for model in row_models], dtype=bool)
    tokens = int(asked.exits.sum())
    depth = float((asked.exits * asked.layer).sum())
    time = _time(asked.take(covered), [m for m in row_models if m is not None], exit_layers,
                 num_layers) if covered.any() else None
    main = max(fitted, key=lambda item: (item[1] is not None, item[1].tokens if item[1] else 0),
               default=None)
    model = main[1] if main and main[1] else pooled
    return {
        "deployment": deployment.name, "num_layers": num_layers,
        "segment": segment, "runtime_id": runtime_id,
        "tokens": tokens, "timed_tokens": int(asked.timed_tokens.sum()),
        "shadow_tokens": int(asked.shadow_tokens.sum()),
        "modelled_tokens": int(asked.exits[covered].sum()),
        "layers_saved": int(((num_layers - asked.layer)
                             * (asked.exits - asked.shadow_tokens)).sum()),
        "layer_speedup": num_layers * tokens / depth if depth > 0 else None,
        "cost_model": model.as_dict() if model else None,
        "cost_model_reason": None if model else (main[2] if main else pooled_reason),
        "cost_models": [{"model_revision": key[0], "head_digest": key[1],
                         "model": own.as_dict() if own else None, "reason": reason}
                        for key, own, reason in fitted],
        "time": time, **_verdict(time), "cost": _money(time, settings)}


def savings(*, session: Session, deployments: Sequence[Deployment], since: datetime,
            until: datetime | None = None, segment: str | None = None,
            runtime_id: str | None = None, settings: Settings | None = None) -> list[dict]:
    """One savings report per deployment over [since, until) (deployment_report)."""
    settings = settings or get_settings()
    if not deployments:
        return []
    rows = _window_rows(session=session, deployment_ids=[d.id for d in deployments],
                        since=since, until=until)
    lineage_of = _lineages(session=session, deployments=deployments)
    return [deployment_report(deployment=deployment, rows=rows.get(deployment.id),
                              lineage_of=lineage_of, segment=segment, runtime_id=runtime_id,
                              settings=settings) for deployment in deployments]


def fleet_total(reports: Sequence[dict], settings: Settings | None = None) -> dict:
    """The sum of deployments' reports: counts add up; time figures over the deployments
    with a model (their tokens are `modelled_tokens`)."""
    settings = settings or get_settings()
    timed = [report["time"] for report in reports if report["time"] is not None]
    time = {name: sum(item[name] for item in timed) for name in _TIME_FIELDS} if timed else None
    counts = {name: sum(report[name] for report in reports)
              for name in ("tokens", "timed_tokens", "shadow_tokens", "modelled_tokens",
                           "layers_saved")}
    return {"deployments": len(reports), **counts, "time": time, **_verdict(time),
            "cost": _money(time, settings)}
