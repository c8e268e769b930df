"""Per-key rate limits: `rate` units per second with bursts of 2 x rate; a request takes one unit
unless it says it costs more (each route's cost: controlplane/guards/policy.py).

With Redis configured, one GCRA bucket per key lives in Redis (a Lua script, atomic, timed by the
Redis server's clock), so every API process draws from the same bucket whichever one answers.
Without Redis (the embedded default runs one API process) the bucket lives in the process:
the same limit, and nothing to share it with.

If Redis cannot be reached the check falls back to this process's bucket rather than refusing
traffic: a Redis outage must not stop runtimes from pulling their thresholds.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
import redis.asyncio

log = logging.getLogger("exitplane.coordination")

KEY_PREFIX = "exitplane:ratelimit:"
# Checks in flight to Redis per API process; past them a check waits for a connection up to
# POOL_WAIT_S, then limits in process. The fallback is logged at most every UNSHARED_LOG_EVERY_S.
POOL_CONNECTIONS = 100
POOL_WAIT_S = 0.25
UNSHARED_LOG_EVERY_S = 10.0

# GCRA: the key holds the theoretical arrival time (TAT, microseconds of the Redis clock).
# A request of `cost` units is allowed when TAT + (cost - 1) x interval - now <= tolerance; it
# then advances TAT by `cost` intervals (one unit: TAT - now <= tolerance, one interval).
# Returns the microseconds to wait (0: taken).
GCRA_LUA = """
local function gcra_take(key, interval, tolerance, cost)
  cost = cost or 1
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local wait = tat + (cost - 1) * interval - now - tolerance
  if wait > 0 then
    return math.max(1, math.ceil(wait))
  end
  tat = tat + cost * interval
  redis.call('SET', key, string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
  return 0
end
"""
_GCRA = (GCRA_LUA
         + "return gcra_take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]))\n")
# A charge after the fact: TAT advances by `cost` intervals whatever it was, so the key owes
# what it spent (at most ARGV[3] microseconds ahead of now) and waits it out.
_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
tat = math.min(tat + tonumber(ARGV[2]) * tonumber(ARGV[1]), now + tonumber(ARGV[3]))
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
return 0
"""
# The most a charge can make a key owe: it waits at most this long afterwards.
MAX_DEBT_S = 60.0


class LocalRateLimiter:
    """A token bucket per key, in this process."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = max(1.0, 2 * rate)
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str, cost: float = 1.0) -> float | None:
        """Take `cost` units from `key`'s bucket; the seconds to wait when it holds fewer."""
        if self.rate <= 0:
            return None
        cost = min(cost, self.burst)
        now = time.monotonic()
        with self._lock:
            level, last = self._buckets.get(key, (self.burst, now))
            level = min(self.burst, level + (now - last) * self.rate)
            if level < cost:
                self._buckets[key] = (level, now)
                return (cost - level) / self.rate
            self._buckets[key] = (level - cost, now)
            self._forget_full(now)
            return None

    def charge(self, key: str, cost: float) -> None:
        """Take `cost` units after the fact, into debt (at most MAX_DEBT_S of refill): the key
        waits until it is paid back."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        with self._lock:
            level, last = self._buckets.get(key, (self.burst, now))
            level = min(self.burst, level + (now - last) * self.rate)
            self._buckets[key] = (max(level - cost, -MAX_DEBT_S * self.rate), now)

    async def owe(self, key: str, cost: float) -> None:
        """`charge` from the event loop."""
        self.charge(key, cost)

    def _forget_full(self, now: float) -> None:
        if len(self._buckets) > 100_000:
                # Only full buckets are forgotten: dropping one loses nothing.
                full = [k for k, (lvl, t) in self._buckets.items()
                        if lvl + (now - t) * self.rate >= self.burst]
                for stale in full:
                    del self._buckets[stale]

    async def retry_after(self, key: str, cost: float = 1.0) -> float | None:
        return self.take(key, cost)


class RedisRateLimiter:
    """A GCRA bucket per key in Redis, shared by every API process."""

    def __init__(self, rate: float, *, kind: str, client: redis.asyncio.Redis,
                 blocking_client: redis.Redis | None = None) -> None:
        self.rate = rate
        self.burst = max(1.0, 2 * rate)
        self._prefix = f"{KEY_PREFIX}{kind}:"
        self._client = client
        self._script = client.register_script(_GCRA)
        # The same script and keys through a blocking client, for callers already on a worker
        # thread (the telemetry fast path): a third of the CPU of the asyncio client's call.
        self._blocking_script = (blocking_client.register_script(_GCRA)
                                 if blocking_client is not None else None)
        self._charge_script = (blocking_client.register_script(_CHARGE)
                               if blocking_client is not None else None)
        self._async_charge_script = client.register_script(_CHARGE)
        self._local = LocalRateLimiter(rate)
        self._unshared_count = 0
        self._unshared_logged = float("-inf")
        interval_us = 1_000_000 / rate if rate > 0 else 0
        self._args = (f"{interval_us:.0f}", f"{(self.burst - 1) * interval_us:.0f}")

    async def retry_after(self, key: str, cost: float = 1.0) -> float | None:
        """Take `cost` units from `key`'s shared bucket; the seconds to wait when it holds
        fewer."""
        if self.rate <= 0:
            return None
        try:
            wait_us = await self._script(keys=[self._prefix + key], args=self._cost(cost))
        except (redis.RedisError, OSError) as error:
            return self._unshared(key, error, cost)
        wait = float(wait_us) / 1_000_000
        return wait if wait > 0 else None

    def take(self, key: str, cost: float = 1.0) -> float | None:
        """`retry_after` for a worker thread (blocking; the same shared bucket)."""
        if self.rate <= 0:
            return None
        if self._blocking_script is None:
            raise RuntimeError("this limiter was made without a blocking client")
        try:
            wait_us = self._blocking_script(keys=[self._prefix + key], args=self._cost(cost))
        except (redis.RedisError, OSError) as error:
            return self._unshared(key, error, cost)
        wait = float(wait_us) / 1_000_000
        return wait if wait > 0 else None

    def charge(self, key: str, cost: float) -> None:
        """`LocalRateLimiter.charge` on the shared bucket (blocking, for a worker thread)."""
        if self.rate <= 0:
            return
        if self._charge_script is None:
            raise RuntimeError("this limiter was made without a blocking client")
        try:
            self._charge_script(keys=[self._prefix + key], args=self._charge_args(cost))
        except (redis.RedisError, OSError) as error:
            self._unshared(key, error, 0)
            self._local.charge(key, cost)

    async def owe(self, key: str, cost: float) -> None:
        """`charge` from the event loop."""
        if self.rate <= 0:
            return
        try:
            await self._async_charge_script(keys=[self._prefix + key],
                                            args=self._charge_args(cost))
        except (redis.RedisError, OSError) as error:
            self._unshared(key, error, 0)
            self._local.charge(key, cost)

    def _charge_args(self, cost: float) -> list[str]:
        return [self._args[0], f"{cost:g}",
                f"{MAX_DEBT_S * 1_000_000 + float(self._args[1]):.0f}"]

    def _cost(self, cost: float) -> tuple[str, str, str]:
        # More than a burst could never be taken: such a request costs a full burst.
        return (*self._args, f"{min(cost, self.burst):g}")

    def _unshared(self, key: str, error: Exception, cost: float = 1.0) -> float | None:
        self._unshared_count += 1
        now = time.monotonic()
        if now - self._unshared_logged >= UNSHARED_LOG_EVERY_S:
            log.warning("shared rate limit unavailable (%s); limiting in process (%d checks "
                        "since the last such line)", type(error).__name__, self._unshared_count)
            self._unshared_logged, self._unshared_count = now, 0
        return self._local.take(key, cost)


RateLimiter = LocalRateLimiter | RedisRateLimiter


def make_rate_limiters(*, rates: dict[str, float], redis_url: str) -> dict[str, RateLimiter]:
    """One limiter per kind: shared through Redis when `redis_url`, else in process."""
    if not redis_url:
        return {kind: LocalRateLimiter(rate) for kind, rate in rates.items()}
    # Short timeouts: a limit check sits on the hot path of every pull. Bounded pools that wait
    # briefly for a connection: a burst of checks queues for the shared limit rather than
    # falling back to this process's own.
    client = redis.asyncio.Redis(connection_pool=redis.asyncio.BlockingConnectionPool.from_url(
        redis_url, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_S,
        socket_connect_timeout=0.5, socket_timeout=0.5))
    blocking = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
        redis_url, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_S,
        socket_connect_timeout=0.5, socket_timeout=0.5))
    return {kind: RedisRateLimiter(rate, kind=kind, client=client, blocking_client=blocking)
            for kind, rate in rates.items()}
