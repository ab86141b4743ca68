"""gemm_all_reduce on real GPUs, NCCL and P2P paths: odd shapes, both dtypes, many back-to-back calls, CUDA graphs,
CUDA_DEVICE_MAX_CONNECTIONS=1, errors and the debug timeout. Skipped without 2 GPUs."""

import os

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.testing import spawn
from tests.gpu.helpers import ENV, ODD_SHAPES, ROUND_SHAPES, WORLD, check_graph_replays, needs_gpus
from tests.gpu.helpers import assert_close as _assert_close
from tests.gpu.helpers import inputs as _inputs
from tests.gpu.helpers import poison_allocator as _poison_allocator

pytestmark = pytest.mark.gpu


def _expected(a, b):
    want = torch.matmul(a, b)
    dist.all_reduce(want)
    return want


def _plans(m, n, k, world_size):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    yield "default", None
    yield "one-tile-per-program", fo.default_plan("all_reduce", m, n, k, world_size, num_sms=sms,
                                                  allow_sequential=False)
    yield "persistent", fo.default_plan("all_reduce", m, n, k, world_size, num_sms=sms, num_programs=sms,
                                        num_groups=5, allow_sequential=False)
    small = fo.TileConfig(64, 64, 32, 3, 2, 4)
    yield "small-tiles-reserved-sms", fo.default_plan("all_reduce", m, n, k, world_size, num_sms=sms, tile=small,
                                                      num_programs=sms - 20, num_groups=7,
                                                      allow_sequential=False)
    yield "cublas-bands", fo.default_plan("all_reduce", m, n, k, world_size, num_sms=sms, gemm="cublas",
                                          num_groups=3, allow_sequential=False)


def _correctness(rank, world_size):
    device = torch.device("cuda", torch.cuda.current_device())
    checked = 0
    for i, (m, n, k) in enumerate(ODD_SHAPES + ROUND_SHAPES):
        for dtype in (torch.bfloat16, torch.float16):
            for transposed in (True, False):
                a, b = _inputs(m, n, k, dtype, seed=100 * i + rank, transposed=transposed)
                want = _expected(a, b)
                for name, plan in _plans(m, n, k, world_size):
                    _poison_allocator(device)
                    got = fo.gemm_all_reduce(a, b, plan=plan)
                    _assert_close(got, want, f"{m}x{n}x{k} {dtype} b{'.t()' if transposed else ''} plan {name}")
                    checked += 1
    # The counters are zero again after every call (reset on the communication stream).
    from flashoverlap.runtime.context import context_of

    comm = context_of(dist.group.WORLD, device).communicator("gemm", "nccl")
    torch.cuda.synchronize()
    assert int(comm.counters.abs().sum()) == 0, "counters were not reset"
    # Repeated calls agree bitwise.
    a, b = _inputs(3000, 4096, 520, torch.bfloat16, seed=7 + rank)
    plan = fo.default_plan("all_reduce", 3000, 4096, 520, world_size, allow_sequential=False)
    first = fo.gemm_all_reduce(a, b, plan=plan)
    assert all(torch.equal(first, fo.gemm_all_reduce(a, b, plan=plan)) for _ in range(5))
    return checked


def _capped_ctas(rank, world_size):
    m, n, k = 2048, 4096, 1024
    a, b = _inputs(m, n, k, torch.bfloat16, seed=rank)
    want = _expected(a, b)
    for ctas in (4, 16):
        plan = fo.default_plan("all_reduce", m, n, k, world_size, comm_ctas=ctas, num_programs=132 - ctas,
                               allow_sequential=False)
        _assert_close(fo.gemm_all_reduce(a, b, plan=plan), want, f"comm_ctas={ctas}")
    return True


def _plain_gemm(rank, world_size):
    from flashoverlap.kernels.gemm import gemm

    for i, (m, n, k) in enumerate(ODD_SHAPES + ROUND_SHAPES):
        for dtype in (torch.bfloat16, torch.float16):
            a, b = _inputs(m, n, k, dtype, seed=i)
            plan = fo.default_plan("all_reduce", m, n, k, 2, allow_sequential=False)
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
            gemm(a, b, plan, out=out, counters=counters)
            _assert_close(out, torch.matmul(a, b), f"plain gemm {m}x{n}x{k} {dtype}")
            assert counters.tolist() == [g.tile_count for g in plan.groups]
            out.fill_(float("nan"))
            counters.zero_()
            gemm(a, b, plan, out=out, counters=counters, tma_store=False)  # plain stores
            _assert_close(out, torch.matmul(a, b), f"plain gemm, pointer stores {m}x{n}x{k} {dtype}")
            assert counters.tolist() == [g.tile_count for g in plan.groups]
            out.fill_(float("nan"))
            gemm(a, b, plan, out=out)  # signalling off
            _assert_close(out, torch.matmul(a, b), f"plain gemm, no signal {m}x{n}x{k} {dtype}")
    return True


def _back_to_back(rank, world_size, calls, path="nccl"):
    shapes = [(777, 2000, 1234), (4096, 4096, 4096), (1, 4096, 4096), (2048, 8192, 1024), (1000, 1000, 100)]
    inputs = [_inputs(m, n, k, torch.bfloat16, seed=10 * i + rank) for i, (m, n, k) in enumerate(shapes)]
    plans = [fo.default_plan("all_reduce", m, n, k, world_size, num_groups=2 + i, allow_sequential=False, path=path)
             for i, (m, n, k) in enumerate(shapes)]
    wants = [_expected(a, b) for a, b in inputs]
    outs = []
    for call in range(calls):  # no synchronisation between calls
        j = call % len(shapes)
        c = fo.gemm_all_reduce(*inputs[j], plan=plans[j])
        if call % 97 == 0 or call >= calls - len(shapes):
            outs.append((j, c))
    torch.cuda.synchronize()
    for j, c in outs:
        _assert_close(c, wants[j], f"back-to-back shape {shapes[j]} ({path})")
    return len(outs)


def _graph_replay(rank, world_size, replays, path="nccl"):
    m, n, k = 1536, 4096, 2048
    plan = fo.default_plan("all_reduce", m, n, k, world_size, allow_sequential=False, path=path)
    a, b = _inputs(m, n, k, torch.bfloat16, seed=rank)
    return check_graph_replays(lambda a, b: fo.gemm_all_reduce(a, b, plan=plan), _expected, a, b, rank, replays)


def _max_connections_one(rank, world_size):
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    checked = _back_to_back(rank, world_size, 50)
    a, b = _inputs(4096, 8192, 2048, torch.bfloat16, seed=rank)
    for name, plan in _plans(4096, 8192, 2048, world_size):
        _assert_close(fo.gemm_all_reduce(a, b, plan=plan), _expected(a, b), f"max connections 1, {name}")
    return checked


def _errors(rank, world_size):
    a, b = _inputs(64, 64, 64, torch.bfloat16, seed=0)
    gloo = dist.new_group(backend="gloo")
    with pytest.raises(ValueError, match="NCCL group"):
        fo.gemm_all_reduce(a, b, group=gloo)
    with pytest.raises(ValueError, match="same device"):
        fo.gemm_all_reduce(a, b.cpu())
    with pytest.raises(ValueError, match="plan is for"):
        fo.gemm_all_reduce(a, b, plan=fo.default_plan("all_reduce", 65, 64, 64, world_size))
    with pytest.raises(RuntimeError, match="CUDA graph"):
        fresh = fo.default_plan("all_reduce", 64, 64, 64, world_size, comm_ctas=3, allow_sequential=False)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            fo.gemm_all_reduce(a, b, plan=fresh)
    return True


def _debug_timeout(rank, world_size):
    """Rule 4: a wait that is never satisfied becomes an error naming the group and rank, not a hang."""
    from flashoverlap.runtime.context import context_of

    os.environ["FLASHOVERLAP_DEBUG_TIMEOUT"] = "2"  # for the op call after the timeout (the debug agreement check)
    device = torch.device("cuda", torch.cuda.current_device())
    m, n, k = 1024, 1024, 256
    plan = fo.default_plan("all_reduce", m, n, k, world_size, num_groups=4, allow_sequential=False)
    comm = context_of(dist.group.WORLD, device).communicator("gemm", "nccl")
    comm.prepare(plan, torch.bfloat16)
    c = torch.zeros(m, n, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match=rf"rank {rank}: all_reduce on group .*: group 0 of {plan.num_groups}"):
        comm.all_reduce(c, plan, timeout=2.0)  # no GEMM was launched: nothing will ever bump the counters
    # Release the waits from another stream, as the GEMM would have, and check the GPU is healthy afterwards.
    with torch.cuda.stream(torch.cuda.Stream()):
        comm.counters[: plan.num_groups].copy_(torch.tensor([g.tile_count for g in plan.groups]))
    torch.cuda.synchronize()
    assert int(comm.counters.abs().sum()) == 0
    a, b = _inputs(m, n, k, torch.bfloat16, seed=rank)
    _assert_close(fo.gemm_all_reduce(a, b, plan=plan), _expected(a, b), "after the timeout")
    return True


@needs_gpus
def test_correctness_odd_and_round_shapes():
    assert spawn(_correctness, WORLD, "nccl", env=ENV)[0] > 100


@needs_gpus
def test_plain_gemm_and_capped_nccl_ctas():
    spawn(_plain_gemm, 1, "nccl", env=ENV)
    spawn(_capped_ctas, WORLD, "nccl", env=ENV)


@needs_gpus
def test_thousand_back_to_back_calls():
    assert spawn(_back_to_back, WORLD, "nccl", args=(1000,), env=ENV)[0] >= 10


@needs_gpus
def test_cuda_graph_capture_and_replay():
    assert spawn(_graph_replay, WORLD, "nccl", args=(100,), env=ENV) == [100] * WORLD


@needs_gpus
def test_cuda_device_max_connections_one():
    spawn(_max_connections_one, WORLD, "nccl", env={**ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})


@needs_gpus
def test_errors_and_debug_timeout():
    spawn(_errors, WORLD, "nccl", env=ENV)
    spawn(_debug_timeout, WORLD, "nccl", env=ENV)


# -- the P2P path: cuBLAS and copy engines, a ring -----------------------------------------------------------------
def _p2p_plans(m, n, k, world_size):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    yield "p2p-default", fo.default_plan("all_reduce", m, n, k, world_size, num_sms=sms, path="p2p")
    yield "p2p-overlapped", fo.default_plan("all_reduce", m, n, k, world_size, num_sms=sms, path="p2p",
                                            allow_sequential=False)
    yield "p2p-many-small-sub-bands", fo.default_plan(
        "all_reduce", m, n, k, world_size, num_sms=sms, path="p2p", num_groups=5,
        tile=fo.TileConfig(64, 64, 32, 3, 2, 4), allow_sequential=False)


def _p2p_correctness(rank, world_size):
    device = torch.device("cuda", torch.cuda.current_device())
    checked = 0
    for i, (m, n, k) in enumerate(ODD_SHAPES + ROUND_SHAPES):
        for dtype in (torch.bfloat16, torch.float16):
            a, b = _inputs(m, n, k, dtype, seed=100 * i + rank)
            want = _expected(a, b)
            for name, plan in _p2p_plans(m, n, k, world_size):
                _poison_allocator(device)
                got = fo.gemm_all_reduce(a, b, plan=plan)
                _assert_close(got, want, f"{m}x{n}x{k} {dtype} plan {name}")
                assert torch.equal(fo.gemm_all_reduce(a, b, plan=plan), got), f"repeat differs ({name})"
                # Every rank holds the same result.
                first = got.clone()
                dist.broadcast(first, src=0)
                assert torch.equal(first, got), f"ranks disagree ({name})"
                checked += 1
    return checked


def _p2p_max_connections_one(rank, world_size):
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    return _back_to_back(rank, world_size, 50, "p2p")


@needs_gpus
def test_p2p_correctness_odd_and_round_shapes():
    assert spawn(_p2p_correctness, WORLD, "nccl", env=ENV)[0] >= 40


@needs_gpus
def test_p2p_thousand_back_to_back_calls():
    assert spawn(_back_to_back, WORLD, "nccl", args=(1000, "p2p"), env=ENV)[0] >= 10


@needs_gpus
def test_p2p_cuda_graph_capture_and_replay():
    assert spawn(_graph_replay, WORLD, "nccl", args=(50, "p2p"), env=ENV) == [50] * WORLD


@needs_gpus
def test_p2p_cuda_device_max_connections_one():
    spawn(_p2p_max_connections_one, WORLD, "nccl", env={**ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
