"""Errors a newcomer meets first point the right way: block-wise fp8 scales at a K that is no multiple of 128 are
told so (not "fit no scaling mode", offering the very shapes passed), and the fp8 styles' install hint is one the
package index serves."""

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
