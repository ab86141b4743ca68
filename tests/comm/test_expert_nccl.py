"""The NCCL expert communicator's own code (``comm/expert/nccl.py``: chunks, rounds, send/recv groups, flags and
their resets, per-chunk GEMMs) on the CPU: each rank a gloo process whose CUDA streams run on the host
(``tests/comm/fake_cuda.py``); the transfers are real (gloo). Combine's signalling GEMM is a thread that stores
the rows segment by segment, destinations in the communicator's priority order, counting each destination's flag
up to 1 (the kernel's contract), so a send issued before its rows are stored sends NaN (every buffer the
communicator allocates starts NaN) and fails the comparison. Every output is compared with the reference
communicator's on the same call: W = 2 and 3, exact and bounded, the three GEMM kinds, fp32, bf16 and fp16,
skewed routing, a rank that sends none and one that receives none, the backward variants (per-choice dispatch,
unweighted combine) and a combine into a preallocated out (the Triton cases)."""

import dataclasses
import threading

import pytest
import torch
import torch.distributed as dist

from flashoverlap.testing import spawn
from tests.comm import fake_cuda

FFN, LOCAL, TOP_K = 8, 3, 2


def _routing(case, rank, world, gen):
    """(tokens, topk_idx) of ``rank`` for one case: skewed towards low expert indices (rank 0's experts),
    balanced, a rank 1 with no tokens (sends none), or no token choosing rank 0's experts (it receives none)."""
    experts = LOCAL * world
    tokens = 0 if case == "sends_none" and rank == 1 else 7 + 3 * rank
    weights = torch.ones(experts)
    if case == "skewed":
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float) ** 1.5
    if case == "receives_none":
        weights[:LOCAL] = 0
    idx = torch.stack([torch.multinomial(weights, TOP_K, generator=gen) for _ in range(tokens)]) if tokens else \
        torch.empty((0, TOP_K), dtype=torch.int64)
    return tokens, idx


def _async_signalling(comm, producers):
    """A stand-in for the signalling grouped GEMM: a thread that stores y segment by segment in the kernel's
    priority order (destinations by round, own last) and counts each destination's flag up to exactly 1."""
    from flashoverlap.comm.expert.chunked_gemm import pair_rounds, relative_ends

    def launch(a, b, layout, y, table, chunks):
        world = layout.world_size
        ends = relative_ends(layout).tolist()
        order = [p for p in pair_rounds(comm.rank, world) if p is not None] + [comm.rank]
        steps = []
        for d in range(world):
            starts = [0] + ends[d][:-1]
            segments = [(chunks.recv_offsets[d] + s, chunks.recv_offsets[d] + e, expert)
                        for expert, (s, e) in enumerate(zip(starts, ends[d])) if e > s]
            comm.flags[d] = 1 - len(segments)  # the prep kernel's start value
            for first, last, expert in segments:
                def step(first=first, last=last, expert=expert, d=d):
                    y[first:last] = (a[first:last].float() @ b[expert].float()).to(y.dtype)
                    comm.flags[d] += 1
                steps.append((order.index(d), step))
        producer = fake_cuda.Producer([step for _, step in sorted(steps, key=lambda s: s[0])], delay_s=0.002)
        producers.append(producer)
        producer.start()

    return launch


def _ranks(rank, world):
    fake_cuda.install(wait_timeout_s=10.0)
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only contend with the ranks and the producer
    from flashoverlap.comm.expert import ExpertCall, ExpertPlan, expert_layout
    from flashoverlap.comm.expert.nccl import ExpertNcclCommunicator
    from flashoverlap.comm.expert.reference import ExpertReferenceCommunicator
    from flashoverlap.comm.protocol import CommGroup

    group = CommGroup.of(dist.group.WORLD, torch.device("cpu"))
    comm, reference = ExpertNcclCommunicator(group), ExpertReferenceCommunicator(group)
    producers: list[threading.Thread] = []
    comm._signalling_gemm = _async_signalling(comm, producers)
    from flashoverlap.comm.expert import chunked_gemm

    made = []  # the modes of the layouts whose chunk ends the communicator computed
    real_ends = chunked_gemm.relative_ends

    def counted_ends(layout):
        made.append(layout.mode)
        return real_ends(layout)

    chunked_gemm.relative_ends = counted_ends  # this rank's own process

    def poisoned(shape, dtype, zero=False):
        buffer = torch.full(shape, float("nan"), dtype=dtype)
        return buffer.zero_() if zero else buffer

    comm._new = poisoned
    experts = LOCAL * world
    checked = 0
    for case in ("skewed", "balanced", "sends_none", "receives_none"):
        gen = torch.Generator().manual_seed(1000 * rank + len(case))
        tokens, idx = _routing(case, rank, world, gen)
        # Every rank knows every rank's token count (the formula), so the bound is the same on every rank.
        bound = max(7 + 3 * (world - 1), 1) * TOP_K
        for mode in ("exact", "bounded"):
            layout = expert_layout(idx, experts, group, mode=mode, bound=bound if mode == "bounded" else None)
            for gemm in ("triton", "cublas", "loop"):
                # The loop needs host sizes: in bounded mode the plan leaves the choice (None) to chunk_gemm.
                plan_gemm = None if gemm == "loop" and mode == "bounded" else gemm
                dtype = {("cublas", "skewed"): torch.bfloat16, ("loop", "skewed"): torch.float16,
                         ("triton", "receives_none"): torch.float16}.get((gemm, case), torch.float32)
                hidden = 24 if gemm == "cublas" else 20  # cuBLAS's grouped GEMM: rows of 16-byte multiples
                tol = {torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}, torch.float16: {"atol": 5e-3, "rtol": 5e-3},
                       torch.float32: {"atol": 1e-4, "rtol": 1e-4}}[dtype]
                per_choice = gemm == "loop" and case == "balanced"  # combine's backward: one row per choice
                x = torch.randn(tokens * TOP_K if per_choice else tokens, hidden, generator=gen).to(dtype)
                w_up = torch.randn(LOCAL, 2 * FFN, hidden, generator=gen).to(dtype).transpose(1, 2)  # w.t() view
                plan = ExpertPlan("dispatch", world, experts, hidden, 2 * FFN, TOP_K, tokens, mode,
                                  bound if mode == "bounded" else None, plan_gemm, per_choice=per_choice)
                call = ExpertCall("moe_dispatch_gemm", plan, x, w_up, return_gathered=True, layout=layout)
                h, recv = comm.run(call)
                want_h, want_recv = reference.run(call)
                torch.testing.assert_close(h, want_h, **tol)
                torch.testing.assert_close(recv, want_recv, **tol)
                weighted = gemm != "cublas"  # dispatch's backward: the unweighted sum
                topk_weights = torch.rand(tokens, TOP_K, generator=gen)
                act = torch.randn(layout.recv_rows, FFN, generator=gen).to(dtype)
                w_down = torch.randn(LOCAL, FFN, hidden, generator=gen).to(dtype)
                plan = ExpertPlan("combine", world, experts, hidden, FFN, TOP_K, tokens, mode,
                                  bound if mode == "bounded" else None, plan_gemm, weighted=weighted)
                given = poisoned((tokens, hidden), dtype) if gemm == "triton" else None  # a preallocated out
                call = ExpertCall("moe_gemm_combine", plan, act, w_down, return_gathered=gemm != "loop",
                                  layout=layout.with_weights(topk_weights) if weighted else layout, out=given)
                out, back = comm.run(call)
                assert given is None or out is given
                want_out, want_back = reference.run(dataclasses.replace(call, out=None))
                torch.testing.assert_close(out, want_out, **tol)
                if gemm != "loop":
                    torch.testing.assert_close(back, want_back, **tol)
                else:
                    assert back is None
                assert not comm.flags.any(), "a flag was left set for the next call"
                checked += 1
    for producer in producers:
        producer.join()
    return checked, len(producers), made.count("exact")


@pytest.mark.parametrize("world", [2, 3])
def test_expert_nccl_communicator_matches_the_reference(world):
    results = spawn(_ranks, world, "gloo")
    # Every case and mode and GEMM ran; the signalling GEMM ran for every exact-mode Triton combine with rows.
    assert all(checked == 4 * 2 * 3 for checked, _, _ in results)
    assert all(signalling >= 2 for _, signalling, _ in results)
    # An exact layout's chunk ends are made once, on its first call, and kept for the calls after it on the same
    # layout (dispatch and combine of three GEMM kinds, but a Triton combine with rows, whose signalling GEMM reads
    # the layout's own ends; combine's layout ``with_weights`` shares its tensors): four cases, four layouts.
    assert all(exact == 4 for _, _, exact in results)


def test_pair_rounds_meet_every_peer_once_and_symmetrically():
    from flashoverlap.comm.expert.chunked_gemm import pair_rounds

    for world in range(1, 10):
        rounds = [pair_rounds(r, world) for r in range(world)]
        assert len({len(r) for r in rounds}) == 1
        for r in range(world):
            assert sorted(p for p in rounds[r] if p is not None) == [p for p in range(world) if p != r]
            for k, p in enumerate(rounds[r]):
                assert p is None or rounds[p][k] == r


def _hybrid_ranks(rank, world):
    """The hybrid GEMM's branches of the NCCL communicator (TRITON_INTERPRET=1: the light launch is the real kernel,
    interpreted): a mix of heavy and light experts, and every expert light (every expert heavy is the loop, tested
    above); skewed routing and a rank that sends none; the backward variants; the received and returned rows asked
    for or not. Each output against the reference
    communicator's; every buffer the communicator allocates starts NaN."""
    fake_cuda.install(wait_timeout_s=10.0)
    torch.set_num_threads(1)
    from flashoverlap.comm.expert import ExpertCall, ExpertPlan, HybridCut, expert_layout
    from flashoverlap.comm.expert import nccl as expert_nccl
    from flashoverlap.comm.expert.nccl import ExpertNcclCommunicator
    from flashoverlap.comm.expert.reference import ExpertReferenceCommunicator
    from flashoverlap.comm.protocol import CommGroup

    group = CommGroup.of(dist.group.WORLD, torch.device("cpu"))
    comm, reference = ExpertNcclCommunicator(group), ExpertReferenceCommunicator(group)
    comm._new = lambda shape, dtype, zero=False: torch.full(shape, float("nan"), dtype=dtype)
    experts, hidden = LOCAL * world, 32
    light_calls = 0
    real = expert_nccl.light_multiplier

    def counted(*args):
        nonlocal light_calls
        light = real(*args)
        light_calls += light is not None
        return light

    expert_nccl.light_multiplier = counted
    for heavy in (6, 10**6):
        cut = HybridCut(heavy_rows=heavy, light_flat_rows=256)
        for case in ("skewed", "sends_none"):
            gen = torch.Generator().manual_seed(1000 * rank + len(case) + heavy)
            tokens, idx = _routing(case, rank, world, gen)
            layout = expert_layout(idx, experts, group)
            for per_choice, weighted, gathered in ((False, True, True), (True, False, False)):
                x = torch.randn(tokens * TOP_K if per_choice else tokens, hidden, generator=gen)
                w_up = torch.randn(LOCAL, 2 * FFN, hidden, generator=gen).transpose(1, 2)
                plan = ExpertPlan("dispatch", world, experts, hidden, 2 * FFN, TOP_K, tokens, gemm="hybrid",
                                  per_choice=per_choice, hybrid=cut)
                call = ExpertCall("moe_dispatch_gemm", plan, x, w_up, return_gathered=gathered, layout=layout)
                h, recv = comm.run(call)
                want_h, want_recv = reference.run(dataclasses.replace(call, return_gathered=True))
                torch.testing.assert_close(h, want_h, atol=1e-4, rtol=1e-4)
                assert (recv is None) != gathered
                if gathered:
                    torch.testing.assert_close(recv, want_recv)
                topk_weights = torch.rand(tokens, TOP_K, generator=gen)
                act = torch.randn(layout.recv_rows, FFN, generator=gen)
                w_down = torch.randn(LOCAL, FFN, hidden, generator=gen)
                plan = ExpertPlan("combine", world, experts, hidden, FFN, TOP_K, tokens, gemm="hybrid",
                                  weighted=weighted, hybrid=cut)
                call = ExpertCall("moe_gemm_combine", plan, act, w_down, return_gathered=gathered,
                                  layout=layout.with_weights(topk_weights) if weighted else layout)
                out, back = comm.run(call)
                want_out, want_back = reference.run(dataclasses.replace(call, return_gathered=True))
                torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
                if gathered:
                    torch.testing.assert_close(back, want_back, atol=1e-4, rtol=1e-4)
    return light_calls


def test_the_hybrid_gemm_matches_the_reference():
    # W = 3: two peers met in rounds and the own chunk. Each rank's calls include some with light experts (the real
    # launch ran).
    assert all(light_calls > 0 for light_calls in spawn(_hybrid_ranks, 3, "gloo", env={"TRITON_INTERPRET": "1"}))


class _Graphs:
    """``CallGraphs``' surface: the second call of a signature "captures" (issues) and "replays"; counts both."""

    def __init__(self):
        self.seen, self.replays, self.signatures = {}, 0, []

    def run(self, signature, issue):
        self.signatures.append(signature)
        self.seen[signature] = self.seen.get(signature, 0) + 1
        if self.seen[signature] < 2:
            return False
        issue()
        self.replays += 1
        return True

    def clear(self):
        self.seen.clear()


def _replay_ranks(rank, world):
    """Bounded-mode calls with ``replay`` go through the communicator's graphs, issued into the outputs the
    signature names (zeroed inside the issued work, so a replayed graph zeroes them too), right on every call;
    exact-mode calls never do."""
    fake_cuda.install(wait_timeout_s=10.0)
    torch.set_num_threads(1)
    from flashoverlap.comm.expert import ExpertCall, ExpertPlan, expert_layout
    from flashoverlap.comm.expert.nccl import ExpertNcclCommunicator
    from flashoverlap.comm.expert.reference import ExpertReferenceCommunicator
    from flashoverlap.comm.protocol import CommGroup

    group = CommGroup.of(dist.group.WORLD, torch.device("cpu"))
    comm, reference = ExpertNcclCommunicator(group), ExpertReferenceCommunicator(group)
    comm.graphs, comm._graphed = (graphs := _Graphs()), True  # a GPU's graphs, stood in for on the CPU
    # The caching allocator's reuse, as a repeated call sees it: the n-th buffer of a call at the previous call's
    # n-th buffer's address, NaN-poisoned again (zeroed where the communicator asks).
    buffers, allocated = {}, [0]

    def new(shape, dtype, zero=False):
        allocated[0] += 1
        buffer = buffers.setdefault((tuple(shape), dtype, allocated[0]), torch.empty(shape, dtype=dtype))
        return buffer.fill_(0.0 if zero else float("nan"))

    def run(call):
        allocated[0] = 0
        return comm.run(call)

    comm._new = new
    experts, hidden = LOCAL * world, 24
    gen = torch.Generator().manual_seed(rank)
    tokens, idx = _routing("skewed", rank, world, gen)
    bound = (7 + 3 * (world - 1)) * TOP_K
    results = []
    for mode in ("bounded", "exact"):
        layout = expert_layout(idx, experts, group, mode=mode, bound=bound if mode == "bounded" else None)
        x = torch.randn(tokens, hidden, generator=gen)
        w_up = torch.randn(LOCAL, 2 * FFN, hidden, generator=gen).transpose(1, 2)
        w_down = torch.randn(LOCAL, FFN, hidden, generator=gen)
        act = torch.randn(layout.recv_rows, FFN, generator=gen)
        before = graphs.replays
        for _ in range(3):
            plan = ExpertPlan("dispatch", world, experts, hidden, 2 * FFN, TOP_K, tokens, mode,
                              bound if mode == "bounded" else None, "cublas")
            call = ExpertCall("moe_dispatch_gemm", plan, x, w_up, return_gathered=True, layout=layout, replay=True)
            got, want = run(call), reference.run(call)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
            plan = ExpertPlan("combine", world, experts, hidden, FFN, TOP_K, tokens, mode,
                              bound if mode == "bounded" else None, "cublas")
            call = ExpertCall("moe_gemm_combine", plan, act, w_down, return_gathered=True, layout=layout, replay=True)
            got, want = run(call), reference.run(call)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        results.append(graphs.replays - before)
    return results


def test_bounded_calls_replay_and_exact_ones_do_not():
    # dispatch and combine, three calls each: the second and third replay in bounded mode; exact mode never.
    assert spawn(_replay_ranks, 2, "gloo") == [[4, 0], [4, 0]]


class _HeldGraphs:
    """``CallGraphs`` as the lane uses it, on the CPU: a signature's second call captures (its issue kept, and run
    again at each replay, so a replay computes the values a GPU graph would); ``replay`` of a signature with no
    capture answers False."""

    def __init__(self):
        self.seen, self.held, self.replays = {}, {}, 0

    def __len__(self):
        return len(self.held)

    def replay(self, signature):
        issue = self.held.get(signature)
        if issue is None:
            return False
        issue()
        self.replays += 1
        return True

    def run(self, signature, issue):
        if self.replay(signature):
            return True
        self.seen[signature] = self.seen.get(signature, 0) + 1
        if self.seen[signature] < 2:
            return False
        self.held[signature] = issue
        return self.replay(signature)

    def clear(self):
        self.seen.clear()
        self.held.clear()


def _lane_ranks(rank, world):
    """The NCCL expert communicator's replay lane (``contract.replayer``): built from a bounded call that may replay,
    given the next call's spec (the same tensors, the caching allocator's addresses), it makes the call's router
    weights and outputs in the call's order and replays the very graph ``run`` captured (dispatch and combine,
    weighted or not, into a preallocated ``out`` or not, returning the extra rows or not), right values each time;
    it answers None once the graph is gone, and none is built for exact mode."""
    import types

    fake_cuda.install(wait_timeout_s=10.0)
    torch.set_num_threads(1)
    from flashoverlap.comm.expert import ExpertCall, ExpertPlan, expert_layout
    from flashoverlap.comm.expert.nccl import ExpertNcclCommunicator
    from flashoverlap.comm.expert.reference import ExpertReferenceCommunicator
    from flashoverlap.comm.protocol import CommGroup

    group = CommGroup.of(dist.group.WORLD, torch.device("cpu"))
    comm, reference = ExpertNcclCommunicator(group), ExpertReferenceCommunicator(group)
    comm.graphs, comm._graphed = (graphs := _HeldGraphs()), True
    buffers, allocated = {}, [0]  # the caching allocator's reuse, call after call (as in _replay_ranks)

    def new(shape, dtype, zero=False):
        allocated[0] += 1
        buffer = buffers.setdefault((tuple(shape), dtype, allocated[0]), torch.empty(shape, dtype=dtype))
        return buffer.fill_(0.0 if zero else float("nan"))

    comm._new = new
    gathered = {}  # Layout.with_weights' gather at one address call after call, as the caching allocator gives it
    real_index_select = torch.Tensor.index_select

    def index_select(self, dim, index):
        out = gathered.setdefault((self.shape, index.shape, self.dtype), torch.empty(index.shape, dtype=self.dtype))
        return torch.index_select(self, dim, index, out=out) if self.ndim == 1 else real_index_select(self, dim, index)

    torch.Tensor.index_select = index_select
    experts, hidden = LOCAL * world, 24
    gen = torch.Generator().manual_seed(rank)
    tokens, idx = _routing("skewed", rank, world, gen)
    bound = (7 + 3 * (world - 1)) * TOP_K
    router = torch.rand(tokens, TOP_K, generator=gen)
    layout = expert_layout(idx, experts, group, mode="bounded", bound=bound)
    x = torch.randn(tokens, hidden, generator=gen)
    w_up = torch.randn(LOCAL, 2 * FFN, hidden, generator=gen).transpose(1, 2)
    w_down = torch.randn(LOCAL, FFN, hidden, generator=gen)
    act = torch.randn(layout.recv_rows, FFN, generator=gen)
    out = torch.empty(tokens, hidden)
    failures = []
    cases = [("dispatch", True, True, False), ("dispatch", False, True, False), ("combine", True, True, False),
             ("combine", False, False, False), ("combine", True, True, True)]
    for op, gathered_rows, weighted, into_out in cases:
        plan = ExpertPlan(op, world, experts, hidden, 2 * FFN if op == "dispatch" else FFN, TOP_K, tokens, "bounded",
                          bound, "cublas", weighted=weighted if op == "combine" else True)
        rows, b = (x, w_up) if op == "dispatch" else (act, w_down)
        call_layout = layout.with_weights(router) if op == "combine" and weighted else layout
        call = ExpertCall(f"moe {op}", plan, rows, b, return_gathered=gathered_rows, layout=call_layout, replay=True,
                          out=out if into_out else None)
        spec = types.SimpleNamespace(layout=layout, topk_weights=router, out=out if into_out else None)
        lane = None
        for i in range(4):
            allocated[0] = 0
            if i < 2:
                got = comm.run(call)
                if i == 1:
                    lane = comm.replayer(call)
                continue
            before = graphs.replays
            got = lane(spec)
            if got is None or graphs.replays != before + 1:
                failures.append(f"{op} {gathered_rows} {weighted} {into_out}: the lane found no graph")
                break
            want = reference.run(call)
            for g, w in zip(got, want):
                if (g is None) != (w is None) or g is not None and not torch.allclose(g, w, atol=1e-4, rtol=1e-4):
                    failures.append(f"{op} {gathered_rows} {weighted} {into_out}: wrong values")
            if into_out and got[0] is not out:
                failures.append("a combine into out did not return out")
        graphs.clear()
        allocated[0] = 0
        if lane is not None and lane(spec) is not None:
            failures.append(f"{op}: a lane whose graph is gone answered")
    exact = expert_layout(idx, experts, group, mode="exact")
    plan = ExpertPlan("dispatch", world, experts, hidden, 2 * FFN, TOP_K, tokens, "exact", None, "cublas")
    if comm.replayer(ExpertCall("moe dispatch", plan, x, w_up, layout=exact, replay=True)) is not None:
        failures.append("exact mode built a lane")
    torch.Tensor.index_select = real_index_select
    return failures


def test_the_replay_lane_finds_the_graph_run_captured():
    assert spawn(_lane_ranks, 2, "gloo") == [[], []]
