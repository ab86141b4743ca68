"""The signalling GEMM in fp8 (kernels/gemm.py with ``Scaling``): values and counters of every scaling mode under the
Triton interpreter, against ``torch._scaled_mm`` on the CPU (tensor-wise and row-wise) or the dequantised float64
product (block-wise, and the modes ``_scaled_mm`` does not take); argument errors; and, on a GPU, the compiled kernel
against ``torch._scaled_mm`` in each mode.

The interpreter multiplies fp8 tiles exactly (``tl.dot`` on ``float8_e4m3fn`` / ``float8_e5m2``, also mixed, fp32
accumulation: checked against the fp32 product of the upcast tiles with Triton 3.9), through pointer loads and TMA
descriptors alike, so nothing is upcast in the kernel for it. Its fp32 -> bf16 conversion truncates (see ``_limit``).
The interpreted cases run in one child process (``python -m tests.kernels.test_fp8_gemm``), which sets
TRITON_INTERPRET before triton is imported; this process never sets it.
"""

import json
import math
import os
import sys

if __name__ == "__main__":  # the child: interpret the kernels (before anything imports triton)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from flashoverlap.kernels.gemm import GatherWait, Scaling, gemm, launch_arguments  # noqa: E402
from flashoverlap.plan import TileConfig  # noqa: E402
from flashoverlap.tune.defaults import default_plan  # noqa: E402
from tests.interpreter import interpreted_rows, needs_interpreter  # noqa: E402

E4, E5 = "float8_e4m3fn", "float8_e5m2"
# Scaling modes: tensor-wise; row-wise; A per row with one B scale (the gathered tensor-wise shards, each with its own
# scale); one A scale with B per column; block-wise (A 1x128, B 128x128).
MODES = ("tensor", "row", "row-a", "col-b", "block")

# (name, op, world size, M, N, K, mode, A and B dtypes, out dtype, bias, tile (block_m, block_n, block_k), B as w.t(),
#  TMA loads, groups, programs)
CASES = [
    ("tensor-odd-pointer", "all_reduce", 2, 37, 45, 50, "tensor", (E4, E4), "bfloat16", False, (16, 16, 16), True,
     False, 3, 5),
    ("tensor-tma-fp32-bias", "all_reduce", 2, 64, 48, 80, "tensor", (E4, E4), "float32", True, (16, 16, 32), True,
     True, 2, 100),
    ("tensor-e5m2-rowmajor-b", "all_reduce", 2, 33, 40, 48, "tensor", (E5, E5), "float32", False, (16, 16, 16),
     False, False, 2, 4),
    ("row-odd-pointer-bias", "all_reduce", 2, 53, 33, 45, "row", (E4, E4), "bfloat16", True, (16, 16, 16), True,
     False, 3, 7),
    ("row-mixed-e4-e5-tma", "all_reduce", 2, 48, 64, 96, "row", (E4, E5), "float32", False, (16, 32, 32), True, True,
     2, 3),
    ("row-rs-tma", "reduce_scatter", 2, 96, 64, 96, "row", (E4, E4), "bfloat16", False, (16, 16, 32), True, True, 2,
     4),
    ("row-rs-odd-w3", "reduce_scatter", 3, 54, 37, 29, "row", (E4, E4), "float32", True, (16, 16, 16), True, False,
     2, 100),
    ("row-a-pointer", "all_reduce", 2, 41, 30, 35, "row-a", (E4, E4), "bfloat16", False, (16, 16, 16), True, False, 2,
     3),
    ("col-b-tma-fp32", "all_reduce", 2, 32, 48, 64, "col-b", (E4, E4), "float32", True, (16, 16, 32), True, True, 2,
     5),
    ("block-odd-pointer", "all_reduce", 2, 37, 150, 300, "block", (E4, E4), "float32", False, (16, 32, 128), True,
     False, 3, 6),
    ("block-wide-tile-bias", "all_reduce", 2, 20, 300, 260, "block", (E4, E4), "bfloat16", True, (16, 256, 128), True,
     False, 2, 100),
    ("block-tma-rs", "reduce_scatter", 2, 64, 272, 384, "block", (E4, E4), "float32", False, (16, 128, 128), True,
     True, 2, 3),
    ("block-tma-rowmajor-b-e5", "all_reduce", 2, 48, 160, 256, "block", (E4, E5), "bfloat16", False, (16, 32, 128),
     False, True, 2, 4),
]

# All-gather: the GEMM on the gathered buffer in the plan's layout, every band arrived.
# (name, rows per rank, N, K, world size, rank, mode, tile, TMA loads, groups)
ALL_GATHER_CASES = [
    ("ag-tensor-shards-rank1", 40, 33, 48, 2, 1, "tensor-shards", (16, 16, 16), False, 3),
    ("ag-row-tma-rank0", 48, 32, 64, 2, 0, "row", (16, 16, 32), True, 2),
    ("ag-block-rank2-of-3", 21, 140, 200, 3, 2, "block", (16, 32, 128), False, 2),
]


def _fp8(shape, dtype_name, gen):
    """Values spread over fp8's range, never zeros: randn scaled, then cast."""
    return (torch.randn(shape, generator=gen) * 3).to(getattr(torch, dtype_name))


def _scales(mode, m, n, k, gen):
    """``(scale_a, scale_b)`` in the layouts ``torch._scaled_mm`` takes (block-wise: A outer-dim-major, B as the
    transpose of a ``[N/128, K/128]`` weight scale)."""
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)

    def rand(*shape):
        return torch.rand(shape, generator=gen) + 0.5

    if mode == "tensor":
        return rand(), rand(1)
    if mode == "row":
        return rand(m, 1), rand(1, n)
    if mode == "row-a":
        return rand(m, 1), rand()
    if mode == "col-b":
        return rand(1), rand(1, n)
    return rand(m, kb).t().contiguous().t(), rand(nb, kb).t()


def dequantised(a, b, scale_a, scale_b, bias=None):
    """``(a * scale_a) @ (b * scale_b) + bias`` in float64, any mode (block scales expanded to their elements)."""
    m, k = a.shape
    n = b.shape[1]
    sa, sb = scale_a.double(), scale_b.double()
    if sa.ndim == 2 and sa.shape[1] > 1 or (sa.ndim == 2 and sb.ndim == 2 and sb.shape == (math.ceil(k / 128),
                                                                                          math.ceil(n / 128))):
        sa = sa.repeat_interleave(128, dim=1)[:, :k]
        sb = sb.repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    out = (a.double() * sa) @ (b.double() * sb)
    return out if bias is None else out + bias.double()


def _reference(a, b, scale_a, scale_b, mode, bias, out_dtype):
    """``torch._scaled_mm`` where it takes the mode (on the CPU: tensor-wise and row-wise), else the dequantised
    product."""
    if mode in ("tensor", "row"):
        b_col = b if b.stride(0) == 1 else b.t().contiguous().t()  # _scaled_mm wants B column-major
        return torch._scaled_mm(a, b_col, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype).double()
    return dequantised(a, b, scale_a, scale_b, bias)


def _rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def run_case(case) -> dict:
    name, op, world, m, n, k, mode, (a_dt, b_dt), out_name, bias, tile, w_t, tma, groups, programs = case
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    out_dtype = getattr(torch, out_name)
    a = _fp8((m, k), a_dt, gen)
    b = _fp8((n, k), b_dt, gen).t() if w_t else _fp8((k, n), b_dt, gen)
    scale_a, scale_b = _scales(mode, m, n, k, gen)
    bias_t = torch.randn(n, generator=gen).to(out_dtype) if bias else None
    plan = default_plan(op, m, n, k, world, tile=TileConfig(*tile, 2, 1, 4), num_groups=groups, num_programs=programs,
                        allow_sequential=False)
    out = torch.full((m, n), float("nan"), dtype=out_dtype)
    counters = torch.zeros(plan.num_groups + 2, dtype=torch.int32)
    gemm(a, b, plan, out=out, counters=counters, scaling=Scaling(scale_a, scale_b, out_dtype, bias_t), use_tma=tma)
    ref = _reference(a, b, scale_a, scale_b, mode, bias_t, out_dtype)
    if plan.blocks > 1:  # the workspace holds the product's rows where the plan's row tables put them
        placed = torch.full_like(ref, float("nan"))
        for a_row, out_row, rows in zip(*plan.tile_rows()):
            placed[out_row : out_row + rows] = ref[a_row : a_row + rows]
        ref = placed
    return {"name": name, "rel_err": _rel_err(out, ref), "nan": bool(torch.isnan(out).any()),
            "counters": counters.tolist(), "expected_counters": [g.tile_count for g in plan.groups] + [0, 0]}


def run_all_gather(case) -> dict:
    """Shards of A, each with its scales, laid out as the plan's gathered buffer (the scales in the same layout)."""
    name, rows, n, k, world, rank, mode, tile, tma, groups = case
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    m = rows * world
    plan = default_plan("all_gather", m, n, k, world, tile=TileConfig(*tile, 2, 1, 4), num_groups=groups,
                        num_programs=3, allow_sequential=False)
    a_full = _fp8((m, k), E4, gen)
    b = _fp8((n, k), E4, gen).t()
    if mode == "tensor-shards":  # each rank's shard has its own scale: per row in effect
        scale_rows = (torch.rand(world, generator=gen) + 0.5).repeat_interleave(rows)[:, None]
        scale_b = torch.rand((), generator=gen) + 0.5
    else:
        scale_rows, scale_b = _scales(mode, m, n, k, gen)

    def gathered(t):
        return torch.cat([t[src * rows + g.row_start : src * rows + g.row_end] for g in plan.groups
                          for src in range(world)])

    flags = torch.ones(plan.num_groups, dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    scaling = Scaling(gathered(scale_rows).t().contiguous().t() if mode == "block" else gathered(scale_rows),
                      scale_b)
    gemm(gathered(a_full), b, plan, out=out, scaling=scaling, wait=GatherWait(flags, rank=rank), use_tma=tma)
    ref = dequantised(a_full, b, scale_rows, scale_b)
    return {"name": name, "rel_err": _rel_err(out, ref), "nan": bool(torch.isnan(out).any())}


@pytest.fixture(scope="module")
def interpreted():
    return interpreted_rows("tests.kernels.test_fp8_gemm", timeout=900)


def _limit(out_dtype: str) -> float:
    # Both sides sum exact fp8 products in fp32, so fp32 outputs differ by the summation order only. The interpreter
    # converts fp32 to bf16 by truncation (Triton 3.9; measured), not to nearest: about 3e-3 of relative error
    # against the dequantised product, 4e-3 against _scaled_mm's rounded bf16.
    return 1e-2 if out_dtype == "bfloat16" else 1e-5


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_fp8_gemm(interpreted, case):
    row = interpreted[case[0]]
    assert not row["nan"], "an output element was never written"
    assert row["rel_err"] < _limit(case[8]), row["rel_err"]
    assert row["counters"] == row["expected_counters"]  # each group's tile count; past the plan's groups untouched


@needs_interpreter
@pytest.mark.parametrize("case", ALL_GATHER_CASES, ids=[c[0] for c in ALL_GATHER_CASES])
def test_interpreted_fp8_all_gather(interpreted, case):
    row = interpreted[case[0]]
    assert not row["nan"], "an output element was never written"
    assert row["rel_err"] < _limit("bfloat16"), row["rel_err"]


# -- argument errors (no launch) ----------------------------------------------------------------------------------
def _operands(m=32, n=48, k=256):
    gen = torch.Generator().manual_seed(0)
    return _fp8((m, k), E4, gen), _fp8((n, k), E4, gen).t()


def _args(scaling, a=None, b=None, tile=(16, 16, 128)):
    a0, b0 = _operands()
    a, b = (a0 if a is None else a), (b0 if b is None else b)
    plan = default_plan("all_reduce", 32, 48, 256, 2, tile=TileConfig(*tile, 2, 1, 4), allow_sequential=False)
    return launch_arguments(a, b, plan, scaling=scaling)


@pytest.mark.parametrize("mode", MODES)
def test_modes_follow_the_scales_shapes(mode):
    scale_a, scale_b = _scales(mode, 32, 48, 256, torch.Generator().manual_seed(1))
    a_mode, b_mode = Scaling(scale_a, scale_b).modes(32, 48, 256)
    assert (a_mode, b_mode) == {"tensor": (1, 1), "row": (2, 2), "row-a": (2, 1), "col-b": (1, 2),
                                "block": (3, 3)}[mode]
    out, _, meta = _args(Scaling(scale_a, scale_b))
    assert out.dtype == torch.bfloat16 and (meta["A_SCALE"], meta["B_SCALE"]) == (a_mode, b_mode)


@pytest.mark.parametrize("scale_a, scale_b, message", [
    (torch.ones(32, 2), torch.ones(2, 2), "fit no mode"),  # A block-wise, B of too many column blocks
    (torch.ones(32, 1), torch.ones(2, 1), "fit no mode"),  # B per K block of one column: no mode
    (torch.ones(32, 2), torch.ones(1), "fit no mode"),  # block A with one B scale
    (torch.ones(1, 32), torch.ones(1), "fit no mode"),  # A's scales along the wrong dimension
    (torch.ones(1, dtype=torch.float64), torch.ones(1), "float32"),
    (torch.ones(1), torch.ones(1, dtype=torch.bfloat16), "float32"),
])
def test_bad_scales_raise(scale_a, scale_b, message):
    with pytest.raises(ValueError, match=message):
        _args(Scaling(scale_a, scale_b))


def test_bad_arguments_raise():
    a, b = _operands()
    one = torch.ones(1)
    with pytest.raises(ValueError, match="need scaling"):
        _args(None)
    with pytest.raises(ValueError, match="fp8 operands"):
        _args(Scaling(one, one), a=a.to(torch.bfloat16))
    with pytest.raises(ValueError, match="block_k = 128"):
        _args(Scaling(torch.ones(32, 2), torch.ones(2, 1)), tile=(16, 16, 64))
    with pytest.raises(ValueError, match="out_dtype"):
        _args(Scaling(one, one, torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="bias"):
        _args(Scaling(one, one, bias=torch.ones(47)))
    with pytest.raises(TypeError, match="unknown keywords"):
        plan = default_plan("all_reduce", 32, 48, 256, 2, allow_sequential=False)
        launch_arguments(a, b, plan, scaling=Scaling(one, one), flag=None)


# -- GPU -------------------------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="needs a CUDA GPU, and TRITON_INTERPRET unset")


def _gpu_scaled_mm(a, b, scale_a, scale_b, mode, bias, out_dtype):
    """``torch._scaled_mm`` in the mode, plus the bias (its CUDA kernels take a bf16 or fp16 bias only); the
    dequantised product where it takes no such operands: K not a multiple of 16 (refused), modes it does not have,
    and block-wise scales over a number of K blocks that is not a multiple of 4 (torch 2.11 reads B's block scales
    padded to one, and returned zeros in the last columns at K / 128 = 5, measured on an H200)."""
    k = a.shape[1]
    if mode in ("tensor", "row") and k % 16 == 0 or mode == "block" and k % 16 == 0 and math.ceil(k / 128) % 4 == 0:
        out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype).double()
        return out if bias is None else out + bias.double()
    return dequantised(a, b, scale_a, scale_b, bias)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op, m, n, k, tile", [
    ("all_reduce", 1000, 1024, 640, (128, 256, 128, 8, 3, 8)),
    ("all_reduce", 777, 2000, 1234, (128, 128, 128, 8, 3, 8)),  # K odd: pointer loads
    ("reduce_scatter", 2048, 1536, 1024, (128, 256, 128, 8, 3, 8)),
])
def test_gpu_fp8_gemm_matches_scaled_mm(mode, op, m, n, k, tile):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 3).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda", generator=gen) * 3).to(torch.float8_e4m3fn).t()
    scale_a, scale_b = (s.cuda() for s in _scales(mode, m, n, k, torch.Generator().manual_seed(k)))
    plan = default_plan(op, m, n, k, 2, tile=TileConfig(*tile), num_groups=3, allow_sequential=False)
    for out_dtype, bias in ((torch.bfloat16, None), (torch.float32, torch.randn(n, device="cuda"))):
        if bias is not None and mode == "block":
            bias = None  # torch's block-wise kernel takes no bias
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
        counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
        gemm(a, b, plan, out=out, counters=counters, scaling=Scaling(scale_a, scale_b, out_dtype, bias))
        want = _gpu_scaled_mm(a, b, scale_a, scale_b, mode, bias, out_dtype)
        if plan.blocks > 1:
            placed = torch.full_like(want, float("nan"))
            for a_row, out_row, rows in zip(*plan.tile_rows()):
                placed[out_row : out_row + rows] = want[a_row : a_row + rows]
            want = placed
        assert not torch.isnan(out).any(), "an output element was never written"
        # fp32: Hopper's fp8 tensor cores accumulate with fewer bits than fp32, and the two kernels sum in other
        # orders (DeepSeek-V3's report: about 14 bits retained).
        assert _rel_err(out, want) < (1e-2 if out_dtype == torch.bfloat16 else 2e-3)
        assert counters.tolist() == [g.tile_count for g in plan.groups]


@pytest.mark.gpu
@needs_gpu
def test_gpu_fp8_mixed_formats_and_all_gather():
    """e4m3 x e5m2 (as torch's scaled matmul allows it on the GPU), and an all-gather plan's waits, row-wise."""
    m, n, k, world = 1024, 768, 512, 2
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 3).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda", generator=gen) * 3).to(torch.float8_e5m2).t()
    scale_a, scale_b = (s.cuda() for s in _scales("row", m, n, k, torch.Generator().manual_seed(6)))
    plan = default_plan("all_reduce", m, n, k, world, tile=TileConfig(128, 128, 128, 8, 3, 8), num_groups=2,
                        allow_sequential=False)
    out = gemm(a, b, plan, counters=torch.zeros(2, dtype=torch.int32, device="cuda"),
               scaling=Scaling(scale_a, scale_b))
    assert _rel_err(out, torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,
                                          out_dtype=torch.bfloat16).double()) < 5e-3
    b = b.to(torch.float8_e4m3fn)
    plan = default_plan("all_gather", m, n, k, world, tile=TileConfig(128, 128, 128, 8, 3, 8), num_groups=2,
                        num_programs=100, allow_sequential=False)
    rows = m // world

    def gathered(t):
        return torch.cat([t[src * rows + g.row_start : src * rows + g.row_end] for g in plan.groups
                          for src in range(world)])

    flags = torch.ones(plan.num_groups, dtype=torch.int32, device="cuda")
    out = gemm(gathered(a), b, plan, scaling=Scaling(gathered(scale_a), scale_b), wait=GatherWait(flags, rank=1))
    want = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16).double()
    assert _rel_err(out, want) < 5e-3


if __name__ == "__main__":
    for case in CASES:
        print(json.dumps(run_case(case)), flush=True)
    for case in ALL_GATHER_CASES:
        print(json.dumps(run_all_gather(case)), flush=True)
    sys.exit(0)
