"""Where a replayed P2P call's host time goes, under the conditions of ``p2p_one_gpu.py``'s host rows (two processes
sharing one GPU, ranks aligned, GPU busy ahead, ``bench.timing.host_us_interleaved``): per op at 4096x8192x8192,
the replayed call (``P2PCommunicator.run``) beside ``torch.mm`` alone, the launch of its graph alone (through the
driver, as ``CallGraphs.run`` does, and through ``CUDAGraph.replay``), the output's allocation, and the graph's
nodes by type; then the launch of synthetic graphs of N nodes of one type (kernels, copies, flag writes, waits,
on one stream or alternating between two), to tell what a node of each type costs at launch. A diagnostic for
issue 19 (replayed host time), not a library figure. Each op's call, bf16 and fp8 row-wise, is also captured into a
kept graph of the caller's, whose nodes are counted by type.

CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 2 -m benchmarks.diagnostics.replay_host [out.json]
"""

import collections
import ctypes
import statistics
import struct

import torch
import torch.distributed as dist

from benchmarks.diagnostics.p2p_one_gpu import HOST_SHAPE, OPS, close_run, host_operands, ipc_p2p, open_run
from benchmarks.diagnostics.results_file import require_cuda
from benchmarks.harness.timing import host_us_interleaved
from flashoverlap.comm import stream_ops
from flashoverlap.comm.protocol import Call
from flashoverlap.comm.scaled import Scales
from flashoverlap.comm.tp import ring_schedule as rs

# CUgraphNodeType (cuda.h)
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}


def node_types(graph: torch.cuda.CUDAGraph) -> dict:
    """The graph's nodes by type (a graph built with ``keep_graph=True``)."""
    lib = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    if lib.cuGraphGetNodes(handle, None, ctypes.byref(count)):
        return {"error": "cuGraphGetNodes"}
    nodes = (ctypes.c_void_p * count.value)()
    lib.cuGraphGetNodes(handle, nodes, ctypes.byref(count))
    kinds = collections.Counter()
    for node in nodes:
        kind = ctypes.c_int(0)
        lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        kinds[NODE_TYPES.get(kind.value, str(kind.value))] += 1
    return {"total": count.value, **dict(kinds)}


def replayed_rows(comm, world) -> dict:
    m, n, k = HOST_SHAPE
    rows = {}
    driver = stream_ops.fast()
    for op in OPS:
        a, b, plan = host_operands(op, world)
        call = Call(op, plan, a, b, replay=True)
        for _ in range(4):
            comm.run(call)
        torch.cuda.synchronize()
        graph, graph_exec, _ = next(reversed(comm.graphs._graphs.values()))  # the signature just captured
        out_rows = plan.block_rows if op == "reduce_scatter" else m

        def launch(graph_exec=graph_exec):
            driver.launch_graph(graph_exec, driver.current_stream(0))

        us = host_us_interleaved({
            "torch.mm": lambda a=a, b=b: torch.mm(a, b),
            "replayed": lambda call=call: comm.run(call),
            "graph launch (driver)": launch,
            "graph.replay()": lambda graph=graph: graph.replay(),
            "torch.empty(out)": lambda rows=out_rows: torch.empty((rows, n), dtype=torch.bfloat16, device="cuda"),
        })
        steps = collections.Counter(type(item).__name__ for item in rs.schedule(plan, dist.get_rank()))
        rows[op] = {"us": {name: round(value, 1) for name, value in us.items()}, "schedule_steps": dict(steps),
                    "nodes": {"bf16": _captured_nodes(comm, Call(op, plan, a, b))}}
        # The same call in fp8 row-wise (its sub-bands' products are cuBLAS's scaled matmuls): its graph's nodes.
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa, sb = torch.rand(a.shape[0], 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
        rows[op]["nodes"]["fp8-row"] = _captured_nodes(comm, Call(op, plan, a8, b8, scales=Scales.of(sa, sb, n=n)))
        print(op, rows[op], flush=True)
    return rows


def _captured_nodes(comm, call) -> dict:
    """``call`` (eager once, then) captured into a kept graph of the caller's, never launched: its nodes by type (a
    cuBLAS product that brings a memset costs the graph's every launch a node more)."""
    try:
        comm.run(call)
        torch.cuda.synchronize()
        dist.barrier()
        kept = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(kept):
            comm.run(call)
        return node_types(kept)
    except Exception as exc:  # a diagnostic's extra: its failure must not lose the rows
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def synthetic_rows(rank: int) -> dict:
    """Graphs of N nodes of one kind, captured once, launched through the driver (host time, both ranks, as the
    replayed rows); then, on rank 0 alone, the GPU time of eight 512-row ``torch.mm`` with a flag signal after each
    (a stream write, a 4-byte copy from a word that holds 1, or none), as a replayed P2P graph holds them."""
    driver = stream_ops.fast()
    tiny = torch.zeros(16, device="cuda")
    flags = torch.zeros(64, dtype=torch.int32, device="cuda")
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    scratch = torch.empty(1 << 16, dtype=torch.uint8, device="cuda")
    a = torch.randn(4096, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda").t()
    c = torch.empty(4096, 8192, dtype=torch.bfloat16, device="cuda")
    pairs = ctypes.create_string_buffer(4 * stream_ops._MEM_OP.size)
    batch = ctypes.CDLL("libcuda.so.1").cuStreamBatchMemOp_v2

    def two_wait_resets(stream, first, second):  # one node: wait >= 1, reset, wait >= 1, reset
        fields = []
        for address in (first, second):
            fields += [stream_ops._WAIT_VALUE_32, address, 1, 0, 0, stream_ops._WRITE_VALUE_32, address, 0, 0, 0]
        struct.Struct("<" + 4 * stream_ops._MEM_OP.format[1:]).pack_into(pairs, 0, *fields)
        assert batch(ctypes.c_void_p(stream), 4, pairs, 0) == 0

    def body(kind, count):
        main = torch.cuda.current_stream().cuda_stream
        for i in range(count):
            flag = flags.data_ptr() + 4 * (i % 32)
            if kind == "kernel":
                tiny.add_(1)
            elif kind == "memcpy 4 KiB":
                driver.copy(main, scratch.data_ptr(), scratch.data_ptr() + 8192, 4096)
            elif kind in ("flag write", "flag write, uploaded"):
                driver.write(main, flag, 1)
            elif kind == "flag copy (4 B from a word of 1)":
                driver.copy(main, flag, one.data_ptr(), 4)
            elif kind == "write + wait_reset":
                driver.write(main, flag, 1)
                driver.wait_reset(main, flag)
            elif kind == "2 writes + 2 wait_resets in one batch":
                driver.write(main, flag, 1)
                driver.write(main, flag + 128, 1)
                two_wait_resets(main, flag, flag + 128)
            elif kind.startswith("mm"):
                torch.mm(a[512 * (i % 8): 512 * (i % 8 + 1)], b, out=c[512 * (i % 8): 512 * (i % 8 + 1)])
                if kind == "mm + flag write":
                    driver.write(main, flag, 1)
                elif kind == "mm + flag copy":
                    driver.copy(main, flag, one.data_ptr(), 4)

    launch_kinds = {"kernel": (1, 40), "memcpy 4 KiB": (40,), "flag write": (1, 8, 40), "flag write, uploaded": (40,),
                    "flag copy (4 B from a word of 1)": (8, 40), "write + wait_reset": (20,),
                    "2 writes + 2 wait_resets in one batch": (10,), "mm": (8,), "mm + flag write": (8,),
                    "mm + flag copy": (8,)}
    graphs = {}
    upload = ctypes.CDLL("libcuda.so.1").cuGraphUpload
    for kind, counts in launch_kinds.items():
        for count in counts:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            body(kind, 1)  # warm (kernel loaded)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                body(kind, count)
            graph.instantiate()
            if kind.endswith("uploaded"):
                assert upload(ctypes.c_void_p(graph.raw_cuda_graph_exec()),
                              ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)) == 0
            graphs[f"{kind} x{count}"] = graph
    torch.cuda.synchronize()
    execs = {name: graph.raw_cuda_graph_exec() for name, graph in graphs.items()}
    fns = {name: (lambda g=graph_exec: driver.launch_graph(g, driver.current_stream(0)))
           for name, graph_exec in execs.items()}
    fns["torch.mm 4096x8192x8192"] = lambda: torch.mm(a, b)
    us = host_us_interleaved(fns, calls=30)
    result = {name: {"host_us": round(value, 1)} for name, value in us.items()}
    for name, graph in graphs.items():
        result[name]["nodes"] = node_types(graph)
    dist.barrier()
    if rank == 0:  # GPU time with the GPU to itself (the other rank waits at the barrier)
        gpu = {name: [] for name in graphs if name.startswith("mm")}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(30):
            for name in gpu:
                torch.cuda._sleep(1_000_000)
                start.record()
                driver.launch_graph(execs[name], driver.current_stream(0))
                end.record()
                end.synchronize()
                gpu[name].append(start.elapsed_time(end) * 1000)
        for name, times in gpu.items():
            result[name]["gpu_us"] = round(statistics.median(times), 1)
        # The same beside bulk copies on another stream (a copy stream's pulls, as in a call): does a signal's
        # 4-byte copy queue behind them on a copy engine?
        side = torch.cuda.Stream()
        big = torch.empty(2, 64 << 20, dtype=torch.uint8, device="cuda")
        busy = {name: [] for name in gpu}
        for _ in range(20):
            for name in busy:
                torch.cuda._sleep(1_000_000)
                side.wait_stream(torch.cuda.current_stream())
                for _ in range(12):
                    driver.copy(side.cuda_stream, big[1].data_ptr(), big[0].data_ptr(), 64 << 20)
                start.record()
                driver.launch_graph(execs[name], driver.current_stream(0))
                end.record()
                end.synchronize()
                torch.cuda.synchronize()
                busy[name].append(start.elapsed_time(end) * 1000)
        for name, times in busy.items():
            result[name]["gpu_us_beside_copies"] = round(statistics.median(times), 1)
        # One signal alone on the caller's stream, timed by events around it, while another stream runs bulk
        # copies (or nothing): a copy that queues behind them takes tens of microseconds.
        for kind in ("flag write", "flag copy"):
            for beside in (False, True):
                times = []
                for _ in range(30):
                    torch.cuda.synchronize()
                    if beside:
                        for _ in range(12):
                            driver.copy(side.cuda_stream, big[1].data_ptr(), big[0].data_ptr(), 64 << 20)
                        torch.cuda._sleep(200_000)  # the copies under way
                    start.record()
                    if kind == "flag write":
                        driver.write(driver.current_stream(0), flags.data_ptr(), 1)
                    else:
                        driver.copy(driver.current_stream(0), flags.data_ptr(), one.data_ptr(), 4)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1000)
                torch.cuda.synchronize()
                result[f"one {kind} on its own stream{', bulk copies beside' if beside else ''}"] = {
                    "gpu_us": round(statistics.median(times), 1), "gpu_us_max": round(max(times), 1)}
    dist.barrier()
    return result


def main():
    require_cuda("benchmarks.diagnostics.replay_host")
    rank, world, device, meta = open_run("replay_host")
    comm = ipc_p2p(device)
    meta["unit"] = "us of host time per call, median of 40 (30 for synthetic), GPU busy ahead"
    report = {"meta": meta, "replayed": replayed_rows(comm, world), "synthetic": synthetic_rows(rank)}
    close_run(report, rank)


if __name__ == "__main__":
    main()
