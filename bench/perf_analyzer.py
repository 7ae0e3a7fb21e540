"""perf_analyzer, Triton's own load generator, as the benchmarks run it (a library: it imports no scenario)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF_ANALYZER = Path(os.environ.get("PERF_ANALYZER", ROOT.parent / "shared" / "tools" / "perf-analyzer"))


@dataclass(frozen=True)
class PerfLevel:
    """One perf_analyzer concurrency level: throughput (infer/s) and p99 (ms); ``error`` when it aborted."""

    concurrency: int
    throughput: float
    p99_ms: float
    error: str = ""

    @property
    def refused(self) -> bool:
        """perf_analyzer stopped on a refusal (not on a measurement that would not settle)."""
        return "overloaded" in self.error

    def outcome(self) -> str:
        """What the table says about refusals at this level."""
        if not self.error:
            return "none"
        return f"refused: {self.error}" if self.refused else f"none; no stable measurement: {self.error}"


def perf_analyzer_path() -> Path | None:
    """perf_analyzer: ``PERF_ANALYZER``, else the one ``../shared/tools`` builds, else on ``PATH``; None when absent."""
    if PERF_ANALYZER.is_file():
        return PERF_ANALYZER
    found = shutil.which("perf_analyzer")
    return Path(found) if found else None


def perf_analyzer_level(grpc_port: int, data: Path, concurrency: int, *, budget_off: bool, tries: int = 2) -> PerfLevel:
    """Run perf_analyzer at one concurrency (count windows of 500 requests, up to 6 trials).

    A level whose measurement does not settle (a noisy machine) is run again, up to ``tries`` times in all.
    """
    csv = data.with_suffix(f".{concurrency}.{int(budget_off)}.csv")
    command = [
        str(PERF_ANALYZER),
        "-m",
        "embed",
        "-i",
        "grpc",
        "-u",
        f"127.0.0.1:{grpc_port}",
        "--input-data",
        str(data),
        "--concurrency-range",
        str(concurrency),
        "--percentile",
        "99",
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        "500",
        "--max-trials",
        "6",
        "--stability-percentage",
        "25",
        "-f",
        str(csv),
    ]
    if budget_off:
        command += ["--request-parameter", "latency_budget_ms:0:int"]
    run = subprocess.run(command, cwd=data.parent, capture_output=True, text=True, timeout=600, check=False)  # noqa: S603
    if run.returncode != 0 or not csv.is_file():
        lines = [line for line in (run.stdout + run.stderr).splitlines() if "error" in line.lower() or "stable" in line]
        error = (lines or [f"exit code {run.returncode}"])[-1][:300]
        failed = PerfLevel(concurrency, float("nan"), float("nan"), error)
        if failed.refused or tries <= 1:
            return failed
        return perf_analyzer_level(grpc_port, data, concurrency, budget_off=budget_off, tries=tries - 1)
    header, row = csv.read_text().splitlines()[:2]
    fields = dict(zip(header.split(","), row.split(","), strict=False))
    return PerfLevel(concurrency, float(fields["Inferences/Second"]), float(fields["p99 latency"]) / 1000)
