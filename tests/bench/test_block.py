"""The tensor-parallel block example on the CPU (two gloo ranks, toy sizes, bf16): loss and every gradient of each
rank's shard against the unsharded block, with flashoverlap's layers (reference path) and with plain PyTorch TP;
and ``torch.compile(fullgraph=True)`` traces the block with flashoverlap's custom ops (forward and backward)."""

import pytest
import torch

from flashoverlap.testing import spawn

LIMIT = 2e-2  # bf16: the sharded and unsharded blocks round in different places


def _check(rank, world_size, impl):
    from flashoverlap.bench.block import check_against_unsharded

    return check_against_unsharded(rank, world_size, impl=impl)


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_block_gradients_match_the_unsharded_block(impl):
    for rank, errors in enumerate(spawn(_check, 2, args=(impl,))):
        bad = {name: err for name, err in errors.items() if not err < LIMIT}
        assert not bad, f"rank {rank} ({impl}): relative errors over {LIMIT}: {bad}"
        assert set(errors) == {"loss", "x", "qkv", "gate_up", "o", "down", "attn_norm", "ffn_norm"}


def _compiled(rank, world_size):
    from flashoverlap.bench.block import TOY, Block, TPBlock

    torch.manual_seed(0)
    shard = TPBlock(Block(TOY, dtype=torch.bfloat16))
    x = torch.randn(16, TOY.hidden, dtype=torch.bfloat16)
    eager_x, compiled_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = shard(eager_x)
    want.float().sum().backward()
    compiled = torch.compile(shard, fullgraph=True, backend="aot_eager")
    got = compiled(compiled_x)
    got.float().sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)
    ops = {str(node.target) for node in _graph_nodes(compiled)}
    return sorted(op for op in ops if "flashoverlap" in op)


def _graph_nodes(compiled):
    from torch._dynamo.eval_frame import OptimizedModule

    assert isinstance(compiled, OptimizedModule)
    gm = torch._dynamo.export(compiled._orig_mod)(torch.randn(16, 64, dtype=torch.bfloat16)).graph_module
    return list(gm.graph.nodes)


def test_compile_fullgraph_traces_the_custom_ops():
    ops = spawn(_compiled, 2)[0]
    assert any("all_gather_gemm" in op for op in ops) and any("gemm_reduce_scatter" in op for op in ops), ops
