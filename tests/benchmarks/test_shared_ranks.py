"""The pure parts of ``benchmarks/shared_ranks.py`` (issue 42's shared-GPU runs), on the CPU: the oracles each rank
computes locally, the soak's random call generator (the same on every rank; every op, dtype and mode drawn; every
call valid on the P2P path), the fault verdict, the results files and the command line."""

import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks import shared_ranks
from benchmarks.shared import calls as tc
from benchmarks.shared import experts as ex
from benchmarks.shared import faults, mechanics, soak
from benchmarks.shared.runs import Progress, merge_rows, write_results

ROOT = Path(__file__).resolve().parents[2]


# -- oracles ---------------------------------------------------------------------------------------------------------


def _everyone(call, world, index=0):
    return [tc.operands(call, world, s, index, "cpu") for s in range(world)]


def test_operands_are_the_same_for_the_same_seed_and_differ_by_rank_and_call():
    call = tc.TpCall("gemm_all_reduce", "bf16", 35, 24, 40, seed=3)
    one, two = tc.operands(call, 2, 1, 0, "cpu"), tc.operands(call, 2, 1, 0, "cpu")
    assert torch.equal(one.a, two.a) and torch.equal(one.b, two.b)
    assert not torch.equal(one.a, tc.operands(call, 2, 0, 0, "cpu").a)
    later = tc.operands(call, 2, 1, 1, "cpu")
    assert not torch.equal(one.a, later.a) and torch.equal(one.b, later.b)  # new values, the same weights
    assert one.b.shape == (40, 24) and one.b.stride() == (1, 40)  # w.t()
    row_major = tc.operands(tc.TpCall("gemm_all_reduce", "bf16", 35, 24, 40, transposed=False), 2, 1, 0, "cpu")
    assert row_major.b.is_contiguous()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_oracles_are_the_plain_products_summed_scattered_and_gathered(dtype):
    world = 3
    ar = tc.TpCall("gemm_all_reduce", dtype, 18, 24, 40, seed=5)
    everyone = _everyone(ar, world)
    total = sum(o.a.double() @ o.b.double() for o in everyone)
    for rank in range(world):
        want, full = tc.oracle(ar, everyone, rank)
        assert full is None and torch.allclose(want.double(), total, rtol=1e-5, atol=1e-5)
    rs = tc.TpCall("gemm_reduce_scatter", dtype, 18, 24, 40, seed=5)
    for rank in range(world):
        assert torch.allclose(tc.oracle(rs, everyone, rank)[0], tc.oracle(ar, everyone, 0)[0][6 * rank : 6 * rank + 6],
                              rtol=1e-6, atol=1e-6)
    ag = tc.TpCall("all_gather_gemm", dtype, 18, 24, 40, gathered=True, seed=9)
    everyone = _everyone(ag, world)
    assert everyone[0].a.shape == (6, 40)  # this rank's shard of the gathered M
    for rank in range(world):
        want, full = tc.oracle(ag, everyone, rank)
        assert torch.equal(full, torch.cat([o.a for o in everyone]))
        assert torch.allclose(want.double(), full.double() @ everyone[rank].b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("transposed", [True, False])
def test_fp8_oracle_product_is_what_torch_scaled_mm_computes(mode, transposed):
    call = tc.TpCall("scaled_gemm_all_reduce", mode, 16, 32, 128, transposed, out="bf16", bias=True, seed=2)
    ops = tc.operands(call, 2, 1, 0, "cpu")
    b = ops.b if not transposed else ops.b
    want = torch._scaled_mm(ops.a, b.t().contiguous().t(), ops.scale_a, ops.scale_b, bias=ops.bias.float(),
                            out_dtype=torch.float32)
    assert torch.allclose(tc.product(call, ops), want, rtol=1e-4, atol=1e-3)


def test_fp8_block_oracle_matches_the_blockwise_definition():
    from flashoverlap.comm import scaled

    call = tc.TpCall("scaled_gemm_reduce_scatter", "block", 4, 200, 256, True, seed=4)
    ops = tc.operands(call, 2, 0, 0, "cpu")
    assert ops.scale_a.shape == (4, 2) and ops.scale_b.shape == (2, 2)
    scales = scaled.Scales.of(ops.scale_a, ops.scale_b, torch.float32)
    want = scaled.dequantised_a(ops.a, ops.scale_a) @ scaled.dequantised_b(ops.b, scales)
    assert torch.allclose(tc.product(call, ops), want, rtol=1e-5, atol=1e-5)
    x = torch.randn(8, 256)
    q, s = tc.quantise(x, "block", "a")
    assert torch.allclose(tc.dequantised(q, s, "block", "a"), x, rtol=0.07, atol=1e-2)


def test_fp8_all_gather_oracle_takes_every_shard_with_its_own_scale():
    call = tc.TpCall("all_gather_scaled_gemm", "tensor", 8, 16, 128, seed=8)
    everyone = _everyone(call, 2)
    assert not torch.equal(everyone[0].scale_a, everyone[1].scale_a)  # shards of different scales
    want, _ = tc.oracle(call, everyone, 1)
    a32 = torch.cat([o.a.float() * o.scale_a for o in everyone])
    assert torch.allclose(want, a32 @ (everyone[1].b.float() * everyone[1].scale_b), rtol=1e-5, atol=1e-4)


def test_relative_error_flags_nan_and_shape_and_needs_no_allocation_with_a_scratch():
    want = torch.randn(5, 7)
    assert tc.relative_error(want.to(torch.bfloat16), want) < 1e-2
    scratch = torch.empty(5, 7)
    assert tc.relative_error(want.clone(), want, scratch) == 0.0
    poisoned = want.clone()
    poisoned[2, 3] = float("nan")
    assert tc.relative_error(poisoned, want) == math.inf
    assert tc.relative_error(poisoned, want, scratch) == math.inf
    assert tc.relative_error(want[:4], want) == math.inf
    assert tc.relative_error(want * 1.1, want) > tc.tolerance(tc.TpCall("gemm_all_reduce", "bf16", 1, 1, 1))
    assert tc.relative_error(torch.zeros(0, 3), torch.zeros(0, 3)) == 0.0


def test_moe_oracle_rows_follow_the_contract():
    world = 3
    mc = ex.MoeCall("bf16", "bounded", tokens=9, local=2, top_k=2, hidden=16, ffn=8, empty_rank=0, seed=1)
    routes = [ex.routing_of(mc, world, s, "cpu") for s in range(world)]
    assert routes[0][0].shape == (0, 2) and routes[1][0].shape == (16, 2)
    routing = ex.Routing([r[0] for r in routes], world, mc.local, mc.mode, mc.bound(world))
    assert mc.bound(world) == (9 + 14) * 2
    assert routing.recv_rows(1) == world * mc.bound(world)
    assert sum(routing.n[0]) == 0  # rank 0 sends nothing
    case = ex.moe_case(mc, world, 1, 2, "cpu")
    assert case.want_h[0].shape == (world * mc.bound(world), 2 * mc.ffn)
    assert case.want_y[0].shape == (16, mc.hidden)
    # every received row of rank 1 is a token of its source times its expert's weight
    w_up = ex.expert_weights(mc, world, 1, "cpu")[0]
    x2 = ex.tokens_of(mc, world, 2, 0, "cpu")
    first, last, e = routing.segments(2, 1)[0]
    j = routing.chosen[2][1][first]
    at = routing.recv_at(1, 2) + first
    expected = (x2[torch.div(j, 2, rounding_mode="floor")].float() @ w_up[e].float()).to(torch.bfloat16)
    assert torch.equal(case.want_h[0][at], expected)
    avoid = ex.MoeCall("bf16", "exact", tokens=9, local=2, top_k=2, hidden=16, ffn=8, avoid_rank=2, seed=1)
    routing = ex.Routing([ex.routing_of(avoid, world, s, "cpu")[0] for s in range(world)], world, 2, "exact", None)
    assert routing.recv_rows(2) == 0


@pytest.mark.parametrize("scaling", ex.SCALINGS)
def test_fp8_expert_oracle_is_the_definition_on_the_dequantised_values(scaling):
    world, rank = 2, 1
    mc = ex.MoeCall("bf16", "bounded", tokens=9, local=2, top_k=2, hidden=256, ffn=128, empty_rank=0, seed=7,
                    scaling=scaling)
    assert mc.problem(world) is None and "fp8-" + scaling in mc.label()
    case = ex.moe_case(mc, world, rank, 2, "cpu")
    blocks = 256 // 128
    assert case.w_up.dtype == torch.float8_e4m3fn and case.w_up.shape == (2, 256, 256)
    assert case.w_up.transpose(1, 2).is_contiguous()  # the [L, K, N] transpose of an nn.Linear-shaped weight
    assert case.scale_up.shape == ((2, 256) if scaling == "row" else (2, blocks, 2))
    assert case.scale_down.shape == ((2, 256) if scaling == "row" else (2, 1, 2))
    assert case.xs[0].dtype == torch.float8_e4m3fn and case.scale_xs[0].shape == (16, 1 if scaling == "row" else 2)
    assert case.scale_acts[0].shape == (case.acts[0].shape[0], 1 if scaling == "row" else 1)
    assert not torch.equal(case.xs[0].float(), case.xs[1].float())
    # one received row by hand: rank 1's own token times its expert's dequantised weight (rank 0 sends none)
    routing = case.routing
    first, last, e = routing.segments(1, 1)[0]
    j = routing.chosen[1][1][first]
    t = torch.div(j, 2, rounding_mode="floor")
    x32 = case.xs[0][t].float() * (case.scale_xs[0][t].float() if scaling == "row"
                                   else case.scale_xs[0][t].float().repeat_interleave(128))
    s = case.scale_up[e]
    w32 = case.w_up[e].float() * (s.reshape(1, -1) if scaling == "row"
                                  else s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:256, :256])
    at = routing.recv_at(1, 1) + first
    assert torch.allclose(case.want_h[0][at], x32 @ w32, rtol=1e-5, atol=1e-5)
    assert case.want_h[0].dtype == torch.float32 and case.want_y[0].shape == (16, 256)
    assert case.want_y[0].abs().sum() > 0
    wrong_scale = ex.moe_case(ex.MoeCall(**{**mc.__dict__, "seed": 8}), world, rank, 1, "cpu")
    assert not torch.allclose(wrong_scale.want_h[0], case.want_h[0])


# -- the cases and the plans -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_mechanics_case_has_an_overlapped_p2p_plan_or_an_overlapped_default(world):
    cases = mechanics.tp_cases(world)
    assert {c.call.op for c in cases} == set(tc.TP_OPS)
    assert {c.call.dtype for c in cases} == {*tc.HALF, *tc.FP8_MODES}
    assert {c.call.transposed for c in cases} == {True, False}
    for case in cases:
        call = case.call
        assert call.problem(world) is None, (call, call.problem(world))
        if call.plan == "given":
            plan = tc.given_plan(call, world)
            assert not plan.sequential and plan.path == "p2p" and (plan.m, plan.world_size) == (call.m, world)
        else:
            assert tc.default_is_overlapped(call, world), call
        if case.shape == "odd":
            rows = call.m if call.kind == "all_reduce" else call.m // world
            assert rows % 2 == 1, call
    bands = [c for c in cases if c.shape == "bands"]
    for c in bands:  # two sub-bands per rank block (all-reduce: W blocks of them)
        groups = len(tc.given_plan(c.call, world).group_row_tiles)
        assert groups == (2 * world if c.call.kind == "all_reduce" else 2), (c.call, groups)
    assert {m.mode for m in mechanics.moe_cases(world)} == set(ex.EXPERT_MODES)
    assert all(m.problem(world) is None for m in mechanics.moe_cases(world))
    fp8 = mechanics.moe_fp8_cases(world)
    assert {(m.mode, m.scaling) for m in fp8} == {(mode, s) for mode in ex.EXPERT_MODES for s in ex.SCALINGS}
    assert all(m.problem(world) is None for m in fp8)
    assert any(m.empty_rank is not None for m in fp8) and any(m.avoid_rank is not None for m in fp8)
    cases = mechanics.plan_of_cases(world, "cuda", False, ("moe-fp8",))
    assert {(c.mode, m) for _, c, m in cases} == {("exact", "eager"), ("exact", "replayed"), ("bounded", "eager"),
                                                  ("bounded", "replayed"), ("bounded", "graph")}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_model_and_example_shapes_overlap_under_the_default_p2p_plan(world):
    """The styles, layers and the example run without a plan: a sequential default would need NCCL."""
    from flashoverlap.tune.defaults import default_plan

    s, h, f = mechanics.model_shape(world, torch.device("cuda"))
    for op, m, n, k in (("all_reduce", s, h, f // world), ("reduce_scatter", s, h, f // world),
                        ("all_gather", s, f // world, h), ("all_gather", 8192, 14336 // world, 4096),
                        ("reduce_scatter", 8192, 4096, 14336 // world)):
        assert not default_plan(op, m, n, k, world, path="p2p").sequential, (op, m, n, k)


def test_the_smallest_given_all_reduce_and_the_refused_one():
    for world in (2, 4, 8):
        low = tc.min_all_reduce_m(world)
        assert tc.TpCall("gemm_all_reduce", "bf16", low, 16, 16).problem(world) is None
        assert tc.TpCall("gemm_all_reduce", "bf16", low - 1, 16, 16).problem(world) is not None
        assert tc.TpCall("gemm_reduce_scatter", "bf16", world, 16, 16).problem(world) is None
        assert tc.TpCall("gemm_reduce_scatter", "bf16", world + 1, 16, 16).problem(world) is not None


# -- the soak's random calls ----------------------------------------------------------------------------------------


def _labels(seed, world, calls):
    out = []
    for burst in soak.bursts(seed, world, calls):
        out.append((burst.call.label(), burst.group, burst.replay, burst.repeats))
    return out


def test_the_soak_draws_the_same_sequence_for_the_same_seed_and_another_for_another():
    assert _labels(0, 4, 500) == _labels(0, 4, 500)
    assert _labels(0, 4, 500) != _labels(1, 4, 500)
    assert _labels(0, 4, 500) != _labels(0, 8, 500)


def test_the_soak_draws_the_same_sequence_in_another_process_with_another_hash_seed():
    code = ("import hashlib, sys; from benchmarks.shared import soak; "
            "print(hashlib.sha256(repr([(b.call.label(), b.group, b.replay, b.repeats) "
            "for b in soak.bursts(0, 8, 300)]).encode()).hexdigest())")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import hashlib

    assert out.stdout.strip() == hashlib.sha256(repr(_labels(0, 8, 300)).encode()).hexdigest()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_soak_covers_every_op_dtype_mode_and_group_and_every_call_is_valid(world):
    bursts = list(soak.bursts(0, world, 10000))
    assert sum(b.calls for b in bursts) >= 10000
    tp = [b for b in bursts if isinstance(b.call, tc.TpCall)]
    moe = [b for b in bursts if isinstance(b.call, ex.MoeCall)]
    assert {b.call.op for b in tp} == set(tc.TP_OPS)
    assert {(b.call.op, b.call.dtype) for b in tp} == {(op, d) for op in tc.HALF_OPS for d in tc.HALF} | {
        (op, mode) for op in tc.FP8_OPS for mode in tc.FP8_MODES}
    assert {b.call.transposed for b in tp} == {True, False}
    assert {(b.call.out, b.call.bias) for b in tp if b.call.fp8} == {("bf16", False), ("bf16", True),
                                                                      ("fp32", False), ("fp32", True)}
    assert {b.replay for b in bursts} == {True, False} and {b.group for b in bursts} == {0, 1}
    assert max(b.repeats for b in bursts) > 1
    assert {m.call.mode for m in moe} == set(ex.EXPERT_MODES)
    assert any(m.call.empty_rank is not None for m in moe)
    for b in tp:
        assert b.call.problem(world) is None
    ms = {(b.call.kind, b.call.m) for b in tp}
    assert ("reduce_scatter", world) in ms and ("all_gather", world) in ms  # one row per rank
    assert ("all_reduce", tc.min_all_reduce_m(world)) in ms
    assert any(b.call.m % 2 for b in tp if b.call.kind == "all_reduce")
    assert any((b.call.m // world) % 2 for b in tp if b.call.kind != "all_reduce")
    assert {b.call.sub_bands for b in tp} == {1, 2, 3}


def test_the_soak_draws_from_a_bounded_pool_so_that_signatures_repeat_and_sweeps_it_first():
    """Every call of the soak is an entry of the pool (38 of them: 30 tensor-parallel, 8 expert layers), each entry
    is called on both groups with replay on in the sweep before any drawn burst, and the sweep is the warm-up."""
    world = 4
    tp, moe = soak.tp_pool(0, world), soak.moe_pool(0, world)
    assert len(tp) == 2 * (len(tc.HALF_OPS) * len(tc.HALF) + len(tc.FP8_OPS) * len(tc.FP8_MODES)) and len(moe) == 8
    assert len(set(tp)) == len(tp) and len(set(moe)) == len(moe)
    from flashoverlap.comm.replay import CAPACITY

    assert len(tp) <= CAPACITY  # per group, within the P2P communicator's graph capacity
    bursts = list(soak.bursts(0, world, 10000))
    sweep = soak.sweep(0, world)
    assert bursts[: len(sweep)] == sweep
    assert {(b.call, b.group) for b in sweep} == {(c, g) for c in [*tp, *moe] for g in (0, 1)}
    assert all(b.replay and b.repeats == soak.SWEEP_REPEATS for b in sweep)
    assert {b.call for b in bursts} == {*tp, *moe}
    assert soak.sweep_calls(0, world) == sum(b.calls for b in sweep) < 500
    assert {b.first for b in bursts} == set(range(soak.SETS)) and soak.SETS >= 2  # consecutive calls: new values
    assert list(soak.bursts(0, world, 10))[0] == sweep[0]  # fewer calls than the sweep: its start


def test_fp8_reduce_scatter_oracle_is_the_rows_of_the_sum():
    for mode in tc.FP8_MODES:
        k = 256
        ar = tc.TpCall("scaled_gemm_all_reduce", mode, 12, 48, k, seed=6)
        rs = tc.TpCall("scaled_gemm_reduce_scatter", mode, 12, 48, k, seed=6)
        everyone = _everyone(ar, 3)
        total = tc.oracle(ar, everyone, 0)[0]
        for rank in range(3):
            assert torch.allclose(tc.oracle(rs, everyone, rank)[0], total[4 * rank : 4 * rank + 4], rtol=1e-5,
                                  atol=1e-5), (mode, rank)


def test_the_soak_entries_hold_the_oracle_of_every_value_set_and_load_them_into_the_same_tensors():
    world, rank = 3, 1
    call = next(c for c in soak.tp_pool(0, world) if c.op == "all_gather_gemm" and c.gathered)
    entry = soak.TpEntry(call, world, rank, torch.device("cpu"))
    a, b = entry.ops.a, entry.ops.b
    for index in range(soak.SETS):
        everyone = [tc.operands(call, world, s, index, "cpu") for s in range(world)]
        want, full = tc.oracle(call, everyone, rank)
        entry.load(index)
        assert entry.ops.a is a and entry.ops.b is b and torch.equal(a, everyone[rank].a)
        assert torch.equal(entry.wants[index], want) and torch.equal(entry.fulls[index], full)
        assert entry.norms[index] == pytest.approx(float(torch.linalg.vector_norm(want)))
    assert not torch.equal(entry.wants[0], entry.wants[1])
    fp8 = next(c for c in soak.tp_pool(0, world) if c.op == "scaled_gemm_reduce_scatter" and c.dtype == "row")
    entry = soak.TpEntry(fp8, world, rank, torch.device("cpu"))
    scale = entry.ops.scale_a
    entry.load(2)
    assert entry.ops.scale_a is scale and torch.equal(scale, tc.activations(fp8, world, rank, 2, "cpu")[1])
    assert entry.wants[2].shape == (fp8.m // world, fp8.n)


def test_the_soak_checks_flag_wrong_values_nan_missing_rows_and_a_gathered_input_that_differs():
    checks = soak.Checks(torch.device("cpu"))
    want = torch.randn(6, 5)
    norm = float(torch.linalg.vector_norm(want))
    scratch = torch.empty(6, 5)
    checks.close(want.to(torch.bfloat16), want, norm, 1.5e-2, scratch, "right")
    checks.close(want * 1.1, want, norm, 1.5e-2, scratch, "10% off")
    poisoned = want.clone()
    poisoned[4, 1] = float("nan")
    checks.close(poisoned, want, norm, 1.5e-2, scratch, "one element never written")
    checks.close(want[:5], want, norm, 1.5e-2, scratch, "a row short")
    full = torch.randn(4, 3).to(torch.bfloat16)
    checks.equal(full.clone(), full, "gathered right")
    other = full.clone()
    other[2, 2] += 1
    checks.equal(other, full, "gathered off by one element")
    checks.equal(None, full, "gathered missing")
    checks.close(torch.zeros(0, 5), torch.zeros(0, 5), 0.0, 1e-3, torch.empty(0, 5), "empty")
    done, notes = checks.read()
    assert done == 8
    assert [n.split(":")[0] for n in notes] == ["10% off", "one element never written", "a row short",
                                               "gathered off by one element", "gathered missing"]
    assert "rel err inf" in notes[1] or "rel err nan" in notes[1]
    assert checks.read() == (0, [])


def test_the_soak_checks_of_several_bursts_share_one_read_and_say_when_another_burst_might_not_fit():
    checks = soak.Checks(torch.device("cpu"), bursts=2)
    want = torch.randn(3, 4)
    scratch = torch.empty(3, 4)
    norm = float(torch.linalg.vector_norm(want))
    for i in range(soak.ERROR_SLOTS):  # a first burst of the most checks one may queue
        checks.close(want * (1.1 if i == 5 else 1.0), want, norm, 1e-3, scratch, f"first {i}")
    checks.end_burst()
    assert not checks.full()  # a second burst still finds its slots
    checks.close(want, want, norm, 1e-3, scratch, "second 0")
    checks.end_burst()
    assert checks.full()
    done, notes = checks.read()
    assert done == soak.ERROR_SLOTS + 1 and [n.split(":")[0] for n in notes] == ["first 5"]
    assert not checks.full() and checks.read() == (0, [])


def test_the_soak_reads_its_checks_every_read_every_bursts_however_few_checks_each_queued():
    # Reads came only when the slots ran short: with a few checks a burst, about every 42 bursts at 8.
    checks = soak.Checks(torch.device("cpu"), bursts=3)
    want = torch.randn(2, 2)
    fulls = []
    for burst in range(7):
        checks.close(want, want, 1.0, 1e-3, torch.empty(2, 2), f"burst {burst}")
        checks.end_burst()
        fulls.append(checks.full())
        if fulls[-1]:
            assert checks.read() == (3, [])
    assert fulls == [False, False, True, False, False, True, False]


def test_read_every_must_be_a_positive_count():
    with pytest.raises(SystemExit):
        shared_ranks.parse_args(["--step", "soak", "--read-every", "0"])
    assert shared_ranks.parse_args(["--step", "soak", "--read-every", "1"]).read_every == 1


def test_soak_summary_memory_is_flat_within_64_mib_of_warm_up():
    def report(rank, samples, warm_calls=100):
        points = [{"at": f"{c} calls", "calls": c, "allocated_mib": a, "reserved_mib": a + 10} for c, a in samples]
        warm = next(p for p in points if p["calls"] == warm_calls)
        return {"rank": rank, "calls": samples[-1][0], "wrong": 0, "errors": 0, "notes": [], "samples": points,
                "warmup": warm, "stopped": None, "seconds": 1.0, "ms_per_call": 2.0, "replays": 7}

    flat = soak.summarise(2, [report(0, [(100, 500.0), (1000, 530.0), (1100, 520.0)]),
                              report(1, [(100, 500.0), (1000, 560.0), (1100, 510.0)])])
    assert flat["flat"] is True and flat["calls"] == 1100 and flat["memory_mib"] == [500.0, 530.0, 520.0]
    grown = soak.summarise(2, [report(0, [(100, 500.0), (1000, 530.0), (1100, 520.0)]),
                               report(1, [(100, 500.0), (1000, 600.0), (1100, 510.0)])])
    assert grown["flat"] is False and grown["worst_rank_growth_mib"] == 100.0
    hung = soak.summarise(2, [report(0, [(100, 500.0), (1000, 500.0)]), None], hung="spawn: ranks did not report")
    assert hung["hangs"] == 1 and hung["calls"] == 1000


# -- the fault verdict -----------------------------------------------------------------------------------------------

GROUP = "group '0' (ranks [0, 1, 2, 3])"


def _raised(message, seconds=5.2):
    return {"status": "raised", "message": message, "seconds": seconds, "group": "0", "group_description": GROUP}


def test_ranks_named_leaves_the_group_description_out():
    assert faults.ranks_named(f"rank 1: x on {GROUP} waited", GROUP) == {1}
    assert faults.ranks_named("ranks [2, 3] differ from this rank", None) == {2, 3}
    assert faults.ranks_named("rank(s) [2] of x hold", None) == {2}
    assert faults.ranks_named("ranks 0, 2 and 3", None) == {0, 2, 3}
    assert faults.ranks_named("waited for partial 0.1 from 2", None) == set()
    assert faults.ranks_named("waited for partial 0.1 from 2", None, loose=True) == {2}


def test_verdict_ok_when_every_survivor_names_op_group_and_absent_rank_in_time():
    good = f"RuntimeError: gemm_all_reduce on {GROUP}: rank 2 never reached the call"
    outcomes = {0: _raised(good), 1: _raised(good), 3: _raised(good, 14.9), 2: {"status": "died", "exit_code": 3}}
    row = faults.verdict("dies", "gemm_all_reduce", 4, 2, outcomes, 5.0)
    assert row["ok"] is True and row["seconds"] == 14.9 and row["why_not"] is None
    assert row["statuses"] == {0: "raised", 1: "raised", 2: "died", 3: "raised"}


def test_verdict_names_what_is_missing():
    today = (f"RuntimeError: flashoverlap: rank 1: gemm_all_reduce on {GROUP} waited more than 5 s for the other "
             "ranks to reach the call (the agreement check)")
    outcomes = {r: _raised(today) for r in (0, 1, 3)}
    row = faults.verdict("skip", "gemm_all_reduce", 4, 2, outcomes, 5.0)
    assert row["ok"] is False and all("absent rank" in why for why in row["why_not"])
    assert row["message"][1] == today  # verbatim
    gloo = {r: _raised("RuntimeError: [gloo/pair.cc:553] Connection closed by peer") for r in (0, 1, 3)}
    row = faults.verdict("dies", "moe_dispatch_gemm", 4, 2, gloo, 5.0)
    assert "op, group, absent rank" in row["why_not"][0]
    slow = {r: _raised(f"gemm_all_reduce on {GROUP}: rank 2 is absent", 15.5) for r in (0, 1, 3)}
    assert faults.verdict("stall", "gemm_all_reduce", 4, 2, slow, 5.0)["ok"] is False
    hung = {0: _raised(f"gemm_all_reduce on {GROUP}: rank 2 is absent"), 1: {"status": "hung"}}
    row = faults.verdict("skip", "gemm_all_reduce", 4, 2, hung, 5.0)
    assert row["ok"] is False and "rank 1: hung" in row["why_not"] and "rank 3: hung" in row["why_not"]


def test_verdict_on_returned_tensors():
    wrong = {r: {"status": "returned", "seconds": 0.1, "wrong": True} for r in (0, 1, 3)}
    row = faults.verdict("dies_in_call", "gemm_all_reduce", 4, 2, wrong, 5.0)
    assert row["ok"] is False and any("returned a tensor" in why for why in row["why_not"])
    right = {r: {"status": "returned", "seconds": 0.1, "wrong": False} for r in (0, 1, 3)}
    row = faults.verdict("dies_in_call", "gemm_all_reduce", 4, 2, right, 5.0)
    assert row["ok"] is True and row["completed_before_the_death"] == [0, 1, 3]
    assert faults.verdict("skip", "gemm_all_reduce", 4, 2, right, 5.0)["ok"] is False


def test_outcome_of_what_the_launcher_saw():
    assert faults.outcome_of("died", 3, 2, 2, "dies") == {"status": "died", "exit_code": 3}
    assert faults.outcome_of("hung", None, 2, 1, "skip") == {"status": "hung"}
    assert faults.outcome_of("error", "Traceback... injected", 2, 2, "raise")["status"] == "raised-injected"
    assert faults.outcome_of("error", "Traceback... boom", 2, 1, "raise")["status"] == "reported_error"
    assert faults.outcome_of("ok", {"status": "raised"}, 2, 1, "skip") == {"status": "raised"}


# -- rows, files, command line ----------------------------------------------------------------------------------------


def test_mechanics_rows_aggregate_over_ranks_and_survive_a_hang(tmp_path):
    a = [{"case": "x", "mode": "eager", "wrong": 0, "checked": 4, "replays": 3, "error": None, "notes": None,
          "worst_rel_err": 0.001, "seconds": 1.0, "number": 0}]
    b = [{"case": "x", "mode": "eager", "wrong": 2, "checked": 4, "replays": 1, "error": "AssertionError: no",
          "notes": ["call 1: relative error inf"], "worst_rel_err": "inf", "seconds": 2.0, "number": 0}]
    row = mechanics.aggregate([a, b], 2)[0]
    assert row["wrong"] == 2 and row["replays"] == 1 and row["replays_by_rank"] == [3, 1]
    assert row["error"] == "AssertionError: no (ranks [1])" and row["worst_rel_err"] == "inf"
    paths = []
    for rank, rows in enumerate((a, b)):
        progress = Progress(tmp_path / f"r{rank}.jsonl")
        progress.write(event="start", number=0, case="x", mode="eager")
        progress.write(event="row", row=rows[0])
        progress.write(event="start", number=1, case="y", mode="graph")
        paths.append(progress.path)
    rows = mechanics.rows_from_progress(paths, 2, "spawn: ranks did not all report within 60 s")
    assert [r["case"] for r in rows] == ["x", "y"] and rows[1]["hang_or_crash"] is True


def test_results_files_merge_rows_by_key(tmp_path):
    path = tmp_path / "f.json"
    write_results(path, {"command": "one", "commit": "c1"}, [{"W": 2, "v": 1}, {"W": 4, "v": 1}], key=lambda r: r["W"])
    write_results(path, {"command": "two", "commit": "c2"}, [{"W": 4, "v": 2}], key=lambda r: r["W"])
    data = json.loads(path.read_text())
    assert data["rows"] == [{"commit": "c1", "W": 2, "v": 1}, {"commit": "c2", "W": 4, "v": 2}]
    assert data["meta"]["command"] == "two"
    assert [(s["commit"], s["command"]) for s in data["meta"]["sources"]] == [("c1", "one"), ("c2", "two")]
    # a run whose rows are all replaced leaves the sources
    write_results(path, {"command": "three", "commit": "c3"}, [{"W": 2, "v": 3}], key=lambda r: r["W"])
    data = json.loads(path.read_text())
    assert [s["commit"] for s in data["meta"]["sources"]] == ["c2", "c3"]
    assert merge_rows([{"k": 1}, {"k": 2}], [{"k": 2, "x": 0}], key=lambda r: r["k"]) == [{"k": 1}, {"k": 2, "x": 0}]


def test_command_line():
    args = shared_ranks.parse_args(["--step", "faults", "--out", "x"])
    assert args.worlds == [4] and args.budget == shared_ranks.DEFAULT_BUDGET["faults"] and args.timeout == 5.0
    args = shared_ranks.parse_args(["--step", "soak", "--worlds", "2,4,8", "--calls", "300", "--budget", "100"])
    assert args.worlds == [2, 4, 8] and args.calls == 300 and args.budget == 100.0
    args = shared_ranks.parse_args(["--step", "faults", "--ops", "gemm_all_reduce,moe_layout", "--scenarios",
                                    "skip,dies"])
    assert args.ops == ["gemm_all_reduce", "moe_layout"] and args.scenarios == ["skip", "dies"]
    for bad in (["--step", "soak", "--worlds", "1,2"], ["--step", "soak", "--worlds", "x"],
                ["--step", "faults", "--ops", "nope"], ["--step", "faults", "--scenarios", "nope"],
                ["--step", "host", "--device", "cpu"], ["--step", "mechanics", "--families", "tp,nope"],
                ["--step", "mechanics", "--families", "experts"],
                ["--step", "mechanics", "--families", "models", "--quick"],  # models has no quick case: nothing
                ["--step", "nope"]):
        with pytest.raises(SystemExit):
            shared_ranks.parse_args(bad)


@pytest.mark.parametrize("argv, named", [
    (["--step", "soak", "--families", "tp"], "--families applies to --step mechanics"),
    (["--step", "host", "--scenarios", "skip"], "--scenarios applies to --step faults"),
    (["--step", "mechanics", "--calls", "300"], "--calls applies to --step soak"),
    (["--step", "soak", "--ops", "gemm_all_reduce"], "--ops applies to --step faults or host"),
    (["--step", "faults", "--graph-waits", "memop"], "--graph-waits applies to --step mechanics or host"),
    (["--step", "host", "--quick"], "--quick applies to --step mechanics"),
    (["--step", "mechanics", "--merge", "a.json", "--resume"], "not to --step mechanics --merge"),
])
def test_an_option_the_step_does_not_read_is_refused_by_name(argv, named, capsys):
    """A step-specific option given to another step (or to ``--merge``, which runs nothing) would be ignored:
    the command refuses it, naming the option and the steps that read it."""
    with pytest.raises(SystemExit):
        shared_ranks.parse_args(argv)
    assert named in capsys.readouterr().err


def test_every_step_specific_option_is_read_by_its_steps_and_accepted_there():
    for name, steps in shared_ranks.STEP_OPTIONS.items():
        for step in steps:
            flag = "--" + name.replace("_", "-")
            value = {"calls": "3", "seed": "1", "timeout": "2", "scenarios": "skip", "families": "tp",
                     "rounds": "2", "shape": "8,8,8", "graph_waits": "memop", "read_every": "4",
                     "ops": "gemm_all_reduce"}.get(name)
            args = shared_ranks.parse_args(["--step", step, flag] + ([value] if value else []))
            assert getattr(args, name) not in (None, False)
            assert f"args.{name}" in inspect.getsource(shared_ranks.RUNNERS[step]), (name, step)
        for step in set(shared_ranks.RUNNERS) - set(steps):  # and the table names every step that reads it
            assert f"args.{name}" not in inspect.getsource(shared_ranks.RUNNERS[step]), (name, step)
    assert set(shared_ranks.STEPS.values()) >= {"shared-ranks.json", "soak.json", "faults.json", "host-shared.json"}


# -- the harness end to end on gloo CPU ranks (the reference path) -------------------------------------------------


def test_the_mechanics_ranks_check_the_reference_path_on_cpu_ranks():
    import time

    from benchmarks.shared.runs import spawn_ranks

    options = {"deadline": time.time() + 120, "device": "cpu", "quick": True, "families": ("moe",)}
    results, failure = spawn_ranks(mechanics.spawned, 2, (options, [None, None]), 180, "cpu")
    assert failure is None, failure
    rows = mechanics.aggregate(results, 2)
    assert len(rows) == 2 and all(r["checked"] > 0 for r in rows)
    assert not [r for r in rows if r["wrong"] or r["error"]], rows


def test_the_soak_ranks_check_every_call_on_cpu_ranks():
    """The soak's ranks end to end on gloo CPU ranks (the reference path): the sweep and some drawn bursts, every
    call checked, none wrong, none raising, both ranks agreeing on the count."""
    import time

    from benchmarks.shared.runs import spawn_ranks

    world = 2
    calls = soak.sweep_calls(0, world) + 60
    # Reads every 7 bursts: the last ones' checks are left for the end's read (104 bursts here, 8 would divide them).
    options = {"deadline": time.time() + 240, "device": "cpu", "calls": calls, "seed": 0, "read_every": 7}
    assert len(list(soak.bursts(0, world, calls))) % options["read_every"] != 0
    results, failure = spawn_ranks(soak.spawned, world, (options, [None, None]), 300, "cpu")
    assert failure is None, failure
    row = soak.summarise(world, results)
    assert row["calls"] >= calls and row["wrong"] == 0 and row["errors"] == 0 and row["hangs"] == 0, row
    assert row["stopped"] is None and row["flat"] is True
    checks_per_rank = sum(b.repeats * (2 if isinstance(b.call, ex.MoeCall) or b.call.gathered else 1)
                          for b in soak.bursts(0, world, calls))
    assert row["checked"] == world * checks_per_rank
    assert row["pool"] == {"tp": 30, "moe": 8, "sets": soak.SETS, "oracle_seconds": row["pool"]["oracle_seconds"]}


def test_the_fp8_expert_mechanics_check_the_reference_path_on_cpu_ranks():
    import time

    from benchmarks.shared.runs import spawn_ranks

    options = {"deadline": time.time() + 120, "device": "cpu", "quick": True, "families": ("moe-fp8",)}
    results, failure = spawn_ranks(mechanics.spawned, 2, (options, [None, None]), 180, "cpu")
    assert failure is None, failure
    rows = mechanics.aggregate(results, 2)
    # One of each scaling, and one whose dispatch tokens come in bf16 (the op quantises them).
    assert [r["dtype"] for r in rows] == ["fp8-row", "fp8-block", "fp8-block"] and all(r["checked"] == 8 for r in rows)
    assert ["bf16 tokens" in r["case"] for r in rows] == [False, False, True], [r["case"] for r in rows]
    assert not [r for r in rows if r["wrong"] or r["error"]], rows


def test_the_fault_launcher_sees_a_rank_die_and_its_peer_raise():
    row = faults.run_scenario("gemm_all_reduce", "dies", 2, 1.0, "cpu")
    assert row["statuses"] == {0: "died", 1: "raised"}, row
    assert row["message"][1] and row["wall_s"] < 60


def test_merge_joins_the_files_of_separate_runs(tmp_path):
    for name, rows in (("a", [{"W": 2, "family": "tp", "v": 1}, {"W": 4, "family": "tp", "v": 1}]),
                       ("b", [{"W": 4, "family": "tp", "v": 2}, {"W": 8, "family": "tp", "v": 2}])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": {"command": name, "commit": name,
                                                                     "step": "mechanics"}, "rows": rows}))
    out = tmp_path / "out"
    assert shared_ranks.main(["--step", "mechanics", "--out", str(out), "--merge", str(tmp_path / "a.json"),
                              str(tmp_path / "b.json")]) == 0
    data = json.loads((out / "h200x1-shared-ranks.json").read_text())
    assert [(r["W"], r["v"]) for r in data["rows"]] == [(2, 1), (4, 2), (8, 2)]
    assert [(r["W"], r["commit"]) for r in data["rows"]] == [(2, "a"), (4, "b"), (8, "b")]
    assert [s["command"] for s in data["meta"]["sources"]] == ["a", "b"]


def test_resume_keeps_the_right_rows_and_runs_only_the_cases_left(tmp_path):
    """``--resume``: a file's right rows are kept with their commit and not run again; a wrong row is run again;
    the families with nothing left are not spawned."""
    first, second = mechanics.plan_of_cases(2, "cpu", True, ("moe",))
    labels = [(mechanics._label(f, c), mode) for f, c, mode in (first, second)]
    rows = [{"W": 2, "family": "moe", "case": labels[0][0], "mode": labels[0][1], "wrong": 0, "error": None,
             "number": 0},
            {"W": 2, "family": "moe", "case": labels[1][0], "mode": labels[1][1], "wrong": 3, "error": None,
             "number": 1}]
    (tmp_path / "cpux1-shared-ranks.json").write_text(json.dumps({"meta": {"commit": "old"}, "rows": rows}))
    assert shared_ranks.main(["--step", "mechanics", "--device", "cpu", "--quick", "--families", "moe,models",
                              "--worlds", "2", "--resume", "--budget", "150", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "cpux1-shared-ranks.json").read_text())
    got = [(r["case"], r["mode"], r["commit"], r["number"], r["wrong"]) for r in data["rows"]]
    assert got[0] == (*labels[0], "old", 0, 0)
    assert got[1][:2] == labels[1] and got[1][2] != "old" and got[1][3:] == (1, 0)
    assert len(got) == 2  # quick mode has no model cases: nothing spawned for them


def test_the_results_file_is_named_for_the_gpu_that_ran_it(tmp_path, monkeypatch):
    """Every file was named h200x1-*, whatever GPU ran it: an H100's rows were merged into the H200's file (and
    renamed by hand). A run takes its device's tag (a CPU check, cpux1-) and records it; a merge, the GPU its files
    name."""
    from benchmarks.harness import gpu_tag

    seen = []
    monkeypatch.setitem(shared_ranks.RUNNERS, "soak",
                        lambda args: seen.append((shared_ranks.results_path(args), args.gpu)) or [{"W": 2, "wrong": 0}])
    out = tmp_path / "out"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_tag, "gpu_tag", lambda device=None: "h100")
    assert shared_ranks.main(["--step", "soak", "--worlds", "2", "--out", str(out)]) == 0
    monkeypatch.undo()
    monkeypatch.setitem(shared_ranks.RUNNERS, "soak",
                        lambda args: seen.append((shared_ranks.results_path(args), args.gpu)) or [{"W": 2, "wrong": 0}])
    assert shared_ranks.main(["--step", "soak", "--device", "cpu", "--worlds", "2", "--out", str(out)]) == 0
    assert seen == [(out / "h100x1-soak.json", "h100"), (out / "cpux1-soak.json", "cpu")]

    def source(name, **meta):
        (tmp_path / name).write_text(json.dumps({"meta": {"step": "soak", "commit": "a", **meta},
                                                 "rows": [{"W": 8, "calls": 10}]}))
        return str(tmp_path / name)

    h100 = source("h100.json", gpus="1x NVIDIA H100 80GB HBM3 shared by W processes (W: the rows' own)")
    tagged = source("tagged.json", gpus="anything", gpu_tag="h100")
    merged = tmp_path / "merged"
    assert shared_ranks.main(["--step", "soak", "--out", str(merged), "--merge", h100, tagged]) == 0
    assert sorted(p.name for p in merged.iterdir()) == ["h100x1-soak.json"]


@pytest.mark.parametrize("metas,error", [
    ([{"gpus": "1x NVIDIA H100 80GB HBM3 shared by W processes"}, {"gpus": "1x NVIDIA H200 shared by W processes"}],
     "different GPUs"),  # an H200's rows under the H100's name, its meta the last file's
    ([{"gpus": "1x NVIDIA H100 80GB HBM3 shared by W processes", "device": "cpu"}], "--device cpu checks"),
    ([{"gpus": "1x no GPU shared by W processes", "device": "cpu"}], "--device cpu checks")])
def test_a_merge_of_mixed_gpus_or_of_cpu_checks_into_the_results_is_refused(metas, error, tmp_path, capsys):
    """A merge named its file for the first file's GPU and wrote a later one's into it; a CPU check's rows, merged
    with the default --out, landed in the committed results (as an H100's file where the GPU machine ran the check,
    or as 'ownx1-' from 'no GPU ... processes')."""
    sources = []
    for i, extra in enumerate(metas):
        (tmp_path / f"{i}.json").write_text(json.dumps({"meta": {"step": "soak", "commit": "a", **extra},
                                                        "rows": [{"W": 2 + i, "calls": 10}]}))
        sources.append(str(tmp_path / f"{i}.json"))
    out = [] if error == "--device cpu checks" else ["--out", str(tmp_path / "out")]
    before = sorted(p.name for p in shared_ranks.RESULTS.iterdir()) if shared_ranks.RESULTS.is_dir() else None
    assert shared_ranks.main(["--step", "soak", *out, "--merge", *sources]) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    if before is not None:
        assert sorted(p.name for p in shared_ranks.RESULTS.iterdir()) == before
    if error != "different GPUs":  # elsewhere the checks merge, as the CPU's
        assert shared_ranks.main(["--step", "soak", "--out", str(tmp_path / "cpu"), "--merge", *sources]) == 0
        assert sorted(p.name for p in (tmp_path / "cpu").iterdir()) == ["cpux1-soak.json"]


def test_merge_refuses_a_file_of_another_step_and_merges_nothing(tmp_path, capsys):
    """A soak file given to ``--step mechanics --merge`` put its rows in the mechanics file."""
    good = {"meta": {"step": "mechanics", "commit": "a"}, "rows": [{"W": 2, "family": "tp"}]}
    (tmp_path / "mech.json").write_text(json.dumps(good))
    (tmp_path / "soak.json").write_text(json.dumps({"meta": {"step": "soak"}, "rows": [{"W": 8, "calls": 10}]}))
    out = tmp_path / "out"
    assert shared_ranks.main(["--step", "mechanics", "--out", str(out), "--merge", str(tmp_path / "mech.json"),
                              str(tmp_path / "soak.json")]) == 2
    assert "soak.json holds rows of step 'soak', not --step mechanics" in capsys.readouterr().err
    assert not (out / "h200x1-shared-ranks.json").exists()  # the good file was not merged either


@pytest.mark.parametrize("argv", [
    ["--step", "soak", "--worlds", "2", "--calls", "10", "--device", "cpu", "--budget", "30"],  # the audit's
    ["--step", "host", "--budget", "44"], ["--step", "mechanics", "--budget", "19"],
    ["--step", "faults", "--timeout", "5", "--budget", "49"]])
def test_a_budget_too_small_for_any_w_is_refused_by_name(argv, capsys):
    """Such a run wrote a row "budget spent: W = 2 not run" and exited 0."""
    with pytest.raises(SystemExit) as exit_info:
        shared_ranks.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--budget" in err and "too small" in err, err


def test_the_smallest_budget_that_runs_a_w_is_accepted():
    for argv in (["--step", "soak", "--budget", str(shared_ranks.MIN_SHARE)],
                 ["--step", "mechanics", "--budget", str(shared_ranks.MIN_FAMILY_SHARE)],
                 ["--step", "faults", "--timeout", "5", "--budget", "50"]):
        assert shared_ranks.parse_args(argv).budget == float(argv[-1])


def test_a_cpu_run_never_writes_the_committed_results(monkeypatch, tmp_path, capsys):
    """``--device cpu`` wrote its harness check into ``benchmarks/results/h200x1-soak.json`` by default; now its
    default is a new temporary folder, and naming the results folder is refused."""
    assert shared_ranks.parse_args(["--step", "soak", "--device", "cpu"]).out is None  # main makes a temporary one
    assert shared_ranks.parse_args(["--step", "soak"]).out == Path("benchmarks/results")  # the GPU run's
    here = str(Path(shared_ranks.__file__).parent / "results")
    for out in ("benchmarks/results", here, "benchmarks/../benchmarks/results"):
        with pytest.raises(SystemExit):
            shared_ranks.parse_args(["--step", "soak", "--device", "cpu", "--out", out])
        assert "--device cpu checks the harness" in capsys.readouterr().err
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []
    monkeypatch.setitem(shared_ranks.RUNNERS, "soak", lambda args: seen.append(args.out) or [{"W": 2, "wrong": 0}])
    assert shared_ranks.main(["--step", "soak", "--device", "cpu", "--worlds", "2"]) == 0
    assert seen[0].parent == tmp_path and seen[0].name.startswith("shared-ranks-cpu-soak-")


@pytest.mark.parametrize("step,rows,code", [
    ("soak", [{"W": 2, "calls": 10, "wrong": 0, "errors": 0, "hangs": 0, "error": None}], 0),
    ("soak", [{"W": 2, "calls": 0, "wrong": 0, "hangs": 0, "error": "budget spent: W = 2 not run"}], 1),
    ("soak", [{"W": 2, "calls": 10, "wrong": 1, "errors": 0, "hangs": 0}], 1),
    ("soak", [{"W": 2, "calls": 10, "wrong": 0, "errors": 0, "hangs": 1}], 1),
    ("mechanics", [{"case": "x", "wrong": 0, "error": None}, {"case": "y", "hang_or_crash": True}], 1),
    ("faults", [{"scenario": "s", "op": "o", "W": 4, "ok": True}], 0),
    ("faults", [{"scenario": "s", "op": "o", "W": 4, "ok": None, "error": "budget spent: not run"}], 1),
    ("faults", [{"scenario": "s", "op": "o", "W": 4, "ok": False}], 1)])
def test_the_exit_status_says_whether_every_row_ran_right(step, rows, code, monkeypatch, tmp_path, capsys):
    """Every run exited 0, whatever its rows said."""
    monkeypatch.setitem(shared_ranks.RUNNERS, step, lambda args: rows)
    assert shared_ranks.main(["--step", step, "--device", "cpu", "--out", str(tmp_path)]) == code
    assert ("rows not run, wrong or hung" in capsys.readouterr().err) == bool(code)


def test_every_family_runs_where_the_w_has_its_least_share(monkeypatch, tmp_path):
    """``one_gpu_run.sh``'s shared step (``--budget 105``, W = 2, 4, 8, families moe, moe-fp8, models): the expert
    families' weighted shares at W = 2 and 4 (about 12 s) were below ``MIN_FAMILY_SHARE``, so they were never run
    there, every time; each family now gets that least while its W has it."""
    from benchmarks.shared import mechanics, runs

    spawned = []

    def spawn(fn, world, args, timeout, device):
        options = args[0]
        spawned.append((world, options["families"][0], round(timeout - shared_ranks.SPAWN_MARGIN)))
        return [[{"case": "c", "mode": "eager", "wrong": 0}]] * world, None

    monkeypatch.setattr(runs, "spawn_ranks", spawn)
    monkeypatch.setattr(mechanics, "aggregate", lambda results, world: [{"case": "c", "mode": "eager", "wrong": 0}])
    args = shared_ranks.parse_args(["--step", "mechanics", "--worlds", "2,4,8", "--families", "moe,moe-fp8,models",
                                    "--budget", "105", "--out", str(tmp_path)])
    args.gpu, args.command = "h100", "the test's"  # what main sets
    rows = shared_ranks.run_mechanics(args)
    assert [(w, f) for w, f, _ in spawned] == [(w, f) for w in (2, 4, 8) for f in ("moe", "moe-fp8", "models")]
    assert all(share >= shared_ranks.MIN_FAMILY_SHARE for _, _, share in spawned), spawned
    assert not [row for row in rows if row.get("error")]
