"""Which precision the exported encoder computes at, and the quality gate it must pass.

``make model PRECISION=auto`` (the default) picks by the config served and, on a CPU, by the hardware it detects:

* for the GPU configs (compose, Kubernetes: ``--device gpu``): fp16, which every GPU that runs Triton 24.10 computes
  natively (text-embeddings-inference and vLLM serve fp16 there too);
* for the CPU config (``make serve``): bf16 where the CPU computes it natively (``avx512_bf16`` or ``amx_bf16`` in
  ``/proc/cpuinfo``), fp32 elsewhere, where torch's bf16 is far slower than fp32.

Whatever the choice, a reduced precision is served only if it passes the gate: its embeddings of the calibration
texts (``calibration.txt``, the export's ``CHECK_TEXTS`` and the user's ``CORPUS``) must reach a cosine of at least
``min_cosine`` to fp32 sentence-transformers' on every text. ``auto`` falls back to fp32 below it and says so;
an explicit precision fails the export.

Pure Python (no torch): tests/unit/test_precision_choice.py tests it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHOICES = ("auto", "fp32", "bf16", "fp16")
"""What ``PRECISION`` / ``--precision`` accepts."""
DEVICES = ("cpu", "gpu")
"""What the served config runs on (``--device``), which ``auto`` picks for."""
DEFAULT_MIN_COSINE = 0.9999
"""Lowest cosine to fp32 sentence-transformers a reduced precision may reach on any calibration text."""
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 CPU flags of native bf16 arithmetic (AVX-512 BF16 dot products, AMX tiles); torch's oneDNN kernels use them."""
CALIBRATION_FILE = Path(__file__).with_name("calibration.txt")
"""The project's own calibration sentences: many topics, lengths and scripts, one per line."""
CORPUS_CALIBRATION_TEXTS = 512
"""Texts taken from the head of the user's ``CORPUS`` for the gate (each costs one embedding at both precisions)."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (the first ``flags`` line of ``cpuinfo``); empty where the file is absent."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@dataclass(frozen=True)
class Choice:
    """A precision and why it was chosen (one line, for the export's log)."""

    precision: str
    reason: str


def choose(requested: str, device: str, flags: set[str]) -> Choice:
    """The precision to export for ``requested`` (one of ``CHOICES``) on a config running on ``device``.

    Args:
        requested: ``auto`` or a precision.
        device: ``cpu`` or ``gpu``: where the served config runs.
        flags: the CPU's feature flags (:func:`cpu_flags`); read for ``auto`` on ``cpu`` only.

    Raises:
        ValueError: ``requested`` or ``device`` is not one of its choices.
    """
    if requested not in CHOICES:
        raise ValueError(f"precision must be one of {', '.join(CHOICES)}; got {requested!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    if requested != "auto":
        return Choice(requested, f"{requested}, as asked")
    if device == "gpu":
        return Choice("fp16", "auto: fp16 for a GPU config")
    native = sorted(flags.intersection(NATIVE_BF16_FLAGS))
    if native:
        return Choice("bf16", f"auto: bf16, the CPU computes it natively ({', '.join(native)})")
    return Choice("fp32", f"auto: fp32, the CPU has no native bf16 ({' or '.join(NATIVE_BF16_FLAGS)})")


def calibration_texts(corpus: Path | None = None, limit: int = CORPUS_CALIBRATION_TEXTS) -> list[str]:
    """``CALIBRATION_FILE``'s sentences, then the first ``limit`` non-blank lines of ``corpus`` when given.

    Raises:
        OSError: ``corpus`` cannot be read.
    """
    texts = [line for line in CALIBRATION_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    if corpus is not None:
        with corpus.open(encoding="utf-8") as lines:
            taken = 0
            for line in lines:
                if taken >= limit:
                    break
                if line.strip():
                    texts.append(line.rstrip("\n"))
                    taken += 1
    return texts
