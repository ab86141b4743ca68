"""The P2P communicator's executor (``comm/tp/p2p.py``) on the CPU: its resolved program issued against a recording
driver and recording streams, and the recording read back as the schedule it must be. Every flag wait resets its
flag on the same stream, every copy moves its rows' bytes on its stream between the right addresses, every
signal writes the right flag, events order the right streams, the hook runs where the schedule says, and the
copy streams are joined back into the caller's stream."""

import contextlib

import pytest
import torch

from flashoverlap.comm import steps
from flashoverlap.comm.protocol import Call
from flashoverlap.comm.replay import Matmul
from flashoverlap.comm.tp import p2p
from flashoverlap.comm.tp import ring_schedule as rs
from flashoverlap.plan import TileConfig
from flashoverlap.tune.defaults import default_plan
from tests.comm.graph_waits import as_kernel_waits, first_load, record_wait_kernels

TILE = TileConfig(16, 16, 16, 2, 1, 4)
PEER_BASE, FLAG_BASE, FLAG_STRIDE = 1 << 40, 1 << 36, 1 << 20


class Recorder:
    """Every driver call and stream call, in order: ``(stream, kind, *args)``."""

    def __init__(self):
        self.trace = []

    def wait_geq(self, stream, address, value):
        self.trace.append((stream, "wait", address, value))

    def wait_reset(self, stream, address):
        self.wait_geq(stream, address, 1)
        self.write(stream, address, 0)

    def write(self, stream, address, value):
        self.trace.append((stream, "write", address, value))

    def copy(self, stream, dst, src, nbytes):
        self.trace.append((stream, "copy", dst, src, nbytes))

    def current_stream(self, index):
        return 0  # the caller's stream: handle 0

    def new_event(self):  # event handles 0, 1, 2, ... in the order they are made
        self.events = getattr(self, "events", 0) + 1
        return self.events - 1

    def free_event(self, event):
        self.trace.append((None, "free", event))

    def record(self, event, stream):
        self.trace.append((stream, "record", event))

    def wait_event(self, stream, event):
        self.trace.append((stream, "wait_event", event))

    def launch_graph(self, graph_exec, stream):
        self.trace.append((stream, "launch_graph", graph_exec))


class FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle

    def record_event(self):
        raise AssertionError("no debug timeout in this test")


class FakeWorkspace:
    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)

    def local(self, shape, dtype):
        return self.buffer.view(dtype).view(shape)

    def peer_ptr(self, rank):
        return PEER_BASE * (rank + 1)

    def flag_ptr(self, rank, slot):
        return FLAG_BASE + rank * FLAG_STRIDE + 4 * slot


def _communicator(rank, world, recorder, monkeypatch):
    comm = object.__new__(p2p.P2PCommunicator)
    comm.rank, comm.world_size, comm.name = rank, world, "test group"
    comm.device = torch.device("cpu")
    comm.copy_stream, comm.local_stream, comm.signal_stream = FakeStream(1), FakeStream(2), FakeStream(3)
    comm._index, comm._handles = 0, (1, 2, 3)
    comm.workspace = FakeWorkspace(rs.regions(world) * (1 << 16))
    comm._events, comm._joins, comm._fork = [], None, None
    comm._programs = {}
    comm._ready = set()
    comm._one = torch.ones(1, dtype=torch.int32)
    compute = FakeStream(0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(p2p.stream_ops, "fast", lambda: recorder)

    def mm(src, b, *, out):  # the matmuls, recorded by the rows they read and write
        recorder.trace.append((0, "mm", src.data_ptr(), tuple(src.shape), out.data_ptr(), tuple(out.shape), False))

    def addmm_(target, src, b):
        recorder.trace.append((0, "mm", src.data_ptr(), tuple(src.shape), target.data_ptr(), tuple(target.shape),
                               True))

    monkeypatch.setattr(p2p.torch, "mm", mm)
    monkeypatch.setattr(torch.Tensor, "addmm_", addmm_)
    return comm


def _expected(plan, rank, comm, bases, row_bytes, gathered_own, captured=False):
    """The trace the schedule implies, with this test's addresses (``captured``: issued into a CUDA graph, where a
    copy stream's signal is a copy of the word that holds 1)."""
    region = comm._region_bytes()
    stream = {"C": 0, "X": 1, "L": 2, "S": 3}

    def address(loc):
        if loc.space == "flag":
            return comm.workspace.flag_ptr(loc.rank, loc.row)
        if loc.space == "sym":
            return comm.workspace.peer_ptr(loc.rank) + rs.region_index(loc.region, plan.world_size) * region \
                + loc.row * row_bytes
        width = plan.n * 2 if loc.space == "out" else row_bytes
        return bases[loc.space] + loc.row * width

    out = [(0, "record", 0)]
    ops = rs.schedule(plan, rank, gathered_own=gathered_own)
    for op in ops:
        if isinstance(op, steps.Wait):
            out += [(stream[op.stream], "wait", address(op.flag), 1), (stream[op.stream], "write", address(op.flag), 0)]
        elif isinstance(op, steps.Signal):
            if not captured:
                out.append((stream[op.stream], "write", address(op.flag), 1))
            else:  # a copy of the word that holds 1; C's on the signal stream S, forked from C by an event
                if op.stream == "C":
                    out += [(0, "record", comm._fork), (3, "wait_event", comm._fork)]
                out.append((3 if op.stream == "C" else stream[op.stream], "copy", address(op.flag),
                            comm._one.data_ptr(), 4))
        elif isinstance(op, steps.Copy):
            out.append((stream[op.stream], "copy", address(op.dst), address(op.src), op.rows * row_bytes))
        elif isinstance(op, steps.Record):
            out.append((stream[op.stream], "record", op.event))
        elif isinstance(op, steps.WaitEvent):
            out.append((stream[op.stream], "wait_event", op.event))
        elif isinstance(op, steps.Hook):
            out.append((0, "hook"))
        elif isinstance(op, steps.Mm):
            src_width = plan.k * 2
            src = bases[op.src.space] + op.src.row * src_width
            if op.dst.space == "sym":  # this rank's own region, through its local mapping
                dst = comm.workspace.buffer.data_ptr() + rs.region_index(op.dst.region, plan.world_size) * region \
                    + op.dst.row * plan.n * 2
            else:
                dst = bases[op.dst.space] + op.dst.row * plan.n * 2
            out.append((0, "mm", src, (op.rows, plan.k), dst, (op.rows, plan.n), op.accumulate))
    forked = captured and any(isinstance(op, steps.Signal) and op.stream == "C" for op in ops)
    for name in steps.streams_used(ops) + (("S",) if forked else ()):  # each joined into C by an event of its own
        join = comm._joins[stream[name]]
        assert join not in range(steps.events(ops))
        out += [(stream[name], "record", join), (0, "wait_event", join)]
    return out


def _issued(comm, recorder, op, world, rank, captured):
    """One call of ``op`` issued by ``comm`` (a small plan, the gathered input returned): the trace it implies."""
    m = 64 * world + (16 if op == "all_reduce" else 0)
    plan = default_plan(op, m, 24, 20, world, tile=TILE, num_groups=2, path="p2p", allow_sequential=False)
    rows = plan.block_rows if op == "all_gather" else plan.m
    a = torch.randn(rows, plan.k, dtype=torch.bfloat16)
    b = torch.randn(plan.k, plan.n, dtype=torch.bfloat16)
    out = torch.empty(plan.block_rows if op == "reduce_scatter" else plan.m, plan.n, dtype=torch.bfloat16)
    gathered = torch.empty(plan.m, plan.k, dtype=torch.bfloat16) if op == "all_gather" else None
    comm.issue(Call(op, plan, a, b, hook=lambda: recorder.trace.append((0, "hook"))), a, out, gathered,
               captured=captured)
    bases = {"a": a.data_ptr(), "out": out.data_ptr(), "gathered": 0 if gathered is None else gathered.data_ptr()}
    width = plan.k if op == "all_gather" else plan.n
    return _expected(plan, rank, comm, bases, width * 2, gathered_own=gathered is not None, captured=captured)


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce", "all_gather"])
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 2)])
def test_the_executor_issues_exactly_the_schedule(op, world, rank, captured, monkeypatch):
    recorder = Recorder()
    comm = _communicator(rank, world, recorder, monkeypatch)
    want = _issued(comm, recorder, op, world, rank, captured)
    assert recorder.trace == want


@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce", "all_gather"])
@pytest.mark.parametrize("world,rank", [(2, 1), (4, 3)])
def test_a_graph_waits_on_flags_with_the_wait_kernel(op, world, rank, monkeypatch):
    """Captured with kernel waits (the default on a GPU): every flag wait of the schedule is the wait kernel
    on the wait's stream, for the flag's slot in this rank's flags, at the wait's place; the rest of the captured
    trace is unchanged. No stream memory operation is captured."""
    recorder = Recorder()
    comm = _communicator(rank, world, recorder, monkeypatch)
    comm.workspace.flags = torch.zeros(FLAG_STRIDE // 4, dtype=torch.int32)
    record_wait_kernels(monkeypatch, recorder, comm.workspace.flags)
    comm.graph_waits = "memop"  # a captured program of memory operations first: the kernel's must be another
    _issued(comm, recorder, op, world, rank, True)
    recorder.trace.clear()
    comm.graph_waits = "kernel"
    kernel_waits = as_kernel_waits(_issued(comm, recorder, op, world, rank, True), comm.workspace.flag_ptr(rank, 0),
                                   FLAG_STRIDE // 4)
    assert any(step[1] == "wait kernel" for step in kernel_waits)
    assert recorder.trace == kernel_waits
    recorder.trace.clear()  # an eager call waits with memory operations whatever the setting
    eager = _issued(comm, recorder, op, world, rank, False)
    assert recorder.trace == eager


class FakeGraph:
    """A capture that queues the call's work once (into the trace, where a CUDA graph would hold it)."""

    def __init__(self, recorder, issue):
        self.recorder = recorder
        issue()

    def replay(self):
        self.recorder.trace.append(("replay",))


def _replaying(monkeypatch, op="reduce_scatter"):
    """A rank-0 communicator whose run() replays through a recording capture, and one call's arguments."""
    recorder = Recorder()
    comm = _communicator(0, 2, recorder, monkeypatch)
    comm.graphs = p2p.CallGraphs(None, capture=lambda issue: FakeGraph(recorder, issue))
    plan = default_plan(op, 128, 24, 20, 2, tile=TILE, num_groups=2, path="p2p", allow_sequential=False)
    a = torch.randn(plan.block_rows if op == "all_gather" else plan.m, plan.k, dtype=torch.bfloat16)
    b = torch.randn(plan.k, plan.n, dtype=torch.bfloat16)
    out = torch.empty(plan.block_rows if op == "reduce_scatter" else plan.m, plan.n, dtype=torch.bfloat16)
    gathered = torch.empty(plan.m, plan.k, dtype=torch.bfloat16)
    monkeypatch.setattr(comm, "prepare", lambda *args: None)
    monkeypatch.setattr(comm, "_load_kernels", lambda *args: None)
    # The allocator hands out the same block for a shape, call after call.
    blocks = {tuple(out.shape): out, tuple(gathered.shape): gathered}
    # On this communicator alone: a stand-in for torch.empty itself would outlive the test if an undo failed.
    monkeypatch.setattr(comm, "_new", lambda shape, dtype: blocks[tuple(shape)])
    return recorder, comm, plan, a, b, blocks


def test_a_plans_first_call_loads_the_wait_kernel_on_a_gpu_before_anything_else(monkeypatch):
    """Deadlock rule 3: a graph of the plan (ours or the user's) launches the wait kernel behind a flag wait, so the
    plan's first (eager, uncaptured) call loads it, first, on a GPU whatever ``graph_waits`` says."""
    _, comm, plan, a, b, _ = _replaying(monkeypatch)
    comm.device, comm.graph_waits = torch.device("cuda", 0), "memop"  # a device object only: nothing runs on it
    assert first_load(monkeypatch, lambda: p2p.P2PCommunicator._load_kernels(comm, plan, a, b, "op")) == (comm.device,)


def test_a_repeated_call_replays_a_graph_of_exactly_the_eager_schedule(monkeypatch):
    recorder, comm, plan, a, b, blocks = _replaying(monkeypatch)
    comm.run(Call("op", plan, a, b, replay=True))  # first call: eager
    eager = list(recorder.trace)
    assert eager and ("replay",) not in eager
    recorder.trace.clear()
    comm.run(Call("op", plan, a, b, replay=True))  # second: captured (the same schedule), then replayed
    replayed = list(recorder.trace)
    recorder.trace.clear()
    comm.issue(Call("op", plan, a, b), a, blocks[(plan.block_rows, plan.n)], captured=True)  # as captured
    assert replayed == recorder.trace + [("replay",)]
    # ... where every signal is a copy of the word that holds 1 (the caller's stream's forked onto S), none a write
    signals = sum(isinstance(item, steps.Signal) for item in rs.schedule(plan, 0))
    one = comm._one.data_ptr()
    assert sum(step[1] == "write" and step[3] == 1 for step in eager) == signals
    assert sum(step[1] == "copy" and step[3] == one for step in replayed[:-1]) == signals
    assert not any(step[1] == "write" and step[3] == 1 for step in replayed[:-1])
    recorder.trace.clear()
    comm.run(Call("op", plan, a, b, replay=True))  # third: the graph alone, no driver call
    assert recorder.trace == [("replay",)]


@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce", "all_gather"])
def test_the_replay_lane_replays_the_graph_run_captured_and_nothing_else(monkeypatch, op):
    """``replayer``: built from a replayed call, it allocates the call's outputs as ``run`` does and replays the
    graph ``run`` captured for them (the same signature), returning the same tensors; where the allocator hands
    other buffers, it finds no graph and returns None, having launched nothing. No lane for a hook, a call that
    does not replay, or an all-gather's shard that ``run`` would copy."""
    recorder, comm, plan, a, b, blocks = _replaying(monkeypatch, op)
    for _ in range(2):  # eager, then captured
        comm.run(Call("op", plan, a, b, replay=True))
    lane = comm.replayer(Call("op", plan, a, b, replay=True))
    recorder.trace.clear()
    replays = comm.graphs.replays
    got, extra = lane()
    assert recorder.trace == [("replay",)] and comm.graphs.replays == replays + 1
    assert got is blocks[(plan.block_rows if op == "reduce_scatter" else plan.m, plan.n)] and extra is None
    moved = {shape: torch.empty_like(block) for shape, block in blocks.items()}
    monkeypatch.setattr(comm, "_new", lambda shape, dtype: moved[tuple(shape)])
    recorder.trace.clear()
    assert lane() is None and recorder.trace == [] and comm.graphs.replays == replays + 1
    assert comm.replayer(Call("op", plan, a, b, replay=False)) is None
    assert comm.replayer(Call("op", plan, a, b, hook=lambda: None, replay=True)) is None
    if op == "all_gather":
        strided = torch.empty(a.shape[1], a.shape[0], dtype=a.dtype).t()
        assert comm.replayer(Call("op", plan, strided, b, replay=True)) is None


def test_in_a_users_capture_copy_streams_signal_by_copy_and_eager_calls_by_stream_write(monkeypatch):
    recorder, comm, plan, a, b, _ = _replaying(monkeypatch)
    kinds = []
    for inside in (False, True):
        monkeypatch.setattr(p2p.guards, "capturing", lambda operand=None, inside=inside: inside)
        recorder.trace.clear()
        comm.run(Call("op", plan, a, b, replay=False))  # not replayed: eager, or captured into the user's graph
        one = comm._one.data_ptr()  # a copy's source, a write's value: (stream, kind, address, source or value)
        kinds.append({(step[0], step[1]) for step in recorder.trace  # (stream, how)
                      if step[1] == "copy" and step[3] == one or step[1] == "write" and step[3] == 1})
    # reduce-scatter signals on C and X; in a capture, C's signals go to the signal stream S (3)
    assert kinds == [{(0, "write"), (1, "write")}, {(3, "copy"), (1, "copy")}]


def test_release_forgets_every_plan_made_ready_every_program_and_every_graph(monkeypatch):
    recorder, comm, plan, a, b, _ = _replaying(monkeypatch, "all_reduce")
    released = []
    comm.workspace.release = lambda: released.append(True)
    for _ in range(3):
        comm.run(Call("op", plan, a, b, replay=True))
    assert comm._ready and comm._programs and len(comm.graphs) == 1
    events = len(comm._events)
    recorder.trace.clear()
    comm.release()
    assert not comm._ready and not comm._programs and len(comm.graphs) == 0 and released == [True]
    freed = [step[2] for step in recorder.trace if step[1] == "free"]
    assert len(freed) == events + 4 and not comm._events and comm._joins is None  # the joins' three, the fork
    recorder.trace.clear()
    comm.run(Call("op", plan, a, b, replay=True))  # made ready again, issued eagerly (no graph survives)
    assert ("replay",) not in recorder.trace and recorder.trace and comm._ready


def test_a_call_on_other_tensors_is_not_replayed_from_a_graph_of_the_first(monkeypatch):
    recorder, comm, plan, a, b, blocks = _replaying(monkeypatch)
    for _ in range(3):
        comm.run(Call("op", plan, a, b, replay=True))
    for other_a, other_b in ((a.clone(), b), (a, b.clone()), (a, b.t().contiguous().t()), (a, b)):
        if other_a is a and other_b is b:  # the same inputs, but the allocator gives the output another block
            shape = (plan.block_rows, plan.n)
            blocks[shape] = torch.empty_like(blocks[shape])
        recorder.trace.clear()
        comm.run(Call("op", plan, other_a, other_b, replay=True))
        assert ("replay",) not in recorder.trace and recorder.trace, "a graph replayed for other tensors"


def test_calls_with_arbitrary_hooks_or_not_to_be_replayed_are_issued_eagerly(monkeypatch):
    recorder, comm, plan, a, b, _ = _replaying(monkeypatch, "all_gather")
    for _ in range(3):
        comm.run(Call("op", plan, a, b, hook=lambda: recorder.trace.append((0, "hook")), replay=True))
    assert ("replay",) not in recorder.trace and recorder.trace.count((0, "hook")) == 3
    recorder.trace.clear()
    for _ in range(3):  # the runtime says no replay (debug mode, a user's capture, switched off)
        comm.run(Call("op", plan, a, b))
    assert ("replay",) not in recorder.trace and recorder.trace


def test_a_call_with_a_debug_deadline_polls_every_flag_wait(monkeypatch):
    recorder, comm, plan, a, b, _ = _replaying(monkeypatch, "all_gather")
    polled = []
    monkeypatch.setattr(comm, "_check_progress", lambda waited, timeout, op: polled.append((len(waited), timeout)))
    monkeypatch.setattr(FakeStream, "record_event", lambda self: None, raising=False)
    comm.run(Call("op", plan, a, b, timeout=5.0))
    waits = sum(isinstance(item, steps.Wait) for item in rs.schedule(plan, 0, gathered_own=False))
    assert polled == [(waits, 5.0)] and waits > 0


@pytest.mark.parametrize("switch", ["allow_bf16_reduced_precision_reduction", "allow_fp16_accumulation"])
def test_a_call_after_a_cublas_switch_changed_is_not_replayed(switch, monkeypatch):
    recorder, comm, plan, a, b, _ = _replaying(monkeypatch)
    for _ in range(3):
        comm.run(Call("op", plan, a, b, replay=True))
    with flipped(switch):
        recorder.trace.clear()
        comm.run(Call("op", plan, a, b, replay=True))  # cuBLAS may pick another kernel now: the old graph must not run
    assert ("replay",) not in recorder.trace and recorder.trace


@contextlib.contextmanager
def flipped(switch):
    """One of cuBLAS's switches flipped, and set back through the same setter whatever happens. (Not
    monkeypatch: the switch is a property of torch's cuBLAS module, not a plain attribute, and pytest >= 9.2
    undoes such a patch with ``delattr``, which raises and leaves the rest of the test's patches in place.)"""
    matmul = torch.backends.cuda.matmul
    before = getattr(matmul, switch)
    setattr(matmul, switch, not before)
    try:
        yield
    finally:
        setattr(matmul, switch, before)


class RecordedMatmul(Matmul):
    def __init__(self, recorder, *tensors):
        super().__init__(*tensors)
        self.recorder = recorder

    def __call__(self):
        self.recorder.trace.append((0, "hook"))


def test_a_weight_gradient_hook_is_held_in_the_graph_and_its_tensors_are_in_the_signature(monkeypatch):
    recorder, comm, plan, a, b, _ = _replaying(monkeypatch, "all_gather")
    x, y, grad = torch.randn(20, 8), torch.randn(8, 24), torch.zeros(20, 24)
    for _ in range(3):
        comm.run(Call("op", plan, a, b, hook=RecordedMatmul(recorder, x, y, grad), replay=True))
    assert recorder.trace.count((0, "hook")) == 2  # the eager call's, and the capture's; the replay holds it
    assert recorder.trace[-1] == ("replay",)
    for other in (RecordedMatmul(recorder, x, y, torch.zeros(20, 24)), RecordedMatmul(recorder, x.clone(), y, grad)):
        recorder.trace.clear()
        comm.run(Call("op", plan, a, b, hook=other, replay=True))
        assert recorder.trace.count((0, "hook")) == 1 and ("replay",) not in recorder.trace


class FakeInstantiatedGraph(FakeGraph):
    """A capture whose instantiated graph torch hands out (``raw_cuda_graph_exec``), as torch >= 2.6 does."""

    def raw_cuda_graph_exec(self):
        return 77

    def replay(self):
        raise AssertionError("an instantiated graph is launched through the driver, not CUDAGraph.replay")


def test_a_replay_launches_the_instantiated_graph_on_the_callers_stream(monkeypatch):
    recorder, comm, plan, a, b, _ = _replaying(monkeypatch)
    comm.graphs = p2p.CallGraphs(torch.device("cuda", 0), capture=lambda issue: FakeInstantiatedGraph(recorder, issue))
    comm.run(Call("op", plan, a, b, replay=True))
    comm.run(Call("op", plan, a, b, replay=True))  # captured, then launched
    recorder.trace.clear()
    comm.run(Call("op", plan, a, b, replay=True))
    assert recorder.trace == [(0, "launch_graph", 77)]
