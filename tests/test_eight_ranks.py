"""Every public op at W = 8 on gloo, in one spawn of eight ranks (one spawn runs them all in sequence: a spawn per op
would cost more than the ops): the tensor-parallel ops in bf16, fp16 and fp32 on the reference path and the ring
(send/recv over gloo), odd M, ``return_gathered``; the fp8 ops tensor-, row- and block-wise; the expert layout
(exact and bounded), dispatch and combine in bf16 with skewed routing and a rank with no tokens, and in fp8 (row-
and block-wise). Every rank checks its results against an oracle it computes itself from the same seeded inputs
(plain PyTorch, in fp32 or fp64), and every call of the sequence is counted."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashoverlap.testing import spawn

WORLD = 8


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)}, want {list(want.shape)}"
    scale = 1 + float(want.abs().max())
    err = float((got.double() - want.double()).abs().max())
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol} * {scale:.3g}"


def _tensor_parallel(fo, rank: int, world: int, done: list) -> None:
    from flashoverlap.plan import TileConfig

    gen = torch.Generator().manual_seed(42)
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
    tile = TileConfig(16, 16, 16, 2, 1, 4)

    def plan(path, op, m, n, k):  # the ring's own plan (the default one is sequential at these sizes)
        if path != "ring":
            return None
        ring = fo.default_plan(op, m, n, k, world, tile=tile, num_groups=2, path="ring", allow_sequential=False)
        assert not ring.sequential, (op, m, n, k)
        return ring

    for dtype, path in ((torch.bfloat16, "auto"), (torch.float16, "ring"), (torch.float32, "auto"),
                        (torch.bfloat16, "ring")):
        n, k = 24, 40
        # All-reduce takes any M (odd here; the ring's plan wants a tile row per group); reduce-scatter and
        # all-gather M a multiple of W.
        m_odd, m_rows = 131 if path == "ring" else 9, 3 * world
        a = [torch.randn(m_odd, k, generator=gen).to(dtype) for _ in range(world)]
        b = [torch.randn(k, n, generator=gen).to(dtype) for _ in range(world)]
        want = sum(x.double() @ y.double() for x, y in zip(a, b))
        _close(f"gemm_all_reduce {dtype} {path}",
               fo.gemm_all_reduce(a[rank], b[rank], path=path, plan=plan(path, "all_reduce", m_odd, n, k)), want,
               tol[dtype])
        done.append(("gemm_all_reduce", dtype, path))
        a = [torch.randn(m_rows, k, generator=gen).to(dtype) for _ in range(world)]
        want = sum(x.double() @ y.double() for x, y in zip(a, b))[rank * 3 : (rank + 1) * 3]
        _close(f"gemm_reduce_scatter {dtype} {path}",
               fo.gemm_reduce_scatter(a[rank], b[rank], path=path, plan=plan(path, "reduce_scatter", m_rows, n, k)),
               want, tol[dtype])
        done.append(("gemm_reduce_scatter", dtype, path))
        shards = [torch.randn(3, k, generator=gen).to(dtype) for _ in range(world)]
        w = torch.randn(n, k, generator=gen).to(dtype)  # an nn.Linear weight: b = w.t(), read in place
        c, gathered = fo.all_gather_gemm(shards[rank], w.t(), path=path, return_gathered=True,
                                         plan=plan(path, "all_gather", 3 * world, n, k))
        assert torch.equal(gathered, torch.cat(shards)), f"all_gather_gemm {dtype} {path}: gathered rows"
        _close(f"all_gather_gemm {dtype} {path}", c, torch.cat(shards).double() @ w.t().double(), tol[dtype])
        done.append(("all_gather_gemm", dtype, path))


def _fp8(rank: int, world: int, done: list) -> None:
    import flashoverlap as fo
    from tests.ops.test_scaled import E4M3, expected, quantise

    gen = torch.Generator().manual_seed(7)
    for mode in ("tensor", "row", "block"):
        m_shard, n, k = 2, 24 + 136 * (mode == "block"), 256 if mode == "block" else 48
        m = m_shard * world
        x = [torch.randn(m, k, generator=gen) for _ in range(world)]
        w = torch.randn(n, k, generator=gen)
        b_q, sb = quantise(w.t().contiguous(), mode, E4M3, "b")
        b = b_q.t().contiguous().t() if mode != "block" else b_q  # column-major, as _scaled_mm wants it
        if mode == "row":
            sb = sb.reshape(1, n)
        a_q = [quantise(xr, mode, E4M3, "a") for xr in x]
        want = sum(expected(aq, b, sa, sb, mode, torch.bfloat16).to(torch.bfloat16).float() for aq, sa in a_q)
        _close(f"scaled_gemm_all_reduce {mode}", fo.scaled_gemm_all_reduce(a_q[rank][0], b, a_q[rank][1], sb).float(),
               want, 1e-2)
        rows = slice(rank * m_shard, (rank + 1) * m_shard)
        _close(f"scaled_gemm_reduce_scatter {mode}",
               fo.scaled_gemm_reduce_scatter(a_q[rank][0], b, a_q[rank][1], sb).float(), want[rows], 1e-2)
        shards = [quantise(x[0][q * m_shard : (q + 1) * m_shard], mode, E4M3, "a") for q in range(world)]
        want = torch.cat([expected(aq, b, sa, sb, mode, torch.bfloat16) for aq, sa in shards])
        _close(f"all_gather_scaled_gemm {mode}",
               fo.all_gather_scaled_gemm(shards[rank][0], b, shards[rank][1], sb).float(), want, 1e-2)
        done += [(op, mode) for op in ("scaled_gemm_all_reduce", "scaled_gemm_reduce_scatter",
                                       "all_gather_scaled_gemm")]


def _experts(fo, rank: int, world: int, done: list) -> None:
    from tests.moe import cases

    for routing, mode in (("skewed", "exact"), ("rank-sends-none", "bounded")):
        p = cases.problem(world, routing, 2, torch.float32, seed=3)
        own = slice(rank * p["local"], (rank + 1) * p["local"])
        bound = max(x.shape[0] for x in p["x"]) * p["top_k"] if mode == "bounded" else None
        layout = fo.moe_layout(p["idx"][rank], p["experts"], mode=mode, bound=bound)
        h = fo.moe_dispatch_gemm(p["x"][rank], p["w13"][own].transpose(1, 2), layout)
        y = fo.moe_gemm_combine(F.silu(h[:, : cases.FFN]) * h[:, cases.FFN :], p["w2"][own].transpose(1, 2),
                                p["weights"][rank], layout)
        cases.close(f"moe {routing} {mode} rank {rank}", y, cases.oracle(p, rank)["y"], torch.float32)
        done += [("moe_layout", mode), ("moe_dispatch_gemm", routing), ("moe_gemm_combine", routing)]


def _fp8_experts(fo, rank: int, world: int, done: list) -> None:
    from tests.moe import fp8_cases as fc

    for scaling, mode in (("row", "exact"), ("block", "bounded")):
        p = fc.problem(world, "skewed", 2, scaling, seed=11)
        bound = max(x.shape[0] for x in p["x"]) * 2 if mode == "bounded" else None
        layout = fo.moe_layout(p["idx"][rank], p["experts"], mode=mode, bound=bound)
        w_up, s_up = fc.local_weights(p, rank, "up")
        w_down, s_down = fc.local_weights(p, rank, "down")
        xq = [fc.quantise64(x, scaling) for x in p["x"]]
        h = fo.moe_dispatch_gemm(xq[rank][0], w_up, layout, scale_x=xq[rank][1], scale_w=s_up)
        positions = fc.receive_positions(p, rank, bound)
        fc.close(f"fp8 dispatch {scaling} {mode}", h[positions] if positions else h[:0],
                 fc.dispatch_oracle(p, rank, [q for q, _ in xq], [s for _, s in xq]))
        a = torch.zeros(h.shape[0], fc.FFN, dtype=torch.bfloat16)
        for pos, (s, t, c, _) in zip(positions, fc.received(p, rank)):
            a[pos] = p["act"][s][t * 2 + c]
        aq = [fc.quantise64(act, scaling) for act in p["act"]]
        y = fo.moe_gemm_combine(a, w_down, p["router"][rank], layout, scale_w=s_down)
        fc.close(f"fp8 combine {scaling} {mode}", y, fc.combine_oracle(p, rank, [q for q, _ in aq],
                                                                        [s for _, s in aq]))
        done += [("moe_dispatch_gemm fp8", scaling), ("moe_gemm_combine fp8", scaling)]


def _every_op(rank: int, world: int) -> list:
    import flashoverlap as fo

    done: list = []
    _tensor_parallel(fo, rank, world, done)
    from flashoverlap.runtime.context import context_of

    held = context_of(dist.group.WORLD, torch.device("cpu")).communicators  # path="ring" ran the ring over gloo
    assert {("gemm", "ring"), ("gemm", "reference")} <= set(held), sorted(held)
    _fp8(rank, world, done)
    _experts(fo, rank, world, done)
    _fp8_experts(fo, rank, world, done)
    dist.barrier()
    return done


def test_every_public_op_at_eight_ranks_on_gloo():
    done = spawn(_every_op, WORLD, timeout=300)
    assert all(d == done[0] for d in done)
    ops = {entry[0] for entry in done[0]}
    assert ops == {"gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm", "scaled_gemm_all_reduce",
                   "scaled_gemm_reduce_scatter", "all_gather_scaled_gemm", "moe_layout", "moe_dispatch_gemm",
                   "moe_gemm_combine", "moe_dispatch_gemm fp8", "moe_gemm_combine fp8"}, ops
    assert len(done[0]) == 12 + 9 + 6 + 4
