"""A runtime with the tiny model keeps generating while the control plane goes down, is
restarted itself during the outage, and once the control plane is back every token record
arrives exactly once."""

from __future__ import annotations

import collections
import itertools
import threading

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.telemetry.models import ShadowSampleRow, TokenRecordRow
from exitplane.client.shipper import TelemetryShipper
from exitplane.client.thresholds import ThresholdClient
from runtime.engine import Engine
from tests.support.runtime_link import DEPLOYMENT, NUM_LAYERS, publish
from tests.support.waiting import patient_get, wait_until

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

RUNTIME_ID = "rt-outage"
_request_ids = itertools.count()


class Runtime:
    """Engine + threshold client + shipper wired as the runtime server wires them."""

    def __init__(self, make_engine, url: str, token: str, tmp_path):
        self.shipper = TelemetryShipper(
            base_url=url, token=token, deployment=DEPLOYMENT, runtime_id=RUNTIME_ID,
            num_layers=NUM_LAYERS, spool_dir=tmp_path / "spool", batch_records=40,
            batch_interval_s=0.2, max_attempts=2, backoff_initial_s=0.05, backoff_max_s=0.3)
        self.engine: Engine = make_engine(runtime_id=RUNTIME_ID, on_record=self.shipper.submit,
                                          shadow_rate=0.25)
        self.client = ThresholdClient(
            self.engine, base_url=url, deployment=DEPLOYMENT, token=token,
            cache_path=tmp_path / "thresholds.json", long_poll_s=1.0, heartbeat_interval_s=1.0,
            backoff_initial_s=0.05, backoff_max_s=0.5, telemetry=self.shipper)
        self.produced: list[tuple[str, int, int]] = []  # (request_id, position, version)
        self.shipper.start()
        self.client.start()

    def serve(self, requests: int, max_new_tokens: int = 6) -> None:
        """Run `requests` prompts to completion, recording every token produced."""
        for _ in range(requests):
            number = next(_request_ids)
            self.engine.add_request([1, 7 + number % 50, 9], request_id=f"req-{number}",
                                    max_new_tokens=max_new_tokens, stop_token_ids=())
        while self.engine.has_work:
            for out in self.engine.step():
                self.produced.append((out.request_id, out.record.position,
                                      out.record.threshold_version))

    def close(self) -> None:
        self.client.stop()
        assert self.shipper.close(20)


def _stored(engine) -> tuple[collections.Counter, int]:
    with Session(engine) as session:
        rows = session.execute(select(TokenRecordRow.request_id, TokenRecordRow.position,
                                      TokenRecordRow.threshold_version)
                               .where(TokenRecordRow.runtime_id == RUNTIME_ID)).all()
        shadow = session.scalar(select(func.count()).select_from(ShadowSampleRow))
    return collections.Counter(tuple(row) for row in rows), int(shadow or 0)


@pytest.mark.slow
def test_the_runtime_rides_out_a_control_plane_outage(control_plane, operator, runtime_token,
                                                      make_engine, tmp_path, engine):
    version = publish(operator, {2: 0.2, 4: 0.1})
    first = Runtime(make_engine, control_plane.url, runtime_token, tmp_path)
    assert first.client.wait_ready(20) and first.engine.policy.version == version

    # Serving normally: records flow up as they are produced.
    first.serve(4)
    assert first.shipper.flush(20) and first.shipper.counters["sent_batches"] >= 1

    # The control plane goes down while a serving loop keeps generating.
    stop_serving = threading.Event()
    during_outage: list[int] = []

    def serving_loop() -> None:
        while not stop_serving.is_set():
            before = len(first.produced)
            first.serve(2)
            during_outage.append(len(first.produced) - before)

    control_plane.stop()
    server = threading.Thread(target=serving_loop)
    server.start()
    try:
        wait_until(lambda: first.shipper.spooled_batches >= 2, message="spooled batches")
    finally:
        stop_serving.set()
        server.join(60)
    assert sum(during_outage) > 0 and not first.shipper.online
    assert first.engine.policy.version == version  # still on the pulled set
    assert first.client.counters["pull_errors"] >= 1
    first.close()  # what was queued goes to the spool

    # The runtime restarts during the outage: cached thresholds, spool still on disk.
    second = Runtime(make_engine, control_plane.url, runtime_token, tmp_path)
    assert second.client.wait_ready(20) and second.client.source == "cache"
    assert second.shipper.spooled_batches >= 2
    second.serve(3)
    assert second.shipper.flush(20)
    assert {v for _, _, v in first.produced + second.produced} == {version}

    # Back up: the spool replays and every record is stored exactly once.
    control_plane.start()
    try:
        assert second.shipper.wait_replayed(60)
        wait_until(lambda: second.client.source == "control_plane",
                   message="the client to confirm its set")
        produced = collections.Counter(first.produced + second.produced)
        assert max(produced.values()) == 1
        stored, shadow_samples = _stored(engine)
        assert stored == produced
        count = patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/telemetry/count").json()
        assert count["records"] == sum(produced.values())
        assert shadow_samples > 0  # shadow tokens made it through the spool as well
        assert first.shipper.dropped_records == second.shipper.dropped_records == 0
        wait_until(lambda: any(r["runtime_id"] == RUNTIME_ID and r["spooled_batches"] == 0
                               and r["applied_version"] == version and r["ready"]
                               for r in patient_get(
                                   operator, f"/v1/deployments/{DEPLOYMENT}/runtimes").json()),
                   message="a heartbeat with an empty spool")
    finally:
        second.close()
