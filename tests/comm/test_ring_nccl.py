"""The ring over send/recv (``path="ring"``, ``comm/tp/ring_nccl.py``) on gloo ranks: every op against plain PyTorch
at odd and round shapes, several sub-band counts and both dtypes, back-to-back calls of changing shapes, the hook
run once, for W = 2 and 3."""

import pytest
import torch

from flashoverlap.testing import spawn

SHAPES = [(96, 40, 24), (130, 72, 33), (256, 64, 64)]


def _ranks(rank, world_size):
    import flashoverlap as fo
    from flashoverlap.plan import TileConfig
    from flashoverlap.runtime.calls import GEMM, GemmSpec, execute
    from flashoverlap.testing import plain

    tile = TileConfig(16, 16, 16, 2, 1, 4)
    gen = torch.Generator().manual_seed(rank)
    checked = 0
    for m, n, k in SHAPES:
        m -= m % world_size
        for dtype in (torch.bfloat16, torch.float16):
            for op, fn in (("all_reduce", fo.gemm_all_reduce), ("reduce_scatter", fo.gemm_reduce_scatter),
                           ("all_gather", fo.all_gather_gemm)):
                for sub in (1, 2, 3):
                    plan = fo.default_plan(op, m, n, k, world_size, tile=tile, num_groups=sub, path="ring",
                                           allow_sequential=False)
                    assert not plan.sequential
                    if plan.sub_bands != sub:  # the shape has fewer tile rows per rank block
                        continue
                    rows = m // world_size if op == "all_gather" else m
                    a = torch.randn(rows, k, generator=gen).to(dtype)
                    b = torch.randn(n, k, generator=gen).to(dtype).t()
                    got, want = fn(a, b, plan=plan, path="ring"), plain(op, a, b)
                    limit = 2e-2 if dtype == torch.bfloat16 else 4e-3
                    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
                    assert err < limit, f"{op} {m}x{n}x{k} {dtype} sub-bands {sub}: relative error {err:.2e}"
                    checked += 1
    calls = []
    a = torch.randn(48 * world_size, 16, generator=gen).to(torch.bfloat16)
    b = torch.randn(16, 24, generator=gen).to(torch.bfloat16)
    ring = fo.default_plan("reduce_scatter", 48 * world_size, 24, 16, world_size, tile=tile, num_groups=2,
                           path="ring", allow_sequential=False)
    got, _ = execute(GEMM, GemmSpec("hook test", "reduce_scatter", a, b, None, ring, "ring",
                                    hook=lambda: calls.append(1)))
    want = plain("reduce_scatter", a, b).double()
    assert ((got.double() - want).norm() / want.norm()).item() < 2e-2
    assert calls == [1]
    # path="auto" follows a ring plan on the CPU too (not the reference).
    from flashoverlap.runtime.calls import GemmSpec, resolve

    assert resolve(GemmSpec("op", "reduce_scatter", a, b, None, ring, "auto"))[0] == "ring"
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_over_send_recv_matches_plain_pytorch(world_size):
    checked = spawn(_ranks, world_size)
    assert len(set(checked)) == 1 and checked[0] >= len(SHAPES) * 2 * 3 * 2, checked


def _fp8_ranks(rank, world_size):
    """Every fp8 op with a ring plan (not sequential) on gloo: refused by the policy on every rank, path "ring" or
    "auto"; with no plan, path="ring" runs the scaled matmul, then one collective (values against a dequantised
    oracle); and the ring communicator itself refuses scales, should the policy let one through."""
    import torch.distributed as dist

    import flashoverlap as fo
    from flashoverlap.plan import TileConfig
    from flashoverlap.runtime import policy

    tile = TileConfig(16, 16, 16, 2, 1, 4)
    m, n, k = 32 * world_size, 24, 256
    gen = torch.Generator().manual_seed(rank)
    said = []
    for op, fn in (("all_reduce", fo.scaled_gemm_all_reduce), ("reduce_scatter", fo.scaled_gemm_reduce_scatter),
                   ("all_gather", fo.all_gather_scaled_gemm)):
        rows = m // world_size if op == "all_gather" else m
        a = torch.randn(rows, k, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).t()
        sa, sb = torch.tensor(2.0), torch.tensor(3.0)
        ring = fo.default_plan(op, m, n, k, world_size, tile=tile, num_groups=2, path="ring", allow_sequential=False)
        assert not ring.sequential
        for path in ("ring", "auto"):
            with pytest.raises(ValueError, match=f"{fn.__name__}: a ring plan does not run fp8"):
                fn(a, b, sa, sb, plan=ring, path=path)
            said.append((op, path))
        got = fn(a, b, sa, sb, path="ring")  # no plan: the scaled matmul, then one collective
        want = plain(op, (a.float() * 2).bfloat16(), (b.float() * 3).bfloat16()).float()
        assert got.dtype == torch.bfloat16
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2, op
    a = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
    ring = fo.default_plan("all_reduce", m, n, k, world_size, tile=tile, num_groups=2, path="ring",
                           allow_sequential=False)
    original = policy.REASON_NOT["ring"]
    policy.REASON_NOT["ring"] = lambda request: None  # a policy that lets an fp8 ring plan through
    try:
        with pytest.raises(RuntimeError, match="the ring communicator multiplies no fp8 operands"):
            fo.scaled_gemm_all_reduce(a, b, sa, sb, plan=ring, path="ring")
    finally:
        policy.REASON_NOT["ring"] = original
        fo.release()  # the call resolved under the stood-in policy holds no entry past it
    dist.barrier()
    return said


def plain(op, a, b):
    from flashoverlap.testing import plain as plain_op

    return plain_op(op, a, b)


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_fp8_call_with_a_ring_plan_is_refused_never_an_unscaled_product(world_size):
    """A ring plan on the CPU ran the fp8 operands unscaled and returned an fp8 tensor, without an error."""
    said = spawn(_fp8_ranks, world_size)
    assert all(s == said[0] for s in said) and len(said[0]) == 6, said
