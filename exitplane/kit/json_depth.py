"""How deeply a JSON text nests, measured before anything decodes it. Python's decoder recurses
once per level, so a body of a few kilobytes of `[` would take the stack to its limit; every
JSON body a client sends is checked here first and refused past `MAX_JSON_DEPTH`. Standard
library only: the scan runs in C (`bytes.replace`, `translate` and `split` drop escapes and
strings and keep the brackets, `itertools.accumulate` sums them), with no Python loop per
byte."""

from __future__ import annotations

from itertools import accumulate

# No body exitplane takes nests past a handful of levels (a telemetry batch: 4).
MAX_JSON_DEPTH = 32

_KEEP_QUOTES_AND_BRACKETS = bytes(b for b in range(256) if b not in b'"[]{}')
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


class TooDeep(ValueError):
    """A JSON text that nests past the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"JSON nests deeper than {limit} levels")
        self.limit = limit


def json_depth(text: bytes) -> int:
    """The deepest nesting of arrays and objects in `text` (0 for a scalar). Brackets inside
    strings do not count; an unterminated string ends the count where it starts (the decoder
    refuses such a text anyway)."""
    if not (b"[" in text or b"{" in text):
        return 0
    # Escapes go first (a backslash always opens a pair, read left to right), so every quote
    # left delimits a string; between quote pairs lies structure.
    unescaped = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = unescaped.translate(None, _KEEP_QUOTES_AND_BRACKETS)
    brackets = structure.replace(b'""', b"")
    if b'"' in brackets:  # some string holds a bracket: drop what lies inside quote pairs
        brackets = b"".join(structure.split(b'"')[::2])  # an unterminated tail is odd
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_json_depth(text: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise TooDeep when `text` nests deeper than `limit`. A text with no more than `limit`
    opening brackets in all passes at the cost of two counts."""
    if text.count(b"[") + text.count(b"{") <= limit:
        return
    if json_depth(text) > limit:
        raise TooDeep(limit)
