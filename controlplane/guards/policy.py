"""The front door's rules, one entry per route: which bucket a request takes from and what it
costs, whether it is a heavy read, whether its refusals are held, how large its body may be,
whether it decodes under the telemetry decode budget and whether its body is read before or
after its caller is checked.

API:

- `POLICIES`: (method, route template) -> `RoutePolicy`, templates as FastAPI names them
  (`/v1/deployments/{name}/thresholds`). Every route of the API has exactly one entry
  (tests/controlplane/guards/test_policy.py), so a new route cannot be forgotten.
- `policy_for(method, template)`: the entry of a routed request (`scope["route"].path`), or
  `UNLISTED` for what the table does not name (a 404, the API reference's assets, the admin UI).
- `match(method, path)`: for code that runs before routing (the body gate, the fast paths),
  which sees a raw path: the `RouteMatch` (its policy, the template, the path parameters such
  as the deployment's `name`), or None when no route of the table has that method and path.
- `body_limit(policy, settings)`: the body limit in bytes, read from the settings field the
  entry names (`CONTROL_BODY` or `TELEMETRY_BODY`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

Bucket = Literal["pull", "ingest", "heartbeat", "read"]

# Units a read takes from its token's "read" bucket before it runs: a lookup by key one, a
# read that scans telemetry, rollups, logs or history, or renders a report, this many.
HEAVY_READ_COST = 5
# The settings fields of the two body limits: kilobytes for control routes (nothing there
# needs more), the telemetry batch limit for telemetry posts.
CONTROL_BODY = "max_control_body_bytes"
TELEMETRY_BODY = "max_body_bytes"


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """How the guards treat requests to one route.

    `bucket`: the token bucket a request takes `cost` units from before the route runs (None:
    none). `heavy`: a heavy read (its token's heavy-read turns, and time owed at the heavy
    rate). `held`: a refusal past its bucket, or past a cap on the runtimes it registers, is
    answered after the refusal hold (EXITPLANE_RATE_LIMIT_HOLD_S). `body_limit`: the settings
    field of its body limit (None: no body is read). `decode_budget`: its body decodes under
    the process's telemetry decode budget. `body_after_auth`: its caller is checked from the
    headers before the body is read (the body gate counts the body as the route reads it)."""

    method: str
    template: str
    bucket: Bucket | None = None
    cost: int = 0
    heavy: bool = False
    held: bool = False
    body_limit: str | None = None
    decode_budget: bool = False
    body_after_auth: bool = False


class RouteMatch(NamedTuple):
    """A raw request path matched to its route: the policy and the path parameters."""

    policy: RoutePolicy
    params: dict[str, str]

    @property
    def template(self) -> str:
        return self.policy.template


def _read(template: str, *, heavy: bool = False) -> RoutePolicy:
    return RoutePolicy("GET", template, bucket="read", cost=HEAVY_READ_COST if heavy else 1,
                       heavy=heavy, held=True)


def _control(method: str, template: str) -> RoutePolicy:
    return RoutePolicy(method, template, body_limit=CONTROL_BODY)


def _open(template: str) -> RoutePolicy:
    """A GET outside every bucket (health, metrics)."""
    return RoutePolicy("GET", template)


_DEPLOYMENT = "/v1/deployments/{name}"

_ENTRIES = (
    # health and metrics: no token, no bucket
    _open("/metrics"),
    _open("/healthz"),
    _open("/readyz"),
    _open("/docs"),  # the API reference page (its assets are static files)
    # deployments, threshold sets, aliases, audit, declared segments
    _control("POST", "/v1/deployments"),
    _read("/v1/deployments"),
    _read(_DEPLOYMENT),
    _control("PATCH", _DEPLOYMENT),
    _control("DELETE", _DEPLOYMENT),
    _control("POST", f"{_DEPLOYMENT}/threshold-sets"),
    _read(f"{_DEPLOYMENT}/threshold-sets", heavy=True),
    _read(f"{_DEPLOYMENT}/threshold-sets/{{version}}"),
    _control("PUT", f"{_DEPLOYMENT}/aliases/{{alias}}"),
    _control("DELETE", f"{_DEPLOYMENT}/aliases/{{alias}}"),
    _control("POST", f"{_DEPLOYMENT}/rollback"),
    _read(f"{_DEPLOYMENT}/audit", heavy=True),
    _read(f"{_DEPLOYMENT}/declared-segments"),
    _control("PUT", f"{_DEPLOYMENT}/declared-segments/{{segment}}"),
    _control("DELETE", f"{_DEPLOYMENT}/declared-segments/{{segment}}"),
    # the runtime's config pull: a bucket of its own
    RoutePolicy("GET", f"{_DEPLOYMENT}/thresholds", bucket="pull", cost=1, held=True),
    # runtimes: heartbeats, leaving, the fleet
    RoutePolicy("POST", f"{_DEPLOYMENT}/heartbeats", bucket="heartbeat", cost=1, held=True,
                body_limit=CONTROL_BODY, body_after_auth=True),
    RoutePolicy("POST", f"{_DEPLOYMENT}/runtimes/{{runtime_id}}/leave", bucket="heartbeat",
                cost=1, held=True, body_limit=CONTROL_BODY),
    _read(f"{_DEPLOYMENT}/runtimes", heavy=True),
    _control("DELETE", f"{_DEPLOYMENT}/runtimes/{{runtime_id}}"),
    _control("DELETE", f"{_DEPLOYMENT}/runtimes"),
    _read(f"{_DEPLOYMENT}/runtime-outliers"),
    _control("POST", f"{_DEPLOYMENT}/runtime-outliers/{{outlier_id}}/clear"),
    # tokens
    _control("POST", "/v1/tokens"),
    _read("/v1/tokens"),
    _read("/v1/audit", heavy=True),
    _control("DELETE", "/v1/tokens/{token_id}"),
    # users of the admin UI
    _read("/v1/users"),
    _control("POST", "/v1/users"),
    _read("/v1/users/{username}"),
    _control("PATCH", "/v1/users/{username}"),
    # telemetry: batches in, rollup reads out
    RoutePolicy("POST", "/v1/telemetry", bucket="ingest", cost=1, held=True,
                body_limit=TELEMETRY_BODY, decode_budget=True, body_after_auth=True),
    _read(f"{_DEPLOYMENT}/telemetry/exit-rates", heavy=True),
    _read(f"{_DEPLOYMENT}/telemetry/disagreement", heavy=True),
    _read(f"{_DEPLOYMENT}/telemetry/signal-histogram", heavy=True),
    _read(f"{_DEPLOYMENT}/telemetry/count", heavy=True),
    _read(f"{_DEPLOYMENT}/segments", heavy=True),
    _read(f"{_DEPLOYMENT}/savings", heavy=True),
    _read("/v1/savings", heavy=True),
    # alerts and hooks
    _read("/v1/alerts", heavy=True),
    _read("/v1/alerts/{alert_id}"),
    _control("POST", "/v1/alerts/{alert_id}/ack"),
    _control("POST", "/v1/alerts/{alert_id}/resolve"),
    _read("/v1/alerts/{alert_id}/report", heavy=True),
    _read("/v1/alerts/{alert_id}/deliveries", heavy=True),
    _read("/v1/hooks"),
    _control("POST", "/v1/hooks"),
    _read("/v1/hooks/{hook_id}"),
    _control("PATCH", "/v1/hooks/{hook_id}"),
    _control("DELETE", "/v1/hooks/{hook_id}"),
    _control("POST", "/v1/hooks/{hook_id}/test"),
    _read("/v1/hooks/{hook_id}/deliveries", heavy=True),
    # calibration and canaries
    _control("POST", f"{_DEPLOYMENT}/calibrations"),
    _read(f"{_DEPLOYMENT}/calibrations", heavy=True),
    _read(f"{_DEPLOYMENT}/calibrations/{{job_id}}", heavy=True),
    _control("POST", f"{_DEPLOYMENT}/calibrations/{{job_id}}/approve"),
    _control("POST", f"{_DEPLOYMENT}/calibrations/{{job_id}}/reject"),
    # the operating curve: what-if evaluates stored evidence (a heavy read sent as a POST)
    RoutePolicy("POST", f"{_DEPLOYMENT}/what-if", bucket="read", cost=HEAVY_READ_COST,
                heavy=True, held=True, body_limit=CONTROL_BODY),
    _read(f"{_DEPLOYMENT}/operating-curve"),
    _read(f"{_DEPLOYMENT}/answers", heavy=True),
    _read(f"{_DEPLOYMENT}/canary", heavy=True),
    _control("POST", f"{_DEPLOYMENT}/canary"),
    _control("POST", f"{_DEPLOYMENT}/canary/promote"),
    _control("POST", f"{_DEPLOYMENT}/canary/revert"),
)


def _table(entries: tuple[RoutePolicy, ...]) -> dict[tuple[str, str], RoutePolicy]:
    table: dict[tuple[str, str], RoutePolicy] = {}
    for entry in entries:
        key = (entry.method, entry.template)
        if key in table:
            raise ValueError(f"two policies for {entry.method} {entry.template}")
        table[key] = entry
    return table


POLICIES: dict[tuple[str, str], RoutePolicy] = _table(_ENTRIES)

# What the table does not name: no bucket, the control-body limit.
UNLISTED = RoutePolicy("", "", body_limit=CONTROL_BODY)


def policy_for(method: str, template: str) -> RoutePolicy:
    """The policy of a routed request by its method and route template (UNLISTED if none)."""
    return POLICIES.get((method, template), UNLISTED)


def _segments(template: str) -> tuple[str | None, ...]:
    """A template's path segments, None where a parameter stands."""
    return tuple(None if part.startswith("{") else part for part in template.split("/"))


# (method, number of segments) -> [(segments, parameter names, policy)], static entries first
# so that a fixed segment wins over a parameter in the same place.
_BY_SHAPE: dict[tuple[str, int], list[tuple[tuple[str | None, ...], tuple[str, ...],
                                            RoutePolicy]]] = {}
for _policy in _ENTRIES:
    _parts = _segments(_policy.template)
    _names = tuple(part.strip("{}") for part in _policy.template.split("/")
                   if part.startswith("{"))
    _BY_SHAPE.setdefault((_policy.method, len(_parts)), []).append((_parts, _names, _policy))
for _candidates in _BY_SHAPE.values():
    _candidates.sort(key=lambda candidate: candidate[0].count(None))


def match(method: str, path: str) -> RouteMatch | None:
    """The route a raw request path (without the root path) names, as routing will find it;
    None when no entry has this method and path. A parameter matches one non-empty segment."""
    parts = path.split("/")
    for template, names, policy in _BY_SHAPE.get((method, len(parts)), ()):
        values = []
        for fixed, part in zip(template, parts, strict=True):
            if fixed is None:
                if not part:
                    break
                values.append(part)
            elif fixed != part:
                break
        else:
            return RouteMatch(policy, dict(zip(names, values, strict=True)))
    return None


def body_limit(policy: RoutePolicy, settings) -> int:
    """The body limit of `policy`'s route in bytes, from `settings` (the control-body limit
    where the entry names none)."""
    return getattr(settings, policy.body_limit or CONTROL_BODY)
