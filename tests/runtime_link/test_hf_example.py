"""examples/hf_runtime.py, the integration guide's worked runtime on plain transformers, run
with the tiny random Llama against a real control plane: it applies the published set, its
tokens exit where the thresholds say, its shadow tokens are stored under its runtime id, and
it leaves the fleet on close."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from controlplane.deployments.service import get_deployment
from controlplane.telemetry.models import ShadowSampleRow
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, NUM_LAYERS, publish
from tests.support.waiting import patient_get

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("hf_runtime", ROOT / "examples" /
                                                  "hf_runtime.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a control plane and a model
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_worked_runtime_reports_exits_and_shadow_tokens(control_plane, operator,
                                                            runtime_token, tiny_model, engine,
                                                            tmp_path):
    from exitplane.client import Runtime

    example = _example()
    version = publish(operator, {2: 0.0, 4: 0.0})  # every checked token exits at layer 2
    changes = []
    with Runtime(url=control_plane.url, token=runtime_token, deployment=DEPLOYMENT,
                 runtime_id="hf-example-1", num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                 shadow_rate=0.25, state_dir=tmp_path / "state", signal="maxprob") as rt:
        rt.on_change(changes.append)
        outputs = [example.generate(tiny_model, rt, [1, 5 + i, 9, 13], 12, f"req-{i}")
                   for i in range(8)]
        rt.flush(30)
        rows = patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/runtimes").json()
        assert [runtime["runtime_id"] for runtime in rows] == ["hf-example-1"]
        metrics = rt.metrics
    assert [c.version for c in changes] == [version]
    assert all(len(out) == 12 for out in outputs)
    assert metrics["telemetry_sent_records"] == 8 * 12
    assert operator.get(f"/v1/deployments/{DEPLOYMENT}/runtimes").json() == []  # it left

    counts = patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/telemetry/count").json()
    assert counts["tokens"] == 8 * 12
    with Session(engine) as session:
        deployment = get_deployment(session=session, name=DEPLOYMENT)
        shadow, runtimes = session.execute(
            select(func.count(), func.count(func.distinct(ShadowSampleRow.runtime_id)))
            .where(ShadowSampleRow.deployment_id == deployment.id)).one()
    assert 5 < shadow < 48 and runtimes == 1  # ~25% of 96 tokens, all under its own id
    with engine.connect() as connection:
        exits = dict(connection.execute(text(
            "SELECT layer, sum(exits) FROM rollups WHERE version = :v GROUP BY layer"),
            {"v": version}).all())
    # thresholds 0.0: every token not shadowed exits at the first exit layer
    assert exits.get(EXIT_LAYERS[0]) == 8 * 12 - shadow and not exits.get(EXIT_LAYERS[1])
