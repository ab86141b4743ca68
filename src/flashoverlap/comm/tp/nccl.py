"""The NCCL communicator (FlashOverlap's design): per group, a zero-SM stream wait on the GEMM's counter, then a
plain ``torch.distributed`` collective on the group's contiguous slice, on a high-priority stream.

Protocol for one call, on the caller's (producer) stream ``P`` and this communicator's stream ``S``:

1. ``prepare``: everything that may block or allocate happens first, outside any wait: the NCCL communicator is
   created and its kernels loaded by a warm-up collective (deadlock rule 3), a capped-CTA clone of the process
   group is created if the plan asks for one, and ``S`` waits for ``P``'s earlier work.
2. The caller launches the signalling GEMM on ``P`` (rule 1: the producer is submitted before any wait on it).
3. ``all_reduce``: on ``S``, for each group: ``cuStreamWaitValue32(counter[g] >= tiles in g)``, then
   ``cuStreamWriteValue32(counter[g] = 0)`` (so counters are zero again for the next call, and a CUDA graph of
   the call can be replayed), then the collective. Inside a graph the wait and reset are a one-warp kernel instead
   (``kernels/counters.py``: a graph's memory-operation nodes cost the host microseconds per launch each), loaded
   by the first call's warm-up like the collective's kernels.
   PyTorch >= 2.8 launches a synchronous collective on the current stream, so the NCCL kernels run on ``S`` itself,
   with its priority.
4. ``P`` waits for ``S``: work after the call sees the reduced result, and the next call's GEMM cannot bump a
   counter before this call's reset of it.

Why this cannot deadlock: every wait on ``S`` is on a counter that the GEMM, already submitted on ``P``, drives to
exactly the awaited value (the plan's tile counts; the kernel bumps each group once per tile). The GEMM waits on
nothing (so a graph's wait kernel, spinning in one warp of one SM, can delay it but never stop it).
``CUDA_DEVICE_MAX_CONNECTIONS=1`` only serialises the hardware queue behind the GEMM, which is already ahead of every
wait when the call is issued eagerly. A graph launches its independent branches in an order of its own, so the
library does not replay under that setting (``settings.py``), and a user's capture under it takes cuBLAS bands
instead of the signalling GEMM (``runtime/policy.captured_plan``): the collectives then depend on the bands through
graph edges, and no kernel spins on a counter in the one queue. With
``FLASHOVERLAP_DEBUG_TIMEOUT`` set, the host checks each group's wait with a deadline and raises an error naming the
group and rank instead of hanging (rule 4).

SMs: NCCL's kernels need SMs while the GEMM runs. A plan's ``num_programs`` below the SM count leaves SMs free, a
plan with one program per tile lets NCCL's blocks in as GEMM programs retire, and ``comm_ctas`` sets NCCL's CTA count
through a clone of the caller's process group created with that NCCL config
(benchmarks/results/logs/why-overlap-is-hard.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from flashoverlap import guards
from flashoverlap.comm import nccl_calls, scaled, stream_ops
from flashoverlap.comm.collectives import (
    all_gather_into_tensor,
    all_gather_now,
    all_reduce_now,
    even_band_rows,
    gathered_in_rank_order,
    place_own_shard,
    reduce_scatter_now,
    reduce_scatter_tensor,
)
from flashoverlap.comm.protocol import Call, CommGroup, GroupFields, HeldHook
from flashoverlap.comm.replay import CallGraphs, addresses, allocate, gemm_call_inputs, gemm_call_signature
from flashoverlap.comm.scaled import cublas_takes
from flashoverlap.comm.stream_ops import counter_wait_kernel, load_wait_kernel
from flashoverlap.plan import MAX_GROUPS, Plan, nccl_free_sms


class _Buffers:
    """One call's tensors: what it returns, allocated by ``NcclCommunicator._buffers`` before the call is looked up for
    replay (``result``; for all-gather where the gathered input is returned ``in_rank_order``, and fp8's ``dense``
    rows and scales), and its workspace, allocated by ``_workspace`` as the first step of the issued work (``product``,
    the reductions' GEMM output: ``result`` itself for all-reduce, the ``[group][W][rows][N]`` workspace for
    reduce-scatter; for all-gather ``gathered``, the plan's band layout, and fp8's own shard: where the bands are even
    their rows (``band_rows``), the shard packed straight into its slots, else a ``packed`` ``[rows, width]`` buffer
    it is packed into and placed from (``_Gathered.pack_own``). Inside this
    communicator's capture the workspace comes from the graphs' pool and stays the graph's: a replayed call allocates
    only what it returns (host time), and its signature holds only their addresses."""

    __slots__ = ("result", "product", "gathered", "packed", "band_rows", "in_rank_order", "dense", "returned")

    def __init__(self) -> None:
        self.result = self.product = self.gathered = self.packed = self.band_rows = self.in_rank_order = None
        self.dense = None

    @classmethod
    def allocate(cls, op: str, shapes: tuple, device: torch.device) -> _Buffers:
        """The returned tensors of ``NcclCommunicator._output_shapes``, allocated in that order (``returned``)."""
        buffers = cls()
        buffers.returned = tensors = allocate(shapes, device)
        buffers.result = tensors[0]
        if op == "all_reduce":
            buffers.product = tensors[0]
        elif len(tensors) > 1:
            buffers.in_rank_order = tensors[1]
            if len(tensors) > 2:
                buffers.dense = (tensors[2], tensors[3])
        return buffers

    def addresses(self) -> tuple:
        """Where the returned tensors lie (the workspace is the graph's own)."""
        return addresses(self.returned)


def _returned(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, object]:
    """A call's ``(result, extra)`` from its returned tensors (``_Buffers.returned``): all-gather's gathered input
    where returned, fp8's as its dense rows and scales."""
    if len(tensors) == 1:
        return tensors[0], None
    return tensors[0], tensors[1] if len(tensors) == 2 else (tensors[2], tensors[3])


class NcclCommunicator(GroupFields):
    """Counters, a high-priority stream and the NCCL groups for one (process group, device)."""

    path = "nccl"

    def __init__(self, group: CommGroup) -> None:
        super().__init__(group)
        self.comm_stream = guards.comm_stream(self.device)
        self.counters = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=self.device)
        # All-gather: flags[g] != 0 once group g's band of every shard has landed; zero between calls.
        self.flags = torch.zeros(MAX_GROUPS, dtype=torch.int32, device=self.device)
        self._warm: set[tuple[str, int, torch.dtype]] = set()
        self._wait_loaded = False  # the graphs' counter-wait kernel (kernels/counters.py) loaded on this device
        self._capped_groups: dict[int, dist.ProcessGroup] = {}
        self._comm_handle = self.comm_stream.cuda_stream
        self._index = self.device.index if self.device.index is not None else 0
        self._joins: tuple[int, int] | None = None  # driver events: producer -> comm stream, and back
        self._bands: dict[tuple, tuple] = {}  # per plan: each group's row ranges or offsets, computed once
        # By comm_ctas: the NCCL communicator that carries those plans' collectives, called directly
        # (comm/nccl_calls.py; None: through torch.distributed), found once the group has run a collective.
        self._direct: dict[int, nccl_calls.NcclComm | None] = {}
        self.graphs = CallGraphs(self.device)  # repeated calls replayed (comm/replay.py)

    # -- one call ----------------------------------------------------------------------------------------
    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One overlapped call of ``call.plan`` (not sequential): the op's result, and for all-gather the gathered
        input in rank order where asked. The hook is issued once the op's own work is queued (it then runs beside
        the op's last collectives).

        Every tensor the call returns or hands between its streams is allocated first, in one order, whatever
        happens next (``_buffers``): so a repeated call finds them at the addresses of the previous one, and a call
        that repeats with the same tensors (``call.replay``, a hook that is ``HeldHook`` or none) replays a CUDA graph
        of its whole schedule, counter waits and resets and NCCL collectives included (``comm/replay.py``; captured
        on the signature's second call, once the first, eager, has made the NCCL state and loaded the kernels)."""
        hook = call.hook
        buffers = self._buffers(call)
        if call.replay and (hook is None or isinstance(hook, HeldHook)):
            signature = self._signature(call, buffers)
            if self.graphs.run(signature, lambda: self._issue_call(call, buffers, captured=True)):
                return _returned(buffers.returned)
        self._issue_call(call, buffers)
        return _returned(buffers.returned)

    def _buffers(self, call: Call) -> _Buffers:
        """The tensors the call returns, allocated in one order on every call (eager, captured, replayed)."""
        return _Buffers.allocate(call.plan.op, self._output_shapes(call), call.a.device)

    def _output_shapes(self, call: Call) -> tuple:
        """``(shape, dtype)`` of each tensor the call returns, in allocation order: the result; for all-gather where
        the gathered input is returned, it in rank order, and fp8's dense rows and scales."""
        plan, a, scales = call.plan, call.a, call.scales
        out_dtype = a.dtype if scales is None else scales.out_dtype
        if plan.op == "reduce_scatter":
            return (((plan.block_rows, plan.n), out_dtype),)
        shapes = [((plan.m, plan.n), out_dtype)]
        if plan.op == "all_gather" and call.return_gathered:
            width, wire = self._gathered_width(call)
            shapes.append(((plan.m, width), wire))
            if scales is not None:
                shapes += [((plan.m, plan.k), a.dtype), ((plan.m, scales.scale_columns(plan.k)), torch.float32)]
        return tuple(shapes)

    def replayer(self, call: Call) -> Callable[[object], tuple | None] | None:
        """The replay lane of calls that read ``call``'s tensors (``comm/protocol.py``, ``CallGraphs.replayer``);
        None where none applies: not replayed, a hook, no graph held yet."""
        if not call.replay or call.hook is not None or not self.graphs:
            return None
        shapes, device = self._output_shapes(call), call.a.device

        def returned() -> tuple[tuple, list]:  # ``_Buffers.allocate``'s returned tensors, and where they lie
            tensors = allocate(shapes, device)
            return addresses(tensors), tensors

        return self.graphs.replayer(gemm_call_inputs(call), returned, _returned)

    @staticmethod
    def _gathered_width(call: Call) -> tuple[int, torch.dtype]:
        """A gathered row's width and dtype: the input's, or fp8's packed bytes (the rows and their scales)."""
        if call.scales is None:
            return call.plan.k, call.a.dtype
        return scaled.row_bytes(call.plan.k, call.a.dtype, call.scales), torch.uint8

    def _workspace(self, call: Call, buffers: _Buffers) -> None:
        """The call's workspace (``_Buffers``), as the first step of its issued work; after the returned tensors:
        reduce-scatter's output before its product, because the communication stream writes the output after the
        first group's wait only, while the producer stream may still be running later groups, whose temporaries
        (the dequantised fp8 product's) the caching allocator would otherwise hand to it once freed."""
        plan, device = call.plan, call.a.device
        if plan.op == "all_gather":
            width, wire = self._gathered_width(call)
            buffers.gathered = torch.empty((plan.m, width), dtype=wire, device=device)
            if call.scales is not None:  # fp8 rows as the wire carries them: straight into the own slots of even
                buffers.band_rows = even_band_rows(plan, plan.m)  # bands, else packed once and placed from here
                if buffers.band_rows is None:
                    buffers.packed = torch.empty((plan.block_rows, width), dtype=wire, device=device)
        elif plan.op == "reduce_scatter":
            buffers.product = torch.empty((plan.m, plan.n), dtype=buffers.result.dtype, device=device)

    def _signature(self, call: Call, buffers: _Buffers) -> tuple:
        """``replay.gemm_call_signature`` over the call's buffers (``comm/replay.py``)."""
        return gemm_call_signature(call, buffers.addresses())

    def _issue_call(self, call: Call, buffers: _Buffers, captured: bool = False) -> None:
        """Queue the call's whole schedule on the current stream and the communication stream, joined back into
        the current stream at the end (``captured``: into this communicator's own graph, no debug deadline)."""
        plan, a, b = call.plan, call.a, call.b
        timeout = None if captured else call.timeout
        self._workspace(call, buffers)
        if plan.op == "all_gather":
            self._all_gather_gemm(call, buffers, timeout)
        else:
            self.prepare(plan, buffers.product.dtype)
            if plan.counts_tiles and a.is_cuda and not captured and not guards.capturing(self.counters):
                # Inside a user's capture under one hardware queue this plan runs as cuBLAS bands
                # (runtime/policy.captured_plan), and a capture cannot create cuBLAS's handle: made here, eagerly.
                _cublas_ready(a.device, a.dtype)
            ready = produce(a, b, plan, self.counters, call.scales, out=buffers.product)
            if plan.op == "all_reduce":
                self.all_reduce(buffers.product, plan, ready, timeout)
            else:
                self.reduce_scatter(buffers.result, buffers.product, plan, ready, timeout)
        if call.hook is not None:
            call.hook()

    def release(self) -> None:
        """Drop the graphs and destroy the capped-CTA clones of the group (collective over the group's ranks, like
        their creation)."""
        self.graphs.clear()
        for clone in self._capped_groups.values():
            dist.destroy_process_group(clone)
        self._capped_groups.clear()
        self._warm.clear()
        self._direct.clear()

    def _all_gather_gemm(self, call: Call, buffers: _Buffers, timeout: float | None) -> None:
        """The communication stream gathers band after band (launched before the GEMM: here it is the producer)
        and raises a flag per band; the GEMM, persistent on all SMs but those left to NCCL, computes its own shard
        and then waits in-kernel for each band's flag. NCCL runs a fixed ``comm_ctas`` CTAs on SMs the GEMM never
        takes, so every wait is satisfiable (deadlock rule 2): plans that leave fewer SMs than ``nccl_free_sms``
        are refused. Inside a CUDA-graph capture (a user's, or this communicator's own for replay) the in-kernel
        waits become graph edges (``_bands_by_cublas``).

        fp8 (``call.scales``): the bands are packed rows (``comm/scaled.pack_rows``' layout: a row's fp8 bytes and its
        scales, one buffer, moved as bytes), packed straight into this rank's slots where the plan's bands are even
        (``_Gathered.pack_own``: no second copy), and the GEMM reads the fp8 rows and their scales in place from
        ``gathered`` (``comm/scaled.PackedRows``' views)."""
        plan, a_shard, b, op, scales = call.plan, call.a, call.b, call.name, call.scales
        device = a_shard.device
        if plan.gemm == "triton":  # only a GEMM that spins on the bands can starve NCCL
            check_leaves_nccl_sms(plan, guards.sm_count(device), op)
        gathered = buffers.gathered
        operand = _Gathered(gathered, plan.k, a_shard.dtype, scales)
        shard, placed, shard_scales = a_shard, False, None  # placed: the own rows in their slots already (fp8)
        if scales is not None:
            shard_scales = scales.shard_rows(plan.block_rows)
            shard, placed = operand.pack_own(a_shard, shard_scales, plan, self.rank, buffers.band_rows,
                                             buffers.packed)
        self.prepare(plan, gathered.dtype)
        if plan.gemm == "cublas" or guards.capturing():
            # fp8: the caller's shard as cuBLAS takes it (row-major, 16-byte aligned), else its packed slots (None)
            own = (a_shard, shard_scales) if scales is None or cublas_takes(a_shard, b, scales.mode) else None
            _bands_by_cublas(self, operand, shard, b, plan, buffers.result, placed, own)
        else:
            from flashoverlap.kernels.gemm import GatherWait, gemm  # Triton: imported where a kernel runs

            _cublas_ready(device, a_shard.dtype)
            self.all_gather(gathered, shard, plan, shard_placed=placed)
            wait_error = torch.zeros(1, dtype=torch.int32, device=device) if timeout else None
            # About a microsecond a poll: the debug bound in polls.
            wait = GatherWait(self.flags, self.rank, wait_error, int(timeout * 1e6) if timeout else 0)
            gemm(operand.a, b, plan, out=buffers.result, scaling=operand.scaling(), wait=wait)
            self.finish_all_gather(plan)
            if wait_error is not None and int(wait_error.item()):
                g = int(wait_error.item()) - 1
                raise RuntimeError(
                    f"flashoverlap: rank {self.rank}: {op} on {self.name} waited more than about {timeout:g} s for "
                    f"group {g} of {plan.num_groups} (FLASHOVERLAP_DEBUG_TIMEOUT); its band never arrived"
                )
        if buffers.in_rank_order is not None:
            operand.in_rank_order(plan, buffers.in_rank_order, buffers.dense)

    # -- 1. before the GEMM -----------------------------------------------------------------------------
    def prepare(self, plan: Plan, dtype: torch.dtype) -> None:
        if (plan.op, plan.comm_ctas, dtype) not in self._warm:
            guards.refuse_inside_capture(f"the first NCCL-path {plan.op} call on {self.name} creates NCCL state")
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
            if plan.comm_ctas not in self._direct:
                self._direct[plan.comm_ctas] = nccl_calls.for_group(comm_group, self.device)
        # The graphs' counter wait (plans whose GEMM bumps counters, ``Plan.counts_tiles``), loaded by the first such
        # plan's call outside a capture: a first call is eager wherever the collective's warm-up above runs with it
        # (rule 3); a plan that finds its op warmed by a cuBLAS-band plan and comes first inside a capture leaves the
        # kernel to load there (as the capture's first wait), and the next eager call loads it.
        if (not self._wait_loaded and plan.counts_tiles and self.device.type == "cuda"
                and not guards.capturing(self.counters)):
            load_wait_kernel(self.device)
            self._wait_loaded = True
        self._fork()

    def _fork(self) -> int:
        """The communication stream waits for the producer's (the current stream's) work queued so far; returns
        the producer's raw handle."""
        if self._joins is None:
            self._joins = (stream_ops.new_event(), stream_ops.new_event())
        producer = stream_ops.current(self._index)
        stream_ops.join(self._comm_handle, producer, self._joins[0])
        return producer

    def _join(self) -> None:
        """The producer (the current stream) waits for the communication stream's work queued so far."""
        stream_ops.join(stream_ops.current(self._index), self._comm_handle, self._joins[1])

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
    def all_reduce(self, c: torch.Tensor, plan: Plan, ready: list[torch.cuda.Event] | None = None,
                   timeout: float | None = None) -> None:
        """All-reduce ``c`` group by group as the GEMM (already launched on the current stream) finishes each
        (its counters tell; or, for bands computed by cuBLAS, the events in ``ready``)."""
        direct, stream = self._direct_for(plan, c.dtype), self._comm_handle
        if direct is not None:  # by address: no band views (host time, eager)
            start, code, bands = c.data_ptr(), direct.code(c.dtype), self._band_offsets(plan, c, False)
            self._issue(plan, lambda grp, group: direct.all_reduce_at(start + bands[grp.index][0],
                                                                      bands[grp.index][1], code, stream),
                        ready, timeout, True)
        else:
            bands = self._split(c, plan, False)
            self._issue(plan, lambda grp, group: all_reduce_now(bands[grp.index], group), ready, timeout)

    def reduce_scatter(self, out: torch.Tensor, workspace: torch.Tensor, plan: Plan,
                       ready: list[torch.cuda.Event] | None = None, timeout: float | None = None) -> None:
        """Reduce-scatter each group's ``[W][rows][N]`` slice of ``workspace`` into its band of this rank's
        ``out [M/W, N]``, as the GEMM (already launched on the current stream) finishes each group."""

        direct, stream = self._direct_for(plan, out.dtype), self._comm_handle
        if direct is not None:  # by address: no band views (host time, eager)
            code, outs, bands = direct.code(out.dtype), self._band_offsets(plan, out, False), \
                self._band_offsets(plan, workspace, True)
            out_at, band_at = out.data_ptr(), workspace.data_ptr()

            def launch(grp, group):
                direct.reduce_scatter_at(out_at + outs[grp.index][0], band_at + bands[grp.index][0],
                                         outs[grp.index][1], code, stream)
        else:
            bands, outs = self._split(workspace, plan, True), self._split(out, plan, False)

            def launch(grp, group):
                reduce_scatter_now(outs[grp.index], bands[grp.index], group)

        self._issue(plan, launch, ready, timeout, direct is not None)

    def all_gather(self, gathered: torch.Tensor, a_shard: torch.Tensor, plan: Plan,
                   events: bool = False, shard_placed: bool = False) -> list[torch.cuda.Event]:
        """Fill ``gathered`` (the plan's ``[group][W][rows][K]`` layout) band by band on the communication stream,
        raising ``flags[g]`` once band ``g`` has landed. Here communication is the producer and the GEMM the
        consumer, so this is called *before* the GEMM is launched (rule 1); the GEMM must leave ``comm_ctas`` SMs
        free for these collectives (rule 2, checked by the op).

        With ``events``, each band's arrival is published as a CUDA event (returned, one per group) instead of a
        flag: inside a CUDA graph the consumer must depend on the bands through graph edges, because a graph may
        queue the NCCL kernels behind a kernel that spins on their flags. ``shard_placed``: ``a_shard`` is in its slots
        already (fp8 rows packed there)."""
        # This rank's bands into their slots first, on the producer stream; each band's all-gather reads its slot
        # in place.
        if not shard_placed:
            place_own_shard(gathered, a_shard, plan, self.rank)
        self._fork()
        comm_group = self.comm_group(plan.comm_ctas)
        direct, stream = self._direct_for(plan, gathered.dtype), self._comm_handle
        base = self.flags.data_ptr()
        arrived = []
        if direct is not None and not events:  # by address: no band or slot views (host time, eager)
            start, code, driver = gathered.data_ptr(), direct.code(gathered.dtype), stream_ops.fast()
            for flag, band, slot, count in self._gather_offsets(plan, gathered):
                direct.all_gather_at(start + band, start + slot, count, code, stream)
                driver.write(stream, base + flag, 1)
            return arrived
        placed = [(band, band[self.rank * grp.rows : (self.rank + 1) * grp.rows])
                  for grp, band in zip(plan.groups, self._split(gathered, plan, True))]
        # torch.distributed issues on the current stream; the direct calls take the stream's handle.
        with contextlib.nullcontext() if direct is not None else torch.cuda.stream(self.comm_stream):
            for grp, (band, slot) in zip(plan.groups, placed):
                if direct is not None:  # in place: the slot is this rank's part of the band
                    direct.all_gather(band, slot, stream)
                else:
                    all_gather_now(band, slot, comm_group)
                if events:
                    arrived.append(self.comm_stream.record_event())
                else:
                    stream_ops.write(self.comm_stream, base + 4 * grp.index, 1)
        return arrived

    def _gather_offsets(self, plan: Plan, gathered: torch.Tensor) -> tuple:
        """Per group of an all-gather plan, in order: its flag's byte offset, and its band's and this rank's slot's
        byte offsets in ``gathered`` (rows of ``gathered.shape[1]`` elements) with the slot's element count; once
        per plan and row width."""
        width, size = gathered.shape[1], gathered.element_size()
        key = (plan, width, size)
        offsets = self._bands.get(key)
        if offsets is None:
            offsets = self._bands[key] = tuple(
                (4 * g.index, g.out_row_start * width * size, (g.out_row_start + self.rank * g.rows) * width * size,
                 g.rows * width) for g in plan.groups)
        return offsets

    def finish_all_gather(self, plan: Plan) -> None:
        """After the GEMM: join the communication stream, then clear the flags (every one has been written by
        then, so no late write can leave a stale flag for the next call)."""
        self._join()
        self.flags[: plan.num_groups].zero_()

    def launch_group(self, launch, grp, comm_group: dist.ProcessGroup) -> None:
        """Issue group ``grp``'s collective on the communication stream once its rows are ready (the benchmark's
        timeline wraps this, from outside, to record when each group became ready and when it finished)."""
        launch(grp, comm_group)

    def _issue(self, plan: Plan, launch, ready: list[torch.cuda.Event] | None = None,
               timeout: float | None = None, direct: bool = False) -> None:
        comm_group = self.comm_group(plan.comm_ctas)
        waited = []
        base = self.counters.data_ptr()
        # Inside a graph (this communicator's replay, or a user's capture) the counter waits are kernels: a graph's
        # stream memory operations cost the host about 2 µs each per launch (kernels/counters.py).
        in_graph = ready is None and guards.capturing(self.counters)
        # torch.distributed issues on the current stream; the direct calls (``direct``) take the stream's handle.
        with contextlib.nullcontext() if direct and not in_graph else torch.cuda.stream(self.comm_stream):
            for grp in plan.groups:
                if ready is not None:  # bands computed by cuBLAS: an event per group, no counter
                    self.comm_stream.wait_event(ready[grp.index])
                elif in_graph:
                    counter_wait_kernel(self.counters, grp.index, grp.tile_count)
                else:  # the wait and the counter's reset in one driver call
                    stream_ops.wait_reset(self.comm_stream, base + 4 * grp.index, grp.tile_count)
                if timeout is not None:
                    waited.append(self.comm_stream.record_event())
                self.launch_group(launch, grp, comm_group)
        self._join()
        if timeout is not None:
            self._check_progress(plan, waited, timeout)

    def _direct_for(self, plan: Plan, dtype: torch.dtype) -> nccl_calls.NcclComm | None:
        """The directly called NCCL communicator of ``plan``'s collectives, where it carries ``dtype``."""
        direct = self._direct.get(plan.comm_ctas)
        return direct if direct is not None and direct.takes(dtype) else None

    def _band_offsets(self, plan: Plan, tensor: torch.Tensor, workspace: bool) -> tuple[tuple[int, int], ...]:
        """``_split``'s bands as ``(byte offset, elements)`` in a row-major ``tensor`` (rows of ``tensor.shape[1]``
        elements), by group index: what a by-address collective takes; once per plan, row width and element size."""
        width, size = tensor.shape[1], tensor.element_size()
        key = (plan, workspace, width, size)
        offsets = self._bands.get(key)
        if offsets is None:
            ranges = [(g.out_row_start, g.out_row_end) if workspace else (g.row_start, g.row_end)
                      for g in plan.groups]
            offsets = self._bands[key] = tuple((start * width * size, (end - start) * width) for start, end in ranges)
        return offsets

    def _split(self, tensor: torch.Tensor, plan: Plan, workspace: bool) -> list[torch.Tensor]:
        """Each group's rows of ``tensor`` (``workspace``: the ``[group][W][rows][N]`` slices, else the group's
        band of rows), by group index (``plan.groups`` is in index order): one ``split_with_sizes`` where the bands
        tile the tensor, as they do."""
        key = (plan, workspace)
        cut = self._bands.get(key)
        if cut is None:
            ranges = [(g.out_row_start, g.out_row_end) if workspace else (g.row_start, g.row_end)
                      for g in plan.groups]
            tiles = (ranges[0][0] == 0 and ranges[-1][1] == tensor.shape[0]
                     and all(x[1] == y[0] for x, y in zip(ranges, ranges[1:])))
            cut = self._bands[key] = (tiles, [end - start for start, end in ranges] if tiles else ranges)
        tiles, sizes = cut
        return list(tensor.split_with_sizes(sizes)) if tiles else [tensor[start:end] for start, end in sizes]

    def _check_progress(self, plan: Plan, waited: list[torch.cuda.Event], timeout: float) -> None:
        guards.poll_events(zip(waited, plan.groups), timeout, lambda grp: (
            f"flashoverlap: rank {self.rank}: {plan.op} on {self.name}: group {grp.index} of "
            f"{plan.num_groups} (rows [{grp.row_start}, {grp.row_end})) did not see its {grp.tile_count} "
            f"tiles within {timeout:g} s (FLASHOVERLAP_DEBUG_TIMEOUT); its counter never reached the "
            "plan's count"))


_CUBLAS_READY: set[tuple[torch.device, torch.dtype]] = set()


def check_leaves_nccl_sms(plan: Plan, num_sms: int, op: str = "all_gather_gemm") -> None:
    """Deadlock rule 2: the GEMM spins on bands that NCCL delivers, so it must leave NCCL ``nccl_free_sms`` SMs
    (its CTAs and a margin) that it never occupies."""
    free = nccl_free_sms(num_sms, plan.comm_ctas)
    if plan.comm_ctas < 1 or plan.grid_size + free > num_sms:
        raise ValueError(
            f"{op}: the plan's GEMM ({plan.grid_size} programs) waits for bands NCCL delivers with "
            f"{plan.comm_ctas} CTAs; it needs comm_ctas >= 1 and programs <= {num_sms} SMs - {free} left to NCCL, "
            "or the waits could starve NCCL of SMs and hang (docs/design.md, deadlock rule 2)"
        )


def _cublas_ready(device: torch.device, dtype: torch.dtype) -> None:
    """Create this thread's cuBLAS handle on an eager call: the captured schedule multiplies with cuBLAS, and
    creating a handle inside a capture fails (CUBLAS_STATUS_NOT_INITIALIZED, seen on the H200s). fp8: the scaled
    matmul's (cuBLASLt) handle, by one 16x16 ``torch._scaled_mm``."""
    if (device, dtype) not in _CUBLAS_READY:
        if dtype in scaled.FP8:
            x = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)  # e5m2 x e5m2 is no scaled product
            one = torch.ones((), device=device)
            torch._scaled_mm(x, x.t(), one, one, out_dtype=torch.bfloat16)
        else:
            torch.matmul(torch.zeros(1, 1, dtype=dtype, device=device), torch.zeros(1, 1, dtype=dtype, device=device))
        _CUBLAS_READY.add((device, dtype))


class _Gathered:
    """An all-gather's gathered buffer as the GEMM reads it: ``a`` ``[M, K]`` (fp8: the fp8 view of the packed rows)
    and, for fp8, the rows' scales (a view) with the call's ``Scales``."""

    def __init__(self, gathered: torch.Tensor, k: int, dtype: torch.dtype, scales: scaled.Scales | None) -> None:
        self.gathered, self.k, self.dtype, self.scales = gathered, k, dtype, scales
        if scales is None:
            self.packed, self.a, self.scale_rows = None, gathered, None
        else:
            self.packed = scaled.PackedRows(gathered, k, dtype, scales.scale_columns(k))
            self.a, self.scale_rows = self.packed.a, self.packed.scales

    def pack_own(self, a_shard: torch.Tensor, scale_rows: torch.Tensor, plan: Plan, rank: int,
                 band_rows: int | None, packed: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """fp8: this rank's rows and their scales packed, and whether into their slots: where the bands are even
        (``band_rows`` rows each, ``_workspace``'s verdict) straight into this rank's slot of every band (two
        copies; returns ``(a_shard, True)``: the all-gather reads the slots in place, not the shard), else into
        ``packed`` (``pack_rows``; returns ``(packed, False)``), which the all-gather places."""
        if band_rows is None:
            return scaled.pack_rows(a_shard, scale_rows, out=packed), False
        bands, rows = len(plan.groups), band_rows
        a_slots, scale_slots = self.packed.slots(bands, plan.world_size, rows, rank)
        a_slots.copy_(a_shard.reshape(bands, rows, self.k))
        scale_slots.copy_(scale_rows.reshape(bands, rows, -1))
        return a_shard, True

    def scaling(self):
        """The kernel's ``Scaling`` (None unscaled): A's scales per gathered row (tensor-wise shards may differ)."""
        if self.scales is None:
            return None
        from flashoverlap.kernels.gemm import Scaling

        return Scaling(self.scale_rows, self.scales.b, self.scales.out_dtype, self.scales.bias)

    def multiply(self, rows: slice, b: torch.Tensor, out: torch.Tensor) -> None:
        """``out = a[rows] @ b`` by cuBLAS (fp8: scaled by the rows' own scales)."""
        self.product(self.a[rows], None if self.scales is None else self.scale_rows[rows], b, out)

    def product(self, a: torch.Tensor, scale_rows: torch.Tensor | None, b: torch.Tensor, out: torch.Tensor) -> None:
        """``out = a @ b`` by cuBLAS: rows of the gathered A, or the caller's own shard as it passed it (fp8: scaled
        by ``scale_rows``, the rows' scales, and the call's B scales)."""
        if self.scales is None:
            torch.matmul(a, b, out=out)
        else:
            scaled.scaled_mm(a, b, self.scales, scale_rows, out=out)

    def in_rank_order(self, plan: Plan, full: torch.Tensor, dense: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The gathered input as ``all_gather_into_tensor`` of whole shards returns it, into ``full`` (the gathered
        buffer's shape); fp8: then its rows and scales into ``dense``'s two tensors."""
        gathered_in_rank_order(self.gathered, plan, out=full)
        if self.scales is not None:
            scaled.gathered_input(full, self.k, self.dtype, self.scales, dense)


def _bands_by_cublas(comm: NcclCommunicator, operand: _Gathered, shard: torch.Tensor, b: torch.Tensor,
                     plan: Plan, c: torch.Tensor, placed: bool,
                     own: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
    """Plans with ``gemm="cublas"``, and every call inside a CUDA-graph capture: the same bands gathered in the
    same order, but each band's slots multiplied by cuBLAS once the band's event has fired, the dependency a stream
    (graph) edge instead of an in-kernel spin. In a graph this is required: a graph may serialize its branches
    onto one hardware queue, where a spinning GEMM ahead of the NCCL kernels it waits for would never finish (the
    in-kernel schedule hung under graph replay on the H200s; that serialization is the likely cause, not a proven
    one). Overlap in a graph is therefore decomposition-like.

    The own rows (``own``: the caller's shard and, fp8, its rows' scales) are one product, issued before any band's
    wait: they are this rank's block of the result in order. Band by band they were one cuBLAS call a group, and
    at some shapes cuBLAS's fp8 kernel comes with a memset each, which a graph's launch pays for
    (``benchmarks/diagnostics/replay_parts.py``: a replayed fp8 up projection, 8192x7168x8192 on one rank, launched
    its graph in 11.6 µs with eight memset nodes, q,k,v's in 2.6 without). The other ranks' rows stay one product a
    band and rank (each waits for its band). ``own`` None (an fp8 shard cuBLAS does not take as it lies): the own
    rows from their slots, band by band."""
    arrived = comm.all_gather(operand.gathered, shard, plan, events=True, shard_placed=placed)
    producer = torch.cuda.current_stream(shard.device)
    c_blocks = c.view(plan.world_size, plan.block_rows, plan.n)  # rank r's rows of the result: c_blocks[r]

    def multiply(grp, r):
        first = grp.out_row_start + r * grp.rows  # the plan's [group][W][rows] layout
        operand.multiply(slice(first, first + grp.rows), b, c_blocks[r, grp.row_start : grp.row_end])

    if own is not None:  # the own shard: in hand before any collective, no wait
        operand.product(*own, b, c_blocks[comm.rank])
    else:  # its slots, placed (or packed and placed) before the first collective on this stream
        for grp in plan.groups:
            multiply(grp, comm.rank)
    for grp, event in zip(plan.groups, arrived):
        producer.wait_event(event)
        for step in range(1, plan.world_size):
            multiply(grp, (comm.rank + step) % plan.world_size)
    comm.finish_all_gather(plan)


def produce(a: torch.Tensor, b: torch.Tensor, plan: Plan, counters: torch.Tensor,
            scales: scaled.Scales | None = None, out: torch.Tensor | None = None) -> list[torch.cuda.Event] | None:
    """A reduction plan's product into ``out`` (``C``, or the reduce-scatter workspace, ``[M, N]`` of the output
    dtype), and what the communicator waits on for each group: the events of cuBLAS bands, or None for the
    signalling GEMM, which bumps ``counters``. fp8 (``scales``): the scaled product in the output dtype."""
    if not plan.counts_tiles:
        return compute_bands(a, b, plan, out, scales)
    from flashoverlap.kernels.gemm import Scaling, gemm  # Triton: imported where a kernel runs

    scaling = None if scales is None else Scaling(scales.a, scales.b, scales.out_dtype, scales.bias)
    gemm(a, b, plan, out=out, counters=counters, scaling=scaling)
    return None


def compute_bands(a: torch.Tensor, b: torch.Tensor, plan: Plan, out: torch.Tensor,
                  scales: scaled.Scales | None = None) -> list[torch.cuda.Event]:
    """``out`` (``C``, or the reduce-scatter workspace ``[group][W][rows][N]``) band by band (fp8: each band scaled
    by its rows' scales); returns one event per group, recorded on the current stream once the group's rows are
    written."""
    stream = torch.cuda.current_stream(a.device) if a.device.type == "cuda" else None  # CPU: the layout alone
    done = []
    for grp in plan.groups:
        for block in range(plan.blocks):  # reduce-scatter: the group's band of every rank block
            first = block * plan.block_rows + grp.row_start
            rows = grp.row_end - grp.row_start
            dst = grp.out_row_start + block * rows if plan.blocks > 1 else grp.row_start
            if scales is None:
                torch.matmul(a[first : first + rows], b, out=out[dst : dst + rows])
            else:
                scale_rows = None if scales.mode == "tensor" else scales.a[first : first + rows]
                scaled.scaled_mm(a[first : first + rows], b, scales, scale_rows, out=out[dst : dst + rows])
        if stream is not None:
            done.append(stream.record_event())
    return done
