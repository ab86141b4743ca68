"""The NCCL expert communicator (path ``"nccl"``): dispatch and combine (``contract.py``) with plain NCCL
send/recv per peer on a high-priority stream, overlapped with the experts' grouped GEMMs. It works wherever NCCL
does: across nodes, and through host memory (PCIe machines, ``NCCL_P2P_DISABLE=1``). Its chunks, rounds and
grouped GEMMs are ``comm/expert/chunked_gemm.py``'s, shared with the P2P path.

Chunks. A call moves one *chunk* of rows per (source, destination) pair: in exact mode the layout's host split sizes
(``send_splits``/``recv_splits``, rows packed), in bounded mode whole ``bound``-row slots (padding included: NCCL
needs sizes the host knows, and the bounded mode never asks the device). Dispatch's receive buffer holds chunk ``s``
(rows from rank ``s``) at ``recv_offsets[s]``; its segments ``(s, l)`` are that chunk's rows for local expert ``l``.
Combine's input ``a`` has dispatch's layout, so its chunk ``d`` is what goes back to rank ``d``, and its returned
rows land in the send layout, chunk ``s`` (from rank ``s``) at ``send_offsets[s]``.

Rounds (``chunked_gemm.pair_rounds``): the ``W - 1`` peers are met one per round, in the rounds of a round-robin
tournament (the circle method; with ``W`` odd, one rank sits each round out), and each round is ONE group of NCCL
operations with that peer (``batch_isend_irecv``: the send to it and the receive from it). **Why this cannot
deadlock**: NCCL runs one rank's groups one after another, in issue order; the pairing is symmetric (r meets p in
round k exactly when p meets r in round k), so if every rank has finished its rounds before k, round k's group on r
is matched by the group p issues in the same round, and nothing else in it can be missing. The only other thing the
communication stream waits on is the GEMM's rows for that peer (combine), and the GEMM, launched before any of these
waits (deadlock rule 1), waits on nothing. By induction over k every round completes. The host issues the rounds in
the same order on every rank, so the same holds with one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``): every
wait sits behind the work that satisfies it. The NCCL kernels and the peer connections are loaded by a warm-up
exchange on the first call (deadlock rule 3), outside any wait and outside any capture.

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

fp8 (``call.scales``, ``comm/expert/scaled.py``): dispatch's rows travel packed with their scales (uint8 rows: the
received rows it returns are packed too), its products and combine's in the output dtype (bf16), which is what combine
returns; combine runs the per-destination form (the signalling launch is bf16/fp16 only), with the fp8 chunk GEMM
``chunk_gemm`` picks (the loop, ``torch._scaled_grouped_mm`` or the fp8 Triton kernel).

With ``FLASHOVERLAP_DEBUG_TIMEOUT`` (``call.timeout``), an event after each round is polled with a deadline; a round
that does not finish in time raises an error naming the rank, the op, the group and the peer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakTensorKeyDictionary

from flashoverlap import guards
from flashoverlap.comm import stream_ops
from flashoverlap.comm.expert.chunked_gemm import (
    ChunkGemm,
    Chunks,
    chunk_ends,
    chunk_gemm,
    chunk_multiplier,
    light_multiplier,
    multiply_chunk,
    pair_rounds,
    relative_ends,
    segment_table,
)
from flashoverlap.comm.expert.contract import (
    ExpertCall,
    ExpertPlan,
    Layout,
    call_outputs,
    call_signature,
    issued_rows,
    replayer,
)
from flashoverlap.comm.expert.rows import combine_at_origin, send_buffer
from flashoverlap.comm.expert.scaled import pack, wired
from flashoverlap.comm.protocol import CommGroup, GroupFields, held_signature
from flashoverlap.comm.replay import CallGraphs

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
        # Exact mode: each chunk's relative segment ends (``chunked_gemm.chunk_ends``), by the layout's segment ends
        # (shared by a layer's dispatch, combine and backward calls), kept while the layout lives.
        self._ends = WeakTensorKeyDictionary()
        self._comm_group: dist.ProcessGroup | None = None
        self._global: list[int] = []
        self.graphs = CallGraphs(self.device)  # repeated bounded-mode calls replayed (comm/replay.py)
        self._graphed = self.device.type == "cuda"  # CUDA graphs: on a GPU only

    # -- one call ------------------------------------------------------------------------------------------
    def run(self, call: ExpertCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The call's result and, where ``return_gathered``, its extra rows (``comm/expert/contract.py``).

        The call's outputs are allocated first, in one order, so that a repeated call finds them where the previous
        one did; a repeated bounded-mode call (``call.replay``, a hook that a graph may hold or none) then replays a
        CUDA graph of its whole schedule, the NCCL rounds included (``comm/replay.py``: captured on the signature's
        second call, once the first, eager, has set up the peers and loaded the kernels). Exact mode's sizes come
        from the host and change with every layer's routing: its calls are issued eagerly."""
        if call.layout is None:
            raise ValueError(f"{call.name}: an expert call needs its layout")
        self.prepare(call.name)
        plan = call.plan
        a = call.a if plan.op == "dispatch" or call.a.stride(-1) == 1 else call.a.contiguous()
        outputs = self._outputs(call, a)
        issue = self._dispatch if plan.op == "dispatch" else self._combine
        replayable = (call.replay and plan.mode == "bounded" and self._graphed
                      and (call.hook is None or held_signature(call.hook) is not None))
        if not (replayable and self.graphs.run(call_signature(call, a, outputs),
                                               lambda: issue(call, a, outputs, captured=True))):
            issue(call, a, outputs)
        return outputs[0], outputs[1] if call.return_gathered else None

    def replayer(self, call: ExpertCall) -> Callable[[Any], tuple | None] | None:
        """The replay lane of bounded-mode calls that read ``call``'s tensors (``contract.replayer``; on a GPU)."""
        return replayer(call, self.graphs, self._new) if self._graphed else None

    def _outputs(self, call: ExpertCall, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``contract.call_outputs`` (the rows buffer only where the call returns it; else the issued work allocates
        it, ``contract.issued_rows``): zeroed, where bounded mode's padding must read zero, inside the call's schedule
        (so that a replayed graph zeroes them too)."""
        return call_outputs(call, a, self._new)

    def release(self) -> None:
        """Destroy the high-priority clone of the group (collective over the group's ranks, like its creation)."""
        if self._comm_group is not None and self._comm_group is not self.group:
            dist.destroy_process_group(self._comm_group)
        self._comm_group = None
        self._tables.clear()
        self._ends.clear()
        self.graphs.clear()

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
    def _dispatch(self, call: ExpertCall, a: torch.Tensor, outputs: tuple[torch.Tensor, torch.Tensor | None],
                  captured: bool = False) -> None:
        """Queue one dispatch (``captured``: into this communicator's own graph, no debug deadline)."""
        plan, layout, b = call.plan, call.layout, call.b
        call, a = wired(call, a, self._new)  # fp8 from bf16 rows: quantised, into the call's own wire rows
        h, recv = outputs[0], issued_rows(call, a, outputs, self._new)
        chunks = Chunks.of(plan, layout)
        bounded = plan.mode == "bounded"
        send_at, recv_at = chunks.send_offsets, chunks.recv_offsets
        compute = torch.cuda.current_stream(self.device)
        scales = call.scales  # fp8: the rows travel packed with their scales (comm/expert/scaled.py)
        wire = a if scales is None else pack(a, scales.a)
        send = send_buffer(wire, plan, layout)
        if bounded:
            h.zero_()
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
        kind = chunk_gemm(plan, a.dtype, a.device, scales)
        light = light_multiplier(kind, plan, layout, b)  # the hybrid's light experts: once every chunk is in recv
        if (call.return_gathered or light is not None) and chunks.recv[me]:
            recv[recv_at[me] : recv_at[me] + chunks.recv[me]].copy_(send[send_at[me] : send_at[me] + chunks.send[me]])
        multiply = self._multiplier(kind, plan, layout, b, scales)
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
        if call.timeout is not None and not captured:
            self._check_progress(call, waited, "the rows from and to")

    # -- combine -------------------------------------------------------------------------------------------
    def _combine(self, call: ExpertCall, a: torch.Tensor, outputs: tuple[torch.Tensor, torch.Tensor | None],
                 captured: bool = False) -> None:
        """Queue one combine (``captured``: into this communicator's own graph, no debug deadline)."""
        plan, layout, b = call.plan, call.layout, call.b
        call, a = wired(call, a, self._new)  # fp8 from bf16 rows: quantised, into the call's own wire rows
        out, back = outputs[0], issued_rows(call, a, outputs, self._new)
        chunks = Chunks.of(plan, layout)
        bounded = plan.mode == "bounded"
        send_at, recv_at = chunks.send_offsets, chunks.recv_offsets
        me, hidden = self.rank, b.shape[2]
        compute = torch.cuda.current_stream(self.device)
        comm = self.comm_stream
        scales = call.scales  # fp8: a's scales by row; the products and the returned rows in the output dtype
        out_dtype = a.dtype if scales is None else scales.out_dtype
        if bounded:
            back.zero_()
        y = self._new((a.shape[0], hidden), out_dtype, zero=bounded)
        comm.wait_stream(compute)  # earlier work on the buffers; the GEMM itself is waited for per destination
        waited = []
        kind = chunk_gemm(plan, a.dtype, a.device, scales)
        if not bounded and plan.gemm == "triton" and a.shape[0] > 0 and scales is None:
            # FlashOverlap: one signalling GEMM, launched before any wait on it (deadlock rule 1).
            table = segment_table(self._tables, self.world_size, layout.experts_per_rank, me, self.device)
            self._signalling_gemm(a, b, layout, y, table, chunks)
            if call.hook is not None:
                call.hook()
            with torch.cuda.stream(comm):
                for p in [*self.rounds, me]:  # every flag waited for and reset, the own one last
                    if p is None:
                        continue
                    stream_ops.wait_reset(comm, self.flags.data_ptr() + 4 * p, 1)  # the wait and the reset
                    if p != me:
                        self._exchange(_rows(y, recv_at[p], chunks.recv[p]), _rows(back, send_at[p], chunks.send[p]),
                                       p)
                    if call.timeout is not None:
                        waited.append((p, comm.record_event()))
            compute.wait_stream(comm)
            if chunks.recv[me]:  # the own rows, stored once S has seen the own flag (the last one)
                back[send_at[me] : send_at[me] + chunks.send[me]].copy_(y[recv_at[me] : recv_at[me] + chunks.recv[me]])
        else:
            multiply = self._multiplier(kind, plan, layout, b, scales)
            light = light_multiplier(kind, plan, layout, b)
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
        if call.timeout is not None and not captured:
            self._check_progress(call, waited, "the rows for and from")
        combine_at_origin(back, plan, layout, out_dtype, out=out)

    # -- the GEMMs -----------------------------------------------------------------------------------------
    def _multiplier(self, kind: str, plan: ExpertPlan, layout: Layout, b: torch.Tensor, scales=None):
        table = segment_table(self._tables, self.world_size, layout.experts_per_rank, self.rank, self.device)
        return chunk_multiplier(kind, plan, layout, b, table["expert"], chunk_ends(self._ends, layout), scales=scales)

    def _signalling_gemm(self, a: torch.Tensor, b: torch.Tensor, layout: Layout, y: torch.Tensor,
                         table: dict[str, torch.Tensor], chunks: Chunks) -> None:
        """``y`` = every segment of ``a`` times its expert, on the current stream, destinations in round order
        (own last) and ``flags[d]`` exactly 1 once destination d's rows are stored. Off the GPU (the CPU tests,
        without the interpreter) a loop, then every flag."""
        if a.device.type != "cuda" and not guards.triton_interpreted():
            ends = relative_ends(layout)
            for d, (start, rows) in enumerate(zip(chunks.recv_offsets, chunks.recv)):
                multiply_chunk(ChunkGemm("loop", b, table["expert"]), a[start : start + rows], ends[d],
                               y[start : start + rows])
            self.flags.fill_(1)
            return
        from flashoverlap.kernels.grouped_gemm import GroupedLaunch, Segments, default_tile, grouped_gemm

        tile = dataclasses.replace(default_tile(a.shape[0], layout.experts_per_rank, a.shape[1], b.shape[2]),
                                   num_programs=None, dynamic=False)
        segments = Segments(layout.recv_seg_ends, table["all_experts"], signal=table["signal"],
                            priority=table["priority"])
        grouped_gemm(a, b, segments, out=y, flags=self.flags, launch=GroupedLaunch(max_rows=a.shape[0], tile=tile))

    def _check_progress(self, call: ExpertCall, waited: list, what: str) -> None:
        guards.poll_events(((event, peer) for peer, event in waited), call.timeout, lambda peer: (
            f"flashoverlap: rank {self.rank}: {call.name} ({call.plan.op}) on {self.name} (NCCL path) waited more "
            f"than {call.timeout:g} s (FLASHOVERLAP_DEBUG_TIMEOUT) for {what} rank {peer}: a peer never reached "
            "this call, or called it with another layout, shapes or dtype"))


def _rows(t: torch.Tensor, start: int, rows: int) -> torch.Tensor | None:
    """Rows ``[start, start + rows)`` of ``t``, or None where there are none (no transfer)."""
    return t[start : start + rows] if rows else None
