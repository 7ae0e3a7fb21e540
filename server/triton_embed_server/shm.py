"""Python backend shared-memory regions that a killed stub leaves in ``/dev/shm``, and their removal.

A Triton 2.51 workaround (docs/troubleshooting.md, "Triton 2.51 defects").
Triton 2.51's Python backend gives each stub a region of ``shm-default-byte-size`` (1 MiB by default), the file
``/dev/shm/triton_<backend>_backend_shm_region_<uuid>``, and unlinks it when the model instance unloads normally.
A stub that is killed (out of memory, SIGKILL) leaves its region behind, even after the watchdog has reloaded the
model, and a killed ``tritonserver`` leaves all of them. :class:`EmbeddedServer` removes, when it stops, the
regions that appeared while it ran and that no live process maps.
"""

from __future__ import annotations

from pathlib import Path

SHM_DIR = Path("/dev/shm")  # noqa: S108 - where POSIX shared memory lives on Linux, not a temp file
REGION_GLOB = "triton_*_backend_shm_region_*"


def backend_regions(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names of the Python backend regions in ``shm_dir`` now (empty when the folder does not exist)."""
    return {path.name for path in shm_dir.glob(REGION_GLOB)} if shm_dir.is_dir() else set()


def mapped_names(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names of the files in ``shm_dir`` that some process maps now, read from ``/proc/<pid>/maps``.

    Processes whose maps cannot be read (another user's, or gone meanwhile) are skipped: their regions belong to
    them, and an unprivileged caller could not remove those anyway.
    """
    prefix = f"{shm_dir}/"
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            _, found, rest = line.partition(prefix)
            if found:
                names.add(rest.split(" ")[0])
    return names


def remove_orphans(candidates: set[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink those of ``candidates`` (region names in ``shm_dir``) that no live process maps; return them."""
    mapped = mapped_names(shm_dir)
    removed = []
    for name in sorted(candidates - mapped):
        try:
            (shm_dir / name).unlink()
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed
