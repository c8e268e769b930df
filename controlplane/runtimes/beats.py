"""Heartbeats of runtimes already on record, written in bulk (fleet cost per request).

A fleet beats every ~15 s per runtime: one transaction per beat would be ~130 commits a second
at 2,000 runtimes, for rows whose every reader (the runtime listing, stale-runtime and
old-version alerts, the gauges) looks at them on a scale of seconds to minutes.

So an API process answers a beat from a runtime it has recorded once (its first beat went to
the store, where the deployment's cap on runtimes is enforced) on the event loop: it checks
what the route checks, keeps the newest beat per runtime here, and a flusher thread writes
what is pending every `interval_s` as one statement executed for every runtime. A beat never
overwrites a newer one already stored (another API process's, say). The runtime listing of
this process flushes first, so what a runtime was told is recorded is what it reads back.
Beats pending when the store is away are kept (the newest per runtime) and written once it is
back; a process that dies loses at most one interval of beats, which the next beats replace.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db import store_away
from controlplane.runtimes.lineage import beat_mismatch_values
from controlplane.runtimes.models import Runtime
from controlplane.runtimes.schemas import RuntimeRead
from controlplane.runtimes.service import BEAT_FIELDS, beat_fields, note_applied_versions
from exitplane.wire import Heartbeat

log = logging.getLogger("exitplane.api")

_TABLE = Runtime.__table__
# Executed once per pending beat (executemany); the last_seen guard keeps a newer stored beat.
_WRITE = (update(_TABLE)
          .where(_TABLE.c.deployment_id == bindparam("beat_deployment"),
                 _TABLE.c.runtime_id == bindparam("beat_runtime"),
                 _TABLE.c.last_seen < bindparam("beat_seen"))
          .values({**{field: bindparam(field) for field in BEAT_FIELDS},
                   **beat_mismatch_values()}))


class HeartbeatBuffer:
    """The runtimes this process has on record (their first_seen) and their newest beats not
    yet written."""

    def __init__(self, session_factory: sessionmaker[Session], *, interval_s: float = 1.0,
                 max_known: int = 100_000) -> None:
        self._session_factory = session_factory
        self.interval_s = interval_s
        self._max_known = max_known
        # (deployment, runtime) -> (first seen, the token that registered it, the version its
        # last stored beat applied)
        self._known: dict[tuple[int, str], tuple[datetime, int | None, int | None]] = {}
        self._pending: dict[tuple[int, str], dict] = {}
        self._lock = threading.Lock()  # the event loop adds, the flusher and listings write
        self._write_lock = threading.Lock()  # one write at a time, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def first_seen(self, deployment_id: int, runtime_id: str, token_id: int | None,
                   applied_version: int | None) -> datetime | None:
        """When the runtime was first seen, if this process has it on record as registered by
        `token_id` and applying `applied_version`; never reads the store (the event loop asks).
        Another token's beat for it gets None, and the store path says why it is refused; so
        does a beat naming a newly applied version, which the store records at once (the
        runtime's evidence at that version counts from then on)."""
        known = self._known.get((deployment_id, runtime_id))
        if known is None or known[1] != token_id or known[2] != applied_version:
            return None
        return known[0]

    def remember(self, deployment_id: int, runtime: RuntimeRead, token_id: int | None) -> None:
        """Note a runtime whose beat, sent with `token_id`, the store has just recorded: its
        next beats with that token are kept here for the next write."""
        if not self.enabled:
            return
        with self._lock:
            if len(self._known) >= self._max_known:
                self._known.clear()  # forgotten ones take the store path once, then return
            self._known[(deployment_id, runtime.runtime_id)] = (
                runtime.first_seen, token_id, runtime.applied_version)

    def forget(self, deployment_id: int, runtime_ids: list[str]) -> None:
        """Take removed runtimes off this process's record: their next beats go to the store,
        which registers them anew (under the caps)."""
        with self._lock:
            for runtime_id in runtime_ids:
                self._known.pop((deployment_id, runtime_id), None)
                self._pending.pop((deployment_id, runtime_id), None)

    def keep(self, deployment_id: int, beat: Heartbeat, now: datetime,
             first_seen: datetime) -> RuntimeRead:
        """Keep the beat for the next write; the runtime as it will read once written."""
        fields = beat_fields(beat, now)
        with self._lock:
            self._pending[(deployment_id, beat.runtime_id)] = fields
        self._start()
        return RuntimeRead(runtime_id=beat.runtime_id, first_seen=first_seen, **fields)

    def flush(self) -> int:
        """Write every pending beat (blocking); how many. When the store is away the beats stay
        pending (a newer one of the same runtime wins) and the error is raised. When the store
        refuses a beat's data, the beats are written one by one and the refused one dropped,
        so one runtime's beat cannot keep every other runtime's from the store."""
        with self._write_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
            if not pending:
                return 0
            rows = [dict(fields, beat_deployment=deployment_id, beat_runtime=runtime_id,
                         beat_seen=fields["last_seen"])
                    for (deployment_id, runtime_id), fields in pending.items()]
            try:
                self._write(rows)
            except Exception as error:
                if not store_away(error):
                    return self._write_one_by_one(rows, pending)
                self._keep_again(pending)
                raise
            except BaseException:
                self._keep_again(pending)
                raise
            return len(rows)

    def _write(self, rows: list[dict]) -> None:
        with self._session_factory() as session:
            written = session.execute(_WRITE, rows).rowcount
            note_applied_versions(session=session, rows=[
                (row["beat_deployment"], row["beat_runtime"], row["applied_version"])
                for row in rows])
            session.commit()
            if written != len(rows):  # a newer stored beat, or a runtime removed meanwhile
                self._forget_removed(session, rows)

    def _forget_removed(self, session: Session, rows: list[dict]) -> None:
        """Forget the runtimes among `rows` the store no longer has (an operator removed them,
        or they were forgotten after a single beat), so their next beats register them."""
        keys = {(row["beat_deployment"], row["beat_runtime"]) for row in rows}
        stored = {tuple(row) for row in session.execute(
            select(_TABLE.c.deployment_id, _TABLE.c.runtime_id)
            .where(_TABLE.c.deployment_id.in_({d for d, _ in keys}),
                   _TABLE.c.runtime_id.in_({r for _, r in keys})))}
        with self._lock:
            for key in keys - stored:
                self._known.pop(key, None)

    def _keep_again(self, pending: dict) -> None:
        with self._lock:
            self._pending = pending | self._pending

    def _write_one_by_one(self, rows: list[dict], pending: dict) -> int:
        written = 0
        for index, row in enumerate(rows):
            try:
                self._write([row])
                written += 1
            except Exception as error:
                if store_away(error):
                    keys = list(pending)[index:]
                    self._keep_again({key: pending[key] for key in keys})
                    raise
                log.warning("heartbeat of runtime %r dropped: the store refused it (%s: %s)",
                            row["beat_runtime"], type(error).__name__, error)
        return written

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="exitplane-heartbeats")
                    self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception as error:  # the store away: kept, written on a later pass
                log.warning("could not write held heartbeats: %s", type(error).__name__)

    def close(self) -> None:
        """Stop the flusher and write what is pending (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.flush()
        except Exception as error:
            log.warning("held heartbeats not written at shutdown: %s", type(error).__name__)
