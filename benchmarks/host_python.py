"""The Python cost of one op call on the CPU, with the CUDA layer faked: what the library's own code costs per call,
apart from what torch and the driver cost. Not a timed test: a measurement, written to a results file.

Two parts, per op:
- ``runtime``: the public op on a one-rank gloo group, its communicator replaced by one that returns at once: the
  checks, the group lookup, path and plan resolution and dispatch, per call.
- ``p2p-executor``: the P2P communicator's ``run`` for a 4096x8192x8192-shaped plan at W = 2 (the schedule the
  one-GPU diagnostic times), with the driver, streams and events replaced by recorders and cuBLAS by a no-op.

It runs against whichever flashoverlap is importable, with that checkout's own recording fakes
(``tests/comm/test_p2p_executor.py``), so the same script measures an older commit too (it adapts to the
communicator interface before the runtime layer, 7a977f7 and earlier). Each figure is the least time per call over
several windows (other work on a shared machine only adds time). Measure both from clean checkouts:

    git worktree add /tmp/fo-before 7a977f7 && git worktree add --detach /tmp/fo-after HEAD
    PYTHONPATH=/tmp/fo-before/src python benchmarks/host_python.py --label before \\
        --out benchmarks/results/cpu-host-python.json
    PYTHONPATH=/tmp/fo-after/src python benchmarks/host_python.py --label after \\
        --out benchmarks/results/cpu-host-python.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
# The checkout whose flashoverlap is importable (this one, or the one PYTHONPATH names): its own tests.comm
# recording driver and streams fit its communicators (an older commit's fakes, for an older commit).
SOURCE = Path(importlib.util.find_spec("flashoverlap").origin).resolve().parents[2]
sys.path.insert(0, str(SOURCE))

import flashoverlap as fo  # noqa: E402
from tests.comm import test_p2p_executor as fakes  # noqa: E402

OPS = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter, "all_gather": fo.all_gather_gemm}
SHAPE = (4096, 8192, 8192)


def _per_call_us(fn, windows: int = 20, calls: int = 50) -> float:
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


def runtime_us(op: str) -> float:
    """The public op through the runtime, with a communicator that does nothing."""
    a = torch.randn(64, 32, dtype=torch.bfloat16)
    b = torch.randn(48, 32, dtype=torch.bfloat16).t()
    try:
        from flashoverlap.runtime.context import context_of
    except ImportError:  # before the runtime layer: the reference path was a module function
        from flashoverlap.comm import reference

        reference.run = lambda plan, a, b, *args, **kw: (a, None)
    else:
        class Noop:
            path = "reference"

            def run(self, call):
                return call.a, None

            def release(self):
                pass

        context_of(dist.group.WORLD, torch.device("cpu")).communicators[("gemm", "reference")] = Noop()
    return _per_call_us(lambda: OPS[op](a, b))


def p2p_executor_us(op: str) -> tuple[float, int]:
    """The P2P communicator's run (eager, no replay) against recorders; returns (us per call, schedule steps)."""
    from flashoverlap.comm import p2p

    try:
        from flashoverlap.tune.defaults import default_plan
    except ImportError:
        from flashoverlap.plan import default_plan
    import pytest

    patch = pytest.MonkeyPatch()
    try:
        recorder = fakes.Recorder()
        comm = fakes._communicator(0, 2, recorder, patch)
        m, n, k = SHAPE
        plan = default_plan(op, m, n, k, 2, path="p2p", allow_sequential=False)
        rs = p2p.rs
        region = rs.region_rows(plan) * (k if op == "all_gather" else n) * 2
        comm.workspace = fakes.FakeWorkspace(rs.regions(2) * region)
        for name, value in (("prepare", lambda *args: None), ("_load_kernels", lambda *args: None),
                            ("_region_bytes", lambda: region)):
            patch.setattr(comm, name, value)
        patch.setattr(p2p, "debug_timeout", lambda: None, raising=False)
        patch.setattr(p2p, "replay_allowed", lambda: False, raising=False)
        patch.setattr(p2p.torch, "mm", lambda *args, **kw: None)
        patch.setattr(torch.Tensor, "addmm_", lambda *args, **kw: None)
        rows = plan.block_rows if op == "all_gather" else m
        # All-gather's shard is made contiguous by the call (a copy engine moves it as one block): a real one.
        a = torch.empty((rows, k), dtype=torch.bfloat16) if op == "all_gather" else \
            torch.empty(1, dtype=torch.bfloat16).as_strided((rows, k), (0, 0))
        b = torch.empty(1, dtype=torch.bfloat16).as_strided((k, n), (0, 0))
        empty = torch.empty
        patch.setattr(p2p.torch, "empty", lambda shape, **kw: empty(1, dtype=kw.get("dtype")).as_strided(shape, (0, 0)))
        patch.setattr(comm, "_new", lambda shape, dtype: empty(1, dtype=dtype).as_strided(shape, (0, 0)),
                      raising=False)
        try:
            from flashoverlap.comm.protocol import Call
        except ImportError:
            def call():
                recorder.trace.clear()
                comm.run(plan, a, b, op)
        else:
            resolved = Call(op, plan, a, b)

            def call():
                recorder.trace.clear()
                comm.run(resolved)
        call()
        steps = len(recorder.trace)
        return _per_call_us(call), steps
    finally:
        patch.undo()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", required=True, help="the row's mode, e.g. before / after")
    parser.add_argument("--out", default=None, help="results JSON to add (or replace) this label's rows in")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        rows = []
        for op in OPS:
            rows.append({"op": op, "part": "runtime", "mode": args.label, "us_per_call": round(runtime_us(op), 2)})
            us, steps = p2p_executor_us(op)
            rows.append({"op": op, "part": "p2p-executor", "mode": args.label, "us_per_call": round(us, 2),
                         "driver_and_stream_calls": steps})
        dist.destroy_process_group()
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=SOURCE, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src"], cwd=SOURCE,
                           capture_output=True, text=True).stdout.strip()
    commit += "-dirty" if dirty else ""
    for row in rows:
        row["commit"] = commit
        print(json.dumps(row))
    if args.out:
        path = Path(args.out)
        data = json.loads(path.read_text()) if path.exists() else {"meta": {}, "rows": []}
        data["rows"] = [r for r in data["rows"] if r["mode"] != args.label] + rows
        pythonpath = os.environ.get("PYTHONPATH")
        runs = {label: run for label, run in data["meta"].get("runs", {}).items() if label != args.label}
        runs[args.label] = {
            "commit": commit, "source": "this checkout" if SOURCE == ROOT else f"PYTHONPATH={pythonpath}",
            "command": " ".join(filter(None, [f"PYTHONPATH={pythonpath}" if pythonpath else "", "python",
                                              *sys.argv])),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average": round(os.getloadavg()[0], 2)}
        data["meta"] = {"command": "python benchmarks/host_python.py --label LABEL --out FILE (runs: each label's "
                                   "exact command; the script's docstring)",
                        "script_commit": subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT,
                                                        capture_output=True, text=True).stdout.strip(),
                        "runs": runs,
                        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (CPU only)",
                        "torch": torch.__version__, "shape": list(SHAPE), "world_size_p2p": 2}
        path.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
