"""The deployment page's runtime table shows a runtime that refuses its deployment's sets: the
version it refuses and the reason, as text on the page (not only in a tooltip)."""

from __future__ import annotations

import html
import re

from sqlalchemy import update
from sqlalchemy.orm import Session

from controlplane.runtimes.models import Runtime

REASON = "refused threshold set: set v2 has exit layers [3, 6, 9]; this runtime exits at [6, 9]"


def _row(page: str, runtime_id: str) -> str:
    match = re.search(rf'<tr data-runtime="{runtime_id}".*?</tr>', page, flags=re.S)
    assert match, f"no row for {runtime_id}"
    return match.group(0)


def test_the_runtime_table_shows_the_refused_version_and_why(as_role, seeded, engine):
    with Session(engine) as session:
        session.execute(update(Runtime).where(Runtime.runtime_id == "rt-a").values(
            ready=False, refused_version=2, error=REASON))
        session.commit()
    page = as_role("viewer").get("/ui/deployments/chat").text
    refusing = _row(page, "rt-a")
    shown = html.unescape(re.sub(r"<[^>]+>", " ", refusing))
    assert "refuses v2" in shown and REASON in shown
    quiet = _row(page, "rt-b")
    assert "refuses" not in quiet and "runtime-error" not in quiet
