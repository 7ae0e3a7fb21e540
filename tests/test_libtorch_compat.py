"""The exported model.pt runs in torch 2.5.0, the PyTorch of Triton 24.10's libtorch backend and pyt-python image.

`make model` exports with the lock's torch (2.13.0); the GPU image and `encoder/configs/libtorch.pbtxt` load the same
file with 24.10's older libtorch. This test installs torch 2.5.0 (tests/libtorch-24.10.lock) into a scratch venv
and compares its embeddings of the artifact with torch 2.13.0's. The venv (4.5 GB, ~60 s to install on 2 cores) is
kept in the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``, ``triton-embed/``) under the lock's hash, as
pre-commit keeps its tool environments: every clone on the machine shares it, and a changed lock gets a new one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import numpy as np
import torch
from triton_embed_server.layout import DEFAULT_MODEL_REPOSITORY

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "tests" / "libtorch-24.10.lock"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "triton-embed"
VENV = CACHE / f"torch-2.5.0-{hashlib.sha256(LOCK.read_bytes()).hexdigest()[:12]}"
MODEL = DEFAULT_MODEL_REPOSITORY / "encoder" / "1" / "model.pt"  # make reference-model writes it

RUN = """
import json, sys, torch
ids, mask = (torch.tensor(x, dtype=torch.int64) for x in json.loads(sys.stdin.read()))
module = torch.jit.load(sys.argv[1], map_location="cpu").eval()
with torch.no_grad():
    out = module(ids, mask)
print(json.dumps({"torch": torch.__version__, "embedding": out.tolist()}))
"""


def scratch_python() -> Path:
    """The scratch venv's interpreter, with exactly the lock's packages (installed once, --no-deps).

    Test processes that ask at once wait for one install (a lock file beside the venv); an install cut short is
    redone (the stamp is written last).
    """
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"{VENV.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.is_file():
            shutil.rmtree(VENV, ignore_errors=True)
            venv.create(VENV, with_pip=True)
            # --no-compile: the runs import a few of the 4.5 GB's modules; byte-compiling every one costs ~12 s
            pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
            subprocess.run([*pip, "--no-compile", "-r", LOCK], check=True)
            stamp.write_text(LOCK.read_text())
    return python


def in_libtorch_24_10(script: str, *args, ids: np.ndarray, mask: np.ndarray) -> dict:
    """Run ``script`` (reads ``[ids, mask]`` as JSON on stdin, prints one JSON line with ``torch``) in torch 2.5.0.

    Returns:
        The script's last line, parsed, after checking it ran in torch 2.5.0.
    """
    done = subprocess.run(
        [scratch_python(), "-c", script, *map(str, args)],
        input=json.dumps([ids.tolist(), mask.tolist()]),
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["torch"].startswith("2.5.0"), result["torch"]
    return result


def test_artifact_runs_in_the_libtorch_of_triton_24_10():
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 29000, size=(4, 23)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 1:] = 0
    ids[mask == 0] = 0
    result = in_libtorch_24_10(RUN, MODEL, ids=ids, mask=mask)
    with torch.no_grad():
        ours = torch.jit.load(str(MODEL)).eval()(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    theirs = np.asarray(result["embedding"], dtype=np.float32)
    assert theirs.shape == (4, 384)
    diff = float(np.abs(theirs - ours).max())
    assert diff < 1e-5, f"torch {result['torch']} differs from torch {torch.__version__} by {diff:.3g}"
