"""The tensor-parallel block example on the CPU (two gloo ranks, toy sizes, bf16): loss and every gradient of each
rank's shard against the unsharded block, with flashoverlap's layers (reference path) and with plain PyTorch TP;
and ``torch.compile(fullgraph=True)`` traces the block with flashoverlap's custom ops (forward and backward)."""

import pytest
import torch

from flashoverlap.testing import spawn

LIMIT = 2e-2  # bf16: the sharded and unsharded blocks round in different places


def _check(rank, world_size, impl):
    from benchmarks.block import check_against_unsharded

    return check_against_unsharded(rank, world_size, impl=impl)


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_block_gradients_match_the_unsharded_block(impl):
    for rank, errors in enumerate(spawn(_check, 2, args=(impl,))):
        bad = {name: err for name, err in errors.items() if not err < LIMIT}
        assert not bad, f"rank {rank} ({impl}): relative errors over {LIMIT}: {bad}"
        assert set(errors) == {"loss", "x", "qkv", "gate_up", "o", "down", "attn_norm", "ffn_norm"}


def _compiled(rank, world_size):
    from benchmarks.block import TOY, Block, TPBlock

    torch.manual_seed(0)
    shard = TPBlock(Block(TOY, dtype=torch.bfloat16))
    x = torch.randn(16, TOY.hidden, dtype=torch.bfloat16)
    eager_x, compiled_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = shard(eager_x)
    want.float().sum().backward()
    compiled = torch.compile(shard, fullgraph=True, backend="aot_eager")
    got = compiled(compiled_x)
    got.float().sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)
    ops = {str(node.target) for node in _graph_nodes(compiled)}
    return sorted(op for op in ops if "flashoverlap" in op)


def _graph_nodes(compiled):
    from torch._dynamo.eval_frame import OptimizedModule

    assert isinstance(compiled, OptimizedModule)
    gm = torch._dynamo.export(compiled._orig_mod)(torch.randn(16, 64, dtype=torch.bfloat16)).graph_module
    return list(gm.graph.nodes)


def test_compile_fullgraph_traces_the_custom_ops():
    ops = spawn(_compiled, 2)[0]
    assert any("all_gather_gemm" in op for op in ops) and any("gemm_reduce_scatter" in op for op in ops), ops


def _rows_at_one_rank(rank, world_size):
    """The benchmark's own loop at toy sizes on one gloo rank, timed by stand-ins (the CPU has no CUDA events):
    every figure of every row is produced by a block that really ran, compiled ones through ``torch.compile``."""
    from benchmarks.block import FIGURES, TOY, bench_rows

    calls = []

    def time_step(step, steps, warmup, host):
        step()  # the first call of a compiled block compiles it
        step()
        host.append(0.0)
        calls.append(step)
        return float(len(calls))

    def time_graph(step, steps):
        step()
        return -1.0

    logged = []
    rows = bench_rows(TOY, [8, 16], steps=1, decode_tokens=4, compile_blocks=True, async_tp=False,
                      log=lambda rows: logged.append(len(rows)), dtype=torch.float32, backend="aot_eager",
                      time_step=time_step, time_graph=time_graph)
    return rows, logged, list(FIGURES)


def test_benchmark_rows_carry_eager_and_compiled_figures_at_one_rank():
    rows, logged, figures = spawn(_rows_at_one_rank, 1)[0]
    assert [(r["mode"], r["tokens"]) for r in rows] == [("prefill", 8), ("train", 8), ("prefill", 16),
                                                        ("train", 16), ("decode", 4)]
    assert logged == [1, 2, 3, 4, 5]
    timed = [name for name in figures if name != "t_async_tp_ms"]  # async TP needs CUDA symmetric memory
    for row in rows[:-1]:
        assert all(row[name] is not None for name in timed), row
        assert row["t_async_tp_ms"] is None and set(row["host_ms"]) == set(timed)
        assert not row.get("notes"), row["notes"]
    decode = rows[-1]
    assert {name for name in figures if decode[name] is not None} == {
        "t_torch_eager_ms", "t_nocomm_eager_ms", "t_ours_eager_ms"}


def test_e_block_compares_eager_with_eager_and_compiled_with_compiled():
    from benchmarks.block import e_block

    # Figures chosen so that crossing the two (compiled ours against eager baselines) would change every answer.
    row = {"t_torch_eager_ms": 10.0, "t_nocomm_eager_ms": 8.0, "t_ours_eager_ms": 9.0,
           "t_torch_compiled_ms": 8.0, "t_nocomm_compiled_ms": 6.0, "t_ours_compiled_ms": 7.5, "t_async_tp_ms": 7.0}
    assert e_block(row, compiled=False) == 0.5
    assert e_block(row, compiled=True) == 0.25
    assert e_block(row, compiled=True, impl="async_tp") == 0.5
    assert e_block(row, compiled=False, impl="async_tp") is None
    assert e_block({**row, "t_ours_compiled_ms": None}, compiled=True) is None
    assert e_block({**row, "t_nocomm_eager_ms": 10.0}, compiled=False) is None  # no bound to win
