"""The admin UI's sign-in gate: a client address whose last sign-in the throttle refused waits
before its next one, and one the throttle has locked out is refused before its form is read.

The throttle (controlplane/guards/signin_throttle.py) refuses a password check whose address,
username or pair is locked, but only once the request has gone through the UI's middleware,
its form parser and a worker thread, with a page rendered for the answer (and the control
plane's body gate reads the form before any of that): a client that loops as fast as the
answers come takes a core of the API process that way, and the runtimes' pulls wait behind
it. Here, before any of that, a POST to the sign-in or password-change form from an address
in `RefusedAddresses` waits on the event loop (nothing but the connection is held) for
EXITPLANE_SIGN_IN_HOLD_S or what is left of the refusal's lock, whichever is shorter
(`RefusalHold`: at most 256 held at once per process; past them, no wait). Then:

- the address itself is locked (whatever the username): it is answered 429 with
  `Retry-After` and `Connection: close`, its body unread, as the throttle would have answered
  it when it came;
- only the username it tried last is locked: it goes on to the throttle, which decides (another
  username from a shared address may sign in).

A client with N connections gets at most N answers per hold. The gate changes when an answer
comes, never what it is.
"""

from __future__ import annotations

import math
from html import escape

from controlplane.auth.clients import Network, client_address, throttle_key
from controlplane.guards.holds import RefusalHold
from controlplane.guards.password_checks import RefusedAddresses

GATED_PATHS = ("/login", "/account/password")


class SignInGate:
    """ASGI middleware of the application the UI is mounted in, at `prefix`."""

    def __init__(self, app, *, refused: RefusedAddresses, trusted_proxies: tuple[Network, ...],
                 hold: RefusalHold, headers: dict[str, str], prefix: str) -> None:
        self.app = app
        self.paths = frozenset(prefix + path for path in GATED_PATHS)
        self.prefix = prefix
        self.refused = refused
        self.trusted_proxies = trusted_proxies
        self.hold = hold
        self.headers = [(name.lower().encode(), value.encode()) for name, value in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" \
                or _route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        key = throttle_key(self._address(scope))
        left, address_locked = self.refused.state(key)
        if left > 0:
            await self.hold(left)
        if left > 0 and address_locked:
            # As the throttle would have refused it when it came, even if the lock has ended
            # during the hold.
            await self._refuse(send, self.refused.state(key)[0],
                               scope.get("root_path", "") + self.prefix)
            return
        await self.app(scope, receive, send)

    def _address(self, scope) -> str:
        peer = scope["client"][0] if scope.get("client") else ""
        forwarded = [value.decode("latin-1") for name, value in scope["headers"]
                     if name == b"x-forwarded-for"]
        return client_address(peer, forwarded, self.trusted_proxies)

    async def _refuse(self, send, left: float, root: str) -> None:
        seconds = max(1, math.ceil(left))
        page = (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Too many "
                f"sign-in attempts</title></head><body><h1>Too many failed sign-ins</h1><p>Too "
                f"many failed sign-ins came from your address; try again in {seconds} s.</p>"
                f"<p><a href=\"{escape(root)}/login\">Back to sign-in</a></p></body></html>"
                ).encode()
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"text/html; charset=utf-8"),
                                (b"content-length", str(len(page)).encode()),
                                (b"retry-after", str(seconds).encode()),
                                (b"cache-control", b"no-store"),
                                (b"connection", b"close"), *self.headers]})
        await send({"type": "http.response.body", "body": page})


def _route_path(scope) -> str:
    """The path inside the application (without the root path it is served under)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
