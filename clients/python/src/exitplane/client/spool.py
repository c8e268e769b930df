"""The shipper's disk side: the append-only spool that keeps undelivered batches (as
`exitplane.client.codec.EncodedBatch`) across crashes (`Spool`), and per-runtime sequence
numbers that never repeat (`SeqCounter`)."""

from __future__ import annotations

import collections
import logging
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from exitplane.client.codec import EncodedBatch
from exitplane.client.files import atomic_write

log = logging.getLogger("exitplane.client.shipper")

_HEADER = struct.Struct(">II")  # payload length, crc32 of the payload
_SEQ_BLOCK = 1024  # sequence numbers reserved on disk at a time


@dataclass
class _Segment:
    path: Path
    size: int  # bytes in the file
    count: int  # batches not yet replayed
    read_offset: int = 0


class Spool:
    """Append-only segment files of length-prefixed, checksummed batches, read in order.

    Each append is flushed and fsynced before it counts as spooled. Segments are named by the
    first batch's seq, so file order is replay order; a fully replayed segment is deleted."""

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int, segment_bytes: int,
                 fsync: bool = True):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._segments: collections.deque[_Segment] = collections.deque()
        self._writer = None  # open handle on the last segment, which new batches extend
        self._head: EncodedBatch | None = None
        self._head_size = 0
        self._segments_made = 0
        self.pending_batches = 0
        self.total_bytes = 0
        self.max_seq = -1
        for path in sorted(self.directory.glob("*.seg")):
            self._recover(path)
        for mark in self.directory.glob("*.read"):  # its segment gone: it must not outlive it
            if not mark.with_suffix(".seg").exists():
                mark.unlink()
        # Batches set aside (a control plane that keeps failing on them while it takes the
        # others): one file each, out of the replay order, retried now and then.
        self.aside_directory = self.directory / "aside"
        self._aside: dict[Path, int] = {}  # path: bytes
        for path in sorted(self.aside_directory.glob("*.batch")):
            try:
                self.max_seq = max(self.max_seq, self.read_aside(path).seq)
            except (OSError, ValueError) as error:
                log.warning("set-aside telemetry batch %s is unreadable (%s); leaving it",
                            path, error)
                continue
            self._aside[path] = path.stat().st_size
            self.total_bytes += self._aside[path]

    def _recover(self, path: Path) -> None:
        """Index a segment left by an earlier process; cut it at the first torn record, and
        start where a clean shutdown left off (its `.read` file; after a crash, from the
        start: the batches delivered since come again, as replays)."""
        data = path.read_bytes()
        offset = count = 0
        boundaries = {0: 0}  # record start: records before it
        while (record := _unframe(data, offset)) is not None:
            batch, offset = record
            self.max_seq = max(self.max_seq, batch.seq)
            count += 1
            boundaries[offset] = count
        if offset != len(data):
            log.warning("spool segment %s has a torn record at byte %d (a crash while "
                        "writing); keeping the %d whole batches before it", path, offset, count)
            os.truncate(path, offset)
        read_offset = _read_mark(_mark(path), boundaries)
        count -= boundaries[read_offset]
        if count == 0:
            _mark(path).unlink(missing_ok=True)
            path.unlink()
            return
        self._segments.append(_Segment(path, offset, count, read_offset))
        self.pending_batches += count
        self.total_bytes += offset

    def append(self, batch: EncodedBatch) -> bool:
        """Persist `batch` at the tail; False (nothing written) when the cap would be passed."""
        record = _frame(batch)
        if self.total_bytes + len(record) > self.max_bytes:
            return False
        tail = self._segments[-1] if self._segments else None
        if self._writer is None or tail is None or tail.size >= self.segment_bytes:
            self._close_writer()
            # seq first (later processes only use higher seqs), then a per-process counter:
            # the halves of a split batch share its seq and may straddle two segments.
            while True:  # a batch put back from aside may carry an old seq: never reuse a file
                name = f"{batch.seq:020d}-{self._segments_made:08d}.seg"
                self._segments_made += 1
                if not (self.directory / name).exists():
                    break
            tail = _Segment(self.directory / name, 0, 0)
            self._writer = open(tail.path, "ab")  # noqa: SIM115 - held open across appends
            self._segments.append(tail)
        self._writer.write(record)
        self._writer.flush()
        if self.fsync:
            os.fsync(self._writer.fileno())
        tail.size += len(record)
        tail.count += 1
        self.pending_batches += 1
        self.total_bytes += len(record)
        self.max_seq = max(self.max_seq, batch.seq)
        return True

    def peek(self) -> EncodedBatch | None:
        """The oldest batch not yet replayed (one already set aside is skipped: a restart
        reads a segment from its start again)."""
        while self._head is None and self._segments:
            head = self._segments[0]
            with open(head.path, "rb") as handle:
                handle.seek(head.read_offset)
                length, _crc = _HEADER.unpack(handle.read(_HEADER.size))
                self._head = EncodedBatch.unpack(handle.read(length))
            self._head_size = _HEADER.size + length
            if self._aside and self._aside_path(self._head) in self._aside:
                self.pop()
        return self._head

    def pop(self) -> None:
        """Forget the batch `peek` returned (it was delivered or rejected)."""
        if self.peek() is None:
            return
        head = self._segments[0]
        head.read_offset += self._head_size
        head.count -= 1
        self.pending_batches -= 1
        self._head = None
        if head.count == 0:
            if len(self._segments) == 1:
                self._close_writer()
            self._segments.popleft()
            _mark(head.path).unlink(missing_ok=True)  # first: never a note without its file
            head.path.unlink(missing_ok=True)
            self.total_bytes -= head.size

    def set_aside(self) -> Path | None:
        """Move the head batch out of the replay order into a file of its own (written and
        synced before it leaves the segment: a crash in between leaves it in both, and its
        batch id makes the second delivery a replay). Returns the file."""
        head = self.peek()
        if head is None:
            return None
        path = self._aside_path(head)  # never one already aside: `peek` skips those
        atomic_write(path, _frame(head))
        self.pop()
        self._aside[path] = path.stat().st_size
        self.total_bytes += self._aside[path]
        return path

    def _aside_path(self, batch: EncodedBatch) -> Path:
        safe_id = re.sub(r"[^A-Za-z0-9_-]", "_", batch.batch_id)[:80]
        return self.aside_directory / f"{batch.seq:020d}-{safe_id}.batch"

    @property
    def aside(self) -> list[Path]:
        """The set-aside batches' files, oldest seq first (the sender thread's view)."""
        return sorted(self._aside)

    @property
    def aside_count(self) -> int:
        """How many batches are set aside (safe to read from any thread)."""
        return len(self._aside)

    @staticmethod
    def read_aside(path: Path) -> EncodedBatch:
        record = _unframe(path.read_bytes(), 0)
        if record is None:
            raise ValueError("torn or corrupt")
        return record[0]

    def drop_aside(self, path: Path) -> None:
        """Forget a set-aside batch (delivered, rejected or back in the spool)."""
        path.unlink(missing_ok=True)
        self.total_bytes -= self._aside.pop(path, 0)

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        """Close the open segment (what was appended is already on disk) and note how far
        the oldest segment was replayed, so a restart does not send those batches again."""
        self._close_writer()
        if self._segments and self._segments[0].read_offset:
            head = self._segments[0]
            atomic_write(_mark(head.path), str(head.read_offset).encode())


def _frame(batch: EncodedBatch) -> bytes:
    """A batch as it sits on disk: length, crc32, then the packed batch."""
    payload = batch.pack()
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def _unframe(data: bytes, offset: int) -> tuple[EncodedBatch, int] | None:
    """The whole record at `offset` and where the next one starts; None when none is there
    or it is torn (short, or its checksum does not match)."""
    if offset + _HEADER.size > len(data):
        return None
    length, crc = _HEADER.unpack_from(data, offset)
    start = offset + _HEADER.size
    payload = data[start:start + length]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    return EncodedBatch.unpack(payload), start + length


def _mark(segment: Path) -> Path:
    """The file that says how far `segment` was replayed when its process stopped."""
    return segment.with_suffix(".read")


def _read_mark(mark: Path, boundaries: dict[int, int]) -> int:
    """The offset `mark` holds if it is the start of a whole record of the segment, else 0
    (missing, unreadable or torn: replay from the start, as replays are harmless)."""
    try:
        offset = int(mark.read_text())
    except (OSError, ValueError):
        return 0
    return offset if offset in boundaries else 0


class SeqCounter:
    """Per-runtime batch sequence numbers that keep increasing across restarts.

    Blocks of numbers are reserved in a small file before use, so a crash skips numbers but
    never repeats one."""

    def __init__(self, path: Path, floor: int):
        self.path = path
        try:
            reserved = int(path.read_text())
        except (OSError, ValueError):
            reserved = 0
        self.next = max(reserved, floor)
        self.reserved = self.next
        self._reserve()

    def _reserve(self) -> None:
        self.reserved = self.next + _SEQ_BLOCK
        atomic_write(self.path, str(self.reserved).encode())

    def take(self) -> int:
        """The next sequence number."""
        if self.next >= self.reserved:
            self._reserve()
        seq, self.next = self.next, self.next + 1
        return seq
