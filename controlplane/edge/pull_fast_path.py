"""Pure-ASGI answers for the hottest requests in the system, a runtime's threshold pull
(`GET /v1/deployments/{name}/thresholds`) with its current ETag: the pull route's rules
(controlplane/deployments/delivery.py: ETag match with the shadow rate where the runtime
applies it, headers, long-poll cap; the token's scope and rate) applied without entering
FastAPI, wherever the caches hold the answer."""

from __future__ import annotations

import time
from typing import NamedTuple

from controlplane.deployments.delivery import (
    MAX_WAIT_S,
    ConfigDelivery,
    DeliveryState,
    etag_matches,
    long_poll_timeout,
    pull_headers,
)
from controlplane.edge.answers import send_json
from controlplane.errors import Forbidden
from controlplane.guards.policy import policy_for
from controlplane.observability import http_request_duration, route_template
from exitplane.kit.bearer import bearer_token
from exitplane.kit.logs import new_request_id, request_id_var
from exitplane.wire import RUNTIME_ID, ThresholdSetWire


class NotModifiedFastPath:
    """Pure-ASGI answers for the hottest requests in the system: a runtime polling with its
    current ETag, without (304 at once) or with a long-poll (`wait`: held here until its set
    changes or the wait ends, then 200 with the new set or 304). When the caller's token and
    the deployment's state are both in the caches, the pull never enters FastAPI; anything
    else (a miss, a changed set, a bad token or parameter, an error while waiting) falls
    through to the full route, which decides.

    Why long-polls too: a fleet holds one per runtime at all times, and through the router each
    held one kept ~250 objects alive (32 coroutines) for its whole wait; at 1,000 runtimes the
    collector's full passes over them paused each API process 50-300 ms every few seconds,
    the tail of every other request (bench/fleet.py's probe: exitplane_gc_pause_seconds).

    With `front=True` the instance stands before the request context (request id, duration,
    access line; the app places it there only while no access line is written): it answers
    plain pulls (no `wait`) with the context's request id header and duration sample, at a
    fraction of the context's cost per request, and hands everything else on to the context
    (and the instance behind it, which holds the long-polls)."""

    def __init__(self, app, *, delivery: ConfigDelivery, principals, digest, limiters,
                 settings, route, front: bool = False) -> None:
        self.app = app
        self.delivery = delivery
        self.principals = principals
        self.digest = digest
        self.settings = settings
        self.front = front
        self._route = route  # the pull's APIRoute: metrics and logs name the route
        # The route's bucket, as its policy names it, and its path around the deployment's name.
        self.limiter = limiters[policy_for("GET", route.path).bucket]
        self._prefix, _, self._suffix = route.path.partition("{name}")
        # Query string -> (runtime id, wait, applies_shadow_rate, applies_shadow_requests), or
        # None when the route must answer (422): a runtime repeats the same query for its
        # whole life, so it is parsed once.
        self._queries: dict[bytes, tuple[str, float, bool, bool] | None] = {}
        self._durations: dict[str, object] = {}  # root path -> the 304's duration histogram

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            path: str = scope["path"]
            if path.startswith(self._prefix) and path.endswith(self._suffix):
                if self.front:
                    if await self._answer_in_front(scope, send):
                        return
                else:
                    pull = self._check(scope)
                    if pull is not None and (self.limiter.rate <= 0
                                             or await self._within_rate(pull)):
                        await self._serve(pull, scope, receive, send)
                        return
        await self.app(scope, receive, send)

    async def _answer_in_front(self, scope, send) -> bool:
        """Answer a plain pull's 304 as the request context would (its request id header,
        its duration sample); False when the context and what lies behind it answer."""
        started = time.perf_counter()
        pull = self._check(scope)
        if pull is None or pull.wait > 0:
            return False
        request_id = new_request_id(pull.request_id)
        token = request_id_var.set(request_id)  # a line logged meanwhile names the request
        try:
            if self.limiter.rate > 0 and not await self._within_rate(pull):
                return False  # the route answers 429
            await send({"type": "http.response.start", "status": 304, "headers": [
                *pull_headers(pull.etag, pull.chosen.version),
                (b"x-request-id", request_id.encode())]})
            await send({"type": "http.response.body", "body": b""})
        finally:
            request_id_var.reset(token)
        self._duration(scope).observe(time.perf_counter() - started)
        return True

    def _duration(self, scope):
        """The duration histogram of a 304 on the pull route, as the request context labels it."""
        root = scope.get("root_path", "")
        child = self._durations.get(root)
        if child is None:
            child = http_request_duration.labels(
                "GET", route_template({"route": self._route, "root_path": root}), "304")
            if len(self._durations) < 16:
                self._durations[root] = child
        return child

    async def _serve(self, pull: _Pull, scope, receive, send) -> None:
        """Answer `pull` (held first while it long-polls), or hand it to the route."""
        chosen, etag, body = pull.chosen, pull.etag, None
        if pull.wait > 0:
            with self.delivery.holding(pull.token_id) as held:
                if not held:  # past the token's cap: the route answers 429
                    await self.app(scope, receive, send)
                    return
                try:
                    state = await self.delivery.wait_for_change(
                        pull.name, pull.runtime_id, etag,
                        long_poll_timeout(pull.wait, self.settings),
                        applies_shadow_rate=pull.applies_shadow_rate,
                        applies_shadow_requests=pull.applies_shadow_requests)
                except Exception:  # the store went away: the route answers
                    await self.app(scope, receive, send)
                    return
            latest = state.for_runtime(pull.runtime_id)
            latest_etag = state.etag(latest, pull.applies_shadow_rate,
                                     pull.applies_shadow_requests)
            if latest_etag != etag:
                # The token may have been revoked (or its cached lookup aged out) while the
                # poll was held: a new set goes out only to a caller still allowed now;
                # otherwise the route looks the token up and answers (401 when revoked).
                if self._allowed(pull.token_key, state) is None:
                    await self.app(scope, receive, send)
                    return
                chosen, etag = latest, latest_etag
                if not etag_matches(pull.if_none_match, etag):  # `*` still does
                    body = state.body(latest).encode()
        scope["route"] = self._route
        if body is None:
            await send({"type": "http.response.start", "status": 304,
                        "headers": list(pull_headers(etag, chosen.version))})
            await send({"type": "http.response.body", "body": b""})
        else:
            await send_json(send, 200, body, pull_headers(etag, chosen.version))

    def _allowed(self, token_key: str, state: DeliveryState):
        """The cached principal of `token_key` if it may pull `state`'s deployment, else None.
        peek: this path never extends a cached principal's life (revocation must hold)."""
        principal = self.principals.peek(token_key)
        if principal is None:
            return None
        try:
            principal.require_deployment(state.deployment_id)  # the route's scope check
        except Forbidden:
            return None
        return principal

    async def _within_rate(self, pull: _Pull) -> bool:
        """Take the pull from its token's rate limit; False when the route must answer 429.
        Callers skip the call while no limit is set (`rate` 0): there is nothing to take."""
        return await self.limiter.retry_after(str(pull.token_id)) is None

    def _query(self, raw: bytes) -> tuple[str, float, bool, bool] | None:
        """(runtime id, wait, applies_shadow_rate, applies_shadow_requests) of a query string,
        or None when the route must say what is wrong (remembered for short query strings, a
        bounded number of them)."""
        known = self._queries.get(raw, _UNPARSED)
        if known is not _UNPARSED:
            return known
        query = dict(part.partition("=")[::2]
                     for part in raw.decode("latin-1").split("&") if part)
        runtime_id = query.get("runtime_id", "")
        wait = _wait_seconds(query.get("wait", "0"))
        applies = _BOOLEANS.get(query.get("applies_shadow_rate", "false").lower())
        requests = _BOOLEANS.get(query.get("applies_shadow_requests", "false").lower())
        parsed = None if wait is None or applies is None or requests is None \
            or not RUNTIME_ID.fullmatch(runtime_id) else (runtime_id, wait, applies, requests)
        if len(raw) <= _QUERY_KEPT_BYTES:
            if len(self._queries) >= _QUERIES_KEPT:
                self._queries.clear()
            self._queries[raw] = parsed
        return parsed

    def _check(self, scope) -> _Pull | None:
        """The pull if this path may answer it (before the token's rate limit); None for the
        route."""
        name = scope["path"][len(self._prefix):-len(self._suffix)]
        state = self.delivery.cached(name)
        if state is None:
            return None
        query = self._query(scope["query_string"])
        if query is None:
            return None  # the route's own 422 says what is wrong
        auth = etag = request_id = None
        for key, value in scope["headers"]:  # the first of each, as the route reads them
            if key == b"authorization":
                if auth is None:
                    auth = value.decode("latin-1")
            elif key == b"if-none-match":
                if etag is None:
                    etag = value.decode("latin-1")
            elif key == b"x-request-id" and request_id is None:
                request_id = value.decode("latin-1")
        if auth is None or not etag:
            return None
        secret = bearer_token(auth)
        if secret is None:
            return None
        token_key = self.digest(secret)
        principal = self._allowed(token_key, state)
        if principal is None:
            return None
        runtime_id, wait, applies_shadow_rate, applies_shadow_requests = query
        chosen = state.for_runtime(runtime_id)
        current = state.etag(chosen, applies_shadow_rate, applies_shadow_requests)
        if not etag_matches(etag, current):
            return None
        return _Pull(name=name, runtime_id=runtime_id, chosen=chosen, wait=wait,
                     token_id=principal.token_id, token_key=token_key, request_id=request_id,
                     if_none_match=etag, etag=current, applies_shadow_rate=applies_shadow_rate,
                     applies_shadow_requests=applies_shadow_requests)


class _Pull(NamedTuple):
    """A pull the fast path answers: the deployment, the runtime, the set it holds, the
    seconds it may wait, its token's id and cache key, the request id, the If-None-Match it
    sent, the entity tag it matched and whether the runtime applies the shadow rate and serves
    shadow requests at the control plane's rate."""

    name: str
    runtime_id: str
    chosen: ThresholdSetWire
    wait: float
    token_id: int
    token_key: str
    request_id: str | None = None
    if_none_match: str = ""
    etag: str = ""
    applies_shadow_rate: bool = False
    applies_shadow_requests: bool = False


_UNPARSED = object()
# A boolean query value as the route reads it (pydantic's words); any other: the route's 422
_BOOLEANS = {word: True for word in ("1", "on", "t", "true", "y", "yes")} | {
    word: False for word in ("0", "off", "f", "false", "n", "no")}
_QUERIES_KEPT = 16_384  # query strings remembered per process (then forgotten at once)
_QUERY_KEPT_BYTES = 256  # a runtime id is at most 128 characters


def _wait_seconds(raw: str) -> float | None:
    """The `wait` parameter as the route reads it (0 to MAX_WAIT_S seconds), else None."""
    try:
        wait = float(raw) if raw else 0.0
    except ValueError:
        return None
    return wait if 0 <= wait <= MAX_WAIT_S else None
