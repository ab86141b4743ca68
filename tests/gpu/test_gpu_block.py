"""The tensor-parallel block on real GPUs (every rank a GPU, NCCL, the default path: P2P on one NVLink node): loss
and every gradient against the unsharded block at a size where the ops overlap, and the block compiled by
Inductor with ``fullgraph=True`` (our ops opaque) agreeing with eager, forward and backward. Skipped without 2
GPUs."""

import pytest
import torch

from flashoverlap.testing import spawn
from tests.gpu.helpers import ENV, WORLD, needs_gpus

pytestmark = pytest.mark.gpu
LIMIT = 2e-2


def _gradients(rank, world_size):
    from benchmarks.block import BlockConfig, check_against_unsharded

    cfg = BlockConfig(hidden=1024, heads=8, kv_heads=2, ffn=4096)
    return check_against_unsharded(rank, world_size, cfg, tokens=4096)


@needs_gpus
def test_block_gradients_match_the_unsharded_block_on_gpus():
    for rank, errors in enumerate(spawn(_gradients, WORLD, "nccl", env=ENV)):
        bad = {k: v for k, v in errors.items() if not v < LIMIT}
        assert not bad, f"rank {rank}: {bad}"


def _compiled(rank, world_size):
    from benchmarks.block import Block, BlockConfig, TPBlock

    cfg = BlockConfig(hidden=1024, heads=8, kv_heads=2, ffn=4096)
    torch.manual_seed(0)
    shard = TPBlock(Block(cfg, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(4096 // world_size, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    eager_x, compiled_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = shard(eager_x)
    want.float().pow(2).mean().backward()
    want_grads = [p.grad.clone() for p in shard.parameters()]
    shard.zero_grad()
    got = torch.compile(shard, fullgraph=True)(compiled_x)
    got.float().pow(2).mean().backward()
    errors = [float((g.double() - w.double()).norm() / w.double().norm()) for g, w in
              zip([got, compiled_x.grad] + [p.grad for p in shard.parameters()], [want, eager_x.grad] + want_grads)]
    return max(errors)


@needs_gpus
def test_block_compiled_fullgraph_matches_eager():
    assert max(spawn(_compiled, WORLD, "nccl", env=ENV)) < LIMIT
