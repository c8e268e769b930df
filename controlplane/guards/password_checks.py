"""Password checks with a bounded cost: the only way the admin UI checks or hashes a password.

An argon2id check takes 19 MiB and tens of milliseconds of a core, so a check is admitted
only when

1. one of this process's `max_concurrent` slots is free (else 429 at once: memory per
   process stays bounded whatever arrives), and
2. the throttle counts it (controlplane/guards/signin_throttle.py: per address, per username
   and per both, atomically, shared by every API process; else 429 with the wait).

The check itself runs outside any transaction: the user's credentials are read in one short
transaction and the outcome written in another (on SQLite every transaction holds the store's
write lock, which heartbeats and token lookups wait for).

The addresses whose attempts the throttle refuses are remembered in `RefusedAddresses` until
the lock ends, so that the admin UI's `SignInGate` holds their next tries (and refuses them
before the form is read when the address itself is locked; controlplane/guards/signin_gate.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.orm import Session, sessionmaker

from controlplane.auth import users
from controlplane.auth.audit import record_admin_event
from controlplane.auth.clients import throttle_key
from controlplane.auth.models import User
from controlplane.errors import RateLimited, Unauthorized
from controlplane.guards.signin_throttle import SignInThrottle


class RefusedAddresses:
    """Client addresses (throttle keys) whose last password check this process refused, each
    with the monotonic time the refusal's lock ends and whether the address itself is locked
    (whatever the username) or only the username tried. An address lock only ends by running
    out (a success gives a count back, never a lock), so it stays true until then; the other
    kind is forgotten when an attempt from the address is counted. Holds at most `capacity`
    addresses: past it, ended entries are dropped, and a new address is not remembered while
    all are live (the throttle still refuses it)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._entries: dict[str, tuple[float, bool]] = {}  # key -> (until, address locked)
        self._lock = threading.Lock()

    def refused(self, key: str, seconds: float, *, address_locked: bool) -> None:
        until = time.monotonic() + seconds
        with self._lock:
            if key not in self._entries and len(self._entries) >= self.capacity:
                now = time.monotonic()
                for old in [old for old, (end, _) in self._entries.items() if end <= now]:
                    del self._entries[old]
                if len(self._entries) >= self.capacity:
                    return
            before, locked = self._entries.get(key, (0.0, False))
            if locked and before > time.monotonic() and not address_locked:
                return  # the address lock says more
            self._entries[key] = (until, address_locked)

    def counted(self, key: str) -> None:
        """An attempt from `key` was let through: forget a refusal that did not lock it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry[1]:
                del self._entries[key]

    def state(self, key: str) -> tuple[float, bool]:
        """(Seconds left of the refusal (0: none known), whether the address is locked)."""
        until, locked = self._entries.get(key, (0.0, False))
        return max(0.0, until - time.monotonic()), locked


class PasswordChecks:
    """Sign-ins and password changes, bounded and throttled."""

    def __init__(self, *, factory: sessionmaker[Session], throttle: SignInThrottle,
                 max_concurrent: int) -> None:
        self.throttle = throttle
        self.refused = RefusedAddresses()
        self._factory = factory
        self._slots = threading.BoundedSemaphore(max_concurrent)

    @contextmanager
    def _slot(self) -> Iterator[None]:
        if not self._slots.acquire(blocking=False):
            raise RateLimited("the server is checking other passwords right now; try again in "
                              "a second", retry_after=1)
        try:
            yield
        finally:
            self._slots.release()

    def _admit(self, username: str, address: str, per_user: bool) -> None:
        attempt = self.throttle.attempt(username, address, per_user=per_user)
        key = throttle_key(address)
        if attempt.wait > 0 or attempt.address_locked > 0:
            self.refused.refused(key, max(attempt.wait, attempt.address_locked),
                                 address_locked=attempt.address_locked > 0)
        else:
            self.refused.counted(key)
        if attempt.wait > 0:
            raise RateLimited(f"too many failed attempts; try again in {math.ceil(attempt.wait)}"
                              " s", retry_after=attempt.wait)

    def sign_in(self, *, username: str, password: str, address: str,
                per_user: bool = True) -> User:
        """The enabled user with this username and password; Unauthorized (the same for an
        unknown user, a wrong password and a disabled user) or RateLimited. `per_user`
        False: the browser signed in as this user before, so failures elsewhere do not
        hold it back."""
        with self._slot():
            self._admit(username, address, per_user)
            with self._factory() as session:
                credentials = users.find_credentials(session=session, username=username)
            right = users.password_matches(credentials.password_hash if credentials else None,
                                           password)
            if not right or credentials is None or credentials.disabled:
                raise Unauthorized("wrong username or password")
            new_hash = users.rehashed(credentials.password_hash, password)
        with self._factory() as session:
            user = users.record_sign_in(session=session, credentials=credentials,
                                        new_hash=new_hash)
            session.commit()
        self.throttle.succeeded(username, address, per_user=per_user)
        return user

    def new_hash(self, password: str) -> str:
        """The hash of a new `password` an admin sets or creates a user with (its length
        checked first), under one of this process's slots (RateLimited when none is free).
        The caller holds no transaction while it runs: on SQLite one holds the store's write
        lock for as long as the hash takes."""
        with self._slot():
            return users.new_password_hash(password)

    def change_password(self, *, user_id: int, current: str, new: str, address: str,
                        per_user: bool = True) -> User:
        """Replace a user's password once their current one is checked (counted against the
        throttle as a sign-in is); returns the user with the new session epoch."""
        users.check_new_password(current=current, new=new)
        with self._slot():
            with self._factory() as session:
                credentials = users.find_credentials(session=session, user_id=user_id)
            if credentials is None:
                raise Unauthorized("sign in again")
            self._admit(credentials.username, address, per_user)
            if not users.password_matches(credentials.password_hash, current):
                raise Unauthorized("the current password is wrong")
            new_hash = users.hash_password(new)
        with self._factory() as session:
            user = users.replace_checked_password(session=session, credentials=credentials,
                                                  new_hash=new_hash)
            record_admin_event(session=session, actor=f"user:{credentials.username}",
                               action="user.password", target=f"user:{credentials.username}")
            session.commit()
        self.throttle.succeeded(credentials.username, address, per_user=per_user)
        return user
