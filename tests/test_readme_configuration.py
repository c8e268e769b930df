"""The README's configuration reference names every setting, and only real ones: a setting added
to controlplane/settings.py without a row (or a row left behind by a removed one) fails here."""

import re
from pathlib import Path

from controlplane.settings import Settings

README = Path(__file__).resolve().parents[1] / "README.md"


def _configuration_section() -> str:
    text = README.read_text()
    start = text.index("\n## Configuration")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_the_configuration_table_lists_exactly_the_settings():
    rows = [line for line in _configuration_section().splitlines() if line.startswith("| `")]
    documented = {name for row in rows
                  for name in re.findall(r"`(EXITPLANE_[A-Z0-9_]+)`", row.split("|")[1])}
    settings = {f"EXITPLANE_{field.upper()}" for field in Settings.model_fields}
    assert sorted(settings - documented) == [], "settings missing from the README table"
    assert sorted(documented - settings) == [], "README rows for settings that do not exist"
