"""The nesting depth of a JSON text, measured without decoding it, agrees with the depth of
what the decoder builds, whatever strings, escapes and brackets the text holds."""

from __future__ import annotations

import json
import random

import pytest

from exitplane.kit.json_depth import MAX_JSON_DEPTH, TooDeep, check_json_depth, json_depth

_PIECES = ["[", "]", "{", "}", '"', "\\", "a", "\n", '"\\"', "\\\\", "é", "\u2028"]


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def _value(rng: random.Random, level: int, tricky: float):
    def text() -> str:
        if rng.random() >= tricky:
            return "plain"
        return "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 6)))

    roll = rng.random()
    if level > 7 or roll < 0.3:
        return rng.choice([text(), rng.randint(-5, 5), None, True, 1.5])
    if roll < 0.65:
        return [_value(rng, level + 1, tricky) for _ in range(rng.randint(0, 3))]
    return {text(): _value(rng, level + 1, tricky) for _ in range(rng.randint(0, 3))}


@pytest.mark.parametrize("tricky", [0.0, 0.2, 1.0])
def test_depth_matches_the_decoded_value(tricky):
    rng = random.Random(int(tricky * 10))
    for _ in range(4000):
        value = _value(rng, 0, tricky)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 1])).encode()
        assert json_depth(text) == _depth(value), text


def test_brackets_in_strings_and_unterminated_strings_are_not_structure():
    assert json_depth(b'{"a": "[[[[{{{{"}') == 1
    assert json_depth(b'["\\\\", [[1]]]') == 3  # an escaped backslash ends before the quote
    assert json_depth(b'["\\"[[[", 1]') == 1  # an escaped quote does not end the string
    assert json_depth(b'[1, "[[[[[[') == 1
    assert json_depth(b"12") == 0


def test_check_refuses_past_the_limit_and_passes_at_it():
    at_limit = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    check_json_depth(at_limit)
    check_json_depth(b"[" + b"[]," * 10_000 + b"[]]")  # many brackets, depth 2
    with pytest.raises(TooDeep, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        check_json_depth(b"[" + at_limit + b"]")
    with pytest.raises(TooDeep):
        check_json_depth(b'{"a":' * 100_000)  # never closed: still measured, still refused
