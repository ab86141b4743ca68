"""The P2P communicator (over NVLink, Flux's principle with cuBLAS): every multiplication by cuBLAS on the caller's
stream, every byte moved by a copy engine on a copy stream, every reduction fused into cuBLAS (``addmm_`` on the
pulled partial, beta = 1), and every cross-rank signal a stream memory operation. No SM moves or sums bytes.

The schedule (which rows, in which order, which flags) is ``comm/ring_schedule.py``, whose module docstring argues
why it cannot deadlock; this module only issues it. One call:

1. Before anything is queued: the symmetric workspace is large enough (growing it is collective and refused
   inside a CUDA-graph capture) and the region layout is fixed by its size; on a plan's first call its cuBLAS
   kernels are run once, eagerly (deadlock rule 3: none is loaded behind a stream wait).
2. Event 0 is recorded on the caller's stream ``C``; the schedule runs: ``Mm`` on ``C`` (``torch.mm`` /
   ``addmm_``), ``Copy`` on the copy stream ``X`` (``cuMemcpyDtoDAsync``), ``Wait`` (``cuStreamWaitValue32`` then
   a reset by ``cuStreamWriteValue32``), ``Signal`` (``cuStreamWriteValue32`` into this rank's or a peer's flag
   header), and events between the two streams.
3. ``C`` waits for ``X``: the result is complete on the caller's stream, as after ``matmul`` and a collective.

With ``FLASHOVERLAP_DEBUG_TIMEOUT`` set (outside a capture), an event after every flag wait is polled with a
deadline; a wait that does not end in time raises an error naming the rank, the op, the group and the flag.
"""

from __future__ import annotations

import time

import torch

from flashoverlap.comm import ring_schedule as rs
from flashoverlap.comm import stream_ops
from flashoverlap.comm.nccl import debug_timeout
from flashoverlap.comm.symmetric import SymmetricWorkspace
from flashoverlap.plan import Plan

REGION_ALIGN = 1 << 16


class P2PCommunicator:
    """Copy stream, events and symmetric workspace for one (process group, device) (``comm/state.py``)."""

    def __init__(self, state) -> None:
        self.group = state.group
        self.device = state.device
        self.rank = state.rank
        self.world_size = state.world_size
        self.name = state.name
        self.copy_stream = torch.cuda.Stream(device=self.device, priority=-(1 << 10))
        self.workspace = SymmetricWorkspace(self.group, self.device)
        self._events: list[torch.cuda.Event] = []
        self._flag_ptrs: dict[tuple[int, int], int] = {}
        self._warm: set[tuple] = set()  # (plan, dtype, b's strides) whose cuBLAS kernels are loaded

    def _region_bytes(self) -> int:
        return (self.workspace.nbytes // rs.regions(self.world_size)) // REGION_ALIGN * REGION_ALIGN

    def run(self, plan: Plan, a: torch.Tensor, b: torch.Tensor, op: str,
            return_gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One overlapped call of ``plan`` (not sequential): the op's result, and for all-gather the gathered input
        (rank order) where ``return_gathered``."""
        self.prepare(plan, a.dtype, op)
        if plan.op == "all_gather":
            a = a.contiguous()  # the copy engine moves the shard's rows as one block
        if (plan, a.dtype, b.stride()) not in self._warm:
            self._load_kernels(plan, a, b, op)
        rows = plan.block_rows if plan.op == "reduce_scatter" else plan.m
        out = torch.empty((rows, plan.n), dtype=a.dtype, device=a.device)
        gathered = None
        if return_gathered:
            gathered = torch.empty((plan.m, plan.k), dtype=a.dtype, device=a.device)
        self.issue(plan, a, b, out, op, gathered)
        return out, gathered

    def prepare(self, plan: Plan, dtype: torch.dtype, op: str) -> None:
        """Step 1: the workspace holds this plan's largest region, in each of the ``W + 1`` region slots."""
        width = plan.k if plan.op == "all_gather" else plan.n
        element = torch.empty((), dtype=dtype).element_size()
        need = rs.region_rows(plan) * width * element
        if need > self._region_bytes():
            size = rs.regions(self.world_size) * (need + REGION_ALIGN)
            if self.workspace.ensure(size, op, ones=(rs.FREE_BASE, rs.FLAG_SLOTS_USED)):
                self._flag_ptrs.clear()

    def issue(self, plan: Plan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, op: str,
              gathered: torch.Tensor | None = None) -> None:
        """Steps 2 and 3 of one call of ``plan`` (after ``prepare``): ``out`` receives the op's result on the
        caller's stream; for all-gather ``gathered`` [M, K] receives the gathered input (its own rows only where it
        is returned)."""
        ops = rs.schedule(plan, self.rank, gathered_own=gathered is not None and plan.op == "all_gather")
        compute = torch.cuda.current_stream(self.device)
        copy = self.copy_stream
        while len(self._events) < rs.events(ops):
            self._events.append(torch.cuda.Event())
        events = self._events
        element = a.element_size()
        width = plan.k if plan.op == "all_gather" else plan.n
        row_bytes = width * element
        region = self._region_bytes()
        own_sym = self.workspace.local((self.workspace.nbytes,), torch.uint8)
        if gathered is None and plan.op == "all_gather":
            gathered = torch.empty((plan.m, plan.k), dtype=a.dtype, device=self.device)
        tensors = {"a": a, "out": out, "gathered": gathered}
        bases = {"a": a.data_ptr(), "out": out.data_ptr(), "gathered": 0 if gathered is None else gathered.data_ptr()}
        streams = {"C": compute, "X": copy}
        timeout = None if torch.cuda.is_current_stream_capturing() else debug_timeout()
        waited: list[tuple[torch.cuda.Event, rs.Wait]] = []

        def sym_view(loc: rs.Loc, rows: int) -> torch.Tensor:
            start = rs.region_index(loc.kind, self.world_size) * region + loc.row * row_bytes
            return own_sym[start : start + rows * row_bytes].view(a.dtype).view(rows, width)

        def address(loc: rs.Loc) -> int:
            if loc.space == "sym":
                return (self.workspace.peer_ptr(loc.rank) + rs.region_index(loc.kind, self.world_size) * region
                        + loc.row * row_bytes)
            if loc.space == "flag":
                return self._flag_ptr(loc.rank, loc.row)
            row = plan.n * element if loc.space == "out" else row_bytes
            return bases[loc.space] + loc.row * row

        events[0].record(compute)
        for item in ops:
            if isinstance(item, rs.Mm):
                src = tensors[item.src.space][item.src.row : item.src.row + item.rows]
                if item.dst.space == "sym":
                    dst = sym_view(item.dst, item.rows)
                else:
                    dst = tensors[item.dst.space][item.dst.row : item.dst.row + item.rows]
                if item.accumulate:
                    dst.addmm_(src, b)
                else:
                    torch.mm(src, b, out=dst)
            elif isinstance(item, rs.Copy):
                stream_ops.copy(copy, address(item.dst), address(item.src), item.rows * row_bytes)
            elif isinstance(item, rs.Wait):
                stream = streams[item.stream]
                flag = address(item.flag)
                stream_ops.wait_geq(stream, flag, 1)
                stream_ops.write(stream, flag, 0)
                if timeout is not None:
                    waited.append((stream.record_event(), item))
            elif isinstance(item, rs.Signal):
                stream_ops.write(streams[item.stream], address(item.flag), 1)
            elif isinstance(item, rs.Record):
                events[item.event].record(streams[item.stream])
            else:
                streams[item.stream].wait_event(events[item.event])
        compute.wait_stream(copy)
        for tensor in (a, out, gathered):
            if tensor is not None:
                tensor.record_stream(copy)
        if timeout is not None:
            self._check_progress(waited, timeout, op)

    def _load_kernels(self, plan: Plan, a: torch.Tensor, b: torch.Tensor, op: str) -> None:
        """Run each matmul shape of the schedule once, eagerly, on scratch outputs: the call queues them behind
        stream waits, and a kernel that is not loaded yet must not be launched there (deadlock rule 3)."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{op}: the first P2P call of a shape loads its cuBLAS kernels and cannot be captured "
                               "in a CUDA graph; call it once, eagerly, before capturing")
        source = a if plan.op != "all_gather" else a.new_zeros((plan.m, plan.k))
        for rows, accumulate in {(item.rows, item.accumulate) for item in rs.schedule(plan, self.rank)
                                 if isinstance(item, rs.Mm)}:
            scratch = torch.zeros((rows, plan.n), dtype=a.dtype, device=a.device)
            if accumulate:
                scratch.addmm_(source[:rows], b)
            else:
                torch.mm(source[:rows], b, out=scratch)
        torch.cuda.synchronize(self.device)
        self._warm.add((plan, a.dtype, b.stride()))

    def _flag_ptr(self, rank: int, slot: int) -> int:
        ptr = self._flag_ptrs.get((rank, slot))
        if ptr is None:
            ptr = self._flag_ptrs[(rank, slot)] = self.workspace.flag_ptr(rank, slot)
        return ptr

    def _check_progress(self, waited, timeout: float, op: str) -> None:
        deadline = time.monotonic() + timeout
        for event, item in waited:
            while not event.query():
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"flashoverlap: rank {self.rank}: {op} on {self.name} (P2P path) waited more than "
                        f"{timeout:g} s (FLASHOVERLAP_DEBUG_TIMEOUT) for {item.what}: a peer never reached this "
                        "call, or called with other shapes or dtypes"
                    )
                time.sleep(1e-4)
