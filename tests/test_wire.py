"""The wire schema: checksums, validation, and what a runtime refuses."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from exitplane.wire import (
    TelemetryBatch,
    ThresholdSetWire,
    TokenRecord,
    threshold_checksum,
    validate_thresholds,
)


def test_checksum_is_stable_and_order_independent():
    a = threshold_checksum(deployment="d", version=2, signal="learned", thresholds={6: 0.9, 9: 0.8})
    b = threshold_checksum(deployment="d", version=2, signal="learned", thresholds={9: 0.8, 6: 0.9})
    assert a == b
    assert a != threshold_checksum(deployment="d", version=3, signal="learned",
                                   thresholds={6: 0.9, 9: 0.8})


def test_tampered_set_fails_verification():
    good = ThresholdSetWire.build(deployment="d", version=1, signal="maxprob",
                                  thresholds={6: 0.9})
    good.verify()
    tampered = good.model_copy(update={"thresholds": {6: 0.1}})
    with pytest.raises(ValueError, match="checksum mismatch"):
        tampered.verify()


def test_never_exit_set_is_all_ones():
    conservative = ThresholdSetWire.never_exit(deployment="d", signal="learned",
                                               exit_layers=[6, 9])
    assert conservative.thresholds == {6: 1.0, 9: 1.0}
    conservative.verify()


@pytest.mark.parametrize(("thresholds", "message"), [
    ({6: 0.5}, "missing thresholds for exit layers \\[9\\]"),
    ({6: 0.5, 9: 0.5, 12: 0.5}, "unknown exit layers \\[12\\]"),
    ({6: 0.5, 9: 1.5}, "layer 9 is 1.5"),
    ({6: 0.5, 9: "high"}, "must be a number"),
])
def test_validate_thresholds_names_the_problem(thresholds, message):
    with pytest.raises(ValueError, match=message):
        validate_thresholds(thresholds, [6, 9])


def _record(**overrides):
    base = dict(threshold_version=1, request_id="r", position=0, exit_layer=6,
                signal_value=0.9, latency_us=100, ts=1.0)
    return TokenRecord(**{**base, **overrides})


def test_batch_rejects_exit_layer_beyond_model():
    with pytest.raises(ValidationError, match="record 1: exit_layer 31 exceeds num_layers 30"):
        TelemetryBatch(batch_id="abcdefgh", deployment="d", runtime_id="r", seq=0, num_layers=30,
                       records=[_record(), _record(exit_layer=31)])


@given(st.dictionaries(st.integers(0, 40), st.floats(0, 1), min_size=1, max_size=10))
def test_built_sets_always_verify(thresholds):
    wire = ThresholdSetWire.build(deployment="d", version=1, signal="learned",
                                  thresholds=thresholds)
    wire.verify()
    again = ThresholdSetWire.model_validate_json(wire.model_dump_json())
    again.verify()
    assert again == wire


@given(st.dictionaries(st.integers(1, 20), st.one_of(st.floats(allow_nan=True), st.text()),
                       max_size=6), st.lists(st.integers(1, 20), unique=True, max_size=6))
def test_validator_accepts_only_exact_coverage_in_range(thresholds, layers):
    ok = (set(thresholds) == set(layers)
          and all(isinstance(v, float) and 0 <= v <= 1 for v in thresholds.values()))
    if ok:
        validate_thresholds(thresholds, layers)
    else:
        with pytest.raises(ValueError):
            validate_thresholds(thresholds, layers)
