"""The sequential communicator (``comm/tp/sequential.py``) on gloo CPU ranks: every op, bf16 and fp8 (tensor-wise and
row-wise), its buffers NaN-poisoned, against plain PyTorch; its replay signature (what a captured call depends on
besides values); and a repeated call's replay path, through a stand-in for the CUDA graph that issues the call's
work again (the real graphs: tests/gpu/test_gpu_sequential_replay.py)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from flashoverlap.testing import spawn


def _poisoned(comm):
    """``comm._buffers`` with every buffer NaN-filled (fp8: 0xFF bytes), so an unwritten output shows."""
    real = comm._buffers

    def buffers(call):
        out = real(call)
        for t in out:
            (t.view(torch.uint8).fill_(0xFF) if t.element_size() == 1 else t.fill_(float("nan")))
        return out

    return buffers


def _want(op, a, b, world, rank, scales=None):
    """The plain result: the product (fp8: dequantised, fp32) and the collective, by plain torch.distributed."""
    if scales is not None:
        a = a.float() * scales[0]
        b = b.float() * scales[1]
    if op == "all_gather":
        full = torch.empty((a.shape[0] * world, a.shape[1]), dtype=a.dtype)
        dist.all_gather_into_tensor(full, a.contiguous())
        return (full @ b).double(), full
    c = (a @ b).double()
    dist.all_reduce(c)
    return (c if op == "all_reduce" else c.chunk(world)[rank]), None


def _ranks(rank, world):
    from flashoverlap.comm.protocol import Call, CommGroup
    from flashoverlap.comm.replay import CallGraphs
    from flashoverlap.comm.scaled import Scales
    from flashoverlap.comm.tp.sequential import SequentialCommunicator
    from flashoverlap.tune.defaults import sequential_plan

    comm = SequentialCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    comm._buffers = _poisoned(comm)
    gen = torch.Generator().manual_seed(rank)
    checked = 0
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        for m, n, k in ((6 * world, 10, 16), (4 * world, 7, 32)):
            rows = m // world if op == "all_gather" else m
            plan = sequential_plan(op, m, n, k, world)
            a = torch.randn(rows, k, generator=gen, dtype=torch.float64)
            b = torch.randn(n, k, generator=gen, dtype=torch.float64).t()  # w.t()
            for gathered in (False, True) if op == "all_gather" else (False,):
                for dtype, mode in ((torch.bfloat16, None), (torch.float8_e4m3fn, "tensor"),
                                    (torch.float8_e4m3fn, "row")):
                    if mode is None:
                        a_in, b_in, scales, deq = a.to(dtype), b.to(dtype), None, None
                    else:
                        sa = torch.rand(rows, 1, generator=gen) + 0.5 if mode == "row" else torch.tensor(0.5)
                        sb = torch.rand(1, n, generator=gen) + 0.5 if mode == "row" else torch.tensor(2.0)
                        a_in = (a / 4).to(dtype)
                        b_in = b.t().contiguous().to(dtype).t()  # column-major, as _scaled_mm takes it
                        scales, deq = Scales.of(sa, sb), (sa.double(), sb.double())
                    got, extra = comm.run(Call(op, plan, a_in, b_in, gathered, scales=scales))
                    want, full = _want(op, a_in.double(), b_in.double(), world, rank, deq)
                    torch.testing.assert_close(got.double(), want.double(), atol=0.1, rtol=2e-2)
                    if gathered:  # the gathered input, byte for byte (fp8: and its scales)
                        rows_back = extra if scales is None else extra[0]
                        assert torch.equal(rows_back.view(torch.uint8), _gathered(a_in, world).view(torch.uint8))
                        if scales is not None:
                            torch.testing.assert_close(extra[1], _gathered(scales.shard_rows(rows), world))
                    checked += 1
    # A repeated call replays (a stand-in graph that issues the call again): the same buffers every call, as the
    # caching allocator hands a repeated call on a GPU; the second call is captured, later ones replayed, each
    # writing its own values into the NaN-poisoned buffers.
    comm._graphed = True
    comm.graphs = CallGraphs(torch.device("cpu"), capture=lambda issue: types.SimpleNamespace(replay=issue))
    plan = sequential_plan("all_reduce", 8, 6, 16, world)
    a, b = torch.empty(8, 16, dtype=torch.bfloat16), torch.empty(6, 16, dtype=torch.bfloat16).t()
    kept = comm._buffers(Call("all_reduce", plan, a, b))
    comm._buffers = lambda call: tuple(t.fill_(float("nan")) for t in kept)
    for _ in range(4):
        a.copy_(torch.randn(8, 16, generator=gen))
        b.copy_(torch.randn(6, 16, generator=gen).t())
        got, _ = comm.run(Call("all_reduce", plan, a, b, replay=True))
        want, _ = _want("all_reduce", a.double(), b.double(), world, rank)
        torch.testing.assert_close(got.double(), want, atol=0.1, rtol=2e-2)
    assert (comm.graphs.captures, comm.graphs.replays) == (1, 3)
    # The replay lane (``replayer``): the graph of the same tensors, on the buffers the allocator hands the call (the
    # same blocks: fresh values in them), refused by the coalescing manager as ``run`` is; other blocks, no graph.
    from flashoverlap.comm import collectives
    from flashoverlap.comm.tp import sequential

    sequential.allocate = lambda shapes, device: tuple(t.fill_(float("nan")) for t in kept)
    lane = comm.replayer(Call("all_reduce", plan, a, b, replay=True))
    a.copy_(torch.randn(8, 16, generator=gen))
    got, _ = lane()
    want, _ = _want("all_reduce", a.double(), b.double(), world, rank)
    torch.testing.assert_close(got.double(), want, atol=0.1, rtol=2e-2)
    assert got is kept[0] and (comm.graphs.captures, comm.graphs.replays) == (1, 4)
    collectives._COALESCING[dist.group.WORLD] = True
    try:
        with pytest.raises(RuntimeError, match="coalescing manager"):
            lane()
    finally:
        del collectives._COALESCING[dist.group.WORLD]
    sequential.allocate = lambda shapes, device: tuple(torch.empty_like(t) for t in kept)
    assert lane() is None and comm.graphs.replays == 4
    assert comm.replayer(Call("all_reduce", plan, a, b)) is None  # a call that does not replay
    comm._graphed = False  # off the GPU: no graphs, no lane
    assert comm.replayer(Call("all_reduce", plan, a, b, replay=True)) is None
    return checked + 1


def _gathered(shard, world):
    """Every rank's ``shard`` in rank order, by plain torch.distributed (on bytes: gloo has no fp8)."""
    shard = shard.contiguous()
    out = torch.empty((shard.shape[0] * world, shard.shape[1]), dtype=shard.dtype)
    dist.all_gather_into_tensor(out.view(torch.uint8), shard.view(torch.uint8))
    return out


def test_the_sequential_communicator_matches_plain_pytorch_and_replays():
    assert spawn(_ranks, 2, "gloo") == [25, 25]


def _signatures(rank, world):
    from flashoverlap.comm.protocol import Call, CommGroup
    from flashoverlap.comm.scaled import Scales
    from flashoverlap.comm.tp.sequential import SequentialCommunicator
    from flashoverlap.tune.defaults import sequential_plan

    comm = SequentialCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    checked = 0
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        m, n, k = 8 * world, 6, 16
        rows = m // world if op == "all_gather" else m
        plan = sequential_plan(op, m, n, k, world)
        a, b = torch.randn(rows, k), torch.randn(n, k).t()
        call = Call(op, plan, a, b)
        first = comm._buffers(call)
        kept = comm._signature(call, first)
        assert comm._signature(Call(op, plan, a, b), first) == kept, op
        for other in (Call(op, plan, a.clone(), b), Call(op, plan, a, b.contiguous()), Call(op, plan, a, b.clone())):
            assert comm._signature(other, first) != kept, op  # another a, b laid out otherwise, another b
        assert comm._signature(call, comm._buffers(call)) != kept, op  # the first buffers alive: new ones elsewhere
        checked += 1
    plan = sequential_plan("all_reduce", 8 * world, 6, 16, world)
    a8, b8 = torch.zeros(8 * world, 16, dtype=torch.float8_e4m3fn), torch.zeros(16, 6, dtype=torch.float8_e4m3fn)
    sa, sb = torch.ones(8 * world, 1), torch.ones(1, 6)
    call = Call("all_reduce", plan, a8, b8, scales=Scales.of(sa, sb))
    buffers = comm._buffers(call)
    kept = comm._signature(call, buffers)
    assert comm._signature(Call("all_reduce", plan, a8, b8, scales=Scales.of(sa.clone(), sb)), buffers) != kept
    return checked + 1


def test_the_sequential_replay_signature_names_every_tensor_a_call_touches():
    assert spawn(_signatures, 2, "gloo") == [4, 4]
