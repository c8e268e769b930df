"""One runtime token cannot grow a process's memory or its log with segment names: the admission
cache held every distinct name any batch carried, for ever (names past the cap included), and
logged a line for each (12 batches of 50,000 new names: +89 MiB and 800,000 lines). Now:

- a batch carrying more distinct segment names than a runtime can (twice the deployment cap, and
  `default`) is refused with 422, before anything is stored or queued;
- the cache holds what deployments have in use (and removed), never the names traffic carried;
- names stored as `default` are logged at most once per deployment per interval, with counts.

Memory figures against a real API process: bench/segment_cache.py."""

from __future__ import annotations

import logging

import msgpack
import pytest
from sqlalchemy.orm import Session

from controlplane.deployments.service import get_deployment
from controlplane.telemetry import admission, service
from exitplane.wire import AGGREGATE_MSGPACK, TelemetryBatch
from tests.support.batches import aggregate_batch, telemetry_batch
from tests.support.deployments import FULL, deploy_for_telemetry
from tests.support.waiting import patient_get

CAP = 16  # EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT's default: a batch may carry 33 names


def _records(names: list[str], ts: float) -> list[dict]:
    return [{"threshold_version": 2, "request_id": f"r{i}", "position": i, "exit_layer": FULL,
             "signal_value": 0.5, "latency_us": 10, "ts": ts, "segment": name}
            for i, name in enumerate(names)]


def _batch(names: list[str], seq: int = 0, deployment: str = "chat") -> dict:
    import time

    return telemetry_batch(_records(names, time.time()), deployment=deployment, seq=seq)


def _aggregate(names: list[str]) -> bytes:
    import time

    minute = int(time.time()) // 60 * 60
    cells = [{"minute": minute, "threshold_version": 2, "layer": FULL, "exits": 1,
              "segment": name, "histogram": [1] + [0] * 19} for name in names]
    return msgpack.packb(aggregate_batch(cells))


def test_a_batch_with_more_distinct_names_than_a_runtime_can_send_is_422(client, tokens,
                                                                         engine):
    runtime = deploy_for_telemetry(client, tokens, engine)
    within = [f"n{index}" for index in range(2 * CAP)] + ["default"]  # 33: what fits
    assert client.post("/v1/telemetry", json=_batch(within), headers=runtime).status_code == 202
    over = [f"m{index}" for index in range(2 * CAP + 2)]
    refused = client.post("/v1/telemetry", json=_batch(over, seq=1), headers=runtime)
    assert refused.status_code == 422
    assert "34 distinct segment names" in refused.json()["detail"]
    assert "at most 33" in refused.json()["detail"]
    aggregate = client.post("/v1/telemetry", content=_aggregate(over), headers={
        **runtime, "Content-Type": AGGREGATE_MSGPACK})
    assert aggregate.status_code == 422 and "distinct segment names" in aggregate.json()["detail"]
    counts = patient_get(client, "/v1/deployments/chat/telemetry/count", headers=runtime).json()
    assert counts["batches"] == 1 and counts["records"] == len(within)


@pytest.mark.parametrize("auto", [False, True])
def test_the_cache_keeps_names_in_use_only_and_logs_once_per_interval(
        client, tokens, engine, caplog, monkeypatch, auto):
    """1,200 new names in 40 batches, opted in to registering names or not: the cache holds at
    most the cap, and one line says how many tokens went to `default`."""
    deploy_for_telemetry(client, tokens, engine)
    monkeypatch.setattr(admission, "_undeclared", {}, raising=False)
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        deployment.auto_segments = auto
        session.commit()
        with caplog.at_level(logging.WARNING, logger="exitplane.telemetry"):
            for seq in range(40):
                names = [f"b{seq}n{index}" for index in range(30)]
                batch = TelemetryBatch.model_validate(_batch(names, seq=seq))
                service.ingest(session=session, deployment=deployment, batches=[batch])
                session.commit()
        deployment_id = deployment.id
    lines = [r.getMessage() for r in caplog.records if "'default'" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"deployment {deployment_id}: ")
    cached = [name for registry in admission._registries[engine].values()
              for name in registry.in_use | registry.removed]
    assert len(cached) == (CAP if auto else 0)
    assert len(admission._undeclared) == 1  # counts per deployment, not per name
    undeclared = admission._undeclared[deployment_id]
    assert undeclared.tokens == 39 * 30  # every batch after the one the line reported


def test_the_ingest_worker_checks_the_names_per_batch_too(engine, client, tokens):
    """A batch the API would refuse, found in the stream (an older API queued it): the worker
    refuses it too instead of caching or storing its names."""
    deploy_for_telemetry(client, tokens, engine)
    over = TelemetryBatch.model_validate(_batch([f"w{index}" for index in range(40)]))
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        with pytest.raises(service.Invalid, match="40 distinct segment names"):
            service.ingest(session=session, deployment=deployment, batches=[over])
    counts = patient_get(client, "/v1/deployments/chat/telemetry/count",
                         headers=tokens.headers(tokens.operator)).json()
    assert counts["batches"] == 0
