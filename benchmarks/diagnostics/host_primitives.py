"""Host time of each primitive the P2P path issues, on the device's host, with the GPU busy ahead: where an eager
call's host time goes (issue 19). Not a library figure: a diagnostic to choose what to cut.

Each primitive runs ``REPEATS`` times back to back after a long GPU sleep, each repeat timed alone; the median is
printed in microseconds. Run alone (one process) or under torchrun with two processes sharing the GPU (the
condition of ``p2p_one_gpu.py``'s host rows); rank 0 prints.

PYTHONPATH=src python -m benchmarks.diagnostics.host_primitives [out.json]
CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 2 -m benchmarks.diagnostics.host_primitives [out.json]
"""

import json
import os
import shlex
import statistics
import sys
import time

import torch

from benchmarks.diagnostics.results_file import require_cuda, results_meta, write_results

REPEATS = 20


def timed(fn, repeats=REPEATS):
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~100 ms: nothing below waits for the GPU
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return round(statistics.median(times) / 1000, 2)


def main():
    require_cuda("benchmarks.diagnostics.host_primitives", path_only=True)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.cuda.set_device(0)
    import flashoverlap as fo
    from flashoverlap.comm import stream_ops
    from flashoverlap.plan import Plan  # noqa: F401  (import cost outside the timings)

    m, n, k = 4096, 8192, 8192
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    half = m // 2
    a_half, c_half = a[:half], c[:half]
    side = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    event = torch.cuda.Event()
    flag = torch.ones(64, dtype=torch.int32, device="cuda")
    scratch = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    fast = stream_ops.fast()
    handle = compute.cuda_stream
    plan = fo.default_plan("reduce_scatter", m, n, k, 2, path="p2p", allow_sequential=False)
    table = {plan: 1}
    torch.mm(a, b)
    torch.mm(a_half, b, out=c_half)
    c_half.addmm_(a_half, b)
    torch.cuda.synchronize()
    rows = {}

    def put(name, fn):
        rows[name] = timed(fn)

    put("torch.mm(a, b) [4096x8192x8192]", lambda: torch.mm(a, b))
    put("torch.mm(a_half, b, out=c_half)", lambda: torch.mm(a_half, b, out=c_half))
    put("c_half.addmm_(a_half, b)", lambda: c_half.addmm_(a_half, b))
    put("torch.addmm(c_half, a_half, b, out=c_half)", lambda: torch.addmm(c_half, a_half, b, out=c_half))
    for library in ("cublas", "cublaslt"):
        try:
            before = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(library)
            torch.mm(a_half, b, out=c_half)
            torch.cuda.synchronize()
            put(f"[{library}] torch.mm(a_half, b, out=c_half)", lambda: torch.mm(a_half, b, out=c_half))
            put(f"[{library}] c_half.addmm_(a_half, b)", lambda: c_half.addmm_(a_half, b))
            torch.backends.cuda.preferred_blas_library(before)
        except Exception as exc:  # noqa: BLE001 (a diagnostic: report and go on)
            rows[f"[{library}] error"] = repr(exc)
    put("a[0:half] (a view)", lambda: a[0:half])
    put("a.narrow(0, 0, half)", lambda: a.narrow(0, 0, half))
    put("torch.empty((4096, 8192))", lambda: torch.empty((m, n), dtype=torch.bfloat16, device="cuda"))
    put("event.record(stream)", lambda: event.record(compute))
    put("stream.wait_event(event)", lambda: side.wait_event(event))
    put("stream.wait_stream(stream)", lambda: compute.wait_stream(side))
    put("tensor.record_stream(stream)", lambda: c.record_stream(side))
    put("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
    put("stream.cuda_stream", lambda: compute.cuda_stream)
    put("fast.write (cuStreamWriteValue32)", lambda: fast.write(handle, flag.data_ptr(), 1))
    put("fast.wait_reset (cuStreamBatchMemOp x2)", lambda: (fast.write(handle, flag.data_ptr(), 1),
                                                            fast.wait_reset(handle, flag.data_ptr())))
    put("fast.copy (cuMemcpyDtoDAsync 1 MiB)", lambda: fast.copy(handle, scratch.data_ptr(),
                                                                 scratch.data_ptr() + (1 << 19), 1 << 19))
    put("hash(plan)", lambda: hash(plan))
    put("table[plan]", lambda: table[plan])
    put("tensor.data_ptr()", lambda: a.data_ptr())
    results = {"meta": results_meta(shlex.join(sys.argv), f"1x {torch.cuda.get_device_name()}, {world} process(es)",
                                   unit="us per call, median of 20, GPU busy ahead"),
               "rows": rows}
    if rank == 0:
        print(json.dumps(results, indent=1), flush=True)
        write_results(results)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
