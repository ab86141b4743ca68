"""The P2P communicator (``comm/tp/p2p.py``) running fp8 calls on the CPU, every rank at once: each rank's
communicator issues its resolved program in a thread of its own against a driver that does what the GPU would, on
real memory (a copy is a ``memmove`` between the ranks' symmetric buffers, a flag wait spins on the word and resets
it, a signal writes it), so that packed rows, their scales, the region offsets, the bias and the reduction of the
pulled partials are all checked on values. The streams of one rank run their work in the order it is issued (one
hardware queue, the case ``ring_schedule``'s deadlock argument covers); the ranks run concurrently.

Against an oracle that shares no code with the executor (``tests/ops/test_scaled.expected``: ``torch._scaled_mm`` or
a dequantised product written out there), every op x tensor/row/block x bf16/fp32 output x with and without bias,
W = 2 and 3, back-to-back calls of one communicator, outputs poisoned with NaN."""

import ctypes
import itertools
import threading
import time

import pytest
import torch

from flashoverlap.comm import scaled
from flashoverlap.comm.protocol import Call
from flashoverlap.comm.tp import p2p
from flashoverlap.comm.tp import ring_schedule as rs
from flashoverlap.plan import TileConfig
from flashoverlap.tune.defaults import default_plan
from tests.ops.test_scaled import expected, quantise

TILE = TileConfig(16, 16, 16, 2, 1, 4)
E4M3 = torch.float8_e4m3fn
BF16_EPS = 2.0**-8  # a bf16 rounding's relative error, with room (2^-9 exactly)


class MemoryDriver:
    """The driver calls the executor makes (``stream_ops.fast``), done at once on host memory."""

    def __init__(self, timeout_s=20.0):
        self.timeout_s = timeout_s
        self._events = itertools.count()

    def wait_reset(self, stream, address):
        word = ctypes.c_int32.from_address(address)
        start = time.monotonic()
        while word.value != 1:
            if time.monotonic() - start > self.timeout_s:
                raise RuntimeError(f"a flag wait at {address:#x} was never satisfied")
            time.sleep(0.0002)
        word.value = 0

    def write(self, stream, address, value):
        ctypes.c_int32.from_address(address).value = value

    def copy(self, stream, dst, src, nbytes):
        ctypes.memmove(dst, src, nbytes)

    def current_stream(self, index):
        return 0

    def new_event(self):
        return next(self._events)

    def free_event(self, event):
        pass

    def record(self, event, stream):  # one queue per rank, run as issued: every event is complete when recorded
        pass

    def wait_event(self, stream, event):
        pass


class SharedWorkspace:
    """Rank ``rank``'s view of every rank's symmetric buffer and flags (plain CPU tensors of one process)."""

    def __init__(self, rank, buffers, flags):
        self.rank, self.buffers, self.flags = rank, buffers, flags
        self.buffer = buffers[rank]
        self.nbytes = self.buffer.numel()
        self.asked = []

    def ensure(self, nbytes, op, ones=(0, 0)):
        self.asked.append(nbytes)
        if nbytes > self.nbytes:
            raise AssertionError(f"the test's workspace ({self.nbytes} bytes) is smaller than asked ({nbytes})")
        return False

    def local(self, shape, dtype):
        return self.buffer.view(dtype).view(shape)

    def peer_ptr(self, rank):
        return self.buffers[rank].data_ptr()

    def flag_ptr(self, rank, slot):
        return self.flags[rank].data_ptr() + 4 * slot


class FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


def communicators(world, nbytes, monkeypatch):
    driver = MemoryDriver()
    monkeypatch.setattr(p2p.stream_ops, "fast", lambda: driver)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    buffers = [torch.full((nbytes,), 0xFF, dtype=torch.uint8) for _ in range(world)]  # fp8 0xFF, fp32 bytes: NaN
    flags = [torch.zeros(rs.FLAG_SLOTS_USED, dtype=torch.int32) for _ in range(world)]
    for f in flags:
        f[rs.FREE_BASE :] = 1
    comms = []
    for rank in range(world):
        comm = object.__new__(p2p.P2PCommunicator)
        comm.rank, comm.world_size, comm.name = rank, world, "test group"
        comm.device = torch.device("cpu")
        comm.copy_stream, comm.local_stream, comm.signal_stream = FakeStream(1), FakeStream(2), FakeStream(3)
        comm._index, comm._handles = 0, (1, 2, 3)
        comm.workspace = SharedWorkspace(rank, buffers, flags)
        comm._events, comm._joins, comm._fork = [], None, None
        comm._programs, comm._ready = {}, set()
        comm._one = torch.ones(1, dtype=torch.int32)
        comm.graphs = p2p.CallGraphs(None)
        # Every output and gathered buffer starts as NaN: a row the call does not write shows.
        comm._new = lambda shape, dtype: torch.full(shape, 0xFF, dtype=torch.uint8) if dtype == torch.uint8 \
            else torch.full(shape, float("nan"), dtype=dtype)
        comms.append(comm)
    return comms, flags


def run_all(comms, calls):
    """Every rank's ``run`` at once, in threads; their results by rank (an exception in any is raised)."""
    results, errors = [None] * len(comms), []

    def one(rank):
        try:
            results[rank] = comms[rank].run(calls[rank])
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            errors.append(error)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    return results


def operands(op, world, m, n, k, mode, out_dtype, with_bias, seed):
    """Per rank: (a, b, Scales). The all-gather's shards and the reductions' inputs differ per rank, and so do
    their scales (tensor-wise shards of different scales: the gathered A is row-wise in effect)."""
    gen = torch.Generator().manual_seed(seed)
    rows = m // world if op == "all_gather" else m
    w = torch.randn(n, k, generator=gen)  # one weight for the all-gather (column-parallel), one per rank else
    per_rank = []
    for rank in range(world):
        a_hp = torch.randn(rows, k, generator=gen) * (1 + rank)
        w_r = w if op == "all_gather" else torch.randn(n, k, generator=gen)
        a, sa = quantise(a_hp, mode)
        b, sb = quantise(w_r.t().contiguous(), mode, operand="b")
        bias = torch.randn(n, generator=gen).to(out_dtype) if with_bias else None
        if op == "all_gather" and rank > 0:  # one b and bias for the column-parallel layer
            b, sb, bias = per_rank[0][1], per_rank[0][2].b, per_rank[0][2].bias
        per_rank.append((a, b, scaled.Scales.of(sa, sb, out_dtype, bias)))
    return per_rank


def check_close(got, want, bound, what):
    assert got.shape == want.shape, what
    assert not torch.isnan(got).any(), f"{what}: rows left unwritten (NaN)"
    err = (got.double() - want).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds its bound by {worst:.3g} (max error {err.max().item():.3g})"


def expect(op, per_rank, rank, world, m, mode, out_dtype):
    """(want, elementwise error bound) for rank ``rank``'s result: the oracle's fp32 product(s) summed in fp64, and
    the rounding a bf16/fp32 output allows (each rank's product rounded once, each of the W - 1 sums once)."""
    eps = BF16_EPS if out_dtype == torch.bfloat16 else 2.0**-20
    if op == "all_gather":
        a_full = torch.cat([a for a, _, _ in per_rank])
        # Each shard multiplies with its own scales: the gathered scales, row by row (tensor-wise: each shard's one
        # scale repeated over its rows, a row-wise A in effect).
        sa = torch.cat([s.rows_of_a(slice(0, a.shape[0]), a.shape[0]) for a, _, s in per_rank])
        b, s0 = per_rank[0][1], per_rank[0][2]
        if mode == "tensor":  # row-wise in effect: the oracle's dequantised product with rows' scales
            want = (a_full.float() * sa) @ (b.float() * s0.b) + (0 if s0.bias is None else s0.bias.float())
        else:
            want = expected(a_full, b, sa, s0.b, mode, out_dtype, s0.bias)
        want = want.double()
        return want, eps * want.abs() + 1e-4
    products = [expected(a, b, s.a, s.b, mode, out_dtype, s.bias).double() for a, b, s in per_rank]
    want = sum(products)
    bound = 2 * world * eps * sum(p.abs() for p in products) + 1e-4
    if op == "reduce_scatter":
        rows = slice(rank * m // world, (rank + 1) * m // world)
        return want[rows], bound[rows]
    return want, bound


CASES = [(op, mode, out_dtype, with_bias)
         for op in ("all_reduce", "reduce_scatter", "all_gather")
         for mode in ("tensor", "row", "block")
         for out_dtype, with_bias in ((torch.bfloat16, True), (torch.float32, False))]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op,mode,out_dtype,with_bias", CASES)
def test_fp8_calls_on_every_rank_match_scaled_mm_and_the_collective(op, mode, out_dtype, with_bias, world,
                                                                    monkeypatch):
    k, n = (256, 40) if mode == "block" else (48, 40)  # block-wise: K a multiple of 128
    comms, flags = communicators(world, rs.regions(world) * (1 << 17), monkeypatch)
    for i, (m_blocks, sub) in enumerate([(3, 2), (3, 2), (2, 3)]):  # back to back: one repeated, one other plan
        m = 16 * m_blocks * world + (16 * (world - 1) if op == "all_reduce" else 0)
        plan = default_plan(op, m, n, k, world, tile=TILE, num_groups=sub, path="p2p", allow_sequential=False)
        assert not plan.sequential
        per_rank = operands(op, world, m, n, k, mode, out_dtype, with_bias, seed=10 * i + world)
        calls = [Call(op, plan, a, b, return_gathered=op == "all_gather", scales=s) for a, b, s in per_rank]
        results = run_all(comms, calls)
        for rank, (out, extra) in enumerate(results):
            what = f"{op} {mode} {out_dtype} bias={with_bias} W={world} call {i} rank {rank}"
            assert out.dtype == out_dtype, what
            want, bound = expect(op, per_rank, rank, world, m, mode, out_dtype)
            check_close(out, want, bound, what)
            if op == "all_gather":  # the gathered fp8 rows and their scales, in rank order, dense, exact
                a_full, scale_full = extra
                assert a_full.is_contiguous() and scale_full.is_contiguous(), what
                assert torch.equal(a_full.view(torch.uint8), torch.cat([a for a, _, _ in per_rank]).view(torch.uint8))
                assert torch.equal(scale_full, torch.cat([s.rows_of_a(slice(0, a.shape[0]), a.shape[0])
                                                          for a, _, s in per_rank])), what
            else:
                assert extra is None
    # Every flag a call set was reset by its waiter; the free flags are set again for the next call.
    for f in flags:
        assert not f[: rs.FREE_BASE].any() and bool((f[rs.FREE_BASE :] == 1).all())


def test_the_workspace_is_asked_for_packed_rows_and_output_dtype_rows(monkeypatch):
    """``prepare`` sizes each region for the rows the call moves: packed fp8 rows (bytes and scales) for the
    all-gather, rows of the output dtype for the reductions; and the program's copies move rows of that width."""
    world, m, n, k = 2, 2048, 40, 256
    comms, _ = communicators(world, rs.regions(world) * p2p.REGION_ALIGN, monkeypatch)
    comm = comms[0]
    for op, mode, out_dtype in (("all_gather", "block", torch.bfloat16), ("all_gather", "row", torch.float32),
                                ("all_gather", "tensor", torch.bfloat16), ("all_reduce", "row", torch.float32),
                                ("reduce_scatter", "tensor", torch.bfloat16)):
        plan = default_plan(op, m, n, k, world, tile=TILE, num_groups=2, path="p2p", allow_sequential=False)
        sa, sb = ((torch.ones(m, k // 128), torch.ones(k // 128, 1)) if mode == "block" else
                  (torch.ones(m, 1), torch.ones(1, n)) if mode == "row" else (torch.tensor(1.0), torch.tensor(1.0)))
        scales = scaled.Scales.of(sa, sb, out_dtype)
        width = scaled.row_bytes(k, E4M3, scales) if op == "all_gather" else n * out_dtype.itemsize
        need = rs.region_rows(plan) * width
        comm.workspace.buffer = torch.zeros(rs.regions(world) * p2p.REGION_ALIGN, dtype=torch.uint8)
        comm.workspace.nbytes = comm.workspace.buffer.numel()
        assert need > comm._region_bytes()
        asked = []

        def grow(nbytes, op, ones, workspace=comm.workspace, asked=asked):  # the collective growth, on one rank
            asked.append(nbytes)
            workspace.buffer, workspace.nbytes = torch.zeros(nbytes, dtype=torch.uint8), nbytes
            return True

        monkeypatch.setattr(comm.workspace, "ensure", grow)
        comm.prepare(plan, E4M3, op, scales)
        assert asked == [rs.regions(world) * (need + p2p.REGION_ALIGN)], (op, mode)
        program = comm._program(plan, E4M3, op == "all_gather", False, scales)[0]
        sizes = {step[-1] for step in program if step[0] == p2p._COPY}
        assert sizes and all(size % width == 0 for size in sizes), (op, mode, sizes, width)


def _recording(monkeypatch, op):
    """A rank-0 communicator whose driver calls and scaled bands are recorded and whose captures are
    ``test_p2p_executor.FakeGraph``s; an fp8 call's operands and the allocator's blocks."""
    from tests.comm.test_p2p_executor import FakeGraph, Recorder, _communicator

    recorder = Recorder()
    comm = _communicator(0, 2, recorder, monkeypatch)
    comm.graphs = p2p.CallGraphs(None, capture=lambda issue: FakeGraph(recorder, issue))
    monkeypatch.setattr(comm, "prepare", lambda *args: None)
    monkeypatch.setattr(comm, "_load_kernels", lambda *args: None)
    monkeypatch.setattr(p2p, "_scaled_band", lambda target, src, scale_a, b, scales, accumulate: recorder.trace.append(
        (0, "scaled", src.data_ptr(), None if scale_a is None else scale_a.data_ptr(), target.data_ptr(),
         accumulate)))
    m, n, k = 128, 32, 256
    plan = default_plan(op, m, n, k, 2, tile=TILE, num_groups=2, path="p2p", allow_sequential=False)
    a = torch.zeros(plan.block_rows if op == "all_gather" else m, k).to(E4M3)
    b = torch.zeros(n, k).to(E4M3).t()
    scales = scaled.Scales.of(torch.ones(a.shape[0], 1), torch.ones(1, n))
    blocks = {}
    monkeypatch.setattr(comm, "_new", lambda shape, dtype: blocks.setdefault((tuple(shape), dtype),
                                                                             torch.empty(shape, dtype=dtype)))
    return recorder, comm, plan, a, b, scales


@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce", "all_gather"])
def test_a_repeated_fp8_call_replays_and_other_scales_do_not(op, monkeypatch):
    recorder, comm, plan, a, b, scales = _recording(monkeypatch, op)
    comm.run(Call(op, plan, a, b, replay=True, scales=scales))  # eager
    eager = [step for step in recorder.trace if step[1] == "scaled"]
    bands = sum(isinstance(item, p2p.steps.Mm) for item in rs.schedule(plan, 0))
    assert len(eager) == bands and all(step[3] is not None for step in eager)  # row-wise: every band its scales
    comm.run(Call(op, plan, a, b, replay=True, scales=scales))  # captured, then replayed
    recorder.trace.clear()
    comm.run(Call(op, plan, a, b, replay=True, scales=scales))
    assert recorder.trace == [("replay",)]
    n = plan.n
    others = [scaled.Scales.of(scales.a.clone(), scales.b),  # the scales elsewhere
              scaled.Scales.of(scales.a, scales.b.clone()),
              scaled.Scales.of(scales.a, scales.b, torch.float32),  # another output dtype
              scaled.Scales.of(scales.a, scales.b, bias=torch.zeros(n, dtype=torch.bfloat16)),  # a bias
              scaled.Scales.of(torch.tensor(1.0), torch.tensor(1.0))]  # another mode
    for other in others:
        recorder.trace.clear()
        comm.run(Call(op, plan, a, b, replay=True, scales=other))
        assert ("replay",) not in recorder.trace and recorder.trace, other
    recorder.trace.clear()
    comm.run(Call(op, plan, a, b, replay=True))  # the same tensors as a call without scales: not the fp8 graph
    assert ("replay",) not in recorder.trace


@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce", "all_gather"])
def test_an_fp8_calls_replay_lane_replays_its_graph_and_returns_what_run_returns(op, monkeypatch):
    """``replayer`` on an fp8 call (all-gather: its gathered input returned too, as rows and scales copied out of
    the packed rows after the replay): the graph ``run`` captured, and ``run``'s tensors."""
    recorder, comm, plan, a, b, scales = _recording(monkeypatch, op)
    gathered = op == "all_gather"
    call = Call(op, plan, a, b, gathered, replay=True, scales=scales)
    for _ in range(2):  # eager, then captured
        comm.run(call)
    recorder.trace.clear()
    want = comm.run(call)
    assert recorder.trace == [("replay",)]
    lane = comm.replayer(call)
    recorder.trace.clear()
    got = lane()
    assert recorder.trace == [("replay",)]
    assert got[0] is want[0]
    if gathered:  # the dense rows and scales: the allocator's blocks, the values copied out of the packed rows
        assert got[1][0] is want[1][0] and got[1][1] is want[1][1]
        assert got[1][0].dtype == a.dtype and got[1][1].shape == (plan.m, 1)
    else:
        assert got[1] is None


def test_an_fp8_all_gather_multiplies_each_band_with_its_own_rows_scales(monkeypatch):
    """The bands of the gathered buffer are multiplied with the scales that arrived in the same packed rows."""
    recorder, comm, plan, a, b, scales = _recording(monkeypatch, "all_gather")
    comm.run(Call("all_gather", plan, a, b, scales=scales))
    for _, _, src, scale, _, _ in (step for step in recorder.trace if step[1] == "scaled"):
        assert scale - src == scaled._aligned(plan.k)  # the scales of the rows read, in the same packed row


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_band_written_through_scaled_mms_out_is_what_scaled_mm_returns(mode, bias, monkeypatch):
    """``scaled.scaled_mm(out=)``'s cuBLAS branch (``_scaled_mm(out=)``, what the executor's bands use), forced
    on the CPU, where torch runs tensor- and row-wise ``_scaled_mm``: the band lands in a row block of a larger
    output, bias and all."""
    gen = torch.Generator().manual_seed(3)
    a, sa = quantise(torch.randn(48, 64, generator=gen), mode)
    b, sb = quantise(torch.randn(32, 64, generator=gen).t().contiguous(), mode, operand="b")
    b = b.t().contiguous().t()  # column-major, as cuBLAS wants it
    scales = scaled.Scales.of(sa, sb, torch.bfloat16, torch.randn(32, generator=gen).to(torch.bfloat16) if bias
                              else None)
    want = torch._scaled_mm(a, b, sa, sb, bias=scales.bias, out_dtype=torch.bfloat16)
    out = torch.full((64, 32), float("nan"), dtype=torch.bfloat16)
    monkeypatch.setattr(scaled, "cublas_takes", lambda *args: True)
    got = scaled.scaled_mm(a, b, scales, out=out[8:56])
    assert got.data_ptr() == out[8:56].data_ptr() and torch.equal(out[8:56], want)
    assert out[:8].isnan().all() and out[56:].isnan().all()
    if mode == "row":  # a band's own rows of scales
        out.fill_(float("nan"))
        scaled.scaled_mm(a[16:32], b, scales, sa[16:32], out=out[:16])
        assert torch.equal(out[:16], want[16:32])
