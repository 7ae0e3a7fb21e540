"""One source of truth for versions: the lock pins every package, and pyproject.toml agrees with it.

The library's own dependencies, and the extras its users install (gateway, tracing, monitor), are ranges, each
containing the locked version; the other extras serve this repository's targets and are exact pins equal to the lock.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
USER_EXTRAS = ("gateway", "tracing", "monitor")


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[normalised(name)] = version
    return pins


def test_every_lock_line_is_an_exact_pin():
    lines = [line for line in (ROOT / "requirements.lock").read_text().splitlines() if line and line[0] != "#"]
    assert lines
    for line in lines:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", line), f"{line!r} is not an exact pin"


@pytest.mark.parametrize(
    "line",
    PROJECT["dependencies"] + [line for extra in USER_EXTRAS for line in PROJECT["optional-dependencies"][extra]],
)
def test_dependencies_are_ranges_that_contain_the_locked_version(line):
    requirement = Requirement(line)
    operators = {spec.operator for spec in requirement.specifier}
    assert ">=" in operators, f"{line!r}: no lower bound"
    assert "<" in operators, f"{line!r}: no upper bound"
    assert not operators & {"==", "==="}, f"{line!r}: an exact pin; the library's users need a range"
    locked = lock_pins().get(normalised(requirement.name))
    assert locked is not None, f"{requirement.name} is not in requirements.lock"
    assert requirement.specifier.contains(locked), (
        f"{requirement.name}: lock {locked} is outside {requirement.specifier}"
    )


@pytest.mark.parametrize(
    "line",
    [line for name, extra in PROJECT["optional-dependencies"].items() if name not in USER_EXTRAS for line in extra],
    ids=str,
)
def test_extras_are_exact_pins_equal_to_the_lock(line):
    requirement = Requirement(line)
    specs = list(requirement.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{line!r} is not an exact pin"
    locked = lock_pins().get(normalised(requirement.name))
    assert locked == specs[0].version, f"{requirement.name}: pyproject {specs[0].version}, lock {locked}"


def test_torch_is_pinned_to_the_cpu_wheel_version():
    assert lock_pins()["torch"] == "2.13.0"
