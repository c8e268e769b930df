"""Which traffic segment a request of the runtime server belongs to.

In order, the first that applies:
1. the `X-Exitplane-Segment` header (a gateway that classifies traffic sets it, and it wins
   over what the client's body claims);
2. the `exitplane_segment` field of an OpenAI-style completions or chat body;
3. a rule of this runtime (`--segment-rules FILE`): the API key the request authenticated with,
   then the request's `model` name;
4. `default`.

A name must look like a deployment name (NAME_PATTERN: lowercase letters, digits, `_.-`, at
most 63 characters); anything else is a 400 naming the rule. A name the applied threshold set
has a map for, or a rule names, is always accepted: the operator chose it. Any other name in the
header or the body is a request's own claim: a server without API keys (anyone may send it)
runs such a request as `default`, so an anonymous caller can never name a segment that reaches
the control plane; with keys, it is accepted while the runtime tracks fewer than `max_segments`
names besides `default` (those of the rules count from the start), and later new names run as
`default`. What is stored is the control plane's call: names its operator declared.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from exitplane.kit.bearer import bearer_token
from exitplane.wire import DEFAULT_MAX_SEGMENTS, DEFAULT_SEGMENT, NAME_PATTERN

SEGMENT_HEADER = "x-exitplane-segment"
SEGMENT_FIELD = "exitplane_segment"
SEGMENT_RULES_ENV = "EXITPLANE_RUNTIME_SEGMENT_RULES"
# The control plane's knob of the same name (controlplane/settings.py), with its default: one
# variable bounds the segments a deployment's runtimes track and its registry stores.
MAX_SEGMENTS_ENV = "EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class MalformedSegment(ValueError):
    """A request named a segment that is not a valid name (the server answers 400)."""


def check_name(name: str, where: str) -> str:
    """`name` if it is a valid segment name, else MalformedSegment saying where it came from."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise MalformedSegment(
            f"{where} {name[:80]!r} is not a segment name: use 1-63 lowercase letters, digits, "
            "'_', '.' or '-', starting with a letter or digit (e.g. 'chat', 'code')")
    return name


def key_digest(api_key: str) -> str:
    """How a rules file names an API key: the sha256 hex digest, never the key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class SegmentRules:
    """This runtime's rules: API key (by sha256 hex digest) -> segment, model name -> segment.

    The file is JSON: {"api_keys": {"<sha256 of the key>": "code"}, "models": {"m": "chat"}};
    `printf %s "$KEY" | sha256sum` gives a key's digest."""

    by_api_key: dict[str, str] = field(default_factory=dict)
    by_model: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> SegmentRules:
        """Read and check a rules file; ValueError says what is wrong and where."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"segment rules {path}: {error}") from error
        if not isinstance(data, dict) or set(data) - {"api_keys", "models"}:
            raise ValueError(f"segment rules {path}: expected a JSON object with 'api_keys' "
                             "and/or 'models', each mapping to segment names")
        maps = {}
        for part in ("api_keys", "models"):
            mapping = data.get(part, {})
            if not isinstance(mapping, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
                raise ValueError(f"segment rules {path}: '{part}' must map strings to segment "
                                 "names")
            for value in mapping.values():
                try:
                    check_name(value, f"segment rules {path}: '{part}' names segment")
                except MalformedSegment as error:
                    raise ValueError(str(error)) from None
            maps[part] = dict(mapping)
        bad = [k for k in maps["api_keys"] if not _DIGEST.fullmatch(k)]
        if bad:
            raise ValueError(f"segment rules {path}: 'api_keys' names keys by their sha256 hex "
                             f"digest (printf %s KEY | sha256sum), not {bad[0][:8]!r}...")
        return cls(by_api_key=maps["api_keys"], by_model=maps["models"])

    @property
    def segments(self) -> set[str]:
        """The segment names the rules give, besides `default`."""
        return ({*self.by_api_key.values(), *self.by_model.values()}) - {DEFAULT_SEGMENT}

    def check_keys(self, api_keys: Iterable[str]) -> None:
        """ValueError when a rule names a key this server does not accept (a typo, a key
        rotated out): such a rule could never apply."""
        digests = {key_digest(key) for key in api_keys}
        if self.by_api_key and not digests:
            raise ValueError("segment rules by API key need the server's API keys "
                             "(--api-key-file or EXITPLANE_RUNTIME_API_KEYS)")
        unknown = [d for d in self.by_api_key if d not in digests]
        if unknown:
            raise ValueError(f"segment rules name an API key this server does not accept "
                             f"(sha256 {unknown[0][:12]}...)")


class SegmentRouter:
    """Resolves each request's segment (module docstring) and bounds the names it tracks."""

    def __init__(self, *, rules: SegmentRules | None = None,
                 max_segments: int = DEFAULT_MAX_SEGMENTS,
                 set_segments: Callable[[], Iterable[str]] = tuple,
                 keyed: bool = False) -> None:
        self.rules = rules or SegmentRules()
        if max_segments < 1:
            raise ValueError("the segment cap must be at least 1")
        if len(self.rules.segments) > max_segments:
            raise ValueError(f"the segment rules name {len(self.rules.segments)} segments; this "
                             f"runtime tracks at most {max_segments} ({MAX_SEGMENTS_ENV})")
        self.max_segments = max_segments
        self._set_segments = set_segments  # the applied threshold set's own maps
        self.keyed = keyed  # whether every request authenticated with one of the server's keys
        self._tracked: set[str] = set(self.rules.segments)
        self._lock = threading.Lock()
        self.overflow = 0  # requests whose new name found the cap reached
        self.unkeyed = 0  # requests of a server without keys whose own name ran as default

    @property
    def tracked(self) -> frozenset[str]:
        """The names accepted so far besides `default` and the applied set's own."""
        return frozenset(self._tracked)

    def resolve(self, *, header: str | None, body: str | None, authorization: str | None,
                model: str | None) -> str:
        """The request's segment; MalformedSegment for a bad name in the header or body."""
        if header is not None:
            return self._admit(check_name(header.strip(), f"the {SEGMENT_HEADER} header"))
        if body is not None:
            return self._admit(check_name(body, f"the body field {SEGMENT_FIELD}"))
        rules = self.rules
        if rules.by_api_key and authorization:
            key = bearer_token(authorization)
            if key is not None:
                named = rules.by_api_key.get(key_digest(key))
                if named is not None:
                    return named
        if model is not None and model in rules.by_model:
            return rules.by_model[model]
        return DEFAULT_SEGMENT

    def _admit(self, name: str) -> str:
        if name == DEFAULT_SEGMENT or name in self.rules.segments or \
                name in self._set_segments():
            return name
        if not self.keyed:
            with self._lock:
                self.unkeyed += 1
            return DEFAULT_SEGMENT
        if name in self._tracked:
            return name
        with self._lock:
            if len(self._tracked) < self.max_segments:
                self._tracked.add(name)
                return name
            self.overflow += 1
        return DEFAULT_SEGMENT
