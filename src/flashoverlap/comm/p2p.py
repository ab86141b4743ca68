"""The P2P communicator (Flux's design, over NVLink): copy engines pull peers' data from symmetric memory, so the
communication takes no SM and the GEMM may hold every SM while it waits.

Reduce-scatter, one call (``prepare_reduction`` before the GEMM, ``reduce`` after it is launched; the copy
stream's operations come from ``p2p_schedule.reduction``, which the CPU tests simulate for every rank):
the GEMM writes its ``[group][W][rows][N]`` workspace straight into this rank's symmetric memory and bumps a
counter per group. On ``S``, per group: wait for the counter (no SM) and reset it; tell every peer "my band g is
written" by setting flag ``g*W + rank`` in the peer's workspace (a stream write into peer memory); wait until every
peer has set ours, and reset them; pull each rank's partial of this rank's rows (own first, then rank+1, ...) into
a local scratch with the copy engine; sum the W partials into the output band (one small kernel, fp32
accumulation). Last, the **done** barrier on ``S``: no rank's next call overwrites a workspace a peer still pulls
from; then ``P`` joins ``S``.

All-reduce is the same with the group's rows of ``C`` cut into W shares: rank r sums share r of every rank's
partial into its output, copies that reduced share back into its own workspace (no peer reads those partial rows),
sets a second flag in every peer, and pulls every peer's reduced share into its output once their flags are set.

Barriers are stream memory operations too (``p2p_schedule.barrier``): each rank sets its slot of the channel in
every peer's flag header, waits for the peers' slots in its own and resets them. No kernel and no host wait (the
kernel barrier of PyTorch's symmetric memory blocked the host for 1.3-1.7 ms a call behind these streams on the
H200s), and, since every flag is reset by its waiter before anything a peer's next signal depends on, no epochs:
the same operations can be captured in a CUDA graph and replayed.

Why it cannot deadlock: the GEMMs wait on nothing; each ``S`` waits on its own GEMM's counters and on flags that
the peers' ``S`` set after waiting only on their own GEMMs' counters (all-reduce's second round: on the peers'
first rounds, which every ``S`` completes before its own second; the done barrier: on the peers' whole schedules,
which need nothing of this rank that precedes it); copies need no SM, and the summing kernels need SMs but nothing
waits for them except the stream that follows. They are queued behind stream waits, so the first call of each plan
runs them once beforehand, eagerly (rule 3: no kernel is loaded behind a wait).

All-gather, one call, on the caller's (producer) stream ``P`` and this communicator's copy stream ``S``:

1. On ``P``: this rank's shard into its symmetric workspace and into its own slots of the gathered buffer.
2. On ``S`` (after ``P``): the **ready** barrier (every rank's shard is in place before anyone pulls); for each
   group's band, for each peer in rotated order (rank+1, rank+2, ...: at any moment the ranks pull from different
   peers), ``cuMemcpyDtoDAsync`` of the peer's band rows into their slot, then ``cuStreamWriteValue32(flags[g] =
   1)``; last the **done** barrier: no rank overwrites its workspace (step 1 of the next call) while a peer may
   still be pulling from it.
3. On ``P``: the GEMM, on every SM, computes its own shard's tiles and waits in the kernel (acquire) for each
   band's flag (launched after step 2 is queued: rule 1). It starts without waiting for the peers.
4. On ``P``: wait for ``S`` and clear the flags.

Why it cannot deadlock: the GEMM waits only on flags that ``S`` writes after copies, which need no SM and depend
only on the peers' ready signals; each rank signals ready after work that waits on nothing, and done after its own
copies. Under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` all of ``S`` is queued ahead of the GEMM. Inside a CUDA graph the
op expresses each band's arrival as a graph edge instead (``events=True``), because a graph may order a spinning
kernel ahead of its producer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashoverlap.comm import p2p_schedule as schedule
from flashoverlap.comm import stream_ops
from flashoverlap.comm.collectives import place_own_shard
from flashoverlap.comm.symmetric import SymmetricWorkspace
from flashoverlap.plan import MAX_GROUPS, Plan

_COMMUNICATORS: dict[tuple[int, int], P2PCommunicator] = {}


def communicator(group: dist.ProcessGroup, device: torch.device) -> P2PCommunicator:
    """The P2P communicator of ``group`` on ``device``, created on first use."""
    key = (id(group), device.index)
    comm = _COMMUNICATORS.get(key)
    if comm is None or comm.group is not group:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "flashoverlap: the first P2P call for a process group creates streams and symmetric memory and "
                "cannot be captured in a CUDA graph; call the op once before capturing"
            )
        comm = _COMMUNICATORS[key] = P2PCommunicator(group, device)
    return comm


class P2PCommunicator:
    """A copy stream, per-band flags and counters, and a symmetric workspace for one (process group, device)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.copy_stream = torch.cuda.Stream(device=device, priority=-(1 << 10))
        self.flags = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device)  # all-gather: band g has landed
        self.counters = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device)  # reduce-scatter: tiles done
        self.workspace = SymmetricWorkspace(group, device)
        self._summed: set[tuple[Plan, torch.dtype]] = set()  # plans whose summing kernels are loaded

    # -- all-gather ----------------------------------------------------------------------------------------------
    def all_gather(self, gathered: torch.Tensor, a_shard: torch.Tensor, plan: Plan,
                   events: bool = False) -> list[torch.cuda.Event]:
        """Fill ``gathered`` (the plan's ``[group][W][rows][K]`` layout) band by band, raising ``flags[g]`` once
        band ``g`` of every peer has landed (or, with ``events``, returning one event per band instead)."""
        producer = torch.cuda.current_stream(self.device)
        shard_rows, k = a_shard.shape
        self.workspace.ensure(a_shard.numel() * a_shard.element_size(), "all_gather_gemm")
        self.workspace.local((shard_rows, k), a_shard.dtype).copy_(a_shard)
        place_own_shard(gathered, a_shard, plan, self.rank)
        self.copy_stream.wait_stream(producer)
        row_bytes = k * a_shard.element_size()
        bases = {"gathered": lambda rank: gathered.data_ptr(), "shard": self.workspace.peer_ptr}
        arrived: list[torch.cuda.Event] = []

        def address(loc: schedule.Loc) -> int:
            if loc.space == "band":
                return self.flags.data_ptr() + 4 * loc.offset
            return bases[loc.space](loc.rank) + loc.offset * row_bytes

        def band_arrived(op: schedule.Write) -> bool:  # in a capture: the band's arrival as a graph edge
            if events and op.loc.space == "band":
                arrived.append(self.copy_stream.record_event())
                return True
            return False

        self._execute(schedule.all_gather(plan, self.rank), address, row_bytes, band_arrived)
        return arrived

    def finish_all_gather(self, plan: Plan) -> None:
        """After the GEMM: join the copy stream (whose last operations are the done barrier) and clear the
        flags."""
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self.flags[: plan.num_groups].zero_()

    def _execute(self, ops: tuple, address, row_bytes: int, intercept=None, out=None, scratch=None) -> None:
        """Issue ``ops`` (``p2p_schedule``) on the copy stream: ``address(loc)`` resolves the call's own spaces
        (the workspace headers' flags are resolved here), copies move ``rows * row_bytes`` bytes, and
        ``intercept(op)`` may take a write over (returning True)."""
        stream = self.copy_stream

        def resolve(loc: schedule.Loc) -> int:
            return self.workspace.flag_ptr(loc.rank, loc.offset) if loc.space == "flag" else address(loc)

        with torch.cuda.stream(stream):
            for op in ops:
                if isinstance(op, schedule.WaitGeq):
                    stream_ops.wait_geq(stream, resolve(op.loc), op.value)
                elif isinstance(op, schedule.Write):
                    if intercept is None or not intercept(op):
                        stream_ops.write(stream, resolve(op.loc), op.value)
                elif isinstance(op, schedule.Copy):
                    stream_ops.copy(stream, resolve(op.dst), resolve(op.src), op.rows * row_bytes)
                else:
                    self._sum(out, scratch, op)

    # -- reduce-scatter and all-reduce -------------------------------------------------------------------------
    def prepare_reduction(self, plan: Plan, dtype: torch.dtype) -> torch.Tensor:
        """Before the GEMM: the workspace it must write (in symmetric memory), and ``S`` ordered after earlier
        work (not after the GEMM: ``S`` must see each group's counter while the GEMM still runs)."""
        if 2 * plan.num_groups * self.world_size > schedule.GROUP_FLAG_SLOTS:
            raise ValueError(f"{plan.op}: the P2P path supports groups * world_size <= "
                             f"{schedule.GROUP_FLAG_SLOTS // 2}, got "
                             f"{plan.num_groups} * {self.world_size}")
        element_size = torch.empty((), dtype=dtype).element_size()
        self.workspace.ensure(plan.m * plan.n * element_size, plan.op)
        if (plan, dtype) not in self._summed:
            self._warm_sums(plan, dtype)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.workspace.local((plan.m, plan.n), dtype)

    def _scratch(self, plan: Plan, dtype: torch.dtype) -> torch.Tensor:
        rows = schedule.scratch_rows(plan, self.rank)
        return torch.empty((self.world_size, max(rows, 1), plan.n), dtype=dtype, device=self.device)

    def _sum(self, out: torch.Tensor, scratch: torch.Tensor, op: schedule.Sum) -> None:
        rows = slice(op.scratch_row, op.scratch_row + op.rows)
        torch.sum(scratch[:, rows], dim=0, out=out[op.out_row : op.out_row + op.rows])

    def _warm_sums(self, plan: Plan, dtype: torch.dtype) -> None:
        """Run the plan's summing kernels once, eagerly, on same-shaped buffers: a call queues them behind stream
        waits, and a kernel that is not loaded yet must not be launched there (deadlock rule 3)."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{plan.op}: the first P2P call of a plan loads its kernels and cannot be captured "
                               "in a CUDA graph; call it once before capturing")
        out_rows = plan.block_rows if plan.op == "reduce_scatter" else plan.m
        out = torch.zeros((out_rows, plan.n), dtype=dtype, device=self.device)
        scratch = self._scratch(plan, dtype).zero_()
        for op in schedule.reduction(plan, self.rank):
            if isinstance(op, schedule.Sum):
                self._sum(out, scratch, op)
        torch.cuda.synchronize(self.device)
        self._summed.add((plan, dtype))

    def reduce(self, out: torch.Tensor, plan: Plan) -> None:
        """After the GEMM is launched on the current stream, run ``schedule.reduction`` on the copy stream:
        reduce-scatter: this rank's rows of the sum into ``out`` ``[M/W, N]``; all-reduce: the whole sum into
        ``out`` ``[M, N]``, each rank reducing its share of every group and pulling the peers' reduced shares."""
        producer = torch.cuda.current_stream(self.device)
        row_bytes = plan.n * out.element_size()
        scratch = self._scratch(plan, out.dtype)  # contiguous [W][rows][N]: the schedule counts its rows flat
        scratch.record_stream(self.copy_stream)
        bases = {"out": lambda rank: out.data_ptr(), "scratch": lambda rank: scratch.data_ptr(),
                 "work": self.workspace.peer_ptr}

        def address(loc: schedule.Loc) -> int:
            if loc.space == "counter":
                return self.counters.data_ptr() + 4 * loc.offset
            return bases[loc.space](loc.rank) + loc.offset * row_bytes

        self._execute(schedule.reduction(plan, self.rank), address, row_bytes, out=out, scratch=scratch)
        producer.wait_stream(self.copy_stream)
