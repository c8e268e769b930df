"""What the worker process does as it starts (Celery's worker_init)."""

import subprocess
import sys
from pathlib import Path


def test_the_worker_loads_its_distribution_tests_before_its_first_task():
    """Evidently is imported at worker_init (in a process of its own here, as `exitplane
    worker` is): the first drift check does not pay for it, and beat and the API never do."""
    code = ("import sys; from celery import signals; import workers.app; "
            "assert 'evidently' not in sys.modules; "
            "signals.worker_init.send(sender=None); "
            "print('evidently' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
