"""bench/gpu_check.py's dry run on the CPU: the whole device path (export, runner, served sweep) in ~2 minutes.

The real run needs the GPU machine; this rehearses every step it takes, with the project's exporter, a real
tritonserver on free loopback ports and the stdlib HTTP client, so that the device run cannot fail on a typo.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu_carry, gpu_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check-out")
    stub_path = tmp_path_factory.mktemp("stub-site")  # empty: the option's code path, numpy stays the venv's
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out), "--stub-path", str(stub_path)]
        + ["--work", str(tmp_path_factory.mktemp("gpu-check-work")), "--carry", str(out / "no-carry")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    return done, out


def test_dry_run_passes_and_writes_the_report(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for name in ("gpu_check.json", "gpu_check.md", "tritonserver.log"):
        assert (out / name).stat().st_size > 0, name
    assert done.stdout.splitlines()[1].startswith("== environment")
    assert "versions: python" in done.stdout and "transformers 5." in done.stdout


def test_export_used_the_projects_exporter_and_passed_its_checks(dry_run):
    data = json.loads((dry_run[1] / "gpu_check.json").read_text())
    assert data["export"]["exporter"] == "triton_embed_server.export.export"
    assert data["export"]["manifest"]["max_abs_diff"] < 1e-5
    assert data["export"]["manifest"]["dim"] == 384 and data["export"]["device_problems"] == []
    assert data["model"]["parameters"] > 22_000_000  # all-MiniLM-L6-v2's architecture
    assert all(p["status"] == "ok" for p in data["phases"].values()), data["phases"]


def test_served_embeddings_equal_in_process_ones(dry_run):
    data = json.loads((dry_run[1] / "gpu_check.json").read_text())
    served = data["served"]
    assert served["equality"]["max_abs_diff"] < 1e-5 and served["equality"]["texts"] >= 20
    assert served["equality"]["dim"] == 384
    assert [lv["concurrency"] for lv in served["levels"]][0] == 1 and served["levels"][0]["requests"] > 0
    assert served["batches"]["encoder"]["executions"] > 0 and served["exit_code"] == 0
    assert not [c for c in data["checks"] if c["ok"] is False], data["checks"]


def test_fp16_is_exported_for_the_gpu_config_and_checked_against_fp32(dry_run):
    data = json.loads((dry_run[1] / "gpu_check.json").read_text())
    assert data["export"]["manifest"]["precision"] == "fp32"
    fp16 = data["export"]["manifest_fp16"]
    assert fp16["precision"] == fp16["precision_asked"] == "fp16" and fp16["min_cosine"] >= 0.9999
    assert data["fp16"]["worst_vs_fp32"] >= 0.9999 and data["fp16"]["worst_vs_eager_fp16"] >= 0.9999
    assert set(data["fp16"]["vs_fp32"]) == set(data["runner"]["vs_eager"])  # every bucket
    assert data["served-fp16"]["precision"] == "fp16" and data["served-fp16"]["equality"]["max_abs_diff"] < 1e-3


def test_summary_has_the_rows_a_user_checks(dry_run):
    table = (dry_run[1] / "gpu_check.md").read_text()
    for row in (
        "| export with the project's exporter",
        "| device constants in the written model.pt files | PASS |",
        "vs each row on the CPU, same file | PASS |",
        "| served at fp32 (one text per request) vs in-process, same file and device | PASS |",
        "| served at fp16 (one text per request) vs in-process, same file and device | PASS |",
        "| PRECISION=auto for the GPU config: fp16 through the exporter's gate",
        "| fp16 vs fp32 bucketed eager, same batches, per bucket (min cosine) | PASS |",
        "| batch x 32 tokens | fp32 texts/s | fp16 texts/s | fp16 / fp32 |",
        "| served `embed` at fp16, one text per request, p99 <= 200 ms |",
        "| graph / eager throughput, batch <= 8 at 32 tokens (lowest) |",
        "| in-process: tokenizer + runner, batches of 4 |",
        "| served `embed`, one text per request, p99 <= 20 ms |",
        "| served `embed`, one text per request, p99 <= 200 ms |",
        "| batch x 32 tokens | eager texts/s |",
        "| concurrency | req/s | p50 ms | p99 ms | errors |",
        "| GPU monitor sees the load | not checked |",
    ):
        assert row in table, row
    assert table.startswith("GPU check: DRY RUN on the CPU")
    assert table in dry_run[0].stdout  # the printed summary is the file


def test_device_command_is_one_line_in_the_script_and_the_docs():
    command = gpu_carry.DEVICE_COMMAND
    assert len(command) <= 2000 and "\n" not in command
    assert command in gpu_check.__doc__
    assert command in (ROOT / "docs" / "benchmarks.md").read_text()


def test_version_problems_name_what_was_found():
    found = {"torch": "2.11.0+cu130", "transformers": "4.57.1", "nvidia-pytriton": "0.7.0", "cuda_available": True}
    (problem,) = gpu_check.version_problems(found, need_cuda=True)
    assert "transformers 4.57.1" in problem and "transformers 5" in problem
    assert gpu_check.version_problems({**found, "transformers": "5.17.0"}, need_cuda=True) == []
    no_gpu = gpu_check.version_problems({**found, "transformers": "5.17.0", "cuda_available": False}, need_cuda=True)
    assert no_gpu == ["torch 2.11.0+cu130 (CUDA None) sees no CUDA device"]


def test_pruned_wheel_keeps_the_312_stub_and_the_server(tmp_path):
    source = tmp_path / "nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl"
    names = [
        "pytriton/tritonserver/bin/tritonserver",
        "pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub",
        "pytriton/tritonserver/python_backend_stubs/3.13/triton_python_backend_stub",
        "nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0",
        "nvidia_pytriton.libs/libtritonserver-717102f0.so",
    ]
    with zipfile.ZipFile(source, "w") as z:
        for name in names:
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o100755 << 16
            z.writestr(info, b"x")
        z.writestr("nvidia_pytriton-0.7.0.dist-info/RECORD", "".join(f"{n},sha256=x,1\n" for n in names))
    (tmp_path / "out").mkdir()
    pruned = gpu_carry.prune_wheel(source, tmp_path / "out")
    assert pruned.name == "nvidia_pytriton-0.7.0-1-py3-none-manylinux_2_35_x86_64.whl"
    with zipfile.ZipFile(pruned) as z:
        kept = [n for n in z.namelist() if not n.endswith("RECORD")]
        record = z.read("nvidia_pytriton-0.7.0.dist-info/RECORD").decode()
        mode = z.getinfo("pytriton/tritonserver/bin/tritonserver").external_attr >> 16
    assert kept == [names[0], names[1], names[4]]
    assert "3.13" not in record and "libpython3" not in record and names[1] in record
    assert mode & 0o111
