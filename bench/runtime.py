"""Early-exit runtime benchmark: HF generate vs our engine at full depth vs early exit.

    .venv/bin/python -P bench/runtime.py [--prompts 8] [--max-new-tokens 48] [--batch 8] \
        [--heads-post-hoc exitplane/data/demo-heads.safetensors] [--shadow-rate 0.05]

Prints tables and, as the last line, one JSON object (see runtime/benchmark.py). Here the
benchmark also fits the control plane's cost model (controlplane/stats/cost_model.py) on the
runs' own token records and prints it with the net saving of early exit against full depth.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from controlplane.stats.cost_model import fit_cost_model
from runtime.benchmark import main

if __name__ == "__main__":
    sys.exit(main(fit_cost=fit_cost_model))
