"""Rate limits: with Redis, one GCRA bucket per key whichever process takes from
it; without Redis, a bucket per process; when Redis is away, the process's own bucket."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio

from controlplane.guards.buckets import LocalRateLimiter, RedisRateLimiter


def _limiter(url: str, rate: float) -> RedisRateLimiter:
    """A limiter with its own connection pool, as in another API process."""
    return RedisRateLimiter(rate, kind="pull", client=redis.asyncio.Redis.from_url(url))


def test_two_processes_draw_from_one_bucket(private_redis):
    async def scenario():
        first, second = _limiter(private_redis.url, 2.0), _limiter(private_redis.url, 2.0)
        # Burst of 2 x rate = 4, shared: alternate between the two "processes".
        answers = [await (first, second)[i % 2].retry_after("token-7") for i in range(6)]
        assert answers[:4] == [None] * 4
        assert all(0 < wait <= 0.5 for wait in answers[4:])
        assert await first.retry_after("token-8") is None  # another token, another bucket
        await asyncio.sleep(answers[-1] + 0.05)
        assert await second.retry_after("token-7") is None  # refilled at 2 per second

    asyncio.run(scenario())


def test_a_missing_redis_falls_back_to_the_process_bucket(private_redis):
    async def scenario():
        limiter = _limiter(private_redis.url, 1.0)
        private_redis.kill()
        started = time.monotonic()
        answers = [await limiter.retry_after("token-1") for _ in range(3)]
        assert answers[:2] == [None, None] and answers[2] > 0  # still limited, in process
        assert time.monotonic() - started < 5

    asyncio.run(scenario())


def test_the_local_bucket_limits_and_refills():
    limiter = LocalRateLimiter(5.0)
    answers = [limiter.take("t") for _ in range(11)]
    assert answers[:10] == [None] * 10 and answers[10] > 0
    assert LocalRateLimiter(0).take("t") is None  # 0 turns the limit off


def test_a_worker_thread_draws_from_the_same_shared_bucket(private_redis):
    """The blocking call (the telemetry fast path's) and the asyncio call share one bucket,
    across processes too."""
    import redis as blocking_redis

    other_process = _limiter(private_redis.url, 2.0)
    limiter = RedisRateLimiter(2.0, kind="pull", client=redis.asyncio.Redis.from_url(
        private_redis.url), blocking_client=blocking_redis.Redis.from_url(private_redis.url))
    answers = [limiter.take("token-9") for _ in range(2)]

    async def from_the_other_process() -> list:
        return [await other_process.retry_after("token-9") for _ in range(2)]

    answers += asyncio.run(from_the_other_process())
    assert answers == [None] * 4  # the burst of 4, drawn from both ways
    assert 0 < limiter.take("token-9") <= 0.5
    private_redis.kill()
    fallback = [limiter.take("token-10") for _ in range(5)]
    assert fallback[:4] == [None] * 4 and fallback[4] > 0  # Redis away: this process's bucket


def test_a_burst_past_the_pool_waits_for_the_shared_bucket(private_redis, monkeypatch, caplog):
    """More checks at once than the pool's connections queue for one (briefly) instead of
    falling back to the process's own bucket, where a flood would find a fresh burst."""
    from controlplane.guards import buckets as limits

    monkeypatch.setattr(limits, "POOL_CONNECTIONS", 4)
    limiter = limits.make_rate_limiters(rates={"pull": 10.0}, redis_url=private_redis.url)["pull"]
    other_process = _limiter(private_redis.url, 10.0)

    async def scenario() -> list:
        for _ in range(20):  # another process empties the shared bucket (burst 20)
            await other_process.retry_after("token-11")
        return await asyncio.gather(*(limiter.retry_after("token-11") for _ in range(60)))

    with caplog.at_level("WARNING", logger="exitplane.coordination"):
        answers = asyncio.run(scenario())
    assert all(answer is not None and answer > 0 for answer in answers), answers
    assert "shared rate limit unavailable" not in caplog.text


def test_a_missing_redis_is_logged_once_per_interval_not_per_check(private_redis, caplog):
    limiter = _limiter(private_redis.url, 1000.0)
    private_redis.kill()

    async def scenario() -> None:
        for _ in range(50):
            await limiter.retry_after("token-12")

    with caplog.at_level("WARNING", logger="exitplane.coordination"):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if "shared rate limit unavailable" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
