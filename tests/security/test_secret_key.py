"""No forgeable UI session. A real `exitplane up` never signs with a constant:
without EXITPLANE_SECRET_KEY it generates a key under the var dir (mode 0600) and keeps it
across restarts; on a non-loopback address a short key refuses to start with one line."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import stat
import subprocess
import sys
import time

import pytest

from controlplane.keys import weak_secret_problem
from controlplane.settings import Settings
from tests.support.network import free_port
from tests.support.processes import ROOT, ExitplaneUp, run_cli, shipped_env

OLD_CONSTANT = "exitplane-embedded-default-secret"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _session_cookie(secret: str, user_id: int = 1) -> str:
    """What an attacker who knows `secret` sends: a session for user `user_id`, signed the
    way dashboards/security.py signs one."""
    key = hmac.new(secret.encode(), b"exitplane-ui:session", hashlib.sha256).digest()
    body = _b64(json.dumps({"c": secrets.token_urlsafe(32), "t": time.time(), "u": user_id,
                            "e": 0}, separators=(",", ":")).encode())
    mac = hmac.new(key, body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


@pytest.mark.slow
def test_a_cookie_signed_with_the_old_constant_is_refused_and_the_key_survives_restart(
        tmp_path):
    var_dir = tmp_path / "var"
    env = shipped_env(var_dir)
    assert run_cli(["db", "upgrade"], env).returncode == 0
    password_file = tmp_path / "password"
    password_file.write_text(secrets.token_urlsafe(16) + "\n")
    made = run_cli(["user", "create", "--username", "root", "--role", "admin",
                    "--password-file", str(password_file)], env)
    assert made.returncode == 0, made.stderr

    up = ExitplaneUp(env, tmp_path / "up.log")
    try:
        forged = up.page(_session_cookie(OLD_CONSTANT))
        assert forged.status_code == 303 and "/ui/login" in forged.headers["location"]
        key_file = var_dir / "secret_key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        assert len(key) >= 32 and key != OLD_CONSTANT
        # The generated key is the one that signs: a cookie made with it is a session.
        assert up.page(_session_cookie(key)).status_code == 200
    finally:
        up.stop()

    again = ExitplaneUp(env, tmp_path / "up-again.log")
    try:
        assert key_file.read_text().strip() == key
        assert again.page(_session_cookie(key)).status_code == 200
        assert again.page(_session_cookie(OLD_CONSTANT)).status_code == 303
    finally:
        again.stop()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


@pytest.mark.slow  # runs the CLI's process
def test_a_short_secret_on_a_public_address_refuses_to_start(tmp_path):
    refused = run_cli(["up", "--no-workers", "--host", "0.0.0.0", "--port", str(free_port())],
                      shipped_env(tmp_path / "var", EXITPLANE_SECRET_KEY="too-short"))
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "EXITPLANE_SECRET_KEY" in lines[0] and "secrets.token_urlsafe" in lines[0]
    assert "too-short" not in refused.stderr
    assert not (tmp_path / "var" / "exitplane.db").exists()  # refused before touching the store


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_or_a_generated_key_may_listen(tmp_path, host):
    short = Settings(var_dir=tmp_path / "short", secret_key="too-short")
    assert weak_secret_problem(short, host) is None
    assert "EXITPLANE_SECRET_KEY" in weak_secret_problem(short, "0.0.0.0")
    generated = Settings(var_dir=tmp_path / "generated", secret_key="")
    assert weak_secret_problem(generated, "0.0.0.0") is None
    assert (tmp_path / "generated" / "secret_key").exists()


def test_the_app_factory_refuses_a_short_key_on_a_public_host(tmp_path):
    from exitplane.app import create_app

    with pytest.raises(RuntimeError, match="EXITPLANE_SECRET_KEY"):
        create_app(Settings(var_dir=tmp_path / "var", secret_key="too-short", host="0.0.0.0",
                            database_url=f"sqlite:///{tmp_path / 'x.db'}"))


def test_no_constant_in_the_code_signs():
    import controlplane.settings

    assert not hasattr(controlplane.settings, "DEFAULT_SECRET")
    assert Settings.model_fields["secret_key"].default == ""


@pytest.mark.slow  # six Python processes
def test_processes_starting_together_share_one_generated_key(tmp_path):
    """API, worker and beat start at once on a fresh var dir: one key wins, all read it."""
    var_dir = tmp_path / "var"
    script = ("from controlplane.keys import secret_key\n"
              "from controlplane.settings import Settings\n"
              "print(secret_key(Settings()))")
    processes = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT,
                                  env=shipped_env(var_dir), stdout=subprocess.PIPE, text=True)
                 for _ in range(6)]
    keys = {process.communicate(timeout=60)[0].strip() for process in processes}
    assert all(process.returncode == 0 for process in processes)
    assert keys == {(var_dir / "secret_key").read_text().strip()}
    assert stat.S_IMODE((var_dir / "secret_key").stat().st_mode) == 0o600
    assert [path.name for path in var_dir.iterdir()] == ["secret_key"]  # no temporary left


# -- entropy, not only length ---------------------------------------------------------------

PATTERNED = ["a" * 32, "a" * 64, "password" * 4, "abcdefghijklmnopqrstuvwxyz012345",
             "0123456789" * 4, ("abcd" + "1234") * 4, "ab" * 24, "Password123!" * 3,
             "a" * 31 + "b", "changeme" * 5]


@pytest.mark.parametrize("secret", PATTERNED)
def test_a_long_key_without_entropy_is_refused_in_production(secret):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        Settings(environment="production", secret_key=secret)
    message = str(refused.value)
    assert "EXITPLANE_SECRET_KEY is not random" in message and "secrets.token_urlsafe" in message
    assert secret not in message


@pytest.mark.parametrize("secret", PATTERNED[:3])
def test_a_long_key_without_entropy_may_not_listen_off_loopback(tmp_path, secret):
    settings = Settings(var_dir=tmp_path / "var", secret_key=secret)
    problem = weak_secret_problem(settings, "0.0.0.0")
    assert problem and "is not random" in problem and "0.0.0.0" in problem
    assert secret not in problem
    assert weak_secret_problem(settings, "127.0.0.1") is None


def test_generated_and_test_keys_have_entropy_enough(tmp_path):
    from controlplane.keys import MIN_SECRET_BITS, estimated_bits, secret_key

    # What the docs, the compose file and the test suites generate, many times over.
    for _ in range(2000):
        for made in (secrets.token_urlsafe(48), secrets.token_urlsafe(24), secrets.token_hex(16),
                     secrets.token_hex(32), f"sk{secrets.token_hex(12)}" * 2):
            assert estimated_bits(made) >= MIN_SECRET_BITS, made
    for index in range(20):
        generated = Settings(var_dir=tmp_path / f"var{index}", secret_key="")
        assert weak_secret_problem(generated, "0.0.0.0") is None
        assert estimated_bits(secret_key(generated)) > 200
    # The test session's key (tests/conftest.py), as every process it starts reads it.
    assert Settings(environment="production").secret_key == os.environ["EXITPLANE_SECRET_KEY"]


@pytest.mark.slow  # runs the CLI's process
def test_exitplane_up_refuses_a_patterned_key_off_loopback_in_one_line(tmp_path):
    refused = run_cli(["up", "--no-workers", "--host", "0.0.0.0", "--port", str(free_port())],
                      shipped_env(tmp_path / "var", EXITPLANE_SECRET_KEY="a" * 32))
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "EXITPLANE_SECRET_KEY is not random" in lines[0] and "a" * 32 not in lines[0]
    assert not (tmp_path / "var" / "exitplane.db").exists()
