"""How operator commands print: the API's objects unchanged (`--output json` or `yaml`), one
identifier per line (`--output name`, for scripts), or aligned columns and `key: value` lines
for people (`--output table`, `--no-headers` without the header line)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

import click

from exitplane.ops.api import HEADERS, fail

# A column: its header and the field it shows (a key of the object, or a function of it).
Column = tuple[str, str | Callable[[dict], Any]]


def cell(value: Any) -> str:
    """One value as a table shows it: times in UTC to the second, maps as `k:v`, no Nones."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return " ".join(f"{key}:{cell(item)}" for key, item in value.items()) or "-"
    if isinstance(value, list | tuple):
        return ",".join(cell(item) for item in value) or "-"
    text = str(value)
    if len(text) >= 19 and text[10:11] == "T" and text[4:5] == "-":
        try:
            return datetime.fromisoformat(text).strftime("%Y-%m-%d %H:%M:%S")
        except ValueError:
            pass
    return " ".join(text.split())


def _value(row: dict, field: str | Callable[[dict], Any]) -> Any:
    return field(row) if callable(field) else row.get(field)


def table(rows: Sequence[dict], columns: Sequence[Column], *, width: int = 60) -> None:
    """Aligned columns with a header (none under --no-headers); a cell longer than `width` is
    cut with an ellipsis."""
    context = click.get_current_context(silent=True)
    headers = context is None or context.meta.get(HEADERS, True)
    grid = [[header for header, _ in columns]] if headers else []
    for row in rows:
        texts = [cell(_value(row, field)) for _, field in columns]
        grid.append([text if len(text) <= width else text[:width - 1] + "…" for text in texts])
    sizes = [max((len(line[i]) for line in grid), default=0) for i in range(len(columns))]
    for line in grid:
        padded = (text.ljust(size) for text, size in zip(line, sizes, strict=True))
        click.echo("  ".join(padded).rstrip())
    if not rows:
        click.echo("(none)", err=True)


def record(row: dict, fields: Sequence[Column]) -> None:
    """One object as `key: value` lines."""
    size = max(len(header) for header, _ in fields)
    for header, field in fields:
        click.echo(f"{header + ':':<{size + 1}} {cell(_value(row, field))}")


# The fields that name an object, in the order `--output name` looks for them.
IDENTIFIERS = ("name", "username", "runtime_id", "id", "version")


def identifier(row: Any) -> str | None:
    """What names one object of the API: its name, username, runtime id, id or version (None
    for an object without any); a plain value is its own."""
    if isinstance(row, dict):
        return next((str(row[key]) for key in IDENTIFIERS if row.get(key) is not None), None)
    return cell(row)


def emit(output: str, data: Any, people: Callable[[], None],
         names: Callable[[Any], Iterable[Any]] | None = None) -> None:
    """Print `data` as JSON or YAML, one identifier per line (`names(data)`, default: each
    object's `identifier`), or call `people()` to print it for a reader."""
    if output == "json":
        click.echo(json.dumps(data, indent=2))
    elif output == "yaml":
        try:
            import yaml
        except ImportError:
            fail("--output yaml needs PyYAML: pip install pyyaml (the controlplane and runtime "
                 "extras have it)")
        click.echo(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), nl=False)
    elif output == "name":
        found = names(data) if names else data if isinstance(data, list) else [data]
        lines = [identifier(item) for item in found]
        if None in lines:
            fail("--output name: this answer's objects have no name or id; use --output json")
        for line in lines:
            click.echo(line)
    else:
        people()
