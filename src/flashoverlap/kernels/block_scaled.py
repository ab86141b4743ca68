"""The block-wise fp8 grouped GEMM on Hopper, in Gluon: ``out[rows of segment s] = sum over 128-deep K steps of
(x[rows, step] @ w[e][step]) * x_scale[rows, step] * w_scale[e, step, column block]`` (``e`` the segment's
expert), each step's MMA kept in flight while the step before it is scaled (issue 44).

Why Gluon: a block-wise step's product must be scaled before it is added, and Triton keeps an MMA in flight across
loop iterations only where its result feeds nothing but the next MMA's accumulator; any other use waits for every
step's MMA (``benchmarks/diagnostics/kernel_facts.py``), so the tensor cores idle while the CUDA cores scale (the
Triton kernel, ``grouped_gemm.scaled_grouped_gemm_kernel``, ran block-wise at about half its row-wise speed on the
same tile). Gluon lets the kernel say it: two product registers alternate, step k's MMA goes into one while the wait
for "at most one MMA outstanding" hands back step k-1's from the other, which is scaled and added as step k runs.
Three tiles of fp32 live at once (the sum and the two products), so a program's tile is 128x128 with two warpgroups
(or 64x128 with one).

Operands through TMA into a ring of ``STAGES`` shared-memory slots, one barrier each; the slot step k-1 read is
refilled (with step k - 1 + STAGES) as soon as step k-1's MMA is known done. One program per tile of the segment table
(``grouped_gemm._segment_table_kernel``, and the same tile walk as the Triton kernels', ``kernels/tile_walk.py``);
programs past the table's tiles return at once, and tiles past the grid (only where segments overlap, beyond the
launch's bound) are taken by stride, as the Triton kernel's persistent programs take them. Rows past the segment
(another segment's, or TMA's zeros past x) and columns past N (the next expert's rows of the flattened weight) are
computed and never stored.

Where it applies (``applies``): a Hopper GPU (sm_90), Triton 3.6 or later with Gluon, K a multiple of 256 (the steps
run in pairs), x's rows and the weights' ``[E, N, K]`` storage (the ``w.transpose(1, 2)`` view that layers hold)
addressable by TMA. Elsewhere ``scaled_grouped_gemm`` runs the Triton kernel, as before.
"""

from __future__ import annotations

import functools

import torch

from flashoverlap import guards
from flashoverlap.kernels.tile_walk import _tile_info, _tile_offsets

STEP = 128  # K per block-wise scale, and per MMA step
SHARED_BYTES = 227 * 1024  # shared memory a Hopper program may take
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_GLUON_MISSING: Exception | None = None
try:
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 6):
        # Gluon's API moved between releases; the kernel is compiled and checked against 3.6 and 3.9.
        raise ImportError(f"the Gluon kernel needs triton >= 3.6, found {triton.__version__}")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _jit = gluon.jit
    # Triton 3.6 (the GPU machines') names the TMA load async_copy_global_to_shared; later ones async_load.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except (ImportError, AttributeError, ValueError) as exc:  # no triton, an older one, no Gluon Hopper ops
    _GLUON_MISSING = exc

    def _jit(fn):
        return fn


@_jit
def _issue_loads(x_desc, w_desc, a_bufs, b_bufs, ready, base, step, steps, off_m, w_row, STAGES: gl.constexpr,
                 BLOCK_K: gl.constexpr):
    """Step ``step``'s x and weight tiles into ring slot ``(base + step) % STAGES``, counted on the slot's barrier
    (none past ``steps``). ``base``: the steps of the program's earlier tiles (each tile has ``steps``), so that
    the ring's slots and phases run on across tiles."""
    slot = (base + step) % STAGES
    live = step < steps
    mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes, live)
    _tma_load(x_desc, [off_m, step * BLOCK_K], ready.index(slot), a_bufs.index(slot), live)
    _tma_load(w_desc, [w_row, step * BLOCK_K], ready.index(slot), b_bufs.index(slot), live)


@_jit
def _product(a_bufs, b_bufs, ready, into, ring, STAGES: gl.constexpr):
    """The MMA of the step at ring position ``ring`` (``base + step``), issued into ``into``'s registers (its value,
    already used, is not read) and left in flight."""
    slot = ring % STAGES
    mbarrier.wait(ready.index(slot), (ring // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), into, use_acc=False,
                         is_async=True)


@_jit
def _step_scale(sx_ptrs, sw_ptr, step, stride_sxk, stride_swk):
    """Step ``step``'s scale of each row (fp32): its x scale times the weight's one scale for the tile's 128
    columns."""
    return (gl.load(sx_ptrs + step * stride_sxk) * gl.load(sw_ptr + step * stride_swk)).to(gl.float32)


@_jit
def _scaled_sum(acc, product, scale):
    """``acc + product * scale`` (per row), pinned before the next MMA's issue: the sum passes through a wait that
    waits for nothing new (at most the one MMA in flight stays outstanding). Left free, the compiler moved these
    multiply-adds past the next MMA's issue, so the product's registers stayed live across it and were copied at
    the loop's end while that MMA was writing them: ptxas then serialised every MMA (its warning C7514)."""
    return warpgroup_mma_wait(num_outstanding=1, deps=(acc + product * scale[:, None],))


@_jit
def block_scaled_kernel(
    x_desc,  # TMA descriptor of x [rows, K] fp8, block [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of the weights' [E * N, K] storage (K-major), block [BLOCK_N, BLOCK_K]
    x_scale,  # fp32 [rows, K / 128]
    w_scale,  # fp32 [E, K / 128, ceil(N / 128)]
    out,  # [rows, N]
    table_ptr,  # int32: the prep kernel's table
    total_rows, N, K, num_segments, tiles_n,
    stride_sxm, stride_sxk, stride_swe, stride_swk, stride_swn, stride_om, stride_on,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_S: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr, TABLE: gl.constexpr,
):
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    total = gl.load(table_ptr + num_segments - 1)
    steps = K // BLOCK_K
    base = 0
    # One tile per program where the launch's bound holds (it does unless segments overlap); tiles past the grid are
    # taken by stride, the ring's slots and phases running on from ``base``.
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        cum = gl.load(table_ptr + gl.arange(0, BLOCK_S, layout=TABLE))
        p, tile0, row0, row1, expert = _tile_info(table_ptr, cum, t, num_segments, BLOCK_S)
        off_m, off_n = _tile_offsets(t, tile0, row0, row1, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        w_row = expert * N + off_n

        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
        sx_ptrs = x_scale + gl.minimum(rows, total_rows - 1).to(gl.int64) * stride_sxm
        sw_ptr = w_scale + expert.to(gl.int64) * stride_swe + (off_n // 128) * stride_swn
        for i in gl.static_range(STAGES - 1):
            _issue_loads(x_desc, w_desc, a_bufs, b_bufs, ready, base, i, steps, off_m, w_row, STAGES, BLOCK_K)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
        even = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
        odd = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA))  # the loop carries it in flight
        s_odd = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, MMA))
        # Steps in pairs, so that each product keeps its registers: ``even`` takes steps 0, 2, ..., ``odd`` the
        # others. The second half issues step k+1's MMA, waits until at most that one is outstanding (step k's is
        # done), refills the slot step k read and adds step k's product, scaled, while step k+1 runs. The first
        # half waits for step k-1's MMA (issued in the iteration before) before it issues step k's: ptxas follows
        # a wait for all but the latest MMA only within one iteration, and serialised every MMA where a product
        # from the iteration before was read after one (its warning C7514). Each refill comes after this program's
        # wait for the MMA that read the slot; with two warpgroups, the other's MMA on that slot is covered by the
        # CTA barrier the compiler puts before every barrier expect and TMA issue (in the PTX: ``bar.sync 0``).
        for k in range(0, steps, 2):
            odd = warpgroup_mma_wait(num_outstanding=0, deps=(odd,))
            even = _product(a_bufs, b_bufs, ready, even, base + k, STAGES)
            _issue_loads(x_desc, w_desc, a_bufs, b_bufs, ready, base, k - 1 + STAGES, steps, off_m, w_row, STAGES,
                         BLOCK_K)
            s_even = _step_scale(sx_ptrs, sw_ptr, k, stride_sxk, stride_swk)
            acc = _scaled_sum(acc, odd, s_odd)
            odd = _product(a_bufs, b_bufs, ready, odd, base + k + 1, STAGES)
            s_odd = _step_scale(sx_ptrs, sw_ptr, k + 1, stride_sxk, stride_swk)
            even = warpgroup_mma_wait(num_outstanding=1, deps=(even,))
            _issue_loads(x_desc, w_desc, a_bufs, b_bufs, ready, base, k + STAGES, steps, off_m, w_row, STAGES,
                         BLOCK_K)
            acc = _scaled_sum(acc, even, s_even)
        odd = warpgroup_mma_wait(num_outstanding=0, deps=(odd,))
        acc += odd * s_odd[:, None]
        base += steps

        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
        c_ptrs = out + rows[:, None].to(gl.int64) * stride_om + cols[None, :] * stride_on
        gl.store(c_ptrs, acc.to(out.dtype.element_ty), mask=(rows[:, None] < row1) & (cols[None, :] < N))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


def fits(tile) -> bool:
    """Whether the kernel runs ``tile`` (a ``grouped_gemm.GroupedTile``): 128x128 with two warpgroups or 64x128
    with one, 128-deep steps, at least 3 ring slots (2 would leave no load ahead of the MMA) and no more than
    Hopper's shared memory holds, one program per tile."""
    ring = (tile.block_m + tile.block_n) * STEP * tile.num_stages  # bytes of shared memory (one-byte operands)
    return ((tile.block_m, tile.num_warps) in ((128, 8), (64, 4)) and tile.block_n == 128 and tile.block_k == STEP
            and 3 <= tile.num_stages and ring + 1024 <= SHARED_BYTES and tile.num_programs is None)


def gluon_missing() -> Exception | None:
    """Why the Gluon kernel cannot be built here (None: it can)."""
    return _GLUON_MISSING


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the Gluon kernel runs ``x [rows, K] @ w [E, K, N]`` block-wise (module docstring): Hopper, Gluon,
    fp8 operands of one format, K a positive multiple of 256, x's rows (a row stride of at least K) and w's
    ``[E, N, K]`` storage (K-major) at 16-byte aligned addresses and strides."""
    if _GLUON_MISSING is not None or x.device.type != "cuda" or guards.triton_interpreted():
        return False
    if not _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return False
    k = x.shape[1]
    num_experts, _, n = w.shape
    return (x.dtype in FP8 and w.dtype == x.dtype and k > 0 and k % (2 * STEP) == 0 and x.stride(1) == 1
            and x.stride(0) >= k and x.stride(0) % 16 == 0 and x.data_ptr() % 16 == 0
            and w.stride(1) == 1 and w.stride(2) == k and w.stride(0) == n * k and w.data_ptr() % 16 == 0)


@functools.cache
def _hopper(index: int) -> bool:
    """Whether CUDA device ``index`` is sm_90 (asked once per device: ``applies`` runs on every block-wise call)."""
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.lru_cache(maxsize=16)
def _layouts(block_m: int, block_n: int, warps: int, e5m2: bool) -> tuple:
    """The shared layouts of x's and the weights' tiles, the MMA's register layout and the table's, for a tile shape:
    made once (building them took 22 µs a launch on a CPU machine, an exact-mode MoE layer's calls several launches
    each)."""
    fp8 = gl.float8e5 if e5m2 else gl.float8e4nv
    return (gl.NVMMASharedLayout.get_default_for([block_m, STEP], fp8),
            gl.NVMMASharedLayout.get_default_for([block_n, STEP], fp8),
            gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, 32]),
            gl.BlockedLayout([1], [32], [warps], [0]))


def launch(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
           table: torch.Tensor, num_segments: int, block_s: int, tiles: int, tile, launcher) -> None:
    """Launch the kernel on the prep kernel's ``table`` (built for ``tile``'s block_m and block_n), one program per
    tile of the host-side bound ``tiles``, through ``launcher`` (a ``kernels/launch.Launcher`` of
    ``block_scaled_kernel``). ``applies(x, w)`` holds; ``tile``: block_k 128, block_n 128, block_m 64 (4 warps) or
    128 (8 warps)."""
    rows, k = x.shape
    num_experts, _, n = w.shape
    block_m, block_n = tile.block_m, tile.block_n
    x_layout, w_layout, mma, table_layout = _layouts(block_m, block_n, tile.num_warps, x.dtype == torch.float8_e5m2)
    x_desc = TensorDescriptor(x, [rows, k], [x.stride(0), 1], [block_m, STEP], x_layout)
    w_flat = w.transpose(1, 2)  # [E, N, K], contiguous (``applies``)
    w_desc = TensorDescriptor(w_flat, [num_experts * n, k], [k, 1], [block_n, STEP], w_layout)
    sx, sw = x_scale.stride(), w_scale.stride()
    launcher(tiles, (
        x_desc, w_desc, x_scale, w_scale, out, table, rows, n, k, num_segments, -(-n // block_n),
        sx[0], sx[1], sw[0], sw[1], sw[2], out.stride(0), out.stride(1),
    ), dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=STEP, BLOCK_S=block_s, GROUP_M=tile.group_m,
        STAGES=tile.num_stages, MMA=mma, TABLE=table_layout, num_warps=tile.num_warps,
    ))
