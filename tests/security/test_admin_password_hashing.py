"""An admin setting a password or creating a user hashes it (argon2id: 19 MiB and tens of ms)
outside any transaction, then writes: on SQLite every transaction holds the store's write lock,
so a hash inside the request's transaction held up every heartbeat and token lookup (and past
the busy timeout, failed them). The same holds for `users.create_user` from a fresh session
(the `exitplane user create` path)."""

from __future__ import annotations

import sqlite3
import threading

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.auth import users
from controlplane.auth.models import User
from tests.support.people import ADMIN, PASSWORD, HeldHasher, csrf_of, sign_in, ui_browser

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.fixture
def admin_user(engine, quick_hashing) -> str:
    with Session(engine) as session:
        users.create_user(session=session, username="admin", password=PASSWORD, role="admin")
        session.commit()
    return "admin"


class HeldHashing(HeldHasher):
    """Argon2 whose new hashes wait until released, so a test can write to the store while a
    hash is under way."""

    def hash(self, password: str) -> str:
        self.checking.release()
        assert self.release.wait(30), "never released"
        return self._inner.hash(password)


def _write_while_hashing(held: HeldHashing, db_url: str, act) -> list:
    """Run `act()` on a thread; once its hash has started, write on another connection (a
    0.5 s busy timeout: "database is locked" if a transaction is open); its result."""
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(act()))
    thread.start()
    try:
        assert held.checking.acquire(timeout=10), "the hash did not start"
        writer = sqlite3.connect(db_url.removeprefix("sqlite:///"), timeout=0.5,
                                 isolation_level=None)
        try:
            writer.execute("BEGIN IMMEDIATE")
            writer.execute("UPDATE users SET last_login_at = last_login_at")
            writer.execute("COMMIT")
        finally:
            writer.close()
    finally:
        held.release.set()
        thread.join(timeout=30)
    assert answer, "the request did not finish"
    return answer


@pytest.mark.parametrize("action", ["create user", "set password"])
def test_an_admin_hashes_a_new_password_outside_any_transaction(app, engine, db_url, admin_user,
                                                                monkeypatch, action):
    with Session(engine) as session:
        spare = users.create_user(session=session, username="spare", password=PASSWORD,
                                  role="viewer")
        session.commit()
        spare_id = spare.id
    with ui_browser(app, client=ADMIN) as browser:
        assert sign_in(browser, "admin").status_code == 200
        token = csrf_of(browser.get("/ui/users").text)
        new_password = PASSWORD + " two"
        held = HeldHashing()
        monkeypatch.setattr(users, "_hasher", held)

        def act() -> httpx.Response:
            if action == "create user":
                return browser.post("/ui/users", follow_redirects=False, data={
                    "username": "newcomer", "password": new_password, "role": "operator",
                    "csrf_token": token})
            return browser.post(f"/ui/users/{spare_id}/password", follow_redirects=False,
                                data={"password": new_password, "csrf_token": token})

        [answer] = _write_while_hashing(held, db_url, act)
        assert answer.status_code == 303, answer.text
        page = browser.get(answer.headers["location"]).text
        assert ("User &#39;newcomer&#39; created as operator." in page
                or "Password of &#39;spare&#39; changed" in page), page
    name = "newcomer" if action == "create user" else "spare"
    with Session(engine) as session:
        stored = session.scalar(select(User.password_hash).where(User.username == name))
    assert users.password_matches(stored, new_password)


def test_create_user_from_a_fresh_session_hashes_before_its_transaction(engine, db_url,
                                                                        monkeypatch):
    held = HeldHashing()
    monkeypatch.setattr(users, "_hasher", held)

    def act() -> str:
        with Session(engine) as session:
            created = users.create_user(session=session, username="ops", password=PASSWORD,
                                        role="admin")
            session.commit()
            return created.username

    assert _write_while_hashing(held, db_url, act) == ["ops"]


def test_a_short_password_is_refused_before_it_is_hashed(app, admin_user, monkeypatch):
    hashed: list[str] = []
    monkeypatch.setattr(users, "hash_password", lambda password: hashed.append(password))
    with ui_browser(app, client=ADMIN) as browser:
        assert sign_in(browser, "admin").status_code == 200
        token = csrf_of(browser.get("/ui/users").text)
        answer = browser.post("/ui/users", data={"username": "short", "password": "too short",
                                                 "role": "viewer", "csrf_token": token})
    assert "passwords need at least 12 characters" in answer.text
    assert hashed == []
