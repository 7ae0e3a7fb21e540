"""The cores a backend may keep busy: the CPU affinity capped by a cgroup CPU quota, read from cgroup v1 and v2 files
laid out as the kernel mounts them (a folder per cgroup), in a temporary folder."""

from __future__ import annotations

import os
from pathlib import Path

from triton_embed_protocol.cpu import cpu_cgroups, cpu_quota, usable_cores

AFFINITY = len(os.sched_getaffinity(0))


def v2(tmp_path: Path, path: str, quotas: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup v2 mount with ``cpu.max`` per folder (``{"kubepods/pod": "150000 100000"}``); its root has
    ``cgroup.controllers`` and, as the kernel makes it, no ``cpu.max`` unless ``quotas`` names ``""``."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for folder, value in quotas.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(value + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{path}\n")
    return proc, root


def v1(tmp_path: Path, controllers: str, path: str, quotas: dict[str, int], period: int = 100_000) -> tuple[Path, Path]:
    """A cgroup v1 mount of the cpu controller with ``cpu.cfs_quota_us`` per folder (-1: none)."""
    root = tmp_path / "cgroup"
    for folder, quota in quotas.items():
        where = root / controllers / folder
        where.mkdir(parents=True, exist_ok=True)
        (where / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (where / "cpu.cfs_period_us").write_text(f"{period}\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"12:memory:/x\n4:{controllers}:{path}\n1:name=systemd:/x\n")
    return proc, root


def test_no_quota_leaves_the_affinity(tmp_path):
    proc, root = v2(tmp_path, "/", {"": "max 100000"})
    assert cpu_quota(proc, root) is None
    cores, how = usable_cores(proc, root)
    assert cores == AFFINITY and "quota" not in how and how.startswith(f"the {AFFINITY} core")


def test_a_v2_quota_below_the_affinity_caps_the_cores_rounded_down(tmp_path):
    proc, root = v2(tmp_path, "/kubepods/pod", {"": "max 100000", "kubepods/pod": "50000 100000"})
    assert cpu_quota(proc, root) == (0.5, root / "kubepods" / "pod" / "cpu.max")
    cores, how = usable_cores(proc, root)
    assert cores == 1  # at least one
    if AFFINITY > 1:
        assert f"a CPU quota of 0.5 CPUs ({root / 'kubepods' / 'pod' / 'cpu.max'})" in how


def test_a_v2_quota_below_a_root_without_cpu_max_is_found(tmp_path):
    """A host's systemd unit (``CPUQuota=``): the v2 root has no ``cpu.max``, the unit's folder has one."""
    proc, root = v2(tmp_path, "/system.slice/triton.service", {"system.slice/triton.service": "100000 100000"})
    assert cpu_quota(proc, root) == (1.0, root / "system.slice" / "triton.service" / "cpu.max")


def test_the_smallest_quota_above_the_process_counts(tmp_path):
    proc, root = v2(tmp_path, "/a/b", {"": "max 100000", "a": "100000 100000", "a/b": "400000 100000"})
    assert cpu_quota(proc, root) == (1.0, root / "a" / "cpu.max")


def test_a_v1_quota_of_a_container_whose_path_names_the_hosts_hierarchy(tmp_path):
    """Docker without a cgroup namespace: /proc names /docker/<id>, the mount shows the container's cgroup as root."""
    proc, root = v1(tmp_path, "cpu,cpuacct", "/docker/0123abcd", {"": 150_000})
    assert cpu_quota(proc, root) == (1.5, root / "cpu,cpuacct" / "cpu.cfs_quota_us")


def test_a_v1_quota_of_minus_one_is_none_and_an_unreadable_file_is_ignored(tmp_path):
    proc, root = v1(tmp_path, "cpu", "/", {"": -1})
    assert cpu_quota(proc, root) is None
    (root / "cpu" / "cpu.cfs_period_us").write_text("not a number\n")
    (root / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert cpu_quota(proc, root) is None
    assert usable_cores(proc, root)[0] == AFFINITY


def test_a_quota_at_or_above_the_affinity_changes_nothing(tmp_path):
    proc, root = v2(tmp_path, "/", {"": f"{AFFINITY * 100_000} 100000"})
    assert usable_cores(proc, root)[0] == AFFINITY


def test_a_v2_mount_without_the_cpu_controller_holds_no_quota(tmp_path):
    """Beside v1 hierarchies the cpu controller may be v1's: the v2 mount then lists no ``cpu``."""
    proc, root = v2(tmp_path, "/a", {"a": "50000 100000"})
    (root / "cgroup.controllers").write_text("memory pids\n")
    assert cpu_cgroups(proc, root) == [] and cpu_quota(proc, root) is None
