"""The signalling GEMM's direct launches (``kernels/launch.py``) on a GPU: a repeated launch skips the JIT and computes
what the JIT's launch does, on fresh values each time; a launch whose operands are aligned otherwise (a view one
element in), or in another dtype or layout, compiles or finds its own kernel. Against ``torch.mm`` in fp32, the
output NaN-poisoned before every launch."""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or
                                                  os.environ.get("TRITON_INTERPRET") == "1",
                                                  reason="needs a CUDA GPU, and TRITON_INTERPRET unset")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_repeated_launches_are_direct_and_right(dtype):
    import flashoverlap as fo
    from flashoverlap.kernels import gemm as gemm_module

    launcher = gemm_module._LAUNCH
    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    m, n, k = 1000, 776, 520
    plan = fo.default_plan("all_reduce", m, n, k, 2, num_sms=sms, allow_sequential=False)
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    backing = torch.empty(m * k + 1, dtype=dtype, device=device)

    def launch(a, b, options):
        out.fill_(float("nan"))
        counters.zero_()
        gemm_module.gemm(a, b, plan, out=out, counters=counters, **options)
        want = a.float() @ b.float()
        torch.testing.assert_close(out.float(), want, atol=2e-2 * k**0.5, rtol=2e-2)

    def weight():
        return (torch.randn(n, k, dtype=dtype, device=device) / k**0.5).t()

    def aligned():
        return torch.randn(m, k, dtype=dtype, device=device)

    def one_in():  # 2 bytes past a 16-byte boundary
        return backing[1:].view(m, k).copy_(torch.randn(m, k, dtype=dtype, device=device))

    # (what, a, b, launch options): without TMA the aligned and the misaligned operands differ in alignment alone.
    cases = [("aligned", aligned, weight, {}), ("aligned, no TMA", aligned, weight, {"use_tma": False}),
             ("a one element in, no TMA", one_in, weight, {"use_tma": False}),
             ("row-major b", aligned, lambda: torch.randn(k, n, dtype=dtype, device=device) / k**0.5, {})]
    for what, make_a, make_b, options in cases:
        before = launcher.fast_launches
        launch(make_a(), make_b(), options)
        assert launcher.fast_launches == before, f"{what}: a new fingerprint's first launch went direct"
        for _ in range(2):
            launch(make_a(), make_b(), options)
        assert launcher.fast_launches - before == 2, f"{what}: the repeated launches did not go direct"
    torch.cuda.synchronize()
