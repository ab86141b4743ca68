"""The P2P expert communicator's executor (``comm/expert/p2p.py``) on the CPU: one call issued against a recording
driver and recording streams, read back as the schedule it must be (every flag wait resets its flag on its stream,
every copy moves its rows' bytes between the right addresses: peers' slots by the workspace's slot size, every
signal writes the right flag, the GEMMs read and write the right rows with their chunk's segments, the hook and the
weighted sum where the schedule says, the copy stream joined back); the workspace sized for the largest chunk any
pair moves (the layout's max_pair_rows in exact mode: no collective); repeated bounded calls replayed from a graph;
and the debug deadline polling every flag wait."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils.weak import WeakTensorKeyDictionary

from flashoverlap.comm import steps
from flashoverlap.comm.expert import ExpertCall, ExpertPlan, HybridCut, Layout, chunked_gemm
from flashoverlap.comm.expert import p2p as ep
from flashoverlap.comm.expert.chunked_gemm import relative_ends
from flashoverlap.comm.replay import CallGraphs
from tests.comm.graph_waits import as_kernel_waits, first_load, record_wait_kernels

PEER_BASE, FLAG_BASE, FLAG_STRIDE = 1 << 40, 1 << 36, 1 << 20
LOCAL, HIDDEN, FFN, TOP_K = 2, 24, 16, 2


class Recorder:
    def __init__(self):
        self.trace = []

    def wait_reset(self, stream, address):
        self.trace += [(stream, "wait", address, 1), (stream, "write", address, 0)]

    def write(self, stream, address, value):
        self.trace.append((stream, "write", address, value))

    def copy(self, stream, dst, src, nbytes):
        self.trace.append((stream, "copy", dst, src, nbytes))

    # Driver events and raw stream handles (``stream_ops.FastDriver``): event handles are 100, 101, ...
    def current_stream(self, index):
        return 0

    def new_event(self):
        self.made = getattr(self, "made", 0) + 1
        return 99 + self.made

    def free_event(self, event):
        self.trace.append(("free", event))

    def record(self, event, stream):
        self.trace.append((stream, "record", event))

    def wait_event(self, stream, event):
        self.trace.append((stream, "wait_event", event))


class FakeStream:
    def __init__(self, handle, recorder):
        self.cuda_stream, self.recorder = handle, recorder

    def wait_stream(self, other):
        self.recorder.trace.append((self.cuda_stream, "join", other.cuda_stream))

    def wait_event(self, event):
        self.recorder.trace.append((self.cuda_stream, "wait_event", event.index))


class FakeWorkspace:
    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.buffer = torch.zeros(8, dtype=torch.uint8)
        self.grown = []

    def ensure(self, nbytes, op, ones=(0, 0)):
        self.grown.append((nbytes, ones))
        self.nbytes = nbytes
        return True

    def peer_ptr(self, rank):
        return PEER_BASE * (rank + 1)

    def flag_ptr(self, rank, slot):
        return FLAG_BASE + rank * FLAG_STRIDE + 4 * slot


def _layout(world, rank, mode, send, recv, bound=None, max_pair_rows=None):
    """A hand-made layout of ``rank`` (no collective): ``send[d]`` rows to rank d, ``recv[s]`` from rank s, split
    over the local experts as evenly as they go; ``max_pair_rows`` default: this rank's own largest pair (exact),
    the bound (bounded)."""
    def per_expert(n):
        return [n // LOCAL + (1 if e < n % LOCAL else 0) for e in range(LOCAL)]

    recv_counts = torch.tensor([per_expert(n) for n in recv], dtype=torch.int64)
    send_counts = torch.tensor([per_expert(n) for n in send], dtype=torch.int64)
    if mode == "exact":
        ends = torch.cumsum(recv_counts.reshape(-1), 0)
    else:
        ends = (torch.arange(world)[:, None] * bound + torch.cumsum(recv_counts, 1)).reshape(-1)
    starts = ends - recv_counts.reshape(-1)
    choices = sum(send)
    tokens = choices // TOP_K
    if max_pair_rows is None:
        max_pair_rows = max(send + recv) if mode == "exact" else bound
    splits = {"send_splits": tuple(send), "recv_splits": tuple(recv)} if mode == "exact" else {}
    return Layout(torch.arange(choices), torch.arange(choices), send_counts, recv_counts, starts.to(torch.int32),
                  ends.to(torch.int32), mode=mode, bound=bound, top_k=TOP_K, tokens=tokens, experts=LOCAL * world,
                  weights=torch.rand(choices), max_pair_rows=max_pair_rows, **splits)


def _communicator(rank, world, recorder, monkeypatch, slot_bytes=1 << 16):
    comm = object.__new__(ep.ExpertP2PCommunicator)
    comm.rank, comm.world_size, comm.name = rank, world, "test group"
    comm.device = torch.device("cpu")
    comm.group = None
    comm.copy_stream = FakeStream(1, recorder)
    comm.workspace = FakeWorkspace(world * slot_bytes)
    comm._index, comm._events, comm._join = 0, [], None
    comm._warm, comm._light_warm, comm._tables, comm._programs = set(), set(), {}, {}
    comm._ends = WeakTensorKeyDictionary()
    comm.graphs = CallGraphs(None)
    compute = FakeStream(0, recorder)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(ep.stream_ops, "fast", lambda: recorder)

    def gemm(spec, x, ends, out, host_ends=None):
        recorder.trace.append(("gemm", x.data_ptr(), x.shape[0], out.data_ptr(), tuple(ends.tolist())))

    monkeypatch.setattr(chunked_gemm, "multiply_chunk", gemm)
    recorder.allocated = []  # the communicator's allocations, in order (``_rows``)

    def new(shape, dtype):
        recorder.allocated.append(torch.empty(shape, dtype=dtype))
        return recorder.allocated[-1]

    monkeypatch.setattr(comm, "_new", new)
    return comm


def _rows(recorder, outputs):
    """A call's rows buffer: its returned one, or where it does not return it, the one its issued work allocated
    last (``contract.issued_rows``)."""
    return outputs[1] if outputs[1] is not None else recorder.allocated[-1]


def _expected(comm, call, chunks, tensors, row_bytes):
    stream = {"C": 0, "X": 1}
    slot = comm._slot_bytes()
    ends = relative_ends(call.layout)

    def address(loc):
        if loc.space == "flag":
            return comm.workspace.flag_ptr(loc.rank, loc.row)
        if loc.space == "sym":
            return comm.workspace.peer_ptr(loc.rank) + loc.region * slot + loc.row * row_bytes
        return tensors[loc.space].data_ptr() + loc.row * row_bytes

    out = []
    gathered = call.return_gathered and call.plan.op == "dispatch"
    for op in ep.schedule(call.plan.op, comm.rank, chunks.send, chunks.recv, gathered):
        if isinstance(op, steps.Wait):
            out += [(stream[op.stream], "wait", address(op.flag), 1), (stream[op.stream], "write", address(op.flag), 0)]
        elif isinstance(op, steps.Signal):
            out.append((stream[op.stream], "write", address(op.flag), 1))
        elif isinstance(op, steps.Copy):
            out.append((stream[op.stream], "copy", address(op.dst), address(op.src), op.rows * row_bytes))
        elif isinstance(op, steps.Record):
            out.append((stream[op.stream], "record", comm._events[op.event]))
        elif isinstance(op, steps.WaitEvent):
            out.append((stream[op.stream], "wait_event", comm._events[op.event]))
        elif isinstance(op, steps.Gemm):
            x = tensors[op.src.space][op.src.row : op.src.row + op.rows]
            dst = tensors[op.dst.space][op.dst.row : op.dst.row + op.rows]
            out.append(("gemm", x.data_ptr(), op.rows, dst.data_ptr(), tuple(ends[op.chunk].tolist())))
        elif isinstance(op, steps.Gather):
            out.append(("gather",))
        elif isinstance(op, steps.Hook):
            out.append((0, "hook"))
        else:
            out.append(("finish",))
    return out + [(1, "record", comm._join), (0, "wait_event", comm._join)]  # X joined into C


CASES = [  # (world, rank, mode, send, recv, bound)
    (2, 0, "exact", (3, 5), (3, 2), None),
    (2, 1, "bounded", (6, 6), (6, 6), 6),
    (3, 2, "exact", (2, 0, 4), (3, 0, 4), None),  # a pair with no rows either way
    (3, 0, "exact", (0, 0, 0), (0, 1, 3), None),  # sends none (no tokens)
    (3, 1, "exact", (1, 0, 2), (0, 0, 0), None),  # receives none
    (4, 3, "bounded", (5, 5, 5, 5), (5, 5, 5, 5), 5),
]


def _issued(comm, recorder, op, world, rank, mode, send, recv, bound, monkeypatch, captured=False):
    """One call of ``op`` issued (``captured``: as into a graph) on the recording driver; returns the trace the
    schedule says it must leave, with memory-operation waits."""
    layout = _layout(world, rank, mode, send, recv, bound)
    tokens = layout.tokens
    plan = ExpertPlan(op, world, LOCAL * world, HIDDEN, 2 * FFN if op == "dispatch" else FFN, TOP_K, tokens, mode,
                      bound, "triton")
    send_tensor = torch.empty(layout.send_capacity, HIDDEN, dtype=torch.bfloat16)
    y = torch.empty(layout.recv_rows, HIDDEN, dtype=torch.bfloat16)

    def gather(a, plan, layout):
        recorder.trace.append(("gather",))
        return send_tensor

    def finish(back, plan, layout, dtype, out=None):
        recorder.trace.append(("finish",))
        assert out is not None and out.data_ptr() == given.data_ptr()  # the weighted sum lands in the call's out
        return out

    monkeypatch.setattr(ep, "send_buffer", gather)
    monkeypatch.setattr(ep, "combine_at_origin", finish)
    monkeypatch.setattr(comm, "_scratch", lambda shape, dtype, zero: y)
    if op == "dispatch":
        a = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
        b = torch.randn(LOCAL, 2 * FFN, HIDDEN, dtype=torch.bfloat16).transpose(1, 2)
    else:
        a = torch.randn(layout.recv_rows, FFN, dtype=torch.bfloat16)
        b = torch.randn(LOCAL, FFN, HIDDEN, dtype=torch.bfloat16)
    given = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16)  # combine: the caller's preallocated result
    call = ExpertCall("moe op", plan, a, b, return_gathered=op == "dispatch", layout=layout,
                      hook=lambda: recorder.trace.append((0, "hook")), out=given if op == "combine" else None)
    chunks = chunked_gemm.Chunks.of(plan, layout)
    outputs = comm._outputs(call, a)
    assert (outputs[0] is given) == (op == "combine")
    comm.issue(call, a, chunks, outputs, captured=captured)
    if op == "dispatch":
        tensors = {"send": send_tensor, "h": outputs[0], "recv": outputs[1]}
    else:
        assert outputs[1] is None  # not returned: the issued work's own
        tensors = {"a": a, "y": y, "back": _rows(recorder, outputs)}
    return _expected(comm, call, chunks, tensors, HIDDEN * 2)


@pytest.mark.parametrize("op", ["dispatch", "combine"])
@pytest.mark.parametrize("world,rank,mode,send,recv,bound", CASES)
def test_the_executor_issues_exactly_the_schedule(op, world, rank, mode, send, recv, bound, monkeypatch):
    recorder = Recorder()
    comm = _communicator(rank, world, recorder, monkeypatch)
    assert recorder.trace == _issued(comm, recorder, op, world, rank, mode, send, recv, bound, monkeypatch)


@pytest.mark.parametrize("op", ["dispatch", "combine"])
@pytest.mark.parametrize("world,rank,mode,send,recv,bound", [CASES[1], CASES[2], CASES[5]])
def test_a_graph_waits_on_flags_with_the_wait_kernel(op, world, rank, mode, send, recv, bound, monkeypatch):
    """Captured with kernel waits (the default on a GPU): every flag wait of the schedule is the wait kernel on the
    wait's stream, for the flag's slot in this rank's flags, at the wait's place; the rest of the captured trace is
    unchanged (signals stay stream writes). An eager call waits with memory operations whatever the setting."""
    recorder = Recorder()
    comm = _communicator(rank, world, recorder, monkeypatch)
    comm.workspace.flags = torch.zeros(FLAG_STRIDE // 4, dtype=torch.int32)
    record_wait_kernels(monkeypatch, recorder, comm.workspace.flags)
    case = (op, world, rank, mode, send, recv, bound, monkeypatch)
    comm.graph_waits = "memop"  # a captured program of memory operations first: the kernel's must be another
    assert recorder.trace == _issued(comm, recorder, *case, captured=True)
    recorder.trace.clear()
    comm.graph_waits = "kernel"
    kernel_waits = as_kernel_waits(_issued(comm, recorder, *case, captured=True), comm.workspace.flag_ptr(rank, 0),
                                   FLAG_STRIDE // 4)
    assert {step[0] for step in kernel_waits if step[1:2] == ("wait kernel",)} == {0, 1}  # C's waits and X's
    assert recorder.trace == kernel_waits
    recorder.trace.clear()
    assert _issued(comm, recorder, *case) == recorder.trace  # eager: memory operations


def test_the_workspace_holds_the_largest_chunk_of_any_pair_with_no_collective(monkeypatch):
    recorder = Recorder()
    comm = _communicator(0, 2, recorder, monkeypatch, slot_bytes=0)
    collectives = []

    def forbidden(name):
        return lambda *args, **kwargs: collectives.append(name)

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier"):
        monkeypatch.setattr(dist, name, forbidden(name))
    monkeypatch.setattr(comm, "_load_kernels", lambda call, chunks: None)
    # A peer's pair moves 40 rows, more than any of this rank's (5): the layout says so (expert_layout read it from
    # the all-gathered counts); the slots must hold it with no collective and no host synchronisation of their own.
    layout = _layout(2, 0, "exact", (3, 5), (4, 2), max_pair_rows=40)
    plan = ExpertPlan("dispatch", 2, 2 * LOCAL, HIDDEN, 2 * FFN, TOP_K, layout.tokens)
    a, b = torch.zeros(4, HIDDEN, dtype=torch.bfloat16), torch.zeros(LOCAL, HIDDEN, 2 * FFN)
    for routing in (layout, layout, layout.with_weights(torch.rand(layout.tokens, TOP_K))):  # one layer's calls
        comm.prepare(ExpertCall("op", plan, a, b, layout=routing), chunked_gemm.Chunks.of(plan, routing))
    assert collectives == []
    assert comm._slot_bytes() >= 40 * HIDDEN * 2 and len(comm.workspace.grown) == 1
    assert comm.workspace.grown[0][1] == (ep.FREE_BASE, ep.FREE_BASE + 2)  # the free flags start at 1
    bounded = _layout(2, 0, "bounded", (50, 50), (50, 50), bound=50)
    plan = ExpertPlan("dispatch", 2, 2 * LOCAL, HIDDEN, 2 * FFN, TOP_K, bounded.tokens, "bounded", 50)
    comm.prepare(ExpertCall("op", plan, a, b, layout=bounded), chunked_gemm.Chunks.of(plan, bounded))
    assert collectives == [] and comm._slot_bytes() >= 50 * HIDDEN * 2  # bounded: the bound
    plan = ExpertPlan("dispatch", 2, 2 * LOCAL, HIDDEN, 2 * FFN, TOP_K, layout.tokens)
    for bad, match in ((dataclasses.replace(layout, max_pair_rows=None), "the layout has no max_pair_rows"),
                       (dataclasses.replace(layout, max_pair_rows=4), "max_pair_rows=4 is below its own largest")):
        with pytest.raises(ValueError, match=match):
            comm.prepare(ExpertCall("op", plan, a, b, layout=bad), chunked_gemm.Chunks.of(plan, bad))


class FakeGraph:
    def __init__(self, recorder, issue):
        self.recorder = recorder
        issue()

    def replay(self):
        self.recorder.trace.append(("replay",))


def _replaying(monkeypatch, mode):
    recorder = Recorder()
    comm = _communicator(0, 2, recorder, monkeypatch)
    comm.graphs = CallGraphs(None, capture=lambda issue: FakeGraph(recorder, issue))
    monkeypatch.setattr(comm, "prepare", lambda call, chunks: None)
    layout = _layout(2, 0, mode, (4, 4), (4, 4), 4 if mode == "bounded" else None)
    plan = ExpertPlan("dispatch", 2, 2 * LOCAL, HIDDEN, 2 * FFN, TOP_K, layout.tokens, mode,
                      4 if mode == "bounded" else None, "triton")
    a = torch.randn(layout.tokens, HIDDEN, dtype=torch.bfloat16)
    b = torch.randn(LOCAL, HIDDEN, 2 * FFN, dtype=torch.bfloat16)
    outputs = comm._outputs(ExpertCall("op", plan, a, b, layout=layout), a)
    monkeypatch.setattr(comm, "_outputs", lambda call, a: outputs)  # the allocator's same blocks, call after call
    blocks = {}  # and the issued work's own (the received rows): the same block per shape, as the trace compares
    monkeypatch.setattr(comm, "_new", lambda shape, dtype: blocks.setdefault((shape, dtype), torch.empty(shape,
                                                                                                      dtype=dtype)))
    send = torch.empty(layout.send_capacity, HIDDEN, dtype=torch.bfloat16)
    monkeypatch.setattr(ep, "send_buffer", lambda a, plan, layout: send)
    return recorder, comm, ExpertCall("op", plan, a, b, layout=layout, replay=True)


def test_a_repeated_bounded_call_replays_a_graph_of_exactly_the_eager_schedule(monkeypatch):
    recorder, comm, call = _replaying(monkeypatch, "bounded")
    comm.run(call)
    eager = list(recorder.trace)
    assert eager and ("replay",) not in eager
    recorder.trace.clear()
    comm.run(call)
    assert recorder.trace == eager + [("replay",)]
    recorder.trace.clear()
    comm.run(call)
    assert recorder.trace == [("replay",)]


def test_the_replay_lane_replays_the_graph_run_captured_and_names_the_workspace(monkeypatch):
    """The P2P expert communicator's replay lane (``contract.replayer``): given the next call's spec, it allocates
    the outputs ``run`` allocates and replays the graph ``run`` captured, nothing else; the workspace's address is
    read at each call (a lane built before the workspace moved misses, and the runtime then runs the call)."""
    import types

    recorder, comm, call = _replaying(monkeypatch, "bounded")
    monkeypatch.setattr(comm, "_outputs", lambda call, a: ep.call_outputs(call, a, comm._new))  # the real order
    comm.run(call)
    h, _ = comm.run(call)  # captured and replayed
    lane = comm.replayer(call)
    spec = types.SimpleNamespace(layout=call.layout, topk_weights=None, out=None)
    recorder.trace.clear()
    got, rows = lane(spec)
    assert recorder.trace == [("replay",)] and got.data_ptr() == h.data_ptr() and rows is None
    comm.workspace = FakeWorkspace(comm.workspace.nbytes)  # the workspace moved: its graphs name the old one
    recorder.trace.clear()
    assert lane(spec) is None and not recorder.trace
    exact = _replaying(monkeypatch, "exact")[2]
    assert comm.replayer(exact) is None and comm.replayer(dataclasses.replace(call, replay=False)) is None


def test_calls_are_issued_as_captured_inside_our_graph_and_the_users_only(monkeypatch):
    recorder, comm, call = _replaying(monkeypatch, "bounded")
    issued = []
    real = comm.issue
    monkeypatch.setattr(comm, "issue", lambda *args, captured=False, **kwargs: (issued.append(captured),
                                                                                 real(*args, captured=captured,
                                                                                      **kwargs)))
    comm.run(call)  # eager, then captured into our graph, then replayed (no issue)
    comm.run(call)
    comm.run(call)
    monkeypatch.setattr(ep.guards, "capturing", lambda operand=None: True)  # inside the user's capture
    comm.run(dataclasses.replace(call, replay=False))
    assert issued == [False, True, True]


def test_a_plans_first_call_loads_the_wait_kernel_on_a_gpu_before_anything_else(monkeypatch):
    """Deadlock rule 3: a graph of the plan (ours or the user's) launches the wait kernel behind a flag wait, so the
    plan's first (eager, uncaptured) call loads it, first, on a GPU whatever ``graph_waits`` says."""
    _, comm, call = _replaying(monkeypatch, "bounded")
    comm.device, comm.graph_waits = torch.device("cuda", 0), "memop"  # a device object only: nothing runs on it
    chunks = chunked_gemm.Chunks.of(call.plan, call.layout)
    assert first_load(monkeypatch, lambda: comm._load_kernels(call, chunks)) == (comm.device,)


def test_exact_mode_calls_are_never_replayed(monkeypatch):
    recorder, comm, call = _replaying(monkeypatch, "exact")
    for _ in range(3):
        recorder.trace.clear()
        comm.run(call)
        assert recorder.trace and ("replay",) not in recorder.trace


def test_a_call_with_a_debug_deadline_polls_every_flag_wait(monkeypatch):
    recorder, comm, call = _replaying(monkeypatch, "bounded")
    polled = []
    monkeypatch.setattr(comm, "_check_progress", lambda call, waited, timeout: polled.append((len(waited), timeout)))
    monkeypatch.setattr(FakeStream, "record_event", lambda self: None, raising=False)
    comm.run(ExpertCall("op", call.plan, call.a, call.b, layout=call.layout, timeout=5.0))
    chunks = chunked_gemm.Chunks.of(call.plan, call.layout)
    waits = sum(isinstance(op, steps.Wait) for op in ep.schedule("dispatch", 0, chunks.send, chunks.recv))
    assert polled == [(waits, 5.0)] and waits == 2


# -- what the executor keeps between calls: resolved schedules and (exact mode) each chunk's segment ends ----------


def _stub_io(monkeypatch, comm, recorder, layout, op, hidden, ffn):
    """What a call does outside its schedule, stood in for: the send buffer (``send_tensor``, its making traced),
    combine's products (``y``, random rows), the origin's weighted sum (traced, not computed) and the kernels'
    loading. Returns ``(send_tensor, y, a, b)``, with ``op``'s operands ``a`` and ``b``."""
    send_tensor = torch.empty(layout.send_capacity, hidden, dtype=torch.bfloat16)
    y = torch.randn(layout.recv_rows, hidden).to(torch.bfloat16)
    monkeypatch.setattr(ep, "send_buffer", lambda a, plan, layout: recorder.trace.append(("gather",)) or send_tensor)
    monkeypatch.setattr(ep, "combine_at_origin", lambda back, plan, layout, dtype, out=None:
                        recorder.trace.append(("finish",)) or out)
    monkeypatch.setattr(comm, "_scratch", lambda shape, dtype, zero: y)
    monkeypatch.setattr(comm, "_load_kernels", lambda call, chunks: None)
    if op == "dispatch":
        a, b = torch.randn(layout.tokens, hidden, dtype=torch.bfloat16), torch.randn(LOCAL, hidden, ffn)
    else:
        a, b = torch.randn(layout.recv_rows, ffn, dtype=torch.bfloat16), torch.randn(LOCAL, ffn, hidden)
    return send_tensor, y, a, b


def _run_call(comm, recorder, monkeypatch, layout, op="dispatch", hidden=HIDDEN):
    """One eager call of ``op`` with ``layout`` (send buffer and weighted sum recorded, not computed); returns its
    trace and the trace the schedule says it must be."""
    world = comm.world_size
    ffn = 2 * FFN if op == "dispatch" else FFN
    plan = ExpertPlan(op, world, LOCAL * world, hidden, ffn, TOP_K, layout.tokens, layout.mode, layout.bound,
                      "triton")
    send_tensor, y, a, b = _stub_io(monkeypatch, comm, recorder, layout, op, hidden, ffn)
    call = ExpertCall("op", plan, a, b, layout=layout, hook=lambda: recorder.trace.append((0, "hook")))
    chunks = chunked_gemm.Chunks.of(plan, layout)
    comm.prepare(call, chunks)
    outputs = comm._outputs(call, a)
    recorder.trace.clear()
    comm.issue(call, a, chunks, outputs)
    tensors = {"send": send_tensor, "h": outputs[0], "recv": _rows(recorder, outputs)} if op == "dispatch" else \
        {"a": a, "y": y, "back": _rows(recorder, outputs)}
    return list(recorder.trace), _expected(comm, call, chunks, tensors, hidden * 2)


def test_a_resolved_schedule_is_kept_per_layout_shape_and_workspace(monkeypatch):
    recorder = Recorder()
    comm = _communicator(0, 2, recorder, monkeypatch)
    first = _layout(2, 0, "exact", (3, 5), (3, 2))
    got, want = _run_call(comm, recorder, monkeypatch, first)
    assert got == want and len(comm._programs) == 1
    program = next(iter(comm._programs.values()))
    got, want = _run_call(comm, recorder, monkeypatch, _layout(2, 0, "exact", (3, 5), (3, 2)))  # same sizes: reused
    assert got == want and len(comm._programs) == 1 and next(iter(comm._programs.values())) is program
    got, want = _run_call(comm, recorder, monkeypatch, _layout(2, 0, "exact", (4, 1), (2, 6)))  # a new layout
    assert got == want and len(comm._programs) == 2
    got, want = _run_call(comm, recorder, monkeypatch, first, hidden=40)  # new shapes: other row offsets
    assert got == want and len(comm._programs) == 3
    # The workspace grows (a pair that moves more rows than a slot holds): the slots' and peers' addresses move.
    big = _layout(2, 0, "exact", (3, 5), (3, 2), max_pair_rows=4000)
    comm.workspace.peer_ptr = lambda rank: PEER_BASE * (rank + 7)
    got, want = _run_call(comm, recorder, monkeypatch, big)
    assert len(comm.workspace.grown) == 1 and got == want and len(comm._programs) == 1


def test_exact_chunk_ends_are_kept_per_layout_and_bounded_ones_read_the_layout_every_call(monkeypatch):
    recorder = Recorder()
    comm = _communicator(1, 3, recorder, monkeypatch)
    made = []
    real = chunked_gemm.relative_ends
    monkeypatch.setattr(chunked_gemm, "relative_ends", lambda layout: made.append(layout.mode) or real(layout))
    exact = _layout(3, 1, "exact", (2, 3, 5), (5, 1, 3))
    for op in ("dispatch", "combine", "dispatch"):  # one layer's calls: the ends made once
        routing = exact if op == "dispatch" else exact.with_weights(torch.rand(exact.tokens, TOP_K))
        got, want = _run_call(comm, recorder, monkeypatch, routing, op)
        assert got == want
    # Once for the chunks' device ends (``chunk_ends``), once for the loop's host ends (``host_relative_ends``: this
    # hand-built layout has no host counts), each kept.
    assert made == ["exact"] * 2
    other = _layout(3, 1, "exact", (4, 3, 2), (1, 3, 5))  # another layer's layout: its own ends
    got, want = _run_call(comm, recorder, monkeypatch, other)
    assert got == want and made == ["exact"] * 4
    other.recv_seg_ends.copy_(other.recv_seg_ends.clone())  # written in place (the same values): made again
    got, want = _run_call(comm, recorder, monkeypatch, other)
    assert got == want and made == ["exact"] * 5
    got, want = _run_call(comm, recorder, monkeypatch, other)  # and kept again
    assert got == want and made == ["exact"] * 5
    bounded = _layout(3, 1, "bounded", (6, 6, 6), (6, 6, 6), bound=6)
    got, want = _run_call(comm, recorder, monkeypatch, bounded)
    assert got == want
    # New routing copied into the layout's tensors (as before a user's graph replays): the next call reads it.
    fresh = _layout(3, 1, "bounded", (6, 6, 6), (2, 5, 3), bound=6)
    for mine, theirs in zip(bounded.tensors(), fresh.tensors()):
        mine.copy_(theirs)
    got, want = _run_call(comm, recorder, monkeypatch, bounded)
    assert got == want and made == ["exact"] * 5 + ["bounded"] * 2
    assert [step[4] for step in got if step[0] == "gemm"] == [(3, 5), (1, 2), (2, 3)]  # own chunk, then 0, 2


def test_release_through_the_runtime_empties_what_the_executor_keeps(monkeypatch):
    from flashoverlap.runtime import context as runtime_context

    recorder = Recorder()
    comm = _communicator(0, 2, recorder, monkeypatch)
    comm.workspace.release = lambda: recorder.trace.append(("workspace released",))
    layout = _layout(2, 0, "exact", (3, 5), (3, 2))
    _run_call(comm, recorder, monkeypatch, layout)
    assert comm._programs and comm._events and comm._join is not None and len(comm._ends) == 1
    events = [*comm._events, comm._join]
    group = object()  # a process group's stand-in: the runtime keys its contexts by identity
    held = object.__new__(runtime_context.GroupContext)
    held.process_group, held.device, held.communicators = group, torch.device("cpu"), {("expert", "p2p"): comm}
    held.rates, held.agreed, held.calls, held.logged = {}, {}, {}, set()
    monkeypatch.setitem(runtime_context.REGISTRY.contexts, (id(group), "cpu", None), held)
    recorder.trace.clear()
    runtime_context.REGISTRY.clear(group)  # what flashoverlap.release does once group is checked (a stand-in here)
    assert not comm._programs and not comm._events and comm._join is None and len(comm._ends) == 0
    assert sorted(recorder.trace[:-1]) == [("free", e) for e in sorted(events)]
    assert recorder.trace[-1] == ("workspace released",)
    got, want = _run_call(comm, recorder, monkeypatch, layout)  # the next call starts afresh
    assert got == want and len(comm._programs) == 1


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_the_hybrids_light_launch_waits_on_nothing_and_reads_every_chunk(op, monkeypatch):
    """The hybrid GEMM (exact mode): dispatch copies the own chunk among the received rows (the schedule's gathered
    copy, also when the rows are not returned) and launches the light experts after X joins C, over the received
    rows into h; combine launches them first, over a into y, and its own chunk's GEMM writes y, whose own rows then
    reach the returned rows. The light kernels of a variant load once, before anything of the call is queued."""
    recorder = Recorder()
    comm = _communicator(1, 3, recorder, monkeypatch)
    layout = _layout(3, 1, "exact", (2, 3, 4), (3, 3, 1))  # the own pair's rows: sent to and received from itself
    loads = []
    monkeypatch.setattr(ep, "chunk_gemm", lambda plan, dtype, device, scales=None: "hybrid")
    monkeypatch.setattr(chunked_gemm, "hybrid_parts", lambda layout, heavy_rows: (frozenset({0}), None))
    monkeypatch.setattr(ep, "light_variant", lambda plan, layout, b: ("variant",))

    def light_multiplier(kind, plan, layout, b):
        assert kind == "hybrid" and plan.hybrid is not None
        return lambda x, out: recorder.trace.append(("light", x.data_ptr(), out.data_ptr()))

    monkeypatch.setattr(ep, "light_multiplier", light_multiplier)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: loads.append(len(recorder.trace)))
    ffn = 2 * FFN if op == "dispatch" else FFN
    plan = ExpertPlan(op, 3, LOCAL * 3, HIDDEN, ffn, TOP_K, layout.tokens, gemm="hybrid",
                      hybrid=HybridCut(heavy_rows=1024, light_flat_rows=256))
    send_tensor, y, a, b = _stub_io(monkeypatch, comm, recorder, layout, op, HIDDEN, ffn)
    chunks = chunked_gemm.Chunks.of(plan, layout)
    for call_index in range(2):
        call = ExpertCall("op", plan, a, b, return_gathered=False, layout=layout)
        comm.prepare(call, chunks)
        outputs = comm._outputs(call, a)
        recorder.trace.clear()
        loads.clear()
        comm.issue(call, a, chunks, outputs)
        trace = list(recorder.trace)
        # The variant's kernels load on the first call only, before anything of it is queued.
        assert loads == ([1] if call_index == 0 and op == "dispatch" else [])
        real = [step for step in trace if step[0] == "light"]
        if op == "dispatch":
            # The loading run (first call only) is the first thing issued, on scratch rows.
            assert len(real) == (2 if call_index == 0 else 1)
            assert call_index > 0 or (trace[0][0] == "light" and trace[0][2] != outputs[0].data_ptr())
            h, recv = outputs[0], _rows(recorder, outputs)
            at = chunked_gemm.offsets(chunks.send)[1] * HIDDEN * 2
            own_copy = (0, "copy", recv.data_ptr() + chunked_gemm.offsets(chunks.recv)[1] * HIDDEN * 2,
                        send_tensor.data_ptr() + at, chunks.recv[1] * HIDDEN * 2)
            assert own_copy in trace, "the own chunk is not copied among the received rows"
            assert trace[-3:] == [(1, "record", comm._join), (0, "wait_event", comm._join),
                                  ("light", recv.data_ptr(), h.data_ptr())]
        else:
            back = _rows(recorder, outputs)
            assert trace[0] == ("light", a.data_ptr(), y.data_ptr()) and len(real) == 1
            own = chunked_gemm.offsets(chunks.recv)[1]
            gemms = [step for step in trace if step[0] == "gemm"]
            assert gemms[-1][3] == y[own:].data_ptr(), "the own chunk's GEMM does not write y"
            start = chunked_gemm.offsets(chunks.send)[1]
            assert torch.equal(back[start : start + chunks.send[1]], y[own : own + chunks.recv[1]])
