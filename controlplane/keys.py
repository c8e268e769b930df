"""The control plane's secret key and what is derived from it (issue 13).

No constant in the code signs anything: `EXITPLANE_SECRET_KEY` when it is set, otherwise a
random key generated on first start and kept in `<var_dir>/secret_key` (mode 0600), which every
process sharing the var dir (API, worker, beat, CLI) reads. UI sessions are signed with it, and
hook credentials are encrypted at rest with a Fernet key derived from it (`Vault`).
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import os
import secrets
from functools import lru_cache
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_FILE = "secret_key"
MIN_SECRET_CHARS = 32
MAKE_ONE = "python -c 'import secrets; print(secrets.token_urlsafe(48))'"
ENCRYPTED_PREFIX = "enc:v1:"


def secret_key(settings) -> str:
    """The configured secret key, or the one kept under the var dir (created on first use)."""
    if settings.secret_key:
        return settings.secret_key
    return _stored_key(Path(settings.var_dir).resolve())


@lru_cache(maxsize=16)
def _stored_key(var_dir: Path) -> str:
    path = var_dir / KEY_FILE
    if not path.exists():
        var_dir.mkdir(parents=True, exist_ok=True)
        # Written to a private temporary name, then hard-linked into place: the link fails if
        # another process got there first, so every process ends up reading the same key, and
        # nobody ever sees a half-written or world-readable file.
        temporary = var_dir / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w") as out:
                out.write(secrets.token_urlsafe(48) + "\n")
                out.flush()
                os.fsync(out.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    key = path.read_text().strip()
    if not key:
        raise RuntimeError(f"{path} is empty: delete it to have a new key generated, or set "
                           "EXITPLANE_SECRET_KEY")
    return key


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address the API binds to) only accepts local clients."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def weak_secret_problem(settings, host: str) -> str | None:
    """The one line that refuses to listen on `host`, or None when the secret is fit for it."""
    if is_loopback(host) or len(secret_key(settings)) >= MIN_SECRET_CHARS:
        return None
    return (f"EXITPLANE_SECRET_KEY is shorter than {MIN_SECRET_CHARS} characters, which is not "
            f"enough to listen on {host}: set it to a random value, e.g. "
            f"export EXITPLANE_SECRET_KEY=\"$({MAKE_ONE})\"")


class SecretUnreadable(Exception):
    """A stored hook credential does not decrypt with this key (EXITPLANE_SECRET_KEY changed?)."""


class Vault:
    """Encrypts hook credentials (HMAC secrets, routing keys, URLs) for the store.

    The Fernet key is derived with HKDF from the secret key, so the secret key itself never
    meets the database and other uses of it stay independent."""

    def __init__(self, secret: str) -> None:
        derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"exitplane",
                       info=b"exitplane hook credentials v1").derive(secret.encode())
        self._fernet = Fernet(base64.urlsafe_b64encode(derived))

    def encrypt(self, value: str | None) -> str | None:
        if value is None:
            return None
        return ENCRYPTED_PREFIX + self._fernet.encrypt(value.encode()).decode("ascii")

    def decrypt(self, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(ENCRYPTED_PREFIX):
            raise SecretUnreadable("a hook credential is stored unencrypted; run "
                                   "`exitplane db upgrade`")
        try:
            return self._fernet.decrypt(value.removeprefix(ENCRYPTED_PREFIX)).decode()
        except InvalidToken:
            raise SecretUnreadable("a hook credential does not decrypt with this secret key; "
                                   "was EXITPLANE_SECRET_KEY changed?") from None


def vault(settings) -> Vault:
    """The vault of `settings`' secret key."""
    return _vault(secret_key(settings))


@lru_cache(maxsize=16)
def _vault(secret: str) -> Vault:
    return Vault(secret)
