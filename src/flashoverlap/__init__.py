"""flashoverlap: tensor- and expert-parallel communication hidden behind the matrix multiplications that produce
it. Pure Python: Triton kernels, torch.distributed (NCCL), PyTorch symmetric memory and cuBLAS through torch.

The ops (``gemm_all_reduce``, ``gemm_reduce_scatter``, ``all_gather_gemm``, their fp8 ``scaled_*`` forms and
the MoE ops, which take fp8 expert weights too) are here; tensor- and expert-parallel layers, the fp8 styles for
torchao float8 models and the fp8 experts among them, are in ``flashoverlap.nn``."""

from flashoverlap.ops import (
    all_gather_gemm,
    all_gather_scaled_gemm,
    gemm_all_reduce,
    gemm_reduce_scatter,
    scaled_gemm_all_reduce,
    scaled_gemm_reduce_scatter,
)
from flashoverlap.ops.moe import moe_dispatch_gemm, moe_gemm_combine, moe_layout
from flashoverlap.plan import Group, Plan, TileConfig
from flashoverlap.runtime import release
from flashoverlap.tune.defaults import default_plan

__version__ = "0.2.0"

__all__ = ["Group", "Plan", "TileConfig", "all_gather_gemm", "default_plan", "gemm_all_reduce",
           "gemm_reduce_scatter", "release", "__version__"]
__all__ += ["moe_dispatch_gemm", "moe_gemm_combine", "moe_layout"]
__all__ += ["all_gather_scaled_gemm", "scaled_gemm_all_reduce", "scaled_gemm_reduce_scatter"]
