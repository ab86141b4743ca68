"""Where a replayed NCCL-path call's host time goes (issue 41: "NCCL path, repeated call, host issue per call
<= 1.5x torch.mm"): per op at a Llama-3-70B TP = 8 shape and the grid's all-reduce (bf16; the all-reduce in fp8
row-wise too), on a one-rank NCCL group with the overlapped plan, each step of a replayed call timed alone beside
the whole call and ``torch.mm`` (``host_us_interleaved``: one call each per round, the GPU busy ahead), then a
cProfile of a loop of replayed calls, and the loop's anatomy as ``benchmarks/host_bound.py`` runs it (from an idle
GPU): each call's own issue time, the replays and captures the loop made, and the host per call at loop lengths 10,
50 and 200 (a call that misses its graph is issued eagerly; a queue that fills blocks the host on the GPU); and the
call captured into a user's graph: its nodes by type and its launches' host time alone.
The steps are the call pipeline's (``runtime/calls.execute``) and the
communicator's (``comm/tp/nccl.NcclCommunicator.run``), in the order a call runs them; their sum is not the whole
(each step timed alone pays a Python call of its own). A diagnostic, not a library figure.

PYTHONPATH=src python -m benchmarks.diagnostics.replay_parts [out.json]
"""

from __future__ import annotations

import sys

import torch

from benchmarks.diagnostics.results_file import one_gpu_setup, one_rank_nccl_diagnostic, results_argument, results_meta
from benchmarks.harness.timing import host_us_interleaved, loop_host_us, profiled
from benchmarks.host_bound import _row_scaled

CASES = [("q,k,v", "all_gather", 8192, 1280, 8192, "bf16"), ("o", "reduce_scatter", 8192, 8192, 1024, "bf16"),
         ("grid", "all_reduce", 4096, 8192, 8192, "bf16"), ("grid", "all_reduce", 4096, 8192, 8192, "fp8-row"),
         # the up projection in fp8 replayed 10-20 us dearer than q,k,v's in every host-bound run on an H100
         ("q,k,v", "all_gather", 8192, 1280, 8192, "fp8-row"), ("up", "all_gather", 8192, 7168, 8192, "fp8-row"),
         ("up", "all_gather", 8192, 7168, 8192, "bf16")]


def _anatomy(fn, graphs) -> dict:
    """A loop of ``fn`` from an idle GPU, as ``host_bound`` times it: each call's issue time (µs), and the loop's
    replays and captures (``graphs``: the communicator's ``CallGraphs``); then the host per call at loop lengths 10,
    50 and 200, each from an idle GPU."""
    import time

    torch.cuda.synchronize()
    replays, captures = graphs.replays, graphs.captures
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        fn()
        times.append(round((time.perf_counter() - t0) * 1e6, 1))
    torch.cuda.synchronize()
    made = {"replays": graphs.replays - replays, "captures": graphs.captures - captures}
    per_length = {}
    for length in (10, 50, 200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(length):
            fn()
        per_length[length] = round((time.perf_counter() - t0) / length * 1e6, 1)
        torch.cuda.synchronize()
    return {"call_us": times, "of 50 calls": made, "host_us_per_loop_length": per_length}


def _user_graph(fn) -> dict:
    """The call captured into a user's graph (kept, so that its nodes can be read): its nodes by type, and the
    host per launch (``CUDAGraph.replay``) of loops of 10, 50 and 200 launches from an idle GPU."""
    import time

    from benchmarks.diagnostics.replay_host import node_types

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    graph.instantiate()
    nodes = node_types(graph)
    per_length = {}
    for length in (10, 50, 200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(length):
            graph.replay()
        per_length[length] = round((time.perf_counter() - t0) / length * 1e6, 1)
        torch.cuda.synchronize()
    return {"nodes": nodes, "launch_host_us_per_loop_length": per_length}


def _operands(op, m, n, k, dtype, device, gen):
    """bf16 ``(a, b = w.t(), None)``, or row-wise fp8 ``(a, b, (scale_a, scale_b))`` as ``host_bound`` makes them;
    one rank: all-gather's shard is all of A."""
    if dtype == "bf16":
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=gen)
        b = (torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=gen) / k**0.5).t()
        return a, b, None
    a, sa = _row_scaled(m, k, device, gen)
    w, sw = _row_scaled(n, k, device, gen)
    return a, w.t(), (sa, sw.reshape(1, n))


def _case(name, op, m, n, k, dtype, device, gen, sms) -> dict:
    import flashoverlap as fo
    from flashoverlap import guards, settings
    from flashoverlap.comm.scaled import Scales
    from flashoverlap.runtime.calls import GEMM, GemmSpec, agree_every_call
    from flashoverlap.runtime.context import REGISTRY
    from flashoverlap.tune.fp8 import fp8_tiles

    a, b, scales = _operands(op, m, n, k, dtype, device, gen)
    tile = None if scales is None else fp8_tiles(m, n, k, "row", op).tile_config()
    plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False,
                           **({} if tile is None else {"tile": tile}))
    if scales is None:
        public = fo.ops.GEMM_OPS[op]

        def whole():
            return public(a, b, path="nccl", plan=plan)

        def alone():
            return torch.mm(a, b)
        spec = GemmSpec(public.__name__, op, a, b, None, plan, "nccl")
    else:
        sa, sb = scales
        public = fo.ops.SCALED_OPS[op]

        def whole():
            return public(a, b, sa, sb, path="nccl", plan=plan)

        def alone():
            return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
        spec = GemmSpec(public.__name__, op, a, b, None, plan, "nccl",
                        scales=Scales.of(sa, sb, torch.bfloat16, None, n))
    for _ in range(4):  # eager, captured, replayed
        whole()
    torch.cuda.synchronize()
    env = settings.current()
    signature = GEMM.signature(spec, env)
    entry = REGISTRY.lookup(signature)
    if entry is None:
        raise RuntimeError(f"{spec.name}: the pipeline's signature was not found (the diagnostic's spec differs)")
    communicator = entry[0]
    call = GEMM.call(spec, entry, env)
    buffers = communicator._buffers(call)
    key = communicator._signature(call, buffers)
    found = key in communicator.graphs._graphs
    out_dtype = torch.bfloat16
    rows_out = plan.block_rows if op == "reduce_scatter" else plan.m
    parts = {
        "torch.mm" if scales is None else "torch._scaled_mm": alone,
        "whole replayed call": whole,
        "an empty Python call": lambda: None,
        "settings.current": settings.current,
        "agree_every_call": lambda: agree_every_call(spec.a, spec.path, spec.group),
        "GEMM.signature": lambda: GEMM.signature(spec, env),
        "REGISTRY.lookup": lambda: REGISTRY.lookup(signature),
        "GEMM.call (capturing check, Call)": lambda: GEMM.call(spec, entry, env),
        "guards.on_current_device": lambda: guards.on_current_device(a),
        "guards.capturing": lambda: guards.capturing(a),
        "_buffers (the outputs' allocation)": lambda: communicator._buffers(call),
        "torch.empty of the output alone": lambda: torch.empty((rows_out, n), dtype=out_dtype, device=device),
        "_signature (replay key)": lambda: communicator._signature(call, buffers),
        "hash of the replay key": lambda: hash(key),
        "CallGraphs.replay (lookup + launch)": lambda: communicator.graphs.replay(key),
    }
    host = host_us_interleaved(parts, calls=64)
    loop = {"torch.mm loop": loop_host_us(alone, 50), "whole replayed call loop": loop_host_us(whole, 50)}
    profile = profiled(whole, 300, orders=("tottime",), limit=30)
    anatomy = {"replayed call": _anatomy(whole, communicator.graphs), "alone": _anatomy(alone, communicator.graphs)}
    try:
        anatomy["user graph"] = _user_graph(whole)
    except Exception as exc:  # a diagnostic's extra: its failure must not lose the row
        anatomy["user graph"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    row = {"shape": name, "op": op, "dtype": dtype, "M": m, "N": n, "K": k, "graph found": found,
           "host_us": {key_: round(v, 2) for key_, v in host.items()},
           "loop_host_us": {key_: round(v, 2) for key_, v in loop.items()}, "loop_anatomy": anatomy,
           "profile": profile}
    print({key_: v for key_, v in row.items() if key_ != "profile"}, flush=True)
    print(profile[:4000], flush=True)
    return row


def main() -> dict:
    device, sms, gen = one_gpu_setup(replay=True)
    rows = []
    for case in CASES:
        try:
            rows.append(_case(*case, device, gen, sms))
        except Exception as exc:  # one case's failure must not lose the others'
            rows.append({"shape": case[0], "op": case[1], "dtype": case[5], "error": f"{type(exc).__name__}: {exc}"})
            print(rows[-1], flush=True)
    return {"meta": results_meta("PYTHONPATH=src python -m benchmarks.diagnostics.replay_parts OUT.json"),
            "rows": rows}


if __name__ == "__main__":
    results_argument(__doc__)
    one_rank_nccl_diagnostic("benchmarks.diagnostics.replay_parts", main)
    sys.exit(0)
