"""The code base passes ruff (lint and format) and the client package passes mypy, as pyproject.toml configures."""

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


def test_mypy_client_package():
    # the files and the strictness come from [tool.mypy] in pyproject.toml, as for `make typecheck`
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
