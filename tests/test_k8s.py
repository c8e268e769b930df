"""deploy/k8s: every manifest validates offline against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail), the pieces an operator needs are there (API, ingest, worker,
beat, runtime, migrations Job, bootstrap Job, probes, secrets by reference, a heads-provisioning
init container), and the commands they run are the commands docker-compose.yml runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.test_compose import COMPOSE, _exitplane_invocations, _parse

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
VERSION = "1.37.0"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
DOCS = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]
# The only differences allowed: service names on the cluster network.
HOSTS = {"http://exitplane-api:8000": "http://api:8000"}


def _by(kind: str, component: str) -> dict:
    [found] = [d for d in DOCS if d["kind"] == kind
               and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return found


def _pod(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, VERSION, strict=True)


@pytest.mark.slow
def test_broken_manifests_are_caught():
    """The check above can fail: a typo'd field and a wrong type are refused."""
    api = next(yaml.safe_load_all((K8S / "api.yaml").read_text()))
    api["spec"]["replicaz"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, VERSION, strict=True)
    api = next(yaml.safe_load_all((K8S / "api.yaml").read_text()))
    api["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, VERSION, strict=True)


def test_kustomization_applies_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]


def test_the_pieces_an_operator_needs():
    for component in ("api", "ingest", "worker", "beat"):
        assert _by("Deployment", component)
    assert _by("Deployment", "beat")["spec"]["replicas"] == 1
    assert _by("Deployment", "beat")["spec"]["strategy"]["type"] == "Recreate"
    assert _pod(_by("Job", "migrate"))["containers"][0]["command"] == ["exitplane", "db",
                                                                       "upgrade"]
    for kind, component in (("Deployment", "api"), ("StatefulSet", "runtime")):
        container = _pod(_by(kind, component))["containers"][0]
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    runtime = _pod(_by("StatefulSet", "runtime"))
    [init] = runtime["initContainers"]
    assert init["command"][:3] == ["exitplane", "runtime", "provision"]
    served = runtime["containers"][0]["command"]
    assert init["command"][init["command"].index("--heads") + 1] == \
        served[served.index("--heads") + 1]
    # Secrets by reference only; the runtime never sees the database credentials.
    for doc in DOCS:
        if doc["kind"] == "ConfigMap":
            assert not any(re.search(r"SECRET|PASSWORD|DATABASE_URL", key) for key in doc["data"])
    for component in ("api", "ingest", "worker", "beat"):
        sources = _pod(_by("Deployment", component))["containers"][0]["envFrom"]
        assert {"secretRef": {"name": "exitplane-secrets"}} in sources
    assert "envFrom" not in runtime["containers"][0]
    [token] = [v for v in runtime["volumes"] if v["name"] == "token"]
    assert token["secret"]["secretName"] == "exitplane-runtime-token"


def _compose_invocations() -> set[str]:
    found = set()
    for service in COMPOSE["services"].values():
        command = service.get("command", [])
        if isinstance(command, list):  # compose's ${NAME:-default} with its defaults
            command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", word) for word in command]
        for args in _exitplane_invocations(command):
            found.add(shlex.join(args))
    return found


def _k8s_invocations() -> set[str]:
    found = set()
    for doc in DOCS:
        if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        pod = _pod(doc)
        for container in pod.get("initContainers", []) + pod["containers"]:
            words = [HOSTS.get(word, word) for word in container["command"]]
            for args in _exitplane_invocations(words):
                _parse(list(args))  # a real command with real options
                found.add(shlex.join(args))
    return found


def test_the_manifests_run_the_commands_compose_runs():
    compose, k8s = _compose_invocations(), _k8s_invocations()
    assert k8s <= compose, k8s - compose
    # The runtime's token is the one step done by hand on Kubernetes (into a Secret).
    assert {c for c in compose - k8s if not c.startswith("token create")} == set()
    assert len(k8s) == 8
