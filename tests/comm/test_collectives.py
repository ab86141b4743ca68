"""The sequential plan's collectives issued straight to the group (``comm/collectives.*_now``): the same result as
``torch.distributed``'s functions, without going through them, except where a ``__torch_function__`` mode must see
them; and the sequential communicator built on them, against plain PyTorch under gloo, refusing a group inside a
coalescing manager."""

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from flashoverlap.comm import collectives
from flashoverlap.comm.protocol import Call, CommGroup
from flashoverlap.comm.tp.sequential import SequentialCommunicator
from flashoverlap.testing import spawn
from flashoverlap.tune.defaults import sequential_plan

DTYPES = (torch.float32, torch.float16)


# torch.distributed's functions the ``*_now`` functions fall back on, as the module that calls them names them.
FALLBACKS = ((dist, "all_reduce"), (collectives, "reduce_scatter_tensor"), (collectives, "all_gather_into_tensor"))


def _swap(replacement) -> dict:
    """Put ``replacement(name, original)`` in place of each fallback; returns what ``_undo`` puts back."""
    saved = {}
    for module, name in FALLBACKS:
        saved[(module, name)] = original = getattr(module, name)
        setattr(module, name, replacement(name, original))
    return saved


def _undo(saved: dict) -> None:
    for (module, name), value in saved.items():
        setattr(module, name, value)


def _refuse(name, original):
    def refuse(*args, **kwargs):
        raise AssertionError(f"went through torch.distributed's {name}")

    return refuse


def _fresh(shape, dtype, rank, seed):
    torch.manual_seed(1000 * seed + rank)
    return torch.randn(shape, dtype=torch.float32).to(dtype)


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def _straight(rank, world_size):
    """Each ``*_now`` against torch's function on fresh inputs (outputs poisoned with NaN), with torch's functions
    made to raise while ``*_now`` runs: the result must come from the straight issue."""
    group = dist.group.WORLD
    checked = 0
    for seed, (rows, cols) in enumerate(((1, 1), (3, 5), (17, 33), (64, 48))):
        for dtype in DTYPES:
            x = _fresh((rows * world_size, cols), dtype, rank, seed)
            want_sum = x.clone()
            dist.all_reduce(want_sum, group=group)
            want_rs = _poisoned((rows, cols), dtype)
            collectives.reduce_scatter_tensor(want_rs, x.clone(), group)
            shard = x[:rows].contiguous()
            want_ag = _poisoned((rows * world_size, cols), dtype)
            collectives.all_gather_into_tensor(want_ag, shard, group)
            saved = _swap(_refuse)
            try:
                got_sum = x.clone()
                collectives.all_reduce_now(got_sum, group)
                got_rs = _poisoned((rows, cols), dtype)
                collectives.reduce_scatter_now(got_rs, x.clone(), group)
                got_ag = _poisoned((rows * world_size, cols), dtype)
                collectives.all_gather_now(got_ag, shard, group)
            finally:
                _undo(saved)
            for got, want in ((got_sum, want_sum), (got_rs, want_rs), (got_ag, want_ag)):
                assert not torch.isnan(got).any()
                torch.testing.assert_close(got, want, atol=0, rtol=0)
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_issued_straight_match_torch_distributed(world_size):
    assert collectives._DIRECT, "this torch lacks what the straight issue needs: every call goes through torch"
    assert spawn(_straight, world_size) == [4 * len(DTYPES) * 3] * world_size


class _Recording(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _overridden(rank, world_size):
    """Under a ``__torch_function__`` mode each ``*_now`` goes through torch's function (which the mode may take
    over); outside it does not."""
    group = dist.group.WORLD
    went = []

    def recording(name, original):
        def record(*args, **kwargs):
            went.append(name)
            return original(*args, **kwargs)

        return record

    saved = _swap(recording)
    try:
        x = torch.ones(2 * world_size, 3)
        out, gathered = torch.empty(2, 3), torch.empty(2 * world_size, 3)

        def issue_all():
            collectives.all_reduce_now(x.clone(), group)
            collectives.reduce_scatter_now(out, x.clone(), group)
            collectives.all_gather_now(gathered, x[:2].clone(), group)

        issue_all()
        assert went == [], went
        with _Recording():
            issue_all()
        assert went == ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"], went
        went.clear()
        issue_all()
        assert went == [], went
    finally:
        _undo(saved)
    return True


def test_a_torch_function_mode_gets_torch_distributed():
    assert spawn(_overridden, 2) == [True, True]


def _inside_coalescing_manager(rank, world_size):
    """Each op's sequential call inside ``dist._coalescing_manager`` on its group raises before issuing anything."""
    comm = SequentialCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    assert collectives._COALESCING is dist.distributed_c10d._world.pg_coalesce_state, "not torch's own state"
    issued = []
    mm = torch.mm
    torch.mm = lambda *args, **kwargs: issued.append("mm")
    try:
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            plan = sequential_plan(op, 4, 3, 2, world_size, path="nccl")
            a = torch.randn(2 if op == "all_gather" else 4, 2)
            with pytest.raises(RuntimeError, match=f"{op}_op: called inside torch.distributed's coalescing manager"):
                with dist._coalescing_manager(group=dist.group.WORLD):
                    comm.run(Call(f"{op}_op", plan, a, torch.randn(2, 3)))
    finally:
        torch.mm = mm
    assert not issued, issued
    return True


def test_the_sequential_communicator_refuses_a_group_inside_a_coalescing_manager():
    # The manager defers the group's collectives to its exit: all-gather's GEMM would read a gathered input that has
    # not arrived, and the others would return unreduced results. The refusal comes before the matmul.
    assert spawn(_inside_coalescing_manager, 2) == [True, True]


def _sequential(rank, world_size):
    """The sequential communicator on every op, odd and round shapes, ``w.t()`` weights: plain PyTorch's result."""
    comm = SequentialCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    checked = 0
    for seed, (m_shard, n, k) in enumerate(((1, 1, 1), (3, 7, 5), (16, 24, 32), (33, 17, 9))):
        m = m_shard * world_size
        for dtype in DTYPES:
            a = _fresh((m, k), dtype, rank, seed)
            w = _fresh((n, k), dtype, rank, seed + 50)
            b = w.t()
            product = a @ b
            summed = product.clone()
            dist.all_reduce(summed)
            shard = a[rank * m_shard : (rank + 1) * m_shard]
            gathered = _poisoned((m, k), dtype)
            collectives.all_gather_into_tensor(gathered, shard.contiguous(), dist.group.WORLD)
            want = {"all_reduce": summed, "reduce_scatter": summed[rank * m_shard : (rank + 1) * m_shard],
                    "all_gather": gathered @ b}
            for op, operand in (("all_reduce", a), ("reduce_scatter", a), ("all_gather", shard)):
                plan = sequential_plan(op, m, n, k, world_size, path="nccl")
                got, extra = comm.run(Call(op, plan, operand, b, return_gathered=op == "all_gather"))
                assert not torch.isnan(got).any()
                torch.testing.assert_close(got, want[op], atol=0, rtol=0)
                if op == "all_gather":
                    torch.testing.assert_close(extra, gathered, atol=0, rtol=0)
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_sequential_communicator_returns_what_plain_pytorch_returns(world_size):
    assert spawn(_sequential, world_size) == [4 * len(DTYPES) * 3] * world_size


def _sequential_fp8(rank, world_size):
    """The sequential communicator's fp8 calls (``torch._scaled_mm``, the dequantised product block-wise, then the
    collective; the all-gather's rows and scales in one coalesced call) against each rank's ``_scaled_mm`` of the
    gathered or unsharded operands, tensor-wise shards of different scales included, outputs poisoned."""
    from flashoverlap.comm.scaled import Scales
    from tests.ops.test_scaled import expected, quantise

    comm = SequentialCommunicator(CommGroup.of(dist.group.WORLD, torch.device("cpu")))
    checked = 0
    for mode, (m_shard, n, k) in (("tensor", (3, 16, 32)), ("row", (5, 32, 48)), ("block", (2, 256, 384))):
        m = m_shard * world_size
        torch.manual_seed(7 + rank)  # each rank its own A, and so its own tensor-wise scale
        a, sa = quantise(torch.randn(m, k), mode)
        torch.manual_seed(99)
        b, sb = quantise(torch.randn(k, n), mode, operand="b")
        sb = sb.reshape(1, n) if mode == "row" else sb
        b = b.t().contiguous().t()
        shard = slice(rank * m_shard, (rank + 1) * m_shard)
        gathered_a = [torch.empty_like(a[shard].view(torch.uint8)) for _ in range(world_size)]
        dist.all_gather(gathered_a, a[shard].contiguous().view(torch.uint8))
        scale_rows = sa[shard] if mode != "tensor" else sa.reshape(1, 1).expand(m_shard, 1)
        gathered_s = [torch.empty_like(scale_rows.contiguous()) for _ in range(world_size)]
        dist.all_gather(gathered_s, scale_rows.contiguous())
        a_full = torch.cat(gathered_a).view(a.dtype)
        s_full = torch.cat(gathered_s)
        summed = expected(a, b, sa, sb, mode, torch.bfloat16)
        dist.all_reduce(summed)
        want = {"all_reduce": summed.to(torch.bfloat16), "reduce_scatter": summed[shard].to(torch.bfloat16),
                "all_gather": _gathered_product(a_full, b, s_full, sb, mode)}
        for op, operand, scale in (("all_reduce", a, sa), ("reduce_scatter", a, sa),
                                   ("all_gather", a[shard], sa if mode == "tensor" else sa[shard])):
            plan = sequential_plan(op, m, n, k, world_size, path="nccl")
            got, extra = comm.run(Call(op, plan, operand, b, return_gathered=op == "all_gather",
                                       scales=Scales.of(scale, sb)))
            assert not torch.isnan(got.float()).any(), (op, mode)
            error = ((got.float() - want[op].float()).norm() / want[op].float().norm()).item()
            assert error < 1e-2, (op, mode, error)  # partials rounded to bf16 and summed: not bit-equal
            if op == "all_gather":
                assert torch.equal(extra[0].view(torch.uint8), a_full.view(torch.uint8)), mode
                assert torch.equal(extra[1], s_full), mode
            checked += 1
    return checked


def _gathered_product(a_full, b, s_full, sb, mode):
    """``_scaled_mm`` of the gathered A, each row with its own shard's scales (tensor-wise: row-wise in effect)."""
    from tests.ops.test_scaled import expected

    if mode == "tensor":
        return expected(a_full, b, s_full, sb.reshape(1, 1).expand(1, b.shape[1]).contiguous(), "row",
                        torch.bfloat16).to(torch.bfloat16)
    return expected(a_full, b, s_full, sb, mode, torch.bfloat16).to(torch.bfloat16)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_sequential_communicator_runs_fp8_calls(world_size):
    assert spawn(_sequential_fp8, world_size) == [9] * world_size


def _pair(rank, world_size):
    """``all_gather_pair_now`` of an fp8 and an fp32 tensor: what two ``all_gather_into_tensor`` calls give."""
    group = dist.group.WORLD
    x = (torch.randn(3, 32) + rank).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2) + rank
    outs = (torch.empty(3 * world_size, 32, dtype=x.dtype), torch.full((3 * world_size, 2), float("nan")))
    collectives.all_gather_pair_now(outs, (x, s), group)
    want_x, want_s = torch.empty_like(outs[0].view(torch.uint8)), torch.empty_like(outs[1])
    collectives.all_gather_into_tensor(want_x, x.view(torch.uint8), group)
    collectives.all_gather_into_tensor(want_s, s, group)
    return torch.equal(outs[0].view(torch.uint8), want_x) and torch.equal(outs[1], want_s)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_pair_of_all_gathers_in_one_call_matches_two(world_size):
    assert spawn(_pair, world_size) == [True] * world_size
