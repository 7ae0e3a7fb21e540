"""``make tune``: a capacity search on this machine, model and texts, written into the served configuration.

The encoder measures what it can at load (its service curve, and from it the door and the bulk lane:
docs/overload.md). What a running server cannot change about itself is searched here: the encoder's instance count
and torch threads per instance (their product the cores the server may use), the dynamic batcher's queue delay, and
the length bucket grid (x1.5 or x2 steps). Each candidate is served from a copy of the model repository, with the
door and the lane off so that the sweep sees the machine's own curve, and swept in a closed loop of one-text requests
(texts never sent before); its figure is the best throughput whose p99 stays within ``--sla-ms``. perf_analyzer
measures where it is installed (``PERF_ANALYZER``, else ``../shared/tools/perf-analyzer``), the bench client
(``bench/loadgen.py``) otherwise or with ``--tool client``. The best candidate's values are written into
``<repository>/encoder/config.pbtxt`` (instance ``count``, ``TORCH_NUM_THREADS``, ``max_queue_delay_microseconds``,
the ``graph_spec`` lengths) with the table of figures in the header comment above them; a later re-export (``make
model`` after the model, the exporter or the templates changed) writes the config from its template again.

    make tune                                # STS-B sentences; CORPUS=file.txt for your own, one text a line
    python -m bench.tune --tool client --levels 4,8,16 --seconds 5 --dry-run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "make tune:"
"""Every header line ``make tune`` writes into the config starts with this (after its ``#``); a later run replaces
them."""


@dataclass(frozen=True)
class Candidate:
    """One served configuration of the encoder.

    Attributes:
        instances: the instance group's ``count``.
        threads: ``TORCH_NUM_THREADS`` per instance.
        delay_us: the dynamic batcher's ``max_queue_delay_microseconds``.
        half_steps: the length buckets in x1.5 steps (8, 16, 24, 32, 48, ...; as ``make model`` writes them), or
            powers of two only (8, 16, 32, ...).
    """

    instances: int
    threads: int
    delay_us: int
    half_steps: bool = True

    def label(self) -> str:
        """``2 x 1 threads, delay 0 us, buckets x1.5``."""
        grid = "x1.5" if self.half_steps else "x2"
        return f"{self.instances} x {self.threads} threads, delay {self.delay_us} us, buckets {grid}"


@dataclass(frozen=True)
class Figure:
    """A candidate's best level within the SLA: throughput (req/s, one text each), p99 (ms) and its concurrency."""

    throughput: float
    p99_ms: float
    concurrency: int


def candidates(
    cores: int, instances: list[int], delays_us: list[int], grids: tuple[bool, ...] = (True,)
) -> list[Candidate]:
    """Every instance count in ``instances`` that divides ``cores`` (threads = cores / count), at every delay and grid.

    ``grids``: ``half_steps`` values to try (:class:`Candidate`).
    """
    counts = [n for n in instances if 1 <= n <= cores and cores % n == 0] or [1]
    return [Candidate(n, cores // n, delay, half) for n in counts for delay in delays_us for half in grids]


def set_encoder(config, candidate: Candidate, max_seq_length: int) -> None:
    """Set ``candidate``'s values in the encoder's config (a ``model_config.ModelConfig``).

    ``max_seq_length``: the exported model's, the last bucket length.

    Raises:
        ValueError: the config lacks one of the values (one instance group, ``TORCH_NUM_THREADS``, a dynamic
            batcher).
    """
    from triton_embed_server import model_config

    model_config.set_instances(config, candidate.instances)
    model_config.set_parameter(config, "TORCH_NUM_THREADS", str(candidate.threads))
    model_config.set_queue_delay(config, candidate.delay_us)
    lengths = model_config.cpu_bucket_lengths(max_seq_length, half_steps=candidate.half_steps)
    model_config.set_bucket_lengths(config, lengths)


def write_encoder(path: Path, candidate: Candidate, max_seq_length: int, comment: list[str] | None = None) -> None:
    """Write ``candidate`` into the encoder's config ``path``, and ``comment`` into its header (each line after MARK).

    A header's earlier ``make tune`` lines are replaced; its other lines stay.

    Raises:
        ValueError: ``path`` is not a config, or it lacks a value :func:`set_encoder` sets.
    """
    from triton_embed_server import model_config

    config = model_config.read(path)
    set_encoder(config, candidate, max_seq_length)
    kept = [line for line in model_config.header(path) if not line.startswith(MARK)]
    model_config.write(path, config, kept + [f"{MARK} {line}".rstrip() for line in comment or []])


def candidate_repository(dst: Path, candidate: Candidate, source: Path) -> Path:
    """A copy of ``source`` serving ``candidate``, the door and the lane off, the response cache off."""
    from bench.serving import variant_repository

    knobs = {("encoder", "MAX_IN_FLIGHT"): "0", ("encoder", "BULK_IN_FLIGHT"): "0"}
    repo = variant_repository(dst, None, knobs=knobs, source=source)
    write_encoder(repo / "encoder" / "config.pbtxt", candidate, max_seq_length(source))
    return repo


def max_seq_length(repository: Path) -> int:
    """The exported encoder's ``max_seq_length`` (its ``1/export.json``; ``make model`` writes it).

    Raises:
        FileNotFoundError: the repository holds no exported encoder.
    """
    import json

    return int(json.loads((repository / "encoder" / "1" / "export.json").read_text())["max_seq_length"])


def sweep(server, texts: list[str], *, levels: list[int], seconds: float, sla_ms: float, tool: str, scratch: Path):
    """Closed loops of one-text requests at each level, stopping past 2x the SLA; ``[(concurrency, req/s, p99)]``."""
    from bench.loadgen import closed_loop, grpc_sender

    out = []
    for k, concurrency in enumerate(levels):
        if tool == "perf_analyzer":
            import json

            from bench.perf_analyzer import perf_analyzer_level
            from bench.perf_data import perf_analyzer_data

            data = scratch / f"texts-{k}.json"
            data.write_text(json.dumps(perf_analyzer_data(texts[k * 20_000 : (k + 1) * 20_000])))
            level = perf_analyzer_level(int(server.grpc_url.rsplit(":", 1)[1]), data, concurrency, budget_off=False)
            row = (concurrency, level.throughput, level.p99_ms)
        else:
            part = texts[k * 20_000 : (k + 1) * 20_000]
            level = closed_loop(lambda: grpc_sender(server.grpc_url), part, concurrency, seconds)
            row = (concurrency, level.throughput, level.p99_ms if not level.errors else float("nan"))
        print(f"    concurrency {row[0]:3d}: {row[1]:7.1f} req/s, p99 {row[2]:7.1f} ms", flush=True)
        out.append(row)
        if not row[2] <= 2 * sla_ms:
            break
    return out


def best(rows: list[tuple[int, float, float]], sla_ms: float) -> Figure | None:
    """The level of highest throughput whose p99 is within ``sla_ms``; None when none is."""
    within = [Figure(rate, p99, c) for c, rate, p99 in rows if p99 <= sla_ms]
    return max(within, key=lambda f: f.throughput, default=None)


def main(argv: list[str] | None = None) -> int:
    """Serve and sweep every candidate, print the table, write the best into the repository's encoder config."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repository",
        type=Path,
        default=ROOT / ".build" / "model_repository",
        help="the served repository whose embed model to tune (make model writes it)",
    )
    parser.add_argument("--corpus", default=None, help="texts, one a line (default: STS Benchmark train + dev)")
    parser.add_argument("--levels", default="4,8,16,24,32,48,64", help="closed-loop concurrencies")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per level (bench client)")
    parser.add_argument("--instances", default="1,2", help="instance counts to try (each must divide the cores)")
    parser.add_argument("--delays-us", default="0,2000", help="dynamic batcher queue delays to try, microseconds")
    parser.add_argument("--buckets", default="x1.5,x2", help="length bucket grids to try: x1.5 and/or x2 steps")
    parser.add_argument("--sla-ms", type=float, default=200.0, help="the p99 target, ms")
    parser.add_argument("--tool", choices=("auto", "perf_analyzer", "client"), default="auto")
    parser.add_argument("--dry-run", action="store_true", help="print the table, write nothing")
    args = parser.parse_args(argv)
    from triton_embed_protocol.cpu import usable_cores
    from triton_embed_server.embedded import EmbeddedServer

    from bench.perf_analyzer import perf_analyzer_path
    from bench.perf_data import unique_texts

    cores = usable_cores()[0]  # the server it starts inherits this process's affinity and cgroup
    tool = args.tool
    if tool == "auto":
        tool = "perf_analyzer" if perf_analyzer_path() else "client"
    levels = [int(x) for x in args.levels.split(",")]
    grids = tuple(dict.fromkeys(step.strip() == "x1.5" for step in args.buckets.split(",")))
    tried = candidates(
        cores, [int(x) for x in args.instances.split(",")], [int(x) for x in args.delays_us.split(",")], grids
    )
    print(f"make tune: {len(tried)} candidates on {cores} cores, {tool}, p99 target {args.sla_ms:g} ms", flush=True)
    figures: dict[Candidate, Figure | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, candidate in enumerate(tried):
            print(f"  {candidate.label()}:", flush=True)
            repo = candidate_repository(Path(tmp) / f"repo-{n}", candidate, args.repository)
            texts = unique_texts(20_000 * len(levels), f"tune{n}-{os.getpid()}", args.corpus)
            with EmbeddedServer(
                model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=Path(tmp) / f"log-{n}"
            ) as server:
                rows = sweep(
                    server, texts, levels=levels, seconds=args.seconds, sla_ms=args.sla_ms, tool=tool, scratch=Path(tmp)
                )
                figures[candidate] = best(rows, args.sla_ms)
    lines = [f"best closed-loop throughput of one-text requests at p99 <= {args.sla_ms:g} ms ({tool}, {cores} cores):"]
    for candidate, figure in figures.items():
        said = (
            "none within the target"
            if figure is None
            else f"{figure.throughput:.0f} req/s at p99 {figure.p99_ms:.0f} ms, {figure.concurrency} concurrent"
        )
        lines.append(f"  {candidate.label()}: {said}")
    print("\n".join(lines))
    ranked = [(f.throughput, c) for c, f in figures.items() if f is not None]
    if not ranked:
        print("make tune: no candidate met the target; the config is left as it is", file=sys.stderr)
        return 1
    chosen = max(ranked, key=lambda pair: pair[0])[1]
    print(f"chosen: {chosen.label()}")
    if not args.dry_run:
        config = args.repository / "encoder" / "config.pbtxt"
        comment = [*lines, f"chosen: {chosen.label()}"]
        write_encoder(config, chosen, max_seq_length(args.repository), comment)
        print(f"written: {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
