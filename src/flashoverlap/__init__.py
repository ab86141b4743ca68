"""flashoverlap: tensor- and expert-parallel communication hidden behind the matrix multiplications that produce
it. Pure Python: Triton kernels, torch.distributed (NCCL) and PyTorch symmetric memory."""

from flashoverlap.ops import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter
from flashoverlap.plan import Group, Plan, TileConfig, default_plan

__version__ = "0.1.0"

__all__ = ["Group", "Plan", "TileConfig", "all_gather_gemm", "default_plan", "gemm_all_reduce",
           "gemm_reduce_scatter", "__version__"]
