"""The exact answer loss: the first token that would exit under a set at a layer whose
prediction did not match, per set, vectorised; the same exit rule as the runtime (first exit
layer with signal strictly above its threshold; NaN signals and thresholds of 1.0 or more never
exit); evidence assembled from a shadow request's records; summaries over many requests."""

import math

import numpy as np
import pytest

from controlplane.stats import answers
from controlplane.stats.answers import (
    answer_differs,
    exit_columns,
    first_divergence,
    request_evidence,
    summarize,
)
from exitplane.wire import ShadowPoint, TokenRecord


def _reference(signals, matched, thresholds):
    """Token by token, set by set: what a runtime replaying the request would do."""
    out = []
    for limits in thresholds:
        found = -1
        for position, (row, hits) in enumerate(zip(signals, matched, strict=True)):
            exit_at = next((layer for layer, (value, limit) in enumerate(
                zip(row, limits, strict=True)) if value > limit), None)  # NaN > x is False
            if exit_at is not None and not hits[exit_at]:
                found = position
                break
        out.append(found)
    return out


def test_a_worked_example():
    signals = np.array([[0.2, 0.9], [0.95, 0.5], [0.6, 0.99]])
    matched = np.array([[False, True], [True, False], [False, False]])
    thresholds = np.array([
        [1.0, 1.0],    # never exits: the full-depth answer
        [0.9, 0.8],    # token 0 exits at layer 2 (matched), token 1 at layer 1 (matched),
                       # token 2 at layer 2 (mismatched): diverges at 2
        [0.1, 1.0],    # token 0 exits at layer 1, mismatched: diverges at 0
        [0.95, 0.9],   # strictly above: 0.95 and 0.9 stay (tokens 0 and 1 run to full
                       # depth); token 2 exits at layer 2 (mismatched)
        [0.95, 0.995],  # nothing passes: identical
    ])
    assert first_divergence(signals, matched, thresholds).tolist() == [-1, 2, 0, 2, -1]
    assert answer_differs(signals, matched, thresholds).tolist() == [False, True, True, True,
                                                                     False]
    assert exit_columns(signals, thresholds[1:2]).tolist() == [[1, 0, 1]]


@pytest.mark.parametrize("seed", range(5))
def test_it_agrees_with_replaying_each_token(seed):
    rng = np.random.default_rng(seed)
    tokens, layers, sets = 40, 4, 200
    signals = rng.random((tokens, layers))
    signals[rng.random((tokens, layers)) < 0.1] = np.nan  # layers not checked
    matched = rng.random((tokens, layers)) < 0.85
    thresholds = rng.uniform(0.5, 1.05, (sets, layers))
    thresholds[::17] = math.inf
    thresholds[::23] = 0.0
    assert first_divergence(signals, matched, thresholds).tolist() == \
        _reference(signals, matched, thresholds)


def test_large_inputs_are_taken_in_slices_of_sets(monkeypatch):
    rng = np.random.default_rng(7)
    signals, matched = rng.random((30, 3)), rng.random((30, 3)) < 0.7
    thresholds = rng.uniform(0.3, 1.0, (101, 3))
    whole = first_divergence(signals, matched, thresholds)
    monkeypatch.setattr(answers, "_CHUNK_ELEMENTS", 200)  # a couple of sets per slice
    assert first_divergence(signals, matched, thresholds).tolist() == whole.tolist()
    assert exit_columns(signals, thresholds).shape == (101, 30)


def test_never_exit_and_exit_everything():
    signals = np.array([[0.3, 0.7], [1.0, 1.0]])
    matched = np.array([[True, False], [False, True]])
    never = np.array([[1.0, 1.0], [2.0, math.inf]])
    assert first_divergence(signals, matched, never).tolist() == [-1, -1]
    # every token exits at the first layer: the first mismatch there is the divergence
    assert first_divergence(signals, matched, np.array([[0.0, 0.0]])).tolist() == [1]
    assert first_divergence(signals, matched, np.array([0.0, 0.0])).tolist() == [1]  # one set


def test_an_empty_request_never_differs():
    empty = np.zeros((0, 2))
    assert first_divergence(empty, empty.astype(bool), np.array([[0.0, 0.0]])).tolist() == [-1]


@pytest.mark.parametrize(("signals", "matched", "thresholds", "message"), [
    (np.zeros((3, 2)), np.zeros((3, 3), bool), np.zeros((1, 2)), "same"),
    (np.zeros(3), np.zeros(3, bool), np.zeros((1, 1)), "same"),
    (np.zeros((3, 2)), np.zeros((3, 2), bool), np.zeros((1, 3)), "one threshold per exit"),
])
def test_shapes_are_checked(signals, matched, thresholds, message):
    with pytest.raises(ValueError, match=message):
        first_divergence(signals, matched, thresholds)


def _token(position, points, **changes):
    return TokenRecord(threshold_version=1, request_id="r", position=position, exit_layer=6,
                       signal_value=0.5, latency_us=1, ts=1.7e9, shadow_request=True,
                       shadow=[ShadowPoint(layer=layer, signal=signal, matched=hit)
                               for layer, signal, hit in points], **changes)


def test_evidence_comes_from_the_records_in_position_order():
    records = [_token(1, [(4, 0.4, False), (2, 0.2, True)]),
               _token(0, [(2, 0.9, True), (4, 0.8, False)])]
    signals, matched = request_evidence(records, exit_layers=[4, 2])
    assert signals.tolist() == [[0.9, 0.8], [0.2, 0.4]]
    assert matched.tolist() == [[True, False], [True, False]]
    partial = [_token(0, [(2, 0.9, False)])]
    signals, _ = request_evidence(partial, exit_layers=[2, 4])
    assert signals[0, 0] == 0.9 and math.isnan(signals[0, 1])  # never exits at layer 4
    with pytest.raises(ValueError, match=r"positions 0\.\.T-1"):
        request_evidence([records[0]], exit_layers=[2, 4])


def test_a_summary_over_many_requests():
    same = (np.array([[0.9, 0.9]]), np.array([[True, True]]))
    early = (np.array([[0.1, 0.1], [0.9, 0.2]]), np.array([[True, True], [False, True]]))
    thresholds = np.array([[0.5, 0.5], [1.0, 1.0]])
    summary = summarize([same, early], thresholds)
    assert summary.requests == 2
    assert summary.divergence.tolist() == [[-1, -1], [1, -1]]
    assert summary.differing.tolist() == [1, 0]
    assert summary.share_differing.tolist() == [0.5, 0.0]
    assert summary.positions(0).tolist() == [1] and summary.positions(1).tolist() == []
    nothing = summarize([], thresholds)
    assert nothing.requests == 0 and np.isnan(nothing.share_differing).all()
