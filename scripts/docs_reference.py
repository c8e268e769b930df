"""The generated parts of the documentation site, and the mkdocs hook that puts them in place.

Each reference page holds a marker (`<!-- generated: configuration -->` and so on); at build
time `on_page_markdown` replaces it with a table rendered from the definition itself, so each
table has one source:

- configuration: the fields of `controlplane.settings.Settings` and their descriptions;
- cli: the `exitplane` click commands (the runtime group included), their options and help;
- http-api: the committed OpenAPI document (docs/openapi.json);
- metrics: the Prometheus families each process registers;
- runtime-server: the options of `exitplane runtime serve`.

mkdocs.yml names this file under `hooks:`; tests/test_configuration_reference.py renders the
configuration table the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")


CODE_SPAN = re.compile(r"(`[^`]*`)")
# What Markdown would take for the start of an HTML tag, comment or entity (and drop or decode)
TAG_START = re.compile(r"<(?=[A-Za-z/!?])")
ENTITY = re.compile(r"&(?=#?\w+;)")


def _text(text: str) -> str:
    """Help or description text as Markdown prose that shows every character: outside code
    spans, a `<` that would open a tag and an `&` that would start an entity are escaped, so a
    placeholder such as `<key>` shows instead of being dropped as an unknown HTML tag."""
    return "".join(part if CODE_SPAN.fullmatch(part) else
                   TAG_START.sub("&lt;", ENTITY.sub("&amp;", part))
                   for part in CODE_SPAN.split(str(text)))


def _cell(text: str) -> str:
    """Markdown table cell text: one line, pipes escaped, placeholders kept (`_text`)."""
    return _text(" ".join(str(text).split())).replace("|", "\\|")


# -- configuration ---------------------------------------------------------------------------


def _default(field) -> str:
    from pydantic_core import PydanticUndefined

    value = field.default
    if value is PydanticUndefined and field.default_factory is not None:
        value = field.default_factory()
    if value is None or value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | tuple):
        return f"`{json.dumps(list(value))}`"
    return f"`{value}`"


def settings_rows() -> list[tuple[str, str, str]]:
    """(variable, default, description) for every Settings field, in definition order."""
    from controlplane.settings import Settings

    return [(f"EXITPLANE_{name.upper()}", _default(field), field.description or "")
            for name, field in Settings.model_fields.items()]


def configuration_reference() -> str:
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{variable}` | {default} | {_cell(description)} |"
              for variable, default, description in settings_rows()]
    return "\n".join(lines)


# -- CLI -------------------------------------------------------------------------------------


def _option_row(param) -> str:
    import click

    names = ", ".join(f"`{opt}`" for opt in [*param.opts, *param.secondary_opts])
    if isinstance(param, click.Argument):
        return f"| `{param.human_readable_name}` (argument) | | |"
    default = ""
    if param.show_default and param.default not in (None, False, ()):
        default = f"`{param.default}`"
    return f"| {names} | {default} | {_cell(param.help or '')} |"


def _command_section(command, path: list[str], ctx, level: int) -> list[str]:
    import click

    out = [f"{'#' * level} `{' '.join(path)}`", ""]
    help_text = (command.help or "").strip()
    if help_text:
        out += [_text(help_text.split("\n\n")[0].replace("\n", " ")), ""]
    params = [p for p in command.params if "--help" not in getattr(p, "opts", ())]
    if params:
        out += ["| option | default | meaning |", "|---|---|---|"]
        out += [_option_row(p) for p in params]
        out.append("")
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            sub_ctx = click.Context(sub, parent=ctx, info_name=name)
            out += _command_section(sub, [*path, name], sub_ctx, min(level + 1, 4))
    return out


def cli_reference() -> str:
    import click

    from exitplane.cli import main

    ctx = click.Context(main, info_name="exitplane")
    return "\n".join(_command_section(main, ["exitplane"], ctx, 2))


def runtime_server_reference() -> str:
    import click

    from exitplane.cli import main

    ctx = click.Context(main, info_name="exitplane")
    runtime = main.get_command(ctx, "runtime")
    runtime_ctx = click.Context(runtime, parent=ctx, info_name="runtime")
    serve = runtime.get_command(runtime_ctx, "serve")
    serve_ctx = click.Context(serve, parent=runtime_ctx, info_name="serve")
    return "\n".join(_command_section(serve, ["exitplane", "runtime", "serve"], serve_ctx, 2))


# -- HTTP API --------------------------------------------------------------------------------


def http_api_reference() -> str:
    document = json.loads((ROOT / "docs" / "openapi.json").read_text())
    out: list[str] = []
    by_tag: dict[str, list[tuple[str, str, dict]]] = {}
    for path, operations in sorted(document["paths"].items()):
        for method, operation in operations.items():
            tag = (operation.get("tags") or ["other"])[0]
            by_tag.setdefault(tag, []).append((method.upper(), path, operation))
    for tag in sorted(by_tag):
        out += [f"## {tag}", "", "| method | path | what it does | answers |", "|---|---|---|---|"]
        for method, path, operation in by_tag[tag]:
            summary = operation.get("description") or operation.get("summary") or ""
            summary = summary.strip().split("\n\n")[0]
            codes = ", ".join(sorted(operation.get("responses", {})))
            out.append(f"| {method} | `{path}` | {_cell(summary)} | {codes} |")
        out.append("")
    return "\n".join(out)


# -- metrics ---------------------------------------------------------------------------------

# Which processes serve the families a module defines (the registry each process exposes).
METRIC_SOURCES = (
    ("exitplane.kit.build",
     "every process (API, ingest worker, Celery worker, beat, runtime server)"),
    ("controlplane.metrics", "API, ingest worker"),
    ("controlplane.observability", "API"),
    ("controlplane.telemetry.gauges", "API (read from the store at scrape time)"),
    ("workers.observability", "Celery worker"),
    ("runtime.server_metrics", "runtime server"),
)
_SUFFIX = {"counter": "_total"}


def _described(collector) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(exposed name, type, labels, help) of what one collector exports: a client-library
    metric by its declaration, any other collector by the families it describes or collects
    (labels: those its families declare, else those its samples carry)."""
    from prometheus_client.metrics import MetricWrapperBase

    if isinstance(collector, MetricWrapperBase):
        return [(collector._name + _SUFFIX.get(collector._type, ""), collector._type,
                 tuple(collector._labelnames), collector._documentation)]
    describe = getattr(collector, "describe", None)
    families = (describe() if describe is not None else None) or collector.collect()
    rows = []
    for family in families:
        labels = tuple(getattr(family, "_labelnames", ()) or sorted(
            {label for sample in family.samples for label in sample.labels
             if label not in ("le", "quantile")}))
        rows.append((family.name + _SUFFIX.get(family.type, ""), family.type, labels,
                     family.documentation))
    return rows


def _families(module_name: str) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(exposed name, type, labels, help) of the families `module_name` defines."""
    import importlib

    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    if module_name == "exitplane.kit.build":
        from exitplane.kit.build import register_process_metrics

        registry = CollectorRegistry()
        register_process_metrics(registry)
        collectors = list(registry._collector_to_names)
    elif module_name == "runtime.server_metrics":
        from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

        from runtime.server_metrics import ServeMetrics

        everywhere = (GCCollector, PlatformCollector, ProcessCollector)  # listed once above
        registry = ServeMetrics(num_layers=1).registry
        collectors = [c for c in registry._collector_to_names
                      if not isinstance(c, everywhere)
                      and getattr(c, "_name", None) != "exitplane_build_info"]
    elif module_name == "controlplane.telemetry.gauges":
        from controlplane.telemetry.gauges import store_collector

        collectors = [store_collector]
    else:
        module = importlib.import_module(module_name)
        collectors = [value for value in vars(module).values()
                      if isinstance(value, MetricWrapperBase)]
    return [row for collector in collectors for row in _described(collector)]


def metric_families() -> list[tuple[str, str, tuple[str, ...], str, str]]:
    """(name, type, labels, help, processes) for every family, by name."""
    rows = [(name, kind, labels, doc, processes)
            for module_name, processes in METRIC_SOURCES
            for name, kind, labels, doc in _families(module_name)]
    return sorted(rows)


def metrics_reference() -> str:
    lines = ["| family | type | labels | exported by | meaning |", "|---|---|---|---|---|"]
    for name, kind, labels, doc, processes in metric_families():
        label_text = ", ".join(f"`{label}`" for label in labels)
        lines.append(f"| `{name}` | {kind} | {label_text} | {processes} | {_cell(doc)} |")
    return "\n".join(lines)


# -- the hook --------------------------------------------------------------------------------

GENERATORS = {
    "configuration": configuration_reference,
    "cli": cli_reference,
    "http-api": http_api_reference,
    "metrics": metrics_reference,
    "runtime-server": runtime_server_reference,
}


def render(markdown: str) -> str:
    """`markdown` with every generated-section marker replaced by its table."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated section {name!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs hook
    return render(markdown)
