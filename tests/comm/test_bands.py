"""cuBLAS-band plans write exactly the layout the signalling GEMM writes (checked on the CPU against the plan's
row tables, the same oracle as the kernel's interpreter tests)."""

import pytest
import torch

from flashoverlap.comm.tp.nccl import compute_bands
from flashoverlap.plan import TileConfig
from flashoverlap.tune.defaults import default_plan


@pytest.mark.parametrize("op,m,world_size,groups", [("all_reduce", 77, 2, 3), ("reduce_scatter", 96, 2, 3),
                                                    ("reduce_scatter", 90, 3, 2), ("reduce_scatter", 200, 4, 5)])
def test_bands_land_where_the_plan_puts_them(op, m, world_size, groups):
    plan = default_plan(op, m, 40, 24, world_size, tile=TileConfig(16, 16, 16, 2, 1, 4), num_groups=groups,
                        gemm="cublas", allow_sequential=False)
    a, b = torch.randn(m, 24, dtype=torch.float64), torch.randn(24, 40, dtype=torch.float64)
    out = torch.full((m, 40), float("nan"), dtype=torch.float64)
    assert compute_bands(a, b, plan, out) == []  # no events on the CPU
    want = torch.full_like(out, float("nan"))
    product = a @ b
    for a_row, out_row, rows in zip(*plan.tile_rows()):
        want[out_row : out_row + rows] = product[a_row : a_row + rows]
    torch.testing.assert_close(out, want, equal_nan=True)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("op,mode", [("all_reduce", "tensor"), ("reduce_scatter", "row"), ("reduce_scatter", "block")])
def test_fp8_bands_land_where_the_plan_puts_them_each_scaled_by_its_rows(op, mode):
    from flashoverlap.comm.scaled import Scales
    from tests.ops.test_scaled import expected, quantise

    m, n, k = 96, 40, 256
    plan = default_plan(op, m, n, k, 2, tile=TileConfig(16, 16, 16, 2, 1, 4), num_groups=3, gemm="cublas",
                        allow_sequential=False)
    a, sa = quantise(torch.randn(m, k), mode)
    b, sb = quantise(torch.randn(k, n), mode, operand="b")
    b = b.t().contiguous().t()
    if mode == "row":
        sb = sb.reshape(1, n)
    out = torch.full((m, n), float("nan"), dtype=torch.float32)
    compute_bands(a, b, plan, out, Scales.of(sa, sb, torch.float32))
    product = expected(a, b, sa, sb, mode, torch.float32)
    want = torch.full_like(out, float("nan"))
    for a_row, out_row, rows in zip(*plan.tile_rows()):
        want[out_row : out_row + rows] = product[a_row : a_row + rows]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,k", [("tensor", 40), ("row", 48), ("block", 384)])
def test_packed_rows_keep_each_rows_bytes_and_scales(mode, k):
    """An fp8 all-gather's wire format: rows packed with their scales at 16-byte aligned offsets, read back as views
    (the GEMM reads both in place)."""
    from flashoverlap.comm import scaled
    from tests.ops.test_scaled import quantise

    a, sa = quantise(torch.randn(10, k), mode)
    scales = scaled.Scales.of(sa, torch.ones(()) if mode != "block" else torch.ones(k // 128, 1))
    rows = scales.rows_of_a(slice(0, 10), 10)
    packed = scaled.pack_rows(a, rows)
    assert packed.dtype == torch.uint8 and packed.shape == (10, scaled.row_bytes(k, a.dtype, scales))
    assert packed.shape[1] % 16 == 0 and packed.shape[1] - k < 16 + 4 * scales.scale_columns(k) + 16
    a_view, scale_view = scaled.unpack_rows(packed, k, a.dtype, scales.scale_columns(k))
    assert a_view.data_ptr() == packed.data_ptr() and scale_view.data_ptr() % 16 == 0
    assert torch.equal(a_view.view(torch.uint8), a.view(torch.uint8))
    assert torch.equal(scale_view, rows.float())


@pytest.mark.parametrize("k,columns,world,rank", [(40, 1, 3, 2), (384, 3, 2, 0), (48, 1, 4, 1)])
def test_packed_rows_views_are_unpack_rows_and_own_slots(k, columns, world, rank):
    """``PackedRows``, the eager fp8 all-gather's views of its gathered buffer (strided views of two dtype views,
    fewer host operators): the same elements as ``unpack_rows``' views, and its ``slots`` the same as
    ``own_slots``' slots unpacked; a write through them lands where ``unpack_rows`` reads."""
    from flashoverlap.comm import scaled
    from flashoverlap.comm.collectives import own_slots
    from flashoverlap.plan import TileConfig
    from flashoverlap.tune.defaults import default_plan

    bands, rows = 3, 16
    m = bands * world * rows
    plan = default_plan("all_gather", m, 32, k, world, tile=TileConfig(16, 16, 16, 2, 1, 4), num_groups=bands,
                        gemm="cublas", comm_ctas=0, allow_sequential=False)
    gathered = torch.randint(0, 120, (m, scaled.packed_width(k, columns)), dtype=torch.uint8)
    views = scaled.PackedRows(gathered, k, torch.float8_e4m3fn, columns)
    a, s = scaled.unpack_rows(gathered, k, torch.float8_e4m3fn, columns)
    assert views.a.shape == a.shape and views.a.stride() == a.stride() and views.a.data_ptr() == a.data_ptr()
    assert views.scales.stride() == s.stride() and views.scales.data_ptr() == s.data_ptr()
    assert torch.equal(views.a.view(torch.uint8), a.view(torch.uint8)) and torch.equal(views.scales, s)
    slot_a, slot_s = views.slots(bands, world, rows, rank)
    want_a, want_s = scaled.unpack_rows(own_slots(gathered, plan, rank), k, torch.float8_e4m3fn, columns)
    assert torch.equal(slot_a.view(torch.uint8), want_a.view(torch.uint8)) and torch.equal(slot_s, want_s)
    slot_a.view(torch.uint8).fill_(7)
    slot_s.fill_(2.5)
    rows_of = [g.out_row_start + rank * rows + i for g in plan.groups for i in range(rows)]
    assert (a.view(torch.uint8)[rows_of] == 7).all() and (s[rows_of] == 2.5).all()
    others = [r for r in range(m) if r not in rows_of]
    assert not (s[others] == 2.5).any()
    with pytest.raises(ValueError, match="dense"):
        scaled.PackedRows(gathered[:, 1:], k - 1, torch.float8_e4m3fn, columns)
    with pytest.raises(ValueError, match="dense uint8"):
        scaled.PackedRows(gathered.view(torch.float8_e4m3fn), k, torch.float8_e4m3fn, columns)
    with pytest.raises(ValueError, match="room for"):
        scaled.PackedRows(gathered, k + 32, torch.float8_e4m3fn, columns)
    # A buffer that starts partway into its storage (rows of a larger one): the same views
    big = torch.randint(0, 120, (m + 5, gathered.shape[1]), dtype=torch.uint8)
    part = big[5:]
    views = scaled.PackedRows(part, k, torch.float8_e4m3fn, columns)
    a, s = scaled.unpack_rows(part, k, torch.float8_e4m3fn, columns)
    assert views.a.data_ptr() == a.data_ptr() and views.scales.data_ptr() == s.data_ptr()
    assert torch.equal(views.a.view(torch.uint8), a.view(torch.uint8)) and torch.equal(views.scales, s)
    slot_a, slot_s = views.slots(bands, world, rows, rank)
    want_a, want_s = scaled.unpack_rows(own_slots(part, plan, rank), k, torch.float8_e4m3fn, columns)
    assert torch.equal(slot_a.view(torch.uint8), want_a.view(torch.uint8)) and torch.equal(slot_s, want_s)


def test_block_wise_scales_at_k_128_are_told_from_row_wise_ones_by_b():
    """At K = 128 block-wise A scales ``[M, 1]`` have row-wise's shape; B's ``[1, ceil(N/128)]`` against row-wise
    ``[1, N]`` tell them apart where N is known (the ops pass it)."""
    from flashoverlap.comm.scaled import mode_of

    sa = torch.ones(64, 1)
    assert mode_of(sa, torch.ones(1, 300), n=300) == "row"
    assert mode_of(sa, torch.ones(1, 3), n=300) == "block"
    assert mode_of(sa, torch.ones(1, 128), n=128) == "row"
    assert mode_of(sa, torch.ones(1, 1), n=128) == "block"
    assert mode_of(sa, torch.ones(1, 3)) == "row"  # N unknown: the row-wise reading, which the check then refuses
    assert mode_of(torch.ones(64, 2), torch.ones(2, 3), n=300) == "block"


def _block_at_k_128(rank, world):
    import flashoverlap as fo
    from tests.ops.test_scaled import quantise

    m, n, k = 64, 300, 128
    gen = torch.Generator().manual_seed(0)  # the same operands on every rank: the sum is world x one product
    a, sa = quantise(torch.randn(m, k, generator=gen), "block")
    b, sb = quantise(torch.randn(k, n, generator=gen), "block", operand="b")
    got = fo.scaled_gemm_all_reduce(a, b, sa, sb, out_dtype=torch.float32)
    want = world * ((a.double() * sa.double()) @ (b.double() * sb.double().repeat_interleave(128, 1)[:, :n]))
    return ((got.double() - want).norm() / want.norm()).item()


def test_a_block_wise_call_at_k_128_runs_block_wise():
    from flashoverlap.testing import spawn

    assert all(err < 1e-5 for err in spawn(_block_at_k_128, 2, "gloo"))


class _Lies:
    """What ``cublas_takes`` reads of a CUDA tensor (the CPU has none): its shape, strides and first byte's
    address."""

    is_cuda = True

    def __init__(self, shape, strides, address):
        self.shape, self._strides, self._address = shape, strides, address

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def data_ptr(self):
        return self._address


@pytest.mark.parametrize("a_lies,b_lies,takes", [
    (((64, 256), (256, 1), 4096), ((256, 32), (1, 256), 8192), True),  # row-major A, w.t() B, both aligned
    (((64, 256), (256, 1), 4104), ((256, 32), (1, 256), 8192), False),  # A starts 8 bytes past a boundary
    (((64, 256), (256, 1), 4096), ((256, 32), (1, 256), 8200), False),  # B does
    (((64, 256), (264, 1), 4096), ((256, 32), (1, 256), 8192), False),  # A's rows 264 bytes apart
    (((64, 256), (256, 1), 4096), ((256, 32), (1, 264), 8192), False),  # B's columns 264 bytes apart
    (((1, 256), (8, 1), 4096), ((256, 32), (1, 256), 8192), True),  # one row: its stride is never stepped
])
def test_cublas_takes_fp8_operands_only_on_16_byte_boundaries(a_lies, b_lies, takes):
    # An own shard that starts mid-buffer goes to cuBLAS as it lies in a captured all-gather (comm/tp/nccl.py):
    # cuBLASLt's fp8 kernels read 16-byte aligned rows, so such a shard must take the dequantised product instead.
    from flashoverlap.comm.scaled import cublas_takes

    assert cublas_takes(_Lies(*a_lies), _Lies(*b_lies), "row") is takes
