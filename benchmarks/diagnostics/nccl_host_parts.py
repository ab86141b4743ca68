"""Where an eager NCCL-path call's host time goes (issue 41): on a one-rank NCCL group, each op at a Llama-3-70B TP = 8
shape under its overlapped plan, issued eagerly (``FLASHOVERLAP_REPLAY=0``) with the GPU kept busy ahead: cProfile's
top functions by own time, and the parts timed alone (the runtime's pipeline with the communicator stubbed, one
process-group collective on a band, the signalling GEMM's launch, one wait-and-reset).

PYTHONPATH=src python -m benchmarks.diagnostics.nccl_host_parts [out.json]
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from benchmarks.diagnostics.results_file import require_cuda
from benchmarks.harness.timing import loop_host_us, profiled

SHAPES = {"all_gather": (8192, 1280, 8192), "reduce_scatter": (8192, 8192, 1024), "all_reduce": (4096, 8192, 8192)}
CALLS = 30


def _timed(fn, calls=CALLS):
    return loop_host_us(fn, calls, 200_000_000)


def main():
    import flashoverlap as fo
    from flashoverlap import settings
    from flashoverlap.comm.collectives import all_reduce_now

    os.environ["FLASHOVERLAP_REPLAY"] = "0"
    settings.refresh()
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ops = fo.ops.GEMM_OPS
    out = {}
    for op, (m, n, k) in SHAPES.items():
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        b = (torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5).t()
        plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False)

        def call(fn=ops[op], a=a, b=b, plan=plan):
            return fn(a, b, path="nccl", plan=plan)

        for _ in range(3):
            call()
        whole = _timed(call)
        text = profiled(call, CALLS, 400_000_000)
        print(f"== {op} {m}x{n}x{k}: {plan.num_groups} groups, {whole:.0f} us a call\n{text}", flush=True)
        out[op] = {"shape": [m, n, k], "groups": plan.num_groups, "host_us": round(whole, 1), "profile": text[:6000]}
    # Parts alone.
    band = torch.randn(512, 8192, dtype=torch.bfloat16, device=device)
    group = dist.group.WORLD
    out["parts_us"] = {
        "pg.allreduce (all_reduce_now) of a 512x8192 band": _timed(lambda: all_reduce_now(band, group)),
        "dist.all_reduce of the band": _timed(lambda: dist.all_reduce(band, group=group)),
        "torch.empty 8192x8192 bf16": _timed(lambda: torch.empty(8192, 8192, dtype=torch.bfloat16, device=device)),
        "band slice": _timed(lambda: band[0:256]),
        "stream context": _timed(lambda: torch.cuda.stream(torch.cuda.current_stream()).__enter__()),
    }
    from flashoverlap.kernels.gemm import gemm

    m, n, k = SHAPES["all_reduce"]
    a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    b = (torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5).t()
    plan = fo.default_plan("all_reduce", m, n, k, 1, num_sms=sms, allow_sequential=False)
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    outp = torch.empty(m, n, dtype=torch.bfloat16, device=device)

    def launch():
        gemm(a, b, plan, out=outp, counters=counters)
        counters.zero_()
    out["parts_us"]["signalling gemm launch + counters.zero_"] = _timed(launch)
    from flashoverlap.kernels.gemm import launch_arguments, signalling_gemm_kernel

    out["parts_us"]["gemm's launch_arguments alone"] = _timed(
        lambda: launch_arguments(a, b, plan, out=outp, counters=counters))
    _, args, meta = launch_arguments(a, b, plan, out=outp, counters=counters)

    def kernel_only():
        signalling_gemm_kernel[(plan.grid_size,)](*args, **meta)
        counters.zero_()
    out["parts_us"]["the Triton kernel launch alone (arguments built) + counters.zero_"] = _timed(kernel_only)
    from flashoverlap.kernels.launch import Launcher

    direct = Launcher(signalling_gemm_kernel)

    def direct_only():
        direct(plan.grid_size, args, meta)
        counters.zero_()
    out["parts_us"]["the direct launch (kernels/launch.py, arguments built) + counters.zero_"] = _timed(direct_only)
    out["parts_us"]["counters.zero_ alone"] = _timed(lambda: counters.zero_())
    out["replay_parts_us"] = _replay_parts(device, sms)
    print(json.dumps(out["parts_us"], indent=1), json.dumps(out["replay_parts_us"], indent=1), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


def _replay_parts(device, sms):
    """A replayed call's host time in parts, per op at its shape: the whole call, ``torch.mm`` beside it, and alone
    the pipeline's lookups before the communicator, the call's allocations, its signature, and the graph launch."""
    import flashoverlap as fo
    from flashoverlap import settings
    from flashoverlap.runtime.calls import GemmSpec

    os.environ["FLASHOVERLAP_REPLAY"] = "1"
    settings.refresh()
    ops = fo.ops.GEMM_OPS
    names = {"all_reduce": "gemm_all_reduce", "reduce_scatter": "gemm_reduce_scatter", "all_gather": "all_gather_gemm"}
    parts = {}
    for op, (m, n, k) in SHAPES.items():
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device)  # one rank: all-gather's shard is all of A
        b = (torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5).t()
        plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False)
        for _ in range(4):
            ops[op](a, b, path="nccl", plan=plan)
        torch.cuda.synchronize()
        parts[f"{op} {m}x{n}x{k}"] = _replay_row(ops[op], GemmSpec(names[op], op, a, b, None, plan, "nccl"))
    return parts


def _replay_row(fn, spec):
    """One op's replayed call in parts (its graph captured already)."""
    from flashoverlap import settings
    from flashoverlap.runtime.calls import GEMM
    from flashoverlap.runtime.context import REGISTRY

    a, b, plan = spec.a, spec.b, spec.plan
    env = settings.current()
    signature = GEMM.signature(spec, env)
    communicator, _, _ = entry = REGISTRY.lookup(signature)
    call = GEMM.call(spec, entry, env)
    buffers = communicator._buffers(call)
    graph_key = communicator._signature(call, buffers)
    found = communicator.graphs.replay(graph_key)  # the call's graph, captured by the calls before
    row = {
        "graph found": found,
        "whole replayed call": _timed(lambda: fn(a, b, path="nccl", plan=plan)),
        "torch.mm": _timed(lambda: torch.mm(a, b)),
        "pipeline: signature + registry lookup + Call": _timed(
            lambda: GEMM.call(spec, REGISTRY.lookup(GEMM.signature(spec, env)), env)),
        "the call's allocations (_buffers)": _timed(lambda: communicator._buffers(call)),
        "the replay signature (_signature)": _timed(lambda: communicator._signature(call, buffers)),
        "the graph launch (CallGraphs.replay)": _timed(lambda: communicator.graphs.replay(graph_key)),
    }  # the graph's nodes by kind and its launch alone: benchmarks/diagnostics/graph_launch.py
    return {key: round(v, 1) if isinstance(v, float) else v for key, v in row.items()}


if __name__ == "__main__":
    from benchmarks.diagnostics.results_file import in_one_rank_nccl_group

    require_cuda("benchmarks.diagnostics.nccl_host_parts", path_only=True)  # before the group: one line
    in_one_rank_nccl_group(main)
