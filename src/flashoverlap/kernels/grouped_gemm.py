"""The grouped GEMM of the expert-parallel paths: ``out[rows of segment s] = x[rows of s] @ w[seg_expert[s]]``
over contiguous row segments, in a device-chosen tile order, publishing a flag per signal group.

Segment sizes never reach the host (the bounded MoE mode is replayed from a CUDA graph): a one-program prep kernel
reads the segment ends on the device, orders the segments (``order``/``seg_priority``), and writes a small table
(per position in that order: cumulative tile end, rows, expert, signal group) and each group's starting flag value.
The GEMM kernel then walks tiles ``pid, pid + programs, ...`` up to the table's total; a tile finds its segment by
counting the cumulative ends at or below its index (one vector load of the table, no search loop), so tiles never
straddle two segments. The grid is sized on the host from a bound (``max_rows``); a bound that is too small costs
time (programs take more tiles), never correctness.

Signals, as in ``kernels/gemm.py`` (``debug_barrier``, then a release atomic add per stored tile), with two changes
that made them cheaper where tiles are short (K = 768: 7% of the time with a returning atomic per tile and a flag
set by the last tile, 3% now; logs/moe-gemm/sweep2-b77905f, sweep3-e410e6d): the flag *is* the counter, started
by the prep kernel at ``1 - tiles of the group``, so it reaches exactly 1 when the group's last tile is published
and no tile needs the atomic's result; and a tile is published only after its program's next tile has computed its
products (just before that tile's store), when its own stores have long completed and the release fence is free. A
waiter must therefore wait for ``flags[g] == 1`` (``cuStreamWaitValue32`` EQ 1, or GEQ 1), never for non-zero.

``torch._grouped_mm`` (cuBLAS/CUTLASS) is the alternative where it measures faster: the choice between them is
policy, ``tune/grouped.py``'s. ``grouped_mm_reference`` is the plain-PyTorch oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashoverlap import guards
from flashoverlap.kernels import block_scaled
from flashoverlap.kernels.launch import Launcher
from flashoverlap.kernels.tile_walk import _tile_info, _tile_offsets

_TRITON_MISSING: ModuleNotFoundError | None = None
try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    _jit = triton.jit
except ModuleNotFoundError as exc:  # a CPU install without the gpu extra: the tiles and the oracle still import
    _TRITON_MISSING = exc

    def _jit(fn):
        return fn

# The sort key packs (priority, -m tiles, expert, segment) into one int64 (the prep kernel sorts keys, not pairs).
# Bits, low to high: segment 13, expert 16, m tiles 22, priority 12 (the kernel spells these numbers out).
MAX_SEGMENTS = 1 << 13
MAX_EXPERTS = 1 << 16
MAX_PRIORITY = (1 << 12) - 1
# Table rows (each BLOCK_S long: cumulative tile end, first tile, first row, end row, expert, signal group of each
# position in tile order), then two scalars: the dynamic next-tile counter and the tiles of heavy segments (MIX).
_TABLE_ROWS = 6
_TABLE_SCALARS = 2


@_jit
def _segment_table_kernel(
    seg_ends_ptr,  # int32 [S]: row ends
    seg_starts_ptr,  # int32 [S] (HAS_STARTS): row starts; otherwise each segment starts at the previous end
    seg_expert_ptr,  # int32 [S]
    seg_signal_ptr,  # int32 [S] (SIGNAL)
    seg_priority_ptr,  # int32 [S] (HAS_PRIORITY)
    table_ptr,  # int32 [6 * BLOCK_S + 2]: written here
    flags_ptr,  # int32 [num_groups] (SIGNAL): set to 1 - (the group's tile count)
    num_segments,
    num_groups,
    num_experts,
    total_rows,
    tiles_n,
    BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SORT: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    HAS_PRIORITY: tl.constexpr,
    SIGNAL: tl.constexpr,
    HAS_GROUPS: tl.constexpr,  # seg_signal given; otherwise every segment is in group 0
    HAS_STARTS: tl.constexpr = False,
):
    pos = tl.arange(0, BLOCK_S)
    valid = pos < num_segments
    if SORT:
        # Rows are clamped to [0, total_rows] and an end below its start is an empty segment: a bad table costs
        # wrong rows, never an access out of bounds.
        start, end = _segment_rows(seg_ends_ptr, seg_starts_ptr, pos, valid, total_rows, HAS_STARTS)
        key = pos.to(tl.int64)
        if HEAVY_FIRST:
            m_tiles = tl.minimum(tl.cdiv(end - start, BLOCK_M), (1 << 22) - 1)
            expert = tl.load(seg_expert_ptr + pos, mask=valid, other=0)
            expert = tl.minimum(tl.maximum(expert, 0), num_experts - 1)
            # More tiles first; equal tile counts by expert, so that one expert's segments (one per source rank)
            # run side by side and share its weights through L2.
            key |= expert.to(tl.int64) << 13
            key |= ((1 << 22) - 1 - m_tiles).to(tl.int64) << 29
        if HAS_PRIORITY:
            prio = tl.load(seg_priority_ptr + pos, mask=valid, other=0)
            prio = tl.minimum(tl.maximum(prio, 0), (1 << 12) - 1)
            key |= prio.to(tl.int64) << 51
        key = tl.where(valid, key, 0x7FFFFFFFFFFFFFFF)
        key = tl.sort(key)
        seg = (key & ((1 << 13) - 1)).to(tl.int32)
    else:
        seg = pos
    start, end = _segment_rows(seg_ends_ptr, seg_starts_ptr, seg, valid, total_rows, HAS_STARTS)
    m_tiles = tl.cdiv(end - start, BLOCK_M)
    tiles = tl.where(valid, m_tiles * tiles_n, 0)
    cum = tl.cumsum(tiles, 0)
    expert = tl.load(seg_expert_ptr + seg, mask=valid, other=0)
    expert = tl.minimum(tl.maximum(expert, 0), num_experts - 1)
    tl.store(table_ptr + 0 * BLOCK_S + pos, tl.where(valid, cum, 0x7FFFFFFF))
    tl.store(table_ptr + 1 * BLOCK_S + pos, cum - tiles)
    tl.store(table_ptr + 2 * BLOCK_S + pos, start)
    tl.store(table_ptr + 3 * BLOCK_S + pos, end)
    tl.store(table_ptr + 4 * BLOCK_S + pos, expert)
    tl.store(table_ptr + 6 * BLOCK_S, 0)  # the GEMM's next-tile counter (DYNAMIC)
    # The tiles of segments with more than one tile row: in heavy-first order without priorities they come first,
    # and the GEMM (MIX) spreads the rest evenly among them.
    tl.store(table_ptr + 6 * BLOCK_S + 1, tl.sum(tl.where(m_tiles > 1, tiles, 0), axis=0))
    if SIGNAL:
        if HAS_GROUPS:
            group = tl.load(seg_signal_ptr + seg, mask=valid, other=-1)
        else:
            group = tl.where(valid, 0, -1)
        group = tl.where((group >= 0) & (group < num_groups), group, -1)  # out of range: never signalled
        tl.store(table_ptr + 5 * BLOCK_S + pos, group)
        for g in range(num_groups):
            # The flag counts up from 1 - (the group's tiles): each stored tile adds 1, the last one makes it 1. A
            # group with no tiles is 1 at once, so its waiter does not hang.
            expected = tl.sum(tl.where(group == g, tiles, 0), axis=0)
            tl.store(flags_ptr + g, 1 - expected)


@_jit
def _segment_rows(seg_ends_ptr, seg_starts_ptr, seg, valid, total_rows, HAS_STARTS: tl.constexpr):
    """Rows ``[start, end)`` of segments ``seg``, clamped into ``[0, total_rows]`` with ``end >= start``."""
    end = tl.load(seg_ends_ptr + seg, mask=valid, other=0)
    if HAS_STARTS:
        start = tl.load(seg_starts_ptr + seg, mask=valid, other=0)
    else:
        start = tl.load(seg_ends_ptr + seg - 1, mask=valid & (seg > 0), other=0)
    start = tl.minimum(tl.maximum(start, 0), total_rows)
    end = tl.maximum(tl.minimum(tl.maximum(end, 0), total_rows), start)
    return start, end


@_jit
def _launch_to_tile(t, total, heavy, MIX: tl.constexpr):
    """The tile (in the table's order) that launch slot ``t`` computes. With MIX the table's light tiles (those
    past ``heavy``: segments of one tile row) are spread evenly among its heavy ones (Bresenham: slot ``t`` is light
    when ``floor((t + 1) * light / total)`` steps up), so that memory-bound tiles run beside compute-bound ones
    instead of after them all."""
    if MIX:
        t64 = t + tl.zeros((), tl.int64)  # int64 products; t is a Python int in the interpreter's flattened loop
        light = total - heavy
        before = (t64 * light) // tl.maximum(total, 1)
        upto = ((t64 + 1) * light) // tl.maximum(total, 1)
        u = tl.where(upto > before, heavy + before, t64 - upto).to(tl.int32)
    else:
        u = t
    return u


@_jit
def _publish(flags_ptr, group, PEER: tl.constexpr):
    """Count one stored tile of ``group`` (none if negative): every thread's stores come before the release."""
    if group >= 0:
        tl.debug_barrier()
        if PEER:
            tl.atomic_add(flags_ptr + group, 1, sem="release", scope="sys")
        else:
            tl.atomic_add(flags_ptr + group, 1, sem="release", scope="gpu")


@_jit
def _times_weights(a_tile, w, acc, kk, off_n, expert, N, K, BLOCK_K: tl.constexpr, W_KMAJOR: tl.constexpr,
                   SWAP: tl.constexpr):
    """``acc`` plus ``a_tile`` times K step ``kk`` of the weight strip (``w`` a TMA descriptor)."""
    if W_KMAJOR:
        b_tile = w.load([expert * N + off_n, kk * BLOCK_K]).T
    else:
        b_tile = w.load([expert * K + kk * BLOCK_K, off_n])
    if SWAP:
        acc = tl.dot(b_tile.T, a_tile.T, acc)
    else:
        acc = tl.dot(a_tile, b_tile, acc)
    return acc


@_jit
def _tma_products(x, w, acc, row0, off_n, expert, N, K, BLOCK_K: tl.constexpr, W_KMAJOR: tl.constexpr,
                  SWAP: tl.constexpr):
    """``acc`` plus the products of ``x``'s rows from ``row0`` (a TMA descriptor: its block's rows) and the weight
    strip, every K step. Rows past the segment are another segment's (or zero-filled past x): computed, never
    stored. Columns past N read the next expert's rows of the flattened weight: also never stored."""
    for kk in tl.range(tl.cdiv(K, BLOCK_K)):
        acc = _times_weights(x.load([row0, kk * BLOCK_K]), w, acc, kk, off_n, expert, N, K, BLOCK_K, W_KMAJOR, SWAP)
    return acc


@_jit
def _gathered_products(x_rows, gathered, w, acc, off_n, expert, N, K, stride_xm, stride_xk, BLOCK_K: tl.constexpr,
                       W_KMAJOR: tl.constexpr, SWAP: tl.constexpr):
    """``_tma_products`` with ``x``'s rows gathered (``gathered``: their rows of ``x_rows``, plain loads), the
    weights still through TMA."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_rows + gathered[:, None] * stride_xm + offs_k[None, :] * stride_xk
    for kk in tl.range(tl.cdiv(K, BLOCK_K)):
        a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < K - kk * BLOCK_K, other=0.0)
        a_ptrs += BLOCK_K * stride_xk
        acc = _times_weights(a_tile, w, acc, kk, off_n, expert, N, K, BLOCK_K, W_KMAJOR, SWAP)
    return acc


@_jit
def _tile_mma_store(x, w, out, flags_ptr, pending, off_m, off_n, row1, expert, total_rows, N, K, stride_xm,
                    stride_xk, stride_we, stride_wk, stride_wn, stride_om, stride_on, row_map, x_rows,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
                    W_KMAJOR: tl.constexpr, SIGNAL: tl.constexpr, PEER: tl.constexpr, SWAP: tl.constexpr = False,
                    ROW_MAP: tl.constexpr = False):
    """``out[off_m : min(off_m + ROWS, row1), off_n : off_n + BLOCK_N] = x[...] @ w[expert][:, ...]``; between
    the products and the store, the previous tile of this program is published to its group ``pending``.

    ROW_MAP: the rows are logical, ``row_map[r]`` the row of ``x`` and ``out`` that logical row ``r`` is. With TMA, a
    tile whose rows map onto consecutive rows of ``x`` (most tiles of an expert's long segments) is loaded through
    ``x``'s descriptor from its first; any other tile gathers its rows from ``x_rows`` (the same tensor, a pointer)
    with plain loads. Without TMA ``x`` is a pointer and every tile gathers.

    SWAP computes the transposed product, ``w[...]^T @ x[...]^T`` (``[BLOCK_N, ROWS]``), so that a tile of few rows
    (ROWS down to 16) is the narrow side of the tensor-core instruction, whose other side is at least 64 high: a
    16-row tail costs 16 rows of products instead of 64."""
    if SWAP:
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if ROW_MAP:  # logical rows past the last are clamped onto it: computed, never stored
        logical = tl.minimum(off_m + tl.arange(0, ROWS), total_rows - 1)
        gathered = tl.load(row_map + logical).to(tl.int64)
    if USE_TMA:
        if ROW_MAP:
            first = tl.min(gathered, axis=0)
            dense = tl.sum(((gathered - first) == tl.arange(0, ROWS)).to(tl.int32), axis=0) == ROWS
            if dense:
                acc = _tma_products(x, w, acc, first.to(tl.int32), off_n, expert, N, K, BLOCK_K, W_KMAJOR, SWAP)
            else:
                acc = _gathered_products(x_rows, gathered, w, acc, off_n, expert, N, K, stride_xm, stride_xk,
                                         BLOCK_K, W_KMAJOR, SWAP)
        else:
            acc = _tma_products(x, w, acc, off_m, off_n, expert, N, K, BLOCK_K, W_KMAJOR, SWAP)
    else:
        offs_m = off_m + tl.arange(0, ROWS)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if ROW_MAP:
            offs_m = gathered
        else:
            offs_m = tl.where(offs_m < total_rows, offs_m, 0)  # clamped; masked at the store
        offs_n = tl.where(offs_n < N, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        b_ptrs = w + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        for kk in range(k_tiles):
            k_left = K - kk * BLOCK_K
            a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b_tile = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if SWAP:
                acc = tl.dot(tl.trans(b_tile), tl.trans(a_tile), acc)
            else:
                acc = tl.dot(a_tile, b_tile, acc)
            a_ptrs += BLOCK_K * stride_xk
            b_ptrs += BLOCK_K * stride_wk
    if SIGNAL:
        _publish(flags_ptr, pending, PEER)
    rows = off_m + tl.arange(0, ROWS)
    cols = off_n + tl.arange(0, BLOCK_N)
    if ROW_MAP:
        c_ptrs = out + gathered[:, None] * stride_om + cols[None, :] * stride_on
    else:
        c_ptrs = out + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    if SWAP:
        result = tl.trans(acc).to(out.dtype.element_ty)
    else:
        result = acc.to(out.dtype.element_ty)
    tl.store(c_ptrs, result, mask=(rows[:, None] < row1) & (cols[None, :] < N))


@_jit
def grouped_gemm_kernel(
    x,  # [rows, K]: a pointer, or a TMA descriptor with block [BLOCK_M, BLOCK_K]
    x_half,  # (HALF_TAIL) the same rows: a pointer, or a TMA descriptor with block [BLOCK_M // 2, BLOCK_K]
    x_swap,  # (SWAP_ROWS) the same rows: a pointer, or a TMA descriptor with block [SWAP_ROWS, BLOCK_K]
    w,  # pointer to [E, K, N] (any strides), or a TMA descriptor of [E*K, N] / (W_KMAJOR) [E*N, K]
    out,  # [rows, N] pointer
    table_ptr,  # int32: the prep kernel's table
    flags_ptr,  # int32 [num_groups] (SIGNAL)
    total_rows,
    N,
    K,
    num_segments,
    num_groups,
    tiles_n,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_om,
    stride_on,
    row_map,  # int32 [total_rows] (ROW_MAP): the row of x and out each logical row is
    x_rows,  # (ROW_MAP) x as a pointer, for the tiles whose rows are gathered
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr,
    W_KMAJOR: tl.constexpr,
    SIGNAL: tl.constexpr,
    PEER: tl.constexpr,
    DYNAMIC: tl.constexpr = False,  # tiles past the first wave taken from an atomic counter, not by stride
    HALF_TAIL: tl.constexpr = False,  # a segment's last tile of <= BLOCK_M // 2 rows runs at half height
    SWAP_ROWS: tl.constexpr = 0,  # a segment's last tile of <= SWAP_ROWS rows runs transposed (0: never)
    MIX: tl.constexpr = False,  # light tiles spread among heavy ones (_launch_to_tile)
    FLAT: tl.constexpr = False,  # one flattened, pipelined loop over tiles and K (full-height tiles, no signals)
    ROW_MAP: tl.constexpr = False,  # rows are logical, gathered and scattered through row_map
):
    cum = tl.load(table_ptr + tl.arange(0, BLOCK_S))  # cumulative tile ends in tile order; INT32_MAX past the end
    total = tl.load(table_ptr + num_segments - 1)
    heavy = tl.load(table_ptr + 6 * BLOCK_S + 1)
    if FLAT:
        # Static stride, no signals (the launcher never sets FLAT with SIGNAL: the barrier before a tile's release
        # splits the fused loop, which then runs unpipelined). The compiler fuses this loop with the K loop, so
        # that the next tile's first loads are in flight during this tile's store.
        for t in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=True):
            u = _launch_to_tile(t, total, heavy, MIX)
            p, tile0, row0, row1, expert = _tile_info(table_ptr, cum, u, num_segments, BLOCK_S)
            off_m, off_n = _tile_offsets(u, tile0, row0, row1, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
            _tile_mma_store(x, w, out, flags_ptr, -1, off_m, off_n, row1, expert, total_rows, N, K,
                            stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_om, stride_on, row_map,
                            x_rows, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, W_KMAJOR, False, PEER, False, ROW_MAP)
    else:
        next_ptr = table_ptr + 6 * BLOCK_S
        t = tl.program_id(0)
        u = _launch_to_tile(t, total, heavy, MIX)
        p, tile0, row0, row1, expert = _tile_info(table_ptr, cum, u, num_segments, BLOCK_S)
        # A tile is published (its group's flag incremented, release) after the *next* tile's products, just
        # before that tile's store: by then its own stores have long completed, so the release fence costs nothing.
        # The last tile of a program is published after the loop.
        pending = -1
        # The next tile's index and table entries are fetched while this one computes and stores: their latency
        # (an atomic, then dependent loads) stays off the critical path.
        while t < total:
            if DYNAMIC:
                t_next = tl.atomic_add(next_ptr, 1, sem="relaxed", scope="gpu") + tl.num_programs(0)
            else:
                t_next = t + tl.num_programs(0)
            off_m, off_n = _tile_offsets(u, tile0, row0, row1, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
            left = row1 - off_m
            if SWAP_ROWS > 0 and left <= SWAP_ROWS:
                _tile_mma_store(x_swap, w, out, flags_ptr, pending, off_m, off_n, row1, expert, total_rows, N, K,
                                stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_om, stride_on, row_map,
                                x_rows, SWAP_ROWS, BLOCK_N, BLOCK_K, USE_TMA, W_KMAJOR, SIGNAL, PEER, True, ROW_MAP)
            elif HALF_TAIL and left <= BLOCK_M // 2:
                _tile_mma_store(x_half, w, out, flags_ptr, pending, off_m, off_n, row1, expert, total_rows, N, K,
                                stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_om, stride_on, row_map,
                                x_rows, BLOCK_M // 2, BLOCK_N, BLOCK_K, USE_TMA, W_KMAJOR, SIGNAL, PEER, False, ROW_MAP)
            else:
                _tile_mma_store(x, w, out, flags_ptr, pending, off_m, off_n, row1, expert, total_rows, N, K,
                                stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_om, stride_on, row_map,
                                x_rows, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, W_KMAJOR, SIGNAL, PEER, False, ROW_MAP)
            if SIGNAL:
                pending = tl.load(table_ptr + 5 * BLOCK_S + p)
            u = _launch_to_tile(t_next, total, heavy, MIX)
            p, tile0, row0, row1, expert = _tile_info(table_ptr, cum, u, num_segments, BLOCK_S)
            t = t_next
        if SIGNAL:
            _publish(flags_ptr, pending, PEER)


# -- launcher -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupedTile:
    """Tile shape and launch shape of the grouped GEMM. ``num_programs``: ``None`` launches one program per tile of the
    host-side bound (programs past the real tiles exit at once); an int launches that many persistent programs
    (``0``: ``programs_per_sm`` per SM), which take tiles by stride, or (``dynamic``) the first by program id and
    the rest from an atomic counter. ``half_tail``: a segment's last tile, when it has at most ``block_m // 2``
    rows, runs at half height (skewed routing leaves many small segments). ``swap_rows`` (0, or a power of two from
    16 to ``block_m // 2``): a last tile of at most that many rows runs transposed, ``w^T x^T``, at that height
    (bf16/fp16 only; others ignore it). ``mix``: in heavy-first order without priorities, the tiles of one-tile-row
    segments (memory-bound: a weight strip read for few rows) are spread evenly among the others (compute-bound),
    instead of all running after them. ``flat``: persistent programs (``num_programs`` an int, not ``dynamic``) run
    one flattened loop over their tiles and K, software-pipelined across tiles; full-height tiles only
    (``half_tail`` and ``swap_rows`` do not apply); without signals only (the barrier before each tile's release
    would split the loop: with ``flags``, ``flat`` is ignored). ``programs_per_sm``: with ``num_programs`` 0, that
    many persistent programs per SM (two small tiles' programs on one SM: one's MMA runs while the other's CUDA
    cores work, where the registers and shared memory of both fit)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    num_programs: int | None = 0
    dynamic: bool = False
    half_tail: bool = False
    swap_rows: int = 0
    mix: bool = False
    flat: bool = False
    programs_per_sm: int = 1

    def persistent_programs(self, device: torch.device) -> int:
        """How many persistent programs an int ``num_programs`` launches on ``device`` (0: ``programs_per_sm`` per
        SM)."""
        return self.num_programs or self.programs_per_sm * guards.sm_count(device)


# Tiles measured on one H200 (torch 2.11, triton 3.6). Sweeps 1-3 (benchmarks/results/logs/moe-gemm/, commits
# ab7bb3a, b77905f, e410e6d): 128x256x64 tiles with 8 warps won everywhere (128x128, 64x256, 256x128 and 128x256x128
# lost 5-50%). Sweep 4 (benchmarks/results/logs/issue20/moe-gemm-sweep-72796ed.{json,log}: `python -m
# flashoverlap.bench.moe_gemm --sweep ... --iters 8 --warmup 2` at 72796ed) timed the tail, mix and flat options in
# the forms the paths run, chosen here by the per-chunk form (``multiply_chunk``: the dispatch of both fast paths,
# the P2P combine), balanced and Zipf(1.2) routing summed:
# - more than 256 rows per expert (Mixtral-like and Qwen3-like chunks: 2048 and 512): the flattened persistent loop,
#   1.01-1.08x torch._grouped_mm on Mixtral-like and 1.02/0.96-0.98 on Qwen3-like chunks, against 0.87-0.99 for the
#   best unflattened tile; where signals rule it out (the flag launches) it runs as persistent 4-stage tiles with
#   half-height tails, the best of those there;
# - at most 256 rows per expert (DeepSeek-like: 128 per chunk), long K: one program per tile, 3 stages, transposed
#   tails of <= 32 rows and light tiles mixed (Zipf up 0.91 against 0.85 without; balanced the same, 0.75: each
#   chunk streams every expert's weights, 7.5 GB, at about 4.1 TB/s);
# - the same with a short K: persistent programs with the atomic counter, 4 stages, same tails and mix (Zipf down
#   0.93 against 0.83; balanced the same).
TILE_FLAT = GroupedTile(128, 256, 64, 8, 4, 8, 0, half_tail=True, flat=True)
TILE_MANY_EXPERTS_LONG_K = GroupedTile(128, 256, 64, 8, 3, 8, None, half_tail=True, swap_rows=32, mix=True)
TILE_MANY_EXPERTS = GroupedTile(128, 256, 64, 8, 4, 8, 0, dynamic=True, half_tail=True, swap_rows=32, mix=True)


def default_tile(rows: int, experts: int, k: int, n: int) -> GroupedTile:
    """The tile the paths use when none is given, for ``rows`` (a bound) over ``experts`` experts, ``[rows, k] x
    [k, n]`` each (from the sweeps named at ``TILE_FLAT``)."""
    if rows > 256 * max(experts, 1):
        return TILE_FLAT
    return TILE_MANY_EXPERTS_LONG_K if k >= 4096 else TILE_MANY_EXPERTS


def workspace_size(num_segments: int) -> int:
    """int32 elements of the scratch table for ``num_segments`` segments."""
    return _TABLE_ROWS * _block_s(num_segments) + _TABLE_SCALARS


def _block_s(num_segments: int) -> int:
    # Few sizes (64, 512, 4096, 8192), so that a handful of kernel variants covers every segment count.
    size = 64
    while size < num_segments:
        size = min(size * 8, MAX_SEGMENTS)
    return size


def _tma_ok(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (t.stride(-1) == 1 and all((s * size) % 16 == 0 for s in t.stride()[:-1])
            and t.data_ptr() % 16 == 0 and t.numel() > 0)


def _check_segments(name: str, t: torch.Tensor | None, num_segments: int, device: torch.device) -> None:
    if t is None:
        return
    if t.dtype != torch.int32 or t.ndim != 1 or t.numel() != num_segments or t.device != device:
        raise ValueError(f"{name} must be a 1-D int32 tensor of {num_segments} elements (one per segment) on "
                         f"{device}, got {t.dtype} {list(t.shape)} on {t.device}")


@dataclass(frozen=True, eq=False)  # tensors: compared by identity
class Segments:
    """The row segments of one ``grouped_gemm`` call, as int32 tensors on ``x``'s device, one element per segment:
    ``ends`` (row ends), ``expert`` (each segment's expert), and optionally ``starts`` (row starts; without them a
    segment starts where the previous one ends), ``signal`` (each segment's signal group: needs ``flags``),
    ``priority`` (values in ``[0, 4095]``, lower first) and ``row_map`` (int32 ``[R]``: the segments then cover
    logical rows ``[0, R)``, logical row ``r`` being row ``row_map[r]`` of ``x`` and ``out``). See ``grouped_gemm``."""

    ends: torch.Tensor
    expert: torch.Tensor
    starts: torch.Tensor | None = None
    signal: torch.Tensor | None = None
    priority: torch.Tensor | None = None
    row_map: torch.Tensor | None = None


@dataclass(frozen=True)
class GroupedLaunch:
    """How ``grouped_gemm`` launches (plain values: made once, shared by calls): ``order`` (``"heavy-first"`` or
    ``"given"``), ``max_rows`` (a host-side bound on the rows the segments cover, sizing the grid; default: all
    rows), ``tile`` (default ``default_tile``), ``use_tma`` (None: where the operands allow it), ``peer_visible``
    (flags released at system scope, for a peer's reader), ``validate`` (check the segment tables on the host
    first: a synchronisation, for tests and debugging)."""

    order: str = "heavy-first"
    max_rows: int | None = None
    tile: GroupedTile | None = None
    use_tma: bool | None = None
    peer_visible: bool = False
    validate: bool = False


DEFAULT_LAUNCH = GroupedLaunch()


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    segments: Segments,
    *,
    out: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    launch: GroupedLaunch = DEFAULT_LAUNCH,
) -> torch.Tensor:
    """``out[a:b] = x[a:b] @ w[segments.expert[s]]`` for every segment ``s`` = rows ``[a, b)``: ``b =
    segments.ends[s]`` and ``a = segments.starts[s]``, or, without starts, ``a = ends[s-1]`` (``a = 0`` for ``s =
    0``). Rows that no segment covers (past ``ends[-1]``; with starts also the gaps between segments) are not
    written. No host synchronisation: capturable in a CUDA graph, replayable with new segment bounds.

    ``x``: ``[rows, K]`` bf16/fp16 (fp32 runs as tf32), unit inner stride. ``w``: ``[E, K, N]`` of x's dtype, any
    strides; ``w_nk.transpose(1, 2)`` of a contiguous ``[E, N, K]`` weight is read in place. ``segments``
    (``Segments``): int32 ``[S]`` tables on x's device. Without starts, ``ends`` is non-decreasing (like
    ``torch._grouped_mm``'s ``offs``); with them, segments may lie in any order with gaps between them (the bounded
    MoE mode's receive slots: ``recv_seg_starts``, ``recv_seg_ends``) but must not overlap. An end below its start
    is an empty segment; bounds are clamped into ``[0, rows]``. Segments may be empty; several segments may share
    an expert. ``out``: ``[rows, N]`` of x's dtype (allocated when omitted).

    Signals: with ``flags`` (int32 ``[G]``; zero on entry is safe, any value is overwritten), ``flags[g]`` becomes
    exactly 1 (release; system scope with ``launch.peer_visible``) once every row of every segment with
    ``segments.signal[s] == g`` is stored, and is <= 0 before: wait for ``== 1`` (or signed ``>= 1``), not for
    non-zero. Groups with no rows are 1 as soon as the prep kernel has run. ``signal`` (values in ``[0, G)``)
    defaults to group 0 for every segment; out-of-range values are never signalled. Flags are rewritten at the
    start of each call (stream order), so replays need no reset.

    Order (``launch.order``): ``"given"`` computes segments in index order; ``"heavy-first"`` puts segments with
    more tile rows first (ties: by expert, so one expert's segments run together and share its weights in L2; then
    by index). ``segments.priority`` (lower first) comes before either: give each signal group its own priority
    (e.g. the own rank's segments 0, or destinations in sending order) to complete groups one after another instead
    of all at the end. ``tile.mix`` spreads the one-tile-row segments among the others (heavy-first order without
    priorities only).

    ``launch.max_rows``: a host-side bound on the rows the segments cover (default ``rows``) that sizes the grid
    when ``tile.num_programs`` is ``None``; a bound too small only makes programs take several tiles.
    ``launch.tile``: tile and launch shape (default ``default_tile``). ``workspace``: int32 scratch of
    ``workspace_size(S)`` elements (allocated per call when omitted; calls that may run concurrently need their
    own). ``launch.validate``: check the segment tables on the host first (a synchronisation).

    ``segments.row_map`` (int32 ``[R]`` on x's device): the segments cover *logical* rows ``[0, R)``, and logical
    row ``r`` is row ``row_map[r]`` of ``x`` and of ``out`` (gathered and scattered in place: a segment's rows need
    not be contiguous in ``x``, e.g. one expert's rows from every source rank in the dispatch layout). ``out`` must
    be given; rows of ``out`` that no mapped row names are not written; the mapped rows of covered logical rows
    must be distinct and lie in ``[0, rows)`` (checked with ``validate``). With TMA, a tile whose logical rows map
    onto consecutive rows of ``x`` loads them through TMA; any other tile gathers them with plain loads.
    """
    if _TRITON_MISSING is not None:
        raise ModuleNotFoundError(f"grouped_gemm needs triton ({_TRITON_MISSING}): pip install \"triton>=3.4\" (or, "
                                  "in a source checkout, pip install -e \".[gpu]\"), or use grouped_mm_reference / "
                                  "torch._grouped_mm")
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"x must be [rows, K] and w [E, K, N], got x {list(x.shape)} and w {list(w.shape)}")
    rows, k = x.shape
    num_experts, k_w, n = w.shape
    if k != k_w:
        raise ValueError(f"x is [rows, K] = {list(x.shape)} but w is [E, K, N] = {list(w.shape)}: K differs "
                         "(pass w_nk.transpose(1, 2) for an [E, N, K] weight)")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x and w must share one dtype of bf16, fp16, fp32, got {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"x and w must be on one device, got {x.device} and {w.device}")
    if num_experts < 1 or num_experts > MAX_EXPERTS:
        raise ValueError(f"w must hold 1 to {MAX_EXPERTS} experts, got {num_experts}")
    seg = segments
    num_segments = seg.ends.numel()
    if num_segments > MAX_SEGMENTS:
        raise ValueError(f"at most {MAX_SEGMENTS} segments, got {num_segments}: merge segments of one expert")
    for name in ("ends", "starts", "expert", "signal", "priority"):
        _check_segments(f"segments.{name}", getattr(seg, name), num_segments, x.device)
    order = launch.order
    if order not in ("given", "heavy-first"):
        raise ValueError(f"launch.order must be 'given' or 'heavy-first', got {order!r}")
    if seg.signal is not None and flags is None:
        raise ValueError("segments.signal needs flags: an int32 tensor with one element per signal group")
    signal = flags is not None
    num_groups = flags.numel() if signal else 0
    if signal and (flags.dtype != torch.int32 or flags.ndim != 1 or num_groups < 1 or flags.device != x.device):
        raise ValueError(f"flags must be a 1-D int32 tensor with one element per signal group on {x.device}, got "
                         f"{flags.dtype} {list(flags.shape)} on {flags.device}")
    if launch.max_rows is not None and launch.max_rows < 0:
        raise ValueError(f"launch.max_rows must be >= 0, got {launch.max_rows}")
    physical_rows = rows
    row_map = seg.row_map
    if row_map is not None:
        if row_map.dtype != torch.int32 or row_map.ndim != 1 or row_map.device != x.device:
            raise ValueError(f"segments.row_map must be a 1-D int32 tensor on {x.device}, got {row_map.dtype} "
                             f"{list(row_map.shape)} on {row_map.device}")
        if out is None:
            raise ValueError("a row map needs out: the rows it names are written in place, the others left alone")
        if launch.validate and row_map.numel():
            mapped = row_map.tolist()
            if min(mapped) < 0 or max(mapped) >= rows or len(set(mapped)) != len(mapped):
                raise ValueError(f"segments.row_map must name distinct rows of x in [0, {rows}), got {mapped[:8]}...")
        rows = row_map.numel()  # the segments' rows are logical from here on
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    elif out.shape != (physical_rows, n) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be [{physical_rows}, {n}] {x.dtype} on {x.device}, got {list(out.shape)} "
                         f"{out.dtype} on {out.device}")
    if x.stride(1) != 1 and physical_rows > 1 and k > 1:
        raise ValueError(f"x must have unit inner stride, got strides {x.stride()}: pass x.contiguous()")
    max_rows = rows if launch.max_rows is None else launch.max_rows
    tile = launch.tile or default_tile(max_rows, num_experts, k, n)
    _check_tile(tile)
    if launch.validate:
        _validate(seg.ends, seg.expert, rows, num_experts, seg.starts)
    if num_segments == 0:
        if signal:
            flags.fill_(1)
        return out
    block_s = _block_s(num_segments)
    need = workspace_size(num_segments)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.int32, device=x.device)
    elif workspace.dtype != torch.int32 or workspace.numel() < need or workspace.device != x.device:
        raise ValueError(f"workspace must be int32 with >= {need} elements on {x.device} "
                         f"(workspace_size({num_segments}))")
    tiles_n = -(-n // tile.block_n)
    sort = order == "heavy-first" or seg.priority is not None
    _TABLE_LAUNCH(1, (
        seg.ends, seg.starts if seg.starts is not None else seg.ends, seg.expert,
        seg.signal if seg.signal is not None else seg.ends, seg.priority if seg.priority is not None else seg.ends,
        workspace, flags if signal else workspace,
        num_segments, num_groups, num_experts, rows, tiles_n,
    ), dict(
        BLOCK_S=block_s, BLOCK_M=tile.block_m, SORT=sort, HEAVY_FIRST=order == "heavy-first",
        HAS_PRIORITY=seg.priority is not None, SIGNAL=signal, HAS_GROUPS=seg.signal is not None,
        HAS_STARTS=seg.starts is not None, num_warps=4 if block_s <= 1024 else 8,
    ))
    bound_tiles = (-(-max_rows // tile.block_m) + min(num_segments, max_rows)) * tiles_n
    if tile.num_programs is None:
        grid = bound_tiles
    else:
        programs = tile.persistent_programs(x.device)
        grid = min(programs, bound_tiles) if bound_tiles else 0
    if grid == 0 or n == 0:
        return out
    w_kmajor = w.stride(1) == 1 and w.stride(2) != 1  # w is w_nk.transpose(1, 2)
    w_stored = w.transpose(1, 2) if w_kmajor else w
    use_tma = launch.use_tma
    if use_tma is None:
        use_tma = (x.is_cuda and k > 0 and _tma_ok(x) and _tma_ok(w_stored)
                   and w_stored.stride(0) == w_stored.shape[1] * w_stored.stride(1)
                   and (w_kmajor or k % tile.block_k == 0))
    # The flattened loop is pipelined across tiles only without signals: the barrier before each release splits it.
    flat = tile.flat and tile.num_programs is not None and not tile.dynamic and not signal
    half_tail = tile.half_tail and tile.block_m >= 32 and not flat
    # The transposed product takes its weight tile as the left operand: 16-bit types only (tf32 tensor-core
    # operands must be K-major).
    swap_rows = tile.swap_rows if x.dtype != torch.float32 and not flat else 0
    # Launch slots map to tiles in the table's order unless mixed, which needs heavy segments first, then light.
    mix = tile.mix and order == "heavy-first" and seg.priority is None
    if use_tma:
        # The weights as one 2-D tensor: [E*K, N], or [E*N, K] for the transposed view. Reading across an
        # expert's edge is harmless where it happens (columns past N, masked at the store); K past an expert's
        # edge would not be, hence K % block_k == 0 for the [E*K, N] layout.
        w_2d = w_stored.reshape(-1, w_stored.shape[2])
        x_arg = TensorDescriptor.from_tensor(x, [tile.block_m, tile.block_k])
        x_half = TensorDescriptor.from_tensor(x, [tile.block_m // 2, tile.block_k]) if half_tail else x_arg
        x_swap = TensorDescriptor.from_tensor(x, [swap_rows, tile.block_k]) if swap_rows else x_arg
        w_block = [tile.block_n, tile.block_k] if w_kmajor else [tile.block_k, tile.block_n]
        w_arg = TensorDescriptor.from_tensor(w_2d, w_block)
    else:
        x_arg = x_half = x_swap = x
        w_arg = w
    _GEMM_LAUNCH(grid, (
        x_arg, x_half, x_swap, w_arg, out, workspace, flags if signal else workspace,
        rows, n, k, num_segments, num_groups, tiles_n,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        row_map if row_map is not None else workspace, x,
    ), dict(
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, BLOCK_S=block_s, GROUP_M=tile.group_m,
        USE_TMA=bool(use_tma), W_KMAJOR=bool(w_kmajor and use_tma), SIGNAL=signal, PEER=bool(launch.peer_visible),
        DYNAMIC=bool(tile.dynamic and tile.num_programs is not None), HALF_TAIL=half_tail, SWAP_ROWS=swap_rows,
        MIX=mix, FLAT=flat, ROW_MAP=row_map is not None, num_warps=tile.num_warps, num_stages=tile.num_stages,
    ))
    return out


# -- fp8 ------------------------------------------------------------------------------------------------------------
# The fp8 grouped GEMM of the expert paths' fp8 calls (comm/expert/scaled.py): the same segment table (the prep
# kernel above) and tile walk, fp8 operands, fp32 accumulation, and the scales applied the way the scaling mode says:
# row-wise (``x_scale [rows, 1]``, ``w_scale [E, N]``) once to the finished accumulator; block-wise (``x_scale
# [rows, K/128]``, ``w_scale [E, K/128, ceil(N/128)]``) to each 128-deep K step's partial product (BLOCK_K is 128).
# Pointer loads (no TMA yet), persistent programs taking tiles by stride, no signals.


@_jit
def _step_scales(sx_ptrs, sw_ptrs, kk, stride_sxk, stride_swk, SCALAR_W: tl.constexpr):
    """K step ``kk``'s scales as its product multiplies them: the rows' ``[BLOCK_M]`` times the weight's one scalar
    (``[BLOCK_M, 1]``), or times its per-column scales (``[BLOCK_M, BLOCK_N]``)."""
    sa = tl.load(sx_ptrs + kk * stride_sxk)
    sb = tl.load(sw_ptrs + kk * stride_swk)
    # One return, after the branch: the compiler generates what follows a constexpr branch's return too (only the
    # interpreter stops there), and a scalar ``sb[None, :]`` does not compile.
    if SCALAR_W:
        s = (sa * sb)[:, None]
    else:
        s = sa[:, None] * sb[None, :]
    return s


@_jit
def scaled_grouped_gemm_kernel(
    x, x_scale, w, w_scale, out, table_ptr,
    total_rows, N, K, num_segments, tiles_n,
    stride_xm, stride_xk, stride_sxm, stride_sxk,
    stride_we, stride_wk, stride_wn, stride_swe, stride_swk, stride_swn,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCKWISE: tl.constexpr,
):
    cum = tl.load(table_ptr + tl.arange(0, BLOCK_S))
    total = tl.load(table_ptr + num_segments - 1)
    for t in tl.range(tl.program_id(0), total, tl.num_programs(0)):
        p, tile0, row0, row1, expert = _tile_info(table_ptr, cum, t, num_segments, BLOCK_S)
        off_m, off_n = _tile_offsets(t, tile0, row0, row1, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        rows_in = tl.where(offs_m < total_rows, offs_m, 0).to(tl.int64)  # clamped: computed, masked at the store
        cols_in = tl.where(offs_n < N, offs_n, 0)
        offs_k = tl.arange(0, BLOCK_K)
        e64 = expert.to(tl.int64)
        a_ptrs = x + rows_in[:, None] * stride_xm + offs_k[None, :] * stride_xk
        b_ptrs = w + e64 * stride_we + offs_k[:, None] * stride_wk + cols_in[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCKWISE:  # K a multiple of BLOCK_K = 128 (the launcher's check): no K masks
            scalar_w: tl.constexpr = BLOCK_N <= 128  # the tile's columns lie in one 128-wide scale block
            sx_ptrs = x_scale + rows_in * stride_sxm
            sw_ptrs = w_scale + e64 * stride_swe + (off_n // 128 if scalar_w else cols_in // 128) * stride_swn
            for kk in range(K // BLOCK_K):
                # The product must be scaled before it is added, so Triton waits for each step's MMA here
                # (``benchmarks/diagnostics/kernel_facts.py`` shows the waits; two independent products per step
                # waited for each, 0b293d9), and the scaling is made short: one multiply-add per element where the
                # weight's scale is one scalar. Programs sharing an SM overlap one's MMA with another's scaling.
                acc += tl.dot(tl.load(a_ptrs), tl.load(b_ptrs)) * _step_scales(sx_ptrs, sw_ptrs, kk, stride_sxk,
                                                                               stride_swk, scalar_w)
                a_ptrs += BLOCK_K * stride_xk
                b_ptrs += BLOCK_K * stride_wk
        else:
            for kk in range(tl.cdiv(K, BLOCK_K)):
                k_left = K - kk * BLOCK_K
                a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b_tile = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                acc = tl.dot(a_tile, b_tile, acc)
                a_ptrs += BLOCK_K * stride_xk
                b_ptrs += BLOCK_K * stride_wk
        if not BLOCKWISE:
            sa = tl.load(x_scale + rows_in * stride_sxm)
            sb = tl.load(w_scale + e64 * stride_swe + cols_in * stride_swn)
            acc = acc * sa[:, None] * sb[None, :]
        c_ptrs = out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(c_ptrs, acc.to(out.dtype.element_ty), mask=(offs_m[:, None] < row1) & (offs_n[None, :] < N))


# Swept on one H200 (benchmarks/results/h200x1-fp8-grouped-tiles.json, rendered in docs/benchmarks.md). Row-wise:
# persistent 128x256 tiles with 4 stages, the fastest or next to it at every config. Block-wise: 64x128 tiles of 4
# warps, one program per tile, so that two programs share each SM (their registers and shared memory fit two): one's
# MMA runs while the other scales its product (Triton waits for each block-wise step's MMA). It was the fastest tile
# at four of the five configs re-measured, and within a few per cent of the fastest at the fifth.
SCALED_TILE = GroupedTile(64, 128, 128, 8, 3, 4, None)  # block-wise
SCALED_TILE_ROW = GroupedTile(128, 256, 128, 8, 4, 8, 0)  # row-wise
# Block-wise, the Gluon kernel (kernels/block_scaled.py), swept on one H100 (h100x1-fp8-grouped-tiles.json): 128x128
# with two warpgroups and 4 ring slots the fastest at every config but the one with K = 768 (6 steps), where 64x128
# tiles of one warpgroup and 3 slots, two programs to an SM, ran 6% faster: with few steps a tile's fill and drain
# weigh, and a second program on the SM runs its loop meanwhile.
SCALED_TILE_HOPPER = GroupedTile(128, 128, 128, 8, 4, 8, None)
SCALED_TILE_HOPPER_SHORT_K = GroupedTile(64, 128, 128, 8, 3, 4, None)
SHORT_K = 1024  # K below which SCALED_TILE_HOPPER_SHORT_K is taken (the sweep: K = 768 below, 2048 and up above)


# Each kernel launched through its compiled kernel's launcher once the JIT has compiled it for the same arguments'
# fingerprint (kernels/launch.py: the JIT's per-launch binding and specialisation cost an fp8 MoE layer's eager call
# four launches' worth of host time, logs of benchmarks/diagnostics/fp8_moe_host.py --profile).
_TABLE_LAUNCH = Launcher(_segment_table_kernel)
_GEMM_LAUNCH = Launcher(grouped_gemm_kernel)
_SCALED_LAUNCH = Launcher(scaled_grouped_gemm_kernel)
_BLOCK_LAUNCH = Launcher(block_scaled.block_scaled_kernel)


def launches() -> dict[str, int]:
    """Launches of each grouped kernel so far, by kernel (``segment_table``, ``grouped`` bf16/fp16, ``scaled`` the
    Triton fp8 kernel, ``block_scaled`` the Gluon block-wise one): which kernel ran is read from their differences."""
    return {"segment_table": _TABLE_LAUNCH.launches, "grouped": _GEMM_LAUNCH.launches,
            "scaled": _SCALED_LAUNCH.launches, "block_scaled": _BLOCK_LAUNCH.launches}


def scaled_grouped_gemm(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        segments: Segments, *, out: torch.Tensor, mode: str, tile: GroupedTile | None = None,
                        workspace: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 ``out[a:b] = (x[a:b] * x_scale[a:b]) @ (w[e] * w_scale[e])`` for every segment (``grouped_gemm``'s
    segments: ends, experts, optional starts; no signals, no row map), fp32 accumulation, rounded to ``out``'s
    dtype. ``x [rows, K]`` fp8 (any row stride, unit inner stride: packed wire rows are read in place), ``w [E, K,
    N]`` fp8, any strides. ``mode`` ``"row"``: ``x_scale [rows, 1]``, ``w_scale [E, N]``; ``"block"``: ``x_scale
    [rows, K/128]``, ``w_scale [E, K/128, ceil(N/128)]`` (K a multiple of 128). Rows no segment covers are not
    written. No host synchronisation."""
    if _TRITON_MISSING is not None:
        raise ModuleNotFoundError(f"scaled_grouped_gemm needs triton ({_TRITON_MISSING})")
    rows, k = x.shape
    num_experts, k_w, n = w.shape
    if k != k_w or mode not in ("row", "block") or (mode == "block" and k % 128):
        raise ValueError(f"scaled_grouped_gemm: x {list(x.shape)}, w {list(w.shape)}, mode {mode!r}: K must agree, "
                         "mode be 'row' or 'block' (block: K a multiple of 128)")
    # Block-wise on Hopper: the Gluon kernel (kernels/block_scaled.py), which keeps each step's MMA in flight while
    # the step before it is scaled, wherever the operands and the tile suit it.
    gluon = mode == "block" and block_scaled.applies(x, w)
    tile = tile or scaled_tile(mode, gluon, x.shape[1])
    gluon = gluon and block_scaled.fits(tile)
    _check_tile(tile)
    if mode == "block" and tile.block_k != 128:
        raise ValueError("scaled_grouped_gemm: block-wise scales need tile.block_k = 128")
    seg = segments
    num_segments = seg.ends.numel()
    if num_segments == 0 or rows == 0 or n == 0:
        return out
    block_s = _block_s(num_segments)
    if workspace is None:
        workspace = torch.empty(workspace_size(num_segments), dtype=torch.int32, device=x.device)
    tiles_n = -(-n // tile.block_n)
    _TABLE_LAUNCH(1, (
        seg.ends, seg.starts if seg.starts is not None else seg.ends, seg.expert, seg.ends, seg.ends,
        workspace, workspace, num_segments, 0, num_experts, rows, tiles_n,
    ), dict(
        BLOCK_S=block_s, BLOCK_M=tile.block_m, SORT=True, HEAVY_FIRST=True, HAS_PRIORITY=False, SIGNAL=False,
        HAS_GROUPS=False, HAS_STARTS=seg.starts is not None, num_warps=4 if block_s <= 1024 else 8,
    ))
    bound_tiles = (-(-rows // tile.block_m) + min(num_segments, rows)) * tiles_n
    if gluon:
        block_scaled.launch(x, x_scale, w, w_scale, out, workspace, num_segments, block_s, bound_tiles, tile,
                            _BLOCK_LAUNCH)
        return out
    programs = bound_tiles if tile.num_programs is None else tile.persistent_programs(x.device)
    grid = min(programs, bound_tiles)
    # The scales' strides as the kernel reads them, without views: x_scale [rows] as [rows, 1]; row-wise w_scale
    # [E, N] as [E, 1, N] (its K stride never read).
    sx = x_scale.stride()
    sx_m, sx_k = (sx[0], sx[1]) if len(sx) == 2 else (sx[0], 0)
    sw = w_scale.stride()
    sw_e, sw_k, sw_n = sw if len(sw) == 3 else (sw[0], 0, sw[1])
    _SCALED_LAUNCH(grid, (
        x, x_scale, w, w_scale, out, workspace, rows, n, k, num_segments, tiles_n,
        x.stride(0), x.stride(1), sx_m, sx_k,
        w.stride(0), w.stride(1), w.stride(2), sw_e, sw_k, sw_n,
        out.stride(0), out.stride(1),
    ), dict(
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, BLOCK_S=block_s, GROUP_M=tile.group_m,
        BLOCKWISE=mode == "block", num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    ))
    return out


def scaled_tile(mode: str, gluon: bool, k: int) -> GroupedTile:
    """The tile ``scaled_grouped_gemm`` takes when given none, for K = ``k``: row-wise ``SCALED_TILE_ROW``;
    block-wise, where the Gluon kernel applies to the operands (``gluon``: ``block_scaled.applies``),
    ``SCALED_TILE_HOPPER``, or ``SCALED_TILE_HOPPER_SHORT_K`` below ``SHORT_K``; else ``SCALED_TILE``."""
    if mode == "row":
        return SCALED_TILE_ROW
    if gluon:
        return SCALED_TILE_HOPPER_SHORT_K if k < SHORT_K else SCALED_TILE_HOPPER
    return SCALED_TILE


def _check_tile(tile: GroupedTile) -> None:
    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0

    if not (pow2(tile.block_m) and pow2(tile.block_n) and pow2(tile.block_k) and min(tile.block_m, tile.block_n,
                                                                                    tile.block_k) >= 16):
        raise ValueError(f"tile: block_m, block_n, block_k must be powers of two >= 16, got {tile}")
    if not (isinstance(tile.programs_per_sm, int) and tile.programs_per_sm >= 1):
        raise ValueError(f"tile.programs_per_sm must be an int >= 1, got {tile.programs_per_sm!r}")
    if tile.swap_rows and not (pow2(tile.swap_rows) and 16 <= tile.swap_rows <= tile.block_m // 2):
        raise ValueError(f"tile.swap_rows must be 0 or a power of two in [16, block_m // 2 = {tile.block_m // 2}], "
                         f"got {tile.swap_rows}")


def _validate(seg_ends: torch.Tensor, seg_expert: torch.Tensor, rows: int, num_experts: int,
              seg_starts: torch.Tensor | None = None) -> None:
    ends = seg_ends.tolist()
    if seg_starts is None:
        if any(b < a for a, b in zip([0, *ends], ends)) or (ends and ends[-1] > rows):
            raise ValueError(f"seg_ends must be non-decreasing from 0 up to at most rows = {rows}, got {ends}")
    else:
        starts = seg_starts.tolist()
        bad = [(a, b) for a, b in zip(starts, ends) if not (0 <= a <= rows and 0 <= b <= rows)]
        if bad:
            raise ValueError(f"segment bounds must lie in [0, rows = {rows}], got (start, end) {bad[:4]}")
        spans = sorted((a, b) for a, b in zip(starts, ends) if b > a)
        overlaps = [(p, q) for p, q in zip(spans, spans[1:]) if q[0] < p[1]]
        if overlaps:
            raise ValueError(f"segments must not overlap, got rows {overlaps[0][0]} and {overlaps[0][1]}")
    experts = seg_expert.tolist()
    if any(e < 0 or e >= num_experts for e in experts):
        raise ValueError(f"seg_expert must lie in [0, {num_experts}), got {experts}")


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, seg_ends: torch.Tensor, seg_expert: torch.Tensor,
                         seg_starts: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: a loop over segments in plain PyTorch, accumulated in fp32 or better, returned in x's dtype.
    Rows that no segment covers are zero."""
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros((x.shape[0], w.shape[2]), dtype=x.dtype, device=x.device)
    ends = seg_ends.tolist()
    starts = seg_starts.tolist() if seg_starts is not None else [0, *ends[:-1]]
    previous = 0
    for start, end, expert in zip(starts, ends, seg_expert.tolist()):
        if seg_starts is None:  # a segment starts where the previous one ended (an end below it: empty)
            start = previous
            previous = max(previous, end)
        if end > start:
            out[start:end] = (x[start:end].to(acc_dtype) @ w[expert].to(acc_dtype)).to(x.dtype)
    return out
