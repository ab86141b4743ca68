"""The P2P executor's batched program (``comm/tp/p2p.py``, ``_batched``): where the driver batches stream memory
operations (``cuStreamBatchMemOp``) and copies (``cuMemcpyBatchAsync``), a call issues the same work in fewer driver
calls. Checked three ways on the CPU:

- against the schedule, through a recording driver that expands each batch into the operations it holds: the same
  operations, each stream's in the same order (a sub-band's pulls from the peers only after its flag waits, never
  before), every other stream's work in the same order relative to them, and a join left out only where the
  caller's stream already waits for that stream's last work;
- on values, every rank at once in threads on real memory (``test_p2p_fp8_executor``'s driver, given the batched
  calls): bf16 and fp8 row-wise results, W = 2 to 8, back-to-back calls, every flag reset;
- the ctypes plumbing of the new driver entry points (the bytes of a batch, both ABIs of cuMemcpyBatchAsync)."""

import ctypes
import struct

import pytest
import torch

from flashoverlap.comm import stream_ops
from flashoverlap.comm.protocol import Call
from flashoverlap.comm.tp import p2p
from flashoverlap.comm.tp import ring_schedule as rs
from flashoverlap.tune.defaults import default_plan
from tests.comm import test_p2p_executor as unbatched
from tests.comm import test_p2p_fp8_executor as memory

TILE = unbatched.TILE


class BatchRecorder(unbatched.Recorder):
    """``test_p2p_executor.Recorder`` that also batches: each batch is recorded as the operations it holds, in its
    order (a wait for >= 1 then its reset, a write, a copy), and counted once in ``calls``."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.batches = []

    def memops(self, stream, batch):
        self.batches.append(("memops", stream, batch.count))
        for kind, address, value in stream_ops.unpack_memops(batch, batch.count):
            self.trace.append((stream, kind, address, value))

    def copies(self, stream, batch):
        self.batches.append(("copies", stream, batch.count))
        for dst, src, nbytes in zip(batch.dsts, batch.srcs, batch.sizes):
            self.copy(stream, dst, src, nbytes)


class Counting:
    """A driver's calls counted (every method the executor calls on it, a batch once)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("current_stream", "new_event"):
            return attr

        def counted(*args):
            self.calls += 1
            return attr(*args)

        return counted


def _issue(recorder, op, world, rank, captured, monkeypatch, num_groups=2):
    comm = unbatched._communicator(rank, world, recorder, monkeypatch)
    m = 64 * world + (16 if op == "all_reduce" else 0)
    plan = default_plan(op, m, 24, 20, world, tile=TILE, num_groups=num_groups, path="p2p", allow_sequential=False)
    rows = plan.block_rows if op == "all_gather" else plan.m
    a = torch.randn(rows, plan.k, dtype=torch.bfloat16)
    b = torch.randn(plan.k, plan.n, dtype=torch.bfloat16)
    out = torch.empty(plan.block_rows if op == "reduce_scatter" else plan.m, plan.n, dtype=torch.bfloat16)
    gathered = torch.empty(plan.m, plan.k, dtype=torch.bfloat16) if op == "all_gather" else None
    trace = getattr(recorder, "inner", recorder).trace
    comm.issue(Call(op, plan, a, b, hook=lambda: trace.append((0, "hook"))), a, out, gathered, captured=captured)
    return comm, plan, (a, b, out, gathered)


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce", "all_gather"])
@pytest.mark.parametrize("world,rank", [(2, 1), (3, 2), (4, 1), (8, 5)])
def test_a_batched_call_issues_the_schedules_work_in_fewer_driver_calls(op, world, rank, captured, monkeypatch):
    plain = unbatched.Recorder()
    plain_calls = Counting(plain)
    comm, plan, (a, b, out, gathered) = _issue(plain_calls, op, world, rank, captured, monkeypatch)
    bases = {"a": a.data_ptr(), "out": out.data_ptr(), "gathered": 0 if gathered is None else gathered.data_ptr()}
    width = plan.k if op == "all_gather" else plan.n
    want = unbatched._expected(plan, rank, comm, bases, width * 2, gathered_own=True, captured=captured)
    assert plain.trace == want
    want = list(want)
    batching = BatchRecorder()
    batching.trace = plain.trace  # where the recorded matmuls go too
    plain.trace.clear()
    batching_calls = Counting(batching)
    monkeypatch.setattr(p2p.stream_ops, "fast", lambda: batching_calls)
    comm.issue(Call(op, plan, a, b, hook=lambda: batching.trace.append((0, "hook"))), a, out, gathered,
               captured=captured)
    got = batching.trace
    joins, fork = set(comm._joins[1:]), comm._fork

    def plain_steps(trace):  # without the joins and the forks onto S (checked apart)
        return [step for step in trace if not (step[1] in ("record", "wait_event") and step[2] in joins | {fork})]

    mine, theirs = plain_steps(got), plain_steps(want)
    assert sorted(map(repr, mine)) == sorted(map(repr, theirs))  # the same operations, each once
    assert len(set(map(repr, theirs))) == len(theirs)

    def is_signal(step):
        return step[1] == "write" and step[3] == 1 or step[1] == "copy" and step[3] == comm._one.data_ptr()

    def kind(step):
        return "signal" if is_signal(step) else step[1]

    def before(trace, step, kinds):  # how many steps of these kinds precede ``step`` on its stream
        own = [s for s in trace if s[0] == step[0]]
        return sum(kind(s) in kinds for s in own[: own.index(step)])

    for step in theirs:  # on its own stream, each step is where the schedule puts it, but for two moves:
        if step[1] in ("mm", "hook"):
            assert before(mine, step, {"mm", "hook"}) == before(theirs, step, {"mm", "hook"})
            continue
        others = {"wait", "write", "copy", "record", "wait_event", "signal"}
        if kind(step) == "copy":  # a pull moves after later flag waits of its stream (the final gather), no more
            assert before(mine, step, others - {"wait", "write"}) == before(theirs, step, others - {"wait", "write"})
            assert before(mine, step, {"wait"}) >= before(theirs, step, {"wait"})
        elif kind(step) == "signal" and step[0] in (1, 2):  # a copy stream's signal moves after its records
            assert before(mine, step, others - {"record"}) == before(theirs, step, others - {"record"})
        else:  # (a record may now precede a signal it followed, and a pull that followed a wait)
            moved = {"copy", "signal"} if kind(step) == "record" else {"copy"}
            assert before(mine, step, others - moved) == before(theirs, step, others - moved), step
            for what in moved:
                assert before(mine, step, {what}) <= before(theirs, step, {what}), step
    # Across streams: no signal is issued after a flag wait that the schedule issues after it (every producer is
    # still issued before its waiter), and the caller's stream waits for the same events after the same work.
    for step in (s for s in theirs if s[1] == "wait"):
        signals = {repr(s) for s in theirs[: theirs.index(step)] if is_signal(s)}
        assert signals <= {repr(s) for s in mine[: mine.index(step)] if is_signal(s)}, step
    for step in (s for s in theirs if s[1] == "wait_event"):
        [record] = [s for s in theirs if s[1] == "record" and s[2] == step[2]]
        assert mine.index(record) < mine.index(step)

    # A join left out only where the caller's stream already waits for that stream's last step.
    for event in joins:
        if (0, "wait_event", event) in got or (0, "wait_event", event) not in want:
            continue
        [source] = [step[0] for step in want if step[1] == "record" and step[2] == event]
        last = max(i for i, step in enumerate(want) if step[0] == source and step[2] not in joins)
        assert want[last][1] == "record" and (0, "wait_event", want[last][2]) in want[last:], (source, want[last])
    # A signal forked onto S is still behind the caller's work it followed: as much of C's work precedes its fork.
    def forked(trace):
        c_work, at_fork, out = 0, None, []
        for step in trace:
            if step[0] == 0 and step[1] == "record" and step[2] == fork:
                at_fork = c_work
            elif step[0] == 0 and not (step[1] in ("record", "wait_event") and step[2] in joins | {fork}):
                c_work += 1
            elif step[0] == 3 and step[1] == "copy":
                out.append((step, at_fork))
        return out

    assert forked(got) == forked(want)
    assert batching_calls.calls <= plain_calls.calls
    if world >= 4 and not captured:
        assert batching_calls.calls < plain_calls.calls


def test_the_all_reduces_final_pulls_of_a_sub_band_are_one_batch_of_waits_and_one_of_copies(monkeypatch):
    world = 8
    recorder = BatchRecorder()
    _issue(recorder, "all_reduce", world, 3, False, monkeypatch, num_groups=2)
    copies = [count for kind, stream, count in recorder.batches if kind == "copies"]
    assert copies == [world - 1] * 2  # one per sub-band
    # The last step's free waits (one per peer) and the signals to every peer are batches too.
    assert max(count for kind, _, count in recorder.batches if kind == "memops") >= 2 * (world - 1)


class BatchMemoryDriver(memory.MemoryDriver):
    """``test_p2p_fp8_executor.MemoryDriver`` with the batched calls, done at once on host memory in order."""

    batched = None  # (memops, copies) calls, for the test to see the batched path was taken

    def memops(self, stream, batch):
        self.batched[0] += 1
        for kind, address, value in stream_ops.unpack_memops(batch, batch.count):
            if kind == "wait":
                word = ctypes.c_int32.from_address(address)
                deadline = memory.time.monotonic() + self.timeout_s
                while word.value < value:
                    if memory.time.monotonic() > deadline:
                        raise RuntimeError(f"a flag wait at {address:#x} was never satisfied")
                    memory.time.sleep(0.0002)
            else:
                self.write(stream, address, value)

    def copies(self, stream, batch):
        self.batched[1] += 1
        for dst, src, nbytes in reversed(list(zip(batch.dsts, batch.srcs, batch.sizes))):  # any order
            ctypes.memmove(dst, src, nbytes)


def _batching_communicators(world, monkeypatch):
    comms, flags = memory.communicators(world, rs.regions(world) * (1 << 17), monkeypatch)
    driver = BatchMemoryDriver(timeout_s=60.0)  # W = 8 threads on 2 loaded cores: a wide bound (a hang still fails)
    driver.batched = [0, 0]
    monkeypatch.setattr(p2p.stream_ops, "fast", lambda: driver)
    return comms, flags, driver


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_batched_bf16_calls_on_every_rank_match_the_collective(op, world, monkeypatch):
    comms, flags, driver = _batching_communicators(world, monkeypatch)
    n, k = 24, 32
    for i, sub in enumerate([2, 2, 1]):  # back to back: one repeated, one other plan
        m = 16 * 2 * world + (16 * (world - 1) if op == "all_reduce" else 0)
        plan = default_plan(op, m, n, k, world, tile=TILE, num_groups=sub, path="p2p", allow_sequential=False)
        gen = torch.Generator().manual_seed(100 * world + i)
        rows = plan.block_rows if op == "all_gather" else m
        inputs = [torch.randn(rows, k, generator=gen).to(torch.float32) for _ in range(world)]
        b_all = [torch.randn(k, n, generator=gen) for _ in range(world)]
        if op == "all_gather":
            b_all = [b_all[0]] * world
        calls = [Call(op, plan, inputs[r], b_all[r], return_gathered=op == "all_gather") for r in range(world)]
        results = memory.run_all(comms, calls)
        if op == "all_gather":
            full = torch.cat(inputs)
            want = [full @ b_all[0]] * world
        else:
            total = sum(x.double() @ y.double() for x, y in zip(inputs, b_all)).float()
            want = [total[r * plan.block_rows : (r + 1) * plan.block_rows] if op == "reduce_scatter" else total
                    for r in range(world)]
        for rank, (got, extra) in enumerate(results):
            assert not torch.isnan(got).any(), f"{op} W={world} call {i} rank {rank}: rows left unwritten"
            torch.testing.assert_close(got, want[rank], rtol=1e-4, atol=1e-4)
            if op == "all_gather":
                assert torch.equal(extra, torch.cat(inputs))
    merged = world >= 3  # flag operations that follow one another on a stream
    assert (driver.batched[0] > 0) == merged and (driver.batched[1] > 0) == (op == "all_reduce" and world > 2)
    for f in flags:
        assert not f[: rs.FREE_BASE].any() and bool((f[rs.FREE_BASE :] == 1).all())


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_batched_fp8_row_wise_calls_on_every_rank_match_scaled_mm_and_the_collective(op, world, monkeypatch):
    comms, flags, driver = _batching_communicators(world, monkeypatch)
    n, k, mode, out_dtype = 40, 48, "row", torch.bfloat16
    for i, sub in enumerate([2, 1]):
        m = 16 * 2 * world + (16 * (world - 1) if op == "all_reduce" else 0)
        plan = default_plan(op, m, n, k, world, tile=TILE, num_groups=sub, path="p2p", allow_sequential=False)
        per_rank = memory.operands(op, world, m, n, k, mode, out_dtype, True, seed=7 * i + world)
        calls = [Call(op, plan, a, b, return_gathered=op == "all_gather", scales=s) for a, b, s in per_rank]
        results = memory.run_all(comms, calls)
        for rank, (out, _) in enumerate(results):
            want, bound = memory.expect(op, per_rank, rank, world, m, mode, out_dtype)
            memory.check_close(out, want, bound, f"{op} W={world} call {i} rank {rank}")
    assert (driver.batched[0] > 0) == (world >= 4)
    for f in flags:
        assert not f[: rs.FREE_BASE].any() and bool((f[rs.FREE_BASE :] == 1).all())


def test_a_debug_deadline_takes_the_unbatched_program_so_each_wait_is_polled(monkeypatch):
    recorder = BatchRecorder()
    comm = unbatched._communicator(0, 4, recorder, monkeypatch)
    plan = default_plan("all_reduce", 64 * 4 + 16, 24, 20, 4, tile=TILE, num_groups=1, path="p2p",
                        allow_sequential=False)
    monkeypatch.setattr(comm, "_check_progress", lambda waited, timeout, op: recorder.trace.append(len(waited)))
    monkeypatch.setattr(unbatched.FakeStream, "record_event", lambda self: None, raising=False)
    a = torch.randn(plan.m, plan.k, dtype=torch.bfloat16)
    out = torch.empty(plan.m, plan.n, dtype=torch.bfloat16)
    comm.issue(Call("all_reduce", plan, a, a.new_zeros(plan.k, plan.n)), a, out, timeout=5.0)
    waits = sum(isinstance(item, p2p.steps.Wait) for item in rs.schedule(plan, 0))
    assert not recorder.batches and recorder.trace[-1] == waits


# --- the driver entry points, through ctypes, without a GPU ---


def test_packed_memops_are_waits_with_their_resets_and_fenced_writes_in_order():
    batch = stream_ops.pack_memops([("wait", 0x1000), ("write", 0x2000, 1), ("wait", 0x3000)])
    assert batch.count == 5
    raw = bytes(batch)
    ops = [struct.unpack_from("<IIQQII", raw, 48 * i) for i in range(5)]  # operation, pad, address, value, flags
    assert [(op[0], op[2], op[3], op[4]) for op in ops] == [(1, 0x1000, 1, 0), (2, 0x1000, 0, 0), (2, 0x2000, 1, 0),
                                                            (1, 0x3000, 1, 0), (2, 0x3000, 0, 0)]
    with pytest.raises(ValueError):
        stream_ops.pack_memops([])
    with pytest.raises(ValueError):
        stream_ops.pack_memops([("wait", 1)] * stream_ops.MEMOPS_MAX)


def test_memops_is_one_batch_call_and_a_failure_raises():
    calls = []
    driver = object.__new__(stream_ops.FastDriver)
    driver._batch = lambda stream, count, params, flags: calls.append((stream, count, bytes(params), flags)) or 0
    batch = stream_ops.pack_memops([("write", 0x40, 1), ("write", 0x80, 1)])
    driver.memops(7, batch)
    assert calls == [(7, 2, bytes(batch), 0)]
    driver._batch = lambda *args: 1
    with pytest.raises(RuntimeError, match="cuStreamBatchMemOp"):
        driver.memops(7, batch)


class FakeLib:
    """A libcuda with cuDriverGetVersion and cuGetProcAddress_v2 handing out a recording cuMemcpyBatchAsync."""

    def __init__(self, version, fails):
        self.version, self.calls, self.asked = version, [], []
        sizes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *sizes, *([ctypes.c_void_p] if fails else []), ctypes.c_void_p)

        def batch(dsts, srcs, sizes_, count, attrs, first, num_attrs, *rest):
            u64 = ctypes.POINTER(ctypes.c_uint64)
            self.calls.append(([ctypes.cast(dsts, u64)[i] for i in range(count)],
                               [ctypes.cast(srcs, u64)[i] for i in range(count)],
                               [ctypes.cast(sizes_, u64)[i] for i in range(count)],
                               ctypes.string_at(attrs, 24), ctypes.cast(first, u64)[0], num_attrs, rest[-1]))
            return 0

        self.batch = proto(batch)

        def get_version(ref):  # plain functions: the code under test sets their ctypes argtypes
            ref._obj.value = self.version
            return 0

        def get_proc_address(symbol, ref, version, flags, found):
            self.asked.append((symbol, version))
            ref._obj.value = ctypes.cast(self.batch, ctypes.c_void_p).value
            found._obj.value = 0
            return 0

        self.cuDriverGetVersion, self.cuGetProcAddress_v2 = get_version, get_proc_address


@pytest.mark.parametrize("version,fails", [(13020, False), (12080, True)])
def test_batched_copies_call_cuMemcpyBatchAsync_with_the_drivers_own_abi(version, fails):  # noqa: N802
    lib = FakeLib(version, fails)
    driver = object.__new__(stream_ops.FastDriver)
    driver._copy_batch, driver._copy_batch_fails = driver._batch_copy_entry(lib)
    assert lib.asked == [(b"cuMemcpyBatchAsync", 13000 if version >= 13000 else 12080)]
    assert driver._copy_batch_fails == fails
    batch = stream_ops.CopyBatch(3)
    for i in range(3):
        batch.dsts[i], batch.srcs[i], batch.sizes[i] = 0x1000 * (i + 1), 0x9000 + i, 64 * (i + 1)
    driver._copies(0x55, batch)
    [(dsts, srcs, sizes, attrs, first, num_attrs, stream)] = lib.calls
    assert (dsts, srcs, sizes) == ([0x1000, 0x2000, 0x3000], [0x9000, 0x9001, 0x9002], [64, 128, 192])
    assert struct.unpack("<IiiiiI", attrs) == (1, 0, 0, 0, 0, 0)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, no hints
    assert (first, num_attrs, stream) == (0, 1, 0x55)


def test_no_batched_copies_on_a_driver_older_than_12_8():
    lib = FakeLib(12060, True)
    driver = object.__new__(stream_ops.FastDriver)
    assert driver._batch_copy_entry(lib) == (None, False) and not lib.asked
    assert driver._batch_copy_entry(object()) == (None, False)


def test_a_batch_of_copies_the_driver_refuses_is_issued_copy_by_copy_and_not_batched_again(monkeypatch):
    class Refusing(BatchRecorder):
        def copies(self, stream, batch):
            raise RuntimeError("cuMemcpyBatchAsync failed with CUDA driver error 1")

    recorder = Refusing()
    _, plan, _ = _issue(recorder, "all_reduce", 4, 1, False, monkeypatch)
    pulls = [step for step in recorder.trace if step[0] == 1 and step[1] == "copy"]
    assert len(pulls) == sum(isinstance(item, p2p.steps.Copy) and item.stream == "X" for item in rs.schedule(plan, 1))
    assert recorder.copies is None  # the next call's program takes no batch of copies


# --- on a GPU: the batched driver calls themselves ---


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_batch_of_memops_and_of_copies_does_what_the_single_calls_do():
    driver = stream_ops.fast()
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    flags = torch.tensor([1, 1, 0, 0], dtype=torch.int32, device=device)
    base = flags.data_ptr()
    torch.cuda.synchronize()
    # two waits (each then reset) and two writes, in order, in one call
    driver.memops(stream.cuda_stream, stream_ops.pack_memops([("wait", base), ("wait", base + 4),
                                                              ("write", base + 8, 1), ("write", base + 12, 1)]))
    stream.synchronize()
    assert flags.tolist() == [0, 0, 1, 1]
    if driver.copies is None:
        pytest.skip("this driver has no cuMemcpyBatchAsync (CUDA < 12.8): the executor copies one by one")
    src = torch.arange(3 * 1024, dtype=torch.int32, device=device)
    dst = torch.zeros_like(src)
    batch = stream_ops.CopyBatch(3)
    for i in range(3):  # three disjoint blocks, the last first
        batch.dsts[i], batch.srcs[i] = dst.data_ptr() + 4096 * (2 - i), src.data_ptr() + 4096 * (2 - i)
        batch.sizes[i] = 4096
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # the copies queue behind other work: stream-ordered sources
        src.add_(1)
    driver.copies(stream.cuda_stream, batch)
    stream.synchronize()
    assert torch.equal(dst, torch.arange(1, 3 * 1024 + 1, dtype=torch.int32, device=device))
