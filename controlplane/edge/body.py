"""Request bodies at the edge: the size gate every request passes (`BodySizeLimit`), the one
reader and replay of a body read before the app, and what a JSON body is."""

from __future__ import annotations

import json

from fastapi import params
from starlette.exceptions import HTTPException

from controlplane.edge.answers import CLOSE, send_json
from controlplane.guards.policy import UNLISTED, body_limit, match
from exitplane.kit.json_depth import TooDeep, check_json_depth


class BodyTooLarge(HTTPException):
    """A body that passed its route's limit while it was read (413; the rest is never read, so
    the connection closes)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes for this route",
                         headers={"Connection": "close"})


class ClientLeft(Exception):
    """The client disconnected before its body was complete: nobody to answer."""


async def read_body(receive, limit: int | None = None) -> bytes:
    """The whole body; BodyTooLarge past `limit` bytes (None: the gate outside counts it),
    ClientLeft when the client disconnected first."""
    chunks, received = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientLeft
        chunk = message.get("body", b"")
        if limit is not None:
            received += len(chunk)
            if received > limit:
                raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive):
    """A receive channel that hands `body` on once, then the client's own messages
    (http.disconnect, when the client goes)."""
    replayed = False

    async def replaying():
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replaying


def counted(receive, limit: int, *, depth_checked: bool = False):
    """`receive`, raising BodyTooLarge once the body it has handed on passes `limit` bytes.
    `depth_checked`: the body is JSON the route decodes itself; its last chunk raises
    BodyTooDeep instead of arriving when the whole body nests past `MAX_JSON_DEPTH`."""
    received = 0
    chunks: list[bytes] = []

    async def counting():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > limit:
                raise BodyTooLarge(limit)
            if depth_checked:
                chunks.append(chunk)
                if not message.get("more_body", False):
                    try:
                        check_json_depth(b"".join(chunks))
                    except TooDeep as error:
                        raise BodyTooDeep(error) from error
                    chunks.clear()
        return message

    return counting


class BodySizeLimit:
    """Refuse a request body over its route's limit with 413 before anything parses it (pure
    ASGI: no cost on the hot GET paths). Each route's limit is the settings field its policy
    names (controlplane/guards/policy.py): kilobytes for control routes (nothing there needs
    more, and auth runs only after the body is read), the batch limit for telemetry; a path no
    route takes gets the control limit.

    A declared Content-Length is refused at once. Otherwise the body is read here, counted
    chunk by chunk (chunked uploads declare no length), and handed to the app only once it is
    complete and within the limit: no route, form parser or middleware sees a byte before.
    A body declared as JSON that nests past `MAX_JSON_DEPTH` is refused with 422 before
    anything decodes it, unless its route decodes it under the decode budget and checks it
    there (telemetry).
    A route whose policy reads the body after auth (telemetry, heartbeats) is the exception:
    it checks the caller from the headers and only then reads the body, through a channel
    that counts it and raises BodyTooLarge past the limit, so a caller without a valid token,
    or past its rate, never has its body read."""

    def __init__(self, app, *, settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        route = match(scope["method"], scope["path"].removeprefix(scope.get("root_path", "")))
        policy = UNLISTED if route is None else route.policy
        limit = body_limit(policy, self.settings)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _refuse(send, f"request body of {int(value)} bytes exceeds the "
                                    f"limit of {limit} bytes for this route")
                return
        # A route that decodes under the decode budget checks its own body's depth.
        depth_checked = not policy.decode_budget and _decodes_as_json(scope)
        if policy.body_after_auth:
            await self.app(scope, counted(receive, limit, depth_checked=depth_checked), send)
            return
        try:
            body = await read_body(receive, limit)
        except ClientLeft:
            return  # nobody to answer
        except BodyTooLarge as error:
            await _refuse(send, error.detail)
            return
        if depth_checked:
            try:
                check_json_depth(body)
            except TooDeep as error:
                await send_json(send, 422, json.dumps({"detail": _too_deep(error)}).encode())
                return
        await self.app(scope, replay(body, receive), send)


async def _refuse(send, message: str) -> None:
    """413 with `connection: close`, as the rest of the body is never read."""
    await send_json(send, 413, json.dumps({"detail": message}).encode(), (CLOSE,))


def _decodes_as_json(scope) -> bool:
    """Whether the request declares a JSON body (a body without one is refused with 415 by
    the routes that take JSON, never decoded)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return is_json_media(value.decode("latin-1"))
    return False


def _too_deep(error: TooDeep) -> str:
    return f"request body is not accepted: {error}"


class BodyTooDeep(HTTPException):
    """A JSON body read after its caller was checked that nests past `MAX_JSON_DEPTH` (422;
    raised once the whole body has arrived, before anything decodes it)."""

    def __init__(self, error: TooDeep) -> None:
        super().__init__(422, _too_deep(error))


def is_json_media(content_type: str) -> bool:
    """Whether a Content-Type names JSON: application/json or application/*+json (any
    parameters, such as a charset)."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


def takes_json_body(route) -> bool:
    """Whether a route reads a JSON body (a body model, not a form; the telemetry route reads
    its content types itself)."""
    body = getattr(route, "body_field", None)
    return body is not None and not isinstance(body.field_info, params.Form)
