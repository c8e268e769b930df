"""Shadow requests: whole requests a runtime served at full depth, every token labelled at every
exit point (docs/protocol.md, "Shadow requests"). Assembled here from their tokens, and read
back under the trust rules for the answer statistics (`calibration.answers`).

A shadow request's tokens are shadow tokens (stored as shadow samples like any other) flagged
`shadow_request`; the last one also `request_end`. Each is staged in `shadow_request_tokens`,
keyed by (deployment, runtime, request id, position). A request is complete once its end marker
arrived and every position from 0 to the end is staged; it then becomes one `shadow_requests`
row holding its tokens' labels in position order, and its staged tokens leave.

- Idempotent: a replayed batch is skipped by its id before it gets here; a position staged
  again with the same content, or a token of a request already complete, is ignored. A request
  id is used once per runtime: a completed one is never assembled again.
- Consistent: a request whose tokens disagree on threshold version, segment, witness or
  lineage, that holds two ends or tokens past its end, or one of whose positions arrives again
  with other content (signals, matched, end marker, version, segment, witness, lineage: two
  requests under one id), is no evidence about one served request: its staged tokens are
  dropped and it is marked so that it never completes (the mark expires like a token).
- Bounded: positions at or past `shadow_request_max_tokens` are not staged (such a request never
  completes), and a staged token whose own timestamp is older than `shadow_request_ttl_s` is
  dropped. Only the requests whose staged counts say they can be complete (their end staged and
  as many positions as it says) or inconsistent are read back whole.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np
from sqlalchemy import case, delete, func, select, tuple_
from sqlalchemy.orm import Session

from controlplane.db import dialect_insert
from controlplane.runtimes.witnesses import witness_labels
from controlplane.settings import get_settings
from controlplane.stats.answers import packed_divergence
from controlplane.stats.robust_evidence import EvidencePolicy, cap_runtime_share
from controlplane.telemetry.columns import BatchColumns
from controlplane.telemetry.models import ShadowRequestRow, ShadowRequestTokenRow
from controlplane.telemetry.tables import shadow_labels
from controlplane.telemetry.trust import trusted

Key = tuple[str, str]  # (runtime id, request id)
# Rows per statement: a batch holds at most a few thousand shadow-request tokens.
_CHUNK = 500


def stage(*, session: Session, deployment_id: int, exit_layers: list[int],
          batches: Sequence[BatchColumns], witnesses: Mapping[str, str],
          segment_of: Mapping[str, str] | None = None) -> int:
    """Stage the shadow-request tokens of freshly stored `batches` and assemble the requests
    they complete; returns how many requests were completed. `witnesses`: each batch's witness
    by batch id; `segment_of`: the name each segment is stored under where not itself."""
    settings = get_settings()
    segment_of = segment_of or {}
    now = datetime.now(UTC)
    rows: list[dict] = []
    for batch in batches:
        flagged = batch.shadow_request[batch.shadowed]  # (m,) per shadowed record
        if not flagged.any():
            continue
        signals, matched = shadow_labels(batch, exit_layers)  # (m, L) each
        for row, index in zip(np.flatnonzero(flagged).tolist(),
                              batch.shadowed[flagged].tolist(), strict=True):
            position = int(batch.position[index])
            if position >= settings.shadow_request_max_tokens:
                continue
            ts = datetime.fromtimestamp(float(batch.ts[index]), UTC)
            rows.append({
                "deployment_id": deployment_id, "runtime_id": batch.runtime_id,
                "request_id": batch.request_id[index], "position": position, "ts": ts,
                "threshold_version": int(batch.threshold_version[index]),
                "segment": segment_of.get(batch.segment[index], batch.segment[index]),
                "witness": witnesses[batch.batch_id],
                "model_revision": batch.model_revision or "",
                "head_digest": batch.head_digest or "",
                "arrival_delay_s": (now - ts).total_seconds(),
                "request_end": bool(batch.request_end[index]),
                "signals": signals[row].astype("<f4").tobytes(),
                "matched": matched[row].astype(np.uint8).tobytes()})
    if not rows:
        return 0
    expire(session=session, deployment_id=deployment_id, now=now)
    keys = sorted({_key(row) for row in rows})
    closed = _closed(session=session, deployment_id=deployment_id, keys=keys)
    rows, clashing = _distinct(row for row in rows if _key(row) not in closed)
    rows = [row for row in rows if _key(row) not in clashing]
    clashing |= _clashing_with_staged(session=session, deployment_id=deployment_id, rows=rows)
    _mark_inconsistent(session=session, deployment_id=deployment_id, keys=sorted(clashing),
                       now=now)
    staged = sorted({_key(row) for row in rows} - clashing)
    return assemble(session=session, deployment_id=deployment_id, keys=staged)


def expire(*, session: Session, deployment_id: int | None = None,
           now: datetime | None = None) -> int:
    """Drop staged tokens whose own timestamp is older than `shadow_request_ttl_s` (of one
    deployment, or all), and the marks of inconsistent requests as old."""
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=get_settings().shadow_request_ttl_s)
    query = delete(ShadowRequestTokenRow).where(ShadowRequestTokenRow.ts < cutoff)
    if deployment_id is not None:
        query = query.where(ShadowRequestTokenRow.deployment_id == deployment_id)
    return session.execute(query).rowcount


def _key(row: dict) -> Key:
    return row["runtime_id"], row["request_id"]


def _content(row) -> tuple:
    """What two stagings of one position must agree on (not when they arrived)."""
    get = row.get if isinstance(row, dict) else lambda name: getattr(row, name)
    return tuple(get(name) for name in _CONTENT)


_CONTENT = ("threshold_version", "segment", "witness", "model_revision", "head_digest",
            "request_end", "signals", "matched")


def _distinct(rows: Iterable[dict]) -> tuple[list[dict], set[Key]]:
    """`rows` with each position once, and the requests one batch sent a position of twice
    with different content (an identical repeat is one token)."""
    first: dict[tuple[str, str, int], dict] = {}
    clashing: set[Key] = set()
    for row in rows:
        seen = first.setdefault((*_key(row), row["position"]), row)
        if seen is not row and _content(seen) != _content(row):
            clashing.add(_key(row))
    return list(first.values()), clashing


def _clashing_with_staged(*, session: Session, deployment_id: int,
                          rows: list[dict]) -> set[Key]:
    """Stage `rows`; returns the requests of those whose position was staged already with
    different content. Only the positions the insert skipped are read back."""
    table = ShadowRequestTokenRow
    skipped: list[dict] = []
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start:start + _CHUNK]
        inserted = {(row.runtime_id, row.request_id, row.position) for row in session.execute(
            dialect_insert(session, table).on_conflict_do_nothing().returning(
                table.runtime_id, table.request_id, table.position), chunk)}
        skipped += [row for row in chunk if (*_key(row), row["position"]) not in inserted]
    clashing: set[Key] = set()
    for start in range(0, len(skipped), _CHUNK):
        chunk = {(*_key(row), row["position"]): row for row in skipped[start:start + _CHUNK]}
        for token in session.scalars(select(table).where(
                table.deployment_id == deployment_id,
                tuple_(table.runtime_id, table.request_id, table.position).in_(list(chunk)))):
            mine = chunk[(token.runtime_id, token.request_id, token.position)]
            if _content(token) != _content(mine):
                clashing.add((token.runtime_id, token.request_id))
    return clashing


# A staged row at this position marks its request inconsistent: its tokens were dropped and
# any that arrive later are not staged, until the mark expires with the time to live.
_INCONSISTENT = -1


def _mark_inconsistent(*, session: Session, deployment_id: int, keys: list[Key],
                       now: datetime) -> None:
    """Drop the staged tokens of `keys` and mark them so that they never complete."""
    table = ShadowRequestTokenRow
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start:start + _CHUNK]
        session.execute(delete(table).where(
            table.deployment_id == deployment_id,
            tuple_(table.runtime_id, table.request_id).in_(chunk)))
        session.execute(dialect_insert(session, table).on_conflict_do_nothing(), [
            {"deployment_id": deployment_id, "runtime_id": runtime_id, "request_id": request_id,
             "position": _INCONSISTENT, "ts": now, "threshold_version": 0, "segment": "",
             "witness": "", "model_revision": "", "head_digest": "", "arrival_delay_s": 0.0,
             "request_end": False, "signals": b"", "matched": b""}
            for runtime_id, request_id in chunk])


def _closed(*, session: Session, deployment_id: int, keys: list[Key]) -> set[Key]:
    """The requests among `keys` that take no more tokens: complete, or marked inconsistent."""
    found: set[Key] = set()
    staged = ShadowRequestTokenRow
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start:start + _CHUNK]
        found |= {(row.runtime_id, row.request_id) for row in session.execute(
            select(ShadowRequestRow.runtime_id, ShadowRequestRow.request_id).where(
                ShadowRequestRow.deployment_id == deployment_id,
                tuple_(ShadowRequestRow.runtime_id, ShadowRequestRow.request_id).in_(chunk))
            .union(select(staged.runtime_id, staged.request_id).where(
                staged.deployment_id == deployment_id, staged.position == _INCONSISTENT,
                tuple_(staged.runtime_id, staged.request_id).in_(chunk))))}
    return found


def _decidable(*, session: Session, deployment_id: int, keys: list[Key]) -> list[Key]:
    """The requests among `keys` whose staged tokens can be complete or are inconsistent, by
    counts alone: the end marker staged, and as many positions as it says or too many ends
    or positions past the end. The others wait, and their tokens are not read."""
    table = ShadowRequestTokenRow
    ends = func.sum(case((table.request_end, 1), else_=0))
    end_at = func.max(case((table.request_end, table.position), else_=None))
    found: list[Key] = []
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start:start + _CHUNK]
        for row in session.execute(
                select(table.runtime_id, table.request_id, func.count().label("tokens"),
                       func.max(table.position).label("last"), ends.label("ends"),
                       end_at.label("end_at"))
                .where(table.deployment_id == deployment_id, table.position >= 0,
                       tuple_(table.runtime_id, table.request_id).in_(chunk))
                .group_by(table.runtime_id, table.request_id)):
            if row.ends and (row.ends > 1 or row.last != row.end_at
                             or row.tokens == row.end_at + 1):
                found.append((row.runtime_id, row.request_id))
    return sorted(found)


def assemble(*, session: Session, deployment_id: int, keys: list[Key] | None = None) -> int:
    """Turn the staged requests among `keys` (None: every staged request whose end arrived)
    that are complete into `shadow_requests` rows; drop and mark the inconsistent ones.
    Returns how many were completed."""
    table = ShadowRequestTokenRow
    if keys is None:
        keys = sorted({(row.runtime_id, row.request_id) for row in session.execute(
            select(table.runtime_id, table.request_id).where(
                table.deployment_id == deployment_id, table.request_end))})
    keys = _decidable(session=session, deployment_id=deployment_id, keys=keys)
    completed = 0
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start:start + _CHUNK]
        staged: dict[Key, list] = {}
        for token in session.scalars(select(table).where(
                table.deployment_id == deployment_id, table.position >= 0,
                tuple_(table.runtime_id, table.request_id).in_(chunk))
                .order_by(table.runtime_id, table.request_id, table.position)):
            staged.setdefault((token.runtime_id, token.request_id), []).append(token)
        finished, done, inconsistent = [], [], []
        for key, tokens in staged.items():
            state = _state(tokens)
            if state == "complete":
                finished.append(_request_row(deployment_id, tokens))
                done.append(key)
            elif state == "inconsistent":
                inconsistent.append(key)
        if finished:
            session.execute(dialect_insert(session, ShadowRequestRow).on_conflict_do_nothing(),
                            finished)
            completed += len(finished)
        if done:
            session.execute(delete(table).where(
                table.deployment_id == deployment_id,
                tuple_(table.runtime_id, table.request_id).in_(done)))
        _mark_inconsistent(session=session, deployment_id=deployment_id, keys=inconsistent,
                           now=datetime.now(UTC))
    session.flush()
    return completed


def _state(tokens: list[ShadowRequestTokenRow]) -> str:
    """'complete', 'waiting' (positions or the end marker missing) or 'inconsistent' for one
    request's staged tokens in position order."""
    ends = [token.position for token in tokens if token.request_end]
    if not ends:
        return "waiting"
    if len(ends) > 1 or tokens[-1].position != ends[0]:
        return "inconsistent"  # two ends, or tokens past the end
    if len(tokens) != ends[0] + 1:
        return "waiting"  # positions are unique and < end + 1: some are missing
    served = {(t.threshold_version, t.segment, t.witness, t.model_revision, t.head_digest)
              for t in tokens}
    return "complete" if len(served) == 1 else "inconsistent"


def _request_row(deployment_id: int, tokens: list[ShadowRequestTokenRow]) -> dict:
    first = tokens[0]
    return {"deployment_id": deployment_id, "runtime_id": first.runtime_id,
            "request_id": first.request_id, "ts": first.ts,
            "threshold_version": first.threshold_version, "segment": first.segment,
            "witness": first.witness, "model_revision": first.model_revision,
            "head_digest": first.head_digest,
            "arrival_delay_s": max(token.arrival_delay_s for token in tokens),
            "tokens": len(tokens),
            "signals": b"".join(token.signals for token in tokens),
            "matched": b"".join(token.matched for token in tokens),
            "completed_at": datetime.now(UTC)}


def assemble_all(*, session: Session) -> int:
    """`assemble` every deployment's staged requests whose end arrived: completes a request
    whose last tokens came in two concurrent transactions, neither of which saw the other's."""
    deployments = session.scalars(select(ShadowRequestTokenRow.deployment_id).where(
        ShadowRequestTokenRow.request_end).distinct()).all()
    return sum(assemble(session=session, deployment_id=deployment_id)
               for deployment_id in deployments)


@dataclass(frozen=True)
class ShadowRequests:
    """A window's complete shadow requests, oldest first: every token's labels in position
    order, request after request (`offsets[i]:offsets[i + 1]` are request i's tokens)."""

    requests: list[str]  # request ids
    runtimes: list[str]
    witnesses: list[str]  # who vouches for each (`runtimes.witnesses`)
    segments: list[str]
    versions: np.ndarray  # (m,) int: the version each was served under
    offsets: np.ndarray  # (m + 1,) int64
    signals: np.ndarray  # (T, L) float32, exit-layer order
    matched: np.ndarray  # (T, L) bool

    def __len__(self) -> int:
        return len(self.requests)

    @classmethod
    def empty(cls, width: int) -> ShadowRequests:
        """No requests (a deployment with `width` exit layers)."""
        return cls([], [], [], [], np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64),
                   np.zeros((0, width), dtype=np.float32), np.zeros((0, width), dtype=bool))

    def keyed_requests(self) -> np.ndarray:
        """Request ids keyed by their runtime (one runtime's ids never join another's)."""
        return np.array([f"{runtime}/{request}" for runtime, request
                         in zip(self.runtimes, self.requests, strict=True)], dtype=str)

    def take(self, keep: np.ndarray) -> ShadowRequests:
        """The requests where `keep` (bool (m,)) holds, in order."""
        index = np.flatnonzero(keep)
        lengths = np.diff(self.offsets)[index]
        rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in index]) \
            if len(index) else np.zeros(0, dtype=np.int64)
        return ShadowRequests(
            requests=[self.requests[i] for i in index], runtimes=[self.runtimes[i] for i in index],
            witnesses=[self.witnesses[i] for i in index],
            segments=[self.segments[i] for i in index], versions=self.versions[index],
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            signals=self.signals[rows], matched=self.matched[rows])

    def divergence(self, thresholds: np.ndarray) -> np.ndarray:
        """(m, K) int: each request's first divergence position under each set (rows of
        `thresholds`, (K, L) in exit-layer order), -1 where its answer equals full depth
        (`stats.answers.packed_divergence`)."""
        return packed_divergence(self.signals, self.matched, self.offsets, thresholds)

    def divergence_by_segment(self, thresholds_of: Callable[[str], Sequence[float]]
                              ) -> np.ndarray:
        """(m,) int: each request's first divergence position under the thresholds
        `thresholds_of(its segment)` gives (exit-layer order), -1 where its answer is the
        full-depth answer."""
        out = np.full(len(self), -1, dtype=np.int64)
        segments = np.asarray(self.segments, dtype=object)
        for name in sorted(set(self.segments)):
            mine = segments == name
            out[mine] = self.take(mine).divergence(np.array([thresholds_of(name)]))[:, 0]
        return out

    def capped(self, policy: EvidencePolicy, *, seed: int = 0) -> ShadowRequests:
        """These requests with each witness cut to its share of them (`cap_runtime_share`:
        whole requests, drawn at random by `seed`)."""
        if len(self) == 0:
            return self
        keep = cap_runtime_share(np.asarray(self.witnesses), self.keyed_requests(),
                                 max_share=policy.max_runtime_share, seed=seed,
                                 max_share_of_median=policy.max_share_of_median,
                                 min_runtimes=policy.robust_min_runtimes)
        return self if keep.all() else self.take(keep)


def shadow_request_evidence(*, session: Session, deployment_id: int, width: int,
                            since: datetime, until: datetime | None = None,
                            version: int | None = None, segment: str | None = None,
                            exclude: Collection[str] | None = None,
                            exclude_witnesses: Collection[str] | None = None,
                            limit: int = 100_000) -> ShadowRequests:
    """The one read of complete shadow requests every answer decision uses: of the window
    (by each request's first token), `version` and `segment` when given, under the trust rules
    of every evidence read (`telemetry.trust`: `exclude` and `exclude_witnesses` as there).
    `width`: the deployment's exit-layer count. A window holding more than `limit` gives its
    newest `limit` (truncating by time is independent of the outcomes)."""
    model = ShadowRequestRow
    query = (select(model.request_id, model.runtime_id, model.witness, model.segment,
                    model.threshold_version, model.tokens, model.signals, model.matched)
             .where(model.deployment_id == deployment_id, model.ts >= since)
             .order_by(model.ts.desc(), model.runtime_id, model.request_id).limit(limit))
    if until is not None:
        query = query.where(model.ts < until)
    if version is not None:
        query = query.where(model.threshold_version == version)
    if segment is not None:
        query = query.where(model.segment == segment)
    query = trusted(query, model, session=session, deployment_id=deployment_id,
                    exclude=exclude, exclude_witnesses=exclude_witnesses)
    rows = list(reversed(session.connection().execute(query).all()))
    tokens = np.array([row.tokens for row in rows], dtype=np.int64)
    signals = np.frombuffer(b"".join(bytes(row.signals) for row in rows), dtype="<f4")
    matched = np.frombuffer(b"".join(bytes(row.matched) for row in rows), dtype=np.uint8)
    return ShadowRequests(
        requests=[row.request_id for row in rows], runtimes=[row.runtime_id for row in rows],
        witnesses=witness_labels([row.witness for row in rows],
                                 [row.runtime_id for row in rows]).tolist(),
        segments=[row.segment for row in rows],
        versions=np.array([row.threshold_version for row in rows], dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64),
        signals=signals.reshape(-1, width).copy(),
        matched=matched.reshape(-1, width).astype(bool))
