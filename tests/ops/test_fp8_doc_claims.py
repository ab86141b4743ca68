"""What docs/usage.md, docs/design.md and the fp8 ops' docstrings say about fp8, pinned to the code: the dtypes,
scale shapes and output dtypes each op takes or refuses (and the words it refuses them with), the bias rules, that
the ring is no fp8 path on CUDA, and what the expert ops return in fp8 (``out_dtype``: bf16 by default, fp32 where
asked, not on the P2P path)."""

from __future__ import annotations

import pytest
import torch

import flashoverlap as fo
from flashoverlap.runtime import policy
from flashoverlap.testing import spawn
from tests.ops.test_errors import world_of_one  # noqa: F401  (a fixture: one gloo rank)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M, K, N = 8, 256, 32
TP_OPS = (fo.scaled_gemm_all_reduce, fo.scaled_gemm_reduce_scatter, fo.all_gather_scaled_gemm)


def _operands(a_dtype=E4M3, b_dtype=E4M3, k=K):
    torch.manual_seed(0)
    return torch.randn(M, k).to(a_dtype), torch.randn(N, k).to(b_dtype).t()  # b: w.t() of an [N, K] weight


ONE = torch.tensor(1.0)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("op", TP_OPS, ids=lambda f: f.__name__)
def test_output_is_bf16_by_default_fp32_on_request_and_nothing_else(op):
    a, b = _operands()
    assert op(a, b, ONE, ONE).dtype == torch.bfloat16
    assert op(a, b, ONE, ONE, out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="out_dtype must be torch.bfloat16 or torch.float32"):
        op(a, b, ONE, ONE, out_dtype=torch.float16)


@pytest.mark.usefixtures("world_of_one")
def test_e5m2_is_taken_beside_e4m3_but_not_on_both_operands():
    for a_dtype, b_dtype in ((E5M2, E4M3), (E4M3, E5M2)):
        a, b = _operands(a_dtype, b_dtype)
        assert fo.scaled_gemm_all_reduce(a, b, ONE, ONE).dtype == torch.bfloat16
    a, b = _operands(E5M2, E5M2)
    with pytest.raises(ValueError, match="both float8_e5m2"):
        fo.scaled_gemm_all_reduce(a, b, ONE, ONE)


@pytest.mark.usefixtures("world_of_one")
def test_the_scales_shapes_say_the_mode():
    a, b = _operands()
    for shape in ((), (1,), (1, 1)):  # tensor-wise: one value each
        fo.scaled_gemm_all_reduce(a, b, ONE.reshape(shape), ONE.reshape(shape))
    fo.scaled_gemm_all_reduce(a, b, torch.ones(M, 1), torch.ones(1, N))  # row-wise
    fo.scaled_gemm_all_reduce(a, b, torch.ones(M, K // 128), torch.ones(K // 128, -(-N // 128)))  # block-wise
    with pytest.raises(ValueError, match="fit no scaling mode"):  # row-wise scales are 2-D
        fo.scaled_gemm_all_reduce(a, b, torch.ones(M), torch.ones(N))
    with pytest.raises(ValueError, match="must be float32"):
        fo.scaled_gemm_all_reduce(a, b, ONE.bfloat16(), ONE)
    a, b = _operands(k=200)
    with pytest.raises(ValueError, match="block-wise scaling needs K .* a multiple of 128"):
        fo.scaled_gemm_all_reduce(a, b, torch.ones(M, 2), torch.ones(2, 1))


@pytest.mark.usefixtures("world_of_one")
def test_the_bias_is_n_wide_in_the_output_dtype():
    a, b = _operands()
    fo.scaled_gemm_all_reduce(a, b, ONE, ONE, bias=torch.zeros(N, dtype=torch.bfloat16))
    fo.scaled_gemm_all_reduce(a, b, ONE, ONE, bias=torch.zeros(N), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="bias must be a"):
        fo.scaled_gemm_all_reduce(a, b, ONE, ONE, bias=torch.zeros(N))  # fp32 bias, bf16 output


def _bias(rank, world):
    a, b = _operands()
    bias = torch.full((N,), 0.5, dtype=torch.float32)
    out = {}
    for name, op in (("all_reduce", fo.scaled_gemm_all_reduce), ("all_gather", fo.all_gather_scaled_gemm)):
        plain = op(a, b, ONE, ONE, out_dtype=torch.float32)
        biased = op(a, b, ONE, ONE, out_dtype=torch.float32, bias=bias)
        out[name] = (biased - plain).mean().item()
    return out


def test_every_ranks_bias_enters_its_own_product():
    """usage.md: in the all-reduce a bias given on every rank is summed W times; the all-gather adds it once."""
    for added in spawn(_bias, 2):
        assert added["all_reduce"] == pytest.approx(2 * 0.5, abs=1e-3)
        assert added["all_gather"] == pytest.approx(0.5, abs=1e-3)


def _request(dtype, **kw):
    return policy.Request(torch.device("cuda"), dtype, 2, None, lambda: None, **kw)


def test_on_cuda_fp8_runs_on_the_fp8_paths_and_the_ring_refuses_it():
    """design.md: an fp8 call naming another overlapped path on CUDA is refused, naming the paths that run fp8."""
    request = _request(E4M3)
    for path in policy.FP8_PATHS:
        assert policy.reason_not(path, request) is None
    assert "ring" not in policy.FP8_PATHS
    why = policy.reason_not("ring", request)
    assert why is not None and "does not run fp8" in why and all(path in why for path in policy.FP8_PATHS)


def test_the_expert_p2p_path_takes_a_bf16_output_only():
    """usage.md: fp8 expert calls with ``out_dtype=torch.float32`` run on the reference and NCCL paths, not P2P (the
    expert rules see the output dtype)."""
    request = policy.ExpertRequest(torch.device("cuda"), torch.float32, 2, frozenset(("reference", "nccl", "p2p")),
                                   lambda: None)
    assert "runs bfloat16/float16" in policy.reason_not_expert_p2p(request)
    assert policy.reason_not_expert_nccl(request) is None
    assert policy.expert_path("moe_dispatch_gemm", "auto", request)[0] == "nccl"


def _experts():
    from flashoverlap.nn.fp8_moe import quantise_weight

    torch.manual_seed(0)
    tokens, hidden, ffn, experts, top_k = 8, 256, 128, 2, 2
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    w13, s13 = quantise_weight(torch.randn(experts, 2 * ffn, hidden), "row")
    w2, s2 = quantise_weight(torch.randn(experts, hidden, ffn), "row")
    layout = fo.moe_layout(torch.randint(0, experts, (tokens, top_k)), experts)
    return x, (w13.transpose(1, 2), s13), (w2.transpose(1, 2), s2), torch.rand(tokens, top_k), layout


@pytest.mark.usefixtures("world_of_one")
def test_the_fp8_expert_ops_return_out_dtype_bf16_by_default():
    x, (w13, s13), (w2, s2), weights, layout = _experts()
    h = fo.moe_dispatch_gemm(x, w13, layout, scale_w=s13)
    assert h.dtype == torch.bfloat16
    assert fo.moe_dispatch_gemm(x, w13, layout, scale_w=s13, out_dtype=torch.float32).dtype == torch.float32
    a = h[:, : h.shape[1] // 2]
    for rows in (a, a.half(), a.float()):  # bf16, fp16 or fp32 intermediate: quantised by the op
        assert fo.moe_gemm_combine(rows, w2, weights, layout, scale_w=s2).dtype == torch.bfloat16
    y = fo.moe_gemm_combine(a, w2, weights, layout, scale_w=s2, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == x.shape
    for call in (lambda: fo.moe_dispatch_gemm(x, w13, layout, scale_w=s13, out_dtype=torch.float16),
                 lambda: fo.moe_gemm_combine(a, w2, weights, layout, scale_w=s2, out_dtype=torch.float16)):
        with pytest.raises(ValueError, match="out_dtype must be torch.bfloat16 or torch.float32"):
            call()


@pytest.mark.usefixtures("world_of_one")
def test_the_fp8_expert_ops_take_e4m3_only_naming_the_argument():
    x, (w13, s13), _, _, layout = _experts()
    with pytest.raises(ValueError, match="x must be float8_e4m3fn"):
        fo.moe_dispatch_gemm(x.float().to(E5M2), w13, layout, scale_x=torch.ones(x.shape[0], 1), scale_w=s13)
    with pytest.raises(ValueError, match="w_up must be float8_e4m3fn"):
        fo.moe_dispatch_gemm(x, w13.float().to(E5M2), layout, scale_w=s13)
    with pytest.raises(ValueError, match=r"scale_x must be float32 \[8, 1\]"):  # the rows' scales in scale_w's mode
        fo.moe_dispatch_gemm(x.float().to(E4M3), w13, layout, scale_x=torch.ones(x.shape[0], 2), scale_w=s13)
