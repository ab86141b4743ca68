"""Ranks that call with different shapes: under PyTorch's own switch ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` every public op
raises on every rank before anything is sent, naming the op, the argument and the ranks; without it, a backend's
error that escapes a call is raised again naming the op, the group and how to turn the check on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flashoverlap as fo
from flashoverlap import settings
from flashoverlap.runtime import agreement
from flashoverlap.testing import spawn
from tests.ops.test_errors import world_of_one  # noqa: F401  (a fixture: one gloo rank)
from tests.ops.test_scaled import quantise


def _calls(rank: int):
    """Each public op called with rank 1's shapes off by one row or column: (op, the argument's words, call)."""
    m = 4 + rank * 2  # rank 1 has other rows (even, so that reduce-scatter's own check passes on both)
    a, b = torch.randn(m, 8), torch.randn(8, 6)
    aq, sa = quantise(torch.randn(m, 32), "tensor")
    bq, sb = quantise(torch.randn(32, 16), "tensor", operand="b")
    idx = torch.tensor([[0], [1], [2], [3]])
    hidden = 8 + rank  # rank 1's hidden size differs
    w_up, w_down = torch.randn(2, hidden, 6), torch.randn(2, 3, hidden)
    return [
        ("gemm_all_reduce", "a's rows M", lambda: fo.gemm_all_reduce(a, b)),
        ("gemm_reduce_scatter", "a's rows M", lambda: fo.gemm_reduce_scatter(a, b)),
        ("all_gather_gemm", "a's rows M", lambda: fo.all_gather_gemm(a, b)),
        ("scaled_gemm_all_reduce", "a's rows M", lambda: fo.scaled_gemm_all_reduce(aq, bq, sa, sb)),
        ("scaled_gemm_reduce_scatter", "a's rows M", lambda: fo.scaled_gemm_reduce_scatter(aq, bq, sa, sb)),
        ("all_gather_scaled_gemm", "a's rows M", lambda: fo.all_gather_scaled_gemm(aq, bq, sa, sb)),
        ("moe_layout", "num_experts", lambda: fo.moe_layout(idx, 4 + 2 * rank)),
        ("moe_dispatch_gemm", "hidden size H",
         lambda: fo.moe_dispatch_gemm(torch.randn(4, hidden), w_up, fo.moe_layout(idx, 4))),
        ("moe_gemm_combine", "hidden size H",
         lambda: fo.moe_gemm_combine(torch.randn(_received(idx), 3), w_down, torch.ones(4, 1),
                                     fo.moe_layout(idx, 4))),
    ]


def _received(idx: torch.Tensor) -> int:
    layout = fo.moe_layout(idx, 4)
    return layout.recv_rows


def _mismatched(rank, world):
    import os

    # Set in the rank (a variable handed to spawn would start fresh interpreters, seconds each): what a user's
    # `TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ...` gives flashoverlap's settings.
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    settings.refresh()
    assert settings.current().agreement is not None, "TORCH_DISTRIBUTED_DEBUG=DETAIL did not turn the check on"
    named = []
    for op, argument, call in _calls(rank):
        with pytest.raises(ValueError) as caught:
            call()
        text = str(caught.value)
        assert text.startswith(f"{op}: rank {rank} of group"), text
        assert f"disagree on {argument}" in text and f"ranks [{1 - rank}] differ" in text, text
        named.append(op)
    dist.barrier()
    return named


def test_every_public_op_names_ranks_that_disagree_under_torch_distributed_debug_detail():
    results = spawn(_mismatched, 2)
    assert results[0] == results[1] and len(results[0]) == 9


@pytest.mark.usefixtures("world_of_one")
def test_a_backend_error_is_raised_again_with_the_op_the_group_and_the_hint(monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("[enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes")

    monkeypatch.setattr(dist, "all_reduce", failing)
    settings.refresh()
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    with pytest.raises(RuntimeError) as caught:
        fo.gemm_all_reduce(a, b, path="reference")
    text = str(caught.value)
    assert text.startswith("gemm_all_reduce on group") and "enforce fail at gloo" in text, text
    assert agreement.HINT in text and isinstance(caught.value.__cause__, RuntimeError)
    # flashoverlap's own errors pass unchanged
    with pytest.raises(ValueError, match="^gemm_all_reduce: a is"):
        fo.gemm_all_reduce(a, torch.randn(7, 6))
