"""Public ops, one file each (the fp8 ones together in ``scaled``): each builds its call's spec and hands it to the
one call pipeline (``runtime/calls.py``); ``library`` and ``moe_library`` register the custom ops."""

from flashoverlap.ops import library  # noqa: F401  (registers torch.ops.flashoverlap.*)
from flashoverlap.ops.all_gather_gemm import all_gather_gemm
from flashoverlap.ops.gemm_all_reduce import gemm_all_reduce
from flashoverlap.ops.gemm_reduce_scatter import gemm_reduce_scatter
from flashoverlap.ops.scaled import all_gather_scaled_gemm, scaled_gemm_all_reduce, scaled_gemm_reduce_scatter

# The tensor-parallel ops by the plan's op name (``Plan.op``), bf16/fp16 and fp8: what the installed bench and the
# benchmark harness call.
GEMM_OPS = {"all_reduce": gemm_all_reduce, "reduce_scatter": gemm_reduce_scatter, "all_gather": all_gather_gemm}
SCALED_OPS = {"all_reduce": scaled_gemm_all_reduce, "reduce_scatter": scaled_gemm_reduce_scatter,
              "all_gather": all_gather_scaled_gemm}

__all__ = ["GEMM_OPS", "SCALED_OPS", "all_gather_gemm", "all_gather_scaled_gemm", "gemm_all_reduce",
           "gemm_reduce_scatter", "scaled_gemm_all_reduce", "scaled_gemm_reduce_scatter"]
