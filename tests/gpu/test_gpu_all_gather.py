"""all_gather_gemm on real GPUs, on the NCCL and the P2P path: odd shapes, both
dtypes, the gathered input, the deadlock-prone configuration (many waves, small bands), back-to-back calls, CUDA
graphs, CUDA_DEVICE_MAX_CONNECTIONS=1, and the plan check of deadlock rule 2. Skipped without 2 GPUs."""

import os

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.ops.all_gather_gemm import all_gather_gemm
from flashoverlap.testing import spawn
from tests.gpu.helpers import (
    ENV,
    ODD_SHAPES,
    ROUND_SHAPES,
    WORLD,
    assert_close,
    check_graph_replays,
    inputs,
    needs_gpus,
    poison_allocator,
)

pytestmark = pytest.mark.gpu


def _gathered(a_shard, world_size):
    full = torch.empty((a_shard.shape[0] * world_size, a_shard.shape[1]), dtype=a_shard.dtype, device="cuda")
    dist.all_gather_into_tensor(full, a_shard)
    return full


PATHS = ["nccl", "p2p", "ring"]


def _plans(m, n, k, world_size, path):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    yield "default", fo.default_plan("all_gather", m, n, k, world_size, num_sms=sms, path=path)
    if path == "nccl":
        yield "comm-bound", fo.default_plan("all_gather", m, n, k, world_size, num_sms=sms, comm_ratio=3.0,
                                            allow_sequential=False)
        yield "cublas-bands", fo.default_plan("all_gather", m, n, k, world_size, num_sms=sms, gemm="cublas",
                                              num_groups=3, allow_sequential=False)
    # Many waves of small tiles and small bands: the configuration where a GEMM starving NCCL would show.
    yield "many-small-bands", fo.default_plan("all_gather", m, n, k, world_size, num_sms=sms,
                                              num_groups=16 if path == "nccl" else 5,
                                              tile=fo.TileConfig(64, 64, 32, 3, 2, 4), allow_sequential=False,
                                              path=path)


def _correctness(rank, world_size, path):
    device = torch.device("cuda", torch.cuda.current_device())
    checked = 0
    for i, (m, n, k) in enumerate(ODD_SHAPES + ROUND_SHAPES):
        rows = -(-m // world_size)
        for dtype in (torch.bfloat16, torch.float16):
            a_shard, b = inputs(rows, n, k, dtype, seed=100 * i + rank)
            full = _gathered(a_shard, world_size)
            want = torch.matmul(full, b)
            for name, plan in _plans(rows * world_size, n, k, world_size, path):
                poison_allocator(device)
                c, gathered = all_gather_gemm(a_shard, b, plan=plan, return_gathered=True)
                assert torch.equal(gathered, full), f"gathered input differs ({name})"
                assert_close(c, want, f"{rows}x{world_size} rows, {n}x{k} {dtype} plan {name}")
                again = all_gather_gemm(a_shard, b, plan=plan)
                assert torch.equal(again, c), f"two calls on the same input differ ({name}, {path})"
                checked += 1
    return checked


def _back_to_back(rank, world_size, calls, path):
    shapes = [(-(-m // world_size), n, k) for m, n, k in ODD_SHAPES + ROUND_SHAPES]
    data = [inputs(rows, n, k, torch.bfloat16, seed=10 * i + rank) for i, (rows, n, k) in enumerate(shapes)]
    wants = [torch.matmul(_gathered(a, world_size), b) for a, b in data]
    kept = []
    for call in range(calls):
        j = call % len(shapes)
        c = all_gather_gemm(*data[j], path=path)
        if call % 37 == 0 or call >= calls - len(shapes):
            kept.append((j, c))
    torch.cuda.synchronize()
    for j, c in kept:
        assert_close(c, wants[j], f"back-to-back {shapes[j]}")
    return len(kept)


def _graph_replay(rank, world_size, replays, path):
    rows, n, k = 1536, 4096, 2048
    plan = fo.default_plan("all_gather", rows * world_size, n, k, world_size, allow_sequential=False, path=path)
    a_shard, b = inputs(rows, n, k, torch.bfloat16, seed=rank)
    return check_graph_replays(lambda a, b: all_gather_gemm(a, b, plan=plan),
                               lambda a, b: torch.matmul(_gathered(a, world_size), b), a_shard, b, rank, replays)


def _max_connections_one(rank, world_size, path):
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    return _back_to_back(rank, world_size, 50, path)


def _rule_two(rank, world_size):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a_shard, b = inputs(4096, 4096, 1024, torch.bfloat16, seed=rank)
    greedy = fo.default_plan("all_gather", 4096 * world_size, 4096, 1024, world_size, num_programs=sms,
                             allow_sequential=False)
    with pytest.raises(ValueError, match="deadlock rule 2"):
        all_gather_gemm(a_shard, b, plan=greedy)
    return True


@needs_gpus
@pytest.mark.parametrize("path", PATHS)
def test_all_gather_correctness(path):
    assert spawn(_correctness, WORLD, "nccl", args=(path,), env=ENV)[0] > 25


@needs_gpus
@pytest.mark.parametrize("path", PATHS)
def test_all_gather_thousand_back_to_back_calls(path):
    # Changing shapes call after call: for P2P, the workspace reuse protocol (ready/done barriers) under load.
    assert spawn(_back_to_back, WORLD, "nccl", args=(1000, path), env=ENV)[0] >= 10


@needs_gpus
@pytest.mark.parametrize("path", PATHS)
def test_all_gather_graph_replay(path):
    assert spawn(_graph_replay, WORLD, "nccl", args=(50, path), env=ENV) == [50] * WORLD


@needs_gpus
@pytest.mark.parametrize("path", PATHS)
def test_all_gather_cuda_device_max_connections_one(path):
    spawn(_max_connections_one, WORLD, "nccl", args=(path,), env={**ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def _p2p_capture_needs_an_eager_call(rank, world_size):
    rows, n, k = 512, 1024, 1024
    a_shard, b = inputs(rows, n, k, torch.bfloat16, seed=rank)
    all_gather_gemm(a_shard, b, path="p2p")  # the group's first call (plan cache exchanged, P2P checked)
    small = fo.default_plan("all_gather", rows * world_size, n, k, world_size, path="p2p", allow_sequential=False)
    all_gather_gemm(a_shard, b, plan=small)  # overlapped: the workspace is allocated, for this size
    big_shard, big_b = inputs(8 * rows, n, 4 * k, torch.bfloat16, seed=rank)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError, match="outside CUDA-graph capture"):
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            # Overlapped (a sequential plan would not touch the workspace): needs a larger one, refused, not hung.
            all_gather_gemm(big_shard, big_b, plan=fo.default_plan("all_gather", 8 * rows * world_size, n, 4 * k,
                                                                   world_size, path="p2p", allow_sequential=False))
    return True


@needs_gpus
def test_all_gather_p2p_workspace_growth_is_refused_inside_capture():
    spawn(_p2p_capture_needs_an_eager_call, WORLD, "nccl", env=ENV)


@needs_gpus
def test_all_gather_refuses_plans_that_could_starve_nccl():
    spawn(_rule_two, WORLD, "nccl", env=ENV)


def _auto_path(rank, world_size, expect_p2p):
    """path="auto" (the default): P2P where every GPU reaches every other, NCCL under NCCL_P2P_DISABLE=1."""
    from flashoverlap.runtime.context import context_of

    rows, n, k = 2048, 8192, 8192  # a grid shape, where the P2P default plan overlaps
    a_shard, b = inputs(rows, n, k, torch.bfloat16, seed=rank)
    want = torch.matmul(_gathered(a_shard, world_size), b)
    poison_allocator(torch.device("cuda", torch.cuda.current_device()))
    assert_close(all_gather_gemm(a_shard, b), want, f"auto path (P2P expected: {expect_p2p})")
    used_p2p = ("gemm", "p2p") in context_of(dist.group.WORLD, a_shard.device).communicators
    assert used_p2p == expect_p2p, f"path='auto' {'did not take' if expect_p2p else 'took'} the P2P path"
    return True


@needs_gpus
def test_all_gather_auto_path_takes_p2p_unless_nccl_p2p_is_disabled():
    spawn(_auto_path, WORLD, "nccl", args=(True,), env=ENV)
    spawn(_auto_path, WORLD, "nccl", args=(False,), env={**ENV, "NCCL_P2P_DISABLE": "1"})
