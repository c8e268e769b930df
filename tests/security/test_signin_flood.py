"""Password checks cannot be used to exhaust the control plane: an anonymous flood of random
usernames is throttled per address, concurrent wrong passwords for one user stop at the limit
(atomically, through the store or Redis, on real servers), a process checks only a few
passwords at once, no check runs inside a transaction (on SQLite that held the write lock
heartbeats wait for), X-Forwarded-For counts only from trusted proxies, IPv6 clients are
keyed by their /64, and password changes are throttled as sign-ins are."""

from __future__ import annotations

import itertools
import secrets
import sqlite3
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from argon2 import PasswordHasher
from sqlalchemy.orm import Session

from controlplane.auth import users
from controlplane.auth.clients import client_address, throttle_key
from controlplane.auth.users import create_user
from controlplane.guards import signin_throttle as throttle
from controlplane.settings import parse_networks
from exitplane.app import create_app
from tests.support.network import serving
from tests.support.people import (
    ADMIN,
    CSRF_FIELD,
    PASSWORD,
    HeldHasher,
    csrf_of,
    sign_in,
    ui_browser,
)
from tests.support.processes import ExitplaneUp, run_cli, shipped_env

PROXY = ("10.1.2.3", 40002)


@pytest.fixture
def admin_user(engine, quick_hashing) -> str:
    with Session(engine) as session:
        create_user(session=session, username="admin", password=PASSWORD, role="admin")
        session.commit()
    return "admin"


def _post_login(browser, username: str, password: str, **headers: str) -> httpx.Response:
    token = csrf_of(browser.get("/ui/login").text)
    return browser.post("/ui/login", headers=headers, follow_redirects=False, data={
        "username": username, "password": password, "csrf_token": token})


# -- per address, whatever the username ------------------------------------------------------

@pytest.fixture
def unheld_app(settings, engine):
    """The app with refusals answered at once (test_signin_gate.py holds them)."""
    app = create_app(settings.model_copy(update={"sign_in_hold_s": 0}), engine=engine)
    yield app
    app.state.config_delivery.close()
    app.state.heartbeats.close()


def test_random_usernames_from_one_address_are_throttled(unheld_app, admin_user):
    """An address runs out after its free failures, whatever names it tries or X-Forwarded-For
    it writes (no proxy is trusted): counted per (name, address) pair alone, each try with a
    new name would be a fresh pair, never throttled, each one an argon2id check."""
    app = unheld_app
    statuses = []
    with ui_browser(app) as attacker:
        for _ in range(25):
            answer = _post_login(attacker, f"user-{secrets.token_hex(4)}", "guess guess guess",
                                 **{"X-Forwarded-For": f"192.0.2.{secrets.randbelow(250)}"})
            statuses.append(answer.status_code)
    free = throttle.FREE_FAILURES_PER_ADDRESS
    assert statuses[:free] == [401] * free
    assert set(statuses[free:]) == {429}
    with ui_browser(app, client=ADMIN) as admin:  # another address is not held back
        assert sign_in(admin, "admin").status_code == 200


# -- X-Forwarded-For and IPv6 ----------------------------------------------------------------

@pytest.mark.parametrize(("peer", "forwarded", "trusted", "client"), [
    ("203.0.113.9", ["198.51.100.1"], "", "203.0.113.9"),  # not a proxy: header ignored
    ("10.1.2.3", ["198.51.100.1"], "10.0.0.0/8", "198.51.100.1"),
    ("10.1.2.3", ["6.6.6.6, 198.51.100.1"], "10.0.0.0/8", "198.51.100.1"),  # 6.6.6.6: forged
    ("10.1.2.3", ["198.51.100.1, 10.9.9.9"], "10.0.0.0/8", "198.51.100.1"),  # two proxies
    ("10.1.2.3", ["198.51.100.1", "10.9.9.9"], "10.0.0.0/8", "198.51.100.1"),  # two headers
    ("10.1.2.3", ["not-an-ip"], "10.0.0.0/8", "10.1.2.3"),
    ("10.1.2.3", [], "10.0.0.0/8", "10.1.2.3"),
    ("::ffff:10.1.2.3", ["[2001:db8::7]"], "10.1.2.3", "2001:db8::7"),
    ("fd00::1", ["198.51.100.1"], "fd00::/8", "198.51.100.1"),
])
def test_forwarded_for_counts_only_from_trusted_proxies(peer, forwarded, trusted, client):
    assert client_address(peer, forwarded, parse_networks(trusted)) == client


def test_ipv6_clients_are_keyed_by_their_64():
    assert throttle_key("2001:db8:1:2:aaaa:bbbb:cccc:dddd") == "2001:db8:1:2::/64"
    assert throttle_key("2001:db8:1:2::1") == throttle_key("2001:db8:1:2:ffff::9")
    assert throttle_key("2001:db8:1:3::1") != throttle_key("2001:db8:1:2::1")
    assert throttle_key("::ffff:198.51.100.7") == "198.51.100.7"
    assert throttle_key("198.51.100.7") == "198.51.100.7"
    assert throttle_key("testclient") == "testclient"


def test_forwarded_for_from_an_untrusted_peer_does_not_pick_the_key(app, admin_user):
    with ui_browser(app) as attacker:
        for index in range(5):
            _post_login(attacker, "admin", "guess guess guess",
                        **{"X-Forwarded-For": f"198.51.100.{index}"})
        assert _post_login(attacker, "admin", PASSWORD,
                           **{"X-Forwarded-For": "198.51.100.99"}).status_code == 429


def test_forwarded_for_from_a_trusted_proxy_names_the_client(settings, engine, admin_user):
    """With the proxy trusted, each client behind it counts for itself: keyed by the proxy's
    address, five failures by one client would lock everyone out."""
    # Answered at once (test_signin_gate.py holds them): a hold as long as the lock would let
    # the next try through to the throttle after it.
    app = create_app(settings.model_copy(update={"trusted_proxies": "10.0.0.0/8",
                                                 "sign_in_hold_s": 0}), engine=engine)
    try:
        with ui_browser(app, client=PROXY) as proxy:
            for _ in range(5):
                answer = _post_login(proxy, "admin", "guess guess guess",
                                     **{"X-Forwarded-For": "203.0.113.9"})
                assert answer.status_code == 401
            assert _post_login(proxy, "admin", PASSWORD,
                               **{"X-Forwarded-For": "203.0.113.9"}).status_code == 429
            # A forged hop in front of the client's address changes nothing.
            assert _post_login(proxy, "admin", PASSWORD, **{
                "X-Forwarded-For": "1.2.3.4, 203.0.113.9"}).status_code == 429
            assert _post_login(proxy, "admin", PASSWORD,
                               **{"X-Forwarded-For": "198.51.100.7"}).status_code == 303
    finally:
        app.state.config_delivery.close()
        app.state.heartbeats.close()


def test_rotating_through_one_ipv6_64_does_not_escape_the_lock(app, admin_user):
    for index in range(1, 6):
        with ui_browser(app, client=(f"2001:db8:1:2::{index:x}", 40000)) as attacker:
            assert _post_login(attacker, "admin", "guess guess guess").status_code == 401
    with ui_browser(app, client=("2001:db8:1:2:dead:beef:0:1", 40000)) as attacker:
        assert _post_login(attacker, "admin", PASSWORD).status_code == 429
    with ui_browser(app, client=("2001:db8:1:3::1", 40000)) as elsewhere:
        assert _post_login(elsewhere, "admin", PASSWORD).status_code == 303


# -- per username, whatever the address ------------------------------------------------------

def test_guesses_spread_over_addresses_lock_the_name_but_not_its_known_browsers(
        settings, engine, admin_user):
    app = create_app(settings.model_copy(update={"trusted_proxies": "10.0.0.0/8"}),
                     engine=engine)
    try:
        with ui_browser(app, client=ADMIN) as known:
            assert sign_in(known, "admin").status_code == 200  # this browser is remembered
            known.cookies.delete("exitplane_session")
            with ui_browser(app, client=PROXY) as proxy:
                for index in range(throttle.FREE_FAILURES_PER_USER):
                    answer = _post_login(proxy, "admin", "guess guess guess",
                                         **{"X-Forwarded-For": f"192.0.2.{index}"})
                    assert answer.status_code == 401
                locked = _post_login(proxy, "admin", PASSWORD,
                                     **{"X-Forwarded-For": "192.0.2.200"})
                assert locked.status_code == 429 and "try again in" in locked.text
                assert int(locked.headers["retry-after"]) >= 1
            assert _post_login(known, "admin", PASSWORD).status_code == 303
    finally:
        app.state.config_delivery.close()
        app.state.heartbeats.close()


# -- password change --------------------------------------------------------------------------

def _change_password(browser, current: str, new: str) -> httpx.Response:
    page = browser.get("/ui/account")
    return browser.post("/ui/account/password", follow_redirects=False, data={
        "current": current, "new": new, "confirm": new, "csrf_token": csrf_of(page.text)})


def test_password_change_is_throttled(app, engine, admin_user):
    with ui_browser(app) as browser:
        assert sign_in(browser, "admin").status_code == 200
        browser.cookies.delete("exitplane_device")  # a stolen session, on another browser
        for _ in range(throttle.FREE_FAILURES):
            wrong = _change_password(browser, "guess guess guess", PASSWORD + "!")
            assert wrong.status_code == 303
            assert "the current password is wrong" in browser.get("/ui/account").text
        locked = _change_password(browser, PASSWORD, PASSWORD + "!")
        assert locked.status_code == 429 and "Too many failed attempts" in locked.text
        assert int(locked.headers["retry-after"]) >= 1
    with Session(engine) as session:  # still the old password
        assert users.authenticate_user(session=session, username="admin", password=PASSWORD)


# -- a bounded number of checks per process, none inside a transaction ----------------------

def _login_form(client: httpx.Client) -> str:
    match = CSRF_FIELD.search(client.get("/ui/login").text)
    assert match
    return match.group(1)


@pytest.mark.slow  # a real server
def test_checks_past_the_per_process_limit_are_answered_429_at_once(settings, engine,
                                                                     admin_user, monkeypatch):
    held = HeldHasher()
    monkeypatch.setattr(users, "_hasher", held)
    app = create_app(settings.model_copy(update={"password_checks_max_concurrent": 2}),
                     engine=engine)
    answers: list[httpx.Response] = []

    def attempt(url: str, username: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            token = _login_form(client)
            answers.append(client.post("/ui/login", data={
                "username": username, "password": "guess guess guess", "csrf_token": token}))

    try:
        with serving(app) as url:
            checking = [threading.Thread(target=attempt, args=(url, f"someone{i}"))
                        for i in range(2)]
            for thread in checking:
                thread.start()
            for _ in checking:
                assert held.checking.acquire(timeout=10), "the checks did not start"
            with httpx.Client(base_url=url, timeout=5) as third:
                token = _login_form(third)
                busy = third.post("/ui/login", data={"username": "admin", "password": PASSWORD,
                                                     "csrf_token": token})
            assert busy.status_code == 429 and "checking other passwords" in busy.text
            assert busy.headers["retry-after"] == "1"
            held.release.set()
            for thread in checking:
                thread.join(timeout=30)
            assert [answer.status_code for answer in answers] == [401, 401]
            with httpx.Client(base_url=url, timeout=30) as later:  # a busy answer cost nothing
                token = _login_form(later)
                signed_in = later.post("/ui/login", data={
                    "username": "admin", "password": PASSWORD, "csrf_token": token})
                assert signed_in.status_code == 303
    finally:
        held.release.set()
        app.state.config_delivery.close()
        app.state.heartbeats.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("action", ["sign in", "change password"])
def test_no_transaction_is_open_while_a_password_is_checked(app, db_url, admin_user,
                                                            monkeypatch, action):
    """On SQLite every transaction holds the store's write lock, so a sign-in checks the
    password outside the request's transaction: checked inside it, heartbeats and token
    lookups would wait for every check under way (23 s under a flood), and past the busy
    timeout fail."""
    held = HeldHasher()
    with ui_browser(app) as browser:
        if action == "change password":
            assert sign_in(browser, "admin").status_code == 200
        monkeypatch.setattr(users, "_hasher", held)
        answer: list[httpx.Response] = []
        request = (lambda: _post_login(browser, "admin", PASSWORD)) if action == "sign in" \
            else (lambda: _change_password(browser, PASSWORD, PASSWORD + "!"))
        thread = threading.Thread(target=lambda: answer.append(request()))
        thread.start()
        try:
            assert held.checking.acquire(timeout=10), "the check did not start"
            writer = sqlite3.connect(db_url.removeprefix("sqlite:///"), timeout=0.5,
                                     isolation_level=None)
            try:
                writer.execute("BEGIN IMMEDIATE")  # "database is locked" while one is open
                writer.execute("ROLLBACK")
            finally:
                writer.close()
        finally:
            held.release.set()
            thread.join(timeout=30)
        assert answer[0].status_code == 303


# -- concurrent wrong passwords, real servers ------------------------------------------------

@pytest.mark.slow  # two real servers, 30 clients
@pytest.mark.parametrize("shared", ["store", "redis"])
@pytest.mark.parametrize("spread", ["one address", "thirty addresses"])
def test_concurrent_wrong_passwords_stop_at_the_limit(request, settings, engine, monkeypatch,
                                                      shared, spread):
    """30 wrong passwords for one user at once, over two API instances sharing the store (or
    Redis): the lock stops the sixth from one address, the eleventh from thirty. Checking
    first and counting after let all 30 through."""
    hasher = PasswordHasher(time_cost=2, memory_cost=8192, parallelism=1)  # ~10 ms a check
    monkeypatch.setattr(users, "_hasher", hasher)
    with Session(engine) as session:
        create_user(session=session, username="admin", password=PASSWORD, role="admin")
        session.commit()
    update = {"password_checks_max_concurrent": 64, "trusted_proxies": "127.0.0.1"}
    if shared == "redis":
        update["redis_url"] = request.getfixturevalue("private_redis").url
    apps = [create_app(settings.model_copy(update=update), engine=engine) for _ in range(2)]
    start = threading.Barrier(30)
    statuses: list[int] = []

    def guess(url: str, index: int) -> None:
        address = "198.51.100.7" if spread == "one address" else f"198.51.100.{index}"
        with httpx.Client(base_url=url, timeout=60) as client:
            token = _login_form(client)
            start.wait(timeout=60)
            statuses.append(client.post("/ui/login", headers={"X-Forwarded-For": address},
                                        data={"username": "admin", "password": f"guess{index}",
                                              "csrf_token": token}).status_code)

    try:
        with serving(apps[0]) as one, serving(apps[1]) as two:
            threads = [threading.Thread(target=guess, args=((one, two)[i % 2], i))
                       for i in range(30)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
    finally:
        for app in apps:
            app.state.config_delivery.close()
            app.state.heartbeats.close()
    limit = throttle.FREE_FAILURES if spread == "one address" else throttle.FREE_FAILURES_PER_USER
    assert Counter(statuses) == {401: limit, 429: 30 - limit}


# -- a real `exitplane up` ----------------------------------------------------------------------

@pytest.mark.slow  # a real `exitplane up`, argon2id at its shipped cost
def test_exitplane_up_throttles_a_flood_by_its_peer_and_keeps_answering_runtimes(tmp_path):
    """uvicorn reads X-Forwarded-For from any loopback peer unless told not to, and a flood
    writing a new address in each request would escape every throttle. Here the flood comes from
    one untrusted peer: after the address's free failures it is answered 429 whatever it
    writes, and runtimes' heartbeats are answered all along (no 5xx to anyone)."""
    env = shipped_env(tmp_path / "var")
    password_file = tmp_path / "password"
    password_file.write_text(secrets.token_urlsafe(16) + "\n")
    for args in (["db", "upgrade"],
                 ["user", "create", "--username", "admin", "--role", "admin",
                  "--password-file", str(password_file)],
                 ["deployment", "ensure", "--name", "chat", "--model-ref", "m",
                  "--num-layers", "12", "--exit-layers", "3,6,9"]):
        assert run_cli(args, env).returncode == 0
    made = run_cli(["token", "create", "--name", "rt", "--scope", "runtime", "--deployment",
                    "chat"], env)
    assert made.returncode == 0, made.stderr
    runtime = {"Authorization": f"Bearer {made.stdout.strip()}"}
    up = ExitplaneUp(env, tmp_path / "up.log")
    beats: Counter = Counter()
    stop = threading.Event()

    def beat() -> None:
        with httpx.Client(base_url=up.url, timeout=60, headers=runtime) as client:
            for index in itertools.count():
                if stop.wait(0.1):
                    return
                beats[client.post("/v1/deployments/chat/heartbeats",
                                  json={"runtime_id": f"rt-{index}"}).status_code] += 1

    def flood(tries: int) -> list[int]:
        with httpx.Client(base_url=up.url, timeout=120) as client:
            token = _login_form(client)
            return [client.post("/ui/login", headers={
                "X-Forwarded-For": f"192.0.2.{secrets.randbelow(250)}"}, data={
                "username": f"nobody-{secrets.token_hex(4)}", "password": "guess guess guess",
                "csrf_token": token}).status_code for _ in range(tries)]

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        one_by_one = flood(25)
        free = throttle.FREE_FAILURES_PER_ADDRESS
        # Refused from the first try past them; a refusal is held (up to 5 s) and each
        # expiry of the doubling lock (2, 4, 8 s) lets one more through.
        assert one_by_one[:free + 1] == [401] * free + [429], one_by_one
        assert set(one_by_one) == {401, 429} and one_by_one[free:].count(401) <= 2, one_by_one
        with ThreadPoolExecutor(20) as pool:
            at_once = [status for statuses in pool.map(flood, [3] * 20) for status in statuses]
        assert set(at_once) <= {401, 429} and at_once.count(401) <= 5, Counter(at_once)
    finally:
        stop.set()
        beating.join(timeout=60)
        up.stop()
    assert set(beats) == {200} and beats[200] >= 5, beats
