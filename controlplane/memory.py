"""Large blocks go back to the operating system when freed.

glibc serves an allocation from a thread's heap ("arena") unless it is at least the mmap
threshold, which starts at 128 KiB and rises to the size of each large block freed (up to 32
MiB). An API process allocates such blocks on many worker threads: an argon2id check's 19 MiB,
a telemetry body of up to 16 MiB and its decoded columns. Under the dynamic threshold each
thread's arena keeps the last of them after it is freed, so a sign-in flood on many threads
leaves an API process larger for good. A fixed threshold makes every block of 1 MiB or more
its own mapping, unmapped when freed: memory held is memory in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BLOCK_BYTES = 1 << 20

_done = False


def return_large_blocks_to_the_os() -> bool:
    """Fix glibc's mmap threshold at LARGE_BLOCK_BYTES for this process (once); whether it
    was set (False where the C library is not glibc)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES):
        log.debug("mallopt is not available: large blocks follow the C library's policy")
        return False
    _done = True
    return True
