"""Capacity search: step the number of Locust users up until the SLA gate fails; report the best passing step.

    python -m loadtest.capacity --users 1,2,4,8,16 --step-s 30 -- --http-port 8000 --grpc-port 8001

Each step is one headless Locust run of ``loadtest/locustfile.py`` (its own process, its own report folder). The
answer is the highest throughput whose run passed the gate: the number an operator sizes a deployment by. Each step
continues the previous step's deck of texts (``--deck-seed``/``--deck-start``), so it does not resend what an
earlier step sent and find it in the response cache.
Exit code 0 when at least one step passed, 1 when none did.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.report import CACHE_WARNING_RATIO, cache_hit_ratio

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Step:
    """One step of the search: ``users`` closed-loop users for one run.

    Attributes:
        users: Locust users; passed: the gate's verdict; exit_code: Locust's exit status.
        throughput_rps: successful requests/s in the window; p50_ms, p99_ms: latency, milliseconds.
        failures, requests: in the window. culprit: the largest stage. line: the gate's verdict line.
        cache_hit_ratio: share of the window's requests answered from the response cache (0..1).
        dealt: one-text requests' texts dealt from the deck by the end of this step, earlier steps' included.
    """

    users: int
    passed: bool
    exit_code: int
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    failures: int
    culprit: str
    line: str
    cache_hit_ratio: float = 0.0
    dealt: int = 0


def run_step(users: int, step_s: float, folder: Path, locust_args: list[str], deck: tuple[int, int] = (0, 0)) -> Step:
    """Run Locust headless with ``users`` users (all spawned in the first second) for ``step_s`` seconds.

    ``deck``: ``(seed, start)`` of the texts' order (``--deck-seed``, ``--deck-start``).

    Raises:
        RuntimeError: Locust wrote no report (it could not start, e.g. a bad option or no server statistics).
    """
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(HERE / "locustfile.py"),
        "--headless",
        "--only-summary",
        "--users",
        str(users),
        "--spawn-rate",
        str(users),
        "--run-time",
        f"{int(step_s)}s",
        "--stop-timeout",
        "10",
        "--report-dir",
        str(folder),
        "--deck-seed",
        str(deck[0]),
        "--deck-start",
        str(deck[1]),
        *locust_args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)  # noqa: S603 - our own argv
    path = folder / "report.json"
    if not path.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"Locust with {users} users wrote no report (exit {done.returncode}):\n{tail}")
    report = json.loads(path.read_text())
    gate = report["gate"]
    return Step(
        users=users,
        passed=bool(gate["passed"]),
        exit_code=done.returncode,
        throughput_rps=gate["throughput_rps"],
        p50_ms=gate["p50_ms"],
        p99_ms=gate["p99_ms"],
        requests=gate["requests"],
        failures=gate["failures"],
        culprit=(report.get("culprit") or {}).get("name", "?"),
        line=gate["line"],
        cache_hit_ratio=cache_hit_ratio(report),
        dealt=report["run"]["deck"]["dealt"],
    )


def best(steps: list[Step]) -> Step | None:
    """The passing step with the highest throughput, or None when no step passed."""
    return max((s for s in steps if s.passed), key=lambda s: s.throughput_rps, default=None)


def markdown(steps: list[Step], sla_note: str) -> str:
    """The search as a markdown table plus the capacity line."""
    lines = [
        f"# Capacity search ({sla_note})",
        "",
        "| users | verdict | req/s | p50 ms | p99 ms | failures | cache hits | largest stage |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in steps:
        verdict = "PASS" if s.passed else "FAIL"
        lines.append(
            f"| {s.users} | {verdict} | {s.throughput_rps:.1f} | {s.p50_ms:.1f} | {s.p99_ms:.1f} | "
            f"{s.failures}/{s.requests} | {100 * s.cache_hit_ratio:.0f}% | {s.culprit} |"
        )
    lines += ["", *verdict_lines(steps)]
    return "\n".join(lines) + "\n"


def verdict_lines(steps: list[Step]) -> list[str]:
    """The capacity line, and the caveats that go with it: the search never failed, or cache hits flattered it."""
    top = best(steps)
    lines = [capacity_line(top)]
    if top is not None and steps[-1].passed:
        lines.append(f"Every step passed: the capacity is at least this; try more users than {steps[-1].users}.")
    if any(s.cache_hit_ratio > CACHE_WARNING_RATIO for s in steps):
        lines.append(
            f"Over {100 * CACHE_WARNING_RATIO:.0f}% of some steps' requests were response-cache hits: those "
            "throughputs flatter the model (restart the server, or use a larger --corpus)."
        )
    return lines


def capacity_line(top: Step | None) -> str:
    """``Capacity: N req/s at U users (p99 X ms)`` or the no-pass line."""
    if top is None:
        return "Capacity: no step passed the SLA gate"
    return f"Capacity: {top.throughput_rps:.1f} req/s at {top.users} users (p99 {top.p99_ms:.1f} ms)"


def main(argv: list[str] | None = None) -> int:
    """Command line; arguments after ``--`` go to every Locust run (ports, ``--sla-ms``, ``--corpus``, ...)."""
    argv = sys.argv[1:] if argv is None else argv
    locust_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m loadtest.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", default="1,2,4,8,16,32", help="user counts to try, ascending, comma-separated")
    parser.add_argument("--step-s", type=float, default=30.0, help="seconds per step (warm-up included)")
    parser.add_argument("--keep-going", action="store_true", help="run every step, not only up to the first FAIL")
    parser.add_argument("--out", type=Path, default=None, help="folder (default loadtest/runs/capacity-<time>/)")
    args = parser.parse_args(own)
    levels = [int(x) for x in args.users.split(",")]
    if levels != sorted(levels) or min(levels) < 1:
        parser.error(f"--users must be ascending positive integers, got {args.users}")
    out = args.out or HERE / "runs" / time.strftime("capacity-%Y%m%d-%H%M%S")
    steps: list[Step] = []
    seed = random.SystemRandom().randrange(2**32)
    for users in levels:
        start = steps[-1].dealt if steps else 0
        step = run_step(users, args.step_s, out / f"users-{users}", locust_args, (seed, start))
        steps.append(step)
        hits = f" [{100 * step.cache_hit_ratio:.0f}% cache hits]" if step.cache_hit_ratio > CACHE_WARNING_RATIO else ""
        print(f"{users:>4} users: {step.line}{hits}", flush=True)
        if not step.passed and not args.keep_going:
            break
    sla = next((locust_args[i + 1] for i, a in enumerate(locust_args[:-1]) if a == "--sla-ms"), "200")
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.md").write_text(markdown(steps, f"SLA p99 {sla} ms, {args.step_s:g} s per step"))
    top = best(steps)
    (out / "capacity.json").write_text(
        json.dumps({"steps": [asdict(s) for s in steps], "best": asdict(top) if top else None}, indent=2)
    )
    print("\n".join(verdict_lines(steps)))
    print(f"Report: {out / 'capacity.md'}")
    return 0 if top is not None else 1


if __name__ == "__main__":
    sys.exit(main())
