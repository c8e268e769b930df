"""The exact answer loss of a shadow request under any threshold set.

A shadow request is served entirely at full depth and records, for every generated token in
order, each exit layer's signal and whether that layer's top-1 matched the full model's. Under
greedy decoding, the answer a threshold set θ would have given is the full-depth answer up to
the first token that would have exited (at its first exit layer whose signal is strictly
greater than θ at that layer, compared in 32 bits as the runtime compares: `stats.exits`) at a
layer whose prediction did not match; from that token on the answers differ. So the position of
that token, or -1, is the answer loss of the request under θ, exactly, provided that before it
the runtime's KV cache after an early exit holds what the full model would (skipped layers
computed later or recomputed, the `lazy` policy): then every earlier token, its hidden states
and its signals are those the shadow request recorded. Under a policy that approximates the
skipped layers' KV (`propagate`), the prediction is exact up to and including the first token
that exits; later tokens see an approximate cache and may move.
A sampled (temperature > 0) answer is not covered.

Plain numpy, vectorised over many threshold sets at once; no database.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from controlplane.stats.exits import as_compared, passes
from exitplane.wire import TokenRecord

# Elements of the (sets, tokens, layers) comparison built at once; larger inputs are taken in
# slices of threshold sets, so memory stays bounded whatever K is.
_CHUNK_ELEMENTS = 1 << 24


def _check(signals: np.ndarray, matched: np.ndarray,
           thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    signals = as_compared(signals)
    matched = np.asarray(matched, dtype=bool)
    thresholds = as_compared(thresholds)
    if thresholds.ndim == 1:
        thresholds = thresholds[None]
    if signals.ndim != 2 or signals.shape != matched.shape:
        raise ValueError(f"signals {signals.shape} and matched {matched.shape} must be the same "
                         "(tokens, exit layers) shape")
    if thresholds.ndim != 2 or thresholds.shape[1] != signals.shape[1]:
        raise ValueError(f"thresholds {thresholds.shape} must be (sets, {signals.shape[1]}): "
                         "one threshold per exit layer")
    return signals, matched, thresholds


def exit_columns(signals: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """(K, T) int: for each set and token, the column (exit layer, ascending) the token exits
    at (its first with signal > threshold), or -1 where it runs to full depth. A NaN signal
    (the layer was not checked) never exits; nor does a threshold of 1.0 or more."""
    signals, _, thresholds = _check(signals, np.zeros(np.shape(signals), dtype=bool), thresholds)
    return np.concatenate([_exits(signals, part) for part in _slices(signals, thresholds)])


def first_divergence(signals: np.ndarray, matched: np.ndarray,
                     thresholds: np.ndarray) -> np.ndarray:
    """(K,) int: for each threshold set (row of `thresholds`, (K, L)), the position of the
    first token of the request (`signals`, `matched`: (T, L), columns the exit layers in
    ascending order) that would exit under it at a layer whose prediction did not match the
    full model's, or -1 where the answer under that set is the full-depth answer."""
    signals, matched, thresholds = _check(signals, matched, thresholds)
    if signals.shape[0] == 0:  # no token generated: nothing can differ
        return np.full(len(thresholds), -1, dtype=np.int64)
    rows = np.arange(signals.shape[0])
    out = []
    for part in _slices(signals, thresholds):
        column = _exits(signals, part)  # (k, T)
        hit = matched[rows[None], np.maximum(column, 0)]  # (k, T): the exit layer's match
        wrong = (column >= 0) & ~hit  # exits with a mismatched prediction
        out.append(np.where(wrong.any(axis=1), np.argmax(wrong, axis=1), -1))
    return np.concatenate(out).astype(np.int64)


def answer_differs(signals: np.ndarray, matched: np.ndarray,
                   thresholds: np.ndarray) -> np.ndarray:
    """(K,) bool: whether the request's answer under each set differs from full depth."""
    return first_divergence(signals, matched, thresholds) >= 0


def _slices(signals: np.ndarray, thresholds: np.ndarray) -> Iterable[np.ndarray]:
    step = max(1, _CHUNK_ELEMENTS // max(1, signals.size))
    yield thresholds[:step]
    for start in range(step, len(thresholds), step):
        yield thresholds[start:start + step]


def _exits(signals: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    cleared = passes(signals[None], thresholds[:, None, :])  # (k, T, L); NaN never clears
    column = np.argmax(cleared, axis=2)
    return np.where(cleared.any(axis=2), column, -1)


def request_evidence(records: Sequence[TokenRecord],
                     exit_layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """A shadow request's (signals, matched), (T, L), from its token records: rows in
    position order (positions 0..T-1, each once), columns `exit_layers` ascending. A layer a
    token has no point for gets a NaN signal (it never exits there)."""
    layers = sorted(exit_layers)
    column = {layer: index for index, layer in enumerate(layers)}
    ordered = sorted(records, key=lambda record: record.position)
    if [record.position for record in ordered] != list(range(len(ordered))):
        raise ValueError("a request's records must hold positions 0..T-1, each once")
    signals = np.full((len(ordered), len(layers)), np.nan)
    matched = np.zeros((len(ordered), len(layers)), dtype=bool)
    for row, record in enumerate(ordered):
        for point in record.shadow or ():
            if point.layer in column:
                signals[row, column[point.layer]] = point.signal
                matched[row, column[point.layer]] = point.matched
    return signals, matched


def packed_divergence(signals: np.ndarray, matched: np.ndarray, offsets: np.ndarray,
                      thresholds: np.ndarray) -> np.ndarray:
    """(m, K) int: the first divergence position of each of m requests packed one after the
    other (request i is rows offsets[i]:offsets[i+1] of `signals`/`matched`) under each set
    (rows of `thresholds`, (K, L)), -1 where its answer equals full depth: `first_divergence`
    for every token of every request at once (sets taken in slices that bound the memory)."""
    thresholds = np.atleast_2d(np.asarray(thresholds, dtype=float))
    offsets = np.asarray(offsets, dtype=np.int64)
    m, total = len(offsets) - 1, len(signals)
    lengths = np.diff(offsets)
    if m == 0 or total == 0:
        return np.full((m, len(thresholds)), -1, dtype=np.int64)
    if (lengths == 0).any():  # an empty answer is its full-depth answer
        out = np.full((m, len(thresholds)), -1, dtype=np.int64)
        kept = lengths > 0
        out[kept] = packed_divergence(signals, matched, np.concatenate(
            [[0], np.cumsum(lengths[kept])]), thresholds)
        return out
    starts = offsets[:-1]
    request_of = np.repeat(np.arange(m), np.diff(offsets))  # (T,)
    position = np.arange(total) - starts[request_of]  # (T,) position within its request
    rows = np.arange(total)
    never = np.iinfo(np.int64).max
    out = np.empty((m, len(thresholds)), dtype=np.int64)
    step = max(1, _CHUNK_ELEMENTS // (total * signals.shape[1]))
    for first in range(0, len(thresholds), step):
        part = thresholds[first:first + step]
        column = exit_columns(signals, part)  # (k, T), -1: full depth
        wrong = (column >= 0) & ~np.asarray(matched, dtype=bool)[rows[None],
                                                                 np.maximum(column, 0)]
        where = np.where(wrong, position[None], never)  # (k, T)
        earliest = np.minimum.reduceat(where, starts, axis=1)  # (k, m)
        out[:, first:first + step] = np.where(earliest == never, -1, earliest).T
    return out


@dataclass(frozen=True)
class AnswerSummary:
    """Answer loss of R requests under K threshold sets: `divergence` (R, K) holds each
    request's first divergence position under each set (-1: identical answer)."""

    divergence: np.ndarray  # (R, K) int64

    @property
    def requests(self) -> int:
        return int(self.divergence.shape[0])

    @property
    def differing(self) -> np.ndarray:
        """(K,) int: requests whose answer differs under each set."""
        return (self.divergence >= 0).sum(axis=0)

    @property
    def share_differing(self) -> np.ndarray:
        """(K,) float: the share of requests whose answer differs (NaN without requests)."""
        if self.requests == 0:
            return np.full(self.divergence.shape[1], np.nan)
        return self.differing / self.requests

    def positions(self, k: int) -> np.ndarray:
        """The first divergence positions of the requests that differ under set `k`."""
        column = self.divergence[:, k]
        return column[column >= 0]


def summarize(requests: Iterable[tuple[np.ndarray, np.ndarray]],
              thresholds: np.ndarray) -> AnswerSummary:
    """`first_divergence` of each request's (signals, matched) under every set."""
    thresholds = np.asarray(thresholds, dtype=np.float64)
    if thresholds.ndim == 1:
        thresholds = thresholds[None]
    pairs = list(requests)
    if not pairs:
        return AnswerSummary(divergence=np.zeros((0, len(thresholds)), dtype=np.int64))
    offsets = np.concatenate([[0], np.cumsum([len(signals) for signals, _ in pairs])])
    return AnswerSummary(divergence=packed_divergence(
        np.concatenate([np.asarray(s, dtype=np.float64) for s, _ in pairs]),
        np.concatenate([np.asarray(m, dtype=bool) for _, m in pairs]), offsets, thresholds))
