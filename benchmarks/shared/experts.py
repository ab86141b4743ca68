"""The expert ops' calls as values, every rank's routing and operands from seeds, and the definition of dispatch
and combine (``comm/expert/contract.py``'s docstring), computed locally by each rank from every rank's routing: rows
in stable expert order per source, fp32 products rounded to the dtype, fp32 weighted sums.

Routing: Gumbel top-k without replacement, with Zipf(1.2) expert popularity where ``skew`` (expert 0 the most
popular), one rank with no tokens (``empty_rank``: it sends none) or one whose experts no token chooses
(``avoid_rank``: it receives none).

fp8 (``MoeCall.scaling``, ``"row"`` or ``"block"``): every rank's tokens and activations are made in fp32 and
quantised (``calls.quantise``: per row ``[rows, 1]``, or per 1x128 block ``[rows, K/128]``), each expert's weight per
output column (``[L, N]``) or per 128x128 block (``[L, K/128, ceil(N/128)]``), stored as ``nn.Linear``-shaped
``[L, N, K]`` and passed as its ``[L, K, N]`` transpose; the oracle is the same definition on the dequantised values
(``calls.dequantised``) in fp32 (the oracle fp32, the outputs bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.shared.calls import BLOCK, HALF, dequantised, generator, quantise

EXPERT_MODES = ("exact", "bounded")
SCALINGS = ("row", "block")


@dataclass(frozen=True)
class MoeCall:
    """One layer's dispatch and combine: ``tokens`` on rank s is ``tokens + 7 * s`` (0 on ``empty_rank``),
    ``local`` experts per rank, top-``top_k`` routing, hidden ``hidden``, expert width ``ffn`` (dispatch's output is
    ``2 * ffn`` wide, SwiGLU's gate and up)."""

    dtype: str = "bf16"
    mode: str = "exact"
    tokens: int = 37
    local: int = 2
    top_k: int = 2
    hidden: int = 64
    ffn: int = 48
    skew: bool = True
    empty_rank: int | None = None
    avoid_rank: int | None = None
    seed: int = 0
    scaling: str | None = None  # fp8: "row" or "block" (tokens, activations and weights fp8; outputs bf16)
    # fp8 only: the dispatch's tokens passed in bf16 (their fp8 values dequantised), for the op to quantise itself
    bf16_tokens: bool = False

    def tokens_of(self, rank: int) -> int:
        return 0 if rank == self.empty_rank else self.tokens + 7 * rank

    def experts(self, world: int) -> int:
        return self.local * world

    def bound(self, world: int) -> int | None:
        """Bounded mode's bound, the same on every rank: the worst case of the largest rank."""
        if self.mode != "bounded":
            return None
        return max(1, max(self.tokens_of(s) for s in range(world)) * self.top_k)

    def label(self) -> str:
        routing = "zipf" if self.skew else "uniform"
        special = (f" rank {self.empty_rank} no tokens" if self.empty_rank is not None else "") + (
            f" rank {self.avoid_rank} receives none" if self.avoid_rank is not None else "")
        dtype = f"fp8-{self.scaling}" if self.scaling else self.dtype
        dtype += " bf16 tokens" if self.bf16_tokens else ""
        return (f"moe {dtype} {self.mode} T={self.tokens}+7s L={self.local} k={self.top_k} H={self.hidden} "
                f"F={self.ffn} {routing}{special}")

    def problem(self, world: int) -> str | None:
        experts = self.experts(world)
        usable = experts - (self.local if self.avoid_rank is not None else 0)
        if self.top_k > usable:
            return f"top_k {self.top_k} > the {usable} experts a token may choose"
        if self.mode not in EXPERT_MODES or self.dtype not in HALF:
            return "bad mode or dtype"
        if self.scaling is not None and self.scaling not in SCALINGS:
            return f"scaling {self.scaling!r} is not one of {SCALINGS}"
        if self.scaling == "block" and (self.hidden % BLOCK or self.ffn % BLOCK):
            return f"block-wise scales need H and F multiples of {BLOCK}"
        if self.bf16_tokens and self.scaling is None:
            return "bf16_tokens is an fp8 case's option"
        return None


def routing_of(call: MoeCall, world: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(topk_idx [T, k] int64, topk_weights [T, k] fp32)``."""
    experts = call.experts(world)
    gen = generator(device, call.seed, rank, 11)
    t = call.tokens_of(rank)
    u = torch.rand(t, experts, device=device, generator=gen).clamp(1e-9, 1 - 1e-9)
    keys = -torch.log(-torch.log(u))
    if call.skew:
        keys = keys + torch.log(1.0 / torch.arange(1, experts + 1, device=device, dtype=torch.float32) ** 1.2)
    if call.avoid_rank is not None:
        first = call.avoid_rank * call.local
        keys[:, first : first + call.local] = float("-inf")
    idx = keys.topk(call.top_k, dim=1).indices if t else torch.empty((0, call.top_k), dtype=torch.int64,
                                                                       device=device)
    weights = torch.rand(t, call.top_k, device=device, generator=gen)
    return idx, weights


def tokens_of(call: MoeCall, world: int, rank: int, index: int, device) -> torch.Tensor:
    """Rank ``rank``'s ``x [T, H]`` of call number ``index``."""
    gen = generator(device, call.seed, rank, 12, index)
    return torch.randn(call.tokens_of(rank), call.hidden, device=device, generator=gen).to(HALF[call.dtype])


def expert_weights(call: MoeCall, world: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(w_up [L, H, 2F], w_down [L, F, H])``, each the transposed view of an ``nn.Linear``-shaped
    ``[L, N, K]`` weight."""
    gen = generator(device, call.seed, rank, 13)
    h, f, dtype = call.hidden, call.ffn, HALF[call.dtype]
    w_up = (torch.randn(call.local, 2 * f, h, device=device, generator=gen) / h**0.5).to(dtype)
    w_down = (torch.randn(call.local, h, f, device=device, generator=gen) / f**0.5).to(dtype)
    return w_up.transpose(1, 2), w_down.transpose(1, 2)


class Routing:
    """The definition of the expert calls from every rank's routing (``all_idx``, by rank): ``chosen[s][d]`` the
    choices (``t * k + c``) of rank s that go to rank d, in stable expert order; receive offsets and sizes per
    mode."""

    def __init__(self, all_idx: list[torch.Tensor], world: int, local: int, mode: str, bound: int | None) -> None:
        self.world, self.local, self.mode, self.bound = world, local, mode, bound
        self.idx = [i.reshape(-1) for i in all_idx]
        self.top_k = all_idx[0].shape[1]
        self.chosen = []
        for flat in self.idx:
            order = torch.sort(flat, stable=True).indices
            dest = torch.div(flat[order], local, rounding_mode="floor")
            self.chosen.append([order[dest == d] for d in range(world)])
        self.n = [[len(self.chosen[s][d]) for d in range(world)] for s in range(world)]

    def recv_at(self, d: int, s: int) -> int:
        return s * self.bound if self.mode == "bounded" else sum(self.n[q][d] for q in range(s))

    def send_at(self, s: int, d: int) -> int:
        return d * self.bound if self.mode == "bounded" else sum(self.n[s][q] for q in range(d))

    def recv_rows(self, d: int) -> int:
        return self.world * self.bound if self.mode == "bounded" else sum(self.n[s][d] for s in range(self.world))

    def segments(self, s: int, d: int) -> list[tuple[int, int, int]]:
        """``(first, last, local expert)`` within the chunk rank s sends rank d."""
        experts = (self.idx[s][self.chosen[s][d]] % self.local).tolist()
        return [(experts.index(e), len(experts) - experts[::-1].index(e), e) for e in sorted(set(experts))]

    def dispatch(self, r: int, xs: list[torch.Tensor], w_up: torch.Tensor) -> torch.Tensor:
        """``h [R, 2F]`` of rank r (padding rows zero), from every rank's tokens ``xs``."""
        dtype, device = xs[0].dtype, w_up.device
        h = torch.zeros(self.recv_rows(r), w_up.shape[2], dtype=dtype, device=device)
        for s in range(self.world):
            j = self.chosen[s][r]
            rows = xs[s][torch.div(j, self.top_k, rounding_mode="floor")]
            at = self.recv_at(r, s)
            for first, last, e in self.segments(s, r):
                h[at + first : at + last] = (rows[first:last].float() @ w_up[e].float()).to(dtype)
        return h

    def combine(self, r: int, acts: list[torch.Tensor], w_downs: list[torch.Tensor], weights: torch.Tensor,
                tokens: int) -> torch.Tensor:
        """``y [T, H]`` of rank r from every rank's activations ``acts`` (their receive rows) and ``w_down``."""
        dtype, hidden, device = acts[0].dtype, w_downs[0].shape[2], weights.device
        out = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
        for d in range(self.world):
            j = self.chosen[r][d]
            at = self.recv_at(d, r)
            y = torch.zeros(len(j), hidden, dtype=dtype, device=device)
            for first, last, e in self.segments(r, d):
                y[first:last] = (acts[d][at + first : at + last].float() @ w_downs[d][e].float()).to(dtype)
            scale = weights.reshape(-1)[j].float()[:, None]
            out.index_add_(0, torch.div(j, self.top_k, rounding_mode="floor"), y.float() * scale)
        return out.to(dtype)


def acts_of(call: MoeCall, routing: Routing, rank: int, index: int, device) -> torch.Tensor:
    """Rank ``rank``'s combine input ``[R, F]`` of call number ``index`` (bounded mode: padding rows random too;
    the definition never reads them)."""
    gen = generator(device, call.seed, rank, 14, index)
    return torch.randn(routing.recv_rows(rank), call.ffn, device=device, generator=gen).to(HALF[call.dtype])


def fp8_rows(call: MoeCall, x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x32 [rows, K]`` quantised in ``call.scaling``: ``(fp8 rows, their scales, the rows dequantised in fp32)``."""
    q, scale = quantise(x32, call.scaling, "a")
    return q, scale, dequantised(q, scale, call.scaling, "a")


def fp8_weight(call: MoeCall, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An ``nn.Linear``-shaped ``[L, N, K]`` fp32 weight quantised per expert: ``(the [L, K, N] transpose of the fp8
    [L, N, K] weight, its scales [L, N] or [L, K/128, ceil(N/128)], the [L, K, N] weight dequantised in fp32)``."""
    qs, scales, deqs = [], [], []
    for w_l in w:
        q, scale = quantise(w_l.t().contiguous(), call.scaling, "b")  # [K, N]: per column, or per 128x128 block
        qs.append(q.t().contiguous())
        scales.append(scale.reshape(-1) if call.scaling == "row" else scale)
        deqs.append(dequantised(q, scale, call.scaling, "b"))
    return torch.stack(qs).transpose(1, 2), torch.stack(scales), torch.stack(deqs)


@dataclass
class MoeCase:
    """Everything one rank needs for a layer's calls: its routing, weights, and per call index its tokens,
    activations and the expected outputs."""

    idx: torch.Tensor
    weights: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    routing: Routing
    xs: list[torch.Tensor]  # this rank's tokens, per call index
    acts: list[torch.Tensor]  # this rank's activations, per call index
    want_h: list[torch.Tensor]
    want_y: list[torch.Tensor]
    # fp8 (``call.scaling``): the scales of the tokens and activations per call index, and of the weights
    scale_xs: list[torch.Tensor] | None = None
    scale_acts: list[torch.Tensor] | None = None
    scale_up: torch.Tensor | None = None
    scale_down: torch.Tensor | None = None


def moe_case(call: MoeCall, world: int, rank: int, calls: int, device) -> MoeCase:
    """This rank's inputs and expected outputs for ``calls`` calls of ``call`` (every rank's inputs made here)."""
    if call.scaling is not None:
        return _fp8_case(call, world, rank, calls, device)
    routes = [routing_of(call, world, s, device) for s in range(world)]
    routing = Routing([r[0] for r in routes], world, call.local, call.mode, call.bound(world))
    w_ups, w_downs = zip(*(expert_weights(call, world, s, device) for s in range(world)))
    xs, acts, want_h, want_y = [], [], [], []
    for i in range(calls):
        every_x = [tokens_of(call, world, s, i, device) for s in range(world)]
        every_act = [acts_of(call, routing, s, i, device) for s in range(world)]
        xs.append(every_x[rank])
        acts.append(every_act[rank])
        want_h.append(routing.dispatch(rank, every_x, w_ups[rank]))
        want_y.append(routing.combine(rank, every_act, list(w_downs), routes[rank][1], call.tokens_of(rank)))
    idx, weights = routes[rank]
    return MoeCase(idx, weights, w_ups[rank], w_downs[rank], routing, xs, acts, want_h, want_y)


def _fp8_case(call: MoeCall, world: int, rank: int, calls: int, device) -> MoeCase:
    """``moe_case`` in fp8: every rank's fp32 values quantised, the definition computed on their dequantised
    values in fp32 (the outputs' dtype bf16)."""
    routes = [routing_of(call, world, s, device) for s in range(world)]
    routing = Routing([r[0] for r in routes], world, call.local, call.mode, call.bound(world))
    h, f = call.hidden, call.ffn
    ups, downs = [], []
    for s in range(world):
        gen = generator(device, call.seed, s, 13)
        ups.append(fp8_weight(call, torch.randn(call.local, 2 * f, h, device=device, generator=gen) / h**0.5))
        downs.append(fp8_weight(call, torch.randn(call.local, h, f, device=device, generator=gen) / f**0.5))
    xs, acts, want_h, want_y, scale_xs, scale_acts = [], [], [], [], [], []
    for i in range(calls):
        every_x = [fp8_rows(call, torch.randn(call.tokens_of(s), h, device=device,
                                              generator=generator(device, call.seed, s, 12, i)))
                   for s in range(world)]
        every_act = [fp8_rows(call, torch.randn(routing.recv_rows(s), f, device=device,
                                                generator=generator(device, call.seed, s, 14, i)))
                     for s in range(world)]
        if call.bf16_tokens:  # the same values in bf16: quantised again by the op (scales within a rounding)
            xs.append(every_x[rank][2].to(torch.bfloat16))
            scale_xs.append(None)
        else:
            xs.append(every_x[rank][0])
            scale_xs.append(every_x[rank][1])
        acts.append(every_act[rank][0])
        scale_acts.append(every_act[rank][1])
        want_h.append(routing.dispatch(rank, [x[2] for x in every_x], ups[rank][2]))  # fp32
        want_y.append(routing.combine(rank, [a[2] for a in every_act], [d[2] for d in downs], routes[rank][1],
                                      call.tokens_of(rank)))
    idx, weights = routes[rank]
    return MoeCase(idx, weights, ups[rank][0], downs[rank][0], routing, xs, acts, want_h, want_y, scale_xs,
                   scale_acts, ups[rank][1], downs[rank][1])


def tolerance(dtype: str) -> float:
    return 1.5e-2 if dtype == "bf16" else 3e-3
