"""The catalogue of Triton 2.51 workarounds in docs/troubleshooting.md and the code agree, in both directions.

Every workaround's code says so with the words "Triton 2.51 workaround", and every file that says so is named
under its entry, so a reader can go from the catalogue to the code and back, and can remove it all after an upgrade.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "Triton 2.51 workaround"
SECTION = "## Triton 2.51 defects we work around"


def entries() -> dict[str, set[str]]:
    """Heading of each defect -> the repository files its Workaround bullet names."""
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    found = {}
    for block in section.split("\n### ")[1:]:
        heading, body = block.split("\n", 1)
        if "**Workaround**" not in body:
            continue
        bullet = body.split("- **Workaround**", 1)[1].split("\n- **", 1)[0]
        names = re.findall(r"`([^`\s]+)`", bullet)
        found[heading.strip()] = {name for name in names if (ROOT / name).is_file()}
    return found


def marked_files() -> set[str]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {
        name
        for name in tracked
        if not name.startswith(("docs/", "tests/"))
        and name != "README.md"
        and (ROOT / name).is_file()
        and MARKER in (ROOT / name).read_text(errors="replace")
    }


def test_each_workaround_names_its_files_and_they_say_so():
    catalogue = entries()
    assert len(catalogue) >= 10, sorted(catalogue)
    for heading, files in catalogue.items():
        assert files, f"'{heading}': its Workaround names no file of the repository"
        for name in files:
            assert MARKER in (ROOT / name).read_text(), f"{name} ('{heading}') does not say '{MARKER}'"


def test_every_file_that_says_it_works_around_triton_is_in_the_catalogue():
    named = set().union(*entries().values())
    assert marked_files() - named == set()
