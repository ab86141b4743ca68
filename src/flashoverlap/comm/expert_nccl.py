"""The NCCL expert communicator (path ``"nccl"``): dispatch and combine (``comm/expert.py``) with plain NCCL
send/recv per peer on a high-priority stream, overlapped with the experts' grouped GEMMs. It works wherever NCCL
does: across nodes, and through host memory (PCIe machines, ``NCCL_P2P_DISABLE=1``). Also the chunk mechanics
that both fast expert paths share (``Chunks``, ``pair_rounds``, ``relative_ends``, ``multiply_chunk``).

Chunks. A call moves one *chunk* of rows per (source, destination) pair: in exact mode the layout's host split sizes
(``send_splits``/``recv_splits``, rows packed), in bounded mode whole ``bound``-row slots (padding included: NCCL
needs sizes the host knows, and the bounded mode never asks the device). Dispatch's receive buffer holds chunk ``s``
(rows from rank ``s``) at ``recv_offsets[s]``; its segments ``(s, l)`` are that chunk's rows for local expert ``l``.
Combine's input ``a`` has dispatch's layout, so its chunk ``d`` is what goes back to rank ``d``, and its returned
rows land in the send layout, chunk ``s`` (from rank ``s``) at ``send_offsets[s]``.

Rounds (``pair_rounds``): the ``W - 1`` peers are met one per round, in the rounds of a round-robin tournament (the
circle method; with ``W`` odd, one rank sits each round out), and each round is ONE group of NCCL operations with
that peer (``batch_isend_irecv``: the send to it and the receive from it). **Why this cannot deadlock**: NCCL runs one
rank's groups one after another, in issue order; the pairing is symmetric (r meets p in round k exactly when p meets
r in round k), so if every rank has finished its rounds before k, round k's group on r is matched by the group p
issues in the same round, and nothing else in it can be missing. The only other thing the communication stream
waits on is the GEMM's rows for that peer (combine), and the GEMM, launched before any of these waits (deadlock rule
1), waits on nothing. By induction over k every round completes. The host issues the rounds in the same order on
every rank, so the same holds with one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``): every wait sits behind
the work that satisfies it. The NCCL kernels and the peer connections are loaded by a warm-up exchange on the
first call (deadlock rule 3), outside any wait and outside any capture.

One dispatch, on the caller's stream ``C`` and the communication stream ``S``:

1. ``C`` gathers the send buffer (``send_buffer``); ``S`` waits for it, then runs the rounds, each followed by an
   event ``arrived[p]``.
2. ``C`` multiplies the own chunk at once (straight from the send buffer), runs the hook, then for each peer in
   round order waits for ``arrived[p]`` (a stream wait on an event: no SM spins) and multiplies chunk ``p``.
3. ``C`` joins ``S``. With the hybrid GEMM (exact mode, ``light_multiplier``), the chunks' multiplications cover
   the heavy experts only; the own chunk is also copied among the received rows (before its GEMM), and ``C``
   multiplies every source's rows of the light experts in one launch after the join.

One combine, own rank's chunk LAST: the own rows need no transfer, so computing them last hides the last peer's
transfer behind them, and every peer's rows leave as early as possible (FlashOverlap's order).

- exact mode with the Triton GEMM (FlashOverlap's design): one signalling launch of ``kernels.grouped_gemm`` over
  all of ``a``, segments prioritised by their destination's round (own last), one flag per destination; ``S`` waits
  for each destination's flag with ``cuStreamWaitValue32`` (zero SMs), resets it, then sends. The launch runs one
  program per tile, so that NCCL's CTAs get SMs as the GEMM's programs retire (a persistent GEMM holding every SM
  starves NCCL until it ends: docs/design.md). Every flag, the own one included, is waited for and reset on
  ``S``, so that every flag is 0 before the next call's GEMM sets it (a stale 1 would let a send go early).
- otherwise (bounded mode, whose gaps between slots the kernel cannot skip yet; the cuBLAS, loop and hybrid GEMMs):
  one GEMM per destination in round order on ``C``, each followed by an event that ``S`` waits for before that
  round. The hybrid first multiplies every destination's rows of the light experts in one launch (before any
  event), then the heavy ones per destination; the own chunk's rows then go from ``y`` to the returned rows.

The origin's weighted sum (``combine_at_origin``) runs on ``C`` after ``C`` joins ``S``.

With ``FLASHOVERLAP_DEBUG_TIMEOUT`` (``call.timeout``), an event after each round is polled with a deadline; a round
that does not finish in time raises an error naming the rank, the op, the group and the peer.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.weak import WeakTensorKeyDictionary

from flashoverlap import guards
from flashoverlap.comm import stream_ops
from flashoverlap.comm.expert import ExpertCall, ExpertPlan, Layout, combine_at_origin, send_buffer
from flashoverlap.comm.protocol import CommGroup, GroupFields

# -- the chunk mechanics both fast expert paths share ----------------------------------------------------------


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
        return _offsets(self.send)

    @property
    def recv_offsets(self) -> tuple[int, ...]:
        return _offsets(self.recv)

    @classmethod
    def of(cls, plan: ExpertPlan, layout: Layout) -> Chunks:
        if plan.mode == "exact":
            return cls(tuple(layout.send_splits), tuple(layout.recv_splits))
        whole = (plan.bound,) * plan.world_size
        return cls(whole, whole)


def _offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
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


# By the layout's segment ends: the tensor that a layer's dispatch, combine (``Layout.with_weights`` makes a new
# Layout around the same tensors) and backward calls share.
_HOST_ENDS = WeakTensorKeyDictionary()


def host_relative_ends(layout: Layout) -> list[list[int]]:
    """``relative_ends`` on the host, per chunk: one host synchronisation per layer's layout (exact mode only,
    which the per-segment ``torch.mm`` loop needs), kept while its tensors live."""
    ends = _HOST_ENDS.get(layout.recv_seg_ends)
    if ends is None:
        ends = _HOST_ENDS[layout.recv_seg_ends] = relative_ends(layout).tolist()
    return ends


def chunk_gemm(plan: ExpertPlan, dtype: torch.dtype, device: torch.device) -> str:
    """The grouped GEMM a chunk runs: the plan's, except where it cannot: cuBLAS's grouped GEMM takes bf16 rows of
    16-byte multiples only (else Triton). A plan without a choice (``gemm=None``, built outside the runtime): the
    per-segment loop in exact mode, Triton in bounded mode (the loop needs host sizes, which bounded mode never
    has; ``ExpertPlan`` refuses the pair). Off the GPU (the CPU tests) the Triton kernel runs only under the
    interpreter: a loop instead."""
    kind = plan.gemm if plan.gemm is not None else ("triton" if plan.mode == "bounded" else "loop")
    k, n = plan.gemm_shape
    if kind == "cublas" and (dtype != torch.bfloat16 or k % 8 or n % 8):
        kind = "triton"
    if device.type != "cuda":
        return kind if kind == "cublas" or os.environ.get("TRITON_INTERPRET") == "1" else "loop"
    return kind


def multiply_chunk(kind: str, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                   seg_expert: torch.Tensor, *, host_ends: list[int] | None = None,
                   workspace: torch.Tensor | None = None, tail: bool = True,
                   only: frozenset[int] | None = None) -> None:
    """``out[rows of l] = x[rows of l] @ w[l]`` for the ``L`` segments of one chunk (``ends``: int32 ``[L]``
    relative to ``x``'s first row, on the device; ``seg_expert``: int32 ``arange(L)``), fp32 accumulation. Rows
    past ``ends[-1]`` are not written, except by cuBLAS, which writes them zero. ``kind``: ``"triton"``
    (``kernels.grouped_gemm``), ``"cublas"`` (``torch._grouped_mm``), ``"loop"`` (``torch.mm`` per segment;
    ``host_ends`` the same ends on the host, read from ``ends`` off the GPU; ``only``: the experts it multiplies,
    the others left alone: the hybrid's heavy part). ``tail=False``: the segments cover every row (exact mode's
    chunks), so cuBLAS's result needs no mask."""
    rows = x.shape[0]
    if rows == 0:
        return
    if kind == "triton":
        from flashoverlap.kernels.grouped_gemm import grouped_gemm  # Triton: imported where a kernel runs

        grouped_gemm(x, w, ends, seg_expert, out=out, order="heavy-first", max_rows=rows, workspace=workspace)
    elif kind == "cublas":
        product = torch._grouped_mm(x, w, offs=ends)
        if tail:  # rows past the last segment are undefined in its result; here they are padding, zero
            # (compared in the ends' int32: no conversion kernel; torch 2.11's torch.where takes no scalar in its
            # out= form, hence the fill and the copy)
            product.masked_fill_(torch.arange(rows, dtype=ends.dtype, device=x.device)[:, None] >= ends[-1:], 0)
        out.copy_(product)
    else:
        if host_ends is None:
            if x.device.type == "cuda":
                raise ValueError("multiply_chunk: the loop GEMM needs the segment ends on the host (host_ends)")
            host_ends = ends.tolist()
        start = 0
        for expert, end in enumerate(host_ends):
            if end > start and (only is None or expert in only):
                torch.mm(x[start:end], w[expert], out=out[start:end])
            start = max(start, end)


# The hybrid GEMM (``ExpertPlan.gemm == "hybrid"``, exact mode). An expert whose rows, summed over the sources, reach
# HEAVY_ROWS is *heavy*: its rows are multiplied chunk by chunk as they land, a ``torch.mm`` per (source, expert)
# segment (compute-bound: the weights are read again per source at little cost). The others are *light*: their
# time is spent streaming their weights, so each runs once over every source's rows, in one Triton launch whose
# tiles take an expert's rows from every chunk through a row map (``grouped_gemm(row_map=...)``): dispatch runs it
# once every chunk has landed, combine before any chunk leaves. Measured on one H200 at the DeepSeek-like slice
# (benchmarks/results/logs/issue20/moe-skew-streams-347ba74380.json): 1.23x / 1.21x torch._grouped_mm (up / down)
# with Zipf(1.2) routing, 0.97x / 0.96x balanced, against 0.90 / 0.93 and 0.74 / 0.74 per source chunk.
HEAVY_ROWS = 1024
# The light launch's tile: the flattened persistent loop where the light experts average at least this many rows (two
# full tile rows each: balanced DeepSeek-like, 0.996x / 0.987x torch._grouped_mm up / down against 0.954x / 0.945x
# with the default tile), the default tile below it (Zipf(1.2): 2-10% faster than the flattened loop there):
# benchmarks/results/logs/issue20/light-tiles-34c87d6c18.json.
LIGHT_FLAT_ROWS = 256


def hybrid_split(layout: Layout) -> tuple[frozenset[int], list[int], list[int]]:
    """The heavy experts (rows summed over the sources >= ``HEAVY_ROWS``), the light ones with rows, and every
    expert's rows, by the layout's host sizes (``host_relative_ends``: exact mode)."""
    per_expert = [0] * layout.experts_per_rank
    for ends in host_relative_ends(layout):
        start = 0
        for expert, end in enumerate(ends):
            per_expert[expert] += max(end - start, 0)
            start = max(start, end)
    heavy = frozenset(e for e, rows in enumerate(per_expert) if rows >= HEAVY_ROWS)
    return heavy, [e for e, rows in enumerate(per_expert) if rows and e not in heavy], per_expert


# The hybrid's split of a layout, by its segment ends (one layer's dispatch, combine and backward calls share it):
# (HEAVY_ROWS it was cut at, the heavy experts, the light experts' tables). Both parts read the same entry, so that
# every expert runs in exactly one of them, also if HEAVY_ROWS changes while the layout lives.
_HYBRID = WeakTensorKeyDictionary()


def hybrid_parts(layout: Layout) -> tuple[frozenset[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """The heavy experts and the light experts' tables (``light_tables``) of ``layout`` at today's ``HEAVY_ROWS``,
    made once per layout and threshold."""
    cached = _HYBRID.get(layout.recv_seg_ends)
    if cached is None or cached[0] != HEAVY_ROWS:
        heavy, light, per_expert = hybrid_split(layout)
        cached = _HYBRID[layout.recv_seg_ends] = (HEAVY_ROWS, heavy, _light_tables(layout, light, per_expert))
    return cached[1], cached[2]


def light_tables(layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """For the light experts (``hybrid_split``), on the device: the row map (int32: for each light expert in turn,
    its rows from every source in source order, as rows of the receive layout), each expert's end among the mapped
    rows (int32) and the experts (int32); None where no expert is light. Made on the device from the layout's
    segment tensors, sized by its host sizes: no synchronisation. Kept with the heavy set (``hybrid_parts``)."""
    return hybrid_parts(layout)[1]


def _light_tables(layout: Layout, light: list[int], per_expert: list[int]):
    tables = None
    if light:
        world, local, device = layout.world_size, layout.experts_per_rank, layout.recv_seg_ends.device
        pick = torch.tensor(light, dtype=torch.int64, device=device)
        starts = layout.recv_seg_starts.view(world, local).index_select(1, pick).t().reshape(-1).to(torch.int64)
        sizes = layout.recv_counts.view(world, local).index_select(1, pick).t().reshape(-1).to(torch.int64)
        total = sum(per_expert[e] for e in light)
        first = torch.cumsum(sizes, 0) - sizes  # each segment's first mapped row
        row_map = (torch.repeat_interleave(starts - first, sizes, output_size=total)
                   + torch.arange(total, dtype=torch.int64, device=device)).to(torch.int32)
        ends = torch.cumsum(sizes.view(len(light), world).sum(1), 0).to(torch.int32)
        tables = (row_map, ends, pick.to(torch.int32))
    return tables


def _light_flat(row_map: torch.Tensor, experts: torch.Tensor) -> bool:
    """Whether the light launch takes the flattened persistent tile (``LIGHT_FLAT_ROWS``)."""
    return row_map.numel() >= LIGHT_FLAT_ROWS * experts.numel()


def light_variant(layout: Layout, b: torch.Tensor) -> tuple | None:
    """What the light launch's compiled kernels depend on besides the tensors' addresses (its tile, its table size,
    the integer arguments Triton specialises: 1 or a multiple of 16), or None where no expert is light: a path that
    queues the launch behind flag waits loads each variant once before (deadlock rule 3)."""
    tables = light_tables(layout)
    if tables is None:
        return None
    row_map, _, experts = tables
    ints = (row_map.numel(), experts.numel(), layout.recv_rows)
    return (_light_flat(row_map, experts), experts.numel().bit_length(),
            tuple((v == 1, v % 16 == 0) for v in ints), b.dtype, tuple(b.shape), b.stride())


def light_multiplier(kind: str, layout: Layout, b: torch.Tensor):
    """``light(x, out)``: the hybrid's light experts (``HEAVY_ROWS``), every source's rows at once: ``out[rows] =
    x[rows] @ b[expert]`` for the rows of the receive layout the row map names (``x`` and ``out`` hold every chunk in
    the receive layout), on the current stream. None for another ``kind``, or where no expert is light."""
    if kind != "hybrid":
        return None
    tables = light_tables(layout)
    if tables is None:
        return None
    from flashoverlap.kernels.grouped_gemm import TILE_FLAT, grouped_gemm, workspace_size  # Triton: where it runs

    row_map, ends, experts = tables
    workspace = torch.empty(workspace_size(experts.numel()), dtype=torch.int32, device=b.device)
    tile = TILE_FLAT if _light_flat(row_map, experts) else None  # None: default_tile

    def light(x: torch.Tensor, out: torch.Tensor) -> None:
        grouped_gemm(x, b, ends, experts, out=out, row_map=row_map, max_rows=row_map.numel(), workspace=workspace,
                     tile=tile)

    return light


def chunk_multiplier(kind: str, plan: ExpertPlan, layout: Layout, b: torch.Tensor, seg_expert: torch.Tensor,
                     ends=None):
    """``multiply(chunk, x, x_row, out, out_row, rows)``: chunk ``chunk``'s segments of ``x`` (from row ``x_row``)
    times their experts' ``b[l]`` into ``out`` (from row ``out_row``), on the current stream (``multiply_chunk``);
    nothing for no rows; the hybrid: its heavy experts' segments only (``light_multiplier`` runs the rest). The
    chunks' relative ends (``ends[chunk]``: ``relative_ends(layout)`` unless a caller keeps them) and the Triton
    kernel's table are made once per call."""
    ends = relative_ends(layout) if ends is None else ends
    only = None
    if kind == "hybrid":
        kind, only = "loop", hybrid_parts(layout)[0]
    host = host_relative_ends(layout) if kind == "loop" and plan.mode == "exact" else None
    workspace = None
    if kind == "triton":
        from flashoverlap.kernels.grouped_gemm import workspace_size  # Triton: imported where a kernel runs

        workspace = torch.empty(workspace_size(layout.experts_per_rank), dtype=torch.int32, device=b.device)
    tail = plan.mode == "bounded"

    def multiply(chunk: int, x: torch.Tensor, x_row: int, out: torch.Tensor, out_row: int, rows: int) -> None:
        if rows:
            multiply_chunk(kind, x[x_row : x_row + rows], b, ends[chunk], out[out_row : out_row + rows], seg_expert,
                           host_ends=None if host is None else host[chunk], workspace=workspace, tail=tail,
                           only=only)

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


# -- the communicator -------------------------------------------------------------------------------------------


class ExpertNcclCommunicator(GroupFields):
    """A high-priority stream, one flag per destination, and the peers' rounds for one (process group, device);
    see the module docstring."""

    path = "nccl"

    def __init__(self, group: CommGroup) -> None:
        super().__init__(group)
        self.comm_stream = guards.comm_stream(self.device)
        # flags[d]: destination d's rows of the signalling GEMM are stored (exactly 1); 0 between calls.
        self.flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        self.rounds = pair_rounds(self.rank, self.world_size)
        self._tables: dict = {}
        self._comm_group: dist.ProcessGroup | None = None
        self._global: list[int] = []

    # -- one call ------------------------------------------------------------------------------------------
    def run(self, call: ExpertCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The call's result and, where ``return_gathered``, its extra rows (``comm/expert.py``)."""
        if call.layout is None:
            raise ValueError(f"{call.name}: an expert call needs its layout")
        self.prepare(call.name)
        if call.plan.op == "dispatch":
            return self._dispatch(call)
        return self._combine(call)

    def release(self) -> None:
        """Destroy the high-priority clone of the group (collective over the group's ranks, like its creation)."""
        if self._comm_group is not None and self._comm_group is not self.group:
            dist.destroy_process_group(self._comm_group)
        self._comm_group = None
        self._tables.clear()

    def _new(self, shape: tuple[int, int], dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        """A call's buffer (zeroed where padding rows must read zero), from the caching allocator."""
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        return buffer.zero_() if zero else buffer

    def prepare(self, op: str) -> None:
        """On the first call: the group that carries the transfers (a clone of an NCCL group with high-priority
        internal streams), then one exchange with every peer in round order, eagerly: NCCL sets up its peer
        connections and loads its kernels here, never behind a stream wait or inside a capture."""
        if self._comm_group is not None:
            return
        guards.refuse_inside_capture(f"{op}: the first NCCL-path expert call sets up the peer connections")
        group = self.group
        if self.device.type == "cuda" and dist.get_backend(self.group) == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
            group = dist.new_group(dist.get_process_group_ranks(self.group), backend="nccl", pg_options=options,
                                   use_local_synchronization=True)
        self._global = [dist.get_global_rank(group, p) for p in range(self.world_size)]
        self._comm_group = group
        # A first operation on the group with every rank in it (NCCL creates its communicator lazily, and a first
        # batch of point-to-point operations must involve every rank), then the rounds.
        dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        probe = torch.zeros((self.world_size, 8), dtype=torch.uint8, device=self.device)
        landed = torch.empty_like(probe)
        with torch.cuda.stream(self.comm_stream):
            for p in self.rounds:
                if p is not None:
                    self._exchange(probe[p], landed[p], p)
        self.comm_stream.synchronize()

    def _exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None, peer: int) -> None:
        """One round: a group of the send to ``peer`` and the receive from it (either may be None: no rows), on the
        current stream, which then waits for both."""
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, self._global[peer], self._comm_group))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self._global[peer], self._comm_group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    # -- dispatch ------------------------------------------------------------------------------------------
    def _dispatch(self, call: ExpertCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan, layout, a, b = call.plan, call.layout, call.a, call.b
        chunks = Chunks.of(plan, layout)
        bounded = plan.mode == "bounded"
        send_at, recv_at = chunks.send_offsets, chunks.recv_offsets
        compute = torch.cuda.current_stream(self.device)
        send = send_buffer(a, plan, layout)
        rows = layout.recv_rows
        recv = self._new((rows, a.shape[1]), a.dtype)
        h = self._new((rows, b.shape[2]), a.dtype, zero=bounded)
        comm = self.comm_stream
        comm.wait_stream(compute)  # the send buffer is written
        arrived, waited = {}, []
        with torch.cuda.stream(comm):
            for p in self.rounds:
                if p is None:
                    continue
                self._exchange(_rows(send, send_at[p], chunks.send[p]), _rows(recv, recv_at[p], chunks.recv[p]), p)
                arrived[p] = comm.record_event()
                waited.append((p, arrived[p]))
        me = self.rank
        kind = chunk_gemm(plan, a.dtype, a.device)
        light = light_multiplier(kind, layout, b)  # the hybrid's light experts: once every chunk is in recv
        if (call.return_gathered or light is not None) and chunks.recv[me]:
            recv[recv_at[me] : recv_at[me] + chunks.recv[me]].copy_(send[send_at[me] : send_at[me] + chunks.send[me]])
        multiply = self._multiplier(kind, plan, layout, b)
        multiply(me, send, send_at[me], h, recv_at[me], chunks.recv[me])
        if call.hook is not None:
            call.hook()
        for p in self.rounds:
            if p is not None and chunks.recv[p]:
                compute.wait_event(arrived[p])
                multiply(p, recv, recv_at[p], h, recv_at[p], chunks.recv[p])
        compute.wait_stream(comm)
        if light is not None:
            light(recv, h)
        if call.timeout is not None:
            self._check_progress(call, waited, "the rows from and to")
        return h, recv if call.return_gathered else None

    # -- combine -------------------------------------------------------------------------------------------
    def _combine(self, call: ExpertCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan, layout, b = call.plan, call.layout, call.b
        a = call.a if call.a.stride(-1) == 1 else call.a.contiguous()
        chunks = Chunks.of(plan, layout)
        bounded = plan.mode == "bounded"
        send_at, recv_at = chunks.send_offsets, chunks.recv_offsets
        me, hidden = self.rank, b.shape[2]
        compute = torch.cuda.current_stream(self.device)
        comm = self.comm_stream
        back = self._new((layout.send_capacity, hidden), a.dtype, zero=bounded)
        y = self._new((a.shape[0], hidden), a.dtype, zero=bounded)
        comm.wait_stream(compute)  # earlier work on the buffers; the GEMM itself is waited for per destination
        waited = []
        kind = chunk_gemm(plan, a.dtype, a.device)
        if not bounded and plan.gemm == "triton" and a.shape[0] > 0:
            # FlashOverlap: one signalling GEMM, launched before any wait on it (deadlock rule 1).
            table = segment_table(self._tables, self.world_size, layout.experts_per_rank, me, self.device)
            self._signalling_gemm(a, b, layout, y, table, chunks)
            if call.hook is not None:
                call.hook()
            with torch.cuda.stream(comm):
                for p in [*self.rounds, me]:  # every flag waited for and reset, the own one last
                    if p is None:
                        continue
                    address = self.flags.data_ptr() + 4 * p
                    stream_ops.wait_geq(comm, address, 1)
                    stream_ops.write(comm, address, 0)
                    if p != me:
                        self._exchange(_rows(y, recv_at[p], chunks.recv[p]), _rows(back, send_at[p], chunks.send[p]),
                                       p)
                    if call.timeout is not None:
                        waited.append((p, comm.record_event()))
            compute.wait_stream(comm)
            if chunks.recv[me]:  # the own rows, stored once S has seen the own flag (the last one)
                back[send_at[me] : send_at[me] + chunks.send[me]].copy_(y[recv_at[me] : recv_at[me] + chunks.recv[me]])
        else:
            multiply = self._multiplier(kind, plan, layout, b)
            light = light_multiplier(kind, layout, b)
            if light is not None:  # the hybrid's light experts, every destination's rows, before any leaves
                light(a, y)
            for p in self.rounds:
                if p is None:
                    continue
                multiply(p, a, recv_at[p], y, recv_at[p], chunks.recv[p])
                done = compute.record_event()
                with torch.cuda.stream(comm):
                    comm.wait_event(done)
                    self._exchange(_rows(y, recv_at[p], chunks.recv[p]), _rows(back, send_at[p], chunks.send[p]), p)
                    if call.timeout is not None:
                        waited.append((p, comm.record_event()))
            if light is None:  # the own rows last, straight into their place among the returned rows
                multiply(me, a, recv_at[me], back, send_at[me], chunks.recv[me])
            elif chunks.recv[me]:  # the hybrid's light rows of the own chunk are in y: the heavy ones join them
                multiply(me, a, recv_at[me], y, recv_at[me], chunks.recv[me])
                back[send_at[me] : send_at[me] + chunks.send[me]].copy_(y[recv_at[me] : recv_at[me] + chunks.recv[me]])
            if call.hook is not None:
                call.hook()
        compute.wait_stream(comm)
        if call.timeout is not None:
            self._check_progress(call, waited, "the rows for and from")
        out = combine_at_origin(back, plan, layout, a.dtype, out=call.out)
        return out, back if call.return_gathered else None

    # -- the GEMMs -----------------------------------------------------------------------------------------
    def _multiplier(self, kind: str, plan: ExpertPlan, layout: Layout, b: torch.Tensor):
        table = segment_table(self._tables, self.world_size, layout.experts_per_rank, self.rank, self.device)
        return chunk_multiplier(kind, plan, layout, b, table["expert"])

    def _signalling_gemm(self, a: torch.Tensor, b: torch.Tensor, layout: Layout, y: torch.Tensor,
                         table: dict[str, torch.Tensor], chunks: Chunks) -> None:
        """``y`` = every segment of ``a`` times its expert, on the current stream, destinations in round order
        (own last) and ``flags[d]`` exactly 1 once destination d's rows are stored. Off the GPU (the CPU tests,
        without the interpreter) a loop, then every flag."""
        if a.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            ends = relative_ends(layout)
            for d, (start, rows) in enumerate(zip(chunks.recv_offsets, chunks.recv)):
                multiply_chunk("loop", a[start : start + rows], b, ends[d], y[start : start + rows], table["expert"])
            self.flags.fill_(1)
            return
        from flashoverlap.kernels.grouped_gemm import default_tile, grouped_gemm

        tile = dataclasses.replace(default_tile(a.shape[0], layout.experts_per_rank, a.shape[1], b.shape[2]),
                                   num_programs=None, dynamic=False)
        grouped_gemm(a, b, layout.recv_seg_ends, table["all_experts"], out=y, seg_signal=table["signal"],
                     flags=self.flags, order="heavy-first", seg_priority=table["priority"], max_rows=a.shape[0],
                     tile=tile)

    def _check_progress(self, call: ExpertCall, waited: list, what: str) -> None:
        guards.poll_events(((event, peer) for peer, event in waited), call.timeout, lambda peer: (
            f"flashoverlap: rank {self.rank}: {call.name} ({call.plan.op}) on {self.name} (NCCL path) waited more "
            f"than {call.timeout:g} s (FLASHOVERLAP_DEBUG_TIMEOUT) for {what} rank {peer}: a peer never reached "
            "this call, or called it with another layout, shapes or dtype"))


def _rows(t: torch.Tensor, start: int, rows: int) -> torch.Tensor | None:
    """Rows ``[start, start + rows)`` of ``t``, or None where there are none (no transfer)."""
    return t[start : start + rows] if rows else None
