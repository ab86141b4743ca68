"""fp8 expert ops on the reference path at W = 2 and 3 (gloo) against the independent fp64 oracle of
``fp8_cases.py``: dispatch's products row by row in the receive order the oracle derives from the routing, combine's
outputs per token; row-wise and 128-block scales, fp8 rows given with their scales and bf16 rows quantised by the op,
exact and bounded mode (padding rows of ``h`` zero; padding rows of combine's input NaN: never read), balanced and
skewed routing, a rank with no tokens, a rank that receives none, a preallocated ``out``; ``torch.compile`` (bounded,
``fullgraph=True``) against eager; mixed dtypes and misshapen scales raise on every rank, naming the argument, and
the ranks go on; and the dispatched bytes at H = 7168 with one scale per 128 channels against bf16's, counted from
the P2P schedule and from what the reference hands ``all_to_all_single``. Allocations poisoned (``ranks.py``)."""

import pytest
import torch
import torch.nn.functional as F

from tests.moe import fp8_cases as fc


def _swiglu(h):
    return F.silu(h[:, : fc.FFN].float()) * h[:, fc.FFN :].float()


def _cases(rank, world):
    import flashoverlap as fo

    done = []
    turn = 0
    for r_index, routing in enumerate(fc.ROUTINGS):
        for scaling in ("row", "block"):
            for lmode in ("exact", "bounded"):
                turn += 1
                top_k = 2 if turn % 3 else 1
                seed = 1000 * world + 10 * r_index + turn
                p = fc.problem(world, routing, top_k, scaling, seed)
                where = f"{routing} {scaling} {lmode} k={top_k} W={world} rank {rank}"
                bound = None
                if lmode == "bounded":
                    bound = max(1, max(x.shape[0] for x in p["x"]) * top_k)
                layout = fo.moe_layout(p["idx"][rank], p["experts"], mode=lmode, bound=bound)
                w_up, s_up = fc.local_weights(p, rank, "up")
                w_down, s_down = fc.local_weights(p, rank, "down")
                # Rows: fp8 with scales (every other case) or bf16, quantised by the op (the oracle quantises them
                # the same way, in fp64).
                xq = [fc.quantise64(x, scaling) for x in p["x"]]
                given_fp8 = ((turn - 1) // 2 + r_index) % 2 == 0  # each (scaling, mode) both ways
                if given_fp8:
                    h = fo.moe_dispatch_gemm(xq[rank][0], w_up, layout, scale_x=xq[rank][1], scale_w=s_up)
                else:
                    h = fo.moe_dispatch_gemm(p["x"][rank], w_up, layout, scale_w=s_up)
                positions = fc.receive_positions(p, rank, bound)
                rows = len(positions) if lmode == "exact" else world * bound
                assert h.shape == (rows, 2 * fc.FFN) and h.dtype == torch.bfloat16, f"{where}: h {h.shape} {h.dtype}"
                want_h = fc.dispatch_oracle(p, rank, [q for q, _ in xq], [s for _, s in xq])
                fc.close(f"{where}: h", h[positions] if positions else h[:0], want_h)
                if lmode == "bounded":
                    pad = torch.ones(rows, dtype=torch.bool)
                    pad[positions] = False
                    assert not h[pad].any(), f"{where}: padding rows of h are not zero"
                # Combine's input: each received row's own intermediate (the oracle knows it by (source, token,
                # choice)); padding rows NaN.
                src_rows = fc.received(p, rank)
                a = torch.full((rows, fc.FFN), float("nan"), dtype=torch.bfloat16)
                for pos, (s, t, c, _) in zip(positions, src_rows):
                    a[pos] = p["act"][s][t * top_k + c]
                aq = [fc.quantise64(act, scaling) for act in p["act"]]
                out = torch.full((p["x"][rank].shape[0], fc.H), float("nan"), dtype=torch.bfloat16) \
                    if turn % 4 == 1 else None
                if (turn + r_index) % 2:  # fp8 a with its scales (padding rows NaN scales too)
                    a_q, a_s = fc.quantise64(torch.nan_to_num(a.double()), scaling)
                    a_s[~torch.isin(torch.arange(rows), torch.tensor(positions, dtype=torch.int64))] = float("nan")
                    y = fo.moe_gemm_combine(a_q, w_down, p["router"][rank], layout, scale_a=a_s, scale_w=s_down,
                                            out=out)
                else:
                    y = fo.moe_gemm_combine(a, w_down, p["router"][rank], layout, scale_w=s_down, out=out)
                assert out is None or y is out, f"{where}: out= was not returned"
                want_y = fc.combine_oracle(p, rank, [q for q, _ in aq], [s for _, s in aq])
                fc.close(f"{where}: y", y, want_y)
                done.append((routing, scaling, lmode, given_fp8))
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_ops_match_the_dequantised_oracle(ranks, world):
    done = ranks(world).run(_cases)[0]
    assert {r for r, *_ in done} == set(fc.ROUTINGS)
    assert {(s, m, g) for _, s, m, g in done} >= {(s, m, g) for s in ("row", "block") for m in ("exact", "bounded")
                                                  for g in (True, False)}


def _compiled(rank, world, scaling):
    import flashoverlap as fo

    p = fc.problem(world, "skewed", 2, scaling, 7 + world)
    bound = max(x.shape[0] for x in p["x"]) * 2
    w_up, s_up = fc.local_weights(p, rank, "up")
    w_down, s_down = fc.local_weights(p, rank, "down")
    traced = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        traced.extend(str(node.target) for node in gm.graph.nodes)
        return lookup_backend("aot_eager")(gm, example_inputs)

    def layer(x, idx, router):
        layout = fo.moe_layout(idx, p["experts"], mode="bounded", bound=bound)
        h = fo.moe_dispatch_gemm(x, w_up, layout, scale_w=s_up)
        return fo.moe_gemm_combine(_swiglu(h).bfloat16(), w_down, router, layout, scale_w=s_down)

    args = (p["x"][rank], p["idx"][rank], p["router"][rank])
    eager = layer(*args)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)(*args)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    return sorted({t for t in traced if "flashoverlap" in t})


def test_fp8_ops_compile_whole_in_bounded_mode(ranks):
    for world, scaling in ((2, "block"), (3, "row")):
        got = ranks(world).run(_compiled, scaling)[0]
        assert got == ["flashoverlap.moe_combine_scaled", "flashoverlap.moe_dispatch_scaled",
                       "flashoverlap.moe_layout"], got


def _errors(rank, world):
    import flashoverlap as fo

    p = fc.problem(world, "balanced", 2, "row", 3)
    layout = fo.moe_layout(p["idx"][rank], p["experts"])
    w_up, s_up = fc.local_weights(p, rank, "up")
    x = p["x"][rank]
    xq, xs = fc.quantise64(x, "row")
    bad = [
        (dict(x=xq, w=w_up.float(), scale_x=xs, scale_w=None), "w_up is torch.float32 but the call is fp8"),
        (dict(x=x, w=w_up, scale_x=None, scale_w=None), "fp8 w_up needs scale_w"),
        (dict(x=xq, w=w_up, scale_x=None, scale_w=s_up), "fp8 x needs scale_x"),
        (dict(x=x, w=w_up, scale_x=xs, scale_w=s_up), "scale_x is given but x is torch.bfloat16"),
        (dict(x=xq, w=w_up, scale_x=xs, scale_w=s_up[:, :-1]), r"scale_w must be float32 \[2, 256\]"),
        (dict(x=xq, w=w_up, scale_x=xs, scale_w=s_up.double()), r"scale_w must be float32"),
        (dict(x=xq, w=w_up, scale_x=xs[:, :1].expand(-1, 2), scale_w=s_up), r"scale_x must be float32 \[\d+, 1\]"),
        # DeepEP's [T, H/128] rows beside row-wise weights: the weights' scales set the mode, and the error says so.
        (dict(x=xq, w=w_up, scale_x=xs.expand(-1, 2), scale_w=s_up),
         r"scale_x must be .*\[rows, 1\], the mode scale_w's shape says: the rows' scales and the weights' share one "
         r"mode"),
        (dict(x=xq, w=w_up, scale_x=xs, scale_w=s_up[:, :, None]), r"scale_w must be float32 \[2, 2, 2\]"),
        (dict(x=x.double(), w=w_up, scale_x=None, scale_w=s_up), "x must be a 2-D bfloat16, float16 or float32"),
        # torch's grouped fp8 kernel (and the DeepEP/torchao formats) take e4m3: e5m2 is refused, not run by one way
        # and failing in another after the rows were sent.
        (dict(x=xq.to(torch.float8_e5m2), w=w_up, scale_x=xs, scale_w=s_up),
         "x must be float8_e4m3fn in an fp8 call .*got torch.float8_e5m2: quantise to float8_e4m3fn"),
        (dict(x=xq, w=w_up.to(torch.float8_e5m2), scale_x=xs, scale_w=s_up), "w_up must be float8_e4m3fn"),
        # The fp8 ops record no autograd: a gradient that would silently never come is refused.
        (dict(x=x.float().requires_grad_(), w=w_up, scale_x=None, scale_w=s_up), "x requires grad"),
    ]
    for args, message in bad:
        with pytest.raises((ValueError, TypeError), match=message):
            fo.moe_dispatch_gemm(args["x"], args["w"], layout, scale_x=args["scale_x"], scale_w=args["scale_w"])
    w_down, s_down = fc.local_weights(p, rank, "down")
    a = torch.randn(layout.recv_rows, fc.FFN).bfloat16()
    with pytest.raises(ValueError, match=r"scale_a must be float32 \[\d+, 1\]"):
        fo.moe_gemm_combine(a.to(fc.FP8), w_down, p["router"][rank], layout,
                            scale_a=torch.ones(layout.recv_rows, 2), scale_w=s_down)
    with pytest.raises(ValueError, match="topk_weights requires grad"):
        fo.moe_gemm_combine(a, w_down, p["router"][rank].float().requires_grad_(), layout, scale_w=s_down)
    with pytest.raises(ValueError, match="w_down is torch.bfloat16 but the call is fp8"):
        fo.moe_gemm_combine(a.to(fc.FP8), w_down.bfloat16(), p["router"][rank], layout,
                            scale_a=torch.ones(layout.recv_rows, 1), scale_w=s_down)
    # Nothing was sent: the ranks still agree on the next call.
    h = fo.moe_dispatch_gemm(xq, w_up, layout, scale_x=xs, scale_w=s_up)
    # Ranks whose combine outputs differ in dtype would send rows of other widths (gloo aborts the process): every
    # rank raises first, naming out_dtype by its values (no switch set: the call's first).
    out_dtype = (torch.bfloat16, torch.float32)[rank]
    names = ("bfloat16", "float32")
    with pytest.raises(ValueError, match=rf"disagree on out_dtype \({names[rank]} here, {names[1 - rank]} on rank"):
        fo.moe_gemm_combine(a.to(fc.FP8), w_down, p["router"][rank].detach(), layout,
                            scale_a=torch.ones(layout.recv_rows, 1), scale_w=s_down, out_dtype=out_dtype)
    return h.shape[0]


def test_fp8_errors_name_the_argument_before_anything_is_sent(ranks):
    ranks(2).run(_errors)


def _reference_bytes(rank, world):
    """The bytes the reference path hands all_to_all_single in one dispatch at H = 7168, fp8 block-wise and bf16."""
    import torch.distributed as dist

    import flashoverlap as fo
    from flashoverlap.comm.expert.scaled import quantise

    sent = []
    real = dist.all_to_all_single

    def counted(out, inp, *args, **kwargs):
        sent.append(inp.numel() * inp.element_size())
        return real(out, inp, *args, **kwargs)

    dist.all_to_all_single = counted
    try:
        hidden, local, tokens = 7168, 1, 3
        gen = torch.Generator().manual_seed(rank)
        idx = torch.randint(0, local * world, (tokens, 2), generator=gen)
        idx[:, 1] = (idx[:, 0] + 1) % (local * world)
        layout = fo.moe_layout(idx, local * world)
        x = torch.randn(tokens, hidden, generator=gen).bfloat16()
        w = torch.randn(local, hidden, 128, generator=gen).bfloat16()
        fo.moe_dispatch_gemm(x, w, layout)
        xq, xs = quantise(x, "block")
        scale_w = torch.ones(local, hidden // 128, 1)
        fo.moe_dispatch_gemm(xq, w.to(fc.FP8), layout, scale_x=xs, scale_w=scale_w)
    finally:
        dist.all_to_all_single = real
    return sent


def test_fp8_dispatch_moves_at_most_0_52_of_the_bf16_bytes(ranks):
    from flashoverlap.comm.expert import ExpertCall, ExpertPlan
    from flashoverlap.comm.expert import p2p as ep
    from flashoverlap.comm.expert.scaled import ExpertScales
    from flashoverlap.comm.steps import Copy

    hidden = 7168
    send, recv = (5, 7), (4, 9)
    plan = ExpertPlan("dispatch", 2, 2, hidden, 4096, 2, 6)
    bf16 = ExpertCall("d", plan, torch.empty(1, hidden, dtype=torch.bfloat16), torch.empty(0))
    scales = ExpertScales("block", torch.empty(0), torch.empty(0))
    fp8 = ExpertCall("d", plan, torch.empty(1, hidden, dtype=fc.FP8), torch.empty(0), scales=scales)
    pushed = [sum(op.rows for op in ep.schedule("dispatch", 0, send, recv) if isinstance(op, Copy) and op.stream == "X")
              * ep._row_bytes(call) for call in (bf16, fp8)]
    assert pushed[0] == 7 * hidden * 2
    assert pushed[1] == 7 * (hidden + 224)  # 7168 fp8 bytes and 56 fp32 scales per row
    assert pushed[1] / pushed[0] <= 0.52, pushed
    for bf16_bytes, fp8_bytes in ranks(2).run(_reference_bytes):
        assert fp8_bytes / bf16_bytes <= 0.52, (fp8_bytes, bf16_bytes)
