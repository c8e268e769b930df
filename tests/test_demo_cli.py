"""`exitplane demo` refuses a port something already listens on, instead of talking to it."""

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
