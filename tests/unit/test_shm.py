"""Removal of leftover Python backend regions: only those no live process maps (real /proc, a temporary folder)."""

from __future__ import annotations

import mmap

from triton_embed_server.shm import backend_regions, remove_orphans


def test_only_unmapped_regions_are_removed(tmp_path):
    names = [f"triton_{b}_backend_shm_region_test-{b}" for b in ("tokenizer", "torchscript")]
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * mmap.PAGESIZE)
    (tmp_path / "other_file").write_bytes(b"x")
    assert backend_regions(tmp_path) == set(names)  # other files are never candidates
    with open(tmp_path / names[0], "r+b") as handle, mmap.mmap(handle.fileno(), 0):  # a live stub's region
        assert remove_orphans(backend_regions(tmp_path), tmp_path) == [names[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[0], "other_file"])
