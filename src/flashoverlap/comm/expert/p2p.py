"""The P2P expert communicator (path ``"p2p"``, one NVLink node): dispatch and combine (``contract.py``) with
copy-engine pushes into the peers' symmetric memory, a flag per (source, destination) pair set by a stream write
after each push, and the receiver's grouped GEMM per arrived chunk. No SM moves a byte; an eager call's flag waits are
stream memory operations, a captured call's the wait kernel (below).

The schedule (``schedule``) is data, pure Python: for one rank and one call, the ordered operations of its two
streams, ``C`` (the caller's: the GEMMs, and the copies out of this rank's own symmetric slots) and ``X`` (the copy
stream, high priority: the pushes into the peers'). ``ExpertP2PCommunicator`` issues it on the GPU;
``tests/comm/expert_sim.py`` executes it for every rank at once on the CPU in random interleavings.

Memory. Each rank's symmetric data region holds ``W`` slots, slot ``s`` for the rows rank ``s`` pushes here (one
chunk: ``comm/expert/chunked_gemm.py``'s ``Chunks``; bounded mode whole ``bound``-row slots, exact mode the layout's
splits). Slot offsets depend only on the workspace size, the same on every rank: the workspace grows only to sizes
all ranks agree on (bounded: the bound; exact: the largest chunk of any pair, ``Layout.max_pair_rows``, which
``expert_layout`` reads from the all-gathered counts in its one host synchronisation: no collective here). The rows
that land are copied out (copy engine, on ``C``) into the call's ordinary buffer (dispatch's received rows,
combine's returned rows), which frees the slot early and gives both paths the same buffers.

Flags, per (source s, destination d) pair: ``full[s]`` lives at d: s's ``X`` sets it after its push; d's ``C``
waits for it, resets it, copies the slot out, then sets ``free[d]``, which lives at s and starts at 1: s's ``X``
waits for it (and resets it) before its next push into that slot, in this call or a later one, of either op. A
pair with no rows (exact mode, known to both sides) skips all four. Every flag is reset by its waiter before its
setter can set it again, so a captured CUDA graph replays (bounded mode; exact mode's sizes change every layer).

dispatch on rank r: ``C`` gathers the send buffer (event 0); ``X`` (after event 0) pushes chunk d to rank
d = r+1, r+2, ...; ``C`` multiplies the own chunk at once (from the send buffer), runs the hook, then for each
source s = r-1, r-2, ... waits for ``full[s]``, copies the slot out, frees it and multiplies chunk s. At step i
rank r pushes to r+i while r+i consumes from r: the first rows pushed are the first consumed.

combine on rank r, own chunk LAST (its rows need no transfer: computed last, they hide the last push): for each
destination d = r+1, r+2, ...: ``C`` multiplies chunk d (event), ``X`` waits for it and for ``free``, pushes it to
d's slot r and sets ``full``; then ``C`` multiplies the own chunk straight into its returned rows, runs the hook,
copies out what the peers pushed here (as dispatch's consumer does), and sums each token's rows with their router
weights (``combine_at_origin``).

**Why it cannot deadlock.** Split each call into phase A (the gather and GEMMs of the chunks that leave, and their
pushes) and phase B (the waits for what arrives, the copies out, the GEMMs on them). A wait in phase A of call i is
on this rank's own earlier work (an event on ``C``) or on a ``free`` flag, which the peer sets in its phase B of an
earlier call; a wait in phase B of call i is on a ``full`` flag, which the peer sets in its phase A of call i. Every
rank issues phase A before phase B and calls in order, and each stream runs its work in issue order, so the earliest
unfinished (call, phase) over all ranks can always proceed: also with one hardware queue for all streams
(``CUDA_DEVICE_MAX_CONNECTIONS=1``), where the queue order is the issue order. Copies and stream memory operations
need no SM; the GEMMs wait on nothing but their own stream. A kernel first launched behind a flag wait (deadlock
rule 3) is loaded eagerly on a plan's first call; and every producer is issued before any wait on it, so even a
kernel that loads late cannot wait on something the host has yet to issue.

In a CUDA graph (a replayed bounded call, or a call captured into the user's graph) each flag wait is the wait
kernel (``kernels/counters.py``: one warp spins on this rank's flag, then resets it), as in the tensor-parallel
P2P path: a memory operation captured into a graph is a node the driver prepares again at every launch, and a call
holds 4(W - 1) of them (28 at W = 8), 2(W - 1) waits (each with its reset, one node) and 2(W - 1) signals; the
kernel takes the waits' half. Every flag is set by a peer's stream write after the peer's own copy, which needs no
SM of this GPU (on a GPU the ranks share, the peer's process runs in its own time slice), so the spinning warp never
holds what its producer needs (deadlock rule 2); the kernel is loaded on a plan's first call (rule 3). What a wait
releases (a copy out of the slot on ``C``, a push on ``X``) starts only once the kernel has ended, after the flag's
write, which the write's default memory barrier orders after the peer's push. Signals stay stream writes in a graph:
a ``full`` signal announces a push into the peer's memory, which that barrier orders before the flag (a ``free``
signal announces only that this rank's own slot was read, and a 4-byte copy, as the tensor-parallel path's graphs
signal, would serve it: not done, unmeasured). ``graph_waits = "memop"`` keeps memory operations
(``stream_ops.graph_waits``).

The hybrid GEMM (exact mode, ``chunked_gemm.light_multiplier``): the schedule's GEMMs cover the heavy experts only.
Dispatch copies the own chunk among the received rows (the schedule's ``gathered`` copy) and, after ``X`` joins
``C``, multiplies every source's rows of the light experts in one launch; combine multiplies every destination's
light rows in one launch before the schedule starts, and its own chunk's GEMM writes ``y``, then its rows are copied
to the returned rows. Neither adds a wait: the deadlock argument above is unchanged (the light launch is loaded with
the others on a plan's first call).

fp8 (``call.scales``, ``comm/expert/scaled.py``): dispatch's rows are packed with their scales by the ``Gather``
step, so the slots and copies move the packed rows' bytes (``_row_bytes``) and the received rows are packed; the
products and combine's returned rows are in the output dtype (bf16). The schedule is the same.

With ``FLASHOVERLAP_DEBUG_TIMEOUT`` (``call.timeout``), an event after every flag wait is polled with a deadline:
a wait that does not end in time raises an error naming the rank, the op, the group and the flag's pair.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from flashoverlap import guards
from flashoverlap.comm import steps, stream_ops
from flashoverlap.comm.expert.chunked_gemm import (
    Chunks,
    chunk_ends,
    chunk_gemm,
    chunk_multiplier,
    light_multiplier,
    light_variant,
    offsets,
    segment_table,
)
from flashoverlap.comm.expert.contract import ExpertCall, call_outputs, call_signature, issued_rows, replayer
from flashoverlap.comm.expert.rows import combine_at_origin, send_buffer
from flashoverlap.comm.expert.scaled import pack, rows_dtype, wire_width, wired
from flashoverlap.comm.protocol import CommGroup, GroupFields, held_signature
from flashoverlap.comm.replay import CallGraphs
from flashoverlap.comm.steps import Copy, Finish, Gather, Gemm, Hook, Loc, Record, Signal, Wait, WaitEvent
from flashoverlap.comm.symmetric import SymmetricWorkspace
from flashoverlap.plan import P2P_MAX_RANKS

SLOT_ALIGN = 1 << 12
MAX_RANKS = P2P_MAX_RANKS
FREE_BASE = MAX_RANKS  # flag slots: full[s] at s (0 .. W-1), free[d] at FREE_BASE + d
# A resolved schedule step's first field (``ExpertP2PCommunicator._program``); the call's buffers by index (3: an
# absolute address, a peer's slot or a flag), per op.
_GEMM, _COPY, _WAIT, _SIGNAL, _RECORD, _WAIT_EVENT, _GATHER, _HOOK, _FINISH, _KERNEL_WAIT = range(10)
_SPACES = {"dispatch": {"send": 0, "recv": 1, "h": 2}, "combine": {"a": 0, "y": 1, "back": 2}}
_STREAMS = {"C": 0, "X": 1}


# -- the schedule, as data ------------------------------------------------------------------------------------


def full_flag(owner: int, source: int) -> Loc:
    return Loc("flag", owner, source)


def free_flag(owner: int, consumer: int) -> Loc:
    return Loc("flag", owner, FREE_BASE + consumer)


@functools.lru_cache(maxsize=1024)
def schedule(op: str, rank: int, send: tuple[int, ...], recv: tuple[int, ...], gathered: bool = False) -> tuple:
    """The ordered operations of one call on ``rank``: ``op`` ``"dispatch"`` or ``"combine"``; ``send[d]``: rows
    of the chunk this rank sends rank d in dispatch (and gets back from d in combine), ``recv[s]``: rows it
    receives from rank s in dispatch (and sends back to s in combine); ``gathered``: dispatch also copies the own
    rows into the received rows it returns. The executor records nothing before the list and joins ``X`` into ``C``
    after it."""
    world = len(send)
    if world > MAX_RANKS or len(recv) != world:
        raise ValueError(f"the P2P expert path serves up to {MAX_RANKS} ranks, with one size per rank; got "
                         f"send {send}, recv {recv}")
    at_send, at_recv = offsets(send), offsets(recv)
    ops: list = []
    if op == "dispatch":
        ops += [Gather(), Record("C", 0), WaitEvent("X", 0)]  # X starts after the send buffer is written
        for step in range(1, world):
            d = (rank + step) % world
            if send[d]:
                ops += [Wait("X", free_flag(rank, d), f"slot {rank} free at rank {d}"),
                        Copy(Loc("sym", d, 0, rank), Loc("send", rank, at_send[d]), send[d], "X"),
                        Signal("X", full_flag(d, rank))]
        if recv[rank]:
            ops.append(Gemm(Loc("send", rank, at_send[rank]), Loc("h", rank, at_recv[rank]), recv[rank], rank))
            if gathered:
                ops.append(Copy(Loc("recv", rank, at_recv[rank]), Loc("send", rank, at_send[rank]), recv[rank], "C"))
        ops.append(Hook())
        for step in range(1, world):
            s = (rank - step) % world
            if recv[s]:
                ops += _consume(rank, s, Loc("recv", rank, at_recv[s]), recv[s])
                ops.append(Gemm(Loc("recv", rank, at_recv[s]), Loc("h", rank, at_recv[s]), recv[s], s))
        return tuple(ops)
    if op != "combine":
        raise ValueError(f"op must be 'dispatch' or 'combine', got {op!r}")
    if not any(recv[d] for d in range(world) if d != rank):
        # X pushes nothing, yet joins the call: inside a capture, the executor's final join of X into C must wait
        # on work of the capture (otherwise X's first wait is for a product of the call).
        ops += [Record("C", 0), WaitEvent("X", 0)]
    event = 1
    for step in range(1, world):
        d = (rank + step) % world
        if recv[d]:
            ops += [Gemm(Loc("a", rank, at_recv[d]), Loc("y", rank, at_recv[d]), recv[d], d), Record("C", event),
                    WaitEvent("X", event), Wait("X", free_flag(rank, d), f"slot {rank} free at rank {d}"),
                    Copy(Loc("sym", d, 0, rank), Loc("y", rank, at_recv[d]), recv[d], "X"),
                    Signal("X", full_flag(d, rank))]
            event += 1
    if recv[rank]:  # the own rows last, straight into their place among the returned rows
        ops.append(Gemm(Loc("a", rank, at_recv[rank]), Loc("back", rank, at_send[rank]), recv[rank], rank))
    ops.append(Hook())
    for step in range(1, world):
        s = (rank - step) % world
        if send[s]:
            ops += _consume(rank, s, Loc("back", rank, at_send[s]), send[s])
    ops.append(Finish())
    return tuple(ops)


def _row_bytes(call: ExpertCall) -> int:
    """The bytes of one row the call moves: dispatch's rows (fp8: packed with their scales), combine's products."""
    plan, scales = call.plan, call.scales
    if scales is None:
        return plan.hidden * call.a.dtype.itemsize
    if plan.op == "dispatch":
        return wire_width(plan.hidden, scales.mode)
    return plan.hidden * scales.out_dtype.itemsize


def _consume(rank: int, source: int, dst: Loc, rows: int) -> list:
    """Phase B for one source: wait for its rows, copy them out of the slot, free the slot."""
    return [Wait("C", full_flag(rank, source), f"the rows from rank {source}"),
            Copy(dst, Loc("sym", rank, 0, source), rows, "C"), Signal("C", free_flag(source, rank))]


# -- the executor -----------------------------------------------------------------------------------------------


class ExpertP2PCommunicator(GroupFields):
    """A copy stream, events and a symmetric workspace of ``W`` slots for one (process group, device)."""

    path = "p2p"
    # How a graph (ours or a user's) waits on a flag: None, the wait kernel on a GPU (``stream_ops.graph_waits``);
    # "kernel" or "memop" forces one (a diagnostic's switch, as ``P2PCommunicator.graph_waits``).
    graph_waits: str | None = None

    def __init__(self, group: CommGroup) -> None:
        super().__init__(group)
        self.copy_stream = guards.comm_stream(self.device)  # X: the pushes to the peers
        self.workspace = SymmetricWorkspace(self.group, self.device)
        self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._events: list[int] = []  # driver events (``stream_ops.FastDriver``): the schedules' by index
        self._join: int | None = None  # the driver event that joins X into C after a call
        self._warm: set[tuple] = set()
        self._light_warm: set[tuple] = set()  # the hybrid's light kernel variants loaded (_load_light)
        self._tables: dict = {}
        # Resolved schedules (``_program``) by (op, chunks, gathered, row bytes): emptied where the workspace grows
        # (its slots and peers' addresses move) and on release.
        self._programs: dict[tuple, tuple] = {}
        # Exact mode: each chunk's relative segment ends (``chunked_gemm.chunk_ends``), by the layout's segment ends
        # (shared by a layer's dispatch, combine and backward calls), kept while the layout lives.
        self._ends = WeakTensorKeyDictionary()
        self.graphs = CallGraphs(self.device)  # repeated bounded-mode calls replayed (comm/replay.py)

    def _slot_bytes(self) -> int:
        return (self.workspace.nbytes // max(self.world_size, 1)) // SLOT_ALIGN * SLOT_ALIGN

    def run(self, call: ExpertCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The call's result and, where ``return_gathered``, its extra rows (``comm/expert/contract.py``). A repeated
        bounded-mode call (``call.replay``) replays a CUDA graph of its schedule."""
        plan, layout, a = call.plan, call.layout, call.a
        if layout is None:
            raise ValueError(f"{call.name}: an expert call needs its layout")
        if plan.op == "combine" and a.stride(-1) != 1:
            a = a.contiguous()
        chunks = Chunks.of(plan, layout)
        self.prepare(call, chunks)
        outputs = self._outputs(call, a)
        if call.replay and plan.mode == "bounded" and (call.hook is None or held_signature(call.hook) is not None):
            signature = self._signature(call, a, outputs)
            if self.graphs.run(signature, lambda: self.issue(call, a, chunks, outputs, captured=True)):
                return self._result(call, outputs)
        self.issue(call, a, chunks, outputs, call.timeout, captured=guards.capturing(a))
        return self._result(call, outputs)

    def replayer(self, call: ExpertCall) -> Callable[[Any], tuple | None] | None:
        """The replay lane of bounded-mode calls that read ``call``'s tensors (``contract.replayer``), the workspace's
        address read at each call (``_signature``'s own part)."""
        return replayer(call, self.graphs, self._new, lambda: (self.workspace.buffer.data_ptr(),))

    def release(self) -> None:
        """Free the graphs, the resolved schedules, the driver events and the symmetric workspace (the peers free
        theirs in the same collective release)."""
        self.graphs.clear()
        self._warm.clear()
        self._light_warm.clear()
        self._tables.clear()
        self._programs.clear()
        self._ends.clear()
        events = [*self._events, *([] if self._join is None else [self._join])]
        if events:
            driver = stream_ops.fast()
            for event in events:
                driver.free_event(event)
        self._events, self._join = [], None
        self.workspace.release()

    def _new(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A call's output, from the caching allocator (whose reuse of addresses lets a repeated call replay)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _outputs(self, call: ExpertCall, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``contract.call_outputs``: the rows buffer (where the pushed rows are copied out to) only where the call
        returns it; else ``issue`` allocates it (``contract.issued_rows``)."""
        return call_outputs(call, a, self._new)

    def _scratch(self, shape: tuple[int, int], dtype: torch.dtype, zero: bool) -> torch.Tensor:
        """A temporary of one call (combine's products), allocated on the caller's stream (in a replayed call, from
        the graph's pool)."""
        return torch.zeros(shape, dtype=dtype, device=self.device) if zero else torch.empty(shape, dtype=dtype,
                                                                                            device=self.device)

    @staticmethod
    def _result(call: ExpertCall, outputs: tuple[torch.Tensor, torch.Tensor | None]):
        return outputs[0], outputs[1] if call.return_gathered else None

    # -- before anything is queued -------------------------------------------------------------------------
    def prepare(self, call: ExpertCall, chunks: Chunks) -> None:
        """The workspace holds the largest chunk any pair moves in this call in each of its ``W`` slots (growing it
        is collective, to a size every rank agrees on, and refused inside a capture); a plan's first call loads its
        GEMM kernels."""
        plan, layout, dtype = call.plan, call.layout, rows_dtype(call.a, call.scales)
        rows = plan.bound if plan.mode == "bounded" else self._largest_pair(call.name, layout, chunks)
        need = rows * _row_bytes(call)
        if need > self._slot_bytes():
            size = self.world_size * (need + SLOT_ALIGN)
            if self.workspace.ensure(size, call.name, ones=(FREE_BASE, FREE_BASE + self.world_size)):
                self.graphs.clear()
                self._programs.clear()
        # Rows the call quantises lie in its wire rows (a row stride of the packed width, and so their scales):
        # other kernel variants than given fp8 rows and scales (Triton specialises strides).
        key = (plan, dtype, call.b.stride(), call.scales is not None and call.scales.a is None)
        if key not in self._warm:
            self._load_kernels(call, chunks)
            self._warm.add(key)

    @staticmethod
    def _largest_pair(name: str, layout, chunks: Chunks) -> int:
        """Exact mode: the largest chunk any pair of ranks moves with this layout, the same on every rank: the
        layout's ``max_pair_rows`` (every rank knows only its own pairs; ``expert_layout`` read the group's largest
        with its split sizes, so no collective and no host synchronisation is added here)."""
        rows = layout.max_pair_rows
        if rows is None:
            raise ValueError(f"{name}: the layout has no max_pair_rows (the P2P path sizes its slots by it): build "
                             "it with moe_layout / expert_layout")
        if rows < max(chunks.send + chunks.recv, default=0):  # a layout's own pairs are among the group's
            raise ValueError(f"{name}: the layout's max_pair_rows={rows} is below its own largest split "
                             f"{max(chunks.send + chunks.recv)}: build it with moe_layout / expert_layout")
        return rows

    def _load_kernels(self, call: ExpertCall, chunks: Chunks) -> None:
        """Run each GEMM of the schedule once, eagerly, on scratch rows: the call queues them behind flag waits, where
        a kernel that is not loaded yet must not be launched first (deadlock rule 3)."""
        guards.refuse_inside_capture(f"{call.name}: the first P2P call of a shape loads its GEMM kernels")
        if self.device.type == "cuda":  # a graph's flag waits, whatever ``graph_waits`` says later
            stream_ops.load_wait_kernel(self.device)
        quantised = call.scales is not None and call.scales.a is None
        call = wired(call, call.a)[0]  # fp8 from bf16 rows: the wire rows and scales, laid out as the call's
        plan, b, scales = call.plan, call.b, call.scales
        multiply = self._multiplier(call, chunk_gemm(plan, call.a.dtype, self.device, scales))
        k, n = b.shape[1], b.shape[2]
        out_dtype = call.a.dtype if scales is None else scales.out_dtype
        for item in schedule(plan.op, self.rank, chunks.send, chunks.recv):
            if isinstance(item, Gemm):
                if scales is not None and plan.op == "dispatch":  # packed rows
                    x = torch.zeros((item.rows, wire_width(k, scales.mode)), dtype=torch.uint8, device=self.device)
                elif quantised:  # the call's own wire rows (their layout is the kernel's), scales by row number
                    x = call.a
                else:  # combine's fp8 rows take their scales by row number: the first rows' are there
                    x = torch.zeros((item.rows, k), dtype=call.a.dtype, device=self.device)
                multiply(item.chunk, x, 0, torch.empty((item.rows, n), dtype=out_dtype, device=self.device), 0,
                         item.rows)
        torch.cuda.synchronize(self.device)

    def _load_light(self, call: ExpertCall, light) -> None:
        """The hybrid's light launch, which dispatch queues behind its flag waits: each of its kernel variants
        (``light_variant``: tile, table size, specialised sizes) is run once on scratch rows before the first call
        that needs it queues anything (deadlock rule 3). Exact layouts are never captured."""
        variant = light_variant(call.plan, call.layout, call.b)
        if variant in self._light_warm:
            return
        guards.refuse_inside_capture(f"{call.name}: the first hybrid call of a layout shape loads its light kernels")
        k, n, rows = call.b.shape[1], call.b.shape[2], call.layout.recv_rows
        light(torch.zeros((rows, k), dtype=call.a.dtype, device=self.device),
              torch.empty((rows, n), dtype=call.a.dtype, device=self.device))
        torch.cuda.synchronize(self.device)
        self._light_warm.add(variant)

    def _multiplier(self, call: ExpertCall, kind: str):
        """``chunked_gemm.chunk_multiplier``'s ``multiply(chunk, x, x_row, out, out_row, rows)`` for this call, each
        chunk's ends one view of ``chunk_ends``."""
        layout = call.layout
        seg_expert = segment_table(self._tables, self.world_size, layout.experts_per_rank, self.rank,
                                   self.device)["expert"]
        return chunk_multiplier(kind, call.plan, layout, call.b, seg_expert, chunk_ends(self._ends, layout),
                                scales=call.scales)

    # -- the call's GPU work ----------------------------------------------------------------------------------
    def issue(self, call: ExpertCall, a: torch.Tensor, chunks: Chunks,
              outputs: tuple[torch.Tensor, torch.Tensor | None], timeout: float | None = None,
              captured: bool = False) -> None:
        """The schedule of one call (after ``prepare``), on the caller's stream and the copy stream; ``outputs`` (see
        ``_outputs``) hold the result on the caller's stream afterwards; ``captured``: the work is being captured into
        a CUDA graph (its flag waits are the wait kernel, ``_graph_waits``). The schedule comes resolved (``_program``),
        and the driver is called through ``ctypes`` with raw stream and event handles (``stream_ops.fast``), as the
        tensor-parallel P2P executor does."""
        call, a = wired(call, a, self._new)  # fp8 from bf16 rows: quantised, into the call's own wire rows
        plan, layout, scales = call.plan, call.layout, call.scales
        bounded = plan.mode == "bounded"
        kind = chunk_gemm(plan, a.dtype, self.device, scales)
        out_dtype = a.dtype if scales is None else scales.out_dtype
        # The hybrid's light experts run over every chunk at once: dispatch's own chunk then joins the received rows.
        light = light_multiplier(kind, plan, layout, call.b)
        if light is not None and plan.op == "dispatch":
            self._load_light(call, light)
        program, ops = self._program(plan.op, chunks,
                                     (call.return_gathered or light is not None) and plan.op == "dispatch",
                                     _row_bytes(call), captured and self._graph_waits() == "kernel")
        driver = stream_ops.fast()
        handles = (driver.current_stream(self._index), self.copy_stream.cuda_stream)
        if plan.op == "dispatch":
            h, recv = outputs[0], issued_rows(call, a, outputs, self._new)
            if bounded:
                h.zero_()  # padding rows (no segment covers them) read zero
            tensors = [None, recv, h]  # the send buffer: made by the schedule's Gather
        else:
            out, back = outputs[0], issued_rows(call, a, outputs, self._new)
            if bounded:
                back.zero_()  # the own slot's padding rows, which no GEMM writes
            # Chunks leave whole (bounded mode: slots, padding included), so the rows no segment covers are zero.
            tensors = [a, self._scratch((a.shape[0], plan.hidden), out_dtype, zero=bounded), back]
        bases = [0 if t is None else t.data_ptr() for t in tensors] + [0]
        multiply = self._multiplier(call, kind)
        if light is not None and plan.op == "combine":  # before any chunk leaves: every destination's light rows
            light(a, tensors[1])
        events = self._events
        wait_reset, write, copy, record, wait_event = (driver.wait_reset, driver.write, driver.copy, driver.record,
                                                       driver.wait_event)
        waited = []
        for step, item in zip(program, ops):
            code = step[0]
            if code == _GEMM:
                _, chunk, src, src_row, dst, dst_row, rows = step
                if light is not None and plan.op == "combine" and dst == 2:
                    # The own chunk into the returned rows: its light rows are in y, the heavy ones join them there.
                    multiply(chunk, tensors[src], src_row, tensors[1], src_row, rows)
                    tensors[2][dst_row : dst_row + rows].copy_(tensors[1][src_row : src_row + rows])
                else:
                    multiply(chunk, tensors[src], src_row, tensors[dst], dst_row, rows)
            elif code == _COPY:
                _, stream, dst, dst_offset, src, src_offset, nbytes = step
                copy(handles[stream], bases[dst] + dst_offset, bases[src] + src_offset, nbytes)
            elif code == _WAIT:
                wait_reset(handles[step[1]], step[2])
                if timeout is not None:  # debug mode: an event to poll, through torch
                    waited.append((self._stream(step[1]).record_event(), item))
            elif code == _KERNEL_WAIT:  # in a graph only
                with torch.cuda.stream(self._stream(step[1])):
                    stream_ops.counter_wait_kernel(self.workspace.flags, step[2], 1)
            elif code == _SIGNAL:
                write(handles[step[1]], step[2], 1)
            elif code == _RECORD:
                record(events[step[2]], handles[step[1]])
            elif code == _WAIT_EVENT:
                wait_event(handles[step[1]], events[step[2]])
            elif code == _GATHER:
                tensors[0] = send_buffer(a if scales is None else pack(a, scales.a), plan, layout)
                bases[0] = tensors[0].data_ptr()
            elif code == _HOOK:
                if call.hook is not None:
                    call.hook()
            else:  # _FINISH
                combine_at_origin(back, plan, layout, out_dtype, out=out)
        # X read send / y: nothing reuses them before its pushes are done.
        record(self._join, handles[1])
        wait_event(handles[0], self._join)
        if light is not None and plan.op == "dispatch":  # every chunk is in the received rows, the own one too
            light(tensors[1], tensors[2])
        if timeout is not None:
            self._check_progress(call, waited, timeout)

    def _program(self, op: str, chunks: Chunks, gathered: bool, row_bytes: int,
                 kernel_waits: bool = False) -> tuple[list, tuple]:
        """The schedule of a call (``schedule``) with what does not change between calls resolved: each step as a
        tuple of its code, streams, buffers by index (``_SPACES``; 3: absolute), byte offsets, flag addresses (or,
        with ``kernel_waits``, a wait's slot in this rank's flags) and sizes; made once per (op, chunks, gathered,
        row bytes, kernel waits) and workspace, with the driver events it uses."""
        key = (op, chunks.send, chunks.recv, gathered, row_bytes, kernel_waits)
        cached = self._programs.get(key)
        if cached is not None:
            return cached
        ops = schedule(op, self.rank, chunks.send, chunks.recv, gathered)
        driver = stream_ops.fast()
        while len(self._events) < steps.events(ops):
            self._events.append(driver.new_event())
        if self._join is None:
            self._join = driver.new_event()
        spaces, slot_bytes, workspace = _SPACES[op], self._slot_bytes(), self.workspace

        def place(loc: Loc) -> tuple[int, int]:  # (buffer index, byte offset)
            if loc.space == "sym":
                return 3, workspace.peer_ptr(loc.rank) + loc.region * slot_bytes + loc.row * row_bytes
            return spaces[loc.space], loc.row * row_bytes

        program = []
        for item in ops:
            if isinstance(item, Gemm):
                program.append((_GEMM, item.chunk, spaces[item.src.space], item.src.row, spaces[item.dst.space],
                                item.dst.row, item.rows))
            elif isinstance(item, Copy):
                program.append((_COPY, _STREAMS[item.stream], *place(item.dst), *place(item.src),
                                item.rows * row_bytes))
            elif isinstance(item, Wait) and kernel_waits:
                assert item.flag.rank == self.rank, "a rank waits on its own flags only (workspace.flags)"
                program.append((_KERNEL_WAIT, _STREAMS[item.stream], item.flag.row))
            elif isinstance(item, (Wait, Signal)):
                program.append((_WAIT if isinstance(item, Wait) else _SIGNAL, _STREAMS[item.stream],
                                workspace.flag_ptr(item.flag.rank, item.flag.row)))
            elif isinstance(item, Record):
                program.append((_RECORD, _STREAMS[item.stream], item.event))
            elif isinstance(item, WaitEvent):
                program.append((_WAIT_EVENT, _STREAMS[item.stream], item.event))
            elif isinstance(item, Gather):
                program.append((_GATHER,))
            elif isinstance(item, Hook):
                program.append((_HOOK,))
            else:  # Finish
                program.append((_FINISH,))
        if len(self._programs) > 256:
            self._programs.clear()
        cached = self._programs[key] = (program, ops)
        return cached

    def _graph_waits(self) -> str:
        """How a graph waits on a flag (module docstring): "kernel" on a GPU, unless ``graph_waits`` says "memop"."""
        return stream_ops.graph_waits(self.graph_waits, self.device)

    def _stream(self, index: int) -> torch.cuda.Stream:
        """The schedule's stream ``index`` (``C``, ``X``) as a torch object (debug mode's polled events)."""
        return (torch.cuda.current_stream(self.device), self.copy_stream)[index]

    def _signature(self, call: ExpertCall, a: torch.Tensor, outputs: tuple[torch.Tensor, torch.Tensor | None]) -> tuple:
        """``contract.call_signature`` and the workspace's address (``comm/replay.py``)."""
        return call_signature(call, a, outputs), self.workspace.buffer.data_ptr()

    def _check_progress(self, call: ExpertCall, waited: list, timeout: float) -> None:
        guards.poll_events(waited, timeout, lambda item: (
            f"flashoverlap: rank {self.rank}: {call.name} ({call.plan.op}) on {self.name} (P2P path) waited more "
            f"than {timeout:g} s (FLASHOVERLAP_DEBUG_TIMEOUT) for {item.what}: a peer never reached this call, "
            "or called it with another layout, shapes or dtype"))
