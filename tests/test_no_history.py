"""The product speaks of the product: its README, docs, sources, help texts and benchmark output
say what the code does now, never how it came to be (ticket numbers, commit hashes, sessions,
runs and attempts). That history lives in git and CHANGELOG.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("controlplane", "dashboards", "exitplane", "runtime", "workers", "bench",
            "migrations", "scripts", "deploy", "docs", "tests", "clients/python")
SUFFIXES = {".py", ".md", ".html", ".js", ".yml", ".yaml", ".toml", ".ini", ".mako", ".sh"}
FILES = ("README.md", "CONTRIBUTING.md", "SECURITY.md", "pyproject.toml", "Makefile",
         "Dockerfile", "docker-compose.yml", "docker-compose.runtime-public.yml", "mkdocs.yml")

MARKERS = {
    "ticket number": r"\bissues?\s*#?\d+|\(#\d+\)",
    "commit hash": r"(?<![@\w])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b",
    "branch or commit": r"\bmain at\b|\bon main\b|'s branch\b",
    "session": r"\b(?:this|that|previous|earlier|last|next|first|second|third|fourth|fifth|"
               r"sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|helper'?s?|lead'?s?)"
               r" sessions?(?:'s)?\b(?! cookie| token| store)",
    "run history": r"\b(?:previous|earlier) runs?\b|\bruns? [1-9] (?:and [1-9] )?"
                   r"(?:closed|was|were|failed|ended|stopped)\b",
    "what was tried": r"\bwe tried\b|\btried and not kept\b|\bwere not kept\b|\bnot rerun\b|"
                      r"\b(?:earlier|first|second) attempts?\b|\bwas fixed\b|"
                      r"\bbefore the fix\b|\bafter the fix\b",
    "round of work": r"\bround of work\b|\b(?:in|during) (?:the )?(?:first|second|third|"
                     r"previous|last) round\b",
    "how it used to be": r"\bbefore (?:[\w-]+ ){1,3}existed\b|\bthe former\b|\bformerly\b|"
                         r"\bas before\b|\b(?:test|one|way) of before\b|\bused to be\b|"
                         r"\bthe earlier default\b|\bthe old (?:cache|scheme|code|default|rule|"
                         r"way|behaviou?r)\b",
}
PATTERN = re.compile("|".join(f"(?P<m{i}>{p})" for i, p in enumerate(MARKERS.values())),
                     re.IGNORECASE)
NAMES = list(MARKERS)


def product_files() -> list[Path]:
    """Every text file of the product the scan covers, tests included (docs/openapi.json and
    the test vectors are generated data, not prose; this file holds the markers' examples)."""
    found = [ROOT / name for name in FILES if (ROOT / name).exists()]
    for package in PACKAGES:
        found += sorted(path for path in (ROOT / package).rglob("*")
                        if path.suffix in SUFFIXES and path.is_file()
                        and "vectors" not in path.parts and "__pycache__" not in path.parts
                        and "build" not in path.parts and path != Path(__file__).resolve())
    return found


def history_markers(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, matched text) of each history marker in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATTERN.finditer(line):
            kind = NAMES[int(next(k for k, v in match.groupdict().items() if v)[1:])]
            found.append((number, kind, match.group(0)))
    return found


def test_the_product_carries_no_account_of_how_it_was_made():
    offenders = [f"{path.relative_to(ROOT)}:{number}: {kind}: {text!r}"
                 for path in product_files()
                 for number, kind, text in history_markers(path.read_text(errors="replace"))]
    assert offenders == [], "history markers in the product:\n" + "\n".join(offenders)


@pytest.mark.parametrize("line", [
    # a ticket reference, put together here so that this file does not carry one itself
    "# {} 14: the teapot whistles when the water boils".format("Issue"),
    "measured on main at 3fa9c1e, the teapot pours faster",
    "the tenth session's pots, after the new spout",
    "Tried and not kept: a copper lid for the teapot",
    "earlier attempts (seventh session): no warmer tea",
    "Poured on the helper's branch before that merge",
    "run 2 closed the teapot's lid",
    "(git archive 7c0ffee there)",
    "the lid rattled in previous runs",
    "the handle was fixed in the second round",
    "the spout pours exactly as before lids existed",
    "the former kettle boiled slower",
    "a whistle, as before",
])
def test_each_kind_of_marker_is_found(line):
    assert history_markers(line), line


@pytest.mark.parametrize("line", [
    "Refuse a POST without the session's CSRF token or from another origin.",
    "a delivery attempt is retried with jittered exponential backoff",
    "five failed attempts lock the username",
    "one Redis round trip per pull",
    "batch_id 0f3c2a9e5b7d4e1f8a6c3b2d1e0f9a8b",
    "the rate limit allows 1000000 requests",
    "round(value, 3)",
    "still failing: next round",
    "records cached after the first run",
    "model revision smollm2-135m-instruct@5d5b8d1",
    "the scan covers every session cookie",
    "revoke the old token once the new one serves",
    "the alert no longer exists",
    "sessions signed in with the old one end",
])
def test_ordinary_words_are_not_markers(line):
    assert history_markers(line) == [], line


def test_the_scan_reaches_sources_docs_and_help_texts():
    names = {str(path.relative_to(ROOT)) for path in product_files()}
    assert {"README.md", "exitplane/cli.py", "runtime/cli.py", "bench/fleet.py",
            "docs/protocol.md", "controlplane/settings.py",
            "dashboards/prometheus/alerts.yml", "tests/conftest.py",
            "clients/python/src/exitplane/wire.py"} <= names
