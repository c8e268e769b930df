"""Provision a runtime's exit heads once, before it serves (`exitplane runtime provision`).

A fresh volume has no heads, so a one-shot step fills it: it copies an artifact the operator
points to (a local path, an http(s) URL, or `shipped`: the SmolLM2-135M-Instruct heads the
exitplane package ships, exit layers 12..27), or trains heads for the served model. It is
idempotent: an artifact whose sha256 sidecar verifies is left alone, so re-running it (every
`docker compose up`, every pod start as an init container) is a no-op. A file lock serialises
concurrent provisioners on a shared volume, and everything is written beside the target and
moved into place, with the sidecar last: a step killed half-way leaves nothing that verifies.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import click

# The `--from` value naming the heads the exitplane package ships (for the default model).
SHIPPED = "shipped"


class ProvisionError(Exception):
    """The heads could not be provisioned; the message says what to do."""


def shipped_heads() -> Path:
    """The heads artifact inside the installed exitplane package (exitplane/data/)."""
    from importlib.resources import files

    path = Path(str(files("exitplane") / "data" / "demo-heads.safetensors"))
    if not path.is_file():
        raise ProvisionError(f"this installation ships no exit heads ({path} is missing); "
                             "give --from a path or an http(s) URL, or train them")
    return path


@contextlib.contextmanager
def locked(target: Path) -> Iterator[None]:
    """An exclusive lock beside `target`; a second provisioner waits for the first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def verified(target: Path) -> dict | None:
    """The provenance of a complete artifact at `target`, or None when it must be provisioned."""
    from runtime.heads import file_sha256, read_metadata

    sidecar = target.with_name(target.name + ".sha256")
    if not (target.exists() and sidecar.exists()):
        return None
    digest = file_sha256(target)
    if sidecar.read_text().split()[0] != digest:
        return None
    meta = read_metadata(target)
    return {"sha256": digest, "model": meta.get("model"), "exit_layers": meta["exit_layers"],
            "num_layers": meta.get("num_layers")}


def fetch(source: str, dest: Path) -> None:
    """Copy a local file, the shipped heads (`shipped`) or download an http(s) URL to `dest`,
    with a progress bar."""
    if source == SHIPPED:
        source = str(shipped_heads())
    if source.startswith(("http://", "https://")):
        import httpx

        with httpx.stream("GET", source, follow_redirects=True, timeout=60) as response:
            if response.status_code != 200:
                raise ProvisionError(f"GET {source} answered {response.status_code}")
            total = int(response.headers.get("content-length") or 0) or None
            with dest.open("wb") as out, click.progressbar(
                    length=total, label="downloading heads", file=sys.stderr) as bar:
                for chunk in response.iter_bytes(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
        return
    path = Path(source)
    if not path.is_file():
        raise ProvisionError(f"heads artifact {source} not found: give a readable file or an "
                             "http(s) URL")
    with path.open("rb") as src, dest.open("wb") as out, click.progressbar(
            length=path.stat().st_size, label="copying heads",
            file=sys.stderr) as bar:
        for block in iter(lambda: src.read(1 << 20), b""):
            out.write(block)
            bar.update(len(block))


def provision(*, target: Path, source: str | None, train: Callable[[Path], None],
              log: Callable[[str], None] = click.echo, expect: dict | None = None) -> dict:
    """Make `target` hold verified heads: keep them, copy them from `source`, or `train` them
    (a callable writing an artifact to the path it is given). Returns the provenance.

    `expect` ({"model": ..., "exit_layers": [...]}, either optional) is checked against heads
    already there: heads for another model or other exit layers are refused, not kept."""
    with locked(target):
        done = verified(target)
        if done is not None:
            for key, wanted in (expect or {}).items():
                if wanted is not None and done.get(key) != wanted:
                    raise ProvisionError(
                        f"heads at {target} were made for {key} {done.get(key)!r}, not "
                        f"{wanted!r}: remove them (and their .sha256) to provision again, or "
                        "give another --heads path")
            log(f"heads already provisioned at {target} (sha256 {done['sha256']}); nothing to do")
            return {**done, "action": "kept"}
        staging = target.with_name(f".{target.name}.staging-{os.getpid()}")
        staging.mkdir(parents=True, exist_ok=True)
        try:
            artifact = staging / target.name
            if source:
                fetch(source, artifact)
                action = "copied"
            else:
                log(f"no heads at {target}: training them (this takes a while)")
                train(artifact)
                action = "trained"
            _check(artifact, source or "training")
            from runtime.heads import file_sha256

            digest = file_sha256(artifact)
            os.replace(artifact, target)
            provenance = {"sha256": digest, "action": action, "source": source or "trained",
                          "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            target.with_name(target.name + ".provenance.json").write_text(
                json.dumps(provenance, indent=2) + "\n")
            # The sidecar last: only now does the artifact count as provisioned.
            sidecar = target.with_name(target.name + ".sha256")
            sidecar.write_text(f"{digest}  {target.name}\n")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        done = verified(target)
        assert done is not None
        log(f"heads provisioned at {target} ({action}, sha256 {digest})")
        return {**done, "action": action}


def _check(artifact: Path, origin: str) -> None:
    """Refuse anything that is not an exitplane heads artifact before it is put in place."""
    from runtime.heads import ExitHeads

    sidecar = artifact.with_name(artifact.name + ".sha256")
    sidecar.unlink(missing_ok=True)  # a fetched file is checked on its format, not a sidecar
    try:
        ExitHeads.load(artifact)
    except Exception as error:
        raise ProvisionError(f"{origin} did not give an exitplane heads artifact: {error}") \
            from error
