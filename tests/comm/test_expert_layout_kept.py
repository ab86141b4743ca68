"""What the expert calls keep per layout (``comm/expert/rows.py``): each choice's token (``choice_tokens``) made
once per exact layout and shared by the layer's calls, made anew for another layout, and read from the layout every
call in bounded mode (whose tensors a user's CUDA graph replay may have overwritten); and the weighted sum at the
origin (``combine_at_origin``) equal to its definition in both modes."""

import pytest
import torch

from flashoverlap.comm.expert import ExpertPlan, Layout
from flashoverlap.comm.expert import rows as expert_rows
from flashoverlap.comm.expert.rows import choice_tokens, combine_at_origin

WORLD, LOCAL, TOP_K = 2, 3, 2


def _layout(mode, seed, tokens=7, bound=None):
    gen = torch.Generator().manual_seed(seed)
    choices = tokens * TOP_K
    send_order = torch.randperm(choices, generator=gen)
    counts = torch.zeros(WORLD, LOCAL, dtype=torch.int64)
    ends = torch.zeros(WORLD * LOCAL, dtype=torch.int32)
    if mode == "exact":
        send_rows, extra = torch.arange(choices), {"send_splits": (choices, 0), "recv_splits": (choices, 0),
                                                    "max_pair_rows": choices}
    else:
        send_rows, extra = torch.randperm(WORLD * bound, generator=gen)[:choices], {"max_pair_rows": bound}
    return Layout(send_order, send_rows, counts, counts.clone(), ends, ends.clone(), mode=mode, bound=bound,
                  top_k=TOP_K, tokens=tokens, experts=WORLD * LOCAL, **extra)


def test_exact_tokens_are_made_once_per_layout_and_anew_for_another():
    first = _layout("exact", 0)
    tokens = choice_tokens(first, TOP_K)
    assert torch.equal(tokens, first.send_order // TOP_K)
    weighted = first.with_weights(torch.rand(first.tokens, TOP_K))  # the layer's combine: the same tensors
    assert choice_tokens(weighted, TOP_K) is tokens and choice_tokens(first, TOP_K) is tokens
    other = _layout("exact", 1)
    assert torch.equal(choice_tokens(other, TOP_K), other.send_order // TOP_K)
    assert not torch.equal(choice_tokens(other, TOP_K), tokens)
    assert torch.equal(choice_tokens(first, 1), first.send_order)  # another k than the layout's: not kept


def test_bounded_tokens_are_read_from_the_layout_every_call():
    layout = _layout("bounded", 2, bound=10)
    before = choice_tokens(layout, TOP_K)
    fresh = _layout("bounded", 3, bound=10)
    layout.send_order.copy_(fresh.send_order)  # new routing copied in, as before a user's graph replays
    assert torch.equal(choice_tokens(layout, TOP_K), fresh.send_order // TOP_K)
    assert not torch.equal(before, fresh.send_order // TOP_K)
    assert layout.send_order not in expert_rows._TOKENS


@pytest.mark.parametrize("mode", ["exact", "bounded"])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("given", [False, True])
def test_the_weighted_sum_at_the_origin_is_its_definition(mode, weighted, dtype, given):
    layout = _layout(mode, 4, bound=None if mode == "exact" else 9)
    layout = layout.with_weights(torch.rand(layout.tokens, TOP_K, dtype=torch.bfloat16))
    plan = ExpertPlan("combine", WORLD, WORLD * LOCAL, 8, 4, TOP_K, layout.tokens, mode,
                      None if mode == "exact" else 9, weighted=weighted)
    y_back = torch.randn(layout.send_capacity, 8).to(dtype)
    rows = y_back.index_select(0, layout.send_rows).float()
    if weighted:
        rows = rows * layout.weights.float()[:, None]
    want = torch.zeros(layout.tokens, 8).index_add_(0, layout.send_order // TOP_K, rows).to(dtype)
    out = torch.full((layout.tokens, 8), float("nan"), dtype=dtype) if given else None
    kept = y_back.clone()
    got = combine_at_origin(y_back, plan, layout, dtype, out=out)
    assert torch.equal(got, want) and (out is None or got is out)
    assert torch.equal(y_back, kept)  # read, not written
