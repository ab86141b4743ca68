"""Any plan a caller passes to any op, on the CPU: the call raises, or its result is plain PyTorch's. Plans of every
op, of the call's shape and of others (M, N, K doubled or halved), of the group's size and one more, for the ring,
NCCL and P2P paths, overlapped and sequential, passed with ``path="auto"``, ``"reference"`` and ``"ring"`` to the
bf16 and the fp8 ops. (An fp8 call given a ring plan ran the ring, which reads no scales, and returned the unscaled
product in fp8 on every rank: no error.)"""

import itertools

import pytest
import torch

from flashoverlap.testing import spawn

SHAPE_CHANGES = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 0.5))


def _plans(world: int, m: int, n: int, k: int) -> dict:
    import flashoverlap as fo
    from flashoverlap.plan import TileConfig
    from flashoverlap.tune.defaults import sequential_plan

    tile = TileConfig(16, 16, 16, 2, 1, 4)
    plans = {}
    for op, (fm, fn, fk), size, path, sequential in itertools.product(
            ("all_reduce", "reduce_scatter", "all_gather"), SHAPE_CHANGES, (world, world + 1), ("ring", "nccl", "p2p"),
            (False, True)):
        shape = (int(m * fm), int(n * fn), int(k * fk))
        try:
            plans[(op, shape, size, path, sequential)] = (
                sequential_plan(op, *shape, size, path=path) if sequential else
                fo.default_plan(op, *shape, size, tile=tile, num_groups=2, path=path, allow_sequential=False))
        except ValueError:
            pass  # a plan that cannot be made for that shape
    return plans


def _ranks(rank, world):
    import flashoverlap as fo
    from flashoverlap.testing import plain

    ops = {"all_reduce": (fo.gemm_all_reduce, fo.scaled_gemm_all_reduce),
           "reduce_scatter": (fo.gemm_reduce_scatter, fo.scaled_gemm_reduce_scatter),
           "all_gather": (fo.all_gather_gemm, fo.all_gather_scaled_gemm)}
    gen = torch.Generator().manual_seed(rank)
    m, n, k = 16 * world, 24, 256
    plans = _plans(world, m, n, k)
    wrong, ran, refused = [], {False: 0, True: 0}, 0
    for op, (half_op, fp8_op) in ops.items():
        rows = m // world if op == "all_gather" else m
        for fp8 in (False, True):
            if fp8:
                a = torch.randn(rows, k, generator=gen).to(torch.float8_e4m3fn)
                b = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).t()
                sa, sb = torch.tensor(2.0), torch.tensor(0.5)
                want = plain(op, a.float() * 2, b.float() * 0.5)

                def call(plan, path, a=a, b=b, sa=sa, sb=sb, fn=fp8_op):
                    return fn(a, b, sa, sb, plan=plan, path=path)
            else:
                a = torch.randn(rows, k, generator=gen).bfloat16()
                b = torch.randn(n, k, generator=gen).bfloat16().t()
                want = plain(op, a.float(), b.float())

                def call(plan, path, a=a, b=b, fn=half_op):
                    return fn(a, b, plan=plan, path=path)
            done, no = given_plans(call, plans, ("auto", "reference", "ring"), want, 3e-2, (op, fp8), wrong)
            ran[fp8] += done
            refused += no
    return wrong, (ran[False], ran[True]), refused


def given_plans(call, plans: dict, paths: tuple[str, ...], want: torch.Tensor, limit: float, what: tuple,
                wrong: list) -> tuple[int, int]:
    """``call(plan, path)`` for every plan of ``plans`` and every path of ``paths``: a call that raises a
    ``ValueError`` or ``TypeError`` (with a message) is refused; one that returns must return bf16 of ``want``'s shape
    within ``limit`` (relative Frobenius error), else it is appended to ``wrong``. Returns ``(ran, refused)``."""
    ran = refused = 0
    for key, plan in plans.items():
        for path in paths:
            try:
                got = call(plan, path)
            except (ValueError, TypeError) as exc:
                assert str(exc), key
                refused += 1
                continue
            ran += 1
            ok = got.shape == want.shape and got.dtype == torch.bfloat16
            err = float((got.float() - want).norm() / want.norm()) if ok else None
            if not ok or not err < limit:
                wrong.append((*what, key, path, tuple(got.shape), str(got.dtype), err))
            del got
    return ran, refused


@pytest.mark.parametrize("world", [2, 3])
def test_a_given_plan_is_refused_or_the_result_is_right(world):
    results = spawn(_ranks, world)
    for wrong, ran, refused in results:
        assert wrong == [], wrong[:5]
        # both outcomes exercised, bf16 and fp8 each, on every rank alike
        assert min(ran) >= 20 and refused >= 40, (ran, refused)
    assert len({(ran, refused) for _, ran, refused in results}) == 1, results
