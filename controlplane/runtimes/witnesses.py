"""Witnesses: the credentials whose word the fleet's robust rules count.

A runtime id is a claim any token could make; a credential is a witness. Each shadow token is
stored with the witness that vouches for it: `token:<id>` for the token that posted it,
`runtime:<id>` when no token did (a service writing evidence itself). The share cap,
leave-one-out, the cross-runtime holdout, the outlier screen, canary analysis and the
few-witnesses promotion rule group evidence by witness, so N runtime ids of one token are one
witness, and a token cannot speak under another token's runtime ids (they belong to the token
that registered them: `controlplane.runtimes.service.claim_runtime_ids`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np

TOKEN_PREFIX = "token:"
RUNTIME_PREFIX = "runtime:"


def witness_of(*, token_id: int | None, runtime_id: str) -> str:
    """The witness of evidence posted by `token_id` under `runtime_id`."""
    if token_id is not None:
        return f"{TOKEN_PREFIX}{token_id}"
    return f"{RUNTIME_PREFIX}{runtime_id}"


def witness_labels(witnesses: Sequence[str], runtimes: Sequence[str]) -> np.ndarray:
    """Each sample's witness; a sample stored without one ('') stands for its runtime id."""
    labels = np.asarray(witnesses, dtype=object)
    if len(labels) and (labels == "").any():
        fallback = np.array([f"{RUNTIME_PREFIX}{runtime}" for runtime in runtimes],
                            dtype=object)
        labels = np.where(labels == "", fallback, labels)
    return labels.astype(str) if len(labels) else np.zeros(0, dtype=str)


def token_of(witness: str) -> int | None:
    """The token id a witness names (None for a runtime-id witness)."""
    if witness.startswith(TOKEN_PREFIX) and witness[len(TOKEN_PREFIX):].isdigit():
        return int(witness[len(TOKEN_PREFIX):])
    return None


class ClaimCache:
    """Which runtime ids each token may report under, as this API process last found them in
    the store (`service.claim_runtime_ids`), trusted for `fresh_s` seconds: telemetry on the
    event loop checks here and reads the store only for an id it has not seen lately. Bounded:
    past `max_entries` it starts afresh (forgotten ids are checked in the store once again)."""

    def __init__(self, *, fresh_s: float = 30.0, max_entries: int = 100_000) -> None:
        self.fresh_s, self.max_entries = fresh_s, max_entries
        self._owner: dict[tuple[int, str], tuple[int, float]] = {}
        self._lock = threading.Lock()

    def known(self, deployment_id: int, token_id: int, runtime_ids: Iterable[str]) -> bool:
        """Whether every id of `runtime_ids` was found registered to `token_id` lately."""
        now = time.monotonic()
        for runtime_id in runtime_ids:
            found = self._owner.get((deployment_id, runtime_id))
            if found is None or found[0] != token_id or now - found[1] > self.fresh_s:
                return False
        return True

    def remember(self, deployment_id: int, token_id: int, runtime_ids: Iterable[str]) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._owner) >= self.max_entries:
                self._owner.clear()
            for runtime_id in runtime_ids:
                self._owner[(deployment_id, runtime_id)] = (token_id, now)

    def forget(self, deployment_id: int, runtime_ids: Iterable[str]) -> None:
        """Runtimes removed or left: their next report is checked in the store."""
        with self._lock:
            for runtime_id in runtime_ids:
                self._owner.pop((deployment_id, runtime_id), None)
