"""The audit text log line (`audit: <actor> <action> <target>: <reason>`) cannot be forged: a
reason or an actor carrying a newline, a terminal escape or any other control character is
written with it escaped (\\n, \\x1b), one event one line. The stored event and the JSON log
line keep the values exactly as given."""

from __future__ import annotations

import json
import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.auth.audit import escape_field, record_admin_event
from controlplane.auth.models import AdminEvent
from exitplane.kit.logs import make_formatter

FORGED = ("ok\n2026-12-05 12:00:00 INFO exitplane.audit audit: user:root user.role "
          "user:mallory: promoted")


def _audit_records(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "exitplane.audit"]


def test_a_reason_cannot_start_a_forged_line(engine, caplog):
    caplog.set_level(logging.INFO, logger="exitplane.audit")
    actor = "user:eve\x1b[2K\rroot"
    with Session(engine) as session:
        record_admin_event(session=session, actor=actor, action="token.revoke",
                           target="token:7", reason=FORGED)
        session.commit()
    [record] = _audit_records(caplog)
    line = record.getMessage()
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line == ("audit: user:eve\\x1b[2K\\rroot token.revoke token:7: ok\\n2026-12-05 "
                    "12:00:00 INFO exitplane.audit audit: user:root user.role user:mallory: "
                    "promoted")
    # The JSON line and the store keep the values as given.
    shipped = json.loads(make_formatter("json").format(record))
    assert (shipped["audit"]["actor"], shipped["audit"]["reason"]) == (actor, FORGED)
    with Session(engine) as session:
        stored = session.scalars(select(AdminEvent)).one()
        assert (stored.actor, stored.reason) == (actor, FORGED)


def test_line_separators_and_c1_controls_are_escaped_in_every_field(engine, caplog):
    caplog.set_level(logging.INFO, logger="exitplane.audit")
    with Session(engine) as session:
        record_admin_event(session=session, actor="user:ann", action="user.role",
                           target="user:bob\u2028x", reason="tab\there\x85\x7f")
        session.commit()
    [record] = _audit_records(caplog)
    line = record.getMessage()
    assert len(line.splitlines()) == 1
    assert line == "audit: user:ann user.role user:bob\\u2028x: tab\\there\\x85\\x7f"


def test_the_escape_keeps_printable_text_and_is_unambiguous():
    assert escape_field("deployment chat deleted: typo") == "deployment chat deleted: typo"
    assert escape_field("café 日本 @-_.") == "café 日本 @-_."
    # A backslash is escaped too: a literal "\n" in a reason never reads as a newline.
    assert escape_field("a\\nb") == "a\\\\nb" and escape_field("a\nb") == "a\\nb"
