"""Retry rules the client's senders share (threshold pulls, telemetry): jittered exponential
backoff and the server's Retry-After (docs/protocol.md: "Pull" and "Answers and what to do")."""

from __future__ import annotations

import random

import httpx


def backoff_delay(attempt: int, initial_s: float, max_s: float) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d], d = initial * 2**attempt capped."""
    delay = min(max_s, initial_s * (2 ** min(attempt, 30)))
    return random.uniform(delay / 2, delay)


def retry_after(response: httpx.Response, cap: float) -> float | None:
    """The response's Retry-After in seconds (delta form), capped at `cap`; None when absent
    or not a number (the caller backs off on its own)."""
    value = response.headers.get("retry-after")
    try:
        return None if value is None else min(cap, max(0.0, float(value)))
    except ValueError:
        return None
