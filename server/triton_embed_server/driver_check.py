"""Refuse, before tritonserver starts, an NVIDIA driver too old for the image's CUDA.

The GPU image runs torch (``torch.version.cuda``) and Triton 24.10 (``CUDA_VERSION``, 12.6.2) on the host's driver.
A driver whose CUDA major version is older than theirs fails at the first CUDA call, and compose would restart the
container in a loop; this check says so once, with the driver it found and the minimum, and exits
``EXIT_REFUSED``.

"Too old", from NVIDIA's CUDA compatibility guide and the Triton 24.10 release notes:

* the driver's own CUDA version (NVML) is at least the one needed: it runs (native);
* same CUDA major version, older minor: it runs through minor version compatibility (CUDA 12: driver 525.60.13 or
  newer), without PTX JIT of newer code; accepted with a note, since NVIDIA documents the 24.10 image for R560+;
* older major version: it runs only through forward compatibility, the image's ``cuda-compat`` libraries, which
  load only on data-center GPUs on the branches the release notes list (``FORWARD_COMPAT_MINIMUMS``). Accepted when
  the CUDA library this process loads (``cuDriverGetVersion``: the compat one when the NGC entrypoint enabled it)
  is new enough; otherwise, or when that library cannot be read and the branch is not listed, refused.

Without a GPU config (no model's chosen config says ``KIND_GPU``) nothing is checked. Run as a script (stdlib only,
Python >= 3.10, like supervisor.py) with tritonserver's arguments: ``python3 driver_check.py --model-repository=DIR
--model-config-name=NAME ...``; docker/triton-entrypoint.sh does so before it starts tritonserver.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

EXIT_REFUSED = 78
"""Exit status of a refused driver (``EX_CONFIG`` of sysexits.h: the host's configuration is wrong)."""
NATIVE_MINIMUM_BRANCH = 560
"""Driver branch that runs Triton 24.10's CUDA 12.6.2 natively (Triton 24.10 release notes)."""
FORWARD_COMPAT_MINIMUMS = ((470, 57), (525, 85), (535, 86), (545, 23))
"""(branch, minor) minimums on which Triton 24.10 runs on data-center GPUs through forward compatibility."""
MINOR_COMPAT_MINIMUMS = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
"""Oldest driver of each CUDA major version, the floor of minor version compatibility (CUDA toolkit release notes)."""


@dataclass(frozen=True)
class DriverFacts:
    """What the host's driver says, as read by :func:`probe_driver`.

    Attributes:
        driver_version: ``nvmlSystemGetDriverVersion``, e.g. ``"535.104.05"``; None without NVML or a GPU.
        driver_cuda: ``nvmlSystemGetCudaDriverVersion``, e.g. ``12020`` for CUDA 12.2; None when unknown.
        loaded_cuda: ``cuDriverGetVersion`` of the ``libcuda.so.1`` this process loads (the image's forward
            compatibility library when it is active), same encoding; None when it cannot be loaded.
        problem: why NVML could not be read (None when it was).
    """

    driver_version: str | None
    driver_cuda: int | None = None
    loaded_cuda: int | None = None
    problem: str | None = None


@dataclass(frozen=True)
class Verdict:
    """The check's outcome: ``ok`` False means do not start tritonserver; ``message`` is one line for the log."""

    ok: bool
    message: str


def parse_cuda(text: str | None) -> tuple[int, int] | None:
    """``"12.6.2"`` or ``"12.4"`` -> ``(12, 6)`` / ``(12, 4)``; None for None or an unparsable text."""
    match = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def cuda_of(encoded: int) -> tuple[int, int]:
    """NVML/driver API encoding -> ``(major, minor)``: ``12020`` -> ``(12, 2)``."""
    return encoded // 1000, encoded % 1000 // 10


def _branch(driver_version: str) -> tuple[int, int]:
    parts = [int(p) for p in re.findall(r"\d+", driver_version)[:2]]
    return parts[0], parts[1] if len(parts) > 1 else 0


def _minimums_text() -> str:
    listed = ", ".join(f"{b}.{m}+ (R{b})" for b, m in FORWARD_COMPAT_MINIMUMS)
    return f"driver {NATIVE_MINIMUM_BRANCH} or newer, or on a data-center GPU {listed} with CUDA forward compatibility"


def decide(*, gpu_models: list[str], config_name: str, needed_cuda: str | None, facts: DriverFacts) -> Verdict:
    """Whether the host's driver can run the CUDA the image needs.

    Args:
        gpu_models: models whose chosen config places instances on a GPU (``KIND_GPU``); empty: nothing to check.
        config_name: the ``--model-config-name`` given (for the messages).
        needed_cuda: CUDA version the image needs, e.g. ``"12.6"`` (the higher of torch's and the image's);
            None when torch has no CUDA build.
        facts: what the driver said (:func:`probe_driver`).

    Returns:
        ``Verdict(ok, message)``; ``ok`` False for a driver too old, no driver at all, or a CPU-only torch.
    """
    if not gpu_models:
        return Verdict(True, f"config '{config_name}' runs on the CPU: no NVIDIA driver check")
    where = f"config '{config_name}' runs {', '.join(gpu_models)} on a GPU"
    if facts.driver_version is None:
        return Verdict(
            False,
            f"{where}, but no NVIDIA driver is visible ({facts.problem or 'NVML unavailable'}): start the container "
            "with the NVIDIA Container Toolkit (compose reserves the GPU) on a host with a GPU",
        )
    need = parse_cuda(needed_cuda)
    if need is None:
        return Verdict(False, f"{where}, but the image's torch is a CPU-only build: rebuild the image")
    return _judge(facts, need)


def _judge(facts: DriverFacts, need: tuple[int, int]) -> Verdict:
    """:func:`decide` for a visible driver and a CUDA build of torch."""
    found = f"NVIDIA driver {facts.driver_version}"
    have = cuda_of(facts.driver_cuda) if facts.driver_cuda else None
    if have is not None:
        found += f" (CUDA {have[0]}.{have[1]})"
    needed = f"CUDA {need[0]}.{need[1]}"
    if have is not None and have >= need:
        return Verdict(True, f"{found} runs {needed}")
    if have is not None and have[0] == need[0]:
        return Verdict(
            True,
            f"{found} runs {needed} through CUDA minor version compatibility (no PTX JIT of newer code); "
            f"NVIDIA documents the image for {_minimums_text()}",
        )
    loaded = cuda_of(facts.loaded_cuda) if facts.loaded_cuda else None
    if loaded is not None and loaded >= need:
        return Verdict(True, f"{found} runs {needed} through the image's CUDA forward compatibility libraries")
    branch, minor = _branch(facts.driver_version)
    listed = dict(FORWARD_COMPAT_MINIMUMS)
    if loaded is None and branch in listed and minor >= listed[branch]:
        return Verdict(
            True,
            f"{found}: forward compatibility to {needed} is documented for R{branch} on data-center GPUs "
            "(its CUDA library could not be read here to confirm it)",
        )
    floor = MINOR_COMPAT_MINIMUMS.get(need[0], f"a CUDA {need[0]} driver")
    if branch not in listed:
        why = f"R{branch} is not a forward-compatible branch"
    elif minor < listed[branch]:
        why = f"forward compatibility needs {branch}.{listed[branch]} or newer on R{branch}"
    else:
        why = "forward compatibility did not load (it works only on data-center GPUs)"
    return Verdict(
        False,
        f"{found} is too old for this image, which needs {needed}; {why}. Minimum: {floor} "
        f"(CUDA {need[0]} minor version compatibility); NVIDIA documents {_minimums_text()}. "
        "Upgrade the host's NVIDIA driver",
    )


def probe_driver() -> DriverFacts:
    """Read the driver's version and CUDA version from NVML, and the loaded ``libcuda``'s CUDA version.

    Returns:
        The facts; ``driver_version`` None (with ``problem``) when NVML cannot be loaded or initialised.
    """
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as exc:
        return DriverFacts(None, problem=f"libnvidia-ml.so.1 not loadable: {exc}")
    status = nvml.nvmlInit_v2()
    if status != 0:
        return DriverFacts(None, problem=f"nvmlInit_v2 returned {status}")
    try:
        text = ctypes.create_string_buffer(96)
        cuda = ctypes.c_int(0)
        driver = text.value.decode() if nvml.nvmlSystemGetDriverVersion(text, 96) == 0 else ""
        driver_cuda = cuda.value if nvml.nvmlSystemGetCudaDriverVersion(ctypes.byref(cuda)) == 0 else None
    finally:
        nvml.nvmlShutdown()
    loaded = None
    try:
        version = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            loaded = version.value
    except OSError:
        pass
    if not driver:
        return DriverFacts(None, problem="nvmlSystemGetDriverVersion failed")
    return DriverFacts(driver, driver_cuda or None, loaded)


def torch_build() -> tuple[str | None, str | None]:
    """``(torch.__version__, torch.version.cuda)`` of the installed torch, read without importing torch.

    Returns:
        ``(None, None)`` when torch is not installed; the CUDA entry is None for a CPU-only build.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    text = path.read_text() if path.is_file() else ""
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    cuda = re.search(r"^cuda\b[^=\n]*=\s*['\"]([\d.]+)['\"]", text, re.MULTILINE)
    return (version.group(1) if version else None), (cuda.group(1) if cuda else None)


def gpu_models(repository: Path, config_name: str | None) -> list[str]:
    """Models whose chosen config (``configs/<name>.pbtxt``, else ``config.pbtxt``) places instances on a GPU."""
    found = []
    for model in sorted(p for p in repository.iterdir() if p.is_dir()) if repository.is_dir() else []:
        chosen = model / "configs" / f"{config_name}.pbtxt" if config_name else None
        config = chosen if chosen is not None and chosen.is_file() else model / "config.pbtxt"
        if config.is_file():
            text = re.sub(r"#[^\n]*", "", config.read_text())
            if re.search(r"\bkind\s*:\s*KIND_GPU\b", text):
                found.append(model.name)
    return found


def _flag(args: list[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def main(argv: list[str] | None = None) -> int:
    """Check the driver for tritonserver's arguments; print one line; 0 to go on, ``EXIT_REFUSED`` to stop."""
    args = sys.argv[1:] if argv is None else argv
    repository = _flag(args, "--model-repository")
    config_name = _flag(args, "--model-config-name") or "config"
    models = gpu_models(Path(repository), config_name) if repository else []
    verdict = Verdict(True, "no --model-repository given: no NVIDIA driver check")
    if repository:
        torch_version, torch_cuda = torch_build()
        image_cuda = os.environ.get("CUDA_VERSION")  # set by the NGC image (12.6.2 in 24.10)
        needed = torch_cuda
        if torch_cuda and parse_cuda(image_cuda) and parse_cuda(image_cuda) > parse_cuda(torch_cuda):
            needed = image_cuda
        facts = probe_driver() if models else DriverFacts(None)
        verdict = decide(gpu_models=models, config_name=config_name, needed_cuda=needed, facts=facts)
        if models and torch_version:
            verdict = Verdict(verdict.ok, f"{verdict.message} [torch {torch_version}, image CUDA {image_cuda}]")
    print(f"triton-embed: {'' if verdict.ok else 'ERROR: '}{verdict.message}", file=sys.stderr)
    return 0 if verdict.ok else EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
