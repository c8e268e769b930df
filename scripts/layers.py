"""Check the import-linter contracts: the product's layers (`.importlinter`) and the client's
independence (`clients/python/.importlinter`).

    python -m scripts.layers        # exit 0: every contract kept; 1: one is broken

The client is checked on its own tree: `exitplane` there is the client distribution's namespace
package, so the server's `exitplane/` must not be on the path (site-packages `.pth` files add
it; `-S` keeps them unread while site-packages stays importable).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients" / "python"
LINT = ("import sys, importlinter.cli as cli; "
        "sys.exit(cli.lint_imports(config_filename=sys.argv[1]))")


def check_product() -> int:
    """The product's contracts, on this checkout."""
    return subprocess.call([sys.executable, "-c", LINT, str(ROOT / ".importlinter")], cwd=ROOT)


def check_client(client: Path = CLIENT) -> int:
    """The client's contract, on `client` (a copy of clients/python for the contract's test)."""
    paths = [str(client / "src"), *dict.fromkeys(
        sysconfig.get_paths()[key] for key in ("purelib", "platlib"))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.call([sys.executable, "-S", "-c", LINT, str(client / ".importlinter")],
                           cwd=client, env=env)


def main() -> int:
    """Both checks; the exit status says whether every contract is kept."""
    results = [check_product(), check_client()]
    return 1 if any(results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
