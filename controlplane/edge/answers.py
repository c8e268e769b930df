"""Answers sent by the pure-ASGI layers of the edge (the body gate, the fast paths): one JSON
answer, and the `connection: close` that ends a request whose body is left unread."""

from __future__ import annotations

CLOSE = (b"connection", b"close")


async def send_json(send, status: int, body: bytes, headers=()) -> None:
    """Answer `status` with `body` (JSON, already encoded) and `headers` besides its type and
    length."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def closing(send):
    """`send` with `connection: close` on the answer's head: the rest of the request's body is
    never read, so the connection cannot carry another request."""
    async def closed(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), CLOSE]}
        await send(message)

    return closed
