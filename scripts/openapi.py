"""Write the control plane's OpenAPI document to docs/openapi.json (or check it is current).

    python scripts/openapi.py           # regenerate docs/openapi.json
    python scripts/openapi.py --check   # exit 1 when the committed document drifted from the app

The document is what FastAPI serves at /openapi.json, with sorted keys, so a diff shows what
changed in the protocol; tests/test_openapi.py fails when it drifts from the app.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENT = ROOT / "docs" / "openapi.json"


def document() -> str:
    """The app's OpenAPI document as committed: sorted keys, two-space indent, final newline."""
    sys.path.insert(0, str(ROOT))
    from controlplane.db import make_engine
    from controlplane.settings import Settings
    from exitplane.app import create_app

    with tempfile.TemporaryDirectory() as var_dir:
        settings = Settings(database_url="sqlite://", var_dir=var_dir)
        engine = make_engine("sqlite://")  # never queried: the schema needs no store
        app = create_app(settings, engine=engine)
        try:
            schema = app.openapi()
        finally:
            app.state.config_delivery.close()
            engine.dispose()
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    current = document()
    if "--check" in argv:
        if not DOCUMENT.exists() or DOCUMENT.read_text() != current:
            print(f"{DOCUMENT.relative_to(ROOT)} is out of date: run python scripts/openapi.py",
                  file=sys.stderr)
            return 1
        return 0
    DOCUMENT.write_text(current)
    print(f"wrote {DOCUMENT.relative_to(ROOT)} ({len(current):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
