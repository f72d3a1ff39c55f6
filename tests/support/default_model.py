"""The embedded default model as `make setup` prepares it, for the checks that need a real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deploy.processes import ROOT

MODEL_DIR = Path(os.environ.get("PAGEDSERVE_MODEL_DIR", ROOT / ".models" / "smollm2-135m-instruct"))


has_model = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").exists(),
    reason=f"default model not prepared in {MODEL_DIR} (run `make setup`)",
)


# --- structured output ----------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}
