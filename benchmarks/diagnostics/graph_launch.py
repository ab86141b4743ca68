"""What a replayed call's graph launch costs the host, and why (issue 41): each tensor-parallel op at a Llama-3-70B
TP = 8 shape on the NCCL path (a one-rank NCCL group, the overlapped plan) captured into a graph as the replay does,
its nodes counted by type, and the host time of one ``cuGraphLaunch`` of it (and the same for a bounded MoE layer
call, bf16 and fp8, on the expert NCCL path); beside them graphs made of one kind of
node each (kernels, stream memory operations, event-joined side-stream kernels, device-to-device copies on the
stream and on a side stream), so that the launch's cost per node
kind can be read off.

PYTHONPATH=src python -m benchmarks.diagnostics.graph_launch [out.json]
"""

from __future__ import annotations

import ctypes
import json
import shlex
import sys
import time

import torch

from benchmarks.diagnostics.results_file import one_rank_nccl_diagnostic, results_meta

SHAPES = {"all_gather": (8192, 1280, 8192), "reduce_scatter": (8192, 8192, 1024), "all_reduce": (4096, 8192, 8192)}
LAUNCHES = 200
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}


def _census(graph: torch.cuda.CUDAGraph) -> dict[str, int]:
    """The captured graph's nodes by type (``keep_graph=True``)."""
    lib = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    assert lib.cuGraphGetNodes(handle, None, ctypes.byref(count)) == 0
    nodes = (ctypes.c_void_p * count.value)()
    assert lib.cuGraphGetNodes(handle, nodes, ctypes.byref(count)) == 0
    kinds: dict[str, int] = {}
    for node in nodes:
        kind = ctypes.c_int(0)
        assert lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) == 0
        name = NODE_TYPES.get(kind.value, str(kind.value))
        kinds[name] = kinds.get(name, 0) + 1
    kinds["total"] = int(count.value)
    return kinds


def _captured(issue) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        issue()  # warm: kernels loaded, NCCL state made
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        issue()
    if hasattr(graph, "instantiate"):
        graph.instantiate()
    return graph


def _launch_us(graph: torch.cuda.CUDAGraph) -> float:
    """Host time of one driver launch of ``graph`` (as ``CallGraphs.replay`` launches), the GPU kept busy ahead."""
    from flashoverlap.comm import stream_ops

    driver = stream_ops.fast()
    graph.replay()
    torch.cuda.synchronize()
    exec_handle = graph.raw_cuda_graph_exec()
    stream = torch.cuda.current_stream().cuda_stream
    best = float("inf")
    for _ in range(5):
        torch.cuda._sleep(100_000_000)
        t0 = time.perf_counter()
        for _ in range(LAUNCHES // 5):
            driver.launch_graph(exec_handle, stream)
        best = min(best, (time.perf_counter() - t0) / (LAUNCHES // 5) * 1e6)
        torch.cuda.synchronize()
    return round(best, 2)


def _synthetic(device) -> dict[str, dict]:
    """Graphs of one node kind each, ``n`` nodes: the launch cost per kind."""
    from flashoverlap.comm import stream_ops

    a = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    flags = torch.zeros(64, dtype=torch.int32, device=device)
    side = torch.cuda.Stream(device=device)
    rows = {}

    def kernels(n):
        def issue():
            for _ in range(n):
                a.mul_(1.0)
        return issue

    def memops(n):
        def issue():
            stream = torch.cuda.current_stream()
            for i in range(n):
                stream_ops.write(stream, flags[i].data_ptr(), 1)
                stream_ops.wait_reset(stream, flags[i].data_ptr(), 1)
        return issue

    def forks(n):
        def issue():
            for _ in range(n):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    a.mul_(1.0)
                torch.cuda.current_stream().wait_stream(side)
        return issue

    sources = [torch.randn(4096, device=device) for _ in range(24)]
    targets = [torch.empty_like(t) for t in sources]

    def copies(n):  # device-to-device copies: memcpy nodes (the P2P path's graphs hold one per band and peer)
        def issue():
            for i in range(n):
                targets[i].copy_(sources[i])
        return issue

    def side_copies(n):  # the same, each on the side stream between event joins, as the P2P path issues them
        def issue():
            for i in range(n):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    targets[i].copy_(sources[i])
                torch.cuda.current_stream().wait_stream(side)
        return issue

    for name, make in (("kernels", kernels), ("memop write+wait_reset pairs", memops),
                       ("side-stream kernels joined by events", forks), ("device-to-device copies", copies),
                       ("side-stream copies joined by events", side_copies)):
        for n in (1, 8, 24):
            graph = _captured(make(n))
            rows[f"{n} {name}"] = {"nodes": _census(graph), "launch_us": _launch_us(graph)}
            del graph
    return rows


def _moe(device) -> dict[str, dict]:
    """One bounded MoE layer call (dispatch, SwiGLU, combine; ``fp8_moe_host``'s configs), bf16 and fp8, captured:
    its nodes by kind and one launch's host time."""
    import torch.nn.functional as F

    import flashoverlap as fo
    from benchmarks.diagnostics.fp8_moe_host import CONFIGS, layer_inputs, layer_weights
    from flashoverlap.ops.moe import moe_dispatch_gemm, moe_gemm_combine

    rows = {}
    for name, local, hidden, ffn, top_k, tokens in CONFIGS:
        x, idx, weights, w13, w2 = layer_inputs(local, hidden, ffn, top_k, tokens, device)
        layout = fo.moe_layout(idx, local, mode="bounded", bound=tokens * top_k)
        for dtype in ("bf16", "fp8-row", "fp8-block"):
            w_up, w_down, s_up, s_down = layer_weights(dtype, w13, w2)

            def layer(w_up=w_up, w_down=w_down, s_up=s_up, s_down=s_down, layout=layout, x=x, ffn=ffn,
                      weights=weights):
                h = moe_dispatch_gemm(x, w_up, layout, path="nccl", scale_w=s_up)
                a = F.silu(h[:, :ffn]) * h[:, ffn:]
                return moe_gemm_combine(a, w_down, weights, layout, path="nccl", scale_w=s_down)

            with torch.no_grad():
                graph = _captured(layer)
                rows[f"{name} bounded {dtype}"] = {"nodes": _census(graph), "launch_us": _launch_us(graph)}
            print(name, dtype, json.dumps(rows[f"{name} bounded {dtype}"]), flush=True)
            del graph
    return rows


def main() -> dict:
    import flashoverlap as fo

    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ops = fo.ops.GEMM_OPS
    out = {"meta": results_meta("python -m benchmarks.diagnostics.graph_launch " + shlex.join(sys.argv[1:])),
           "ops": {}, "synthetic": {}}
    for op, (m, n, k) in SHAPES.items():
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        b = (torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5).t()
        plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False)
        graph = _captured(lambda fn=ops[op], a=a, b=b, plan=plan: fn(a, b, path="nccl", plan=plan))
        mm = _captured(lambda a=a, b=b: torch.mm(a, b))
        out["ops"][f"{op} {m}x{n}x{k}"] = {"groups": len(plan.group_row_tiles),
                                           "nodes": _census(graph), "launch_us": _launch_us(graph),
                                           "mm graph launch_us": _launch_us(mm)}
        print(op, json.dumps(out["ops"][f"{op} {m}x{n}x{k}"]), flush=True)
        del graph, mm
    out["moe"] = _moe(device)
    out["synthetic"] = _synthetic(device)
    print(json.dumps(out["synthetic"], indent=1), flush=True)
    return out


if __name__ == "__main__":
    one_rank_nccl_diagnostic("benchmarks.diagnostics.graph_launch", main)
