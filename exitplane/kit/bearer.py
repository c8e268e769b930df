"""The bearer credential of an `Authorization` header (RFC 6750: `Bearer <token>`), the one
parser every exitplane service uses: the control plane's token checks, its fast paths and its
metrics token, and the runtime server's API keys. Standard library only."""

from __future__ import annotations

_SCHEME = "bearer "


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization` header value, stripped of surrounding whitespace; None
    when the scheme is not `Bearer` (any case) or the token is empty."""
    if authorization[:7].lower() != _SCHEME:
        return None
    return authorization[7:].strip() or None
