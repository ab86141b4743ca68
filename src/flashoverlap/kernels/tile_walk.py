"""The grouped GEMMs' tile walk: which segment a tile of the prep kernel's table
(``grouped_gemm._segment_table_kernel``) belongs to, and where in that segment's output it lies. Shared by the Triton
kernels of ``grouped_gemm.py`` and the Gluon kernel of ``block_scaled.py`` (a Gluon kernel may call these: they make
no tensor of their own, so they need no layout)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ModuleNotFoundError:  # a CPU install without the gpu extra

    def _jit(fn):
        return fn


@_jit
def _tile_info(table_ptr, cum, t, num_segments, BLOCK_S: tl.constexpr):
    """Position in tile order of tile ``t``'s segment, and that segment's first tile, rows and expert."""
    p = tl.minimum(tl.sum((cum <= t).to(tl.int32), axis=0), num_segments - 1)
    tile0 = tl.load(table_ptr + 1 * BLOCK_S + p)
    row0 = tl.load(table_ptr + 2 * BLOCK_S + p)
    row1 = tl.load(table_ptr + 3 * BLOCK_S + p)
    expert = tl.load(table_ptr + 4 * BLOCK_S + p)
    return p, tile0, row0, row1, expert


@_jit
def _tile_offsets(t, tile0, row0, row1, tiles_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP_M: tl.constexpr):
    """First row and column of tile ``t`` of the segment ``[row0, row1)`` whose tiles start at ``tile0``: bands of
    GROUP_M tile rows, column after column (L2 reuse of x rows and w columns)."""
    local = t - tile0
    m_tiles = tl.cdiv(row1 - row0, BLOCK_M)
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    height = tl.minimum(m_tiles - first_m, GROUP_M)
    off_m = row0 + (first_m + (local % width) % height) * BLOCK_M
    off_n = ((local % width) // height) * BLOCK_N
    return off_m, off_n
