"""The base of every JSON request body the API takes: unknown fields are ignored, as
docs/protocol.md promises within v1 (a newer client keeps working against an older server),
and named back to the caller in the `Exitplane-Ignored-Fields` answer header, so a client
can tell an operator which of its fields this server did not apply.

`ignored_fields` holds the request's list while the front door (`edge.front.RequestContext`)
serves a request with a body; outside one, nothing is collected."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

IGNORED_FIELDS_HEADER = "exitplane-ignored-fields"
# At most this many names are kept per request (each at most 64 characters).
MAX_NAMED = 16

ignored_fields: ContextVar[list[str] | None] = ContextVar("ignored_fields", default=None)


class RequestModel(BaseModel):
    """A request body: known fields are validated, unknown ones ignored and noted."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _note_unknown_fields(cls, data: Any) -> Any:
        noted = ignored_fields.get()
        if noted is not None and isinstance(data, dict):
            known = set(cls.model_fields)
            known |= {field.alias for field in cls.model_fields.values() if field.alias}
            for name in data:
                if name not in known and len(noted) < MAX_NAMED:
                    noted.append(str(name)[:64])
        return data


def ignored_header(noted: list[str]) -> tuple[bytes, bytes] | None:
    """The answer header naming the ignored fields (latin-1 safe), or None when there are
    none."""
    if not noted:
        return None
    names = ", ".join(dict.fromkeys(noted))
    return (IGNORED_FIELDS_HEADER.encode(),
            names.encode("ascii", "replace").replace(b"\r", b"?").replace(b"\n", b"?"))
