"""The two-GPU fp8 benchmark (``benchmarks/fp8_ops.py``) dry-run on the CPU at W = 2 (gloo, tiny shapes, the
reference path, wall-clock times): fp8 operands and scales of each mode's shapes, every op checked against
``torch._scaled_mm`` (or the dequantised product) then the collective, the rows in the bf16 file's format plus the fp8
fields, the meta, and the results file rank 0 writes."""

import json
import math
import os

import pytest
import torch

from flashoverlap.testing import spawn

ROW_FIELDS = {"op", "path", "dtype", "M", "N", "K", "t_gemm_ms", "t_comm_ms", "t_seq_ms", "t_ms", "t_ideal_ms",
              "speedup", "E", "host_us", "baselines", "scaling", "t_bf16_op_ms", "t_fused_scaled_ms", "auto",
              "rel_err"}
META_FIELDS = {"gpus", "world_size", "setting", "torch", "triton", "nccl", "commit", "command", "date"}


def _dry_run(rank, world, out):
    from benchmarks.fp8_ops import parser, run

    argv = ["--dry-run", "--out", out]
    meta, rows, path = run(parser().parse_args(argv), argv, True, torch.device("cpu"))
    return meta, rows, path


def _operands(rank, world):
    from benchmarks.fp8_ops import fp8_operands

    shapes = {}
    for op in ("all_reduce", "all_gather"):
        for mode in ("tensor", "row", "block"):
            x = fp8_operands(op, (64, 48, 256), mode, rank, world, torch.device("cpu"))
            assert x["a"].dtype == x["b"].dtype == torch.float8_e4m3fn
            assert x["a"].float().abs().max() > 0 and x["b"].float().abs().max() > 0  # never zeros
            assert x["b"].stride(0) == 1  # w.t(): column-major, as _scaled_mm wants it
            shapes[op, mode] = (tuple(x["a"].shape), tuple(x["scale_a"].shape), tuple(x["scale_b"].shape),
                                float(x["scale_a"].flatten()[0]))
    return shapes


def test_operands_and_scales_have_each_modes_shapes():
    ranks = spawn(_operands, 2)
    got = ranks[0]
    assert [v[:3] for v in got.values()] == [
        ((64, 256), (), ()), ((64, 256), (64, 1), (1, 48)), ((64, 256), (64, 2), (2, 1)),  # all-reduce: [M, K]
        ((32, 256), (), ()), ((32, 256), (32, 1), (1, 48)), ((32, 256), (32, 2), (2, 1)),  # all-gather: shards
    ]
    # Tensor-wise all-gather: one A scale on every rank (as torch's fused op assumes); elsewhere each rank its own.
    assert ranks[0]["all_gather", "tensor"][3] == ranks[1]["all_gather", "tensor"][3]
    assert ranks[0]["all_reduce", "row"][3] != ranks[1]["all_reduce", "row"][3]


def test_dry_run_rows_meta_and_results_file(tmp_path):
    out = str(tmp_path / "fp8.json")
    ranks = spawn(_dry_run, 2, args=(out,))
    meta, rows, path = ranks[0]
    assert path == out and os.path.exists(out)
    assert ranks[1][1] == rows or all(  # the same figures on both ranks (maximum over ranks), NaN aside
        json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) for a, b in zip(ranks[1][1], rows))
    with open(out) as f:
        written = json.load(f)
    assert written["meta"] == meta and len(written["rows"]) == len(rows) == 9
    assert META_FIELDS <= set(meta) and meta["world_size"] == 2 and meta["dry_run"] is True
    assert meta["setting"] == "dry-run" and "benchmarks.fp8_ops" in meta["command"]
    assert [(r["op"], r["scaling"]) for r in rows] == [
        (op, s) for op in ("all_reduce", "reduce_scatter", "all_gather") for s in ("tensor", "row", "block")]
    for r in rows:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        assert (r["M"], r["N"], r["K"], r["dtype"], r["path"]) == (64, 48, 256, "float8_e4m3fn", "reference")
        for name in ("t_gemm_ms", "t_comm_ms", "t_seq_ms", "t_ms", "t_bf16_op_ms"):
            assert r[name] > 0, (name, r)
        assert r["t_ideal_ms"] == max(r["t_gemm_ms"], r["t_comm_ms"])
        assert r["speedup"] == pytest.approx(r["t_seq_ms"] / r["t_ms"])
        if r["t_seq_ms"] > r["t_ideal_ms"]:
            assert r["E"] == pytest.approx((r["t_seq_ms"] - r["t_ms"]) / (r["t_seq_ms"] - r["t_ideal_ms"]))
        else:
            assert math.isnan(r["E"])
        assert all(e < 1e-2 for name, e in r["rel_err"].items() if name != "fused"), r["rel_err"]
        assert r["auto"]["path"] == "reference" and r["auto"]["t_ms"] > 0
        # No fused scaled op on the CPU (all-reduce: none in torch at all), and the note says why.
        assert r["t_fused_scaled_ms"] is None and r["baselines"]["async_tp_ms"] is None
        note = r["baselines"]["async_tp_note"]
        assert ("no fused scaled all-reduce" in note) if r["op"] == "all_reduce" else ("dry run" in note)


def _mismatch(rank, world):
    import benchmarks.fp8_ops as bench

    real = bench.SCALED_OPS["all_reduce"]
    bench.SCALED_OPS["all_reduce"] = lambda *args, **kw: real(*args, **kw) * 1.1
    try:
        with pytest.raises(AssertionError, match="relative error"):
            bench.bench_case("all_reduce", (64, 48, 256), "row", iters=1, dry_run=True, setting_name="dry-run",
                             device=torch.device("cpu"))
    finally:
        bench.SCALED_OPS["all_reduce"] = real
    return True


def test_a_wrong_result_fails_loudly():
    assert spawn(_mismatch, 2) == [True, True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA GPUs gets")
def test_without_cuda_and_without_dry_run_it_refuses_instead_of_a_dry_run_under_the_gpu_name(monkeypatch):
    """It used to fall into a dry run without CUDA and write it where the two-GPU results go (the device script
    then exited 0): a dry run is asked for by name."""
    import benchmarks.fp8_ops as bench

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--out", "never.json"])
    assert "needs 2 CUDA GPUs, one per rank, found none" in str(stop.value) and "--dry-run" in str(stop.value)


@pytest.mark.parametrize("argv,said", [
    (["--dry-run", "--out", "FOLDER"], "is a directory; name the results file"),
    (["--dry-run", "--shapes", "3,48,256"], "--shapes 3,48,256: reduce_scatter needs M divisible by the 2 ranks"),
    (["--dry-run", "--shapes", "64,48,200"], "--shapes 64,48,200: block-wise scales need K divisible by 128"),
    (["--shapes", "64,48,200", "--scalings", "block", "--ops", "all_reduce"], "block-wise scales need K divisible"),
])
def test_an_out_or_a_case_it_could_not_run_is_refused_before_the_group_starts(monkeypatch, tmp_path, capsys, argv,
                                                                               said):
    """``--out`` naming a folder failed in rank 0's write after the first row; ``--shapes`` with M not divisible by
    the ranks, or K not by the 128-wide block of block-wise scales, failed inside the first such case: a traceback
    from every rank (gloo's "Check failed", a size mismatch), GPUs or not."""
    import benchmarks.fp8_ops as bench

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [str(tmp_path) if arg == "FOLDER" else arg for arg in argv]
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2 and said in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_the_documented_cases_pass_the_check():
    import benchmarks.fp8_ops as bench

    for argv, world in (([], 2), ([], 8), (["--dry-run"], 2), (["--dry-run"], 4)):
        assert bench.case_problem(bench.parser().parse_args(argv), world) is None, (argv, world)
