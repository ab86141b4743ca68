"""Render every figure of README.md and docs/*.md from the committed results files.

A document holds, for each rendered piece, a pair of markers:

    <!-- render: NAME FILE [FILE ...] -->
    ...whatever the renderer NAME makes of the files (replaced on --write)...
    <!-- end render -->

``python benchmarks/readme_tables.py --write [DOC ...]`` rewrites every such piece (of the documents named, else
of all); ``--check`` (what the CPU suite runs, ``tests/test_readme.py``) exits 1 and names the pieces whose text
differs from a fresh rendering. Every table ends with its source: the file, the commit that produced it and the
command. A sentence that states a range computes it here (``range-*`` renderers). A spec's file may be a glob
(``moe-layer``): every matching file is rendered, and none renders a line that says so.

Where the code a table measures has changed since the commit it was measured at (``git diff --quiet COMMIT HEAD --
PATHS`` says so), its source line says "the code it measures has changed since". The paths per table are
``MEASURES``'s: the library (``src/flashoverlap``) for every performance figure, the install's dependencies
(``pyproject.toml``) for the CPU install, and for the mutation run the library, the tests and the mutation list. A
change to a benchmark script alone is not flagged. So a commit that changes the library can make ``--check`` fail
until the pieces are re-rendered with the note: the figures cannot go stale unnoticed. Where git cannot say (no
repository, or a commit absent from a shallow clone), ``--check`` accepts the piece with or without the note.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"(<!-- render: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- end render -->)", re.S)
OPS = {"all_reduce": "gemm_all_reduce", "reduce_scatter": "gemm_reduce_scatter", "all_gather": "all_gather_gemm"}
LIBRARY = ("src/flashoverlap",)
# The paths whose code each table measures (see the module docstring), by renderer.
MEASURES = {"cpu-install": ("pyproject.toml",), "mutations": ("src/flashoverlap", "tests", "tools/mutate.py"),
            "reliability": ("src/flashoverlap", "benchmarks/reliability.py")}
# Commands a results file records that have moved since (recorded prefix: the one that runs it now). The record is a
# measurement's and stays as it is; its source line names the current command beside it (``_command``).
MOVED = {"python -m flashoverlap.bench.moe_gemm": "python -m benchmarks.moe_gemm",
         "torchrun --nproc-per-node 2 benchmarks/diagnostics/p2p_sub_bands.py":
             "torchrun --nproc-per-node 2 -m benchmarks.diagnostics.p2p_sub_bands"}
# Recorded module invocations that still run, but run something else now (recorded: the one that runs what wrote the
# file): ``python -m flashoverlap.bench`` ran the full harness then and runs the installed ``flashoverlap bench ops``
# now (no baselines, no results file of this shape), save with the harness's own options (``bench.py``).
RESPELT = {" -m flashoverlap.bench ": " -m benchmarks.ops "}


def respelling(recorded: str) -> tuple[str, str] | None:
    """The ``RESPELT`` entry ``(old, now)`` that ``recorded`` needs to run what wrote its file, or None: not one of
    those commands, or one whose options ``bench ops`` hands to the harness itself (``--timeline``, ``--sweep``, ...:
    any option its own parser does not know, ``flashoverlap.cli.main``)."""
    import shlex

    from flashoverlap import cli

    padded = recorded.strip() + " "
    for old, now in RESPELT.items():
        if old in padded:
            _, unknown = cli.parser().parse_known_args(["bench", "ops", *shlex.split(padded.split(old, 1)[1])])
            return None if unknown else (old, now)
    return None


# Marks a note that git could not confirm or deny (inside a fresh rendering only, never written to a document).
UNSURE = "\x00"


def changed_since(commit: str, paths: tuple[str, ...], repo: Path = ROOT) -> bool | None:
    """Whether ``paths`` differ between ``commit`` and HEAD in ``repo`` (``git diff --quiet``); None where git cannot
    say (no git, no repository, or the commit is not in it)."""
    sha = str(commit).split("-")[0]  # a "-dirty" suffix: the commit the working tree was based on
    try:
        known = subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{sha}^{{commit}}"], capture_output=True)
        if known.returncode:
            return None
        diff = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", sha, "HEAD", "--", *paths],
                              capture_output=True)
    except OSError:
        return None
    return {0: False, 1: True}.get(diff.returncode)


def stale_note(commit: str, measures: tuple[str, ...] = LIBRARY, short: bool = False) -> str:
    """``"; the code it measures has changed since (git diff ...)"`` where it has (``short``: without the command),
    ``""`` where not, and the note between ``UNSURE`` marks where git cannot say."""
    sha = str(commit).split("-")[0][:10]
    note = ", code changed since" if short else \
        f"; **the code it measures has changed since** (`git diff {sha} HEAD -- {' '.join(measures)}`)"
    changed = changed_since(commit, measures)
    return note if changed else "" if changed is False else UNSURE + note + UNSURE


def _load(path: str) -> dict:
    with open(ROOT / path) as f:
        return json.load(f)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _e(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:+.2f}"


def _command(recorded: str) -> str:
    """A recorded command as a source line shows it: in a code span, and where it has moved since (``MOVED``), the
    command that runs it now beside it."""
    recorded = recorded.strip()
    for old, now in MOVED.items():
        if recorded == old or recorded.startswith(old + " "):
            return f"`{recorded}` (as recorded; it has moved: `{now}{recorded[len(old):]}` runs it now)"
    found = respelling(recorded)
    if found is not None:
        now = (recorded + " ").replace(*found, 1).strip()
        return f"`{recorded}` (as recorded; that command runs another program now: `{now}` runs what wrote this)"
    return f"`{recorded}`"


def _source(path: str, data: dict, command: str | None = None) -> str:
    """A results file's source line: where and at which commit, and its recorded command (``command``: what the
    line says instead, where the recorded one no longer runs as written)."""
    meta = data["meta"]
    return (f"<sub>Source: `{path}` ({meta['gpus']}, {meta['setting']}, torch {meta['torch']}, commit "
            f"`{str(meta['commit'])[:10]}`{stale_note(meta['commit'])}"
            + (f"; {command}).</sub>" if command else f"): {_command(meta['command'])}.</sub>"))


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
    lines = ["| op | M, N, K | T_seq (ms) | best decomp. (ms) | async TP (ms) | **ours** (ms, path) | speedup | E "
             "| E async TP | host µs seq / ours |",
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
    return "\n".join(lines) + "\n\n" + OPS_LEGEND + "\n\n" + _source(path, data)


def headline(*paths: str) -> str:
    """The front page's table: per op and results file (GPUs and setting), how many shapes were measured, the worst
    and the best speedup of a plain call (``path="auto"``) over the plain code at those shapes, and the commit."""
    per_op: dict[str, list[str]] = {op: [] for op in OPS}
    sources = []
    for path in paths:
        data = _load(path)
        meta, speeds, seen = data["meta"], {}, set()
        for row in data["rows"]:
            key = (row["op"], row["M"], row["N"], row["K"])
            if key not in seen:  # a shape's P2P row repeats the baselines of its NCCL row
                seen.add(key)
                speeds.setdefault(row["op"], []).append((row["t_seq_ms"] / _auto(row)["t_ms"], key[1:]))
        commit = f"`{str(meta['commit'])[:10]}`{stale_note(meta['commit'], short=True)}"
        for op, found in speeds.items():
            (lo, lo_at), (hi, hi_at) = min(found), max(found)
            per_op[op].append(f"| {OPS[op]} | {meta['gpus']}, {meta['setting']} | {len(found)} "
                              f"| {lo:.2f}x ({', '.join(map(str, lo_at))}) | {hi:.2f}x ({', '.join(map(str, hi_at))}) "
                              f"| {commit} |")
        recorded = meta['command'].strip()
        found = respelling(recorded)
        now = "" if found is None else f" (now `{found[1].strip()}`)"
        sources.append(f"`{path}` (commit `{str(meta['commit'])[:10]}`{stale_note(meta['commit'])}): "
                       f"`{recorded}`{now}")
    lines = ["| op | GPUs, setting | shapes | speedup, worst (M, N, K) | speedup, best (M, N, K) | measured at |",
             "| --- | --- | --- | --- | --- | --- |", *(line for rows in per_op.values() for line in rows)]
    return "\n".join(lines) + "\n\n" + HEADLINE_LEGEND + "\n\n<sub>Sources: " + "; ".join(sources) + ".</sub>"


HEADLINE_LEGEND = (
    "<sub>speedup: `T_seq / T`, the time of the plain code (`torch.matmul`, then the NCCL collective) over that of "
    "a plain call (`path=\"auto\"`, no tuning), bf16, two ranks, at the benchmark grid's shapes, each figure timed "
    "in one run beside its baselines with calls queued behind GPU work as in a model "
    "([docs/benchmarks.md](docs/benchmarks.md)). `nvlink`: NCCL's defaults; `pcie-like`: `NCCL_P2P_DISABLE=1`, NCCL "
    "through host memory as between PCIe GPUs (the NCCL path only). \"Code changed since\": the code it measures "
    "(the library, `src/flashoverlap`) has changed since the commit measured, so the figure may no longer hold.</sub>")


OPS_LEGEND = (
    "<sub>`T_seq`: `torch.matmul` then the NCCL collective, one after the other (what users run today). "
    "`best decomp.`: the GEMM cut into 2, 4 or 8 row chunks, each chunk's collective issued asynchronously on a "
    "second stream, the best of the three. `async TP`: PyTorch's `torch.ops.symm_mem.fused_matmul_reduce_scatter` / "
    "`fused_all_gather_matmul` (none for all-reduce). **ours** (`T`): a plain call (`path=\"auto\"`, no tuning "
    "cache) and the path it took. `speedup`: `T_seq / T`. `E`: `(T_seq - T) / (T_seq - max(T_gemm, T_comm))`, the "
    "share of the hideable time hidden (`T_gemm`: `torch.matmul` alone, `T_comm`: the collective alone); `E async "
    "TP`: the same for async TP. `host µs`: the host time to issue one call while the GPU is busy.</sub>")


BLOCK_FIGURES = ("t_torch_eager_ms", "t_nocomm_eager_ms", "t_ours_eager_ms", "t_torch_compiled_ms",
                 "t_nocomm_compiled_ms", "t_async_tp_ms", "t_ours_compiled_ms")


def _e_block(row: dict, kind: str, t) -> float | None:
    """``(t_torch - t) / (t_torch - t_nocomm)`` with the baselines of the same kind (eager or compiled)."""
    torch_ms, nocomm_ms = row[f"t_torch_{kind}_ms"], row[f"t_nocomm_{kind}_ms"]
    if None in (torch_ms, nocomm_ms, t) or torch_ms <= nocomm_ms:
        return None
    return (torch_ms - t) / (torch_ms - nocomm_ms)


def block_table(path: str) -> str:
    """The transformer block, two lines per mode and token count: eager blocks beside each other, compiled blocks
    beside each other, and E_block of each line against its own line's baselines (never across the two)."""
    data = _load(path)
    lines = ["| mode | tokens | blocks | PyTorch TP (ms) | no communication (ms) | async TP (ms) | **ours** (ms) "
             "| E_block ours | E_block async TP |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        missing = [name for name in BLOCK_FIGURES if name not in row]
        if missing:
            raise ValueError(f"{path}: a block row without {missing} (a file from before eager and compiled "
                             "baselines were measured separately): measure it again")
        for kind in ("eager", "compiled"):
            ours = row[f"t_ours_{kind}_ms"]
            if ours is None and row[f"t_torch_{kind}_ms"] is None:
                continue  # nothing of this kind was measured (decode steps are eager only)
            tp = row["t_async_tp_ms"] if kind == "compiled" else None
            lines.append(
                f"| {row['mode']} | {row['tokens']} | {kind} | {_ms(row[f't_torch_{kind}_ms'])} "
                f"| {_ms(row[f't_nocomm_{kind}_ms'])} | {_ms(tp)} | **{_ms(ours)}** | {_e(_e_block(row, kind, ours))} "
                f"| {_e(_e_block(row, kind, tp))} |")
    return "\n".join(lines) + "\n\n" + BLOCK_LEGEND + "\n\n" + _source(path, data)


BLOCK_LEGEND = (
    "<sub>ms per step. `PyTorch TP`: matmul then NCCL through differentiable functional collectives. `no "
    "communication`: the same block with every collective replaced by a local stand-in of the same shape (the bound "
    "on what overlap can win). `async TP`: the plain block compiled with Inductor's micro-pipeline TP pass (compiled "
    "only). `E_block`: `(PyTorch TP - T) / (PyTorch TP - no communication)` within the line: eager against eager, "
    "compiled against compiled.</sub>")


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
    # The file records none; the script took (and takes) the results file's path as its one argument.
    recorded = _command("torchrun --nproc-per-node 2 benchmarks/diagnostics/p2p_sub_bands.py OUT.json")
    return "\n".join(lines) + f"\n\n<sub>Source: `{path}` (commit `{str(data['commit'])[:10]}`" \
        f"{stale_note(data['commit'])}): {recorded}.</sub>"


def paths_table(path: str) -> str:
    """Every row of a benchmark file: each path's T and E, plan and host time, beside the same baselines."""
    data = _load(path)
    lines = ["| op | path | M, N, K | T_gemm (ms) | T_comm (ms) | T_seq (ms) | T (ms) | E | plan | host µs seq / T |",
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
    return "\n".join(lines) + "\n\n" + PATHS_LEGEND + "\n\n" + _source(path, data)


PATHS_LEGEND = (
    "<sub>`T_gemm`: `torch.matmul` alone. `T_comm`: the NCCL collective alone on the whole result. `T_seq`: the two "
    "one after the other. `T`: flashoverlap on that path, end to end. `E`: `(T_seq - T) / (T_seq - max(T_gemm, "
    "T_comm))`. `host µs`: the host time to issue one call while the GPU is busy.</sub>")


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
        sources.append(f"`{path}` (commit `{str(meta['commit'])[:10]}`{stale_note(meta['commit'])})")
    return "\n".join(lines) + "\n\n<sub>Sources: " + ", ".join(sources) + ": `tune validate`.</sub>"


def mutations_table(path: str) -> str:
    """The mutation run: each named mutation, what it breaks, and whether its tests caught it."""
    data = _load(path)
    lines = ["| mutation | what it breaks | caught by | caught |", "| --- | --- | --- | --- |"]
    for row in data["rows"]:
        verdict = {True: "yes", False: "**no**", None: "broken mutation"}[row["caught"]]
        lines.append(f"| `{row['name']}` | {row['what']} | `{row['tests'].split('::')[0]}` | {verdict} |")
    caught = sum(1 for row in data["rows"] if row["caught"])
    commit = data["meta"]["commit"]
    return "\n".join(lines) + f"\n\n{caught} of {len(data['rows'])} caught. <sub>Source: `{path}` (commit " \
        f"`{str(commit)[:10]}`{stale_note(commit, MEASURES['mutations'])}): `{data['meta']['command']}`.</sub>"


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
        f"`{path}` (commit `{commit[:10]}`{stale_note(commit, MEASURES['reliability'])}): `torchrun " \
        "--nproc-per-node 2 benchmarks/reliability.py --calls " \
        f"{summary['calls']}`.</sub>"


def cpu_install(path: str) -> str:
    """What a CPU machine installs: site-packages of a fresh environment per install command."""
    data = _load(path)
    meta = data["meta"]
    lines = [f"| CPU install, fresh environment, `pip install {meta['torch']}` first (the CPU build from this "
             "machine's local wheel index: elsewhere the README's line with PyTorch's CPU index) | site-packages (MiB) "
             "| triton | cuda-bindings |", "| --- | --- | --- | --- |"]
    for row in data["installs"]:
        command = "pip install -e ." if row["extra"] is None else f'pip install -e ".{row["extra"]}"'
        lines.append(f"| `{command}` | {row['site_packages_mib']} | {'yes' if row['has_triton'] else 'no'} "
                     f"| {'yes' if row['has_cuda_bindings'] else 'no'} |")
    return "\n".join(lines) + f"\n\n<sub>Source: `{path}` ({meta['machine']}, Python {meta['python']}, commit " \
        f"`{str(meta['commit'])[:10]}`, {meta['date'][:10]}{stale_note(meta['commit'], MEASURES['cpu-install'])}): " \
        f"`{meta['command']}`.</sub>"


def _sourced(path: str, meta: dict) -> str:
    """A source line from whatever a file's meta holds (files of different scripts name their fields apart)."""
    what = ", ".join(str(meta[k]) for k in ("gpus", "gpu", "setting") if meta.get(k))
    what += f", torch {meta['torch']}" if meta.get("torch") else ""
    date = f", {meta['date'][:10]}" if meta.get("date") else ""
    commit = str(meta["commit"])[:10]
    runs = [s for s in meta.get("sources") or () if isinstance(s, dict) and s.get("commit") and s.get("command")]
    if len(runs) > 1:  # rows of several runs (each row names its commit, or its run where runs share one)
        labelled = all(s.get("run") for s in runs)
        listed = "; ".join((f"run {s['run']} ({str(s.get('date', ''))[:16]}), " if labelled else "")
                           + f"commit `{str(s['commit'])[:10]}`{stale_note(s['commit'])}: {_command(s['command'])}"
                           for s in runs)
        return f"<sub>Source: `{path}` ({what}{date}; rows of {len(runs)} runs, each row naming its " \
            f"{'run' if labelled else 'commit'}): {listed}.</sub>"
    return f"<sub>Source: `{path}` ({what}, commit `{commit}`{date}{stale_note(meta['commit'])}): " \
        f"{_command(meta['command'])}.</sub>"


def _us(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def host_one_gpu(path: str) -> str:
    """Host time per call on one GPU shared by two processes: per op, path and mode, beside ``torch.mm`` alone in
    the same run (eager and replayed calls: their ratio) or beside ``torch.mm`` plus the collective issued directly
    (calls of the sequential plan: the difference)."""
    data = _load(path)
    paired = any("paired_ratio" in row or "paired_extra_us" in row for row in data["rows"])
    lines = ["| op | path | mode | M, N, K | host (µs) | `torch.mm` (µs) | direct (µs) | host / `torch.mm` "
             "| host - direct (µs) |" + (" paired: ratio / extra (µs) |" if paired else ""),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if paired else "")]
    for row in data["rows"]:
        direct = row.get("direct_us")
        ratio = f"{row['host_us'] / row['torch_mm_us']:.1f}x" if direct is None and row.get("torch_mm_us") else "-"
        extra = f"{row['host_us'] - direct:+.0f}" if direct is not None else "-"
        line = (f"| {OPS.get(row['op'], row['op'])} | {row['path']} | {row['mode']} | {row['M']}, {row['N']}, "
                f"{row['K']} | {_us(row['host_us'])} | {_us(row.get('torch_mm_us'))} | {_us(direct)} | {ratio} "
                f"| {extra} |")
        if paired:
            line += (f" {row['paired_ratio']:.1f}x |" if "paired_ratio" in row
                     else f" {row['paired_extra_us']:+.0f} |" if "paired_extra_us" in row else " - |")
        lines.append(line)
    return "\n".join(lines) + "\n\n" + HOST_LEGEND + "\n\n" + _sourced(path, data["meta"])


HOST_LEGEND = (
    "<sub>Host time to issue one call (µs), measured with two processes sharing one GPU (a gloo group, CUDA IPC in "
    "place of symmetric memory): host cost, not two-GPU speed. Baselines, same run: `torch.mm` alone on the same "
    "operands (for `eager`, a P2P call issued afresh, and `replayed`, a repeated call replayed from a CUDA graph), "
    "and `direct`: `torch.mm` plus the same collective issued directly on a one-rank NCCL group (for `sequential`, "
    "a call of the matmul-then-collective plan). Paired (where the file has it): the median over rounds of the "
    "call's ratio to `torch.mm` (eager, replayed) or of its difference from `direct` (sequential) timed in the same "
    "round, which a slow spell of the host that lasts a round moves less than the medians apart.</sub>")


def _one_gpu(meta: dict) -> str:
    """``"One H200"`` (or the GPU the file's ``meta["gpus"]`` names: a device call may get an H100)."""
    name = str(meta.get("gpus", "NVIDIA H200")).split(" shared by ")[0].removeprefix("1x ").removeprefix("NVIDIA ")
    return f"One {name}"


def host_bound(path: str) -> str:
    """The loop a model runs (``benchmarks/host_bound.py``): per shape and dtype, host, GPU and wall time per call of
    each path, with wall over GPU (above 1: the GPU waited) and host over the plain matmul's host time."""
    data = _load(path)
    # rows of several runs at one shape (a before and an after, or one commit run twice: rows then name their "run"):
    # a column naming each row's run, each row over its own run's matmul
    shapes = [(row["shape"], row["op"], row["M"], row["N"], row["K"], row["dtype"], row.get("path"), row.get("mode"))
              for row in data["rows"]]
    by_run = len(set(shapes)) < len(shapes)
    runs = any("run" in row for row in data["rows"])
    lines = ["| shape | op | M, N, K | dtype | " + (("run | " if runs else "commit | ") if by_run else "")
             + "path | mode | host (µs) | GPU (µs) | wall (µs) | wall / GPU | host / matmul's |",
             "| --- " * (11 + by_run) + "|"]

    def run_of(row):
        return row.get("run", row.get("commit"))

    alone = {(row["shape"], row["op"], row["M"], row["N"], row["K"], row["dtype"], run_of(row)): row["host_us"]
             for row in data["rows"] if row.get("path") in ("mm", "scaled_mm") and "host_us" in row}
    for row in data["rows"]:
        key = (row["shape"], row["op"], row["M"], row["N"], row["K"], row["dtype"], run_of(row))
        head = (f"| {row['shape']} | {OPS.get(row['op'], row['op'])} | {row['M']}, {row['N']}, {row['K']} "
                f"| {row['dtype']}" + (f" | {run_of(row) or '-'}" if by_run else ""))
        if "error" in row:
            lines.append(f"{head} | {row.get('path', '-')} | {row.get('mode', '-')} | error: "
                         f"{row['error'][:80]} | | | | |")
            continue
        base = alone.get(key)
        ratio = "-" if row["path"] in ("mm", "scaled_mm") or not base else f"{row['host_us'] / base:.1f}x"
        path_name = {"mm": "`torch.mm`", "scaled_mm": "`torch._scaled_mm`"}.get(row["path"], row["path"])
        lines.append(f"{head} | {path_name} | {row['mode']} | {_us(row['host_us'])} | {_us(row['gpu_us'])} "
                     f"| {_us(row['wall_us'])} | {row['wall_us'] / row['gpu_us']:.2f} | {ratio} |")
    legend = HOST_BOUND_LEGEND.format(gpu=_one_gpu(data["meta"]))
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, data["meta"])


def host_queue(path: str) -> str:
    """An eager call's host time against the loop's length (``benchmarks/diagnostics/host_queue.py``): per case, the
    NCCL path's host time per call for each loop length, beside the plain matmul's."""
    data = _load(path)
    loops = data["meta"]["loops"]
    cases = {}
    for row in data["rows"]:
        cases.setdefault((row["shape"], row["op"], row["dtype"]), {}).setdefault(row["path"], {})[row["loop"]] = \
            row["host_us"]
    lines = ["| shape | op | dtype | path | " + " | ".join(f"{n} call{'s' * (n > 1)}" for n in loops) + " |",
             "| --- " * (4 + len(loops)) + "|"]
    for (shape, op, dtype), paths in cases.items():
        for path_name, by_loop in paths.items():
            name = "nccl (eager)" if path_name == "nccl" else ("`torch._scaled_mm`" if dtype != "bfloat16"
                                                               else "`torch.mm`")
            lines.append(f"| {shape} | {OPS.get(op, op)} | {dtype} | {name} | "
                         + " | ".join(_us(by_loop[n]) if n in by_loop else "-" for n in loops) + " |")
    legend = (f"<sub>{_one_gpu(data['meta'])}, a one-rank NCCL group: host time to issue one call (µs), per call of "
              f"a loop of that many calls back to back (the GPU idle and synchronised before each loop), the median "
              f"of {data['meta']['rounds']} rounds; the NCCL path under its overlapped plan, `FLASHOVERLAP_REPLAY=0`."
              "</sub>")
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, data["meta"])


HOST_BOUND_LEGEND = (
    "<sub>{gpu}, a one-rank NCCL group; per call of 50 back to back on the same tensors: host = the time to issue "
    "it, GPU = the same loop queued behind a long GPU sleep (the host never what the GPU waits on), wall = issue plus "
    "the final synchronisation. Each figure the median of 7 rounds, the paths of a row group interleaved in each. "
    "`sequential`: the library's matmul-then-collective plan; `nccl`: the NCCL path under its overlapped plan "
    "(`default_plan(..., allow_sequential=False)`), `eager` with `FLASHOVERLAP_REPLAY=0`, `replayed` a repeated "
    "call replayed from a CUDA graph (the default); `auto`: `path=\"auto\"` with no plan, replayed (on one rank "
    "the sequential plan, which replays repeated calls from ad9c1d59df on). host / matmul's: over `torch.mm`'s "
    "(bf16) or `torch._scaled_mm`'s (fp8 row-wise) host time in the same row group.</sub>")


def _fp8_choice(row: dict) -> str:
    """The way ``tune/grouped_fp8.py`` (this checkout's rule, a pure function of the shape) picks for a measured row,
    exact mode, on an H200."""
    from flashoverlap.tune.grouped import GroupedCall
    from flashoverlap.tune.grouped_fp8 import expert_gemm_fp8

    call = GroupedCall.balanced(row["experts"], row["rows"], row["K"], row["N"])
    return expert_gemm_fp8(call, row["scaling"], mode="exact", device_capability=(9, 0))[0]


def fp8_grouped(path: str) -> str:
    """The fp8 grouped GEMM three ways beside bf16 ``torch._grouped_mm`` (``benchmarks/diagnostics/fp8_grouped.py``):
    per config, routing and scaling, each way's time, the way ``tune/grouped_fp8.py`` picks, and its ratios."""
    data = _load(path)
    lines = ["| config | set | routing | scaling | experts, rows, K, N | ours (ms) | `_scaled_grouped_mm` (ms) "
             "| `_scaled_mm` loop (ms) | bf16 `_grouped_mm` (ms) | chosen | chosen / best | bf16 / chosen |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        head = (f"| {row['config']} | {row.get('set', '-')} | {row['routing']} | {row.get('scaling', '-')} "
                f"| {row.get('experts', '-')}, {row.get('rows', '-')}, {row.get('K', '-')}, {row.get('N', '-')}")
        if row.get("skipped"):
            lines.append(f"{head} | not run: {row['skipped']} | | | | | | |")
            continue
        if row.get("t_ours_ms") is None and row.get("t_loop_ms") is None:
            lines.append(f"{head} | error: {str(row.get('error', '-'))[:70]} | | | | | | |")
            continue
        times = {"ours": row.get("t_ours_ms"), "cublas": row.get("t_scaled_grouped_mm_ms"),
                 "loop": row.get("t_loop_ms")}
        way = _fp8_choice(row)
        chosen = times["ours" if way == "triton" else way]
        best = min(t for t in times.values() if t is not None)
        bf16 = row.get("t_bf16_grouped_mm_ms")
        kernel = {"gluon": " (Gluon)", "triton": " (Triton)"}.get(row.get("kernel"), "")
        lines.append(f"{head} | {_ms(times['ours'])}{kernel} | {_ms(times['cublas'])} | {_ms(times['loop'])} "
                     f"| {_ms(bf16)} "
                     f"| {'ours' if way == 'triton' else way} | {chosen / best:.2f} | "
                     f"{'-' if bf16 is None else f'{bf16 / chosen:.2f}x'} |")
    legend = (f"<sub>{_one_gpu(data['meta'])}, per-rank slices at W = 2, fp8 e4m3 rows and weights, bf16 out; `ours`: "
              "`kernels.grouped_gemm.scaled_grouped_gemm` at the file's commit: the Triton kernel, or block-wise on "
              "Hopper the Gluon kernel of `kernels/block_scaled.py` where it applies (from 02d6ecef72 on; a row "
              "names the kernel it ran where the file records it); `_scaled_grouped_mm`: torch's (row-wise only); "
              "loop: one `torch._scaled_mm` per expert. `chosen`: the way `tune/grouped_fp8.py`'s rule picks "
              "for the shape (the rule of this checkout, fitted on an H200's figures; exact mode); "
              "`set`: the configs the rule was fitted on, and those it was "
              "validated on. bf16 / chosen above 1: the fp8 way is faster than bf16 `torch._grouped_mm`.</sub>")
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, data["meta"])


def fp8_tiles(path: str) -> str:
    """The fp8 grouped GEMM's tile sweep (``benchmarks/diagnostics/fp8_grouped_tiles.py``): per config and scaling,
    bf16 ``torch._grouped_mm``, the kernel's tile and the fastest right tile, with how many of its programs share an
    SM where the file has the compiled facts."""
    data = _load(path)
    facts = data["meta"].get("facts", {})
    lines = ["| config | scaling | experts, rows, K, N | bf16 `_grouped_mm` (ms) | kernel's tile then: ms "
             "| fastest tile | its time (ms) | programs per SM | bf16 / fastest | bf16 / kernel's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        head = (f"| {row['config']} | {row['scaling']} | {row.get('experts', '-')}, {row.get('rows', '-')}, "
                f"{row.get('K', '-')}, {row.get('N', '-')}")
        if row.get("best") is None:
            lines.append(f"{head} | not run: {str(row.get('skipped') or row.get('error', '-'))[:70]} | | | | | | |")
            continue
        tiles = row["tiles"]
        spec = tiles[row["best"]]["tile"]
        fit = facts.get(row["scaling"], {}).get(row["best"], {}).get("programs_per_sm_fit")
        per_sm = spec[6] if len(spec) > 6 else 1  # files from before programs_per_sm: one
        programs = "one per tile" if spec[5] is None else f"{per_sm}" + (f" (fit {fit})" if fit else "")
        current, over_current = tiles.get("current", {}), row.get("bf16_over_current")
        then = current.get("tile") or []
        gluon = " Gluon" if current.get("kernel") == "gluon" else ""
        then = f"{then[0]}x{then[1]}-s{then[3]}{gluon}: " if len(then) > 3 else ""
        best = row["best"] + (" (Gluon)" if tiles[row["best"]].get("kernel") == "gluon" else "")
        lines.append(f"{head} | {_ms(row['t_bf16_grouped_mm_ms'])} | {then}{_ms(current.get('t_ms'))} | {best} "
                     f"| {_ms(row['t_best_ms'])} | {programs} | {row['bf16_over_best']:.2f}x | "
                     f"{'-' if over_current is None else f'{over_current:.2f}x'} |")
    gpu = str(data["meta"].get("gpus", "GPU")).replace("NVIDIA ", "")
    legend = (f"<sub>One {gpu}, per-rank slices at W = 2, balanced routing, fp8 e4m3, bf16 out, every tile's output "
              "checked against a per-expert `_scaled_mm` loop (a wrong tile is never the fastest). Tile names: rows x "
              "columns, pipeline stages (`s`), warps (`w`, else 8), persistent programs per SM (`2sm`, `3sm`, else one)"
              " or one program per tile (`tiles`); `Gluon`: the tile ran the Gluon block-wise kernel "
              "(`kernels/block_scaled.py`), else the Triton one. `kernel's tile then`: the tile the launcher took for "
              "the scaling at the commit measured, and its time. `programs per SM`: the fastest tile's, and how many "
              "fit by its registers and shared memory as compiled (`benchmarks/diagnostics/kernel_facts.py`). bf16 / "
              "... above 1: the fp8 kernel is faster than bf16 `torch._grouped_mm`.</sub>")
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, data["meta"])


def shared_ranks(path: str) -> str:
    """The shared-GPU mechanics (``benchmarks/shared_ranks.py --step mechanics``) summed per W, family and mode:
    cases run, calls checked, wrong values, replays against the repeated calls that should replay, cases that
    raised or were not run."""
    data = _load(path)
    groups: dict[tuple, dict] = {}
    for row in data["rows"]:
        key = (row["W"], row.get("family") or "-", row.get("mode") or "-")
        g = groups.setdefault(key, {"cases": 0, "checked": 0, "wrong": 0, "replays": 0, "wanted": 0, "raised": 0,
                                    "skipped": 0})
        if str(row.get("error") or "").startswith("budget spent"):
            g["skipped"] += 1
            continue
        g["cases"] += 1
        g["checked"] += row.get("checked") or 0
        g["wrong"] += row.get("wrong") or 0
        g["replays"] += row.get("replays") or 0
        g["wanted"] += row.get("replays_wanted") or 0
        g["raised"] += 1 if row.get("error") else 0
    lines = ["| W | family | mode | cases | values checked | wrong | replays / repeated calls | cases that raised "
             "| not run (budget) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (w, family, mode), g in sorted(groups.items(), key=lambda item: tuple(map(str, item[0]))):
        wanted = f"{g['replays']} / {g['wanted']}" if g["wanted"] else "-"
        lines.append(f"| {w} | {family} | {mode} | {g['cases']} | {g['checked']} | {g['wrong']} | {wanted} "
                     f"| {g['raised']} | {g['skipped']} |")
    return "\n".join(lines) + "\n\n" + _sourced(path, data["meta"])


def soak(path: str) -> str:
    """The shared-GPU soak: per W, random calls checked, wrong values, errors, hangs, device memory."""
    data = _load(path)
    by_commit = len({row.get("commit") for row in data["rows"]}) > 1  # rows of several runs: each row's commit
    by_run = any("run" in row for row in data["rows"])  # runs of one commit: each row names its run
    # Runs that read their checks apart (rows that do not record it are not a value of their own: before the option
    # was honoured, a row could record one it did not follow).
    by_reads = len({row["read_every"] for row in data["rows"] if row.get("read_every") is not None}) > 1
    lines = ["| W | " + ("commit | " if by_commit else "") + ("run | " if by_run else "")
             + ("read every (bursts) | " if by_reads else "")
             + "calls | wrong | errors | hangs | memory samples (MiB) | flat | ms / call | replays | stopped |",
             "| --- " * (10 + by_commit + by_run + by_reads) + "|"]
    for row in data["rows"]:
        memory = ", ".join(f"{m:.0f}" for m in row.get("memory_mib") or [])
        lines.append(f"| {row['W']} | " + (f"{str(row.get('commit') or '-')[:10]} | " if by_commit else "")
                     + (f"{row.get('run', '-')} | " if by_run else "")
                     + (f"{row.get('read_every') or '-'} | " if by_reads else "")
                     + f"{row.get('calls')} | {row.get('wrong')} | {row.get('errors')} | "
                     f"{row.get('hangs')} | {memory} | {row.get('flat')} | {row.get('ms_per_call')} | "
                     f"{row.get('replays')} | {row.get('stopped') or '-'} |")
    return "\n".join(lines) + "\n\n" + _sourced(path, data["meta"])


def faults(path: str) -> str:
    """The shared-GPU fault scenarios: per scenario and op, whether every surviving rank raised an error naming
    the op, the group and the absent rank in time, and what rank 0 said."""
    data = _load(path)
    lines = ["| scenario | op | W | ok | seconds | what was missing | rank 0's message (cut) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        message = row.get("message") or {}
        first = next(iter(message.values()), "") if isinstance(message, dict) else str(message)
        why = "; ".join(sorted({w.split(": ", 1)[-1] for w in row.get("why_not") or []})) or "-"
        ok = "not run" if row.get("ok") is None else row["ok"]
        seconds = "-" if row.get("seconds") is None else row["seconds"]
        lines.append(f"| {row['scenario']} | {row['op']} | {row['W']} | {ok} | {seconds} | {why} "
                     f"| {str(first)[:110].replace('|', '/')} |")
    return "\n".join(lines) + "\n\n" + _sourced(path, data["meta"])


def _target(ratio: float | None) -> str:
    """A row's target ratio as the table shows it ("—" where the row has none)."""
    return "—" if ratio is None else f"<= {ratio}x"


def host_shared(path: str) -> str:
    """Host time per call with W ranks sharing one GPU, eager and replayed, beside ``torch.mm`` alone."""
    data = _load(path)
    lines = ["| W | op | dtype | mode | host (µs) | `torch.mm` (µs) | paired ratio | target | the call's matmuls "
             "alone (µs) | eager / those |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        if row.get("op") is None:
            lines.append(f"| {row['W']} | {row.get('error', '-')} | | | | | | | | |")
            continue
        if "host_us" not in row:  # an op the step's budget (or a rank's error) left unmeasured
            lines.append(f"| {row['W']} | {OPS.get(row['op'], row['op'])} | - | {row.get('mode', '-')} | "
                         f"not measured: {str(row.get('error', '-')).split(' | ')[0][:60]} | | | | | |")
            continue
        bands = "-" if row.get("bands_us") is None else f"{row['bands']} launches, {_us(row['bands_us'])}"
        over = "-" if row.get("eager_over_bands") is None else f"{row['eager_over_bands']:.1f}x"
        lines.append(f"| {row['W']} | {OPS.get(row['op'], row['op'])} | {row['dtype']} | {row['mode']} | "
                     f"{_us(row['host_us'])} | {_us(row['torch_mm_us'])} | {row['paired_ratio']:.1f}x | "
                     f"{_target(row['target_ratio'])} | {bands} | {over} |")
    legend = ("<sub>The call's matmuls alone: per matmul step of the plan's schedule, the launches the P2P executor "
              "makes for it (`torch.mm` with `out=` or `addmm_`; fp8: `torch._scaled_mm`, plus an add where the step "
              "accumulates) on that many rows, no library code: about the floor of an eager call's host time (rows "
              "without it predate the column).</sub>")
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, data["meta"])


def fp8_moe_host(path: str) -> str:
    """The fp8 expert layer's host time per call beside the bf16 layer's (one GPU, a one-rank NCCL group)."""
    data = _load(path)
    runs = any("run" in row for row in data["rows"])  # rows of several runs, each row naming its run
    lines = ["| config | mode | " + ("run | " if runs else "") + "dtype | host (µs) | GPU (ms) | host / bf16's |",
             "| --- " * (6 + runs) + "|"]
    for row in data["rows"]:
        head = f"| {row['config']} | {row['mode']} | " + (f"{row.get('run', '-')} | " if runs else "") + row["dtype"]
        if row.get("error"):
            lines.append(f"{head} | error: {row['error'][:80]} | | |")
            continue
        lines.append(f"{head} | {_us(row['host_us'])} | {row['t_gpu_ms']:.2f} | {row['ratio_to_bf16']:.2f}x |")
    return "\n".join(lines) + "\n\n" + _sourced(path, data["meta"])


def moe_host_one_gpu(path: str) -> str:
    """Host time per MoE layer call on one GPU shared by two processes: ours (below the public op) beside the plain
    layer, timed interleaved in the same run, per mode."""
    data = _load(path)
    lines = ["| mode | replayed | grouped GEMM (up, down) | host syncs, ours / plain | ours (µs) | plain layer (µs) "
             "| ours / plain |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        if row.get("op") != "layer":
            continue
        gemm = ", ".join(row["gemm"]) + (" (the runtime's choice)" if row.get("chosen", True) else "")
        # A replayed call's count is written only where it was measured (before 2026-12-02 it was set to 0).
        counted = "syncs" in row and (not row["replayed"] or row.get("replay_syncs_counted"))
        syncs = f"{row['syncs']} / {row['plain_syncs']}" if counted else f"not counted / {row.get('plain_syncs', '-')}"
        lines.append(f"| {row['mode']} | {'yes' if row['replayed'] else 'no'} | {gemm} | {syncs} "
                     f"| {_us(row['host_us'])} | {_us(row['plain_us'])} | {row['host_us'] / row['plain_us']:.2f}x |")
    return "\n".join(lines) + "\n\n" + MOE_HOST_LEGEND + "\n\n" + _sourced(path, data["meta"])


MOE_HOST_LEGEND = (
    "<sub>Host time to issue one MoE layer call (µs), the GPU idle before each call (the plain layer synchronises "
    "with the host once, ours once in exact mode), two processes sharing one GPU (W = 2, P2P path through CUDA "
    "IPC; 2048 tokens per rank, hidden 1024, "
    "FFN 512, 16 experts, top-4, balanced, bf16). ours: `expert_layout`, the dispatch, SwiGLU and the combine, as "
    "`ExpertParallelMLP` runs them below the public op, on the grouped GEMM the runtime chooses, and on the other "
    "of Triton and cuBLAS beside it. host syncs: synchronising CUDA calls in one call (the plain layer's: eager) "
    "(`torch.cuda.set_sync_debug_mode`). plain layer: the counts (without a host synchronisation), their "
    "`all_to_all_single` and one host synchronisation, the rows' `all_to_all_single`, `torch._grouped_mm` "
    "up, SwiGLU, `torch._grouped_mm` down, the reverse all-to-all and the weighted sum, on a one-rank NCCL group "
    "(NCCL refuses two ranks on one GPU; the host work is the same). Timed interleaved in one run.</sub>")


def moe_gemm(path: str) -> str:
    """The expert GEMMs on one GPU: the grouped GEMM on the path the library chooses, beside ``torch._grouped_mm``
    and a per-expert ``torch.mm`` loop, per config, routing and projection."""
    data = _load(path)
    meta = data["meta"]
    lines = ["| config | routing | proj | experts | rows | **ours** (ms, path) | `torch._grouped_mm` (ms) "
             "| per-expert loop (ms) | ours vs `_grouped_mm` | one launch after every chunk (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        speed = f"{row['t_grouped_mm_ms'] / row['t_ms']:.2f}x" if row.get("t_ms") and row.get("t_grouped_mm_ms") \
            else "-"
        lines.append(f"| {row['config']} | {row['routing']} | {row['proj']} | {row['experts']} | {row['rows']} "
                     f"| **{_ms(row.get('t_ms'))}** ({row.get('path') or '-'}) | {_ms(row.get('t_grouped_mm_ms'))} "
                     f"| {_ms(row.get('t_loop_ms'))} | {speed} | {_ms(row.get('t_triton_ms'))} |")
    world = meta.get("world_size_sliced")
    legend = (f"<sub>ms per call, bf16, one rank's slice{f' at W = {world}' if world else ''} (its local experts and "
              "the rows it receives; `rows`: tokens x top-k). **ours**: the grouped GEMM as the expert paths run it, "
              "signals included, in the way the library runs the exact mode there (`triton`: our signalling "
              "kernel, `cublas`: `torch._grouped_mm`, each once per source rank's chunk as it lands, which streams "
              "every local expert's weights again per chunk; `hybrid`, where many experts have few rows each "
              "(DeepSeek-like): the heavy experts (1024 rows or more) a `torch.mm` per (source, expert) segment as "
              "chunks land, the light ones once over every source's rows in one launch of our kernel that takes an "
              "expert's rows from every chunk through a row map). `one launch after every chunk`: "
              "our kernel once over all the rows, as a path that waited for every chunk (no overlap) would run it. "
              "`torch._grouped_mm`: PyTorch's grouped GEMM alone, on the rows regrouped by expert. `per-expert "
              "loop`: one `torch.mm` per expert. `ours vs _grouped_mm`: its time over ours (above 1: ours is "
              "faster).</sub>")
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, meta)


def cpu_host_python(path: str) -> str:
    """The Python cost per call on the CPU with CUDA faked, per op and part, one column per label (``before``,
    ``after``), and their ratio where both are there."""
    data = _load(path)
    meta = data["meta"]
    labels = list(dict.fromkeys(row["mode"] for row in data["rows"]))
    by = {(row["op"], row["part"], row["mode"]): row for row in data["rows"]}
    both = labels[:2] if len(labels) >= 2 else []
    lines = ["| op | part | " + " | ".join(f"{label} (µs per call)" for label in labels)
             + (f" | {both[1]} / {both[0]}" if both else "") + " | driver and stream calls |",
             "| --- | --- | " + " | ".join("---" for _ in labels) + (" | ---" if both else "") + " | --- |"]
    for op, part in dict.fromkeys((row["op"], row["part"]) for row in data["rows"]):
        rows = [by.get((op, part, label)) for label in labels]
        cells = " | ".join("-" if r is None else f"{r['us_per_call']:.1f}" for r in rows)
        if both:
            first, second = by.get((op, part, both[0])), by.get((op, part, both[1]))
            cells += f" | {second['us_per_call'] / first['us_per_call']:.2f}x" if first and second else " | -"
        steps = " / ".join(str(r.get("driver_and_stream_calls", "-")) if r else "-" for r in rows)
        lines.append(f"| {OPS.get(op, op)} | {part} | {cells} | {steps} |")
    shape = "x".join(str(d) for d in meta.get("shape", []))
    legend = ("<sub>µs of Python per call on a CPU machine, CUDA faked (the least over several windows of calls; "
              f"{meta.get('machine', '')}, torch {meta.get('torch', '')}). `runtime`: the public op on a one-rank "
              "gloo group (checks, path and plan resolution, dispatch) with a communicator that returns at once. "
              f"`p2p-executor`: the P2P communicator's `run` of a {shape} plan at W = {meta.get('world_size_p2p')} "
              "against recording fakes of the driver, streams and events (cuBLAS a no-op); `driver and stream "
              "calls`: the calls it issued per call, per label. Not the GPU's host time: the driver's own cost is "
              "left out.</sub>")
    runs = meta.get("runs", {})
    last = list(runs)[-1] if runs else None  # the latest run measures the code as it is now
    sources = "; ".join(f"{label}: commit `{run['commit']}`{stale_note(run['commit']) if label == last else ''}, "
                        f"`{run['command']}`" for label, run in runs.items())
    return "\n".join(lines) + "\n\n" + legend + f"\n\n<sub>Source: `{path}`: {sources}.</sub>"


def cpu_nccl_host(path: str) -> str:
    """The NCCL path's host work per call on the CPU (``benchmarks/nccl_host_python.py``), per shape, dtype and mode:
    torch operators and µs of CPU time per call under the first two labels (``before``, ``after``)."""
    data = _load(path)
    meta = data["meta"]
    labels = list(dict.fromkeys(row["label"] for row in data["rows"]))[:2]
    by = {(row["shape"], row["dtype"], row["mode"], row["label"]): row for row in data["rows"]}
    lines = ["| shape | op | dtype | mode | " + " | ".join(f"torch operators, {label}" for label in labels) + " | "
             + " | ".join(f"µs, {label}" for label in labels) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in range(2 * len(labels))) + " |"]
    for shape, dtype, mode in dict.fromkeys((row["shape"], row["dtype"], row["mode"]) for row in data["rows"]):
        rows = [by.get((shape, dtype, mode, label)) for label in labels]
        op = next(r for r in rows if r is not None)["op"]
        ops = " | ".join("-" if r is None else str(r["torch_ops"]) for r in rows)
        us = " | ".join("-" if r is None else f"{r['us_per_call']:.1f}" for r in rows)
        lines.append(f"| {shape} | {OPS.get(op, op)} | {dtype} | {mode} | {ops} | {us} |")
    legend = ("<sub>One call of each op through the runtime on a CPU machine, one rank, the CUDA streams, the direct "
              "NCCL calls, the driver and the Triton GEMM's launch replaced by stand-ins that cost nothing, on plans "
              "of the structure the Llama-3-70B TP = 8 shapes' overlapped plans have (small tensors): the least CPU "
              f"time per call over several windows ({meta.get('machine', '')}, torch {meta.get('torch', '')}) and the "
              "torch operators it issues (on a GPU each costs a dispatch, most a launch). `replayed`: the host's work "
              "before a replayed call's graph launch. Not the GPU's host time.</sub>")
    runs = meta.get("runs", {})
    last = list(runs)[-1] if runs else None
    sources = "; ".join(f"{label}: commit `{run['commit']}`{stale_note(run['commit']) if label == last else ''}, "
                        f"`{run['command']}`" for label, run in runs.items())
    return "\n".join(lines) + "\n\n" + legend + f"\n\n<sub>Source: `{path}`: {sources}.</sub>"


def cpu_moe_host(path: str) -> str:
    """The MoE layer's host work per call on the CPU (``benchmarks/fp8_moe_host_python.py``), per config, mode, calls
    (eager, replayed) and dtype: µs of CPU time per layer call under the first two labels and their ratio."""
    data = _load(path)
    meta = data["meta"]
    labels = list(dict.fromkeys(row["label"] for row in data["rows"]))[:2]
    by = {(row["config"], row["mode"], row.get("calls"), row["dtype"], row["label"]): row for row in data["rows"]}
    lines = ["| config | mode | calls | dtype | torch operators | " + " | ".join(f"µs, {label}" for label in labels)
             + (f" | {labels[1]} / {labels[0]}" if len(labels) == 2 else "") + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in labels)
             + (" | ---" if len(labels) == 2 else "") + " |"]
    for key in dict.fromkeys((row["config"], row["mode"], row.get("calls"), row["dtype"]) for row in data["rows"]):
        rows = [by.get((*key, label)) for label in labels]
        ops = "/".join(dict.fromkeys(str(r["torch_ops"]) for r in rows if r is not None))
        us = " | ".join("-" if r is None else f"{r['us_per_call']:.1f}" for r in rows)
        ratio = ""
        if len(labels) == 2:
            ratio = " | -" if None in rows else f" | {rows[1]['us_per_call'] / rows[0]['us_per_call']:.2f}x"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {ops} | {us}{ratio} |")
    legend = ("<sub>One MoE layer call (the dispatch, SwiGLU, the combine; the NCCL expert path of a one-rank group) "
              "on a CPU machine, the CUDA streams, the GEMMs and the graphs replaced by stand-ins that cost nothing "
              f"(small tensors): the least CPU time per call over several windows ({meta.get('machine', '')}, torch "
              f"{meta.get('torch', '')}) and the torch operators it issues. `replayed`: what the host does before "
              "each call's graph launch. Not the GPU's host time.</sub>")
    pairs = meta.get("pairs")
    if pairs and len(labels) == 2:
        spans = "; ".join(f"pair {pair['pair']}: eager {_span(pair['eager_after_over_before'])}x, replayed "
                          f"{_span(pair['replayed_after_over_before'])}x" for pair in pairs)
        legend += (f"\n\n<sub>{len(pairs)} pairs of runs ({labels[0]}, then {labels[1]}), back to back; the table is "
                   f"pair {meta.get('kept_pair')}'s. {labels[1]} / {labels[0]} per pair, over its rows: {spans}.</sub>")
    runs = meta.get("runs", {})
    last = list(runs)[-1] if runs else None
    sources = "; ".join(f"{label}: commit `{run['commit']}`{stale_note(run['commit']) if label == last else ''}, "
                        f"`{run['command']}`" for label, run in runs.items())
    return "\n".join(lines) + "\n\n" + legend + f"\n\n<sub>Source: `{path}`: {sources}.</sub>"


def moe_layer(pattern: str) -> str:
    """Every MoE layer results file matching ``pattern`` (no file: a line saying so): per config, tokens,
    routing and pass, the plain layer, the bound without communication, and the fastest of ours over modes and
    paths."""
    def table(data: dict) -> list[str]:
        lines = ["| config | tokens | routing | pass | plain (ms) | no communication (ms) | **ours** (ms, mode, path) "
                 "| E | host µs plain / ours |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        best: dict[tuple, dict] = {}
        for row in data["rows"]:
            if row.get("t_ms") is None:
                continue  # a path that could not serve the call (its note row)
            key = (row["config"], row["W"], row["tokens"], row["routing"], row["pass"])
            if key not in best or row["t_ms"] < best[key]["t_ms"]:
                best[key] = row
        for (config, _, tokens, routing, pass_), row in best.items():
            lines.append(f"| {config} | {tokens} | {routing} | {pass_} | {_ms(row['t_plain_ms'])} "
                         f"| {_ms(row['t_nocomm_ms'])} | **{_ms(row['t_ms'])}** ({row['mode']}, {row['path']}) "
                         f"| {_e(row.get('E'))} | {_us(row.get('host_plain_us'))} / {_us(row.get('host_us'))} |")
        return lines

    return _per_file(pattern, table, MOE_LEGEND)


MOE_LEGEND = (
    "<sub>ms per layer call (bf16, SwiGLU experts over the W ranks). `plain`: NCCL `all_to_all_single` of the rows, "
    "`torch._grouped_mm`, the reverse all-to-all and the weighted sum (the counts exchanged first, one host "
    "synchronisation). `no communication`: the same with every all-to-all a local copy of the same size (the bound "
    "on what overlap can win). **ours**: the fastest of the file's modes and paths. `E`: `(plain - ours) / (plain - "
    "no communication)`. `host µs`: the host time to issue one call while the GPU is busy.</sub>")



def _span(values, digits: int = 2) -> str:
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


FP8_OPS = {"all_reduce": "scaled_gemm_all_reduce", "reduce_scatter": "scaled_gemm_reduce_scatter",
           "all_gather": "all_gather_scaled_gemm"}


def _grouped(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """``rows`` by the values of ``keys``, in the order first met."""
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault(tuple(row[key] for key in keys), []).append(row)
    return groups


def fp8_gemm(path: str) -> str:
    """The fp8 GEMM as each path runs it against ``torch._scaled_mm`` in the same mode: per op, path and scaling, the
    range over the grid's shapes."""
    data = _load(path)
    groups = _grouped(data["rows"], "op", "path", "scaling")
    lines = ["| op | path | scaling | GEMM | shapes | speed vs `torch._scaled_mm` | at the same SMs | TFLOP/s "
             "| speed vs bf16 `torch.mm` |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (op, path_name, scaling), rows in groups.items():
        gemms = {(row.get("plan") or {}).get("gemm", "triton" if row.get("tiles") else "cuBLAS sub-bands")
                 for row in rows}
        gemm = "/".join(sorted("cuBLAS bands" if g == "cublas" else g for g in gemms))
        lines.append(f"| {FP8_OPS.get(op, op)} | {path_name} | {scaling} | {gemm} | {len(rows)} "
                     f"| {_span([r['speed_vs_scaled_mm'] for r in rows])}x | {_budget_span(rows)} "
                     f"| {_span([r['tflops'] for r in rows], 0)} "
                     f"| {_span([r['t_bf16_mm_ms'] / r['t_ms'] for r in rows])}x |")
    legend = ("<sub>One H200, each op's per-rank GEMM at the bf16 grid's shapes (W = 2), median CUDA-event times "
              "queued behind GPU work, fresh random fp8 operands. `nccl`: the GEMM of the NCCL path's default fp8 plan "
              "(signals, groups and tile order included); `nccl-triton`: our block-wise Triton kernel on the same "
              "plan, for the record; `p2p`: `torch._scaled_mm` on the P2P ring's sub-bands. *At the same SMs*: where "
              "the plan's GEMM runs on fewer programs than the GPU has SMs (the all-gather's, which leaves NCCL its "
              "SMs), against `torch._scaled_mm` given those SMs (SM carve-out); – where the GEMM has every SM. "
              "Speeds are ratios of "
              "times in the same run (above 1: faster than the baseline); ranges over the shapes.</sub>")
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, data["meta"])


def _budget_span(rows: list[dict]) -> str:
    """The range of ``speed_vs_budget`` over ``rows`` that have it, or a dash."""
    values = [row["speed_vs_budget"] for row in rows if "speed_vs_budget" in row]
    return f"{_span(values)}x" if values else "–"


def fp8_host(path: str) -> str:
    """Host time per fp8 call beside the bf16 call of the same op, path and shape."""
    data = _load(path)
    lines = ["| op | path | scaling | bf16 call (µs) | fp8 call (µs) | fp8 / bf16 (paired) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        lines.append(f"| {FP8_OPS.get(row['op'], row['op'])} | {row['path']} | {row['scaling']} | "
                     f"{_us(row['host_us_bf16'])} | {_us(row['host_us_fp8'])} | {row['fp8_over_bf16']:.2f}x |")
    legend = ("<sub>Host time to issue one call while the GPU is busy (µs, eager), one process on one H200 and a "
              "one-rank NCCL group, M, N, K = 4096, 8192, 8192, timed interleaved with the bf16 call; the ratio is "
              "the median over rounds of the paired ratio. `sequential`: the default plan on one rank (the matmul "
              "then the collective); `nccl`: overlapped plans given to both calls. Block-wise scales as models carry "
              "them: A's row-major `[M, K/128]`, B's the transpose of the weight's `[N/128, K/128]`.</sub>")
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, data["meta"])


def fp8_p2p(path: str) -> str:
    """The P2P path's fp8 calls on one GPU shared by two processes: the mechanics checked, and host time per call
    (row-wise fp8 beside bf16, eager and replayed)."""
    data = _load(path)
    lines = ["| op | bf16 eager (µs) | fp8 eager (µs) | bf16 replayed (µs) | fp8 replayed (µs) | fp8 - bf16 eager, "
             "replayed (µs, paired) |", "| --- | --- | --- | --- | --- | --- |"]
    for (op,), rows in _grouped(data["rows"], "op").items():
        us = {row["call"]: row["host_us"] for row in rows if "call" in row}
        paired = next(row for row in rows if "call" not in row)
        lines.append(f"| {FP8_OPS.get(op, op)} | {_us(us['bf16 eager'])} | {_us(us['fp8 eager'])} | "
                     f"{_us(us['bf16 replayed'])} | {_us(us['fp8 replayed'])} | "
                     f"{paired['fp8 - bf16 eager us']:+.0f}, {paired['fp8 - bf16 replayed us']:+.0f} |")
    failures = data["failures"]
    legend = (f"<sub>Mechanics: {data['checked']} calls (every op x tensor/row/block scales x bf16 output with a bias "
              "/ fp32 output, two shapes, `w.t()` and row-major B, eager and replayed) each equal to the sequential "
              "result computed locally, gathered rows and scales byte for byte; "
              + (f"{len(failures)} cases replayed fewer calls than the rule gives (values right): "
                 + "; ".join(f.split(": ", 1)[1].replace("'scales part 5'", "'the packed own shard'")
                             for f in failures) if failures else "every case replayed as the rule "
                 "gives") + ". Host time: M, N, K = 4096, 8192, 8192, row-wise fp8 and bf16 calls timed interleaved "
              "while the GPU is busy, two processes on one H200.</sub>")
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, data["meta"])


def fp8_bytes(path: str) -> str:
    """What an fp8 call puts on the wire against the bf16 call of the same op, counted from the plan."""
    data = _load(path)
    groups = _grouped(data["rows"], "op", "scaling")
    lines = ["| op | scaling | bytes per row moved | fp8 bytes / bf16 bytes |", "| --- | --- | --- | --- |"]
    for (op, scaling), rows in groups.items():
        moved = ("fp8 row + its scales (" + str(rows[0]["scale_bytes_per_row"]) + " B), 16-byte aligned"
                 if op == "all_gather" else "bf16 partial products")
        lines.append(f"| {FP8_OPS.get(op, op)} | {scaling} | {moved} | {_span([r['ratio'] for r in rows], 3)} |")
    legend = ("<sub>Counted from the NCCL path's plans at the grid's shapes (W = 2, K = 8192 for the all-gather): "
              "the sum over groups of what each group's collective moves.</sub>")
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + _sourced(path, data["meta"])


def _files(pattern: str) -> list[str]:
    """The results files matching ``pattern``, as paths from the repository's root (absolute outside it)."""
    return [os.path.relpath(f, ROOT) if Path(f).is_relative_to(ROOT) else f
            for f in sorted(glob.glob(str(ROOT / pattern)))]


def _per_file(pattern: str, table: Callable[[dict], list[str]], legend: str = "") -> str:
    """A table per results file matching ``pattern`` (``table``: its lines from the file's data), each with its
    source line, then ``legend``; a line saying so where no file matches."""
    pieces = []
    for path in _files(pattern):
        data = _load(path)
        pieces.append("\n".join(table(data)) + "\n\n" + _sourced(path, data["meta"]))
    if not pieces:
        return f"Not measured yet (no file matches `{pattern}`)."
    return "\n\n".join(pieces) + (f"\n\n{legend}" if legend else "")


def fp8_ops(pattern: str) -> str:
    """The two-GPU fp8 grid (``benchmarks/fp8_ops.py``), per file: each op, scaling and shape, ours beside sequential
    (``torch._scaled_mm`` then NCCL), PyTorch's fused scaled op and the bf16 op."""
    def table(data: dict) -> list[str]:
        lines = ["| op | scaling | M, N, K | path | `T_seq` (ms) | PyTorch fused (ms) | bf16 op (ms) | **ours** (ms) "
                 "| speedup | E |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in data["rows"]:
            shape = f"{row['M']}, {row['N']}, {row['K']}"
            lines.append(f"| {FP8_OPS.get(row['op'], row['op'])} | {row['scaling']} | {shape} | {row['path']} "
                         f"| {_ms(row['t_seq_ms'])} | {_ms(row.get('t_fused_scaled_ms'))} "
                         f"| {_ms(row.get('t_bf16_op_ms'))} | **{_ms(row['t_ms'])}** | {row['speedup']:.2f} "
                         f"| {_e(row.get('E'))} |")
        return lines

    return _per_file(pattern, table)


def fp8_block(pattern: str) -> str:
    """The two-GPU float8 block (``benchmarks/fp8_block.py``), per file: each recipe, mode and token count, torchao's
    TP, torchtitan's async TP, ours and the pass, with ``E_block``."""
    def table(data: dict) -> list[str]:
        lines = ["| recipe | mode | tokens | torchao TP compiled (ms) | async TP (ms) | ours eager (ms) "
                 "| ours compiled (ms) | torchao + pass (ms) | E_block ours compiled / pass |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in data["rows"]:
            gains = row.get("E_block") or {}
            lines.append(f"| {row['recipe']} | {row['mode']} | {row['tokens']} | {_ms(row.get('t_torch_compiled_ms'))} "
                         f"| {_ms(row.get('t_async_tp_ms'))} | {_ms(row.get('t_ours_eager_ms'))} "
                         f"| {_ms(row.get('t_ours_compiled_ms'))} | {_ms(row.get('t_pass_ms'))} "
                         f"| {_e(gains.get('ours_compiled'))} / {_e(gains.get('pass'))} |")
        return lines

    return _per_file(pattern, table)

def timeline_sources(*paths: str) -> str:
    """The source line of each timeline picture's data (``benchmarks/harness/timeline.py`` draws the picture from it):
    where and at which commit it was measured, and whether the code has changed since. Its command is the file's
    to record: the option that drew the picture has changed since (``benchmarks.ops --timeline PNG`` now)."""
    said = "the file records its command, an older form of `benchmarks.ops --timeline PNG`"
    return "\n\n".join(_source(path, _load(path), said) for path in paths)


RENDERERS = {"headline": headline, "ops": ops_table, "block": block_table, "e-range": e_range,
             "host-ratio-range": host_ratio_range,
             "sub-bands": sub_band_table, "paths": paths_table, "model-summary": model_summary,
             "mutations": mutations_table, "reliability": reliability, "cpu-install": cpu_install,
             "cpu-moe-host": cpu_moe_host,
             "host-one-gpu": host_one_gpu, "moe-gemm": moe_gemm,
             "cpu-host-python": cpu_host_python, "moe-layer": moe_layer, "moe-host-one-gpu": moe_host_one_gpu,
             "fp8-gemm": fp8_gemm, "fp8-host": fp8_host, "fp8-bytes": fp8_bytes, "fp8-p2p": fp8_p2p,
             "fp8-ops": fp8_ops, "fp8-block": fp8_block, "host-bound": host_bound, "host-queue": host_queue,
             "fp8-grouped": fp8_grouped, "fp8-tiles": fp8_tiles, "shared-ranks": shared_ranks, "soak": soak,
             "faults": faults,
             "host-shared": host_shared, "fp8-moe-host": fp8_moe_host, "cpu-nccl-host": cpu_nccl_host,
             "timeline-sources": timeline_sources}


def render(spec: str) -> str:
    name, *args = spec.split()
    text = RENDERERS[name](*args)
    return text if "\n" not in text else text + "\n"


def agrees(written: str, fresh: str) -> bool:
    """Whether a document's piece equals a fresh rendering, where each note git could not confirm or deny (between
    ``UNSURE`` marks) may be there or not."""
    if UNSURE not in fresh:
        return written == fresh
    parts = fresh.split(UNSURE)  # text, note, text, note, ..., text
    pattern = "".join(re.escape(part) if i % 2 == 0 else f"(?:{re.escape(part)})?" for i, part in enumerate(parts))
    return re.fullmatch(pattern, written, re.S) is not None


def process(write: bool, only: list[str] | None = None) -> list[str]:
    """Re-render every marked piece (of the documents named in ``only``, paths from the repository's root, where
    given); returns ``doc: spec`` for each that differed (rewritten with ``write``: a note git could not confirm is
    left as the document has it where the rest agrees, else dropped)."""
    stale = []
    for doc in DOCS if not only else [ROOT / name for name in only]:
        text = doc.read_text()

        def fresh(match: re.Match, doc=doc) -> str:
            body = render(match["spec"])
            if agrees(match["body"], body):
                return match.group(0)
            stale.append(f"{doc.relative_to(ROOT)}: {match['spec']}")
            return match.group(1) + re.sub(f"{UNSURE}.*?{UNSURE}", "", body, flags=re.S) + match.group(4)

        new = MARKER.sub(fresh, text)
        if write and new != text:
            doc.write_text(new)
    return stale


USAGE = "usage: python benchmarks/readme_tables.py --write|--check [DOC ...] (default: every document)"


def main(argv: list[str]) -> int:
    """The command line: ``--help``, or ``--write``/``--check`` and the documents (paths from the repository's root),
    each a file holding at least one rendered piece (a misspelt path was a traceback, a file without markers
    checked nothing and exited 0)."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n\n" + __doc__.split("\n\n")[0])
        return 0
    if argv[:1] not in (["--write"], ["--check"]):
        print(USAGE, file=sys.stderr)
        return 2
    for name in argv[1:]:
        doc = ROOT / name
        if not doc.is_file():
            print(f"readme_tables.py: {argv[0]} {name}: no such file (documents are named from the repository's "
                  f"root, {ROOT})", file=sys.stderr)
            return 2
        if not MARKER.search(doc.read_text(errors="replace")):
            print(f"readme_tables.py: {argv[0]} {name}: holds no rendered piece (no <!-- render: ... --> marker)",
                  file=sys.stderr)
            return 2
    stale = process(write=argv[0] == "--write", only=argv[1:])
    for piece in stale:
        print(("rewrote " if argv[0] == "--write" else "stale: ") + piece)
    if not stale and argv[0] == "--check":
        print("every rendered piece " + (f"of {', '.join(argv[1:])} " if argv[1:] else "") + "matches its results file")
    return 1 if stale and argv[0] == "--check" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
