"""moe_layout, moe_dispatch_gemm and moe_gemm_combine on the reference path at W = 2, 3, 4 (gloo) against the plain
unsharded SwiGLU MoE (``cases.py``): output and every gradient (tokens, both expert weights, router weights), with
and without autograd (the custom ops and the direct runtime call), in bf16, fp16 and fp32 (turning from case to
case), exact and bounded mode, every routing of ``cases.ROUTINGS`` at top-k 1, 2 and 8, uneven token counts,
weights as ``transpose(1, 2)`` views and contiguous; allocations poisoned (``ranks.py``), bounded mode's padding
rows checked to be zero; the layout's ``max_pair_rows`` against the largest pair of the whole problem."""

import pytest
import torch
import torch.nn.functional as F

from tests.moe import cases


def _padding(layout, rows: int) -> torch.Tensor:
    """The receive rows no segment covers."""
    covered = torch.zeros(rows, dtype=torch.bool)
    for start, end in zip(layout.recv_seg_starts.tolist(), layout.recv_seg_ends.tolist()):
        covered[start:end] = True
    return ~covered


DTYPES = ("bfloat16", "float16", "float32")


def _forward_backward(rank, world, mode):
    """Every routing at every top-k it allows, the dtype turning from case to case (each dtype meets most routings
    over the three world sizes and two modes)."""
    import flashoverlap as fo
    from flashoverlap.ops import moe_library

    done = []
    turn = world + (mode == "bounded")
    for case, routing in enumerate(cases.ROUTINGS):
        ks = sorted({cases.top_k_for(routing, k, cases.experts_for(world), world) for k in (1, 2, 8)})
        for top_k in ks:
            seed = 100 * case + top_k
            dtype_name = DTYPES[(turn := turn + 1) % len(DTYPES)]
            dtype = getattr(torch, dtype_name)
            p = cases.problem(world, routing, top_k, dtype, seed)
            want = cases.oracle(p, rank)
            own = slice(rank * p["local"], (rank + 1) * p["local"])
            bound = None
            if mode == "bounded":  # ranks hold different token counts: the worst case over them, agreed
                bound = max(1, max(x.shape[0] for x in p["x"]) * top_k)
            where = f"{routing} top_k={top_k} {mode} {dtype_name} W={world} rank {rank}"
            x = p["x"][rank].clone().requires_grad_()
            weights = p["weights"][rank].clone().requires_grad_()
            w13 = p["w13"][own].clone().requires_grad_()
            w2 = p["w2"][own].clone().requires_grad_()
            layout = fo.moe_layout(p["idx"][rank], p["experts"], mode=mode, bound=bound)
            # The group's largest (source, destination) pair, the same on every rank (exact: from the exchanged
            # counts; bounded: the bound), also in the layout the custom ops rebuild from its tensors and values.
            pairs = [int((i // p["local"] == d).sum()) for i in p["idx"] for d in range(world)]
            largest = max(pairs) if mode == "exact" else bound
            rebuilt = moe_library.layout_of(layout.tensors(), moe_library.layout_values(layout))
            assert layout.max_pair_rows == largest == rebuilt.max_pair_rows, f"{where}: max_pair_rows"
            # The transposed views nn.Linear-shaped weights give, and (every other case) contiguous [L, K, N].
            w_up, w_down = w13.transpose(1, 2), w2.transpose(1, 2)
            if seed % 2:
                w_up, w_down = w_up.contiguous(), w_down.contiguous()
            h = fo.moe_dispatch_gemm(x, w_up, layout)
            received = sum(int(((i >= own.start) & (i < own.stop)).sum()) for i in p["idx"])
            rows = received if mode == "exact" else world * bound
            assert h.shape == (rows, 2 * cases.FFN), f"{where}: h is {list(h.shape)}, want {rows} rows"
            if mode == "bounded":
                assert not h[_padding(layout, rows)].any(), f"{where}: padding rows of h are not zero"
            a = F.silu(h[:, : cases.FFN]) * h[:, cases.FFN :]
            y = fo.moe_gemm_combine(a, w_down, weights, layout)
            cases.close(f"{where}: y", y, want["y"], dtype)
            (y.float() * p["grad"][rank].float()).sum().backward()
            for name, got in (("x", x.grad), ("weights", weights.grad), ("w13", w13.grad), ("w2", w2.grad)):
                assert got is not None, f"{where}: no gradient for {name}"
                cases.close(f"{where}: grad {name}", got, want[name], dtype)
            if seed % 2 == 0:
                with torch.no_grad():  # the direct runtime call (no custom op)
                    h = fo.moe_dispatch_gemm(p["x"][rank], w_up, layout)
                    y = fo.moe_gemm_combine(F.silu(h[:, : cases.FFN]) * h[:, cases.FFN :], w_down,
                                            p["weights"][rank], layout)
                cases.close(f"{where}: y without autograd", y, want["y"], dtype)
            done.append((routing, top_k, dtype_name))
    return done


@pytest.mark.parametrize("mode", ["exact", "bounded"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_the_plain_moe(ranks, world, mode):
    done = ranks(world).run(_forward_backward, mode)[0]
    assert {1, 2, 8} <= {k for _, k, _ in done} and {r for r, _, _ in done} == set(cases.ROUTINGS)
    assert {d for _, _, d in done} == set(DTYPES)
