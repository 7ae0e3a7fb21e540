"""The CPU cores a backend may keep busy: its CPU affinity, capped by its cgroup's CPU quota (a container's CPU limit).

Torch runs one thread per core it is given. Under a quota smaller than the affinity (Kubernetes ``limits: {cpu: 1}``
on a larger node, ``docker run --cpus``), a thread per core of the affinity serves less, later: on 2 cores under a
1-CPU quota, 2 threads served 39-48 requests/s of the load test's mix at p99 196-212 ms, 1 thread 62-71 at 123-146
ms (docs/benchmarks.md, "Cores under a CPU quota"). Pure Python, no torch: tests/unit/test_cpu.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
"""This process's cgroups, one line each: ``hierarchy:controllers:path`` (cgroup v2: ``0::path``)."""

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup hierarchies are mounted: v2 itself (or under ``unified`` beside v1), v1 one folder per
controller (``cpu``, ``cpu,cpuacct``)."""


def _quota_in(folder: Path, v2: bool) -> tuple[float, Path] | None:
    """The CPU quota set on one cgroup folder, CPUs, and the file that sets it (None: none set, or unreadable)."""
    try:
        if v2:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else (int(quota) / int(period), folder / "cpu.max")
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        cpus = quota / int((folder / "cpu.cfs_period_us").read_text())
        return None if quota < 0 else (cpus, folder / "cpu.cfs_quota_us")
    except (OSError, ValueError, ZeroDivisionError):
        return None


def cpu_cgroups(proc_cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> list[tuple[Path, str, bool]]:
    """This process's cgroups that hold a cpu controller: ``(mount, the process's path in it, v2)`` each.

    A v2 mount is recognised by its ``cgroup.controllers`` naming ``cpu`` (its root has no ``cpu.max``; beside v1
    hierarchies the cpu controller may be v1's), a v1 one by ``cpu.cfs_quota_us``. Empty when ``proc_cgroup`` cannot
    be read or no mount is found.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[Path, str, bool]] = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:
            v2, bases, marker = True, [cgroup_root, cgroup_root / "unified"], "cgroup.controllers"
        elif "cpu" in controllers.split(","):
            bases = [cgroup_root / controllers, cgroup_root / "cpu", cgroup_root / "cpu,cpuacct"]
            v2, marker = False, "cpu.cfs_quota_us"
        else:
            continue
        base = next((b for b in bases if (b / marker).is_file()), None)
        if base is not None and (not v2 or "cpu" in (base / marker).read_text().split()):
            found.append((base, path, v2))
    return found


def cpu_quota(proc_cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> tuple[float, Path] | None:
    """The smallest CPU quota over this process's cgroup and the cgroups above it, CPUs, and the file that sets it.

    In a container the process's cgroup path may name the host's hierarchy while the mount shows the container's own
    cgroup at its root: folders that do not exist are skipped, so the root's quota still counts.

    Returns:
        ``(CPUs, file)``, e.g. ``(1.5, Path("/sys/fs/cgroup/cpu.max"))``; None when no quota is set or nothing is
        readable.
    """
    found: list[tuple[float, Path]] = []
    for base, path, v2 in cpu_cgroups(proc_cgroup, cgroup_root):
        parts = Path(path.strip("/")).parts
        for depth in range(len(parts), -1, -1):
            folder = base.joinpath(*parts[:depth])
            if folder.is_dir() and (quota := _quota_in(folder, v2)) is not None:
                found.append(quota)
    return min(found, default=None, key=lambda item: item[0])


def usable_cores(proc_cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> tuple[int, str]:
    """The cores this process may keep busy, and how they were found.

    The CPU affinity's cores, capped by the cgroup CPU quota (:func:`cpu_quota`) rounded down, at least 1.

    Returns:
        ``(cores, how)``, e.g. ``(2, "the 2 cores of the CPU affinity")`` or
        ``(1, "1 of the 2 cores of the CPU affinity: a CPU quota of 1.5 CPUs (/sys/fs/cgroup/cpu.max)")``.
    """
    affinity = len(os.sched_getaffinity(0))
    how = f"the {affinity} cores of the CPU affinity" if affinity > 1 else "the 1 core of the CPU affinity"
    quota = cpu_quota(proc_cgroup, cgroup_root)
    if quota is None or quota[0] >= affinity:
        return affinity, how
    cpus, where = quota
    cores = max(1, math.floor(cpus))
    return cores, f"{cores} of {how}: a CPU quota of {cpus:g} {'CPU' if cpus == 1 else 'CPUs'} ({where})"
