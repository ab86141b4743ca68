"""The P2P communicator (over NVLink, Flux's principle with cuBLAS): every multiplication by cuBLAS on the caller's
stream, every byte moved by a copy engine on a copy stream, every reduction fused into cuBLAS (``addmm_`` on the
pulled partial, beta = 1), and every cross-rank wait a stream memory operation (in a graph, a one-warp wait
kernel). No SM moves or sums bytes.

The schedule (which rows, in which order, which flags) is ``comm/tp/ring_schedule.py``, whose module docstring argues
why it cannot deadlock; this module only issues it. One call:

1. Before anything is queued: the symmetric workspace is large enough (growing it is collective and refused
   inside a CUDA-graph capture) and the region layout is fixed by its size; on a plan's first call its cuBLAS
   kernels are run once, eagerly (deadlock rule 3: none is loaded behind a stream wait).
2. Event 0 is recorded on the caller's stream ``C``; the schedule runs: ``Mm`` on ``C`` (``torch.mm`` / ``addmm_``),
   ``Copy`` on the copy streams ``X`` and ``L`` (``cuMemcpyDtoDAsync``), ``Wait`` (a wait for 1 and a reset to 0, one
   ``cuStreamBatchMemOp``; in a graph, the wait kernel), ``Signal`` (a 1 into a peer's flag header), and events
   between the streams. Host time is the cost here (an op call must not cost much more than matmul plus a
   collective): the schedule is resolved once per plan (``_program``: addresses, offsets, views) and the driver is
   called through ``ctypes`` (``stream_ops.fast``), events and stream handles included (driver events, not
   ``torch.cuda.Event``); a call that repeats with the same tensors replays a CUDA graph of steps 2 and 3 instead
   (``comm/replay.py``). The resolved program is batched where the driver allows (``_batched``, outside debug mode):
   flag waits and signals that follow one another on a stream are one ``cuStreamBatchMemOp``, a copy stream's signal
   joins that stream's next ones, the all-reduce's final pulls of a sub-band from the W - 1 peers are one batch of
   waits and one ``cuMemcpyBatchAsync`` (CUDA >= 12.8; copy by copy where the driver lacks it, and inside a capture),
   and a copy stream whose last work ``C`` already waits for is not joined again. At W = 8 an eager call takes 52 /
   40 / 37 driver calls (AR / RS / AG) instead of 94 / 53 / 57 (``benchmarks/results/cpu-host-python-w8.json``): host
   time grows with W by a driver call per peer, not several. A signal issued eagerly is a ``cuStreamWriteValue32``.
   Captured into a graph (ours or a user's), it is a 4-byte ``cuMemcpyDtoDAsync`` of a word that holds 1: on a copy
   stream (``X``, ``L``) in place, behind that stream's own copy; on ``C``, on a branch of its own (stream ``S``,
   forked from ``C`` by an event, joined back in step 3), so that ``C``'s next matmul never waits for a copy engine.
   Measured on one H200 (``benchmarks/diagnostics/replay_host.py``, ``host_trace.py``): in a graph a stream memory
   operation is a node that costs the host microseconds at every launch (a copy node, and an event's edge, nothing)
   and the GPU a few between two matmuls; issued eagerly, the copy is the dearer driver call. ``S`` holds nothing but
   these copies, each after a matmul of ``C``'s that has already been queued, so it never waits on a peer. The order
   the peer relies on holds for the copy without a fence: what a signal announces precedes it (on its stream, or on
   ``C`` before the fork) and has ended before the copy starts, and it lies in this GPU's own memory, where the peer
   reads it, or is a pull from the peer that is complete; no fence is needed because no step of the schedule writes
   into a peer's memory but the signals themselves (``tests/comm/test_ring_protocol.py``). Eagerly a wait is a stream
   memory operation (a wait for 1 and a reset to 0). In a graph it is the wait kernel (``kernels/counters.py``: one
   warp spins on the flag, then resets it): a graph's memory-operation nodes are prepared again at every launch, and
   at W = 8 a captured program holds up to 57 of them (all-reduce, 16384x8192x4096), where a synthetic graph of 48
   took 1.3 ms to launch (``benchmarks/results/logs/graph-launch-465680a749.json``) and kernel nodes cost almost
   nothing. The flag's producer is a peer's copy after the peer's own work, so the spinning warp never holds SMs it
   needs (deadlock rule 2): on another GPU it holds none of that GPU's, and where ranks share one GPU the peer's
   process runs in its own time slice (or, under MPS, beside the warp); it can only slow this rank's own matmuls, by
   one warp. Measured on one H200 with ranks sharing it: W = 2 mechanics right, every repeated call replayed; at W =
   8, 16384x8192x4096, a replayed all-reduce's host time 378 -> 206 µs and all-gather's 422 -> 218 µs against memory
   operations (``benchmarks/results/logs/graph-waits/``). ``graph_waits = "memop"`` keeps the memory operations.
3. ``C`` waits for the other streams (an event recorded on each, waited for on ``C``): the result is complete on the
   caller's stream, as after ``matmul`` and a collective. No ``record_stream``: the tensors the copy streams touch
   (``a``, fp8's packed own shard, ``out``, ``gathered``) are used on them only before that join, so the caching
   allocator's reuse of their memory, on ``C`` or on a stream the user synchronised with ``C``, is ordered after
   every use.

fp8 calls (``call.scales``, ``comm/scaled.py``) run the same schedule; only what a step computes and how wide a
row is change. Every ``Mm`` is a scaled product of its band (``torch._scaled_mm`` where cuBLAS takes it, written
straight into the band's destination through ``out=``; the dequantised product elsewhere), with the band's rows'
A scales and the bias (each rank's product carries it once, as ``_scaled_mm(bias=)`` and the sequential path
have it: an all-reduce sums W copies), in ``scales.out_dtype``. ``_scaled_mm`` has no beta, so an accumulating
step is two kernels on ``C``: the band's product, then its add to the partial pulled in place (the sum of two values
of the output dtype computed in fp32 and rounded once). A ring's result is summed hop by hop, each hop rounding
the running partial once to the output dtype (W - 1 roundings, as NCCL's ring sums bf16). The reductions' regions
and copies hold rows of the output dtype. The all-gather moves packed rows (``scaled.pack_rows``: a row's fp8
bytes and its scales, one unit): the own shard is packed once on ``C`` before event 0 (so the copy streams,
which wait for event 0, see it packed) into a scratch buffer that is the schedule's ``a``; the gathered buffer is
``[M, packed row bytes]`` uint8; each band multiplies the fp8 view of its rows with the scales view of the same
rows (tensor-wise shards of different scales: row-wise in effect). A returned gathered input is
``(a_full, scale_full)``, dense, in rank order. A replayed fp8 call's signature adds the mode, the output dtype and
where the scales and the bias lie; step 1 loads each band's scaled kernels (with their scale-layout copies and
the add).

With ``FLASHOVERLAP_DEBUG_TIMEOUT`` set (outside a capture), an event after every flag wait is polled with a
deadline; a wait that does not end in time raises an error naming the rank, the op, the group and the flag.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from flashoverlap import guards
from flashoverlap.comm import scaled, steps, stream_ops
from flashoverlap.comm.protocol import Call, CommGroup, GroupFields, HeldHook
from flashoverlap.comm.replay import CallGraphs, address, signature
from flashoverlap.comm.symmetric import SymmetricWorkspace
from flashoverlap.comm.tp import ring_schedule as rs
from flashoverlap.plan import Plan

REGION_ALIGN = 1 << 16
# A resolved schedule step's first field (``P2PCommunicator._program``), and the call's buffers by index. The last
# three appear only in a batched program (``_batched``).
_MM, _COPY, _WAIT, _SIGNAL, _RECORD, _WAIT_EVENT, _HOOK, _FORKED_SIGNAL, _MEMOPS, _COPIES, _FORKED_SIGNALS = range(11)
_KERNEL_WAIT = 11  # a flag wait in a graph, as the wait kernel (``kernels/counters.py``): (code, stream, flag slot)
_SPACES = {"a": 0, "out": 1, "gathered": 2}


def _batched(program: list, world: int, copies: bool, one: int) -> list:
    """A resolved program with fewer driver calls and the same stream semantics (a batched program; the debug mode's
    polled waits and a driver without ``memops`` take the program as it is):

    - Flag waits and signals that follow one another in the program on one stream are one ``cuStreamBatchMemOp``
      (``_MEMOPS``), which runs them in the same order: every other stream's work is issued in the same order
      relative to them, and the stream itself runs the same operations in the same order.
    - Where the program pulls from the peers one after another on one stream, each pull behind its own flag wait
      (the all-reduce's final gather of the reduced sub-bands: a wait and a copy per peer and sub-band), the waits
      of one sub-band's ``W - 1`` pulls are issued first, as one batch, and then its copies (``copies``: as one
      ``cuMemcpyBatchAsync``, ``_COPIES``, where they are disjoint; else one by one). Only that stream's order
      changes, and no wait can depend on a pull moved after it: a rank writes data only into its own memory, a
      peer learns of a pull only through a signal or an event of this rank, and none is issued between the waits
      and the copies of the run (they follow one another in the program), so what the waits wait for never
      depends on the pulls, and every producer is still issued before its waiter (deadlock rules 1 and 3 of the
      design; ``tests/comm/test_p2p_batched.py`` runs every rank's batched program on real memory).
    - A copy stream's signal (a pull's ``free`` flag, set once the pull is done) is issued with that stream's next
      flag operations where only steps that never block lie between (a record, another stream's event wait, a
      matmul, another stream's signal): the copy stream runs it at the same point of its own work (behind the same
      pull, before its next wait), and it is issued before anything that could wait for it. (A ``free`` flag is
      waited for only by its producer's next call.)
    - In a capture, signals of the caller's stream that follow one another are one fork onto ``S`` and their
      copies (``_FORKED_SIGNALS``). (A signal in a capture is a copy of the word at ``one``: never moved.)"""
    # 1. The waits and copies of a run of (wait, copy) pairs on one stream, one sub-band's (W - 1 pairs) at a time.
    steps_: list = []
    i, n = 0, len(program)
    while i < n:
        j = i
        while (j + 1 < n and program[j][0] == _WAIT and program[j + 1][0] == _COPY and program[j + 1][5] != one
               and program[j][1] == program[j + 1][1] == program[i][1]):
            j += 2
        pairs = (j - i) // 2
        if pairs < 2:
            steps_.append(program[i])
            i += 1
            continue
        for start in range(0, pairs, max(1, world - 1)):
            chunk = program[i + 2 * start : i + 2 * min(pairs, start + world - 1)]
            steps_ += chunk[0::2]
            group = chunk[1::2]
            if copies and len(group) > 1 and _disjoint(group):
                steps_.append(("copies", group))
            else:
                steps_ += group
        i = j
    # 2. A copy stream's signal joins that stream's next flag operations over steps that never block.
    i = 0
    while i < len(steps_):
        step = steps_[i]
        if step[0] == _SIGNAL and step[1] in (1, 2):
            t = i + 1
            while t < len(steps_) and _passable(steps_[t], step[1]):
                t += 1
            if t > i + 1 and t < len(steps_) and steps_[t][0] in (_WAIT, _SIGNAL) and steps_[t][1] == step[1]:
                steps_.insert(t, step)
                del steps_[i]
                continue
        i += 1
    # 3. Consecutive waits and signals of one stream as one batch; consecutive forked signals as one fork.
    out: list = []
    i, n = 0, len(steps_)
    while i < n:
        step = steps_[i]
        code = step[0]
        if code in (_WAIT, _SIGNAL):
            j = i
            while j < n and steps_[j][0] in (_WAIT, _SIGNAL) and steps_[j][1] == step[1]:
                j += 1
            if j - i == 1:
                out.append(step)
            else:
                ops = [("wait", item[2]) if item[0] == _WAIT else ("write", item[2], 1) for item in steps_[i:j]]
                for start in range(0, len(ops), stream_ops.MEMOPS_MAX // 2):
                    out.append((_MEMOPS, step[1], stream_ops.pack_memops(ops[start : start + stream_ops.MEMOPS_MAX
                                                                            // 2])))
            i = j
        elif code == _FORKED_SIGNAL:
            j = i
            while j < n and steps_[j][0] == _FORKED_SIGNAL:
                j += 1
            out.append((_FORKED_SIGNALS, tuple(item[1] for item in steps_[i:j])) if j - i > 1 else step)
            i = j
        elif code == "copies":
            group = step[1]
            batch = stream_ops.CopyBatch(len(group))
            fills = []  # (array, index, buffer, offset) where the address depends on the call's tensors
            for k, (_, _, dst_space, dst_offset, src_space, src_offset, nbytes) in enumerate(group):
                batch.sizes[k] = nbytes
                for array, space, offset in ((batch.dsts, dst_space, dst_offset), (batch.srcs, src_space, src_offset)):
                    if space == 3:
                        array[k] = offset
                    else:
                        fills.append((array, k, space, offset))
            out.append((_COPIES, group[0][1], batch, tuple(fills), tuple(group)))
            i += 1
        else:
            out.append(step)
            i += 1
    return out


def _passable(step: tuple, stream: int) -> bool:
    """Whether a copy stream's signal may be issued after ``step`` instead of before it (``_batched``): ``step``
    never blocks, and it is not work of ``stream`` that the signal would then follow."""
    code = step[0]
    return (code in (_MM, _RECORD) or code == _WAIT_EVENT and step[1] != stream
            or code == _SIGNAL and step[1] != stream)


# steps whose second field is a stream
_ON_A_STREAM = (_COPY, _WAIT, _SIGNAL, _RECORD, _WAIT_EVENT, _MEMOPS, _COPIES, _KERNEL_WAIT)


def _joined_already(program: list, stream: int) -> bool:
    """Whether the caller's stream ``C`` already waits, within the resolved ``program``, for all of ``stream``'s
    work: its last step is an event that ``C`` waits for after it (step 3's join of that stream would order
    nothing more)."""
    last = max((i for i, step in enumerate(program) if step[0] in _ON_A_STREAM and step[1] == stream), default=None)
    if last is None or program[last][0] != _RECORD:
        return False
    event = program[last][2]
    return any(step[0] == _WAIT_EVENT and step[1] == 0 and step[2] == event for step in program[last:])


@functools.cache
def _copy_batches_allowed(device: torch.device) -> bool:
    """Whether this device's copies may be batched (``cuMemcpyBatchAsync``): not tried on Blackwell (compute
    capability 10 and later), where another project reports it failing; a CPU test device may."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 10


def _disjoint(copies: list) -> bool:
    """Whether no two of the resolved copies ``copies`` write overlapping bytes and none reads what another writes
    (the copies of one ``cuMemcpyBatchAsync`` may run in any order)."""
    writes = sorted((space, offset, offset + nbytes) for _, _, space, offset, _, _, nbytes in copies)
    for (space, _, end), (next_space, start, _) in zip(writes, writes[1:]):
        if space == next_space and start < end:
            return False
    for _, _, _, _, space, offset, nbytes in copies:
        for w_space, w_start, w_end in writes:
            if space == w_space and offset < w_end and w_start < offset + nbytes:
                return False
    return True


def _cuts(ops: list, totals: tuple[int, int, int]) -> tuple[list, list[dict]]:
    """How each of the call's tensors (a, out, gathered: ``totals`` rows) is cut into the row blocks its matmuls
    read or write: per tensor None (no matmul uses it), ``(sizes, None)`` where the blocks tile it (the call
    makes every view in one ``split_with_sizes``), else ``(None, blocks)`` (one slice per block); and per tensor
    the index of each ``(row, rows)`` block among the views."""
    used: list[set] = [set(), set(), set()]
    for item in ops:
        if isinstance(item, steps.Mm):
            used[_SPACES[item.src.space]].add((item.src.row, item.rows))
            if item.dst.space != "sym":
                used[_SPACES[item.dst.space]].add((item.dst.row, item.rows))
    cuts, index = [], []
    for blocks, total in zip(used, totals):
        if not blocks:
            cuts.append(None)
            index.append({})
            continue
        bounds = sorted({0, total, *(row for row, _ in blocks), *(row + rows for row, rows in blocks)})
        follows = dict(zip(bounds, bounds[1:]))
        if bounds[-1] == total and all(follows.get(row) == row + rows for row, rows in blocks):
            cuts.append(([end - start for start, end in zip(bounds, bounds[1:])], None))
            index.append({(row, rows): bounds.index(row) for row, rows in blocks})
        else:
            ordered = sorted(blocks)
            cuts.append((None, ordered))
            index.append({block: i for i, block in enumerate(ordered)})
    return cuts, index


def _widths(plan: Plan, dtype: torch.dtype, scales: scaled.Scales | None) -> tuple[torch.dtype, int]:
    """A call's output dtype and the bytes of one row of ``a`` as the all-gather moves it (fp8: a packed row, its
    fp8 bytes and its scales, ``scaled.row_bytes``)."""
    if scales is None:
        return dtype, plan.k * dtype.itemsize
    return scales.out_dtype, scaled.row_bytes(plan.k, dtype, scales)


def _scaled_band(target: torch.Tensor, src: torch.Tensor, scale_a: torch.Tensor | None, b: torch.Tensor,
                 scales: scaled.Scales, accumulate: bool) -> None:
    """An fp8 call's ``Mm`` step on ``C``: ``target (+)= src @ b`` scaled (``scale_a``: the band's rows' scales,
    None for the call's one tensor-wise scale), the bias in the band's product. ``_scaled_mm`` has no beta: an
    accumulating step adds its product to the pulled partial in a second kernel, the sum of the two computed in
    fp32 and rounded once to the output dtype."""
    if accumulate:
        target.add_(scaled.scaled_mm(src, b, scales, scale_a))
    else:
        scaled.scaled_mm(src, b, scales, scale_a, out=target)


class P2PCommunicator(GroupFields):
    """Copy stream, events and symmetric workspace for one (process group, device)."""

    path = "p2p"
    # How a graph (ours or a user's) waits on a flag: None, the wait kernel on a GPU (``_graph_waits``); "kernel" or
    # "memop" on the class or an instance to choose (a diagnostic's switch).
    graph_waits: str | None = None

    def __init__(self, group: CommGroup) -> None:
        super().__init__(group)
        self.copy_stream = guards.comm_stream(self.device)  # X: pulls from peers
        self.local_stream = guards.comm_stream(self.device)  # L: copies within the GPU
        self.signal_stream = guards.comm_stream(self.device)  # S: C's signals inside a graph (no waits, ever)
        self.workspace = SymmetricWorkspace(self.group, self.device)
        self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._handles = (self.copy_stream.cuda_stream, self.local_stream.cuda_stream, self.signal_stream.cuda_stream)
        self._events: list[int] = []  # driver events (``stream_ops.FastDriver``), the schedule's by index
        self._joins: tuple[int, int, int, int] | None = None  # step 3: one driver event per stream of ours
        self._fork: int | None = None  # the event that hands a signal of C's to S
        self._ready: set[tuple] = set()  # (plan, dtype, b's strides, fp8 scales' kind) past step 1
        self._one = torch.ones(1, dtype=torch.int32, device=self.device)  # what a signal copies into a flag
        torch.cuda.synchronize(self.device)  # written before any stream of ours copies it (they wait on no event)
        self._programs: dict[tuple, tuple[list, tuple]] = {}
        self.graphs = CallGraphs(self.device)  # repeated calls replayed (comm/replay.py)

    def _region_bytes(self) -> int:
        return (self.workspace.nbytes // rs.regions(self.world_size)) // REGION_ALIGN * REGION_ALIGN

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One overlapped call of ``call.plan`` (not sequential): the op's result, and for all-gather the gathered
        input (rank order) where asked. The hook, if any, issues independent work on the caller's stream where the
        schedule would wait for its first pull (``steps.Hook``).

        Written for host time (a replayed call is this method and one graph launch): a repeated call's graph is
        looked up first, by a signature built from the call alone; only a call without one asks whether step 1 was
        done. (A graph exists only for a plan past step 1 on the workspace in its signature: ``prepare`` and
        ``release`` drop every graph.)"""
        plan, a, b, hook, scales = call.plan, call.a, call.b, call.hook, call.scales
        if plan.op == "all_gather":
            a = a.contiguous()  # the copy engine moves the shard's rows as one block
        out, gathered, own, dense = self._buffers(plan, a.dtype, a.shape[0], scales, call.return_gathered)
        signature = None
        if call.replay and (hook is None or isinstance(hook, HeldHook)):
            signature = self._signature(plan, a, b, out, gathered, hook, scales, own)
            if self.graphs.replay(signature):
                return self._result(out, gathered, plan, a.dtype, scales, dense)
        # Step 1, once per plan, dtype and layout of b (fp8: and kind of scales).
        ready = (plan, a.dtype, b.stride(), None if scales is None else (scales.mode, scales.out_dtype,
                                                                         scales.bias is not None))
        if ready not in self._ready:
            self._make_ready(plan, a, b, call.name, scales)
            self._ready.add(ready)
            if signature is not None:  # step 1 may have grown the workspace, which the signature names
                signature = self._signature(plan, a, b, out, gathered, hook, scales, own)
        if signature is not None and self.graphs.record(
                signature, lambda: self.issue(call, a, out, gathered, captured=True, packed_own=own)):
            return self._result(out, gathered, plan, a.dtype, scales, dense)
        # A call the runtime let replay is not inside a capture; any other may be inside a user's.
        self.issue(call, a, out, gathered, timeout=call.timeout, captured=not call.replay and guards.capturing(a),
                   packed_own=own)
        return self._result(out, gathered, plan, a.dtype, scales, dense)

    def _buffers(self, plan: Plan, dtype: torch.dtype, rows: int, scales: scaled.Scales | None,
                 return_gathered: bool) -> tuple:
        """A call's tensors ``(out, gathered, own, dense)``, allocated in one order on every call (``dtype``: a's,
        ``rows``: a's rows). fp8 all-gather: the own shard's packed rows (``own``) and the returned gathered input's
        dense tensors, allocated here with the call's other tensors, so that every call (eager, captured or
        replayed) takes the same allocations in the same order and a repeated call finds its buffers at the
        addresses its graph holds (allocated later, they moved the next call's buffers: logs/issue35)."""
        out = self._new((plan.block_rows if plan.op == "reduce_scatter" else plan.m, plan.n),
                        dtype if scales is None else scales.out_dtype)
        gathered = self._gathered(plan, dtype, scales) if return_gathered else None
        own = dense = None
        if scales is not None and plan.op == "all_gather":
            own = self._packed_shard(plan, dtype, rows, scales)
            if gathered is not None:  # the returned gathered input, copied out of the packed rows after the call
                dense = (self._new((plan.m, plan.k), dtype),
                         self._new((plan.m, scales.scale_columns(plan.k)), torch.float32))
        return out, gathered, own, dense

    def replayer(self, call: Call) -> Callable[[object], tuple | None] | None:
        """The replay lane of calls that read ``call``'s tensors (``comm/protocol.py``, ``CallGraphs.replayer``);
        None where none applies: not replayed, a hook, no graph held yet, an all-gather's shard not contiguous
        (``run`` copies it: a new address on every call)."""
        plan, a, scales = call.plan, call.a, call.scales
        if (not call.replay or call.hook is not None or not self.graphs
                or plan.op == "all_gather" and not a.is_contiguous()):
            return None
        dtype, rows, gathered = a.dtype, a.shape[0], call.return_gathered
        # what the buffers and the result need of the scales (their mode and output dtype), none of their tensors
        bare = None if scales is None else scaled.Scales(None, None, scales.mode, scales.out_dtype)

        def allocate() -> tuple[tuple, tuple]:
            buffers = self._buffers(plan, dtype, rows, bare, gathered)
            return self._outputs(*buffers[:3]), buffers

        def result(buffers: tuple) -> tuple:
            out, gathered_rows, _, dense = buffers
            return self._result(out, gathered_rows, plan, dtype, bare, dense)

        return self.graphs.replayer(self._inputs(plan, a, call.b, None, scales), allocate, result)

    def _gathered(self, plan: Plan, dtype: torch.dtype, scales: scaled.Scales | None) -> torch.Tensor:
        """All-gather's gathered buffer: ``[M, K]`` of ``a``'s dtype; fp8, ``[M, packed row bytes]`` uint8."""
        if scales is None:
            return self._new((plan.m, plan.k), dtype)
        return self._new((plan.m, _widths(plan, dtype, scales)[1]), torch.uint8)

    def _packed_shard(self, plan: Plan, dtype: torch.dtype, rows: int, scales: scaled.Scales) -> torch.Tensor:
        """fp8 all-gather: the buffer the own shard (``rows`` of ``dtype``) is packed into, ``[rows, packed row
        bytes]`` uint8."""
        return self._new((rows, _widths(plan, dtype, scales)[1]), torch.uint8)

    @staticmethod
    def _result(out: torch.Tensor, gathered: torch.Tensor | None, plan: Plan, dtype: torch.dtype,
                scales: scaled.Scales | None, dense: tuple | None = None) -> tuple:
        if gathered is None or scales is None:
            return out, gathered
        return out, scaled.gathered_input(gathered, plan.k, dtype, scales, dense)

    def _signature(self, plan: Plan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                   gathered: torch.Tensor | None, hook, scales: scaled.Scales | None = None,
                   own: torch.Tensor | None = None) -> tuple:
        """What a call's GPU work depends on besides the tensors' values (``comm/replay.py``): ``_inputs`` and where
        the call's own tensors lie (``out`` and ``gathered``: fresh and contiguous, of the plan's shapes, ``out``'s
        dtype the output dtype; fp8 all-gather's packed shard ``own``)."""
        return signature(self._inputs(plan, a, b, hook, scales), self._outputs(out, gathered, own))

    def _inputs(self, plan: Plan, a: torch.Tensor, b: torch.Tensor, hook, scales: scaled.Scales | None) -> tuple:
        """``replay.signature``'s first part: the plan, the dtype, where each operand lies and how it is laid out,
        the workspace, the held hook's tensors; an fp8 call's scales: their mode, the output dtype, and where the
        scales and the bias lie and how they are laid out."""
        return (plan, a.dtype, a.data_ptr(), a.shape, a.stride(), b.data_ptr(), b.shape, b.stride(),
                self._workspace_address(), None if hook is None else hook.signature,
                None if scales is None else (scales.mode, scales.out_dtype, address(scales.a), address(scales.b),
                                             address(scales.bias)))

    @staticmethod
    def _outputs(out: torch.Tensor, gathered: torch.Tensor | None, own: torch.Tensor | None) -> tuple:
        """``replay.signature``'s second part: where the call's own tensors lie."""
        return out.data_ptr(), None if gathered is None else gathered.data_ptr(), address(own)

    def _graph_waits(self) -> str:
        """How a graph waits on a flag (module docstring): "kernel" on a GPU, unless ``graph_waits`` says "memop"."""
        return stream_ops.graph_waits(self.graph_waits, self.device)

    def _workspace_address(self) -> int:
        """Where the workspace lies (0 before the first call has allocated it: that call's signature is made again
        after step 1, and no graph is captured before it)."""
        buffer = self.workspace.buffer
        return 0 if buffer is None else buffer.data_ptr()

    def _make_ready(self, plan: Plan, a: torch.Tensor, b: torch.Tensor, op: str,
                    scales: scaled.Scales | None = None) -> None:
        """Step 1 for a plan, dtype and layout of b (fp8: and kind of scales): the workspace (it only grows) and the
        cuBLAS kernels."""
        self.prepare(plan, a.dtype, op, scales)
        self._load_kernels(plan, a, b, op, scales)

    def release(self) -> None:
        """Free the graphs, the resolved programs and the symmetric workspace (the peers free theirs in the same
        collective release)."""
        self.graphs.clear()
        self._programs.clear()
        self._ready.clear()
        driver = stream_ops.fast() if self._events else None
        for event in [*self._events, *(self._joins or ())[1:], *([] if self._fork is None else [self._fork])]:
            driver.free_event(event)
        self._events, self._joins, self._fork = [], None, None
        self.workspace.release()

    def _new(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A call's output or gathered buffer, from the caching allocator (whose reuse of addresses is what lets a
        repeated call replay its graph)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def prepare(self, plan: Plan, dtype: torch.dtype, op: str, scales: scaled.Scales | None = None) -> None:
        """Step 1: the workspace holds this plan's largest region, in each of the ``W + 1`` region slots (rows of
        ``a`` for all-gather, fp8: packed rows; of the output dtype for the reductions)."""
        out_dtype, a_row = _widths(plan, dtype, scales)
        need = rs.region_rows(plan) * (a_row if plan.op == "all_gather" else plan.n * out_dtype.itemsize)
        if need > self._region_bytes():
            size = rs.regions(self.world_size) * (need + REGION_ALIGN)
            if self.workspace.ensure(size, op, ones=(rs.FREE_BASE, rs.FLAG_SLOTS_USED)):
                self._programs.clear()
                self.graphs.clear()

    def issue(self, call: Call, a: torch.Tensor, out: torch.Tensor, gathered: torch.Tensor | None = None, *,
              timeout: float | None = None, captured: bool = False, packed_own: torch.Tensor | None = None) -> None:
        """Steps 2 and 3 of one call (after ``prepare``) of ``call.plan`` on ``a`` (``call.a``, contiguous for
        all-gather) and ``call.b``, its hook where the schedule says: ``out`` receives the op's result on the
        caller's stream; for all-gather ``gathered`` [M, K] receives the gathered input (its own rows only where it
        is returned). ``timeout``: debug mode's deadline (None: the waits are not polled); ``captured``: the work is
        being captured into a CUDA graph (its signals are copies); ``packed_own``: fp8 all-gather, the
        ``[rows, packed row bytes]`` uint8 buffer the own shard is packed into (allocated here where not given)."""
        plan, b, hook, op, scales = call.plan, call.b, call.hook, call.name, call.scales
        gathered_own = gathered is not None and plan.op == "all_gather"
        if gathered is None and plan.op == "all_gather":
            gathered = self._gathered(plan, a.dtype, scales)
        driver = stream_ops.fast()
        # A batched program (``_batched``) where the driver batches stream memory operations, outside debug mode
        # (which polls each wait); copies batched where it has cuMemcpyBatchAsync, outside a capture.
        memops = getattr(driver, "memops", None) if timeout is None else None
        copies = getattr(driver, "copies", None) if memops is not None and not captured else None
        if copies is not None and not _copy_batches_allowed(self.device):
            copies = None
        program, ops, joined, cuts = self._program(plan, a.dtype, gathered_own, captured, scales,
                                                   batch=(memops is not None, copies is not None))
        handles = (driver.current_stream(self._index), *self._handles)
        events, fork, one = self._events, self._fork, self._one.data_ptr()
        sources, scale_sources = (a, out, gathered), (None, None, None)
        if scales is not None:  # fp8 (module docstring): the matmuls read fp8 rows and their rows' scales
            if plan.op == "all_gather":  # the own shard packed once, on C before event 0: the schedule's ``a``
                if packed_own is None:
                    packed_own = self._packed_shard(plan, a.dtype, a.shape[0], scales)
                a = scaled.pack_rows(a, scales.shard_rows(a.shape[0]), packed_own)
                columns = scales.scale_columns(plan.k)
                (a_rows, a_scales), (g_rows, g_scales) = (scaled.unpack_rows(packed, plan.k, call.a.dtype, columns)
                                                          for packed in (a, gathered))
                sources, scale_sources = (a_rows, out, g_rows), (a_scales, None, g_scales)
            elif scales.mode != "tensor":
                scale_sources = (scales.a, None, None)
        # The matmuls' row blocks of a, out and gathered (fp8: and of the scales of a's and gathered's rows): one
        # split per tensor (one C call for all its views).
        parts, scale_parts = ([None if cut is None or tensor is None else tensor.split_with_sizes(cut[0])
                               if cut[0] is not None else [tensor[row : row + rows] for row, rows in cut[1]]
                               for tensor, cut in zip(tensors, cuts)] for tensors in (sources, scale_sources))
        bases = (a.data_ptr(), out.data_ptr(), 0 if gathered is None else gathered.data_ptr(), 0)
        wait_reset, write, copy, record, wait_event = (driver.wait_reset, driver.write, driver.copy, driver.record,
                                                       driver.wait_event)
        waited: list[tuple[torch.cuda.Event, steps.Wait]] = []
        record(events[0], handles[0])
        for step in program:
            code = step[0]
            if code == _MM:
                _, src_space, src_part, dst, dst_part, accumulate = step
                src = parts[src_space][src_part]
                target = dst if dst_part is None else parts[dst][dst_part]
                if scales is not None:
                    scale_a = scale_parts[src_space]
                    _scaled_band(target, src, None if scale_a is None else scale_a[src_part], b, scales, accumulate)
                elif accumulate:
                    target.addmm_(src, b)
                else:
                    torch.mm(src, b, out=target)
            elif code == _COPY:
                _, stream, dst_space, dst_offset, src_space, src_offset, nbytes = step
                copy(handles[stream], bases[dst_space] + dst_offset, bases[src_space] + src_offset, nbytes)
            elif code == _WAIT:
                _, stream, flag, item = step
                wait_reset(handles[stream], flag)
                if timeout is not None:  # debug mode: an event to poll, through torch
                    waited.append((self._stream(stream).record_event(), item))
            elif code == _SIGNAL:
                write(handles[step[1]], step[2], 1)
            elif code == _KERNEL_WAIT:  # in a graph only (no Python runs at a replay)
                with torch.cuda.stream(self._stream(step[1])):
                    stream_ops.counter_wait_kernel(self.workspace.flags, step[2], 1)
            elif code == _MEMOPS:
                memops(handles[step[1]], step[2])
            elif code == _COPIES:
                _, stream, batch, fills, group = step
                for array, index, space, offset in fills:
                    array[index] = bases[space] + offset
                try:
                    copies(handles[stream], batch)
                except RuntimeError:  # the driver refused the batch (none of it queued): the copies one by one,
                    for _, _, dst_space, dst_offset, src_space, src_offset, nbytes in group:  # and no batch again
                        copy(handles[stream], bases[dst_space] + dst_offset, bases[src_space] + src_offset, nbytes)
                    driver.copies = None
            elif code == _FORKED_SIGNAL:  # C's signal in a graph: a branch on S, which C never waits for
                record(fork, handles[0])
                wait_event(handles[3], fork)
                copy(handles[3], step[1], one, 4)
            elif code == _FORKED_SIGNALS:  # several in a row: one fork
                record(fork, handles[0])
                wait_event(handles[3], fork)
                for flag in step[1]:
                    copy(handles[3], flag, one, 4)
            elif code == _RECORD:
                record(events[step[2]], handles[step[1]])
            elif code == _HOOK:
                if hook is not None:
                    hook()
            else:
                wait_event(handles[step[1]], events[step[2]])
        joins = self._joins
        for index in joined:  # step 3
            record(joins[index], handles[index])
            wait_event(handles[0], joins[index])
        if timeout is not None:
            self._check_progress(waited, timeout, op)

    def _program(self, plan: Plan, dtype: torch.dtype, gathered_own: bool, captured: bool = False,
                 scales: scaled.Scales | None = None, batch: tuple[bool, bool] = (False, False)
                 ) -> tuple[list, tuple, tuple, list]:
        """The schedule with everything that does not change between calls resolved: flag addresses, copy
        offsets and sizes, views of this rank's symmetric regions (built once per plan and workspace), and how
        the call's tensors are cut into the matmuls' row blocks (``_cuts``). fp8: rows of the output dtype, and the
        all-gather's rows are packed rows (``_widths``). ``batch``: (stream memory operations, copies) batched
        (``_batched``), and then a copy stream whose last work the caller's stream already waits for is not joined
        again."""
        out_dtype, a_row = _widths(plan, dtype, scales)
        kernel_waits = captured and self._graph_waits() == "kernel"
        key = (plan, dtype, out_dtype, a_row, gathered_own, captured, batch, kernel_waits)  # a new workspace empties it
        cached = self._programs.get(key)
        if cached is not None:
            return cached
        ops = rs.schedule(plan, self.rank, gathered_own=gathered_own)
        driver = stream_ops.fast()
        while len(self._events) < steps.events(ops):
            self._events.append(driver.new_event())
        if self._joins is None:
            self._joins = (0, driver.new_event(), driver.new_event(), driver.new_event())
        if captured and self._fork is None:
            self._fork = driver.new_event()
        element = out_dtype.itemsize
        row_bytes = a_row if plan.op == "all_gather" else plan.n * element
        region = self._region_bytes()
        own_sym = self.workspace.local((self.workspace.nbytes,), torch.uint8)
        stream_index = {"C": 0, "X": 1, "L": 2, "S": 3}

        def sym_offset(loc: steps.Loc) -> int:
            return rs.region_index(loc.region, self.world_size) * region + loc.row * row_bytes

        def place(loc: steps.Loc) -> tuple[int, int]:  # (base index: a, out, gathered, absolute), byte offset
            if loc.space == "sym":
                return 3, self.workspace.peer_ptr(loc.rank) + sym_offset(loc)
            row = plan.n * element if loc.space == "out" else row_bytes
            return _SPACES[loc.space], loc.row * row

        totals = (plan.block_rows if plan.op == "all_gather" else plan.m,
                  plan.block_rows if plan.op == "reduce_scatter" else plan.m, plan.m)
        cuts, index = _cuts(ops, totals)
        program = []
        for item in ops:
            if isinstance(item, steps.Mm):
                src = _SPACES[item.src.space]
                if item.dst.space == "sym":
                    start = sym_offset(item.dst)
                    view = own_sym[start : start + item.rows * plan.n * element].view(out_dtype).view(item.rows, plan.n)
                    dst, dst_part = view, None
                else:
                    dst = _SPACES[item.dst.space]
                    dst_part = index[dst][item.dst.row, item.rows]
                program.append((_MM, src, index[src][item.src.row, item.rows], dst, dst_part, item.accumulate))
            elif isinstance(item, steps.Copy):
                program.append((_COPY, stream_index[item.stream], *place(item.dst), *place(item.src),
                                item.rows * row_bytes))
            elif isinstance(item, steps.Wait) and kernel_waits:
                assert item.flag.rank == self.rank, "a rank waits on its own flags only (workspace.flags)"
                program.append((_KERNEL_WAIT, stream_index[item.stream], item.flag.row))
            elif isinstance(item, steps.Wait):
                program.append((_WAIT, stream_index[item.stream], self.workspace.flag_ptr(item.flag.rank,
                                                                                         item.flag.row), item))
            elif isinstance(item, steps.Signal):  # in a graph, a copy of the word that holds 1 (module docstring)
                flag = self.workspace.flag_ptr(item.flag.rank, item.flag.row)
                if not captured:
                    program.append((_SIGNAL, stream_index[item.stream], flag))
                elif item.stream == "C":
                    program.append((_FORKED_SIGNAL, flag))
                else:
                    program.append((_COPY, stream_index[item.stream], 3, flag, 3, self._one.data_ptr(), 4))
            elif isinstance(item, steps.Record):
                program.append((_RECORD, stream_index[item.stream], item.event))
            elif isinstance(item, steps.Hook):
                program.append((_HOOK,))
            else:
                program.append((_WAIT_EVENT, stream_index[item.stream], item.event))
        if len(self._programs) > 256:
            self._programs.clear()
        if batch[0]:
            program = _batched(program, plan.world_size, batch[1], self._one.data_ptr())
        joined = tuple(stream_index[name] for name in steps.streams_used(ops)
                       if not (batch[0] and _joined_already(program, stream_index[name])))
        if captured and any(isinstance(item, steps.Signal) and item.stream == "C" for item in ops):
            joined += (stream_index["S"],)
        self._programs[key] = (program, ops, joined, cuts)
        return program, ops, joined, cuts

    def _load_kernels(self, plan: Plan, a: torch.Tensor, b: torch.Tensor, op: str,
                      scales: scaled.Scales | None = None) -> None:
        """Run each matmul shape of the schedule once, eagerly, on scratch outputs: the call queues them behind
        stream waits, and a kernel that is not loaded yet must not be launched there (deadlock rule 3). fp8: each
        band's scaled product as the call runs it (its scales' layout copies, the add of an accumulating step),
        all-gather's from packed rows."""
        guards.refuse_inside_capture(f"{op}: the first P2P call of a shape loads its cuBLAS kernels")
        if self.device.type == "cuda":  # a graph's flag waits (step 2, captured), whatever ``graph_waits`` says later
            stream_ops.load_wait_kernel(self.device)
        shapes = {(item.rows, item.accumulate) for item in rs.schedule(plan, self.rank) if isinstance(item, steps.Mm)}
        if scales is not None:
            source, scale_a = a, None if scales.mode == "tensor" else scales.a
            if plan.op == "all_gather":
                packed = torch.zeros((plan.m, _widths(plan, a.dtype, scales)[1]), dtype=torch.uint8, device=a.device)
                scaled.pack_rows(a, scales.shard_rows(a.shape[0]), packed[: a.shape[0]])
                source, scale_a = scaled.unpack_rows(packed, plan.k, a.dtype, scales.scale_columns(plan.k))
                # A returned gathered input's copies, queued after waits on C.
                scaled.gathered_input(packed, plan.k, a.dtype, scales)
            for rows, accumulate in shapes:
                scratch = torch.zeros((rows, plan.n), dtype=scales.out_dtype, device=a.device)
                _scaled_band(scratch, source[:rows], None if scale_a is None else scale_a[:rows], b, scales,
                             accumulate)
            torch.cuda.synchronize(self.device)
            return
        source = a if plan.op != "all_gather" else a.new_zeros((plan.m, plan.k))
        for rows, accumulate in shapes:
            scratch = torch.zeros((rows, plan.n), dtype=a.dtype, device=a.device)
            if accumulate:
                scratch.addmm_(source[:rows], b)
            else:
                torch.mm(source[:rows], b, out=scratch)
        torch.cuda.synchronize(self.device)

    def _stream(self, index: int) -> torch.cuda.Stream:
        """The schedule's stream ``index`` (``C``, ``X``, ``L``) as a torch object (debug mode's polled events)."""
        return (torch.cuda.current_stream(self.device), self.copy_stream, self.local_stream)[index]

    def _check_progress(self, waited, timeout: float, op: str) -> None:
        guards.poll_events(waited, timeout, lambda item: (
            f"flashoverlap: rank {self.rank}: {op} on {self.name} (P2P path) waited more than "
            f"{timeout:g} s (FLASHOVERLAP_DEBUG_TIMEOUT) for {item.what}: a peer never reached this call, or "
            "called with other shapes or dtypes"))
