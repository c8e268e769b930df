"""The client's Aggregator on its own: minute keys as the store cuts them, histogram bins,
tokens without a signal (exits not checked) counted but left out of the histogram, layers the
deployment lacks refused, and a cut that starts the counts again."""

import pytest

from exitplane.client.aggregate import Aggregator
from exitplane.wire import HISTOGRAM_BINS, TokenRecord


def _record(**fields) -> TokenRecord:
    values = {"threshold_version": 2, "request_id": "r", "position": 0, "exit_layer": 4,
              "signal_value": 0.5, "latency_us": 1, "ts": 1_764_460_799.9} | fields
    return TokenRecord.model_construct(**values)  # as a runtime builds it, signal maybe None


def test_counts_bins_and_unchecked_tokens():
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    assert aggregator.add(_record())
    assert aggregator.add(_record(signal_value=1.0, ts=1_764_460_800.0))  # next minute
    assert aggregator.add(_record(signal_value=None))  # exits not checked: no signal
    assert not aggregator.add(_record(exit_layer=3))  # not a layer of this deployment
    assert aggregator.pending_tokens == 3
    cells = aggregator.cut()
    assert [(c.minute, c.threshold_version, c.layer, c.exits) for c in cells] == [
        (1_764_460_740, 2, 4, 2), (1_764_460_800, 2, 4, 1)]
    assert cells[0].histogram == [0] * 10 + [1] + [0] * 9  # 0.5 -> bin 10; None left out
    assert cells[1].histogram == [0] * (HISTOGRAM_BINS - 1) + [1]  # 1.0 -> the last bin
    assert aggregator.cut() == [] and aggregator.pending_tokens == 0


def test_bulk_counts_and_restore_add_up():
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    histogram = [[1] + [0] * 19, [0] * 20, [0] * 19 + [3]]
    aggregator.add_counts(minute=120, threshold_version=1, exits=[1, 0, 5],
                          histogram=histogram)
    cells = aggregator.cut()
    aggregator.restore(cells)
    aggregator.restore(cells)
    again = aggregator.cut()
    assert [(c.layer, c.exits, c.histogram[-1]) for c in again] == [(2, 2, 0), (6, 10, 6)]


def test_cells_are_keyed_by_segment_and_restore_keeps_it():
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    for segment, layer in (("code", 2), ("code", 2), ("chat", 2), ("default", 2), ("code", 6)):
        assert aggregator.add(_record(segment=segment, exit_layer=layer))
    aggregator.add_counts(minute=1_764_460_740, threshold_version=2, exits=[0, 3, 0],
                          histogram=[[0] * 20, [0] * 20, [0] * 20], segment="chat")
    cells = aggregator.cut()
    assert [(c.segment, c.layer, c.exits) for c in cells] == [
        ("chat", 2, 1), ("chat", 4, 3), ("code", 2, 2), ("code", 6, 1), ("default", 2, 1)]
    # 'default' stays off the wire; a named segment travels.
    wire = [c.model_dump(mode="json") for c in cells]
    assert "segment" not in wire[-1] and wire[0]["segment"] == "chat"
    aggregator.restore(cells)
    assert aggregator.cut() == cells


def test_split_aggregate_batch_keeps_each_cells_segment():
    from exitplane.client.codec import encode_aggregate
    from exitplane.wire import AggregateBatch

    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    for index in range(12):
        aggregator.add(_record(segment=("chat", "code", "default")[index % 3],
                               exit_layer=(2, 4, 6)[index % 4 % 3], signal_value=0.9))
    cells = aggregator.cut()
    encoded = encode_aggregate(deployment="d", runtime_id="rt", seq=3, num_layers=6,
                               raw_sample_rate=0.0, cells=cells)
    halves = encoded.split()
    assert len(halves) == 2 and sum(half.records for half in halves) == 12
    rejoined = [cell for half in halves
                for cell in AggregateBatch.model_validate(half.decode()).cells]
    assert rejoined == cells
    assert {cell.segment for cell in rejoined} == {"chat", "code", "default"}


def test_a_cell_carries_its_tokens_cost_only_when_each_was_timed():
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    for latency, checks in ((300, 1), (340, 1)):
        aggregator.add(_record(exit_layer=2, latency_us=latency, exit_checks=checks))
    aggregator.add(_record(exit_layer=6, latency_us=900, exit_checks=2))
    aggregator.add(_record(exit_layer=6, latency_us=800))  # not timed: the cell is not either
    cells = {cell.layer: cell for cell in aggregator.cut()}
    assert (cells[2].exits, cells[2].latency_us, cells[2].exit_checks) == (2, 640, 2)
    assert (cells[6].exits, cells[6].latency_us, cells[6].exit_checks) == (2, None, None)


def test_bulk_costs_and_restore_keep_the_sums():
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    empty = [[0] * HISTOGRAM_BINS] * 3
    aggregator.add_counts(minute=120, threshold_version=1, exits=[3, 0, 1], histogram=empty,
                          latency_us=[900, 0, 700], exit_checks=[3, 0, 2])
    cut = aggregator.cut()
    assert [(c.layer, c.exits, c.latency_us, c.exit_checks) for c in cut] == [
        (2, 3, 900, 3), (6, 1, 700, 2)]
    aggregator.restore(cut)
    aggregator.restore(cut)
    assert [(c.exits, c.latency_us, c.exit_checks) for c in aggregator.cut()] == [
        (6, 1800, 6), (2, 1400, 4)]
    with pytest.raises(ValueError, match="together"):
        aggregator.add_counts(minute=120, threshold_version=1, exits=[1, 0, 0],
                              histogram=empty, latency_us=[5, 0, 0])
