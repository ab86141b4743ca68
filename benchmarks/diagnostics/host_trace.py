"""Where one eager P2P call's host time goes, step by step, under the conditions of ``p2p_one_gpu.py``'s host rows
(two processes sharing one GPU, the ranks aligned by a barrier, the GPU busy ahead): every torch and driver entry
point the call uses is wrapped to stamp its start and end, and the time between stamps is the call's own Python.
A diagnostic for issue 19 (eager host time), not a library figure.

CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 2 -m benchmarks.diagnostics.host_trace [out.json]
"""

import collections
import statistics
import time

import torch
import torch.distributed as dist

import flashoverlap as fo
from benchmarks.diagnostics.p2p_one_gpu import HOST_SHAPE, OPS, close_run, direct_call, host_operands, ipc_p2p, open_run
from benchmarks.diagnostics.results_file import require_cuda
from flashoverlap.comm import stream_ops
from flashoverlap.comm.protocol import Call

CALLS = 20
stamps: list[tuple[str, int, int]] = []


def traced(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            stamps.append((name, t0, time.perf_counter_ns()))

    return wrapper


def patch(sequential=False):
    """Wrap the entry points (``sequential``: those of the public op's sequential plan and the runtime under it);
    returns the undo list."""
    undo = []

    def swap(owner, attr, name):
        original = getattr(owner, attr)
        undo.append((owner, attr, original))
        setattr(owner, attr, traced(name, original))

    swap(torch, "mm", "torch.mm")
    swap(torch, "empty", "torch.empty")
    swap(torch.Tensor, "addmm_", "addmm_")
    swap(torch.Tensor, "record_stream", "record_stream")
    swap(torch.cuda, "current_stream", "current_stream")
    swap(torch.cuda.Event, "record", "event.record")
    swap(torch.cuda.Stream, "wait_event", "wait_event")
    swap(torch.cuda.Stream, "wait_stream", "wait_stream")
    swap(torch.cuda.Stream, "record_event", "record_event")
    if sequential:
        from flashoverlap import settings
        from flashoverlap.comm import collectives
        from flashoverlap.comm.tp import sequential as seq
        from flashoverlap.ops import library
        from flashoverlap.runtime import calls

        swap(torch, "matmul", "torch.matmul")
        swap(dist, "all_reduce", "dist.all_reduce")
        swap(collectives, "_reduce_scatter", "reduce_scatter")
        swap(collectives, "_all_gather", "all_gather")
        swap(torch.Tensor, "contiguous", "contiguous")
        swap(torch.cuda, "is_current_stream_capturing", "is_capturing")
        swap(torch.cuda, "current_device", "current_device")
        swap(calls, "check_operands", "check_operands")
        swap(calls, "group_context", "group_context")
        swap(calls, "resolve", "resolve")
        swap(settings, "current", "settings.current")
        swap(library, "needed", "library.needed")
        swap(seq.SequentialCommunicator, "run", "sequential.run")
        return undo
    driver = stream_ops.fast()
    for attr in ("write", "wait_reset", "copy", "record", "wait_event", "current_stream"):
        swap(driver, attr, f"driver.{attr}")
    return undo


def trace(fn):
    """One call per repeat, as ``bench.timing.host_us`` times it; per repeat: the total, the time inside each entry
    point by name, and the rest (the call's own Python)."""
    runs = []
    for _ in range(CALLS):
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)
        stamps.clear()
        t0 = time.perf_counter_ns()
        fn()
        total = time.perf_counter_ns() - t0
        inside = collections.defaultdict(float)
        counts = collections.Counter()
        for name, start, end in stamps:
            inside[name] += (end - start) / 1000
            counts[name] += 1
        first = [(name, round((start - t0) / 1000, 1), round((end - start) / 1000, 1))
                 for name, start, end in stamps[:6]]
        runs.append({"total": total / 1000, "inside": dict(inside), "counts": dict(counts), "first": first})
    torch.cuda.synchronize()
    middle = sorted(runs, key=lambda r: r["total"])[len(runs) // 2]
    names = sorted({n for r in runs for n in r["inside"]})
    return {"total_us": round(statistics.median(r["total"] for r in runs), 1),
            "median_run": {"inside_us": {n: round(middle["inside"].get(n, 0), 1) for n in names},
                           "counts": middle["counts"],
                           "python_us": round(middle["total"] - sum(middle["inside"].values()), 1),
                           "first_steps_at_us": middle["first"]}}


def main():
    require_cuda("benchmarks.diagnostics.host_trace")
    rank, world, device, meta = open_run("host_trace")
    comm = ipc_p2p(device)
    m, n, k = HOST_SHAPE
    report = {"meta": {**meta, "shape": [m, n, k]}, "ops": {}}
    undo = None
    for op in OPS:
        a, b, plan = host_operands(op, world)
        call = Call(op, plan, a, b, replay=False)
        for _ in range(3):
            comm.run(call)
        torch.cuda.synchronize()
        undo = patch()
        try:
            report["ops"][op] = {"plan": str(plan), "p2p_eager": trace(lambda call=call: comm.run(call)),
                                 "torch.mm": trace(lambda a=a, b=b: torch.mm(a, b)),
                                 "torch.mm x4": trace(lambda a=a, b=b: [torch.mm(a, b) for _ in range(4)])}
        finally:
            for owner, attr, original in reversed(undo):
                setattr(owner, attr, original)
    solo = [dist.new_group([r], backend="nccl") for r in range(world)][rank]
    public = fo.ops.GEMM_OPS
    for op in OPS:
        full = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()

        def direct(op=op, full=full, b=b):
            return direct_call(op, full, b, solo, m)

        def ours(op=op, full=full, b=b):
            return public[op](full, b, group=solo)

        for _ in range(3):
            ours(), direct()
        torch.cuda.synchronize()
        undo = patch(sequential=True)
        try:
            report["ops"][op].update({"sequential_ours": trace(ours), "sequential_direct": trace(direct)})
        finally:
            for owner, attr, original in reversed(undo):
                setattr(owner, attr, original)
    close_run(report, rank)


if __name__ == "__main__":
    main()
