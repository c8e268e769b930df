"""Reads are rate-limited per token and weighted by cost: one token firing heavy reads (telemetry
scans, audit pages, reports) gets 429 with Retry-After, as pulls do, while other tokens are
served; with Redis every API process draws from the one bucket of the token. Unlimited heavy
reads let a single token keep the store busy for everyone."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.deployments.service import create_deployment, get_deployment
from controlplane.guards.policy import HEAVY_READ_COST
from tests.support.waiting import wait_until

HEAVY = "/v1/deployments/chat/telemetry/count"
LIGHT = "/v1/deployments/chat"


@pytest.fixture
def chat(engine, tokens):
    with Session(engine) as session:
        create_deployment(session=session, actor="test", spec=DeploymentCreate(
            name="chat", model_ref="m", num_layers=12, exit_layers=[3, 6, 9]))
        session.commit()


def _token(engine, scope: str = "operator") -> dict[str, str]:
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat") if scope == "runtime" else None
        _, secret = create_token(session=session, name=f"reader-{time.monotonic_ns()}",
                                 scope=scope, deployment=deployment)
        session.commit()
    return {"Authorization": f"Bearer {secret}"}


def _until_refused(client, path: str, auth: dict, limit: int = 300
                   ) -> tuple[int, object, float]:
    """How many reads of `path` were served before the first 429, that 429, and the seconds
    they took (the bucket refills meanwhile)."""
    started = time.monotonic()
    for served in range(limit):
        answer = client.get(path, headers=auth)
        if answer.status_code == 429:
            return served, answer, time.monotonic() - started
        assert answer.status_code == 200, answer.text
    return limit, None, time.monotonic() - started


def test_300_heavy_reads_from_one_token_get_429_with_retry_after(serve, chat, engine):
    # 20 units at once, then 10 a second; refusals answered at once (their hold: below).
    client = serve(rate_limit_read_per_s=10.0, rate_limit_hold_s=0)
    auth, other = _token(engine), _token(engine)
    started = time.monotonic()
    answers = [client.get(HEAVY, headers=auth) for _ in range(300)]
    elapsed = time.monotonic() - started
    served = sum(a.status_code == 200 for a in answers)
    refused = [a for a in answers if a.status_code == 429]
    assert served + len(refused) == 300
    assert refused, "300 heavy reads from one token were all served"
    # A burst of 20 units at 5 units a read, then 2 reads a second.
    assert served <= 4 + 2 * elapsed + 1, (served, elapsed)
    assert int(refused[0].headers["Retry-After"]) >= 1
    assert "too many reads for this token" in refused[0].json()["detail"]
    # Another token has a bucket of its own, and a runtime token reading is limited too.
    assert client.get(HEAVY, headers=other).status_code == 200
    _, refusal, _ = _until_refused(client, HEAVY, _token(engine, "runtime"))
    assert refusal is not None


def test_the_default_read_limit_holds_one_token_to_20_heavy_reads_a_second(serve, chat, engine):
    client = serve()
    served, refusal, elapsed = _until_refused(client, HEAVY, _token(engine), limit=1000)
    assert refusal is not None or elapsed > 1000 / 20  # only a slower client stays under it
    assert served <= 40 + 20 * elapsed + 1, (served, elapsed)


def test_reads_are_weighted_by_cost(serve, chat, engine, monkeypatch):
    from controlplane.guards import reads

    for unit in ("READ_UNIT_S", "HEAVY_READ_UNIT_S"):  # the declared costs only: no time owed
        monkeypatch.setattr(reads, unit, 1e9)
    client = serve(rate_limit_read_per_s=10.0)  # a burst of 20 units, 10 a second after
    heavy, _, heavy_s = _until_refused(client, HEAVY, _token(engine))
    light, refusal, light_s = _until_refused(client, LIGHT, _token(engine))
    # Each served what its cost allows in the burst plus the refill while it ran.
    assert 20 // HEAVY_READ_COST <= heavy <= (20 + 10 * heavy_s) / HEAVY_READ_COST + 1
    assert 20 <= light <= 20 + 10 * light_s + 1
    assert float(refusal.headers["Retry-After"]) >= 1
    # A drained read bucket leaves the runtime's pulls alone: they have their own.
    runtime = _token(engine, "runtime")
    _until_refused(client, HEAVY, runtime)
    pull = client.get("/v1/deployments/chat/thresholds", headers=runtime,
                      params={"runtime_id": "rt-1"})
    assert pull.status_code != 429


def test_a_token_read_bucket_is_shared_by_every_api_process(serve, chat, engine, private_redis):
    first = serve(redis_url=private_redis.url, rate_limit_read_per_s=10.0, rate_limit_hold_s=0)
    second = serve(redis_url=private_redis.url, rate_limit_read_per_s=10.0, rate_limit_hold_s=0)
    auth = _token(engine)
    started = time.monotonic()
    answers = [(first, second)[i % 2].get(HEAVY, headers=auth).status_code for i in range(12)]
    elapsed = time.monotonic() - started
    # One burst of 20 units (4 heavy reads) and its refill for both processes, where a bucket
    # each would have served 8 and more.
    assert answers.count(200) <= 4 + 2 * elapsed + 1, (answers, elapsed)


def test_a_token_looping_on_its_refusals_is_held_not_served_faster(serve, chat, engine):
    """Each refusal is held (1 s here), on the event loop: eight connections looping on their
    refusals make about one request per connection per second, where refusals answered at once
    would make hundreds a second for the process to refuse; other tokens are answered
    meanwhile."""
    # One read every 2 s (a burst of 1): a 1 s hold never sees the bucket refilled.
    client = serve(rate_limit_read_per_s=0.5, rate_limit_hold_s=1.0)
    auth, other = _token(engine), _token(engine)
    assert client.get(LIGHT, headers=auth).status_code == 200  # the bucket is empty
    began = time.monotonic()
    refused = client.get(LIGHT, headers=auth)
    assert refused.status_code == 429 and time.monotonic() - began >= 0.9
    assert int(refused.headers["Retry-After"]) >= 1
    answered: list[int] = []
    held = threading.Thread(target=lambda: answered.append(
        client.get(LIGHT, headers=auth).status_code))
    held.start()
    time.sleep(0.2)
    assert client.get(LIGHT, headers=other).status_code == 200
    assert held.is_alive() and answered == []  # another token was answered meanwhile
    held.join(5)
    stop = time.monotonic() + 3.0
    counts: list[int] = []

    def loop() -> None:
        made = 0
        while time.monotonic() < stop:
            client.get(LIGHT, headers=auth)
            made += 1
        counts.append(made)

    loops = [threading.Thread(target=loop) for _ in range(8)]
    for thread in loops:
        thread.start()
    for thread in loops:
        thread.join(30)
    # One read served every 2 s, and one refusal per connection per second.
    assert len(counts) == 8 and sum(counts) <= 8 * 4 + 3, counts



def _slow_counts(monkeypatch, seconds: float, gate: threading.Event | None = None) -> dict:
    """Make the telemetry count read take `seconds` (the first one, when a `gate` is given:
    until the gate is set); who ran it at once (per token, at most)."""
    from controlplane.telemetry import service

    seen = {"running": {}, "most_at_once": 0, "calls": 0}
    guard = threading.Lock()
    real = service.counts

    def slow(**kwargs):
        who = threading.get_ident()
        with guard:
            seen["calls"] += 1
            first = seen["calls"] == 1
            seen["running"][who] = True
            seen["most_at_once"] = max(seen["most_at_once"], len(seen["running"]))
        if gate is not None and first:
            gate.wait(30)
        else:
            time.sleep(seconds)
        with guard:
            del seen["running"][who]
        return real(**kwargs)

    monkeypatch.setattr(service, "counts", slow)
    return seen


def test_a_read_owes_the_time_it_kept_the_api_busy(serve, chat, engine, monkeypatch):
    """A declared cost can be far below what a read costs the store (a scan over a large
    store, a wide window): a token's heavy reads keep an API busy for about a quarter second a
    second at the default rate, whatever they ask for. One heavy read of 0.6 s owes 240 units;
    at 10 a second the token waits."""
    from controlplane.guards.reads import HEAVY_READ_UNIT_S

    client = serve(rate_limit_read_per_s=10.0, rate_limit_hold_s=0)
    _slow_counts(monkeypatch, 0.6)
    auth, other = _token(engine), _token(engine)
    assert client.get(HEAVY, headers=auth).status_code == 200
    refused = client.get(LIGHT, headers=auth)  # the token's one bucket: light reads wait too
    assert refused.status_code == 429, refused.text
    owed = 0.6 / HEAVY_READ_UNIT_S - 20  # what it kept the API busy for, less the burst
    assert float(refused.headers["Retry-After"]) >= owed / 10 - 1
    assert client.get(LIGHT, headers=other).status_code == 200


def test_the_time_a_read_owes_is_shared_by_every_api_process(serve, chat, engine,
                                                             private_redis, monkeypatch):
    first = serve(redis_url=private_redis.url, rate_limit_read_per_s=10.0, rate_limit_hold_s=0)
    second = serve(redis_url=private_redis.url, rate_limit_read_per_s=10.0,
                   rate_limit_hold_s=0)
    _slow_counts(monkeypatch, 0.6)
    auth = _token(engine)
    assert first.get(HEAVY, headers=auth).status_code == 200
    refused = second.get(LIGHT, headers=auth)
    assert refused.status_code == 429 and float(refused.headers["Retry-After"]) >= 3


def test_heavy_reads_of_one_token_take_turns_and_a_full_queue_is_refused(serve, chat, engine,
                                                                        monkeypatch):
    """Each heavy read runs on a worker thread; one token firing them in parallel held as
    many threads and as much of the store as it opened connections. A token now runs
    HEAVY_READS_AT_ONCE per process and queues HEAVY_READS_WAITING (served in turn), past them
    429; another token's heavy read runs beside them."""
    from controlplane.guards import reads
    from controlplane.guards.reads import HEAVY_READS_AT_ONCE, HEAVY_READS_WAITING

    for unit in ("READ_UNIT_S", "HEAVY_READ_UNIT_S"):  # turns only: no time owed
        monkeypatch.setattr(reads, unit, 1e9)
    # Tokens stay known while the first read is held: on SQLite that read holds the store,
    # and a token lookup would wait for it.
    client = serve(rate_limit_read_per_s=1000.0, rate_limit_hold_s=0, token_cache_ttl_s=120)
    gate = threading.Event()  # the first read runs until the test lets it finish
    seen = _slow_counts(monkeypatch, 0.05, gate)
    auth, other = _token(engine), _token(engine)
    for token in (auth, other):  # looked up (and cached) before the first read is held
        assert client.get(LIGHT, headers=token).status_code == 200
    opened = HEAVY_READS_AT_ONCE + HEAVY_READS_WAITING + 3
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda: statuses.append(
        client.get(HEAVY, headers=auth).status_code)) for _ in range(opened)]
    try:
        for thread in threads:
            thread.start()
        # With the first read held, every request has come: one runs, eight wait, three are
        # refused at once.
        assert wait_until(lambda: statuses.count(429) == 3 and len(seen["running"]) == 1,
                          timeout=30), (statuses, seen)
        assert statuses.count(429) == 3 and seen["calls"] == 1, (statuses, seen)
        if engine.dialect.name == "postgresql":  # SQLite runs one transaction at a time
            # The other token's read runs beside the first token's held one, not queued
            # behind its reads.
            assert client.get(HEAVY, headers=other).status_code == 200
            assert not gate.is_set() and len(seen["running"]) == 1, seen
    finally:
        gate.set()
        for thread in threads:
            thread.join(30)
    if engine.dialect.name != "postgresql":
        assert client.get(HEAVY, headers=other).status_code == 200
    assert statuses.count(200) == HEAVY_READS_AT_ONCE + HEAVY_READS_WAITING, statuses
    assert statuses.count(429) == 3, statuses
    # Never more than one of the token's reads at once (with the other token's: one more).
    at_most = HEAVY_READS_AT_ONCE + (engine.dialect.name == "postgresql")
    assert seen["most_at_once"] == at_most, seen
