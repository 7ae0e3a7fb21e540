"""One source of truth for versions: every pin in pyproject.toml equals the one in requirements.lock."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_pyproject_pins_match_lock():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    locked = lock_pins()
    assert requirements
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^;\s]+)", requirement)
        assert match, f"{requirement!r} is not an exact pin"
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        assert locked.get(name) == match.group(3), f"{name}: pyproject {match.group(3)}, lock {locked.get(name)}"


def test_torch_is_pinned_to_the_cpu_wheel_version():
    assert lock_pins()["torch"] == "2.13.0"
