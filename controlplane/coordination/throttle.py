"""Sign-in throttling: failures counted per (username, client address), exponential backoff.

The first FREE_FAILURES - 1 failures of a pair cost nothing; the n-th from then on locks that
pair for BASE_S x 2^(n - FREE_FAILURES) seconds (2, 4, 8 ... s), at most MAX_LOCK_S. A pair's
count is forgotten FORGET_S after its last failure; a success forgets only that pair. Keying
by the address as well means an attacker elsewhere cannot lock the admin out, and nothing
clears every entry at once, so an attacker cannot reset the counts by flooding.

With Redis configured the counts live there (every API process sees the same); without it
(the embedded default runs one API process) they live in the process. While Redis cannot be
reached the process's own counts apply, so sign-in stays possible and still throttled.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import redis

log = logging.getLogger("exitplane.coordination")

FREE_FAILURES = 5
BASE_S = 2.0
MAX_LOCK_S = 900.0
FORGET_S = 86400.0
KEY_PREFIX = "exitplane:signin:"
LOCAL_SOFT_CAP = 50_000


def lock_seconds(failures: int) -> float:
    """How long the pair is locked after its `failures`-th failure."""
    if failures < FREE_FAILURES:
        return 0.0
    return min(MAX_LOCK_S, BASE_S * 2 ** min(failures - FREE_FAILURES, 30))


def _pair(username: str, address: str) -> str:
    # Hashed: keys then carry neither user names nor addresses, and have a bounded length.
    return hashlib.sha256(f"{username.strip().lower()}\0{address}".encode()).hexdigest()[:32]


class SignInThrottle:
    """Failed sign-ins per (username, address): in Redis when `client` is given."""

    def __init__(self, client: redis.Redis | None = None) -> None:
        self._client = client
        self._local: dict[str, tuple[int, float, float]] = {}  # pair -> (n, locked_until, last)
        self._lock = threading.Lock()

    def blocked_for(self, username: str, address: str) -> float:
        """Seconds before this pair may try again (0: now)."""
        pair = _pair(username, address)
        if self._client is not None:
            try:
                remaining_ms = self._client.pttl(KEY_PREFIX + pair + ":lock")
                return max(0.0, remaining_ms / 1000, self._local_lock(pair))
            except (redis.RedisError, OSError) as error:
                log.warning("shared sign-in throttle unavailable (%s)", type(error).__name__)
        return self._local_lock(pair)

    def _local_lock(self, pair: str) -> float:
        with self._lock:
            _, locked_until, _ = self._local.get(pair, (0, 0.0, 0.0))
        return max(0.0, locked_until - time.time())

    def failed(self, username: str, address: str) -> float:
        """Count a failure; returns the seconds the pair is now locked for."""
        pair = _pair(username, address)
        if self._client is not None:
            try:
                return self._failed_shared(pair)
            except (redis.RedisError, OSError) as error:
                log.warning("shared sign-in throttle unavailable (%s)", type(error).__name__)
        return self._failed_local(pair)

    def _failed_shared(self, pair: str) -> float:
        count_key = KEY_PREFIX + pair + ":n"
        with self._client.pipeline(transaction=True) as pipe:
            failures, _ = pipe.incr(count_key).expire(count_key, int(FORGET_S)).execute()
        wait = lock_seconds(int(failures))
        if wait > 0:
            self._client.set(KEY_PREFIX + pair + ":lock", "1", px=int(wait * 1000))
        return wait

    def _failed_local(self, pair: str) -> float:
        now = time.time()
        with self._lock:
            failures, _, last = self._local.get(pair, (0, 0.0, now))
            if now - last > FORGET_S:
                failures = 0
            failures += 1
            wait = lock_seconds(failures)
            self._local[pair] = (failures, now + wait, now)
            if len(self._local) > LOCAL_SOFT_CAP:
                self._forget_harmless(now)
        return wait

    def succeeded(self, username: str, address: str) -> None:
        """Forget this pair's failures (and only this pair's)."""
        pair = _pair(username, address)
        if self._client is not None:
            try:
                self._client.delete(KEY_PREFIX + pair + ":n", KEY_PREFIX + pair + ":lock")
            except (redis.RedisError, OSError) as error:
                log.warning("shared sign-in throttle unavailable (%s)", type(error).__name__)
        with self._lock:
            self._local.pop(pair, None)

    def _forget_harmless(self, now: float) -> None:
        """Bound memory by dropping pairs whose loss changes nothing an attacker could use:
        forgotten ones, and unlocked ones that had not passed their free failures."""
        for pair, (failures, locked_until, last) in list(self._local.items()):
            if now - last > FORGET_S or (failures < FREE_FAILURES and locked_until <= now):
                del self._local[pair]
