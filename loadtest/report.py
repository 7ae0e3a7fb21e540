"""The run folder: ``report.md`` (for people), ``report.json`` (for scripts), ``latency.png``, ``stages.png``."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
from triton_embed.server_stats import StepStats

from loadtest.gate import GateResult, Sample, percentiles, stretch_line, timeline, window, worst_stretch
from loadtest.stages import Stage, culprit

TRITON_FAILURE_COUNTS = 2
"""How many times Triton 2.51's statistics count one failed request of an ensemble (see :func:`build`);
a Triton 2.51 workaround (docs/troubleshooting.md)."""


def by_name(samples: list[Sample]) -> list[dict]:
    """Per ``(request_type, name)``: requests, failures, p50/p99 of the successes (ms), sorted by name."""
    groups: dict[tuple[str, str], list[Sample]] = {}
    for x in samples:
        groups.setdefault((x.request_type, x.name), []).append(x)
    rows = []
    for (kind, name), group in sorted(groups.items()):
        ok = np.array([x.response_ms for x in group if not x.failed])
        p50, p99 = percentiles(ok, [50, 99])
        rows.append(
            {
                "type": kind,
                "name": name,
                "requests": len(group),
                "failures": sum(x.failed for x in group),
                "p50_ms": p50,
                "p99_ms": p99,
            }
        )
    return rows


NUMBER = re.compile(r"\d+(?:\.\d+)?")


def errors(samples: list[Sample], top: int = 10) -> list[dict]:
    """The ``top`` most frequent kinds of failure over the run.

    Failures are grouped by request type, name and message with its numbers taken out: the server's overload
    messages carry the ms waited and the ms needed, so grouping whole messages would leave a count of 1-4 beside
    each of many near-identical lines and hide which cause dominated.

    Returns:
        ``type``, ``name``, ``error`` (class: message, the first of its kind), ``count``, most frequent first.
    """
    counts: dict[tuple[str, str, str], int] = {}
    first: dict[tuple[str, str, str], str] = {}
    for x in samples:
        if x.failed:
            key = (x.request_type, x.name, NUMBER.sub("#", x.error))
            counts[key] = counts.get(key, 0) + 1
            first.setdefault(key, x.error)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [{"type": t, "name": n, "error": first[(t, n, k)], "count": c} for (t, n, k), c in ranked]


CACHE_WARNING_RATIO = 0.10
"""Above this share of response-cache hits, summaries warn that the figures flatter the model."""


def cache_hit_ratio(report: dict) -> float:
    """Response-cache hits / ensemble requests in the window (0.0 without Triton statistics)."""
    embed = report["triton"]["window"].get("embed")
    return embed["cache_hits"] / embed["requests"] if embed and embed["requests"] else 0.0


def gpu_summary(samples, episodes=()) -> list[dict]:
    """Per GPU over the run: samples, mean/max utilisation (%), max memory used (bytes), mean power (W).

    Args:
        samples: ``triton_embed_monitor.GpuSample`` list.
        episodes: ``triton_embed_monitor.Episode`` list (``idle_with_queue``, ``saturated``); each GPU's row lists
            its own as ``{"kind", "start_s", "duration_s"}``.
    """
    per_gpu: dict[int, list] = {}
    for s in samples:
        per_gpu.setdefault(s.index, []).append(s)
    rows = []
    for index, group in sorted(per_gpu.items()):
        util = np.array([s.gpu_util_pct for s in group])
        rows.append(
            {
                "index": index,
                "name": group[0].name,
                "samples": len(group),
                "gpu_util_mean_pct": float(util.mean()),
                "gpu_util_max_pct": float(util.max()),
                "mem_used_max_bytes": max(s.mem_used_bytes for s in group),
                "mem_total_bytes": group[0].mem_total_bytes,
                "power_mean_w": float(np.mean([s.power_w for s in group])),
                "episodes": [
                    {"kind": e.kind, "start_s": e.start, "duration_s": e.duration_s} for e in episodes if e.gpu == index
                ],
            }
        )
    return rows


def build(
    *,
    run: dict,
    gate: GateResult,
    samples: list[Sample],
    window_s: tuple[float, float],
    steps_run: dict[str, StepStats],
    steps_window: dict[str, StepStats],
    stages: list[Stage],
    gpu: list[dict] | None,
    refusals: dict | None = None,
) -> dict:
    """Everything the run measured, as one JSON-ready dict (see ``loadtest/README.md`` for the fields).

    ``refusals``: ``{"timeline": loadtest.refusals.per_second(...), "window": ..., "run": ...}`` (the last two
    ``loadtest.refusals.summary(...)`` of the window and of the whole run), the requests the server refused as
    overloaded (None, or an empty timeline, when it publishes no counter).

    ``count_check`` compares Locust's requests over the whole run with the ensemble's successes plus failures in
    Triton's statistics over the same run: they must agree (within 1%) for the stage breakdown to describe the
    requests the gate judged. Triton 2.51 counts every failed ensemble request twice in ``fail`` and
    ``nv_inference_request_failure`` (docs/troubleshooting.md), so its failures are divided by
    :data:`TRITON_FAILURE_COUNTS`.
    """
    embed = steps_run.get("embed")
    triton_requests = embed.requests + embed.failures // TRITON_FAILURE_COUNTS if embed else None
    blamed = culprit(stages)
    rows = timeline(samples, origin_s=run["started_s"])
    window_t = (window_s[0] - run["started_s"], window_s[1] - run["started_s"])
    return {
        "run": run,
        "gate": gate.as_dict(),
        "window": {"start_s": window_s[0], "end_s": window_s[1]},
        "requests": by_name(window(samples, *window_s)),
        "errors": errors(samples),
        "count_check": {
            "locust_requests": len(samples),
            "triton_requests": triton_requests,
            "relative_difference": abs(len(samples) - triton_requests) / max(1, triton_requests)
            if triton_requests is not None
            else None,
        },
        "triton": {
            "run": {k: v.as_dict() for k, v in steps_run.items()},
            "window": {k: v.as_dict() for k, v in steps_window.items()},
        },
        "stages": [s.as_dict() for s in stages],
        "culprit": blamed.as_dict() if blamed else None,
        "gpu": gpu,
        "refusals": refusals if refusals and refusals.get("timeline") else None,
        "timeline": rows,
        "worst_stretch": worst_stretch(rows, window_t, gate.spec.p99_ms),
    }


def _markdown(report: dict) -> str:
    gate, run, check = report["gate"], report["run"], report["count_check"]
    lines = [
        f"# Load test {run['started']}",
        "",
        f"**{gate['line']}**",
        "",
        f"Target {run['target']}; users {run['users']} ({', '.join(run['user_classes'])}), spawn rate "
        f"{run['spawn_rate']}/s, warm-up {run['warmup_s']:g} s after the last user started; corpus {run['corpus']}.",
        "",
        "## Requests in the window",
        "",
        "| type | name | requests | failures | p50 ms | p99 ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['type']} | {r['name']} | {r['requests']} | {r['failures']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |"
        for r in report["requests"]
    ]
    if report["errors"]:
        lines += ["", "## Failures (whole run, by kind: the message with its numbers aside; most frequent first)", ""]
        lines += ["| type | name | count | error (the first of its kind) |"]
        lines += ["|---|---|---:|---|"]
        lines += [f"| {e['type']} | {e['name']} | {e['count']} | {e['error']} |" for e in report["errors"]]
    lines += [
        "",
        "## Where the time went (mean per request, window)",
        "",
        "| stage | ms | share of client mean |",
        "|---|---:|---:|",
    ]
    lines += [f"| {s['name']} | {s['ms']:.2f} | {100 * s['share']:.0f}% |" for s in report["stages"]]
    lines += _stage_total_lines(report["stages"])
    if report["culprit"]:
        c = report["culprit"]
        lines += ["", f"Largest stage: **{c['name']}**, {c['ms']:.1f} ms ({100 * c['share']:.0f}% of the mean)."]
    if report.get("worst_stretch"):
        lines += [
            "",
            f"{stretch_line(report['worst_stretch'])}: the mean above hides it; see latency.png and the server's log "
            "for those seconds.",
        ]
    lines += [
        "",
        "## Triton statistics per step (window)",
        "",
        "| model | requests | failures | texts | executions | avg batch | queue ms | input ms | infer ms | output ms "
        "| cache hits |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in report["triton"]["window"].items():
        lines.append(
            f"| {name} | {s['requests']} | {s['failures']} | {s['inferences']} | {s['executions']} | "
            f"{s['avg_batch']:.1f} | {s['queue_ms']:.2f} | {s['compute_input_ms']:.2f} | {s['compute_infer_ms']:.2f} "
            f"| {s['compute_output_ms']:.2f} | {s['cache_hits']} |"
        )
    embed = report["triton"]["window"].get("embed")
    if embed and embed["cache_hits"]:
        hits, requests = embed["cache_hits"], embed["requests"]
        lines += [
            "",
            f"{hits} of {requests} requests ({100 * hits / requests:.0f}%)"
            " were answered from the response cache: repeated texts measure the cache, not the model. Use a larger"
            " corpus, or turn `response_cache` off in `embed/config.pbtxt`, to measure the model. The cache sits in"
            " front of the ensemble: the `embed` row counts those requests (its hits column), and the steps never"
            " see them, so the tokenizer's and the encoder's requests are fewer by as many.",
        ]
    if check["triton_requests"] is None:
        lines += ["", "Triton's statistics could not be read at the end of the run: no breakdown, no count check."]
    else:
        lines += [
            "",
            f"Request count check (whole run): Locust {check['locust_requests']}, Triton {check['triton_requests']} "
            f"(difference {100 * check['relative_difference']:.2f}%).",
        ]
    lines += _refusal_lines(report.get("refusals"))
    lines += ["", "## GPU", ""]
    if report["gpu"]:
        lines += ["| GPU | name | samples | util mean % | util max % | memory max MiB | power mean W |"]
        lines += ["|---:|---|---:|---:|---:|---:|---:|"]
        lines += [
            f"| {g['index']} | {g['name']} | {g['samples']} | {g['gpu_util_mean_pct']:.0f} "
            f"| {g['gpu_util_max_pct']:.0f} | {g['mem_used_max_bytes'] / 2**20:.0f} | {g['power_mean_w']:.0f} |"
            for g in report["gpu"]
        ]
        flagged = [
            f"- GPU {g['index']}: **{e['kind']}** for {e['duration_s']:.1f} s"
            for g in report["gpu"]
            for e in g["episodes"]
        ]
        lines += ["", *(flagged or ["No GPU idle while requests waited, no sustained saturation."])]
    else:
        lines.append("No GPU samples (no NVIDIA driver or GPU on the machine that ran Locust).")
    lines += ["", "![latency and throughput](latency.png)", "", "![stages](stages.png)", ""]
    return "\n".join(lines)


def _stage_total_lines(stages: list[dict]) -> list[str]:
    """The breakdown's total row, and why it passes 100% when it does.

    The stages add up to the client's mean, less the steps' own time outside queue and compute, unless a residual
    (ensemble overhead, outside Triton) came out negative and was shown as 0: Triton's statistics and Locust's
    clock count slightly different requests at the window's edges, so the steps' means can exceed the ensemble's
    by a few tenths of a millisecond, and the total then reads ~101%.
    """
    if not stages:
        return []
    total_ms = sum(s["ms"] for s in stages)
    total_share = sum(s["share"] for s in stages)
    lines = [f"| total | {total_ms:.2f} | {100 * total_share:.0f}% |"]
    if total_share >= 1.005:
        lines += [
            "",
            f"The stages add up to {100 * total_share:.1f}% of the client's mean: a residual that came out negative "
            "(Triton's statistics and Locust's clock count slightly different requests at the window's edges) "
            "is shown as 0.",
        ]
    return lines


def _refusal_lines(refusals: dict | None) -> list[str]:
    """The report's "Refusals" section: the requests the server refused as overloaded, in the window and in all."""
    lines = ["", "## Refusals (window)", ""]
    w = refusals["window"] if refusals else None
    if w is None:
        return [
            *lines,
            "No refusal figures: the server publishes no `triton_embed_shed_requests_total` (the "
            "libtorch encoder) or `/metrics` was not readable (`--metrics-port`).",
        ]
    run = refusals["run"]
    return [
        *lines,
        f"The encoder refused {w['refused']} requests as overloaded in the window's {w['window_s']:.0f} s, "
        f"{run['refused']} over the whole run (`triton_embed_shed_requests_total`; per second: the third panel of "
        "`latency.png`).",
    ]


def _plots(report: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["timeline"]
    t = [r["t_s"] for r in rows]
    refused = (report.get("refusals") or {}).get("timeline") or []
    panels = 3 if refused else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3 * panels), sharex=True)
    lat, rps = axes[0], axes[1]
    for key in ("p50_ms", "p95_ms", "p99_ms"):  # a second without a success has no latency: a gap, not a 0
        lat.plot(t, [r[key] if r["rps"] else float("nan") for r in rows], label=key.split("_")[0])
    lat.axhline(report["gate"]["spec"]["p99_ms"], color="red", linestyle="--", label="SLA p99")
    start = report["window"]["start_s"] - report["run"]["started_s"]
    for ax in (lat, rps):
        ax.axvspan(0, start, color="grey", alpha=0.2, label="ramp-up + warm-up" if ax is lat else None)
    lat.set_ylabel("latency (ms)")
    lat.legend(loc="upper right")
    rps.plot(t, [r["rps"] for r in rows], color="black", label="successes/s")
    rps.bar(t, [r["failures"] for r in rows], color="red", label="failures")
    rps.set_ylabel("requests/s")
    rps.legend(loc="upper right")
    if refused:
        _refusal_panel(axes[2], refused)
    axes[-1].set_xlabel("seconds since start")
    fig.suptitle(textwrap.fill(report["gate"]["line"], width=130), fontsize=8)  # the whole verdict, wrapped
    fig.tight_layout()
    fig.savefig(folder / "latency.png", dpi=100)
    plt.close(fig)

    stages = report["stages"]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh([s["name"] for s in stages][::-1], [s["ms"] for s in stages][::-1])
    ax.set_xlabel("mean ms per request (window)")
    ax.set_title("where the time went")
    fig.tight_layout()
    fig.savefig(folder / "stages.png", dpi=100)
    plt.close(fig)


def write(report: dict, folder: Path) -> None:
    """Write ``report.json``, ``report.md``, ``latency.png`` and ``stages.png`` into ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=2))
    (folder / "report.md").write_text(_markdown(report))
    _plots(report, folder)


def _refusal_panel(ax, rows: list[dict]) -> None:
    """Requests the encoder refused as overloaded, per second over the run (bars)."""
    ax.bar([r["t_s"] for r in rows], [r["refused_per_s"] for r in rows], color="red", label="refused by the encoder/s")
    ax.set_ylabel("refusals/s")
    ax.legend(loc="upper left", fontsize=8)
