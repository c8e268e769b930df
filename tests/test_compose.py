"""docker-compose.yml cannot be started here (no Docker engine), so check what can be checked:
the services and health checks, that no secret is baked in, and that every `exitplane`
command a service runs exists in the CLI and accepts its options."""

import re
from pathlib import Path

from tests.support.compose import COMPOSE, exitplane_invocations, parse_invocation


def test_the_production_services_are_all_there_with_health_checks():
    services = COMPOSE["services"]
    assert set(services) == {"postgres", "redis", "api", "bootstrap", "heads", "ingest", "worker",
                             "beat", "runtime"}
    for name in ("postgres", "redis", "api", "runtime"):
        assert "healthcheck" in services[name], name
    assert services["api"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "exitplane db upgrade" in services["api"]["command"][2]  # migrations first


def test_no_secret_is_baked_in():
    text = (Path(__file__).parent.parent / "docker-compose.yml").read_text()
    env = COMPOSE["x-controlplane-env"]
    assert env["EXITPLANE_SECRET_KEY"].startswith("${EXITPLANE_SECRET_KEY:?")
    assert "POSTGRES_PASSWORD:?" in env["EXITPLANE_DATABASE_URL"]
    assert env["EXITPLANE_ENVIRONMENT"] == "production"
    assert not re.search(r"(?i)(password|secret|token)\s*[:=]\s*[A-Za-z0-9]{12,}", text)
    # The runtime's token is written by the bootstrap step into a volume only the two mount,
    # read-only on the runtime's side.
    runtime = COMPOSE["services"]["runtime"]
    token = runtime["command"][runtime["command"].index("--token-file") + 1]
    assert token.startswith("/var/lib/exitplane-bootstrap/")
    assert "bootstrap:/var/lib/exitplane-bootstrap:ro" in runtime["volumes"]
    assert "bootstrap:/var/lib/exitplane-bootstrap" in COMPOSE["services"]["bootstrap"]["volumes"]


def test_the_runtime_starts_from_nothing():
    """One-shot steps provision what the runtime needs; it waits for them to succeed."""
    services = COMPOSE["services"]
    waits = services["runtime"]["depends_on"]
    assert waits["heads"]["condition"] == "service_completed_successfully"
    assert waits["bootstrap"]["condition"] == "service_completed_successfully"
    for one_shot in ("heads", "bootstrap"):
        assert services[one_shot]["restart"] == "no", one_shot
    heads = services["heads"]["command"]
    served = services["runtime"]["command"]
    # the file the provisioning step fills is the file the runtime serves with, on its volume
    assert heads[heads.index("--heads") + 1] == served[served.index("--heads") + 1]
    assert services["heads"]["volumes"] == ["runtime-state:/var/lib/exitplane-runtime"]
    bootstrap = services["bootstrap"]["command"][2]
    assert "exitplane deployment ensure --name ${EXITPLANE_DEPLOYMENT:-chat}" in bootstrap
    assert "--deployment ${EXITPLANE_DEPLOYMENT:-chat} --out " + \
        served[served.index("--token-file") + 1] in bootstrap


def test_every_service_command_exists_in_the_cli():
    seen = set()
    for service in COMPOSE["services"].values():
        for args in exitplane_invocations(service.get("command", [])):
            seen.add(parse_invocation(args).name)
    assert seen >= {"upgrade", "up", "ingest", "worker", "beat", "serve", "ensure", "create",
                    "provision"}
