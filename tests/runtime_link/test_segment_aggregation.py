"""Segments through the real client and a real control plane: a mixed-segment token
stream shipped as records and through the aggregating shipper leaves identical rollups and
histograms per segment, with each segment's policy counts under its own thresholds."""

from __future__ import annotations

from collections import Counter

from sqlalchemy import text

from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, ROLLUP, fast_shipper, token_stream

SEGMENTS = ("default", "chat", "code")


def _by_segment(engine, runtime_id: str) -> tuple[list, list]:
    with engine.connect() as connection:
        rollups = connection.execute(text(
            f"SELECT segment, {ROLLUP} FROM rollups WHERE runtime_id = :r "
            "ORDER BY segment, version, minute, layer"), {"r": runtime_id}).all()
        histogram = connection.execute(text(
            "SELECT segment, version, minute, layer, bin, count FROM rollup_histograms "
            "WHERE runtime_id = :r ORDER BY segment, version, minute, layer, bin"),
            {"r": runtime_id}).all()
    return [tuple(row) for row in rollups], [tuple(row) for row in histogram]


def test_segmented_aggregates_give_the_rollups_segmented_records_give(
        control_plane, operator, runtime_token, engine, tmp_path):
    # `code` is put in use by the set that maps it; `chat` is declared (telemetry stores an
    # undeclared segment name as `default`).
    declared = operator.put(f"/v1/deployments/{DEPLOYMENT}/declared-segments/chat",
                            json={"reason": "chat traffic"})
    assert declared.status_code == 200, declared.text
    published = operator.post(f"/v1/deployments/{DEPLOYMENT}/threshold-sets", json={
        "thresholds": {"2": 0.9, "4": 0.6}, "segments": {"code": {"2": 0.2, "4": 0.1}},
        "reason": "code exits earlier", "activate": True})
    assert published.status_code == 201, published.text
    version = published.json()["version"]
    stream = [record.model_copy(update={"segment": SEGMENTS[index % 3]})
              for index, record in enumerate(token_stream(3000, versions=[0, version]))]
    plain = fast_shipper(control_plane.url, runtime_token, tmp_path / "a", "rt-records").start()
    edge = fast_shipper(control_plane.url, runtime_token, tmp_path / "b", "rt-edge",
                        raw_sample_rate=0.1, exit_layers=EXIT_LAYERS,
                        aggregate_interval_s=0.2).start()
    for record in stream:
        assert plain.submit(record)
        assert edge.submit(record)
    assert plain.flush(60) and edge.flush(60)
    assert plain.wait_replayed(60) and edge.wait_replayed(60)
    assert plain.close(10) and edge.close(10)

    expected, aggregated = _by_segment(engine, "rt-records"), _by_segment(engine, "rt-edge")
    assert aggregated == expected
    first = EXIT_LAYERS[0]
    tokens = Counter()
    for segment, _version, _minute, layer, reached, *_ in expected[0]:
        if layer == first:
            tokens[segment] += reached
    assert tokens == Counter(record.segment for record in stream)
    # code's own, lower thresholds let the policy exit more of its shadow tokens at layer 2.
    policy = Counter()
    shadow = Counter()
    for segment, row_version, _minute, layer, *counts in expected[0]:
        if layer == first and row_version == version:
            shadow[segment] += counts[2]
            policy[segment] += counts[4]
    assert shadow["code"] and shadow["chat"]
    assert policy["code"] / shadow["code"] > 0.6 > policy["chat"] / shadow["chat"]
