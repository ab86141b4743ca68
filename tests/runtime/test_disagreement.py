"""Ranks that disagree on a call, with no switch set (no ``TORCH_DISTRIBUTED_DEBUG``, no debug timeout): every public
op (bf16, fp8, the expert layout, dispatch and combine, fp8 dispatch) raises on every rank, naming the op, the
argument and the ranks that differ, and no rank returns a tensor; at W = 2 and 3 (rank 0 differs from the others).
Then the group is still usable, and a repeated call exchanges nothing (the agreement ran once)."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

from flashoverlap.testing import spawn

FP8 = torch.float8_e4m3fn


def _fp8(x: torch.Tensor, mode: str, operand: str = "a") -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in fp8 with tensor-wise or row-wise fp32 scales (``operand`` "b": one per column of ``[K, N]``)."""
    top = torch.finfo(FP8).max
    if mode == "tensor":
        scale = x.abs().amax().clamp(min=1e-6) / top
        return (x / scale).to(FP8), scale.reshape(()).float()
    scale = x.abs().amax(1 if operand == "a" else 0, keepdim=True).clamp(min=1e-6) / top
    return (x / scale).to(FP8), scale.float()


def _expert_fp8(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 expert weights ``[L, H, N]`` and their scales: row-wise ``[L, N]``, block-wise ``[L, H/128, N/128]``."""
    top = torch.finfo(FP8).max
    local, k, n = w.shape
    if mode == "row":
        scale = (w.abs().amax(1) / top).clamp(min=1e-6)  # [L, N]
        return (w / scale[:, None, :]).to(FP8), scale.float()
    scale = (w.reshape(local, k // 128, 128, -1, 128).abs().amax((2, 4)) / top).clamp(min=1e-6)
    expanded = scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return (w / expanded).to(FP8), scale.float()


def _cases(rank: int, world: int):
    """(op, the argument the error must name, the call): rank 0's call differs from the other ranks' in that
    argument alone."""
    import flashoverlap as fo

    odd = rank == 0
    g = torch.Generator().manual_seed(rank)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    bf = torch.bfloat16
    experts = 2 * world
    idx = torch.arange(4).reshape(4, 1) % experts
    hidden = 128 + 128 * odd  # fp8 block-wise needs multiples of 128
    cases = [
        # The case: rank 1 returned a [20, 32] tensor, rank 0 aborted inside gloo.
        ("all_gather_gemm", "a's rows M", lambda: fo.all_gather_gemm(randn(8 + 2 * odd, 16, dtype=bf),
                                                                     randn(16, 32, dtype=bf))),
        ("gemm_all_reduce", "b's columns N", lambda: fo.gemm_all_reduce(randn(6, 16, dtype=bf),
                                                                        randn(16, 8 + odd, dtype=bf))),
        ("gemm_all_reduce", "K (a's columns, b's rows)", lambda: fo.gemm_all_reduce(randn(6, 16 + odd, dtype=bf),
                                                                                    randn(16 + odd, 8, dtype=bf))),
        ("gemm_reduce_scatter", "dtype of a and b",
         lambda: fo.gemm_reduce_scatter(randn(6, 16, dtype=(bf, torch.float16)[odd]),
                                        randn(16, 8, dtype=(bf, torch.float16)[odd]))),
        ("gemm_reduce_scatter", "path", lambda: fo.gemm_reduce_scatter(randn(6, 16, dtype=bf), randn(16, 8, dtype=bf),
                                                                       path=("auto", "reference")[odd])),
        ("scaled_gemm_all_reduce", "scaling (the scales' shapes)",
         lambda: fo.scaled_gemm_all_reduce(*_scaled(randn(6, 32), randn(32, 16), ("tensor", "row")[odd]))),
        ("scaled_gemm_reduce_scatter", "out_dtype",
         lambda: fo.scaled_gemm_reduce_scatter(*_scaled(randn(6, 32), randn(32, 16), "row"),
                                               out_dtype=(bf, torch.float32)[odd])),
        ("all_gather_scaled_gemm", "a's rows M",
         lambda: fo.all_gather_scaled_gemm(*_scaled(randn(8 + 2 * odd, 32), randn(32, 16), "row"))),
        ("moe_layout", "num_experts", lambda: fo.moe_layout(idx, experts * (1 + odd))),
        ("moe_dispatch_gemm", "hidden size H",
         lambda: fo.moe_dispatch_gemm(randn(4, hidden), randn(2, hidden, 6), fo.moe_layout(idx, experts))),
        ("moe_dispatch_gemm", "expert weights' width (dispatch's N, combine's K)",
         lambda: fo.moe_dispatch_gemm(randn(4, 16), randn(2, 16, 6 + 2 * odd), fo.moe_layout(idx, experts))),
        ("moe_gemm_combine", "hidden size H",
         lambda: fo.moe_gemm_combine(randn(_received(fo, idx, experts), 6), randn(2, 6, hidden), torch.ones(4, 1),
                                     fo.moe_layout(idx, experts))),
        ("moe_dispatch_gemm", "fp8 scaling",
         lambda: _fp8_dispatch(fo, randn(4, 128, dtype=bf), randn(2, 128, 128), ("row", "block")[odd],
                               fo.moe_layout(idx, experts))),
        ("moe_gemm_combine", "fp8 scaling",
         lambda: _fp8_combine(fo, randn(_received(fo, idx, experts), 128, dtype=bf), randn(2, 128, 128),
                              ("row", "block")[odd], fo.moe_layout(idx, experts))),
    ]
    return cases


def _scaled(a: torch.Tensor, b: torch.Tensor, mode: str):
    aq, sa = _fp8(a, mode)
    bq, sb = _fp8(b, mode, "b")
    return aq, bq, sa, sb


def _fp8_dispatch(fo, x: torch.Tensor, w: torch.Tensor, mode: str, layout):
    wq, scale = _expert_fp8(w, mode)
    return fo.moe_dispatch_gemm(x, wq, layout, scale_w=scale)


def _fp8_combine(fo, a: torch.Tensor, w: torch.Tensor, mode: str, layout):
    wq, scale = _expert_fp8(w, mode)
    return fo.moe_gemm_combine(a, wq, torch.ones(layout.tokens, layout.top_k), layout, scale_w=scale)


def _received(fo, idx: torch.Tensor, experts: int) -> int:
    return fo.moe_layout(idx, experts).recv_rows


NAMED_VALUES = {"dtype of a and b": {"bfloat16", "float16"}, "path": {"auto", "reference"},
                "scaling (the scales' shapes)": {"tensor", "row"}, "out_dtype": {"bfloat16", "float32"},
                "fp8 scaling": {"row", "block"}}


def _disagreeing(rank: int, world: int, every_call: bool = True):
    """``every_call``: the reference path's rule (an exchange per call); False: the GPU paths' (an exchange on a
    call's first call only, ``runtime/calls.agree_every_call`` answering False as it does there), on gloo."""
    import flashoverlap as fo
    from flashoverlap import settings
    from flashoverlap.runtime import agreement, calls, context

    if not every_call:
        calls.agree_every_call = lambda a, path, group: False
    for variable in ("TORCH_DISTRIBUTED_DEBUG", "FLASHOVERLAP_DEBUG_TIMEOUT"):
        os.environ.pop(variable, None)
    settings.refresh()
    assert settings.current().agreement is None, "a switch is set: this test is about the default"
    others = list(range(1, world))
    returned, named = [], []
    for op, argument, call in _cases(rank, world):
        try:
            out = call()
        except ValueError as exc:
            text = str(exc)
            assert text.startswith(f"{op}: rank {rank} of group"), text
            assert f"disagree on {argument} (" in text, text
            if argument in NAMED_VALUES:  # a coded field's values by name, not by their codes
                mine, theirs = re.search(rf"{re.escape(argument)} \((\S+) here, (\S+) on rank", text).groups()
                assert {mine, theirs} <= NAMED_VALUES[argument] and mine != theirs, text
            assert f"ranks {others if rank == 0 else [0]} differ" in text, text
            named.append((op, argument))
        else:
            returned.append((op, argument, tuple(getattr(out, "shape", ()))))
    assert not returned, f"rank {rank} returned tensors: {returned}"
    # The group is usable after the errors; on the reference path a repeated call is agreed on too, one small
    # exchange per call; under the GPU paths' rule a repeated call exchanges nothing.
    a, b = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)), torch.ones(16, 8)
    fo.all_gather_gemm(a, b)
    exchanged = []
    real = agreement.gather_rows
    agreement.gather_rows = lambda *args: exchanged.append(args[0]) or real(*args)
    try:
        for _ in range(3):
            c = fo.all_gather_gemm(a, b)
    finally:
        agreement.gather_rows = real
    gathered = torch.empty(world * 4, 16)
    dist.all_gather_into_tensor(gathered, a)
    torch.testing.assert_close(c, gathered @ b)
    assert exchanged == (["all_gather_gemm"] * 3 if every_call else []), exchanged
    assert context.REGISTRY.resolved
    return named


def _repeating_different_calls(rank: int, world: int):
    """Every rank makes call A, then call B (both agreed); then rank 0 repeats A while the others repeat B, whose
    collectives move as many bytes (a [12, 8] result against an [8, 12] one): with no switch set, every rank
    raises, naming the arguments, and none returns a tensor (a first-call check alone let each add the other's
    differently shaped matrix). Dense, fp8 and expert ops, and the routing layout (top-1 against top-2)."""
    import flashoverlap as fo

    for variable in ("TORCH_DISTRIBUTED_DEBUG", "FLASHOVERLAP_DEBUG_TIMEOUT"):
        os.environ.pop(variable, None)
    from flashoverlap import settings

    settings.refresh()
    g = torch.Generator().manual_seed(rank)
    a_ = (torch.randn(12, 16, generator=g), torch.randn(16, 8, generator=g))
    b_ = (torch.randn(8, 16, generator=g), torch.randn(16, 12, generator=g))
    fp8 = {"A": _scaled(*a_, "row"), "B": _scaled(*b_, "row")}
    experts = 2 * world
    idx = torch.arange(6).reshape(6, 1) % experts
    layout = fo.moe_layout(idx, experts)
    x = {"A": torch.randn(6, 8, generator=g), "B": torch.randn(6, 16, generator=g)}  # the hidden sizes differ
    w = {"A": torch.randn(2, 8, 16, generator=g), "B": torch.randn(2, 16, 8, generator=g)}  # the same bytes
    top2 = torch.arange(12).reshape(6, 2) % experts  # top-2 routing beside idx's top-1
    calls = {"gemm_all_reduce": lambda c: fo.gemm_all_reduce(*(a_ if c == "A" else b_)),
             "scaled_gemm_all_reduce": lambda c: fo.scaled_gemm_all_reduce(*fp8[c]),
             "moe_dispatch_gemm": lambda c: fo.moe_dispatch_gemm(x[c], w[c], layout),
             "moe_layout": lambda c: fo.moe_layout(idx if c == "A" else top2, experts)}
    outcome = {}
    for op, call in calls.items():
        call("A")
        call("B")
        try:
            out = call("A" if rank == 0 else "B")
        except ValueError as exc:
            assert str(exc).startswith(f"{op}: rank {rank} of group") and "disagree on" in str(exc), str(exc)
            outcome[op] = "raised"
        else:
            outcome[op] = f"returned {getattr(out, 'shape', type(out).__name__)}"
    return outcome


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_each_repeating_a_different_call_raise_on_the_reference_path(world):
    outcomes = spawn(_repeating_different_calls, world, timeout=240)
    assert all(o == {op: "raised" for op in outcomes[0]} for o in outcomes), outcomes


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("every_call", [True, False], ids=["reference-rule", "first-call-rule"])
def test_ranks_that_disagree_raise_on_every_rank_and_none_returns_a_tensor_with_no_switch_set(world, every_call):
    named = spawn(_disagreeing, world, args=(every_call,), timeout=240)
    assert all(n == named[0] for n in named) and len(named[0]) == len(_cases(0, 2)), named


def _parameter_on_one_rank(rank: int, world: int):
    """Rank 0 passes its operand as an ``nn.Parameter``, the others as plain tensors: the same call, so every rank
    must decide alike whether to agree on it (deciding by exact type deadlocked here at the second call)."""
    import flashoverlap as fo

    a = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    a = torch.nn.Parameter(a, requires_grad=False) if rank == 0 else a
    b = torch.ones(8, 6)
    out = [fo.gemm_all_reduce(a, b) for _ in range(3)]
    return float((out[-1] - out[0]).abs().max())


def test_a_parameter_operand_on_one_rank_is_the_same_call():
    assert spawn(_parameter_on_one_rank, 2, timeout=60) == [0.0, 0.0]


def _layout_collective_errors(rank: int, world: int) -> list[str]:
    """moe_layout's own exchange (``comm/expert/layout.expert_layout``) finds ranks that disagree on the mode or the
    bound, an index out of range on one rank, or a routing beyond the bound; every rank raises, and the message must
    name the public op, moe_layout (it said ``expert_layout: ...``, ``topk_idx: ...`` or ``bound=... exceeded``)."""
    import flashoverlap as fo
    from flashoverlap import settings

    for variable in ("TORCH_DISTRIBUTED_DEBUG", "FLASHOVERLAP_DEBUG_TIMEOUT"):
        os.environ.pop(variable, None)
    settings.refresh()
    experts = 2 * world
    idx = torch.arange(4).reshape(4, 1) % experts
    bad = idx.clone()
    if rank == 0:
        bad[0, 0] = experts  # out of range on rank 0 only
    calls = [lambda: fo.moe_layout(idx, experts, mode=("bounded", "exact")[rank > 0], bound=4 if rank == 0 else None),
             lambda: fo.moe_layout(idx, experts, mode="bounded", bound=4 + (rank == 0)),
             lambda: fo.moe_layout(bad, experts),
             lambda: fo.moe_layout(torch.zeros(4, 1, dtype=torch.int64), experts, mode="bounded", bound=2)]
    messages = []
    for call in calls:
        try:
            call()
        except (ValueError, RuntimeError) as exc:
            messages.append(str(exc))
        else:
            messages.append("returned")
    return messages


@pytest.mark.parametrize("world", [2, 3])
def test_moe_layouts_own_collective_errors_name_the_op(world):
    # Fuzzed (tools/fuzz_agreement.py): "expert_layout: the ranks of group '0' ... disagree on the mode or the bound".
    outcomes = spawn(_layout_collective_errors, world, timeout=120)
    for messages in outcomes:
        assert len(messages) == 4 and all(m.startswith("moe_layout: ") for m in messages), messages
    assert "disagree on the mode or the bound" in outcomes[0][0] and "bound=4" in outcomes[0][1]
    assert "outside [0," in outcomes[0][2] and "exceeded" in outcomes[0][3]
