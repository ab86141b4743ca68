"""``ExpertParallelMLP`` on two gloo ranks: ``from_moe_block`` against the plain ``MoEBlock`` (output and every
gradient: input, gate, experts), routing by its own gate, by logits and by given indices and weights, bounded mode
with the default bound; and ``torch.compile(fullgraph=True)`` of the layer in bounded mode (forward and backward
equal to eager; ``aot_eager``: Dynamo and AOTAutograd trace the custom ops through their fakes), exact mode compiled
with its layout as a graph break."""

import torch
import torch.distributed as dist

from tests.moe.cases import close

H, FFN, E, T, K = 16, 24, 8, 10, 2


def _block_and_inputs(world, dtype, hidden=H, ffn=FFN):
    from flashoverlap.nn import MoEBlock

    torch.manual_seed(0)
    block = MoEBlock(hidden, ffn, E, K, dtype=dtype)
    x = torch.randn(world, T, hidden, dtype=dtype)
    grad = torch.randn(world, T, hidden, dtype=dtype)
    return block, x, grad


def _grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def _from_moe_block(rank, world, dtype_name, hidden=H, ffn=FFN):
    from flashoverlap.nn import ExpertParallelMLP, route

    dtype = getattr(torch, dtype_name)
    block, x, grad = _block_and_inputs(world, dtype, hidden, ffn)
    x_full = x.clone().requires_grad_()
    want = block(x_full)
    (want.float() * grad.float()).sum().backward()
    want_grads = _grads(block)
    local = E // world
    for mode in ("exact", "bounded"):  # bounded: the default bound (every rank has T tokens)
        layer = ExpertParallelMLP.from_moe_block(block, mode=mode)
        x_r = x[rank].clone().requires_grad_()
        y = layer(x_r)
        close(f"{mode}: y", y, want[rank].detach(), dtype)
        (y.float() * grad[rank].float()).sum().backward()
        close(f"{mode}: grad x", x_r.grad, x_full.grad[rank], dtype)
        gate_grad = layer.gate.weight.grad.clone()
        dist.all_reduce(gate_grad)  # the replicated gate: each rank's tokens give it their part
        close(f"{mode}: grad gate", gate_grad, want_grads["gate.weight"], dtype)
        for i in range(local):
            e = rank * local + i
            w13 = torch.cat([want_grads[f"experts.{e}.w1.weight"], want_grads[f"experts.{e}.w3.weight"]])
            close(f"{mode}: grad w13[{i}]", layer.w13.grad[i], w13, dtype)
            close(f"{mode}: grad w2[{i}]", layer.w2.grad[i], want_grads[f"experts.{e}.w2.weight"], dtype)
    # The router given from outside, as logits or as indices and weights, on [batch, tokens, H] inputs.
    with torch.no_grad():
        logits = block.gate(x[rank])
        idx, weights = route(logits, K)
        for routed in (layer(x[rank][None], logits=logits[None]), layer(x[rank][None], idx[None], weights[None])):
            close("routed from outside", routed[0], want[rank], dtype)
    return True


def test_from_moe_block_matches_the_plain_block(ranks):
    ranks(2).run(_from_moe_block, "bfloat16")
    ranks(2).run(_from_moe_block, "float32")


def test_widths_off_sixteen_bytes_train_as_the_plain_block(ranks):
    """Hidden and FFN widths whose rows are not a multiple of 16 bytes (``torch._grouped_mm``'s stride rule, which
    the weight gradient's grouped product broke on): the weight gradients by one product per expert, still right."""
    ranks(2).run(_from_moe_block, "bfloat16", 12, 20)
    ranks(2).run(_from_moe_block, "float32", 6, 10)


def _rank_without_tokens(rank, world):
    """Rank 1 has no tokens (``x [0, H]``, as a rank of an uneven batch may): routed by the layer's gate and by
    logits, and the plain block on no rows; the other rank's output is the block's."""
    from flashoverlap.nn import ExpertParallelMLP

    block, x, _ = _block_and_inputs(world, torch.float32)
    x_r = x[rank] if rank == 0 else x[rank][:0]
    assert block(x[rank][:0]).shape == (0, H)  # the plain block on no rows (it reshaped [0, -1])
    none = x[rank][:0].clone().requires_grad_()
    block(none).sum().backward()  # its output on no rows is part of the graph (a zeros tensor was not)
    assert none.grad is not None and none.grad.shape == (0, H)
    for mode in ("exact", "bounded"):
        layer = ExpertParallelMLP.from_moe_block(block, mode=mode, bound=T * K if mode == "bounded" else None)
        with torch.no_grad():
            for y in (layer(x_r), layer(x_r, logits=block.gate(x_r))):
                assert y.shape == x_r.shape, (mode, y.shape)
                if rank == 0:
                    close(f"{mode}: y", y, block(x_r), torch.float32)
    return True


def test_a_rank_without_tokens_routes_by_the_gate(ranks):
    ranks(2).run(_rank_without_tokens)


def _compiled(rank, world):
    from torch._dynamo.backends.registry import lookup_backend

    from flashoverlap.nn import ExpertParallelMLP

    traced = []

    def backend(gm, example_inputs):  # aot_eager, recording what Dynamo's graph calls
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return lookup_backend("aot_eager")(gm, example_inputs)

    dtype = torch.float16
    block, x, grad = _block_and_inputs(world, dtype)
    results = {}
    for mode, fullgraph in (("bounded", True), ("exact", False)):
        layer = ExpertParallelMLP.from_moe_block(block, mode=mode)
        outs = []
        for compiled in (False, True):
            layer.zero_grad()
            run = torch.compile(layer, fullgraph=fullgraph, backend=backend) if compiled else layer
            x_r = x[rank].clone().requires_grad_()
            y = run(x_r)
            (y.float() * grad[rank].float()).sum().backward()
            outs.append((y.detach(), x_r.grad, layer.w13.grad.clone(), layer.w2.grad.clone(),
                         layer.gate.weight.grad.clone()))
        for name, eager, compiled in zip(("y", "grad x", "grad w13", "grad w2", "grad gate"), *outs):
            close(f"{mode} compiled: {name}", compiled, eager, dtype)
        results[mode] = sorted({t for t in traced if "flashoverlap" in t})
        traced.clear()
    torch._dynamo.reset()
    return results


def test_compiled_layer_matches_eager(ranks):
    got = ranks(2).run(_compiled)[0]
    # One graph held the layout, the dispatch and the combine (fullgraph=True: no break); in exact mode the layout
    # ran outside the graph (its split sizes are host integers), the two ops inside.
    ops = "flashoverlap.{}"
    assert got["bounded"] == [ops.format(op) for op in ("moe_combine", "moe_dispatch", "moe_layout")], got
    assert got["exact"] == [ops.format(op) for op in ("moe_combine", "moe_dispatch")], got


def _fp8_layer_keeps_its_format(rank, world):
    """``Float8ExpertParallelMLP.from_float`` converts in place; ``.to(torch.bfloat16)`` and ``.half()`` leave its
    fp8 weights and fp32 scales as they are (fp8 counts as floating point to ``nn.Module.to``: they were cast, and
    the next call failed naming an internal argument), and the output after ``.to`` is the output before."""
    from flashoverlap.nn import ExpertParallelMLP, Float8ExpertParallelMLP

    block, x, _ = _block_and_inputs(world, torch.bfloat16)
    big = type(block)(128, 128, E, K, dtype=torch.bfloat16)  # block-wise scales: widths of 128
    layer = ExpertParallelMLP.from_moe_block(big)
    converted = Float8ExpertParallelMLP.from_float(layer, "row")
    assert converted is layer
    formats = {n: b.dtype for n, b in layer.named_buffers()}
    xs = torch.randn(T, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        before = layer(xs)
        layer.to(torch.bfloat16)
        after = layer(xs)
        layer.half()
    assert {n: b.dtype for n, b in layer.named_buffers()} == formats, formats
    assert formats["w13_fp8"] == torch.float8_e4m3fn and formats["w13_scale"] == torch.float32
    return float((after.float() - before.float()).abs().max())


def test_an_fp8_layer_keeps_its_format_under_to_dtype(ranks):
    assert ranks(2).run(_fp8_layer_keeps_its_format) == [0.0, 0.0]


def _block_widths_checked_at_construction(rank, world):
    """Block-wise fp8 needs widths of 128: said when the layer is built (or converted), naming the widths, not at
    the first call's dispatch."""
    import pytest

    from flashoverlap.nn import ExpertParallelMLP, Float8ExpertParallelMLP

    with pytest.raises(ValueError, match=r"fp8='block' .* hidden \(128\) and ffn \(64\) must be multiples of 128"):
        ExpertParallelMLP(128, 64, E, K, fp8="block", dtype=torch.bfloat16)
    layer = ExpertParallelMLP(H, FFN, E, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"from_float: scaling='block' .* hidden \({H}\) and ffn \({FFN}\)"):
        Float8ExpertParallelMLP.from_float(layer, "block")
    # An input of another dtype is the layer's error, named before its gate's matmul refuses it in its own words.
    gated = ExpertParallelMLP(H, FFN, E, K, gate=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the input x is torch.float32 but the experts' weights are torch.bfloat16"):
        gated(torch.randn(T, H))
    return True


def test_block_wise_widths_are_checked_when_the_layer_is_built(ranks):
    assert ranks(2).run(_block_widths_checked_at_construction) == [True, True]
