"""The alert reaction registry: the API and the Celery worker install the automatic
fallback for the kinds it answers and its recheck of a spike seen again; the alerts domain runs
what is registered, in order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from controlplane.alerts import reactions
from controlplane.alerts.kinds import AlertKind

ROOT = Path(__file__).resolve().parents[3]
FALLBACK_KINDS = {"quality_regression", "answer_regression", "exit_rate_spike",
                  "exit_rate_collapse"}
# In a fresh interpreter (the registry is per process): build the app, print what is registered.
PROBE = """
import json, sys
from controlplane.alerts import reactions
from controlplane.alerts.kinds import AlertKind
from controlplane.flows.fallback import react_to_alert, recheck_spike
before = {{k.value: len(reactions.reactions_for(k)) + len(reactions.rechecks_for(k))
          for k in AlertKind}}
{build}
print(json.dumps({{"before": before, "after": {{k.value: [f is react_to_alert
    for f in reactions.reactions_for(k)] for k in AlertKind}},
    "rechecks": {{k.value: [f is recheck_spike for f in reactions.rechecks_for(k)]
                 for k in AlertKind if reactions.rechecks_for(k)}}}}))
"""


def _registered_after(build: str, tmp_path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "EXITPLANE_VAR_DIR": str(tmp_path / "var"),
           "EXITPLANE_DATABASE_URL": f"sqlite:///{tmp_path / 'probe.db'}"}
    run = subprocess.run([sys.executable, "-c", PROBE.format(build=build)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _assert_fallback_installed(found: dict) -> None:
    assert set(found["before"].values()) == {0}  # nothing is registered by importing alone
    assert {kind for kind, registered in found["after"].items() if registered} == FALLBACK_KINDS
    for kind in FALLBACK_KINDS:
        assert found["after"][kind] == [True]  # the fallback, once
    assert found["after"]["distribution_drift"] == []
    assert found["after"]["canary_failed"] == []
    assert found["rechecks"] == {"exit_rate_spike": [True]}  # a spike seen again, re-judged


@pytest.mark.slow  # a fresh Python process
def test_create_app_installs_the_fallback(tmp_path):
    _assert_fallback_installed(_registered_after(
        "from exitplane.app import create_app\ncreate_app()\ncreate_app()", tmp_path))


@pytest.mark.slow  # a fresh Python process
def test_the_celery_worker_app_installs_the_fallback(tmp_path):
    _assert_fallback_installed(_registered_after("import workers.app", tmp_path))


@pytest.fixture
def empty_registry():
    saved = {kind: reactions.reactions_for(kind) for kind in AlertKind}
    saved_rechecks = {kind: reactions.rechecks_for(kind) for kind in AlertKind}
    reactions.clear()
    yield
    reactions.clear()
    for kind, registered in saved.items():
        for reaction in registered:
            reactions.register(reaction, kinds=[kind])
    for kind, registered in saved_rechecks.items():
        for recheck in registered:
            reactions.register_recheck(recheck, kinds=[kind])


def test_react_runs_the_reactions_of_the_alert_kind_in_order(empty_registry, caplog):
    calls = []
    first = lambda *, session, alert: calls.append(("first", alert.kind))  # noqa: E731
    second = lambda *, session, alert: calls.append(("second", alert.kind))  # noqa: E731
    reactions.register(first, kinds=["exit_rate_spike", AlertKind.QUALITY_REGRESSION])
    reactions.register(second, kinds=[AlertKind.EXIT_RATE_SPIKE])
    reactions.register(first, kinds=[AlertKind.EXIT_RATE_SPIKE])  # again: still once
    spike = SimpleNamespace(kind="exit_rate_spike", dedup_key="chat:exit_rate_spike:all")
    reactions.react(session=None, alert=spike)
    reactions.react(session=None, alert=SimpleNamespace(kind="runtime_stale", dedup_key="x"))
    assert calls == [("first", "exit_rate_spike"), ("second", "exit_rate_spike")]
    assert "installed no reactions" not in caplog.text
    with pytest.raises(ValueError):
        reactions.register(first, kinds=["no_such_kind"])


def test_a_recheck_runs_for_its_kind_with_what_the_check_measured(empty_registry):
    calls = []
    recheck = lambda *, session, alert, **evidence: calls.append((alert.kind, evidence))  # noqa: E731
    reactions.register_recheck(recheck, kinds=[AlertKind.EXIT_RATE_SPIKE])
    reactions.register_recheck(recheck, kinds=[AlertKind.EXIT_RATE_SPIKE])  # again: still once
    reactions.recheck(session=None, alert=SimpleNamespace(kind="exit_rate_spike"),
                      quality_gate={"upper": 0.01})
    reactions.recheck(session=None, alert=SimpleNamespace(kind="runtime_stale"),
                      quality_gate={"upper": 0.01})
    assert calls == [("exit_rate_spike", {"quality_gate": {"upper": 0.01}})]


def test_an_alert_fired_where_nothing_is_installed_is_logged(empty_registry, caplog):
    reactions.react(session=None, alert=SimpleNamespace(kind="quality_regression",
                                                        dedup_key="chat:quality_regression:all"))
    assert "chat:quality_regression:all fired in a process that installed no reactions" in \
        caplog.text
