"""``flashoverlap.release(group)`` on real GPUs: after calls on every path (P2P with replayed graphs and its symmetric
workspace, NCCL with a capped-CTA clone of the group, sequential), the device memory the caching allocator holds
returns to its level before the first call, and the next call still gives plain PyTorch's answer. Skipped without 2
GPUs."""

import gc

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.runtime.context import existing_context
from flashoverlap.testing import plain, spawn
from tests.gpu.helpers import ENV, WORLD, assert_close, inputs, needs_gpus

pytestmark = pytest.mark.gpu


# The device memory a release may leave in use beyond the level before the first call: NCCL's lazily created
# per-peer state of the caller's own group stays (it belongs to the group, not to flashoverlap).
DEVICE_SLACK = 64 << 20


def _allocated(device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _device_used(device) -> int:
    """Device memory in use by anything (the caching allocator's cache emptied first): symmetric memory and NCCL
    buffers are not the caching allocator's."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _release(rank, world_size):
    device = torch.device("cuda", torch.cuda.current_device())
    m, n, k = 4096, 4096, 2048
    a, b = inputs(m, n, k, torch.bfloat16, seed=rank)
    shard = a[: m // world_size].contiguous()
    want = {op: plain(op, x, b) for op, x in (("all_reduce", a), ("reduce_scatter", a), ("all_gather", shard))}
    dist.all_reduce(torch.ones(1, device=device))  # the group's own NCCL state, before the level is taken
    before, used_before = _allocated(device), _device_used(device)
    for _ in range(3):  # a capture on the second call, replays after
        for path in ("p2p", "nccl"):
            assert_close(fo.gemm_all_reduce(a, b, path=path), want["all_reduce"], f"all_reduce {path}")
            assert_close(fo.gemm_reduce_scatter(a, b, path=path), want["reduce_scatter"], f"reduce_scatter {path}")
            assert_close(fo.all_gather_gemm(shard, b, path=path), want["all_gather"], f"all_gather {path}")
        capped = fo.default_plan("all_reduce", m, n, k, world_size, comm_ctas=4, allow_sequential=False)
        assert_close(fo.gemm_all_reduce(a, b, plan=capped), want["all_reduce"], "capped NCCL CTAs")
    context = existing_context(dist.group.WORLD, device)
    assert {("gemm", "p2p"), ("gemm", "nccl")} <= set(context.communicators)
    held, used_held = _allocated(device), _device_used(device)
    assert held > before, "the calls kept nothing: the test would not see a release"
    fo.release(dist.group.WORLD)
    after, used_after = _allocated(device), _device_used(device)
    assert after <= before, f"release left {after - before} bytes allocated (held {held - before} before it)"
    assert used_after <= used_before + DEVICE_SLACK, (
        f"release left {(used_after - used_before) >> 20} MiB of device memory in use (held "
        f"{(used_held - used_before) >> 20} MiB before it)")
    assert existing_context(dist.group.WORLD, device) is None
    assert_close(fo.gemm_all_reduce(a, b, path="p2p"), want["all_reduce"], "after release")
    fo.release()
    return held - before


@needs_gpus
def test_release_returns_memory_to_its_level_before_the_first_call():
    assert min(spawn(_release, WORLD, "nccl", env=ENV)) > 0
