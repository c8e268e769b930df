"""The column-wise batch parser accepts exactly what the wire model accepts, with the same
values and the same errors; the batch check names the first bad record whatever its fault."""

import copy
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from controlplane.deployments.models import Deployment
from controlplane.errors import Invalid
from controlplane.telemetry import columns
from controlplane.telemetry.columns import MODEL_RULES, BatchColumns, parse_batch
from controlplane.telemetry.service import BadRecord, check_batch
from exitplane.wire import ShadowPoint, TelemetryBatch, TokenRecord
from tests.support.batches import telemetry_batch
from tests.support.deployments import FULL, LAYERS


def _record(index: int, shadow: bool = False) -> dict:
    record = {"threshold_version": 2, "request_id": f"r{index % 3}", "position": index,
              "exit_layer": FULL if shadow else LAYERS[index % 3],
              "signal_value": 0.25 * (index % 5), "latency_us": 100 + index,
              "ts": 1.7e9 + index * 0.3}
    if shadow:
        record["shadow"] = [{"layer": layer, "signal": 0.3 * position, "matched": position != 1}
                            for position, layer in enumerate(reversed(LAYERS))]
    return record


def _batch(size: int = 6) -> dict:
    return telemetry_batch([_record(i, shadow=i % 3 == 1) for i in range(size)],
                           batch_id="batch-0001", seq=3)


def _outcome(parse, payload):
    try:
        batch = parse(copy.deepcopy(payload))
    except ValidationError as error:
        return "error", error.errors(include_url=False, include_context=False)
    values = {}
    for field in dataclasses.fields(BatchColumns):
        value = getattr(batch, field.name)
        if isinstance(value, np.ndarray):
            # NaN (an unchecked token's signal) never equals itself: compare it as None.
            listed = [None if x != x else x for x in value.ravel().tolist()]
            value = (value.dtype.str, value.shape, listed)
        values[field.name] = value
    return "ok", values


def _by_model(payload):
    return BatchColumns.from_model(TelemetryBatch.model_validate(payload))


ODD_VALUES = [0, 1, 3, 12, 13, 2.0, 2.5, -1, True, False, "7", "x", "", None, 2**31, 2**63,
              1e11, float("nan"), float("inf"), [], {}, (1,), "é" * 130]


@st.composite
def mutated_batches(draw):
    payload = _batch(draw(st.integers(1, 6)))
    records = payload["records"]
    for _ in range(draw(st.integers(0, 3))):
        record = records[draw(st.integers(0, len(records) - 1))]
        if not isinstance(record, dict):
            continue
        shadow = record.get("shadow") if isinstance(record.get("shadow"), list) else None
        kind = draw(st.sampled_from(["header", "record", "drop", "point", "shape"]))
        if kind == "header":
            payload[draw(st.sampled_from(list(TelemetryBatch.model_fields)))] = \
                draw(st.sampled_from(ODD_VALUES))
        elif kind == "record":
            record[draw(st.sampled_from(list(TokenRecord.model_fields)))] = \
                draw(st.sampled_from(ODD_VALUES))
        elif kind == "drop":
            record.pop(draw(st.sampled_from(list(TokenRecord.model_fields))), None)
        elif kind == "point" and shadow:
            point = shadow[draw(st.integers(0, len(shadow) - 1))]
            if isinstance(point, dict):
                point[draw(st.sampled_from(list(ShadowPoint.model_fields)))] = \
                    draw(st.sampled_from([*ODD_VALUES, 3, 6, 9]))
        elif kind == "shape":
            change = draw(st.sampled_from(["extra key", "no dict", "tuple records", "repeat",
                                           "no points", "points tuple", "point no dict",
                                           "too deep"]))
            if change == "extra key":
                record["unknown"] = 1
            elif change == "no dict":
                records[0] = [1, 2]
            elif change == "tuple records":
                payload["records"] = tuple(records)
            elif change == "repeat" and shadow and isinstance(shadow[0], dict):
                shadow.append(dict(shadow[0]))  # (an earlier mutation may have made it a tuple)
            elif change == "no points":
                record["shadow"] = []
            elif change == "points tuple" and shadow:
                record["shadow"] = tuple(shadow)
            elif change == "point no dict" and shadow:
                shadow[0] = (3, 0.5, True)
            elif change == "too deep":
                record["exit_layer"] = FULL + 1
    return payload


@settings(max_examples=400, deadline=None)
@given(mutated_batches())
def test_parser_agrees_with_the_wire_model(payload):
    assert _outcome(parse_batch, payload) == _outcome(_by_model, payload)


@pytest.mark.parametrize("payload", [
    _batch(),
    TelemetryBatch.model_validate(_batch()).model_dump(mode="json"),  # what the shipper sends
])
def test_valid_batches_take_the_column_path(payload):
    batch = columns._parse_columns(payload)  # raises _NotFast if it would fall back
    assert len(batch) == 6 and batch.shadowed.tolist() == [1, 4]
    assert batch.to_wire() == TelemetryBatch.model_validate(payload).model_dump(mode="json")


def test_every_model_validator_is_guarded():
    """A validator the column path does not know about would let bad batches through."""
    found = {f"{model.__name__}.{name}"
             for model in (TelemetryBatch, TokenRecord, ShadowPoint)
             for kind in ("validators", "field_validators", "root_validators",
                          "model_validators")
             for name in getattr(model.__pydantic_decorators__, kind)}
    assert found == MODEL_RULES


def _check(payload):
    deployment = Deployment(id=1, name="chat", num_layers=FULL, exit_layers=LAYERS)
    check_batch(deployment=deployment, batch=parse_batch(payload), known_versions={0, 2})


@pytest.mark.parametrize(("changes", "message"), [
    ({5: {"threshold_version": 7}, 2: {"exit_layer": 4}}, "record 2: exit_layer 4 is neither"),
    ({4: {"shadow": [{"layer": 3, "signal": 0.1, "matched": True}]}, 5: {"exit_layer": 5}},
     "record 4: shadow points must cover exactly the exit layers [3, 6, 9]"),
    ({1: {"shadow": [*_record(1, shadow=True)["shadow"], {"layer": 4, "signal": 0.1,
                                                          "matched": True}]}},
     "record 1: shadow points must cover exactly"),
    ({3: {"shadow": []}}, "record 3: shadow points must cover exactly"),
    ({0: {"threshold_version": 1, "exit_layer": 5}}, "record 0: exit_layer 5 is neither"),
    ({5: {"threshold_version": 1}}, "record 5: threshold_version 1 was never published"),
])
def test_the_first_bad_record_is_named(changes, message):
    payload = _batch()
    for index, change in changes.items():
        payload["records"][index] |= change
    with pytest.raises(BadRecord, match=message.replace("[", r"\[").replace("]", r"\]")):
        _check(payload)


def test_a_batch_for_another_model_is_refused_whole():
    with pytest.raises(Invalid, match="num_layers 30"):
        _check({**_batch(), "num_layers": 30})
    _check(_batch())
