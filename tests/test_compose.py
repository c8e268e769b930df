"""docker-compose.yml cannot be started here (no Docker engine), so check what can be checked:
the services and health checks, that no secret is baked in, and that every `exitplane`
command a service runs exists in the CLI and accepts its options."""

import re
from pathlib import Path

import yaml

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
    assert "exitplane bootstrap deployment --name ${EXITPLANE_DEPLOYMENT:-chat}" in bootstrap
    assert "--deployment ${EXITPLANE_DEPLOYMENT:-chat} --out " + \
        served[served.index("--token-file") + 1] in bootstrap


def test_every_service_command_exists_in_the_cli():
    seen = set()
    for service in COMPOSE["services"].values():
        for args in exitplane_invocations(service.get("command", [])):
            parse_invocation(args)  # the command exists and takes these options
            seen.add(" ".join(next(iter([args[:i] for i, w in enumerate(args)
                                         if w.startswith("-")]), args)))
    assert seen == {"db upgrade", "up", "ingest", "worker", "beat", "runtime serve",
                    "bootstrap deployment", "bootstrap token", "runtime provision"}


def _override(name: str) -> dict:
    return yaml.safe_load((Path(__file__).parent.parent / name).read_text())


def test_the_runtime_keeps_its_id_across_restarts():
    """`exitplane runtime serve` keeps its id in --state-dir/runtime-id unless given one: the
    compose runtime's state dir is a named volume (a restart or a re-created container finds
    the id there), with the opt-in override too, and no fixed id is set that a second runtime
    could share."""
    runtime = COMPOSE["services"]["runtime"]
    for override in ("docker-compose.runtime-public.yml",):
        merged = {**runtime, **_override(override)["services"]["runtime"]}
        command = merged["command"]
        assert "--runtime-id" not in command
        assert "EXITPLANE_RUNTIME_ID" not in merged.get("environment", {})
        state = command[command.index("--state-dir") + 1]
        volumes = {entry.split(":")[1]: entry.split(":")[0] for entry in merged["volumes"]}
        assert state in volumes, f"--state-dir {state} is not on a volume"
        assert volumes[state] in COMPOSE["volumes"]  # named (not a bind mount, not anonymous)
        assert not volumes[state].startswith((".", "/"))
    # the state is the runtime's own: no other long-running service writes to it
    for name, service in COMPOSE["services"].items():
        if name not in ("runtime", "heads"):  # heads provisions into it, once, before
            assert not any(str(v).startswith("runtime-state:") for v in
                           service.get("volumes", [])), name
