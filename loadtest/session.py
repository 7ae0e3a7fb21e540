"""One Locust test run: statistics snapshots, GPU samples, the SLA gate and the report, wired to Locust's events."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from pathlib import Path

import gevent
import numpy as np
import tritonclient.http as httpclient
from triton_embed.server_stats import STEPS, parse, steps

from loadtest import refusals, report
from loadtest.gate import GateResult, Recorder, SlaSpec, evaluate, stretch_line, window
from loadtest.stages import breakdown

log = logging.getLogger("loadtest")
RUNS_DIR = Path(__file__).resolve().parent / "runs"


class StatsSource:
    """Raw ``model_stats`` entries of the ensemble and its steps from Triton's HTTP statistics API.

    ``models``: the model's ensemble, tokenizer and encoder as Triton names them (``server_stats.steps``); the
    snapshots name them ``embed``, ``tokenizer`` and ``encoder`` whatever the model's name, as the stage blame reads.
    """

    def __init__(self, url: str, models: tuple[str, ...] = STEPS) -> None:
        self.url, self.models = url, models

    def snapshot(self) -> dict[str, dict]:
        """``{step: model_stats[0]}`` now (counters since the server started).

        Raises:
            tritonclient.utils.InferenceServerException: the server is unreachable or a model is unknown.
        """
        client = httpclient.InferenceServerClient(self.url, connection_timeout=10, network_timeout=10)
        try:
            return {
                role: client.get_inference_statistics(m)["model_stats"][0]
                for role, m in zip(STEPS, self.models, strict=True)
            }
        finally:
            client.close()


def _gpu_monitor(interval_s: float, metrics_url: str):
    """A started ``triton_embed_monitor.GpuMonitor`` (reading Triton's queue too), or None without a GPU."""
    from triton_embed_monitor import GpuMonitor

    monitor = GpuMonitor(interval_s=interval_s, triton_metrics_url=metrics_url)
    return monitor.start() if monitor.available else None


class LoadRun:
    """Listens to one Locust environment's events and, when a test stops, judges and reports it.

    Timeline of a run: ``test_start`` (statistics snapshot, GPU monitor on) -> users spawn ->
    ``spawning_complete`` -> ``--warmup-s`` seconds -> window start (second snapshot) -> ``test_stop`` (window
    end, last snapshot, gate, report). The gate's verdict sets the exit code at ``quitting``.
    """

    def __init__(self, environment) -> None:
        self.env = environment
        self.opts = environment.parsed_options
        self.recorder = Recorder()
        self.stats = StatsSource(f"{self.opts.triton_host}:{self.opts.http_port}", steps(self.opts.model))
        self.result: GateResult | None = None
        self.folder: Path | None = None
        self._reset()
        events = environment.events
        events.request.add_listener(self.recorder.on_request)
        events.test_start.add_listener(self.on_test_start)
        events.spawning_complete.add_listener(self.on_spawning_complete)
        events.test_stop.add_listener(self.on_test_stop)
        events.quitting.add_listener(self.on_quitting)
        events.quit.add_listener(self.on_quit)

    def _reset(self) -> None:
        self.started_s = time.time()
        self.user_classes: list[str] = []
        self.summary: list[str] = []
        self.window_start_s: float | None = None
        self.snapshots: dict[str, dict[str, dict]] = {}
        self.monitor = None
        self.refusals: refusals.RefusalSampler | None = None

    def spec(self) -> SlaSpec:
        """The limits from the command line (``--sla-ms``, ``--sla-p95-ms``, ``--max-fail-ratio``, ...)."""
        o = self.opts
        return SlaSpec(
            p99_ms=o.sla_ms,
            p95_ms=o.sla_p95_ms if o.sla_p95_ms is not None else o.sla_ms,
            max_fail_ratio=o.max_fail_ratio,
            min_requests=o.min_requests,
        )

    def on_test_start(self, **_) -> None:
        """A new run: forget the last one's samples, snapshot Triton's statistics, start GPU and refusal sampling."""
        self._reset()
        self.recorder.samples.clear()
        self.snapshots["start"] = self.stats.snapshot()
        metrics_url = f"http://{self.opts.triton_host}:{self.opts.metrics_port}/metrics"
        self.monitor = _gpu_monitor(self.opts.gpu_interval_s, metrics_url)
        self.refusals = refusals.RefusalSampler(metrics_url, self.opts.refusals_interval_s).start()

    def on_spawning_complete(self, user_count: int, **_) -> None:
        """All users run: the measured window opens ``--warmup-s`` seconds from now."""
        self.window_start_s = time.time() + self.opts.warmup_s
        self.user_classes = sorted(name for name, n in self.env.runner.user_classes_count.items() if n)
        gevent.spawn_later(self.opts.warmup_s, self._open_window)
        log.info("%d users running; window opens in %.0f s", user_count, self.opts.warmup_s)

    def _open_window(self) -> None:
        self.snapshots["window"] = self.stats.snapshot()

    def on_test_stop(self, **_) -> None:
        """Close the window, judge it, write the report and print the verdict line."""
        end_s = time.time()
        gevent.sleep(0.2)  # let Triton account for the last responses
        try:
            self.snapshots["end"] = self.stats.snapshot()
        except Exception as exc:  # noqa: BLE001 - the gate still judges what the client saw
            log.error("no statistics from Triton at the end of the run (%s): the report has no stage breakdown", exc)
            self.snapshots["end"] = {}
        gpu_samples, episodes = [], []
        if self.monitor is not None:
            from triton_embed_monitor import find_episodes

            self.monitor.stop()
            gpu_samples = self.monitor.samples()
            episodes = find_episodes(gpu_samples, self.monitor.queue_samples())
        refused = self.refusals.stop() if self.refusals is not None else []
        samples = self.recorder.samples
        start_s = self.window_start_s if self.window_start_s is not None else end_s
        try:
            self.result = evaluate(samples, start_s, end_s, self.spec())
        except ValueError as exc:  # the run ended before the window opened
            self.result = GateResult(False, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, (str(exc),), self.spec())
        end, begin = self.snapshots["end"], self.snapshots.get("window", self.snapshots["start"])
        steps_window = {m: parse(end[m], begin[m]) for m in end}
        steps_run = {m: parse(end[m], self.snapshots["start"][m]) for m in end}
        ok = [x.response_ms for x in window(samples, start_s, end_s) if not x.failed]
        stages = breakdown(steps_window, float(np.mean(ok)) if ok else 0.0) if steps_window else []
        o = self.opts
        run = {
            "started": datetime.fromtimestamp(self.started_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "started_s": self.started_s,
            "target": f"{o.triton_host} (HTTP {o.http_port}, gRPC {o.grpc_port}), model {o.model}",
            "users": o.num_users,
            "spawn_rate": o.spawn_rate,
            "warmup_s": o.warmup_s,
            "user_classes": self.user_classes or [c.__name__ for c in self.env.user_classes],
            "corpus": (
                f"{o.corpus or 'STS-B train+dev'} ({len(self.env.corpus)} texts, {len(self.env.deck.texts)} distinct)"
            ),
            "deck": {"seed": self.env.deck.seed, "dealt": self.env.deck.dealt, "wraps": self.env.deck.wraps},
        }
        whole_run = refusals.summary(refused, (self.started_s, float("inf")))
        data = report.build(
            run=run,
            gate=self.result,
            samples=samples,
            window_s=(start_s, end_s),
            steps_run=steps_run,
            steps_window=steps_window,
            stages=stages,
            gpu=report.gpu_summary(gpu_samples, episodes) if gpu_samples else None,
            refusals={
                "timeline": refusals.per_second(refused, self.started_s),
                "window": refusals.summary(refused, (start_s, end_s)),
                "run": whole_run,
            },
        )
        self.folder = Path(o.report_dir) if o.report_dir else RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
        report.write(data, self.folder)
        blamed = data["culprit"]
        self.summary = [self.result.line()]
        if blamed is not None:
            self.summary.append(
                f"Largest stage: {blamed['name']}, {blamed['ms']:.1f} ms ({100 * blamed['share']:.0f}% of the mean)"
            )
        if data["worst_stretch"]:
            self.summary.append(stretch_line(data["worst_stretch"]))
        past_capacity = refusals.past_capacity_line(self.result.failures, whole_run["refused"]) if whole_run else None
        if not self.result.passed and past_capacity:
            self.summary.append(past_capacity)
        hits = report.cache_hit_ratio(data)
        if hits > report.CACHE_WARNING_RATIO:
            wraps = self.env.deck.wraps
            why = (
                f"every text of the corpus had been sent (the deck went round {wraps}x) and came again: use a larger "
                "--corpus"
                if wraps
                else "the server had answered these texts before (an earlier run): restart the server"
            )
            self.summary.append(
                f"Warning: {100 * hits:.0f}% of the requests were response-cache hits (repeated texts), which flatters "
                f"the figures; {why} to measure the model"
            )
        self.summary.append(f"Report: {self.folder / 'report.md'}")
        print("\n".join(self.summary), flush=True)

    def on_quitting(self, environment, **_) -> None:
        """Exit code: 0 when the gate passed, 1 when it failed (Locust's own any-failure rule is replaced)."""
        if self.result is not None:
            environment.process_exit_code = 0 if self.result.passed else 1

    def on_quit(self, **_) -> None:
        """Repeat the verdict after Locust's final statistics tables, so that it is the last thing printed."""
        if self.summary:
            print("\n".join(self.summary), flush=True)
