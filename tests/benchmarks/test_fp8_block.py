"""The float8 block benchmark's dry run on the CPU (two gloo ranks, toy sizes, bf16, the rowwise recipe): every
variant but async TP built by ``benchmarks.fp8_block.bench_rows`` and stepped (training step and prefill) through the
benchmark's own loop with a stand-in timer; the compiled ones traced whole by dynamo (``fullgraph=True``, backend
``eager`` to stay under 30 s: the full dry run, ``python -m benchmarks.fp8_block --dry-run``, compiles with
``aot_eager`` and the pass's block with Inductor). The rows' form and the meta; async TP recorded as not run on CPU.
And the rank-major layout: torchao's contiguous ``Shard(0)`` of the fused projections is block.py's column shard."""

import importlib.util

import pytest
import torch

from flashoverlap.testing import spawn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao is not installed (pip install flashoverlap[fp8])")


def _dry(rank, world_size):
    from benchmarks.fp8_block import dry_run

    return dry_run(rank, world_size, ("rowwise",), 32, "eager", "eager", "test")


def test_dry_run_rows_and_meta_at_two_ranks():
    from benchmarks.fp8_block import FIGURES, NOT_ON_CPU

    results = spawn(_dry, 2)
    rows, meta = results[0]
    assert [(r["recipe"], r["mode"], r["tokens"]) for r in rows] == [("rowwise", "train", 32),
                                                                     ("rowwise", "prefill", 32)]
    for row in rows:
        ran = [name for name in FIGURES if name != "t_async_tp_ms"]
        assert all(row[name] == 1.0 for name in ran), row  # every block but async TP really stepped
        assert set(row["host_ms"]) == set(ran)
        assert row["t_async_tp_ms"] is None and row["notes"] == {"t_async_tp_ms": NOT_ON_CPU}, row
        assert row["rewrites"] == {}  # the pass runs only under Inductor
        assert set(row["E_block"]) == {"ours_eager", "ours_compiled", "async_tp", "pass"}
    assert meta["world_size"] == 2 and meta["recipes"] == ["rowwise"] and meta["command"] == "test"
    assert {"torch", "torchao", "flashoverlap", "commit", "date"} <= set(meta)
    assert [r["mode"] for r in results[1][0]] == ["train", "prefill"]


def test_rank_major_layout_gives_each_rank_its_column_shard():
    from benchmarks.block import TOY, Block, _column_shard
    from benchmarks.fp8_block import _rank_major

    torch.manual_seed(0)
    block = Block(TOY)
    hd = TOY.head_dim
    for world in (2, 4):
        full = _rank_major(block, world)
        for name, sizes in (("qkv", [TOY.heads * hd, TOY.kv_heads * hd, TOY.kv_heads * hd]),
                            ("gate_up", [TOY.ffn, TOY.ffn])):
            weight = getattr(block, name).weight
            for rank, part in enumerate(getattr(full, name).weight.chunk(world)):
                assert torch.equal(part, _column_shard(weight, sizes, rank, world))
        assert torch.equal(full.o.weight, block.o.weight) and torch.equal(full.down.weight, block.down.weight)


@pytest.mark.parametrize("argv,said", [(["--dry-run", "--out", "FOLDER"], "is a directory; name the results file"),
                                       (["--dry-run", "--tokens", "64"], "--tokens: the GPU run's"),
                                       (["--steps=3", "--dry-run"], "--steps: the GPU run's")])
def test_the_dry_run_refuses_an_out_it_could_not_write_and_the_gpu_runs_options(tmp_path, monkeypatch, capsys, argv,
                                                                               said):
    """``--dry-run --out FOLDER`` failed in the write after every variant ran (a minute and a half on 2 cores);
    ``--dry-run --tokens 64`` ran 32 tokens, the option ignored."""
    import benchmarks.fp8_block as bench

    monkeypatch.setattr(bench, "_dry_main", lambda args: 0)  # never reached where refused; else no minute's run
    with pytest.raises(SystemExit) as stop:
        bench.main([str(tmp_path) if arg == "FOLDER" else arg for arg in argv])
    assert stop.value.code == 2 and said in capsys.readouterr().err
