"""Operator commands for the people who sign in to the admin UI, over the HTTP API (an admin
token): list, show, create, update (role, password), disable, enable."""

from __future__ import annotations

from pathlib import Path

import click

from exitplane.ops.api import ControlPlane, fail, operator_command, part
from exitplane.ops.render import emit, record, table

ROLES = ("viewer", "operator", "admin")
ROLE_HELP = "viewers read, operators act, admins manage"


def read_password(password_file: str | None, *, prompt: str = "password") -> str:
    """A new password: the first line of `password_file`, else typed twice at a prompt."""
    if password_file:
        try:
            return Path(password_file).read_text().rstrip("\r\n")
        except OSError as error:
            fail(f"cannot read the password file {password_file}: {error.strerror or error}")
    try:
        return click.prompt(prompt, hide_input=True, confirmation_prompt=True, err=True)
    except click.Abort:
        fail("no password given (--password-file FILE, or type it at the prompt)")


PASSWORD_FILE = click.option(
    "--password-file", type=click.Path(dir_okay=False), default=None,
    help="read the password from this file (default: prompt)")


@click.group()
def users() -> None:
    """People who sign in to the admin UI (/ui), over the API (an admin token): list, show,
    create, update, disable, enable."""


def _path(username: str) -> str:
    return f"/v1/users/{part(username)}"


USER_COLUMNS = [("USERNAME", "username"), ("ROLE", "role"), ("DISABLED", "disabled"),
                ("CREATED", "created_at"), ("LAST SIGN-IN", "last_login_at")]


@operator_command(users, "list")
def users_list(api: ControlPlane) -> None:
    """Every user: role, disabled or not, last sign-in."""
    found = api.get("/v1/users")
    emit(api.output, found, lambda: table(found, USER_COLUMNS))


@operator_command(users, "show")
@click.argument("username")
def users_show(api: ControlPlane, username: str) -> None:
    """User USERNAME."""
    found = api.get(_path(username))
    emit(api.output, found, lambda: record(found, [(key.lower(), field)
                                                   for key, field in USER_COLUMNS]))


def _line(user: dict, what: str) -> str:
    return (f"user {user['username']} {what} (role {user['role']}"
            + (", disabled)" if user["disabled"] else ")"))


@operator_command(users, "create")
@click.argument("username")
@click.option("--role", type=click.Choice(ROLES), required=True, help=ROLE_HELP)
@PASSWORD_FILE
def users_create(api: ControlPlane, username: str, role: str,
                 password_file: str | None) -> None:
    """Create user USERNAME with a role and a password."""
    password = read_password(password_file)
    made = api.request("POST", "/v1/users",
                       json={"username": username, "role": role, "password": password})
    emit(api.output, made, lambda: click.echo(_line(made, "created")))


@operator_command(users, "update")
@click.argument("username")
@click.option("--role", type=click.Choice(ROLES), default=None, help=ROLE_HELP)
@click.option("--password", "new_password", is_flag=True,
              help="set a new password (typed at a prompt, or --password-file)")
@PASSWORD_FILE
def users_update(api: ControlPlane, username: str, role: str | None, new_password: bool,
                 password_file: str | None) -> None:
    """Change USERNAME's role or password; either ends the user's sessions. The last enabled
    admin cannot be demoted."""
    changes: dict = {"role": role} if role else {}
    if new_password or password_file:
        changes["password"] = read_password(password_file, prompt="new password")
    if not changes:
        fail("give --role ROLE, --password or --password-file FILE")
    found = api.request("PATCH", _path(username), json=changes)
    emit(api.output, found, lambda: click.echo(_line(found, "updated")))


def _set_disabled(api: ControlPlane, username: str, disabled: bool) -> None:
    found = api.request("PATCH", _path(username), json={"disabled": disabled})
    emit(api.output, found, lambda: click.echo(
        _line(found, "disabled" if disabled else "enabled")))


@operator_command(users, "disable")
@click.argument("username")
def users_disable(api: ControlPlane, username: str) -> None:
    """Refuse USERNAME's sign-ins and end their sessions (not the last enabled admin)."""
    _set_disabled(api, username, True)


@operator_command(users, "enable")
@click.argument("username")
def users_enable(api: ControlPlane, username: str) -> None:
    """Let USERNAME sign in again."""
    _set_disabled(api, username, False)
