"""The control plane's secret key and what is derived from it.

No constant in the code signs anything: `EXITPLANE_SECRET_KEY` when it is set, otherwise a
random key generated on first start and kept in `<var_dir>/secret_key` (mode 0600), which every
process sharing the var dir (API, worker, beat, CLI) reads. UI sessions are signed with it, and
hook credentials are encrypted at rest with a Fernet key derived from it (`Vault`).
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import math
import os
import secrets
from collections import Counter
from functools import lru_cache
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_FILE = "secret_key"
MIN_SECRET_CHARS = 32
# What `estimated_bits` must find in a configured key. Every key the generators one would use
# make scores far above it (48 random base64url characters: about 300; 32 hex digits: 75 or
# more), while a repeated character, a repeated word or a run like "abcd..." scores under 45.
MIN_SECRET_BITS = 64
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


def estimated_bits(secret: str) -> float:
    """A conservative estimate of the entropy of `secret`, in bits: the Shannon entropy of
    its characters times the number of characters that add something. A character adds
    nothing when it extends a run of one character or a step-by-one sequence ("aaa", "abc",
    "321") or when its three-character window was seen earlier (a repeated word)."""
    if not secret:
        return 0.0
    size = len(secret)
    per_char = max(0.0, -sum(n / size * math.log2(n / size) for n in Counter(secret).values()))
    seen: set[str] = set()
    adding = 0
    for index, char in enumerate(secret):
        if index >= 2:
            step = ord(char) - ord(secret[index - 1])
            if abs(step) <= 1 and step == ord(secret[index - 1]) - ord(secret[index - 2]):
                continue
        window = secret[max(0, index - 2):index + 1]
        if len(window) == 3 and window in seen:
            continue
        seen.add(window)
        adding += 1
    return per_char * adding


def randomness_problem(secret: str) -> str | None:
    """Why `secret`, long enough, is still no secret (a repeated character or pattern), or
    None. Says so without the secret."""
    bits = estimated_bits(secret)
    if bits >= MIN_SECRET_BITS:
        return None
    return (f"EXITPLANE_SECRET_KEY is not random: it repeats characters or a pattern (about "
            f"{bits:.0f} bits of entropy where at least {MIN_SECRET_BITS} are needed)")


def weak_secret_problem(settings, host: str) -> str | None:
    """The one line that refuses to listen on `host`, or None when the secret is fit for it."""
    if is_loopback(host):
        return None
    secret = secret_key(settings)
    if len(secret) < MIN_SECRET_CHARS:
        problem = f"EXITPLANE_SECRET_KEY is shorter than {MIN_SECRET_CHARS} characters"
    else:
        problem = randomness_problem(secret)
        if problem is None:
            return None
    return (f"{problem}, which is not enough to listen on {host}: set it to a random value, "
            f"e.g. export EXITPLANE_SECRET_KEY=\"$({MAKE_ONE})\"")


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
