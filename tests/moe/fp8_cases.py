"""fp8 expert ops' test problems and their independent oracle, in fp64 (nothing here calls flashoverlap).

One global problem per seed (every rank's tokens, routing, router weights and per-choice intermediate rows; every
expert's fp8 weights and scales), so each rank computes, for itself: the rows it must receive, in the layout's
receive order (by source rank, then local expert, then the source's (token, choice) order), their dispatch products,
and its tokens' combined outputs. Quantisation here is written out again (amax / 448 per row or per 1x128 block) so
that it is checked, not trusted.

Routings: ``balanced``, ``skewed`` (Zipf(1.2)), ``rank-sends-none`` (rank 0 has no tokens),
``rank-receives-none`` (no token picks the last rank's experts).
"""

from __future__ import annotations

import torch

H, FFN = 256, 128  # multiples of 128: block-wise scales apply
BLOCK = 128
FP8 = torch.float8_e4m3fn
ROUTINGS = ("balanced", "skewed", "rank-sends-none", "rank-receives-none")
TOL = 2e-2  # max |got - want| <= TOL * (1 + max |want|): bf16 roundings and an fp8 rounding of the intermediate


def quantise64(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``x`` and its fp32 scales (``[rows, 1]`` or ``[rows, K/128]``), computed in fp64."""
    x = x.double()
    rows, k = x.shape
    top = torch.finfo(FP8).max
    if mode == "block":
        blocks = x.reshape(rows, k // BLOCK, BLOCK)
        scale = (blocks.abs().amax(2) / top).clamp_min(1e-12).float()
        q = (blocks / scale.double()[:, :, None]).clamp(-top, top).reshape(rows, k).to(FP8)
        return q, scale
    scale = (x.abs().amax(1, keepdim=True) / top).clamp_min(1e-12).float()
    return (x / scale.double()).clamp(-top, top).to(FP8), scale


def deq_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.double()
    if s.shape[1] > 1:
        s = s.repeat_interleave(BLOCK, 1)
    return q.double() * s


def deq_weight(q: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    """``q [K, N]`` fp8 with ``[N]`` or ``[K/128, ceil(N/128)]`` scales, fp64."""
    s = scale.double()
    if mode == "block":
        s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: q.shape[0], : q.shape[1]]
    else:
        s = s.reshape(1, -1)
    return q.double() * s


def weights(experts: int, k: int, n: int, mode: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's fp8 ``[E, K, N]`` (a ``transpose(1, 2)`` view of ``[E, N, K]`` storage, as nn.Linear weights
    give) and its scales (``[E, N]``, or ``[E, K/128, N/128]`` as the transposed view of ``[E, N/128, K/128]``)."""
    w = torch.randn(experts, n, k, generator=gen) / k**0.5  # nn.Linear-shaped
    if mode == "row":
        scale = (w.abs().amax(2) / 448).clamp_min(1e-12)  # [E, N]
        q = (w / scale[:, :, None]).to(FP8)
        return q.transpose(1, 2), scale.float()
    blocks = w.reshape(experts, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = (blocks.abs().amax((2, 4)) / 448).clamp_min(1e-12)  # [E, N/128, K/128]
    q = (blocks / scale[:, :, None, :, None]).reshape(experts, n, k).to(FP8)
    return q.transpose(1, 2), scale.float().transpose(1, 2)


def problem(world: int, routing: str, top_k: int, mode: str, seed: int, local: int = 2, tokens: int = 5) -> dict:
    gen = torch.Generator().manual_seed(seed)
    experts = local * world
    zipf = (torch.arange(1, experts + 1, dtype=torch.float64) ** -1.2)[torch.randperm(experts, generator=gen)]
    xs, idxs, routers, acts = [], [], [], []
    for r in range(world):
        t = 0 if routing == "rank-sends-none" and r == 0 else tokens + r
        pool = list(range(experts - local)) if routing == "rank-receives-none" else list(range(experts))
        if routing == "balanced":
            idx = (torch.arange(t)[:, None] * top_k + torch.arange(top_k)[None, :] + r) % experts
        else:
            probs = zipf[pool] if routing == "skewed" else torch.ones(len(pool), dtype=torch.float64)
            picked = torch.multinomial(probs.expand(max(t, 1), -1), top_k, replacement=False, generator=gen)[:t]
            idx = torch.tensor(pool)[picked]
        xs.append(torch.randn(t, H, generator=gen).bfloat16())
        idxs.append(idx.reshape(t, top_k))
        routers.append(torch.softmax(torch.randn(t, top_k, generator=gen), -1))
        acts.append(torch.randn(t * top_k, FFN, generator=gen).bfloat16())  # the intermediate row of each choice
    w_up, s_up = weights(experts, H, 2 * FFN, mode, gen)
    w_down, s_down = weights(experts, FFN, H, mode, gen)
    return {"x": xs, "idx": idxs, "router": routers, "act": acts, "w_up": w_up, "s_up": s_up, "w_down": w_down,
            "s_down": s_down, "experts": experts, "local": local, "top_k": top_k, "mode": mode}


def received(p: dict, rank: int) -> list[tuple[int, int, int, int]]:
    """The (source, token, choice, local expert) of each row ``rank`` receives, in receive order."""
    rows = []
    local = p["local"]
    for s, idx in enumerate(p["idx"]):
        flat = idx.reshape(-1).tolist()
        order = sorted(range(len(flat)), key=lambda j: (flat[j], j))  # stable by expert
        rows += [(s, j // p["top_k"], j % p["top_k"], flat[j] % local) for j in order if flat[j] // local == rank]
    return rows


def receive_positions(p: dict, rank: int, bound: int | None) -> list[int]:
    """Each received row's position in the receive buffer (exact: packed; bounded: source s from ``s * bound``)."""
    rows = received(p, rank)
    if bound is None:
        return list(range(len(rows)))
    out, seen = [], {}
    for s, *_ in rows:
        out.append(s * bound + seen.get(s, 0))
        seen[s] = seen.get(s, 0) + 1
    return out


def local_weights(p: dict, rank: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    own = slice(rank * p["local"], (rank + 1) * p["local"])
    return p[f"w_{name}"][own], p[f"s_{name}"][own]


def dispatch_oracle(p: dict, rank: int, x_q: list, x_s: list) -> torch.Tensor:
    """``[rows received, 2F]`` fp64: each received row's dequantised product with its expert's ``w_up``."""
    w, s = local_weights(p, rank, "up")
    out = []
    for src, t, _, e in received(p, rank):
        out.append(deq_rows(x_q[src][t : t + 1], x_s[src][t : t + 1]) @ deq_weight(w[e], s[e], p["mode"]))
    return torch.cat(out) if out else torch.zeros(0, 2 * FFN, dtype=torch.float64)


def combine_oracle(p: dict, rank: int, a_q: list, a_s: list) -> torch.Tensor:
    """``[T_rank, H]`` fp64: each of ``rank``'s tokens' router-weighted sum of its choices' rows (``a_q[rank][t*k+c]``,
    quantised) times their experts' ``w_down``."""
    idx, router = p["idx"][rank], p["router"][rank].double()
    t_count, k = idx.shape
    out = torch.zeros(t_count, H, dtype=torch.float64)
    for t in range(t_count):
        for c in range(k):
            e = int(idx[t, c])
            j = t * k + c
            w = deq_weight(p["w_down"][e], p["s_down"][e], p["mode"])
            out[t] += router[t, c] * (deq_rows(a_q[rank][j : j + 1], a_s[rank][j : j + 1]) @ w)[0]
    return out


def close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)}, want {list(want.shape)}"
    if want.numel() == 0:
        return
    scale = 1 + float(want.abs().max())
    err = float((got.double() - want).abs().max())  # NaN compares false: fails below
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} * {scale:.3g}"
