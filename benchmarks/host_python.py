"""The Python cost of one op call on the CPU, with the CUDA layer faked: what the library's own code costs per call,
apart from what torch and the driver cost. Not a timed test: a measurement, written to a results file.

Two parts, per op:
- ``runtime``: the public op on a one-rank gloo group, its communicator replaced by one that returns at once: the
  checks, the group lookup, path and plan resolution and dispatch, per call.
- ``p2p-executor``: the P2P communicator's ``run`` (eager) for the shape's default P2P plan at each W of
  ``--worlds`` (default 2; 4096x8192x8192 by default, the schedule the one-GPU diagnostic times; ``--shape
  2048,4096,4096`` is the shared-GPU host step's), bf16 and, with ``--dtypes bf16,row``, fp8 row-wise, with the
  driver, streams and events replaced by recorders and cuBLAS (and the fp8 packing) by no-ops. ``driver_calls``
  counts the calls into the driver (a batch once, where the checkout batches), ``matmuls`` the cuBLAS calls.
- ``p2p-replayed`` (with ``--parts``): the same ``run`` where the call replays its graph (a recording stand-in):
  the signature and the lookup.

It runs against whichever flashoverlap is importable, with that checkout's own recording fakes
(``tests/comm/test_p2p_executor.py``), so the same script measures an older commit too (it adapts to the
communicator interface before the runtime layer, 7a977f7 and earlier). Each figure is the least time per call over
several windows (other work on a shared machine only adds time). Measure both from clean checkouts:

    git worktree add /tmp/fo-before 7a977f7 && git worktree add --detach /tmp/fo-after HEAD
    PYTHONPATH=/tmp/fo-before/src python benchmarks/host_python.py --label before \\
        --out benchmarks/results/cpu-host-python.json
    PYTHONPATH=/tmp/fo-after/src python benchmarks/host_python.py --label after \\
        --out benchmarks/results/cpu-host-python.json

The W columns (``benchmarks/results/cpu-host-python-w8.json``): the same with ``--shape 2048,4096,4096 --worlds
2,4,8 --dtypes bf16,row --parts p2p-executor,p2p-replayed``.
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

from cpu_runs import checkout_commit, names_of, per_call_us, results_out, write_run  # noqa: E402

import flashoverlap as fo  # noqa: E402
from tests.comm import test_p2p_executor as fakes  # noqa: E402

# Written out, not flashoverlap.ops.GEMM_OPS: the script measures older checkouts too, which lack it.
OPS = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter, "all_gather": fo.all_gather_gemm}
SHAPE = (4096, 8192, 8192)
PARTS = ("runtime", "p2p-executor")


class Counting:
    """A recording driver's calls counted: every method the executor calls on it (a batch once), but the lookups
    of the current stream and the making of events (once per communicator)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("current_stream", "new_event", "free_event"):
            return attr

        def counted(*args):
            self.calls += 1
            return attr(*args)

        return counted


def _recorder():
    """The checkout's recording driver (``tests/comm/test_p2p_executor.Recorder``), with the batched calls where
    the checkout's driver has them (the executor batches where the driver does): each recorded as one entry, as the
    driver takes it."""
    from flashoverlap.comm import stream_ops

    if not hasattr(stream_ops.FastDriver, "memops"):
        return fakes.Recorder()

    class BatchRecorder(fakes.Recorder):
        def memops(self, stream, batch):
            self.trace.append((stream, "memops", batch))

        def copies(self, stream, batch):
            self.trace.append((stream, "copies", batch))

    return BatchRecorder()


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

            def replayer(self, call):  # no replay lane (comm/protocol.py; absent before it)
                return None

            def release(self):
                pass

        context_of(dist.group.WORLD, torch.device("cpu")).communicators[("gemm", "reference")] = Noop()
    return per_call_us(lambda: OPS[op](a, b), windows=20, calls=50)


def p2p_executor_us(op: str, world: int = 2, shape: tuple[int, int, int] = SHAPE, dtype: str = "bf16",
                    replayed: bool = False) -> tuple[float, int, int, int]:
    """The P2P communicator's run (eager, or a replayed call with ``replayed``) against recorders at ``world``
    ranks (rank 0), bf16 or fp8 row-wise (``dtype="row"``); returns (us per call, schedule steps, driver calls,
    matmuls)."""
    from flashoverlap.comm.tp import p2p

    try:
        from flashoverlap.tune.defaults import default_plan
    except ImportError:
        from flashoverlap.plan import default_plan
    import pytest

    patch = pytest.MonkeyPatch()
    try:
        recorder = _recorder()
        comm = fakes._communicator(0, world, recorder, patch)
        m, n, k = shape
        plan = default_plan(op, m, n, k, world, path="p2p", allow_sequential=False)
        rs = p2p.rs
        fp8 = dtype == "row"
        scales = None
        element = 1 if fp8 else 2
        if fp8:
            from flashoverlap.comm import scaled

            rows = plan.block_rows if op == "all_gather" else m
            scales = scaled.Scales.of(torch.ones(rows, 1), torch.ones(1, n))
            row = scaled.row_bytes(k, torch.float8_e4m3fn, scales) if op == "all_gather" else n * 2
        else:
            row = (k if op == "all_gather" else n) * element
        region = rs.region_rows(plan) * row
        comm.workspace = fakes.FakeWorkspace(rs.regions(world) * region)
        for name, value in (("prepare", lambda *args: None), ("_load_kernels", lambda *args: None),
                            ("_region_bytes", lambda: region)):
            patch.setattr(comm, name, value)
        patch.setattr(p2p, "debug_timeout", lambda: None, raising=False)
        patch.setattr(p2p, "replay_allowed", lambda: False, raising=False)
        matmuls = [0]

        def matmul(*args, **kw):
            matmuls[0] += 1

        patch.setattr(p2p.torch, "mm", matmul)
        patch.setattr(torch.Tensor, "addmm_", matmul)
        if fp8:
            patch.setattr(p2p, "_scaled_band", matmul)
            patch.setattr(p2p.scaled, "pack_rows", lambda a, scale_rows, out=None: out)
        rows = plan.block_rows if op == "all_gather" else m
        a_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        # All-gather's shard is made contiguous by the call (a copy engine moves it as one block): a real one.
        a = torch.empty((rows, k), dtype=a_dtype) if op == "all_gather" else \
            torch.empty(1, dtype=a_dtype).as_strided((rows, k), (0, 0))
        b = torch.empty(1, dtype=a_dtype).as_strided((k, n), (0, 0))
        empty = torch.empty
        blocks: dict = {}  # the caching allocator's block for a shape, call after call (what lets a call replay)

        def new(shape, dtype):
            key = (tuple(shape), dtype)
            if key not in blocks:
                blocks[key] = empty(shape, dtype=dtype)
            return blocks[key]

        patch.setattr(p2p.torch, "empty", lambda shape, **kw: new(shape, kw.get("dtype")))
        patch.setattr(comm, "_new", new, raising=False)
        if replayed:
            class Graph:
                def __init__(self, issue):
                    issue()

                def replay(self):
                    pass

            comm.graphs = p2p.CallGraphs(None, capture=Graph)
        try:
            from flashoverlap.comm.protocol import Call
        except ImportError:
            def call():
                recorder.trace.clear()
                comm.run(plan, a, b, op)
        else:
            resolved = Call(op, plan, a, b, replay=replayed, **({"scales": scales} if fp8 else {}))

            def call():
                recorder.trace.clear()
                comm.run(resolved)
        for _ in range(3):  # the program resolved; replayed: the graph captured
            call()
        steps = len(recorder.trace)
        counting = Counting(recorder)
        patch.setattr(p2p.stream_ops, "fast", lambda: counting)
        matmuls[0] = 0
        call()
        calls, mms = counting.calls, matmuls[0]
        patch.setattr(p2p.stream_ops, "fast", lambda: recorder)
        return per_call_us(call, windows=20, calls=50), steps, calls, mms
    finally:
        patch.undo()


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before anything runs: W values of at least 2, a shape of three positive integers
    whose M each W divides (every rank of reduce_scatter and all_gather holds M / W rows)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="the row's mode, e.g. before / after")
    parser.add_argument("--out", default=None, type=results_out("host_python.py"),
                        help="results JSON to add (or replace) this label's rows in")
    parser.add_argument("--worlds", type=_ints, default=[2], help="W of the P2P rows, comma-separated (default 2)")
    parser.add_argument("--shape", type=_ints, default=list(SHAPE), metavar="M,N,K", help="M,N,K of the P2P rows")
    parser.add_argument("--dtypes", type=names_of(("bf16", "row")), default=["bf16"],
                        help="bf16 and/or row (fp8 row-wise), comma-separated")
    parser.add_argument("--parts", type=names_of(("runtime", "p2p-executor", "p2p-replayed")), default=list(PARTS),
                        help=f"comma-separated of runtime, p2p-executor, p2p-replayed (default {','.join(PARTS)})")
    args = parser.parse_args(argv)
    if any(w < 2 for w in args.worlds):
        parser.error(f"--worlds: each W is a rank count of at least 2 (the P2P path's peers), got {args.worlds}")
    if len(args.shape) != 3 or any(v < 1 for v in args.shape):
        parser.error(f"--shape: three positive integers M,N,K, got {','.join(map(str, args.shape))}")
    uneven = [w for w in args.worlds if args.shape[0] % w]
    if uneven:
        parser.error(f"--shape: M = {args.shape[0]} is not divisible by W = {uneven} of --worlds (each rank of "
                     "reduce_scatter and all_gather holds M / W rows)")
    args.shape = tuple(args.shape)
    return args


def main() -> int:
    args = parse_args()
    worlds, shape = args.worlds, args.shape
    parts = args.parts
    extended = (worlds, shape, args.dtypes, parts) != ([2], SHAPE, ["bf16"], list(PARTS))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        rows = []
        for op in OPS:
            if "runtime" in parts:
                rows.append({"op": op, "part": "runtime", "mode": args.label,
                             "us_per_call": round(runtime_us(op), 2)})
            for world in worlds:
                for dtype in args.dtypes:
                    for part in ("p2p-executor", "p2p-replayed"):
                        if part not in parts:
                            continue
                        us, steps, calls, mms = p2p_executor_us(op, world, shape, dtype, part == "p2p-replayed")
                        row = {"op": op, "part": part, "mode": args.label, "us_per_call": round(us, 2),
                               "driver_and_stream_calls": steps}
                        if extended:
                            row = {"op": op, "dtype": dtype, "W": world, **row, "driver_calls": calls,
                                   "matmuls": mms}
                        rows.append(row)
        dist.destroy_process_group()
    commit = checkout_commit(SOURCE)
    for row in rows:
        row["commit"] = commit
        print(json.dumps(row))
    if args.out:
        write_run(args.out, args.label, "mode", rows, commit, ROOT, SOURCE, "host_python.py",
                  {"shape": list(shape), "world_size_p2p": worlds[0] if len(worlds) == 1 else worlds,
                   **({"dtypes": args.dtypes, "parts": parts} if extended else {})})
    return 0


if __name__ == "__main__":
    sys.exit(main())
