"""The fast expert paths' fp8 calls on the CPU against the independent fp64 oracle (``fp8_cases.py``):

- NCCL (``comm/expert/nccl.py``): each rank a gloo process whose CUDA streams run on the host
  (``tests/comm/fake_cuda.py``), the transfers real; every buffer the communicator allocates starts NaN (packed rows:
  0xFF bytes, an fp8 NaN and a NaN scale).
- P2P (``comm/expert/p2p.py``): W ranks as threads of this process, each issuing its real schedule through a driver
  that does what the GPU would (copies by ``memmove`` between the ranks' workspaces, flag waits that block until the
  peer's signal, then reset), so a row read before it lands, or a flag left set, shows.

Both: W = 2 and 3, row-wise and block-wise, exact and bounded, skewed routing, a rank with no tokens and one that
receives none; fp8 rows given, or (every other case) quantised from bf16 rows by the communicator's first issued
step; dispatch's products and packed received rows, combine's outputs and returned rows."""

from __future__ import annotations

import ctypes
import threading
import time
import types

import pytest
import torch

from flashoverlap.testing import spawn
from tests.moe import fp8_cases as fc

CASES = [("skewed", "row", "exact"), ("skewed", "block", "bounded"), ("rank-sends-none", "block", "exact"),
         ("rank-receives-none", "row", "bounded"), ("balanced", "block", "exact"), ("balanced", "row", "bounded")]


def _calls(p, rank, world, layout, bound, deferred=False):
    """The dispatch and combine calls of one case on ``rank`` (fp8 rows given with their scales; ``deferred``: as the
    ops hand over bf16/fp32 rows, scales None, which the communicator's issued work quantises first into wire rows
    it allocates, NaN-poisoned where the communicator's allocator is) and the combine's input rows' positions."""
    from flashoverlap.comm.expert import ExpertCall, ExpertPlan
    from flashoverlap.comm.expert.scaled import ExpertScales

    def rows_and_scales(x):
        if not deferred:
            return fc.quantise64(x, mode)
        return x.float(), None  # the communicator quantises them into wire rows of its own

    mode, top_k = p["mode"], p["top_k"]
    tokens = p["x"][rank].shape[0]
    lmode = "bounded" if bound else "exact"
    w_up, s_up = fc.local_weights(p, rank, "up")
    w_down, s_down = fc.local_weights(p, rank, "down")
    x_q, x_s = rows_and_scales(p["x"][rank])
    plan = ExpertPlan("dispatch", world, p["experts"], fc.H, 2 * fc.FFN, top_k, tokens, lmode, bound)
    dispatch = ExpertCall("moe_dispatch_gemm", plan, x_q, w_up, True,
                          scales=ExpertScales(mode, s_up, x_s, dtype=fc.FP8), layout=layout)
    positions = fc.receive_positions(p, rank, bound)
    rows = layout.recv_rows
    act = torch.full((rows, fc.FFN), float("nan"), dtype=torch.bfloat16)
    for pos, (s, t, c, _) in zip(positions, fc.received(p, rank)):
        act[pos] = p["act"][s][t * top_k + c]
    a_q, a_s = rows_and_scales(torch.nan_to_num(act.double()))
    plan = ExpertPlan("combine", world, p["experts"], fc.H, fc.FFN, top_k, tokens, lmode, bound)
    combine = ExpertCall("moe_gemm_combine", plan, a_q, w_down, True,
                         scales=ExpertScales(mode, s_down, a_s, dtype=fc.FP8),
                         layout=layout.with_weights(p["router"][rank]))
    return dispatch, combine, positions


def _check(p, rank, where, dispatch_out, combine_out, positions, bound, reference=None):
    h, recv = dispatch_out
    want_h = fc.dispatch_oracle(p, rank, *zip(*[fc.quantise64(x, p["mode"]) for x in p["x"]]))
    fc.close(f"{where}: h", h[positions] if positions else h[:0], want_h)
    if bound:
        pad = torch.ones(h.shape[0], dtype=torch.bool)
        pad[positions] = False
        assert not h[pad].any(), f"{where}: padding rows of h are not zero"
    y, back = combine_out
    want_y = fc.combine_oracle(p, rank, *zip(*[fc.quantise64(a, p["mode"]) for a in p["act"]]))
    fc.close(f"{where}: y", y, want_y)
    if reference is not None:  # the reference communicator's packed received rows and returned rows
        (_, want_recv), (_, want_back) = reference
        from flashoverlap.comm.expert.scaled import unpack

        columns = fc.H // fc.BLOCK if p["mode"] == "block" else 1
        for got_part, want_part in zip(unpack(recv[positions], fc.H, fc.FP8, columns),
                                       unpack(want_recv[positions], fc.H, fc.FP8, columns)):  # padding never read
            assert torch.equal(got_part.view(torch.uint8), want_part.view(torch.uint8)), \
                f"{where}: the packed received rows differ"
        torch.testing.assert_close(back, want_back, atol=2e-2, rtol=2e-2, equal_nan=True)  # _scaled_mm vs dequantised


# -- NCCL ------------------------------------------------------------------------------------------------------


def _nccl_ranks(rank, world):
    import torch.distributed as dist

    from tests.comm import fake_cuda

    fake_cuda.install(wait_timeout_s=10.0)
    torch.set_num_threads(1)
    from flashoverlap.comm.expert import expert_layout
    from flashoverlap.comm.expert.nccl import ExpertNcclCommunicator
    from flashoverlap.comm.expert.reference import ExpertReferenceCommunicator
    from flashoverlap.comm.protocol import CommGroup

    group = CommGroup.of(dist.group.WORLD, torch.device("cpu"))
    comm, reference = ExpertNcclCommunicator(group), ExpertReferenceCommunicator(group)

    def poisoned(shape, dtype, zero=False):
        if dtype == torch.uint8:
            buffer = torch.full(shape, 0xFF, dtype=dtype)  # an fp8 NaN, a NaN scale
        else:
            buffer = torch.full(shape, float("nan"), dtype=dtype)
        return buffer.zero_() if zero else buffer

    comm._new = poisoned
    done = 0
    for n, (routing, scaling, lmode) in enumerate(CASES):
        p = fc.problem(world, routing, 2, scaling, 50 + n)
        bound = max(x.shape[0] for x in p["x"]) * 2 if lmode == "bounded" else None
        layout = expert_layout(p["idx"][rank], p["experts"], group, mode=lmode, bound=bound)
        dispatch, combine, positions = _calls(p, rank, world, layout, bound, deferred=n % 2 == 1)
        got = comm.run(dispatch), comm.run(combine)
        want = reference.run(dispatch), reference.run(combine)
        _check(p, rank, f"NCCL {routing} {scaling} {lmode} W={world} rank {rank}", *got, positions, bound, want)
        assert not comm.flags.any()
        done += 1
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_nccl_path_matches_the_oracle(world):
    assert spawn(_nccl_ranks, world, "gloo") == [len(CASES)] * world


def _wired_in_the_graph(rank, world):
    """fp8 from bf16 rows, bounded, repeated: the wire rows are allocated and written inside the issued work that a
    graph holds (``comm/expert/scaled.wired``), so a repeated call's host allocates only its outputs before the
    graph lookup (its result, and its rows where it returns them: else the issued work allocates them too), the
    signature names the bf16 rows (not a wire buffer), and every call, replayed or not, is right. The graphs stand in
    as in ``tests/comm/test_expert_nccl.py``: a repeated signature's issued work runs again."""
    import torch.distributed as dist

    from tests.comm import fake_cuda

    fake_cuda.install(wait_timeout_s=10.0)
    torch.set_num_threads(1)
    from flashoverlap.comm.expert import expert_layout
    from flashoverlap.comm.expert.nccl import ExpertNcclCommunicator
    from flashoverlap.comm.expert.reference import ExpertReferenceCommunicator
    from flashoverlap.comm.protocol import CommGroup
    from flashoverlap.comm.replay import address

    group = CommGroup.of(dist.group.WORLD, torch.device("cpu"))
    comm, reference = ExpertNcclCommunicator(group), ExpertReferenceCommunicator(group)
    buffers, allocated, before_lookup, replays = {}, [0], [], [0]

    def new(shape, dtype, zero=False):  # the caching allocator's reuse: the n-th buffer of a call where it was
        allocated[0] += 1
        fill = 0 if zero else (0xFF if dtype == torch.uint8 else float("nan"))
        return buffers.setdefault((tuple(shape), dtype, allocated[0]), torch.empty(shape, dtype=dtype)).fill_(fill)

    class Graphs:
        def __init__(self):
            self.seen = {}

        def run(self, signature, issue):
            before_lookup.append((allocated[0], signature))
            self.seen[signature] = self.seen.get(signature, 0) + 1
            if self.seen[signature] < 2:
                return False
            issue()
            replays[0] += 1
            return True

        def clear(self):
            self.seen.clear()

    comm._new, comm.graphs, comm._graphed = new, Graphs(), True
    p = fc.problem(world, "skewed", 2, "block", 77)
    bound = max(x.shape[0] for x in p["x"]) * 2
    layout = expert_layout(p["idx"][rank], p["experts"], group, mode="bounded", bound=bound)
    dispatch, combine, positions = _calls(p, rank, world, layout, bound, deferred=True)
    dispatch.replay = combine.replay = True
    returned = None
    for gathered in (True, False):  # the received / returned rows returned, or the issued work's own
        dispatch.return_gathered = combine.return_gathered = gathered
        for _ in range(3):
            got = []
            for call in (dispatch, combine):
                allocated[0] = 0
                got.append(comm.run(call))
                outside, signature = before_lookup[-1]
                want = 2 if gathered else 1  # the result, and the rows where they are returned
                assert outside == want, f"{call.name}: {outside} buffers allocated before the graph lookup, not {want}"
                # the bf16 rows, by address, in the signature's inputs part (``replay.signature``)
                assert call.scales.a is None and address(call.a) in signature[0], call.name
                assert (got[-1][1] is not None) == gathered, call.name
            if gathered:
                want = reference.run(dispatch), reference.run(combine)
                _check(p, rank, f"NCCL wired W={world} rank {rank}", *got, positions, bound, want)
                returned = [out.clone() for out, _ in got]
            else:  # the same results as the calls that returned their rows
                for (out, _), before in zip(got, returned):
                    torch.testing.assert_close(out, before, rtol=0, atol=0, equal_nan=True)
    return replays[0]


def test_fp8_rows_from_bf16_are_quantised_inside_the_replayed_work():
    # dispatch and combine, three calls each, rows returned or not: the second and third of each replay.
    assert spawn(_wired_in_the_graph, 2, "gloo") == [8, 8]


# -- P2P: ranks as threads, the driver doing what the GPU would ----------------------------------------------------


class _Driver:
    def __init__(self):
        self.events = 0

    def wait_reset(self, stream, address):
        word = ctypes.c_int32.from_address(address)
        deadline = time.monotonic() + 20
        while word.value != 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"a flag wait at {address:#x} was never signalled")
            time.sleep(0.0005)
        word.value = 0

    def write(self, stream, address, value):
        word = ctypes.c_int32.from_address(address)
        assert value == 0 or word.value == 0, "a signal found its flag still set"
        word.value = value

    def copy(self, stream, dst, src, nbytes):
        ctypes.memmove(dst, src, nbytes)

    def current_stream(self, index):
        return 0

    def new_event(self):
        self.events += 1
        return self.events

    def free_event(self, event):
        pass

    def record(self, event, stream):
        pass

    def wait_event(self, stream, event):
        pass


class _Workspace:
    def __init__(self, world, nbytes):
        from flashoverlap.comm.expert import p2p as ep

        self.nbytes = nbytes
        self.buffer = torch.full((nbytes,), 0xFF, dtype=torch.uint8)  # NaN bytes until rows land
        self.flags = torch.zeros(2 * ep.MAX_RANKS, dtype=torch.int32)
        self.flags[ep.FREE_BASE : ep.FREE_BASE + world] = 1  # every slot free
        self.peers = None

    def ensure(self, nbytes, op, ones=(0, 0)):
        assert nbytes <= self.nbytes, "the test's workspace is too small"
        return False

    def peer_ptr(self, rank):
        return self.peers[rank].buffer.data_ptr()

    def flag_ptr(self, rank, slot):
        return self.peers[rank].flags.data_ptr() + 4 * slot

    def release(self):
        pass


def _p2p_communicator(rank, world, workspace):
    from torch.utils.weak import WeakTensorKeyDictionary

    from flashoverlap.comm.expert import p2p as ep
    from flashoverlap.comm.replay import CallGraphs

    comm = object.__new__(ep.ExpertP2PCommunicator)
    comm.rank, comm.world_size, comm.name, comm.group = rank, world, "threads", None
    comm.device = torch.device("cpu")
    comm.copy_stream = types.SimpleNamespace(cuda_stream=1)
    comm.workspace = workspace
    comm._index, comm._events, comm._join = 0, [], None
    comm._warm, comm._light_warm, comm._tables, comm._programs = set(), set(), {}, {}
    comm._ends = WeakTensorKeyDictionary()
    comm.graphs = CallGraphs(None)
    return comm


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_p2p_path_matches_the_oracle(world, monkeypatch):
    from flashoverlap.comm.expert import expert_layout
    from flashoverlap.comm.expert import layout as layout_module
    from flashoverlap.comm.expert import p2p as ep

    driver = _Driver()
    monkeypatch.setattr(ep.stream_ops, "fast", lambda: driver)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: types.SimpleNamespace(cuda_stream=0))
    barrier = threading.Barrier(world)
    slots = [None] * world

    def all_gather(out, inp, group):  # the layout's one collective, between the threads
        slots[group.rank] = inp.clone()
        barrier.wait()
        out.copy_(torch.cat(slots).view_as(out))
        barrier.wait()

    monkeypatch.setattr(layout_module, "all_gather_into_tensor", all_gather)
    workspaces = [_Workspace(world, 1 << 20) for _ in range(world)]
    for w in workspaces:
        w.peers = workspaces
    comms = [_p2p_communicator(r, world, workspaces[r]) for r in range(world)]
    errors, done = [], [0] * world

    def rank_thread(rank):
        try:
            group = types.SimpleNamespace(world_size=world, rank=rank, name="threads")
            group.process_group = group
            for n, (routing, scaling, lmode) in enumerate(CASES):
                p = fc.problem(world, routing, 2, scaling, 70 + n)
                bound = max(x.shape[0] for x in p["x"]) * 2 if lmode == "bounded" else None
                layout = expert_layout(p["idx"][rank], p["experts"], group, mode=lmode, bound=bound)
                dispatch, combine, positions = _calls(p, rank, world, layout, bound, deferred=n % 2 == 0)
                got = comms[rank].run(dispatch), comms[rank].run(combine)
                _check(p, rank, f"P2P {routing} {scaling} {lmode} W={world} rank {rank}", *got, positions, bound)
                barrier.wait()  # every rank's flags settled before the next case's layout
                done[rank] += 1
        except BaseException as exc:  # noqa: BLE001: reported below
            errors.append((rank, exc))
            barrier.abort()

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    real = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)]
    assert not real, real[0]
    assert done == [len(CASES)] * world
    for w in workspaces:  # every full flag reset by its waiter, every free flag set again by its consumer
        assert not w.flags[:world].any() and bool((w.flags[ep.FREE_BASE : ep.FREE_BASE + world] == 1).all())
