"""``make model PRECISION=auto`` picks by the hardware it detects (server/triton_embed_server/precision.py)."""

from __future__ import annotations

import pytest
from triton_embed_server.precision import CALIBRATION_FILE, calibration_texts, choose, cpu_flags

EPYC_FLAGS = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}  # an AMD EPYC with AVX-512 BF16
SAPPHIRE_RAPIDS_FLAGS = {"avx512f", "amx_tile", "amx_bf16"}
CASCADE_LAKE_FLAGS = {"avx2", "avx512f", "avx512_vnni"}  # AVX-512 but no bf16 arithmetic


@pytest.mark.parametrize(
    ("requested", "device", "flags", "expected"),
    [
        ("auto", "cpu", EPYC_FLAGS, "bf16"),
        ("auto", "cpu", SAPPHIRE_RAPIDS_FLAGS, "bf16"),
        ("auto", "cpu", CASCADE_LAKE_FLAGS, "fp32"),
        ("auto", "cpu", set(), "fp32"),  # no /proc/cpuinfo: nothing detected, nothing assumed
        ("auto", "gpu", CASCADE_LAKE_FLAGS, "fp16"),
        ("fp32", "cpu", EPYC_FLAGS, "fp32"),
        ("bf16", "cpu", CASCADE_LAKE_FLAGS, "bf16"),  # asked for: the gate, not the hardware, decides
        ("fp16", "gpu", set(), "fp16"),
    ],
)
def test_auto_follows_the_hardware_and_an_explicit_precision_is_kept(requested, device, flags, expected):
    assert choose(requested, device, flags).precision == expected


def test_the_reason_names_what_was_detected():
    assert choose("auto", "cpu", EPYC_FLAGS).reason == "auto: bf16, the CPU computes it natively (avx512_bf16)"
    assert "no native bf16 (avx512_bf16 or amx_bf16)" in choose("auto", "cpu", CASCADE_LAKE_FLAGS).reason
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16, fp16; got 'int8'"):
        choose("int8", "cpu", set())
    with pytest.raises(ValueError, match="device must be one of cpu, gpu; got 'tpu'"):
        choose("auto", "tpu", set())


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512_bf16 sse\nprocessor\t: 1\nflags\t\t: other\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx512_bf16", "sse"}
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.mark.full_install
def test_calibration_texts_are_the_projects_then_the_corpus_head(tmp_path):
    own = calibration_texts()
    assert len(own) >= 150 and all(t.strip() for t in own) and len(set(own)) == len(own)
    assert any(len(t) > 150 for t in own) and any("日本語" in t or "。" in t for t in own)  # long texts, scripts
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("first\n\n  \nsecond\nthird\n")
    assert calibration_texts(corpus, limit=2) == [*own, "first", "second"]
    assert CALIBRATION_FILE.read_text(encoding="utf-8").count("\n") == len(own)
