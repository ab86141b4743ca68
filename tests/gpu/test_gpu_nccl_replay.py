"""The NCCL path's repeated calls replayed from CUDA graphs (``comm/tp/nccl.py``, ``comm/replay.py``), and its calls
inside a user's graph and under ``torch.compile(mode="reduce-overhead")``, on one GPU (a one-rank NCCL group: the
counters' waits and resets, the signalling GEMM and the NCCL collectives are all in the graph, whatever the world
size). Every op, bf16, fp16 and fp8 in every scaling mode, the signalling GEMM's plans and cuBLAS bands', ``w.t()``
and row-major ``b``, an odd M; each call on new values in the same tensors with the previous output NaN-poisoned,
against plain PyTorch (the dequantised product in fp32 for fp8); replays counted: every call after a case's first
``EAGER_ALLOWED`` replays, nothing being allocated between the calls (inputs and oracles made before a case's calls,
the checks in a scratch buffer), as in a model's steady state."""

import os

import pytest
import torch
import torch.distributed as dist

from flashoverlap.testing import spawn
from tests.gpu.helpers import ENV, assert_close, check_graph_replays
from tests.gpu.test_gpu_scaled import _dequantised

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or
                                                  os.environ.get("TRITON_INTERPRET") == "1",
                                                  reason="needs a CUDA GPU, and TRITON_INTERPRET unset")]

CALLS = 5  # per case: the first eager, the second captured and replayed, then replays
# Calls of a case that may run eagerly: its first, and one more while the caching allocator settles (a call's
# output may land in a block the previous call's oracle freed: a new signature, seen once more before it replays).
EAGER_ALLOWED = 2
BF16_SHAPES = [(1002, 1000, 520), (2048, 4096, 1024)]
FP8_CASES = [("tensor", 1000, 1040, 640), ("row", 2048, 4096, 1024), ("block", 1024, 1024, 1024)]


def _oracle(op, a_full, b):
    """Plain PyTorch at W = 1: the product itself (all-gather's a is the whole input)."""
    return a_full.float() @ b.float()


def _check(got, want, scratch, what):
    """``got`` against the fp32 oracle ``want``, allocating nothing the size of a call's tensors between the calls
    (the difference in ``scratch``; a NaN anywhere makes the norm NaN, which fails the bound)."""
    diff = scratch[: want.numel()].view(want.shape)
    torch.sub(got, want, out=diff)
    err = (diff.norm() / want.norm().clamp_min(1e-30)).item()
    limit = 1e-2 if got.dtype == torch.bfloat16 else 2e-3
    assert err < limit, f"{what}: relative error {err:.2e} (NaN: an element never written) >= {limit}"


def _replayed(rank, world):
    import flashoverlap as fo
    from flashoverlap import settings
    from flashoverlap.runtime.context import context_of
    from flashoverlap.tune.fp8 import fp8_tiles
    from tests.ops.test_scaled import quantise

    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bf16_ops = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter,
                "all_gather": fo.all_gather_gemm}
    fp8_ops = {"all_reduce": fo.scaled_gemm_all_reduce, "reduce_scatter": fo.scaled_gemm_reduce_scatter,
               "all_gather": fo.all_gather_scaled_gemm}
    cases = 0
    short = {}  # case -> replays, where a case's repeated calls did not all replay
    diff = torch.empty(4096 * 4096, dtype=torch.float32, device=device)  # the checks' one scratch buffer

    def graphs():
        return context_of(dist.group.WORLD, device).communicator("gemm", "nccl").graphs

    def counted(case, replay, before):
        replays = graphs().replays - before
        if replay == "1" and replays < CALLS - EAGER_ALLOWED or replay == "0" and replays:
            short[case] = replays
    for replay in ("1", "0"):
        os.environ["FLASHOVERLAP_REPLAY"] = replay
        settings.refresh()
        for op in bf16_ops:
            for gemm in ("triton", "cublas"):
                for m, n, k in BF16_SHAPES:
                    for dtype in (torch.bfloat16, torch.float16):
                        for transposed in (True, False):
                            gen = torch.Generator(device=device).manual_seed(cases)
                            a = torch.randn(m, k, dtype=dtype, device=device, generator=gen)
                            w = torch.randn(n, k, dtype=dtype, device=device, generator=gen) / k**0.5
                            b = w.t() if transposed else w.t().contiguous()
                            plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False, gemm=gemm,
                                                   num_groups=3)
                            fresh = [torch.randn(a.shape, dtype=dtype, device=device, generator=gen)
                                     for _ in range(CALLS)]
                            wants = [_oracle(op, x, b) for x in fresh]
                            before = graphs().replays
                            for call in range(CALLS):
                                a.copy_(fresh[call])
                                got = bf16_ops[op](a, b, path="nccl", plan=plan)
                                _check(got, wants[call], diff,
                                       f"{op} {gemm} {m}x{n}x{k} {dtype} t={transposed} replay={replay} #{call}")
                                got.fill_(float("nan"))
                                del got
                            counted(f"{op} {gemm} {m}x{n}x{k} {dtype} t={transposed} replay={replay}", replay, before)
                            cases += 1
            for mode, m, n, k in FP8_CASES:
                for gemm in ("triton", "cublas"):
                    a, sa = quantise(torch.randn(m, k, device=device), mode)
                    b, sb = quantise(torch.randn(k, n, device=device), mode, operand="b")
                    if mode == "row":
                        sb = sb.reshape(1, n)
                    b = b.t().contiguous().t()
                    tile = fp8_tiles(m, n, k, mode, op).tile_config()
                    plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, tile=tile, allow_sequential=False, gemm=gemm,
                                           num_groups=3)
                    fresh = [quantise(torch.randn(m, k, device=device), mode) for _ in range(CALLS)]
                    wants = [_dequantised(x, b, scale, sb, mode) for x, scale in fresh]
                    before = graphs().replays
                    for call in range(CALLS):
                        a.copy_(fresh[call][0])
                        sa.copy_(fresh[call][1])
                        got = fp8_ops[op](a, b, sa, sb, path="nccl", plan=plan)
                        _check(got, wants[call], diff, f"{op} fp8 {mode} {gemm} {m}x{n}x{k} replay={replay} #{call}")
                        got.fill_(float("nan"))
                        del got
                    counted(f"{op} fp8 {mode} {gemm} {m}x{n}x{k} replay={replay}", replay, before)
                    cases += 1
    os.environ.pop("FLASHOVERLAP_REPLAY")
    settings.refresh()
    comm = context_of(dist.group.WORLD, device).communicator("gemm", "nccl")
    direct = sorted(ctas for ctas, nccl in comm._direct.items() if nccl is not None)
    return {"cases": cases, "replays": graphs().replays, "captures": graphs().captures, "short": short,
            "direct": direct}


def test_repeated_nccl_calls_replay_graphs_that_read_the_current_values():
    counts = spawn(_replayed, 1, "nccl", env=ENV)[0]
    # Every case's calls after its first EAGER_ALLOWED replay; none with replay off.
    short = counts["short"]
    assert not short, "\n".join(f"{case}: {n} replays of {CALLS} calls" for case, n in short.items())
    assert counts["direct"], counts  # the collectives went to NCCL directly (comm/nccl_calls.py), as on CUDA they do


def _user_graphs(rank, world):
    """Each op on the NCCL path's overlapped plans (signalling GEMM and cuBLAS bands) and the sequential plan
    (matmul, then the collective) captured into a user's
    ``torch.cuda.graph`` and replayed on new values; then the three ops under ``torch.compile(mode=
    "reduce-overhead")`` (cudagraph trees), replayed on new values."""
    import flashoverlap as fo

    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ops = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter,
           "all_gather": fo.all_gather_gemm}
    m, n, k = 2048, 2048, 1024
    checked = 0
    for op, fn in ops.items():
        for gemm in ("triton", "cublas", "sequential"):
            gen = torch.Generator(device=device).manual_seed(checked)
            a = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=gen)
            b = (torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=gen) / k**0.5).t()
            plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, comm_ratio=0.0) if gemm == "sequential" else \
                fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False, gemm=gemm, num_groups=4)
            check_graph_replays(lambda a, b, fn=fn, plan=plan: fn(a, b, path="nccl", plan=plan),
                                lambda a, b: (a.float() @ b.float()).to(a.dtype), a, b, rank, replays=3)
            checked += 1
    for op, fn in ops.items():
        compiled = torch.compile(lambda a, b, fn=fn: fn(a, b) * 1.0, mode="reduce-overhead", fullgraph=True)
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        b = (torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5).t()
        for step in range(4):
            a.copy_(torch.randn(a.shape, dtype=a.dtype, device=device))
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(a, b)
            assert_close(got, (a.float() @ b.float()).to(a.dtype), f"{op} reduce-overhead step {step}")
            checked += 1
    return checked


def test_nccl_path_calls_inside_user_graphs_and_reduce_overhead():
    assert spawn(_user_graphs, 1, "nccl", env=ENV)[0] == 9 + 12


def _graph_node_kinds(rank, world):
    """Each op's overlapped call (the signalling GEMM's plan, where the counters are waited on) captured into a graph
    kept for inspection: its nodes by kind (``cuGraphNodeGetType``)."""
    import ctypes

    import flashoverlap as fo
    from flashoverlap.kernels import counters

    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    lib = ctypes.CDLL("libcuda.so.1")
    ops = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter}
    kinds = {}
    for op, fn in ops.items():
        m, n, k = 2048, 4096, 1024
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        b = (torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5).t()
        plan = fo.default_plan(op, m, n, k, world, num_sms=sms, allow_sequential=False, gemm="triton")
        fn(a, b, path="nccl", plan=plan)
        torch.cuda.synchronize()
        waits = counters._LAUNCH
        loaded, fast = len(waits._compiled), waits.fast_launches
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            out = fn(a, b, path="nccl", plan=plan)
        torch.cuda.current_stream().wait_stream(side)
        # Every wait kernel in the capture was the one the first call loaded: launched directly, none through the JIT
        # (deadlock rule 3), whatever the group's index and tile count.
        assert (loaded, len(waits._compiled), waits.fast_launches - fast) == (1, 1, plan.num_groups), op
        handle, count = ctypes.c_void_p(graph.raw_cuda_graph()), ctypes.c_size_t(0)
        assert lib.cuGraphGetNodes(handle, None, ctypes.byref(count)) == 0
        nodes = (ctypes.c_void_p * count.value)()
        assert lib.cuGraphGetNodes(handle, nodes, ctypes.byref(count)) == 0
        types = []
        for node in nodes:
            kind = ctypes.c_int(0)
            assert lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) == 0
            types.append(kind.value)
        graph.replay()
        assert_close(out, (a.float() @ b.float()).to(a.dtype), f"{op} graph with its wait kernels")
        kinds[op] = (plan.num_groups, types)
    return kinds


def test_a_captured_call_holds_no_stream_memory_operation():
    """The counter waits inside a graph are kernels (``kernels/counters.py``): a memory-operation node (type 12,
    ``CU_GRAPH_NODE_TYPE_BATCH_MEM_OP``) would cost every launch microseconds of host time; each is the one kernel
    the first eager call loaded (no compile or module load inside the capture)."""
    kinds = spawn(_graph_node_kinds, 1, "nccl", env=ENV)[0]
    for op, (groups, types) in kinds.items():
        assert 12 not in types, (op, types)
        assert types.count(0) >= groups + 1, (op, types)  # the GEMM and a wait kernel per group


def _one_queue_captures(rank, world):
    """Under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (set before the process made its CUDA context), a user's capture of
    the signalling GEMM's reductions takes cuBLAS bands (``runtime/policy.captured_plan``): no
    wait kernel is launched into it, and its replays are right on new values."""
    import flashoverlap as fo
    from flashoverlap.kernels import counters

    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    m, n, k = 2048, 2048, 1024
    checked = 0
    for op, fn in (("all_reduce", fo.gemm_all_reduce), ("reduce_scatter", fo.gemm_reduce_scatter)):
        gen = torch.Generator(device=device).manual_seed(checked)
        a = torch.randn(m, k, dtype=torch.bfloat16, device=device, generator=gen)
        b = (torch.randn(n, k, dtype=torch.bfloat16, device=device, generator=gen) / k**0.5).t()
        plan = fo.default_plan(op, m, n, k, 1, num_sms=sms, allow_sequential=False, gemm="triton", num_groups=4)
        fn(a, b, path="nccl", plan=plan)  # eagerly first: the NCCL state, the wait kernel's load, cuBLAS's handle
        torch.cuda.synchronize()
        waits = counters._LAUNCH
        launched = waits.fast_launches
        check_graph_replays(lambda a, b, fn=fn, plan=plan: fn(a, b, path="nccl", plan=plan),
                            lambda a, b: (a.float() @ b.float()).to(a.dtype), a, b, rank, replays=3)
        assert waits.fast_launches == launched, f"{op}: a wait kernel launched under one hardware queue"
        checked += 1
    return checked


def test_a_users_capture_under_one_hardware_queue_waits_on_graph_edges():
    assert spawn(_one_queue_captures, 1, "nccl", env={**ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})[0] == 2
