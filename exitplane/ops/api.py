"""How an operator command reaches the control plane: its URL and token, one request, the
exit codes (0 done, 1 the control plane refused, 2 bad input or nothing answered), and the
values commands take (path segments, moments)."""

from __future__ import annotations

import functools
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote

import click
import httpx
from click.core import ParameterSource

DEFAULT_URL = "http://127.0.0.1:8000"
REFUSED = 1  # the control plane answered with an error
UNUSABLE = 2  # bad input, an unreadable file, or no control plane answered
# A read refused for the token's rate is asked again after its Retry-After, when that is at
# most READ_RETRY_MAX_S, up to READ_RETRIES times; a longer wait is reported.
READ_RETRIES = 3
READ_RETRY_MAX_S = 10.0


def fail(message: str, code: int = UNUSABLE) -> NoReturn:
    """End the command with one line on stderr."""
    click.echo(f"exitplane: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


class ControlPlane:
    """One control plane as the operator commands see it: a base URL, a bearer token and how
    answers are printed (`output`: table, json, yaml or name; `headers`: a table's header
    line)."""

    def __init__(self, *, url: str, token: str | None, output: str, timeout_s: float,
                 headers: bool = True) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            fail(f"the control plane URL {url!r} ends in /v1: give its base URL, as "
                 f"{self.url[:-3]!r}; each command adds the API's path")
        self.token = token
        self.output = output
        self.timeout_s = timeout_s
        self.headers = headers
        self.ignored: list[str] = []  # the request fields the last answer said it ignored

    def request(self, method: str, path: str, *, json: Any = None,
                params: dict | None = None) -> Any:
        """Send one request; return the answer's JSON (None when it has no body)."""
        if not self.token:
            fail("no API token: set EXITPLANE_TOKEN or EXITPLANE_TOKEN_FILE, or pass "
                 "--token-file FILE")
        query = {key: value for key, value in (params or {}).items() if value is not None}
        try:
            for attempt in range(READ_RETRIES + 1):
                answer = httpx.request(method, self.url + path, json=json, params=query,
                                       headers={"Authorization": f"Bearer {self.token}",
                                                "User-Agent": "exitplane-cli"},
                                       timeout=self.timeout_s)
                wait = _read_retry_after(method, answer)
                if wait is None or attempt == READ_RETRIES:
                    break
                time.sleep(wait)
        except httpx.TimeoutException:
            fail(f"{self.url} did not answer within {self.timeout_s:g} s")
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as error:
            fail(f"invalid control plane URL {self.url!r} ({error}); give one like "
                 f"{DEFAULT_URL}")
        except httpx.HTTPError as error:
            fail(f"cannot reach {self.url}: {_reason(error)}")
        if answer.is_error:
            fail(_refusal(answer), REFUSED)
        self.ignored = [name.strip() for name in
                        answer.headers.get("exitplane-ignored-fields", "").split(",")
                        if name.strip()]
        if self.ignored:
            click.echo(f"exitplane: warning: this control plane ignored {', '.join(self.ignored)}"
                       ": fields it does not know (a misspelt name, or one of a newer release "
                       "than the server's)", err=True)
        if not answer.content:
            return None
        try:
            return answer.json()
        except ValueError:
            fail(f"{self.url}{path} answered {answer.status_code} without JSON; is {self.url} "
                 "an exitplane control plane?")

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params)


def _read_retry_after(method: str, answer: httpx.Response) -> float | None:
    """The seconds to wait before asking again: a read refused for its token's rate (429) with
    a Retry-After of at most READ_RETRY_MAX_S; None otherwise."""
    if method != "GET" or answer.status_code != 429:
        return None
    try:
        wait = float(answer.headers.get("Retry-After", ""))
    except ValueError:
        return None
    return wait if 0 <= wait <= READ_RETRY_MAX_S else None


def part(value: str | int) -> str:
    """A path segment: a name or id, percent-encoded."""
    return quote(str(value), safe="")


def moment(value: str) -> datetime:
    """An ISO time (UTC when it has no offset) or an age like 30m, 6h, 2d before now."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if value[-1:] in units and value[:-1].replace(".", "", 1).isdigit():
        return datetime.now(UTC) - timedelta(seconds=float(value[:-1]) * units[value[-1]])
    try:
        found = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value!r} is neither an ISO time nor an age like 30m, 6h, 2d") from None
    return found if found.tzinfo else found.replace(tzinfo=UTC)


def _reason(error: httpx.HTTPError) -> str:
    """`[Errno 111] Connection refused` -> `connection refused`."""
    text = str(error) or type(error).__name__
    if text.startswith("[Errno") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:1].lower() + text[1:]


def _refusal(answer: httpx.Response) -> str:
    """The control plane's own message for an error answer, with its status."""
    try:
        body = answer.json()
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if not isinstance(detail, str) or not detail:
        return (f"{answer.request.url.copy_with(query=None)} answered "
                f"{answer.status_code} {answer.reason_phrase}")
    if answer.status_code == 401:
        detail += " (check EXITPLANE_TOKEN / --token-file)"
    return f"{detail} (HTTP {answer.status_code})"


def _token(token_file: str | None) -> str | None:
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as error:
            fail(f"cannot read the token file {token_file}: {error.strerror or error}")
        if not token:
            fail(f"the token file {token_file} is empty")
        return token
    return os.environ.get("EXITPLANE_TOKEN") or None


OUTPUTS = ("table", "json", "yaml", "name")
# Where a group's (or the root's) connection options leave what the command line gave them,
# for the command below to take (click shares a context's `meta` with its children).
GIVEN = "exitplane.connection"
HEADERS = "exitplane.headers"  # False: tables print without their header line (--no-headers)
_HELP = {
    "url": "the control plane's base URL (env: EXITPLANE_URL)",
    "token_file": "read the API token from this file (env: EXITPLANE_TOKEN_FILE; default: the "
                  "EXITPLANE_TOKEN variable)",
    "output": "table for people; json or yaml (the API's own objects) for scripts; name: one "
              "identifier per line (env: EXITPLANE_OUTPUT)",
    "no_headers": "print tables without their header line",
    "timeout_s": "seconds to wait for the control plane",
}


def _connection_options() -> list[click.Option]:
    """Fresh --url, --token-file, --output, --no-headers and --timeout options of a command
    (click lists a command's options in reverse order of this list)."""
    return [
        click.Option(["--timeout", "timeout_s"], type=click.FloatRange(min=0.1), default=30.0,
                     show_default=True, help=_HELP["timeout_s"]),
        click.Option(["--no-headers"], is_flag=True, default=False, help=_HELP["no_headers"]),
        click.Option(["--output", "-o"], envvar="EXITPLANE_OUTPUT", default="table",
                     show_default=True, type=click.Choice(OUTPUTS), help=_HELP["output"]),
        click.Option(["--token-file"], envvar="EXITPLANE_TOKEN_FILE", default=None,
                     type=click.Path(dir_okay=False), help=_HELP["token_file"]),
        click.Option(["--url"], envvar="EXITPLANE_URL", default=DEFAULT_URL, show_default=True,
                     help=_HELP["url"]),
    ]


def _given(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Keep a group's connection option, when the command line gave it, for the commands
    below (a later group's replaces an earlier one's)."""
    if value is not None and value is not False and \
            ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE:
        ctx.meta.setdefault(GIVEN, {})[param.name] = value
    return value


def group_connection_options() -> list[click.Option]:
    """The connection options as a group (or the root command) takes them, before its
    command's name: `exitplane --url URL deployments list`. The command's own option, given
    after its name, wins; then the nearest group's; then the environment."""
    return [
        click.Option(["--url"], default=None, expose_value=False, callback=_given,
                     help=f"{_HELP['url']}, for the API commands below"),
        click.Option(["--token-file"], default=None, type=click.Path(dir_okay=False),
                     expose_value=False, callback=_given,
                     help=f"{_HELP['token_file']}, for the API commands below"),
        click.Option(["--output", "-o"], default=None, type=click.Choice(OUTPUTS),
                     expose_value=False, callback=_given,
                     help=f"{_HELP['output']}, for the API commands below"),
        click.Option(["--no-headers"], is_flag=True, default=False, expose_value=False,
                     callback=_given, help=f"{_HELP['no_headers']}, for the API commands below"),
        click.Option(["--timeout", "timeout_s"], type=click.FloatRange(min=0.1), default=None,
                     expose_value=False, callback=_given,
                     help=f"{_HELP['timeout_s']}, for the API commands below"),
    ]


def _connection(ctx: click.Context, given: dict[str, Any]) -> dict[str, Any]:
    """The command's connection values: its own command-line options first, then a group's
    (GIVEN), then the environment and defaults."""
    above = ctx.meta.get(GIVEN, {})
    return {name: value if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
            or name not in above else above[name] for name, value in given.items()}


def operator_command(group: click.Group | None, name: str, **attrs: Any):
    """A command of `group` (None: a command of its own) that talks to the control plane:
    after its own options it gets --url, --token-file, --output, --no-headers and --timeout
    (also accepted before the command's name, on its group or the root), and its function
    receives the ControlPlane as `api`."""

    def decorate(function):
        @functools.wraps(function)
        def command(url: str, token_file: str | None, output: str, no_headers: bool,
                    timeout_s: float, **kwargs: Any):
            chosen = _connection(click.get_current_context(), {
                "url": url, "token_file": token_file, "output": output,
                "no_headers": no_headers, "timeout_s": timeout_s})
            click.get_current_context().meta[HEADERS] = not chosen["no_headers"]
            api = ControlPlane(url=chosen["url"], token=_token(chosen["token_file"]),
                               output=chosen["output"], timeout_s=chosen["timeout_s"],
                               headers=not chosen["no_headers"])
            return function(api=api, **kwargs)

        command.__click_params__ = [*_connection_options(),
                                    *getattr(function, "__click_params__", [])]
        return (group.command if group else click.command)(name, **attrs)(command)

    return decorate


_NEW_TOKEN_OPTIONS = (
    click.option("--name", required=True, help="who or what holds the token"),
    click.option("--scope", type=click.Choice(["runtime", "operator", "admin"]), required=True,
                 help="runtime: pull thresholds and ship telemetry; operator: act; "
                      "admin: manage"),
    click.option("--deployment", default=None, help="the deployment a runtime token serves"),
    click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None,
                 help="write the secret to this file (mode 600) instead of printing it"),
)


def new_token_options(command):
    """--name, --scope, --deployment and --out of a command that creates a token (over the
    API, or in the database directly)."""
    for option in reversed(_NEW_TOKEN_OPTIONS):
        command = option(command)
    return command


def write_token_file(out_file: str, secret: str) -> None:
    """Write a token's secret to `out_file`, mode 600, whole or not at all."""
    path = Path(out_file)
    partial = path.with_name(path.name + ".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secret + "\n")
        partial.replace(path)  # never a half-written token for a runtime to read
    except OSError as error:
        partial.unlink(missing_ok=True)
        fail(f"cannot write the token file {out_file}: {error.strerror or error}")
