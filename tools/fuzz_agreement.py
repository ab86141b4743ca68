"""A randomized search for silent disagreement (a tool, not part of the suite).

Each trial, drawn from a seed (the same on every rank), picks a public op and valid arguments, perturbs ONE argument
on ONE rank, calls the op on every rank of a gloo group and classifies each rank's outcome: raised (the message),
returned (shape, and whether it equals the plain-PyTorch result computed from every rank's actual inputs) or hung.
A defect: one rank returns while another raises; a wrong shape or value; a hang (a backend timeout: ranks that
entered mismatched collectives); an agreement error that does not name the op.

Every call runs on subgroups made with a short timeout (``GROUP_TIMEOUT``), so that what the default group's
30 minutes would turn into a hang shows in seconds: "absent" (a peer raised a local argument error before the
agreement exchange, and this rank waited for it: by design, bounded by the group's timeout) and "backend" (a
collective timed out or broke: the ranks were in different collectives).

    PYTHONPATH=src timeout 3000 python tools/fuzz_agreement.py --trials 300 [--seed 0] [--only OP] [--show]
    PYTHONPATH=src python tools/fuzz_agreement.py --replay SEED --world W   # one trial, every rank's outcome

Rules: ``reference`` (the CPU's: every call agreed) and ``first-call`` (the GPU paths' rule, emulated on gloo as
tests/runtime/test_disagreement.py does: ``calls.agree_every_call`` answering False). ``repeat``: the unperturbed
call is made once on every rank first (its signature cached, its row agreed), then the perturbed one.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import sys
import time
import traceback

import torch
import torch.distributed as dist

GROUP_TIMEOUT = 6.0  # seconds: the subgroups' own timeout (the agreement waits a little less)
WAIT_PEERS = 25.0  # seconds a rank waits for its peers' outcome of a trial before calling it a hang
BF, F16, F32, E4, E5 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2
DENSE_OPS = ("gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm", "all_gather_gemm+gathered")
SCALED_OPS = ("scaled_gemm_all_reduce", "scaled_gemm_reduce_scatter", "all_gather_scaled_gemm")
MOE_OPS = ("moe_layout", "moe_dispatch_gemm", "moe_gemm_combine")
OPS = DENSE_OPS + SCALED_OPS + MOE_OPS
# Perturbations whose call every rank may legitimately make as it is: every rank must return the oracle's result.
BENIGN = {"b_layout", "return_gathered", "a_noncontig", "scale_value", "bias_one_rank", "tokens", "weights_dtype",
          "b_dtype"}


# -- the trial: drawn from a seed, the same on every rank -----------------------------------------------------------


def draw(seed: int, world: int, only: str | None = None) -> dict:
    rng = random.Random(seed)
    op = only or rng.choice(OPS)
    t = {"seed": seed, "world": world, "op": op, "odd": rng.randrange(world),
         "rule": rng.choice(("reference", "first-call")), "repeat": rng.random() < 0.3}
    if op in DENSE_OPS:
        t.update(dtype=rng.choice(("bf16", "fp16", "fp32")), n=rng.randint(1, 24), k=rng.randint(1, 24),
                 path=rng.choice(("auto", "reference")), plan=rng.random() < 0.2, b_t=rng.random() < 0.3)
        t["m"] = world * rng.randint(1, 6) if op == "gemm_reduce_scatter" else rng.randint(1, 12)
        t["perturb"] = rng.choice(("m+1", "m*2", "n+1", "n*2", "k+1", "k*2", "dtype", "path", "plan_other",
                                   "plan_none", "b_layout", "group", "a_noncontig")
                                  + (("return_gathered",) if op.startswith("all_gather") else ()))
    elif op in SCALED_OPS:
        mode = rng.choice(("tensor", "row", "block"))
        t.update(mode=mode, n=rng.randint(1, 24), k=128 * rng.randint(1, 2) if mode == "block" else rng.randint(1, 24),
                 out=rng.choice(("bf16", "fp32")), bias=rng.random() < 0.4, a8=rng.choice(("e4m3", "e5m2")),
                 path=rng.choice(("auto", "reference")), b_t=rng.random() < 0.3)
        t["m"] = world * rng.randint(1, 6) if op == "scaled_gemm_reduce_scatter" else rng.randint(1, 12)
        choices = ["m+1", "n+1", "k+", "mode", "out_dtype", "bias", "a_dtype", "b_dtype", "path", "plan_other",
                   "b_layout", "group"]
        if mode == "tensor":
            choices.append("scale_value")
        if op == "scaled_gemm_all_reduce" and t["bias"]:
            choices.append("bias_one_rank")
        t["perturb"] = rng.choice(choices)
    else:
        kind = rng.choice(("bf16", "fp32", "fp8row", "fp8block"))
        t.update(kind=kind, local=rng.randint(1, 2), top_k=rng.randint(1, 2), tokens=rng.randint(1, 6),
                 h=128 if kind == "fp8block" else rng.randint(1, 16),
                 f=128 if kind == "fp8block" else rng.randint(1, 16),
                 mode=rng.choice(("exact", "bounded")), bound=rng.choice((None, "explicit")),
                 path=rng.choice(("auto", "reference")), out=rng.choice(("bf16", "fp32")),
                 x8=kind.startswith("fp8") and rng.random() < 0.5)
        choices = ["experts", "top_k", "mode", "bound", "tokens", "group", "stale_layout"]
        if op != "moe_layout":
            choices += ["h+1", "f+1", "local", "dtype", "path", "weights_dtype"]
            if kind.startswith("fp8"):
                choices += ["fp8_mode", "out_dtype", "x_fp8"]
            else:
                choices += ["to_fp8"]
        t["perturb"] = rng.choice(choices)
    return t


DT = {"bf16": BF, "fp16": F16, "fp32": F32, "e4m3": E4, "e5m2": E5}


def _gen(t: dict, rank: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(t["seed"] * 1009 + rank * 101 + salt)


def _fp8(x: torch.Tensor, mode: str, operand: str, dtype=E4) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.finfo(dtype).max
    if mode == "tensor":
        scale = x.abs().amax().clamp(min=1e-6) / top
        return (x / scale).to(dtype), scale.reshape(()).float()
    if mode == "row":
        scale = x.abs().amax(1 if operand == "a" else 0, keepdim=True).clamp(min=1e-6) / top
        return (x / scale).to(dtype), scale.float()
    if operand == "a":
        m, k = x.shape
        scale = (x.reshape(m, k // 128, 128).abs().amax(2) / top).clamp(min=1e-6)
        return (x / scale.repeat_interleave(128, 1)).to(dtype), scale.float()
    k, n = x.shape
    nb = -(-n // 128)
    padded = torch.zeros(k, nb * 128)
    padded[:, :n] = x
    scale = (padded.reshape(k // 128, 128, nb, 128).abs().amax((1, 3)) / top).clamp(min=1e-6)
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :n]
    return (x / expanded).to(dtype), scale.float()


# -- the arguments of one rank ---------------------------------------------------------------------------------------


def tp_args(t: dict, rank: int, groups: dict, perturbed: bool) -> dict:
    """One rank's call of a dense or fp8 tensor-parallel op: a dict of what to call and what the oracle needs."""
    p = t["perturb"] if perturbed else None
    m, n, k = t["m"], t["n"], t["k"]
    m = {"m+1": m + 1, "m*2": 2 * m}.get(p, m)
    n = {"n+1": n + 1, "n*2": 2 * n}.get(p, n)
    k = {"k+1": k + 1, "k*2": 2 * k, "k+": k + (128 if t.get("mode") == "block" else 1)}.get(p, k)
    g = _gen(t, rank)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n, generator=g)
    path = t["path"]
    if p == "path":
        path = "reference" if path == "auto" else "auto"
    group = groups["other" if p == "group" else "main"]
    op = t["op"].split("+")[0]
    kind = {"gemm_all_reduce": "all_reduce", "gemm_reduce_scatter": "reduce_scatter", "all_gather_gemm": "all_gather",
            "scaled_gemm_all_reduce": "all_reduce", "scaled_gemm_reduce_scatter": "reduce_scatter",
            "all_gather_scaled_gemm": "all_gather"}[op]
    world = t["world"]
    plan = None
    if (t.get("plan") and p != "plan_none") or p == "plan_other":
        from flashoverlap import default_plan

        pm, pn, pk = (t["m"] * (world if kind == "all_gather" else 1), t["n"], t["k"])
        if p == "plan_other":
            pn += 1
        plan = default_plan(kind, pm, pn, pk, world)
    out = {"op": op, "kind": kind, "group": group, "path": path, "plan": plan}
    if op in DENSE_OPS:
        dtype = DT[t["dtype"]]
        if p == "dtype":
            dtype = {BF: F16, F16: F32, F32: BF}[dtype]
        a, b = a.to(dtype), b.to(dtype)
        if t["b_t"] != (p == "b_layout"):
            b = b.t().contiguous().t()
        if p == "a_noncontig":
            a = torch.cat([a, a], 1)[:, :k] if k > 0 else a
        out.update(a=a, b=b, gathered=t["op"].endswith("gathered") != (p == "return_gathered"))
        return out
    mode = t["mode"]
    if p == "mode":
        mode = {"tensor": "row", "row": "block" if k % 128 == 0 else "tensor", "block": "row"}[mode]
    a8 = DT[t["a8"]]
    if p == "a_dtype":
        a8 = E5 if a8 == E4 else E4
    b8 = E5 if p == "b_dtype" and a8 == E4 else E4
    if p == "scale_value":
        a = a * (1 + rank)
    aq, sa = _fp8(a, mode, "a", a8)
    bq, sb = _fp8(b, mode, "b", b8)
    if t["b_t"] != (p == "b_layout"):
        bq = bq.t().contiguous().t()
    out_dtype = DT[t["out"]]
    if p == "out_dtype":
        out_dtype = F32 if out_dtype == BF else BF
    has_bias = t["bias"] != (p == "bias")
    if p == "bias_one_rank":
        has_bias = rank == 0
    bias = torch.randn(n, generator=g).to(out_dtype) if has_bias else None
    out.update(a=aq, b=bq, sa=sa, sb=sb, out_dtype=out_dtype, bias=bias, mode=mode, gathered=False)
    return out


def tp_call(c: dict):
    import flashoverlap as fo

    op = c["op"]
    if op in DENSE_OPS:
        fn = getattr(fo, op)
        if op == "all_gather_gemm":
            return fn(c["a"], c["b"], c["group"], plan=c["plan"], path=c["path"], return_gathered=c["gathered"])
        return fn(c["a"], c["b"], c["group"], plan=c["plan"], path=c["path"])
    return getattr(fo, op)(c["a"], c["b"], c["sa"], c["sb"], c["group"], out_dtype=c["out_dtype"], bias=c["bias"],
                           path=c["path"], plan=c["plan"])


def tp_oracle(cs: list[dict], rank: int):
    """The plain-PyTorch result on ``rank`` from every rank's actual arguments (None: plain PyTorch could not run it:
    shapes or dtypes that disagree)."""
    from flashoverlap.comm import scaled

    c = cs[rank]
    world = len(cs)

    def product(x: dict) -> torch.Tensor:
        if "sa" not in x:
            return x["a"].float() @ x["b"].float()
        scales = scaled.Scales.of(x["sa"], x["sb"], x["out_dtype"], x["bias"], x["b"].shape[1])
        sa = x["sa"].reshape(1, 1) if x["mode"] == "tensor" else x["sa"]
        p = scaled.dequantised_a(x["a"], sa) @ scaled.dequantised_b(x["b"], scales)
        return p if x["bias"] is None else p + x["bias"].float()

    dtype = c["out_dtype"] if "sa" in c else c["a"].dtype
    if len({x["a"].dtype for x in cs}) > 1 or len({x.get("out_dtype") for x in cs}) > 1:
        return None
    if c["kind"] == "all_gather":
        if len({x["a"].shape[1] for x in cs}) > 1 or cs[rank]["a"].shape[1] != c["b"].shape[0]:
            return None
        if len({x["a"].shape[0] for x in cs}) > 1:
            return None  # all_gather_into_tensor needs equal shards
        if "sa" in c:
            if len({x["mode"] for x in cs}) > 1:
                return None
            # each shard's rows with its own A scales, times this rank's B (its scales and bias)
            return torch.cat([product({**c, "a": x["a"], "sa": x["sa"]}) for x in cs]).to(dtype)
        gathered = torch.cat([x["a"] for x in cs])
        res = (gathered.float() @ c["b"].float()).to(dtype)
        return (res, gathered) if c["gathered"] else res
    if len({(tuple(x["a"].shape[:1]), x["b"].shape[1]) for x in cs}) > 1:
        return None
    partial = [product(x).to(dtype).float() for x in cs]
    total = sum(partial).to(dtype)
    if c["kind"] == "all_reduce":
        return total
    if total.shape[0] % world:
        return None
    rows = total.shape[0] // world
    return total[rank * rows:(rank + 1) * rows]


# -- the expert ops ---------------------------------------------------------------------------------------------------


def moe_inputs(t: dict, rank: int, perturbed: bool) -> dict:
    p = t["perturb"] if perturbed else None
    world = t["world"]
    local = t["local"]
    experts = world * local + (world if p == "experts" else 0)
    top_k = min(t["top_k"] + (1 if p == "top_k" else 0), experts)
    if p == "top_k" and top_k == t["top_k"]:
        top_k = 1 if t["top_k"] > 1 else top_k
    tokens = t["tokens"] + (2 if p == "tokens" else 0)
    g = _gen(t, rank)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, top_k, dtype=torch.int64)
    idx = idx.reshape(tokens, top_k)
    mode = t["mode"]
    if p == "mode":
        mode = "bounded" if mode == "exact" else "exact"
    bound = None
    if mode == "bounded":
        bound = t["tokens"] * t["top_k"] + 2 if t["bound"] == "explicit" else None
        if p == "bound":
            bound = (bound or t["tokens"] * t["top_k"]) + 1
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    if p == "weights_dtype":
        weights = weights.to(BF)
    return {"experts": experts, "idx": idx, "mode": mode, "bound": bound, "weights": weights, "tokens": tokens}


def routed(inputs: list[dict], world: int, local: int) -> list[list[tuple]]:
    """Every destination's received rows in order: ``(position, source, token, choice, local expert)``, as the
    layout lays them out (exact: packed; bounded: source s's block at ``s * bound``)."""
    experts = inputs[0]["experts"]
    out = [[] for _ in range(world)]
    for d in range(world):
        pos = 0
        for s, x in enumerate(inputs):
            flat = x["idx"].reshape(-1).tolist()
            order = sorted(range(len(flat)), key=lambda i: (flat[i], i))
            if x["mode"] == "bounded":
                pos = s * x["bound_eff"]
            for i in order:
                e = flat[i]
                if e // local == d and e < experts:
                    out[d].append((pos, s, i // x["idx"].shape[1], i % x["idx"].shape[1], e % local))
                    pos += 1
    return out


def _routing(inputs: list[dict], world: int, local: int) -> list[list[tuple]] | None:
    """``routed``'s rows, or None where the ranks' routings cannot meet (their expert counts, modes or top-k
    differ); each input's ``bound_eff`` set first (its bound, or every row it routes)."""
    for x in inputs:
        x["bound_eff"] = x["bound"] or max(1, x["tokens"] * x["idx"].shape[1])
    if len({(x["experts"], x["mode"], x["idx"].shape[1]) for x in inputs}) > 1:
        return None
    return routed(inputs, world, local)


def moe_args(t: dict, rank: int, groups: dict, perturbed: bool) -> dict:
    p = t["perturb"] if perturbed else None
    local = t["local"]
    inp = moe_inputs(t, rank, perturbed)
    g = _gen(t, rank, 7)
    step = 128 if t["kind"] == "fp8block" else 1  # block-wise widths stay multiples of 128 (the tool's quantiser)
    h = t["h"] + (step if p == "h+1" else 0)
    f = t["f"] + (step if p == "f+1" else 0)
    kind = t["kind"]
    if p == "to_fp8":
        kind = "fp8row"
    fp8_mode = {"fp8row": "row", "fp8block": "block"}.get(kind)
    if p == "fp8_mode" and h % 128 == 0 and f % 128 == 0:
        fp8_mode = "row" if fp8_mode == "block" else "block"
    dtype = {"bf16": BF, "fp32": F32}.get(kind, BF)
    if p == "dtype":
        dtype = F32 if dtype == BF else BF
    lw = local + (1 if p == "local" else 0)
    # weights for every rank are drawn from the rank's own generator
    if t["op"] == "moe_dispatch_gemm":
        rows, k, n = torch.randn(inp["tokens"], h, generator=g), h, f
    else:
        rows, k, n = None, f, h
    w = torch.randn(lw, k, n, generator=g) / max(k, 1) ** 0.5
    path = t["path"]
    if p == "path":
        path = "reference" if path == "auto" else "auto"
    out_dtype = DT[t["out"]] if fp8_mode else BF
    if p == "out_dtype" and fp8_mode:
        out_dtype = F32 if out_dtype == BF else BF
    return {"inp": inp, "h": h, "f": f, "k": k, "n": n, "dtype": dtype, "fp8_mode": fp8_mode, "w": w, "rows": rows,
            "path": path, "out_dtype": out_dtype, "group": groups["other" if p == "group" else "main"],
            "x8": t["x8"] != (p == "x_fp8"), "local_w": lw}


def moe_weights(a: dict):
    """The call's weight (fp8 with its scale where fp8) and the dequantised fp32 weight the oracle multiplies by."""
    w = a["w"]
    if a["fp8_mode"] is None:
        w = w.to(a["dtype"])
        return w, None, w.float()
    from flashoverlap.comm.expert.scaled import dequantised_weight

    qs = [_fp8(w[e], a["fp8_mode"], "b") for e in range(w.shape[0])]
    wq = torch.stack([q for q, _ in qs])
    if a["fp8_mode"] == "row":
        scale = torch.stack([s.reshape(-1) for _, s in qs])
    else:
        scale = torch.stack([s for _, s in qs])
    deq = torch.stack([dequantised_weight(wq[e], scale[e], a["fp8_mode"]) for e in range(w.shape[0])])
    return wq, scale, deq


def moe_rows(a: dict, rows: torch.Tensor):
    """The rows as passed (fp8 with scales where ``x8``) and as the oracle multiplies them (dequantised)."""
    from flashoverlap.comm.expert.scaled import dequantised_rows, quantise

    if a["fp8_mode"] is None:
        r = rows.to(a["dtype"])
        return r, None, r.float()
    r = rows.to(a["dtype"])
    q, s = quantise(r, a["fp8_mode"])
    q, s = q.contiguous(), s.contiguous()
    deq = dequantised_rows(q, s)
    return (q, s, deq) if a["x8"] else (r, None, deq)


def moe_call(t: dict, a: dict, layout):
    import flashoverlap as fo

    wq, ws, _ = moe_weights(a)
    kw = {"path": a["path"]}
    if a["fp8_mode"]:
        kw.update(scale_w=ws, out_dtype=a["out_dtype"])
    if t["op"] == "moe_dispatch_gemm":
        x, sx, _ = moe_rows(a, a["rows"])
        if sx is not None:
            kw["scale_x"] = sx
        return fo.moe_dispatch_gemm(x, wq, layout, a["group"], **kw)
    x, sx, _ = moe_rows(a, a["rows"])
    if sx is not None:
        kw["scale_a"] = sx
    return fo.moe_gemm_combine(x, wq, a["inp"]["weights"], layout, a["group"], **kw)


def moe_oracle(t: dict, args: list[dict], rank: int):
    world, local = t["world"], t["local"]
    inputs = [x["inp"] for x in args]
    rows = _routing(inputs, world, local)
    if rows is None or inputs[0]["mode"] == "bounded" and len({x["bound_eff"] for x in inputs}) > 1:
        return None
    if t["op"] == "moe_layout":
        return ("layout", len(rows[rank]) if inputs[0]["mode"] == "exact" else world * inputs[0]["bound_eff"])
    # (an fp8 call quantises bf16/fp32 rows itself: their dtype is no part of what crosses the wire)
    if len({(x["k"], x["n"], None if x["fp8_mode"] else x["dtype"], x["fp8_mode"], x["out_dtype"], x["local_w"])
            for x in args}) > 1:
        return None
    a = args[rank]
    out_dtype = a["out_dtype"] if a["fp8_mode"] else a["dtype"]
    total = world * inputs[0]["bound_eff"] if inputs[0]["mode"] == "bounded" else None
    if t["op"] == "moe_dispatch_gemm":
        if any(x["rows"].shape[0] != x["inp"]["tokens"] for x in args):
            return None
        _, _, w = moe_weights(a)
        deq = [moe_rows(x, x["rows"])[2] for x in args]
        r = total if total is not None else len(rows[rank])
        h = torch.zeros(r, a["n"])
        for pos, s, tok, _c, le in rows[rank]:
            h[pos] = deq[s][tok] @ w[le]
        return h.to(out_dtype)
    # combine: every destination's received rows (drawn in run_trial), back to their tokens
    y = torch.zeros(inputs[rank]["tokens"], a["n"])
    for d in range(world):
        _, _, w = moe_weights(args[d])
        deq = moe_rows(args[d], args[d]["rows"])[2]
        for pos, s, tok, c, le in rows[d]:
            if s == rank:
                y[tok] += inputs[rank]["weights"][tok, c].float() * (deq[pos] @ w[le]).to(out_dtype).float()
    return y.to(out_dtype)


def combine_rows(t: dict, args: list[dict]) -> None:
    """A combine's ``a`` [R, F] on every rank: drawn once the receive rows are known (R from the routing)."""
    world, local = t["world"], t["local"]
    rows = _routing([x["inp"] for x in args], world, local)
    for d, a in enumerate(args):
        if rows is None:
            r = 1
        elif a["inp"]["mode"] == "bounded":
            r = world * a["inp"]["bound_eff"]
        else:
            r = len(rows[d])
        a["rows"] = torch.randn(r, a["k"], generator=_gen(t, d, 11))


# -- one trial on every rank ------------------------------------------------------------------------------------------


def classify(exc: BaseException, op: str) -> str:
    text = str(exc)
    if "disagree" in text:
        return "agree"
    if "did not reach the call" in text or "never reached it" in text:
        return "absent"
    if "communication backend failed" in text or "timed out" in text.lower() or "Connection" in text:
        return "backend"
    return "local"


def _names(op: str) -> tuple[str, ...]:
    """The public ops whose name an error of ``op``'s trial may carry (a MoE trial builds its layout first)."""
    return (op, "moe_layout") if op in MOE_OPS else (op,)


def one_trial(rank: int, t: dict, groups: dict) -> dict:
    world = t["world"]
    op = t["op"]
    name = {"all_gather_gemm+gathered": "all_gather_gemm"}.get(op, op)
    perturbed = rank == t["odd"]
    record = {"rank": rank}
    try:
        if op in MOE_OPS:
            import flashoverlap as fo

            args = [moe_args(t, r, groups, r == t["odd"]) for r in range(world)]
            if op == "moe_gemm_combine":
                combine_rows(t, args)
            a = args[rank]
            inp = a["inp"]

            def layout(x: dict, idx=None):
                return fo.moe_layout(x["inp"]["idx"] if idx is None else idx, x["inp"]["experts"], x["group"],
                                     mode=x["inp"]["mode"], bound=x["inp"]["bound"])

            if t["repeat"]:
                bases = [moe_args(t, r, groups, False) for r in range(world)]
                if op == "moe_gemm_combine":
                    combine_rows(t, bases)
                first = layout(bases[rank])
                if op != "moe_layout":
                    moe_call(t, bases[rank], first)
            want = None
            if op == "moe_layout":
                got = ("layout", layout(a).recv_rows)
                want = moe_oracle(t, args, rank)
            elif t["perturb"] == "stale_layout":
                # every rank builds L1 (its routing) then L2 (routing drawn afresh); the odd rank passes L2
                other = torch.randint(0, inp["experts"], inp["idx"].shape, generator=_gen(t, rank, 5))
                l1, l2 = layout(a), layout(a, other)
                got = moe_call(t, a, l2 if perturbed else l1)
            else:
                got = moe_call(t, a, layout(a))
                want = moe_oracle(t, args, rank)
        else:
            cs = [tp_args(t, r, groups, r == t["odd"]) for r in range(world)]
            if t["repeat"]:
                tp_call(tp_args(t, rank, groups, False))
            got = tp_call(cs[rank])
            want = tp_oracle(cs, rank)
    except BaseException as exc:  # noqa: BLE001
        text = str(exc).split("\n")[0][:400]
        record.update(outcome="raised", category=classify(exc, name), message=text,
                      names_op=any(text.startswith(n) or f" {n} " in text[:160] for n in _names(name)),
                      type=type(exc).__name__)
        if record["category"] == "local" and not isinstance(exc, (ValueError, TypeError, RuntimeError)):
            record["trace"] = traceback.format_exc()[-1500:]
        return record
    record.update(outcome="returned", shape=_shape(got))
    if want is None:
        record["correct"] = None  # plain PyTorch could not run this call: returning at all is wrong
    else:
        record["correct"] = _equal(got, want, t)
        record["want_shape"] = _shape(want)
    return record


def _shape(x):
    if isinstance(x, tuple):
        return [_shape(v) for v in x]
    if isinstance(x, torch.Tensor):
        return [list(x.shape), str(x.dtype).removeprefix("torch.")]
    return repr(x)


def _equal(got, want, t: dict) -> bool:
    if isinstance(want, tuple) and want and want[0] == "layout":
        return got == want
    if isinstance(want, tuple):
        return isinstance(got, tuple) and len(got) == len(want) and all(_equal(g, w, t) for g, w in zip(got, want))
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.numel() == 0:
        return True
    tol = {F32: 1e-3, F16: 1e-2, BF: 3e-2}.get(want.dtype, 3e-2)
    scale = 1 + float(want.float().abs().max())
    return float((got.float() - want.float()).abs().max()) <= tol * scale * 2


def batch(rank: int, world: int, trials: list[dict]) -> list[dict]:
    from flashoverlap import settings
    from flashoverlap.runtime import calls

    for variable in ("TORCH_DISTRIBUTED_DEBUG", "FLASHOVERLAP_DEBUG_TIMEOUT"):
        os.environ.pop(variable, None)
    settings.refresh()
    real_rule = calls.agree_every_call
    store = dist.distributed_c10d._get_default_store()
    records = []
    for i, t in enumerate(trials):
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
        groups = {"main": dist.new_group(timeout=timeout), "other": dist.new_group(timeout=timeout)}
        calls.agree_every_call = real_rule if t["rule"] == "reference" else (lambda a, path, group: False)
        start = time.monotonic()
        record = one_trial(rank, t, groups)
        record["seconds"] = round(time.monotonic() - start, 2)
        calls.agree_every_call = real_rule
        records.append(record)
        store.set(f"fuzz/{i}/{rank}", json.dumps(record["outcome"] == "raised" and record["category"]))
        deadline = time.monotonic() + WAIT_PEERS
        peers = [f"fuzz/{i}/{r}" for r in range(world)]
        while not store.check(peers) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not store.check(peers):
            record["peer_hung"] = [r for r in range(world) if not store.check([f"fuzz/{i}/{r}"])]
            return records
        states = [json.loads(store.get(key)) for key in peers]
        if any(s in ("backend", "absent") for s in states):
            return records  # the groups may be unusable: a fresh batch for what follows
        import flashoverlap as fo

        fo.release()
    return records


# -- the driver -----------------------------------------------------------------------------------------------------


def verdict(t: dict, records: list[dict | None]) -> tuple[str, str]:
    """("clean" | "by-design" | "defect", why)."""
    if any(r is None or r.get("peer_hung") for r in records):
        if t["rule"] == "first-call" and t["repeat"]:
            # the same documented limitation (below), where gloo aborts the process on the mismatched collectives
            return "known-limit", "first-call rule, repeated call: a rank hung or died (gloo abort)"
        return "defect", "hang: a rank never reported"
    outcomes = {r["outcome"] for r in records}
    if outcomes == {"returned", "raised"}:
        return "defect", "some ranks returned, others raised"
    if outcomes == {"returned"}:
        if t["perturb"] == "stale_layout":
            return "unverified", "every rank returned (a stale layout whose counts matched: no oracle)"
        if t["perturb"] not in BENIGN and any(r["correct"] is None for r in records):
            return "defect", "every rank returned though plain PyTorch could not run the call"
        bad = [r["rank"] for r in records if r["correct"] is False]
        if bad:
            return "defect", f"ranks {bad} returned a wrong result"
        return "clean", "returned, correct"
    cats = collections.Counter(r["category"] for r in records)
    if t["rule"] == "first-call" and t["repeat"] and set(cats) <= {"backend", "absent", "agree", "local"} and \
            cats.keys() & {"backend", "absent"}:
        # agreement.py's docstring: a rank that repeats an agreed call while another makes a new one is not seen
        # under the first-call rule (only debug mode exchanges on every call): the group's timeout ends it
        return "known-limit", f"first-call rule, repeated call: {dict(cats)}"
    if cats.get("backend"):
        return "defect", f"a collective broke or timed out (ranks in different collectives): {dict(cats)}"
    if set(cats) == {"agree"}:
        unnamed = [r["rank"] for r in records if not r["names_op"]]
        if unnamed:
            return "defect", f"message does not name the op on ranks {unnamed}"
        if t["perturb"] in BENIGN:
            return "clean", "raised (a benign perturbation refused)"
        return "clean", "every rank raised, agreement"
    if set(cats) <= {"local", "absent"} and cats.get("absent"):
        return "by-design", "a rank's local error; its peers waited the group's timeout"
    if set(cats) == {"local"}:
        unnamed = [r["rank"] for r in records if not r["names_op"]]
        if unnamed:
            return "defect", f"every rank raised, but the message does not name the op on ranks {unnamed}"
        return "clean", "every rank raised (a local check)"
    return "defect", f"mixed errors {dict(cats)}"


def run(trials: list[dict], world: int, spawn_timeout: float) -> list[list[dict | None]]:
    from flashoverlap.testing import spawn

    try:
        per_rank = spawn(batch, world, "gloo", args=(trials,), timeout=spawn_timeout, grace=WAIT_PEERS + 10)
    except Exception as exc:  # noqa: BLE001  a rank died or the spawn timed out
        if len(trials) == 1:
            return [[{"rank": -1, "outcome": "raised", "category": "spawn", "message": str(exc)[-600:],
                      "names_op": False, "peer_hung": True}] * world]
        return [x for t in trials for x in run([t], world, spawn_timeout)]
    done = min(len(r) for r in per_rank)
    out = [[per_rank[q][i] for q in range(world)] for i in range(done)]
    if done < len(trials):  # the batch stopped early at trial done-1: the rest in a fresh batch
        out += run(trials[done:], world, spawn_timeout) if done > 0 else []
        if done == 0:
            out = run(trials[:1], world, spawn_timeout) + run(trials[1:], world, spawn_timeout)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=12, help="trials per spawn of the ranks")
    parser.add_argument("--only", default=None, choices=OPS, help="one op's trials")
    parser.add_argument("--replay", type=int, default=None, help="one trial by its seed")
    parser.add_argument("--world", type=int, default=None, choices=(2, 3),
                        help="only this world size (default: 2 and 3, the seeds alternating between them: even "
                             "seeds at 2, odd at 3, --replay too)")
    parser.add_argument("--show", action="store_true", help="print every trial")
    parser.add_argument("--log", default=None, help="append every trial as a JSON line")
    options = parser.parse_args()
    if options.trials < 1 or options.batch < 1:
        parser.error("--trials and --batch take a positive count")
    if options.replay is not None:
        t = draw(options.replay, options.world or 2 + options.replay % 2, options.only)  # the world its run drew
        records = run([t], t["world"], 120)[0]
        print(json.dumps(t))
        for r in records:
            print(json.dumps(r))
        kind, why = verdict(t, records)
        print(kind, why)
        sys.exit(1 if kind == "defect" else 0)
    summary = collections.Counter()
    defects = []
    log = open(options.log, "a") if options.log else None
    seeds = list(range(options.seed, options.seed + options.trials))
    for world in (options.world,) if options.world else (2, 3):
        mine = [draw(s, world, options.only) for s in seeds if options.world or (s % 2) == (world - 2)]
        for start in range(0, len(mine), options.batch):
            chunk = mine[start:start + options.batch]
            results = run(chunk, world, 60 + 40 * len(chunk))
            for t, records in zip(chunk, results):
                kind, why = verdict(t, records)
                key = (t["op"], kind)
                summary[key] += 1
                if log:
                    log.write(json.dumps({"trial": t, "records": records, "verdict": [kind, why]}) + "\n")
                    log.flush()
                if options.show or kind == "defect":
                    print(f"[{kind}] seed={t['seed']} W={world} {t['op']} perturb={t['perturb']} rule={t['rule']} "
                          f"repeat={t['repeat']}: {why}", flush=True)
                    if kind == "defect":
                        defects.append((t, records))
                        for r in records:
                            print("   ", json.dumps({k: v for k, v in (r or {}).items() if k != "trace"})[:600],
                                  flush=True)
    print("\nsummary (op, verdict): count")
    for key, count in sorted(summary.items()):
        print(f"  {key}: {count}")
    print(f"defects: {len(defects)}")
    sys.exit(1 if defects else 0)


if __name__ == "__main__":
    main()
