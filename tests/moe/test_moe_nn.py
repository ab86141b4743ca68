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


def _shapes_and_grads_refused_before_anything_runs(rank, world):
    """A wrong width of ``x``, logits of another expert count, routing of other leading dimensions or another k:
    each the layer's ValueError naming the argument, on every rank before any collective (the input was reshaped
    into other rows, and ``logits [T, E - 1]`` routed to the first E - 1 experts only, without an error); the same
    for the plain ``MoEBlock``. A gated fp8 inference layer called with autograd on (the gate's parameters need
    gradients) is refused by the layer, not by the combine after the dispatch; an input of another dtype than the
    gate's is named before the gate's matmul."""
    import pytest

    from flashoverlap.nn import ExpertParallelMLP, Float8ExpertParallelMLP, MoEBlock

    layer = ExpertParallelMLP(H, FFN, E, K, gate=True, dtype=torch.bfloat16)
    block = MoEBlock(H, FFN, E, K, dtype=torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx, weights = torch.randint(0, E, (T, K)), torch.rand(T, K, dtype=torch.bfloat16)
    bad = [((torch.randn(T, 2 * H, dtype=torch.bfloat16),), {}, r"x must be \[\.\.\., H = 16\], got \[10, 32\]"),
           ((x,), {"logits": torch.randn(T, E - 1, dtype=torch.bfloat16)}, r"logits must be \[\.\.\., E = 8\]"),
           ((x,), {"logits": torch.randn(T // 2, 2 * E, dtype=torch.bfloat16)}, r"logits must be"),
           ((x, idx.reshape(-1), weights.reshape(-1)), {}, r"topk_idx must be \[\.\.\., k\] .* got \[20\]"),
           ((x, idx, weights[:, :1]), {}, r"must have the same k"),
           ((x.reshape(2, T // 2, H), idx.reshape(T // 2, 2, K), weights), {}, r"topk_idx must be")]
    for args, kwargs, words in bad:
        with pytest.raises(ValueError, match=words):
            layer(*args, **kwargs)
        if "logits" not in kwargs:
            with pytest.raises(ValueError, match=words):
                block(*args)
    assert layer(x.reshape(2, T // 2, H), idx.reshape(2, T // 2, K), weights).shape == (2, T // 2, H)
    # x's rows flattened already: routing of any leading shape with as many rows, in their order
    assert layer(x, idx.reshape(2, T // 2, K), weights.reshape(2, T // 2, K)).shape == (T, H)
    layer.gate.float()  # an fp32 router under autocast: autocast casts x and the gate's weight alike
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).shape == (T, H)
    fp8 = Float8ExpertParallelMLP.from_float(ExpertParallelMLP(128, 128, E, K, gate=True, dtype=torch.bfloat16), "row")
    with pytest.raises(ValueError, match="Float8ExpertParallelMLP: fp8 experts run forward only"):
        fp8(torch.randn(T, 128, dtype=torch.bfloat16))  # x needs no gradient; the gate's weight does
    with torch.no_grad(), pytest.raises(ValueError, match="the input x is torch.float16 but the gate's weight"):
        fp8(torch.randn(T, 128, dtype=torch.float16))
    with torch.no_grad():
        assert fp8(torch.randn(T, 128, dtype=torch.bfloat16)).shape == (T, 128)
    return True


def test_shapes_and_gradients_are_refused_by_the_layer_before_anything_runs(ranks):
    assert ranks(2).run(_shapes_and_grads_refused_before_anything_runs) == [True, True]


def _fp8_inference_layers(rank, world):
    """``ExpertParallelMLP(fp8="block")`` and ``Float8ExpertParallelMLP.from_float(..., "block")`` give the same
    values (the docs' promise: the same numerics, the weights cast at every call or once), and the first casts its
    weights at every call: a write through ``.data`` (which autograd's version counter does not see) is in the next
    call's values, as a fresh layer's."""
    import copy

    from flashoverlap.nn import ExpertParallelMLP, Float8ExpertParallelMLP

    torch.manual_seed(1)  # the same weights on every rank's copy of the layer's shard
    layer = ExpertParallelMLP(128, 128, 2 * world, 2, fp8="block", dtype=torch.bfloat16)
    torch.manual_seed(10 + rank)
    x = torch.randn(7, 128, dtype=torch.bfloat16)
    idx = torch.randint(0, 2 * world, (7, 2))
    weights = torch.rand(7, 2, dtype=torch.bfloat16)
    with torch.no_grad():
        got = layer(x, idx, weights)
        once = Float8ExpertParallelMLP.from_float(copy.deepcopy(layer), "block")
        assert torch.equal(once(x, idx, weights), got)
        layer.w13.data.copy_(torch.randn_like(layer.w13) / 11)  # a loader's write, unseen by the version counter
        layer.w2.data.mul_(-3)
        again = layer(x, idx, weights)
        fresh = copy.deepcopy(layer)
        assert not torch.equal(again, got)
        assert torch.equal(again, fresh(x, idx, weights))
    return True


def test_fp8_inference_layers_agree_and_cast_the_weights_at_every_call(ranks):
    assert ranks(2).run(_fp8_inference_layers) == [True, True]
