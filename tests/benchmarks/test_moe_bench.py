"""The MoE layer benchmark's code on two gloo ranks at toy sizes (the CPU has no CUDA events: a stand-in timer
runs each timed function and returns fixed figures): the plain layer, its no-communication stand-in and ours compute
the same layer (outputs and gradients), every row carries every figure, E follows from them, and a path that cannot
serve the call is a note row, not a failure."""

import torch

from flashoverlap.testing import spawn


def _bench(rank, world):
    from benchmarks.moe import TOY_CONFIGS, PlainMoE, _ours, bench_rows, route

    config = TOY_CONFIGS["toy"]
    torch.manual_seed(rank)
    local = config.experts // world
    w_up = torch.randn(local, config.hidden, 2 * config.ffn, dtype=torch.bfloat16) / 4
    w_down = torch.randn(local, config.ffn, config.hidden, dtype=torch.bfloat16) / 5
    x = torch.randn(10, config.hidden, dtype=torch.bfloat16)  # the same tokens on each rank: the default bound
    idx, weights = route(10, config, "zipf", rank, torch.device("cpu"), torch.bfloat16)
    plain = PlainMoE(w_up, w_down, None)
    want = plain(x, idx, weights, record=True)
    errors = {}
    for name, layer in (("nocomm", lambda *a: plain(*a, comm=False)),
                        ("exact", _ours(w_up, w_down, None, "exact", "auto")),
                        ("bounded", _ours(w_up, w_down, None, "bounded", "auto"))):
        errors[name] = float((layer(x, idx, weights).float() - want.float()).abs().max() / want.float().abs().max())
    # Gradients: the plain layer's against ours (the stand-in's are meaningless by design).
    grads = []
    for ours in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w_up, w_down, weights)]
        if ours:
            out = _ours(leaves[1], leaves[2], None, "exact", "auto")(leaves[0], idx, leaves[3])
        else:
            out = PlainMoE(leaves[1], leaves[2], None)(leaves[0], idx, leaves[3])
        out.float().sum().backward()
        grads.append([t.grad.float() for t in leaves])
    errors["grads"] = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*grads))

    calls = []

    def timer(fns, host):
        for fn in fns.values():
            fn()
            calls.append(1)
        host.update({name: 1.0 for name in fns})
        return {"t_plain_ms": 3.0, "t_nocomm_ms": 1.0, "t_ms": 2.0}

    rows = bench_rows(TOY_CONFIGS, [6], ["balanced", "zipf"], ["exact", "bounded"], ["auto", "nccl"],
                      ["forward", "forward+backward"], timer, device=torch.device("cpu"))
    return errors, rows, len(calls)


def test_moe_bench_rows_on_two_cpu_ranks():
    for errors, rows, calls in spawn(_bench, 2):
        assert all(err < 3e-2 for err in errors.values()), errors
        timed = [r for r in rows if "notes" not in r]
        skipped = [r for r in rows if "notes" in r]
        assert len(timed) == 2 * 2 * 2 and calls == 3 * len(timed)  # routings x passes x modes
        assert len(skipped) == 2 * 2 and all("needs CUDA tensors" in r["notes"] for r in skipped)
        for row in timed:
            assert row["path"] == "reference" and row["W"] == 2 and row["E"] == 0.5
            assert row["host_us"] == row["host_plain_us"] == 1.0 and row["config"] == "toy"
