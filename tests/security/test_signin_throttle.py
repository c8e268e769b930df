"""Sign-in throttling: failures are keyed by username and client address with an
exponential backoff, shared by every API process through Redis, and never cleared wholesale:
an attacker can neither lock the admin out from elsewhere nor reset the counts by flooding."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from controlplane.auth.users import create_user
from controlplane.guards import signin_throttle as throttle
from controlplane.guards.signin_throttle import SignInThrottle, lock_seconds
from exitplane.app import create_app
from tests.support.people import ADMIN, ATTACKER, PASSWORD, sign_in


@pytest.fixture
def admin_user(engine, quick_hashing) -> str:
    with Session(engine) as session:
        create_user(session=session, username="admin", password=PASSWORD, role="admin")
        session.commit()
    return "admin"


def test_backoff_doubles_after_the_free_failures():
    waits = [lock_seconds(n) for n in range(1, 10)]
    assert waits[:4] == [0, 0, 0, 0]
    assert waits[4:] == [2, 4, 8, 16, 32]
    assert lock_seconds(100) == throttle.MAX_LOCK_S


def test_an_attacker_elsewhere_cannot_lock_the_admin_out(app, admin_user):
    with TestClient(app, base_url="https://testserver", client=ATTACKER) as attacker:
        for _ in range(5):
            assert sign_in(attacker, "admin", password="guess").status_code == 401
        locked = sign_in(attacker, "admin")  # even the right password waits now
        assert locked.status_code == 429 and "try again in" in locked.text
    with TestClient(app, base_url="https://testserver", client=ADMIN) as admin:
        assert sign_in(admin, "admin").status_code == 200


def test_a_success_forgets_only_its_own_address(app, admin_user):
    with TestClient(app, base_url="https://testserver", client=ATTACKER) as attacker:
        for _ in range(4):
            sign_in(attacker, "admin", password="guess")
    with TestClient(app, base_url="https://testserver", client=ADMIN) as admin:
        assert sign_in(admin, "admin").status_code == 200
    with TestClient(app, base_url="https://testserver", client=ATTACKER) as attacker:
        # The admin's success did not wipe the attacker's four failures: the fifth locks.
        assert sign_in(attacker, "admin", password="guess").status_code == 401
        assert sign_in(attacker, "admin", password="guess").status_code == 429


def test_flooding_other_names_does_not_reset_a_lock(monkeypatch):
    monkeypatch.setattr(throttle, "LOCAL_SOFT_CAP", 1000)
    limiter = SignInThrottle()
    for _ in range(6):
        limiter.failed("admin", ATTACKER[0])
    locked_for = limiter.blocked_for("admin", ATTACKER[0])
    assert locked_for > 0
    for index in range(5000):  # far past the cap: the old throttle cleared every entry here
        limiter.failed(f"user{index}", ATTACKER[0])
    assert limiter.blocked_for("admin", ATTACKER[0]) > 0
    assert len(limiter._local) <= 1001 + 1  # memory stays bounded by dropping harmless pairs


def test_failures_are_shared_by_every_api_process_through_redis(settings, engine, admin_user,
                                                                 private_redis):
    shared = settings.model_copy(update={"redis_url": private_redis.url})
    first, second = create_app(shared, engine=engine), create_app(shared, engine=engine)
    with TestClient(first, base_url="https://testserver", client=ATTACKER) as one:
        for _ in range(5):
            assert sign_in(one, "admin", password="guess").status_code == 401
    with TestClient(second, base_url="https://testserver", client=ATTACKER) as other:
        assert sign_in(other, "admin").status_code == 429
    with TestClient(second, base_url="https://testserver", client=ADMIN) as admin:
        assert sign_in(admin, "admin").status_code == 200
    for app in (first, second):
        app.state.config_delivery.close()


def test_redis_throttle_backs_off_and_forgets_one_pair(private_redis):
    import redis

    client = redis.Redis.from_url(private_redis.url)
    limiter = SignInThrottle(client)
    waits = [limiter.failed("admin", ATTACKER[0]) for _ in range(6)]
    assert waits == [0, 0, 0, 0, 2, 4]
    assert 3 < limiter.blocked_for("admin", ATTACKER[0]) <= 4
    assert limiter.blocked_for("admin", ADMIN[0]) == 0
    limiter.failed("admin", ADMIN[0])
    limiter.succeeded("admin", ADMIN[0])
    assert limiter.blocked_for("admin", ATTACKER[0]) > 3  # the other pair is untouched
    assert all(key.startswith(b"exitplane:signin:") and b"admin" not in key
               for key in client.keys("*"))  # neither names nor addresses in the keys


def test_without_redis_reachable_the_process_still_throttles(private_redis):
    import redis

    limiter = SignInThrottle(redis.Redis.from_url(private_redis.url, socket_connect_timeout=0.5,
                                                  socket_timeout=0.5))
    private_redis.kill()
    assert [limiter.failed("admin", ATTACKER[0]) for _ in range(5)] == [0, 0, 0, 0, 2]
    assert limiter.blocked_for("admin", ATTACKER[0]) > 1
    assert limiter.blocked_for("admin", ADMIN[0]) == 0
