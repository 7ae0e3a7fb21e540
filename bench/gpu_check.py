"""GPU check of the real artifact: export, graph replay vs eager and CPU, served ensemble vs in-process, GPU monitor.

One run on a CUDA machine (expected under 7 minutes on an H200; every phase has a time limit, the whole run 9
minutes):

1. builds a sentence-transformers folder of all-MiniLM-L6-v2's architecture with random weights (config and tokenizer
   files from ``make gpu-carry``; the trained weights do not travel, and speed does not depend on them) and exports
   it with the project's exporter (``triton_embed_server.export.export``, its self-check included) into a served
   repository of its own at fp32, and with ``PRECISION=auto`` for the GPU config (fp16, through its quality gate)
   into a second one;
2. loads the written ``model.pt`` through ``runners.load_module`` on the GPU; per bucket of the default grid
   (batch 1..64 x length 16..256), graph replay of a ragged batch must equal each row run alone, eagerly on the GPU
   and on the CPU from the same file (max abs diff < 1e-3); graph vs eager throughput per batch at length 32
   (aim: >= 2x for batch <= 8);
3. fp16: per bucket, graph replay of the fp16 file against each row run alone at fp16 and against the fp32 graph
   replay of the same batch (min cosine >= 0.9999), and fp16 against fp32 graph throughput per batch at length 32;
   in-process throughput of tokenizer + graph runner (batches of 64) on the fp32 file;
4. the NVML monitor (``triton_embed_monitor``) must see this GPU's utilisation rise under graph replays;
5. starts the embedded tritonserver with ``--model-config-name=gpu`` on the copy; each text served alone must equal
   the in-process embedding (< 1e-3); a closed-loop sweep of one-text requests (KServe v2 JSON over ``http.client``,
   ``bench/gpu_load.py``) gives the throughput at p99 <= 20 ms and <= 200 ms, and the first over the in-process
   throughput (aim: >= 0.7x); then the same on the fp16 copy (each text against the fp16 graph runner).

Writes ``gpu_check.json``, ``gpu_check.md`` (tables to paste into docs/benchmarks.md) and ``tritonserver.log`` under
``--out``, prints the summary, and exits 1 when a correctness check fails or a phase fails, 2 when the environment
cannot run it (versions are printed first), 3 when the whole run passed its time limit.

On the GPU machine (Python 3.12 with CUDA torch, transformers 5, sentence-transformers, tokenizers and numpy 2;
nothing to download there): ``make gpu-carry`` here puts the pruned nvidia-pytriton wheel, nvidia-ml-py, numpy 1.26.4
for the backend stubs and the MiniLM files under ``.build/gpu-carry`` (56 MiB with the working tree, of the 64 that
may travel); then the device tool's ``run`` with carry ``[".build/gpu-carry"]``, timeout_s 600, and this one line::

    set -o pipefail; I='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target'; $I /tmp/site .build/gpu-carry/wheels/*.whl && $I /tmp/stub-site .build/gpu-carry/stub-wheels/*.whl || exit 1; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; timeout 570 python3 -m bench.gpu_check --carry .build/gpu-carry --stub-path /tmp/stub-site --out $OUT 2>&1 | tee $OUT/gpu_check.log

``--dry-run`` runs every step here on the CPU in ~2 minutes: the same export, the runner eager on
the CPU, tritonserver on the CPU with the default config, a small grid and short levels (tests/test_gpu_check.py).
"""  # noqa: E501 - the device command is one line

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_report, gpu_steps  # noqa: E402


class PhaseTimeout(Exception):
    """A phase ran past its time limit."""


@dataclass(frozen=True)
class Plan:
    """What one run measures and how long each phase may take (seconds)."""

    device: str
    graphs: bool
    batch_sizes: tuple[int, ...]
    lengths: tuple[int, ...]
    calls: int
    in_process_s: float
    single_calls: int
    levels: tuple[int, ...]
    level_s: float
    level_warmup_s: float
    client_processes: int
    monitor_s: float
    model_config_name: str | None
    budget_s: float
    limits: dict[str, float] = field(default_factory=dict)


GPU_PLAN = Plan(
    device="cuda",
    graphs=True,
    batch_sizes=(1, 2, 4, 8, 16, 32, 64),
    lengths=(16, 32, 64, 128, 256),
    calls=200,
    in_process_s=5.0,
    single_calls=200,
    levels=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    level_s=4.0,
    level_warmup_s=1.0,
    client_processes=max(1, min(8, (os.cpu_count() or 2) // 2)),
    monitor_s=8.0,
    model_config_name="gpu",
    budget_s=540.0,
    limits={
        "environment": 90,
        "model": 60,
        "export": 240,
        "runner": 180,
        "speed": 120,
        "fp16": 120,
        "in-process": 60,
        "monitor": 60,
        "served": 200,
        "served-fp16": 200,
    },
)
DRY_PLAN = Plan(
    device="cpu",
    graphs=False,
    batch_sizes=(1, 2, 4),
    lengths=(16, 32),
    calls=5,
    in_process_s=2.0,
    single_calls=10,
    levels=(1, 2),
    level_s=1.5,
    level_warmup_s=0.5,
    client_processes=1,
    monitor_s=1.0,
    model_config_name=None,
    budget_s=480.0,
    limits={
        "environment": 120,
        "model": 60,
        "export": 240,
        "runner": 120,
        "speed": 60,
        "fp16": 120,
        "in-process": 30,
        "monitor": 30,
        "served": 180,
        "served-fp16": 180,
    },
)


class Report:
    """Results, checks and phase timings; written to ``gpu_check.json`` and ``gpu_check.md`` after every phase."""

    def __init__(self, out: Path, plan: Plan, dry_run: bool) -> None:
        self.out = out
        self.data: dict = {"dry_run": dry_run, "plan": asdict(plan), "phases": {}, "checks": []}
        self.lock = threading.Lock()

    def check(self, name: str, ok: bool | None, figure: str, limit: str) -> None:
        """Record a check row; ``ok`` None means not checked (reported, not a failure)."""
        self.data["checks"].append({"name": name, "ok": ok, "figure": figure, "limit": limit})
        print(f"  [{ {True: 'PASS', False: 'FAIL', None: 'NOT CHECKED'}[ok] }] {name}: {figure} (limit {limit})")

    def ok(self, *phases: str) -> bool:
        """True when every named phase ran and finished without an error."""
        return all(self.data["phases"].get(p, {}).get("status") == "ok" for p in phases)

    def run(self, name: str, limit_s: float, step, *, needs: tuple[str, ...] = ()):
        """Run ``step()`` under a ``limit_s`` second alarm; store its dict result under ``name``; never raises.

        Returns:
            The step's result, or None when it failed, timed out or was skipped (a phase it needs did not pass).
        """
        missing = [p for p in needs if not self.ok(p)]
        print(f"== {name} (limit {limit_s:.0f} s)", flush=True)
        if missing:
            self._phase(name, f"skipped: needs {', '.join(missing)}", 0.0)
            return None

        def on_alarm(signum, frame):
            raise PhaseTimeout(f"{name} ran past its {limit_s:.0f} s limit")

        start = time.monotonic()
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit_s)
        try:
            result = step()
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and the run goes on
            signal.setitimer(signal.ITIMER_REAL, 0)
            traceback.print_exc()
            self._phase(name, f"failed: {type(exc).__name__}: {exc}", time.monotonic() - start)
            return None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if result is not None:
            self.data[name] = result
        self._phase(name, "ok", time.monotonic() - start)
        return result

    def _phase(self, name: str, status: str, seconds: float) -> None:
        self.data["phases"][name] = {"status": status, "seconds": round(seconds, 2)}
        print(f"   {name}: {status} ({seconds:.1f} s)", flush=True)
        self.write()

    def failed(self) -> bool:
        """True when a check failed or a phase did not finish."""
        return any(c["ok"] is False for c in self.data["checks"]) or not all(
            p["status"] == "ok" for p in self.data["phases"].values()
        )

    def write(self) -> None:
        """Write both files (safe to call from the watchdog thread)."""
        with self.lock:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
            (self.out / "gpu_check.md").write_text(gpu_report.markdown(self.data))


def versions() -> dict:
    """Python, torch (and its CUDA), transformers, sentence-transformers, tokenizers, numpy, nvidia-pytriton."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict = {"python": platform.python_version(), "executable": sys.executable}
    for name in ("torch", "transformers", "sentence_transformers", "tokenizers", "numpy"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
            out[name] = None
            out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
    for dist in ("nvidia-pytriton", "nvidia-ml-py"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    if out["torch"]:
        import torch

        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        out["gpu"] = torch.cuda.get_device_name(0) if out["cuda_available"] else None
    return out


def _major_minor(text: str) -> tuple[int, int]:
    parts = (text.split("+", maxsplit=1)[0].split(".") + ["0"])[:2]
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def version_problems(found: dict, *, need_cuda: bool) -> list[str]:
    """Why these versions cannot run the check (empty when they can); each line names what was found."""
    problems = [f"{name} cannot be imported: {found[f'{name}_error']}" for name in found if f"{name}_error" in found]
    if found.get("torch") and _major_minor(found["torch"]) < (2, 1):
        problems.append(f"torch {found['torch']}: CUDA graph capture as the runner does it needs torch 2.1 or newer")
    if found.get("transformers") and _major_minor(found["transformers"])[0] < 5:
        problems.append(
            f"transformers {found['transformers']}: the exporter is tested with transformers 5 (its attention mask "
            "builders and SDPA tracing); carry a transformers 5 wheel"
        )
    if not found.get("nvidia-pytriton"):
        problems.append("nvidia-pytriton is not installed: pip install --no-deps the carried wheel")
    if need_cuda and found.get("torch") and not found.get("cuda_available"):
        problems.append(f"torch {found['torch']} (CUDA {found.get('torch_cuda')}) sees no CUDA device")
    return problems


def environment(report: Report, dry_run: bool) -> dict:
    """Print versions; fail on any that cannot work; find the pytriton stub and its libraries."""
    found = versions()
    report.data["versions"] = found
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items() if not k.endswith("_error")), flush=True)
    problems = version_problems(found, need_cuda=not dry_run)
    if problems:
        raise RuntimeError("this environment cannot run the check:\n  " + "\n  ".join(problems))
    from triton_embed_server.layout import find_layout

    layout = find_layout()
    missing = gpu_steps.stub_libraries_missing()
    result = {"pytriton": str(layout.root.parent), "stub": str(layout.stub()), "stub_libraries_missing": missing}
    if missing:
        result["warning"] = (
            f"the Python backend stub cannot find {', '.join(missing)}: tritonserver will not load the models "
            "(the served phase fails; the others run)"
        )
        print("WARNING: " + result["warning"], flush=True)
    return result


def start_watchdog(report: Report, budget_s: float) -> threading.Timer:
    """After ``budget_s`` seconds: write what was measured, say so, exit 3 (tritonserver dies with us)."""

    def expire() -> None:
        report.data["phases"]["whole run"] = {"status": f"failed: ran past its {budget_s:.0f} s limit"}
        report.write()
        print(
            f"gpu_check: the whole run passed its {budget_s:.0f} s limit; partial results in {report.out}", flush=True
        )
        os._exit(3)

    timer = threading.Timer(budget_s, expire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915 - one phase after another, read top to bottom
    """Run every phase, write the report, print the summary; see the module docstring for the exit codes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"), help="folder for the report files")
    parser.add_argument("--carry", type=Path, default=ROOT / ".build" / "gpu-carry", help="make gpu-carry's folder")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    parser.add_argument("--dry-run", action="store_true", help="rehearse on the CPU: small grid, short levels")
    parser.add_argument(
        "--stub-path",
        type=Path,
        default=None,
        help="folder put first on the Python backend stubs' path only (numpy 1.26.4 on a machine with numpy 2)",
    )
    args = parser.parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    report = Report(args.out, plan, args.dry_run)
    watchdog = start_watchdog(report, plan.budget_s)
    limits = plan.limits
    print(f"gpu_check {'DRY RUN on the CPU' if args.dry_run else 'on the GPU'}; work folder {work}", flush=True)

    if report.run("environment", limits["environment"], lambda: environment(report, args.dry_run)) is None:
        watchdog.cancel()
        report.write()
        return 2

    import torch
    from buckets import BucketTable, GraphSettings
    from runners import BucketedRunner, load_module

    device = torch.device(plan.device, 0) if plan.device == "cuda" else torch.device("cpu")
    state = types.SimpleNamespace()
    folder = work / "minilm-random"
    repo = work / "model_repository"
    repo16 = work / "model_repository-fp16"

    report.run(
        "model", limits["model"], lambda: gpu_steps.build_random_model(gpu_steps.minilm_source(args.carry), folder)
    )

    def export_step() -> dict:
        from triton_embed_server.encoder_module import device_problems
        from triton_embed_server.export import MAX_ABS_DIFF, export

        for folder_ in (repo, repo16):
            shutil.rmtree(folder_, ignore_errors=True)
        manifest = export(folder, repo, force=True, precision="fp32")
        manifest16 = export(folder, repo16, force=True, precision="auto", device="gpu")
        gpu_steps.cache_off(repo)
        gpu_steps.cache_off(repo16)
        written = repo / "encoder" / "1" / "model.pt"
        pinned = device_problems(torch.jit.load(str(written), map_location="cpu"))
        pinned += device_problems(torch.jit.load(str(repo16 / "encoder" / "1" / "model.pt"), map_location="cpu"))
        report.check(
            "PRECISION=auto for the GPU config: fp16 through the exporter's gate (min cosine to fp32, on the CPU)",
            manifest16.precision == "fp16",
            f"{manifest16.precision}, min cosine {manifest16.min_cosine:.6f}",
            f"fp16, >= {gpu_steps.MIN_COSINE_FP16:g}",
        )
        report.check(
            "export with the project's exporter (its self-check vs sentence-transformers)",
            manifest.max_abs_diff < MAX_ABS_DIFF,
            f"max abs diff {manifest.max_abs_diff:.2g}",
            f"< {MAX_ABS_DIFF:g}",
        )
        report.check("device constants in the written model.pt files", not pinned, "; ".join(pinned) or "none", "none")
        return {
            "exporter": f"{export.__module__}.{export.__qualname__}",
            "manifest": asdict(manifest),
            "manifest_fp16": asdict(manifest16),
            "model_pt_bytes": written.stat().st_size,
            "tokenizer_json": str(repo / "tokenizer" / "1" / "tokenizer.json"),
            "device_problems": pinned,
        }

    report.run("export", limits["export"], export_step, needs=("model",))

    def runner_step() -> dict:
        path = repo / "encoder" / "1" / "model.pt"
        state.module = load_module(path, device)
        state.module_cpu = load_module(path, torch.device("cpu"))
        table = BucketTable.grid(plan.batch_sizes, plan.lengths)
        lines: list[str] = []
        state.graph = BucketedRunner(state.module, device, GraphSettings(plan.graphs, table, False), log=lines.append)
        state.graph.warmup()
        state.eager = BucketedRunner(state.module, device, GraphSettings(False, table, False), log=lines.append)
        state.eager.warmup()
        diffs = gpu_steps.check_buckets(state.graph, state.module, device, state.module_cpu)
        path_name = "graph replay" if state.graph.use_graphs else "bucketed eager (no graphs on the CPU)"
        report.check(
            f"{path_name} vs each row eager on {device.type}, per bucket",
            diffs["worst_vs_eager"] < gpu_steps.MAX_DIFF,
            f"worst {diffs['worst_vs_eager']:.2g} over {len(diffs['vs_eager'])} buckets",
            f"< {gpu_steps.MAX_DIFF:g}",
        )
        report.check(
            f"{path_name} vs each row on the CPU, same file",
            diffs["worst_vs_cpu"] < gpu_steps.MAX_DIFF,
            f"worst {diffs['worst_vs_cpu']:.2g} over {len(diffs['vs_cpu'])} buckets",
            f"< {gpu_steps.MAX_DIFF:g}",
        )
        return {"device": str(device), "graphs": state.graph.use_graphs, "load_log": lines, **diffs}

    report.run("runner", limits["runner"], runner_step, needs=("export",))
    report.run(
        "speed",
        limits["speed"],
        lambda: {
            "length_32": gpu_steps.speed_per_batch(state.eager, state.graph, list(plan.batch_sizes), calls=plan.calls)
        },
        needs=("runner",),
    )

    def fp16_step() -> dict:
        state.module16 = load_module(repo16 / "encoder" / "1" / "model.pt", device)
        lines: list[str] = []
        state.graph16 = BucketedRunner(
            state.module16, device, GraphSettings(plan.graphs, state.graph.table, False), log=lines.append
        )
        state.graph16.warmup()
        checked = gpu_steps.check_fp16(state.graph16, state.module16, state.graph, device)
        path_name = "graph replay" if state.graph16.use_graphs else "bucketed eager"
        report.check(
            f"fp16 {path_name} vs each row alone at fp16 on {device.type}, per bucket (min cosine)",
            checked["worst_vs_eager_fp16"] >= gpu_steps.MIN_COSINE_FP16,
            f"worst {checked['worst_vs_eager_fp16']:.6f} over {len(checked['vs_eager_fp16'])} buckets",
            f">= {gpu_steps.MIN_COSINE_FP16:g}",
        )
        report.check(
            f"fp16 vs fp32 {path_name}, same batches, per bucket (min cosine)",
            checked["worst_vs_fp32"] >= gpu_steps.MIN_COSINE_FP16,
            f"worst {checked['worst_vs_fp32']:.6f} over {len(checked['vs_fp32'])} buckets",
            f">= {gpu_steps.MIN_COSINE_FP16:g}",
        )
        speed = gpu_steps.speed_per_batch(
            state.graph, state.graph16, list(plan.batch_sizes), calls=plan.calls, names=("fp32", "fp16")
        )
        return {"load_log": lines, "length_32": speed, **checked}

    report.run("fp16", limits["fp16"], fp16_step, needs=("runner", "export"))

    texts = gpu_steps.make_texts(folder / "vocab.txt", 4096) if (folder / "vocab.txt").is_file() else []

    def in_process_step() -> dict:
        state.tokenizer = gpu_steps.load_tokenizer(repo)
        batch = max(plan.batch_sizes)
        return gpu_steps.in_process(
            state.graph, state.tokenizer, texts, batch=batch, seconds=plan.in_process_s, single_calls=plan.single_calls
        )

    report.run("in-process", limits["in-process"], in_process_step, needs=("runner",))

    def monitor_step() -> dict:
        from bench.gpu_monitor import check_monitor

        biggest = max(state.graph.table.buckets, key=lambda b: b.tokens)
        ids = torch.randint(1000, 29000, (biggest.batch_size, biggest.length)).numpy()
        mask = ids * 0 + 1

        def load() -> None:
            end = time.monotonic() + plan.monitor_s
            while time.monotonic() < end:
                state.graph(ids, mask)

        result = check_monitor(load, device)
        result["load"] = f"{biggest} for {plan.monitor_s:g} s"
        if result["checked"]:
            figure = f"idle {result['idle_util_pct_mean']:.0f}% -> {result['load_util_pct_mean']:.0f}% under load"
        else:
            figure = result["reason"]
        report.check("GPU monitor sees the load", result["ok"] if result["checked"] else None, figure, "+20 points")
        return result

    report.run("monitor", limits["monitor"], monitor_step, needs=("runner",))

    from triton_embed_server import embedded

    if args.stub_path is not None:
        embedded.server_environment = gpu_steps.with_stub_path(embedded.server_environment, args.stub_path)

    def served_step(repository: Path, runner_name: str, log_name: str, phase: str) -> dict:
        runner = getattr(state, runner_name)
        log = work / log_name
        server = embedded.EmbeddedServer(
            model_repository=repository,
            http_port=0,
            grpc_port=0,
            metrics_port=0,
            log_file=log,
            model_config_name=plan.model_config_name,
        )
        result: dict = {"model_config_name": plan.model_config_name, "stub_path": str(args.stub_path or "")}
        start = time.monotonic()
        server.start()
        try:
            server.wait_ready(timeout_s=limits[phase] / 2)
            result["ready_s"] = round(time.monotonic() - start, 1)
            print(f"   tritonserver ready in {result['ready_s']} s ({server.http_url})", flush=True)
            same = gpu_steps.served_equals_in_process(
                server.http_url, runner, state.tokenizer, gpu_steps.check_texts(texts)
            )
            result["equality"] = same
            precision = json.loads((repository / "encoder" / "1" / "export.json").read_text())["precision"]
            result["precision"] = precision
            report.check(
                f"served at {precision} (one text per request) vs in-process, same file and device",
                same["max_abs_diff"] < gpu_steps.MAX_DIFF,
                f"max abs diff {same['max_abs_diff']:.2g} over {same['texts']} texts",
                f"< {gpu_steps.MAX_DIFF:g}",
            )
            texts_file = work / "texts.json"
            texts_file.write_text(json.dumps(texts))
            left = limits[phase] - (time.monotonic() - start) - 20
            result.update(gpu_steps.run_sweep(server.http_url, texts_file, plan, timeout_s=max(10.0, left)))
            result["batches"] = gpu_steps.encoder_batches(server.http_url)
            result["admission"] = gpu_steps.admission(server.metrics_url)
        finally:
            result["exit_code"] = server.stop()
            if log.is_file():
                shutil.copyfile(log, report.out / log_name)
        return result

    report.run(
        "served",
        limits["served"],
        lambda: served_step(repo, "graph", "tritonserver.log", "served"),
        needs=("in-process",),
    )
    report.run(
        "served-fp16",
        limits["served-fp16"],
        lambda: served_step(repo16, "graph16", "tritonserver-fp16.log", "served-fp16"),
        needs=("in-process", "fp16"),
    )
    watchdog.cancel()
    report.write()
    print("\n" + gpu_report.markdown(report.data), flush=True)
    return 1 if report.failed() else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
