"""Password-check throttling: failures counted per client address, per username and per
(username, address), each with its exponential backoff, shared by every API process.

Each key of a check has free failures; the n-th failure from then on locks the key for
BASE_S x 2^(n - free) seconds (2, 4, 8 ... s), at most MAX_LOCK_S. A key's count is forgotten
FORGET_S after its last failure.

- (username, address), 5 free: guessing one user's password from one address.
- address, whatever the username, 20 free: a flood of random usernames from one client.
  IPv6 clients count by their /64 (`controlplane.auth.clients.throttle_key`).
- username, whatever the address, 10 free: guesses spread over many addresses. A browser
  that has signed in as that user before is exempt (`attempt(..., per_user=False)`), so an
  attacker elsewhere cannot lock the user out; the other two keys still hold it.

An attempt is counted as a failure before its password is checked, in one atomic step that
first refuses it if any of its keys is locked (`attempt`): of 30 concurrent wrong passwords
the sixth finds the lock the fifth set, whichever API process answers. A success then
forgets its (username, address) and gives back the one it counted on the other two keys, so
nothing clears a key an attacker has been counting up, and flooding other names resets
nothing.

The counts live in Redis when it is configured (one Lua script, timed by the Redis clock),
else in the database (one short transaction locking the keys' rows), else in this process.
While Redis cannot be reached this process's own counts apply, so sign-in stays possible and
still throttled.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import redis
from sqlalchemy import delete, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from controlplane.auth.clients import throttle_key
from controlplane.auth.models import SignInFailures
from controlplane.db import utcnow

log = logging.getLogger("exitplane.coordination")

FREE_FAILURES = 5
FREE_FAILURES_PER_USER = 10
FREE_FAILURES_PER_ADDRESS = 20
BASE_S = 2.0
MAX_LOCK_S = 900.0
FORGET_S = 86400.0
KEY_PREFIX = "exitplane:signin:"
LOCAL_SOFT_CAP = 50_000
PRUNE_EVERY_S = 60.0

# KEYS: the attempt's keys. ARGV: check (1: refuse while any key is locked), forget, base and
# maximum lock (ms), then each key's free failures. Returns {wait ms (0: counted), then each
# key's lock in ms: what is left of it when refused, what the count set when counted}.
_ATTEMPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[1] == '1' then
  local wait = 0
  local left = {0}
  for i, key in ipairs(KEYS) do
    local locked = math.max(0, tonumber(redis.call('HGET', key, 'until') or '0') - now)
    if locked > wait then wait = locked end
    left[i + 1] = math.ceil(locked)
  end
  if wait > 0 then
    left[1] = math.ceil(wait)
    return left
  end
end
local result = {0}
for i, key in ipairs(KEYS) do
  local failures = redis.call('HINCRBY', key, 'n', 1)
  local free = tonumber(ARGV[4 + i])
  local lock = 0
  if failures >= free then
    lock = math.min(tonumber(ARGV[4]), tonumber(ARGV[3]) * 2 ^ math.min(failures - free, 30))
    redis.call('HSET', key, 'until', now + lock)
  end
  redis.call('PEXPIRE', key, ARGV[2])
  result[i + 1] = math.floor(lock)
end
return result
"""
# KEYS: the pair, then the keys whose count goes back by one.
_SUCCEEDED = """
redis.call('DEL', KEYS[1])
for i = 2, #KEYS do
  if redis.call('HINCRBY', KEYS[i], 'n', -1) <= 0 then redis.call('DEL', KEYS[i]) end
end
"""


class Attempt(NamedTuple):
    """What `SignInThrottle.attempt` decided (seconds)."""

    wait: float
    address_locked: float


def lock_seconds(failures: int, free: int = FREE_FAILURES) -> float:
    """How long a key with `free` free failures is locked after its `failures`-th failure."""
    if failures < free:
        return 0.0
    return min(MAX_LOCK_S, BASE_S * 2 ** min(failures - free, 30))


def _hash(*parts: str) -> str:
    # Hashed: keys then carry neither user names nor addresses, and have a bounded length.
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Keys:
    """The keys one attempt counts under, each with its free failures; the pair first."""

    pair: str
    user: str
    address: str
    per_user: bool

    @classmethod
    def of(cls, username: str, address: str, per_user: bool = True) -> Keys:
        name, where = username.strip().lower(), throttle_key(address)
        return cls(pair="p:" + _hash(name, where), user="u:" + _hash(name),
                   address="a:" + _hash(where), per_user=per_user)

    def counted(self) -> list[tuple[str, int]]:
        keys = [(self.pair, FREE_FAILURES), (self.address, FREE_FAILURES_PER_ADDRESS)]
        return keys + ([(self.user, FREE_FAILURES_PER_USER)] if self.per_user else [])

    def given_back(self) -> list[str]:
        """The keys a success gives its count back to (the pair is forgotten instead)."""
        return [self.address] + ([self.user] if self.per_user else [])


def _free_of(key: str) -> int:
    return {"p": FREE_FAILURES, "u": FREE_FAILURES_PER_USER,
            "a": FREE_FAILURES_PER_ADDRESS}[key[0]]


class SignInThrottle:
    """Failed password checks per address, username and both: in Redis when `client` is
    given, else in the store of `factory` when given, else in this process."""

    def __init__(self, client: redis.Redis | None = None,
                 factory: sessionmaker[Session] | None = None) -> None:
        self._client = client
        self._factory = factory
        self._local: dict[str, tuple[int, float, float]] = {}  # key -> (n, locked_until, last)
        self._lock = threading.Lock()
        self._pruned = 0.0
        if client is not None:
            self._attempt_script = client.register_script(_ATTEMPT)
            self._succeeded_script = client.register_script(_SUCCEEDED)

    def attempt(self, username: str, address: str, *, per_user: bool = True) -> Attempt:
        """Count an attempt as a failure unless one of its keys is locked, atomically.
        `wait` is 0 when counted (the caller checks the password, then calls `succeeded` if
        it was right), else the seconds before the next attempt may be made; `address_locked`
        is how long the address is locked out whatever the username (the lock this count
        set, or what is left of the one that refused it)."""
        wait, locks = self._count(Keys.of(username, address, per_user), check=True)
        return Attempt(wait=wait, address_locked=locks[1])

    def failed(self, username: str, address: str) -> float:
        """Count a failure without `attempt`'s check; returns the seconds the pair is now
        locked for."""
        _, locks = self._count(Keys.of(username, address), check=False)
        return locks[0]

    def blocked_for(self, username: str, address: str, *, per_user: bool = True) -> float:
        """Seconds before this username may be tried from this address again (0: now)."""
        keys = [key for key, _ in Keys.of(username, address, per_user).counted()]
        if self._client is not None:
            try:
                with self._client.pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.hget(KEY_PREFIX + key, "until")
                    pipe.time()
                    *locked, (seconds, micros) = pipe.execute()
                now_ms = seconds * 1000 + micros // 1000
                shared = max(float(value or 0) - now_ms for value in locked) / 1000
                return max(0.0, shared, self._local_lock(keys))
            except (redis.RedisError, OSError) as error:
                self._unshared(error)
        elif self._factory is not None:
            with self._factory() as session:
                until = session.scalars(select(SignInFailures.locked_until).where(
                    SignInFailures.key.in_(keys))).all()
            now = utcnow()
            return max([0.0] + [(moment - now).total_seconds() for moment in until if moment])
        return self._local_lock(keys)

    def succeeded(self, username: str, address: str, *, per_user: bool = True) -> None:
        """The password was right: forget the pair's failures, give back the attempt counted
        on the username and the address."""
        keys = Keys.of(username, address, per_user)
        if self._client is not None:
            try:
                self._succeeded_script(keys=[KEY_PREFIX + key for key in
                                             [keys.pair, *keys.given_back()]])
            except (redis.RedisError, OSError) as error:
                self._unshared(error)
        elif self._factory is not None:
            with self._factory() as session, session.begin():
                session.execute(delete(SignInFailures).where(SignInFailures.key == keys.pair))
                session.execute(update(SignInFailures).where(
                    SignInFailures.key.in_(keys.given_back()))
                    .values(failures=SignInFailures.failures - 1))
        with self._lock:
            self._local.pop(keys.pair, None)
            for key in keys.given_back():
                if key in self._local:
                    failures, locked_until, last = self._local[key]
                    self._local[key] = (max(0, failures - 1), locked_until, last)

    # -- the three places the counts live -------------------------------------------------

    def _count(self, keys: Keys, *, check: bool) -> tuple[float, list[float]]:
        counted = keys.counted()
        if self._client is not None:
            try:
                return self._count_shared(counted, check)
            except (redis.RedisError, OSError) as error:
                self._unshared(error)
        elif self._factory is not None:
            return self._count_stored(counted, check)
        return self._count_local(counted, check)

    def _count_shared(self, counted: list[tuple[str, int]], check: bool
                      ) -> tuple[float, list[float]]:
        result = self._attempt_script(
            keys=[KEY_PREFIX + key for key, _ in counted],
            args=[int(check), int(FORGET_S * 1000), int(BASE_S * 1000), int(MAX_LOCK_S * 1000),
                  *(free for _, free in counted)])
        return int(result[0]) / 1000, [int(lock) / 1000 for lock in result[1:]]

    def _count_stored(self, counted: list[tuple[str, int]], check: bool
                      ) -> tuple[float, list[float]]:
        now = utcnow()
        keys = sorted(key for key, _ in counted)  # one order: concurrent attempts never deadlock
        with self._factory() as session, session.begin():
            insert = (postgresql_insert if session.get_bind().dialect.name == "postgresql"
                      else sqlite_insert)
            # Rows first, so that the locking read below finds (and locks) every key.
            session.execute(insert(SignInFailures).values(
                [{"key": key, "failures": 0, "last_failure_at": now} for key in keys])
                .on_conflict_do_nothing(index_elements=["key"]))
            rows = {row.key: row for row in session.scalars(
                select(SignInFailures).where(SignInFailures.key.in_(keys))
                .order_by(SignInFailures.key).with_for_update())}
            if check:
                left = [max(0.0, (rows[key].locked_until - now).total_seconds())
                        if key in rows and rows[key].locked_until else 0.0
                        for key, _ in counted]
                if max(left) > 0:
                    return max(left), left
            locks = []
            for key, free in counted:
                row = rows.get(key)
                if row is None:  # pruned between the insert and the read: count afresh
                    row = SignInFailures(key=key, failures=0, last_failure_at=now)
                    session.add(row)
                if (now - row.last_failure_at).total_seconds() > FORGET_S:
                    row.failures = 0
                row.failures += 1
                row.last_failure_at = now
                lock = lock_seconds(row.failures, free)
                if lock > 0:
                    row.locked_until = now + timedelta(seconds=lock)
                locks.append(lock)
            self._prune(session)
        return 0.0, locks

    def _prune(self, session: Session) -> None:
        """Now and then, drop rows whose count is forgotten, or given back a while ago."""
        if time.monotonic() - self._pruned < PRUNE_EVERY_S:
            return
        self._pruned = time.monotonic()
        now = utcnow()
        session.execute(delete(SignInFailures).where(
            (SignInFailures.last_failure_at < now - timedelta(seconds=FORGET_S))
            | ((SignInFailures.failures <= 0)
               & (SignInFailures.last_failure_at < now - timedelta(seconds=PRUNE_EVERY_S)))))

    def _count_local(self, counted: list[tuple[str, int]], check: bool
                     ) -> tuple[float, list[float]]:
        now = time.time()
        with self._lock:
            if check:
                left = [max(0.0, self._local.get(key, (0, 0.0, 0.0))[1] - now)
                        for key, _ in counted]
                if max(left) > 0:
                    return max(left), left
            locks = []
            for key, free in counted:
                failures, locked_until, last = self._local.get(key, (0, 0.0, now))
                if now - last > FORGET_S:
                    failures = 0
                failures += 1
                lock = lock_seconds(failures, free)
                self._local[key] = (failures, now + lock if lock else locked_until, now)
                locks.append(lock)
            if len(self._local) > LOCAL_SOFT_CAP:
                self._forget_harmless(now)
        return 0.0, locks

    def _local_lock(self, keys: list[str]) -> float:
        now = time.time()
        with self._lock:
            return max(0.0, *(self._local.get(key, (0, 0.0, 0.0))[1] - now for key in keys))

    def _unshared(self, error: Exception) -> None:
        log.warning("shared sign-in throttle unavailable (%s)", type(error).__name__)

    def _forget_harmless(self, now: float) -> None:
        """Bound memory by dropping keys whose loss changes nothing an attacker could use:
        forgotten ones, and unlocked ones that had not passed their free failures."""
        for key, (failures, locked_until, last) in list(self._local.items()):
            if now - last > FORGET_S or (failures < _free_of(key) and locked_until <= now):
                del self._local[key]
