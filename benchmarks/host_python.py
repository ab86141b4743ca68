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
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
# The checkout whose flashoverlap is importable (this one, or the one PYTHONPATH names): its own tests.comm
# recording driver and streams fit its communicators (an older commit's fakes, for an older commit).
SOURCE = Path(importlib.util.find_spec("flashoverlap").origin).resolve().parents[2]
sys.path.insert(0, str(SOURCE))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cpu_runs, beside this script

from cpu_runs import checkout_commit, per_call_us, write_run  # noqa: E402

import flashoverlap as fo  # noqa: E402
from tests.comm import test_p2p_executor as fakes  # noqa: E402

OPS = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter, "all_gather": fo.all_gather_gemm}
SHAPE = (4096, 8192, 8192)


def runtime_us(op: str) -> float:
    """The public op through the runtime, with a communicator that does nothing."""
    a = torch.randn(64, 32, dtype=torch.bfloat16)
    b = torch.randn(48, 32, dtype=torch.bfloat16).t()
    try:
        from flashoverlap.runtime.context import context_of
    except ImportError:  # before the runtime layer: the reference path was a module function
        from flashoverlap.comm.tp import reference

        reference.run = lambda plan, a, b, *args, **kw: (a, None)
    else:
        class Noop:
            path = "reference"

            def run(self, call):
                return call.a, None

            def release(self):
                pass

        context_of(dist.group.WORLD, torch.device("cpu")).communicators[("gemm", "reference")] = Noop()
    return per_call_us(lambda: OPS[op](a, b), windows=20, calls=50)


def p2p_executor_us(op: str) -> tuple[float, int]:
    """The P2P communicator's run (eager, no replay) against recorders; returns (us per call, schedule steps)."""
    from flashoverlap.comm.tp import p2p

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
        return per_call_us(call, windows=20, calls=50), steps
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
    commit = checkout_commit(SOURCE)
    for row in rows:
        row["commit"] = commit
        print(json.dumps(row))
    if args.out:
        write_run(args.out, args.label, "mode", rows, commit, ROOT, SOURCE, "host_python.py",
                  {"shape": list(SHAPE), "world_size_p2p": 2})
    return 0


if __name__ == "__main__":
    sys.exit(main())
