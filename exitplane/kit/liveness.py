"""Liveness by promise: a process writes into its heartbeat file the time by which it will have
come round its loop again; a probe checks that this time has not passed.

The worker, the ingest worker and beat write it from their own loop (not from a thread of its
own), so a process whose loop hangs stops renewing its promise and the probe fails, while a
process that is busy for a known while (a Celery task up to its time limit) promises that
much. The file holds one number, Unix seconds, replaced atomically.

    python -m exitplane.kit.liveness /var/lib/exitplane/heartbeat    # exit 0: alive, 1: not

Only the standard library here: a probe starts this every few seconds.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def promise(path: str | os.PathLike, seconds: float) -> None:
    """Write that this process will be back in its loop within `seconds`."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.write_text(f"{time.time() + seconds:.3f}\n")
    os.replace(partial, target)


def problem(path: str | os.PathLike, now: float | None = None) -> str | None:
    """Why the process behind `path` is not alive (None: it is)."""
    now = time.time() if now is None else now
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return f"{path}: no heartbeat yet (the process has not started its loop)"
    except OSError as error:
        return f"{path}: unreadable ({error.strerror})"
    try:
        deadline = float(text)
    except ValueError:
        return f"{path}: not a heartbeat (expected Unix seconds, found {text[:40]!r})"
    if now > deadline:
        return f"{path}: the process promised to be back {now - deadline:.0f} s ago"
    return None


def main(argv: list[str] | None = None) -> int:
    """The probe: exit 0 while the promise in the file named holds, else 1 with the reason."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m exitplane.kit.liveness HEARTBEAT_FILE", file=sys.stderr)
        return 2
    reason = problem(args[0])
    if reason:
        print(reason, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
