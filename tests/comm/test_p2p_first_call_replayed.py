"""The first call of a fresh P2P communicator with replay on (the runtime's default): its workspace does not exist
yet when ``run`` builds the call's replay signature, before step 1 allocates it.

The shared-GPU soak at ab48e7f raised ``AttributeError: 'NoneType' object has no attribute 'data_ptr'`` on
``scaled_gemm_all_reduce row 513x48x256 b=w.t() out=bf16 plan=given/1`` at W = 2 (and the mechanics on every
layer and style call of a fresh group): ``_signature`` read ``workspace.buffer.data_ptr()`` while ``buffer`` was
still None. Fixed in b69de40 (``P2PCommunicator._workspace_address``: 0 before the first allocation, the signature
made again after step 1). Here every rank's communicator starts with no workspace, as ``SymmetricWorkspace`` does,
and runs the same call three times with replay on (eager, captured, replayed), new values in place each time,
outputs NaN-poisoned, every value checked against an oracle that shares no code with the executor."""

import pytest
import torch

from flashoverlap.comm.protocol import Call
from flashoverlap.comm.tp import p2p
from flashoverlap.comm.tp import ring_schedule as rs
from flashoverlap.plan import TileConfig
from flashoverlap.tune.defaults import default_plan
from tests.comm.test_p2p_fp8_executor import SharedWorkspace, check_close, communicators, expect, operands, run_all

# The soak's given plans: 16-row tiles (benchmarks/shared/calls.py, SMALL_TILE_M)
TILE = TileConfig(block_m=16, block_n=64, block_k=64)


class LazyWorkspace(SharedWorkspace):
    """A workspace with no buffer until the first ``ensure`` (``SymmetricWorkspace`` before its first call)."""

    def __init__(self, rank, buffers, flags):
        super().__init__(rank, buffers, flags)
        self.buffer, self.nbytes, self.allocations = None, 0, 0

    def ensure(self, nbytes, op, ones=(0, 0)):
        self.asked.append(nbytes)
        if nbytes <= self.nbytes:
            return False
        if nbytes > self.buffers[self.rank].numel():
            raise AssertionError(f"the test's buffer ({self.buffers[self.rank].numel()} bytes) is smaller than asked "
                                 f"({nbytes})")
        self.buffer, self.nbytes = self.buffers[self.rank], self.buffers[self.rank].numel()
        self.allocations += 1
        return True


class HeldGraph:
    """A capture that holds the call's work without running it, and runs it again on every replay (what a CUDA
    graph does: the same work on whatever the same addresses hold)."""

    captured = 0

    def __init__(self, issue):
        self.issue = issue
        HeldGraph.captured += 1

    def replay(self):
        self.issue()


def _fresh(world, monkeypatch):
    comms, flags = communicators(world, rs.regions(world) * (1 << 17), monkeypatch)
    blocks = [{} for _ in comms]
    for rank, comm in enumerate(comms):
        comm.workspace = LazyWorkspace(rank, comm.workspace.buffers, comm.workspace.flags)
        comm.graphs = p2p.CallGraphs(None, capture=HeldGraph)

        # The caching allocator hands a repeated call the same blocks (what lets it replay), poisoned here.
        def new(shape, dtype, blocks=blocks[rank]):
            block = blocks.get((tuple(shape), dtype))
            if block is None:
                block = blocks[tuple(shape), dtype] = torch.empty(shape, dtype=dtype)
            return block.fill_(0xFF) if dtype == torch.uint8 else block.fill_(float("nan"))

        comm._new = new
    return comms, flags


CASES = [  # (op, M, N, K, fp8 mode or None for bf16)
    ("all_reduce", 513, 48, 256, "row"),  # the soak's call
    ("all_reduce", 35, 24, 40, None),
    ("reduce_scatter", 34, 48, 128, "tensor"),
    ("all_gather", 34, 48, 256, "block"),
]


@pytest.mark.parametrize("op,m,n,k,mode", CASES)
def test_a_fresh_communicators_first_call_with_replay_on_runs_and_is_right(op, m, n, k, mode, monkeypatch):
    world = 2
    comms, flags = _fresh(world, monkeypatch)
    plan = default_plan(op, m, n, k, world, tile=TILE, num_groups=1, path="p2p", allow_sequential=False)
    assert not plan.sequential
    assert all(comm.workspace.buffer is None for comm in comms)
    captured = HeldGraph.captured
    if mode is None:
        gen = torch.Generator().manual_seed(7)
        rows = m // world if op == "all_gather" else m
        per_rank = [(torch.randn(rows, k, generator=gen).to(torch.bfloat16),
                     (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).t(), None) for _ in range(world)]
    else:
        per_rank = operands(op, world, m, n, k, mode, torch.bfloat16, False, seed=3)
    calls = [Call(op, plan, a, b, replay=True, scales=s) for a, b, s in per_rank]
    for i in range(3):  # eager (the first call: no workspace yet), captured, replayed
        if i:  # new values in the same tensors
            gen = torch.Generator().manual_seed(100 + i)
            for a, _, s in per_rank:
                if s is None:
                    a.copy_(torch.randn(a.shape, generator=gen))
                else:
                    q = torch.randn(a.shape, generator=gen).mul_(a.float().abs().amax() / 4).to(a.dtype)
                    a.copy_(q)
                    s.a.mul_(1.5)
        results = run_all(comms, calls)
        for rank, (out, _) in enumerate(results):
            what = f"{op} {mode or 'bf16'} {m}x{n}x{k} call {i} rank {rank}"
            if mode is None:
                want, bound = _bf16_expect(op, per_rank, rank, world, m)
            else:
                want, bound = expect(op, per_rank, rank, world, m, mode, torch.bfloat16)
            check_close(out, want, bound, what)
    assert all(comm.workspace.allocations == 1 for comm in comms)
    assert HeldGraph.captured - captured == world  # the second call captured on every rank, the third replayed
    assert all(comm.graphs.replays == 2 for comm in comms)
    for f in flags:
        assert not f[: rs.FREE_BASE].any() and bool((f[rs.FREE_BASE :] == 1).all())


def _bf16_expect(op, per_rank, rank, world, m):
    if op == "all_gather":
        want = torch.cat([a for a, _, _ in per_rank]).double() @ per_rank[rank][1].double()
        return want, 2.0**-7 * want.abs() + 1e-3
    products = [a.double() @ b.double() for a, b, _ in per_rank]
    want = sum(products)
    bound = 2 * world * 2.0**-8 * sum(p.abs() for p in products) + 1e-3
    if op == "reduce_scatter":
        rows = slice(rank * m // world, (rank + 1) * m // world)
        return want[rows], bound[rows]
    return want, bound


def test_the_signature_before_step_one_names_no_workspace(monkeypatch):
    """The signature of a call on a communicator without a workspace holds 0 where the workspace's address goes
    (the call makes it again after step 1), and it is built without touching the missing buffer."""
    comms, _ = _fresh(2, monkeypatch)
    comm = comms[0]
    plan = default_plan("all_reduce", 513, 48, 256, 2, tile=TILE, num_groups=1, path="p2p", allow_sequential=False)
    a, b, s = operands("all_reduce", 2, 513, 48, 256, "row", torch.bfloat16, False, seed=1)[0]
    out = comm._new((513, 48), torch.bfloat16)
    assert comm.workspace.buffer is None
    inputs, outputs, _ = comm._signature(plan, a, b, out, None, None, s)  # replay.signature's parts
    assert inputs[8] == 0 and inputs[2] == a.data_ptr() and outputs[0] == out.data_ptr()
