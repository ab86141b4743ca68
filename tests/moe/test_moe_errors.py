"""Bad input to the MoE ops, on two gloo ranks: every error names the argument and is raised on every rank before
any token row moves, and the group stays usable (a good call after the errors gives the plain answer). Local
errors (types, shapes, a hidden size that disagrees with the weights, a layout used with another group, a bad
``out``); collective errors (an expert index out of range on one rank, exact and bounded mode, a routing beyond
the bound, ranks that disagree on the mode or the bound, one rank's weights holding another number of experts) are
raised by every rank together; in debug mode
(``FLASHOVERLAP_DEBUG_TIMEOUT``) ranks that disagree on a call (bound, dtype, path, hidden size) or on the counts
raise, naming the ranks."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.moe import cases


def _raises(kind, match, fn, *args, **kwargs) -> str:
    with pytest.raises(kind, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _good_call(rank, p, fo, mode="exact", out=False):
    """A call the errors must not have spoiled: the plain answer (``out``: into a preallocated result, poisoned)."""
    own = slice(rank * p["local"], (rank + 1) * p["local"])
    layout = fo.moe_layout(p["idx"][rank], p["experts"], mode=mode, bound=64 if mode == "bounded" else None)
    h = fo.moe_dispatch_gemm(p["x"][rank], p["w13"][own].transpose(1, 2), layout)
    given = torch.full((layout.tokens, cases.H), float("nan")) if out else None
    y = fo.moe_gemm_combine(F.silu(h[:, : cases.FFN]) * h[:, cases.FFN :], p["w2"][own].transpose(1, 2),
                            p["weights"][rank], layout, out=given)
    assert given is None or y is given
    cases.close("after the errors", y, cases.oracle(p, rank)["y"], torch.float32)


def _argument_errors(rank, world):
    import flashoverlap as fo

    p = cases.problem(world, "skewed", 2, torch.float32)
    own = slice(rank * p["local"], (rank + 1) * p["local"])
    x, idx, weights = p["x"][rank], p["idx"][rank], p["weights"][rank]
    w_up, w_down = p["w13"][own].transpose(1, 2), p["w2"][own].transpose(1, 2)
    E = p["experts"]
    _raises(TypeError, "topk_idx must be a torch.Tensor", fo.moe_layout, idx.tolist(), E)
    _raises(ValueError, "topk_idx must be a 2-D integer tensor", fo.moe_layout, idx.float(), E)
    _raises(ValueError, "topk_idx must be a 2-D integer tensor", fo.moe_layout, idx[:, 0], E)
    _raises(ValueError, "num_experts must be a positive multiple of the group's 2 ranks", fo.moe_layout, idx, 7)
    _raises(ValueError, r"k must lie in \[1, num_experts = 2\]", fo.moe_layout, torch.zeros(3, 4, dtype=torch.int64),
            2)
    _raises(ValueError, "mode must be one of", fo.moe_layout, idx, E, mode="fast")
    _raises(ValueError, "bound must be an int >= 1", fo.moe_layout, idx, E, mode="bounded", bound=0)
    _raises(ValueError, "bound must be an int >= 1", fo.moe_layout, idx, E, mode="bounded", bound=True)  # was 1
    _raises(ValueError, "bound=5 applies to mode='bounded' only", fo.moe_layout, idx, E, bound=5)
    layout = fo.moe_layout(idx, E)
    _raises(ValueError, "x has hidden size 15", fo.moe_dispatch_gemm, x[:, :15], w_up, layout)
    _raises(ValueError, "x has 9 rows but the layout routes", fo.moe_dispatch_gemm, x[:9], w_up, layout)
    _raises(ValueError, "w_up must be 3-D", fo.moe_dispatch_gemm, x, w_up[0], layout)
    _raises(ValueError, "x is torch.float32 but w_up is torch.bfloat16", fo.moe_dispatch_gemm, x,
            w_up.bfloat16(), layout)
    _raises(ValueError, "x must be bfloat16, float16 or float32", fo.moe_dispatch_gemm, x.long(), w_up, layout)
    _raises(ValueError, "the weights hold 3 local experts", fo.moe_dispatch_gemm, x, w_up[:3], layout)
    _raises(TypeError, "layout must be the Layout moe_layout returns", fo.moe_dispatch_gemm, x, w_up, idx)
    _raises(ValueError, "path must be one of", fo.moe_dispatch_gemm, x, w_up, layout, path="fast")
    _raises(ValueError, "path='nccl' needs CUDA tensors", fo.moe_dispatch_gemm, x, w_up, layout, path="nccl")
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group, in one order
    _raises(ValueError, "layout was built for 2 ranks but the group has 1", fo.moe_dispatch_gemm, x, w_up, layout,
            alone)
    # Through the custom op (autograd records it): the same errors.
    _raises(ValueError, "x has hidden size 15", fo.moe_dispatch_gemm, x[:, :15].clone().requires_grad_(), w_up,
            layout)
    h = fo.moe_dispatch_gemm(x, w_up, layout)
    a = F.silu(h[:, : cases.FFN]) * h[:, cases.FFN :]
    _raises(ValueError, "a has 3 rows but the layout delivers", fo.moe_gemm_combine, a[:3], w_down, weights, layout)
    _raises(ValueError, "a has 23 features", fo.moe_gemm_combine, a[:, :23], w_down, weights, layout)
    _raises(ValueError, "topk_weights must be a floating tensor of topk_idx's shape", fo.moe_gemm_combine, a, w_down,
            weights[:, :1], layout)
    _raises(ValueError, "topk_weights must be a floating tensor", fo.moe_gemm_combine, a, w_down, idx, layout)
    _raises(ValueError, "w_down must be 3-D", fo.moe_gemm_combine, a, w_down[0], weights, layout)
    # out_dtype is fp8 calls' (fp8 weights): a bf16/fp16/fp32 call returns its rows' dtype, so another one raises
    # (it was ignored: out_dtype=torch.float32 on bf16 operands returned bf16).
    _raises(ValueError, "moe_dispatch_gemm: out_dtype=torch.float32 applies to fp8 calls .* x is torch.bfloat16",
            fo.moe_dispatch_gemm, x.bfloat16(), w_up.bfloat16(), layout, out_dtype=torch.float32)
    _raises(ValueError, "moe_gemm_combine: out_dtype=torch.float32 applies to fp8 calls .* a is torch.bfloat16",
            fo.moe_gemm_combine, a.bfloat16(), w_down.bfloat16(), weights, layout, out_dtype=torch.float32)
    _raises(ValueError, "moe_gemm_combine: out_dtype=torch.float16 applies to fp8 calls", fo.moe_gemm_combine, a,
            w_down, weights, layout, out_dtype=torch.float16)
    assert fo.moe_gemm_combine(a, w_down, weights, layout, out_dtype=torch.float32).dtype == torch.float32
    tokens = x.shape[0]
    for out, got in ((torch.empty(tokens + 1, cases.H), rf"\[{tokens + 1}, {cases.H}\] torch.float32"),
                     (torch.empty(tokens, cases.H, dtype=torch.float16), "torch.float16"), ([], "list")):
        _raises((ValueError, TypeError), rf"moe_gemm_combine: out must be .*{got}", fo.moe_gemm_combine, a, w_down,
                weights, layout, out=out)
    _raises(ValueError, "out= does not take part in autograd", fo.moe_gemm_combine, a, w_down,
            weights.clone().requires_grad_(), layout, out=torch.empty(tokens, cases.H))
    _good_call(rank, p, fo, out=True)
    return True


def _collective_errors(rank, world):
    import flashoverlap as fo
    from flashoverlap.comm.expert import BoundExceeded

    p = cases.problem(world, "balanced", 2, torch.float32)
    idx = p["idx"][rank].clone()
    if rank == 1:
        idx[3, 1] = p["experts"]  # one index out of range, on rank 1 only: both ranks must raise
    message = _raises(ValueError, r"topk_idx: rank\(s\) \[1\] of group .* hold expert indices outside \[0, 8\)",
                      fo.moe_layout, idx, p["experts"])
    below = p["idx"][rank].clone()
    if rank == 0:
        below[0, 0] = -1  # a negative index, on rank 0 only, in bounded mode (checked with the bound)
    _raises(ValueError, r"topk_idx: rank\(s\) \[0\] of group .* outside \[0, 8\) \(1 in all\); nothing was sent",
            fo.moe_layout, below, p["experts"], mode="bounded", bound=64)
    # Every token to rank 0's experts: 11 rows from rank 1 to rank 0 (T_1 = 11 tokens, top-1 there).
    crowded = torch.zeros((p["x"][rank].shape[0], 1), dtype=torch.int64)
    bound = _raises(BoundExceeded, r"bound=10 rows per \(source, destination\) exceeded .*rank 1 -> rank 0: 11",
                    fo.moe_layout, crowded, p["experts"], mode="bounded", bound=10)
    at_the_bound = fo.moe_layout(crowded, p["experts"], mode="bounded", bound=11)  # exactly the bound: fine
    h = fo.moe_dispatch_gemm(p["x"][rank], p["w13"][:4].transpose(1, 2), at_the_bound)
    # Rank 0 receives its own 10 rows and rank 1's 11, each in its slot of 11 rows; rank 1 receives none.
    assert h.shape[0] == 22 and int(h.any(dim=1).sum()) == (21 if rank == 0 else 0)
    # The default bound is tokens * top_k: ranks with 10 and 11 tokens disagree, and so do exact and bounded.
    disagree = _raises(ValueError, r"disagree on the mode or the bound \(rank 0: bounded, bound=20, rank 1: "
                       r"bounded, bound=22\)", fo.moe_layout, p["idx"][rank], p["experts"], mode="bounded")
    _raises(ValueError, r"disagree on the mode or the bound \(rank 0: exact, rank 1: bounded, bound=30\)",
            fo.moe_layout, p["idx"][rank], p["experts"], mode=("exact", "bounded")[rank], bound=rank * 30 or None)
    _good_call(rank, p, fo, mode="bounded")
    return message, bound, disagree


def _debug_errors(rank, world):
    import flashoverlap as fo
    from flashoverlap import settings

    before = os.environ.get("FLASHOVERLAP_DEBUG_TIMEOUT")  # the ranks outlive the test: leave it as found
    os.environ["FLASHOVERLAP_DEBUG_TIMEOUT"] = "60"
    settings.refresh()
    try:
        p = cases.problem(world, "skewed", 2, torch.float32)
        q = cases.problem(world, "balanced", 2, torch.float32, seed=7)
        own = slice(rank * p["local"], (rank + 1) * p["local"])
        w_up = p["w13"][own].transpose(1, 2)
        _raises(ValueError, rf"the ranks disagree on bound \({40 + rank} here, {41 - rank} on rank {1 - rank}\)",
                fo.moe_layout,
                p["idx"][rank], p["experts"], mode="bounded", bound=40 + rank)
        layouts = [fo.moe_layout(p["idx"][rank], p["experts"]), fo.moe_layout(q["idx"][rank], p["experts"])]
        # Rank 1 passes the other layer's layout: what each rank sends is not what the other expects.
        _raises(ValueError, "the ranks' layouts disagree .*rank 0 sends rank 1 other counts than rank 1 expects",
                fo.moe_dispatch_gemm, p["x"][rank], w_up, layouts[rank])
        x = p["x"][rank] if rank == 0 else p["x"][rank].half()
        dtypes = ("float32", "float16")  # the values named, not their codes
        mine, theirs = dtypes[rank], dtypes[1 - rank]
        _raises(ValueError, rf"the ranks disagree on dtype \({mine} here, {theirs} on rank {1 - rank}\)",
                fo.moe_dispatch_gemm, x, w_up.to(x.dtype), layouts[0])
        paths = ("auto", "reference")
        _raises(ValueError, rf"the ranks disagree on path \({paths[rank]} here, {paths[1 - rank]} on rank {1 - rank}\)",
                fo.moe_dispatch_gemm, p["x"][rank], w_up, layouts[0], path=paths[rank])
        # Each rank's x and w_up agree, but rank 1's hidden size is not rank 0's.
        width = cases.H - rank
        _raises(ValueError, rf"hidden size H \({width} here, {cases.H - 1 + rank} on rank {1 - rank}\)",
                fo.moe_dispatch_gemm,
                p["x"][rank][:, :width], w_up[:, :width], layouts[0])
        _good_call(rank, p, fo)
    finally:
        if before is None:
            del os.environ["FLASHOVERLAP_DEBUG_TIMEOUT"]
        else:
            os.environ["FLASHOVERLAP_DEBUG_TIMEOUT"] = before
        settings.refresh()
    return True


def _one_rank_holds_other_experts(rank, world):
    """Rank 1 passes every expert's weights (the unsharded ones), rank 0 its own: the weights' L is checked against
    the layout only once the ranks agreed on the call, so both must raise there, naming it; before, rank 1 raised
    alone and rank 0 waited in the all-to-all until the group's timeout."""
    import flashoverlap as fo

    p = cases.problem(world, "skewed", 2, torch.float32)
    own = slice(rank * p["local"], (rank + 1) * p["local"]) if rank == 0 else slice(None)
    layout = fo.moe_layout(p["idx"][rank], p["experts"])
    mine, theirs = (p["local"], p["experts"]) if rank == 0 else (p["experts"], p["local"])
    named = rf"disagree on local experts \(the weights' L\) \({mine} here, {theirs} on rank {1 - rank}\)"
    _raises(ValueError, named, fo.moe_dispatch_gemm, p["x"][rank], p["w13"][own].transpose(1, 2), layout)
    good = slice(rank * p["local"], (rank + 1) * p["local"])
    h = fo.moe_dispatch_gemm(p["x"][rank], p["w13"][good].transpose(1, 2), layout)
    a = F.silu(h[:, : cases.FFN]) * h[:, cases.FFN :]
    _raises(ValueError, named, fo.moe_gemm_combine, a, p["w2"][own].transpose(1, 2), p["weights"][rank], layout)
    _good_call(rank, p, fo)
    return True


def test_bad_arguments_are_named_before_anything_moves(ranks):
    ranks(2).run(_argument_errors)


def test_a_bad_index_or_an_exceeded_bound_raises_on_every_rank(ranks):
    (index0, bound0, disagree0), (index1, bound1, disagree1) = ranks(2).run(_collective_errors)
    assert disagree0 == disagree1
    assert index0 == index1 and "nothing was sent" in index0
    assert "bound=10" in bound0 and "bound=10" in bound1 and "bound >= 11" in bound0


def test_debug_mode_names_the_ranks_that_disagree(ranks):
    ranks(2).run(_debug_errors)


def test_a_rank_whose_weights_hold_other_experts_makes_every_rank_raise(ranks):
    assert ranks(2).run(_one_rank_holds_other_experts, timeout=120) == [True, True]
