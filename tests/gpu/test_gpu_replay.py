"""Repeated P2P calls replayed from CUDA graphs (``comm/replay.py``) on real GPUs: the same tensors, new values in
them call after call (odd and round shapes, both dtypes, ``w.t()`` or not), each result against plain PyTorch with
the output's memory NaN-poisoned by the call before; the graphs were captured and replayed, and switching replay
off gives the same results. Skipped without 2 GPUs."""

import os

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap import settings
from flashoverlap.runtime.context import context_of
from flashoverlap.testing import plain, spawn
from tests.gpu.helpers import ENV, WORLD, assert_close, inputs, needs_gpus

pytestmark = pytest.mark.gpu

OPS = {"all_reduce": fo.gemm_all_reduce, "reduce_scatter": fo.gemm_reduce_scatter, "all_gather": fo.all_gather_gemm}
SHAPES = [(1002, 1000, 520), (4096, 4096, 4096)]  # M divisible by the world size (2)


def _repeated_calls(rank, world_size):
    device = torch.device("cuda", torch.cuda.current_device())
    for op, fn in OPS.items():
        for i, (m, n, k) in enumerate(SHAPES):
            for dtype in (torch.bfloat16, torch.float16):
                for transposed in (True, False):
                    rows = m // world_size if op == "all_gather" else m
                    a, b = inputs(rows, n, k, dtype, seed=10 * i + rank, transposed=transposed)
                    plan = fo.default_plan(op, m, n, k, world_size, path="p2p", allow_sequential=False)
                    for replay in ("1", "0"):
                        os.environ["FLASHOVERLAP_REPLAY"] = replay
                        settings.refresh()
                        for call in range(5):
                            gen = torch.Generator(device="cuda").manual_seed(1000 * call + 10 * i + rank)
                            a.copy_(torch.randn(a.shape, dtype=dtype, device="cuda", generator=gen))
                            want = plain(op, a, b)
                            got = fn(a, b, plan=plan)
                            what = f"{op} {m}x{n}x{k} {dtype} b{'.t()' if transposed else ''} replay={replay} #{call}"
                            assert_close(got, want, what)
                            got.fill_(float("nan"))  # the next call's output gets this memory back
                            del got, want
    os.environ.pop("FLASHOVERLAP_REPLAY")
    settings.refresh()
    replays = context_of(dist.group.WORLD, device).communicator("gemm", "p2p").graphs.replays
    # 3 ops x 2 shapes x 2 dtypes x 2 layouts, 5 replayed calls each: the first eager, then a capture and replays.
    assert replays >= 24 * 3, f"only {replays} calls were replayed"
    return replays


@needs_gpus
def test_repeated_p2p_calls_replay_graphs_that_read_the_current_values():
    spawn(_repeated_calls, WORLD, "nccl", env=ENV)
