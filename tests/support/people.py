"""People of each role and signing them in through the admin UI's login form."""

from __future__ import annotations

import re
import threading

from argon2 import PasswordHasher
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from controlplane.auth.users import create_user

PASSWORD = "correct horse battery staple"
ROLES = ("viewer", "operator", "admin")
# Client addresses (host, port) of browsers signing in.
ATTACKER = ("203.0.113.9", 40000)
ADMIN = ("198.51.100.7", 40001)


def quick_hasher():
    """Argon2 with minimal cost: tests that sign people in check who gets in, not the hash's
    strength."""
    return PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)


def create_people(engine) -> dict[str, str]:
    """Store `people`'s users (username -> role)."""
    with Session(engine) as session:
        for role in ROLES:
            create_user(session=session, username=role, password=PASSWORD, role=role)
        session.commit()
    return {role: role for role in ROLES}


CSRF_FIELD = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_of(html: str) -> str:
    match = CSRF_FIELD.search(html)
    assert match, "the page has no CSRF field"
    return match.group(1)


def sign_in(client, username: str, password: str = PASSWORD):
    """Sign `client` in through the login form; returns the response after the redirect."""
    page = client.get("/ui/login")
    response = client.post("/ui/login", data={"username": username, "password": password,
                                              "csrf_token": csrf_of(page.text)})
    return response


def ui_browser(app, client=ATTACKER) -> TestClient:
    """A browser on the admin UI (https://testserver) from client address `client`."""
    return TestClient(app, base_url="https://testserver", client=client)


class HeldHasher:
    """Argon2 whose checks wait until released, so a test can look at the server while
    checks are under way."""

    def __init__(self) -> None:
        self._inner = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
        self.checking = threading.Semaphore(0)
        self.release = threading.Event()

    def verify(self, password_hash: str, password: str) -> bool:
        self.checking.release()
        assert self.release.wait(30), "never released"
        return self._inner.verify(password_hash, password)

    def hash(self, password: str) -> str:
        return self._inner.hash(password)

    def check_needs_rehash(self, password_hash: str) -> bool:
        return False
