"""docs/config.md's key table is the one generated from the config models: a key added, renamed or
left without a description fails here until `python3 -m faircast_ds.config.keys --update docs/config.md`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from faircast_ds.config.section import FairCastConfig
from faircast_ds.config import keys as config_docs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "config.md"


def _models(model: type[BaseModel]):
    yield model
    for info in model.model_fields.values():
        sub = config_docs._submodel(info.annotation)
        if sub is not None:
            yield from _models(sub)


def test_docs_table_is_the_generated_one():
    documented = config_docs.between_markers(DOCS.read_text(encoding="utf-8"))
    assert documented == config_docs.key_table(), (
        "docs/config.md's key table differs from the config models; regenerate it with "
        "`python3 -m faircast_ds.config.keys --update docs/config.md`")


def test_every_key_has_a_row_and_a_description():
    table = config_docs.key_table()
    for model in _models(FairCastConfig):
        for name, info in model.model_fields.items():
            assert (info.description or "").strip(), f"{model.__name__}.{name} has no Field(description=...)"
            assert f".{name}` |" in table


def test_a_key_without_a_description_is_refused():
    class Undocumented(BaseModel):
        documented: int = Field(default=1, description="fine")
        bare: int = 2

    with pytest.raises(ValueError, match=r"fair_cast\.bare has no description"):
        list(config_docs._rows(Undocumented, "fair_cast"))


def test_the_command_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "faircast_ds.config.keys"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    assert out == config_docs.key_table()
    assert "| `fair_cast.diagnostics.every` | int ≥ 0 | `10` |" in out
