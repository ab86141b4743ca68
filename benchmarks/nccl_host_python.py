"""The NCCL path's host work per call on the CPU (issue 41: "profile the first (eager) call and the calls that cannot
replay; remove the Python and driver work that does not need to happen per call"), bf16 beside fp8 row-wise, so that
a change is measured before and after without a GPU. Not a timed test: a measurement, written to a results file.

A call of each op through the public API and the runtime on a one-rank gloo group whose CUDA streams run on the host
(``tests/comm/fake_cuda.py``), with what a GPU would do replaced by stand-ins that cost nothing: the direct NCCL calls
(``comm/nccl_calls.py``, which a GPU's call makes by address: a one-rank collective's copy where it needs one), the
driver's stream-memory operations, and the Triton GEMM's launch (its launcher's Python runs; the stand-in bumps the
counters as the kernel leaves them). The plans have the structure of the overlapped plans that ``host_bound.py``
times on one H200 at the Llama-3-70B TP = 8 shapes (``default_plan(..., allow_sequential=False)``, fp8 with its
tiles: the groups, the GEMM kind, the programs and the NCCL CTAs) on small tensors (64 rows per group, N 48,
K 256): the Python and the operators issued do not depend on the widths.

Modes: ``eager`` (``FLASHOVERLAP_REPLAY=0``: every call issued) and ``replayed`` (each call finds its graph, a stand-in
that costs nothing: what a replayed call's host does before its graph launch). Rows {shape, op, dtype ("bf16",
"fp8-row"), mode, groups, gemm, us_per_call (the least time per call over windows: the library's Python and torch's
CPU kernels on small tensors), torch_ops (the profiler's top-level ``aten::`` events: on a GPU each costs a dispatch
and most a launch), kernels (those of them that would launch a GPU kernel), triton_launches, label, commit}. Run it
against a checkout (``PYTHONPATH=<checkout>/src``) to measure that checkout:

    git worktree add --detach /tmp/fo-before <commit>
    PYTHONPATH=/tmp/fo-before/src python benchmarks/nccl_host_python.py --label before \\
        --out benchmarks/results/cpu-nccl-host-python.json
    PYTHONPATH=src python benchmarks/nccl_host_python.py --label after \\
        --out benchmarks/results/cpu-nccl-host-python.json
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import types
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(importlib.util.find_spec("flashoverlap").origin).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.comm.fake_cuda: this checkout's (it fakes torch.cuda, not flashoverlap)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cpu_runs, beside this script

import cpu_runs  # noqa: E402

SHAPES = [  # (name, op, M, N, K): host_bound.py's Llama-3-70B TP = 8 per-rank shapes (all-gather: the gathered M)
    ("q,k,v", "all_gather", 8192, 1280, 8192),
    ("o", "reduce_scatter", 8192, 8192, 1024),
    ("up", "all_gather", 8192, 7168, 8192),
    ("down", "reduce_scatter", 8192, 8192, 3584),
    ("grid", "all_reduce", 4096, 8192, 8192),
]
ROWS_PER_GROUP, N, K = 64, 48, 256


class Direct:
    """The direct NCCL calls' surface (``comm/nccl_calls.NcclComm``: by tensor, and by address where the measured
    checkout calls so) on a one-rank group: what the collective leaves (a reduce-scatter's copy into its output; the
    rest leave their buffers as they are), no NCCL."""

    calls = 0

    def takes(self, dtype: torch.dtype) -> bool:
        return True

    @staticmethod
    def code(dtype: torch.dtype) -> int:
        return 0

    def all_reduce(self, tensor: torch.Tensor, stream: int) -> None:
        Direct.calls += 1

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, stream: int) -> None:
        Direct.calls += 1  # one rank: the band is the output (copied by address: no torch operator to count)
        ctypes.memmove(out.data_ptr(), inp.data_ptr(), out.numel() * out.element_size())

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, stream: int) -> None:
        Direct.calls += 1

    def all_gather_at(self, out: int, inp: int, count: int, code: int, stream: int) -> None:
        Direct.calls += 1

    def all_reduce_at(self, ptr: int, count: int, code: int, stream: int) -> None:
        Direct.calls += 1

    def reduce_scatter_at(self, out: int, inp: int, count: int, code: int, stream: int) -> None:
        Direct.calls += 1  # one rank: the band is the output (2 bytes an element: bf16, the reductions' dtype here)
        ctypes.memmove(out, inp, count * 2)


def _install(patch) -> dict:
    """The stand-ins (module docstring); returns the Triton launch counter."""
    from flashoverlap.comm import nccl_calls, stream_ops
    from flashoverlap.comm.tp import nccl
    from flashoverlap.kernels import gemm
    from flashoverlap.runtime import policy

    launches = {"count": 0}

    counts = {}  # per tile-to-group table (the plan's, made once): each group's tile count

    def launch(grid, args, meta):  # the signalling GEMM: every tile's counter bump, as the kernel leaves them
        launches["count"] += 1  # (by address: no torch operator of the stand-in's own is counted)
        counters, owner = args[3], args[5]
        if counters is not owner:
            key = (owner.data_ptr(), owner.numel())
            if key not in counts:
                counts[key] = numpy.bincount(numpy.ctypeslib.as_array((ctypes.c_int32 * key[1]).from_address(key[0])))
            tiles = counts[key]
            numpy.ctypeslib.as_array((ctypes.c_int32 * tiles.size).from_address(counters.data_ptr()))[:] = tiles

    patch.setattr(gemm, "_LAUNCH", launch)
    patch.setattr(nccl_calls, "for_group", lambda group, device, enabled=True: Direct())
    patch.setattr(stream_ops, "fast", lambda: types.SimpleNamespace(
        write=stream_ops.write, wait_reset=stream_ops.wait_reset, copy=stream_ops.copy))
    patch.setattr(nccl.NcclCommunicator, "comm_group", lambda self, comm_ctas: self.group)  # no capped clones
    patch.setitem(policy.REASON_NOT, "nccl", lambda request: None)  # the NCCL path, on a CPU group
    patch.setattr(nccl, "check_leaves_nccl_sms", lambda plan, num_sms, op="": None)  # the CPU has no SMs
    return launches


def _stand_in_graphs(comm):
    """The communicator's graphs, where every call finds its graph and a replay launches nothing: what a replayed
    call's host does besides the graph's launch. (On the CPU the allocator does not hand a call's outputs the
    previous call's addresses, as CUDA's caching allocator does: the lookup hashes the signature and finds it.)"""
    from flashoverlap.comm import replay

    class Found(replay.CallGraphs):
        def replay(self, signature) -> bool:
            self.replays += hash(signature) is not None
            return True

        def __len__(self) -> int:  # graphs held
            return 1

    if hasattr(replay.CallGraphs, "replayer"):
        return Found(comm.device)
    return types.SimpleNamespace(run=lambda signature, issue: hash(signature) is not None, clear=lambda: None)


def _call(op: str, dtype: str, plan, gen: torch.Generator):
    import flashoverlap as fo

    rows = plan.m // plan.world_size if op == "all_gather" else plan.m
    # The tables written out, not flashoverlap.ops.GEMM_OPS / SCALED_OPS: the script measures older checkouts too.
    if dtype == "bf16":
        a = torch.randn(rows, plan.k, generator=gen).bfloat16()
        b = (torch.randn(plan.n, plan.k, generator=gen) / plan.k**0.5).bfloat16().t()
        fn = {"all_gather": fo.all_gather_gemm, "reduce_scatter": fo.gemm_reduce_scatter,
              "all_reduce": fo.gemm_all_reduce}[op]
        return lambda: fn(a, b, path="nccl", plan=plan)
    a = torch.randn(rows, plan.k, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(plan.n, plan.k, generator=gen).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(rows, 1, generator=gen) + 0.5, torch.rand(1, plan.n, generator=gen) + 0.5
    fn = {"all_gather": fo.all_gather_scaled_gemm, "reduce_scatter": fo.scaled_gemm_reduce_scatter,
          "all_reduce": fo.scaled_gemm_all_reduce}[op]
    return lambda: fn(a, b, sa, sb, path="nccl", plan=plan)


def rows_for(shape, windows: int, calls: int, verbose: bool = False) -> list[dict]:
    import pytest

    from flashoverlap import settings
    from flashoverlap.plan import TileConfig
    from flashoverlap.runtime.context import context_of
    from flashoverlap.tune.defaults import default_plan
    from flashoverlap.tune.fp8 import fp8_tiles

    name, op, m, n, k = shape
    out = []
    with pytest.MonkeyPatch.context() as patch:
        launches = _install(patch)
        for dtype in ("bf16", "fp8-row"):
            fp8 = dtype != "bf16"
            tile = fp8_tiles(m, n, k, "row", op).tile_config() if fp8 else None
            real = default_plan(op, m, n, k, 1, allow_sequential=False, **({"tile": tile} if fp8 else {}))
            small = TileConfig(16, 16, 128 if fp8 else 16, 2, 1, 4)
            plan = default_plan(op, ROWS_PER_GROUP * real.num_groups, N, K, 1, tile=small, num_groups=real.num_groups,
                                gemm=real.gemm, comm_ctas=real.comm_ctas, num_programs=real.num_programs,
                                allow_sequential=False)
            call = _call(op, "fp8" if fp8 else "bf16", plan, torch.Generator().manual_seed(0))
            for mode in ("eager", "replayed"):
                patch.setenv("FLASHOVERLAP_REPLAY", "0" if mode == "eager" else "1")
                settings.refresh()
                with torch.no_grad():
                    call()  # the first call: NCCL state, plan tables, agreement
                    if mode == "replayed":  # from the next call on the call's graph is found (a stand-in)
                        comm = context_of(dist.group.WORLD, torch.device("cpu")).communicators[("gemm", "nccl")]
                        patch.setattr(comm, "graphs", _stand_in_graphs(comm))
                        call()  # the call's lane, where the measured checkout has one
                    launches["count"] = 0
                    call()
                    triton = launches["count"]
                    ops, kernels, names = cpu_runs.operator_counts(call)
                    us = cpu_runs.per_call_us(call, windows=windows, calls=calls)
                if verbose:
                    print(name, dtype, mode, names, file=sys.stderr)
                out.append({"shape": name, "op": op, "dtype": dtype, "mode": mode, "groups": plan.num_groups,
                            "gemm": plan.gemm, "us_per_call": round(us, 1), "torch_ops": ops, "kernels": kernels,
                            "triton_launches": triton})
        settings.refresh()
    return out


def main() -> int:
    parser = cpu_runs.labelled_parser(__doc__, "nccl_host_python.py")
    args = parser.parse_args()
    with cpu_runs.one_rank_on_the_host(ROOT):
        measure(args)
    return 0


def measure(args) -> None:
    measured = [row for _ in range(args.repeat) for shape in SHAPES
                for row in rows_for(shape, args.windows, args.calls, args.verbose)]
    rows = list(cpu_runs.least_rows(measured, ("shape", "dtype", "mode")).values())
    commit = cpu_runs.checkout_commit(SOURCE)
    cpu_runs.labelled(rows, args.label, commit)
    for row in rows:
        print(row)
    if args.out:
        cpu_runs.write_run(args.out, args.label, "label", rows, commit, ROOT, SOURCE, "nccl_host_python.py",
                  {"world_size": 1, "path": "nccl", "small_shapes": {"rows_per_group": ROWS_PER_GROUP, "N": N, "K": K},
                   "unit": "us_per_call: least over --windows windows of --calls calls, times --repeat; torch's CPU "
                           "kernels on small tensors included, the Triton GEMM, the direct NCCL calls and the driver "
                           "stand-ins, the CUDA streams the host's (tests/comm/fake_cuda.py)"})


if __name__ == "__main__":
    sys.exit(main())
