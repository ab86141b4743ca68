"""The expert-parallel (MoE) communicators' mechanics on ONE GPU shared by two processes: a correctness check where
no two-GPU machine is at hand, not a performance figure (the two ranks share one GPU's SMs and copy engines).

- P2P path (``comm/expert/p2p.py``), W = 2: PyTorch's symmetric memory and NCCL refuse two ranks on one GPU, so the
  group is gloo, the workspace is shared by CUDA IPC (``p2p_one_gpu.IpcWorkspace``) and the communicator is called
  directly with ``ExpertCall``s; the layouts are the real ``expert_layout`` with its one all-gather routed through
  the host (gloo takes CPU tensors). Exact and bounded mode, the grouped GEMMs (Triton, cuBLAS, loop; in exact mode
  also the hybrid, with every expert light or heavy at the default threshold and with a low one that mixes them,
  its dispatch called with and without the received rows returned), bf16
  and fp16, skewed and balanced routing, a rank that sends none, one that receives none, the backward variants
  (per-choice dispatch, unweighted combine), eager calls (a weight-gradient hook held in the graph), bounded calls
  replayed from the communicator's own CUDA graphs, and bounded calls captured in a user's CUDA graph and replayed
  with NEW routing copied into the layout's tensors (nothing in bounded mode depends on the host).
- NCCL path (``comm/expert/nccl.py``): NCCL refuses two ranks on one GPU, so its transfers cannot run here. What
  runs is its W = 1 case on a one-rank NCCL group per process: the own-chunk GEMMs, combine's signalling grouped GEMM
  with its flag waited for by ``cuStreamWaitValue32`` and reset, exact and bounded, eager and in a user's CUDA graph.

Every rank makes every rank's inputs from seeds and computes the expected results locally, from the definition
(``comm/expert/contract.py``'s docstring: rows in stable expert order per source, fp32 accumulation), not from any
communicator. Every output is checked, then poisoned with NaN, and the communicators' outputs start NaN, so an
element never written shows. Host time to issue one call (GPU busy ahead) is printed for P2P eager and replayed
beside ``torch._grouped_mm`` alone on the same rows.

Host time per layer call (rows ``{op: "layer", path, mode, replayed, gemm, host_us, plain_us, ratio, syncs,
plain_syncs}``: ``syncs`` the synchronising CUDA calls of one eager call, none allowed in bounded mode), issue 20's
target: at most 1.5x the plain layer's): one layer of ours as ``ExpertParallelMLP`` runs it below the public op
(``expert_layout``, the dispatch communicator run, SwiGLU, the router weights in send order, the combine
communicator run; the grouped GEMM the runtime's policy chooses), exact, bounded eager and bounded replayed, beside
the plain layer (``plain_layer``: the counts' ``all_to_all_single`` and one host synchronisation, the rows'
``all_to_all_single``, ``torch._grouped_mm`` up, SwiGLU, ``torch._grouped_mm`` down, the reverse
``all_to_all_single``, the weighted sum) on a one-rank NCCL group per process (NCCL refuses two ranks on one GPU; a
one-rank group issues the same host work), timed interleaved (``host_us_interleaved``) with the GPU idle before each
call, since both synchronise with the host. Our layout's all-gather is issued as on NCCL: this rank's part through
the one-rank group, the peer's part copied from a real exchange recorded first (``LayoutExchange``). Both layers
are checked against the definition once; a cProfile of ten eager calls of ours is printed per mode.

CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \
    torchrun --nproc-per-node 2 -m benchmarks.diagnostics.moe_one_gpu [out.json]
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.diagnostics.p2p_one_gpu import IpcWorkspace, close_run, open_run
from benchmarks.diagnostics.results_file import require_cuda
from benchmarks.harness.timing import host_us, host_us_interleaved
from benchmarks.shared.experts import Routing as SharedRouting
from flashoverlap.comm.collectives import all_gather_into_tensor
from flashoverlap.comm.expert import ExpertCall, ExpertPlan, HybridCut, expert_layout
from flashoverlap.comm.expert import layout as expert_module
from flashoverlap.comm.expert.nccl import ExpertNcclCommunicator
from flashoverlap.comm.expert.p2p import ExpertP2PCommunicator
from flashoverlap.comm.protocol import CommGroup
from flashoverlap.comm.replay import Matmul
from flashoverlap.runtime.experts import choose_gemm
from flashoverlap.testing import host_synchronisations
from flashoverlap.tune.grouped import HYBRID_CUT

# (name, tokens of rank s, hidden, ffn, experts, top_k, routing)
CASES = [
    ("odd-skewed", lambda s: 333 + 7 * s, 520, 264, 8, 2, "skewed"),
    ("round-balanced", lambda s: 2048, 1024, 512, 16, 4, "balanced"),
    ("rank1-sends-none", lambda s: 0 if s == 1 else 300, 256, 128, 4, 2, "balanced"),
    ("rank0-receives-none", lambda s: 301 + s, 256, 128, 4, 2, "avoid-rank0"),
]
_ORIGINAL_ALL_GATHER = expert_module.all_gather_into_tensor


def _all_gather_through_host(out, inp, group, async_op=False):
    """``expert_layout``'s one all-gather: gloo takes CPU tensors; a one-rank NCCL group goes as it is."""
    if dist.get_backend(group) != "gloo":
        return _ORIGINAL_ALL_GATHER(out, inp, group, async_op)
    cpu = torch.empty(out.shape, dtype=out.dtype)
    all_gather_into_tensor(cpu, inp.cpu(), group)
    out.copy_(cpu)


expert_module.all_gather_into_tensor = _all_gather_through_host


def inputs(case, world, dtype, seed):
    """Every rank's (topk_idx, topk_weights, x, w_up [L, H, 2F] (a transposed view), w_down [L, F, H] (a view))."""
    _, tokens, hidden, ffn, experts, top_k, routing = case
    local = experts // world
    out = []
    for s in range(world):
        gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + s)
        t = tokens(s)
        keys = -torch.log(-torch.log(torch.rand(t, experts, device="cuda", generator=gen).clamp(1e-9, 1 - 1e-9)))
        if routing == "skewed":  # Zipf(1.2) expert popularity, sampled without replacement (Gumbel top-k)
            keys = keys + torch.log(1.0 / torch.arange(1, experts + 1, device="cuda") ** 1.2)
        elif routing == "avoid-rank0":
            keys[:, :local] = float("-inf")
        idx = keys.topk(top_k, dim=1).indices if t else torch.empty((0, top_k), dtype=torch.int64, device="cuda")
        weights = torch.rand(t, top_k, device="cuda", generator=gen)
        x = torch.randn(t, hidden, device="cuda", generator=gen).to(dtype)
        w_up = (torch.randn(local, 2 * ffn, hidden, device="cuda", generator=gen) / hidden**0.5).to(dtype)
        w_down = (torch.randn(local, hidden, ffn, device="cuda", generator=gen) / ffn**0.5).to(dtype)
        out.append((idx, weights, x, w_up.transpose(1, 2), w_down.transpose(1, 2)))
    return out


class Routing(SharedRouting):
    """The definition of the expert calls (comm/expert/contract.py), computed from every rank's routing (the chunks,
    offsets and segments: ``benchmarks/shared/experts.Routing``), with what this diagnostic also checks: the received
    rows of dispatch and the returned rows of combine, per-choice rows, and combine unweighted."""

    def dispatch(self, r, xs, w_up, per_choice=False):
        """(h [R, N], received rows [R, H]) of rank r."""
        x0 = xs[0]
        recv = torch.zeros(self.recv_rows(r), x0.shape[1], dtype=x0.dtype, device="cuda")
        h = torch.zeros(self.recv_rows(r), w_up.shape[2], dtype=x0.dtype, device="cuda")
        for s in range(self.world):
            j = self.chosen[s][r]
            rows = xs[s][j if per_choice else torch.div(j, self.top_k, rounding_mode="floor")]
            at = self.recv_at(r, s)
            recv[at : at + len(j)] = rows
            for first, last, e in self.segments(s, r):
                h[at + first : at + last] = (rows[first:last].float() @ w_up[e].float()).to(x0.dtype)
        return h, recv

    def combine(self, r, acts, w_downs, weights, tokens, weighted=True):
        """(out [T, H], returned rows [S, H]) of rank r, from every rank's activations and w_down."""
        dtype, hidden = acts[0].dtype, w_downs[0].shape[2]
        capacity = self.world * self.bound if self.mode == "bounded" else tokens * self.top_k
        back = torch.zeros(capacity, hidden, dtype=dtype, device="cuda")
        out = torch.zeros(tokens, hidden, dtype=torch.float32, device="cuda")
        for d in range(self.world):
            j = self.chosen[r][d]
            at = self.recv_at(d, r)
            y = torch.zeros(len(j), hidden, dtype=dtype, device="cuda")
            for first, last, e in self.segments(r, d):
                y[first:last] = (acts[d][at + first : at + last].float() @ w_downs[d][e].float()).to(dtype)
            back[self.send_at(r, d) : self.send_at(r, d) + len(j)] = y
            scale = weights.reshape(-1)[j].float()[:, None] if weighted else 1.0
            out.index_add_(0, torch.div(j, self.top_k, rounding_mode="floor"), y.float() * scale)
        return out.to(dtype), back


def check(got, want, what, limit=None):
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: shape {list(got.shape)}, expected {list(want.shape)}")
    if got.numel() == 0:
        return
    nan = bool(torch.isnan(got).any())
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    if limit is None:
        limit = 1e-2 if got.dtype == torch.bfloat16 else 2e-3
    if nan or err >= limit:
        raise AssertionError(f"{what}: nan={nan} rel_err={err:.2e}")


def poisoned(shape, dtype, zero=False):
    buffer = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    return buffer.zero_() if zero else buffer


def activations(routing, world, ffn, dtype, seed):
    out = []
    for d in range(world):
        gen = torch.Generator(device="cuda").manual_seed(seed * 7919 + d)
        out.append(torch.randn(routing.recv_rows(d), ffn, device="cuda", generator=gen).to(dtype))
    return out


# The hybrid GEMM's heavy threshold lowered, so that these small cases mix heavy and light experts (at the
# policy's, every expert here is one or the other).
LOW_HEAVY_CUT = HybridCut(heavy_rows=150, light_flat_rows=HYBRID_CUT.light_flat_rows)


def cut_of(gemm, cut=None):
    """The plan's hybrid cut for ``gemm``: ``cut`` (default the policy's) for the hybrid, None for the others."""
    return (cut or HYBRID_CUT) if gemm == "hybrid" else None


def one_config(comm, group, rank, world, case, mode, gemm, dtype, seed, replay, report, variant=False, cut=None):
    """Dispatch then combine of one configuration (a few calls each), every output checked; ``cut``: the hybrid's
    (default the policy's)."""
    name, tokens, hidden, ffn, experts, top_k, _ = case
    local = experts // world
    everyone = inputs(case, world, dtype, seed)
    idx, weights, x, w_up, w_down = everyone[rank]
    bound = max(tokens(s) for s in range(world)) * top_k if mode == "bounded" else None
    bound = max(bound, 1) if bound is not None else None
    routing = Routing([e[0] for e in everyone], world, local, mode, bound)
    layout = expert_layout(idx, experts, group, mode=mode, bound=bound)
    per_choice = variant  # combine's backward: one row per choice
    xs = [e[2].repeat_interleave(top_k, 0) if per_choice else e[2] for e in everyone]
    want_h, want_recv = routing.dispatch(rank, xs, w_up, per_choice)
    plan = ExpertPlan("dispatch", world, experts, hidden, 2 * ffn, top_k, tokens(rank), mode, bound, gemm,
                      per_choice=per_choice, hybrid=cut_of(gemm, cut))
    what = f"{type(comm).__name__} {name} {mode} {gemm} {dtype} replay={replay} variant={variant}"
    hook_x = torch.randn(hidden, 64, dtype=dtype, device="cuda")
    hook_y = torch.randn(64, 96, dtype=dtype, device="cuda")
    for call in range(4 if replay else 2):
        hook_x.normal_()
        grad = torch.full((hidden, 96), float("nan"), dtype=dtype, device="cuda")
        gathered = gemm != "hybrid" or call == 0  # the hybrid copies the own chunk among the received rows anyway
        h, recv = comm.run(ExpertCall("moe_dispatch_gemm", plan, xs[rank], w_up, gathered,
                                      Matmul(hook_x, hook_y, grad), replay=replay, layout=layout))
        torch.cuda.synchronize()
        check(h, want_h, f"{what} dispatch #{call}")
        if gathered:
            check(recv, want_recv, f"{what} received rows #{call}")
            recv.fill_(float("nan"))
        check(grad, hook_x @ hook_y, f"{what} hook #{call}")
        h.fill_(float("nan"))
        report["checked"] += 1
    acts = activations(routing, world, ffn, dtype, seed)
    w_downs = [e[4] for e in everyone]
    weighted = not variant  # dispatch's backward: the unweighted sum
    want_out, want_back = routing.combine(rank, acts, w_downs, weights, tokens(rank), weighted)
    plan = ExpertPlan("combine", world, experts, hidden, ffn, top_k, tokens(rank), mode, bound, gemm,
                      weighted=weighted, hybrid=cut_of(gemm, cut))
    call_layout = layout.with_weights(weights) if weighted else layout
    for call in range(4 if replay else 2):
        out, back = comm.run(ExpertCall("moe_gemm_combine", plan, acts[rank], w_down, True, replay=replay,
                                        layout=call_layout))
        torch.cuda.synchronize()
        check(out, want_out, f"{what} combine #{call}")
        check(back, want_back, f"{what} returned rows #{call}")
        out.fill_(float("nan")), back.fill_(float("nan"))
        report["checked"] += 1


def captured(comm, group, rank, world, case, gemm, dtype, report):
    """Bounded dispatch and combine captured in a user's CUDA graph, replayed with new routing, tokens, weights
    and activations copied into the captured tensors."""
    name, tokens, hidden, ffn, experts, top_k, _ = case
    local = experts // world
    bound = max(max(tokens(s) for s in range(world)) * top_k, 1)
    first = inputs(case, world, dtype, 500)
    idx, weights, x, w_up, w_down = first[rank]
    layout = expert_layout(idx, experts, group, mode="bounded", bound=bound)
    x_in, w_in = x.clone(), weights.clone()
    act_in = torch.randn(world * bound, ffn, dtype=dtype, device="cuda")
    plan_d = ExpertPlan("dispatch", world, experts, hidden, 2 * ffn, top_k, tokens(rank), "bounded", bound, gemm)
    plan_c = ExpertPlan("combine", world, experts, hidden, ffn, top_k, tokens(rank), "bounded", bound, gemm)
    # Eagerly once (first calls of the shape load kernels and size the workspace), then captured.
    comm.run(ExpertCall("dispatch", plan_d, x_in, w_up, layout=layout))
    comm.run(ExpertCall("combine", plan_c, act_in, w_down, layout=layout.with_weights(w_in)))
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        h, recv = comm.run(ExpertCall("dispatch", plan_d, x_in, w_up, True, layout=layout))
        out, back = comm.run(ExpertCall("combine", plan_c, act_in, w_down, True, layout=layout.with_weights(w_in)))
    torch.cuda.current_stream().wait_stream(side)
    for replay in range(3):
        everyone = inputs(case, world, dtype, 600 + replay)
        new = expert_layout(everyone[rank][0], experts, group, mode="bounded", bound=bound)
        for mine, theirs in zip(layout.tensors(), new.tensors()):
            mine.copy_(theirs)
        x_in.copy_(everyone[rank][2])
        w_in.copy_(everyone[rank][1])
        routing = Routing([e[0] for e in everyone], world, local, "bounded", bound)
        acts = activations(routing, world, ffn, dtype, 700 + replay)
        act_in.copy_(acts[rank])
        for t in (h, recv, out, back):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want_h, want_recv = routing.dispatch(rank, [e[2] for e in everyone], w_up)
        # The weights are the captured ones (the first inputs'); tokens, routing and activations are new.
        want_out, want_back = routing.combine(rank, acts, [e[4] for e in first], everyone[rank][1], tokens(rank))
        what = f"{type(comm).__name__} {name} bounded {gemm} {dtype} user graph replay {replay}"
        check(h, want_h, what + " dispatch")
        check(recv, want_recv, what + " received rows")
        check(out, want_out, what + " combine")
        check(back, want_back, what + " returned rows")
        report["checked"] += 1
    del graph


def plain_layer(x, topk_idx, topk_weights, w_up, w_down, group):
    """The plain expert-parallel layer users run today, on ``group`` (here a one-rank NCCL group: NCCL takes one rank
    per GPU, and a one-rank group issues the same host work): the per-expert counts' ``all_to_all_single`` and one
    host synchronisation (the split sizes), the rows in send order, ``all_to_all_single`` of the rows, regrouped by
    expert, ``torch._grouped_mm`` (gate and up fused), SwiGLU, ``torch._grouped_mm``, back to (source, expert)
    order, the reverse ``all_to_all_single``, the router-weighted sum. ``topk_idx`` indexes the group's
    ``W * L`` experts (``L = w_up.shape[0]``)."""
    world, local, ffn = dist.get_world_size(group), w_up.shape[0], w_down.shape[1]
    tokens, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # Counted without a host synchronisation (CUDA's bincount reads the indices' min and max back), so that the
    # plain layer's one synchronisation is the split sizes', as in Megatron's dispatcher.
    counts = torch.zeros(world * local, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    totals = torch.cat([counts.view(world, local).sum(1), recv_counts.view(world, local).sum(1)]).tolist()
    send_splits, recv_splits = totals[:world], totals[world:]
    received = sum(recv_splits)
    token = torch.div(order, k, rounding_mode="floor")
    x_recv = x.new_empty((received, x.shape[1]))
    dist.all_to_all_single(x_recv, x.index_select(0, token), recv_splits, send_splits, group=group)
    per_segment = recv_counts.view(world, local).reshape(-1)
    row_expert = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(world), per_segment,
                                         output_size=received)
    perm = torch.argsort(row_expert, stable=True)
    offs = torch.cumsum(recv_counts.view(world, local).sum(0), 0).to(torch.int32)
    h = torch._grouped_mm(x_recv.index_select(0, perm), w_up, offs=offs)
    a = F.silu(h[:, :ffn]) * h[:, ffn:]
    y = torch._grouped_mm(a, w_down, offs=offs).index_select(0, torch.argsort(perm))
    y_back = y.new_empty((tokens * k, y.shape[1]))
    dist.all_to_all_single(y_back, y, send_splits, recv_splits, group=group)
    weighted = y_back * topk_weights.reshape(-1).index_select(0, order)[:, None].to(y_back.dtype)
    return torch.zeros_like(x).index_add(0, token, weighted)


def expected_plain(x, topk_idx, topk_weights, w_up, w_down):
    """The plain layer's result on one rank, from the definition: ``y[t] = sum_c w[t, c] * expert(x[t])``."""
    ffn = w_down.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_up.shape[0]):
        token, choice = torch.nonzero(topk_idx == e, as_tuple=True)
        if token.numel():
            h = (x[token].float() @ w_up[e].float()).to(x.dtype)
            a = F.silu(h[:, :ffn]) * h[:, ffn:]
            y = (a.float() @ w_down[e].float()).to(x.dtype)
            out.index_add_(0, token, y.float() * topk_weights[token, choice, None].float())
    return out.to(x.dtype)


class LayoutExchange:
    """``expert_layout``'s one all-gather as a layer on an NCCL group issues it, for the timed layer calls: this
    rank's part through the one-rank NCCL group, the peers' parts copied from a real exchange (through the host, on
    gloo) recorded first, so the layout is the real one and the host work is one NCCL collective and a copy."""

    def __init__(self, solo, rank, world):
        self.solo, self.rank, self.world = solo, rank, world
        self.recorded = {}
        self.key, self.record = None, True  # the layout's mode; record the real exchange (else replay it)

    def __call__(self, out, inp, group, async_op=False):
        if self.record:
            _all_gather_through_host(out, inp, group)
            self.recorded[self.key] = out.clone()
            return None
        rows, recorded = out.view(self.world, -1), self.recorded[self.key].view(self.world, -1)
        _ORIGINAL_ALL_GATHER(rows[self.rank].view(inp.shape), inp, self.solo)
        for peer in range(self.world):
            if peer != self.rank:
                rows[peer].copy_(recorded[peer])
        return None


def host_syncs(fn, warm=1):
    """``testing.host_synchronisations`` of one call of ``fn``, after ``warm`` warm-up calls. Each is a wait for
    this process's queue, and on a GPU shared by two processes possibly for the peer's time slice."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    found = host_synchronisations(fn)
    torch.cuda.synchronize()
    return found


def layer_rows(comm, group, solo, rank, world, case, idx, weights, x, w_up, w_down, everyone):
    """Host time per layer call, ours (the P2P path as ``ExpertParallelMLP`` runs it below the public op: the
    layout, the dispatch communicator run, SwiGLU, the router weights in send order, the combine communicator run)
    beside the plain layer (``plain_layer`` on the one-rank NCCL group ``solo``), interleaved in one run. Timed with
    the GPU idle before each call (``sleep_cycles=0``): both layers synchronise with the host once in exact mode
    (the plain layer in every mode), which would otherwise wait out a sleep queued ahead. Each layer is checked
    once against the definition first."""
    import cProfile
    import io
    import pstats

    _, tokens, hidden, ffn, experts, top_k, _ = case
    local = experts // world
    bound = tokens(0) * top_k
    dtype = x.dtype
    capability = torch.cuda.get_device_capability()
    # The plain layer on its one-rank group: this rank's tokens to its own L experts (the same rows and GEMMs).
    plain_idx = idx % local
    want = expected_plain(x, plain_idx, weights, w_up, w_down)
    # The plain layer sums each token's k rows in bf16 (as users' code does): a looser limit than fp32 sums get.
    check(plain_layer(x, plain_idx, weights, w_up, w_down, solo), want, "plain layer", limit=3e-2)
    exchange = LayoutExchange(solo, rank, world)
    poisoning = comm.__dict__.pop("_new", None)  # the communicator's own outputs here, not NaN-filled ones
    rows = []
    for mode in ("exact", "bounded"):
        mode_bound = bound if mode == "bounded" else None
        chosen = (choose_gemm(mode, local, tokens(rank) * top_k, hidden, 2 * ffn, dtype, capability, world),
                  choose_gemm(mode, local, tokens(rank) * top_k, ffn, hidden, dtype, capability, world))
        # The runtime's choice, and beside it the other of Triton and cuBLAS for both projections: what the choice
        # costs or saves in host time (a Triton grouped GEMM costs more host time than cuBLAS's).
        variants = [chosen, ("triton", "triton") if chosen == ("cublas", "cublas") else ("cublas", "cublas")]
        plans = {pair: (ExpertPlan("dispatch", world, experts, hidden, 2 * ffn, top_k, tokens(rank), mode, mode_bound,
                                   pair[0], hybrid=cut_of(pair[0])),
                        ExpertPlan("combine", world, experts, hidden, ffn, top_k, tokens(rank), mode, mode_bound,
                                   pair[1], hybrid=cut_of(pair[1])))
                 for pair in variants}
        exchange.key, exchange.record = mode, True
        expert_module.all_gather_into_tensor = exchange
        try:
            expert_layout(idx, experts, group, mode=mode, bound=mode_bound)  # records the real exchange
            exchange.record = False

            def ours(replay, pair=chosen, mode=mode, mode_bound=mode_bound, plans=plans):
                plan_d, plan_c = plans[pair]
                layout = expert_layout(idx, experts, group, mode=mode, bound=mode_bound)
                h, _ = comm.run(ExpertCall("moe_dispatch_gemm", plan_d, x, w_up, layout=layout, replay=replay))
                a = F.silu(h[:, :ffn]) * h[:, ffn:]
                y, _ = comm.run(ExpertCall("moe_gemm_combine", plan_c, a, w_down, layout=layout.with_weights(weights),
                                           replay=replay))
                return y

            def plain():
                return plain_layer(x, plain_idx, weights, w_up, w_down, solo)

            routing = Routing([e[0] for e in everyone], world, local, mode, mode_bound)
            acts = []
            for d in range(world):
                h_d, _ = routing.dispatch(d, [e[2] for e in everyone], everyone[d][3])
                acts.append(F.silu(h_d[:, :ffn]) * h_d[:, ffn:])
            want_y, _ = routing.combine(rank, acts, [e[4] for e in everyone], weights, tokens(rank))
            sites = {"plain": host_syncs(plain)}
            for pair in variants:
                check(ours(False, pair), want_y, f"layer {mode} {pair}")
                sites[pair] = host_syncs(lambda pair=pair: ours(False, pair))
            if rank == 0:
                print(f"== host synchronisations per eager layer call, {mode}: {sites}", flush=True)
            syncs = {key: len(found) for key, found in sites.items()}
            for pair in variants:
                if mode == "bounded" and syncs[pair]:
                    raise AssertionError(f"layer bounded {pair}: {syncs[pair]} host synchronisation(s) per eager "
                                         "call, expected none (comm/expert/contract.py's claim)")
            # A replayed call's (its graph captured on the second call: three warm-up calls).
            replay_syncs = ({pair: len(host_syncs(lambda pair=pair: ours(True, pair), warm=3)) for pair in variants}
                            if mode == "bounded" else {})
            for replay in (False, True) if mode == "bounded" else (False,):
                fns = {"+".join(pair): (lambda replay=replay, pair=pair: ours(replay, pair)) for pair in variants}
                fns["plain"] = plain
                for _ in range(3):  # kernels loaded, graphs captured: the timed calls are the steady ones
                    for fn in fns.values():
                        fn()
                us = host_us_interleaved(fns, calls=40, sleep_cycles=0)
                for pair in variants:
                    rows.append({"op": "layer", "path": "p2p", "mode": mode, "replayed": replay, "gemm": list(pair),
                                 "chosen": pair == chosen, "host_us": round(us["+".join(pair)], 1),
                                 "plain_us": round(us["plain"], 1),
                                 "ratio": round(us["+".join(pair)] / us["plain"], 2),
                                 "syncs": replay_syncs[pair] if replay else syncs[pair],
                                 "replay_syncs_counted": True, "plain_syncs": syncs["plain"]})
            profile = cProfile.Profile()
            for _ in range(10):
                dist.barrier()
                torch.cuda.synchronize()
                profile.enable()
                ours(False)
                profile.disable()
            torch.cuda.synchronize()
            if rank == 0:
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
                print(f"== eager layer, {mode}: cProfile of 10 calls\n" + "\n".join(
                    line for line in text.getvalue().splitlines() if line.strip()), flush=True)
            for name, fn in (("ours", lambda: ours(False)), ("plain", plain)):  # host time per torch op
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(10):
                        fn()
                torch.cuda.synchronize()
                if rank == 0:
                    averages = prof.key_averages()
                    launches = sorted(((e.count // 10, e.key) for e in averages if not e.key.startswith("cuda")
                                       and e.key.startswith("aten::") and e.count), reverse=True)
                    print(f"== eager layer, {mode}, {name}: torch.profiler, 10 calls, by self CPU time\n"
                          + averages.table(sort_by="self_cpu_time_total", row_limit=14)
                          + "\nper call: " + ", ".join(f"{key} {count}" for count, key in launches), flush=True)
        finally:
            expert_module.all_gather_into_tensor = _all_gather_through_host
    if poisoning is not None:
        comm._new = poisoning
    return rows


def host_rows(comm, group, solo, rank, world):
    """Host time to issue one call of the round case (GPU busy ahead), P2P eager and replayed, beside
    ``torch._grouped_mm`` alone on the rows this rank receives; and one layer call, ours beside the plain layer
    (``layer_rows``)."""
    case = CASES[1]
    _, tokens, hidden, ffn, experts, top_k, _ = case
    everyone = inputs(case, world, torch.bfloat16, 42)
    idx, weights, x, w_up, w_down = everyone[rank]
    bound = tokens(0) * top_k
    rows = []
    for mode in ("exact", "bounded"):
        layout = expert_layout(idx, experts, group, mode=mode, bound=bound if mode == "bounded" else None)
        plan = ExpertPlan("dispatch", world, experts, hidden, 2 * ffn, top_k, tokens(rank), mode,
                          bound if mode == "bounded" else None, "cublas")
        for replay in (False, True) if mode == "bounded" else (False,):
            call = ExpertCall("moe_dispatch_gemm", plan, x, w_up, layout=layout, replay=replay)
            us = host_us(lambda call=call: comm.run(call), calls=30)
            rows.append({"op": "dispatch", "path": "p2p", "mode": mode, "replayed": replay, "host_us": round(us, 1)})
    recv = torch.randn(layout.recv_rows, hidden, dtype=torch.bfloat16, device="cuda")
    ends = layout.recv_seg_ends[-(experts // world):].contiguous()
    mm_us = host_us(lambda: torch._grouped_mm(recv, w_up, offs=ends), calls=30)
    rows.append({"op": "torch._grouped_mm alone", "host_us": round(mm_us, 1)})
    rows += layer_rows(comm, group, solo, rank, world, case, idx, weights, x, w_up, w_down, everyone)
    return rows


def main():
    require_cuda("benchmarks.diagnostics.moe_one_gpu", path_only=True)
    rank, world, device, meta = open_run("moe_one_gpu")
    group = CommGroup.of(dist.group.WORLD, device)
    report = {"meta": meta, "checked": 0,
              "not_run": "the NCCL path's transfers (NCCL refuses two ranks on one GPU): only its W = 1 case ran, on a "
                         "one-rank NCCL group per process"}
    blocks = [torch.full((64 << 20,), float("nan"), dtype=torch.float16, device=device) for _ in range(4)]
    del blocks  # the caching allocator's free memory reads NaN: an unwritten element shows
    p2p = ExpertP2PCommunicator(group)
    p2p.workspace = IpcWorkspace(dist.group.WORLD, device)
    p2p._new = lambda shape, dtype: poisoned(shape, dtype)
    start = time.time()
    for i, case in enumerate(CASES):
        for mode in ("exact", "bounded"):
            for gemm in ("triton", "cublas", "loop", "hybrid") if mode == "exact" else ("triton", "cublas"):
                both = gemm in ("triton", "hybrid") and i < 2
                dtypes = (torch.bfloat16, torch.float16) if both else (torch.bfloat16,)
                for dtype in dtypes:
                    one_config(p2p, group, rank, world, case, mode, gemm, dtype, 10 * i + 1, False, report)
                    if mode == "bounded":
                        one_config(p2p, group, rank, world, case, mode, gemm, dtype, 10 * i + 2, True, report)
            if mode == "exact":
                one_config(p2p, group, rank, world, case, mode, "hybrid", torch.bfloat16, 10 * i + 4, False, report,
                           cut=LOW_HEAVY_CUT)
            one_config(p2p, group, rank, world, case, mode, "triton", torch.bfloat16, 10 * i + 3, False, report,
                       variant=True)
        print(f"rank {rank}: P2P {case[0]}: correct ({report['checked']} calls so far, {p2p.graphs.captures} "
              f"captures, {p2p.graphs.replays} replays, {time.time() - start:.0f} s)", flush=True)
    for gemm in ("triton", "cublas"):
        captured(p2p, group, rank, world, CASES[0], gemm, torch.bfloat16, report)
    print(f"rank {rank}: P2P bounded calls in a user's CUDA graph, new routing each replay: correct", flush=True)
    # A one-rank NCCL group per process (every process makes each, collectively): the plain layer's collectives in
    # the host rows, then the NCCL path's W = 1 case.
    solo = [dist.new_group([r], backend="nccl") for r in range(world)][rank]
    report["rows"] = host_rows(p2p, group, solo, rank, world)
    p2p.release()
    solo_group = CommGroup.of(solo, device)
    nccl = ExpertNcclCommunicator(solo_group)
    nccl._new = poisoned
    for i, case in enumerate(CASES[:2]):
        one_case = (case[0], lambda s, t=case[1]: t(rank), *case[2:])
        for mode in ("exact", "bounded"):
            for gemm in ("triton", "cublas", "loop", "hybrid") if mode == "exact" else ("triton", "cublas"):
                one_config(nccl, solo_group, 0, 1, one_case, mode, gemm, torch.bfloat16, 10 * i + 5, False, report)
            if mode == "exact":
                one_config(nccl, solo_group, 0, 1, one_case, mode, "hybrid", torch.bfloat16, 10 * i + 6, False,
                           report, cut=LOW_HEAVY_CUT)
    captured(nccl, solo_group, 0, 1, (CASES[0][0], lambda s: CASES[0][1](rank), *CASES[0][2:]), "triton",
             torch.bfloat16, report)
    print(f"rank {rank}: NCCL path at W = 1 (own chunks, signalling GEMM and its flags, a user's graph): correct",
          flush=True)
    nccl.release()
    close_run(report, rank)


if __name__ == "__main__":
    main()
