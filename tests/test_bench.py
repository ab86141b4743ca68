"""The installed ``flashoverlap bench ops`` on two gloo ranks (the CPU has no CUDA events: a stand-in timer runs each
timed call once and returns fixed figures): every op's calls run and ``ours`` computes what ``seq`` computes; every
row carries docs/benchmarks.md's columns, E follows from them; the table prints a line per row."""

import pytest
import torch

from flashoverlap import bench
from flashoverlap.testing import plain, spawn

TIMES = {"gemm": 1.0, "comm": 0.5, "seq": 1.5, "ours": 1.25}


def _rows(rank, world):
    outputs = {}
    for op in bench.OP_FUNCTIONS:
        a, b, fns = bench.calls(op, (8, 6, 4), torch.float32, device="cpu")
        outputs[op] = float((fns["ours"]() - plain(op, a, b)).abs().max())

    def timer(fns, host):
        for fn in fns.values():
            fn()
        host.update({name: 10.0 for name in fns})
        return dict(TIMES)

    rows = bench.bench_rows(list(bench.OP_FUNCTIONS), [(8, 6, 4), (4, 2, 2)], torch.float32, timer, device="cpu")
    return outputs, rows


def test_bench_rows_on_two_cpu_ranks(capsys):
    for outputs, rows in spawn(_rows, 2):
        assert all(err < 1e-5 for err in outputs.values()), outputs
        assert [(r["op"], r["M"]) for r in rows] == [(op, m) for op in bench.OP_FUNCTIONS for m in (8, 4)]
        for row in rows:
            assert (row["t_seq_ms"], row["t_ms"], row["t_ideal_ms"]) == (1.5, 1.25, 1.0)
            assert row["E"] == bench.efficiency(1.5, 1.25, 1.0) == 0.5 and row["speedup"] == pytest.approx(1.2)
            assert row["host_us"] == {"seq": 10.0, "ours": 10.0} and row["dtype"] == "float32"
    bench.print_table("gemm_all_reduce", rows[:2])
    out = capsys.readouterr().out
    assert "T_ideal" in out and "10/10" in out and out.count("     8x     6x     4") == 1


def test_the_grid_is_docs_benchmarks_grid():
    assert bench.GRIDS["all_reduce"] == bench.GRIDS["reduce_scatter"]
    assert (8192, 28672, 8192) in bench.GRIDS["all_gather"] and len(bench.GRIDS["all_reduce"]) == 5
    assert bench.efficiency(1.0, 1.0, 1.0) != bench.efficiency(1.0, 1.0, 1.0)  # nothing to hide: NaN
