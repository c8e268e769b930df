"""The telemetry shipper against the real `/v1/telemetry`: batching, spooling through an
outage, ordered replay with the same ids, idempotent replays, the disk cap, 422 and 413."""

from __future__ import annotations

import logging
import shutil
import time

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.telemetry.models import TelemetryBatchRow
from exitplane.client.codec import EncodedBatch
from exitplane.client.shipper import TelemetryShipper
from exitplane.client.spool import Spool
from exitplane.wire import TokenRecord
from tests.support.network import free_port
from tests.support.runtime_link import DEPLOYMENT, NUM_LAYERS, ControlPlane
from tests.support.waiting import patient_get, wait_until

sqlite_only = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def _records(count: int, *, version: int = 1, start: int = 0) -> list[TokenRecord]:
    layers = [2, 4, NUM_LAYERS]
    return [TokenRecord(threshold_version=version, request_id=f"req-{(start + i) // 10}",
                        position=(start + i) % 10, exit_layer=layers[(start + i) % 3],
                        signal_value=0.5, latency_us=120, ts=time.time())
            for i in range(count)]


def _shipper(url: str, token: str, spool_dir, **kwargs) -> TelemetryShipper:
    options = {"batch_records": 50, "batch_interval_s": 0.2, "max_attempts": 2,
               "backoff_initial_s": 0.05, "backoff_max_s": 0.3, "request_timeout_s": 10.0,
               **kwargs}
    return TelemetryShipper(base_url=url, token=token, deployment=DEPLOYMENT,
                            runtime_id="rt-ship", num_layers=NUM_LAYERS, spool_dir=spool_dir,
                            **options)


def _counts(operator) -> dict:
    response = patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/telemetry/count")
    assert response.status_code == 200, response.text
    return {key: response.json()[key] for key in ("records", "batches", "shadow_samples")}


def _stored_batches(engine) -> list[tuple[str, int]]:
    """(batch_id, seq) in the order the control plane received them."""
    with Session(engine) as session:
        rows = session.execute(select(TelemetryBatchRow.batch_id, TelemetryBatchRow.seq)
                               .order_by(TelemetryBatchRow.received_at))
        return [tuple(row) for row in rows]


def _spooled(directory) -> list[EncodedBatch]:
    """What a spool directory holds, read from a copy so the original stays untouched."""
    copy = directory.parent / f"{directory.name}-inspect"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(directory, copy)
    spool, batches = Spool(copy, max_bytes=1 << 30, segment_bytes=1 << 20), []
    while (batch := spool.peek()) is not None:
        batches.append(batch)
        spool.pop()
    spool.close()
    return batches


@sqlite_only
@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_batches_arrive_by_size_and_by_time(control_plane, operator, runtime_token, tmp_path,
                                            encoding, engine):
    shipper = _shipper(control_plane.url, runtime_token, tmp_path / "spool",
                       encoding=encoding).start()
    try:
        for record in _records(120):
            assert shipper.submit(record)
        # 2 full batches go by size; the last 20 records go when the batch interval ends.
        wait_until(lambda: shipper.counters["sent_records"] == 120, message="120 records")
        assert shipper.counters["sent_batches"] == 3
        assert _counts(operator) == {"records": 120, "batches": 3, "shadow_samples": 0}
        seqs = [seq for _, seq in _stored_batches(engine)]
        assert seqs == sorted(seqs) and len(set(seqs)) == 3
        assert shipper.spooled_batches == 0 and shipper.dropped_records == 0
    finally:
        assert shipper.close(10)


@sqlite_only
def test_outage_spools_then_replays_in_order_with_the_same_ids(
        control_plane, operator, runtime_token, tmp_path, engine):
    spool_dir = tmp_path / "spool"
    shipper = _shipper(control_plane.url, runtime_token, spool_dir).start()
    try:
        for record in _records(60):
            shipper.submit(record)
        assert shipper.flush(20)
        assert shipper.counters["sent_records"] == 60  # 50 + 10, before the outage

        control_plane.stop()
        for record in _records(130, start=60):
            shipper.submit(record)
        assert shipper.flush(20)
        assert not shipper.online
        spooled = _spooled(spool_dir)
        assert [b.records for b in spooled] == [50, 50, 30]
        assert [b.seq for b in spooled] == sorted(b.seq for b in spooled)
        assert shipper.spooled_batches == 3 and shipper.counters["spooled_batches"] == 3
        assert len(_stored_batches(engine)) == 2  # nothing arrived during the outage

        # Back up: the spool replays in order, with the ids it was written with.
        control_plane.start()
        assert shipper.wait_replayed(30)
        assert _counts(operator)["records"] == 190
        assert _stored_batches(engine)[-3:] == [(b.batch_id, b.seq) for b in spooled]
        assert shipper.counters["replayed_batches"] == 3 and shipper.dropped_records == 0
        assert list(spool_dir.glob("*.seg")) == []  # replayed segments are deleted
    finally:
        assert shipper.close(10)


@sqlite_only
def test_a_replayed_batch_is_acknowledged_not_stored_twice(control_plane, operator,
                                                           runtime_token, tmp_path, engine):
    spool_dir = tmp_path / "spool"
    control_plane.stop()
    first = _shipper(control_plane.url, runtime_token, spool_dir)  # never started: close spools
    for record in _records(120):
        first.submit(record)
    assert first.close(10)
    assert first.spooled_batches == 3
    # The same spool twice, as after a crash between delivering a batch and forgetting it.
    shutil.copytree(spool_dir, tmp_path / "spool-again")
    control_plane.start()

    second = _shipper(control_plane.url, runtime_token, spool_dir).start()
    assert second.wait_replayed(30) and second.close(10)
    assert second.counters["sent_records"] == 120 and second.counters["duplicate_batches"] == 0
    third = _shipper(control_plane.url, runtime_token, tmp_path / "spool-again").start()
    assert third.wait_replayed(30) and third.close(10)
    assert third.counters["duplicate_batches"] == 3 and third.counters["sent_records"] == 0
    assert third.counters["duplicate_records"] == 120  # delivered before: acknowledged, not lost
    assert _counts(operator) == {"records": 120, "batches": 3, "shadow_samples": 0}

    # A restarted runtime keeps numbering after what it spooled before.
    fourth = _shipper(control_plane.url, runtime_token, spool_dir).start()
    fourth.submit(_records(1)[0])
    assert fourth.flush(10) and fourth.close(10)
    seqs = [seq for _, seq in _stored_batches(engine)]
    assert seqs[-1] > max(seqs[:-1])


@sqlite_only
def test_the_disk_cap_drops_and_counts_whole_batches(control_plane, operator, runtime_token,
                                                     tmp_path):
    control_plane.stop()
    # One 50-record batch spools to a little over 5 KB: the cap holds two of them.
    shipper = _shipper(control_plane.url, runtime_token, tmp_path / "spool",
                       spool_max_bytes=12_000).start()
    for record in _records(250):
        shipper.submit(record)
    assert shipper.flush(20)
    assert shipper.spooled_batches == 2
    assert shipper.dropped_records == 150 and shipper.counters["dropped_spool_records"] == 150
    assert shipper.spool.total_bytes <= 12_000

    control_plane.start()
    assert shipper.wait_replayed(30)
    assert _counts(operator)["records"] == 100
    assert shipper.close(10)


@sqlite_only
def test_a_422_is_logged_counted_and_not_retried(control_plane, operator, runtime_token,
                                                 tmp_path, caplog):
    shipper = _shipper(control_plane.url, runtime_token, tmp_path / "spool").start()
    bad = _records(5)
    bad[3] = bad[3].model_copy(update={"threshold_version": 99})  # never published
    with caplog.at_level(logging.ERROR, logger="exitplane.client.shipper"):
        for record in bad:
            shipper.submit(record)
        assert shipper.flush(20)
        for record in _records(5, start=5):
            shipper.submit(record)
        assert shipper.flush(20)
    assert shipper.counters["rejected_batches"] == 1 and shipper.counters["rejected_records"] == 5
    assert shipper.counters["retries"] == 0 and shipper.counters["send_errors"] == 0
    assert shipper.spooled_batches == 0 and shipper.online
    assert "record 3: threshold_version 99" in caplog.text
    assert _counts(operator) == {"records": 5, "batches": 1, "shadow_samples": 0}
    assert shipper.close(10)


@sqlite_only
def test_a_413_splits_the_batch_until_it_fits(settings, engine, operator, runtime_token,
                                              tmp_path):
    from exitplane.app import create_app

    small = settings.model_copy(update={"max_body_bytes": 2500})
    plane = ControlPlane(make_app=lambda: create_app(small, engine=engine), port=free_port())
    plane.start()
    try:
        shipper = _shipper(plane.url, runtime_token, tmp_path / "spool", batch_records=80)
        shipper.start()
        for record in _records(80):
            shipper.submit(record)
        assert shipper.flush(20)
        assert shipper.counters["splits"] == 3 and shipper.counters["sent_records"] == 80
        stored = _stored_batches(engine)
        parent = stored[0][0][:32]
        assert sorted(batch_id for batch_id, _ in stored) == [
            parent + suffix for suffix in ("aa", "ab", "ba", "bb")]

        # A spooled batch that meets the limit on replay is split the same way.
        plane.stop()
        for record in _records(80, start=80):
            shipper.submit(record)
        assert shipper.flush(20)
        [spooled] = _spooled(tmp_path / "spool")
        plane.start()
        assert shipper.wait_replayed(30) and shipper.close(10)
        replayed = [batch_id for batch_id, _ in _stored_batches(engine)[4:]]
        assert replayed == [spooled.batch_id + suffix for suffix in ("aa", "ab", "ba", "bb")]
        assert _counts(operator)["records"] == 160 and shipper.counters["splits"] == 6
    finally:
        plane.close()


@sqlite_only
def test_a_bad_token_keeps_spooling_and_says_so(control_plane, operator, runtime_token,
                                                tmp_path, caplog):
    spool_dir = tmp_path / "spool"
    with caplog.at_level(logging.ERROR, logger="exitplane.client.shipper"):
        wrong = _shipper(control_plane.url, "ept_not-a-token", spool_dir).start()
        for record in _records(60):
            wrong.submit(record)
        assert wrong.flush(20) and wrong.close(10)
    assert wrong.counters["auth_errors"] >= 1 and wrong.spooled_batches == 2
    assert "check the runtime token" in caplog.text
    assert _counts(operator)["records"] == 0

    fixed = _shipper(control_plane.url, runtime_token, spool_dir).start()
    assert fixed.wait_replayed(30) and fixed.close(10)
    assert _counts(operator)["records"] == 60


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path):
    shipper = TelemetryShipper(base_url=f"http://127.0.0.1:{free_port()}", token="t",
                               deployment=DEPLOYMENT, runtime_id="rt", num_layers=NUM_LAYERS,
                               spool_dir=tmp_path / "spool", queue_size=10)
    accepted = [shipper.submit(record) for record in _records(15)]
    assert accepted == [True] * 10 + [False] * 5
    assert shipper.dropped_records == 5 and shipper.metrics["queue_depth"] == 10


def test_a_runtime_id_the_control_plane_would_refuse_is_refused_at_once(tmp_path):
    """Every batch with such an id would be a 422 (dropped): say so before the first token."""
    def shipper(runtime_id: str) -> TelemetryShipper:
        return TelemetryShipper(base_url=f"http://127.0.0.1:{free_port()}", token="t",
                                deployment=DEPLOYMENT, runtime_id=runtime_id,
                                num_layers=NUM_LAYERS, spool_dir=tmp_path / runtime_id[:8])

    for bad in ("pod/3", "<rt>", "x" * 129):
        with pytest.raises(ValueError, match="must match"):
            shipper(bad)
    assert shipper("gpu-7.pod:3").runtime_id == "gpu-7.pod:3"


def test_the_spool_keeps_whole_batches_after_a_torn_write(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 20)
    for seq in range(3):
        assert spool.append(EncodedBatch(f"batch{seq:04d}", seq, 1, "application/msgpack",
                                         b"x" * 100))
    spool.close()
    [segment] = tmp_path.glob("*.seg")
    with segment.open("ab") as handle:
        handle.write(b"\x00\x00\x01\x00torn")  # a crash in the middle of a fourth append
    reopened = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=1 << 20)
    assert reopened.pending_batches == 3 and reopened.max_seq == 2
    seen = []
    while (batch := reopened.peek()) is not None:
        seen.append(batch.batch_id)
        reopened.pop()
    assert seen == ["batch0000", "batch0001", "batch0002"]
    assert list(tmp_path.glob("*.seg")) == []


def _poison_first_batch(monkeypatch, error: Exception) -> list[str]:
    """Make the control plane fail with `error` on the first batch it is sent, every time it
    is sent again (a bug one batch trips); returns that batch's id once seen."""
    from controlplane.telemetry import service

    real, poisoned = service.ingest, []

    def ingest(*, session, deployment, batches, **kwargs):
        poisoned[:] = poisoned or [batches[0].batch_id]
        if any(batch.batch_id in poisoned for batch in batches):
            raise error
        return real(session=session, deployment=deployment, batches=batches, **kwargs)

    monkeypatch.setattr(service, "ingest", ingest)
    return poisoned


@sqlite_only
def test_a_batch_the_server_keeps_failing_on_is_set_aside_and_retried_later(
        control_plane, operator, runtime_token, tmp_path, monkeypatch, caplog):
    """A 500 on the spool's head, replay after replay, while the control plane takes other
    batches: the head goes aside (on disk, counted as spooled) and the batches behind it
    are delivered; once the control plane is fixed the set-aside batch is delivered too,
    after a restart of the runtime as well."""
    spool_dir = tmp_path / "spool"
    poisoned = _poison_first_batch(monkeypatch, KeyError("a bug this batch trips"))
    shipper = _shipper(control_plane.url, runtime_token, spool_dir, set_aside_after=3,
                       aside_retry_s=0.5).start()
    with caplog.at_level(logging.ERROR, logger="exitplane.client.shipper"):
        for record in _records(150):  # three batches of 50; the first trips the bug
            shipper.submit(record)
        assert shipper.flush(20)
        wait_until(lambda: shipper.counters["sent_records"] == 100, timeout=30,
                   message="the two batches behind the poisoned one")
    assert shipper.counters["set_aside_batches"] == 1
    [aside] = (spool_dir / "aside").glob("*.batch")
    assert poisoned[0] in aside.name
    assert shipper.spooled_batches == 1 and shipper.spool.pending_batches == 0
    assert shipper.dropped_records == 0 and shipper.counters["rejected_batches"] == 0
    assert "set aside" in caplog.text
    wait_until(lambda: shipper.counters["send_errors"] >= 2 + 3 + 1, timeout=10,
               message="a retry of the set-aside batch while the bug is there")
    assert aside.exists() and _counts(operator)["records"] == 100
    assert shipper.close(10)

    # Restarted, the runtime still holds it; fixed, the control plane takes it.
    monkeypatch.undo()
    again = _shipper(control_plane.url, runtime_token, spool_dir, aside_retry_s=0.2)
    assert again.spooled_batches == 1
    again.start()
    wait_until(lambda: again.spooled_batches == 0, timeout=20, message="the set-aside batch")
    assert again.counters["recovered_aside_batches"] == 1
    assert _counts(operator) == {"records": 150, "batches": 3, "shadow_samples": 0}
    assert list((spool_dir / "aside").glob("*.batch")) == []
    assert again.spool.total_bytes == 0
    assert again.close(10)


@sqlite_only
def test_a_control_plane_that_is_away_never_sets_a_batch_aside(
        control_plane, operator, runtime_token, tmp_path, monkeypatch):
    """503 (the store away) on every replay is an outage, not a bad batch: the spool keeps
    its order and nothing goes aside."""
    from sqlalchemy.exc import OperationalError

    _poison_first_batch(monkeypatch, OperationalError("INSERT", {}, Exception("server closed")))
    shipper = _shipper(control_plane.url, runtime_token, tmp_path / "spool",
                       set_aside_after=2).start()
    for record in _records(100):
        shipper.submit(record)
    assert shipper.flush(20)
    wait_until(lambda: shipper.counters["send_errors"] >= 2 + 4, timeout=20,
               message="replays answered 503")
    assert shipper.counters["set_aside_batches"] == 0 and shipper.spool.pending_batches == 2
    assert _counts(operator)["records"] == 0  # the second batch stays behind the first
    monkeypatch.undo()
    assert shipper.wait_replayed(30)
    assert _counts(operator)["records"] == 100 and shipper.close(10)


def test_a_set_aside_batch_leaves_the_replay_order_and_survives_a_restart(tmp_path):
    def batch(seq: int) -> EncodedBatch:
        return EncodedBatch(f"batch{seq:04d}", seq, 1, "application/msgpack", b"x" * 100)

    spool = Spool(tmp_path / "a", max_bytes=1 << 20, segment_bytes=1 << 20)
    for seq in range(3):
        assert spool.append(batch(seq))
    shutil.copytree(tmp_path / "a", tmp_path / "crashed")  # before the head was set aside
    path = spool.set_aside()
    assert path.parent == tmp_path / "a" / "aside" and "batch0000" in path.name
    assert spool.peek().batch_id == "batch0001" and spool.pending_batches == 2
    spool.close()
    # The crashed copy: the file was written, the batch had not left its segment yet.
    (tmp_path / "crashed" / "aside").mkdir()
    shutil.copy(path, tmp_path / "crashed" / "aside" / path.name)
    (tmp_path / "crashed" / "aside" / "torn.batch").write_bytes(b"\x00\x00")

    reopened = Spool(tmp_path / "a", max_bytes=1 << 20, segment_bytes=1 << 20)
    assert reopened.aside == [path] and reopened.max_seq == 2
    # The clean close noted how far the segment was replayed (the crashed copy below, read
    # from the segment's start, skips the set-aside batch instead).
    assert reopened.peek().batch_id == "batch0001" and reopened.pending_batches == 2
    assert Spool.read_aside(path).batch_id == "batch0000"
    reopened.drop_aside(path)
    while reopened.peek() is not None:
        reopened.pop()
    assert reopened.total_bytes == 0 and not path.exists()
    assert reopened.append(batch(0))  # a batch put back from aside: a segment file of its own
    assert reopened.peek().batch_id == "batch0000"
    assert len(list((tmp_path / "a").glob("*.seg"))) == 1

    crashed = Spool(tmp_path / "crashed", max_bytes=1 << 20, segment_bytes=1 << 20)
    [aside] = crashed.aside  # the torn file is left alone, not indexed
    assert crashed.peek().batch_id == "batch0001" and crashed.pending_batches == 2
    segment_bytes = sum(p.stat().st_size for p in (tmp_path / "crashed").glob("*.seg"))
    assert crashed.total_bytes == segment_bytes + aside.stat().st_size


def test_a_restart_after_a_clean_close_does_not_send_replayed_batches_again(tmp_path):
    def batch(seq: int) -> EncodedBatch:
        return EncodedBatch(f"batch{seq:04d}", seq, 1, "application/msgpack", b"x" * 100)

    def reopen() -> Spool:
        return Spool(tmp_path / "s", max_bytes=1 << 20, segment_bytes=1 << 20)

    spool = reopen()
    for seq in range(4):
        assert spool.append(batch(seq))
    spool.pop()
    spool.pop()
    shutil.copytree(tmp_path / "s", tmp_path / "crashed")  # a crash: no note of the offset
    spool.close()
    again = reopen()
    assert again.peek().batch_id == "batch0002" and again.pending_batches == 2
    crashed = Spool(tmp_path / "crashed", max_bytes=1 << 20, segment_bytes=1 << 20)
    assert crashed.peek().batch_id == "batch0000" and crashed.pending_batches == 4

    # A note that is not the start of a record (damaged) is ignored: from the start.
    [mark] = (tmp_path / "s").glob("*.read")
    mark.write_text("17")
    assert reopen().pending_batches == 4
    mark.write_text("not a number")
    assert reopen().pending_batches == 4

    # A note whose segment is gone (a crash between the two deletions) is removed, so a
    # later segment of the same name cannot inherit it.
    (tmp_path / "s" / "00000000000000000009-00000000.read").write_text("0")
    reopen()
    assert not (tmp_path / "s" / "00000000000000000009-00000000.read").exists()

    # Replayed to the end, the segment and its note go.
    again = reopen()
    while again.peek() is not None:
        again.pop()
    again.close()
    assert list((tmp_path / "s").iterdir()) == []
