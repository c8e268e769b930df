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


@pytest.mark.parametrize("quick", [True, False])
def test_demo_heads_train_by_steps_not_by_the_clock(quick):
    """The demo's exit heads must be the same on a slow machine as on a fast one: a CI box at
    ~1 s per adapter step cut the quick heads to 42 steps, they exited too rarely for the shift
    to code to hurt quality, and the loop never closed. The adapter phase always gets at least
    40% of the budget (`phase_deadline`); that must cover every step at 2.5 s a step."""
    from exitplane.demo import heads_config
    from runtime.train import phase_deadline

    config = heads_config(quick)
    slowest_step_s = 2.5
    # the worst case: text generation and the teacher pass already used the whole budget
    started, now = 0.0, config.time_budget_s
    adapter_phase_s = phase_deadline(started, now, config.time_budget_s, 0.75) - now
    assert adapter_phase_s >= config.adapter_steps * slowest_step_s
