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
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError as exc:  # a CPU install has no Triton; only the GPU paths need it
    raise ImportError(
        f"flashoverlap's GPU kernels need Triton (>= 3.3, with tensor descriptors): pip install 'flashoverlap[gpu]' "
        f"({exc})") from exc

from flashoverlap.plan import Plan

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            # Out-of-range rows, columns and K are zero-filled by the copy engine.
            for kk in tl.range(k_tiles, warp_specialize=WARP_SPECIALIZE):
                a_tile = a.load([off_m, kk * BLOCK_K])
                if B_KMAJOR:
                    acc = tl.dot(a_tile, b.load([off_n, kk * BLOCK_K]).T, acc)
                else:
                    acc = tl.dot(a_tile, b.load([kk * BLOCK_K, off_n]), acc)
        else:
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            # Clamp out-of-range rows/columns to a valid address; their results are masked at the store.
            offs_m = tl.where(offs_m < M, offs_m, 0)
            offs_n = tl.where(offs_n < N, offs_n, 0)
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = a + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
            for kk in range(k_tiles):
                k_left = K - kk * BLOCK_K
                a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b_tile = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                acc = tl.dot(a_tile, b_tile, acc)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
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


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    plan: Plan,
    *,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    use_tma: bool | None = None,
    flags: torch.Tensor | None = None,
    rank: int = 0,
    wait_error: torch.Tensor | None = None,
    max_spins: int = 0,
    tma_store: bool = False,
) -> torch.Tensor:
    """``out = a @ b`` following ``plan``'s tile order; with ``counters``, each tile's group counter is bumped.

    For a row-mapped plan (``plan.blocks > 1``: reduce-scatter) ``out`` is the ``[M, N]`` workspace and row
    ``Plan.tile_rows`` decide where each tile's rows land (see ``Plan.groups``), not row-major ``a @ b``.

    ``a``: ``[M, K]``; ``b``: ``[K, N]`` (any strides; ``w.t()`` of a contiguous ``[N, K]`` weight is read in
    place); both bf16, fp16 or fp32, accumulated in fp32. ``out``: ``[M, N]`` of the same dtype, allocated when
    omitted. ``counters``: int32 with at least ``plan.num_groups`` elements, zero on entry; on exit entry ``g``
    equals ``plan.groups[g].tile_count``. ``use_tma``: force or forbid TMA loads (default: where the strides allow).

    ``tma_store``: store ``out`` through TMA where its strides allow (measured no faster than plain stores on an
    H200, benchmarks/results/logs/why-overlap-is-hard.md; off by default).

    All-gather plans: ``a`` is the gathered ``[M, K]`` buffer in the plan's layout; ``rank`` picks the tile
    order (own shard first); every tile of group ``g`` waits until ``flags[g] != 0``. With ``max_spins`` a wait
    gives up after that many polls and writes ``1 + g`` to ``wait_error`` (int32, one element) instead of
    hanging: the result is then wrong and the caller must raise.
    """
    out, args, meta = launch_arguments(a, b, plan, out=out, counters=counters, use_tma=use_tma, flags=flags,
                                       rank=rank, wait_error=wait_error, max_spins=max_spins, tma_store=tma_store)
    signalling_gemm_kernel[(plan.grid_size,)](*args, **meta)
    return out


def launch_arguments(a, b, plan, *, out=None, counters=None, use_tma=None, flags=None, rank=0, wait_error=None,
                     max_spins=0, tma_store=False) -> tuple[torch.Tensor, tuple, dict]:
    """``gemm``'s checks and the kernel's arguments: ``(out, positional arguments, constexprs and launch
    options)``. The benchmark's sweeps launch the kernel with other loop forms from these (``bench/gemm_forms.py``)."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a and b must be 2-D, got a.ndim={a.ndim}, b.ndim={b.ndim}")
    m, k = a.shape
    k_b, n = b.shape
    if k != k_b:
        raise ValueError(f"a is [M, K] = {list(a.shape)} but b is [K, N] = {list(b.shape)}: K differs")
    if (m, n, k) != (plan.m, plan.n, plan.k):
        raise ValueError(f"plan is for (m, n, k) = {(plan.m, plan.n, plan.k)}, operands give {(m, n, k)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
    wait = plan.op == "all_gather"
    if wait and (flags is None or flags.dtype != torch.int32 or flags.numel() < plan.num_groups):
        raise ValueError(f"an all-gather plan needs flags: int32 with >= {plan.num_groups} elements")
    if max_spins and (wait_error is None or wait_error.dtype != torch.int32):
        raise ValueError("max_spins needs wait_error: an int32 tensor of one element")
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != a.dtype:
        raise ValueError(f"out must be [{m}, {n}] {a.dtype}, got {list(out.shape)} {out.dtype}")
    signal = counters is not None
    if signal and (counters.dtype != torch.int32 or counters.numel() < plan.num_groups):
        raise ValueError(f"counters must be int32 with >= {plan.num_groups} elements")
    order, owner, row_table = plan_tables(plan, a.device, rank)
    row_map = plan.blocks > 1

    b_kmajor = b.stride(0) == 1 and b.stride(1) != 1  # b is w.t() of a row-major [N, K] weight
    b_stored = b.t() if b_kmajor else b
    if use_tma is None:
        use_tma = a.is_cuda and _tma_ok(a) and _tma_ok(b_stored)
    t = plan.tile
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
        flags if wait else owner,  # unused pointers when not waiting
        wait_error if max_spins else owner,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
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
        BULK_WAIT=not _INTERPRETED,
        ROW_MAP=row_map,
        WAIT=wait,
        MAX_SPINS=int(max_spins) if wait else 0,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return out, args, meta
