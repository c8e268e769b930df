"""UI users: argon2 hashes, roles, the last admin, session epochs, and `exitplane user create`."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from sqlalchemy.orm import Session

from controlplane.auth import users
from controlplane.errors import Conflict, Invalid, Unauthorized

PASSWORD = "a sufficiently long one"


def test_passwords_are_hashed_and_checked(session: Session):
    user = users.create_user(session=session, username="Ana", password=PASSWORD, role="operator")
    assert user.username == "ana"
    assert user.password_hash.startswith("$argon2id$") and PASSWORD not in user.password_hash
    assert users.authenticate_user(session=session, username="ANA", password=PASSWORD) is user
    assert user.last_login_at is not None
    for name, password in (("ana", "wrong password!!"), ("nobody", PASSWORD)):
        with pytest.raises(Unauthorized, match="wrong username or password"):
            users.authenticate_user(session=session, username=name, password=password)


def test_bad_input_is_refused(session: Session):
    with pytest.raises(Invalid, match="at least 12"):
        users.create_user(session=session, username="bo", password="short", role="viewer")
    with pytest.raises(Invalid, match="unknown role"):
        users.create_user(session=session, username="bo", password=PASSWORD, role="root")
    with pytest.raises(Invalid, match="usernames are"):
        users.create_user(session=session, username="-bo", password=PASSWORD, role="viewer")
    users.create_user(session=session, username="bo", password=PASSWORD, role="viewer")
    with pytest.raises(Conflict, match="already exists"):
        users.create_user(session=session, username="BO", password=PASSWORD, role="viewer")


@pytest.mark.slow
def test_changes_end_sessions_and_the_last_admin_stays(session: Session):
    admin = users.create_user(session=session, username="root", password=PASSWORD, role="admin")
    with pytest.raises(Conflict, match="last enabled admin"):
        users.set_role(session=session, user=admin, role="operator")
    with pytest.raises(Conflict, match="last enabled admin"):
        users.set_disabled(session=session, user=admin, disabled=True)
    other = users.create_user(session=session, username="cy", password=PASSWORD, role="viewer")
    epoch = other.session_epoch
    users.set_role(session=session, user=other, role="admin")
    users.set_password(session=session, user=other,
                       password_hash=users.new_password_hash(PASSWORD + "!"))
    users.set_disabled(session=session, user=other, disabled=True)
    assert other.session_epoch == epoch + 3
    with pytest.raises(Unauthorized):
        users.authenticate_user(session=session, username="cy", password=PASSWORD + "!")
    assert users.has_role(admin, "operator") and users.has_role(other, "viewer")
    viewer = users.create_user(session=session, username="dee", password=PASSWORD,
                               role="viewer")
    assert not users.has_role(viewer, "operator")


def test_cli_creates_a_user_from_a_password_file(db_url, engine, tmp_path, monkeypatch):
    from controlplane.settings import get_settings
    from exitplane.cli import main

    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    monkeypatch.setenv("EXITPLANE_DATABASE_URL", db_url)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(main, ["user", "create", "--username", "ops",
                                           "--role", "operator", "--password-file", str(secret)])
        again = CliRunner().invoke(main, ["user", "create", "--username", "ops",
                                          "--role", "operator", "--password-file", str(secret)])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    assert "user 'ops' created with role operator" in result.output
    assert again.exit_code == 2 and "already exists" in again.output
    with Session(engine) as session:
        user = users.authenticate_user(session=session, username="ops", password=PASSWORD)
        assert user.role == "operator"


@pytest.mark.slow
def test_own_password_change_needs_the_current_one(session: Session):
    user = users.create_user(session=session, username="fay", password=PASSWORD, role="viewer")
    epoch = user.session_epoch
    with pytest.raises(Unauthorized, match="current password is wrong"):
        users.change_own_password(session=session, user=user, current="nope nope nope",
                                  new=PASSWORD + "!")
    with pytest.raises(Invalid, match="same as the current"):
        users.change_own_password(session=session, user=user, current=PASSWORD, new=PASSWORD)
    users.change_own_password(session=session, user=user, current=PASSWORD, new=PASSWORD + "!")
    assert user.session_epoch == epoch + 1
    assert users.authenticate_user(session=session, username="fay",
                                   password=PASSWORD + "!") is user
