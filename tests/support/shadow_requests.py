"""Shadow requests as runtimes ship them: whole requests at full depth, every token labelled at
every exit layer, the last one marked `request_end`; and synthetic requests whose answer risk
under any threshold set is known in closed form."""

from __future__ import annotations

import numpy as np

from tests.support.calibration import FULL, LAYERS


def shadow_request_records(signals: np.ndarray, matched: np.ndarray, *, request_id: str,
                           start: float, version: int = 0, segment: str | None = None,
                           layers: list[int] = LAYERS, num_layers: int = FULL,
                           end: bool = True) -> list[dict]:
    """The wire records of one shadow request of len(signals) tokens ((T, L) labels in
    `layers` order), a token every 10 ms from unix time `start`; the last marked as the
    request's end unless `end` is False."""
    records = []
    for position in range(len(signals)):
        record = {"threshold_version": version, "request_id": request_id,
                  "position": position, "exit_layer": num_layers,
                  "signal_value": float(signals[position, -1]), "latency_us": 900,
                  "ts": start + position * 0.01, "shadow_request": True,
                  "shadow": [{"layer": layer, "signal": float(signals[position, j]),
                              "matched": bool(matched[position, j])}
                             for j, layer in enumerate(layers)]}
        if segment is not None:
            record["segment"] = segment
        records.append(record)
    if end and records:
        records[-1]["request_end"] = True
    return records


class KnownAnswerRisk:
    """Tokens whose signal at each exit layer is uniform on [0, 1) and independent, matching
    full depth with probability signal**power[l]; requests of `tokens` tokens each. A token
    exits under θ at its first layer with signal > θ_l, wrongly with probability
    q(θ) = sum_l prod_{j<l} θ_j ∫_{θ_l}^1 (1 - s^a_l) ds, so P(answer differs) = 1 - (1 - q)^T,
    exactly."""

    def __init__(self, power=(1.0, 2.0, 4.0), tokens: int = 8) -> None:
        self.power, self.tokens = np.asarray(power, dtype=float), tokens

    def tokens_of(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(signals float32 (n, L), matched bool (n, L))."""
        signals = rng.random((n, len(self.power))).astype(np.float32)
        matched = rng.random(signals.shape) < signals.astype(float) ** self.power[None, :]
        return signals, matched

    def token_risk(self, thresholds) -> float:
        """q(θ): the share of tokens that exit with a mismatch."""
        theta = np.clip(np.asarray(thresholds, dtype=float), 0.0, 1.0)
        a = self.power
        wrong_above = (1.0 - theta) - (1.0 - theta ** (a + 1.0)) / (a + 1.0)
        reach = np.concatenate([[1.0], np.cumprod(theta)[:-1]])
        return float((reach * wrong_above).sum())

    def answer_risk(self, thresholds) -> float:
        """P(a request's answer differs from full depth) under θ."""
        return 1.0 - (1.0 - self.token_risk(thresholds)) ** self.tokens
