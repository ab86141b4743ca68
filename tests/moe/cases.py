"""The MoE tests' problems and oracle: one global problem (every rank's tokens and routing, all experts' weights)
drawn from a seed, so that each rank computes the plain unsharded answer for itself, and the comparison.

Routings (``ROUTINGS``), for ``W`` ranks, ``E`` experts, ``L = E / W`` per rank, rank r with ``T_r = T + r``
tokens (uneven on purpose): ``balanced`` (choice c of token t: expert ``(t*k + c + r) % E``), ``skewed`` (Zipf(1.2)
expert popularity, sampled without replacement), ``idle-expert`` (experts 1 and E-1 never chosen),
``rank-receives-none`` (rank W-1's experts never chosen), ``rank-sends-none`` (rank 0 has no tokens),
``local-only`` (every token's experts on its own rank: nothing crosses ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROUTINGS = ("balanced", "skewed", "idle-expert", "rank-receives-none", "rank-sends-none", "local-only")
H, FFN, T = 16, 24, 10
# max |got - want| <= TOL * (1 + max |want|): a few roundings of the dtype; a misrouted or missing row is off by
# the values themselves.
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def experts_for(world: int) -> int:
    return 9 if world == 3 else 8


def allowed(routing: str, experts: int, world: int) -> list[int]:
    """The experts a routing may choose from (before the per-rank rule of ``local-only``)."""
    local = experts // world
    if routing == "idle-expert":
        return [e for e in range(experts) if e not in (1, experts - 1)]
    if routing == "rank-receives-none":
        return list(range((world - 1) * local))
    return list(range(experts))


def top_k_for(routing: str, top_k: int, experts: int, world: int) -> int:
    """``top_k`` where the routing allows it, else the most it allows."""
    room = experts // world if routing == "local-only" else len(allowed(routing, experts, world))
    return min(top_k, room)


def problem(world: int, routing: str, top_k: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Every rank's inputs and all experts' weights (identical on every rank for one seed)."""
    gen = torch.Generator().manual_seed(seed)
    experts = experts_for(world)
    local = experts // world
    k = top_k_for(routing, top_k, experts, world)
    pool = allowed(routing, experts, world)
    zipf = torch.arange(1, experts + 1, dtype=torch.float64) ** -1.2
    zipf = zipf[torch.randperm(experts, generator=gen)]
    xs, idxs, weights = [], [], []
    for r in range(world):
        tokens = 0 if routing == "rank-sends-none" and r == 0 else T + r
        if routing == "balanced":
            idx = (torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :] + r) % experts
        else:
            choices = list(range(r * local, (r + 1) * local)) if routing == "local-only" else pool
            probs = zipf[choices] if routing == "skewed" else torch.ones(len(choices), dtype=torch.float64)
            picked = torch.multinomial(probs.expand(max(tokens, 1), -1), k, replacement=False, generator=gen)
            idx = torch.tensor(choices)[picked][:tokens]
        xs.append(torch.randn(tokens, H, generator=gen).to(dtype))
        idxs.append(idx)
        weights.append(torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(dtype))
    w13 = (torch.randn(experts, 2 * FFN, H, generator=gen) / H**0.5).to(dtype)  # nn.Linear-shaped [E, 2F, H]
    w2 = (torch.randn(experts, H, FFN, generator=gen) / FFN**0.5).to(dtype)  # [E, H, F]
    grads = [torch.randn(x.shape, generator=gen).to(dtype) for x in xs]
    return {"x": xs, "idx": idxs, "weights": weights, "w13": w13, "w2": w2, "grad": grads, "experts": experts,
            "local": local, "top_k": k}


def plain(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
          w2: torch.Tensor) -> torch.Tensor:
    """The unsharded SwiGLU MoE in the inputs' dtype, vectorised: ``y[t] = sum_c weights[t, c] * w2_e (silu(w1_e
    x[t]) * w3_e x[t])``, ``e = idx[t, c]``, ``w13_e = [w1_e; w3_e]``."""
    h = torch.einsum("tcnh,th->tcn", w13[idx], x)
    a = F.silu(h[..., :FFN]) * h[..., FFN:]
    y = torch.einsum("tchf,tcf->tch", w2[idx], a)
    return (weights[..., None] * y).sum(1)


def oracle(p: dict, rank: int) -> dict:
    """Rank ``rank``'s output and every gradient, computed in fp32 from the (rounded) inputs: the loss is
    ``sum_r <y_r, grad_r>`` over every rank, so the experts' gradients gather every rank's tokens."""
    def leaf(t: torch.Tensor) -> torch.Tensor:  # a copy even in fp32, where .float() would return t itself
        return t.to(torch.float32, copy=True).requires_grad_()

    w13, w2 = leaf(p["w13"]), leaf(p["w2"])
    xs = [leaf(x) for x in p["x"]]
    ws = [leaf(w) for w in p["weights"]]
    ys = [plain(x, i, w, w13, w2) for x, i, w in zip(xs, p["idx"], ws)]
    sum((y * g.float()).sum() for y, g in zip(ys, p["grad"])).backward()
    own = slice(rank * p["local"], (rank + 1) * p["local"])
    return {"y": ys[rank].detach(), "x": xs[rank].grad, "weights": ws[rank].grad, "w13": w13.grad[own],
            "w2": w2.grad[own]}


def close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)}, want {list(want.shape)}"
    if want.numel() == 0:
        return
    scale = 1 + float(want.abs().max())
    err = float((got.detach().double() - want.double()).abs().max())  # NaN compares false: fails below
    assert err <= TOL[dtype] * scale, f"{name}: max error {err:.3g} > {TOL[dtype]} * {scale:.3g}"
