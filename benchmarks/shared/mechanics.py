"""Mechanics at W ranks on one GPU, through the public ops, layers and styles (the runtime's own workspace, plans,
agreement and replay): every case's values against the oracle each rank computes locally, outputs NaN-poisoned,
each case's replays counted.

Cases (``tp_cases``, ``moe_cases``, ``MODEL_CASES``):

- every tensor-parallel op x bf16/fp16 (fp8: tensor-, row-, block-wise) x ``b`` as ``w.t()`` and row-major, at three
  shapes: ``odd`` (odd M: all-reduce ``16 W + 3``, reduce-scatter and all-gather ``3 W``, a given P2P plan,
  ``path="p2p"``), ``bands`` (two sub-bands per rank block, the given plan with ``path="auto"``) and ``auto``
  (2048x4352x256: no plan, ``path="auto"``, the runtime's own plan, overlapped by the default rule); fp8 with ``b``
  as ``w.t()`` has bf16 output and a bias, row-major fp32 output; all_gather_gemm with ``w.t()`` returns the gathered
  input too (checked byte for byte);
- the expert ops (``moe_layout``, ``moe_dispatch_gemm``, ``moe_gemm_combine``, ``path="p2p"``): Zipf-skewed
  routing, exact and bounded, a rank with no tokens, a rank that receives none, bf16 and fp16; and in fp8 (family
  ``moe-fp8``, ``moe_fp8_cases``: the P2P expert path with fp8 tokens, activations and weights, row-wise ``[T, 1]``
  and block ``[T, H/128]`` scales, exact and bounded, the tokens fp8 or bf16 (the op quantising them), against the
  definition on the dequantised values);
- ``ExpertParallelMLP`` (exact, bounded) forward and backward against ``MoEBlock`` on every rank's tokens; the TP
  styles (``ColwiseParallel``/``RowwiseParallel`` with ``parallelize_module``, default and sequence-parallel layouts)
  and layers (``flashoverlap.nn.parallelize``, with and without sequence parallelism) on a SwiGLU feed-forward,
  forward and backward against the unsharded one (every op of it overlapped by the default plan: 2048 tokens,
  hidden 4352, 4352 FFN features per rank).

Modes (``CALLS`` calls each): ``eager`` (``FLASHOVERLAP_REPLAY=0``), ``replayed`` (the same tensors, new values
copied in before each call, inputs and oracles made before the first call: every repeated call should replay,
``calls - 1`` replays), ``graph`` (one eager call, then the call captured in a user's ``torch.cuda.graph`` and
replayed on new values). The expert
communicator replays bounded mode only (exact mode's sizes change with the routing): its exact-mode cases want 0.
"""

from __future__ import annotations

import copy
import gc
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.shared import calls as tc
from benchmarks.shared import experts as ex
from benchmarks.shared.runs import Progress, device_of, go_on, guarded, short, synchronize

# Calls per case: eager 2; replayed 4 (the first eager, then 3 replays); graph 1 eager, then 2 replays of the
# user's graph.
CALLS = {"eager": 2, "replayed": 4, "graph": 3}
MODES = ("eager", "replayed", "graph")
# Overlapped by the default P2P rule at W = 2, 4, 8 (M*N*2 >= 4 MB, >= 2 waves); K = 256: block-wise scales at K = 128
# ([M, 1] and [1, ceil(N/128)]) read as row-wise by their shapes, and are refused.
AUTO_SHAPE = (2048, 4352, 256)
# The feed-forward of the model cases: every op of its forward and backward overlapped by the default P2P plan at
# W = 2, 4, 8 (all-reduce and reduce-scatter of [S, H], all-gather of [S, F/W]).
MODEL_TOKENS, MODEL_HIDDEN, MODEL_FFN_PER_RANK = 2048, 4352, 4352
MODEL_CASES = ("styles", "styles-sequence-parallel", "layers", "layers-sequence-parallel", "expert-mlp-exact",
               "expert-mlp-bounded")
MODEL_TOLERANCE = 3e-2


@dataclass(frozen=True)
class TpCase:
    call: tc.TpCall
    path: str
    shape: str


def tp_cases(world: int, quick: bool = False) -> list[TpCase]:
    """Every tensor-parallel case at ``world`` ranks (``quick``: bf16 and row-wise fp8 at the odd shape only)."""
    cases = []
    seed = 0
    for op in tc.TP_OPS:
        fp8 = op in tc.FP8_OPS
        kind = tc.TP_OPS[op]
        dtypes = (("row",) if quick else tc.FP8_MODES) if fp8 else (("bf16",) if quick else tuple(tc.HALF))
        shapes = {
            "odd": ((16 * world + 3 if kind == "all_reduce" else 3 * world), 80, 512, "given", 1, "p2p"),
            "bands": ((64 * world + 5 if kind == "all_reduce" else 67 * world), 144, 256, "given", 2, "auto"),
            "auto": (*AUTO_SHAPE, "default", 1, "auto"),
        }
        if quick:
            shapes = {"odd": shapes["odd"]}
        for dtype in dtypes:
            for transposed in (True, False):
                for shape, (m, n, k, plan, bands, path) in shapes.items():
                    seed += 1
                    call = tc.TpCall(op, dtype, m, n, k, transposed, out="bf16" if transposed or not fp8 else "fp32",
                                     bias=fp8 and transposed, plan=plan, sub_bands=bands,
                                     gathered=op == "all_gather_gemm" and transposed, seed=seed)
                    cases.append(TpCase(call, path, shape))
    return cases


def moe_cases(world: int, quick: bool = False) -> list[ex.MoeCall]:
    """The expert cases: Zipf routing exact and bounded, bf16 and fp16, a rank with no tokens, one that receives
    none (``quick``: two of them)."""
    cases = [
        ex.MoeCall("bf16", "exact", tokens=37, local=2, top_k=2, hidden=64, ffn=48, seed=101),
        ex.MoeCall("bf16", "bounded", tokens=37, local=2, top_k=2, hidden=64, ffn=48, seed=102),
        ex.MoeCall("fp16", "exact", tokens=53, local=3, top_k=3, hidden=96, ffn=40, empty_rank=0, seed=103),
        ex.MoeCall("fp16", "bounded", tokens=53, local=3, top_k=3, hidden=96, ffn=40, empty_rank=0, seed=104),
        ex.MoeCall("bf16", "exact", tokens=29, local=2, top_k=2, hidden=64, ffn=32, avoid_rank=world - 1, seed=105),
        ex.MoeCall("bf16", "bounded", tokens=29, local=2, top_k=2, hidden=64, ffn=32, avoid_rank=world - 1,
                   seed=106),
    ]
    return cases[:2] if quick else cases


def moe_fp8_cases(world: int, quick: bool = False) -> list[ex.MoeCall]:
    """The fp8 expert cases (issue 44: the P2P expert path in fp8): row-wise and block-wise scales (block: H and F
    multiples of 128), exact and bounded, a rank with no tokens, one that receives none, and the dispatch's tokens in
    bf16 for the op to quantise (``quick``: one of each scaling, bounded, and one with bf16 tokens)."""
    cases = [
        ex.MoeCall("bf16", "exact", tokens=37, local=2, top_k=2, hidden=128, ffn=64, seed=201, scaling="row"),
        ex.MoeCall("bf16", "bounded", tokens=37, local=2, top_k=2, hidden=128, ffn=64, empty_rank=0, seed=202,
                   scaling="row"),
        ex.MoeCall("bf16", "exact", tokens=29, local=2, top_k=2, hidden=256, ffn=128, empty_rank=world - 1,
                   seed=203, scaling="block"),
        ex.MoeCall("bf16", "bounded", tokens=29, local=2, top_k=2, hidden=256, ffn=128, seed=204, scaling="block"),
        ex.MoeCall("bf16", "exact", tokens=21, local=3, top_k=3, hidden=96, ffn=48, avoid_rank=world - 1, seed=205,
                   scaling="row"),
        ex.MoeCall("bf16", "bounded", tokens=21, local=2, top_k=2, hidden=128, ffn=128, avoid_rank=world - 1,
                   seed=206, scaling="block"),
        ex.MoeCall("bf16", "exact", tokens=37, local=2, top_k=2, hidden=128, ffn=64, empty_rank=0, seed=207,
                   scaling="row", bf16_tokens=True),
        ex.MoeCall("bf16", "bounded", tokens=29, local=2, top_k=2, hidden=256, ffn=128, seed=208, scaling="block",
                   bf16_tokens=True),
    ]
    return [cases[1], cases[3], cases[7]] if quick else cases


# -- helpers -------------------------------------------------------------------------------------------------------


def set_replay(on: bool) -> None:
    """Replay on (the default) or off (``FLASHOVERLAP_REPLAY=0``), read again by the runtime."""
    from flashoverlap import settings

    if on:
        os.environ.pop("FLASHOVERLAP_REPLAY", None)
    else:
        os.environ["FLASHOVERLAP_REPLAY"] = "0"
    settings.refresh()


def poison(device: torch.device) -> None:
    """Fill free memory of the caching allocator with NaN, so that an output element never written shows."""
    if device.type == "cuda":
        blocks = [torch.full((8 << 20,), float("nan"), dtype=torch.float16, device=device) for _ in range(4)]
        del blocks


def replays(group, device: torch.device, kind: str = "gemm") -> int:
    """Graph replays of the group's ``(kind, "p2p")`` communicator so far (0 where it has none yet)."""
    from flashoverlap.runtime.context import existing_context

    context = existing_context(group if group is not None else dist.group.WORLD, device)
    comm = None if context is None else context.communicators.get((kind, "p2p"))
    graphs = getattr(comm, "graphs", None)
    return 0 if graphs is None else graphs.replays


class Tally:
    """A case's wrong values and worst relative error."""

    def __init__(self) -> None:
        self.checked, self.wrong, self.worst, self.notes = 0, 0, 0.0, []

    def check(self, got: torch.Tensor, want: torch.Tensor, limit: float, what: str, scratch=None) -> None:
        err = tc.relative_error(got, want, scratch)
        self.checked += 1
        self.worst = max(self.worst, err)
        if not err < limit:
            self.wrong += 1
            if len(self.notes) < 4:
                self.notes.append(f"{what}: relative error {err:.3g} (limit {limit:g}), shape {list(got.shape)} "
                                  f"vs {list(want.shape)}")

    def equal(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        self.checked += 1
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
            self.wrong += 1
            if len(self.notes) < 4:
                self.notes.append(f"{what}: differs from the gathered input")


def _row(case: str, op: str, dtype: str, mode: str, shape: str, tally: Tally, calls: int, replayed: int | None,
         wanted: int | None, error: str | None, seconds: float, **extra) -> dict:
    return {"case": case, "op": op, "dtype": dtype, "mode": mode, "shape": shape, "calls": calls,
            "checked": tally.checked, "wrong": tally.wrong, "worst_rel_err": round(tally.worst, 6)
            if tally.worst != float("inf") else "inf", "replays": replayed, "replays_wanted": wanted,
            "error": error, "notes": tally.notes or None, "seconds": round(seconds, 3), **extra}


# -- tensor-parallel cases ----------------------------------------------------------------------------------------


def run_tp(case: TpCase, mode: str, rank: int, world: int, device: torch.device, group) -> dict:
    call = case.call
    tally = Tally()
    start = time.perf_counter()
    cpu = device.type != "cuda"
    plan = None if cpu else tc.given_plan(call, world)
    path = "auto" if cpu else case.path
    state: dict = {"replays": None}
    n = CALLS[mode]

    def body():
        mine = tc.weights(call, world, rank, device)
        values, wants = [], []
        for i in range(n):
            everyone = [tc.operands(call, world, s, i, device) for s in range(world)]
            want, full = tc.oracle(call, everyone, rank)
            wants.append((want, full))
            values.append((everyone[rank].a, everyone[rank].scale_a))
            del everyone
        a = values[0][0].clone()
        scale_a = None if values[0][1] is None else values[0][1].clone()
        ops = tc.Operands(a, mine.b, scale_a, mine.scale_b, mine.bias)
        limit = tc.tolerance(call)
        scratch = torch.empty((call.out_rows(world), call.n), dtype=torch.float32, device=device)

        def load(i: int) -> None:
            ops.a.copy_(values[i][0])
            if ops.scale_a is not None:
                ops.scale_a.copy_(values[i][1])

        def verify(out, gathered, i: int, what: str) -> None:
            tally.check(out, wants[i][0], limit, what, scratch)
            if call.gathered:
                if gathered is None:
                    tally.wrong += 1
                    tally.notes.append(f"{what}: no gathered input returned")
                else:
                    tally.equal(gathered, wants[i][1], what)

        synchronize(device)
        if mode in ("eager", "replayed"):
            set_replay(mode == "replayed")
            poison(device)
            before = replays(group, device)
            for i in range(n):
                load(i)
                out, gathered = tc.invoke(call, ops, group, plan, path)
                verify(out, gathered, i, f"call {i}")
                if out.is_floating_point():
                    out.fill_(float("nan"))  # the next call's output gets this memory back
                del out, gathered
            synchronize(device)
            state["replays"] = replays(group, device) - before
            return
        # graph: one eager call, then the call captured in the user's graph and replayed on new values
        set_replay(False)
        load(0)
        out, gathered = tc.invoke(call, ops, group, plan, path)
        verify(out, gathered, 0, "eager call before capture")
        del out, gathered
        synchronize(device)
        poison(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, gathered = tc.invoke(call, ops, group, plan, path)
        for i in range(1, n):
            load(i)
            out.fill_(float("nan"))
            if gathered is not None:
                gathered.zero_()
            graph.replay()
            verify(out, gathered, i, f"graph replay {i}")
        synchronize(device)
        del graph, out, gathered

    _, error = guarded(body)
    set_replay(True)
    wanted = {"eager": 0, "replayed": n - 1}.get(mode)
    return _row(call.label(), call.op, call.dtype, mode, case.shape, tally, n, state["replays"], wanted, error,
                time.perf_counter() - start, M=call.m, N=call.n, K=call.k,
                b="w.t()" if call.transposed else "row-major", plan=call.plan, path=path)


# -- expert cases -----------------------------------------------------------------------------------------------------


def gluon_launches() -> int:
    """Launches of the Gluon block-wise fp8 kernel in this process so far (``kernels/block_scaled.py``, counted by its
    launcher; 0 where it never ran): an expert case's row records how many of its grouped GEMMs ran it
    (``gluon_launches``)."""
    from flashoverlap.kernels import grouped_gemm  # imports without Triton too (its launchers then never launch)

    return grouped_gemm.launches()["block_scaled"]


def run_moe(mc: ex.MoeCall, mode: str, rank: int, world: int, device: torch.device, group) -> dict:
    import flashoverlap as fo

    tally = Tally()
    start = time.perf_counter()
    path = "auto" if device.type != "cuda" else "p2p"
    state: dict = {"replays": None}
    n = CALLS[mode]
    gluon_before = gluon_launches()

    def body():
        case = ex.moe_case(mc, world, rank, n, device)
        limit = ex.tolerance(mc.dtype)
        want_h = [w.float() for w in case.want_h]
        want_y = [w.float() for w in case.want_y]
        layout = fo.moe_layout(case.idx, mc.experts(world), group, mode=mc.mode, bound=mc.bound(world))
        x, act = case.xs[0].clone(), case.acts[0].clone()
        fp8 = mc.scaling is not None  # the scales too live in one tensor each, new values copied in
        scale_x = case.scale_xs[0].clone() if fp8 and not mc.bf16_tokens else None
        scale_act = case.scale_acts[0].clone() if fp8 else None
        scratch_h = torch.empty(want_h[0].shape, dtype=torch.float32, device=device)
        scratch_y = torch.empty(want_y[0].shape, dtype=torch.float32, device=device)

        def load(i: int) -> None:
            x.copy_(case.xs[i])
            act.copy_(case.acts[i])
            if fp8:
                if scale_x is not None:
                    scale_x.copy_(case.scale_xs[i])
                scale_act.copy_(case.scale_acts[i])

        def calls():
            if fp8:
                h = fo.moe_dispatch_gemm(x, case.w_up, layout, group, path=path, scale_x=scale_x,
                                         scale_w=case.scale_up)
                y = fo.moe_gemm_combine(act, case.w_down, case.weights, layout, group, path=path,
                                        scale_a=scale_act, scale_w=case.scale_down)
                return h, y
            h = fo.moe_dispatch_gemm(x, case.w_up, layout, group, path=path)
            y = fo.moe_gemm_combine(act, case.w_down, case.weights, layout, group, path=path)
            return h, y

        synchronize(device)
        if mode in ("eager", "replayed"):
            set_replay(mode == "replayed")
            poison(device)
            before = replays(group, device, "expert")
            for i in range(n):
                load(i)
                h, y = calls()
                tally.check(h, want_h[i], limit, f"dispatch {i}", scratch_h)
                tally.check(y, want_y[i], limit, f"combine {i}", scratch_y)
                h.fill_(float("nan"))
                y.fill_(float("nan"))
                del h, y
            synchronize(device)
            state["replays"] = replays(group, device, "expert") - before
            return
        set_replay(False)
        load(0)
        h, y = calls()
        tally.check(h, want_h[0], limit, "dispatch before capture", scratch_h)
        tally.check(y, want_y[0], limit, "combine before capture", scratch_y)
        del h, y
        synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h, y = calls()
        for i in range(1, n):
            load(i)
            h.fill_(float("nan"))
            y.fill_(float("nan"))
            graph.replay()
            tally.check(h, want_h[i], limit, f"graph dispatch {i}", scratch_h)
            tally.check(y, want_y[i], limit, f"graph combine {i}", scratch_y)
        synchronize(device)
        del graph, h, y

    _, error = guarded(body)
    set_replay(True)
    wanted = None
    if mode == "eager":
        wanted = 0
    elif mode == "replayed":
        wanted = 2 * (n - 1) if mc.mode == "bounded" else 0
    return _row(mc.label(), "moe_dispatch_gemm+moe_gemm_combine", f"fp8-{mc.scaling}" if mc.scaling else mc.dtype,
                mode, mc.mode, tally, 2 * n, state["replays"], wanted, error, time.perf_counter() - start, path=path,
                gluon_launches=gluon_launches() - gluon_before)


# -- models: styles, layers, ExpertParallelMLP --------------------------------------------------------------------


class FeedForward(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, dtype, device) -> None:
        super().__init__()
        nn = torch.nn
        self.w1 = nn.Linear(hidden, ffn, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(hidden, ffn, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


def model_shape(world: int, device: torch.device) -> tuple[int, int, int]:
    """(tokens, hidden, ffn) of the feed-forward cases: GPU-sized (overlapped by the default plan), or CPU-sized."""
    if device.type == "cuda":
        return MODEL_TOKENS, MODEL_HIDDEN, MODEL_FFN_PER_RANK * world
    return 8 * world, 32, 16 * world


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run_feed_forward(name: str, rank: int, world: int, device: torch.device, group) -> dict:
    """A SwiGLU feed-forward sharded by the styles or the layers, forward and backward, against the unsharded one:
    the output, the input's gradient and every weight's gradient (this rank's shard of it)."""
    tally = Tally()
    start = time.perf_counter()
    sequence = name.endswith("sequence-parallel")

    def body():
        s, h, f = model_shape(world, device)
        torch.manual_seed(4242)  # the same model and tokens on every rank
        dtype = torch.bfloat16
        plain = FeedForward(h, f, dtype, device)
        x = torch.randn(1, s, h, dtype=dtype, device=device)
        model = copy.deepcopy(plain)
        x_plain = x.clone().requires_grad_()
        want = plain(x_plain)
        want.float().square().sum().backward()
        if name.startswith("styles"):
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor.parallel import parallelize_module

            from flashoverlap.nn import ColwiseParallel, RowwiseParallel

            # The mesh over the ranks' own gloo group: init_device_mesh("cuda") on a gloo world makes a new group
            # whose CUDA backend is NCCL (torch's DeviceMesh), which refuses ranks that share a GPU.
            mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)
            styles = ({"w1": ColwiseParallel(input_layouts=Shard(1)), "w3": ColwiseParallel(input_layouts=Shard(1)),
                       "w2": RowwiseParallel(output_layouts=Shard(1))} if sequence else
                      {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
            for style in styles.values():
                if hasattr(style, "src_data_rank"):
                    style.src_data_rank = None  # every rank takes its shard of its own (identical) copy: no scatter
            parallelize_module(model, mesh, styles)
        else:
            from flashoverlap.nn import parallelize

            parallelize(model, {"w1": "colwise", "w3": "colwise", "w2": "rowwise"}, group,
                        sequence_parallel=sequence)
        if sequence:
            x_ours = x.chunk(world, dim=1)[rank].clone().requires_grad_()
            want_y = want.chunk(world, dim=1)[rank]
            want_dx = x_plain.grad.chunk(world, dim=1)[rank]
        else:
            x_ours = x.clone().requires_grad_()
            want_y, want_dx = want, x_plain.grad
        y = model(x_ours)
        y.float().square().sum().backward()
        tally.check(y.detach(), want_y.detach().float(), MODEL_TOLERANCE, "output")
        tally.check(x_ours.grad, want_dx.float(), MODEL_TOLERANCE, "input gradient")
        for lin, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            got = _local(getattr(model, lin).weight.grad)
            want_g = getattr(plain, lin).weight.grad.chunk(world, dim=dim)[rank]
            tally.check(got, want_g.float(), MODEL_TOLERANCE, f"{lin} gradient")
        synchronize(device)

    _, error = guarded(body)
    shape = model_shape(world, device)
    return _row(name, "feed-forward", "bf16", "eager", f"S={shape[0]} H={shape[1]} F={shape[2]}", tally, 1, None,
                None, error, time.perf_counter() - start)


def run_expert_mlp(name: str, rank: int, world: int, device: torch.device, group) -> dict:
    """``ExpertParallelMLP.from_moe_block`` forward and backward against ``MoEBlock`` on every rank's tokens (the
    routing given, Zipf-skewed): this rank's output and input gradient, its experts' weight gradients."""
    from flashoverlap.nn import ExpertParallelMLP, MoEBlock

    tally = Tally()
    start = time.perf_counter()
    mode = name.rsplit("-", 1)[1]

    def body():
        dtype = torch.bfloat16
        # Every rank has tokens: a rank with none makes ExpertParallelMLP.forward raise on that rank alone
        # (``topk_idx.reshape(0, -1)``, nn/moe.py), leaving its peers in the layout's all-gather; the expert ops'
        # cases cover a rank without tokens.
        mc = ex.MoeCall("bf16", mode, tokens=45, local=2, top_k=2, hidden=64, ffn=48, seed=300)
        experts = mc.experts(world)
        torch.manual_seed(77)
        block = MoEBlock(mc.hidden, mc.ffn, experts, mc.top_k, device=device, dtype=dtype)
        layer = ExpertParallelMLP.from_moe_block(block, group, mode=mode, bound=mc.bound(world))
        routes = [ex.routing_of(mc, world, s, device) for s in range(world)]
        xs = [ex.tokens_of(mc, world, s, 0, device) for s in range(world)]
        x_all = torch.cat(xs).requires_grad_()
        y_all = block(x_all, torch.cat([r[0] for r in routes]), torch.cat([r[1] for r in routes]))
        y_all.float().square().sum().backward()
        first = sum(x.shape[0] for x in xs[:rank])
        rows = slice(first, first + xs[rank].shape[0])
        x_r = xs[rank].clone().requires_grad_()
        y_r = layer(x_r, routes[rank][0], routes[rank][1])
        y_r.float().square().sum().backward()
        tally.check(y_r.detach(), y_all.detach()[rows].float(), MODEL_TOLERANCE, "output")
        if x_r.grad is not None or x_r.shape[0]:
            grad = x_r.grad if x_r.grad is not None else torch.zeros_like(x_r)
            tally.check(grad, x_all.grad[rows].float(), MODEL_TOLERANCE, "input gradient")

        def grad_of(p):
            return torch.zeros_like(p) if p.grad is None else p.grad

        local = range(layer.first_expert, layer.first_expert + layer.local_experts)
        want13 = torch.stack([torch.cat([grad_of(block.experts[e].w1.weight), grad_of(block.experts[e].w3.weight)])
                              for e in local])
        want2 = torch.stack([grad_of(block.experts[e].w2.weight) for e in local])
        tally.check(grad_of(layer.w13), want13.float(), MODEL_TOLERANCE, "w13 gradient")
        tally.check(grad_of(layer.w2), want2.float(), MODEL_TOLERANCE, "w2 gradient")
        synchronize(device)

    _, error = guarded(body)
    return _row(name, "ExpertParallelMLP", "bf16", "eager", mode, tally, 1, None, None, error,
                time.perf_counter() - start)


# -- the step ------------------------------------------------------------------------------------------------------


def plan_of_cases(world: int, device_kind: str, quick: bool, families: tuple[str, ...]) -> list[tuple]:
    """The step's cases in order, as ``(family, case, mode)``; the same list on every rank."""
    cuda = device_kind == "cuda"
    modes = MODES if cuda else ("eager",)
    out = []
    if "tp" in families:
        for case in tp_cases(world, quick):
            if not cuda and case.shape == "auto":
                continue  # CPU: the reference path at the auto shape is slow and proves nothing more
            out += [("tp", case, mode) for mode in modes]
    if "moe" in families:
        for mc in moe_cases(world, quick):
            out += [("moe", mc, mode) for mode in modes if mode != "graph" or mc.mode == "bounded"]
    if "moe-fp8" in families:
        for mc in moe_fp8_cases(world, quick):
            out += [("moe", mc, mode) for mode in modes if mode != "graph" or mc.mode == "bounded"]
    if "models" in families and not quick:
        out += [("models", name, "eager") for name in MODEL_CASES]
    return out


def case_count(world: int, device_kind: str, quick: bool, family: str) -> int:
    return len(plan_of_cases(world, device_kind, quick, (family,)))


def _label(family: str, case) -> str:
    return case.call.label() if family == "tp" else case.label() if family == "moe" else case


def right_rows(path) -> dict[tuple[int, str], list[dict]]:
    """A mechanics results file's right rows (no error, no wrong value), by ``(W, family)``, each naming its commit:
    what ``--resume`` keeps and does not run again."""
    import json
    from pathlib import Path

    if not Path(path).exists():
        return {}
    data = json.loads(Path(path).read_text())
    commit = data.get("meta", {}).get("commit")
    kept: dict[tuple[int, str], list[dict]] = {}
    for row in data.get("rows", []):
        if not row.get("error") and not row.get("wrong") and row.get("mode") is not None:
            kept.setdefault((row["W"], row["family"]), []).append({"commit": commit, **row})
    return kept


def forced_graph_waits(options: dict) -> None:
    """``options["graph_waits"]`` ("kernel" or "memop"): how this process's P2P graphs, tensor-parallel and expert,
    wait on a flag, whatever the GPUs (``P2PCommunicator.graph_waits``, ``ExpertP2PCommunicator.graph_waits``; the
    library's own: the kernel on a GPU), for a diagnostic run."""
    if options.get("graph_waits"):
        from flashoverlap.comm.expert.p2p import ExpertP2PCommunicator
        from flashoverlap.comm.tp.p2p import P2PCommunicator

        P2PCommunicator.graph_waits = ExpertP2PCommunicator.graph_waits = options["graph_waits"]


def spawned(rank: int, world: int, options: dict, paths: list[str]):
    """``rank_main`` with rank ``rank``'s progress file (``paths[rank]``): what the step spawns."""
    return rank_main(rank, world, {**options, "progress": paths[rank]})


def rank_main(rank: int, world: int, options: dict) -> list[dict]:
    """One rank of the mechanics step (``spawn_on_one_gpu``): every case of ``plan_of_cases`` until the deadline
    (``options["deadline"]``, checked collectively before each case); returns this rank's rows, also written one by
    one to its progress file."""
    device = device_of(options.get("device", "cuda"))
    forced_graph_waits(options)
    group = dist.group.WORLD
    progress = Progress(options.get("progress"))
    families = tuple(options.get("families") or ("tp", "moe", "moe-fp8", "models"))
    skip = {tuple(pair) for pair in options.get("skip") or ()}
    # numbered as in the whole plan (a resumed run's rows keep their cases' numbers)
    cases = [(number, family, case, mode) for number, (family, case, mode)
             in enumerate(plan_of_cases(world, device.type, options.get("quick", False), families))
             if (_label(family, case), mode) not in skip]
    rows = []
    started = time.time()
    for done, (number, family, case, mode) in enumerate(cases):
        if not go_on(options["deadline"]):
            if rank == 0:
                print(f"mechanics W={world}: budget spent after {done} of {len(cases)} cases", flush=True)
            rows.append({"case": "(budget)", "op": None, "dtype": None, "mode": None, "calls": 0, "wrong": 0,
                         "replays": None, "error": f"budget spent: {len(cases) - done} of {len(cases)} cases "
                                                   "not run", "skipped": len(cases) - done})
            break
        label = _label(family, case)
        progress.write(event="start", number=number, case=label, mode=mode)
        if family == "tp":
            row = run_tp(case, mode, rank, world, device, group)
        elif family == "moe":
            row = run_moe(case, mode, rank, world, device, group)
        elif case.startswith("expert-mlp"):
            row = run_expert_mlp(case, rank, world, device, group)
        else:
            row = run_feed_forward(case, rank, world, device, group)
        row["number"] = number
        rows.append(row)
        progress.write(event="row", row=row)
        if rank == 0 and (row["wrong"] or row["error"] or done % 20 == 0 or done == len(cases) - 1):
            status = "ok" if not row["wrong"] and not row["error"] else (
                f"WRONG {row['wrong']}" if row["wrong"] else "ERROR")
            print(f"mechanics W={world} [{done + 1}/{len(cases)}, {time.time() - started:.0f} s] {label} {mode}: "
                  f"{status} replays={row['replays']}/{row.get('replays_wanted')}"
                  + (f" -- {row['error'][:300]}" if row["error"] else ""), flush=True)
        gc.collect()
    try:
        import flashoverlap as fo

        synchronize(device)
        fo.release()
    except Exception as exc:  # noqa: BLE001
        rows.append({"case": "(release)", "op": None, "dtype": None, "mode": None, "calls": 0, "wrong": 0,
                     "replays": None, "error": short(exc)})
    return rows


def aggregate(per_rank: list[list[dict]], world: int) -> list[dict]:
    """One row per case from every rank's rows (the same cases in the same order on every rank): ``wrong`` summed,
    ``replays`` the fewest of any rank, errors by rank, the worst error the largest."""
    rows = []
    for rank_rows in zip(*per_rank):
        first = dict(rank_rows[0])
        first["W"] = world
        first["wrong"] = sum(r.get("wrong") or 0 for r in rank_rows)
        first["checked"] = sum(r.get("checked") or 0 for r in rank_rows)
        counts = [r.get("replays") for r in rank_rows if r.get("replays") is not None]
        first["replays"] = min(counts) if counts else None
        first["replays_by_rank"] = [r.get("replays") for r in rank_rows] if counts and len(set(counts)) > 1 else None
        errors = {rank: r["error"] for rank, r in enumerate(rank_rows) if r.get("error")}
        if errors:
            texts = set(errors.values())
            first["error"] = (next(iter(texts)) + f" (ranks {sorted(errors)})" if len(texts) == 1
                              else " | ".join(f"rank {rank}: {text}" for rank, text in errors.items()))
        notes = [f"rank {rank}: {note}" for rank, r in enumerate(rank_rows) for note in (r.get("notes") or [])]
        first["notes"] = notes[:8] or None
        worst = [r.get("worst_rel_err") for r in rank_rows if r.get("worst_rel_err") is not None]
        first["worst_rel_err"] = "inf" if "inf" in worst else max(worst, default=None)
        first["seconds"] = max((r.get("seconds") or 0) for r in rank_rows)
        rows.append(first)
    return rows


def rows_from_progress(paths: list, world: int, failure: str) -> list[dict]:
    """What a spawn that hung or crashed left: every rank's finished rows (aggregated where every rank finished the
    case), then one row for the case ranks started and never finished."""
    per_rank = []
    unfinished = None
    for path in paths:
        records = Progress.read(path)
        done = [r["row"] for r in records if r.get("event") == "row"]
        per_rank.append(done)
        starts = [r for r in records if r.get("event") == "start"]
        if starts and (not done or starts[-1]["number"] > done[-1].get("number", -1)):
            unfinished = unfinished or starts[-1]
    common = min((len(rows) for rows in per_rank), default=0)
    rows = aggregate([rows[:common] for rows in per_rank], world) if common else []
    label = unfinished or {"case": "(unknown)", "mode": None}
    rows.append({"W": world, "case": label.get("case"), "op": None, "dtype": None, "mode": label.get("mode"),
                 "calls": 0, "wrong": 0, "replays": None, "hang_or_crash": True,
                 "error": f"no result: the ranks hung or crashed in this case or after it ({failure})"})
    return rows
