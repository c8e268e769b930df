"""Token ids to text for the runtime server, incrementally: each token decodes a short window
of ids, never half a UTF-8 character reaches a client, and stop strings are matched over the
characters each token adds (Knuth-Morris-Pratt), so a token costs the same at position 10 and
4,000."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to

class StopMatcher:
    """Knuth-Morris-Pratt over the generated text, fed only the characters each token adds:
    finding a stop (and how much of the tail could still become one) costs O(new characters)
    per token, however long the text and the stop string are."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0  # length of the longest suffix of the text that is a prefix of stop
        self._fail = [0] * len(stop)  # KMP failure function
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._fail[i] = k

    def feed(self, text: str) -> int | None:
        """Advance over text; the index in it just past the first complete match, or None."""
        stop, fail, k = self.stop, self._fail, self.state
        for i, char in enumerate(text):
            while k and char != stop[k]:
                k = fail[k - 1]
            if char == stop[k]:
                k += 1
                if k == len(stop):
                    self.state = k
                    return i + 1
        self.state = k
        return None


class Detokenizer:
    """Incremental decoding with prefix and read offsets (as in vLLM and TGI), and stops.

    `ids[prefix_at:read_at]` were decoded already and give the window its leading context (a
    word-initial space, a byte-level merge); the text a token adds is the window's decode past
    that prefix's decode. It is held while it ends in a replacement character, which an
    incomplete UTF-8 sequence decodes to, so a character split over byte tokens comes out whole.
    Callers run it off the event loop (ServeState.text_pool)."""

    # Tokens held while the text ends in a replacement character before some are released
    # anyway: an invalid byte run would otherwise grow the window without bound.
    MAX_PENDING = 8
    # A UTF-8 character has at most 3 bytes after its first and every token adds at least one
    # byte, so the text of all but the last 3 ids can no longer change.
    SETTLE_TOKENS = 3

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self._matchers = [StopMatcher(stop) for stop in stops]
        self.ids: list[int] = []
        self._prefix_at = 0  # window start: one token before the unread ones (word spacing)
        self._read_at = 0  # ids before this are in self.text
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """The text delta this token releases ('' while a character or a stop is pending)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        prefix = self._decode(self.ids[self._prefix_at:self._read_at])
        window = self._decode(self.ids[self._prefix_at:])
        new = window[len(prefix):]
        read_to = len(self.ids)
        if not new or new.endswith(REPLACEMENT):
            if read_to - self._read_at < self.MAX_PENDING:
                return ""
            new, read_to = self._settled(prefix, window)
        return self._release(new, read_to)

    def _settled(self, prefix: str, window: str) -> tuple[str, int]:
        """(text, read_to) to release from a window held MAX_PENDING tokens: the longest run of
        ids, leaving at least the last SETTLE_TOKENS, whose text agrees with the window's (no
        later byte completed a character there), else everything as it decodes now."""
        for read_to in range(len(self.ids) - self.SETTLE_TOKENS, self._read_at, -1):
            settled = self._decode(self.ids[self._prefix_at:read_to])
            if settled.startswith(prefix) and window.startswith(settled):
                return settled[len(prefix):], read_to
        return window[len(prefix):], len(self.ids)

    def _release(self, new: str, read_to: int) -> str:
        """Append new (the text of ids up to read_to), cut at a stop, and return what may be
        sent: all of it except a tail that could still become a stop string."""
        self._prefix_at, self._read_at = self._read_at, read_to
        start = len(self.text)
        self.text += new
        cut = None
        for matcher in self._matchers:
            end = matcher.feed(new)
            if end is not None:
                at = start + end - len(matcher.stop)
                cut = at if cut is None else min(cut, at)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
        hold = 0 if self.stopped else max((m.state for m in self._matchers), default=0)
        delta = self.text[self.emitted:len(self.text) - hold]
        self.emitted += len(delta)
        return delta

    def push_many(self, tokens: list[int]) -> list[str]:
        """push() each token until a stop matches; one delta per token pushed."""
        deltas = []
        for token in tokens:
            if self.stopped:
                break
            deltas.append(self.push(token))
        return deltas

    def finish(self) -> str:
        """The generation ended: release the held ids as they decode (an incomplete character
        at the very end stays a replacement character, as in a full decode) and any tail held
        for a stop; self.text is then the whole answer."""
        released = ""
        if not self.stopped and self._read_at < len(self.ids):
            prefix = self._decode(self.ids[self._prefix_at:self._read_at])
            window = self._decode(self.ids[self._prefix_at:])
            released = self._release(window[len(prefix):], len(self.ids))
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return released + delta
