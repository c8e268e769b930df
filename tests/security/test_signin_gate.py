"""The sign-in gate (controlplane/guards/signin_gate.py), on a real uvicorn: once the throttle has
locked a client address out, its sign-ins are held, then refused before their form is read
(429, Retry-After, the connection closed), without a password check or a throttle count;
other addresses are answered meanwhile; the holds are bounded. An address refused for one
username's lock is held too, then let through to the throttle, which still decides."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy.orm import Session

from controlplane.auth.clients import throttle_key
from controlplane.auth.users import create_user
from controlplane.guards import signin_throttle as throttle
from exitplane.app import create_app
from tests.support.network import raw_response, serving
from tests.support.people import PASSWORD, csrf_of

ATTACKER = "203.0.113.9"
ADMIN = "198.51.100.7"
PROXIED = "192.0.2.44"  # many people behind one NAT
HOLD_S = 3.0


@pytest.fixture
def gated(settings, engine, quick_hashing) -> Iterator[tuple[str, object]]:
    """(URL, the UI's PasswordChecks) of an app behind a trusted proxy on loopback (so that
    X-Forwarded-For tells clients apart), with an admin and ATTACKER's address locked out."""
    with Session(engine) as session:
        create_user(session=session, username="admin", password=PASSWORD, role="admin")
        session.commit()
    app = create_app(settings.model_copy(update={"sign_in_hold_s": HOLD_S,
                                                 "trusted_proxies": "127.0.0.1"}), engine=engine)
    ui = next(route.app for route in app.routes if getattr(route, "path", "") == "/ui")
    checks = ui.state.password_checks
    for index in range(throttle.FREE_FAILURES_PER_ADDRESS + 6):  # locked for 2 * 2^6 s
        checks.throttle.failed(f"nobody-{index}", ATTACKER)
    checks.hold = ui.state.sign_in_hold  # for the test of its bound
    try:
        with serving(app) as url:
            yield url, checks
    finally:
        app.state.config_delivery.close()
        app.state.heartbeats.close()


def _post(url: str, address: str, username: str, password: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30,
                      headers={"X-Forwarded-For": address}) as client:
        token = csrf_of(client.get("/ui/login").text)
        return client.post("/ui/login", follow_redirects=True, data={
            "username": username, "password": password, "csrf_token": token})


def _raw_post(url: str, address: str, declared: int, sent: bytes) -> socket.socket:
    """A sign-in that declared a `declared`-byte form and sent only `sent` of it."""
    port = int(url.rsplit(":", 1)[1])
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    connection.sendall(
        (f"POST /ui/login HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Forwarded-For: {address}\r\n"
         "Content-Type: application/x-www-form-urlencoded\r\n"
         f"Content-Length: {declared}\r\n\r\n").encode() + sent)
    return connection


class _Counting:
    """Counts the throttle's attempts (each one a count, and a password check when let in)."""

    def __init__(self, checks) -> None:
        self.calls = 0
        self._attempt = checks.throttle.attempt
        checks.throttle.attempt = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._attempt(*args, **kwargs)


def test_a_locked_out_address_is_held_then_refused_before_its_form_is_read(gated):
    url, checks = gated
    # The first try after the lock reaches the throttle, which refuses it and tells the gate.
    first = _post(url, ATTACKER, "nobody-new", "guess guess guess")
    assert first.status_code == 429
    counting = _Counting(checks)
    began = time.monotonic()
    connection = _raw_post(url, ATTACKER, declared=60_000, sent=b"username=x&password=")
    try:
        status, headers, body = raw_response(connection)
        held = time.monotonic() - began
        assert status == 429 and headers["connection"] == "close", (status, headers)
        assert 60 < int(headers["retry-after"]) <= 128, headers
        assert b"try again in" in body and headers["x-frame-options"] == "DENY"
        assert connection.recv(65536) == b"", "the connection stayed open"
    finally:
        connection.close()
    assert held >= HOLD_S * 0.9, held
    assert counting.calls == 0  # neither counted nor checked
    # Whatever name or password it sends next.
    assert _post(url, ATTACKER, "admin", PASSWORD).status_code == 429
    assert counting.calls == 0


def test_other_addresses_are_answered_while_a_locked_one_is_held(gated):
    url, _ = gated
    assert _post(url, ATTACKER, "nobody-new", "guess guess guess").status_code == 429
    answered = []
    held = threading.Thread(target=lambda: answered.append(
        _post(url, ATTACKER, "nobody-else", "guess guess guess").status_code))
    held.start()
    time.sleep(0.3)
    signed_in = _post(url, ADMIN, "admin", PASSWORD)
    assert signed_in.status_code == 200 and signed_in.url.path != "/ui/login", signed_in.url
    assert held.is_alive() and answered == []  # still held while the admin got in
    held.join(HOLD_S * 3)
    assert answered == [429]


def test_holds_are_bounded_past_them_a_refusal_is_answered_at_once(gated):
    url, checks = gated
    checks.hold.max_held = 1
    assert _post(url, ATTACKER, "nobody-new", "guess guess guess").status_code == 429
    first = _raw_post(url, ATTACKER, declared=100, sent=b"")
    try:
        time.sleep(0.3)
        second = _raw_post(url, ATTACKER, declared=100, sent=b"")
        try:
            second.settimeout(HOLD_S / 2)  # answered before the first's hold ends
            assert raw_response(second)[0] == 429
        finally:
            second.close()
        assert raw_response(first)[0] == 429
    finally:
        first.close()


def test_an_address_refused_for_one_username_is_held_and_the_throttle_still_decides(gated):
    url, checks = gated
    for _ in range(throttle.FREE_FAILURES + 2):  # the pair (victim, PROXIED) locked for 8 s
        checks.throttle.failed("victim", PROXIED)
    assert _post(url, PROXIED, "victim", "guess guess guess").status_code == 429
    counting = _Counting(checks)
    began = time.monotonic()
    again = _post(url, PROXIED, "victim", "guess guess guess")
    assert time.monotonic() - began >= HOLD_S * 0.9
    assert again.status_code == 429 and counting.calls == 1  # the throttle answered it
    assert "csrf_token" in again.text  # its sign-in page, not the gate's
    began = time.monotonic()
    signed_in = _post(url, PROXIED, "admin", PASSWORD)  # someone else at that address
    assert time.monotonic() - began >= HOLD_S * 0.9
    assert signed_in.status_code == 200 and signed_in.url.path != "/ui/login", signed_in.url
    assert checks.refused.state(throttle_key(PROXIED)) == (0.0, False)  # no longer held
