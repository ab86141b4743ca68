"""The NCCL communicator's own code (group slices, workspace layout, counters, flags, per-band events) on the CPU,
with the producer asynchronous (``tests/comm/fake_cuda.py``): each rank is a gloo process whose CUDA streams run on
the host and whose "GEMM" is a thread that writes the product tile by tile, bumping the group's counter after
each tile (or, for cuBLAS bands, completing the band's event); the collectives are real (gloo). A collective issued
before its group is complete reads NaN (the product starts NaN-poisoned) and fails the comparison; a counter not
reset is caught by the next call; a wait never satisfied raises."""

import ctypes
import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist

from flashoverlap.testing import spawn
from tests.comm import fake_cuda


def _producer(a, b, plan, product, counters):
    """The signalling GEMM's effect, tile by tile in the plan's order (``Plan.tile_order``, ``tile_rows``,
    ``tile_groups``): the tile's rows and columns written, then its group's counter bumped."""
    from flashoverlap.comm.tp.nccl import compute_bands

    full = torch.empty_like(product)
    compute_bands(a, b, plan, full)  # the whole product in the plan's layout, copied out tile by tile
    _, out_rows, valid = plan.tile_rows()
    steps = []
    for tile, group in zip(plan.tile_order().tolist(), plan.tile_groups().tolist()):
        p, col = divmod(tile, plan.tiles_n)
        rows = slice(int(out_rows[p]), int(out_rows[p]) + int(valid[p]))
        cols = slice(col * plan.tile.block_n, (col + 1) * plan.tile.block_n)

        def step(rows=rows, cols=cols, group=group):
            product[rows, cols] = full[rows, cols]
            counters[group] += 1

        steps.append(step)
    return fake_cuda.Producer(steps, delay_s=0.002)


def _band_producer(a, b, plan, product):
    """cuBLAS bands: each group's rows, then its event."""
    from flashoverlap.comm.tp.nccl import compute_bands

    full = torch.empty_like(product)
    compute_bands(a, b, plan, full)
    events = [fake_cuda.Event() for _ in plan.groups]

    def band(grp, event):
        rows = slice(grp.out_row_start, grp.out_row_end) if plan.blocks > 1 else slice(grp.row_start, grp.row_end)
        product[rows] = full[rows]
        event.done.set()

    return fake_cuda.Producer([lambda g=g, e=e: band(g, e) for g, e in zip(plan.groups, events)]), events


def _ranks(rank, world_size):
    fake_cuda.install(wait_timeout_s=10.0)
    from flashoverlap.comm.collectives import gathered_in_rank_order
    from flashoverlap.comm.protocol import CommGroup
    from flashoverlap.comm.tp.nccl import NcclCommunicator
    from flashoverlap.plan import TileConfig
    from flashoverlap.tune.defaults import default_plan

    tile = TileConfig(16, 16, 16, 2, 1, 4)
    comm = NcclCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    gen = torch.Generator().manual_seed(rank)
    m, n, k = 48 * world_size, 40, 24
    a, b = torch.randn(m, k, generator=gen, dtype=torch.float64), torch.randn(k, n, generator=gen, dtype=torch.float64)
    total = a @ b
    dist.all_reduce(total)
    checked = []
    for _call in range(2):  # twice: the counters must be zero again for the second call
        for op in ("all_reduce", "reduce_scatter"):
            for gemm_kind in ("cublas", "triton"):
                plan = default_plan(op, m, n, k, world_size, tile=tile, num_groups=3, gemm=gemm_kind,
                                    allow_sequential=False)
                comm.prepare(plan, torch.float64)
                product = torch.full((m, n), float("nan"), dtype=torch.float64)
                if gemm_kind == "cublas":
                    producer, ready = _band_producer(a, b, plan, product)
                else:
                    producer, ready = _producer(a, b, plan, product, comm.counters), None
                producer.start()
                if op == "all_reduce":
                    comm.all_reduce(product, plan, ready)
                    torch.testing.assert_close(product, total)
                else:
                    out = torch.full((plan.block_rows, n), float("nan"), dtype=torch.float64)
                    comm.reduce_scatter(out, product, plan, ready)
                    torch.testing.assert_close(out, total[rank * plan.block_rows : (rank + 1) * plan.block_rows])
                producer.join()
                assert not comm.counters.any(), "counters not reset for the next call"
                checked.append((op, gemm_kind))
    for groups in (3, 2):  # 3: bands of equal rows (one strided copy of the own shard); 2: 32 and 16 rows
        plan = default_plan("all_gather", m, n, k, world_size, tile=tile, num_groups=groups, comm_ctas=0,
                            allow_sequential=False)  # NCCL's own CTA count: no capped NCCL group on gloo
        comm.prepare(plan, torch.float64)
        shard = a[: plan.block_rows].contiguous()
        gathered = torch.full((m, k), float("nan"), dtype=torch.float64)
        comm.all_gather(gathered, shard, plan)
        assert comm.flags[: plan.num_groups].tolist() == [1] * plan.num_groups  # every band's flag raised
        full = torch.empty((m, k), dtype=torch.float64)
        dist.all_gather_into_tensor(full, shard)
        torch.testing.assert_close(gathered_in_rank_order(gathered, plan), full)
        comm.finish_all_gather(plan)
        assert not comm.flags.any()
        # The direct NCCL calls' addresses (a GPU's): each group's band, this rank's slot in it, its flag.
        start = gathered.data_ptr()
        for grp, (flag, band, slot, count) in zip(plan.groups, comm._gather_offsets(plan, gathered)):
            view = gathered[grp.out_row_start : grp.out_row_end]
            own = view[rank * grp.rows : (rank + 1) * grp.rows]
            assert (flag, band, slot, count) == (4 * grp.index, view.data_ptr() - start, own.data_ptr() - start,
                                                 own.numel()), grp
        checked.append(("all_gather", groups))
    # The reductions' direct calls by address: each group's band of C (all-reduce), and of the reduce-scatter's
    # workspace with this rank's band of the output.
    for op in ("all_reduce", "reduce_scatter"):
        plan = default_plan(op, m, n, k, world_size, tile=tile, num_groups=3, allow_sequential=False)
        c = torch.empty((m, n), dtype=torch.float64)
        out = torch.empty((plan.block_rows, n), dtype=torch.float64)
        for grp, (offset, count) in zip(plan.groups, comm._band_offsets(plan, c, op == "reduce_scatter")):
            rows = c[grp.out_row_start : grp.out_row_end] if op == "reduce_scatter" else \
                c[grp.row_start : grp.row_end]
            assert (offset, count) == (rows.data_ptr() - c.data_ptr(), rows.numel()), (op, grp)
        for grp, (offset, count) in zip(plan.groups, comm._band_offsets(plan, out, False)):
            rows = out[grp.row_start : grp.row_end]
            assert op == "all_reduce" or (offset, count) == (rows.data_ptr() - out.data_ptr(), rows.numel()), grp
    return len(checked)


@pytest.mark.parametrize("world_size", [2, 3])
def test_nccl_communicator_code_with_an_asynchronous_producer(world_size):
    assert spawn(_ranks, world_size, "gloo") == [10] * world_size


def _captured_waits(rank, world_size):
    """Inside a graph (a capture, faked here) the counter waits are the wait kernel's (``kernels/counters.py``),
    one per group with its tile count, on the communication stream, never a stream memory operation: a graph's
    memory-operation nodes cost the host microseconds per launch each. The kernel is the host's wait here; values and
    counters as eagerly; the collectives through ``torch.distributed`` and through a stand-in for the direct NCCL
    calls (which take the stream's handle, so the call issues them outside any stream context)."""
    fake_cuda.install(wait_timeout_s=10.0)
    from flashoverlap import guards
    from flashoverlap.comm import stream_ops
    from flashoverlap.comm.collectives import all_reduce_now, reduce_scatter_now
    from flashoverlap.comm.protocol import CommGroup
    from flashoverlap.comm.tp import nccl
    from flashoverlap.plan import TileConfig
    from flashoverlap.tune.defaults import default_plan

    kernel_waits = []
    host_wait_reset = stream_ops.wait_reset  # the fake's: the host spins on the memory

    current = []  # the streams of the open ``torch.cuda.stream`` contexts: a kernel launches on the innermost

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream)

        def __exit__(self, *exc):
            current.pop()

    def at(address, count, dtype):  # count elements of dtype at address, as a tensor sharing the memory
        return torch.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(address), dtype=dtype)

    class Direct:  # the direct NCCL calls' surface (comm/nccl_calls.py), by address, through gloo
        def takes(self, dtype):
            return True

        @staticmethod
        def code(dtype):
            return dtype

        def all_reduce_at(self, address, count, dtype, stream):
            all_reduce_now(at(address, count, dtype), dist.group.WORLD)

        def reduce_scatter_at(self, out, band, count, dtype, stream):
            reduce_scatter_now(at(out, count, dtype), at(band, count * world_size, dtype), dist.group.WORLD)

    def wait_kernel(counters, index, value):
        assert current and current[-1] is comm.comm_stream, "the wait kernel launched off the communication stream"
        kernel_waits.append((index, value))
        host_wait_reset(None, counters.data_ptr() + 4 * index, value)

    def memop_in_a_graph(*args):
        raise AssertionError("a stream memory operation captured into a graph")

    nccl.counter_wait_kernel = wait_kernel
    comm = nccl.NcclCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    tile = TileConfig(16, 16, 16, 2, 1, 4)
    gen = torch.Generator().manual_seed(rank)
    m, n, k = 48 * world_size, 40, 24
    a, b = torch.randn(m, k, generator=gen, dtype=torch.float64), torch.randn(k, n, generator=gen, dtype=torch.float64)
    total = a @ b
    dist.all_reduce(total)
    plans = {op: default_plan(op, m, n, k, world_size, tile=tile, num_groups=3, gemm="triton", allow_sequential=False)
             for op in ("all_reduce", "reduce_scatter")}
    for plan in plans.values():  # eagerly first: the NCCL state is made outside any capture
        comm.prepare(plan, torch.float64)
    guards.capturing = lambda *args, **kwargs: True
    torch.cuda.stream = StreamContext
    for (op, plan), direct in itertools.product(plans.items(), (None, Direct())):
        comm.prepare(plan, torch.float64)
        comm._direct[plan.comm_ctas] = direct
        product = torch.full((m, n), float("nan"), dtype=torch.float64)
        producer = _producer(a, b, plan, product, comm.counters)
        producer.start()
        kernel_waits.clear()
        stream_ops.wait_reset = memop_in_a_graph
        try:
            if op == "all_reduce":
                comm.all_reduce(product, plan)
                torch.testing.assert_close(product, total)
            else:
                out = torch.full((plan.block_rows, n), float("nan"), dtype=torch.float64)
                comm.reduce_scatter(out, product, plan)
                torch.testing.assert_close(out, total[rank * plan.block_rows : (rank + 1) * plan.block_rows])
        finally:
            stream_ops.wait_reset = host_wait_reset
        producer.join()
        assert kernel_waits == [(g.index, g.tile_count) for g in plan.groups], (op, kernel_waits)
        assert not comm.counters.any(), "counters not reset for the next call"
    return 4


def test_a_captured_call_waits_on_counters_with_the_wait_kernel():
    assert spawn(_captured_waits, 2, "gloo") == [4, 4]


def _wait_kernel_loads(rank, world_size):
    """The graphs' counter-wait kernel is loaded once, eagerly, by the first call of a plan whose signalling GEMM bumps
    counters (``prepare``), never by an all-gather's or a cuBLAS-band plan's, and not inside a capture (where the
    next eager call loads it). The device is a GPU's as the rule reads it; the warm-up ran on the CPU first."""
    fake_cuda.install(wait_timeout_s=10.0)
    from flashoverlap import guards
    from flashoverlap.comm.protocol import CommGroup
    from flashoverlap.comm.tp import nccl
    from flashoverlap.plan import TileConfig
    from flashoverlap.tune.defaults import default_plan

    loads = []
    nccl.load_wait_kernel = loads.append
    comm = nccl.NcclCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    tile = TileConfig(16, 16, 16, 2, 1, 4)
    m, n, k = 48 * world_size, 40, 24

    def plan(op, gemm):
        return default_plan(op, m, n, k, world_size, tile=tile, num_groups=3, gemm=gemm, allow_sequential=False,
                            **({"comm_ctas": 0} if op == "all_gather" else {}))

    plans = {name: plan(*name) for name in (("all_gather", "triton"), ("reduce_scatter", "cublas"),
                                             ("reduce_scatter", "triton"), ("all_reduce", "triton"))}
    for p in plans.values():  # the collectives' warm-up, on the CPU
        comm.prepare(p, torch.float64)
    assert loads == [], "loaded on a CPU device"
    comm.device = torch.device("cuda", 0)
    seen = []
    for name in (("all_gather", "triton"), ("reduce_scatter", "cublas")):
        comm.prepare(plans[name], torch.float64)
    seen.append(len(loads))  # 0: neither launches the wait kernel
    capturing = guards.capturing
    guards.capturing = lambda *args, **kwargs: True
    comm.prepare(plans[("reduce_scatter", "triton")], torch.float64)
    seen.append(len(loads))  # 0: inside a capture
    guards.capturing = capturing
    for name in (("reduce_scatter", "triton"), ("all_reduce", "triton"), ("reduce_scatter", "triton")):
        comm.prepare(plans[name], torch.float64)
    seen.append(len(loads))  # 1: once, by the first eager call that needs it
    return seen, loads == [torch.device("cuda", 0)]


def test_the_graphs_wait_kernel_is_loaded_once_eagerly_by_the_first_plan_that_uses_it():
    assert spawn(_wait_kernel_loads, 1, "gloo") == [([0, 0, 1], True)]


def _signatures(rank, world_size):
    """The NCCL communicator's replay signature (``_buffers``, ``_signature``) on the CPU: what a captured call
    depends on besides values. Every tensor the call reads or writes moves the signature when it moves, and a call
    repeated on the same tensors and buffers has the same one (on a GPU the caching allocator hands a repeated call
    the buffers its previous call freed: tests/gpu/test_gpu_nccl_replay.py)."""
    fake_cuda.install(wait_timeout_s=5.0)
    from flashoverlap.comm.protocol import Call, CommGroup
    from flashoverlap.comm.scaled import Scales
    from flashoverlap.comm.tp.nccl import NcclCommunicator
    from flashoverlap.tune.defaults import default_plan

    comm = NcclCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    m, n, k = 32 * world_size, 24, 16
    checked = 0
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        rows = m // world_size if op == "all_gather" else m
        plan = default_plan(op, m, n, k, world_size, num_groups=2, gemm="cublas", allow_sequential=False)
        a, b = torch.randn(rows, k), torch.randn(n, k).t()
        for gathered in ((False, True) if op == "all_gather" else (False,)):
            call = Call(op, plan, a, b, gathered)
            first = comm._buffers(call)
            kept = comm._signature(call, first)
            assert comm._signature(Call(op, plan, a, b, gathered), first) == kept, (op, gathered)  # same tensors
            moved = [Call(op, plan, a.clone(), b, gathered), Call(op, plan, a, b.contiguous(), gathered),
                     Call(op, plan, a, b.clone(), gathered)]
            for other in moved:  # another a, b laid out otherwise, another b
                assert comm._signature(other, first) != kept, (op, gathered)
            held = comm._buffers(call)  # the first call's buffers still alive: the new ones lie elsewhere
            assert comm._signature(call, held) != kept, (op, gathered)
            # The returned tensors only (all-gather: its gathered input too where it is returned); the workspace is
            # allocated as the issued work's first step, so a captured graph holds its own (all-reduce: the product
            # is the result).
            assert sum(x is not None for x in first.addresses()) == (2 if gathered else 1), (op, first.addresses())
            addresses = first.addresses()
            comm._workspace(call, first)
            assert first.addresses() == addresses, op
            workspace = {"all_reduce": first.product is first.result,
                         "reduce_scatter": first.product is not None and first.product.shape == (m, n),
                         "all_gather": first.gathered is not None and first.gathered.shape == (m, k)}
            assert workspace[op], (op, gathered)
            checked += 1
    # fp8: where the scales lie is part of it.
    plan = default_plan("all_reduce", m, n, k, world_size, num_groups=2, gemm="cublas", allow_sequential=False)
    a8, b8 = torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.zeros(k, n, dtype=torch.float8_e4m3fn)
    sa, sb = torch.ones(m, 1), torch.ones(1, n)
    call = Call("all_reduce", plan, a8, b8, scales=Scales.of(sa, sb))
    buffers = comm._buffers(call)
    kept = comm._signature(call, buffers)
    assert comm._signature(Call("all_reduce", plan, a8, b8, scales=Scales.of(sa.clone(), sb)), buffers) != kept
    assert comm._signature(Call("all_reduce", plan, a8, b8, scales=Scales.of(sa, sb, torch.float32)), buffers) != kept
    return checked + 1


def test_the_replay_signature_names_every_tensor_a_call_touches():
    assert spawn(_signatures, 2, "gloo") == [5, 5]


def _lanes(rank, world_size):
    """``NcclCommunicator.replayer`` against ``run``: built from a replayed call, its function allocates the call's
    returned tensors as ``run`` does and looks the graph up under ``run``'s signature, returning those tensors; with
    the allocator's blocks elsewhere it finds none and returns None. (The allocator is a stand-in that hands a shape
    its block, as CUDA's caching allocator hands a repeated call its previous call's.)"""
    import types

    fake_cuda.install(wait_timeout_s=5.0)
    from flashoverlap.comm import replay
    from flashoverlap.comm.protocol import Call, CommGroup
    from flashoverlap.comm.scaled import Scales
    from flashoverlap.comm.tp import nccl
    from flashoverlap.tune.defaults import default_plan

    seen = []

    class Graphs(replay.CallGraphs):
        def replay(self, signature):
            seen.append(signature)
            return super().replay(signature)

    pool = {}

    def pooled(shapes, device):  # replay.allocate, with a caching allocator's reuse: a shape's block every call
        return [pool.setdefault((tuple(shape), dtype), torch.empty(shape, dtype=dtype, device=device))
                for shape, dtype in shapes]

    nccl.allocate = pooled
    comm = nccl.NcclCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    comm.graphs = Graphs(comm.device, capture_after=1, capture=lambda issue: types.SimpleNamespace(replay=lambda: 0))
    m, n, k = 32 * world_size, 24, 16
    checked = 0
    cases = [(op, gathered, None) for op in ("all_reduce", "reduce_scatter", "all_gather")
             for gathered in ((False, True) if op == "all_gather" else (False,))]
    cases.append(("all_gather", True, "row"))
    for op, gathered, fp8 in cases:
        pool.clear()
        rows = m // world_size if op == "all_gather" else m
        plan = default_plan(op, m, n, k, world_size, num_groups=2, gemm="cublas", allow_sequential=False)
        a, b, scales = torch.randn(rows, k), torch.randn(n, k).t(), None
        if fp8:
            a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            scales = Scales.of(torch.ones(rows, 1), torch.ones(1, n))
        call = Call(op, plan, a, b, gathered, replay=True, scales=scales)
        want = comm.run(call)  # captured (a stand-in) and replayed
        assert comm.replayer(Call(op, plan, a, b, gathered, scales=scales)) is None  # not a replayed call
        lane = comm.replayer(call)
        replays = comm.graphs.replays
        got = lane()
        assert seen[-1] == seen[-2] and comm.graphs.replays == replays + 1, (op, gathered, fp8)
        assert got[0] is want[0] and (got[1] is want[1] if not fp8 else got[1][0] is want[1][0]), (op, gathered)
        assert (got[1] is None) == (not gathered)
        pool.clear()  # the blocks elsewhere: no graph for them
        assert lane() is None and comm.graphs.replays == replays + 1
        checked += 1
    hook = replay.Matmul(torch.randn(2, 2), torch.randn(2, 2), torch.empty(2, 2))
    assert comm.replayer(Call("all_reduce", plan, a, b, hook=hook, replay=True)) is None
    nccl.allocate = replay.allocate
    return checked


def test_the_replay_lane_finds_the_graph_run_captured():
    assert spawn(_lanes, 1, "gloo") == [5]


def _fp8_all_gather(rank, world_size):
    """An fp8 all-gather through the NCCL communicator's ``run`` on the CPU (cuBLAS bands, whose scaled product is the
    dequantised one here): each rank's fp8 rows and their scales, packed straight into its slot of every band where
    the bands are even (``_Gathered.pack_own``) or packed once and placed where they are not, gathered and
    multiplied, against the product of the dequantised gathered A; the returned gathered input (rows and scales)
    against ``all_gather`` of each, and the same product where the call does not return it."""
    fake_cuda.install(wait_timeout_s=10.0)
    from flashoverlap.comm.protocol import Call, CommGroup
    from flashoverlap.comm.scaled import Scales
    from flashoverlap.comm.tp import nccl
    from flashoverlap.comm.tp.nccl import NcclCommunicator
    from flashoverlap.kernels import gemm as gemm_kernel
    from flashoverlap.plan import TileConfig
    from flashoverlap.tune.defaults import default_plan

    comm = NcclCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    nccl.check_leaves_nccl_sms = lambda plan, num_sms, op="": None  # the CPU has no SMs to leave
    gemm_kernel._LAUNCH = lambda grid, args, meta: None  # the signalling GEMM's launch: a stand-in
    shared, gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(10 + rank)
    shard_rows, n, k = 48, 40, 256
    m = shard_rows * world_size
    tile = TileConfig(16, 16, 16, 2, 1, 4)
    b = (torch.randn(n, k, generator=shared) / 4).to(torch.float8_e4m3fn).t()  # one w.t() on every rank
    checked = []
    for mode in ("row", "tensor", "block", "block, column-major"):
        a = (torch.randn(shard_rows, k, generator=gen) * 3).to(torch.float8_e4m3fn)
        columns = k // 128 if mode.startswith("block") else 1
        if mode == "tensor":  # each rank its own scale: the gathered A is row-wise in effect
            scale_a, rows_a = torch.tensor(0.5 + rank), torch.full((shard_rows, 1), 0.5 + rank)
            sb, b_deq = torch.tensor(0.75), b.float() * 0.75
        elif mode == "block, column-major":  # the layout torch._scaled_mm wants: scale.t().contiguous().t()
            scale_a = rows_a = (torch.rand(columns, shard_rows, generator=gen) + 0.5).t()
            sb = torch.rand(k // 128, -(-n // 128), generator=shared) + 0.5
            b_deq = b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)[:k, :n]
        else:
            scale_a = rows_a = torch.rand(shard_rows, columns, generator=gen) + 0.5
            if mode == "row":
                sb = torch.rand(1, n, generator=shared) + 0.5
                b_deq = b.float() * sb
            else:
                sb = torch.rand(k // 128, -(-n // 128), generator=shared) + 0.5
                b_deq = b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)[:k, :n]
        full_a = torch.empty(m, k, dtype=torch.uint8)
        dist.all_gather_into_tensor(full_a, a.view(torch.uint8))
        full_scale = torch.empty(m, columns)
        dist.all_gather_into_tensor(full_scale, rows_a.contiguous())
        a_deq = full_a.view(torch.float8_e4m3fn).float() * full_scale.repeat_interleave(k // columns, 1)
        want = a_deq @ b_deq
        for groups, bands in ((3, [16, 16, 16]), (2, [32, 16])):  # even bands; uneven (no one view of the slots)
            plan = default_plan("all_gather", m, n, k, world_size, tile=tile, num_groups=groups, gemm="cublas",
                                comm_ctas=0, allow_sequential=False)
            assert [g.rows for g in plan.groups] == bands, plan.groups
            # The own rows: the caller's shard in one product where cuBLAS takes it as it lies, else its slots band
            # by band (the CPU's scaled products are the dequantised ones either way: the choice stood in).
            for returned, own_product in itertools.product((True, False), (True, False)):
                nccl.cublas_takes = lambda a, b, mode, own_product=own_product: own_product
                call = Call("all_gather_gemm", plan, a, b, returned, scales=Scales.of(scale_a, sb, n=n))
                out, gathered = comm.run(call)
                torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
                if returned:
                    rows, scales = gathered
                    torch.testing.assert_close(rows.view(torch.uint8), full_a)
                    torch.testing.assert_close(scales, full_scale)
                else:
                    assert gathered is None
                checked.append((mode, groups, returned, own_product))
            # The signalling GEMM's branch (its kernel a stand-in that computes nothing here: the gathered rows the
            # GEMM would read are what is checked, through the gathered input the call returns).
            triton = dataclasses.replace(plan, gemm="triton", tile=TileConfig(16, 16, 128, 2, 1, 4))  # block_k: 128
            _, (rows, scales) = comm.run(Call("all_gather_gemm", triton, a, b, True, scales=Scales.of(scale_a, sb,
                                                                                                      n=n)))
            torch.testing.assert_close(rows.view(torch.uint8), full_a)
            torch.testing.assert_close(scales, full_scale)
            checked.append((mode, groups, "triton"))
    return len(checked)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_fp8_all_gather_packs_its_rows_into_their_slots_and_gathers_them(world_size):
    assert spawn(_fp8_all_gather, world_size, "gloo") == [40] * world_size
