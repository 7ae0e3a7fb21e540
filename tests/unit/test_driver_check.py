"""The entrypoint's driver check: its decision given versions, and the script on this machine (no GPU here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from triton_embed_server.driver_check import (
    EXIT_REFUSED,
    DriverFacts,
    cuda_of,
    decide,
    gpu_models,
    parse_cuda,
    torch_build,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "server" / "triton_embed_server" / "driver_check.py"
GPU = {"gpu_models": ["encoder"], "config_name": "gpu"}


def test_versions_parse():
    assert parse_cuda("12.6.2") == (12, 6) and parse_cuda("12.4") == (12, 4) and parse_cuda(None) is None
    assert cuda_of(12020) == (12, 2) and cuda_of(11040) == (11, 4) and cuda_of(12060) == (12, 6)


def test_a_driver_of_an_older_cuda_major_is_refused_with_what_to_do():
    verdict = decide(**GPU, needed_cuda="12.6", facts=DriverFacts("450.80.02", 11000, 11000))
    assert not verdict.ok
    message = verdict.message
    assert "NVIDIA driver 450.80.02 (CUDA 11.0) is too old" in message and "needs CUDA 12.6" in message
    assert "Minimum: 525.60.13" in message and "560 or newer" in message and "535.86+ (R535)" in message
    assert "R450 is not a forward-compatible branch" in message and "Upgrade the host's NVIDIA driver" in message


def test_a_forward_compatible_branch_without_its_compat_library_is_refused():
    """R470 on a GeForce: the branch is listed, but the image's compat library did not load (libcuda says 11.4)."""
    verdict = decide(**GPU, needed_cuda="12.6", facts=DriverFacts("470.82.01", 11040, 11040))
    assert not verdict.ok and "forward compatibility did not load" in verdict.message


@pytest.mark.parametrize(
    ("facts", "says"),
    [
        (DriverFacts("560.35.03", 12060, 12060), "runs CUDA 12.6"),  # native
        (DriverFacts("580.95.05", 13000, 13000), "runs CUDA 12.6"),  # newer major
        (DriverFacts("535.104.05", 12020, 12020), "minor version compatibility"),  # same major, older minor
        (DriverFacts("470.82.01", 11040, 12060), "forward compatibility libraries"),  # compat libcuda loaded
        (DriverFacts("535.86.10", None, None), "documented for R535"),  # branch listed, libcuda unreadable
    ],
    ids=["native", "newer", "minor-compat", "forward-compat", "listed-branch"],
)
def test_new_enough_and_forward_compatible_drivers_are_accepted(facts, says):
    verdict = decide(**GPU, needed_cuda="12.6", facts=facts)
    assert verdict.ok and says in verdict.message, verdict.message


def test_a_branch_below_its_listed_minimum_is_refused():
    verdict = decide(**GPU, needed_cuda="12.6", facts=DriverFacts("470.42.01", None, None))
    assert not verdict.ok and "forward compatibility needs 470.57 or newer on R470" in verdict.message


def test_no_gpu_config_needs_no_driver_and_a_gpu_config_without_one_is_refused():
    cpu = decide(gpu_models=[], config_name="cpu", needed_cuda=None, facts=DriverFacts(None, problem="no NVML"))
    assert cpu.ok and cpu.message == "config 'cpu' runs on the CPU: no NVIDIA driver check"
    missing = decide(**GPU, needed_cuda="12.4", facts=DriverFacts(None, problem="libnvidia-ml.so.1 not loadable"))
    assert not missing.ok and "no NVIDIA driver is visible (libnvidia-ml.so.1 not loadable)" in missing.message
    cpu_torch = decide(**GPU, needed_cuda=None, facts=DriverFacts("560.35.03", 12060, 12060))
    assert not cpu_torch.ok and "CPU-only build" in cpu_torch.message


def test_gpu_models_follow_the_chosen_config(tmp_path):
    shutil.copytree(ROOT / "model_repository", tmp_path / "models", ignore=shutil.ignore_patterns("1"))
    models = tmp_path / "models"
    assert gpu_models(models, "gpu") == ["encoder"] and gpu_models(models, "libtorch") == ["encoder"]
    assert gpu_models(models, "cpu") == []  # no configs/cpu.pbtxt: every config.pbtxt, all KIND_CPU
    assert gpu_models(tmp_path / "absent", "gpu") == []


@pytest.mark.full_install
def test_torch_build_is_read_without_importing_torch():
    """The same version and CUDA release torch itself reports (a CPU wheel: None; PyPI's default wheel: its CUDA)."""
    read = torch_build()
    truth = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert read == (truth[0], None if truth[1] == "None" else truth[1])


def test_script_skips_cpu_configs_and_refuses_a_gpu_config_without_a_driver():
    """As the entrypoint runs it (stdlib only, any python3): this machine has no NVIDIA driver."""

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False, timeout=60
        )

    cpu = run(f"--model-repository={ROOT / 'model_repository'}", "--model-config-name=cpu")
    assert cpu.returncode == 0 and "config 'cpu' runs on the CPU: no NVIDIA driver check" in cpu.stderr
    gpu = run("--model-repository", str(ROOT / "model_repository"), "--model-config-name", "gpu")
    assert gpu.returncode == EXIT_REFUSED, gpu.stderr
    assert (
        gpu.stderr.startswith("triton-embed: ERROR: config 'gpu' runs encoder on a GPU") and gpu.stderr.count("\n") == 1
    )
