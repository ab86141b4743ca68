"""Errors a newcomer meets first point the right way: block-wise fp8 scales at a K that is no multiple of 128 are
told so (not "fit no scaling mode", offering the very shapes passed), and the fp8 styles' install hint is one the
package index serves, as are the GPU kernels' and the stream operations' (triton, cuda-bindings)."""

import pytest
import torch

from flashoverlap.comm.scaled import Scales
from flashoverlap.runtime.checks import check_scaled

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("m,n,k", [(4, 256, 96), (4, 40, 96), (4, 256, 200)])
def test_block_wise_scales_at_a_k_not_a_multiple_of_128_say_so(m, n, k):
    a, b = torch.zeros(m, k, dtype=E4M3), torch.zeros(k, n, dtype=E4M3)
    blocks_k, blocks_n = -(-k // 128), -(-n // 128)
    scales = Scales.of(torch.ones(m, blocks_k), torch.ones(blocks_k, blocks_n))  # the block-wise shapes
    with pytest.raises(ValueError, match=rf"block-wise scaling needs K .* a multiple of 128, got K = {k}"):
        check_scaled("scaled_gemm_all_reduce", a, b, scales, "all_reduce")


def test_scales_that_fit_no_mode_still_list_every_mode():
    a, b = torch.zeros(4, 256, dtype=E4M3), torch.zeros(256, 16, dtype=E4M3)
    with pytest.raises(ValueError, match=r"fit no scaling mode.*K a multiple of 128"):
        check_scaled("scaled_gemm_all_reduce", a, b, Scales.of(torch.ones(3, 1), torch.ones(1, 16)), "all_reduce")


def test_the_fp8_styles_install_hint_is_one_the_package_index_serves():
    from flashoverlap.nn import float8

    assert 'pip install "torchao>=0.10"' in float8._INSTALL and "pip install flashoverlap[" not in float8._INSTALL


# What the package index does not serve (flashoverlap is installed from a source checkout), and what installs instead.
_NOT_SERVED = ("pip install 'flashoverlap[", 'pip install "flashoverlap[', "pip install flashoverlap[")


def _says_what_installs(message: str, package: str) -> None:
    assert not any(wrong in message for wrong in _NOT_SERVED), message
    assert f"pip install {package}" in message and 'pip install -e ".[gpu]"' in message, message


def test_the_gemm_kernels_install_hint_is_one_the_package_index_serves(monkeypatch):
    import importlib
    import sys

    import flashoverlap.kernels  # noqa: F401  (the package: only the kernel module is imported afresh)

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "flashoverlap.kernels.gemm", raising=False)  # restored after the test
    with pytest.raises(ImportError) as raised:
        importlib.import_module("flashoverlap.kernels.gemm")
    _says_what_installs(str(raised.value), '"triton>=3.4"')


def test_the_grouped_gemm_install_hint_is_one_the_package_index_serves(monkeypatch):
    from flashoverlap.kernels import grouped_gemm as module

    monkeypatch.setattr(module, "_TRITON_MISSING", ModuleNotFoundError("No module named 'triton'"))
    with pytest.raises(ModuleNotFoundError) as raised:
        module.grouped_gemm(torch.zeros(2, 4), torch.zeros(1, 4, 4), None)
    _says_what_installs(str(raised.value), '"triton>=3.4"')


def test_the_stream_operations_install_hint_is_one_the_package_index_serves(monkeypatch):
    import sys

    from flashoverlap.comm import stream_ops

    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)  # neither spelling of cuda-python imports
    stream_ops._driver.cache_clear()
    try:
        with pytest.raises(RuntimeError) as raised:
            stream_ops._driver()
    finally:
        stream_ops._driver.cache_clear()  # the next caller imports it for real
    _says_what_installs(str(raised.value), "cuda-bindings")


def test_a_traced_fp8_call_with_a_plan_names_no_tuning_that_cannot_help(monkeypatch):
    """``tune plan`` tunes bf16 and fp16 only (its ``--dtype`` choices): the compiled fp8 call's refusal of ``plan=``
    must not send the user there."""
    import flashoverlap as fo
    from flashoverlap.cli import main

    with pytest.raises(SystemExit) as refused:  # the hint's premise: `tune plan --dtype` has no fp8 choice
        main(["tune", "plan", "--dtype", "float8_e4m3fn", "--help"])
    assert refused.value.code == 2  # argparse's usage error (--help alone exits 0)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    a = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    b = torch.zeros(8, 4, dtype=torch.float8_e4m3fn)
    plan = fo.default_plan("all_reduce", 4, 4, 8, 1)
    with pytest.raises(ValueError, match="plan=") as caught:
        fo.scaled_gemm_all_reduce(a, b, torch.ones(()), torch.ones(()), plan=plan)
    assert "fp16 only" in str(caught.value) and "tune the shape" not in str(caught.value)
