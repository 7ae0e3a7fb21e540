"""The code base passes ruff (lint rules and formatting as configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = str(Path(sys.executable).parent / "ruff")


def test_ruff_check():
    done = subprocess.run(
        [RUFF, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format():
    done = subprocess.run([RUFF, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
