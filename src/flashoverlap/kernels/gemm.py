"""The signalling GEMM: ``C = A @ B`` computed in the plan's tile order, publishing a counter per group.

Each program loops over the plan's tile order with a stride of the number of programs (persistent when there
are fewer programs than tiles, one tile per program otherwise). After a tile is stored, every thread of the
program has finished its stores (``debug_barrier``), then one release-ordered atomic increments the counter of the
tile's group: whoever observes the counter at the group's tile count (a stream wait, an acquire load) also
observes every element of the group's rows. The kernel knows tiles, their order and counters; it knows nothing of
ranks or collectives.

Operands are loaded through TMA tensor descriptors where their strides allow (16-byte aligned rows, unit inner
stride), otherwise through masked pointer loads; both work for any ``M, N, K >= 1``. ``B`` may be a plain
row-major ``[K, N]`` tensor or the transposed view ``w.t()`` of an ``[N, K]`` weight, without a copy.

fp8 (``Scaling``): the same kernel multiplies ``float8_e4m3fn`` / ``float8_e5m2`` operands into an fp32 accumulator
and applies the scales as ``torch._scaled_mm`` does: one scale or one per row of A, one scale or one per column of B,
in the epilogue; or DeepSeek-V3's blocks (A per 1x128, B per 128x128), inside the K loop, one 128-deep slab at a
time. Then the optional bias, then the output dtype (bf16 by default, or fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError as exc:  # a CPU install has no Triton; only the GPU paths need it
    raise ImportError(
        f"flashoverlap's GPU kernels need Triton (>= 3.3, with tensor descriptors): pip install \"triton>=3.4\" (or, "
        f"in a source checkout, the flashoverlap[gpu] extra: pip install -e \".[gpu]\") ({exc})") from exc

from flashoverlap import guards
from flashoverlap.kernels.launch import Launcher
from flashoverlap.plan import Plan

# How an operand is scaled (the kernel's A_SCALE / B_SCALE): not at all, by one scale, per row of A (per column of
# B), or per block (A 1x128, B 128x128; both or neither).
NONE, ONE, PER_ROW, BLOCKS = 0, 1, 2, 3
SCALE_BLOCK = 128  # the K depth (and B's N width) of one scale block


@triton.jit
def _accumulate(acc, a_tile, b_tile, kk, scale_a_ptr, scale_b_ptr, a_rows, off_n, cols, stride_sam, stride_sak,
                stride_sbk, stride_sbn, BLOCK_N: tl.constexpr, BLOCK_SCALED: tl.constexpr):
    """``acc + a_tile @ b_tile``; block-scaled, the K slab ``kk`` (128 deep) is multiplied on its own and added
    times its scales: A's of each row, B's of each 128-column block."""
    if BLOCK_SCALED:
        scale_a = tl.load(scale_a_ptr + a_rows * stride_sam + kk * stride_sak)
        if BLOCK_N <= 128:  # the tile lies inside one column block (tiles are aligned to their width): one scale
            scale_b = tl.load(scale_b_ptr + kk * stride_sbk + (off_n // 128) * stride_sbn)
            return acc + tl.dot(a_tile, b_tile) * (scale_a * scale_b)[:, None]
        scale_b = tl.load(scale_b_ptr + kk * stride_sbk + (cols // 128) * stride_sbn)
        return acc + tl.dot(a_tile, b_tile) * scale_a[:, None] * scale_b[None, :]
    return tl.dot(a_tile, b_tile, acc)


@triton.jit
def _epilogue(acc, scale_a_ptr, scale_b_ptr, bias_ptr, a_rows, cols, stride_sam, stride_sbn, A_SCALE: tl.constexpr,
              B_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The scales applied after the K loop (one, or per row of A / column of B), then the bias, all in fp32."""
    if A_SCALE == 1:
        acc = acc * tl.load(scale_a_ptr)
    elif A_SCALE == 2:
        acc = acc * tl.load(scale_a_ptr + a_rows * stride_sam)[:, None]
    if B_SCALE == 1:
        acc = acc * tl.load(scale_b_ptr)
    elif B_SCALE == 2:
        acc = acc * tl.load(scale_b_ptr + cols * stride_sbn)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    return acc


@triton.jit
def signalling_gemm_kernel(
    a,  # [M, K]: a pointer, or a TMA descriptor with block [BLOCK_M, BLOCK_K]
    b,  # [K, N] (B_KMAJOR=False) or its transpose [N, K] (B_KMAJOR=True): pointer or descriptor
    c,  # [M, N]: a pointer, or a TMA descriptor with block [BLOCK_M, BLOCK_N] (TMA_STORE)
    counters_ptr,  # int32 [num_groups]: tiles stored so far, per group
    tile_order_ptr,  # int32 [num_tiles]: pid_m * tiles_n + pid_n of the i-th tile computed
    tile_group_ptr,  # int32 [num_tiles]: group of the i-th tile computed
    row_table_ptr,  # int32 [tiles_m, 3] (ROW_MAP): first A row, first output row, rows of each tile row
    flags_ptr,  # int32 [num_groups] (WAIT): non-zero once group g's rows of A have arrived
    wait_error_ptr,  # int32 [1] (WAIT with MAX_SPINS): 1 + the group whose wait ran out, 0 if none did
    scale_a_ptr,  # fp32 (A_SCALE): one scale, one per row of A, or [M, ceil(K/128)] per 1x128 block
    scale_b_ptr,  # fp32 (B_SCALE): one scale, one per column of B, or [ceil(K/128), ceil(N/128)] per 128x128 block
    bias_ptr,  # [N] (HAS_BIAS): added after the scales
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_sam,  # A's scales: per row, and per K block (A_SCALE == BLOCKS)
    stride_sak,
    stride_sbk,  # B's scales: per K block (B_SCALE == BLOCKS), and per column or column block
    stride_sbn,
    num_tiles,
    tiles_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    TMA_STORE: tl.constexpr,
    SIGNAL: tl.constexpr,
    BULK_WAIT: tl.constexpr,  # False only under the interpreter, which cannot run inline PTX
    ROW_MAP: tl.constexpr = False,
    WAIT: tl.constexpr = False,
    MAX_SPINS: tl.constexpr = 0,  # 0: wait as long as it takes; otherwise give up and report (debug mode)
    FLATTEN: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
    A_SCALE: tl.constexpr = 0,  # NONE, ONE, PER_ROW (of A) or BLOCKS (1x128)
    B_SCALE: tl.constexpr = 0,  # NONE, ONE, PER_ROW (here: per column of B) or BLOCKS (128x128)
    HAS_BIAS: tl.constexpr = False,
):
    k_tiles = tl.cdiv(K, BLOCK_K)
    # flatten=False keeps the K loop pipelined on its own; flattening it into the tile loop made the
    # signalling variant of this kernel three times slower on H200 (docs/design.md).
    for i in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        packed = tl.load(tile_order_ptr + i)
        pid_m = packed // tiles_n
        pid_n = packed % tiles_n
        if ROW_MAP:
            # Row-mapped plans (reduce-scatter, all-gather): the tile row's first A row and first output row come
            # from the plan (one of them in a [group][W][rows] workspace); rows past its block are computed but
            # never stored.
            off_m = tl.load(row_table_ptr + 3 * pid_m)
            out_m = tl.load(row_table_ptr + 3 * pid_m + 1)
            rows_here = tl.load(row_table_ptr + 3 * pid_m + 2)
        else:
            off_m = pid_m * BLOCK_M
        if WAIT:
            # All-gather: a tile of another rank's shard waits until its group's band has arrived. The flag is
            # written by the communication stream after the band's collective completed; the acquire load makes
            # the band's bytes visible to this program's later loads.
            group = tl.load(tile_group_ptr + i)
            if group >= 0:
                ready = tl.atomic_add(flags_ptr + group, 0, sem="acquire", scope="gpu")
                if MAX_SPINS == 0:
                    while ready == 0:
                        ready = tl.atomic_add(flags_ptr + group, 0, sem="acquire", scope="gpu")
                else:
                    spins = 0
                    while (ready == 0) & (spins < MAX_SPINS):
                        ready = tl.atomic_add(flags_ptr + group, 0, sem="acquire", scope="gpu")
                        spins += 1
                    if ready == 0:
                        tl.atomic_xchg(wait_error_ptr, group + 1)
                if BULK_WAIT:
                    # TMA reads go through the async proxy: order them after the generic-proxy acquire.
                    group = tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.b32 $0, $1;", "=r,r",
                                                      [group], dtype=tl.int32, is_pure=False, pack=1)
            tl.debug_barrier()
        off_n = pid_n * BLOCK_N
        # Rows of A and columns of B this tile reads, clamped to valid ones: the scales' and pointer loads' indices
        # (clamped rows and columns are computed but never stored).
        a_rows = off_m + tl.arange(0, BLOCK_M)
        a_rows = tl.where(a_rows < M, a_rows, 0)
        cols = off_n + tl.arange(0, BLOCK_N)
        cols = tl.where(cols < N, cols, 0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            # Out-of-range rows, columns and K are zero-filled by the copy engine.
            for kk in tl.range(k_tiles, warp_specialize=WARP_SPECIALIZE):
                a_tile = a.load([off_m, kk * BLOCK_K])
                if B_KMAJOR:
                    b_tile = b.load([off_n, kk * BLOCK_K]).T
                else:
                    b_tile = b.load([kk * BLOCK_K, off_n])
                acc = _accumulate(acc, a_tile, b_tile, kk, scale_a_ptr, scale_b_ptr, a_rows, off_n, cols,
                                  stride_sam, stride_sak, stride_sbk, stride_sbn, BLOCK_N, A_SCALE == 3)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = a + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
            for kk in range(k_tiles):
                k_left = K - kk * BLOCK_K
                a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b_tile = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                acc = _accumulate(acc, a_tile, b_tile, kk, scale_a_ptr, scale_b_ptr, a_rows, off_n, cols,
                                  stride_sam, stride_sak, stride_sbk, stride_sbn, BLOCK_N, A_SCALE == 3)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
        acc = _epilogue(acc, scale_a_ptr, scale_b_ptr, bias_ptr, a_rows, cols, stride_sam, stride_sbn, A_SCALE,
                        B_SCALE, HAS_BIAS)
        if TMA_STORE:
            c.store([off_m, off_n], acc.to(c.dtype))  # the copy engine clips rows/columns out of range
        elif ROW_MAP:
            local = tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            c_ptrs = c + (out_m + local)[:, None] * stride_cm + cols[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=(local[:, None] < rows_here) & (cols[None, :] < N))
        else:
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            c_ptrs = c + rows[:, None] * stride_cm + cols[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))
        if SIGNAL:
            group = tl.load(tile_group_ptr + i)
            if TMA_STORE and BULK_WAIT:
                # The bulk store is asynchronous and Triton only waits for it to have *read* shared memory: wait
                # until its writes to C are complete, and order them (async proxy) before the generic-proxy
                # release below. The asm returns `group` unchanged so the atomic depends on it.
                group = tl.inline_asm_elementwise(
                    "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.b32 $0, $1;",
                    "=r,r", [group], dtype=tl.int32, is_pure=False, pack=1)
            # Every thread's stores of this tile come before the release below.
            tl.debug_barrier()
            tl.atomic_add(counters_ptr + group, 1, sem="release", scope="gpu")


# -- launcher -----------------------------------------------------------------------------------------------
_TABLES: dict[tuple[Plan, torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_MAX_CACHED_TABLES = 64


def plan_tables(plan: Plan, device: torch.device, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's tile order, tile-to-group map and per-tile-row rows (``Plan.tile_rows``, ``[tiles_m, 3]``) as
    int32 tensors on ``device``, built once per plan."""
    rank = rank if plan.op == "all_gather" else 0  # only all-gather's order depends on the rank
    key = (plan, torch.device(device), rank)
    tables = _TABLES.get(key)
    if tables is None:
        if key[1].type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "flashoverlap: a plan's first use copies its tile tables to the GPU and cannot be captured in a "
                "CUDA graph; call the op once with this plan before capturing"
            )
        if len(_TABLES) >= _MAX_CACHED_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        order = torch.from_numpy(plan.tile_order(rank).copy()).to(device)
        owner = torch.from_numpy(plan.tile_groups(rank).copy()).to(device)
        rows = torch.from_numpy(np.stack(plan.tile_rows(), axis=1).copy()).to(device)
        tables = _TABLES[key] = (order, owner, rows)
    return tables


def _tma_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor with unit inner stride and 16-byte aligned base and row stride."""
    size = t.element_size()
    return (
        t.stride(1) == 1
        and (t.stride(0) * size) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.shape[0] > 0
        and t.shape[1] > 0
    )


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, eq=False)
class Scaling:
    """What makes the GEMM a scaled fp8 one, as ``torch._scaled_mm`` takes it beside its operands: ``out =
    (a * scale_a) @ (b * scale_b) + bias`` in ``out_dtype``, accumulated in fp32.

    The scales are fp32 and say the mode by their shapes, as ``_scaled_mm``'s do:

    - one scale (one element): the whole operand;
    - A ``[M, 1]``: one per row of A; B ``[1, N]``: one per column of B (row-wise). A per-row A scale with one B
      scale is also taken: the all-gather's tensor-wise shards each carry their own scale, so the gathered A is
      row-wise in effect (expand each shard's scale over its rows);
    - A ``[M, ceil(K/128)]`` per 1x128 block and B ``[ceil(K/128), ceil(N/128)]`` per 128x128 block (DeepSeek-V3),
      both or neither; the plan's ``block_k`` must then be 128. Any strides (``_scaled_mm`` wants A's outer-dim-major,
      ``scale.t().contiguous().t()``, and B's as ``w_scale.t()`` of a ``[N/128, K/128]`` weight scale).

    A's scales follow the rows of the ``a`` the kernel reads: for an all-gather plan, the gathered buffer's layout.
    ``bias``: ``[N]`` (any float dtype), added after the scales.
    """

    scale_a: torch.Tensor
    scale_b: torch.Tensor
    out_dtype: torch.dtype = torch.bfloat16
    bias: torch.Tensor | None = None

    def modes(self, m: int, n: int, k: int) -> tuple[int, int]:
        """``(A's mode, B's mode)`` among ``ONE``, ``PER_ROW``, ``BLOCKS`` for an ``[m, k] @ [k, n]`` product;
        ``ValueError`` for scales that fit no mode."""
        sa, sb = self.scale_a, self.scale_b
        for name, t in (("scale_a", sa), ("scale_b", sb)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise ValueError(f"Scaling.{name} must be a float32 tensor, got "
                                 f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        kb, nb = math.ceil(k / SCALE_BLOCK), math.ceil(n / SCALE_BLOCK)
        if tuple(sa.shape) == (m, kb) and tuple(sb.shape) == (kb, nb):
            # Block-wise; where a shape also reads as one scale or per row (K or N within one block), same product.
            a_mode = b_mode = BLOCKS
        else:
            a_mode = ONE if sa.numel() == 1 else PER_ROW if tuple(sa.shape) == (m, 1) else None
            b_mode = ONE if sb.numel() == 1 else PER_ROW if tuple(sb.shape) == (1, n) else None
        if a_mode is None or b_mode is None:
            raise ValueError(
                f"Scaling: scales of shapes scale_a {list(sa.shape)}, scale_b {list(sb.shape)} fit no mode for "
                f"[{m}, {k}] @ [{k}, {n}]: one scale each (tensor-wise), scale_a [{m}, 1] and/or scale_b [1, {n}] "
                f"(row-wise), or scale_a [{m}, {kb}] with scale_b [{kb}, {nb}] (block-wise 1x128 / 128x128)")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"Scaling.out_dtype must be one of {OUT_DTYPES}, got {self.out_dtype}")
        if self.bias is not None and (self.bias.shape != (n,) or not self.bias.is_floating_point()):
            raise ValueError(f"Scaling.bias must be a float tensor of shape [{n}], got "
                             f"{list(self.bias.shape)} {self.bias.dtype}")
        return a_mode, b_mode


@dataclass(frozen=True, eq=False)
class GatherWait:
    """An all-gather plan's in-kernel waits: every tile of group ``g`` waits until ``flags[g] != 0`` (int32, at
    least ``plan.num_groups`` elements); ``rank`` picks the tile order (own shard first). With ``max_spins`` a wait
    gives up after that many polls and writes ``1 + g`` to ``wait_error`` (int32, one element) instead of hanging:
    the result is then wrong and the caller must raise."""

    flags: torch.Tensor
    rank: int = 0
    wait_error: torch.Tensor | None = None
    max_spins: int = 0


_LAUNCH = Launcher(signalling_gemm_kernel)  # compiled kernels by fingerprint: a repeated launch skips the JIT

# Launch switches, and the all-gather keywords as they were spelled before ``GatherWait``.
_SWITCHES = frozenset({"use_tma", "tma_store"})
_WAIT_KEYWORDS = frozenset({"flags", "rank", "wait_error", "max_spins"})


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: Plan,
    *,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    scaling: Scaling | None = None,
    wait: GatherWait | None = None,
    **options,
) -> torch.Tensor:
    """``out = a @ b`` following ``plan``'s tile order; with ``counters``, each tile's group counter is bumped.

    For a row-mapped plan (``plan.blocks > 1``: reduce-scatter) ``out`` is the ``[M, N]`` workspace and row
    ``Plan.tile_rows`` decide where each tile's rows land (see ``Plan.groups``), not row-major ``a @ b``.

    ``a``: ``[M, K]``; ``b``: ``[K, N]`` (any strides; ``w.t()`` of a contiguous ``[N, K]`` weight is read in
    place); both bf16, fp16 or fp32, accumulated in fp32. ``out``: ``[M, N]`` of the same dtype, allocated when
    omitted. ``counters``: int32 with at least ``plan.num_groups`` elements, zero on entry; on exit entry ``g``
    equals ``plan.groups[g].tile_count``.

    ``scaling``: fp8 operands (``float8_e4m3fn`` / ``float8_e5m2``) and their scales (``Scaling``): ``out`` is then
    ``Scaling.out_dtype``. All-gather plans need ``wait`` (``GatherWait``): ``a`` is the gathered ``[M, K]`` buffer in
    the plan's layout.

    ``options``: ``use_tma`` forces or forbids TMA loads (default: where the strides allow); ``tma_store`` stores
    ``out`` through TMA where its strides allow (measured no faster than plain stores on an H200,
    benchmarks/results/logs/why-overlap-is-hard.md; off by default). The all-gather keywords ``flags``, ``rank``,
    ``wait_error``, ``max_spins`` are still taken in place of ``wait`` (its fields), for the callers written before it.
    """
    out, args, meta = launch_arguments(a, b, plan, out=out, counters=counters, scaling=scaling, wait=wait, **options)
    _LAUNCH(plan.grid_size, args, meta)
    return out


def _gather_wait(wait: GatherWait | None, options: dict) -> tuple[GatherWait | None, dict]:
    """``wait``, or one made of the old all-gather keywords in ``options``; and the launch switches left."""
    unknown = set(options) - _SWITCHES - _WAIT_KEYWORDS
    if unknown:
        raise TypeError(f"gemm: unknown keywords {sorted(unknown)}")
    old = {key: options[key] for key in _WAIT_KEYWORDS & set(options)}
    if old and wait is not None:
        raise TypeError(f"gemm: give wait=GatherWait(...) or its fields {sorted(old)}, not both")
    if old.get("flags") is not None:
        wait = GatherWait(**old)
    return wait, {key: options[key] for key in _SWITCHES & set(options)}


def _scaled_operands(a, b, scaling: Scaling | None, m: int, n: int, k: int, block_k: int):
    """The output dtype and the kernel's scale arguments: ``(out dtype, (scale_a, scale_b, bias), (stride_sam,
    stride_sak, stride_sbk, stride_sbn), constexprs)``."""
    fp8 = a.dtype in FP8_DTYPES or b.dtype in FP8_DTYPES
    if scaling is None:
        if fp8:
            raise ValueError(f"fp8 operands ({a.dtype}, {b.dtype}) need scaling=Scaling(scale_a, scale_b)")
        if a.dtype != b.dtype:
            raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
        return a.dtype, (None, None, None), (0, 0, 0, 0), dict(A_SCALE=NONE, B_SCALE=NONE, HAS_BIAS=False)
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"a scaled GEMM takes fp8 operands ({', '.join(map(str, FP8_DTYPES))}), got {a.dtype} and "
                         f"{b.dtype}")
    a_mode, b_mode = scaling.modes(m, n, k)
    if a_mode == BLOCKS and block_k != SCALE_BLOCK:
        raise ValueError(f"block-wise scales need the plan's block_k = {SCALE_BLOCK} (one K slab per scale), got "
                         f"{block_k}")
    sa, sb = scaling.scale_a, scaling.scale_b
    for name, t in (("scale_a", sa), ("scale_b", sb), ("bias", scaling.bias)):
        if t is not None and t.device != a.device:
            raise ValueError(f"Scaling.{name} is on {t.device}, the operands on {a.device}")
    # Per row of A: [M, 1] (stride 0 serves a broadcast view); per column of B: [1, N].
    strides = (sa.stride(0) if sa.ndim == 2 else 0, sa.stride(1) if a_mode == BLOCKS else 0,
               sb.stride(0) if b_mode == BLOCKS else 0, sb.stride(1) if sb.ndim == 2 else 0)
    bias = scaling.bias
    meta = dict(A_SCALE=a_mode, B_SCALE=b_mode, HAS_BIAS=bias is not None)
    return scaling.out_dtype, (sa, sb, bias), strides, meta


def launch_arguments(a, b, plan, *, out=None, counters=None, scaling=None, wait=None,
                     **options) -> tuple[torch.Tensor, tuple, dict]:
    """``gemm``'s checks and the kernel's arguments: ``(out, positional arguments, constexprs and launch
    options)``. The benchmark's sweeps launch the kernel with other loop forms from these (``bench/gemm_forms.py``)."""
    wait, switches = _gather_wait(wait, options)
    use_tma, tma_store = switches.get("use_tma"), bool(switches.get("tma_store", False))
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a and b must be 2-D, got a.ndim={a.ndim}, b.ndim={b.ndim}")
    m, k = a.shape
    k_b, n = b.shape
    if k != k_b:
        raise ValueError(f"a is [M, K] = {list(a.shape)} but b is [K, N] = {list(b.shape)}: K differs")
    if (m, n, k) != (plan.m, plan.n, plan.k):
        raise ValueError(f"plan is for (m, n, k) = {(plan.m, plan.n, plan.k)}, operands give {(m, n, k)}")
    t = plan.tile
    out_dtype, (scale_a, scale_b, bias), scale_strides, scale_meta = _scaled_operands(a, b, scaling, m, n, k,
                                                                                      t.block_k)
    is_wait = plan.op == "all_gather"
    flags = wait.flags if wait is not None else None
    if is_wait and (flags is None or flags.dtype != torch.int32 or flags.numel() < plan.num_groups):
        raise ValueError(f"an all-gather plan needs wait=GatherWait(flags): int32 with >= {plan.num_groups} "
                         "elements")
    max_spins = wait.max_spins if wait is not None else 0
    wait_error = wait.wait_error if wait is not None else None
    if max_spins and (wait_error is None or wait_error.dtype != torch.int32):
        raise ValueError("max_spins needs wait_error: an int32 tensor of one element")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != out_dtype:
        raise ValueError(f"out must be [{m}, {n}] {out_dtype}, got {list(out.shape)} {out.dtype}")
    signal = counters is not None
    if signal and (counters.dtype != torch.int32 or counters.numel() < plan.num_groups):
        raise ValueError(f"counters must be int32 with >= {plan.num_groups} elements")
    order, owner, row_table = plan_tables(plan, a.device, wait.rank if wait is not None else 0)
    row_map = plan.blocks > 1

    b_kmajor = b.stride(0) == 1 and b.stride(1) != 1  # b is w.t() of a row-major [N, K] weight
    b_stored = b.t() if b_kmajor else b
    if use_tma is None:
        use_tma = a.is_cuda and _tma_ok(a) and _tma_ok(b_stored)
    if use_tma:
        a_arg = TensorDescriptor.from_tensor(a, [t.block_m, t.block_k])
        b_block = [t.block_n, t.block_k] if b_kmajor else [t.block_k, t.block_n]
        b_arg = TensorDescriptor.from_tensor(b_stored, b_block)
    else:
        a_arg, b_arg = a, b
    # A TMA store writes whole tiles: a row-mapped tile would overwrite the next band's rows of the workspace.
    tma_store = bool(tma_store and use_tma and _tma_ok(out) and not row_map)
    c_arg = TensorDescriptor.from_tensor(out, [t.block_m, t.block_n]) if tma_store else out
    args = (
        a_arg,
        b_arg,
        c_arg,
        counters if signal else owner,  # an unused pointer when not signalling
        order,
        owner,
        row_table,
        flags if is_wait else owner,  # unused pointers when not waiting
        wait_error if max_spins else owner,
        owner if scale_a is None else scale_a,  # unused pointers when not scaled
        owner if scale_b is None else scale_b,
        owner if bias is None else bias,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        *scale_strides,
        plan.num_tiles,
        plan.tiles_n,
    )
    meta = dict(
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        USE_TMA=bool(use_tma),
        B_KMAJOR=bool(b_kmajor and use_tma),
        TMA_STORE=tma_store,
        SIGNAL=signal,
        BULK_WAIT=not guards.triton_interpreted(),
        ROW_MAP=row_map,
        WAIT=is_wait,
        MAX_SPINS=int(max_spins) if is_wait else 0,
        **scale_meta,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return out, args, meta
