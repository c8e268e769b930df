"""The memory a telemetry body may take to decode, per process.

A telemetry body up to SMALL_BODY_BYTES is read and decoded outside the decode budget: a
fleet's interval batches (~4 KiB: the counts and 100 sampled records as columns), aggregate
batches (~0.5 KiB) and sampled-record batches (~13 KiB for 100 records) decode in well under
a millisecond into well under a megabyte; the fast path serves them on the event loop. A
larger one (or one of unknown length) decodes under the process's `DecodeBudget`, which the
policy table names for its route (`decode_budget`, controlplane/guards/policy.py). The routes
reach it through the app's state (`telemetry_decodes`), which `install_guards` sets.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

from controlplane.errors import BatchTooLarge, RateLimited
from controlplane.guards.buckets import RateLimiter

SMALL_BODY_BYTES = 32 << 10

# What one decoded value may hold at most, besides the bytes of the body it came from (map keys
# count as values here). Measured on CPython 3.11 with tracemalloc over the shapes a body can
# take that build the most per value: empty lists and maps, maps keyed by new strings, short
# strings and byte strings, numbers past the small-int cache: at most 69 bytes a value (the
# zeros of bench/telemetry_bounds.py's expanding batch: 8). The rest covers what validation
# builds beside it.
DECODED_VALUE_BYTES = 100
# Values a decode charges the budget for at once (1 MB), so that the decoder's hooks take the
# budget's lock once in this many values, not once per container.
_CHARGE_STEP_VALUES = 10_000
# What a batch refused while decoding (413) costs its token in ingest units: one per this many
# bytes of its body, taken into debt (`DecodeBudget.charge_refused`).
REFUSED_BYTES_PER_UNIT = 64 * 1024


class DecodersBusy(RateLimited):
    """The decode budget of this API process is taken by other requests: retry shortly (429,
    Retry-After). One client can fill it, so the answer is the caller's to wait out, never a
    5xx."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=1.0)


class DecodeCharge:
    """What one request holds of its process's `DecodeBudget`: twice its body's bytes (the body,
    and the strings decoded from it: a string costs its bytes on the wire again once decoded)
    and DECODED_VALUE_BYTES for each value as it is decoded."""

    def __init__(self, budget: DecodeBudget) -> None:
        self.budget = budget
        self.held = 0  # bytes
        self._values_left = 0  # values charged for and not decoded yet

    def body(self, length: int) -> None:
        self.budget.take(self, 2 * length)

    def values(self, count: int) -> None:
        """Charge `count` more decoded values; DecodersBusy or BatchTooLarge past the budget."""
        self._values_left -= count
        if self._values_left >= 0:
            return
        need = -self._values_left
        step = max(need, _CHARGE_STEP_VALUES)
        if self.held + step * DECODED_VALUE_BYTES > self.budget.size:
            step = need  # near the whole budget: charge only what is decoded
        self.budget.take(self, step * DECODED_VALUE_BYTES)
        self._values_left += step


class DecodeBudget:
    """The telemetry bodies over SMALL_BODY_BYTES (or of unknown length) this process reads and
    decodes at once (EXITPLANE_TELEMETRY_MAX_DECODES) and the memory they may hold together
    (EXITPLANE_TELEMETRY_DECODE_BUDGET_MIB), so that decoding memory is bounded by bytes per
    process whatever shape the bodies take. A request is charged its body when it is admitted,
    before the body is read (the declared length; the byte limit when unknown): past the slots
    or the budget it is refused at once (429) rather than queued, as a queue would hold its
    connection and buffers. Its values are charged as they are decoded: past the budget the
    decode stops, with 429 while other requests hold part of it, and 413 (split it) when the
    batch alone needs more than all of it. A batch refused so costs its token ingest units
    (`charge_refused`, from `ingest`: the token's ingest bucket)."""

    def __init__(self, *, slots: int, size_bytes: int, max_body_bytes: int,
                 ingest: RateLimiter | None = None) -> None:
        self.slots, self.size, self.max_body_bytes = slots, size_bytes, max_body_bytes
        self.ingest = ingest
        self.used = 0  # bytes charged to requests under way
        self._taken = 0
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings, ingest: RateLimiter | None = None) -> DecodeBudget:
        return cls(slots=settings.telemetry_max_decodes,
                   size_bytes=settings.telemetry_decode_budget_mib << 20,
                   max_body_bytes=settings.max_body_bytes, ingest=ingest)

    def take(self, charge: DecodeCharge, amount: int) -> None:
        with self._lock:
            if charge.held + amount > self.size:
                raise BatchTooLarge(
                    "the batch needs more memory to decode than this API process gives all "
                    "telemetry decodes together (EXITPLANE_TELEMETRY_DECODE_BUDGET_MIB): split "
                    "it (ids <id>a and <id>b)")
            if self.used + amount > self.size:
                raise DecodersBusy("this API process is decoding as many large telemetry "
                                   "batches as its memory allows "
                                   "(EXITPLANE_TELEMETRY_DECODE_BUDGET_MIB); retry in 1 s")
            self.used += amount
            charge.held += amount

    @contextlib.contextmanager
    def held(self, content_length: str | None) -> Iterator[DecodeCharge | None]:
        """The request's charge for as long as the block runs (None for a small body, which
        needs none); DecodersBusy when no slot or not enough of the budget is free."""
        known = content_length is not None and content_length.isdigit()
        if known and int(content_length) <= SMALL_BODY_BYTES:
            yield None
            return
        with self._lock:
            if self._taken >= self.slots:
                raise DecodersBusy(f"this API process is decoding {self.slots} large telemetry "
                                   "batches (EXITPLANE_TELEMETRY_MAX_DECODES); retry in 1 s")
            self._taken += 1
        charge = DecodeCharge(self)
        try:
            charge.body(int(content_length) if known else self.max_body_bytes)
            yield charge
        finally:
            with self._lock:
                self._taken -= 1
                self.used -= charge.held
                charge.held = 0

    def charge_refused(self, token_key: str, size: int) -> None:
        """A batch found too large only while decoding cost this process its reading and part
        of its decoding: its token owes one ingest unit per REFUSED_BYTES_PER_UNIT of it, so
        that a token repeating such batches waits instead of keeping the process busy (an
        honest runtime splits them once). Blocking (a worker thread)."""
        if self.ingest is not None:
            self.ingest.charge(token_key, math.ceil(size / REFUSED_BYTES_PER_UNIT))
