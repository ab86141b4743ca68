"""The MoE layer benchmark's fp8 rows (``--precisions bf16 fp8-row fp8-block``) on two gloo ranks at a toy size with
H = F = 128 (block-wise scales apply), a stand-in timer that runs every timed function: the plain fp8 layer (fp8 rows
and scales all-to-all'd, the scaled grouped GEMM dequantised on the CPU) computes what the fp8 expert ops compute;
the fp8 training rows run ours (``ExpertParallelMLP(fp8="row")``'s autograd) and the plain layer around torchao's
grouped GEMM (here ``fp8_training_cases``' CPU emulation of it: torchao's runs on CUDA only), close to each other;
every row carries its precision and the fp8 rows ``t_plain_bf16_ms``; block-wise training and a width that is no
multiple of 128 are note rows; the command line takes ``--precisions`` with bf16 the default."""

import torch

from tests.moe import fp8_training_cases as fc


def _bench(rank, world):
    import benchmarks.moe as bench
    from benchmarks.moe import MoEConfig, PlainFp8MoE, PlainMoE, _ours_fp8, _ours_fp8_training, bench_rows, route

    bench._torchao_gmm = lambda: fc._TorchaoGroupedMM.apply  # torchao's grouped GEMM, emulated on the CPU
    config = MoEConfig(4, 2, 128, 128)
    local = config.experts // world
    gen = torch.Generator().manual_seed(rank)
    w_up = (torch.randn(local, 128, 256, generator=gen) / 11).bfloat16()
    w_down = (torch.randn(local, 128, 128, generator=gen) / 11).bfloat16()
    x = torch.randn(10, 128, generator=gen).bfloat16()
    idx, weights = route(10, config, "zipf", rank, torch.device("cpu"), torch.bfloat16)
    errors = {}
    want = PlainMoE(w_up, w_down, None)(x, idx, weights).double()
    for scaling in ("row", "block"):
        wu, wd = bench.fp8_weights(w_up, scaling), bench.fp8_weights(w_down, scaling)
        plain = PlainFp8MoE(wu, wd, scaling, None)(x, idx, weights).double()
        ours = _ours_fp8(wu, wd, None, "exact", "auto")(x, idx, weights).double()
        errors[f"{scaling}: ours vs plain fp8"] = float((ours - plain).norm() / plain.norm())
        errors[f"{scaling}: plain fp8 vs bf16 (fp8's own error)"] = float((plain - want).norm() / want.norm())
    master = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_up, w_down)]
    outs = []
    for ours in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, *master, weights)]
        if ours:
            layer = _ours_fp8_training(leaves[1], leaves[2], None, "exact", "auto")
        else:
            layer = PlainMoE(leaves[1], leaves[2], None, gmm=bench._torchao_gmm())
        y = layer(leaves[0], idx, leaves[3])
        y.float().sum().backward()
        outs.append([y.detach(), *(t.grad for t in leaves)])
    for name, theirs, ours in zip(("y", "dx", "dw_up", "dw_down", "drouter"), *outs):
        errors[f"training {name}: ours vs plain"] = float((ours.double() - theirs.double()).norm()
                                                          / theirs.double().norm())

    calls = []

    def timer(fns, host):
        for fn in fns.values():
            fn()
            calls.append(1)
        host.update({name: 1.0 for name in fns})
        return {"t_plain_ms": 3.0, "t_nocomm_ms": 1.0, "t_ms": 2.0, "t_plain_bf16_ms": 4.0}

    configs = {"toy128": config, "toy": bench.TOY_CONFIGS["toy"]}
    rows = bench_rows(configs, [6], ["zipf"], ["exact"], ["auto"], ["forward", "forward+backward"], timer,
                      device=torch.device("cpu"), precisions=["bf16", "fp8-row", "fp8-block"])
    return errors, rows, len(calls)


def test_fp8_bench_rows(ranks):
    for errors, rows, calls in ranks(2).run(_bench):
        for what, err in errors.items():
            limit = 0.1 if "fp8's own" in what else 0.02
            assert err < limit, (what, err, errors)
        assert min(err for what, err in errors.items() if "fp8's own" in what) > 1e-3, errors  # fp8 did run
        timed = [r for r in rows if "notes" not in r]
        notes = {(r["config"], r["precision"], r["pass"]): r["notes"] for r in rows if "notes" in r}
        # toy128: bf16 and fp8-row both passes, fp8-block forward; toy: bf16 both passes (fp8 needs 128-multiples
        # block-wise; toy's row-wise rows run).
        got = sorted((r["config"], r["precision"], r["pass"]) for r in timed)
        want = sorted([("toy128", p, q) for p in ("bf16", "fp8-row") for q in ("forward", "forward+backward")]
                      + [("toy128", "fp8-block", "forward")]
                      + [("toy", p, q) for p in ("bf16", "fp8-row") for q in ("forward", "forward+backward")])
        assert got == want, got
        assert "inference only" in notes[("toy128", "fp8-block", "forward+backward")], notes
        assert "multiples of 128" in notes[("toy", "fp8-block", "forward")], notes
        for row in timed:
            fp8 = row["precision"] != "bf16"
            assert ("t_plain_bf16_ms" in row) == fp8 and row["E"] == 0.5 and row["path"] == "reference", row
        assert calls == sum(4 if r["precision"] != "bf16" else 3 for r in timed)


def test_precisions_option():
    import argparse

    from benchmarks.moe import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).precisions == ["bf16"]
    assert parser.parse_args(["--precisions", "bf16", "fp8-row", "fp8-block"]).precisions == [
        "bf16", "fp8-row", "fp8-block"]
