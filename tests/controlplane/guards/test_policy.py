"""The guards' policy table: one entry for every route of the API, none for a route that does
not exist, and the raw-path lookup finds the route routing finds."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute, iter_route_contexts

from controlplane.guards.policy import (
    CONTROL_BODY,
    POLICIES,
    TELEMETRY_BODY,
    UNLISTED,
    body_limit,
    match,
    policy_for,
)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from controlplane.edge.app import create_api
    from controlplane.settings import Settings

    folder = tmp_path_factory.mktemp("policy")
    return create_api(Settings(database_url=f"sqlite:///{folder}/store.db",
                               var_dir=folder / "var"))


def _routes(api) -> list[APIRoute]:
    return [context.original_route for context in iter_route_contexts(api.routes)
            if isinstance(context.original_route, APIRoute)]


def _operations(api) -> list[tuple[str, str]]:
    return [(method, route.path) for route in _routes(api) for method in sorted(route.methods)]


def test_every_route_has_exactly_one_policy(api):
    operations = _operations(api)
    assert len(operations) == len(set(operations))
    assert sorted(set(operations) - set(POLICIES)) == [], "routes without a policy"
    assert sorted(set(POLICIES) - set(operations)) == [], "policies of no route"


def _filled(template: str) -> tuple[str, dict[str, str]]:
    params = {part.strip("{}"): f"v{i}" for i, part in enumerate(template.split("/"))
              if part.startswith("{")}
    return template.format(**params), params


def test_match_finds_the_route_routing_finds(api):
    routes = _routes(api)
    for (method, template), policy in POLICIES.items():
        path, params = _filled(template)
        found = match(method, path)
        assert found is not None and found.policy is policy, (method, path)
        assert found.template == template and found.params == params
        scope = {"type": "http", "method": method, "path": path, "root_path": ""}
        routed = next(route for route in routes if route.matches(scope)[0].name == "FULL")
        assert routed.path == template, (method, path)


def test_match_refuses_what_no_route_takes():
    assert match("GET", "/v1/deployments/fleet/thresholds").params == {"name": "fleet"}
    assert match("POST", "/v1/deployments/fleet/thresholds") is None
    assert match("GET", "/v1/deployments//thresholds") is None
    assert match("GET", "/v1/deployments/a/b/thresholds") is None
    assert match("POST", "/v1/telemetry/more") is None
    assert match("GET", "/ui/deployments") is None


def test_the_table_says_what_each_kind_of_route_gets():
    pull = policy_for("GET", "/v1/deployments/{name}/thresholds")
    assert (pull.bucket, pull.cost, pull.held, pull.heavy) == ("pull", 1, True, False)
    telemetry = policy_for("POST", "/v1/telemetry")
    assert (telemetry.bucket, telemetry.body_limit, telemetry.decode_budget,
            telemetry.body_after_auth) == ("ingest", TELEMETRY_BODY, True, True)
    beat = policy_for("POST", "/v1/deployments/{name}/heartbeats")
    assert (beat.bucket, beat.body_limit, beat.body_after_auth) == \
        ("heartbeat", CONTROL_BODY, True)
    audit = policy_for("GET", "/v1/deployments/{name}/audit")
    assert (audit.bucket, audit.heavy, audit.cost) == ("read", True, 5)
    assert policy_for("GET", "/v1/deployments").cost == 1
    assert policy_for("GET", "/nowhere") is UNLISTED
    for (method, _), policy in POLICIES.items():
        assert (policy.body_limit is None) == (method == "GET")
        assert policy.held == (policy.bucket is not None)


def test_body_limits_come_from_the_settings_the_table_names():
    from controlplane.settings import Settings

    settings = Settings(max_control_body_bytes=1000, max_body_bytes=5000)
    assert body_limit(policy_for("POST", "/v1/telemetry"), settings) == 5000
    assert body_limit(policy_for("POST", "/v1/deployments"), settings) == 1000
    assert body_limit(UNLISTED, settings) == 1000
