"""The chunk mechanics and the grouped GEMMs that both fast expert paths (``comm/expert/nccl.py``,
``comm/expert/p2p.py``) run: a call's rows per (this rank, peer) pair (``Chunks``), the peers' rounds
(``pair_rounds``), each chunk's segments (``relative_ends``), the grouped GEMM of one chunk (``multiply_chunk``: the
Triton kernel, ``torch._grouped_mm`` or a ``torch.mm`` loop, as the plan says) and the hybrid GEMM (heavy experts a
``torch.mm`` per segment chunk by chunk, the light ones once over every chunk: ``light_multiplier``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from flashoverlap import guards
from flashoverlap.comm.expert.contract import ExpertPlan, HybridCut, Layout


@dataclass(frozen=True)
class Chunks:
    """Rows per (this rank, peer) pair of one call, host-known: ``send[d]`` rows go to rank ``d`` (dispatch's send
    buffer; combine's returned rows come back from ``d`` into the same places), ``recv[s]`` rows come from rank
    ``s`` (dispatch's receive buffer; combine's ``a``). Exact mode: the layout's splits, packed; bounded mode:
    ``bound`` each (whole slots)."""

    send: tuple[int, ...]
    recv: tuple[int, ...]

    @property
    def send_offsets(self) -> tuple[int, ...]:
        return offsets(self.send)

    @property
    def recv_offsets(self) -> tuple[int, ...]:
        return offsets(self.recv)

    @classmethod
    def of(cls, plan: ExpertPlan, layout: Layout) -> Chunks:
        if plan.mode == "exact":
            return cls(tuple(layout.send_splits), tuple(layout.recv_splits))
        whole = (plan.bound,) * plan.world_size
        return cls(whole, whole)


def offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return tuple(out)


def pair_rounds(rank: int, world: int) -> tuple[int | None, ...]:
    """This rank's peer in each round of a round-robin tournament over ``world`` ranks (the circle method: rank
    ``n - 1`` fixed, the others rotating), None where it sits the round out (``world`` odd). Symmetric: ``rank``
    meets ``p`` in round k exactly when ``p`` meets ``rank`` in round k."""
    n = world + world % 2  # odd: a phantom rank n - 1, whose partner idles
    rounds = []
    for k in range(n - 1):
        if rank == n - 1:
            partner = next(q for q in range(n - 1) if (2 * q) % (n - 1) == k % (n - 1))
        else:
            partner = (k - rank) % (n - 1)
            if partner == rank:
                partner = n - 1
        rounds.append(None if partner >= world else partner)
    return tuple(rounds)


def relative_ends(layout: Layout) -> torch.Tensor:
    """int32 ``[W, L]``: each received segment's end relative to its chunk's first row (the chunk's first segment
    starts there, also when it is empty): row ``s`` is chunk ``s``'s ``seg_ends`` for the grouped GEMM. Device-only
    (capturable)."""
    world, local = layout.world_size, layout.experts_per_rank
    ends = layout.recv_seg_ends.view(world, local)
    return (ends - layout.recv_seg_starts.view(world, local)[:, :1]).to(torch.int32)


def chunk_ends(cache: WeakTensorKeyDictionary, layout: Layout) -> tuple[torch.Tensor, ...]:
    """Each chunk's segment ends relative to its first row (``relative_ends``, one view per chunk). Exact mode: made
    once per layout and kept in ``cache`` (a communicator's, by the layout's segment ends, the tensor a layer's
    dispatch, combine and backward calls share) while the layout lives and its segment tensors are not written in
    place (their version counters), outside a capture (a tensor made inside one belongs to its graph's memory);
    bounded mode: per call, on the device, so that a graph holding the call reads the layout's tensors as they are at
    replay."""
    if layout.mode != "exact":
        return relative_ends(layout).unbind(0)
    ends_in, starts_in = layout.recv_seg_ends, layout.recv_seg_starts
    version = (ends_in._version, starts_in._version)
    kept = cache.get(ends_in)
    if kept is None or kept[0] != version:
        kept = (version, relative_ends(layout).unbind(0))
        if not guards.capturing(ends_in):
            cache[ends_in] = kept
    return kept[1]


# By the layout's segment ends: the tensor that a layer's dispatch, combine (``Layout.with_weights`` makes a new
# Layout around the same tensors) and backward calls share.
_HOST_ENDS = WeakTensorKeyDictionary()


def host_relative_ends(layout: Layout) -> list[list[int]]:
    """``relative_ends`` on the host, per chunk (exact mode only, which the per-segment ``torch.mm`` loop needs),
    kept while its tensors live: from the counts ``expert_layout`` read in its one synchronisation, or, for a layout
    without them (rebuilt from its tensors), one host synchronisation per layout."""
    ends = _HOST_ENDS.get(layout.recv_seg_ends)
    if ends is None:
        if layout.recv_counts_host is not None:  # exact mode: packed, each chunk's ends its counts' running sums
            ends = [list(itertools.accumulate(counts)) for counts in layout.recv_counts_host]
        else:
            ends = relative_ends(layout).tolist()
        _HOST_ENDS[layout.recv_seg_ends] = ends
    return ends


def chunk_gemm(plan: ExpertPlan, dtype: torch.dtype, device: torch.device, scales=None) -> str:
    """The grouped GEMM a chunk runs: the plan's, except where it cannot: cuBLAS's grouped GEMM takes bf16 rows of
    16-byte multiples only (else Triton). A plan without a choice (``gemm=None``, built outside the runtime): the
    per-segment loop in exact mode, Triton in bounded mode (the loop needs host sizes, which bounded mode never
    has; ``ExpertPlan`` refuses the pair). Off the GPU (the CPU tests) the Triton kernel runs only under the
    interpreter: a loop instead."""
    kind = plan.gemm if plan.gemm is not None else ("triton" if plan.mode == "bounded" else "loop")
    k, n = plan.gemm_shape
    if scales is not None:  # fp8 (comm/expert/scaled.py): the loop, torch._scaled_grouped_mm (row-wise) or Triton
        if kind == "hybrid":
            kind = "loop"
        if kind == "cublas" and (scales.mode != "row" or k % 16 or n % 16):
            kind = "triton" if device.type == "cuda" else "loop"
        if device.type != "cuda":  # torch._scaled_grouped_mm runs on CUDA only
            return "triton" if kind == "triton" and guards.triton_interpreted() else "loop"
        return kind
    if kind == "cublas" and (dtype != torch.bfloat16 or k % 8 or n % 8):
        kind = "triton"
    if device.type != "cuda":
        return kind if kind == "cublas" or guards.triton_interpreted() else "loop"
    return kind


@dataclass(frozen=True, eq=False)  # tensors: compared by identity
class ChunkGemm:
    """How one call multiplies its chunks (``multiply_chunk``): ``kind`` ``"triton"`` (``kernels.grouped_gemm``),
    ``"cublas"`` (``torch._grouped_mm``) or ``"loop"`` (``torch.mm`` per segment); the stacked weights ``w: [L, K,
    N]``; ``seg_expert``, int32 ``arange(L)``; ``workspace``, the Triton kernel's table (made per call when None);
    ``tail``: rows may lie past a chunk's last segment (bounded mode's padding), which cuBLAS's result must then
    mask to zero; ``only``: the experts the loop multiplies, the others left alone (the hybrid's heavy part)."""

    kind: str
    w: torch.Tensor
    seg_expert: torch.Tensor
    workspace: torch.Tensor | None = None
    tail: bool = True
    only: frozenset[int] | None = None


def multiply_chunk(gemm: ChunkGemm, x: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                   host_ends: list[int] | None = None) -> None:
    """``out[rows of l] = x[rows of l] @ gemm.w[l]`` for the ``L`` segments of one chunk (``ends``: int32 ``[L]``
    relative to ``x``'s first row, on the device; ``host_ends``: the same on the host, which the loop needs on the
    GPU), fp32 accumulation, the way ``gemm`` says. Rows past ``ends[-1]`` are not written, except by cuBLAS, which
    writes them zero."""
    rows, kind, w = x.shape[0], gemm.kind, gemm.w
    if rows == 0:
        return
    if kind == "triton":
        from flashoverlap.kernels.grouped_gemm import GroupedLaunch, Segments, grouped_gemm  # Triton: where it runs

        grouped_gemm(x, w, Segments(ends, gemm.seg_expert), out=out, workspace=gemm.workspace,
                     launch=GroupedLaunch(max_rows=rows))
    elif kind == "cublas":
        product = torch._grouped_mm(x, w, offs=ends)
        if gemm.tail:  # rows past the last segment are undefined in its result; here they are padding, zero
            # (compared in the ends' int32: no conversion kernel; torch 2.11's torch.where takes no scalar in its
            # out= form, hence the fill and the copy)
            product.masked_fill_(torch.arange(rows, dtype=ends.dtype, device=x.device)[:, None] >= ends[-1:], 0)
        out.copy_(product)
    else:
        if host_ends is None:
            if x.device.type == "cuda":
                raise ValueError("multiply_chunk: the loop GEMM needs the segment ends on the host (host_ends)")
            host_ends = ends.tolist()
        start, only = 0, gemm.only
        for expert, end in enumerate(host_ends):
            if end > start and (only is None or expert in only):
                torch.mm(x[start:end], w[expert], out=out[start:end])
            start = max(start, end)


# The hybrid GEMM (``ExpertPlan.gemm == "hybrid"``, exact mode; ``ExpertPlan.hybrid`` its ``HybridCut``, chosen by
# ``tune/grouped.py``). An expert whose rows, summed over the sources, reach ``heavy_rows`` is *heavy*: its rows are
# multiplied chunk by chunk as they land, a ``torch.mm`` per (source, expert) segment (compute-bound: the weights are
# read again per source at little cost). The others are *light*: their time is spent streaming their weights, so
# each runs once over every source's rows, in one Triton launch whose tiles take an expert's rows from every chunk
# through a row map (``Segments.row_map``): dispatch runs it once every chunk has landed, combine before any chunk
# leaves. The light launch takes the flattened persistent tile where the light experts average at least
# ``light_flat_rows`` rows, the default tile below it.


def hybrid_split(layout: Layout, heavy_rows: int) -> tuple[frozenset[int], list[int], list[int]]:
    """The heavy experts (rows summed over the sources >= ``heavy_rows``), the light ones with rows, and every
    expert's rows, by the layout's host sizes (``host_relative_ends``: exact mode)."""
    per_expert = [0] * layout.experts_per_rank
    for ends in host_relative_ends(layout):
        start = 0
        for expert, end in enumerate(ends):
            per_expert[expert] += max(end - start, 0)
            start = max(start, end)
    heavy = frozenset(e for e, rows in enumerate(per_expert) if rows >= heavy_rows)
    return heavy, [e for e, rows in enumerate(per_expert) if rows and e not in heavy], per_expert


# The hybrid's split of a layout, by its segment ends (one layer's dispatch, combine and backward calls share it):
# (the heavy_rows it was cut at, the heavy experts, the light experts' tables). Both parts read the same entry, so
# that every expert runs in exactly one of them, also where calls on the layout cut it at another threshold.
_HYBRID = WeakTensorKeyDictionary()


def hybrid_parts(layout: Layout, heavy_rows: int
                 ) -> tuple[frozenset[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """The heavy experts and the light experts' tables (``light_tables``) of ``layout`` cut at ``heavy_rows``, made
    once per layout and threshold."""
    cached = _HYBRID.get(layout.recv_seg_ends)
    if cached is None or cached[0] != heavy_rows:
        heavy, light, per_expert = hybrid_split(layout, heavy_rows)
        cached = _HYBRID[layout.recv_seg_ends] = (heavy_rows, heavy,
                                                  _light_tables(layout, light, per_expert, heavy_rows))
    return cached[1], cached[2]


def light_tables(layout: Layout, heavy_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """For the light experts (``hybrid_split``), on the device: the row map (int32: for each light expert in turn,
    its rows from every source in source order, as rows of the receive layout), each expert's end among the mapped
    rows (int32) and the experts (int32); None where no expert is light. Made on the device from the layout's
    segment tensors, sized by its host sizes: no synchronisation. Kept with the heavy set (``hybrid_parts``)."""
    return hybrid_parts(layout, heavy_rows)[1]


def _light_tables(layout: Layout, light: list[int], per_expert: list[int], heavy_rows: int):
    tables = None
    if light:
        world, local, device = layout.world_size, layout.experts_per_rank, layout.recv_seg_ends.device
        # The light experts' numbers are made on the device from its own counts: the host list copied there
        # (``torch.tensor(light, device=...)``, a pageable copy) waits for all the work queued on the stream, so a
        # layer whose routing changes every call (training) stalled its host on the GPU once a call. A stable sort
        # puts the light experts first, in order; how many there are is the host's count (the same counts).
        counts = layout.recv_counts.view(world, local)  # rows per (source, local expert)
        rows = counts.sum(0)
        is_light = (rows > 0) & (rows < heavy_rows)
        pick = torch.sort((~is_light).to(torch.uint8), stable=True).indices[:len(light)]
        starts = layout.recv_seg_starts.view(world, local).index_select(1, pick).t().reshape(-1).to(torch.int64)
        sizes = counts.index_select(1, pick).t().reshape(-1).to(torch.int64)
        total = sum(per_expert[e] for e in light)
        first = torch.cumsum(sizes, 0) - sizes  # each segment's first mapped row
        row_map = (torch.repeat_interleave(starts - first, sizes, output_size=total)
                   + torch.arange(total, dtype=torch.int64, device=device)).to(torch.int32)
        ends = torch.cumsum(sizes.view(len(light), world).sum(1), 0).to(torch.int32)
        tables = (row_map, ends, pick.to(torch.int32))
    return tables


def _light_flat(row_map: torch.Tensor, experts: torch.Tensor, cut: HybridCut) -> bool:
    """Whether the light launch takes the flattened persistent tile (``cut.light_flat_rows``)."""
    return row_map.numel() >= cut.light_flat_rows * experts.numel()


def light_variant(plan: ExpertPlan, layout: Layout, b: torch.Tensor) -> tuple | None:
    """What the light launch's compiled kernels depend on besides the tensors' addresses (its tile, its table size,
    the integer arguments Triton specialises: 1 or a multiple of 16), or None where no expert is light (or the plan
    is not the hybrid): a path that queues the launch behind flag waits loads each variant once before (deadlock
    rule 3)."""
    if plan.hybrid is None:
        return None
    tables = light_tables(layout, plan.hybrid.heavy_rows)
    if tables is None:
        return None
    row_map, _, experts = tables
    ints = (row_map.numel(), experts.numel(), layout.recv_rows)
    return (_light_flat(row_map, experts, plan.hybrid), experts.numel().bit_length(),
            tuple((v == 1, v % 16 == 0) for v in ints), b.dtype, tuple(b.shape), b.stride())


def light_multiplier(kind: str, plan: ExpertPlan, layout: Layout, b: torch.Tensor):
    """``light(x, out)``: the hybrid's light experts (``plan.hybrid``), every source's rows at once: ``out[rows] =
    x[rows] @ b[expert]`` for the rows of the receive layout the row map names (``x`` and ``out`` hold every chunk in
    the receive layout), on the current stream. None for another ``kind``, or where no expert is light."""
    if kind != "hybrid":
        return None
    tables = light_tables(layout, plan.hybrid.heavy_rows)
    if tables is None:
        return None
    from flashoverlap.kernels.grouped_gemm import (  # Triton: imported where a kernel runs
        TILE_FLAT,
        GroupedLaunch,
        Segments,
        grouped_gemm,
        workspace_size,
    )

    row_map, ends, experts = tables
    workspace = torch.empty(workspace_size(experts.numel()), dtype=torch.int32, device=b.device)
    launch = GroupedLaunch(max_rows=row_map.numel(),
                           tile=TILE_FLAT if _light_flat(row_map, experts, plan.hybrid) else None)  # None: default
    segments = Segments(ends, experts, row_map=row_map)

    def light(x: torch.Tensor, out: torch.Tensor) -> None:
        grouped_gemm(x, b, segments, out=out, workspace=workspace, launch=launch)

    return light


def chunk_multiplier(kind: str, plan: ExpertPlan, layout: Layout, b: torch.Tensor, seg_expert: torch.Tensor,
                     ends=None, scales=None):
    """``multiply(chunk, x, x_row, out, out_row, rows)``: chunk ``chunk``'s segments of ``x`` (from row ``x_row``)
    times their experts' ``b[l]`` into ``out`` (from row ``out_row``), on the current stream (``multiply_chunk``);
    nothing for no rows; the hybrid: its heavy experts' segments only (``light_multiplier`` runs the rest). The
    chunks' relative ends (``ends[chunk]``: ``relative_ends(layout)`` unless a caller keeps them) and the Triton
    kernel's table are made once per call. fp8 (``scales``, ``comm/expert/scaled.py``): ``x`` is packed rows (uint8)
    or fp8 rows whose scales are ``scales.a`` by the same row numbers; ``out`` in the output dtype."""
    ends = relative_ends(layout) if ends is None else ends
    workspace = None
    if kind == "triton":  # the kernel's table, one for the call's chunks (they run one after another on a stream)
        from flashoverlap.kernels.grouped_gemm import workspace_size  # Triton: imported where a kernel runs

        workspace = torch.empty(workspace_size(layout.experts_per_rank), dtype=torch.int32, device=b.device)
    if scales is not None:
        return _scaled_multiplier(kind, plan, layout, b, ends, scales, seg_expert, workspace)
    only = None
    if kind == "hybrid":
        kind, only = "loop", hybrid_parts(layout, plan.hybrid.heavy_rows)[0]
    host = host_relative_ends(layout) if kind == "loop" and plan.mode == "exact" else None
    gemm = ChunkGemm(kind, b, seg_expert, workspace, tail=plan.mode == "bounded", only=only)

    def multiply(chunk: int, x: torch.Tensor, x_row: int, out: torch.Tensor, out_row: int, rows: int) -> None:
        if rows:
            multiply_chunk(gemm, x[x_row : x_row + rows], ends[chunk], out[out_row : out_row + rows],
                           None if host is None else host[chunk])

    return multiply


def _scaled_multiplier(kind: str, plan: ExpertPlan, layout: Layout, b: torch.Tensor, ends, scales,
                       seg_expert: torch.Tensor | None, workspace: torch.Tensor | None):
    """``chunk_multiplier`` for fp8 rows (``scaled.scaled_multiply``); ``seg_expert`` the Triton kernel's experts
    (``arange(L)``, the communicator's table: made once, not per call), ``workspace`` its table (``"triton"``)."""
    from flashoverlap.comm.expert.scaled import scaled_multiply, segment_rows

    host = host_relative_ends(layout) if kind == "loop" and plan.mode == "exact" else None
    k = b.shape[1]

    def multiply(chunk: int, x: torch.Tensor, x_row: int, out: torch.Tensor, out_row: int, rows: int) -> None:
        if rows:
            data, scale = segment_rows(x, scales, k, x_row, rows)
            scaled_multiply(kind, data, scale, b, scales, ends[chunk], out[out_row : out_row + rows],
                            None if host is None else host[chunk], seg_expert=seg_expert, workspace=workspace)

    return multiply


def segment_table(tables: dict, world: int, local: int, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The constant int32 tables of a (world, local experts, rank), kept in ``tables``: ``expert`` (``arange(L)``,
    one chunk's ``seg_expert``), ``all_experts`` (every segment's local expert), ``signal`` (every segment's
    destination), ``priority`` (every segment's destination's round in ``pair_rounds``, the own rank last)."""
    key = (world, local, rank, device)
    table = tables.get(key)
    if table is None:
        guards.refuse_inside_capture("the expert communicators' first call of a shape makes their tables")
        order = [p for p in pair_rounds(rank, world) if p is not None] + [rank]
        rank_priority = [order.index(s) for s in range(world)]
        expert = torch.arange(local, dtype=torch.int32, device=device)
        table = tables[key] = {
            "expert": expert,
            "all_experts": expert.repeat(world),
            "signal": torch.arange(world, dtype=torch.int32, device=device).repeat_interleave(local),
            "priority": torch.tensor(rank_priority, dtype=torch.int32, device=device).repeat_interleave(local),
        }
    return table
