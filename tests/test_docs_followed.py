"""The documentation works when followed: the generated CLI and runtime-server references show
every `<placeholder>` their help texts hold once mkdocs renders them, shell examples quote URLs
that zsh would glob (`?`) or a shell would split (`&`), and the getting-started pages do not
create the same deployment or token twice."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import markdown
import pytest
from alembic.config import Config
from alembic.script import ScriptDirectory
from mkdocs.config import load_config

from scripts import docs_reference

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"<[A-Za-z][^<>]*>")
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell|console|zsh)?\n(.*?)```", flags=re.S)
# a URL (literal, or a $VARIABLE/path) holding `?` or `&`
URL = re.compile(r"(?:https?://|\$\{?\w+\}?/)[^\s\"']*[?&][^\s\"']*")


class _Visible(HTMLParser):
    """The text a browser shows for an HTML fragment (entities decoded, tags dropped)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def _rendered_text(page_markdown: str) -> str:
    """`page_markdown` as the site renders it (mkdocs.yml's Markdown extensions), as shown."""
    config = load_config(str(ROOT / "mkdocs.yml"))
    html = markdown.markdown(page_markdown, extensions=config["markdown_extensions"],
                             extension_configs=config["mdx_configs"])
    visible = _Visible()
    visible.feed(html)
    return " ".join("".join(visible.parts).split())


def _help_texts(path: list[str]) -> list[str]:
    """Every help text of the `exitplane` command at `path` (e.g. ["runtime", "serve"]) and of
    the commands and options under it, one line each."""
    import click

    from exitplane.cli import main

    found: list[str] = []

    def walk(command, ctx) -> None:
        found.append((command.help or "").strip().split("\n\n")[0])
        found.extend(getattr(param, "help", None) or "" for param in command.params)
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                walk(sub, click.Context(sub, parent=ctx, info_name=name))

    command, ctx = main, click.Context(main, info_name="exitplane")
    for name in path:
        command = command.get_command(ctx, name)
        ctx = click.Context(command, parent=ctx, info_name=name)
    walk(command, ctx)
    return [" ".join(text.split()) for text in found if text]


@pytest.mark.parametrize(("page", "path"), [("cli", []), ("runtime-server", ["runtime", "serve"])])
def test_the_generated_references_show_their_placeholders(page, path):
    generated = docs_reference.GENERATORS[page]()
    shown = _rendered_text(generated)
    placeholders = {match for text in _help_texts(path) for match in PLACEHOLDER.findall(text)}
    assert {"<key>", "<host>"} <= placeholders  # what the help texts hold today
    missing = sorted(p for p in placeholders if p not in shown)
    assert missing == [], missing
    # code spans are left alone: what is inside backticks shows as written
    assert "&lt;" not in " ".join(re.findall(r"`[^`]*`", generated))


def test_text_outside_code_spans_is_escaped_and_code_spans_are_not():
    assert docs_reference._text("Bearer <key> &amp; & `a<b>` <`X`> a < b") == \
        "Bearer &lt;key> &amp;amp; & `a<b>` <`X`> a < b"
    assert docs_reference._cell("a | </b>") == "a \\| &lt;/b>"


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _unquoted_urls(text: str) -> list[str]:
    """URLs with `?` or `&` outside quotes in the shell blocks of a Markdown text."""
    found = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.splitlines():
            code = re.split(r"\s#", line)[0]
            for match in URL.finditer(code):
                before = code[:match.start()]
                if before.count('"') % 2 == 0 and before.count("'") % 2 == 0:
                    found.append(match.group(0))
    return found


def test_shell_examples_quote_urls_with_query_strings():
    found = {path.relative_to(ROOT).as_posix(): _unquoted_urls(path.read_text())
             for path in _documents()}
    assert {name: urls for name, urls in found.items() if urls} == {}
    # the check sees an unquoted one
    assert _unquoted_urls("```bash\ncurl -s http://h/x?a=1 -H 'y'\n```\n") == ["http://h/x?a=1"]
    assert _unquoted_urls("```bash\ncurl -s \"$API/x?a=1&b=2\"\n```\n") == []


def _created(text: str) -> dict[str, set[str]]:
    """The deployments and token names a page's shell blocks create."""
    shell = "\n".join(SHELL_BLOCK.findall(text)).replace("\\\n", " ")
    deployments = set(re.findall(
        r"(?:deployment ensure|bootstrap deployment) --name (\S+)", shell))
    deployments |= set(re.findall(r"/v1/deployments -H .*?\"name\": \"([^\"]+)\"", shell))
    tokens = set(re.findall(r"(?:token create|bootstrap token) --name (\S+)", shell))
    tokens |= set(re.findall(r"/v1/tokens -H .*?\"name\": \"([^\"]+)\"", shell))
    return {"deployments": deployments, "tokens": tokens}


def test_the_getting_started_pages_can_be_followed_one_after_the_other():
    pages = sorted((ROOT / "docs" / "getting-started").glob("*.md"))
    created = {page.name: _created(page.read_text()) for page in pages}
    assert created["index.md"]["deployments"] == {"chat"}
    assert created["api-by-example.md"]["deployments"]
    for kind in ("deployments", "tokens"):
        seen: dict[str, str] = {}
        for page, made in created.items():
            for name in made[kind]:
                assert name not in seen, f"{page} and {seen[name]} both create {kind} {name}"
                seen[name] = page


def test_the_operator_guide_shows_the_head_migration():
    """The `db current` example names the newest migration, as a store at head answers."""
    root = Path(__file__).resolve().parents[1]
    config = Config()
    config.set_main_option("script_location", str(root / "migrations"))
    head = ScriptDirectory.from_config(config).get_current_head()
    guide = (root / "docs" / "guides" / "operator-cli.md").read_text()
    assert f"$ exitplane db current\n{head} (head)\n" in guide
