"""The fp8 ops on the CPU under gloo, every op x scaling mode on the reference path, against ``torch._scaled_mm``
(tensor- and row-wise, which run on the CPU) or the dequantised product (block-wise) of the gathered or unsharded
operands, then the plain collective: odd M, ``w.t()`` weights, both fp8 formats where ``_scaled_mm`` allows them,
bias and fp32 output, per-shard tensor-wise scales; bad input named before anything is sent; the bytes an
all-gather moves, fp8 against bf16."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap.comm.scaled import BLOCK, Scales, row_bytes
from flashoverlap.ops.scaled import all_gather_scaled_gemm_gathered
from flashoverlap.testing import spawn
from tests.ops.test_errors import world_of_one  # noqa: F401  (a fixture: one gloo rank)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantise(x: torch.Tensor, mode: str, dtype=E4M3, operand: str = "a") -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as fp8 and its fp32 scales in ``mode`` (``operand`` "a": ``[M, K]``; "b": the ``[K, N]`` weight)."""
    top = torch.finfo(dtype).max
    if mode == "tensor":
        scale = x.abs().amax().clamp(min=1e-6) / top
        return (x / scale).to(dtype), scale.reshape(()).float()
    if mode == "row":
        dim = 1 if operand == "a" else 0
        scale = x.abs().amax(dim, keepdim=True).clamp(min=1e-6) / top
        return (x / scale).to(dtype), scale.float()
    if operand == "a":  # 1 x 128 blocks
        blocks = x.reshape(x.shape[0], -1, BLOCK)
        scale = blocks.abs().amax(2).clamp(min=1e-6) / top
        return (blocks / scale[:, :, None]).reshape(x.shape).to(dtype), scale.float()
    k, n = x.shape  # 128 x 128 blocks of b [K, N]
    pad = -n % BLOCK
    padded = torch.nn.functional.pad(x, (0, pad)).reshape(k // BLOCK, BLOCK, -1, BLOCK)
    scale = padded.abs().amax((1, 3)).clamp(min=1e-6) / top
    expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:, :n]
    return (x / expanded).to(dtype), scale.float()


def expected(a, b, sa, sb, mode, out_dtype, bias=None) -> torch.Tensor:
    """One rank's ``torch._scaled_mm`` where the CPU runs it, else the dequantised product, in fp32 before the
    output rounding's sum (the ops sum partials rounded to ``out_dtype`` in fp32)."""
    if mode != "block" and not (a.dtype == b.dtype == E5M2):
        return torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype).float()
    # The dequantised product, written out here (not the library's: an oracle that shares the code it checks cannot
    # see that code's mistakes).
    k, n = b.shape
    if mode == "block":
        a32 = a.float() * sa.float().repeat_interleave(BLOCK, 1)[:, :k]
        b32 = b.float() * sb.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:k, :n]
    else:
        a32, b32 = a.float() * sa.float().reshape(-1, 1), b.float() * sb.float().reshape(1, -1)
    c = a32 @ b32 if bias is None else a32 @ b32 + bias.float()
    return c.to(out_dtype).float()


def _ops(rank, world, mode, out_dtype, b_dtype, seed):
    gen = torch.Generator().manual_seed(seed)  # the same weights on every rank's draw; inputs differ by rank
    m_shard, n, k = 5, 24 + 136 * (mode == "block"), 256 if mode == "block" else 48
    m = m_shard * world
    x = [torch.randn(m, k, generator=gen) for _ in range(world)]  # rank r's K-shard of the input (all-reduce, RS)
    w = torch.randn(n, k, generator=gen)  # an nn.Linear weight [N, K]; b = w.t()
    bias = torch.randn(n, generator=gen).to(out_dtype) if seed % 2 else None
    results = {}
    b_q, sb = quantise(w.t().contiguous(), mode, b_dtype, "b")
    b = b_q.t().contiguous().t() if mode != "block" else b_q  # w.t(): column-major, as _scaled_mm wants it
    if mode == "row":
        sb = sb.reshape(1, n)
    a_q = [quantise(xr, mode, E4M3, "a") for xr in x]
    want = sum(expected(aq, b, sa, sb, mode, out_dtype, bias).to(out_dtype).float() for aq, sa in a_q)
    for name, got in (("all_reduce", fo.scaled_gemm_all_reduce(*a_q[rank][:1], b, a_q[rank][1], sb,
                                                               out_dtype=out_dtype, bias=bias)),
                      ("reduce_scatter", fo.scaled_gemm_reduce_scatter(a_q[rank][0], b, a_q[rank][1], sb,
                                                                       out_dtype=out_dtype, bias=bias))):
        rows = slice(None) if name == "all_reduce" else slice(rank * m_shard, (rank + 1) * m_shard)
        assert got.dtype == out_dtype and not got.isnan().any(), name
        results[name] = ((got.float() - want[rows]).abs().max() / want.abs().max()).item()
    # All-gather: rank r's shard is rows [r*m_shard, ...) of one input, each shard quantised on its own (tensor-wise:
    # each shard its own scale).
    shards = [quantise(x[0][q * m_shard : (q + 1) * m_shard], mode, E4M3, "a") for q in range(world)]
    c, a_full, s_full = all_gather_scaled_gemm_gathered(shards[rank][0], b,
                                                        Scales.of(shards[rank][1], sb, out_dtype, bias))
    torch.testing.assert_close(fo.all_gather_scaled_gemm(shards[rank][0], b, shards[rank][1], sb,
                                                         out_dtype=out_dtype, bias=bias), c, atol=0, rtol=0)
    want = torch.cat([expected(aq, b, sa, sb, mode, out_dtype, bias) for aq, sa in shards])
    assert torch.equal(a_full.view(torch.uint8), torch.cat([s[0] for s in shards]).view(torch.uint8))
    scales = [s[1].reshape(1, 1).expand(m_shard, 1) if mode == "tensor" else s[1] for s in shards]
    assert torch.equal(s_full, torch.cat(scales))
    results["all_gather"] = ((c.float() - want.to(out_dtype).float()).abs().max() / want.abs().max()).item()
    return results


@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
def test_the_fp8_ops_match_scaled_mm_then_the_collective(mode):
    for world, out_dtype, b_dtype, seed in ((2, torch.bfloat16, E4M3, 0), (3, torch.float32, E5M2, 1),
                                            (4, torch.bfloat16, E4M3, 3)):
        for rank, errors in enumerate(spawn(_ops, world, args=(mode, out_dtype, b_dtype, seed))):
            tolerance = 1e-2 if out_dtype == torch.bfloat16 else 1e-5
            bad = {op: e for op, e in errors.items() if not e <= tolerance}
            assert not bad, f"{mode} W={world} {out_dtype} rank {rank}: relative errors {bad}"


def _bad(rank, world):
    a, sa = quantise(torch.randn(4, 256), "row")
    b, sb = quantise(torch.randn(256, 16), "row", operand="b")
    cases = [
        (dict(scale_a=sa[:3]), "fit no scaling mode"),
        (dict(scale_a=sa.double()), "scale_a must be float32"),
        (dict(a=a.to(torch.bfloat16)), "a must be float8_e4m3fn or float8_e5m2"),
        (dict(a=a.to(E5M2), b=b.to(E5M2)), "both float8_e5m2"),
        (dict(a=a[:, :200], b=b[:200], scale_a=torch.ones(4, 2), scale_b=torch.ones(2, 1)), "multiple of 128"),
        (dict(out_dtype=torch.float16), "out_dtype must be"),
        (dict(bias=torch.zeros(16)), "bias must be"),
        # The fp8 ops record no autograd: a gradient that would silently never come (or come only partly, through
        # the bias and scales without the collective) is refused, naming the operand.
        (dict(bias=torch.zeros(16, dtype=torch.bfloat16, requires_grad=True)), "bias requires grad"),
        (dict(scale_a=sa.clone().requires_grad_()), "scale_a requires grad, but the fp8 ops record no autograd"),
        # Scales that are not tensors are named, not met by an AttributeError of the call's signature.
        (dict(scale_a=1.0), "scale_a must be a torch.Tensor, got float"),
        (dict(scale_a=None), "scale_a must be a torch.Tensor, got NoneType"),
        (dict(scale_b=2), "scale_b must be a torch.Tensor, got int"),
    ]
    for change, message in cases:
        args = dict(a=a, b=b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, bias=None) | change
        with pytest.raises((ValueError, TypeError), match=message):
            fo.scaled_gemm_all_reduce(args["a"], args["b"], args["scale_a"], args["scale_b"],
                                      out_dtype=args["out_dtype"], bias=args["bias"])
    with torch.no_grad():  # inference: the same operands run
        bias = torch.zeros(16, dtype=torch.bfloat16, requires_grad=True)
        assert fo.scaled_gemm_all_reduce(a, b, sa, sb, bias=bias).shape == (4, 16)
    return True


def test_bad_input_is_named_before_anything_is_sent():
    assert spawn(_bad, 2) == [True, True]


def _disagree(rank, world):
    import os

    from flashoverlap import settings

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    settings.refresh()
    try:
        a, sa = quantise(torch.randn(4, 32), "tensor" if rank == 0 else "row")
        b, sb = quantise(torch.randn(32, 16), "tensor" if rank == 0 else "row", operand="b")
        with pytest.raises(ValueError, match=r"disagree on scaling \(the scales' shapes\)"):
            fo.scaled_gemm_all_reduce(a, b, sa, sb.reshape(sb.shape if rank == 0 else (1, 16)))
    finally:
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]
        settings.refresh()
    return True


def test_ranks_that_disagree_on_the_mode_are_named():
    assert spawn(_disagree, 2) == [True, True]


def test_an_fp8_all_gather_moves_about_half_the_bytes_of_a_bf16_one():
    k = 8192
    row = Scales(torch.ones(1, 1), torch.ones(1, 1), "row")
    ratio = row_bytes(k, E4M3, row) / row_bytes(k, torch.bfloat16, None)
    assert ratio <= 0.52, ratio
    block = Scales(torch.ones(1, 64), torch.ones(64, 1), "block")
    assert row_bytes(k, E4M3, block) == k + 4 * (k // BLOCK)


@pytest.mark.usefixtures("world_of_one")
def test_fp8_traces_under_compile_as_one_custom_op():
    a, sa = quantise(torch.randn(6, 32), "row")
    b, sb = quantise(torch.randn(32, 16), "row", operand="b")

    def f(a, b, sa, sb):
        return fo.scaled_gemm_all_reduce(a, b, sa, sb) * 2

    got = torch.compile(f, backend="eager", fullgraph=True)(a, b, sa, sb)
    torch.testing.assert_close(got, (torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16) * 2), atol=0,
                               rtol=0)
    assert dist.get_world_size() == 1


def _rounding(rank, world):
    """Each rank's partial product travels in the output dtype and the partials are summed in fp32: bit for bit
    what rounding each rank's ``torch._scaled_mm`` output, summing in fp32 and rounding again gives."""
    gen = torch.Generator().manual_seed(11)
    x = [torch.randn(8, 64, generator=gen) for _ in range(world)]
    b, sb = quantise(torch.randn(64, 24, generator=gen), "tensor", operand="b")
    quantised = [quantise(xr, "tensor") for xr in x]
    partials = [expected(aq, b, sa, sb, "tensor", torch.float32) for aq, sa in quantised]
    want = sum(p.to(torch.bfloat16).float() for p in partials).to(torch.bfloat16)
    a, sa = quantised[rank]
    assert torch.equal(fo.scaled_gemm_all_reduce(a, b, sa, sb, path="reference"), want)
    assert torch.equal(fo.scaled_gemm_reduce_scatter(a, b, sa, sb, path="reference"), want[rank * 4 : rank * 4 + 4])
    return True


def test_partials_travel_in_the_output_dtype_and_are_summed_in_fp32():
    assert spawn(_rounding, 2) == [True, True]
