"""Early-exit runtime benchmark: HF generate vs our engine at full depth vs early exit.

    .venv/bin/python bench/runtime.py [--prompts 8] [--max-new-tokens 48] [--batch 8]

Prints tables and, as the last line, one JSON object (see runtime/benchmark.py).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from runtime.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
