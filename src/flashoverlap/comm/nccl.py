"""The NCCL communicator (FlashOverlap's design): per group, a zero-SM stream wait on the GEMM's counter, then a
plain ``torch.distributed`` collective on the group's contiguous slice, on a high-priority stream.

Protocol for one call, on the caller's (producer) stream ``P`` and this communicator's stream ``S``:

1. ``prepare``: everything that may block or allocate happens first, outside any wait: the NCCL communicator is
   created and its kernels loaded by a warm-up collective (deadlock rule 3), a capped-CTA clone of the process
   group is created if the plan asks for one, and ``S`` waits for ``P``'s earlier work.
2. The caller launches the signalling GEMM on ``P`` (rule 1: the producer is submitted before any wait on it).
3. ``all_reduce``: on ``S``, for each group: ``cuStreamWaitValue32(counter[g] >= tiles in g)``, then
   ``cuStreamWriteValue32(counter[g] = 0)`` (so counters are zero again for the next call, and a CUDA graph of
   the call can be replayed), then the collective. PyTorch >= 2.8 launches a synchronous collective on the
   current stream, so the NCCL kernels run on ``S`` itself, with its priority.
4. ``P`` waits for ``S``: work after the call sees the reduced result, and the next call's GEMM cannot bump a
   counter before this call's reset of it.

Why this cannot deadlock: every wait on ``S`` is on a counter that the GEMM, already submitted on ``P``, drives to
exactly the awaited value (the plan's tile counts; the kernel bumps each group once per tile). The GEMM waits on
nothing. ``CUDA_DEVICE_MAX_CONNECTIONS=1`` only serialises the hardware queue behind the GEMM, which is already
ahead of every wait. With ``FLASHOVERLAP_DEBUG_TIMEOUT`` set, the host checks each group's wait with a deadline
and raises an error naming the group and rank instead of hanging (rule 4).

SMs: NCCL's kernels need SMs while the GEMM runs. A plan's ``num_programs`` below the SM count leaves SMs free, a
plan with one program per tile lets NCCL's blocks in as GEMM programs retire, and ``comm_ctas`` sets NCCL's CTA count
through a clone of the caller's process group created with that NCCL config (docs/why-overlap-is-hard.md).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from flashoverlap.comm import stream_ops
from flashoverlap.comm.collectives import all_gather_into_tensor, place_own_shard, reduce_scatter_tensor
from flashoverlap.plan import MAX_GROUPS, Plan

_COMMUNICATORS: dict[tuple[int, int], NcclCommunicator] = {}


def debug_timeout() -> float | None:
    """Seconds to wait for each group before raising, from ``FLASHOVERLAP_DEBUG_TIMEOUT`` (unset: no check)."""
    value = os.environ.get("FLASHOVERLAP_DEBUG_TIMEOUT")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"FLASHOVERLAP_DEBUG_TIMEOUT must be a number of seconds, got {value!r}") from None
    return seconds if seconds > 0 else None


def communicator(group: dist.ProcessGroup, device: torch.device) -> NcclCommunicator:
    """The communicator of ``group`` on ``device``, created on first use."""
    key = (id(group), device.index)
    comm = _COMMUNICATORS.get(key)
    if comm is None or comm.group is not group:
        _refuse_inside_capture()
        comm = _COMMUNICATORS[key] = NcclCommunicator(group, device)
    return comm


def _refuse_inside_capture() -> None:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "flashoverlap: the first call of an op for a (process group, dtype, comm_ctas) creates NCCL state and "
            "buffers and cannot be captured in a CUDA graph; call the op once before capturing"
        )


class NcclCommunicator:
    """Counters, a high-priority stream and the NCCL groups for one (process group, device)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        # The most negative priority is clamped to the device's highest.
        self.comm_stream = torch.cuda.Stream(device=device, priority=-(1 << 10))
        self.counters = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device)
        # All-gather: flags[g] != 0 once group g's band of every shard has landed; zero between calls.
        self.flags = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=device)
        self._warm: set[tuple[str, int, torch.dtype]] = set()
        self._capped_groups: dict[int, dist.ProcessGroup] = {}
        # When a list: each reduction-type call appends, per group, (index, ready event, done event): the moment
        # the comm stream saw the group's tiles complete, and the moment its collective finished (timeline).
        self.timeline: list | None = None

    # -- 1. before the GEMM -----------------------------------------------------------------------------
    def prepare(self, plan: Plan, dtype: torch.dtype) -> None:
        if (plan.op, plan.comm_ctas, dtype) not in self._warm:
            _refuse_inside_capture()
            comm_group = self.comm_group(plan.comm_ctas)
            # The very collective the plan will issue, once, outside any wait: NCCL loads its kernels lazily.
            world_size = dist.get_world_size(comm_group)
            probe = torch.zeros(8 * world_size, dtype=dtype, device=self.device)
            with torch.cuda.stream(self.comm_stream):
                if plan.op == "reduce_scatter":
                    reduce_scatter_tensor(probe[:8], probe, comm_group)
                elif plan.op == "all_gather":
                    all_gather_into_tensor(probe, probe[8 * self.rank : 8 * (self.rank + 1)], comm_group)
                else:
                    dist.all_reduce(probe, group=comm_group)
            self.comm_stream.synchronize()
            self._warm.add((plan.op, plan.comm_ctas, dtype))
        self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))

    def comm_group(self, comm_ctas: int) -> dist.ProcessGroup:
        """The process group that carries the collectives of plans with this ``comm_ctas``: the caller's group
        for 0, otherwise a clone of it whose NCCL communicator uses exactly ``comm_ctas`` CTAs (created on first
        use, collectively over the group's ranks)."""
        if comm_ctas == 0:
            return self.group
        if comm_ctas not in self._capped_groups:
            options = dist.ProcessGroupNCCL.Options()
            options.config.min_ctas = comm_ctas
            options.config.max_ctas = comm_ctas
            options.is_high_priority_stream = True
            ranks = dist.get_process_group_ranks(self.group)
            self._capped_groups[comm_ctas] = dist.new_group(
                ranks, backend="nccl", pg_options=options, use_local_synchronization=True
            )
        return self._capped_groups[comm_ctas]

    # -- 3. and 4. after the GEMM ---------------------------------------------------------------------
    def all_reduce(self, c: torch.Tensor, plan: Plan, ready: list[torch.cuda.Event] | None = None) -> None:
        """All-reduce ``c`` group by group as the GEMM (already launched on the current stream) finishes each
        (its counters tell; or, for bands computed by cuBLAS, the events in ``ready``)."""
        self._issue(plan, lambda grp, group: dist.all_reduce(c[grp.row_start : grp.row_end], group=group), ready)

    def reduce_scatter(self, out: torch.Tensor, workspace: torch.Tensor, plan: Plan,
                       ready: list[torch.cuda.Event] | None = None) -> None:
        """Reduce-scatter each group's ``[W][rows][N]`` slice of ``workspace`` into its band of this rank's
        ``out [M/W, N]``, as the GEMM (already launched on the current stream) finishes each group."""

        def launch(grp, group):
            band = workspace[grp.out_row_start : grp.out_row_end]
            reduce_scatter_tensor(out[grp.row_start : grp.row_end], band, group)

        self._issue(plan, launch, ready)

    def all_gather(self, gathered: torch.Tensor, a_shard: torch.Tensor, plan: Plan,
                   events: bool = False) -> list[torch.cuda.Event]:
        """Fill ``gathered`` (the plan's ``[group][W][rows][K]`` layout) band by band on the communication stream,
        raising ``flags[g]`` once band ``g`` has landed. Here communication is the producer and the GEMM the
        consumer, so this is called *before* the GEMM is launched (rule 1); the GEMM must leave ``comm_ctas`` SMs
        free for these collectives (rule 2, checked by the op).

        With ``events``, each band's arrival is published as a CUDA event (returned, one per group) instead of a
        flag: inside a CUDA graph the consumer must depend on the bands through graph edges, because a graph may
        queue the NCCL kernels behind a kernel that spins on their flags."""
        producer = torch.cuda.current_stream(self.device)
        # This rank's bands into their slots first, on the producer stream; each band's all-gather reads its slot
        # in place.
        placed = place_own_shard(gathered, a_shard, plan, self.rank)
        self.comm_stream.wait_stream(producer)
        comm_group = self.comm_group(plan.comm_ctas)
        base = self.flags.data_ptr()
        arrived = []
        with torch.cuda.stream(self.comm_stream):
            for grp, (band, slot) in zip(plan.groups, placed):
                all_gather_into_tensor(band, slot, comm_group)
                if events:
                    arrived.append(self.comm_stream.record_event())
                else:
                    stream_ops.write(self.comm_stream, base + 4 * grp.index, 1)
        return arrived

    def finish_all_gather(self, plan: Plan) -> None:
        """After the GEMM: join the communication stream, then clear the flags (every one has been written by
        then, so no late write can leave a stale flag for the next call)."""
        torch.cuda.current_stream(self.device).wait_stream(self.comm_stream)
        self.flags[: plan.num_groups].zero_()

    def _issue(self, plan: Plan, launch, ready: list[torch.cuda.Event] | None = None) -> None:
        producer = torch.cuda.current_stream(self.device)
        comm_group = self.comm_group(plan.comm_ctas)
        timeout = None if torch.cuda.is_current_stream_capturing() else debug_timeout()
        timing = self.timeline is not None and not torch.cuda.is_current_stream_capturing()
        waited = []
        base = self.counters.data_ptr()
        with torch.cuda.stream(self.comm_stream):
            for grp in plan.groups:
                if ready is not None:  # bands computed by cuBLAS: an event per group, no counter
                    self.comm_stream.wait_event(ready[grp.index])
                else:
                    address = base + 4 * grp.index
                    stream_ops.wait_geq(self.comm_stream, address, grp.tile_count)
                    stream_ops.write(self.comm_stream, address, 0)
                if timeout is not None or timing:
                    waited.append(self.comm_stream.record_event(torch.cuda.Event(enable_timing=timing)))
                launch(grp, comm_group)
                if timing:
                    self.timeline.append((grp.index, waited[-1], self.comm_stream.record_event(
                        torch.cuda.Event(enable_timing=True))))
        producer.wait_stream(self.comm_stream)
        if timeout is not None:
            self._check_progress(plan, waited, timeout)

    def _check_progress(self, plan: Plan, waited: list[torch.cuda.Event], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for grp, event in zip(plan.groups, waited):
            while not event.query():
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"flashoverlap: rank {self.rank}: group {grp.index} of {plan.num_groups} (rows "
                        f"[{grp.row_start}, {grp.row_end})) did not see its {grp.tile_count} tiles within "
                        f"{timeout:g} s (FLASHOVERLAP_DEBUG_TIMEOUT); its counter never reached the plan's count"
                    )
                time.sleep(1e-4)
