"""gemm_reduce_scatter on real GPUs, on the NCCL and the P2P path: odd shapes, both
dtypes, back-to-back calls of changing shapes, CUDA graphs, CUDA_DEVICE_MAX_CONNECTIONS=1. Skipped without 2 GPUs."""

import os

import pytest
import torch

import flashoverlap as fo
from flashoverlap import settings
from flashoverlap.comm.collectives import reduce_scatter_tensor
from flashoverlap.ops.gemm_reduce_scatter import gemm_reduce_scatter
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


def _expected(a, b, world_size):
    out = torch.empty((a.shape[0] // world_size, b.shape[1]), dtype=a.dtype, device=a.device)
    reduce_scatter_tensor(out, torch.matmul(a, b), None)
    return out


PATHS = ["nccl", "p2p", "ring"]


def _plans(m, n, k, world_size, path):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if path in ("p2p", "ring"):
        yield "default", fo.default_plan("reduce_scatter", m, n, k, world_size, num_sms=sms, path=path)
        yield f"{path}-overlapped", fo.default_plan("reduce_scatter", m, n, k, world_size, num_sms=sms, path=path,
                                                    allow_sequential=False)
        yield f"{path}-many-small-sub-bands", fo.default_plan(
            "reduce_scatter", m, n, k, world_size, num_sms=sms, path=path,
            tile=fo.TileConfig(64, 64, 32, 3, 2, 4), num_groups=5, allow_sequential=False)
        return
    yield "default", None
    yield "one-tile-per-program", fo.default_plan("reduce_scatter", m, n, k, world_size, num_sms=sms,
                                                  allow_sequential=False)
    yield "persistent-comm-bound", fo.default_plan("reduce_scatter", m, n, k, world_size, num_sms=sms,
                                                   comm_ratio=3.0, allow_sequential=False)
    yield "small-tiles", fo.default_plan("reduce_scatter", m, n, k, world_size, num_sms=sms,
                                         tile=fo.TileConfig(64, 64, 32, 3, 2, 4), num_groups=5,
                                         allow_sequential=False)
    yield "cublas-bands", fo.default_plan("reduce_scatter", m, n, k, world_size, num_sms=sms, gemm="cublas",
                                          num_groups=3, allow_sequential=False)


def _shapes(world_size):
    # M must split evenly: round each M up to a multiple of the world size (odd rows per rank stay odd).
    return [(-(-m // world_size) * world_size, n, k) for m, n, k in ODD_SHAPES + ROUND_SHAPES]


def _correctness(rank, world_size, path):
    device = torch.device("cuda", torch.cuda.current_device())
    checked = 0
    for i, (m, n, k) in enumerate(_shapes(world_size)):
        for dtype in (torch.bfloat16, torch.float16):
            for transposed in (True, False):
                a, b = inputs(m, n, k, dtype, seed=100 * i + rank, transposed=transposed)
                want = _expected(a, b, world_size)
                for name, plan in _plans(m, n, k, world_size, path):
                    poison_allocator(device)
                    got = gemm_reduce_scatter(a, b, plan=plan)
                    assert got.shape == (m // world_size, n)
                    assert_close(got, want, f"{m}x{n}x{k} {dtype} plan {name}")
                    if path in ("p2p", "ring"):
                        assert torch.equal(gemm_reduce_scatter(a, b, plan=plan), got), f"repeat differs ({name})"
                    checked += 1
    return checked


def _back_to_back(rank, world_size, calls, path):
    shapes = _shapes(world_size)
    data = [inputs(m, n, k, torch.bfloat16, seed=10 * i + rank) for i, (m, n, k) in enumerate(shapes)]
    plans = [fo.default_plan("reduce_scatter", m, n, k, world_size, num_groups=2 + i % 5, allow_sequential=False,
                             path=path)
             for i, (m, n, k) in enumerate(shapes)]
    wants = [_expected(a, b, world_size) for a, b in data]
    kept = []
    for call in range(calls):
        j = call % len(shapes)
        out = gemm_reduce_scatter(*data[j], plan=plans[j])
        if call % 37 == 0 or call >= calls - len(shapes):
            kept.append((j, out))
    torch.cuda.synchronize()
    for j, out in kept:
        assert_close(out, wants[j], f"back-to-back {shapes[j]}")
    return len(kept)


def _graph_replay(rank, world_size, replays, path):
    m, n, k = 1536 * world_size, 4096, 2048
    plan = fo.default_plan("reduce_scatter", m, n, k, world_size, allow_sequential=False, path=path)
    a, b = inputs(m, n, k, torch.bfloat16, seed=rank)
    return check_graph_replays(lambda a, b: gemm_reduce_scatter(a, b, plan=plan),
                               lambda a, b: _expected(a, b, world_size), a, b, rank, replays)


def _max_connections_one(rank, world_size, path):
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    return _back_to_back(rank, world_size, 50, path)


@needs_gpus
@pytest.mark.parametrize("path", PATHS)
def test_reduce_scatter_correctness(path):
    assert spawn(_correctness, WORLD, "nccl", args=(path,), env=ENV)[0] > 80


@needs_gpus
@pytest.mark.parametrize("path", PATHS)
def test_reduce_scatter_thousand_back_to_back_calls(path):
    assert spawn(_back_to_back, WORLD, "nccl", args=(1000, path), env=ENV)[0] >= 10


@needs_gpus
@pytest.mark.parametrize("path", PATHS)
def test_reduce_scatter_graph_replay(path):
    assert spawn(_graph_replay, WORLD, "nccl", args=(50, path), env=ENV) == [50] * WORLD


@needs_gpus
@pytest.mark.parametrize("path", PATHS)
def test_reduce_scatter_cuda_device_max_connections_one(path):
    spawn(_max_connections_one, WORLD, "nccl", args=(path,), env={**ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})



def _auto_follows_the_tuned_path(rank, world_size, cache_dir, tuned_path):
    """A plan that `tune plan --path auto` cached for this shape decides path="auto" (the default), either way."""
    from flashoverlap.runtime.context import context_of
    from flashoverlap.tune import cache

    os.environ["FLASHOVERLAP_CACHE_DIR"] = cache_dir

    settings.refresh()  # read once: read again
    m, n, k = 1024 * world_size, 4096, 2048
    name = torch.cuda.get_device_name(torch.cuda.current_device())
    if rank == 0:
        plan = fo.default_plan("reduce_scatter", m, n, k, world_size, num_groups=3, allow_sequential=False,
                               path=tuned_path)
        cache.store(cache.cache_key(name, world_size, "reduce_scatter", "auto", "bfloat16"), plan)
    torch.distributed.barrier()
    a, b = inputs(m, n, k, torch.bfloat16, seed=rank)
    want = _expected(a, b, world_size)
    poison_allocator(torch.device("cuda", torch.cuda.current_device()))
    assert_close(gemm_reduce_scatter(a, b), want, f"auto path, tuned on {tuned_path}")
    used_p2p = ("gemm", "p2p") in context_of(torch.distributed.group.WORLD, a.device).communicators
    assert used_p2p == (tuned_path == "p2p"), f"path='auto' did not follow the tuned plan's path {tuned_path}"
    return True


@needs_gpus
@pytest.mark.parametrize("path", PATHS)
def test_reduce_scatter_auto_path_follows_a_tuned_plan(path, tmp_path):
    assert spawn(_auto_follows_the_tuned_path, WORLD, "nccl", args=(str(tmp_path), path), env=ENV) == [True] * WORLD
