"""The configuration reference (docs/reference/configuration.md) is generated from the Settings
fields when the site is built: it names every setting, each with a description, and nothing
else. A setting added to controlplane/settings.py without a description fails here."""

import importlib.util
from pathlib import Path

from controlplane.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "configuration.md"


def _reference():
    spec = importlib.util.spec_from_file_location("docs_reference",
                                                  ROOT / "scripts" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_has_a_description():
    undescribed = [f"EXITPLANE_{name.upper()}" for name, field in Settings.model_fields.items()
                   if not (field.description or "").strip()]
    assert undescribed == [], "settings without a description (Field(description=...))"


def test_the_generated_reference_lists_exactly_the_settings():
    rendered = _reference().render(PAGE.read_text())
    assert "<!-- generated:" not in rendered
    rows = [line for line in rendered.splitlines() if line.startswith("| `EXITPLANE_")]
    documented = [row.split("`")[1] for row in rows]
    settings = [f"EXITPLANE_{name.upper()}" for name in Settings.model_fields]
    assert documented == settings
    for row, (name, field) in zip(rows, Settings.model_fields.items(), strict=True):
        assert " ".join(field.description.split()) in row.replace("\\|", "|"), name


def test_a_field_without_a_description_would_be_found():
    from pydantic import Field
    from pydantic_settings import BaseSettings

    class Sloppy(BaseSettings):
        documented: int = Field(default=1, description="what it does")
        forgotten: int = 2

    assert [n for n, f in Sloppy.model_fields.items() if not f.description] == ["forgotten"]
