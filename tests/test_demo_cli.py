"""`exitplane demo`'s command line: a port something already listens on is refused instead of
talked to; stories and throttles it does not know are usage errors."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXITPLANE = str(Path(sys.executable).parent / "exitplane")


@pytest.mark.slow  # runs the CLI's process
def test_demo_refuses_a_busy_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([EXITPLANE, "demo", "--quick", "--no-serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "EXITPLANE_VAR_DIR": str(tmp_path)})
    assert done.returncode == 1
    assert f"port {port} is already in use" in done.stderr and "--port" in done.stderr
    assert not (tmp_path / "demo").exists()  # nothing was set up


def test_segments_story_flag_reaches_the_demo(tmp_path):
    """`--story segments` parses and runs the same guarded setup (a busy port is refused)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([EXITPLANE, "demo", "--story", "segments", "--quick", "--no-serve",
                               "--port", str(port)], capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "EXITPLANE_VAR_DIR": str(tmp_path)})
    assert done.returncode == 1
    assert f"port {port} is already in use" in done.stderr
    assert not (tmp_path / "demo").exists()


def test_unknown_story_is_a_usage_error(tmp_path):
    done = subprocess.run([EXITPLANE, "demo", "--story", "bogus", "--no-serve"],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "EXITPLANE_VAR_DIR": str(tmp_path)})
    assert done.returncode == 2
    assert "bogus" in done.stderr and "segments" in done.stderr
    assert not (tmp_path / "demo").exists()


def test_throttle_below_one_is_a_usage_error(tmp_path):
    done = subprocess.run([EXITPLANE, "demo", "--throttle", "0.5", "--no-serve"],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "EXITPLANE_VAR_DIR": str(tmp_path)})
    assert done.returncode == 2
    assert "--throttle" in done.stderr and "0.5" in done.stderr
    assert not (tmp_path / "demo").exists()
