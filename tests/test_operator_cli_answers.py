"""`exitplane deployments answers` against a running `exitplane up`: per version and segment,
how many shadow requests, how many would answer differently from full depth, the identical
share and the bound against delta_answer, as a table and as JSON; a bad window is one line."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

from controlplane.deployments.service import get_deployment
from controlplane.telemetry.service import ingest
from exitplane.wire import TelemetryBatch
from tests.support.batches import telemetry_batch
from tests.support.operator_plane import served_plane
from tests.support.shadow_requests import shadow_request_records

pytestmark = pytest.mark.slow
LAYERS, FULL = [2, 4], 6


@pytest.fixture(scope="module")
def plane(sqlite_template, tmp_path_factory):
    with served_plane(sqlite_template, tmp_path_factory.mktemp("answers-cli")) as found:
        yield found


def test_answers_per_version_and_segment(plane, tmp_path):
    version = plane.json("versions", "publish", "chat", "--threshold", "2=0.9",
                         "--threshold", "4=0.8", "--reason", "tuned", "--activate")["version"]
    assert plane.http.patch("/v1/deployments/chat",
                            json={"delta_answer": 0.1}).status_code == 200
    records = []
    start = datetime.now(UTC).timestamp() - 120
    for i in range(10):  # 3 of 10 answers differ: token 1 exits at layer 2 on a mismatch
        signals = np.full((4, 2), 0.5, dtype=np.float32)
        matched = np.ones(signals.shape, dtype=bool)
        if i < 3:
            signals[1, 0], matched[1, 0] = 0.95, False
        records += shadow_request_records(signals, matched, request_id=f"q{i}",
                                          start=start + i, version=version, layers=LAYERS,
                                          num_layers=FULL)
    with plane.session() as session:
        ingest(session=session, deployment=get_deployment(session=session, name="chat"),
               batches=[TelemetryBatch.model_validate(telemetry_batch(
                   records, deployment="chat", runtime_id="rt-1", num_layers=FULL))])
        session.commit()

    found = plane.json("deployments", "answers", "chat", "--window", "1h")
    assert found["delta_answer"] == 0.1 and found["requests"] == 10
    [row] = [segment for entry in found["versions"] if entry["version"] == version
             for segment in entry["segments"]]
    assert (row["segment"], row["requests"], row["differing"]) == ("default", 10, 3)
    text = plane.run("deployments", "answers", "chat", "--version", "active").stdout
    assert "δ_answer:" in text and "0.1" in text
    line = next(line for line in text.splitlines() if line.startswith(str(version)))
    assert line.split()[:5] == [str(version), "default", "10", "3", "70.0%"]
    assert " NO " in f" {line} "  # 3 of 10 cannot be bounded within 0.1

    plane.run("deployments", "answers", "chat", "--window", "soon", code=2)
