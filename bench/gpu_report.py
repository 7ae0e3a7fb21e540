"""Markdown for ``bench/gpu_check.py``'s results: the tables to paste into docs/benchmarks.md's GPU section.

Works on partial results too (a phase that failed or timed out shows as "not measured"), since the report is
rewritten after every phase.
"""

from __future__ import annotations

import math

P99_TARGETS_MS = (20.0, 200.0)
"""The p99 bounds the served throughput is quoted at."""
SERVED_AIM = 0.7
"""Served throughput at p99 <= 20 ms over in-process throughput that the check aims for."""
GRAPH_AIM = 2.0
"""Graph over eager throughput the check aims for at batch <= 8."""


def best_under(levels: list[dict], p99_ms: float) -> dict | None:
    """The sweep level with the highest throughput, p99 at most ``p99_ms`` and no errors; None if none."""
    ok = [lv for lv in levels if lv["requests"] and lv["errors"] == 0 and lv["p99_ms"] <= p99_ms]
    return max(ok, key=lambda lv: lv["throughput"]) if ok else None


def figures(data: dict) -> dict:
    """The headline figures: graph/eager at batch <= 8, in-process throughput, served at each p99 bound and ratios."""
    out: dict = {}
    speed = (data.get("speed") or {}).get("length_32") or []
    small = [r["graph_over_eager"] for r in speed if r["batch"] <= 8]
    out["graph_over_eager_min_batch_le_8"] = min(small) if small else None
    ceiling = (data.get("in-process") or {}).get("throughput")
    out["in_process_per_s"] = ceiling
    levels = (data.get("served") or {}).get("levels") or []
    levels16 = (data.get("served-fp16") or {}).get("levels") or []
    for bound in P99_TARGETS_MS:
        level = best_under(levels, bound)
        out[f"served_p99_le_{bound:g}ms"] = level
        out[f"ratio_p99_le_{bound:g}ms"] = level["throughput"] / ceiling if level and ceiling else None
        level16 = best_under(levels16, bound)
        out[f"served_fp16_p99_le_{bound:g}ms"] = level16
        ratio16 = level16["throughput"] / level["throughput"] if level and level16 else None
        out[f"fp16_over_fp32_p99_le_{bound:g}ms"] = ratio16
    return out


def _fmt(value, spec: str = ".0f", missing: str = "not measured") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def _pair_table(rows: list[dict], names: tuple[str, str]) -> list[str]:
    """Markdown lines of ``gpu_steps.speed_per_batch`` rows of two runners named ``names``; none without rows."""
    if not rows:
        return []
    first, second = names
    return [
        "",
        f"| batch x 32 tokens | {first} texts/s | {second} texts/s | {second} / {first} | {first} p99 ms "
        f"| {second} p99 ms |",
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['batch']} | {r[f'{first}_per_s']:.0f} | {r[f'{second}_per_s']:.0f} "
            f"| {r[f'{second}_over_{first}']:.2f} | {r[f'{first}_p99_ms']:.2f} | {r[f'{second}_p99_ms']:.2f} |"
            for r in rows
        ),
    ]


def markdown(data: dict) -> str:
    """Summary, checks, headline figures, graph vs eager per batch, the served sweep, phases; as markdown."""
    v = data.get("versions") or {}
    where = "DRY RUN on the CPU (rehearsal; not GPU figures)" if data.get("dry_run") else (v.get("gpu") or "GPU")
    lines = [
        f"GPU check: {where}; torch {v.get('torch')} (CUDA {v.get('torch_cuda')}), transformers "
        f"{v.get('transformers')}, sentence-transformers {v.get('sentence_transformers')}, tokenizers "
        f"{v.get('tokenizers')}, numpy {v.get('numpy')}, nvidia-pytriton {v.get('nvidia-pytriton')}, "
        f"Python {v.get('python')}.",
        "",
        "| check | result | figure | limit |",
        "| --- | --- | --- | --- |",
    ]
    for c in data.get("checks", []):
        result = {True: "PASS", False: "**FAIL**", None: "not checked"}[c["ok"]]
        lines.append(f"| {c['name']} | {result} | {c['figure']} | {c['limit']} |")

    f = figures(data)
    ceiling = f["in_process_per_s"]
    in_proc = data.get("in-process") or {}
    lines += [
        "",
        "| figure | value | aim |",
        "| --- | --- | --- |",
        f"| graph / eager throughput, batch <= 8 at 32 tokens (lowest) | "
        f"{_fmt(f['graph_over_eager_min_batch_le_8'], '.2f')}x | >= {GRAPH_AIM:g}x |",
        f"| in-process: tokenizer + runner, batches of {in_proc.get('batch', '?')} | {_fmt(ceiling)} texts/s "
        f"(one text: p50 {_fmt(in_proc.get('single_p50_ms'), '.2f')} ms, p99 "
        f"{_fmt(in_proc.get('single_p99_ms'), '.2f')} ms) | |",
    ]
    for bound in P99_TARGETS_MS:
        level, ratio = f[f"served_p99_le_{bound:g}ms"], f[f"ratio_p99_le_{bound:g}ms"]
        value = (
            f"{level['throughput']:.0f} req/s at concurrency {level['concurrency']} (p99 {level['p99_ms']:.1f} ms); "
            f"{_fmt(ratio, '.2f')}x in-process"
            if level
            else "not met: every level had a higher p99 or errors"
            if (data.get("served") or {}).get("levels")
            else "not measured"
        )
        aim = f">= {SERVED_AIM:g}x in-process" if bound == P99_TARGETS_MS[0] else ""
        lines.append(f"| served `embed`, one text per request, p99 <= {bound:g} ms | {value} | {aim} |")

    for bound in P99_TARGETS_MS:
        level16, ratio16 = f[f"served_fp16_p99_le_{bound:g}ms"], f[f"fp16_over_fp32_p99_le_{bound:g}ms"]
        value = (
            f"{level16['throughput']:.0f} req/s at concurrency {level16['concurrency']} (p99 {level16['p99_ms']:.1f} "
            f"ms); {_fmt(ratio16, '.2f')}x fp32"
            if level16
            else "not measured"
        )
        lines.append(f"| served `embed` at fp16, one text per request, p99 <= {bound:g} ms | {value} | |")

    lines += _pair_table((data.get("speed") or {}).get("length_32") or [], ("eager", "graph"))
    lines += _pair_table((data.get("fp16") or {}).get("length_32") or [], ("fp32", "fp16"))
    served = data.get("served") or {}
    if served.get("levels"):
        batches = (served.get("batches") or {}).get("encoder") or {}
        lines += [
            "",
            f"Served sweep (`--model-config-name={served.get('model_config_name')}`, closed loop, one text per "
            f"request, KServe v2 JSON over HTTP; the encoder ran {_fmt(batches.get('mean_batch'), '.1f')} texts per "
            f"execution on average; ready {served.get('ready_s')} s after start):",
            "",
            "| concurrency | req/s | p50 ms | p99 ms | errors |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {lv['concurrency']} | {lv['throughput']:.0f} | {lv['p50_ms']:.2f} | {lv['p99_ms']:.2f} "
            f"| {lv['errors']} |"
            for lv in served["levels"]
        ]
    knobs = (served.get("admission") or {}).get("knobs") or {}
    if knobs:
        curve = (served.get("admission") or {}).get("curve_ms") or {}
        lines += [
            "",
            "Admission measured on this device: "
            + ", ".join(f"{k} {v['value']:g} ({v['source']})" for k, v in knobs.items())
            + "; service curve: "
            + ", ".join(f"{rows} in {ms:.2f} ms" for rows, ms in curve.items()),
        ]
    runner = data.get("runner") or {}
    if runner.get("load_log"):
        lines += ["", "Runner load: " + "; ".join(runner["load_log"])]
    phases = data.get("phases") or {}
    lines += [
        "",
        "Phases: " + ", ".join(f"{name} {p['status']} ({p.get('seconds', 0):.0f} s)" for name, p in phases.items()),
    ]
    return "\n".join(lines) + "\n"
