"""What the CPU host-cost scripts (``host_python.py``, ``moe_host_python.py``, ``fp8_moe_host_python.py``,
``nccl_host_python.py``) share: the operators that launch no GPU kernel, a one-rank group on the host, the least time
per call, the least row per case over repeats, the measured checkout's commit, and one labelled run ("before",
"after") merged into a results file beside the others."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

# Operators that launch no GPU kernel (views, metadata, allocation without a fill): what a CPU run's operator count
# leaves out of its ``kernels``.
NO_KERNEL = {"aten::view", "aten::slice", "aten::select", "aten::transpose", "aten::t", "aten::as_strided",
             "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::empty", "aten::empty_like",
             "aten::detach", "aten::alias", "aten::_reshape_alias", "aten::unflatten", "aten::split",
             "aten::chunk", "aten::narrow", "aten::permute", "aten::lift_fresh", "aten::empty_strided",
             "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view", "aten::split_with_sizes"}


def operator_counts(fn) -> tuple[int, int, list[str]]:
    """The torch operators one call of ``fn`` issues from Python (after a first call; the profiler's top-level
    ``aten::`` events): ``(how many, how many would launch a GPU kernel (not ``NO_KERNEL``), their names)``. On a GPU
    each costs host time of its own (a dispatch, and most a kernel launch), which the CPU's time understates."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    return len(names), sum(1 for n in names if n not in NO_KERNEL), names


def at_least_one(text: str) -> int:
    """A count of 1 or more (``--repeat``, ``--windows``, ``--calls``): 0 measured nothing, and the label's rows in
    the results file were replaced by none."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of 1 or more, got {text!r}")
    return int(text)


def names_of(known: tuple[str, ...]) -> Callable[[str], list[str]]:
    """A parser of comma-separated names, each one of ``known``, at least one: a misspelt one measured nothing for
    it, and the label's rows were replaced by fewer. (``flashoverlap.cli.names_of``'s twin, kept here: these scripts
    import the measured checkout's flashoverlap, which may predate it.)"""
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{'unknown ' + ', '.join(unknown) if unknown else 'none named'}; "
                                             f"choose from {', '.join(known)}")
        return names
    return parse


def results_out(script: str) -> Callable[[str], str]:
    """A parser of ``--out FILE``, the results file ``script``'s run merges its rows into (``write_run``, once every
    row is measured): refused at once where that would fail or mix files then, after minutes of measuring: a folder,
    a folder that does not exist or is not writable, a file that is no results file (no JSON, no rows) or another
    script's (its ``meta.command``, which ``write_run`` writes, names another)."""
    def parse(text: str) -> str:
        path = Path(text)
        folder = path.parent
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; name the results file")
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{folder} is not a folder (create it first)")
        if not os.access(path if path.exists() else folder, os.W_OK):
            raise argparse.ArgumentTypeError(f"{path if path.exists() else folder} is not writable")
        if path.exists():
            try:
                data = json.loads(path.read_text())
                ok = isinstance(data["rows"], list) and f"benchmarks/{script} " in data["meta"]["command"]
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                ok = False
            if not ok:
                raise argparse.ArgumentTypeError(f"{text} is no results file of benchmarks/{script}; name a new "
                                                 "file or one it wrote")
        return text
    return parse


def labelled_parser(doc: str, script: str) -> argparse.ArgumentParser:
    """The command line of a labelled CPU run of ``benchmarks/<script>``: ``--label`` (required), ``--out``
    (``results_out``), ``--repeat``, ``--windows``, ``--calls`` and ``--verbose`` (print each call's operators); a
    script adds its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="the rows' label, e.g. before / after")
    parser.add_argument("--out", default=None, type=results_out(script),
                        help="results JSON to add (or replace) this label's rows in")
    parser.add_argument("--repeat", type=at_least_one, default=2,
                        help="measure every row this many times, keep the least")
    parser.add_argument("--windows", type=at_least_one, default=20)
    parser.add_argument("--calls", type=at_least_one, default=20)
    parser.add_argument("--verbose", action="store_true", help="print each call's operators")
    return parser


@contextlib.contextmanager
def one_rank_on_the_host(root: Path):
    """A one-rank gloo group whose CUDA streams run on the host (``root``'s ``tests/comm/fake_cuda.py``: the checkout
    whose fakes fit the measured library), torch on one thread, for the duration: the scripts that run the NCCL path's
    own code without a GPU."""
    sys.path.insert(0, str(root))
    from tests.comm import fake_cuda

    torch.set_num_threads(1)
    fake_cuda.install(wait_timeout_s=10.0)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(store, 'init')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def per_call_us(fn: Callable[[], object], windows: int, calls: int) -> float:
    """The least time per call over ``windows`` runs of ``calls`` calls: on a shared machine, other work only ever
    adds time, so the least window is the code's own cost (as ``timeit`` advises)."""
    for _ in range(calls):  # warm: first-call caches, lazily built objects
        fn()
    best = float("inf")
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def least_rows(rows: list[dict], fields: tuple[str, ...]) -> dict[tuple, dict]:
    """Per case (the values of ``fields``), the row of least ``us_per_call``: on a shared machine, other work only
    ever adds time."""
    least: dict[tuple, dict] = {}
    for row in rows:
        key = tuple(row[field] for field in fields)
        if key not in least or row["us_per_call"] < least[key]["us_per_call"]:
            least[key] = row
    return least


def labelled(rows: list[dict], label: str, commit: str) -> list[dict]:
    """``rows``, each given the run's label and the measured checkout's commit, and printed one JSON line each."""
    for row in rows:
        row["label"], row["commit"] = label, commit
        print(json.dumps(row))
    return rows


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True).stdout.strip()


def checkout_commit(source: Path) -> str:
    """The measured checkout's commit, ``-dirty`` where its ``src`` differs from it."""
    dirty = _git(source, "status", "--porcelain", "--untracked-files=no", "--", "src")
    return _git(source, "rev-parse", "--short=10", "HEAD") + ("-dirty" if dirty else "")


def write_run(out: str, label: str, label_key: str, rows: list[dict], commit: str, root: Path, source: Path,
              script: str, meta: dict) -> None:
    """Merge one run's ``rows`` (each naming ``label`` under ``label_key``) into the results file ``out``: the
    file's rows of other labels are kept, and ``meta.runs`` records each label's commit, source, exact command,
    date and load; ``meta`` adds the script's own fields."""
    path = Path(out)
    data = json.loads(path.read_text()) if path.exists() else {"meta": {}, "rows": []}
    data["rows"] = [r for r in data["rows"] if r[label_key] != label] + rows
    pythonpath = os.environ.get("PYTHONPATH")
    runs = {name: run for name, run in data["meta"].get("runs", {}).items() if name != label}
    runs[label] = {
        "commit": commit, "source": "this checkout" if source == root else f"PYTHONPATH={pythonpath}",
        "command": " ".join(filter(None, [f"PYTHONPATH={pythonpath}" if pythonpath else "", "python", *sys.argv])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": round(os.getloadavg()[0], 2)}
    data["meta"] = {"command": f"python benchmarks/{script} --label LABEL --out FILE (runs: each label's exact "
                               "command; the script's docstring)",
                    "script_commit": _git(root, "rev-parse", "--short=10", "HEAD"), "runs": runs,
                    "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (CPU only)",
                    "torch": torch.__version__, **meta}
    path.write_text(json.dumps(data, indent=1) + "\n")
