"""Waiting for a condition, and reading as a patient client reads."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float = 20.0, message: str = "condition",
               interval: float = 0.05):
    """Poll `predicate` until it returns something truthy, and return that; fail the test
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {message}")
        time.sleep(interval)


def patient_get(client, url: str, **kwargs):
    """GET `url` as a well-behaved client polls: a 429 waits its Retry-After (at most 2 s) and
    asks again, for up to a minute. `client`: a TestClient, an httpx client or `httpx`."""
    deadline = time.monotonic() + 60
    while True:
        answer = client.get(url, **kwargs)
        if answer.status_code != 429 or time.monotonic() > deadline:
            return answer
        time.sleep(min(2.0, float(answer.headers.get("Retry-After", 1))))
