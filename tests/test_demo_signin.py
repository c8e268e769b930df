"""The demo leaves a ready UI sign-in: a user whose generated password sits in a 0600 file
under the demo's var dir, and that user can sign in to the UI."""

import os
import stat

import pytest
from fastapi.testclient import TestClient

from controlplane.settings import Settings
from exitplane.app import create_app
from exitplane.demo import (
    ADMIN_TOKEN_FILE,
    UI_PASSWORD_FILE,
    UI_USERNAME,
    ControlPlane,
    write_password_file,
)
from tests.support.people import sign_in


def test_the_password_file_is_created_owner_only(tmp_path):
    path = tmp_path / "ui-password"
    permissive = os.umask(0)  # nothing masked: the mode comes from the demo alone
    try:
        password = write_password_file(path)
    finally:
        os.umask(permissive)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == password + "\n"
    assert len(password) >= 12
    again = write_password_file(path)  # a second demo run writes a new one
    assert again != password and stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.slow  # runs `exitplane db upgrade` and `exitplane user create`
def test_the_demo_user_signs_in_to_the_ui(tmp_path):
    env = {**os.environ, "EXITPLANE_VAR_DIR": str(tmp_path)}
    env.pop("EXITPLANE_DATABASE_URL", None)
    cp = ControlPlane(tmp_path, 8000, env)
    cp.cli("db", "upgrade")
    permissive = os.umask(0)  # nothing masked: the modes come from the demo alone
    try:
        admin = cp.create_admin_token()
        created = cp.create_sign_in()
    finally:
        os.umask(permissive)
    token_file = tmp_path / ADMIN_TOKEN_FILE
    assert token_file.read_text() == admin + "\n"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert created.username == UI_USERNAME
    assert created.password_file == tmp_path / UI_PASSWORD_FILE
    assert stat.S_IMODE(created.password_file.stat().st_mode) == 0o600
    told = created.describe(running=True)
    assert "http://127.0.0.1:8000/ui" in told and UI_USERNAME in told
    assert str(created.password_file) in told
    assert password_not_in(told, created.password_file)
    assert f"EXITPLANE_VAR_DIR={tmp_path} exitplane up --port 8000" in created.describe(
        running=False)

    settings = Settings(var_dir=tmp_path,
                        database_url=f"sqlite:///{tmp_path / 'exitplane.db'}")
    app = create_app(settings)
    try:
        with TestClient(app, base_url="https://testserver") as ui:
            refused = sign_in(ui, UI_USERNAME, "not the password at all")
            assert refused.status_code == 401
            password = created.password_file.read_text().rstrip("\n")
            signed = sign_in(ui, UI_USERNAME, password)
            assert signed.status_code == 200, signed.text
            assert UI_USERNAME in ui.get("/ui/account").text
    finally:
        app.state.config_delivery.close()
        app.state.heartbeats.close()


def password_not_in(text: str, path) -> bool:
    """The printed sign-in names the file, never the password itself."""
    return path.read_text().strip() not in text
