"""Render every figure of README.md and docs/*.md from the committed results files.

A document holds, for each rendered piece, a pair of markers:

    <!-- render: NAME FILE [FILE ...] -->
    ...whatever the renderer NAME makes of the files (replaced on --write)...
    <!-- end render -->

``python benchmarks/readme_tables.py --write`` rewrites every such piece; ``--check`` (what the CPU suite runs,
``tests/test_readme.py``) exits 1 and names the pieces whose text differs from a fresh rendering. Every table
ends with its source: the file, the commit that produced it and the command. A sentence that states a range
computes it here (``range-*`` renderers).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"(<!-- render: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- end render -->)", re.S)
OPS = {"all_reduce": "gemm_all_reduce", "reduce_scatter": "gemm_reduce_scatter", "all_gather": "all_gather_gemm"}


def _load(path: str) -> dict:
    with open(ROOT / path) as f:
        return json.load(f)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _e(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:+.2f}"


def _source(path: str, data: dict) -> str:
    meta = data["meta"]
    return (f"<sub>Source: `{path}` ({meta['gpus']}, {meta['setting']}, torch {meta['torch']}, commit "
            f"`{str(meta['commit'])[:10]}`): `{meta['command'].strip()}`.</sub>")


def efficiency(t_seq: float, t: float, t_ideal: float) -> float:
    return (t_seq - t) / (t_seq - t_ideal) if t_seq > t_ideal else float("nan")


def _auto(row: dict) -> dict:
    """What a plain call got: the row's ``auto`` entry, or (files from before it existed) the row itself."""
    if "auto" in row:
        return row["auto"]
    return {"t_ms": row["t_ms"], "E": row["E"], "path": row["path"],
            "host_us": (row.get("host_us") or {}).get("ours")}


def ops_table(path: str) -> str:
    """One row per op and shape: what ``path="auto"`` gave, beside sequential, decomposition and async TP."""
    data = _load(path)
    lines = ["| op | M, N, K | T_seq | best decomp. | async TP | **ours** (path) | speedup | E | E async TP "
             "| host µs seq / ours |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    seen = set()
    for row in data["rows"]:
        key = (row["op"], row["M"], row["N"], row["K"])
        if key in seen:  # a shape's P2P row repeats the baselines of its NCCL row
            continue
        seen.add(key)
        auto, base = _auto(row), row["baselines"]
        tp = base.get("async_tp_ms")
        host = row.get("host_us") or {}
        lines.append(
            f"| {OPS[row['op']]} | {row['M']}, {row['N']}, {row['K']} | {_ms(row['t_seq_ms'])} "
            f"| {_ms(base['decomposition_ms'])} | {_ms(tp)} | **{_ms(auto['t_ms'])}** ({auto['path']}) "
            f"| {row['t_seq_ms'] / auto['t_ms']:.2f}x | {_e(auto['E'])} "
            f"| {_e(efficiency(row['t_seq_ms'], tp, row['t_ideal_ms']) if tp else None)} "
            f"| {host.get('seq', float('nan')):.0f} / {auto['host_us'] or float('nan'):.0f} |")
    return "\n".join(lines) + "\n\n" + _source(path, data)


def block_table(path: str) -> str:
    """The transformer block: each implementation's step time, and E_block = share of the communication bound won."""
    data = _load(path)
    lines = ["| mode | tokens | PyTorch TP | no communication | async TP (compiled) | **ours eager** "
             "| **ours compiled** | E_block eager | E_block compiled |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        bound = row["t_torch_ms"] - row["t_nocomm_ms"]

        def e_block(t, bound=bound, row=row):
            return None if t is None or bound <= 0 else (row["t_torch_ms"] - t) / bound

        lines.append(
            f"| {row['mode']} | {row['tokens']} | {_ms(row['t_torch_ms'])} | {_ms(row['t_nocomm_ms'])} "
            f"| {_ms(row['t_async_tp_ms'])} | **{_ms(row['t_ours_eager_ms'])}** | **{_ms(row['t_ours_compiled_ms'])}** "
            f"| {_e(e_block(row['t_ours_eager_ms']))} | {_e(e_block(row['t_ours_compiled_ms']))} |")
    return "\n".join(lines) + "\n\n" + _source(path, data)


def e_range(path: str, op: str, path_name: str = "auto") -> str:
    """``lo..hi`` of E over a file's shapes of ``op`` (``auto``: what plain calls got; else that path's rows)."""
    data = _load(path)
    values = []
    for row in data["rows"]:
        if row["op"] != op:
            continue
        if path_name == "auto":
            if row["path"] == "nccl":  # every shape has an NCCL row, which carries what plain calls got
                values.append(_auto(row)["E"])
        elif row["path"] == path_name:
            values.append(row["E"])
    return f"{min(values):+.2f}..{max(values):+.2f}"


def host_ratio_range(path: str) -> str:
    """``lo..hi`` of ours/sequential host time per call over a file's rows (plain calls)."""
    data = _load(path)
    ratios = [_auto(r)["host_us"] / r["host_us"]["seq"] for r in data["rows"]
              if r["path"] == "nccl" and r.get("host_us") and _auto(r)["host_us"]]
    return f"{min(ratios):.1f}x..{max(ratios):.1f}x"


def sub_band_table(path: str) -> str:
    """The P2P ring's sub-band sweep: E per sub-band count at each grid shape."""
    data = _load(path)
    counts = sorted({int(s) for row in data["rows"] for s in row["E"]})
    lines = ["| op | M, N, K | " + " | ".join(f"S={s}" for s in counts) + " | async TP |",
             "| --- | --- | " + " | ".join("---" for _ in counts) + " | --- |"]
    for row in data["rows"]:
        cells = " | ".join(_e(row["E"].get(str(s))) for s in counts)
        lines.append(f"| {OPS[row['op']]} | {row['M']}, {row['N']}, {row['K']} | {cells} | {_e(row['E_async_tp'])} |")
    return "\n".join(lines) + f"\n\n<sub>Source: `{path}` (commit `{str(data['commit'])[:10]}`): " \
        "`torchrun --nproc-per-node 2 benchmarks/diagnostics/p2p_sub_bands.py`.</sub>"


def paths_table(path: str) -> str:
    """Every row of a benchmark file: each path's T and E, plan and host time, beside the same baselines."""
    data = _load(path)
    lines = ["| op | path | M, N, K | T_gemm | T_comm | T_seq | T | E | plan | host µs seq / T |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        plan = row["plan"]
        what = "sequential" if plan["sequential"] else f"{plan['groups']} groups" + (
            ", cuBLAS" if plan.get("gemm") == "cublas" else f", {plan['programs']} programs")
        host = row.get("host_us") or {}
        lines.append(
            f"| {OPS[row['op']]} | {row['path']} | {row['M']}, {row['N']}, {row['K']} | {_ms(row['t_gemm_ms'])} "
            f"| {_ms(row['t_comm_ms'])} | {_ms(row['t_seq_ms'])} | {_ms(row['t_ms'])} | {_e(row['E'])} | {what} "
            f"| {host.get('seq', float('nan')):.0f} / {host.get('ours', float('nan')):.0f} |")
    return "\n".join(lines) + "\n\n" + _source(path, data)


def model_summary(*paths: str) -> str:
    """The tuner's model checks: mean and max prediction error, and picks within 3% of the exhaustive best."""
    lines = ["| setting | path | mean error | max error | picks within 3% of the best |",
             "| --- | --- | --- | --- | --- |"]
    sources = []
    for path in paths:
        data = _load(path)
        meta = data["meta"]
        paths_in = sorted({row["path"] for row in data["rows"]})
        lines.append(f"| {meta['setting']} | {', '.join(paths_in)} | {100 * meta['mean_error']:.1f}% "
                     f"| {100 * meta['max_error']:.1f}% | {meta['picks_within_3pct']} of {len(data['rows'])} |")
        sources.append(f"`{path}` (commit `{str(meta['commit'])[:10]}`)")
    return "\n".join(lines) + "\n\n<sub>Sources: " + ", ".join(sources) + ": `tune validate`.</sub>"


def mutations_table(path: str) -> str:
    """The mutation run: each named mutation, what it breaks, and whether its tests caught it."""
    data = _load(path)
    lines = ["| mutation | what it breaks | caught by | caught |", "| --- | --- | --- | --- |"]
    for row in data["rows"]:
        verdict = {True: "yes", False: "**no**", None: "broken mutation"}[row["caught"]]
        lines.append(f"| `{row['name']}` | {row['what']} | `{row['tests'].split('::')[0]}` | {verdict} |")
    caught = sum(1 for row in data["rows"] if row["caught"])
    return "\n".join(lines) + f"\n\n{caught} of {len(data['rows'])} caught. <sub>Source: `{path}` (commit " \
        f"`{str(data['meta']['commit'])[:10]}`): `{data['meta']['command']}`.</sub>"


def reliability(path: str, commit: str) -> str:
    """The reliability run's log (``benchmarks/reliability.py``'s output): the random calls' summary line and each
    fault scenario's line."""
    text = (ROOT / path).read_text()
    summary, faults = None, []
    for line in text.splitlines():
        body = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else ""
        if body.startswith("{"):
            summary = json.loads(body)
        elif body.startswith("fault"):
            faults.append(body)
    memory = summary["memory_bytes"]
    lines = ["| calls checked (both ranks) | wrong | plain NCCL collectives checked "
             "| memory after warm-up / at the end / peak (MiB) | flat (the script's bound: +64 MiB) | seconds |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| {summary['checked_all_ranks']} of {2 * summary['calls']} | {summary['failures_all_ranks']} "
             f"| {summary['plain_collectives_checked']} | {memory['after_warmup'] / 2**20:.0f} / "
             f"{memory['end'] / 2**20:.0f} / {memory['max_allocated'] / 2**20:.0f} | "
             f"{'yes' if summary['memory_flat'] else 'no'} | {summary['seconds']:.0f} |"]
    fault_lines = "\n".join(f"- `{line[:160]}`" for line in faults) or "- none completed"
    return "\n".join(lines) + f"\n\nFault scenarios completed ({len(faults)}):\n\n{fault_lines}\n\n<sub>Source: " \
        f"`{path}` (commit `{commit[:10]}`): `torchrun --nproc-per-node 2 benchmarks/reliability.py --calls " \
        f"{summary['calls']}`.</sub>"


RENDERERS = {"ops": ops_table, "block": block_table, "e-range": e_range, "host-ratio-range": host_ratio_range,
             "sub-bands": sub_band_table, "paths": paths_table, "model-summary": model_summary,
             "mutations": mutations_table, "reliability": reliability}


def render(spec: str) -> str:
    name, *args = spec.split()
    text = RENDERERS[name](*args)
    return text if "\n" not in text else text + "\n"


def process(write: bool) -> list[str]:
    """Re-render every marked piece; returns ``doc: spec`` for each that differed (rewritten with ``write``)."""
    stale = []
    for doc in DOCS:
        text = doc.read_text()

        def fresh(match: re.Match, doc=doc) -> str:
            body = render(match["spec"])
            if match["body"] != body:
                stale.append(f"{doc.relative_to(ROOT)}: {match['spec']}")
            return match.group(1) + body + match.group(4)

        new = MARKER.sub(fresh, text)
        if write and new != text:
            doc.write_text(new)
    return stale


if __name__ == "__main__":
    if sys.argv[1:] not in (["--write"], ["--check"]):
        raise SystemExit("usage: python benchmarks/readme_tables.py --write|--check")
    stale = process(write=sys.argv[1] == "--write")
    for piece in stale:
        print(("rewrote " if sys.argv[1] == "--write" else "stale: ") + piece)
    raise SystemExit(1 if stale and sys.argv[1] == "--check" else 0)
